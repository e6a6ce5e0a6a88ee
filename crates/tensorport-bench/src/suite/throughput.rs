//! Throughput runs, in the parent: consumer threads (tensorport), the subscriber (iceoryx2) or
//! readers (Unix socket) taking what the streaming children send; and memcpy's rate beside them.

use super::*;

/// Seconds a reader waits past --seconds for its children to finish (they send at least
/// [`MIN_MESSAGES`], which a loaded machine may take a while to do).
pub(super) const READ_GRACE_S: f64 = 120.0;

/// Messages/s from counts and the first and last arrival.
pub(super) fn rate(count: u64, first: Option<Instant>, last: Instant) -> f64 {
    let secs = first.map_or(0.0, |f| last.duration_since(f).as_secs_f64());
    if secs > 0.0 {
        count as f64 / secs
    } else {
        0.0
    }
}

pub(super) fn socket_dir() -> CliResult<tempfile::TempDir> {
    Ok(tempfile::Builder::new().prefix("tp-bench-").tempdir()?)
}

/// What one throughput run measured: the rate, and the slowest producer's share against the
/// mean (1.0: all equal).
pub(super) struct Run {
    pub(super) rate: f64,
    pub(super) fairness: f64,
}

/// With `TENSORPORT_BENCH_TRACE=1`, a tensorport consumer thread says how full its batches were
/// and where its time went: in `recv_batch` (taking and admitting, or waiting for work) and in
/// answering. Full batches and little time in `recv_batch` per message: the consumer is the
/// bound; batches of one or two: it waits for the producers.
struct ConsumerTrace {
    on: bool,
    batches: u64,
    messages: u64,
    recv: Duration,
    answer: Duration,
}

impl Default for ConsumerTrace {
    fn default() -> Self {
        ConsumerTrace {
            on: trace_on(),
            batches: 0,
            messages: 0,
            recv: Duration::ZERO,
            answer: Duration::ZERO,
        }
    }
}

impl ConsumerTrace {
    fn add(&mut self, n: usize, recv: Duration, answer: Duration) {
        self.batches += 1;
        self.messages += n as u64;
        self.recv += recv;
        self.answer += answer;
    }

    fn report(&self) {
        if self.on && self.batches > 0 {
            let k = self.messages as f64;
            eprintln!(
                "trace tensorport consumer: {} batches, {:.1} messages each; per message: recv {:.3} us, answer {:.3} us",
                self.batches,
                k / self.batches as f64,
                self.recv.as_secs_f64() * 1e6 / k,
                self.answer.as_secs_f64() * 1e6 / k,
            );
        }
    }
}

/// One producer's messages and its first and last arrival, as the reader saw them.
type Arrivals = (u64, Option<Instant>, Option<Instant>);

fn note(a: &mut Arrivals, now: Instant) {
    a.0 += 1;
    a.1.get_or_insert(now);
    a.2 = Some(now);
}

/// Fairness: each producer's rate while it streamed (its messages over the time from its first
/// to its last), the slowest against the mean. (Counts alone would read equal when every
/// producer sends the minimum number of messages, as large payloads do.) The same measure for
/// every peer.
fn fairness<'a>(producers: impl IntoIterator<Item = &'a Arrivals>) -> f64 {
    let rates: Vec<f64> = producers
        .into_iter()
        .filter_map(|&(c, f, l)| match (f, l) {
            (Some(f), Some(l)) if c > 1 && l > f => Some((c - 1) as f64 / (l - f).as_secs_f64()),
            _ => None,
        })
        .collect();
    let mean = rates.iter().sum::<f64>() / rates.len().max(1) as f64;
    rates
        .iter()
        .copied()
        .reduce(f64::min)
        .map_or(1.0, |m| m / mean.max(1e-9))
}

/// tensorport: `n` producer processes streaming into one in-process server, taken by
/// `consumers` threads (each serving its share of the sessions).
pub(super) fn tp_throughput(cx: &Ctx, size: usize, n: usize, consumers: usize) -> CliResult<Run> {
    let dir = socket_dir()?;
    let sock = dir.path().join("tp.sock");
    let (me, kid) = if n == 1 && consumers == 1 {
        cx.pair()
    } else {
        (None, None)
    };
    if let Some(c) = me {
        pin(c)?;
    }
    let mut cfg = ServerConfig::new(&sock);
    cfg.slot_size = size as u64;
    cfg.spin = FOREVER;
    cfg.consumers = consumers.max(1);
    if cx.pace_window > 0 {
        cfg.pace = Some(tensorport::Pace::new(cx.pace_window));
    }
    let server = Server::bind(cfg)?;
    let target = sock.to_string_lossy();
    let mut kids = cx.streamers(Role::TpStream, &target, size, n, kid)?;
    start_together(&mut kids, "tensorport")?;
    // The readers stop when the children are done; this only bounds a run that hangs.
    let deadline = Instant::now() + Duration::from_secs_f64(cx.seconds + READ_GRACE_S);
    // Each consumer: its count, first and last message, and per session id its messages and
    // first and last message.
    type PerSession = Vec<Arrivals>;
    type ConsumerRun = (u64, Option<Instant>, Instant, PerSession);
    let runs: Vec<CliResult<ConsumerRun>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..consumers.max(1))
            .map(|_| {
                let server = &server;
                s.spawn(move || {
                    let (mut count, mut first, mut last) = (0u64, None, Instant::now());
                    let mut per_session: PerSession = vec![(0, None, None); n + 2];
                    let mut batch = Vec::with_capacity(64);
                    let mut answers: Vec<(tensorport::Request, [u8; 0])> = Vec::with_capacity(64);
                    let mut tr = ConsumerTrace::default();
                    while Instant::now() < deadline {
                        let t0 = tr.on.then(Instant::now);
                        server.recv_batch_into(
                            &mut batch,
                            cx.batch,
                            Duration::from_millis(100),
                            Duration::ZERO,
                        )?;
                        let t1 = t0.map(|t| (t, Instant::now()));
                        if batch.is_empty() {
                            if first.is_some() && server.status().sessions.is_empty() {
                                break;
                            }
                            continue;
                        }
                        let now = Instant::now();
                        first.get_or_insert(now);
                        for r in batch.drain(..) {
                            std::hint::black_box(r.bytes().first());
                            count += 1;
                            if let Some(c) = per_session.get_mut(r.session_id() as usize) {
                                note(c, now);
                            }
                            if cx.respond_each {
                                let _ = r.respond(&[]);
                            } else {
                                answers.push((r, []));
                            }
                        }
                        let n = answers.len();
                        let _ = server.respond_all(&mut answers);
                        last = Instant::now();
                        if let Some((t0, t1)) = t1 {
                            tr.add(n.max(1), t1 - t0, last - t1);
                        }
                    }
                    tr.report();
                    Ok((count, first, last, per_session))
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("consumer thread"))
            .collect()
    });
    drop(server);
    cx.unpin();
    wait_ok(kids, "tensorport")?;
    let (mut count, mut first, mut last) = (0u64, None::<Instant>, None::<Instant>);
    let mut per_session: Vec<Arrivals> = vec![(0, None, None); n + 2];
    for r in runs {
        let (c, f, l, per) = r?;
        count += c;
        if let Some(f) = f {
            first = Some(first.map_or(f, |x| x.min(f)));
            last = Some(last.map_or(l, |x| x.max(l)));
        }
        for (a, b) in per_session.iter_mut().zip(per) {
            a.0 += b.0;
            a.1 = match (a.1, b.1) {
                (Some(x), Some(y)) => Some(x.min(y)),
                (x, y) => x.or(y),
            };
            a.2 = a.2.max(b.2);
        }
    }
    Ok(Run {
        rate: rate(count, first, last.unwrap_or_else(Instant::now)),
        fairness: fairness(&per_session),
    })
}

/// iceoryx2: `n` publisher processes, one subscriber in this process.
pub(super) fn ice_throughput(cx: &Ctx, size: usize, n: usize) -> CliResult<Run> {
    let tag = format!("tp-bench-{}-{size}-{n}", std::process::id());
    let (me, kid) = if n == 1 { cx.pair() } else { (None, None) };
    if let Some(c) = me {
        pin(c)?;
    }
    let node = ice_node()?;
    let svc = ice_data(&node, &format!("{tag}/data"), 64)?;
    let sub = ice(svc.subscriber_builder().create(), "subscriber")?;
    let mut kids = cx.streamers(Role::IceStream, &tag, size, n, kid)?;
    start_together(&mut kids, "iceoryx2")?;
    let (mut count, mut first, mut last) = (0u64, None, Instant::now());
    // The readers stop when the children are done; this only bounds a run that hangs.
    let deadline = Instant::now() + Duration::from_secs_f64(cx.seconds + READ_GRACE_S);
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    // Per publisher (by its id, in order of first arrival): its arrivals, for fairness.
    let mut publishers: Vec<(iceoryx2::identifiers::UniquePublisherId, Arrivals)> =
        Vec::with_capacity(n);
    let mut origins = [0usize; 64];
    let mut last_k = 0usize;
    loop {
        // Up to 64 samples per look at the clock, as the tensorport server takes batches.
        let mut got = 0;
        while got < 64 {
            match ice(sub.receive(), "receive")? {
                Some(s) => {
                    std::hint::black_box(s.payload().first());
                    // The subscriber drains one publisher's samples in a row, so the last
                    // one's place is tried first (the scan would cost iceoryx2's side time
                    // tensorport's indexed count does not).
                    let o = s.origin();
                    let k = match publishers.get(last_k) {
                        Some(p) if p.0 == o => last_k,
                        _ => match publishers.iter().position(|p| p.0 == o) {
                            Some(k) => k,
                            None => {
                                publishers.push((o, (0, None, None)));
                                publishers.len() - 1
                            }
                        },
                    };
                    origins[got] = k;
                    last_k = k;
                    got += 1;
                }
                None => break,
            }
        }
        if got > 0 {
            let now = Instant::now();
            first.get_or_insert(now);
            for &k in &origins[..got] {
                note(&mut publishers[k].1, now);
            }
            count += got as u64;
            last = now;
            idle_since = now;
            spins = 0;
            if now >= deadline {
                break;
            }
            continue;
        }
        // Idle: the clock every 32 looks and a yield every 256, as tensorport's consumer does.
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(32) {
            std::hint::spin_loop();
            continue;
        }
        if spins.is_multiple_of(256) {
            std::thread::yield_now();
        }
        let now = Instant::now();
        if now >= deadline
            || (now.duration_since(idle_since) > Duration::from_millis(100)
                && kids.iter_mut().all(|k| matches!(k.try_wait(), Ok(Some(_)))))
        {
            break;
        }
    }
    cx.unpin();
    wait_ok(kids, "iceoryx2")?;
    Ok(Run {
        rate: rate(count, first, last),
        fairness: fairness(publishers.iter().map(|p| &p.1)),
    })
}

/// A plain Unix-socket copy: `n` processes write payloads, one reader thread per connection.
pub(super) fn uds_throughput(cx: &Ctx, size: usize, n: usize) -> CliResult<f64> {
    let dir = socket_dir()?;
    let sock = dir.path().join("uds.sock");
    let listener = UnixListener::bind(&sock)?;
    let (me, kid) = if n == 1 { cx.pair() } else { (None, None) };
    if let Some(c) = me {
        pin(c)?;
    }
    let target = sock.to_string_lossy();
    let mut kids = cx.streamers(Role::UdsStream, &target, size, n, kid)?;
    let readers: Vec<_> = (0..n)
        .map(|_| {
            let (mut s, _) = listener.accept()?;
            Ok(std::thread::spawn(move || {
                let mut buf = vec![0u8; size];
                let (mut count, mut first, mut last) = (0u64, None, Instant::now());
                while s.read_exact(&mut buf).is_ok() {
                    first.get_or_insert_with(Instant::now);
                    count += 1;
                    last = Instant::now();
                }
                (count, first, last)
            }))
        })
        .collect::<CliResult<_>>()?;
    start_together(&mut kids, "Unix socket")?;
    let mut total = 0;
    let (mut t0, mut t1): (Option<Instant>, Option<Instant>) = (None, None);
    for r in readers {
        let (c, f, l) = r.join().map_err(|_| CliError::new("reader thread"))?;
        total += c;
        if let Some(f) = f {
            t0 = Some(t0.map_or(f, |t: Instant| t.min(f)));
            t1 = Some(t1.map_or(l, |t: Instant| t.max(l)));
        }
    }
    cx.unpin();
    wait_ok(kids, "Unix socket")?;
    Ok(rate(total, t0, t1.unwrap_or_else(Instant::now)))
}

pub(super) fn memcpy_gbps(size: usize, seconds: f64) -> f64 {
    let src = vec![7u8; size];
    let mut dst = vec![0u8; size];
    let (t, mut n) = (Instant::now(), 0u64);
    while t.elapsed().as_secs_f64() < seconds {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        n += 1;
    }
    n as f64 * size as f64 / t.elapsed().as_secs_f64() / 1e9
}
