//! What the farm shows: log lines and the live progress block (the farm's [`Report`]), and the
//! summary at the end.

use std::sync::Mutex;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tensorport_farm::farm::{ChildRow, ChildState, Report, Snapshot, Summary};

use crate::common::plural;

/// Log lines and the live progress block. indicatif redraws the block in place and prints log
/// lines above it without tearing either; off a terminal the block is hidden and log lines go
/// straight to stderr.
pub struct Console {
    multi: MultiProgress,
    overall: ProgressBar,
    rows: Mutex<Vec<ProgressBar>>,
    /// Whether the block is drawn.
    live: bool,
}

impl Console {
    pub fn new(draw: bool, inputs: u64) -> Console {
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
            live: draw,
        }
    }

    pub fn log(&self, line: &str) {
        self.multi.suspend(|| eprintln!("{line}"));
    }

    /// Shows `done` inputs with `summary` beside the bar, and one line per entry of `rows`.
    pub fn draw(&self, done: u64, summary: String, rows: &[String]) {
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

    pub fn clear(&self) {
        let _ = self.multi.clear();
    }
}

impl Report for Console {
    fn log(&self, line: &str) {
        Console::log(self, line)
    }

    fn wants_progress(&self) -> bool {
        self.live
    }

    fn progress(&self, snap: &Snapshot) {
        let (summary, rows) = progress(snap);
        self.draw(snap.done, summary, &rows);
    }
}

/// The line beside the progress bar, and one row for each server and producer.
fn progress(snap: &Snapshot) -> (String, Vec<String>) {
    let secs = snap.elapsed.as_secs_f64();
    let summary = format!(
        "{:.1} images/s  handed out {}  errors {}  batches {} (mean {:.1})  {:.1}s",
        snap.done as f64 / secs.max(1e-3),
        snap.handed_out,
        snap.errors,
        snap.batches.0,
        if snap.batches.0 > 0 {
            snap.batches.1 as f64 / snap.batches.0 as f64
        } else {
            0.0
        },
        secs
    );
    let mut rows: Vec<String> = snap
        .servers
        .iter()
        .map(|s| {
            format!(
                "  {:<11} {}  {}",
                s.name,
                state(s),
                plural(s.restarts, "restart")
            )
        })
        .collect();
    for w in &snap.producers {
        rows.push(format!(
            "  {:<11} {:<40} done {:<6} handed out {:<3} {}",
            w.name,
            state(w),
            w.done,
            w.handed_out,
            plural(w.restarts, "restart")
        ));
    }
    (summary, rows)
}

/// A child's state in words.
fn state(row: &ChildRow) -> String {
    let exit = |e: &Option<String>| e.clone().unwrap_or_else(|| "?".into());
    match &row.state {
        ChildState::Running { pid } => format!("running, pid {pid}"),
        ChildState::Starting { pid: Some(pid) } => format!("starting, pid {pid}"),
        ChildState::Starting { pid: None } => "starting".into(),
        ChildState::Restarting { after: None, .. } => "restarting".into(),
        ChildState::Restarting {
            after: Some(d),
            last_exit,
        } => format!(
            "restarting in {:.1}s ({})",
            d.as_secs_f64(),
            exit(last_exit)
        ),
        ChildState::GaveUp { last_exit } => format!("gave up ({})", exit(last_exit)),
        ChildState::Attached => "attached".into(),
    }
}

/// The rates after start-up: from the first result to the last, and, where some producers
/// returned their first result clearly later than others (GPU producers starting their CUDA
/// contexts beside CPU producers: more than a twentieth of the span from the first result to
/// the last), from the moment every producer had returned one.
fn after_start_up(s: &Summary) -> String {
    let (Some(first), Some(last)) = (s.first_result, s.last_result) else {
        return String::new();
    };
    if s.done <= 1 || last <= first {
        return String::new();
    }
    let mut text = format!(
        "; {:.1} after start-up ({:.2} s to the first result",
        (s.done - 1) as f64 / (last - first).as_secs_f64(),
        first.as_secs_f64()
    );
    match s.all_running {
        Some((all, after))
            if all.saturating_sub(first) * 20 > last - first && last > all && after > 1 =>
        {
            text += &format!(
                "; {:.1} with every producer running, from {:.2} s)",
                after as f64 / (last - all).as_secs_f64(),
                all.as_secs_f64()
            );
        }
        _ => text.push(')'),
    }
    text
}

/// The summary printed at the end of a run (and the per-stage means when profiled).
pub fn print_summary(s: &Summary) {
    let secs = s.elapsed.as_secs_f64();
    let fill = if s.batches.0 > 0 {
        s.batches.1 as f64 / s.batches.0 as f64
    } else {
        0.0
    };
    println!(
        "inputs      {}\n\
         done        {} ({} with errors){}\n\
         time        {secs:.2} s\n\
         throughput  {:.1} images/s{}\n\
         latency     p50 {:.1} ms, p99 {:.1} ms (lease to result)\n\
         batches     {} (mean fill {fill:.1} of {}){}\n\
         producers   {} ({}{}), server restarts {}\n\
         results     {}",
        s.inputs,
        s.done,
        s.errors,
        if s.done < s.inputs {
            "  INCOMPLETE"
        } else {
            ""
        },
        s.done as f64 / secs.max(1e-9),
        after_start_up(s),
        s.latency_ms.0,
        s.latency_ms.1,
        s.batches.0,
        s.max_batch,
        if s.server_restarts > 0 {
            " since the last server start"
        } else {
            ""
        },
        match s.gpu_producers {
            (0, _) => s.producers.0.to_string(),
            (g, _) => format!("{} CPU, {g} GPU", s.producers.0),
        },
        plural(s.producer_restarts, "restart"),
        if s.moves > 0 {
            format!(", {} moved to a faster server", s.moves)
        } else {
            String::new()
        },
        s.server_restarts,
        s.output.display()
    );
    if s.gpu_producers.0 > 0 {
        println!(
            "by kind     CPU producers {} results, GPU producers {}",
            s.producers.1, s.gpu_producers.1
        );
    }
    if let Some((st, k)) = s.stages {
        let k = k as f64;
        println!(
            "stages      per input, mean ms: read {:.3} (read ahead), decode {:.3}, resize {:.3}, normalise {:.3}\n\
             \x20           hand-off: lease wait {:.3}, submit {:.3}; submit to result {:.2}\n\
             \x20           one producer prepares {:.0} inputs/s (decode + resize + normalise)",
            st.read_ms / k,
            st.decode_ms / k,
            st.resize_ms / k,
            st.normalise_ms / k,
            st.lease_ms / k,
            st.submit_ms / k,
            st.result_ms / k,
            k * 1e3 / (st.decode_ms + st.resize_ms + st.normalise_ms).max(1e-9),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn summary(first: f64, all: Option<(f64, u64)>, last: f64, done: u64) -> Summary {
        Summary {
            inputs: done,
            done,
            errors: 0,
            elapsed: Duration::from_secs_f64(last + 0.5),
            first_result: Some(Duration::from_secs_f64(first)),
            last_result: Some(Duration::from_secs_f64(last)),
            all_running: all.map(|(t, n)| (Duration::from_secs_f64(t), n)),
            latency_ms: (1.0, 2.0),
            batches: (1, done),
            max_batch: 32,
            server_restarts: 0,
            producers: (12, done / 2),
            gpu_producers: (2, done / 2),
            producer_restarts: 0,
            moves: 0,
            output: "out.jsonl".into(),
            stages: None,
        }
    }

    #[test]
    fn the_rate_with_every_producer_running_is_shown_where_it_came_later() {
        // 1,001 results from 1 s to 3 s; every producer running from 2 s, 800 results after.
        assert_eq!(
            after_start_up(&summary(1.0, Some((2.0, 800)), 3.0, 1001)),
            "; 500.0 after start-up (1.00 s to the first result; 800.0 with every producer \
             running, from 2.00 s)"
        );
        // Every producer's first result came with the run's first, soon after it (a twentieth
        // of the span or less), or too few results after it.
        for all in [
            None,
            Some((1.0, 1000)),
            Some((1.1, 950)),
            Some((2.0, 1)),
            Some((3.0, 0)),
        ] {
            assert_eq!(
                after_start_up(&summary(1.0, all, 3.0, 1001)),
                "; 500.0 after start-up (1.00 s to the first result)"
            );
        }
        // One result: no rate at all.
        assert_eq!(after_start_up(&summary(1.0, None, 1.0, 1)), "");
    }
}
