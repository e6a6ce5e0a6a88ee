//! The suite: tensorport and its peers on the same payloads, in one run.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use iceoryx2::port::publisher::Publisher;
use iceoryx2::port::subscriber::Subscriber;
use iceoryx2::prelude::*;
use tensorport::{DType, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};

use crate::{CliError, CliResult};

mod child;
mod ice;
mod latency;
mod throughput;

use child::*;
use ice::*;
use latency::*;
use throughput::*;

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
/// are pinned to cores 0 and 1. Fairness (with several producers): the slowest producer's rate
/// while it streamed, against the mean.
///
/// With TENSORPORT_BENCH_TRACE=1 in the environment, every streaming child prints on stderr where
/// its time went: waiting for a slot or sample, filling it, handing it over.
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
    /// tensorport's consumers answer each request alone (`Request::respond`) instead of each
    /// batch at once (`Server::respond_all`: per session one lock, one publication and one
    /// wake-up check for its requests of the batch).
    #[arg(long)]
    pub respond_each: bool,
    /// How long a tensorport producer's lease of a slot of 1 MiB or more polls for the slot it
    /// submitted last before taking another (`ProducerConfig::warm_wait`; 0: never); default:
    /// the library's.
    #[arg(long, value_name = "MICROSECONDS")]
    pub warm_wait_us: Option<u64>,
    /// Slots in each tensorport producer's pool (`ProducerConfig::slots`): how many of its
    /// tensors may be in flight at once.
    #[arg(long, default_value_t = 8)]
    pub slots: u32,
    /// Most requests a tensorport consumer takes in one `recv_batch` (and answers together)
    /// in the throughput runs. A producer's slots come back when its requests are answered, so
    /// a larger batch holds them longer.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// tensorport's server paces its producers (`ServerConfig::pace`): a producer this many
    /// grants ahead of the slowest active one gets no slot back until that one catches up.
    /// Evens the producers' shares out where their fills run at different speeds, at the cost
    /// of the fast ones' time. 0 (the default): no pacing.
    #[arg(long, value_name = "GRANTS", default_value_t = 0)]
    pub pace_window: u32,
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
    /// `--respond-each`.
    respond_each: bool,
    /// `--warm-wait-us`.
    warm_wait_us: Option<u64>,
    /// `--slots`.
    slots: u32,
    /// `--batch`.
    batch: usize,
    /// `--pace-window`.
    pace_window: u32,
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
    /// Streaming children wait for the parent's go (see [`start_together`]).
    fn streams(self) -> bool {
        matches!(self, Role::TpStream | Role::IceStream | Role::UdsStream)
    }

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
            .stdin(if role.streams() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped());
        if let Some(cpu) = cpu {
            c.args(["--cpu", &cpu.to_string()]);
        }
        if let Some(us) = self.warm_wait_us {
            c.args(["--warm-wait-us", &us.to_string()]);
        }
        c.args(["--slots", &self.slots.to_string()]);
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

/// Waits until every streaming child says it is set up, then tells them all to start. A child
/// that stops first, or is not set up within [`throughput::READ_GRACE_S`], ends the run with an
/// error, and every child of it is killed (none is left waiting for its go).
fn start_together(kids: &mut [Child], who: &str) -> CliResult<()> {
    let deadline = Instant::now() + Duration::from_secs_f64(READ_GRACE_S);
    let ready = kids.iter_mut().try_for_each(|k| {
        let out = k
            .stdout
            .as_mut()
            .ok_or_else(|| CliError::new("a child without its stdout"))?;
        if read_line_by(out, deadline)?.trim_ascii() == READY.as_bytes() {
            Ok(())
        } else {
            Err(CliError::new(format!(
                "a {who} producer stopped before it was set up (see its error above)"
            )))
        }
    });
    if let Err(e) = ready {
        for k in kids.iter_mut() {
            let _ = k.kill();
            let _ = k.wait();
        }
        return Err(e);
    }
    for k in kids.iter_mut() {
        if let Some(mut go) = k.stdin.take() {
            go.write_all(b"g")?;
        }
    }
    Ok(())
}

/// One line from a child's stdout, a byte at a time (nothing after it may be taken from the
/// pipe), by `deadline`; what came before the end of the pipe if it ends first.
fn read_line_by(out: &mut std::process::ChildStdout, deadline: Instant) -> CliResult<Vec<u8>> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::io::Read;
    use std::os::fd::AsFd;
    let mut line = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let ms =
            PollTimeout::try_from(left.as_millis().min(60_000) as i32).unwrap_or(PollTimeout::MAX);
        let mut pfd = [PollFd::new(out.as_fd(), PollFlags::POLLIN)];
        match poll(&mut pfd, ms) {
            Ok(0) if left.is_zero() => {
                return Err(CliError::new(format!(
                    "a benchmark child was not set up within {READ_GRACE_S} s"
                )))
            }
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(CliError::new(format!("waiting for a child: {e}"))),
        }
        let mut b = [0u8; 1];
        match out.read(&mut b)? {
            0 => return Ok(line),
            _ if b[0] == b'\n' => return Ok(line),
            _ => line.push(b[0]),
        }
    }
}

impl Ctx {
    /// `n` streaming children of `role` (not yet started: see [`start_together`]), the k-th
    /// on `cpu` or, with `--pin-producers`, on its own core.
    fn streamers(
        &self,
        role: Role,
        target: &str,
        size: usize,
        n: usize,
        cpu: Option<usize>,
    ) -> CliResult<Vec<Child>> {
        (0..n)
            .map(|k| self.child(role, target, size, true, cpu.or(self.spread_cpu(k))))
            .collect()
    }
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

/// Runs the suite (or, in a child process, its role); returns the measurements of a full run.
pub fn run(mut a: Args) -> CliResult<Option<Results>> {
    if let Some(role) = a.role {
        run_child(&a, role)?;
        return Ok(None);
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
        respond_each: a.respond_each,
        warm_wait_us: a.warm_wait_us,
        slots: a.slots,
        batch: a.batch.max(1),
        pace_window: a.pace_window,
    };
    let pinning = match cx.cpus {
        Some((c, p)) => format!("pinned: consumer to CPU {c}, producer to CPU {p}"),
        None => "unpinned".into(),
    };
    let paced = match a.pace_window {
        0 => String::new(),
        w => format!("; tensorport's server paces its producers (window {w})"),
    };
    println!(
        "tensorport-bench — {cores} cores; throughput: median of {} runs of {} s per cell; {} round trips per latency cell; one producer {pinning}{paced}; tensorport: {} slots per producer, batches of up to {}",
        a.repeat.max(1),
        a.seconds,
        a.round_trips,
        a.slots,
        a.batch.max(1),
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
            let (mut fair, mut ice_fair) = (Vec::new(), Vec::new());
            for _ in 0..a.repeat.max(1) {
                let run = tp_throughput(&cx, size, n, consumers)?;
                tps.push(run.rate);
                fair.push(run.fairness);
                let run = ice_throughput(&cx, size, n)?;
                ics.push(run.rate);
                ice_fair.push(run.fairness);
                udss.push(uds_throughput(&cx, size, n)?);
            }
            let (tp, ic, uds) = (median(&mut tps), median(&mut ics), median(&mut udss));
            if n > 1 {
                let worst = |f: &[f64]| f.iter().copied().fold(f64::INFINITY, f64::min);
                let show = |f: &[f64]| {
                    f.iter()
                        .map(|x| format!("{x:.2}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                fairness_rows.push(format!(
                    "| {size} B | {n} | {consumers} | {:.2} ({}) | {:.2} ({}) |",
                    worst(&fair),
                    show(&fair),
                    worst(&ice_fair),
                    show(&ice_fair)
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
        println!("\nFairness between each peer's producers (the slowest one's rate while it streamed / the mean rate; the worst run, then every run):\n");
        println!("| payload | producers | tensorport consumers | tensorport slowest / mean | iceoryx2 slowest / mean |");
        println!("| --- | --- | --- | --- | --- |");
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
    Ok(Some(Results { tput, lat }))
}

/// A run's measurements, for the plots.
pub struct Results {
    pub tput: Vec<Throughput>,
    pub lat: Vec<Latency>,
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
