//! Which kind of producer bounds a farm with both kinds, now: the work left for each kind
//! (the inputs its producers hold and those queued for it) over the rate it has shown. A CPU
//! producer takes a plain JPEG — the GPU producers' kind — only while the GPU producers would
//! finish later than the CPU producers: a large plain JPEG costs a CPU producer tens of
//! milliseconds that a JPEG engine spends a few on, which helps where the GPU producers are
//! behind (a folder of baseline photos) and delays the run where the CPU producers are
//! (progressive photos waiting for them).

use std::time::{Duration, Instant};

/// Results a kind must have returned, and time since its first, before its rate counts: a
/// GPU producer answers in batches, so its first results say little about its rate.
const MIN_RESULTS: u64 = 64;
const MIN_TIME: Duration = Duration::from_secs(1);

/// One kind of producer's results so far, for its rate.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Pace {
    /// When its first result came.
    first: Option<Instant>,
    /// Results since (the first included).
    results: u64,
}

impl Pace {
    /// One more result, at `now`.
    pub(super) fn result(&mut self, now: Instant) {
        self.first.get_or_insert(now);
        self.results += 1;
    }

    /// Results per second since its first, once there are [`MIN_RESULTS`] over [`MIN_TIME`].
    pub(super) fn rate(&self, now: Instant) -> Option<f64> {
        let secs = now.saturating_duration_since(self.first?);
        (self.results >= MIN_RESULTS && secs >= MIN_TIME)
            .then(|| self.results as f64 / secs.as_secs_f64())
    }
}

/// The work left for one kind of producer: inputs its producers hold and inputs queued for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Left {
    pub held: u64,
    pub queued: f64,
}

/// Whether the GPU producers bound the run: what is left for them, at their rate, takes longer
/// than what is left for the CPU producers at theirs. Until both kinds have a rate, yes (the
/// CPU producers then take plain JPEGs as the routing allows).
pub(super) fn gpu_bound(gpu: (Left, Option<f64>), cpu: (Left, Option<f64>)) -> bool {
    let secs = |(l, rate): (Left, Option<f64>)| {
        rate.filter(|r| *r > 0.0)
            .map(|r| (l.held as f64 + l.queued) / r)
    };
    match (secs(gpu), secs(cpu)) {
        (Some(g), Some(c)) => g > c,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn left(held: u64, queued: f64) -> Left {
        Left { held, queued }
    }

    #[test]
    fn a_rate_counts_after_enough_results_and_time() {
        let t0 = Instant::now();
        let mut p = Pace::default();
        assert_eq!(p.rate(t0), None);
        for _ in 0..200 {
            p.result(t0);
        }
        // Many results, no time yet.
        assert_eq!(p.rate(t0 + Duration::from_millis(500)), None);
        let r = p.rate(t0 + Duration::from_secs(2)).unwrap();
        assert!((r - 100.0).abs() < 1e-9, "{r}");
        // Time, too few results.
        let mut q = Pace::default();
        q.result(t0);
        assert_eq!(q.rate(t0 + Duration::from_secs(10)), None);
    }

    #[test]
    fn the_slower_side_to_finish_is_the_bound() {
        // Varied photos: progressive files wait for the CPU producers (880 left at 260 a
        // second) while the GPU producers clear 3,000 plain ones at 1,300 a second.
        let cpu = (left(192, 880.0), Some(260.0));
        let gpu = (left(512, 3000.0), Some(1300.0));
        assert!(!gpu_bound(gpu, cpu));
        // Baseline photos: nothing waits for the CPU producers but what they hold.
        let cpu = (left(192, 0.0), Some(220.0));
        let gpu = (left(512, 10_000.0), Some(1500.0));
        assert!(gpu_bound(gpu, cpu));
        // The end of that run: the GPU producers' last inputs take less than the CPU
        // producers' own.
        let gpu = (left(300, 0.0), Some(1500.0));
        assert!(!gpu_bound(gpu, cpu));
    }

    #[test]
    fn without_both_rates_the_gpu_producers_are_taken_as_the_bound() {
        let l = left(10, 10.0);
        assert!(gpu_bound((l, None), (l, Some(100.0))));
        assert!(gpu_bound((l, Some(100.0)), (l, None)));
        assert!(gpu_bound((l, Some(0.0)), (l, Some(100.0))));
    }
}
