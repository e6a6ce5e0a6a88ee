//! `tensorport-dev soak`: long farm load with random producer kills, watching the server for leaks.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::common::{CliError, CliResult};

/// Run a server and N producers for a long time, SIGKILLing a random producer every
/// --kill-every-ms (and starting a new one), and print the server's open fds, resident memory,
/// mapped pool bytes and throughput every --interval. At the end all producers stop and the
/// server's figures are compared with those before the first producer connected: they must be
/// flat. Not a test to run in CI: it takes as long as you ask.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 600)]
    pub seconds: u64,
    /// Producer processes.
    #[arg(long, short = 'p', default_value_t = 4)]
    pub producers: usize,
    /// Kill a random producer this often, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub kill_every_ms: u64,
    /// Print a sample this often, in seconds.
    #[arg(long, default_value_t = 30)]
    pub interval: u64,
    /// Side of the square images (smaller: more hand-offs per second).
    #[arg(long, default_value_t = 64)]
    pub image_size: usize,
}

struct Sample {
    fds: usize,
    rss_kib: u64,
    mapped: u64,
    completed: u64,
    sessions: usize,
}

fn sample(pid: u32, socket: &Path) -> CliResult<Sample> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut mapped = 0;
    for l in std::fs::read_to_string(format!("/proc/{pid}/maps"))?.lines() {
        if l.contains("memfd:tensorport-pool") {
            if let Some((a, b)) = l.split_whitespace().next().and_then(|r| r.split_once('-')) {
                let (a, b) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16));
                if let (Ok(a), Ok(b)) = (a, b) {
                    mapped += b - a;
                }
            }
        }
    }
    let st = tensorport::Control::connect(socket, Duration::from_secs(2))?.status()?;
    Ok(Sample {
        fds,
        rss_kib,
        mapped,
        completed: st.totals.completed,
        sessions: st.sessions.len(),
    })
}

fn spawn(exe: &Launcher, args: &[String]) -> CliResult<Child> {
    exe.command()
        .args(args)
        .env(
            tensorport_farm::process::FARM_PID_ENV,
            std::process::id().to_string(),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| CliError::new(format!("cannot start {}: {e}", args[2])))
}

use std::os::unix::process::CommandExt;

use tensorport_farm::config::Launcher;

pub fn run(a: Args) -> CliResult<u8> {
    let exe = crate::launcher();
    if !exe.program.is_file() {
        return Err(CliError::new(format!(
            "soak runs the tensorport executable beside this one, {}, which is not there: build both (cargo build --release)",
            exe.program.display()
        )));
    }
    let tmp = tempfile::Builder::new()
        .prefix("tensorport-soak-")
        .tempdir()?;
    let socket: PathBuf = tmp.path().join("tensorport.sock");
    let sock = socket.display().to_string();
    let size = a.image_size.to_string();
    let mut server = spawn(
        &exe,
        &[
            "--log".into(),
            "error".into(),
            "serve".into(),
            "--socket".into(),
            sock.clone(),
            "--image-size".into(),
            size.clone(),
            "--width".into(),
            "4".into(),
            "--max-sessions".into(),
            (a.producers + 4).to_string(),
        ],
    )?;
    let mut line = String::new();
    BufReader::new(server.stdout.take().expect("piped")).read_line(&mut line)?;
    if !line.starts_with("ready") {
        return Err(CliError::new("the server did not start"));
    }
    let pid = server.id();
    let stop = tensorport_farm::process::Stop::new();
    stop.on_signals(true)
        .map_err(|e| CliError::new(format!("cannot handle SIGINT/SIGTERM: {e}")))?;
    let base = sample(pid, &socket)?;
    println!(
        "baseline (no producers): fds {}, RSS {:.1} MiB, mapped pools {} B",
        base.fds,
        base.rss_kib as f64 / 1024.0,
        base.mapped
    );
    println!(
        "{:>7} {:>9} {:>6} {:>9} {:>12} {:>9} {:>6}",
        "t (s)", "images/s", "fds", "RSS MiB", "mapped MiB", "sessions", "kills"
    );
    let producer_args = |i: usize, gen: u64| -> Vec<String> {
        vec![
            "--log".into(),
            "error".into(),
            "produce".into(),
            "--socket".into(),
            sock.clone(),
            "--synthetic".into(),
            "1000000000000".into(),
            "--output".into(),
            "/dev/null".into(),
            "--image-size".into(),
            size.clone(),
            "--name".into(),
            format!("soak-{i}-{gen}"),
        ]
    };
    let mut producers: Vec<Child> = Vec::new();
    for i in 0..a.producers {
        producers.push(spawn(&exe, &producer_args(i, 0))?);
    }
    let started = Instant::now();
    let (mut last_t, mut last_done) = (started, base.completed);
    let mut next_kill = started + Duration::from_millis(a.kill_every_ms);
    let mut next_sample = started + Duration::from_secs(a.interval.max(1));
    let (mut kills, mut rng) = (0u64, 0x2545F4914F6CDD1Du64);
    while started.elapsed() < Duration::from_secs(a.seconds) && !stop.draining() {
        std::thread::sleep(Duration::from_millis(20));
        let now = Instant::now();
        if now >= next_kill {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let i = (rng % producers.len() as u64) as usize;
            let _ = producers[i].kill();
            let _ = producers[i].wait();
            kills += 1;
            producers[i] = spawn(&exe, &producer_args(i, kills))?;
            next_kill = now + Duration::from_millis(a.kill_every_ms);
        }
        if now >= next_sample {
            let s = sample(pid, &socket)?;
            let rate = (s.completed - last_done) as f64 / now.duration_since(last_t).as_secs_f64();
            (last_t, last_done) = (now, s.completed);
            println!(
                "{:>7.0} {:>9.1} {:>6} {:>9.1} {:>12.1} {:>9} {:>6}",
                started.elapsed().as_secs_f64(),
                rate,
                s.fds,
                s.rss_kib as f64 / 1024.0,
                s.mapped as f64 / (1 << 20) as f64,
                s.sessions,
                kills
            );
            next_sample = now + Duration::from_secs(a.interval.max(1));
        }
    }
    for p in producers.iter_mut() {
        let _ = p.kill();
        let _ = p.wait();
    }
    // Let the server notice and reclaim the last sessions.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut end = sample(pid, &socket)?;
    while (end.sessions > 0 || end.mapped > 0 || end.fds > base.fds) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        end = sample(pid, &socket)?;
    }
    let st = tensorport::Control::connect(&socket, Duration::from_secs(2))?.status()?;
    let _ = server.kill();
    let _ = server.wait();
    let secs = started.elapsed().as_secs_f64();
    let flat = end.fds <= base.fds && end.mapped == 0 && end.rss_kib < base.rss_kib + 64 * 1024;
    println!(
        "\n{:.0} s, {kills} producers killed, {} sessions reclaimed, {} images ({:.1}/s)\n\
         server fds {} -> {}, RSS {:.1} -> {:.1} MiB, mapped pools {} -> {} B: {}",
        secs,
        st.totals.sessions_reclaimed,
        end.completed,
        end.completed as f64 / secs,
        base.fds,
        end.fds,
        base.rss_kib as f64 / 1024.0,
        end.rss_kib as f64 / 1024.0,
        base.mapped,
        end.mapped,
        if flat { "flat" } else { "NOT FLAT" }
    );
    Ok(if flat { 0 } else { 1 })
}
