//! Who may do what: another uid's producers and servers, and who may drain.

use super::*;

pub(crate) fn other_uid_client(socket: &str) {
    // Drop to nobody, then connect.
    nix::unistd::setgid(nix::unistd::Gid::from_raw(65534)).unwrap();
    nix::unistd::setuid(nix::unistd::Uid::from_raw(65534)).unwrap();
    match Producer::connect(socket, ProducerConfig::new("intruder")) {
        Ok(_) => println!("connected"),
        Err(tensorport::ConnectError::Refused { code, .. }) => println!("refused {code:?}"),
        Err(e) => println!("error {e}"),
    }
}

pub(crate) fn other_uid() {
    if !nix::unistd::geteuid().is_root() {
        println!("  skipped: needs root to run a client under another uid (CI runs as root)");
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("tp-uid-")
        .tempdir()
        .unwrap();
    let sock = dir.path().join("tp.sock");
    let (server, _ok, _torn, stop) = checking_server(ServerConfig::new(&sock));
    // With the default permissions another user cannot even reach the socket.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )
    .unwrap();
    let out = spawn_child("other-uid", &[socket_env(&sock)]).wait_ok(Duration::from_secs(10));
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("Permission denied") || s.contains("os error 13"),
        "{s}"
    );
    // Even with the socket opened up, the server checks the peer's uid.
    std::fs::set_permissions(&sock, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    let out = spawn_child("other-uid", &[socket_env(&sock)]).wait_ok(Duration::from_secs(10));
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("refused PermissionDenied"), "{s}");
    assert!(server.status().totals.connections_refused >= 1);
    assert!(logs().contains("refusing connection from another user"));
    stop.store(true, Ordering::SeqCst);
}

pub(crate) fn other_uid_server(socket: &str) {
    nix::unistd::setgid(nix::unistd::Gid::from_raw(65534)).unwrap();
    nix::unistd::setuid(nix::unistd::Uid::from_raw(65534)).unwrap();
    let mut cfg = ServerConfig::new(socket);
    cfg.allowed_uids = vec![0];
    let _server = Server::bind(cfg).expect("bind as nobody");
    println!("ready");
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(30));
}

/// A process of another user listening on the path the producer was given: the producer
/// refuses it before sending anything.
pub(crate) fn untrusted_server() {
    if !nix::unistd::geteuid().is_root() {
        println!("  skipped: needs root to run a server under another uid (CI runs as root)");
        return;
    }
    let dir = tempfile::Builder::new()
        .prefix("tp-squat-")
        .tempdir()
        .unwrap();
    // A directory nobody can write, as a shared spool would be.
    let spool = dir.path().join("spool");
    std::fs::create_dir(&spool).unwrap();
    std::os::unix::fs::chown(&spool, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let sock = spool.join("tp.sock");
    let mut squatter = spawn_child("other-uid-server", &[socket_env(&sock)]);
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(squatter.0.as_mut().unwrap().stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "ready");
    let e = Producer::connect(&sock, ProducerConfig::new("careful")).unwrap_err();
    assert!(
        matches!(
            e,
            tensorport::ConnectError::UntrustedServer { uid: 65534, .. }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("runs as uid 65534"), "{e}");
}

/// A producer session's `Drain` is refused (not fatal) and changes nothing; a control session's
/// drains the server.
pub(crate) fn drain_authority() {
    let (_dir, sock) = socket_dir();
    let (server, _ok, _torn, stop) = checking_server(ServerConfig::new(&sock));
    let mut r = Raw::connect(&sock);
    r.hello(2);
    r.send(&ClientMsg::Drain);
    let (code, text) = r.next_error_text();
    assert_eq!(code, ErrorCode::PermissionDenied, "{text}");
    assert!(
        text.contains("tensorport ctl drain"),
        "expected the refusal to say who may drain: {text}"
    );
    assert!(!server.is_draining(), "a producer drained the server");
    assert_still_served(&sock, 2);
    // The operator may.
    let mut c = tensorport::Control::connect(&sock, Duration::from_secs(10)).unwrap();
    c.drain().unwrap();
    assert!(server.is_draining());
    assert!(
        logs().contains("drain asked by a control session"),
        "expected the log to say who drained"
    );
    stop.store(true, Ordering::SeqCst);
}
