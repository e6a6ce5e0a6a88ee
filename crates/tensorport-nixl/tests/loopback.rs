//! Two real processes reading host memory over UCX's TCP transport on loopback (`nixl-bench hold`
//! and `nixl-bench read`): every byte arrives, a peer describing memory it did not register is
//! refused without harm to the holder, a holder killed mid-read ends the reader with an error.
//! NIXL comes from PyPI's nixl-cu13 wheel (scripts/fetch-nixl.sh, run here the first time); where
//! it cannot be fetched, the tests say so and skip.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_nixl-bench");

/// The unpacked wheel, fetched once per test binary (`None`: not available here).
fn nixl() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| match tensorport_nixl::fetch_into_checkout() {
        Ok(dir) => Some(dir),
        Err(why) => {
            eprintln!("SKIPPED: NIXL could not be fetched (scripts/fetch-nixl.sh: {why})");
            None
        }
    })
    .as_deref()
}

fn command(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env("TENSORPORT_NIXL", dir)
        .env("UCX_TLS", tensorport_nixl::tcp_transports())
        .env("UCX_WARN_UNUSED_ENV_VARS", "n");
    c
}

/// Waits for `child` at most `limit`, killing it after that (then `None`).
fn wait_for(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Holder {
    child: Child,
    line: String,
}

impl Holder {
    fn start(dir: &Path, slots: &str) -> Holder {
        let mut child = command(dir, &["hold", "--slots", slots, "--slot-len", "602112"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn hold");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the holder prints its line within a minute");
        assert!(line.split_whitespace().count() == 6, "holder said {line:?}");
        Holder { child, line }
    }

    /// Runs a reader on `line`; its exit status (None: killed by the watchdog) and output.
    fn read(dir: &Path, line: &str, seconds: &str) -> (Option<std::process::ExitStatus>, String) {
        let mut r = command(dir, &["read", "--seconds", seconds, "--in-flight", "8"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn read");
        r.stdin
            .take()
            .expect("piped")
            .write_all(line.as_bytes())
            .expect("write the line");
        let status = wait_for(&mut r, Duration::from_secs(90));
        let mut out = String::new();
        if let Some(mut o) = r.stdout.take() {
            let _ = std::io::Read::read_to_string(&mut o, &mut out);
        }
        if let Some(mut e) = r.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut out);
        }
        (status, out)
    }

    fn stop(mut self) -> Option<std::process::ExitStatus> {
        let _ = self.child.stdin.take().expect("piped").write_all(b"done\n");
        wait_for(&mut self.child, Duration::from_secs(30))
    }
}

#[test]
fn every_byte_arrives_and_a_lying_peer_is_refused_without_harm() {
    let Some(dir) = nixl() else { return };
    let h = Holder::start(dir, "16");
    let (status, out) = Holder::read(dir, &h.line, "0.5");
    assert!(
        status.is_some_and(|s| s.success()) && out.contains("16 checked"),
        "reader: {status:?} {out}"
    );

    // A layout past what the holder registered: NIXL refuses to prepare the reads.
    let f: Vec<&str> = h.line.split_whitespace().collect();
    let base: u64 = f[1].parse().unwrap();
    for (what, line) in [
        (
            "slots past the registration",
            format!("{} {} {} 32 {} {}\n", f[0], f[1], f[2], f[4], f[5]),
        ),
        (
            "a base below it",
            format!(
                "{} {} {} {} {} {}\n",
                f[0],
                base - 4096,
                f[2],
                f[3],
                f[4],
                f[5]
            ),
        ),
        (
            "another agent's name",
            format!(
                "someone-else {} {} {} {} {}\n",
                f[1], f[2], f[3], f[4], f[5]
            ),
        ),
        (
            "metadata cut short",
            format!(
                "{} {} {} {} {} {}\n",
                f[0],
                f[1],
                f[2],
                f[3],
                &f[4][..f[4].len() / 2],
                f[5]
            ),
        ),
    ] {
        let (status, out) = Holder::read(dir, &line, "0.2");
        assert!(
            status.is_some_and(|s| !s.success())
                && out.contains("nixl-bench read:")
                && !out.contains("expected `NAME"),
            "{what}: the reader should fail with an error, got {status:?} {out}"
        );
    }
    // The holder still serves an honest reader.
    let (status, out) = Holder::read(dir, &h.line, "0.2");
    assert!(
        status.is_some_and(|s| s.success()) && out.contains("16 checked"),
        "after the refusals: {status:?} {out}"
    );
    assert!(
        h.stop().is_some_and(|s| s.success()),
        "the holder ends cleanly"
    );
}

#[test]
fn a_holder_killed_mid_read_ends_the_reader_with_an_error() {
    let Some(dir) = nixl() else { return };
    let mut h = Holder::start(dir, "16");
    let line = h.line.clone();
    let dir2 = dir.to_path_buf();
    let reader = std::thread::spawn(move || Holder::read(&dir2, &line, "20"));
    std::thread::sleep(Duration::from_secs(2));
    h.child.kill().expect("SIGKILL the holder");
    let _ = h.child.wait();
    let (status, out) = reader.join().expect("reader thread");
    assert!(
        status.is_some_and(|s| !s.success()),
        "the reader must end with an error, not hang or succeed: {status:?} {out}"
    );
}
