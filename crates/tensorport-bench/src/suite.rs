//! The suite: tensorport and its peers on the same payloads, in one run.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use iceoryx2::port::publisher::Publisher;
use iceoryx2::port::subscriber::Subscriber;
use iceoryx2::prelude::*;
use tensorport::{DType, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};

use crate::{CliError, CliResult};

/// Measure tensorport's host hand-off against its peers on this machine, in one run, with the
/// same payloads: iceoryx2 publish/subscribe (zero-copy shared memory, safe overflow off so
/// nothing is dropped), a plain Unix-socket copy of the bytes, and memcpy (the floor of filling
/// a buffer). Producers are separate processes; each fills every payload before handing it over.
///
/// Throughput: messages/s and GB/s with 1, 2, 4 producers, every side polling. Latency: one
/// producer, one message in flight, one-way = half the round trip (the reply is a small
/// message: tensorport's result, an 8-byte sample or write), as percentiles, both sides polling
/// and both sides sleeping between messages (tensorport on its doorbells, iceoryx2 on an event
/// service, the socket in `read`). With one producer and at least two cores, the two processes
/// are pinned to cores 0 and 1.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A few seconds in all (what CI runs): 4 KiB and 64 KiB, one producer.
    #[arg(long)]
    pub quick: bool,
    /// Payload sizes in bytes.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4096,65536,1048576,19267584"
    )]
    pub sizes: Vec<usize>,
    /// Producer counts for the throughput runs.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub producers: Vec<usize>,
    /// Consumer threads on tensorport's side of a throughput run with more than one producer
    /// (`ServerConfig::consumers`; each serves its share of the sessions). 0: the cores the
    /// producers leave (at least one, at most one per producer): every thread polls, so more
    /// threads than cores starve some. One producer always has one consumer.
    #[arg(long, default_value_t = 1)]
    pub consumers: usize,
    /// Seconds per throughput measurement.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Runs of each throughput cell (peers interleaved); the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Round trips per latency measurement (after 50 unmeasured ones).
    #[arg(long, default_value_t = 5000)]
    pub round_trips: usize,
    /// Write plots (throughput vs size, latency CDF; SVG) into this directory.
    #[arg(long, value_name = "DIR")]
    pub plots: Option<PathBuf>,
    /// Leave processes unpinned even with one producer.
    #[arg(long)]
    pub no_pin: bool,
    /// With more than one producer, pin each producer process to its own CPU (one hardware
    /// thread of every physical core first), on every side alike; consumers stay unpinned.
    #[arg(long)]
    pub pin_producers: bool,
    /// (internal) run as a benchmark child.
    #[arg(long, hide = true, value_enum)]
    pub role: Option<Role>,
    /// (internal) where the child connects (socket path or iceoryx2 service prefix).
    #[arg(long, hide = true)]
    pub target: Option<String>,
    /// (internal) the child's payload size.
    #[arg(long, hide = true, default_value_t = 0)]
    pub size: usize,
    /// (internal) poll (1) or sleep (0) while waiting.
    #[arg(long, hide = true, default_value_t = 1)]
    pub poll: u8,
    /// (internal) the core to pin the child to.
    #[arg(long, hide = true)]
    pub cpu: Option<usize>,
}

const WARMUP: usize = 50;
const FOREVER: Duration = Duration::from_secs(3600);

fn ice<T, E: std::fmt::Debug>(r: Result<T, E>, what: &str) -> CliResult<T> {
    r.map_err(|e| CliError::new(format!("iceoryx2 {what}: {e:?}")))
}

/// Pins this process (all its threads created afterwards) to `cpu`.
fn pin(cpu: usize) -> CliResult<()> {
    let mut set = nix::sched::CpuSet::new();
    set.set(cpu)
        .map_err(|e| CliError::new(format!("cpu {cpu}: {e}")))?;
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
        .map_err(|e| CliError::new(format!("pinning to cpu {cpu}: {e}")))
}

/// The CPUs this process may run on, and the first two of them (where a producer/consumer pair
/// is pinned), if there are two.
fn allowed_cpus() -> (Option<nix::sched::CpuSet>, Option<(usize, usize)>) {
    let Ok(set) = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) else {
        return (None, None);
    };
    let mut cpus = (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false));
    let pair = match (cpus.next(), cpus.next()) {
        (Some(a), Some(b)) => Some((a, b)),
        _ => None,
    };
    (Some(set), pair)
}

struct Ctx {
    exe: PathBuf,
    /// The affinity we started with (restored after each pinned measurement).
    allowed: Option<nix::sched::CpuSet>,
    /// Where a one-producer pair runs: (consumer, producer).
    cpus: Option<(usize, usize)>,
    seconds: f64,
    round_trips: usize,
    /// With `--pin-producers`: the allowed CPUs, one hardware thread of each physical core
    /// first, then their siblings; producer k of a many-producer run goes to the k-th.
    spread: Vec<usize>,
}

/// The allowed CPUs ordered so that each physical core's first hardware thread comes before any
/// core's second (Linux's topology files; in CPU order where they are missing).
fn spread_cpus(allowed: &Option<nix::sched::CpuSet>) -> Vec<usize> {
    let Some(set) = allowed else {
        return Vec::new();
    };
    let mut cpus: Vec<(usize, usize)> = (0..nix::sched::CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .map(|c| {
            let rank = std::fs::read_to_string(format!(
                "/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"
            ))
            .ok()
            .and_then(|l| {
                // "0,8" or "0-1": this CPU's place among its siblings.
                let sibs: Vec<usize> = l
                    .trim()
                    .split([',', '-'])
                    .filter_map(|x| x.parse().ok())
                    .collect();
                sibs.iter().position(|&x| x == c)
            })
            .unwrap_or(0);
            (rank, c)
        })
        .collect();
    cpus.sort();
    cpus.into_iter().map(|(_, c)| c).collect()
}

/// What a benchmark child process does: stream into a sink, or answer pings; over tensorport,
/// iceoryx2, or a Unix socket.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    TpStream,
    TpPing,
    IceStream,
    IcePing,
    UdsStream,
    UdsPing,
}

impl Role {
    fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .map(|p| p.get_name().to_string())
            .unwrap_or_default()
    }
}

impl Ctx {
    fn child(
        &self,
        role: Role,
        target: &str,
        size: usize,
        poll: bool,
        cpu: Option<usize>,
    ) -> CliResult<Child> {
        let mut c = Command::new(&self.exe);
        c.args(["--log", "error", "--role", &role.name(), "--target", target])
            .args(["--size", &size.to_string()])
            .args(["--seconds", &self.seconds.to_string()])
            .args(["--round-trips", &self.round_trips.to_string()])
            .args(["--poll", if poll { "1" } else { "0" }])
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        if let Some(cpu) = cpu {
            c.args(["--cpu", &cpu.to_string()]);
        }
        Ok(c.spawn()?)
    }

    /// The CPU for producer `k` of a many-producer run, with `--pin-producers`.
    fn spread_cpu(&self, k: usize) -> Option<usize> {
        (!self.spread.is_empty()).then(|| self.spread[k % self.spread.len()])
    }

    /// Cores for (parent, child) when one producer runs against one consumer.
    fn pair(&self) -> (Option<usize>, Option<usize>) {
        match self.cpus {
            Some((a, b)) => (Some(a), Some(b)),
            None => (None, None),
        }
    }

    /// Back to the affinity we started with.
    fn unpin(&self) {
        if let Some(set) = &self.allowed {
            let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), set);
        }
    }
}

/// Messages every streaming child sends at least, however short --seconds: on a loaded machine a
/// child may get so little time before its deadline that the reader sees all it sent in one
/// look, which measures nothing (the rate needs a first and a last arrival apart).
const MIN_MESSAGES: usize = 1024;

/// Seconds a reader waits past --seconds for its children to finish (they send at least
/// [`MIN_MESSAGES`], which a loaded machine may take a while to do).
const READ_GRACE_S: f64 = 120.0;

/// Whether a streaming child goes on: it reads the clock every 64 messages (every peer alike),
/// and sends at least [`MIN_MESSAGES`].
fn more(i: usize, deadline: Instant) -> bool {
    i < MIN_MESSAGES || !i.is_multiple_of(64) || Instant::now() < deadline
}

/// Every peer writes every byte of every payload with this same loop (iceoryx2 through
/// `write_from_fn`, which runs it over its uninitialised sample).
#[inline(always)]
fn byte_of(i: usize) -> impl FnMut(usize) -> u8 {
    move |_| i as u8
}

fn fill(buf: &mut [u8], i: usize) {
    let mut f = byte_of(i);
    for (k, b) in buf.iter_mut().enumerate() {
        *b = f(k);
    }
}

fn service_name(tag: &str) -> CliResult<ServiceName> {
    ice(ServiceName::new(tag), "service name")
}

fn ice_node() -> CliResult<Node<ipc::Service>> {
    ice(
        NodeBuilder::new()
            .signal_handling_mode(SignalHandlingMode::Disabled)
            .create::<ipc::Service>(),
        "node",
    )
}

type IceSvc =
    iceoryx2::service::port_factory::publish_subscribe::PortFactory<ipc::Service, [u8], ()>;
type IceEvent = iceoryx2::service::port_factory::event::PortFactory<ipc::Service>;

fn ice_data(node: &Node<ipc::Service>, tag: &str, publishers: usize) -> CliResult<IceSvc> {
    ice(
        node.service_builder(&service_name(tag)?)
            .publish_subscribe::<[u8]>()
            .enable_safe_overflow(false)
            .subscriber_max_buffer_size(8)
            .history_size(0)
            .max_publishers(publishers.max(1))
            .max_subscribers(1)
            .open_or_create(),
        "service",
    )
}

fn ice_event(node: &Node<ipc::Service>, tag: &str) -> CliResult<IceEvent> {
    ice(
        node.service_builder(&service_name(tag)?)
            .event()
            .open_or_create(),
        "event service",
    )
}

fn ice_publisher(svc: &IceSvc, size: usize) -> CliResult<Publisher<ipc::Service, [u8], ()>> {
    ice(
        svc.publisher_builder()
            .initial_max_slice_len(size)
            .backpressure_strategy(BackpressureStrategy::RetryUntilDelivered)
            .create(),
        "publisher",
    )
}

fn ice_send(p: &Publisher<ipc::Service, [u8], ()>, size: usize, i: usize) -> CliResult<()> {
    let s = ice(p.loan_slice_uninit(size), "loan")?;
    ice(s.write_from_fn(byte_of(i)).send(), "send")?;
    Ok(())
}

/// Waits for the next sample: spinning, or sleeping on `listener` between looks.
fn ice_recv(
    sub: &Subscriber<ipc::Service, [u8], ()>,
    listener: Option<&iceoryx2::port::listener::Listener<ipc::Service>>,
    deadline: Instant,
) -> CliResult<usize> {
    let mut spins = 0u32;
    loop {
        if let Some(s) = ice(sub.receive(), "receive")? {
            return Ok(*std::hint::black_box(s.payload().first().unwrap_or(&0)) as usize);
        }
        spins = spins.wrapping_add(1);
        // The clock every 32 looks and a yield every 256, as tensorport's own spin loops do.
        if spins.is_multiple_of(32) && Instant::now() > deadline {
            return Err(CliError::new("iceoryx2: no sample within the deadline"));
        }
        match listener {
            // A bounded wait: a notification sent before the ports saw each other is not lost
            // for long (only warm-up round trips can hit this).
            Some(l) => {
                ice(l.timed_wait(|_| {}, Duration::from_millis(10)), "wait")?;
            }
            None if spins.is_multiple_of(256) => std::thread::yield_now(),
            None => std::hint::spin_loop(),
        }
    }
}

/// With `TENSORPORT_BENCH_TRACE=1` in the environment, a streaming child prints where its time
/// went (waiting for a slot or sample, filling it, handing it over) to stderr when it ends: to
/// tell a slow fill from a slow return of slots.
struct Trace {
    on: bool,
    start: Instant,
    setup: Duration,
    epoch: std::time::SystemTime,
    wait: Duration,
    fill: Duration,
    send: Duration,
    last: Option<Instant>,
}

impl Trace {
    /// Starts the clock; `born` is when the child began setting up (connecting, its pool).
    fn new(born: Instant) -> Trace {
        Trace {
            on: std::env::var_os("TENSORPORT_BENCH_TRACE").is_some_and(|v| v == "1"),
            start: Instant::now(),
            setup: born.elapsed(),
            epoch: std::time::SystemTime::now(),
            wait: Duration::ZERO,
            fill: Duration::ZERO,
            send: Duration::ZERO,
            last: None,
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

    fn report(&self, who: &str, n: usize) {
        if let (true, Some(last)) = (self.on, self.last) {
            let k = n.max(1) as f64;
            let us = |d: Duration| d.as_secs_f64() * 1e6 / k;
            let at = self
                .epoch
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            eprintln!(
                "trace {who} pid {}: set up {:.1} ms, started at {:.3} s: {n} messages in {:.3} s; per message: wait {:.1} us, fill {:.1} us, send {:.1} us",
                std::process::id(),
                self.setup.as_secs_f64() * 1e3,
                at.as_secs_f64() % 1000.0,
                (last - self.start).as_secs_f64(),
                us(self.wait),
                us(self.fill),
                us(self.send)
            );
        }
    }
}

/// The children.
fn run_child(a: &Args, role: Role) -> CliResult<ExitCode> {
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
    let deadline = born + Duration::from_secs_f64(a.seconds);
    let total = a.round_trips + WARMUP;
    let mut rtts = Vec::with_capacity(total);
    match role {
        Role::TpStream | Role::TpPing => {
            let mut cfg = ProducerConfig::new(role.name());
            cfg.slots = 8;
            cfg.slot_size = size as u64;
            cfg.spin = if poll { FOREVER } else { Duration::ZERO };
            let mut p = Producer::connect(&target, cfg)?;
            let spec = TensorSpec::new(DType::U8, &[size as u64]);
            let ping = role == Role::TpPing;
            let mut i = 0;
            let mut tr = Trace::new(born);
            while if ping { i < total } else { more(i, deadline) } {
                let t = ping.then(Instant::now);
                let t0 = Instant::now();
                let mut l = p.lease(Duration::from_secs(10))?;
                let t1 = Instant::now();
                fill(&mut l.bytes_mut()[..size], i);
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
            let mut i = 0;
            let mut tr = Trace::new(born);
            while more(i, deadline) {
                let t0 = Instant::now();
                let s = ice(publisher.loan_slice_uninit(size), "loan")?;
                let t1 = Instant::now();
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
            let mut i = 0;
            while if ping { i < total } else { more(i, deadline) } {
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
    Ok(ExitCode::SUCCESS)
}

fn samples(out: std::process::Output, who: &str) -> CliResult<Vec<f64>> {
    if !out.status.success() {
        return Err(CliError::new(format!(
            "the {who} latency child failed: {}",
            out.status
        )));
    }
    let v: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.is_empty() {
        return Err(CliError::new(format!(
            "the {who} latency child measured nothing"
        )));
    }
    Ok(v)
}

fn wait_ok(kids: Vec<Child>, who: &str) -> CliResult<()> {
    for k in kids {
        let o = k.wait_with_output()?;
        if !o.status.success() {
            return Err(CliError::new(format!(
                "a {who} producer failed: {}",
                o.status
            )));
        }
    }
    Ok(())
}

/// Messages/s from counts and the first and last arrival.
fn rate(count: u64, first: Option<Instant>, last: Instant) -> f64 {
    let secs = first.map_or(0.0, |f| last.duration_since(f).as_secs_f64());
    if secs > 0.0 {
        count as f64 / secs
    } else {
        0.0
    }
}

fn socket_dir() -> CliResult<tempfile::TempDir> {
    Ok(tempfile::Builder::new().prefix("tp-bench-").tempdir()?)
}

/// A server for the latency runs: one producer, one consumer.
fn tp_server(sock: &Path, size: usize, poll: bool) -> CliResult<Server> {
    let mut cfg = ServerConfig::new(sock);
    cfg.slot_size = size as u64;
    cfg.spin = if poll { FOREVER } else { Duration::ZERO };
    Ok(Server::bind(cfg)?)
}

/// What one tensorport throughput run measured: the rate, and the slowest producer's share
/// against the mean (1.0: all equal).
struct TpRun {
    rate: f64,
    fairness: f64,
}

/// tensorport: `n` producer processes streaming into one in-process server, taken by
/// `consumers` threads (each serving its share of the sessions).
fn tp_throughput(cx: &Ctx, size: usize, n: usize, consumers: usize) -> CliResult<TpRun> {
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
    let server = Server::bind(cfg)?;
    let target = sock.to_string_lossy();
    let kids: Vec<Child> = (0..n)
        .map(|k| {
            cx.child(
                Role::TpStream,
                &target,
                size,
                true,
                kid.or(cx.spread_cpu(k)),
            )
        })
        .collect::<CliResult<_>>()?;
    // The readers stop when the children are done; this only bounds a run that hangs.
    let deadline = Instant::now() + Duration::from_secs_f64(cx.seconds + READ_GRACE_S);
    // Each consumer: its count, first and last message, and per session id its messages and
    // first and last message.
    type PerSession = Vec<(u64, Option<Instant>, Option<Instant>)>;
    type ConsumerRun = (u64, Option<Instant>, Instant, PerSession);
    let runs: Vec<CliResult<ConsumerRun>> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..consumers.max(1))
            .map(|_| {
                let server = &server;
                s.spawn(move || {
                    let (mut count, mut first, mut last) = (0u64, None, Instant::now());
                    let mut per_session: PerSession = vec![(0, None, None); n + 2];
                    let mut batch = Vec::with_capacity(64);
                    while Instant::now() < deadline {
                        server.recv_batch_into(
                            &mut batch,
                            64,
                            Duration::from_millis(100),
                            Duration::ZERO,
                        )?;
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
                                c.0 += 1;
                                c.1.get_or_insert(now);
                                c.2 = Some(now);
                            }
                            let _ = r.respond(&[]);
                        }
                        last = Instant::now();
                    }
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
    let mut per_session: Vec<(u64, Option<Instant>, Option<Instant>)> = vec![(0, None, None); n + 2];
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
    // Fairness: each producer's rate while it streamed (its messages over the time from its
    // first to its last), the slowest against the mean. (Counts alone would read equal when
    // every producer sends the minimum number of messages, as large payloads do.)
    let rates: Vec<f64> = per_session
        .iter()
        .filter_map(|&(c, f, l)| match (f, l) {
            (Some(f), Some(l)) if c > 1 && l > f => Some((c - 1) as f64 / (l - f).as_secs_f64()),
            _ => None,
        })
        .collect();
    let mean = rates.iter().sum::<f64>() / rates.len().max(1) as f64;
    let fairness = rates
        .iter()
        .copied()
        .reduce(f64::min)
        .map_or(1.0, |m| m / mean.max(1e-9));
    Ok(TpRun {
        rate: rate(count, first, last.unwrap_or_else(Instant::now)),
        fairness,
    })
}

/// iceoryx2: `n` publisher processes, one subscriber in this process.
fn ice_throughput(cx: &Ctx, size: usize, n: usize) -> CliResult<f64> {
    let tag = format!("tp-bench-{}-{size}-{n}", std::process::id());
    let (me, kid) = if n == 1 { cx.pair() } else { (None, None) };
    if let Some(c) = me {
        pin(c)?;
    }
    let node = ice_node()?;
    let svc = ice_data(&node, &format!("{tag}/data"), 64)?;
    let sub = ice(svc.subscriber_builder().create(), "subscriber")?;
    let mut kids: Vec<Child> = (0..n)
        .map(|k| cx.child(Role::IceStream, &tag, size, true, kid.or(cx.spread_cpu(k))))
        .collect::<CliResult<_>>()?;
    let (mut count, mut first, mut last) = (0u64, None, Instant::now());
    // The readers stop when the children are done; this only bounds a run that hangs.
    let deadline = Instant::now() + Duration::from_secs_f64(cx.seconds + READ_GRACE_S);
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        // Up to 64 samples per look at the clock, as the tensorport server takes batches.
        let mut got = 0;
        while got < 64 {
            match ice(sub.receive(), "receive")? {
                Some(s) => {
                    std::hint::black_box(s.payload().first());
                    got += 1;
                }
                None => break,
            }
        }
        if got > 0 {
            let now = Instant::now();
            first.get_or_insert(now);
            count += got;
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
    Ok(rate(count, first, last))
}

/// A plain Unix-socket copy: `n` processes write payloads, one reader thread per connection.
fn uds_throughput(cx: &Ctx, size: usize, n: usize) -> CliResult<f64> {
    let dir = socket_dir()?;
    let sock = dir.path().join("uds.sock");
    let listener = UnixListener::bind(&sock)?;
    let (me, kid) = if n == 1 { cx.pair() } else { (None, None) };
    if let Some(c) = me {
        pin(c)?;
    }
    let target = sock.to_string_lossy();
    let kids: Vec<Child> = (0..n)
        .map(|k| {
            cx.child(
                Role::UdsStream,
                &target,
                size,
                true,
                kid.or(cx.spread_cpu(k)),
            )
        })
        .collect::<CliResult<_>>()?;
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

fn memcpy_gbps(size: usize, seconds: f64) -> f64 {
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

fn tp_latency(cx: &Ctx, size: usize, poll: bool) -> CliResult<Vec<f64>> {
    let dir = socket_dir()?;
    let sock = dir.path().join("lat.sock");
    let (me, kid) = cx.pair();
    if let Some(c) = me {
        pin(c)?;
    }
    let server = tp_server(&sock, size, poll)?;
    let child = cx.child(Role::TpPing, &sock.to_string_lossy(), size, poll, kid)?;
    for _ in 0..cx.round_trips + WARMUP {
        let r = server
            .recv_timeout(Duration::from_secs(10))?
            .ok_or_else(|| CliError::new("the tensorport latency producer stopped"))?;
        std::hint::black_box(r.bytes().first());
        r.respond(&[])?;
    }
    cx.unpin();
    samples(child.wait_with_output()?, "tensorport")
}

fn ice_latency(cx: &Ctx, size: usize, poll: bool) -> CliResult<Vec<f64>> {
    let tag = format!("tp-bench-{}-lat-{size}-{poll}", std::process::id());
    let (me, kid) = cx.pair();
    if let Some(c) = me {
        pin(c)?;
    }
    let node = ice_node()?;
    let ping = ice_data(&node, &format!("{tag}/ping"), 1)?;
    let pong = ice_data(&node, &format!("{tag}/pong"), 1)?;
    let sub = ice(ping.subscriber_builder().create(), "subscriber")?;
    let publisher = ice_publisher(&pong, 8)?;
    let (notifier, listener) = if poll {
        (None, None)
    } else {
        let to_me = ice_event(&node, &format!("{tag}/ping-ev"))?;
        let to_child = ice_event(&node, &format!("{tag}/pong-ev"))?;
        (
            Some(ice(to_child.notifier_builder().create(), "notifier")?),
            Some(ice(to_me.listener_builder().create(), "listener")?),
        )
    };
    let child = cx.child(Role::IcePing, &tag, size, poll, kid)?;
    for i in 0..cx.round_trips + WARMUP {
        ice_recv(
            &sub,
            listener.as_ref(),
            Instant::now() + Duration::from_secs(10),
        )?;
        ice_send(&publisher, 8, i)?;
        if let Some(n) = &notifier {
            ice(n.notify(), "notify")?;
        }
    }
    cx.unpin();
    samples(child.wait_with_output()?, "iceoryx2")
}

fn uds_latency(cx: &Ctx, size: usize) -> CliResult<Vec<f64>> {
    let dir = socket_dir()?;
    let sock = dir.path().join("lat.sock");
    let (me, kid) = cx.pair();
    if let Some(c) = me {
        pin(c)?;
    }
    let listener = UnixListener::bind(&sock)?;
    let child = cx.child(Role::UdsPing, &sock.to_string_lossy(), size, false, kid)?;
    let (mut s, _) = listener.accept()?;
    let mut buf = vec![0u8; size];
    for _ in 0..cx.round_trips + WARMUP {
        s.read_exact(&mut buf)?;
        s.write_all(&[0u8; 8])?;
    }
    cx.unpin();
    samples(child.wait_with_output()?, "Unix socket")
}

/// p50, p99, p99.9 of `v` (sorted in place).
pub fn percentiles(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let p = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (p(0.5), p(0.99), p(0.999))
}

/// One throughput cell: messages/s per peer.
pub struct Throughput {
    pub size: usize,
    pub producers: usize,
    pub tp: f64,
    pub ice: f64,
    pub uds: f64,
    pub memcpy: f64,
}

/// One latency row: one-way samples in µs per peer (sorted).
pub struct Latency {
    pub size: usize,
    pub polling: bool,
    pub tp: Vec<f64>,
    pub ice: Vec<f64>,
    pub uds: Option<Vec<f64>>,
}

fn median(v: &mut [f64]) -> f64 {
    percentiles(v).0
}

fn fmt_p(v: &mut [f64]) -> String {
    let (a, b, c) = percentiles(v);
    format!("{} / {} / {} µs", sig3(a), sig3(b), sig3(c))
}

pub fn run(mut a: Args) -> CliResult<ExitCode> {
    if let Some(role) = a.role {
        return run_child(&a, role);
    }
    if a.quick {
        a.sizes = vec![4096, 65536];
        a.producers = vec![1];
        a.seconds = 0.2;
        a.round_trips = 300;
        a.repeat = 1;
    }
    if a.sizes.is_empty() || a.sizes.contains(&0) {
        return Err(CliError::usage("--sizes: give positive byte counts"));
    }
    if a.producers.is_empty() || a.producers.contains(&0) {
        return Err(CliError::usage("--producers: give positive counts"));
    }
    if a.round_trips == 0 || a.seconds <= 0.0 {
        return Err(CliError::usage(
            "--round-trips and --seconds must be positive",
        ));
    }
    iceoryx2::prelude::set_log_level(LogLevel::Error);
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let (allowed, pair) = allowed_cpus();
    let spread = if a.pin_producers {
        spread_cpus(&allowed)
    } else {
        Vec::new()
    };
    let cx = Ctx {
        exe: std::env::current_exe()?,
        allowed,
        cpus: pair.filter(|_| !a.no_pin),
        seconds: a.seconds,
        round_trips: a.round_trips,
        spread,
    };
    let pinning = match cx.cpus {
        Some((c, p)) => format!("pinned: consumer to CPU {c}, producer to CPU {p}"),
        None => "unpinned".into(),
    };
    println!(
        "tensorport-bench — {cores} cores; throughput: median of {} runs of {} s per cell; {} round trips per latency cell; one producer {pinning}",
        a.repeat.max(1),
        a.seconds,
        a.round_trips,
    );
    println!("\n| payload | producers | tensorport msgs/s | tensorport GB/s | iceoryx2 msgs/s | iceoryx2 GB/s | Unix socket msgs/s | Unix socket GB/s | memcpy GB/s | tensorport / iceoryx2 |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut tput = Vec::new();
    let mut fairness_rows = Vec::new();
    for &size in &a.sizes {
        let mem = memcpy_gbps(size, a.seconds.min(1.0));
        for &n in &a.producers {
            let (mut tps, mut ics, mut udss) = (Vec::new(), Vec::new(), Vec::new());
            let consumers = match (n, a.consumers) {
                (1, _) => 1,
                // Every spinning thread its own core: producers first, consumers on the rest.
                (_, 0) => cores.saturating_sub(n).clamp(1, n),
                (_, k) => k.min(n),
            };
            let mut fair = Vec::new();
            for _ in 0..a.repeat.max(1) {
                let run = tp_throughput(&cx, size, n, consumers)?;
                tps.push(run.rate);
                fair.push(run.fairness);
                ics.push(ice_throughput(&cx, size, n)?);
                udss.push(uds_throughput(&cx, size, n)?);
            }
            let (tp, ic, uds) = (median(&mut tps), median(&mut ics), median(&mut udss));
            let fairness = fair.iter().copied().fold(f64::INFINITY, f64::min);
            if n > 1 {
                fairness_rows.push(format!(
                    "| {size} B | {n} | {consumers} | {:.2} |",
                    fairness
                ));
            }
            let gb = |x: f64| x * size as f64 / 1e9;
            println!(
                "| {size} B | {n} | {tp:.0} | {} | {ic:.0} | {} | {uds:.0} | {} | {} | {} |",
                sig3(gb(tp)),
                sig3(gb(ic)),
                sig3(gb(uds)),
                sig3(mem),
                sig3(tp / ic.max(1e-9))
            );
            tput.push(Throughput {
                size,
                producers: n,
                tp,
                ice: ic,
                uds,
                memcpy: mem,
            });
        }
    }
    if !fairness_rows.is_empty() {
        println!("\nFairness between tensorport's producers (the slowest one's rate while it streamed / the mean rate, worst of the runs):\n");
        println!("| payload | producers | consumers | slowest / mean |");
        println!("| --- | --- | --- | --- |");
        for r in &fairness_rows {
            println!("{r}");
        }
    }
    println!("\n| payload | waiting | tensorport one-way p50 / p99 / p99.9 | iceoryx2 one-way p50 / p99 / p99.9 | Unix socket one-way p50 / p99 / p99.9 | p50 tensorport / iceoryx2 |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let mut lat = Vec::new();
    for &size in &a.sizes {
        for polling in [true, false] {
            let mut tp = tp_latency(&cx, size, polling)?;
            let mut ic = ice_latency(&cx, size, polling)?;
            let mut uds = if polling {
                None
            } else {
                Some(uds_latency(&cx, size)?)
            };
            let ratio = percentiles(&mut tp).0 / percentiles(&mut ic).0.max(1e-9);
            println!(
                "| {size} B | {} | {} | {} | {} | {ratio:.2} |",
                if polling { "polling" } else { "blocking" },
                fmt_p(&mut tp),
                fmt_p(&mut ic),
                uds.as_mut().map_or("—".into(), |u| fmt_p(u)),
            );
            lat.push(Latency {
                size,
                polling,
                tp,
                ice: ic,
                uds,
            });
        }
    }
    if let Some(dir) = &a.plots {
        std::fs::create_dir_all(dir)?;
        let t = dir.join("throughput_vs_size.svg");
        let l = dir.join("latency_cdf.svg");
        crate::plot::throughput(&t, &tput)?;
        crate::plot::latency_cdf(&l, &lat)?;
        println!("\nplots: {} and {}", t.display(), l.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `x` to three significant digits (at least the integer part): a small figure on a loaded
/// machine reads `0.00412`, never a `0.00` that looks like nothing was measured.
fn sig3(x: f64) -> String {
    if !x.is_finite() || x <= 0.0 {
        return format!("{x}");
    }
    let decimals = (2 - x.log10().floor() as i32).max(0) as usize;
    format!("{x:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::sig3;

    #[test]
    fn three_significant_digits_never_round_to_zero() {
        assert_eq!(sig3(1234.6), "1235");
        assert_eq!(sig3(12.345), "12.3");
        assert_eq!(sig3(1.2345), "1.23");
        assert_eq!(sig3(0.004123), "0.00412");
        assert_eq!(sig3(0.0), "0");
    }
}
