//! When a model worker stops taking requests for its next batch, and what its engine's time went
//! to. An engine that pads every batch to a fixed shape (ONNX Runtime's sessions on a GPU) runs
//! a batch of 90 images in the time of 128: while it runs the last batch, the worker keeps
//! taking requests for the next one until that one must be gathered so as to be ready when the
//! engine is free ([`Pace::take_until`]); the engine's own measure of its run time and the
//! worker's of its gathers decide when that is.

use std::time::{Duration, Instant};

/// A moving mean of durations (the last few dozen weigh most) and their sum.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RunTimes {
    mean: Option<Duration>,
    /// Every duration recorded, added up.
    pub total: Duration,
    /// How many were recorded.
    pub count: u64,
}

impl RunTimes {
    /// Adds one.
    pub fn record(&mut self, d: Duration) {
        self.total += d;
        self.count += 1;
        self.mean = Some(match self.mean {
            None => d,
            // One part in eight: a change of batch shape or of load shows within a few dozen.
            Some(m) => m.mul_f64(0.875) + d.mul_f64(0.125),
        });
    }

    /// The moving mean, once one was recorded.
    pub fn mean(&self) -> Option<Duration> {
        self.mean
    }
}

/// Room left between the end of a gather and the engine becoming free, for the submit and the
/// gathers that take longer than most.
const MARGIN: Duration = Duration::from_micros(300);

/// A worker's batches through its engine: when the engine will be free, how long gathers take.
#[derive(Debug, Default)]
pub struct Pace {
    /// When the engine will have run every batch submitted to it, as estimated; `None` when a
    /// batch's run time is not known (nothing measured yet, or an engine that does not say).
    free_at: Option<Instant>,
    gathers: RunTimes,
}

impl Pace {
    /// Until when the worker takes requests for its next batch, now that it is `now` and the
    /// engine holds a batch: the engine's free time less a gather and a margin. `None` when
    /// that is not known or already past: take only what is queued.
    pub fn take_until(&self, now: Instant) -> Option<Instant> {
        let free = self.free_at?;
        let gather = self.gathers.mean().unwrap_or(Duration::ZERO);
        let by = free.checked_sub(gather.mul_f64(1.25) + MARGIN)?;
        (by > now).then_some(by)
    }

    /// A batch took `took` to gather.
    pub fn gathered(&mut self, took: Duration) {
        self.gathers.record(took);
    }

    /// A batch was submitted at `now`, to run for `run` (as its engine measures; `None` if it
    /// does not say) after those before it.
    pub fn submitted(&mut self, now: Instant, run: Option<Duration>) {
        self.free_at = match run {
            Some(run) => Some(self.free_at.map_or(now, |f| f.max(now)) + run),
            None => None,
        };
    }

    /// The oldest batch's scores came back at `now`; `next` is the run time of the batch
    /// queued behind it, if any, which started as it ended.
    pub fn collected(&mut self, now: Instant, next: Option<Option<Duration>>) {
        self.free_at = match next {
            None => None,
            Some(run) => run.map(|r| now + r),
        };
    }

    /// The gathers so far.
    pub fn gathers(&self) -> RunTimes {
        self.gathers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_moving_mean_follows_the_recent_runs_and_the_sum_keeps_all() {
        let mut r = RunTimes::default();
        assert_eq!(r.mean(), None);
        r.record(10 * MS);
        assert_eq!(r.mean(), Some(10 * MS));
        for _ in 0..60 {
            r.record(20 * MS);
        }
        let m = r.mean().unwrap();
        assert!(m > 19 * MS && m <= 20 * MS, "{m:?}");
        assert_eq!(r.count, 61);
        assert_eq!(r.total, 10 * MS + 60 * 20 * MS);
    }

    #[test]
    fn requests_are_taken_until_the_next_batch_must_be_gathered() {
        let t0 = Instant::now();
        let mut p = Pace::default();
        p.gathered(2 * MS);
        p.submitted(t0, Some(10 * MS));
        // Free at 10 ms; a gather of 2 ms (counted 2.5) and the margin before it.
        assert_eq!(
            p.take_until(t0),
            Some(t0 + 10 * MS - (25 * MS / 10) - MARGIN)
        );
        // Past that: only what is queued.
        assert_eq!(p.take_until(t0 + 8 * MS), None);
    }

    #[test]
    fn a_batch_queued_behind_another_runs_after_it_and_restarts_the_clock_when_collected() {
        let t0 = Instant::now();
        let mut p = Pace::default();
        p.submitted(t0, Some(10 * MS));
        p.submitted(t0 + MS, Some(10 * MS));
        assert_eq!(p.free_at, Some(t0 + 20 * MS));
        // The first came back late, at 12 ms: the second started then.
        p.collected(t0 + 12 * MS, Some(Some(10 * MS)));
        assert_eq!(p.free_at, Some(t0 + 22 * MS));
        assert_eq!(p.take_until(t0 + 12 * MS), Some(t0 + 22 * MS - MARGIN));
        // Nothing left in the engine, or a run of unknown length: nothing to wait for.
        p.collected(t0 + 22 * MS, None);
        assert_eq!(p.take_until(t0), None);
        p.submitted(t0, None);
        assert_eq!(p.take_until(t0), None);
    }
}
