//! What a run's results add up to: errors, latencies, stage times, and when the first and the
//! last result came (the rate between them leaves the start-up out: the server and its device,
//! the producers and their pools, as the DataLoader's benchmark leaves its workers' start-up
//! out), and when every producer had returned one (the rate after that leaves out the time when
//! only the producers that start fastest ran: CPU producers before the GPU producers' CUDA
//! contexts, one server before another).

use std::time::{Duration, Instant};

use crate::record::{ResultLine, StageTimes};

pub(super) struct RunStats {
    pub(super) errors: u64,
    latencies: Vec<f64>,
    stage_sum: StageTimes,
    profiled: u64,
    first_result: Option<Instant>,
    last_result: Instant,
    /// When every producer had returned a result, and the results by then.
    all_running: Option<(Instant, u64)>,
    /// Results counted.
    results: u64,
}

impl RunStats {
    /// For a run of about `n` inputs.
    pub(super) fn new(n: u64) -> RunStats {
        RunStats {
            errors: 0,
            latencies: Vec::with_capacity(n as usize),
            stage_sum: StageTimes::default(),
            profiled: 0,
            first_result: None,
            last_result: Instant::now(),
            all_running: None,
            results: 0,
        }
    }

    /// Counts an input's first result.
    pub(super) fn record(&mut self, r: &ResultLine) {
        self.last_result = Instant::now();
        self.first_result.get_or_insert(self.last_result);
        self.results += 1;
        if r.error.is_some() {
            self.errors += 1;
        }
        self.latencies.push(r.latency_ms);
        if let Some(st) = r.stages {
            self.stage_sum += st;
            self.profiled += 1;
        }
    }

    /// Whether the moment every producer had returned a result is known.
    pub(super) fn all_running_known(&self) -> bool {
        self.all_running.is_some()
    }

    /// Notes that every producer has now returned a result (the result just recorded being
    /// the last of their first ones); only the first time counts.
    pub(super) fn all_running(&mut self) {
        self.all_running
            .get_or_insert((self.last_result, self.results));
    }

    /// When every producer had returned a result, from `started`, and how many results came
    /// after that moment (up to the last).
    pub(super) fn since_all_running(&self, started: Instant) -> Option<(Duration, u64)> {
        self.all_running
            .map(|(t, n)| (t.saturating_duration_since(started), self.results - n))
    }

    /// When the first and the last result came, from `started`.
    pub(super) fn span(&self, started: Instant) -> (Option<Duration>, Option<Duration>) {
        let since = |t: Instant| t.saturating_duration_since(started);
        (
            self.first_result.map(since),
            self.first_result.map(|_| since(self.last_result)),
        )
    }

    /// The latencies' median and 99th percentile, in milliseconds.
    pub(super) fn latency_ms(&mut self) -> (f64, f64) {
        self.latencies.sort_by(f64::total_cmp);
        (
            percentile(&self.latencies, 0.5),
            percentile(&self.latencies, 0.99),
        )
    }

    /// The stage times summed over the profiled inputs, and how many there were.
    pub(super) fn stages(&self) -> Option<(StageTimes, u64)> {
        (self.profiled > 0).then_some((self.stage_sum, self.profiled))
    }
}

/// The value at fraction `p` of `sorted`.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(latency_ms: f64, error: bool) -> ResultLine {
        ResultLine {
            index: 0,
            input: "synthetic:0".into(),
            input_bytes: None,
            class: None,
            scores: None,
            top_k: None,
            error: error.then(|| "bad".into()),
            latency_ms,
            producer: "p".into(),
            stages: None,
        }
    }

    #[test]
    fn latencies_errors_and_the_span_add_up() {
        let started = Instant::now();
        let mut s = RunStats::new(4);
        assert_eq!(s.span(started), (None, None));
        assert_eq!(s.latency_ms(), (0.0, 0.0));
        for (ms, err) in [(4.0, false), (1.0, true), (3.0, false), (2.0, false)] {
            s.record(&line(ms, err));
        }
        assert_eq!(s.errors, 1);
        assert_eq!(s.latency_ms(), (3.0, 4.0));
        let (first, last) = s.span(started);
        assert!(first.unwrap() <= last.unwrap());
        assert!(s.stages().is_none());
        assert_eq!(s.since_all_running(started), None);
    }

    #[test]
    fn the_moment_every_producer_runs_counts_the_results_after_it_once() {
        let started = Instant::now();
        let mut s = RunStats::new(5);
        s.record(&line(1.0, false));
        s.record(&line(1.0, false));
        s.all_running();
        let (at, after) = s.since_all_running(started).unwrap();
        assert_eq!(after, 0);
        s.record(&line(1.0, false));
        s.record(&line(1.0, false));
        // A restarted producer's first result again does not move the moment.
        s.all_running();
        s.record(&line(1.0, false));
        let (again, after) = s.since_all_running(started).unwrap();
        assert_eq!((again, after), (at, 3));
        let (first, last) = s.span(started);
        assert!(first.unwrap() <= at && at <= last.unwrap());
    }
}
