//! Producers and servers that start, die (SIGKILL) and come back: intact tensors, nothing
//! leaked, nobody left waiting; the pool's seal, the handshake limits, the socket file.

use super::*;

pub(crate) fn child_slow_producer(socket: &str) {
    let mut p = Producer::connect(socket, ProducerConfig::new("slow-producer")).expect("connect");
    let mut i = 0u64;
    loop {
        while p.try_recv_result().expect("poll").is_some() {}
        let spec = TensorSpec::new(DType::F32, &[64, 1024]);
        let n = spec.extent().unwrap() as usize;
        let mut lease = p.lease(Duration::from_secs(20)).expect("lease");
        let bytes = &mut lease.bytes_mut()[..n];
        // Half of a fresh tensor, a pause (a SIGKILL likely lands here), then all of it.
        let mut tmp = vec![0u8; n];
        fill((7 << 40) | i, &mut tmp);
        bytes[..n / 2].copy_from_slice(&tmp[..n / 2]);
        std::thread::sleep(Duration::from_millis(15));
        bytes.copy_from_slice(&tmp);
        lease.submit(&spec).expect("submit");
        println!("submitted {i}");
        i += 1;
    }
}

pub(crate) fn child_server_hold(socket: &str) {
    let server = Server::bind(ServerConfig::new(socket)).expect("bind");
    println!("ready");
    std::io::stdout().flush().unwrap();
    let mut held = Vec::new();
    loop {
        if let Ok(Some(r)) = server.recv_timeout(Duration::from_millis(100)) {
            held.push(r);
        }
    }
}

pub(crate) fn four_producers() {
    let (_dir, sock) = socket_dir();
    let fds0 = open_fds();
    let maps0 = pool_mappings();
    let srv = CheckingServer::start(ServerConfig::new(&sock));
    let fds_listening = open_fds();
    let mut kids = spawn_checked_producers(&sock, 4, 1000);
    wait_all_ok(&mut kids, Duration::from_secs(120));
    assert_eq!(srv.verified.load(Ordering::SeqCst), 4000);
    assert_eq!(srv.torn.load(Ordering::SeqCst), 0);
    let st = srv.server.status();
    assert_eq!(st.totals.submitted, 4000);
    assert_eq!(st.totals.completed, 4000);
    assert_eq!(st.totals.protocol_errors, 0);
    // Every session, pool mapping and fd is gone again, with the server still up.
    assert_reclaimed(&srv, fds_listening, maps0, "leak");
    drop(srv);
    assert!(eventually(PATIENCE, || open_fds() <= fds0));
}

pub(crate) fn killed_producer() {
    let (_dir, sock) = socket_dir();
    let maps0 = pool_mappings();
    let srv = CheckingServer::start(ServerConfig::new(&sock));
    let fds_listening = open_fds();
    // Hold the first 3 tensors of the slow producer, so it dies with slots submitted to us.
    *srv.hold_from.lock().unwrap() = Some(("slow-producer".into(), 3));
    let mut slow = spawn_child("slow-producer", &[socket_env(&sock)]);
    let mut kids = spawn_checked_producers(&sock, 3, 300);
    // Let the slow producer get tensors in, then kill it, most likely mid-write.
    assert!(eventually(PATIENCE, || srv
        .per_producer
        .lock()
        .unwrap()
        .get("slow-producer")
        .copied()
        .unwrap_or(0)
        >= 6));
    slow.kill9();
    // The server notices at once and reclaims the session.
    assert!(eventually(PATIENCE, || srv
        .server
        .status()
        .totals
        .sessions_reclaimed
        == 1));
    assert!(eventually(PATIENCE, || logs().contains("producer gone; reclaiming")));
    // The tensors it submitted before dying are still whole and readable until released.
    {
        let held = srv.held.lock().unwrap();
        assert_eq!(held.len(), 3);
        for r in held.iter() {
            assert!(
                verify(r.bytes()),
                "held tensor changed after its producer died"
            );
        }
    }
    srv.held.lock().unwrap().clear();
    wait_all_ok(&mut kids, Duration::from_secs(120));
    assert_eq!(
        srv.torn.load(Ordering::SeqCst),
        0,
        "a torn tensor was delivered"
    );
    assert!(srv.verified.load(Ordering::SeqCst) >= 900);
    assert_reclaimed(&srv, fds_listening, maps0, "leak after kill");
}

/// Soon (within `PATIENCE`): no session left, the server's fds back to `fds` and its pool mappings to `maps`.
pub(crate) fn assert_reclaimed(srv: &CheckingServer, fds: usize, maps: usize, what: &str) {
    assert!(
        eventually(PATIENCE, || srv.server.status().sessions.is_empty()
            && open_fds() == fds
            && pool_mappings() == maps),
        "{what}: fds {} (listening {fds}), pool mappings {} (start {maps})",
        open_fds(),
        pool_mappings()
    );
}

pub(crate) fn killed_server() {
    let (_dir, sock) = socket_dir();
    let mut srv = spawn_child("server-hold", &[socket_env(&sock)]);
    let mut line = String::new();
    BufReader::new(srv.0.as_mut().unwrap().stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    let (tx, rx) = mpsc::channel::<&'static str>();
    let spawn = |what: &'static str, tx: mpsc::Sender<&'static str>, sock: std::path::PathBuf| {
        std::thread::spawn(move || -> (Error, Instant) {
            let mut cfg = ProducerConfig::new(what);
            cfg.slots = 2;
            let mut p = Producer::connect(&sock, cfg).unwrap();
            let spec = TensorSpec::new(DType::U8, &[64]);
            let n = if what == "lease" { 2 } else { 1 };
            for _ in 0..n {
                let mut l = p.lease(Duration::from_secs(5)).unwrap();
                fill(1, &mut l.bytes_mut()[..64]);
                l.submit(&spec).unwrap();
            }
            tx.send(what).unwrap();
            let err: Error = if what == "lease" {
                // Every slot is with the server, which holds them: this blocks.
                p.lease(Duration::from_secs(30))
                    .map(|_| ())
                    .unwrap_err()
                    .into()
            } else {
                p.recv_result(Duration::from_secs(30))
                    .map(|_| ())
                    .unwrap_err()
                    .into()
            };
            (err, Instant::now())
        })
    };
    let a = spawn("lease", tx.clone(), sock.clone());
    let b = spawn("result", tx, sock.clone());
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let killed_at = Instant::now();
    srv.kill9();
    for t in [a, b] {
        let (err, at) = t.join().unwrap();
        let waited = at.duration_since(killed_at);
        assert!(matches!(err, Error::ServerGone), "unexpected error: {err}");
        // Noticed through the closed socket, not by running out the 30 s the calls were given.
        assert!(
            waited < Duration::from_secs(15),
            "expected ServerGone at once (the socket closed), but it took {waited:?}: the \
             producer seems to have waited out its timeout"
        );
        assert!(err.to_string().contains("closed the connection"));
    }
}

pub(crate) fn sealed_pool() {
    let (_dir, sock) = socket_dir();
    let _srv = CheckingServer::start(ServerConfig::new(&sock));
    let p = Producer::connect(&sock, ProducerConfig::new("sealed")).unwrap();
    let len = p.layout().pool_len as i64;
    assert_eq!(
        nix::unistd::ftruncate(p.pool_fd(), 0),
        Err(nix::Error::EPERM)
    );
    assert_eq!(
        nix::unistd::ftruncate(p.pool_fd(), len / 2),
        Err(nix::Error::EPERM)
    );
    assert_eq!(
        nix::unistd::ftruncate(p.pool_fd(), len * 2),
        Err(nix::Error::EPERM)
    );
    // Seals cannot be changed either.
    assert_eq!(
        nix::fcntl::fcntl(
            p.pool_fd(),
            nix::fcntl::FcntlArg::F_ADD_SEALS(nix::fcntl::SealFlag::F_SEAL_WRITE)
        ),
        Err(nix::Error::EPERM)
    );
}

pub(crate) fn limits() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.max_sessions = 2;
    cfg.handshake_timeout = Duration::from_millis(300);
    let srv = CheckingServer::start(cfg);
    // A connection that never says hello is dropped after the handshake timeout.
    let mut idle = Raw::connect(&sock);
    // (expect_error reads with its own bound, so a server that never times it out fails here.)
    idle.expect_error(ErrorCode::HandshakeTimeout, true);
    // Two producers fit; a third is refused with a clear error.
    let a = Producer::connect(&sock, ProducerConfig::new("a")).unwrap();
    let _b = Producer::connect(&sock, ProducerConfig::new("b")).unwrap();
    let e = Producer::connect(&sock, ProducerConfig::new("c")).unwrap_err();
    assert!(
        matches!(
            e,
            tensorport::ConnectError::Refused {
                code: ErrorCode::TooManySessions,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("maximum of 2 producers"));
    // When one leaves, there is room again.
    a.close().unwrap();
    assert!(eventually(PATIENCE, || srv.server.status().sessions.len() == 1));
    Producer::connect(&sock, ProducerConfig::new("d")).unwrap();
}

pub(crate) fn socket_file() {
    let (_dir, sock) = socket_dir();
    // A live server's socket is not taken over.
    let s1 = Server::bind(ServerConfig::new(&sock)).unwrap();
    let e = Server::bind(ServerConfig::new(&sock)).unwrap_err();
    assert!(matches!(e, tensorport::BindError::AddrInUse(_)), "{e}");
    // A server killed with SIGKILL leaves its socket file; the next server replaces it.
    let mut hold = spawn_child("server-hold", &[socket_env(&sock.with_extension("2"))]);
    let mut line = String::new();
    BufReader::new(hold.0.as_mut().unwrap().stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    hold.kill9();
    assert!(
        sock.with_extension("2").exists(),
        "socket file left behind by SIGKILL"
    );
    let s2 = Server::bind(ServerConfig::new(sock.with_extension("2"))).unwrap();
    Producer::connect(sock.with_extension("2"), ProducerConfig::new("x")).unwrap();
    drop(s2);
    drop(s1);
    assert!(!sock.exists(), "socket file removed on clean shutdown");
}
