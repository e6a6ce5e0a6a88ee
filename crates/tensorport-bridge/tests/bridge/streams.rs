//! Remote producers end to end: every input once over loopback, a killed producer, a gateway
//! that dies, pyarrow's client, the command line's help and errors.

use super::*;

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
