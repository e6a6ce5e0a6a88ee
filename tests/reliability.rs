//! Reliability and hostile-peer tests with real processes: a chaos run of hundreds of SIGKILLs,
//! hand-written protocol abuse, another uid, connection floods, in-flight limits, and a producer
//! that stops reading its results.

mod support;

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::*;
use tensorport::wire::{
    encode_frame, ClientMsg, ErrorCode, RawLocation, RawTensorDesc, ServerMsg, SlotRef,
};
use tensorport::{DType, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};

fn main() {
    support::main(
        &[
            ("chaos_200_sigkills_at_random_moments", chaos),
            ("hostile_slot_abuse_and_fd_floods", hostile_slots),
            ("truncated_and_lying_frames", lying_frames),
            ("device_registrations_on_a_cpu_server", device_on_cpu),
            ("many_descriptors_per_message_all_closed", many_fds),
            ("drain_is_the_operators_not_a_producers", drain_authority),
            ("memory_budget_holds_against_a_hello_flood", memory_budget),
            (
                "a_refused_socket_submit_names_its_request",
                refused_submit_named,
            ),
            ("idle_sessions_make_room_for_newcomers", idle_eviction),
            ("another_uid_is_refused", other_uid),
            ("a_server_of_another_uid_is_not_trusted", untrusted_server),
            ("connection_flood_is_bounded", flood),
            ("in_flight_limit_holds", in_flight_limit),
            ("stalled_reader_is_dropped_memory_flat", stalled_reader),
            ("a_peer_that_stops_reading_stalls_nobody_else", head_of_line),
            ("hostile_ring_entries_and_positions", hostile_ring),
            (
                "random_message_sequences_answer_each_request_once",
                sequences,
            ),
            ("protocol_1_clients_still_served", protocol_1_client),
        ],
        child,
    );
}

fn child(role: &str, socket: &str) {
    match role {
        "chaos-producer" => chaos_producer(socket),
        "other-uid" => other_uid_client(socket),
        "other-uid-server" => other_uid_server(socket),
        r => panic!("unknown role {r}"),
    }
}

/// Loops forever with random pauses in every phase, so a kill can land anywhere: connecting,
/// leasing, half-way through writing, right after submitting, waiting for a result.
fn chaos_producer(socket: &str) {
    let mut rng = (std::process::id() as u64).wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut rand = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut cfg = ProducerConfig::new("chaos");
    cfg.slots = 1 + rand(4) as u32;
    cfg.slot_size = 64 * 1024;
    let mut p = Producer::connect(socket, cfg).expect("connect");
    println!("connected");
    std::io::stdout().flush().unwrap();
    for i in 0.. {
        let len = 16 + rand(60_000) as usize;
        let mut lease = p.lease(Duration::from_secs(10)).expect("lease");
        let mut tmp = vec![0u8; len];
        fill(((std::process::id() as u64) << 32) | i, &mut tmp);
        let bytes = lease.bytes_mut();
        bytes[..len / 2].copy_from_slice(&tmp[..len / 2]);
        if rand(2) == 0 {
            std::thread::sleep(Duration::from_micros(rand(3000)));
        }
        bytes[..len].copy_from_slice(&tmp);
        lease
            .submit(&TensorSpec::new(DType::U8, &[len as u64]))
            .expect("submit");
        if rand(3) == 0 {
            let _ = p.recv_result(Duration::from_secs(10));
        }
        while p.try_recv_result().expect("poll").is_some() {}
    }
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A server whose consumer verifies every tensor and answers with its checksum.
fn checking_server(
    cfg: ServerConfig,
) -> (Arc<Server>, Arc<AtomicU64>, Arc<AtomicU64>, Arc<AtomicBool>) {
    let server = Arc::new(Server::bind(cfg).unwrap());
    let (ok, torn, stop) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let (s, o, t, st) = (server.clone(), ok.clone(), torn.clone(), stop.clone());
    std::thread::spawn(move || {
        while !st.load(Ordering::SeqCst) {
            match s.recv_timeout(Duration::from_millis(50)) {
                Ok(Some(r)) => {
                    if verify(r.bytes()) {
                        o.fetch_add(1, Ordering::SeqCst);
                    } else {
                        t.fetch_add(1, Ordering::SeqCst);
                    }
                    let sum = checksum(r.bytes());
                    let _ = r.respond(&sum.to_le_bytes());
                }
                Ok(None) => {}
                Err(_) => break,
            }
        }
    });
    (server, ok, torn, stop)
}

fn chaos() {
    let (_dir, sock) = socket_dir();
    let maps0 = pool_mappings();
    let (server, ok, torn, stop) = checking_server(ServerConfig::new(&sock));
    // A steady producer in this process checks that service never stops.
    let steady_done = Arc::new(AtomicU64::new(0));
    let steady_stop = Arc::new(AtomicBool::new(false));
    let steady = {
        let (sock, done, st) = (sock.clone(), steady_done.clone(), steady_stop.clone());
        std::thread::spawn(move || {
            let mut p = Producer::connect(&sock, ProducerConfig::new("steady")).unwrap();
            let mut i = 0u64;
            while !st.load(Ordering::SeqCst) {
                let mut l = p.lease(Duration::from_secs(5)).expect("steady lease");
                fill(i, &mut l.bytes_mut()[..4096]);
                let want = checksum(&l.bytes_mut()[..4096]);
                l.submit(&TensorSpec::new(DType::U8, &[4096])).unwrap();
                let c = p
                    .recv_result(Duration::from_secs(5))
                    .expect("steady result");
                assert_eq!(c.result.unwrap(), want.to_le_bytes());
                done.fetch_add(1, Ordering::SeqCst);
                i += 1;
            }
        })
    };
    // Warm up, then measure the baseline.
    std::thread::sleep(Duration::from_millis(200));
    let fds0 = open_fds();
    let rss0 = rss_kib();
    let t0 = Instant::now();
    let mut kills = 0;
    let mut before_connect = 0;
    let mut seed = 12345u64;
    let mut rand = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    // Each child: (guard, when it connected (set by a reader thread), kill delay after connecting,
    // or an absolute kill time for the ones killed while still connecting).
    type Connected = Arc<Mutex<Option<Instant>>>;
    let mut live: Vec<(ChildGuard, Connected, Duration, Option<Instant>)> = Vec::new();
    while kills < 200 {
        assert!(
            t0.elapsed() < Duration::from_secs(600),
            "the chaos run made no progress in 10 minutes ({kills} kills so far)"
        );
        while live.len() < 4 {
            let mut c = spawn_child("chaos-producer", &[socket_env(&sock)]);
            let connected: Connected = Arc::new(Mutex::new(None));
            let (out, flag) = (
                c.0.as_mut().unwrap().stdout.take().unwrap(),
                connected.clone(),
            );
            std::thread::spawn(move || {
                let mut line = String::new();
                if std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).is_ok()
                    && line.starts_with("connected")
                {
                    *flag.lock().unwrap() = Some(Instant::now());
                }
            });
            // One in ten dies while connecting; the rest 0-40 ms into their work.
            let early = (rand(10) == 0).then(|| Instant::now() + Duration::from_millis(rand(30)));
            live.push((c, connected, Duration::from_micros(rand(40_000)), early));
        }
        let now = Instant::now();
        for (c, ..) in live.iter_mut() {
            // A child must only ever end by our SIGKILL.
            if let Ok(Some(st)) = c.0.as_mut().unwrap().try_wait() {
                let mut err = String::new();
                let _ = std::io::Read::read_to_string(
                    c.0.as_mut().unwrap().stderr.as_mut().unwrap(),
                    &mut err,
                );
                panic!("a chaos producer died by itself ({st}): {err}");
            }
        }
        for (c, connected, after, early) in live.iter_mut() {
            let due = match (*early, *connected.lock().unwrap()) {
                (Some(t), None) => now >= t,
                (_, Some(t)) => now >= t + *after,
                (None, None) => false,
            };
            if due {
                if connected.lock().unwrap().is_none() {
                    before_connect += 1;
                }
                c.kill9();
                kills += 1;
            }
        }
        live.retain(|(c, ..)| c.0.is_some());
        std::thread::sleep(Duration::from_micros(500));
    }
    drop(live);
    let steady_before = steady_done.load(Ordering::SeqCst);
    assert!(eventually(PATIENCE, || steady_done.load(Ordering::SeqCst)
        > steady_before + 20));
    steady_stop.store(true, Ordering::SeqCst);
    steady.join().unwrap();
    let st = server.status();
    println!(
        "  {kills} kills ({before_connect} while connecting) in {:.1}s; {} tensors verified; {} sessions reclaimed; steady producer {} round trips",
        t0.elapsed().as_secs_f64(),
        ok.load(Ordering::SeqCst),
        st.totals.sessions_reclaimed,
        steady_done.load(Ordering::SeqCst)
    );
    assert_eq!(
        torn.load(Ordering::SeqCst),
        0,
        "a torn tensor was delivered"
    );
    assert!(st.totals.sessions_reclaimed >= 150, "{:?}", st.totals);
    assert!(
        eventually(PATIENCE, || server.status().sessions.is_empty()
            && open_fds() <= fds0
            && pool_mappings() == maps0),
        "leak: fds {} (baseline {fds0}), pool mappings {} (baseline {maps0}), sessions {}",
        open_fds(),
        pool_mappings(),
        server.status().sessions.len()
    );
    let rss1 = rss_kib();
    println!(
        "  server fds {fds0} -> {}, RSS {rss0} -> {rss1} KiB",
        open_fds()
    );
    assert!(
        rss1 < rss0 + 32 * 1024,
        "RSS grew from {rss0} to {rss1} KiB"
    );
    stop.store(true, Ordering::SeqCst);
}

fn submit(slot: SlotRef, id: u64) -> ClientMsg {
    ClientMsg::Submit {
        request_id: id,
        tensor: RawTensorDesc {
            dtype: DType::U8 as u8,
            shape: vec![64],
            strides: None,
            offset: 0,
            len: 64,
            location: RawLocation::HostSlot(slot),
            fence: None,
        },
    }
}

fn hostile_slots() {
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

fn other_uid_client(socket: &str) {
    // Drop to nobody, then connect.
    nix::unistd::setgid(nix::unistd::Gid::from_raw(65534)).unwrap();
    nix::unistd::setuid(nix::unistd::Uid::from_raw(65534)).unwrap();
    match Producer::connect(socket, ProducerConfig::new("intruder")) {
        Ok(_) => println!("connected"),
        Err(tensorport::Error::Refused { code, .. }) => println!("refused {code:?}"),
        Err(e) => println!("error {e}"),
    }
}

fn other_uid() {
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

fn flood() {
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

fn in_flight_limit() {
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

fn stalled_reader() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.write_timeout = Duration::from_millis(300);
    let server = Arc::new(Server::bind(cfg).unwrap());
    // The consumer answers every request with 256 KiB: a client that does not read fills its
    // socket buffer quickly.
    let (s, stop) = (server.clone(), Arc::new(AtomicBool::new(false)));
    let st = stop.clone();
    let answer = vec![7u8; 256 * 1024];
    std::thread::spawn(move || {
        while !st.load(Ordering::SeqCst) {
            if let Ok(Some(r)) = s.recv_timeout(Duration::from_millis(20)) {
                let _ = r.respond(&answer);
            }
        }
    });
    let mut r = Raw::connect(&sock);
    let (_, g) = r.hello(2);
    let rss0 = rss_kib();
    // Submit, never read a result: grants come back on the same socket, so keep submitting on
    // the two slots' known generations for as long as the server accepts.
    let t = Instant::now();
    let mut gens = [g[0].generation, g[1].generation];
    let mut id = 0u64;
    while t.elapsed() < Duration::from_secs(3) {
        for (k, gen) in gens.iter_mut().enumerate() {
            id += 1;
            let msg = submit(
                SlotRef {
                    slot: g[k].slot,
                    generation: *gen,
                },
                id,
            );
            if r.s.write_all(&encode_frame(&msg).unwrap()).is_err() {
                break;
            }
            *gen += 1;
        }
        std::thread::sleep(Duration::from_millis(5));
        if server.status().totals.sessions_reclaimed > 0 {
            break;
        }
    }
    assert!(
        eventually(PATIENCE, || server.status().totals.sessions_reclaimed == 1),
        "the stalled producer was not dropped"
    );
    assert!(logs().contains("dropping session"));
    let rss1 = rss_kib();
    assert!(
        rss1 < rss0 + 16 * 1024,
        "server memory grew from {rss0} to {rss1} KiB"
    );
    // Others are still served.
    assert_still_served(&sock, 3);
    stop.store(true, Ordering::SeqCst);
}

/// Two hostile producers that never read their sockets make the consumer write to them: one
/// resubmits blindly (each answered with 256 KiB on the socket), one floods its submission
/// queue with bad entries (each refused on the socket). With a write that blocks, the consumer
/// would wait up to the write timeout (60 s here) on each, and every other producer with it.
/// Another producer's results must keep flowing: its worst gap stays far below that timeout.
fn head_of_line() {
    use tensorport_shm::ring::{SqEntry, SqWriter};
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    let write_timeout = Duration::from_secs(60);
    cfg.write_timeout = write_timeout;
    let server = Arc::new(Server::bind(cfg).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let (s, st) = (server.clone(), stop.clone());
    let big = vec![7u8; 256 * 1024];
    std::thread::spawn(move || {
        while !st.load(Ordering::SeqCst) {
            if let Ok(Some(r)) = s.recv_timeout(Duration::from_millis(20)) {
                let answer = match r.producer() {
                    "blind" => big.clone(),
                    _ => checksum(r.bytes()).to_le_bytes().to_vec(),
                };
                let _ = r.respond(&answer);
            }
        }
    });
    // Hostile 1: protocol 1, resubmits on guessed generations, reads nothing.
    let mut blind = Raw::connect(&sock);
    blind.send(&ClientMsg::Hello(tensorport::wire::Hello {
        magic: tensorport::wire::MAGIC,
        min_version: 1,
        max_version: 1,
        role: tensorport::wire::Role::Producer,
        name: "blind".into(),
        want_slots: 2,
        want_slot_size: 4096,
    }));
    let _ = blind.recv();
    let g = match blind.recv() {
        Some(ServerMsg::Grant(g)) => g,
        other => panic!("expected Grant, got {other:?}"),
    };
    let hostile_stop = Arc::new(AtomicBool::new(false));
    let hs = hostile_stop.clone();
    let blind_thread = std::thread::spawn(move || {
        let mut gens = [g[0].generation, g[1].generation];
        let mut id = 0u64;
        'out: while !hs.load(Ordering::SeqCst) {
            for (k, gen) in gens.iter_mut().enumerate() {
                id += 1;
                let slot = SlotRef {
                    slot: g[k].slot,
                    generation: *gen,
                };
                if blind
                    .s
                    .write_all(&encode_frame(&submit(slot, id)).unwrap())
                    .is_err()
                {
                    break 'out;
                }
                *gen += 1;
            }
            if id.is_multiple_of(64) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    });
    // Hostile 2: protocol 2, bad entries on its queue as fast as the server takes them.
    let mut flood = Raw::connect(&sock);
    flood.hello_with(2, 2, 2);
    let (_, mut fds) = welcome_with_fds(&flood);
    let to_server = fds.remove(2);
    let ring = tensorport_shm::RingMem::open(fds.remove(1)).unwrap();
    let hs = hostile_stop.clone();
    let flood_thread = std::thread::spawn(move || {
        let _socket = flood;
        let mut sq = SqWriter::default();
        let mut e = SqEntry {
            slot: 999,
            dtype: DType::U8 as u8,
            rank: 1,
            len: 64,
            ..SqEntry::default()
        };
        e.shape[0] = 64;
        while !hs.load(Ordering::SeqCst) {
            e.request_id += 1;
            match sq.push(&ring, &e) {
                Ok(true) => {}
                Ok(false) => {
                    let _ = nix::unistd::write(&to_server, &1u64.to_ne_bytes());
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(_) => break,
            }
        }
    });
    // Meanwhile an honest producer: results must keep coming.
    let mut p = Producer::connect(&sock, ProducerConfig::new("honest")).unwrap();
    let (mut worst, mut n, mut after) = (Duration::ZERO, 0u64, 0u64);
    let mut last = Instant::now();
    let t = Instant::now();
    while after < 300 {
        let mut l = p.lease(PATIENCE).unwrap();
        fill(n, &mut l.bytes_mut()[..64]);
        l.submit(&TensorSpec::new(DType::U8, &[64])).unwrap();
        let c = p.recv_result(PATIENCE).unwrap();
        assert!(c.result.is_ok(), "{:?}", c.result);
        worst = worst.max(last.elapsed());
        last = Instant::now();
        n += 1;
        if server.status().totals.sessions_reclaimed >= 2 {
            after += 1;
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the hostile sessions were never dropped: {:?}",
            server.status()
        );
    }
    println!(
        "worst gap between the honest producer's results: {:.1} ms over {n} results",
        worst.as_secs_f64() * 1e3
    );
    assert!(
        worst < write_timeout / 3,
        "the honest producer waited {worst:?} for a result while others did not read"
    );
    let log = logs();
    assert!(log.contains("dropping session"), "{log}");
    assert!(log.contains("does not read its socket"), "{log}");
    hostile_stop.store(true, Ordering::SeqCst);
    blind_thread.join().unwrap();
    flood_thread.join().unwrap();
    stop.store(true, Ordering::SeqCst);
}

fn lying_frames() {
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
fn device_on_cpu() {
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

fn other_uid_server(socket: &str) {
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
fn untrusted_server() {
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
        matches!(e, tensorport::Error::UntrustedServer { uid: 65534, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("runs as uid 65534"), "{e}");
}

/// A new producer connects and gets one tensor through: the server is still serving.
fn assert_still_served(sock: &std::path::Path, seed: u64) {
    let mut p = Producer::connect(sock, ProducerConfig::new("after")).unwrap();
    let mut l = p.lease(Duration::from_secs(2)).unwrap();
    fill(seed, &mut l.bytes_mut()[..64]);
    l.submit(&TensorSpec::new(DType::U8, &[64])).unwrap();
    let c = p.recv_result(Duration::from_secs(2)).unwrap();
    assert!(c.result.is_ok(), "{:?}", c.result);
}

/// Receives the `Welcome` frame alone (its length peeked first) with the descriptors on it.
fn welcome_with_fds(r: &Raw) -> (tensorport::wire::Welcome, Vec<std::os::fd::OwnedFd>) {
    use nix::sys::socket::{recv, recvmsg, ControlMessageOwned, MsgFlags};
    use std::os::fd::FromRawFd;
    let mut h = [0u8; 4];
    assert_eq!(
        recv(r.s.as_raw_fd(), &mut h, MsgFlags::MSG_PEEK).unwrap(),
        4
    );
    let mut buf = vec![0u8; 4 + u32::from_le_bytes(h) as usize];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 8]);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(
        r.s.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .unwrap();
    let mut fds = Vec::new();
    for c in msg.cmsgs().unwrap() {
        if let ControlMessageOwned::ScmRights(v) = c {
            // SAFETY: the kernel just installed these descriptors for this process alone.
            fds.extend(
                v.into_iter()
                    .map(|fd| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    assert_eq!(msg.bytes, buf.len());
    match tensorport::wire::decode_server(&buf[4..]).unwrap() {
        ServerMsg::Welcome(w) => (w, fds),
        other => panic!("expected Welcome, got {other:?}"),
    }
}

/// A protocol-2 client written by hand from docs/protocol.md: it finds the queues in the
/// `Welcome`, gets a result through them, has bad entries refused one by one on the socket,
/// and is disconnected (with a fatal error, others still served) when it moves its tail
/// backwards.
fn hostile_ring() {
    use tensorport_shm::ring::{
        CqHeader, CqReader, SqEntry, SqWriter, CQ_GRANT, CQ_INLINE_BYTES, CQ_RESULT,
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
    let entry = |id: u64, slot: SlotRef| {
        let mut e = SqEntry {
            request_id: id,
            slot: slot.slot,
            generation: slot.generation,
            dtype: DType::U8 as u8,
            rank: 1,
            len: 64,
            ..SqEntry::default()
        };
        e.shape[0] = 64;
        e
    };
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
fn sequences() {
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
fn protocol_1_client() {
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
fn many_fds() {
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

/// A producer session's `Drain` is refused (not fatal) and changes nothing; a control session's
/// drains the server.
fn drain_authority() {
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

/// A `Hello` with the given slots and slot size.
fn hello_asking(slots: u32, slot_size: u64) -> ClientMsg {
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
fn memory_budget() {
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
                assert!(message.contains("--memory-budget"), "{message}");
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

/// A socket `Submit` refused before validation (a rank over 8 fails the decoder's size checks)
/// carries its request id, as every other refusal of a Submit does.
fn refused_submit_named() {
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

/// Every producer place held, one by a session that does nothing: a newcomer still gets in, and
/// the idle one is told why it was closed. The busy session is not the one closed.
fn idle_eviction() {
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
