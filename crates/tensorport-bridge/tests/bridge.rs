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

    fn gateway_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("gateway.log")).unwrap_or_default()
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

#[test]
fn remote_producers_over_loopback_every_input_once_and_intact() {
    let f = Fixture::new();
    let mut a = f.producer("alpha", 300, &[]).spawn().unwrap();
    let mut b = f
        .producer("beta", 200, &["--batch", "16", "--in-flight", "48"])
        .spawn()
        .unwrap();
    assert!(a.wait().unwrap().success());
    assert!(b.wait().unwrap().success());
    assert_each_input_once(&f.lines("alpha"), 300);
    assert_each_input_once(&f.lines("beta"), 200);
    let mut got = f.received("alpha");
    got.sort_unstable();
    assert_eq!(
        got,
        (0..300).collect::<Vec<_>>(),
        "the server got each tensor once"
    );
    assert_eq!(f.received("beta").len(), 200);
    assert_eq!(f.seen.lock().unwrap().torn, 0, "no torn tensor");
    // Each stream was a session of its own, closed at its end.
    wait_until("the sessions close", Duration::from_secs(30), || {
        f.sessions() == 0
    });
    let t = f.server.status().totals;
    assert_eq!((t.sessions_opened, t.protocol_errors), (2, 0));
}

#[test]
fn a_killed_remote_producer_is_reclaimed_and_others_carry_on() {
    let f = Fixture::new();
    let victim = f.victim(&[]);
    assert_eq!(f.sessions(), 1);
    f.kill_victim(victim, Duration::from_secs(30));
    let log = f.gateway_log();
    assert!(
        log.contains("remote producer gone") || log.contains("remote producer left"),
        "{log}"
    );
    // The gateway and the server serve the next producer as before.
    f.serves_next(&[]);
}

#[test]
fn a_peer_without_the_token_is_refused() {
    let f = Fixture::new();
    let wrong = f.dir.path().join("wrong");
    run_ok(Command::new(BIN).arg("token").arg(&wrong));
    let out = f
        .producer("intruder", 10, &["--token-file", wrong.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "refused, and not retried");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Unauthenticated") && err.contains("token"),
        "{err}"
    );
    assert!(f.lines("intruder").is_empty());
    assert_eq!(
        f.server.status().totals.sessions_opened,
        0,
        "nothing reached the server"
    );
    assert!(f
        .gateway_log()
        .contains("refused a call without the gateway's token"));
    // A token file others may read is refused before connecting.
    let loose = f.dir.path().join("loose");
    std::fs::copy(f.token(), &loose).unwrap();
    std::fs::set_permissions(&loose, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out = f
        .producer("loose", 10, &["--token-file", loose.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("chmod 600"));
}

#[test]
fn the_remote_producer_reconnects_after_the_gateway_dies_every_input_once() {
    let mut f = Fixture::new();
    let port = f.url.rsplit(':').next().unwrap().to_string();
    let mut p = f
        .producer("survivor", 600, &["--retries", "20", "--in-flight", "8"])
        .spawn()
        .unwrap();
    wait_until("tensors arrive", Duration::from_secs(60), || {
        f.received("survivor").len() >= 40
    });
    let mut g = f.gateway.take().unwrap();
    g.kill().unwrap();
    g.wait().unwrap();
    // The dead gateway's session is reclaimed by the server; a new gateway takes its port.
    wait_until(
        "the dead gateway's session closes",
        Duration::from_secs(30),
        || f.sessions() == 0,
    );
    f.start_gateway(&format!("127.0.0.1:{port}"));
    assert!(
        p.wait().unwrap().success(),
        "the producer finished through the new gateway"
    );
    assert_each_input_once(&f.lines("survivor"), 600);
    assert_eq!(f.seen.lock().unwrap().torn, 0);
}

#[test]
fn hostile_streams_are_ended_and_harm_no_one() {
    use arrow_flight::encode::FlightDataEncoderBuilder;
    use arrow_flight::FlightClient;
    use futures::{StreamExt, TryStreamExt};
    use tensorport_bridge::schema::{TensorLayout, EXTENSION_METADATA};

    let f = Fixture::new();
    let token = tensorport_bridge::auth::Token::read(&f.token()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let good = |ids: &[u64]| {
        let mut data = Vec::new();
        for &i in ids {
            data.extend(expected(i));
        }
        layout
            .batch(ids, arrow_buffer::Buffer::from_vec(data))
            .unwrap()
    };
    // Sends `batches` on one stream; returns how the gateway ended it.
    let exchange = |batches: Vec<arrow_array::RecordBatch>, with_token: bool| {
        rt.block_on(async {
            let channel = tonic::transport::Endpoint::from_shared(f.url.clone())
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut c = FlightClient::new(channel);
            if with_token {
                c.add_header("authorization", &token.bearer()).unwrap();
            }
            // Each batch with its own schema message, so a later one may change it.
            let data = futures::stream::iter(batches.into_iter().map(|b| {
                FlightDataEncoderBuilder::new()
                    .with_schema(b.schema())
                    .build(futures::stream::iter([Ok(b)]))
            }))
            .flatten();
            match c.do_exchange(data).await {
                Err(e) => Err(e.to_string()),
                Ok(s) => s.try_collect::<Vec<_>>().await.map_err(|e| e.to_string()),
            }
        })
    };
    // No token: refused before anything is read.
    let e = exchange(vec![good(&[0])], false).unwrap_err();
    assert!(e.contains("needs its token"), "{e}");
    // A shape that lies about the list's size.
    let b = good(&[0, 1]);
    let mut field = b.schema().field(1).clone();
    let mut meta = field.metadata().clone();
    meta.insert(
        EXTENSION_METADATA.to_string(),
        r#"{"shape":[3,64,64]}"#.to_string(),
    );
    field = field.with_metadata(meta);
    let lying = arrow_array::RecordBatch::try_new(
        Arc::new(arrow_schema::Schema::new(vec![
            b.schema().field(0).clone(),
            field,
        ])),
        b.columns().to_vec(),
    )
    .unwrap();
    let e = exchange(vec![lying], true).unwrap_err();
    assert!(e.contains("bad tensor shape"), "{e}");
    // The same request id twice in flight.
    let e = exchange(vec![good(&[5, 5])], true).unwrap_err();
    assert!(e.contains("already in flight"), "{e}");
    // A stream whose second batch changes the tensors' shape.
    let other = TensorLayout::new(tensorport::DType::F32, &[4]).unwrap();
    let odd = other
        .batch(&[9], arrow_buffer::Buffer::from_vec(vec![0u8; 16]))
        .unwrap();
    let e = exchange(vec![good(&[7]), odd], true).unwrap_err();
    assert!(e.contains("the stream does not decode"), "{e}");
    // A well-formed stream on the same gateway gets its answers.
    let answers = exchange(vec![good(&[1, 2, 3])], true).unwrap();
    let rows: usize = answers.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, 3);
    // And so does a remote producer.
    run_ok(&mut f.producer("after", 32, &[]));
    assert_each_input_once(&f.lines("after"), 32);
    assert_eq!(
        f.seen.lock().unwrap().torn,
        0,
        "nothing torn reached the server"
    );
    assert_eq!(f.server.status().totals.protocol_errors, 0);
}

#[test]
fn plaintext_on_an_address_other_hosts_reach_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    run_ok(Command::new(BIN).arg("token").arg(&token));
    let out = Command::new(BIN)
        .args(["gateway", "--listen", "0.0.0.0:0", "--token-file"])
        .arg(&token)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--tls-cert") && err.contains("--allow-plaintext"),
        "{err}"
    );
    // The producer's side: its token is never sent in clear to another host, and TLS flags
    // with an http:// gateway are refused rather than ignored — before anything is sent (the
    // names below are never resolved).
    let refuse = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["produce", "--synthetic", "1", "--token-file"])
            .arg(&token)
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refuse(&["--gateway", "http://gateway.invalid:7450"]);
    assert!(
        err.contains("in clear") && err.contains("https://"),
        "{err}"
    );
    let err = refuse(&["--gateway", "http://127.0.0.1:7450", "--tls-ca", "ca.pem"]);
    assert!(err.contains("TLS settings"), "{err}");
}

/// A CA, a gateway certificate for `localhost` and a producer certificate signed by it, and a
/// producer certificate signed by another CA; as PEM files in `dir`.
fn pki(dir: &std::path::Path) {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, KeyUsagePurpose,
    };
    let ca = |name: &str| {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), ca.pem()).unwrap();
        ca
    };
    let leaf = |name: &str, san: &str, issuer: &CertifiedIssuer<'_, KeyPair>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![san.to_string()])
            .unwrap()
            .signed_by(&key, issuer)
            .unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    };
    let trusted = ca("ca");
    leaf("gateway", "localhost", &trusted);
    leaf("producer", "producer", &trusted);
    let other = ca("other-ca");
    leaf("rogue", "producer", &other);
}

#[test]
fn mutual_tls_admits_only_producers_with_a_certificate_of_the_gateways_ca() {
    let certs = tempfile::tempdir().unwrap();
    pki(certs.path());
    let p = |name: &str| certs.path().join(name).to_str().unwrap().to_string();
    let f = Fixture::with_gateway_args(&[
        "--tls-cert".into(),
        p("gateway.pem"),
        "--tls-key".into(),
        p("gateway.key"),
        "--tls-client-ca".into(),
        p("ca.pem"),
    ]);
    assert!(f.url.starts_with("https://"), "{}", f.url);
    let tls = |who: &str| {
        vec![
            "--tls-ca".to_string(),
            p("ca.pem"),
            "--tls-domain".into(),
            "localhost".into(),
            "--tls-cert".into(),
            p(&format!("{who}.pem")),
            "--tls-key".into(),
            p(&format!("{who}.key")),
            "--retries".into(),
            "0".into(),
        ]
    };
    let args = tls("producer");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_ok(&mut f.producer("trusted", 40, &args));
    assert_each_input_once(&f.lines("trusted"), 40);
    // A certificate from another CA, none at all, or no TLS: refused, nothing reaches the server.
    let rogue = tls("rogue");
    let rogue: Vec<&str> = rogue.iter().map(String::as_str).collect();
    let no_cert = [
        "--tls-ca",
        &p("ca.pem"),
        "--tls-domain",
        "localhost",
        "--retries",
        "0",
    ];
    let plain_url = f.url.replacen("https://", "http://", 1);
    let plain = ["--gateway", plain_url.as_str(), "--retries", "0"];
    for (name, args) in [
        ("rogue", &rogue[..]),
        ("no-cert", &no_cert[..]),
        ("plain", &plain[..]),
    ] {
        let out = f.producer(name, 10, args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{name} must be refused");
        assert!(f.lines(name).is_empty(), "{name} got answers");
    }
    assert_eq!(f.received("rogue").len() + f.received("no-cert").len(), 0);
    assert_eq!(
        f.server.status().totals.sessions_opened,
        1,
        "only the trusted producer's"
    );
}

/// A virtual environment with pyarrow and numpy from PyPI, made once under `target/`.
fn pyarrow_python() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe
        .ancestors()
        .nth(3)
        .expect("target/<profile>/deps/<test>");
    let venv = target.join("pyenv-flight");
    let python = venv.join("bin/python");
    let ready = venv.join(".tensorport-ready");
    if !ready.is_file() {
        let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        run_ok(Command::new(py).args(["-m", "venv"]).arg(&venv));
        run_ok(Command::new(&python).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--retries",
            "5",
            "pyarrow",
            "numpy",
        ]));
        std::fs::write(&ready, b"pyarrow numpy\n").unwrap();
    }
    python
}

#[test]
fn a_pyarrow_flight_client_written_from_the_docs_is_served() {
    let python = pyarrow_python();
    let f = Fixture::new();
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/python/flight_producer.py");
    let url = f.url.replacen("http://", "grpc://", 1);
    let out = run_ok(
        Command::new(&python)
            .arg(&example)
            .arg(&url)
            .arg(f.token())
            .args(["--count", "50", "--shape", &format!("3,{SIZE},{SIZE}")])
            .args(["--batch", "8", "--name", "pyarrow"]),
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut ids = HashSet::new();
    for l in &lines {
        let id = l["id"].as_u64().unwrap();
        assert!(ids.insert(id), "request {id} answered twice");
        let scores = l["scores"].as_array().unwrap_or_else(|| panic!("{l}"));
        assert_eq!(scores[0].as_f64().unwrap() as u64, id);
        assert_eq!(
            scores[1].as_f64().unwrap(),
            1.0,
            "tensor {id} arrived intact"
        );
    }
    assert_eq!(ids.len(), 50);
    assert_eq!(f.received("pyarrow").len(), 50);
    assert_eq!(f.seen.lock().unwrap().torn, 0);
}

#[test]
fn help_explains_each_subcommand() {
    for (args, needles) in [
        (
            &["--help"][..],
            &["gateway", "produce", "token", "Arrow Flight"][..],
        ),
        (
            &["gateway", "--help"],
            &[
                "--listen",
                "--token-file",
                "--tls-cert",
                "--tls-client-ca",
                "--allow-plaintext",
                "--max-remotes",
            ],
        ),
        (
            &["produce", "--help"],
            &[
                "--gateway",
                "--token-file",
                "--tls-ca",
                "--input",
                "--synthetic",
                "--retries",
                "exactly one",
            ],
        ),
        (
            &["token", "--help"],
            &["readable only by you", "never overwrites"],
        ),
    ] {
        let out = run_ok(Command::new(BIN).args(args));
        let text = String::from_utf8_lossy(&out.stdout);
        for n in needles {
            assert!(text.contains(n), "{args:?} --help lacks {n:?}:\n{text}");
        }
    }
    // A mistake gets a usage error (exit 2), not a panic.
    let out = Command::new(BIN)
        .args(["produce", "--gateway"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_gateway_without_its_server_says_so_and_the_producer_gives_up() {
    // The gateway's local server is not running: each stream is told why, the producer retries
    // (the server may be restarting), then gives up with the gateway's words.
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    run_ok(Command::new(BIN).arg("token").arg(&token));
    let (mut gateway, url) = spawn_gateway(
        "127.0.0.1:0",
        &dir.path().join("nobody.sock"),
        &token,
        &[],
        Stdio::null(),
    );
    let out = Command::new(BIN)
        .args([
            "produce",
            "--gateway",
            &url,
            "--synthetic",
            "8",
            "--retries",
            "1",
        ])
        .args(["--image-size", &SIZE.to_string(), "--token-file"])
        .arg(&token)
        .output()
        .unwrap();
    let _ = gateway.kill();
    let _ = gateway.wait();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot reach its tensorport server") && err.contains("tensorport serve"),
        "{err}"
    );
    // What was sent gets its line, saying why it was not answered.
    let stdout = String::from_utf8_lossy(&out.stdout);
    for l in stdout.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v["error"].as_str().unwrap().contains("not answered"), "{l}");
    }
}

#[test]
fn a_long_producer_name_is_cut_to_fit_not_refused() {
    let f = Fixture::new();
    let name = "n".repeat(60);
    run_ok(&mut f.producer(&name, 16, &[]));
    assert_each_input_once(&f.lines(&name), 16);
    let s = f.seen.lock().unwrap();
    let local = s.ids.keys().next().unwrap();
    assert!(
        local.starts_with("bridge: nnnn") && local.len() <= 64,
        "{local}"
    );
}

#[test]
fn a_remote_producer_that_stops_reading_is_dropped_and_harms_no_one() {
    use arrow_flight::encode::FlightDataEncoderBuilder;
    use arrow_flight::FlightClient;
    use futures::StreamExt;
    use tensorport_bridge::schema::TensorLayout;

    // A server that answers every request with an empty result.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let server = Arc::new(Server::bind(ServerConfig::new(&sock)).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let handler = {
        let (server, stop) = (server.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(Some(r)) = server.recv_timeout(Duration::from_millis(50)) {
                    let _ = r.respond(&[]);
                }
            }
        })
    };
    let token = dir.path().join("token");
    run_ok(Command::new(BIN).arg("token").arg(&token));
    let log = dir.path().join("gateway.log");
    let (mut gateway, url) = spawn_gateway(
        "127.0.0.1:0",
        &sock,
        &token,
        &["--peer-timeout".into(), "2".into()],
        std::fs::File::create(&log).unwrap().into(),
    );
    // A client that streams tensors without end and never reads a result: once its receive
    // window (64 KiB) and the gateway's queue are full of results, the gateway waits
    // --peer-timeout, then drops it.
    let t = tokio::runtime::Runtime::new().unwrap();
    let bearer = tensorport_bridge::auth::Token::read(&token)
        .unwrap()
        .bearer();
    let unread = t.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .initial_stream_window_size(65_535)
            .initial_connection_window_size(65_535)
            .connect()
            .await
            .unwrap();
        let mut c = FlightClient::new(channel);
        c.add_header("authorization", &bearer).unwrap();
        let layout = TensorLayout::new(tensorport::DType::U8, &[4]).unwrap();
        let schema = layout.schema();
        let batches = futures::stream::iter(0u64..).map(move |k| {
            let ids: Vec<u64> = (k * 64..(k + 1) * 64).collect();
            Ok(layout
                .batch(&ids, arrow_buffer::Buffer::from_vec(vec![7u8; 64 * 4]))
                .unwrap())
        });
        let data = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .build(batches);
        c.do_exchange(data).await.unwrap()
    });
    wait_until(
        "the reader-less stream has a session",
        Duration::from_secs(60),
        || server.status().sessions.len() == 1,
    );
    wait_until(
        "the gateway drops the producer that stopped reading",
        Duration::from_secs(120),
        || server.status().sessions.is_empty(),
    );
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("left its results unread"), "{said}");
    // The gateway and the server go on serving others.
    let out = dir.path().join("next.jsonl");
    run_ok(
        Command::new(BIN)
            .args(["produce", "--gateway", &url, "--synthetic", "32"])
            .args(["--image-size", &SIZE.to_string(), "--token-file"])
            .arg(&token)
            .arg("-o")
            .arg(&out),
    );
    let lines = std::fs::read_to_string(&out).unwrap();
    assert_eq!(lines.lines().count(), 32);
    assert!(!lines.contains("\"error\""), "{lines}");
    drop(unread);
    drop(t);
    let _ = gateway.kill();
    let _ = gateway.wait();
    stop.store(true, Ordering::Relaxed);
    handler.join().unwrap();
}

/// A memory figure of process `pid` in KiB: `VmHWM` (its peak) or `VmRSS` (resident now).
fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The gateway's peak memory in KiB.
fn peak_kib(pid: u32) -> u64 {
    status_kib(pid, "VmHWM")
}

/// Arrow dictionaries, which a general Arrow reader absorbs and keeps for the stream's life:
/// a schema of 40 dictionary fields followed by a 4 MiB dictionary for each and no record batch
/// is ended at its schema, and so is a tensor schema followed by dictionary batches; the
/// gateway's peak memory stays far below the 160 MiB a stream offers; a remote producer is
/// served afterwards.
#[test]
fn dictionary_batches_end_the_stream_and_cost_no_memory() {
    use arrow_array::{ArrayRef, DictionaryArray, StringArray, UInt32Array};
    use arrow_flight::encode::{DictionaryHandling, FlightDataEncoderBuilder};
    use arrow_flight::{FlightClient, FlightData};
    use arrow_schema::{DataType, Field, Schema};
    use futures::TryStreamExt;
    use tensorport_bridge::schema::TensorLayout;

    let f = Fixture::new();
    let pid = f.gateway.as_ref().unwrap().id();
    let token = tensorport_bridge::auth::Token::read(&f.token()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let encode = |b: arrow_array::RecordBatch, dict| -> Vec<FlightData> {
        rt.block_on(
            FlightDataEncoderBuilder::new()
                .with_schema(b.schema())
                .with_dictionary_handling(dict)
                .build(futures::stream::iter([Ok(b)]))
                .try_collect(),
        )
        .unwrap()
    };
    let is = |m: &FlightData, h: arrow_ipc::MessageHeader| {
        arrow_ipc::root_as_message(&m.data_header).is_ok_and(|x| x.header_type() == h)
    };
    // 40 dictionary fields, a 4 MiB dictionary each.
    let fields: Vec<Field> = (0..40)
        .map(|k| {
            Field::new(
                format!("d{k}"),
                DataType::Dictionary(Box::new(DataType::UInt32), Box::new(DataType::Utf8)),
                false,
            )
        })
        .collect();
    let columns: Vec<ArrayRef> = (0..40)
        .map(|k| {
            let values = StringArray::from(vec![format!("{k}").repeat(4 << 20)]);
            Arc::new(
                DictionaryArray::try_new(UInt32Array::from(vec![0u32]), Arc::new(values)).unwrap(),
            ) as ArrayRef
        })
        .collect();
    let db = arrow_array::RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).unwrap();
    let dict_stream: Vec<FlightData> = encode(db, DictionaryHandling::Resend)
        .into_iter()
        .filter(|m| !is(m, arrow_ipc::MessageHeader::RecordBatch))
        .collect();
    assert_eq!(dict_stream.len(), 41, "a schema and 40 dictionaries");
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let good = layout
        .batch(&[0], arrow_buffer::Buffer::from_vec(expected(0)))
        .unwrap();
    let mut tensor_then_dicts = vec![encode(good, DictionaryHandling::Hydrate).remove(0)];
    tensor_then_dicts.extend(dict_stream[1..].iter().cloned());
    let send = |msgs: Vec<FlightData>| {
        rt.block_on(async {
            let channel = tonic::transport::Endpoint::from_shared(f.url.clone())
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut c = FlightClient::new(channel);
            c.add_header("authorization", &token.bearer()).unwrap();
            match c
                .do_exchange(futures::stream::iter(msgs.into_iter().map(Ok)))
                .await
            {
                Err(e) => e.to_string(),
                Ok(s) => match s.try_collect::<Vec<_>>().await {
                    Err(e) => e.to_string(),
                    Ok(v) => format!("answered {} batches", v.len()),
                },
            }
        })
    };
    let before = peak_kib(pid);
    for round in 0..5 {
        let e = send(dict_stream.clone());
        assert!(
            e.contains("the stream does not decode"),
            "round {round}: {e}"
        );
        let e = send(tensor_then_dicts.clone());
        assert!(e.contains("dictionary"), "round {round}: {e}");
    }
    let after = peak_kib(pid);
    println!(
        "10 streams offering 40 dictionaries of 4 MiB each: gateway peak {} -> {} MiB",
        before >> 10,
        after >> 10
    );
    assert!(
        after < before + (100 << 10),
        "the gateway's peak grew from {before} to {after} KiB"
    );
    run_ok(&mut f.producer("after-dictionaries", 16, &[]));
    assert_each_input_once(&f.lines("after-dictionaries"), 16);
}

fn fds_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// 500 TCP connections that never speak: the gateway keeps at most its connection caps open
/// (each newcomer past a cap closes the oldest silent one), closes the ones it kept once they
/// have gone `--auth-timeout` without a call carrying the token, and its descriptors come
/// back; a remote producer is then served.
#[test]
fn silent_connections_are_capped_and_closed_at_their_deadline() {
    let f = Fixture::with_gateway_args(&[
        "--auth-timeout".into(),
        "1".into(),
        "--max-connections".into(),
        "40".into(),
        "--max-connections-per-host".into(),
        "20".into(),
    ]);
    let pid = f.gateway.as_ref().unwrap().id();
    let addr = f.url.trim_start_matches("http://").to_string();
    std::thread::sleep(Duration::from_millis(200));
    let fds0 = fds_of(pid);
    let silent: Vec<std::net::TcpStream> = (0..500)
        .filter_map(|_| std::net::TcpStream::connect(&addr).ok())
        .collect();
    // Past the cap each newcomer closes the oldest silent one, which ends as its task wakes.
    wait_until(
        "the gateway to hold no more than its per-host cap",
        Duration::from_secs(10),
        || fds_of(pid) <= fds0 + 20 + 8,
    );
    // Every one is closed by the gateway: at once over the cap, at the deadline otherwise.
    for mut c in silent.into_iter().step_by(25) {
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        // The server's HTTP/2 preface may come first; then the end.
        let mut rest = Vec::new();
        let t = Instant::now();
        let r = std::io::Read::read_to_end(&mut c, &mut rest);
        assert!(
            r.is_ok() || t.elapsed() < Duration::from_secs(25),
            "a silent connection was held: {r:?} after {:?}",
            t.elapsed()
        );
    }
    wait_until(
        "the gateway's descriptors to come back",
        Duration::from_secs(30),
        || fds_of(pid) <= fds0 + 2,
    );
    run_ok(&mut f.producer("after-silence", 16, &[]));
    assert_each_input_once(&f.lines("after-silence"), 16);
    assert!(
        f.gateway_log().contains("to make room"),
        "{}",
        f.gateway_log()
    );
}

/// A flood of connections without the token from the producers' own address (some silent,
/// some sending HTTP/2's preface and nothing more) keeps both caps full; remote producers with
/// the token still get through, each with every input once: the oldest connections without
/// the token make room for them.
#[test]
fn a_flood_of_tokenless_connections_does_not_lock_producers_out() {
    use std::io::Write;
    let f = Fixture::with_gateway_args(&[
        "--max-connections".into(),
        "12".into(),
        "--max-connections-per-host".into(),
        "8".into(),
    ]);
    let addr = f.url.trim_start_matches("http://").to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut open = std::collections::VecDeque::new();
            let start = Instant::now();
            let mut made = 0u32;
            // Bounded in count and time.
            while !stop.load(Ordering::Relaxed)
                && made < 20_000
                && start.elapsed() < Duration::from_secs(120)
            {
                if let Ok(mut c) = std::net::TcpStream::connect(&addr) {
                    if made.is_multiple_of(2) {
                        let _ = c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
                    }
                    open.push_back(c);
                    made += 1;
                }
                if open.len() > 32 {
                    open.pop_front();
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            made
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    for k in 0..3 {
        let name = format!("through-the-flood-{k}");
        run_ok(&mut f.producer(&name, 16, &[]));
        assert_each_input_once(&f.lines(&name), 16);
    }
    stop.store(true, Ordering::Relaxed);
    let made = flood.join().unwrap();
    assert!(made > 60, "the flood made only {made} connections");
    // The caps were full: room was made.
    assert!(
        f.gateway_log().contains("to make room"),
        "{}",
        f.gateway_log()
    );
}

/// The gateway's resident memory in KiB.
fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS")
}

/// A stream (raw HTTP/2, as tonic's client cannot leave a message half sent) that sends its
/// schema and then 30 MiB of a message announced as 60 MiB, and nothing more, on a gateway with
/// one place: it holds the place and the memory only until `--peer-timeout`, then both are
/// given back together, and a remote producer is served.
#[test]
fn a_stream_left_half_sent_gives_back_its_place_and_its_memory() {
    let f = Fixture::with_gateway_args(&[
        "--max-remotes".into(),
        "1".into(),
        "--peer-timeout".into(),
        "3".into(),
    ]);
    let pid = f.gateway.as_ref().unwrap().id();
    let token = tensorport_bridge::auth::Token::read(&f.token()).unwrap();
    let addr = f.url.trim_start_matches("http://").to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let schema_msg = tensor_schema_message(&rt);
    std::thread::sleep(Duration::from_millis(200));
    let before = rss_kib(pid);
    let (held, ended) = rt.block_on(async {
        let (resp, send) = half_sent(&addr, &token.bearer(), &schema_msg, 60 << 20, 30 << 20).await;
        // While it is held: the gateway has read most of it.
        let t = Instant::now();
        let mut held = 0;
        while t.elapsed() < Duration::from_secs(20) {
            held = held.max(rss_kib(pid));
            if held > before + (20 << 10) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The gateway ends the stream at its peer timeout: the response's end (its trailers)
        // comes while this side still holds the stream open.
        let ended = tokio::time::timeout(Duration::from_secs(60), async {
            let mut body = resp.await.unwrap().into_body();
            while let Some(chunk) = body.data().await {
                if chunk.is_err() {
                    return None;
                }
            }
            body.trailers().await.ok().flatten()
        })
        .await;
        drop(send);
        (held, ended)
    });
    let trailers = ended.expect("the gateway held the half-sent stream for a minute");
    let status = trailers
        .as_ref()
        .and_then(|t| t.get("grpc-message"))
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    assert!(
        status.contains("gives%20its%20place%20back") || status.contains("gives its place back"),
        "the stream ended otherwise: {trailers:?}"
    );
    assert!(
        held > before + (20 << 10),
        "the gateway did not take the message in ({before} -> {held} KiB): the test proves nothing"
    );
    // What the stream took at most (sampling may have caught the growth before its top), and
    // at least half of it comes back (the allocator may keep some for reuse).
    let held = held.max(peak_kib(pid));
    let back_to = before + (held - before) / 2;
    let t = Instant::now();
    while rss_kib(pid) > back_to {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the half-sent message's memory was not given back: {} -> {held} -> {} KiB\n{}",
            before,
            rss_kib(pid),
            f.gateway_log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "gateway RSS {} MiB, {} MiB while the stream held 30 MiB, {} MiB after",
        before >> 10,
        held >> 10,
        rss_kib(pid) >> 10
    );
    // The one place is free again.
    run_ok(&mut f.producer("after-half-sent", 16, &[]));
    assert_each_input_once(&f.lines("after-half-sent"), 16);
}

/// Opens a raw HTTP/2 DoExchange stream to `addr`, sends `first` (a whole message) and then
/// `sent` bytes of a message announced as `declared` bytes, and leaves it there: the stream and
/// its connection stay open as long as the returned handles live.
async fn half_sent(
    addr: &str,
    bearer: &str,
    first: &arrow_flight::FlightData,
    declared: u32,
    sent: usize,
) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let req = http::Request::builder()
        .method("POST")
        .uri(format!(
            "http://{addr}/arrow.flight.protocol.FlightService/DoExchange"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", bearer)
        .body(())
        .unwrap();
    let (resp, mut send) = client.send_request(req, false).unwrap();
    let body = prost::Message::encode_to_vec(first);
    let mut frame = vec![0u8];
    frame.extend((body.len() as u32).to_be_bytes());
    frame.extend(body);
    frame.push(0);
    frame.extend(declared.to_be_bytes());
    // A stream the gateway refuses (no place) is reset: what is left is not sent.
    let mut ok = send.send_data(frame.into(), false).is_ok();
    let mut left = sent;
    while ok && left > 0 {
        let n = left.min(1 << 20);
        ok = send
            .send_data(bytes::Bytes::from(vec![7u8; n]), false)
            .is_ok();
        left -= n;
    }
    (resp, send)
}

/// Every limit at once: a gateway with 4 places and 4 MiB tensors, and 12 streams, each with its
/// schema and then all but a little of the largest message the gateway takes, held there. Four
/// hold places (and what they sent), eight are refused; the gateway's peak memory stays within
/// the bound docs/scale-out.md states for these settings (4 × (two messages of 5 MiB and the
/// 8 MiB window) = 72 MiB over its own), and a remote producer is served once they are gone.
#[test]
fn the_gateways_memory_stays_within_its_stated_bound_with_every_limit_pushed() {
    let f = Fixture::with_gateway_args(&[
        "--max-remotes".into(),
        "4".into(),
        "--max-tensor-mib".into(),
        "4".into(),
        "--peer-timeout".into(),
        "30".into(),
    ]);
    let pid = f.gateway.as_ref().unwrap().id();
    let token = tensorport_bridge::auth::Token::read(&f.token()).unwrap();
    let addr = f.url.trim_start_matches("http://").to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let schema_msg = tensor_schema_message(&rt);
    std::thread::sleep(Duration::from_millis(200));
    let before = peak_kib(pid);
    // The largest message taken: the tensor limit and 1 MiB.
    let declared = (5u32 << 20) - 64;
    let streams = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..12 {
            v.push(
                half_sent(
                    &addr,
                    &token.bearer(),
                    &schema_msg,
                    declared,
                    (5 << 20) - 4096,
                )
                .await,
            );
        }
        // Time for the gateway to take in what it will.
        tokio::time::sleep(Duration::from_secs(3)).await;
        v
    });
    let peak = peak_kib(pid);
    let bound = (4 * (2 * 5 + 8)) << 10;
    println!(
        "12 streams holding 5 MiB messages on 4 places: gateway peak {} -> {} MiB (stated bound {} MiB over its own)",
        before >> 10,
        peak >> 10,
        bound >> 10
    );
    assert!(
        peak <= before + bound,
        "the gateway's peak grew by {} KiB, over the stated bound of {bound} KiB",
        peak - before
    );
    drop(streams);
    drop(rt);
    run_ok(&mut f.producer("after-limits", 16, &[]));
    assert_each_input_once(&f.lines("after-limits"), 16);
}

/// The schema message of a stream of this test's tensors, as a Flight client sends it first.
fn tensor_schema_message(rt: &tokio::runtime::Runtime) -> arrow_flight::FlightData {
    use arrow_flight::encode::FlightDataEncoderBuilder;
    use futures::TryStreamExt;
    use tensorport_bridge::schema::TensorLayout;
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let good = layout
        .batch(&[0], arrow_buffer::Buffer::from_vec(expected(0)))
        .unwrap();
    rt.block_on(
        FlightDataEncoderBuilder::new()
            .with_schema(good.schema())
            .build(futures::stream::iter([Ok(good)]))
            .try_collect::<Vec<_>>(),
    )
    .unwrap()
    .remove(0)
}

/// NIXL from PyPI's nixl-cu13 wheel (scripts/fetch-nixl.sh, run here the first time, into the
/// checkout's target/nixl, where this process's own NIXL calls find it too) and UCX on its TCP
/// transport, for the gateway and the producers; `None` (the test says so and skips) where it
/// cannot be fetched.
fn nixl_env() -> Option<Vec<(String, String)>> {
    static DIR: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| match tensorport_nixl::fetch_into_checkout() {
        Ok(dir) => Some(dir),
        Err(why) => {
            eprintln!("SKIPPED: NIXL could not be fetched (scripts/fetch-nixl.sh: {why})");
            None
        }
    });
    let dir = dir.as_ref()?;
    Some(vec![
        ("TENSORPORT_NIXL".into(), dir.display().to_string()),
        ("UCX_TLS".into(), tensorport_nixl::tcp_transports().into()),
        ("UCX_WARN_UNUSED_ENV_VARS".into(), "n".into()),
    ])
}

#[test]
fn nixl_producers_every_input_once_and_intact_beside_a_flight_one() {
    let Some(env) = nixl_env() else { return };
    let f = Fixture::with(&[], env);
    let mut a = f
        .producer("nixl-a", 300, &["--transport", "nixl"])
        .spawn()
        .unwrap();
    let mut b = f
        .producer(
            "nixl-b",
            200,
            &["--transport", "nixl", "--batch", "16", "--in-flight", "48"],
        )
        .spawn()
        .unwrap();
    let mut c = f.producer("flight", 100, &[]).spawn().unwrap();
    for p in [&mut a, &mut b, &mut c] {
        assert!(p.wait().unwrap().success(), "{}", f.gateway_log());
    }
    assert_each_input_once(&f.lines("nixl-a"), 300);
    assert_each_input_once(&f.lines("nixl-b"), 200);
    assert_each_input_once(&f.lines("flight"), 100);
    let mut got = f.received("nixl-a");
    got.sort_unstable();
    assert_eq!(
        got,
        (0..300).collect::<Vec<_>>(),
        "the server got each tensor once"
    );
    assert_eq!(f.seen.lock().unwrap().torn, 0, "no torn tensor");
    assert!(
        f.gateway_log().contains("NIXL stream"),
        "{}",
        f.gateway_log()
    );
    wait_until("the sessions close", Duration::from_secs(30), || {
        f.sessions() == 0
    });
}

/// The TCP addresses process `pid` listens on, from /proc/net/tcp{,6} and its descriptors.
fn listening(pid: u32) -> Vec<std::net::SocketAddr> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
    let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    l.strip_prefix("socket:[")
                        .and_then(|x| x.strip_suffix(']'))
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default();
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local address, state (0A: listening), inode.
            if f.len() < 10 || f[3] != "0A" || !inodes.contains(f[9]) {
                continue;
            }
            let (addr, port) = f[1].split_once(':').unwrap();
            let port = u16::from_str_radix(port, 16).unwrap();
            // The kernel prints each 32-bit word of the address in the host's (little-endian)
            // byte order.
            let words: Vec<u32> = (0..addr.len() / 8)
                .map(|k| {
                    u32::from_str_radix(&addr[8 * k..8 * k + 8], 16)
                        .unwrap()
                        .swap_bytes()
                })
                .collect();
            let ip = match words[..] {
                [v4] => IpAddr::V4(Ipv4Addr::from(v4)),
                [a, b, c, d] => IpAddr::V6(Ipv6Addr::from(
                    (u128::from(a) << 96)
                        | (u128::from(b) << 64)
                        | (u128::from(c) << 32)
                        | u128::from(d),
                )),
                _ => continue,
            };
            out.push(SocketAddr::new(ip, port));
        }
    }
    out
}

/// A gateway listening on loopback confines NIXL's UCX to loopback: while NIXL streams run,
/// everything the gateway listens on is a loopback address (UCX's own listener included),
/// where UCX left alone listens on the machine's network address.
#[test]
fn the_gateways_ucx_listens_only_on_the_flight_interface() {
    let Some(env) = nixl_env() else { return };
    let f = Fixture::with(&[], env);
    let pid = f.gateway.as_ref().unwrap().id();
    let flight_only = listening(pid);
    assert_eq!(flight_only.len(), 1, "{flight_only:?}");
    let mut p = f
        .producer(
            "nixl-listen",
            3000,
            &["--transport", "nixl", "--batch", "1"],
        )
        .spawn()
        .unwrap();
    // UCX's listener comes with the stream's NIXL agent.
    let t = Instant::now();
    let mut seen = flight_only.clone();
    while seen.len() < 2 && t.elapsed() < Duration::from_secs(60) {
        if let Ok(Some(_)) = p.try_wait() {
            break;
        }
        seen = listening(pid);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(p.wait().unwrap().success(), "{}", f.gateway_log());
    assert!(seen.len() >= 2, "UCX's listener was never seen: {seen:?}");
    assert!(
        seen.iter().all(|a| match a.ip() {
            std::net::IpAddr::V4(v4) => v4.is_loopback(),
            std::net::IpAddr::V6(v6) => {
                v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
            }
        }),
        "the gateway listens beyond loopback: {seen:?}"
    );
    assert_each_input_once(&f.lines("nixl-listen"), 3000);
    assert!(
        f.gateway_log().contains("confined to lo"),
        "{}",
        f.gateway_log()
    );
}

/// A gateway listening on every address was not told which interface NIXL may use: it
/// refuses NIXL streams, saying how to allow them, and serves Flight streams as before.
#[test]
fn a_gateway_on_every_address_refuses_nixl_until_told_an_interface() {
    let Some(env) = nixl_env() else { return };
    let mut f = Fixture::with(&["--allow-plaintext".into()], env);
    if let Some(mut g) = f.gateway.take() {
        let _ = g.kill();
        let _ = g.wait();
    }
    f.start_gateway("0.0.0.0:0");
    // Reached over loopback: the producer refuses plain http:// to any other address.
    f.url = f.url.replace("0.0.0.0", "127.0.0.1");
    let o = f
        .producer("nixl-refused", 8, &["--transport", "nixl"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "a NIXL stream was served");
    assert!(err.contains("--nixl-interface"), "{err}");
    run_ok(&mut f.producer("flight-beside", 8, &[]));
    assert_each_input_once(&f.lines("flight-beside"), 8);
}

#[test]
fn a_killed_nixl_producer_is_reclaimed_and_the_next_is_served() {
    let Some(env) = nixl_env() else { return };
    let f = Fixture::with(&[], env);
    let victim = f.victim(&["--transport", "nixl"]);
    f.kill_victim(victim, Duration::from_secs(60));
    f.serves_next(&["--transport", "nixl"]);
}

/// A producer whose set-up describes slots it never registered, names slots past its set-up,
/// or sends metadata that is not NIXL's: the gateway ends that stream with an error that says
/// so, nothing reaches the server, and the next producer is served.
#[test]
fn a_nixl_set_up_that_lies_is_refused_and_harms_no_one() {
    use tensorport_bridge::nixl::{slot_batch, Hello, Outbound};
    use tensorport_bridge::remote::{connect, Exchange, RemoteConfig};
    use tensorport_bridge::schema::TensorLayout;

    let Some(env) = nixl_env() else { return };
    let f = Fixture::with(&[], env);
    let layout = TensorLayout::new(tensorport::DType::F32, &[3, SIZE as u64, SIZE as u64]).unwrap();
    let out = Outbound::new(&format!("liar-{}", std::process::id()), 4, &layout, None).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cfg = RemoteConfig {
        gateway: f.url.clone(),
        token: tensorport_bridge::auth::Token::read(&f.token()).unwrap(),
        tls: None,
        name: "liar".into(),
        connect_timeout: Duration::from_secs(10),
        allow_plaintext: false,
    };
    let outcome = |hello: Hello, rows: Vec<(u64, u32)>| {
        rt.block_on(async {
            let mut client = connect(&cfg).await.unwrap();
            let schema = hello.schema();
            let mut ex = Exchange::open_with(&mut client, schema.clone(), "liar", 4)
                .await
                .unwrap();
            ex.send(slot_batch(&schema, &rows).unwrap()).await.unwrap();
            ex.finish();
            let mut answered = 0;
            loop {
                match tokio::time::timeout(Duration::from_secs(60), ex.results()).await {
                    Ok(Some(Ok(r))) => answered += r.len(),
                    Ok(Some(Err(e))) => return (answered, Some(e.to_string())),
                    Ok(None) => return (answered, None),
                    Err(_) => panic!("the gateway neither answered nor ended the stream"),
                }
            }
        })
    };
    // Slots past what the agent registered: NIXL refuses to prepare reads of them.
    let mut beyond = out.hello().clone();
    beyond.slots.base += 1 << 30;
    let (n, err) = outcome(beyond, vec![(0, 0)]);
    assert_eq!(n, 0);
    assert!(
        err.as_deref().is_some_and(|e| e.contains("NIXL")),
        "{err:?}"
    );
    // A slot past the set-up's count.
    let (n, err) = outcome(out.hello().clone(), vec![(0, 9)]);
    assert_eq!(n, 0);
    assert!(
        err.as_deref().is_some_and(|e| e.contains("slot 9")),
        "{err:?}"
    );
    // Slots said to be on a GPU, to a gateway whose server takes no device tensors (and here,
    // without a GPU, whose GPU does not open).
    let mut on_gpu = out.hello().clone();
    on_gpu.slots.memory = tensorport_nixl::Memory::Device(0);
    let (n, err) = outcome(on_gpu, vec![(0, 0)]);
    assert_eq!(n, 0);
    assert!(
        err.as_deref().is_some_and(|e| e.contains("device tensors")),
        "{err:?}"
    );
    // Metadata that is not NIXL's.
    let mut junk = out.hello().clone();
    junk.metadata = vec![0x5a; 300];
    let (n, err) = outcome(junk, vec![(0, 0)]);
    assert_eq!(n, 0);
    assert!(err.is_some());
    assert_eq!(
        f.received("liar").len(),
        0,
        "nothing from a liar reached the server"
    );
    run_ok(&mut f.producer("next", 32, &["--transport", "nixl"]));
    assert_each_input_once(&f.lines("next"), 32);
    wait_until("the sessions close", Duration::from_secs(30), || {
        f.sessions() == 0
    });
}
