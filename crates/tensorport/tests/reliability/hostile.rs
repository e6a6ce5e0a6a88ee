//! Hostile producers speaking the protocol by hand: slots not theirs, lying frames, forged
//! queue entries, descriptor floods, random message sequences, old clients.

use super::*;

pub(crate) fn hostile_slots() {
    let (_dir, sock) = socket_dir();
    let (server, _ok, _torn, stop) = checking_server(ServerConfig::new(&sock));
    let mut r = Raw::connect(&sock);
    let (_, g) = r.hello(4);
    // Returning a slot twice: the second is refused.
    r.send(&ClientMsg::Return(g[0]));
    r.send(&ClientMsg::Return(g[0]));
    assert_eq!(r.next_error(), ErrorCode::SlotNotLeased);
    // Submitting a slot after giving it back: refused.
    r.send(&submit(g[0], 1));
    assert_eq!(r.next_error(), ErrorCode::SlotNotLeased);
    // A slot id and generation we were never granted.
    r.send(&submit(
        SlotRef {
            slot: g[1].slot,
            generation: 41,
        },
        2,
    ));
    assert_eq!(r.next_error(), ErrorCode::SlotNotLeased);
    // Ten descriptors on one message that carries none: all closed, refused.
    r.send_with_fds(&ClientMsg::Status, 10);
    assert_eq!(r.next_error(), ErrorCode::FdsNotExpected);
    // The session still works after all of that.
    r.send(&ClientMsg::Status);
    loop {
        match r.recv() {
            Some(ServerMsg::Status(s)) => {
                assert!(s.totals.protocol_errors >= 4, "{:?}", s.totals);
                break;
            }
            Some(_) => {}
            None => panic!("session closed"),
        }
    }
    // And others are served.
    assert_still_served(&sock, 1);
    // Asking for more slots than allowed gets the maximum, not more.
    let mut cfg = ProducerConfig::new("greedy");
    cfg.slots = 1_000_000;
    let g = Producer::connect(&sock, cfg).unwrap();
    assert_eq!(
        g.layout().slot_count,
        ServerConfig::new(&sock).max_slots_per_session
    );
    drop(server);
    stop.store(true, Ordering::SeqCst);
}

pub(crate) fn lying_frames() {
    let (_dir, sock) = socket_dir();
    let (server, _ok, torn, stop) = checking_server(ServerConfig::new(&sock));
    let submit_bytes = |slot: SlotRef| encode_frame(&submit(slot, 1)).unwrap()[4..].to_vec();
    // A length that lies short: the payload ends mid-message.
    let mut r = Raw::connect(&sock);
    let (_, g) = r.hello(2);
    let body = submit_bytes(g[0]);
    let mut f = 3u32.to_le_bytes().to_vec();
    f.extend(&body[..3]);
    r.send_bytes(&f);
    r.expect_error(ErrorCode::Malformed, true);
    // A length that lies long: a whole message, then bytes that are not one.
    let mut r = Raw::connect(&sock);
    let (_, g) = r.hello(2);
    let mut body = submit_bytes(g[0]);
    body.extend([0xAA; 40]);
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend(&body);
    r.send_bytes(&f);
    r.expect_error(ErrorCode::Malformed, true);
    // A frame cut off by the client going away: the server drops the session, and nothing else.
    assert!(eventually(PATIENCE, || server.status().sessions.is_empty()));
    let before = server.status().totals.sessions_reclaimed;
    let mut r = Raw::connect(&sock);
    r.hello(2);
    let mut f = 100u32.to_le_bytes().to_vec();
    f.extend([0u8; 10]);
    r.send_bytes(&f);
    drop(r);
    assert!(eventually(PATIENCE, || server
        .status()
        .totals
        .sessions_reclaimed
        == before + 1));
    // Others are served throughout.
    assert_still_served(&sock, 9);
    assert_eq!(torn.load(Ordering::SeqCst), 0);
    assert!(server.status().totals.protocol_errors >= 2);
    stop.store(true, Ordering::SeqCst);
}

/// `RegisterDevice` on a server without a GPU: refused, with or without the descriptor a VMM
/// handle carries, and the descriptor is closed (no fd leaks).
pub(crate) fn device_on_cpu() {
    use tensorport::wire::RawDeviceHandle;
    let (_dir, sock) = socket_dir();
    let (server, _ok, _torn, stop) = checking_server(ServerConfig::new(&sock));
    let mut r = Raw::connect(&sock);
    r.hello(2);
    std::thread::sleep(Duration::from_millis(50));
    let fds0 = open_fds();
    let send_with_fd = |r: &mut Raw, msg: &ClientMsg| r.send_with_fds(msg, 1);
    let vmm = ClientMsg::RegisterDevice {
        buffer: 0,
        len: 1 << 20,
        handle: RawDeviceHandle::VmmPosixFd,
    };
    // With its descriptor: no GPU here.
    send_with_fd(&mut r, &vmm);
    assert_eq!(r.next_error(), ErrorCode::Unsupported);
    // Without it: still refused (the importer check comes first).
    r.send(&vmm);
    assert_eq!(r.next_error(), ErrorCode::Unsupported);
    // A legacy handle with a descriptor attached: the descriptor is not its to carry.
    let legacy = ClientMsg::RegisterDevice {
        buffer: 1,
        len: 1 << 20,
        handle: RawDeviceHandle::LegacyIpc {
            memory: vec![0; 64],
            event: vec![0; 64],
        },
    };
    send_with_fd(&mut r, &legacy);
    let mut codes = vec![r.next_error(), r.next_error()];
    codes.sort_by_key(|c| c.as_u16());
    assert_eq!(
        codes,
        vec![ErrorCode::FdsNotExpected, ErrorCode::Unsupported]
    );
    // Every descriptor sent was closed by the server.
    assert!(
        eventually(PATIENCE, || open_fds() <= fds0),
        "server fds {} > {fds0}",
        open_fds()
    );
    // The session still works.
    r.send(&ClientMsg::Status);
    loop {
        match r.recv() {
            Some(ServerMsg::Status(_)) => break,
            Some(_) => {}
            None => panic!("closed"),
        }
    }
    drop(server);
    stop.store(true, Ordering::SeqCst);
}

/// A protocol-2 client written by hand from docs/protocol.md: it finds the queues in the
/// `Welcome`, gets a result through them, has bad entries refused one by one on the socket,
/// and is disconnected (with a fatal error, others still served) when it moves its tail
/// backwards.
pub(crate) fn hostile_ring() {
    use tensorport_shm::ring::{
        CqHeader, CqReader, SqWriter, CQ_GRANT, CQ_INLINE_BYTES, CQ_RESULT,
    };
    let (_dir, sock) = socket_dir();
    let (server, _ok, _torn, stop) = checking_server(ServerConfig::new(&sock));
    let mut r = Raw::connect(&sock);
    r.hello_with(1, 2, 4);
    let (w, mut fds) = welcome_with_fds(&r);
    assert_eq!((w.version, w.fds, fds.len()), (2, 4, 4), "{w:?}");
    let to_server = fds.remove(2);
    let ring = tensorport_shm::RingMem::open(fds.remove(1)).unwrap();
    let grants = match r.recv() {
        Some(ServerMsg::Grant(g)) => g,
        other => panic!("expected Grant, got {other:?}"),
    };
    let bell = || nix::unistd::write(&to_server, &1u64.to_ne_bytes()).unwrap();
    let (mut sq, mut cq) = (SqWriter::default(), CqReader::default());
    let entry = u8_entry;
    // A valid one: its result and the slot's grant come back in one completion.
    assert!(sq.push(&ring, &entry(1, grants[0])).unwrap());
    bell();
    let mut payload = [0u8; CQ_INLINE_BYTES];
    let deadline = Instant::now() + Duration::from_secs(5);
    let h: CqHeader = loop {
        if let Some(h) = cq.pop(&ring, &mut payload).unwrap() {
            break h;
        }
        assert!(Instant::now() < deadline, "no completion on the queue");
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(h.flags, CQ_GRANT | CQ_RESULT);
    assert_eq!(h.request_id, 1);
    assert_eq!(h.slot, grants[0].slot);
    assert_eq!(
        &payload[..h.len as usize],
        &checksum(&[0u8; 64]).to_le_bytes()
    );
    // Bad entries: each refused on the socket with its request id; the session lives on.
    let mut e = entry(
        2,
        SlotRef {
            slot: 99,
            generation: 0,
        },
    );
    assert!(sq.push(&ring, &e).unwrap());
    bell();
    assert_eq!(r.next_error(), ErrorCode::OutOfBounds);
    e = entry(3, grants[1]);
    e.rank = 9;
    assert!(sq.push(&ring, &e).unwrap());
    bell();
    assert_eq!(r.next_error(), ErrorCode::BadRank);
    e = entry(4, grants[1]);
    e.len = 1 << 40;
    assert!(sq.push(&ring, &e).unwrap());
    bell();
    assert_eq!(r.next_error(), ErrorCode::OutOfBounds);
    e = entry(
        5,
        SlotRef {
            slot: grants[1].slot,
            generation: 77,
        },
    );
    assert!(sq.push(&ring, &e).unwrap());
    bell();
    assert_eq!(r.next_error(), ErrorCode::SlotNotLeased);
    // A tail moved backwards (a fresh writer starts again at 0): fatal, socket closed.
    let mut rogue = SqWriter::default();
    assert!(rogue.push(&ring, &entry(6, grants[1])).unwrap());
    bell();
    r.expect_error(ErrorCode::Malformed, true);
    assert!(eventually(PATIENCE, || server.status().sessions.is_empty()));
    assert!(server.status().totals.protocol_errors >= 5);
    assert_still_served(&sock, 7);
    stop.store(true, Ordering::SeqCst);
}

/// 400 sessions, each a pseudo-random sequence of 64 messages (the fuzz target `session` plays
/// the same game with coverage guidance): whatever order of submits, stale and forged slots,
/// returns, refused drains and registrations, garbage and goodbyes, every admitted request is
/// answered exactly once and every pool is given back.
pub(crate) fn sequences() {
    use support::session_ops::{assert_settled, play, sequence_server};
    let (_dir, sock) = socket_dir();
    let (server, stop) = sequence_server(&sock);
    let mut rng = 0x2545F4914F6CDD1Du64;
    let mut sent = 0;
    for _ in 0..400 {
        let ops: Vec<u8> = (0..128)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng >> 24) as u8
            })
            .collect();
        sent += play(&sock, &ops);
    }
    assert_settled(&server, PATIENCE);
    let t = server.status().totals;
    println!(
        "{sent} messages in 400 sessions: {} requests admitted and answered, {} refused",
        t.submitted, t.protocol_errors
    );
    assert!(t.submitted > 500 && t.protocol_errors > 1000, "{t:?}");
    // Still serving: a new producer's request is answered (this consumer fails some on purpose).
    let mut p = Producer::connect(&sock, ProducerConfig::new("after")).unwrap();
    p.lease(PATIENCE)
        .unwrap()
        .submit(&TensorSpec::new(DType::U8, &[64]))
        .unwrap();
    p.recv_result(PATIENCE).unwrap();
    stop.store(true, Ordering::SeqCst);
}

/// A client that speaks only protocol 1 (the socket for everything) is served as before.
pub(crate) fn protocol_1_client() {
    let (_dir, sock) = socket_dir();
    let (server, _ok, _torn, stop) = checking_server(ServerConfig::new(&sock));
    let mut cfg = ProducerConfig::new("v1");
    cfg.rings = false;
    let mut p = Producer::connect(&sock, cfg).unwrap();
    assert!(!p.uses_rings());
    for i in 0..50 {
        let mut l = p.lease(Duration::from_secs(2)).unwrap();
        fill(i, &mut l.bytes_mut()[..256]);
        l.submit(&TensorSpec::new(DType::U8, &[256])).unwrap();
        let c = p.recv_result(Duration::from_secs(2)).unwrap();
        assert!(c.result.is_ok(), "{:?}", c.result);
    }
    // And a server with the queues turned off serves protocol-2 clients on the socket.
    drop(p);
    stop.store(true, Ordering::SeqCst);
    drop(server);
    let (_dir2, sock2) = socket_dir();
    let mut cfg = ServerConfig::new(&sock2);
    cfg.rings = false;
    let (_server2, ok2, _, stop2) = checking_server(cfg);
    let mut p = Producer::connect(&sock2, ProducerConfig::new("v2")).unwrap();
    assert!(!p.uses_rings());
    let mut l = p.lease(Duration::from_secs(2)).unwrap();
    fill(1, &mut l.bytes_mut()[..256]);
    l.submit(&TensorSpec::new(DType::U8, &[256])).unwrap();
    p.recv_result(Duration::from_secs(2))
        .unwrap()
        .result
        .unwrap();
    assert_eq!(ok2.load(Ordering::SeqCst), 1);
    stop2.store(true, Ordering::SeqCst);
}

/// Messages carrying more descriptors than any message takes — in the handshake and in a
/// session, up to the kernel's 253 per message — are refused with the count that arrived, every
/// descriptor is closed (the server's fd count comes back), and the server serves on.
pub(crate) fn many_fds() {
    let (_dir, sock) = socket_dir();
    let (server, _ok, _torn, stop) = checking_server(ServerConfig::new(&sock));
    std::thread::sleep(Duration::from_millis(50));
    let (fds0, rss0) = (open_fds(), rss_kib());
    // In the handshake: a Hello with 6 descriptors, on 100 connections.
    let hello = ClientMsg::Hello(tensorport::wire::Hello {
        magic: tensorport::wire::MAGIC,
        min_version: 1,
        max_version: 2,
        role: tensorport::wire::Role::Producer,
        name: "fd-flood".into(),
        want_slots: 2,
        want_slot_size: 4096,
    });
    for _ in 0..100 {
        let mut r = Raw::connect(&sock);
        r.send_with_fds(&hello, 6);
        let (code, text) = r.next_error_text();
        assert_eq!(code, ErrorCode::FdsNotExpected, "{text}");
        assert!(
            text.starts_with("6 file descriptor(s)"),
            "expected the error to say how many arrived: {text}"
        );
    }
    // In a session: Status frames with 5, 8 and 253 descriptors, 300 in all.
    let mut r = Raw::connect(&sock);
    r.hello(2);
    for i in 0..300 {
        let n = [5, 8, 253][i % 3];
        r.send_with_fds(&ClientMsg::Status, n);
        let (code, text) = r.next_error_text();
        assert_eq!(code, ErrorCode::FdsNotExpected, "{text}");
        assert!(
            text.starts_with(&format!("{n} file descriptor(s)")),
            "expected the error to say {n} arrived: {text}"
        );
    }
    drop(r);
    assert!(
        eventually(PATIENCE, || open_fds() <= fds0),
        "the server's descriptors grew from {fds0} to {} after the floods",
        open_fds()
    );
    println!(
        "  {} descriptors sent in 400 messages: open fds {fds0} -> {}, RSS {rss0} -> {} KiB",
        100 * 6 + 100 * (5 + 8 + 253),
        open_fds(),
        rss_kib()
    );
    assert_still_served(&sock, 2);
    let t = server.status().totals;
    assert!(
        t.protocol_errors >= 300 && t.connections_refused >= 100,
        "expected 300 refused messages and 100 refused handshakes counted: {t:?}"
    );
    stop.store(true, Ordering::SeqCst);
}

/// A socket `Submit` refused before validation (a rank over 8 fails the decoder's size checks)
/// carries its request id, as every other refusal of a Submit does.
pub(crate) fn refused_submit_named() {
    let (_dir, sock) = socket_dir();
    let (_server, _ok, _torn, stop) = checking_server(ServerConfig::new(&sock));
    let mut r = Raw::connect(&sock);
    let (_, g) = r.hello(2);
    let mut msg = submit(g[0], 4242);
    if let ClientMsg::Submit { tensor, .. } = &mut msg {
        tensor.shape = vec![1; 9];
    }
    r.send(&msg);
    loop {
        match r.recv() {
            Some(ServerMsg::Error {
                code, request_id, ..
            }) => {
                assert_eq!(ErrorCode::from_u16(code), ErrorCode::BadRank);
                assert_eq!(request_id, Some(4242), "the refusal must name the request");
                break;
            }
            Some(_) => continue,
            None => panic!("the connection closed without a refusal"),
        }
    }
    stop.store(true, Ordering::SeqCst);
}

/// A server in a child process of its own (this test binary's `sink-server` role) whose
/// descriptor table holds `nofile` entries.
fn sink_server(sock: &std::path::Path, nofile: u32) -> ChildGuard {
    let child = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -n {nofile} && exec \"$0\""))
        .arg(std::env::current_exe().unwrap())
        .env(CHILD_ENV, "sink-server")
        .env("TP_SOCKET", sock)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let guard = ChildGuard(Some(child));
    assert!(
        eventually(PATIENCE, || sock.exists()),
        "the sink server did not bind {}",
        sock.display()
    );
    guard
}

/// The `sink-server` role: a server answering every request at once with an empty result,
/// until it is killed.
pub(crate) fn sink_server_child(socket: &str) {
    let server = Server::bind(ServerConfig::new(socket)).unwrap();
    loop {
        match server.recv_batch(64, Duration::from_millis(100), Duration::ZERO) {
            Ok(batch) => {
                let mut answers: Vec<_> = batch.into_iter().map(|r| (r, [0u8; 0])).collect();
                let _ = server.respond_all(&mut answers);
            }
            Err(_) => return,
        }
    }
}

fn fds_of(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// Descriptors sent with frames that never finish: one session sending a partial frame with 253
/// descriptors per `sendmsg` is closed at once, and so is each of several doing it together
/// against a server with a 400-entry descriptor table — where the kernel cuts their batches
/// short (`EMFILE`, `MSG_CTRUNC`) — with every descriptor that arrived closed: the server's
/// table comes back to where it was, and new producers are served.
pub(crate) fn fds_in_unfinished_frames() {
    const TABLE: u64 = 400;
    let (_dir, sock) = socket_dir();
    let server = sink_server(&sock, TABLE as u32);
    let pid = server.pid();
    assert_still_served(&sock, 1);
    std::thread::sleep(Duration::from_millis(100));
    let fds0 = fds_of(pid);
    // A frame announcing 1,000 bytes, of which 10 come.
    let mut partial = 1000u32.to_le_bytes().to_vec();
    partial.extend([0u8; 10]);
    for round in 0..3 {
        let mut attackers: Vec<Raw> = (0..4)
            .map(|_| {
                let mut r = Raw::connect(&sock);
                r.hello(2);
                r
            })
            .collect();
        // Each sends until the server closes it (a send then fails) or 20 times.
        for r in &mut attackers {
            for _ in 0..20 {
                if !r.send_bytes_with_fds(&partial, 253) {
                    break;
                }
            }
        }
        for r in &mut attackers {
            let (code, text) = r.next_error_text();
            assert_eq!(code, ErrorCode::FdsNotExpected, "round {round}: {text}");
            assert!(text.contains("unfinished frame"), "{text}");
            assert!(r.recv().is_none(), "the session stayed open");
        }
        drop(attackers);
        assert!(
            eventually(PATIENCE, || fds_of(pid) <= fds0),
            "round {round}: the server holds {} descriptors, {fds0} before",
            fds_of(pid)
        );
        assert_still_served(&sock, round + 2);
    }
    // A table with no room at all: the kernel installs none of a partial frame's descriptors
    // and only says it cut them (`MSG_CTRUNC`); the session still ends. The last producer's
    // session is gone first, so no descriptor is freed under the lowered limit.
    assert!(
        eventually(PATIENCE, || fds_of(pid) <= fds0),
        "the server holds {} descriptors, {fds0} before",
        fds_of(pid)
    );
    let mut r = Raw::connect(&sock);
    r.hello(2);
    std::thread::sleep(Duration::from_millis(100));
    set_nofile(pid, lowest_free_fd(pid), TABLE);
    for _ in 0..5 {
        if !r.send_bytes_with_fds(&partial, 253) {
            break;
        }
    }
    let (code, text) = r.next_error_text();
    set_nofile(pid, TABLE, TABLE);
    assert_eq!(code, ErrorCode::FdsNotExpected, "full table: {text}");
    assert!(text.contains("did not fit"), "{text}");
    assert!(r.recv().is_none(), "the session stayed open");
    drop(r);
    assert_still_served(&sock, 5);
    println!(
        "  3 rounds of 4 sessions × 253 descriptors a send, then one into a full table: \
         server fds {fds0} -> {}",
        fds_of(pid)
    );
}

/// The lowest descriptor number `pid` has free: as its limit, no descriptor fits its table.
fn lowest_free_fd(pid: i32) -> u64 {
    let open: std::collections::BTreeSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    (0..).find(|n| !open.contains(n)).unwrap()
}

/// Sets `pid`'s descriptor limit to `soft`, keeping its hard limit `hard`.
fn set_nofile(pid: i32, soft: u64, hard: u64) {
    let limit = nix::libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: `limit` is a valid rlimit and the old-limit pointer may be null.
    let rc =
        unsafe { nix::libc::prlimit(pid, nix::libc::RLIMIT_NOFILE, &limit, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// A producer keeping its submission queue full of invalid entries: refused ones count against
/// its turn (another producer is served meanwhile), only a few refusals are logged, and after
/// `max_refusals` the session ends with `TooManyRefusals`.
pub(crate) fn refusal_flood() {
    use tensorport_shm::ring::SqWriter;
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.max_refusals = 300;
    let (server, ok, _torn, stop) = checking_server(cfg);
    let before = logs().matches("refused:").count();
    let mut r = Raw::connect(&sock);
    r.hello_with(1, 2, 4);
    let (_w, mut fds) = welcome_with_fds(&r);
    let to_server = fds.remove(2);
    let ring = tensorport_shm::RingMem::open(fds.remove(1)).unwrap();
    let mut sq = SqWriter::default();
    drop(r.s.set_read_timeout(Some(Duration::from_secs(60))));
    // A good producer working beside it the whole time.
    let done = Arc::new(AtomicBool::new(false));
    let good = {
        let (sock, done) = (sock.clone(), done.clone());
        std::thread::spawn(move || {
            let mut p = Producer::connect(&sock, ProducerConfig::new("good")).unwrap();
            let mut n = 0u64;
            while !done.load(Ordering::SeqCst) || n < 20 {
                let mut l = p.lease(PATIENCE).unwrap();
                fill(n, &mut l.bytes_mut()[..64]);
                l.submit(&TensorSpec::new(DType::U8, &[64])).unwrap();
                assert!(p.recv_result(PATIENCE).unwrap().result.is_ok());
                n += 1;
            }
            n
        })
    };
    // Invalid entries (a slot that does not exist), the queue kept full, until the session ends.
    let reader = {
        let s = r.s.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut r = Raw { s };
            let mut codes = Vec::new();
            while let Some(m) = r.recv() {
                if let ServerMsg::Error { code, fatal, .. } = m {
                    codes.push((ErrorCode::from_u16(code), fatal));
                }
            }
            codes
        })
    };
    assert!(eventually(PATIENCE, || server.status().sessions.len() == 2));
    let (mut id, mut refusals) = (0u64, 0);
    let t = Instant::now();
    while server.status().sessions.len() == 2 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the flooding session was not ended after {id} invalid entries"
        );
        loop {
            let e = u8_entry(
                id,
                SlotRef {
                    slot: 99,
                    generation: 0,
                },
            );
            match sq.push(&ring, &e) {
                Ok(true) => id += 1,
                _ => break,
            }
        }
        let _ = nix::unistd::write(&to_server, &1u64.to_ne_bytes());
        std::thread::sleep(Duration::from_millis(1));
    }
    let codes = reader.join().unwrap();
    for (code, fatal) in &codes {
        if *code == ErrorCode::SlotNotLeased || *code == ErrorCode::OutOfBounds {
            assert!(!fatal);
            refusals += 1;
        }
    }
    assert_eq!(
        codes.last().copied(),
        Some((ErrorCode::TooManyRefusals, true)),
        "the flooding session must end with TooManyRefusals"
    );
    assert_eq!(refusals, 300, "refusals answered before the end");
    done.store(true, Ordering::SeqCst);
    let served = good.join().expect("the good producer was disturbed");
    assert!(ok.load(Ordering::SeqCst) >= served);
    let logged = logs().matches("refused:").count() - before;
    assert!(
        logged <= 8 + 9,
        "{logged} refusal lines logged for 300 refusals: the log must be rate-limited"
    );
    println!("  {id} invalid entries pushed, 300 refused, {logged} logged, then TooManyRefusals; the other producer got {served} results meanwhile");
    stop.store(true, Ordering::SeqCst);
}
