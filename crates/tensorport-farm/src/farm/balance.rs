//! Moving producers between a farm's servers by demand.
//!
//! Producers start against the listening server with the fewest producers. That is even when
//! the servers are: when one is slower (a busier GPU, a smaller one, a model that runs longer on
//! its inputs), its producers wait on it while another server could take more. Every few seconds
//! the farm compares, per server, the results each of its producers got in that window; when a
//! server's producers get clearly fewer each than another's, one of them finishes the inputs it
//! holds and restarts against the faster server. Where the producers themselves bound the farm
//! (every server keeps up), their rates are alike and nothing moves.

use std::time::{Duration, Instant};

/// How often the rates are compared, and the least time between two moves.
pub(super) const WINDOW: Duration = Duration::from_secs(3);
/// A server's producers are moved from only if they get less than this share of the results
/// each that the fastest server's producers get.
const SLOW_SHARE: f64 = 0.6;
/// Results in a window, on the two servers compared, below which nothing is decided: the
/// window grows until it has that many (so a slow machine decides later, not never).
pub(super) const MIN_RESULTS: u64 = 64;

/// One server's side of a window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Load {
    /// It listens.
    pub ready: bool,
    /// CPU producers running against it and not already moving.
    pub movable: usize,
    /// All producers running against it.
    pub producers: usize,
    /// Results through it in the window.
    pub results: u64,
}

/// The server to move a producer from and the one to move it to, if the window says one should
/// move: the slow one keeps at least one producer.
pub(super) fn pick_move(loads: &[Load]) -> Option<(usize, usize)> {
    let rate = |l: &Load| l.results as f64 / l.producers.max(1) as f64;
    let live = || {
        loads
            .iter()
            .enumerate()
            .filter(|(_, l)| l.ready && l.producers > 0)
    };
    let (fast, f) = live().max_by(|a, b| rate(a.1).total_cmp(&rate(b.1)))?;
    let (slow, s) = live()
        .filter(|(_, l)| l.movable > 0 && l.producers > 1)
        .min_by(|a, b| rate(a.1).total_cmp(&rate(b.1)))?;
    let enough = s.results + f.results >= MIN_RESULTS;
    (slow != fast && enough && rate(s) < SLOW_SHARE * rate(f)).then_some((slow, fast))
}

/// The results each server got since the window began.
#[derive(Debug)]
pub(super) struct Window {
    pub began: Instant,
    pub results: Vec<u64>,
}

impl Window {
    pub(super) fn new(servers: usize) -> Window {
        Window {
            began: Instant::now(),
            results: vec![0; servers],
        }
    }

    /// Whether the window is long enough to judge.
    pub(super) fn is_due(&self) -> bool {
        self.began.elapsed() >= WINDOW
    }

    /// Starts a new window.
    pub(super) fn reset(&mut self) {
        self.began = Instant::now();
        self.results.iter_mut().for_each(|r| *r = 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(producers: usize, results: u64) -> Load {
        Load {
            ready: true,
            movable: producers,
            producers,
            results,
        }
    }

    #[test]
    fn a_slow_servers_producer_moves_to_the_fast_one() {
        // Server 1's three producers got 40 results each, server 0's 100 each.
        assert_eq!(pick_move(&[load(3, 300), load(3, 120)]), Some((1, 0)));
        // Three servers: from the slowest to the fastest.
        assert_eq!(
            pick_move(&[load(2, 100), load(2, 400), load(2, 300)]),
            Some((0, 1))
        );
    }

    #[test]
    fn alike_rates_move_nothing() {
        assert_eq!(pick_move(&[load(3, 300), load(3, 280)]), None);
        assert_eq!(
            pick_move(&[load(3, 300), load(3, 181)]),
            None,
            "above the share"
        );
        assert_eq!(pick_move(&[load(4, 400)]), None, "one server");
    }

    #[test]
    fn too_little_evidence_or_nothing_to_move_moves_nothing() {
        // Too few results to judge.
        assert_eq!(pick_move(&[load(2, 40), load(2, 10)]), None);
        // The slow server's last producer stays.
        assert_eq!(pick_move(&[load(3, 300), load(1, 10)]), None);
        // Its producers are GPU producers or already moving.
        let mut slow = load(3, 30);
        slow.movable = 0;
        assert_eq!(pick_move(&[load(3, 300), slow]), None);
        // A server that does not listen is neither source nor target.
        let mut down = load(3, 0);
        down.ready = false;
        assert_eq!(pick_move(&[load(3, 300), down]), None);
        let mut fast_down = load(3, 900);
        fast_down.ready = false;
        assert_eq!(
            pick_move(&[load(3, 300), fast_down, load(3, 90)]),
            Some((2, 0))
        );
    }

    #[test]
    fn a_server_without_producers_is_not_a_target_by_rate() {
        // A server with no producers has no rate to compare; placement by fewest producers
        // fills it when producers (re)start.
        assert_eq!(pick_move(&[load(4, 400), load(0, 0)]), None);
    }
}
