//! The warm lease: with large slots, a lease prefers the slot this producer submitted last (its
//! bytes are the ones still in this core's caches) and polls briefly for it to come back before
//! it takes a colder one. Two slots in turn per producer is twice the working set; with many
//! producers of large tensors that overflows the shared cache, and every fill goes to memory
//! (on the H200 host, 15 producers of 19.3 MB tensors filled at about two thirds of the speed).
//!
//! The rule, as a small state machine ([`WarmLease`]): wait only for slots of at least
//! [`WARM_MIN_SLOT`] bytes, at most [`crate::ProducerConfig::warm_wait`] and at most a sixteenth
//! of the time since the last lease (about the fill: where answers come late, waiting costs
//! more than a cold slot); after a wait runs out, take what is free at once for the next
//! [`WARM_SKIP_AFTER_MISS`] leases.

use std::time::{Duration, Instant};

/// Slots from this size up are leased warm: a wait of a few microseconds is small beside
/// filling them, and two of them per producer overflow a cache sooner (one 1 MiB slot fits the
/// H200 host's 2 MiB of L2 per core, two do not: one producer of 1 MiB tensors ran 14–20%
/// faster leased warm; with 8 and 15 producers it made no difference).
pub const WARM_MIN_SLOT: u64 = 1 << 20;

/// Leases that do not wait for the warm slot after a wait for it ran out.
pub const WARM_SKIP_AFTER_MISS: u32 = 64;

/// The warm-lease state of one producer.
#[derive(Debug, Clone)]
pub(super) struct WarmLease {
    /// The longest wait; zero: off (slots below [`WARM_MIN_SLOT`], or turned off).
    wait: Duration,
    /// The host slot submitted last, until a lease has looked for it.
    slot: Option<u32>,
    /// Leases left that take any free slot at once.
    skip: u32,
    /// When the last slot was leased (kept only while on).
    leased: Option<Instant>,
}

impl WarmLease {
    /// For a pool of `slot_size`-byte slots, waiting at most `wait`.
    pub(super) fn new(slot_size: u64, wait: Duration) -> WarmLease {
        WarmLease {
            wait: if slot_size >= WARM_MIN_SLOT {
                wait
            } else {
                Duration::ZERO
            },
            slot: None,
            skip: 0,
            leased: None,
        }
    }

    /// Host slot `slot` was submitted.
    pub(super) fn submitted(&mut self, slot: u32) {
        self.slot = Some(slot);
    }

    /// A lease is about to take a free slot at `now`: the slot to wait for and until when, if
    /// this lease waits. Each submitted slot is looked for by one lease at most.
    pub(super) fn plan(&mut self, now: Instant) -> Option<(u32, Instant)> {
        let slot = self.slot.take()?;
        if self.wait.is_zero() {
            return None;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return None;
        }
        let since = self
            .leased
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        Some((slot, now + self.wait.min(since / 16)))
    }

    /// The wait planned ran out without the slot.
    pub(super) fn missed(&mut self) {
        self.skip = WARM_SKIP_AFTER_MISS;
    }

    /// A slot was leased at `now`.
    pub(super) fn leased(&mut self, now: Instant) {
        if !self.wait.is_zero() {
            self.leased = Some(now);
        }
    }

    /// Whether leases read the clock for this (only while on).
    pub(super) fn on(&self) -> bool {
        !self.wait.is_zero()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn small_slots_never_wait() {
        let mut w = WarmLease::new(WARM_MIN_SLOT - 1, 20 * US);
        assert!(!w.on());
        w.submitted(3);
        assert_eq!(w.plan(Instant::now()), None);
    }

    #[test]
    fn a_wait_is_bounded_by_the_setting_and_by_the_time_since_the_last_lease() {
        let t0 = Instant::now();
        let mut w = WarmLease::new(WARM_MIN_SLOT, 20 * US);
        // No lease yet: nothing to go by, so no time to wait.
        w.submitted(1);
        assert_eq!(w.plan(t0), Some((1, t0)));
        // 160 µs since the last lease: a sixteenth is 10 µs, under the 20 µs setting.
        w.leased(t0);
        w.submitted(2);
        assert_eq!(w.plan(t0 + 160 * US), Some((2, t0 + 170 * US)));
        // 1.6 ms since: the setting bounds it.
        w.leased(t0);
        w.submitted(4);
        let at = t0 + 1600 * US;
        assert_eq!(w.plan(at), Some((4, at + 20 * US)));
    }

    #[test]
    fn each_submitted_slot_is_looked_for_once() {
        let t0 = Instant::now();
        let mut w = WarmLease::new(WARM_MIN_SLOT, 20 * US);
        w.leased(t0);
        w.submitted(5);
        assert!(w.plan(t0 + 400 * US).is_some());
        assert_eq!(w.plan(t0 + 800 * US), None, "already looked for");
    }

    #[test]
    fn a_miss_turns_waiting_off_for_the_next_leases() {
        let t0 = Instant::now();
        let mut w = WarmLease::new(WARM_MIN_SLOT, 20 * US);
        w.leased(t0);
        w.submitted(0);
        assert!(w.plan(t0 + 400 * US).is_some());
        w.missed();
        for k in 0..WARM_SKIP_AFTER_MISS {
            w.submitted(k % 4);
            assert_eq!(w.plan(t0 + 400 * US), None, "lease {k} after the miss");
        }
        w.submitted(1);
        assert!(
            w.plan(t0 + 400 * US).is_some(),
            "waits again after the skip"
        );
    }

    #[test]
    fn zero_turns_it_off() {
        let mut w = WarmLease::new(WARM_MIN_SLOT * 4, Duration::ZERO);
        assert!(!w.on());
        w.submitted(0);
        assert_eq!(w.plan(Instant::now()), None);
    }
}
