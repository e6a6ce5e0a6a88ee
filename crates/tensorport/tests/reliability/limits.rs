//! Bounds that hold under pressure: connection floods, the in-flight limit, the memory
//! budget, idle sessions making room.

use super::*;

pub(crate) fn flood() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.max_sessions = 4;
    cfg.handshake_timeout = Duration::from_millis(500);
    let (server, _ok, _torn, stop) = checking_server(cfg);
    let mut good = Producer::connect(&sock, ProducerConfig::new("good")).unwrap();
    // 200 connections that never say hello.
    let conns: Vec<UnixStream> = (0..200)
        .filter_map(|_| UnixStream::connect(&sock).ok())
        .collect();
    // The good producer is still served while the flood sits there.
    for i in 0..20 {
        let mut l = good.lease(PATIENCE).unwrap();
        fill(i, &mut l.bytes_mut()[..128]);
        l.submit(&TensorSpec::new(DType::U8, &[128])).unwrap();
        assert!(good.recv_result(PATIENCE).unwrap().result.is_ok());
    }
    assert!(
        eventually(PATIENCE, || server.status().totals.connections_refused
            >= 170),
        "only {} refused",
        server.status().totals.connections_refused
    );
    // While the flood is still held open by its client, the handshake timeout closes the
    // connections that never spoke, and a new producer gets in.
    assert!(
        eventually(PATIENCE, || Producer::connect(
            &sock,
            ProducerConfig::new("late")
        )
        .is_ok()),
        "a new producer was locked out by connections that never said hello"
    );
    let refused = server.status().totals.connections_refused;
    drop(conns);
    // 80 more held open, then a producer connects while they are: each of the 80 is closed by
    // the server within the handshake timeout, not held for as long as the client wishes.
    let held: Vec<UnixStream> = (0..80)
        .filter_map(|_| UnixStream::connect(&sock).ok())
        .collect();
    let mut late = None;
    assert!(eventually(PATIENCE, || {
        late = Producer::connect(&sock, ProducerConfig::new("late-2")).ok();
        late.is_some()
    }));
    let mut l = late.as_mut().unwrap().lease(PATIENCE).unwrap();
    fill(7, &mut l.bytes_mut()[..64]);
    l.submit(&TensorSpec::new(DType::U8, &[64])).unwrap();
    assert!(late.unwrap().recv_result(PATIENCE).unwrap().result.is_ok());
    // The server said goodbye to every one of them (EOF after its refusal).
    for mut c in held {
        c.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut rest = Vec::new();
        assert!(std::io::Read::read_to_end(&mut c, &mut rest).is_ok());
    }
    assert!(server.status().totals.connections_refused >= refused + 80);
    stop.store(true, Ordering::SeqCst);
}

pub(crate) fn in_flight_limit() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.max_in_flight = 3;
    let server = Arc::new(Server::bind(cfg).unwrap());
    // A consumer that releases slots at once but never answers: requests stay in flight.
    let held = Arc::new(Mutex::new(Vec::new()));
    let (s, h) = (server.clone(), held.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let st = stop.clone();
    std::thread::spawn(move || {
        while !st.load(Ordering::SeqCst) {
            if let Ok(Some(r)) = s.recv_timeout(Duration::from_millis(20)) {
                h.lock().unwrap().push(r.release());
            }
        }
    });
    let mut r = Raw::connect(&sock);
    let (_, g) = r.hello(2);
    // One request at a time: an accepted one is released at once (a Grant comes back), a
    // refused one leaves its slot with us.
    let mut free = std::collections::VecDeque::from(g);
    let mut id = 0;
    let (code, slot) = loop {
        let slot = free.pop_front().expect("a free slot");
        id += 1;
        assert!(id < 10, "the in-flight limit did not hold");
        r.send(&submit(slot, id));
        match r.recv() {
            Some(ServerMsg::Grant(g)) => free.extend(g),
            Some(ServerMsg::Error { code, .. }) => break (ErrorCode::from_u16(code), slot),
            o => panic!("unexpected {o:?}"),
        }
    };
    assert_eq!(code, ErrorCode::TooManyInFlight);
    assert_eq!(id, 4);
    assert!(eventually(PATIENCE, || held.lock().unwrap().len() == 3));
    // Request 1 is still in flight (never answered): reusing its id is refused, before the
    // in-flight limit is even looked at.
    r.send(&submit(slot, 1));
    assert_eq!(r.next_error(), ErrorCode::DuplicateRequest);
    stop.store(true, Ordering::SeqCst);
}

/// A `Hello` with the given slots and slot size.
pub(crate) fn hello_asking(slots: u32, slot_size: u64) -> ClientMsg {
    ClientMsg::Hello(tensorport::wire::Hello {
        magic: tensorport::wire::MAGIC,
        min_version: 1,
        max_version: 2,
        role: tensorport::wire::Role::Producer,
        name: "greedy".into(),
        want_slots: slots,
        want_slot_size: slot_size,
    })
}

/// Hellos asking for the most memory each: a pool over the per-session cap is refused, pools
/// are accepted until the budget is spent and refused after, the reserved bytes never pass the
/// budget, and a reclaimed session's bytes come back for a newcomer.
pub(crate) fn memory_budget() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.memory_budget = 64 << 20;
    cfg.max_session_bytes = 24 << 20;
    let (server, _ok, _torn, stop) = checking_server(cfg);
    assert_eq!(server.pool_memory(), (0, 64 << 20));
    // The most a Hello may ask for: 256 slots of 256 MiB.
    let mut r = Raw::connect(&sock);
    r.send(&hello_asking(256, 256 << 20));
    let (code, text) = r.next_error_text();
    assert_eq!(code, ErrorCode::MemoryBudget, "{text}");
    assert!(text.contains("fewer or smaller slots"), "{text}");
    // 20 MiB each: three fit in 64 MiB, the rest of a flood of twelve is refused.
    let mut held = Vec::new();
    let (mut refused, mut most) = (0, 0);
    for _ in 0..12 {
        let mut r = Raw::connect(&sock);
        r.send(&hello_asking(5, 4 << 20));
        match r.recv() {
            Some(ServerMsg::Welcome(_)) => held.push(r),
            Some(ServerMsg::Error { code, message, .. }) => {
                assert_eq!(
                    ErrorCode::from_u16(code),
                    ErrorCode::MemoryBudget,
                    "{message}"
                );
                assert!(message.contains("memory budget"), "{message}");
                refused += 1;
            }
            other => panic!("expected Welcome or a refusal, got {other:?}"),
        }
        let (used, limit) = server.pool_memory();
        assert!(
            used <= limit,
            "{used} bytes reserved, over the budget of {limit}"
        );
        most = most.max(used);
    }
    println!(
        "  a Hello asking 64 GiB and 12 asking 20 MiB: at most {} MiB reserved of a 64 MiB budget",
        most >> 20
    );
    assert_eq!(
        (held.len(), refused),
        (3, 9),
        "expected 3 pools of 20 MiB in 64 MiB"
    );
    // One leaves: its 20 MiB come back, and a newcomer fits again.
    held.pop();
    assert!(
        eventually(PATIENCE, || server.pool_memory().0 == 40 << 20),
        "expected 40 MiB reserved after a session left, got {:?}",
        server.pool_memory()
    );
    let mut r = Raw::connect(&sock);
    r.send(&hello_asking(5, 4 << 20));
    assert!(matches!(r.recv(), Some(ServerMsg::Welcome(_))));
    drop(r);
    drop(held);
    assert!(
        eventually(PATIENCE, || server.pool_memory().0 == 0),
        "expected every pool given back, got {:?}",
        server.pool_memory()
    );
    stop.store(true, Ordering::SeqCst);
}

/// Every producer place held, one by a session that does nothing: a newcomer still gets in, and
/// the idle one is told why it was closed. The busy session is not the one closed.
pub(crate) fn idle_eviction() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.max_sessions = 2;
    cfg.idle_eviction = Duration::from_millis(300);
    let (server, _ok, _torn, stop) = checking_server(cfg);
    let mut idle = Raw::connect(&sock);
    idle.hello(2);
    // The second place: a producer that keeps working (a submit every few milliseconds) until
    // the test is over, however slow the machine.
    let done = Arc::new(AtomicBool::new(false));
    let busy = {
        let (sock, done) = (sock.clone(), done.clone());
        std::thread::spawn(move || {
            let mut p = Producer::connect(&sock, ProducerConfig::new("busy")).unwrap();
            let spec = TensorSpec::new(DType::U8, &[64]);
            let mut i = 0u64;
            while !done.load(Ordering::SeqCst) {
                i += 1;
                let mut l = p.lease(Duration::from_secs(30)).unwrap();
                fill(i, &mut l.bytes_mut()[..64]);
                l.submit(&spec).unwrap();
                p.recv_result(Duration::from_secs(30)).unwrap();
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    assert!(eventually(PATIENCE, || server.status().sessions.len() == 2));
    std::thread::sleep(Duration::from_millis(400));
    // Full; the idle one has been idle long enough: the newcomer gets its place.
    let newcomer = Producer::connect(&sock, ProducerConfig::new("newcomer"));
    assert!(
        newcomer.is_ok(),
        "the newcomer was refused: {:?}",
        newcomer.err()
    );
    let mut told = None;
    while let Some(m) = idle.recv() {
        if let ServerMsg::Error { code, message, .. } = m {
            told = Some((ErrorCode::from_u16(code), message));
        }
    }
    let (code, message) = told.expect("the idle session was closed without a word");
    assert_eq!(code, ErrorCode::TooManySessions, "{message}");
    assert!(message.contains("idle for"), "{message}");
    done.store(true, Ordering::SeqCst);
    busy.join().expect("the busy producer was disturbed");
    stop.store(true, Ordering::SeqCst);
}

/// Idle sessions holding the whole memory budget: a newcomer asking for a pool gets it once one
/// of them has been idle for `idle_eviction` (the longest idle one is closed, and told why).
pub(crate) fn idle_memory_eviction() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.memory_budget = 64 << 20;
    cfg.max_session_bytes = 24 << 20;
    // Long enough that the fourth Hello below comes before it, however loaded the machine.
    cfg.idle_eviction = Duration::from_secs(2);
    let (server, _ok, _torn, stop) = checking_server(cfg);
    // Three pools of 20 MiB: the budget is spent.
    let mut idle: Vec<Raw> = (0..3)
        .map(|_| {
            let mut r = Raw::connect(&sock);
            r.send(&hello_asking(5, 4 << 20));
            match r.recv() {
                Some(ServerMsg::Welcome(_)) => r,
                other => panic!("expected Welcome, got {other:?}"),
            }
        })
        .collect();
    // Before they are idle long enough, a fourth is refused.
    let mut r = Raw::connect(&sock);
    r.send(&hello_asking(5, 4 << 20));
    assert_eq!(r.next_error(), ErrorCode::MemoryBudget);
    std::thread::sleep(Duration::from_millis(2100));
    // Now one of them gives its pool up for the newcomer.
    let mut r = Raw::connect(&sock);
    r.send(&hello_asking(5, 4 << 20));
    match r.recv() {
        Some(ServerMsg::Welcome(_)) => {}
        other => panic!("the newcomer was refused though idle sessions held the budget: {other:?}"),
    }
    let (used, limit) = server.pool_memory();
    assert!(used <= limit, "{used} > {limit}");
    // Exactly one idle session was closed, with a reason.
    assert!(eventually(PATIENCE, || server.status().sessions.len() == 3));
    let closed: Vec<(usize, String)> = idle
        .iter_mut()
        .enumerate()
        .filter_map(|(i, r)| {
            let (said, eof) = read_for_a_while(r);
            eof.then_some((i, said))
        })
        .collect();
    assert_eq!(
        closed.len(),
        1,
        "one idle session should make room: {closed:?}"
    );
    let said = closed[0].1.clone();
    assert!(
        said.contains("idle for") && said.contains("memory"),
        "{said}"
    );
    stop.store(true, Ordering::SeqCst);
}

/// Silent connections opened as fast as the test can, hundreds held at once, while producers
/// connect: every producer gets in (the silent ones only ever push out each other).
pub(crate) fn silent_flood() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.max_sessions = 8;
    cfg.handshake_timeout = Duration::from_secs(30);
    let (server, _ok, _torn, stop) = checking_server(cfg);
    let done = Arc::new(AtomicBool::new(false));
    let flood = {
        let (sock, done) = (sock.clone(), done.clone());
        std::thread::spawn(move || {
            let mut held = std::collections::VecDeque::new();
            let mut opened = 0u64;
            while !done.load(Ordering::SeqCst) && opened < 200_000 {
                if let Ok(c) = UnixStream::connect(&sock) {
                    held.push_back(c);
                    opened += 1;
                }
                if held.len() > 300 {
                    held.pop_front();
                }
            }
            opened
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..20 {
        let p = Producer::connect(&sock, ProducerConfig::new("through-the-flood"));
        assert!(
            p.is_ok(),
            "producer {i} was locked out by silent connections: {:?}",
            p.err()
        );
    }
    done.store(true, Ordering::SeqCst);
    let opened = flood.join().unwrap();
    println!(
        "  {opened} silent connections opened while 20 producers connected; {} refused or closed",
        server.status().totals.connections_refused
    );
    stop.store(true, Ordering::SeqCst);
}

/// The error texts `r` receives within 300 ms, and whether the server closed it.
fn read_for_a_while(r: &mut Raw) -> (String, bool) {
    use std::io::Read;
    r.s.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut said = String::new();
    loop {
        let mut h = [0u8; 4];
        match r.s.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return (said, true),
            Err(_) => return (said, false),
        }
        let mut p = vec![0u8; u32::from_le_bytes(h) as usize];
        r.s.read_exact(&mut p).unwrap();
        if let ServerMsg::Error { message, .. } = tensorport::wire::decode_server(&p).unwrap() {
            said.push_str(&message);
        }
    }
}
