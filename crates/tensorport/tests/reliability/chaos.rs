//! Hundreds of producers SIGKILLed at random moments while a steady one keeps going.

use super::*;

/// Loops forever with random pauses in every phase, so a kill can land anywhere: connecting,
/// leasing, half-way through writing, right after submitting, waiting for a result.
pub(crate) fn chaos_producer(socket: &str) {
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

pub(crate) fn chaos() {
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
