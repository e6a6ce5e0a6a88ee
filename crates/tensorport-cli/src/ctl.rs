//! `tensorport ctl`: status and drain of a running server.

use std::time::Duration;

use tensorport::{Control, StatusReport};

use crate::common::{CliResult, SocketArg};

/// Talk to a running server.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Seconds to wait for the server's answer.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=crate::common::MAX_SECS))]
    pub timeout: u64,
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand, Debug)]
pub enum What {
    /// Sessions, slots, requests in flight, throughput and error counts.
    Status {
        /// Print the raw report as JSON.
        #[arg(long)]
        json: bool,
        /// Every server of a farm: the given socket and the ones `farm --servers`/`--devices`
        /// puts beside it (`NAME-1.sock`, `NAME-2.sock`, …), each shown, then their totals.
        #[arg(long)]
        farm: bool,
    },
    /// Finish the work in flight, refuse new producers, and exit once the producers have left.
    Drain,
}

pub fn run(a: Args) -> CliResult<u8> {
    if let What::Status { json, farm: true } = a.what {
        return farm_status(&a.socket.path(), a.timeout, json);
    }
    let mut c = Control::connect(a.socket.path(), Duration::from_secs(a.timeout.max(1)))?;
    match a.what {
        What::Status { json, .. } => {
            let s = c.status()?;
            if json {
                println!("{}", status_json(&s));
            } else {
                print!("{}", render(&s));
            }
        }
        What::Drain => {
            c.drain()?;
            println!("draining: the server exits once its producers have left");
        }
    }
    Ok(0)
}

fn status_json(s: &StatusReport) -> serde_json::Value {
    serde_json::json!({
        "pid": s.pid,
        "uptime_ms": s.uptime_ms,
        "draining": s.draining,
        "totals": {
            "submitted": s.totals.submitted,
            "completed": s.totals.completed,
            "bytes": s.totals.bytes,
            "protocol_errors": s.totals.protocol_errors,
            "sessions_opened": s.totals.sessions_opened,
            "sessions_reclaimed": s.totals.sessions_reclaimed,
            "connections_refused": s.totals.connections_refused,
            "batches": s.totals.batches,
            "batched": s.totals.batched,
        },
        "sessions": s.sessions.iter().map(|x| serde_json::json!({
            "session_id": x.session_id, "name": x.name, "pid": x.pid, "slots": x.slots,
            "granted": x.granted, "in_flight": x.in_flight, "submitted": x.submitted,
            "completed": x.completed, "errors": x.errors,
        })).collect::<Vec<_>>(),
    })
}

/// The human-readable status.
pub fn render(s: &StatusReport) -> String {
    let t = &s.totals;
    let secs = (s.uptime_ms as f64 / 1e3).max(1e-3);
    let fill = if t.batches > 0 {
        t.batched as f64 / t.batches as f64
    } else {
        0.0
    };
    let mut out = format!(
        "server pid {}  up {:.1}s{}\n\
         requests  {} submitted, {} completed ({:.1}/s), {:.1} MB handed over\n\
         batches   {} (mean fill {:.1})\n\
         sessions  {} open, {} opened, {} reclaimed after a crash; {} connections refused, {} protocol errors\n",
        s.pid,
        secs,
        if s.draining { "  DRAINING" } else { "" },
        t.submitted,
        t.completed,
        t.completed as f64 / secs,
        t.bytes as f64 / 1e6,
        t.batches,
        fill,
        s.sessions.len(),
        t.sessions_opened,
        t.sessions_reclaimed,
        t.connections_refused,
        t.protocol_errors,
    );
    if !s.sessions.is_empty() {
        out.push_str("  id  name                 pid      slots granted in-flight submitted completed errors\n");
        for x in &s.sessions {
            out.push_str(&format!(
                "  {:<3} {:<20} {:<8} {:>5} {:>7} {:>9} {:>9} {:>9} {:>6}\n",
                x.session_id,
                x.name,
                x.pid,
                x.slots,
                x.granted,
                x.in_flight,
                x.submitted,
                x.completed,
                x.errors
            ));
        }
    }
    out
}

/// The sockets of a farm whose first server listens at `first`: it, then `STEM-1.sock`,
/// `STEM-2.sock`… for as long as they exist.
pub fn farm_sockets(first: &std::path::Path) -> Vec<std::path::PathBuf> {
    let stem = first
        .file_stem()
        .map_or("tensorport".into(), |s| s.to_string_lossy().into_owned());
    let mut v = vec![first.to_path_buf()];
    for k in 1.. {
        let p = first.with_file_name(format!("{stem}-{k}.sock"));
        if !p.exists() {
            break;
        }
        v.push(p);
    }
    v
}

/// `status --farm`: each server's status, then the farm's totals.
fn farm_status(first: &std::path::Path, timeout: u64, json: bool) -> CliResult<u8> {
    let sockets = farm_sockets(first);
    let mut reports = Vec::with_capacity(sockets.len());
    for s in &sockets {
        let mut c = Control::connect(s, Duration::from_secs(timeout.max(1)))?;
        reports.push(c.status()?);
    }
    let sum = |f: &dyn Fn(&StatusReport) -> u64| reports.iter().map(f).sum::<u64>();
    let (submitted, completed) = (sum(&|r| r.totals.submitted), sum(&|r| r.totals.completed));
    let sessions = sum(&|r| r.sessions.len() as u64);
    if json {
        let servers: Vec<_> = sockets
            .iter()
            .zip(&reports)
            .map(|(s, r)| serde_json::json!({"socket": s.display().to_string(), "status": status_json(r)}))
            .collect();
        let v = serde_json::json!({
            "servers": servers,
            "totals": {"servers": reports.len(), "sessions": sessions, "submitted": submitted, "completed": completed},
        });
        println!("{v}");
        return Ok(0);
    }
    for (s, r) in sockets.iter().zip(&reports) {
        println!("== {}", s.display());
        print!("{}", render(r));
    }
    println!(
        "farm      {} servers, {sessions} sessions; {submitted} requests submitted, {completed} completed",
        reports.len()
    );
    Ok(0)
}
