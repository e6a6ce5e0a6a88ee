//! Shared helpers for the multi-process tests: a tiny harness (so the test binary can re-run
//! itself as a child process), self-verifying tensor contents, process guards, and fd/mapping
//! counters for leak checks.
#![allow(dead_code)]

pub mod session_ops;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Environment variable naming the role a re-executed test binary plays.
pub const CHILD_ENV: &str = "TP_TEST_CHILD";

/// A test: name and body. A body fails by panicking.
pub type TestFn = fn();

/// Runs `tests` (or the ones whose name contains the first non-flag argument), or, when this
/// process was started as a child ([`spawn_child`]), calls `child` with its role and the
/// server's socket path. Prints one line per test and the `N passed, N failed` summary; exits
/// non-zero on any failure.
pub fn main(tests: &[(&str, TestFn)], child: fn(&str, &str)) {
    if let Ok(role) = std::env::var(CHILD_ENV) {
        let socket = std::env::var("TP_SOCKET").expect("a child needs TP_SOCKET");
        child(&role, &socket);
        return;
    }
    install_log_capture();
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let list = std::env::args().any(|a| a == "--list");
    let (mut passed, mut failed) = (0, 0);
    for (name, f) in tests {
        if filter.as_deref().is_some_and(|flt| !name.contains(flt)) {
            continue;
        }
        if list {
            println!("{name}: test");
            continue;
        }
        print!("test {name} ... ");
        std::io::stdout().flush().ok();
        let t = Instant::now();
        match std::panic::catch_unwind(f) {
            Ok(()) => {
                passed += 1;
                println!("ok ({:.1}s)", t.elapsed().as_secs_f64());
            }
            Err(e) => {
                failed += 1;
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                println!("FAILED: {msg}");
            }
        }
    }
    if list {
        return;
    }
    println!("\n{passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}

static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();

struct LogWriter(Arc<Mutex<Vec<u8>>>);
impl Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        if std::env::var_os("TP_TEST_LOG").is_some() {
            std::io::stderr().write_all(b)?;
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Captures this process's tracing output, so tests can check that a log line was written.
pub fn install_log_capture() {
    let buf = LOG.get_or_init(|| Arc::new(Mutex::new(Vec::new()))).clone();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_ansi(false)
        .with_writer(move || LogWriter(buf.clone()))
        .try_init();
}

/// Everything logged so far.
pub fn logs() -> String {
    LOG.get()
        .map(|b| String::from_utf8_lossy(&b.lock().unwrap()).into_owned())
        .unwrap_or_default()
}

/// A child process that is killed (SIGKILL) and reaped when dropped.
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    pub fn pid(&self) -> i32 {
        self.0.as_ref().unwrap().id() as i32
    }
    pub fn kill9(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = c.wait();
        }
        self.0 = None;
    }
    /// Waits for exit; panics after `timeout`.
    pub fn wait_ok(&mut self, timeout: Duration) -> std::process::Output {
        let mut c = self.0.take().expect("child present");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(_st) = c.try_wait().unwrap() {
                return c.wait_with_output().unwrap();
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let out = c.wait_with_output().unwrap();
                panic!(
                    "child did not finish in {timeout:?}; stderr:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Starts this test binary again as a child with `role` and extra environment.
pub fn spawn_child(role: &str, env: &[(&str, String)]) -> ChildGuard {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(CHILD_ENV, role)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    ChildGuard(Some(cmd.spawn().expect("spawn child")))
}

/// A fresh private directory for a socket, removed on drop.
pub fn socket_dir() -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::Builder::new()
        .prefix("tp-test-")
        .tempdir()
        .unwrap();
    let p = d.path().join("tp.sock");
    (d, p)
}

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Mappings of tensorport pools in this process.
pub fn pool_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:tensorport-pool"))
        .count()
}

/// How long a test waits for something that should happen promptly (a reclaim, a log line, an fd
/// count falling back). Waits end as soon as the condition holds, so a generous bound costs a
/// passing test nothing; it only has to be long enough that a loaded machine never trips it.
/// Tests check *that* something happens, never how fast: speed is the benchmarks' job.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// Polls `f` until it is true or `timeout` passes; returns its last value.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Fills `buf` with a stream determined by `seed`, which it stores in its first 8 bytes. A buffer
/// filled this way can be checked on its own by [`verify`]: a torn or stale tail shows.
pub fn fill(seed: u64, buf: &mut [u8]) {
    assert!(buf.len() >= 8);
    buf[..8].copy_from_slice(&seed.to_le_bytes());
    let mut x = seed | 1;
    for chunk in buf[8..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Whether `buf` is exactly what [`fill`] wrote for the seed in its first 8 bytes.
pub fn verify(buf: &[u8]) -> bool {
    if buf.len() < 8 {
        return false;
    }
    let seed = u64::from_le_bytes(buf[..8].try_into().unwrap());
    let mut x = seed | 1;
    for chunk in buf[8..].chunks(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if chunk != &x.to_le_bytes()[..chunk.len()] {
            return false;
        }
    }
    true
}

/// FNV-1a 64 of `bytes`.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

pub fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

pub fn socket_env(p: &Path) -> (&'static str, String) {
    ("TP_SOCKET", p.display().to_string())
}

/// A client that speaks the protocol by hand, for hostile-peer tests.
pub struct Raw {
    pub s: std::os::unix::net::UnixStream,
}

impl Raw {
    pub fn connect(sock: &Path) -> Raw {
        let s = std::os::unix::net::UnixStream::connect(sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        Raw { s }
    }

    pub fn send(&mut self, m: &tensorport::wire::ClientMsg) {
        self.s
            .write_all(&tensorport::wire::encode_frame(m).unwrap())
            .unwrap();
    }

    /// Writes bytes as they are; errors (a closed peer) are ignored.
    pub fn send_bytes(&mut self, b: &[u8]) {
        let _ = self.s.write_all(b);
    }

    /// The next message, or `None` at EOF.
    pub fn recv(&mut self) -> Option<tensorport::wire::ServerMsg> {
        use std::io::Read;
        let mut h = [0u8; 4];
        match self.s.read_exact(&mut h) {
            Ok(()) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::UnexpectedEof
                    || e.kind() == std::io::ErrorKind::ConnectionReset =>
            {
                return None
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                panic!("the server sent nothing and kept the session open for 5 s")
            }
            Err(e) => panic!("read: {e}"),
        }
        let mut p = vec![0u8; u32::from_le_bytes(h) as usize];
        self.s.read_exact(&mut p).unwrap();
        Some(tensorport::wire::decode_server(&p).unwrap())
    }

    pub fn hello_with(&mut self, min: u16, max: u16, slots: u32) {
        self.send(&tensorport::wire::ClientMsg::Hello(
            tensorport::wire::Hello {
                magic: tensorport::wire::MAGIC,
                min_version: min,
                max_version: max,
                role: tensorport::wire::Role::Producer,
                name: "hostile".into(),
                want_slots: slots,
                want_slot_size: 4096,
            },
        ));
    }

    /// Handshake asking for `slots`; returns the slot size and the granted slots.
    pub fn hello(&mut self, slots: u32) -> (u64, Vec<tensorport::wire::SlotRef>) {
        use tensorport::wire::ServerMsg;
        self.hello_with(1, 1, slots);
        let size = match self.recv() {
            Some(ServerMsg::Welcome(w)) => w.pool.slot_size,
            other => panic!("expected Welcome, got {other:?}"),
        };
        match self.recv() {
            Some(ServerMsg::Grant(g)) => (size, g),
            other => panic!("expected Grant, got {other:?}"),
        }
    }

    /// The next message must be an error with `code` and `fatal`; a fatal one closes the socket.
    pub fn expect_error(&mut self, code: tensorport::wire::ErrorCode, fatal: bool) {
        use tensorport::wire::{ErrorCode, ServerMsg};
        match self.recv() {
            Some(ServerMsg::Error {
                code: c, fatal: f, ..
            }) => {
                assert_eq!(ErrorCode::from_u16(c), code);
                assert_eq!(f, fatal, "fatal flag for {code:?}");
            }
            other => panic!("expected {code:?}, got {other:?}"),
        }
        if fatal {
            assert!(
                self.recv().is_none(),
                "connection stays open after a fatal error"
            );
        }
    }

    /// Reads until an error frame and returns its code (grants and results are skipped).
    pub fn next_error(&mut self) -> tensorport::wire::ErrorCode {
        self.next_error_text().0
    }

    /// Reads until an error frame and returns its code and message.
    pub fn next_error_text(&mut self) -> (tensorport::wire::ErrorCode, String) {
        use tensorport::wire::{ErrorCode, ServerMsg};
        loop {
            match self.recv() {
                Some(ServerMsg::Error { code, message, .. }) => {
                    return (ErrorCode::from_u16(code), message)
                }
                Some(_) => {}
                None => panic!("connection closed before an error frame"),
            }
        }
    }

    /// Sends `bytes` in one `sendmsg` with `n` descriptors (of /dev/null) attached; returns
    /// whether the kernel took it (false once the server closed the connection).
    pub fn send_bytes_with_fds(&mut self, bytes: &[u8], n: usize) -> bool {
        use std::os::fd::AsRawFd;
        let files: Vec<std::fs::File> = (0..n)
            .map(|_| std::fs::File::open("/dev/null").unwrap())
            .collect();
        let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
        nix::sys::socket::sendmsg::<()>(
            self.s.as_raw_fd(),
            &[std::io::IoSlice::new(bytes)],
            &[nix::sys::socket::ControlMessage::ScmRights(&fds)],
            nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .is_ok()
    }

    /// Sends `msg` as one frame with `n` descriptors (of /dev/null) attached to it.
    pub fn send_with_fds(&mut self, msg: &tensorport::wire::ClientMsg, n: usize) {
        let frame = tensorport::wire::encode_frame(msg).unwrap();
        assert!(self.send_bytes_with_fds(&frame, n), "sendmsg failed");
    }
}

// ---------------------------------------------------------------------------------------------
// Tensors used by the tests: mixed shapes and dtypes, some with offsets and strides.

pub fn spec_for(i: u64) -> tensorport::TensorSpec {
    match i % 7 {
        0 => tensorport::TensorSpec::new(tensorport::DType::F32, &[3, 224, 224]),
        1 => tensorport::TensorSpec::new(tensorport::DType::U8, &[1, 64, 64]),
        2 => tensorport::TensorSpec::new(tensorport::DType::I64, &[7, 13]),
        3 => tensorport::TensorSpec::new(tensorport::DType::F16, &[4, 4, 4, 4]).at_offset(64),
        4 => tensorport::TensorSpec::new(tensorport::DType::BF16, &[2, 3, 32, 32]),
        5 => tensorport::TensorSpec::new(tensorport::DType::I32, &[16, 8]).with_strides(&[1, 16]),
        _ => tensorport::TensorSpec::new(tensorport::DType::F64, &[5, 5, 5]).at_offset(4096),
    }
}

/// The result the test server sends: checksum of the bytes it saw, element count, dtype.
pub fn encode_answer(sum: u64, numel: u64, dtype: tensorport::DType) -> Vec<u8> {
    let mut v = sum.to_le_bytes().to_vec();
    v.extend_from_slice(&numel.to_le_bytes());
    v.push(dtype as u8);
    v
}

/// A producer process: `TP_COUNT` tensors of mixed shapes (see [`spec_for`]) with self-checking
/// contents; every answer must be the checksum [`encode_answer`] computes. Exits 0 if all match.
pub fn checked_producer(socket: &str) {
    let id: u64 = env_or("TP_ID", "0").parse().unwrap();
    let count: u64 = env_or("TP_COUNT", "100").parse().unwrap();
    let mut p = tensorport::Producer::connect(
        socket,
        tensorport::ProducerConfig::new(format!("test-producer-{id}")),
    )
    .unwrap_or_else(|e| {
        eprintln!("connect: {e}");
        std::process::exit(3)
    });
    let mut expected: std::collections::HashMap<u64, Vec<u8>> = Default::default();
    let (mut sent, mut ok, mut bad) = (0u64, 0u64, 0u64);
    let mut check = |c: tensorport::Completion,
                     expected: &mut std::collections::HashMap<u64, Vec<u8>>| {
        match (expected.remove(&c.request_id), c.result) {
            (Some(want), Ok(got)) if want == got => ok += 1,
            (want, got) => {
                bad += 1;
                eprintln!("request {}: want {:?} got {:?}", c.request_id, want, got);
            }
        }
    };
    while sent < count || p.in_flight() > 0 {
        while let Some(c) = p.try_recv_result().expect("poll") {
            check(c, &mut expected);
        }
        if sent < count {
            let spec = spec_for(sent + id);
            let extent = spec.extent().unwrap() as usize;
            let off = spec.offset as usize;
            let mut lease = p.lease(Duration::from_secs(20)).expect("lease");
            let region = &mut lease.bytes_mut()[off..off + extent];
            fill((id << 40) | sent, region);
            let want = encode_answer(checksum(region), spec.shape.iter().product(), spec.dtype);
            let rid = lease.submit(&spec).expect("submit");
            expected.insert(rid, want);
            sent += 1;
        } else if p.in_flight() > 0 {
            let c = p.recv_result(Duration::from_secs(20)).expect("result");
            check(c, &mut expected);
        }
    }
    p.close().ok();
    println!("ok={ok} bad={bad} missing={}", expected.len());
    std::process::exit(if ok == count && bad == 0 { 0 } else { 1 });
}

/// Starts `n` [`checked_producer`] processes (ids 0..n) of `count` tensors each.
pub fn spawn_checked_producers(sock: &Path, n: usize, count: u64) -> Vec<ChildGuard> {
    (0..n)
        .map(|i| {
            spawn_child(
                "producer",
                &[
                    socket_env(sock),
                    ("TP_ID", i.to_string()),
                    ("TP_COUNT", count.to_string()),
                ],
            )
        })
        .collect()
}

/// Waits for every child to exit successfully (each within `timeout`).
pub fn wait_all_ok(kids: &mut [ChildGuard], timeout: Duration) {
    for (i, k) in kids.iter_mut().enumerate() {
        let out = k.wait_ok(timeout);
        assert!(
            out.status.success(),
            "producer {i} failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
