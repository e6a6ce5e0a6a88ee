//! `tensorport bench`: tensorport and its peers on the same payloads, in one run.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use tensorport::{DType, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};

use crate::common::{CliError, CliResult};

/// Measure tensorport's host hand-off against its peers on this machine, in one run, with the
/// same payloads: a plain Unix-socket copy of the bytes, and memcpy (the floor of filling a
/// buffer). Producers are separate processes; each fills every payload before handing it over.
/// Throughput: tensors/s and GB/s with 1, 2, 4 producers. Latency: one producer, one tensor in
/// flight, one-way = half the round trip (the reply is a small message), percentiles.
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
    /// Seconds per throughput measurement.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Round trips per latency measurement.
    #[arg(long, default_value_t = 2000)]
    pub round_trips: usize,
    /// (internal) run as a benchmark child.
    #[arg(long, hide = true)]
    pub role: Option<String>,
    /// (internal) where the child connects.
    #[arg(long, hide = true)]
    pub socket: Option<PathBuf>,
    /// (internal) the child's payload size.
    #[arg(long, hide = true, default_value_t = 0)]
    pub size: usize,
}

fn child(exe: &Path, role: &str, sock: &Path, size: usize, a: &Args) -> CliResult<Child> {
    Ok(Command::new(exe)
        .args(["--log", "error", "bench", "--role", role])
        .arg("--socket")
        .arg(sock)
        .args(["--size", &size.to_string()])
        .args(["--seconds", &a.seconds.to_string()])
        .args(["--round-trips", &a.round_trips.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()?)
}

fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let p = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (p(0.5), p(0.99), p(0.999))
}

fn fill(buf: &mut [u8], i: usize) {
    buf.fill(i as u8);
}

/// The children.
fn run_child(a: &Args, role: &str) -> CliResult<ExitCode> {
    let sock = a
        .socket
        .clone()
        .ok_or_else(|| CliError::usage("--socket"))?;
    let size = a.size;
    let deadline = Instant::now() + Duration::from_secs_f64(a.seconds);
    let spec = TensorSpec::new(DType::U8, &[size as u64]);
    let mut rtts = Vec::new();
    match role {
        "tp-stream" | "tp-ping" => {
            let mut cfg = ProducerConfig::new(role);
            cfg.slots = 8;
            cfg.slot_size = size as u64;
            let mut p = Producer::connect(&sock, cfg)?;
            let ping = role == "tp-ping";
            let mut i = 0;
            while if ping {
                i < a.round_trips
            } else {
                Instant::now() < deadline
            } {
                let t = Instant::now();
                let mut l = p.lease(Duration::from_secs(10))?;
                fill(&mut l.bytes_mut()[..size], i);
                l.submit(&spec)?;
                if ping {
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
        }
        "uds-stream" | "uds-ping" => {
            let mut s = UnixStream::connect(&sock)?;
            let mut buf = vec![0u8; size];
            let mut ack = [0u8; 8];
            let ping = role == "uds-ping";
            let mut i = 0;
            while if ping {
                i < a.round_trips
            } else {
                Instant::now() < deadline
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
        other => return Err(CliError::usage(format!("unknown role {other}"))),
    }
    if !rtts.is_empty() {
        let (a, b, c) = percentiles(rtts);
        println!("{a} {b} {c}");
    }
    Ok(ExitCode::SUCCESS)
}

/// tensorport: `n` producer processes streaming into one in-process server.
fn tp_throughput(exe: &Path, a: &Args, size: usize, n: usize) -> CliResult<f64> {
    let dir = tempfile::Builder::new().prefix("tp-bench-").tempdir()?;
    let sock = dir.path().join("tp.sock");
    let mut cfg = ServerConfig::new(&sock);
    cfg.slot_size = size as u64;
    let server = Server::bind(cfg)?;
    let mut kids: Vec<Child> = (0..n)
        .map(|_| child(exe, "tp-stream", &sock, size, a))
        .collect::<CliResult<_>>()?;
    let (mut count, mut first, mut last) = (0u64, None, Instant::now());
    loop {
        let batch = server.recv_batch(64, Duration::from_millis(200), Duration::ZERO)?;
        if batch.is_empty() {
            if kids.iter_mut().all(|k| matches!(k.try_wait(), Ok(Some(_)))) {
                break;
            }
            continue;
        }
        first.get_or_insert_with(Instant::now);
        for r in batch {
            std::hint::black_box(r.bytes().first());
            count += 1;
            let _ = r.respond(&[]);
        }
        last = Instant::now();
    }
    let secs = first
        .map(|f| last.duration_since(f).as_secs_f64())
        .unwrap_or(0.0);
    Ok(count as f64 / secs.max(1e-9))
}

/// A plain Unix-socket copy: `n` processes write payloads, one reader per connection.
fn uds_throughput(exe: &Path, a: &Args, size: usize, n: usize) -> CliResult<f64> {
    let dir = tempfile::Builder::new().prefix("tp-bench-").tempdir()?;
    let sock = dir.path().join("uds.sock");
    let listener = UnixListener::bind(&sock)?;
    let mut kids: Vec<Child> = (0..n)
        .map(|_| child(exe, "uds-stream", &sock, size, a))
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
    for k in kids.iter_mut() {
        let _ = k.wait();
    }
    let secs = match (t0, t1) {
        (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
        _ => 0.0,
    };
    Ok(total as f64 / secs.max(1e-9))
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

fn latency(exe: &Path, a: &Args, size: usize, tp: bool) -> CliResult<(f64, f64, f64)> {
    let dir = tempfile::Builder::new().prefix("tp-bench-").tempdir()?;
    let sock = dir.path().join("lat.sock");
    let out = if tp {
        let mut cfg = ServerConfig::new(&sock);
        cfg.slot_size = size as u64;
        let server = Server::bind(cfg)?;
        let kid = child(exe, "tp-ping", &sock, size, a)?;
        for _ in 0..a.round_trips {
            let r = server
                .recv_timeout(Duration::from_secs(10))?
                .ok_or_else(|| CliError::new("the latency producer stopped"))?;
            std::hint::black_box(r.bytes().first());
            r.respond(&[])?;
        }
        kid.wait_with_output()?
    } else {
        let listener = UnixListener::bind(&sock)?;
        let kid = child(exe, "uds-ping", &sock, size, a)?;
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; size];
        for _ in 0..a.round_trips {
            s.read_exact(&mut buf)?;
            s.write_all(&[0u8; 8])?;
        }
        kid.wait_with_output()?
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<f64> = text
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    match v[..] {
        [a, b, c] => Ok((a, b, c)),
        _ => Err(CliError::new(format!("latency child printed {text:?}"))),
    }
}

pub fn run(mut a: Args) -> CliResult<ExitCode> {
    if let Some(role) = a.role.clone() {
        return run_child(&a, &role);
    }
    if a.quick {
        a.sizes = vec![4096, 65536];
        a.producers = vec![1];
        a.seconds = 0.2;
        a.round_trips = 200;
    }
    let exe = std::env::current_exe()?;
    println!(
        "tensorport bench — {} cores, {} s per throughput cell, {} round trips per latency cell",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        a.seconds,
        a.round_trips
    );
    println!("\n| payload | producers | tensorport tensors/s | tensorport GB/s | Unix socket msgs/s | Unix socket GB/s | memcpy GB/s |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for &size in &a.sizes {
        let mem = memcpy_gbps(size, a.seconds.min(1.0));
        for &n in &a.producers {
            let tp = tp_throughput(&exe, &a, size, n)?;
            let uds = uds_throughput(&exe, &a, size, n)?;
            println!(
                "| {size} B | {n} | {tp:.0} | {:.2} | {uds:.0} | {:.2} | {mem:.1} |",
                tp * size as f64 / 1e9,
                uds * size as f64 / 1e9
            );
        }
    }
    println!("\n| payload | tensorport one-way p50 / p99 / p99.9 | Unix socket one-way p50 / p99 / p99.9 |");
    println!("| --- | --- | --- |");
    for &size in &a.sizes {
        let (a1, b1, c1) = latency(&exe, &a, size, true)?;
        let (a2, b2, c2) = latency(&exe, &a, size, false)?;
        println!("| {size} B | {a1:.1} / {b1:.1} / {c1:.1} µs | {a2:.1} / {b2:.1} / {c2:.1} µs |");
    }
    Ok(ExitCode::SUCCESS)
}
