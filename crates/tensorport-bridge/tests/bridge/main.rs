//! The bridge between real processes over loopback, on Arrow Flight's real gRPC transport: a
//! tensorport server (in this test process, so it can check every tensor it receives), a
//! `tensorport-bridge gateway` process, and `tensorport-bridge produce` processes as remote
//! producers. Nothing here depends on the machine's speed: waits are deadlines, not timings.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tensorport::{Server, ServerConfig};
use tensorport_vision::{Preprocessor, Source, Transform};

const BIN: &str = env!("CARGO_BIN_EXE_tensorport-bridge");
/// Small images keep the unoptimised test build quick.
const SIZE: u32 = 32;

/// The tensor a remote producer prepares for synthetic input `i`.
fn expected(i: u64) -> Vec<u8> {
    prepared(i)
}

/// The tensor `producer` sends for request `i`: `examples/python/flight_producer.py` sends
/// `arange(3·32·32) + i`, `tensorport-bridge produce` synthetic image `i`.
fn expected_from(producer: &str, i: u64) -> Vec<u8> {
    if producer.starts_with("bridge: pyarrow") {
        (0..3 * SIZE * SIZE)
            .flat_map(|k| (k as f32 + i as f32).to_ne_bytes())
            .collect()
    } else {
        prepared(i)
    }
}

fn prepared(i: u64) -> Vec<u8> {
    let mut prep = Preprocessor::new(Transform::standard(SIZE));
    let mut out = vec![0f32; (3 * SIZE * SIZE) as usize];
    prep.prepare(&Source::Synthetic(i), &mut out).unwrap();
    out.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// What the in-process server saw.
#[derive(Default)]
struct Seen {
    /// Producer name → request ids received.
    ids: HashMap<String, Vec<u64>>,
    /// Tensors whose bytes were not the expected ones.
    torn: u64,
}

/// A server answering each request with `[request id, 1.0 if its tensor is intact]` as f32s,
/// a gateway in front of it, and a token.
struct Fixture {
    dir: tempfile::TempDir,
    server: Arc<Server>,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    handler: Option<JoinHandle<()>>,
    gateway: Option<Child>,
    url: String,
    extra: Vec<String>,
    /// Environment of the gateway and the producers.
    env: Vec<(String, String)>,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture::with_gateway_args(&[])
    }

    /// A fixture whose gateway gets `extra` arguments.
    fn with_gateway_args(extra: &[String]) -> Fixture {
        Fixture::with(extra, Vec::new())
    }

    /// A fixture whose gateway gets `extra` arguments, and whose processes `env`.
    fn with(extra: &[String], env: Vec<(String, String)>) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let server = Arc::new(Server::bind(ServerConfig::new(dir.path().join("s.sock"))).unwrap());
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let handler = {
            let (server, seen, stop) = (server.clone(), seen.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut cache: HashMap<(bool, u64), Vec<u8>> = HashMap::new();
                while !stop.load(Ordering::Relaxed) {
                    let Ok(Some(req)) = server.recv_timeout(Duration::from_millis(50)) else {
                        continue;
                    };
                    let id = req.request_id();
                    let python = req.producer().starts_with("bridge: pyarrow");
                    let want = cache
                        .entry((python, id))
                        .or_insert_with(|| expected_from(req.producer(), id));
                    let intact = req.bytes() == want.as_slice();
                    {
                        let mut s = seen.lock().unwrap();
                        s.ids
                            .entry(req.producer().to_string())
                            .or_default()
                            .push(id);
                        s.torn += u64::from(!intact);
                    }
                    let answer: Vec<u8> = [id as f32, if intact { 1.0 } else { 0.0 }]
                        .iter()
                        .flat_map(|x| x.to_le_bytes())
                        .collect();
                    let _ = req.respond(&answer);
                }
            })
        };
        let token = dir.path().join("token");
        run_ok(Command::new(BIN).arg("token").arg(&token));
        let mut f = Fixture {
            dir,
            server,
            seen,
            stop,
            handler: Some(handler),
            gateway: None,
            url: String::new(),
            extra: extra.to_vec(),
            env,
        };
        f.start_gateway("127.0.0.1:0");
        f
    }

    fn token(&self) -> PathBuf {
        self.dir.path().join("token")
    }

    /// A client of this fixture's gateway, in this process, named `name`.
    fn remote_config(&self, name: &str) -> tensorport_bridge::remote::RemoteConfig {
        tensorport_bridge::remote::RemoteConfig {
            gateway: self.url.clone(),
            token: tensorport_bridge::auth::Token::read(&self.token()).unwrap(),
            tls: None,
            name: name.into(),
            connect_timeout: Duration::from_secs(10),
            allow_plaintext: false,
        }
    }

    /// Starts the gateway on `listen`; waits for its `listening on` line.
    fn start_gateway(&mut self, listen: &str) {
        let mut args = vec!["--in-flight".to_string(), "16".into()];
        args.extend(self.extra.iter().cloned());
        let log = std::fs::File::create(self.dir.path().join("gateway.log")).unwrap();
        let (child, url) = spawn_gateway_with(
            listen,
            &self.dir.path().join("s.sock"),
            &self.token(),
            &args,
            log.into(),
            &self.env,
        );
        self.url = url;
        self.gateway = Some(child);
    }

    /// A remote producer of `n` synthetic inputs, writing to `name`.jsonl.
    fn producer(&self, name: &str, n: u64, extra: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.args(["produce", "--gateway", &self.url, "--name", name])
            .arg("--token-file")
            .arg(self.token())
            .args([
                "--synthetic",
                &n.to_string(),
                "--image-size",
                &SIZE.to_string(),
            ])
            .args(["--batch", "4", "--in-flight", "16"])
            .arg("-o")
            .arg(self.dir.path().join(format!("{name}.jsonl")))
            .args(extra)
            .envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    fn lines(&self, name: &str) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.jsonl")))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Requests the server received from the remote producer `name`.
    fn received(&self, name: &str) -> Vec<u64> {
        let s = self.seen.lock().unwrap();
        s.ids
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("bridge: {name} from ")))
            .flat_map(|(_, v)| v.iter().copied())
            .collect()
    }

    fn sessions(&self) -> usize {
        self.server.status().sessions.len()
    }

    /// The gateway's log so far. Lossy: a NIXL reader process that UCX aborts may print bytes
    /// of the changed metadata that are not UTF-8, which must not hide the rest.
    fn gateway_log(&self) -> String {
        let bytes = std::fs::read(self.dir.path().join("gateway.log")).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// A remote producer "victim" of endless inputs, once 40 of its tensors have arrived.
    fn victim(&self, extra: &[&str]) -> Child {
        let victim = self.producer("victim", 10_000_000, extra).spawn().unwrap();
        wait_until(
            "the victim's tensors arrive",
            Duration::from_secs(60),
            || self.received("victim").len() >= 40,
        );
        victim
    }

    /// SIGKILLs `victim` and waits up to `within` for the gateway to close its session.
    fn kill_victim(&self, mut victim: Child, within: Duration) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(victim.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        victim.wait().unwrap();
        wait_until("the gateway closes the victim's session", within, || {
            self.sessions() == 0
        });
    }

    /// A producer "next" of 64 inputs, served in full: each once, intact.
    fn serves_next(&self, extra: &[&str]) {
        run_ok(&mut self.producer("next", 64, extra));
        assert_each_input_once(&self.lines("next"), 64);
        assert_eq!(self.seen.lock().unwrap().torn, 0);
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(mut g) = self.gateway.take() {
            let _ = g.kill();
            let _ = g.wait();
        }
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handler.take() {
            let _ = h.join();
        }
    }
}

/// A gateway on `listen` in front of `socket`; waits for its `listening on` line and returns
/// it with its URL.
fn spawn_gateway(
    listen: &str,
    socket: &std::path::Path,
    token: &std::path::Path,
    extra: &[String],
    stderr: Stdio,
) -> (Child, String) {
    spawn_gateway_with(listen, socket, token, extra, stderr, &[])
}

/// As [`spawn_gateway`], with `env` in the gateway's environment.
fn spawn_gateway_with(
    listen: &str,
    socket: &std::path::Path,
    token: &std::path::Path,
    extra: &[String],
    stderr: Stdio,
    env: &[(String, String)],
) -> (Child, String) {
    let mut child = Command::new(BIN)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .args(["gateway", "--listen", listen, "--socket"])
        .arg(socket)
        .arg("--token-file")
        .arg(token)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .strip_prefix("listening on ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("the gateway did not start: {line:?}"))
        .to_string();
    (child, url)
}

fn run_ok(c: &mut Command) -> Output {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn wait_until(what: &str, deadline: Duration, mut ok: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every input of `lines` answered exactly once, by its own tensor, intact.
fn assert_each_input_once(lines: &[serde_json::Value], n: u64) {
    assert_eq!(lines.len() as u64, n, "one line per input");
    let mut seen = HashSet::new();
    for l in lines {
        let i = l["index"].as_u64().unwrap();
        assert!(seen.insert(i), "input {i} answered twice");
        assert!(l.get("error").is_none(), "input {i} failed: {l}");
        let scores = l["scores"].as_array().unwrap();
        assert_eq!(
            scores[0].as_f64().unwrap() as u64,
            i,
            "the answer is input {i}'s"
        );
        assert_eq!(
            scores[1].as_f64().unwrap(),
            1.0,
            "input {i}'s tensor arrived intact"
        );
    }
    assert_eq!(seen.len() as u64, n);
}

mod limits;
mod nixl;
mod security;
mod streams;
