//! The benchmark's child processes (`--role`): streaming producers of every peer, and the
//! latency children that answer pings; and the trace they print with `TENSORPORT_BENCH_TRACE=1`.

use super::*;

/// Messages every streaming child sends at least, however short --seconds: on a loaded machine a
/// child may get so little time in its window that the reader sees all it sent in one look
/// (up to 64), which measures nothing (the rate needs a first and a last arrival apart). The
/// window itself starts at the parent's go, after every child is set up; so the minimum only
/// matters on a loaded machine, and the window, not a count, ends every producer's run: the
/// rate is what all of them delivered together in the same span, whatever their spread
/// (reported apart, as fairness). A larger minimum would outlast the window at 19.3 MB:
/// every producer would send exactly the minimum, and the slowest one's finish set the span.
pub(super) const MIN_MESSAGES: usize = 128;

/// Whether a streaming child of `size`-byte messages goes on: it sends at least
/// [`MIN_MESSAGES`], then stops at `deadline`, read every 64 messages below 64 KiB (a clock
/// read is not free beside a 4 KiB fill) and every message from 64 KiB (so no producer runs
/// 64 large messages past the window); every peer alike.
pub(super) fn more(i: usize, size: usize, deadline: Instant) -> bool {
    let every = if size >= 64 * 1024 { 1 } else { 64 };
    i < MIN_MESSAGES || !i.is_multiple_of(every) || Instant::now() < deadline
}

/// Every peer writes every byte of every payload with this same loop (iceoryx2 through
/// `write_from_fn`, which runs it over its uninitialised sample).
#[inline(always)]
pub(super) fn byte_of(i: usize) -> impl FnMut(usize) -> u8 {
    move |_| i as u8
}

pub(super) fn fill(buf: &mut [u8], i: usize) {
    let mut f = byte_of(i);
    for (k, b) in buf.iter_mut().enumerate() {
        *b = f(k);
    }
}

/// Whether `TENSORPORT_BENCH_TRACE=1` is in the environment.
pub(super) fn trace_on() -> bool {
    std::env::var_os("TENSORPORT_BENCH_TRACE").is_some_and(|v| v == "1")
}

/// With `TENSORPORT_BENCH_TRACE=1` in the environment, a streaming child prints where its time
/// went (waiting for a slot or sample, filling it, handing it over) to stderr when it ends: to
/// tell a slow fill from a slow return of slots.
pub(super) struct Trace {
    on: bool,
    start: Instant,
    setup: Duration,
    epoch: std::time::SystemTime,
    wait: Duration,
    fill: Duration,
    send: Duration,
    last: Option<Instant>,
    /// The distinct buffers written (their addresses; up to 64 are told apart).
    buffers: Vec<usize>,
}

impl Trace {
    /// Starts the clock; `setup` is how long the child took to connect and make its pool or
    /// publisher (before it waited for the others).
    fn new(setup: Duration) -> Trace {
        Trace {
            on: trace_on(),
            start: Instant::now(),
            setup,
            epoch: std::time::SystemTime::now(),
            wait: Duration::ZERO,
            fill: Duration::ZERO,
            send: Duration::ZERO,
            last: None,
            buffers: Vec::new(),
        }
    }

    /// One message: loan asked at `t0`, granted at `t1`, filled by `t2`, sent now.
    fn add(&mut self, t0: Instant, t1: Instant, t2: Instant) {
        if self.on {
            let now = Instant::now();
            self.wait += t1 - t0;
            self.fill += t2 - t1;
            self.send += now - t2;
            self.last = Some(now);
        }
    }

    /// The message about to be filled is written at `addr`.
    fn buffer(&mut self, addr: *const u8) {
        let a = addr as usize;
        if self.on && self.buffers.len() < 64 && !self.buffers.contains(&a) {
            self.buffers.push(a);
        }
    }

    fn report(&self, who: &str, n: usize) {
        if let (true, Some(last)) = (self.on, self.last) {
            let k = n.max(1) as f64;
            let us = |d: Duration| d.as_secs_f64() * 1e6 / k;
            let at = self
                .epoch
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            // One write, so the children's lines do not interleave.
            let line = format!(
                "trace {who} pid {}: set up {:.1} ms, started at {:.3} s: {n} messages in {:.3} s; per message: wait {:.1} us, fill {:.1} us, send {:.1} us{}",
                std::process::id(),
                self.setup.as_secs_f64() * 1e3,
                at.as_secs_f64() % 1000.0,
                (last - self.start).as_secs_f64(),
                us(self.wait),
                us(self.fill),
                us(self.send),
                match self.buffers.len() {
                    0 => String::new(),
                    k => format!("; {k} distinct buffers written"),
                }
            );
            let _ = std::io::stderr()
                .lock()
                .write_all(format!("{line}\n").as_bytes());
        }
    }
}

/// A streaming child, set up (connected, its pool or publisher made), says so on stdout and
/// waits for the parent's go on stdin: every producer of a run starts streaming at once, on
/// every side alike, so no side's measurement holds a stretch where some producers were still
/// setting up (tensorport's pools are backed up front; iceoryx2's pages come with the first
/// writes). Returns when it may start.
fn start_signal() -> CliResult<Instant> {
    use std::io::Read;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{READY}")?;
    out.flush()?;
    let mut go = [0u8; 1];
    std::io::stdin().read_exact(&mut go)?;
    Ok(Instant::now())
}

/// What a streaming child prints when it is ready to start.
pub(super) const READY: &str = "ready";

/// The children.
pub(super) fn run_child(a: &Args, role: Role) -> CliResult<()> {
    if let Some(cpu) = a.cpu {
        pin(cpu)?;
    }
    let target = a
        .target
        .clone()
        .ok_or_else(|| CliError::usage("--target"))?;
    let size = a.size;
    let poll = a.poll != 0;
    let born = Instant::now();
    let seconds = Duration::from_secs_f64(a.seconds);
    let total = a.round_trips + WARMUP;
    let mut rtts = Vec::with_capacity(total);
    match role {
        Role::TpStream | Role::TpPing => {
            let mut cfg = ProducerConfig::new(role.name());
            cfg.slots = a.slots;
            cfg.slot_size = size as u64;
            cfg.spin = if poll { FOREVER } else { Duration::ZERO };
            if let Some(us) = a.warm_wait_us {
                cfg.warm_wait = Duration::from_micros(us);
            }
            let mut p = Producer::connect(&target, cfg)?;
            let spec = TensorSpec::new(DType::U8, &[size as u64]);
            let ping = role == Role::TpPing;
            let setup = born.elapsed();
            let deadline = if ping { born } else { start_signal()? } + seconds;
            let mut i = 0;
            let mut tr = Trace::new(setup);
            while if ping {
                i < total
            } else {
                more(i, size, deadline)
            } {
                let t = ping.then(Instant::now);
                let t0 = Instant::now();
                let mut l = p.lease(Duration::from_secs(10))?;
                let t1 = Instant::now();
                let buf = &mut l.bytes_mut()[..size];
                tr.buffer(buf.as_ptr());
                fill(buf, i);
                let t2 = Instant::now();
                l.submit(&spec)?;
                tr.add(t0, t1, t2);
                if let Some(t) = t {
                    p.recv_result(Duration::from_secs(10))?;
                    rtts.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                } else {
                    while p.try_recv_result()?.is_some() {}
                }
                i += 1;
            }
            while p.in_flight() > 0 {
                p.recv_result(Duration::from_secs(10))?;
            }
            let _ = p.close();
            tr.report("tensorport", i);
        }
        Role::IceStream => {
            let node = ice_node()?;
            let svc = ice_data(&node, &format!("{target}/data"), 64)?;
            let publisher = ice_publisher(&svc, size)?;
            let setup = born.elapsed();
            let deadline = start_signal()? + seconds;
            let mut i = 0;
            let mut tr = Trace::new(setup);
            while more(i, size, deadline) {
                let t0 = Instant::now();
                let mut s = ice(publisher.loan_slice_uninit(size), "loan")?;
                let t1 = Instant::now();
                tr.buffer(s.payload_mut().as_ptr().cast());
                let s = s.write_from_fn(byte_of(i));
                let t2 = Instant::now();
                ice(s.send(), "send")?;
                tr.add(t0, t1, t2);
                i += 1;
            }
            tr.report("iceoryx2", i);
        }
        Role::IcePing => {
            let node = ice_node()?;
            let ping = ice_data(&node, &format!("{target}/ping"), 1)?;
            let pong = ice_data(&node, &format!("{target}/pong"), 1)?;
            let publisher = ice_publisher(&ping, size)?;
            let sub = ice(pong.subscriber_builder().create(), "subscriber")?;
            let (notifier, listener) = if poll {
                (None, None)
            } else {
                let to_server = ice_event(&node, &format!("{target}/ping-ev"))?;
                let to_me = ice_event(&node, &format!("{target}/pong-ev"))?;
                (
                    Some(ice(to_server.notifier_builder().create(), "notifier")?),
                    Some(ice(to_me.listener_builder().create(), "listener")?),
                )
            };
            // The server's subscriber exists (it was made before this process started).
            for i in 0..total {
                let t = Instant::now();
                ice_send(&publisher, size, i)?;
                if let Some(n) = &notifier {
                    ice(n.notify(), "notify")?;
                }
                ice_recv(
                    &sub,
                    listener.as_ref(),
                    Instant::now() + Duration::from_secs(10),
                )?;
                rtts.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            }
        }
        Role::UdsStream | Role::UdsPing => {
            let mut s = UnixStream::connect(&target)?;
            let mut buf = vec![0u8; size];
            let mut ack = [0u8; 8];
            let ping = role == Role::UdsPing;
            let deadline = if ping { born } else { start_signal()? } + seconds;
            let mut i = 0;
            while if ping {
                i < total
            } else {
                more(i, size, deadline)
            } {
                let t = Instant::now();
                fill(&mut buf, i);
                s.write_all(&buf)?;
                if ping {
                    s.read_exact(&mut ack)?;
                    rtts.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
                }
                i += 1;
            }
        }
    }
    let mut out = std::io::stdout().lock();
    for x in rtts.iter().skip(WARMUP) {
        write!(out, "{x:.3} ")?;
    }
    writeln!(out)?;
    Ok(())
}
