//! What the farm shows: log lines and the live progress block, and the summary at the end.

use std::sync::Mutex;
use std::time::Instant;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::children::State;
use super::supervisor::Supervisor;
use crate::common::plural;

/// Log lines and the live progress block. indicatif redraws the block in place and prints log
/// lines above it without tearing either; off a terminal the block is hidden and log lines go
/// straight to stderr.
pub(super) struct Console {
    multi: MultiProgress,
    overall: ProgressBar,
    rows: Mutex<Vec<ProgressBar>>,
}

impl Console {
    pub(super) fn new(draw: bool, inputs: u64) -> Console {
        let target = if draw {
            // Not `ProgressDrawTarget::stderr()`: that hides itself off a terminal, and
            // `--progress always` means always.
            ProgressDrawTarget::term_like_with_hz(Box::new(console::Term::stderr()), 4)
        } else {
            ProgressDrawTarget::hidden()
        };
        let multi = MultiProgress::with_draw_target(target);
        let style = ProgressStyle::with_template(
            "tensorport farm [{bar:30}] {pos}/{len} ({percent}%) {msg}",
        )
        .expect("a valid template")
        .progress_chars("=> ");
        let overall = multi.add(ProgressBar::new(inputs).with_style(style));
        Console {
            multi,
            overall,
            rows: Mutex::new(Vec::new()),
        }
    }

    pub(super) fn log(&self, line: &str) {
        self.multi.suspend(|| eprintln!("{line}"));
    }

    /// Shows `done` inputs with `summary` beside the bar, and one line per entry of `rows`.
    pub(super) fn draw(&self, done: u64, summary: String, rows: &[String]) {
        self.overall.set_position(done);
        self.overall.set_message(summary);
        let mut bars = self.rows.lock().unwrap();
        while bars.len() < rows.len() {
            let style = ProgressStyle::with_template("{msg}").expect("a valid template");
            bars.push(self.multi.add(ProgressBar::new(0).with_style(style)));
        }
        for (bar, row) in bars.iter().zip(rows) {
            bar.set_message(row.clone());
        }
    }

    pub(super) fn clear(&self) {
        let _ = self.multi.clear();
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// The line beside the progress bar, and one row for the server and each producer.
pub(super) fn progress(
    sup: &Supervisor,
    started: Instant,
    batches: (u64, u64),
) -> (String, Vec<String>) {
    let secs = started.elapsed().as_secs_f64();
    let summary = format!(
        "{:.1} images/s  handed out {}  errors {}  batches {} (mean {:.1})  {:.1}s",
        sup.done_count as f64 / secs.max(1e-3),
        sup.in_flight(),
        sup.errors,
        batches.0,
        if batches.0 > 0 {
            batches.1 as f64 / batches.0 as f64
        } else {
            0.0
        },
        secs
    );
    let mut rows: Vec<String> = sup
        .servers
        .iter()
        .enumerate()
        .map(|(k, s)| {
            format!(
                "  {:<11} {}  {}",
                sup.farm.server_name(k),
                match (&s.child, s.ready) {
                    (Some(c), true) => format!("running, pid {}", c.id()),
                    (Some(c), false) => format!("starting, pid {}", c.id()),
                    (None, _) => "restarting".into(),
                },
                plural(s.restarts, "restart")
            )
        })
        .collect();
    for w in &sup.workers {
        let state = match &w.state {
            State::Running { child, .. } => format!("running, pid {}", child.id()),
            State::Waiting { .. } if w.generation == 0 => "starting".into(),
            State::Waiting { until } => format!(
                "restarting in {:.1}s ({})",
                until
                    .saturating_duration_since(Instant::now())
                    .as_secs_f64(),
                w.last_exit.as_deref().unwrap_or("?")
            ),
            State::GaveUp => format!("gave up ({})", w.last_exit.as_deref().unwrap_or("?")),
        };
        rows.push(format!(
            "  {:<11} {state:<40} done {:<6} handed out {:<3} {}",
            w.name,
            w.done,
            w.assigned.len(),
            plural(w.restarts, "restart")
        ));
    }
    (summary, rows)
}

/// The summary printed at the end of a run (and the per-stage means with `--profile`).
pub(super) fn print_summary(sup: &mut Supervisor, started: Instant, batches: (u64, u64)) {
    let (n, done_count, errors) = (sup.n, sup.done_count, sup.errors);
    let args = &sup.farm.args;
    let secs = started.elapsed().as_secs_f64();
    sup.latencies.sort_by(f64::total_cmp);
    let restarts: u32 = sup.workers.iter().map(|w| w.restarts).sum();
    let fill = if batches.0 > 0 {
        batches.1 as f64 / batches.0 as f64
    } else {
        0.0
    };
    println!(
        "inputs      {n}\n\
         done        {done_count} ({errors} with errors){}\n\
         time        {secs:.2} s\n\
         throughput  {:.1} images/s{}\n\
         latency     p50 {:.1} ms, p99 {:.1} ms (lease to result)\n\
         batches     {} (mean fill {fill:.1} of {}){}\n\
         producers   {} ({}{}), server restarts {}\n\
         results     {}",
        if done_count < n { "  INCOMPLETE" } else { "" },
        done_count as f64 / secs.max(1e-9),
        match sup.first_result {
            Some(first) if done_count > 1 && sup.last_result > first => format!(
                "; {:.1} after start-up ({:.2} s to the first result)",
                (done_count - 1) as f64 / (sup.last_result - first).as_secs_f64(),
                (first - started).as_secs_f64()
            ),
            _ => String::new(),
        },
        percentile(&sup.latencies, 0.5),
        percentile(&sup.latencies, 0.99),
        batches.0,
        args.model.max_batch,
        if sup.server_restarts() > 0 {
            " since the last server start"
        } else {
            ""
        },
        args.producers,
        plural(restarts, "restart"),
        if sup.moves > 0 {
            format!(", {} moved to a faster server", sup.moves)
        } else {
            String::new()
        },
        sup.server_restarts(),
        args.output.display()
    );
    if sup.profiled > 0 {
        let k = sup.profiled as f64;
        let s = sup.stage_sum;
        println!(
            "stages      per input, mean ms: read {:.3} (read ahead), decode {:.3}, resize {:.3}, normalise {:.3}\n\
             \x20           hand-off: lease wait {:.3}, submit {:.3}; submit to result {:.2}\n\
             \x20           one producer prepares {:.0} inputs/s (decode + resize + normalise)",
            s.read_ms / k,
            s.decode_ms / k,
            s.resize_ms / k,
            s.normalise_ms / k,
            s.lease_ms / k,
            s.submit_ms / k,
            s.result_ms / k,
            k * 1e3 / (s.decode_ms + s.resize_ms + s.normalise_ms).max(1e-9),
        );
    }
}
