//! How slots are lent: loans written on threads, several consumers, the warm lease, fair pacing.

use super::*;

/// Three consumer threads, six producer processes: the sessions are dealt out two per
/// consumer, every tensor is checked and answered exactly once, and every producer finishes
/// (none is starved by the sharding).
pub(crate) fn several_consumers() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.consumers = 3;
    let srv = CheckingServer::start(cfg);
    let mut kids = spawn_checked_producers(&sock, 6, 500);
    wait_all_ok(&mut kids, PATIENCE * 2);
    assert_eq!(srv.verified.load(Ordering::SeqCst), 3000);
    assert_eq!(srv.torn.load(Ordering::SeqCst), 0);
    let t = srv.server.status().totals;
    assert_eq!((t.submitted, t.completed), (3000, 3000));
    let per = srv.per_producer.lock().unwrap().clone();
    assert_eq!(per.len(), 6, "{per:?}");
    assert!(per.values().all(|&n| n == 500), "{per:?}");
}

/// Loans do not borrow the producer: four are out at once, written on four threads, then
/// submitted; a loan dropped unsubmitted gives its slot back; another producer's loan is refused.
pub(crate) fn loans() {
    let (_dir, sock) = socket_dir();
    let cs = CheckingServer::start(ServerConfig::new(&sock));
    let mut cfg = ProducerConfig::new("loans");
    cfg.slots = 4;
    let mut p = Producer::connect(&sock, cfg.clone()).unwrap();
    for round in 0..50u64 {
        let mut out: Vec<tensorport::Loan> = (0..4).map(|_| p.loan(PATIENCE).unwrap()).collect();
        let slots: std::collections::HashSet<u32> = out.iter().map(|l| l.slot().slot).collect();
        assert_eq!(slots.len(), 4, "four distinct slots out at once");
        std::thread::scope(|s| {
            for (k, l) in out.iter_mut().enumerate() {
                s.spawn(move || fill(round * 4 + k as u64, &mut l.bytes_mut()[..4096]));
            }
        });
        let mut sums = HashMap::new();
        for mut l in out {
            let sum = checksum(&l.bytes_mut()[..4096]);
            let id = p
                .submit_loan(l, &TensorSpec::new(DType::U8, &[4096]))
                .unwrap();
            sums.insert(id, encode_answer(sum, 4096, DType::U8));
        }
        for _ in 0..4 {
            let c = p.recv_result(PATIENCE).unwrap();
            let want = sums
                .remove(&c.request_id)
                .expect("a result for a submitted loan");
            assert_eq!(
                c.result.as_deref().ok(),
                Some(&want[..]),
                "request {}",
                c.request_id
            );
        }
    }
    assert_eq!(cs.verified.load(Ordering::SeqCst), 200);
    assert_eq!(cs.torn.load(Ordering::SeqCst), 0);
    // All four out: no fifth (the slots and the in-flight limit are spent), until one comes back.
    let held: Vec<tensorport::Loan> = (0..4).map(|_| p.loan(PATIENCE).unwrap()).collect();
    assert!(matches!(
        p.loan(Duration::from_millis(50)),
        Err(tensorport::LeaseError::Timeout(..))
    ));
    let back: Vec<u32> = held.iter().map(|l| l.slot().slot).collect();
    drop(held);
    let again = p.loan(PATIENCE).unwrap();
    assert!(back.contains(&again.slot().slot));
    // Another producer's loan.
    let mut q = Producer::connect(&sock, cfg).unwrap();
    let theirs = q.loan(PATIENCE).unwrap();
    let e = p
        .submit_loan(theirs, &TensorSpec::new(DType::U8, &[16]))
        .unwrap_err();
    assert!(matches!(e, tensorport::SubmitError::ForeignLoan), "{e}");
}

/// The warm lease (slots of 4 MiB and more): the slot submitted last is taken again when the
/// server gives it back in time; every tensor stays intact and is answered once; and a server
/// that holds that slot does not hold up the next lease, which takes another slot.
pub(crate) fn warm_lease() {
    let (_dir, sock) = socket_dir();
    let cs = CheckingServer::start(ServerConfig::new(&sock));
    let mut cfg = ProducerConfig::new("warm");
    cfg.slots = 4;
    cfg.slot_size = tensorport::WARM_MIN_SLOT;
    // Long, so the bound that counts is a sixteenth of the time between leases (about 10 ms
    // here: the "fill" below), which a server answering at once meets, even woken from sleep
    // on a busy machine.
    cfg.warm_wait = Duration::from_secs(1);
    let mut p = Producer::connect(&sock, cfg).unwrap();
    let spec = TensorSpec::new(DType::U8, &[4096]);
    let (mut last, mut reused, mut sums) = (None, 0u32, HashMap::new());
    for i in 0..100u64 {
        let mut l = p.lease(PATIENCE).unwrap();
        let slot = l.slot().slot;
        reused += u32::from(last == Some(slot));
        fill(i, &mut l.bytes_mut()[..4096]);
        std::thread::sleep(Duration::from_millis(10));
        let sum = checksum(&l.bytes_mut()[..4096]);
        let id = l.submit(&spec).unwrap();
        sums.insert(id, encode_answer(sum, 4096, DType::U8));
        last = Some(slot);
        while let Some(c) = p.try_recv_result().unwrap() {
            assert_eq!(
                c.result.ok(),
                sums.remove(&c.request_id),
                "answered once, right"
            );
        }
    }
    while p.in_flight() > 0 {
        let c = p.recv_result(PATIENCE).unwrap();
        assert_eq!(
            c.result.ok(),
            sums.remove(&c.request_id),
            "answered once, right"
        );
    }
    assert!(sums.is_empty());
    assert_eq!(cs.verified.load(Ordering::SeqCst), 100);
    assert_eq!(cs.torn.load(Ordering::SeqCst), 0);
    // How often depends on how soon the server thread runs (the machine's load): reported, not
    // asserted. The warm choice itself is asserted below, where no timing decides it.
    println!("  the slot submitted last was leased again {reused} times of 99");
    // The server now holds this producer's next tensor: the lease after it must take another
    // slot (after at most the warm wait), and so must the next ones.
    *cs.hold_from.lock().unwrap() = Some(("warm".into(), 1));
    let mut l = p.lease(PATIENCE).unwrap();
    let held = l.slot().slot;
    fill(1000, &mut l.bytes_mut()[..4096]);
    std::thread::sleep(Duration::from_millis(2));
    l.submit(&spec).unwrap();
    for i in 0..3 {
        let mut l = p.lease(PATIENCE).unwrap();
        assert_ne!(l.slot().slot, held, "lease {i} after the held one");
        fill(1001 + i, &mut l.bytes_mut()[..4096]);
        l.submit(&spec).unwrap();
        p.recv_result(PATIENCE).unwrap();
    }
    assert_eq!(cs.held.lock().unwrap().len(), 1);

    // On a fresh producer: slot W, submitted last, comes back before slot H (held by the server,
    // then answered), so a plain last-in-first-out lease would take H. The warm lease takes W.
    let mut cfg = ProducerConfig::new("warm-order");
    cfg.slots = 4;
    cfg.slot_size = tensorport::WARM_MIN_SLOT;
    cfg.warm_wait = Duration::from_secs(1);
    let mut q = Producer::connect(&sock, cfg).unwrap();
    *cs.hold_from.lock().unwrap() = Some(("warm-order".into(), 1));
    let (mut h, mut w) = (q.loan(PATIENCE).unwrap(), q.loan(PATIENCE).unwrap());
    let (hs, ws) = (h.slot().slot, w.slot().slot);
    fill(2000, &mut h.bytes_mut()[..4096]);
    fill(2001, &mut w.bytes_mut()[..4096]);
    let hid = q.submit_loan(h, &spec).unwrap();
    let wid = q.submit_loan(w, &spec).unwrap();
    assert_eq!(q.recv_result(PATIENCE).unwrap().request_id, wid);
    let held = {
        let mut held = cs.held.lock().unwrap();
        let k = held
            .iter()
            .position(|r| r.producer() == "warm-order")
            .expect("the server holds H");
        held.remove(k)
    };
    let answer = encode_answer(
        checksum(held.bytes()),
        held.desc().numel(),
        held.desc().dtype(),
    );
    held.respond(&answer).unwrap();
    assert_eq!(q.recv_result(PATIENCE).unwrap().request_id, hid);
    // Both slots granted back (each grant follows its result).
    let deadline = Instant::now() + PATIENCE;
    while q.free_slots() < 4 {
        assert!(Instant::now() < deadline, "the slots were not granted back");
        q.poll().unwrap();
    }
    let l = q.lease(PATIENCE).unwrap();
    assert_eq!(
        l.slot().slot,
        ws,
        "the warm slot, not {hs} (given back last)"
    );
}

/// Fair pacing (`ServerConfig::pace`): a fast producer gets at most `window` slots granted back
/// ahead of the slowest active one; each request the slow one gets answered lets it one further;
/// once the slow one leaves, every held slot comes back. No step depends on timing: each result
/// carries its slot's grant (or not), so the counts below are exact.
pub(crate) fn paced_producers() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.slots_per_session = 4;
    // Idle only after ten minutes: the slow producer stays active throughout.
    cfg.pace = Some(tensorport::Pace {
        window: 4,
        idle: Duration::from_secs(600),
    });
    let cs = CheckingServer::start(cfg);
    let spec = TensorSpec::new(DType::U8, &[4096]);
    let producer = |name: &str| {
        let mut c = ProducerConfig::new(name);
        c.slots = 4;
        c.slot_size = 4096;
        Producer::connect(&sock, c).unwrap()
    };
    let one = |p: &mut Producer, i: u64| {
        let mut l = p.lease(PATIENCE).unwrap();
        fill(i, &mut l.bytes_mut()[..4096]);
        l.submit(&spec).unwrap();
        let c = p.recv_result(PATIENCE).unwrap();
        assert!(c.result.is_ok(), "{:?}", c.result);
    };
    let mut slow = producer("slow");
    let mut fast = producer("fast");
    slots_back(&mut fast, 4, "the first grants");
    one(&mut slow, 0);
    // The fast one, one request at a time, while it has a slot: its 4 own, then one per grant
    // the pacer lets through (4, or 5 if the floor moved up to the slow one's first grant
    // meanwhile).
    let mut sent = 0;
    while fast.free_slots() > 0 {
        one(&mut fast, 100 + sent);
        sent += 1;
        assert!(sent <= 9, "the fast producer ran past its window");
    }
    assert!(
        sent >= 8,
        "{sent} requests: held back before its window was spent"
    );
    // Each answer to the slow one lets the fast one one request further.
    for k in 1..=3u64 {
        one(&mut slow, k);
        slots_back(&mut fast, 1, "no slot back after an answer to the slow one");
        assert_eq!(fast.free_slots(), 1, "one slot per answer to the slow one");
        one(&mut fast, 200 + k);
        sent += 1;
        assert_eq!(fast.free_slots(), 0);
    }
    // The slow one leaves: nobody holds the fast one back.
    slow.close().unwrap();
    slots_back(
        &mut fast,
        4,
        "held slots not given back after the slow one left",
    );
    for i in 0..20 {
        one(&mut fast, 300 + i);
    }
    assert_eq!(cs.torn.load(Ordering::SeqCst), 0);
    println!(
        "  the fast producer: {} requests within the window, one per answer to the slow one, 20 more once it left",
        sent - 3
    );
}

/// Waits until `p` holds at least `n` free slots (polling, as a producer that only polls would);
/// fails with `what` after [`PATIENCE`].
fn slots_back(p: &mut Producer, n: usize, what: &str) {
    let deadline = Instant::now() + PATIENCE;
    while p.free_slots() < n {
        assert!(Instant::now() < deadline, "{what}: {} free", p.free_slots());
        p.poll().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Fair pacing counts host slots only: a producer of device tensors alone, however busy, never
/// holds a host producer back (its count would never rise, and pin the floor).
pub(crate) fn paced_server_ignores_device_producers() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.slots_per_session = 4;
    cfg.device = Some(Arc::new(FakeImporter));
    cfg.pace = Some(tensorport::Pace {
        window: 2,
        idle: Duration::from_secs(600),
    });
    let server = Arc::new(Server::bind(cfg).unwrap());
    let (s, stop) = (server.clone(), Arc::new(AtomicBool::new(false)));
    let st = stop.clone();
    let consumer = std::thread::spawn(move || {
        while !st.load(Ordering::SeqCst) {
            if let Ok(Some(r)) = s.recv_timeout(Duration::from_millis(20)) {
                let _ = r.respond(&[]);
            }
        }
    });
    let mut gpu = Producer::connect(&sock, ProducerConfig::new("device-only")).unwrap();
    register_fake_buffer(&mut gpu, 0);
    let device_spec = TensorSpec::new(DType::U8, &[4096]);
    let mut host = {
        let mut c = ProducerConfig::new("host");
        c.slots = 4;
        c.slot_size = 4096;
        Producer::connect(&sock, c).unwrap()
    };
    let spec = TensorSpec::new(DType::U8, &[4096]);
    for k in 1..=3u64 {
        // The device producer submits (and would count as active, were device tensors paced).
        gpu.wait_device(0, PATIENCE).unwrap();
        gpu.submit_device(0, &device_spec, Some(k)).unwrap();
        gpu.recv_result(PATIENCE).unwrap();
        // The host producer, well past the window: every slot comes back each time.
        for i in 0..10u64 {
            let mut l = host.lease(PATIENCE).unwrap();
            fill(k * 100 + i, &mut l.bytes_mut()[..4096]);
            l.submit(&spec).unwrap();
            host.recv_result(PATIENCE).unwrap();
            slots_back(
                &mut host,
                4,
                "a host slot held behind a device-only producer",
            );
        }
    }
    stop.store(true, Ordering::SeqCst);
    consumer.join().unwrap();
    println!("  30 host requests past a window of 2, beside a busy device-only producer: never held for good");
}
