//! Producers that stop reading: dropped, and nobody else held up.

use super::*;

pub(crate) fn stalled_reader() {
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
pub(crate) fn head_of_line() {
    use tensorport_shm::ring::SqWriter;
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    let write_timeout = Duration::from_secs(60);
    cfg.write_timeout = write_timeout;
    // The peers under test are ended for not reading, not for their refusals' count.
    cfg.max_refusals = u64::MAX;
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
        let mut e = u8_entry(
            0,
            SlotRef {
                slot: 999,
                generation: 0,
            },
        );
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
