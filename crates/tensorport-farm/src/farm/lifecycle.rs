//! One child's restarts, the same for servers and producers: after each failure it is
//! restarted after a back-off that grows, until it has failed too many times in a row without
//! serving in between; then it is given up on.

use std::time::Duration;

/// A child's restarts so far, and its failures since it last served.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Restarts {
    /// Restarts over the whole run.
    pub(super) total: u32,
    /// Failures since it last served (a result through it, or one of its own).
    pub(super) in_row: u32,
}

/// What to do with a child that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Start it again after this back-off.
    Restart(Duration),
    /// It failed this many times in a row: give up on it.
    GiveUp(u32),
}

impl Restarts {
    /// A failure: restart it after the back-off, or give up on it past `max` in a row.
    pub(super) fn failed(&mut self, max: u32) -> Verdict {
        self.in_row += 1;
        self.total += 1;
        if self.in_row > max {
            Verdict::GiveUp(self.in_row)
        } else {
            Verdict::Restart(backoff(self.in_row - 1))
        }
    }

    /// It served: its failures in a row count from zero again.
    pub(super) fn served(&mut self) {
        self.in_row = 0;
    }
}

/// The wait before restart number `failures + 1` in a row: 0.1 s, doubling, at most 5 s.
fn backoff(failures: u32) -> Duration {
    Duration::from_millis((100u64 << failures.min(6)).min(5_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn back_off_grows_until_it_gives_up_and_serving_forgives() {
        let mut r = Restarts::default();
        let Verdict::Restart(a) = r.failed(2) else {
            panic!()
        };
        let Verdict::Restart(b) = r.failed(2) else {
            panic!()
        };
        assert!(b >= a);
        assert_eq!(r.failed(2), Verdict::GiveUp(3));
        r.served();
        assert!(matches!(r.failed(2), Verdict::Restart(_)));
        assert_eq!(r.total, 4);
    }
}
