//! Fair pacing (opt-in: [`ServerConfig::pace`](crate::ServerConfig::pace)). Producers that fill
//! their slots at different speeds (cores that get less of the machine's memory bandwidth than
//! others, say) get different shares of the server, however fairly it takes their requests:
//! the transport can only even them out by holding the fast ones back. With a [`Pace`], the
//! server counts the slots it grants back to each session on one shared scale and holds a
//! slot back (does not grant it yet) while its session is `window` grants ahead of the
//! slowest active session; the consumers look again every [`TICK`] and grant what may go.
//!
//! - **Active**: a session that submitted a host tensor within `idle`, or that has slots held
//!   back (it would submit if it could). Idle sessions hold nobody back. Device tensors are
//!   not paced (their buffers are the producer's, given back as soon as they are read), so a
//!   producer of device tensors alone is never active here.
//! - **Coming back**: a session that was idle starts level with the slowest active one (the
//!   floor), so it neither runs ahead on credit nor holds the others back to catch up.
//! - **No deadlock**: the slowest active session is never held back (its count is the floor,
//!   below floor + window), and a session whose slots are all held back still counts as
//!   active, so the floor rises to it once the others are gone or idle.
//!
//! It costs throughput wherever the fast producers' time could not go to the slow ones.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport_wire::SlotRef;

use crate::lock;
use crate::server::session::Session;
use crate::server::shared::Shared;

/// How often the consumers recompute the floor and grant the slots that may go.
pub(crate) const TICK: Duration = Duration::from_micros(50);

/// How the server paces producers (see the module notes of `server/pace.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pace {
    /// Grants a session may be ahead of the slowest active session before its slots are held
    /// back (at least 1).
    pub window: u32,
    /// A session that has submitted nothing for this long is idle: it holds nobody back until
    /// it submits again.
    pub idle: Duration,
}

impl Pace {
    /// A window of `window` grants; sessions idle after 20 ms without a submit.
    pub fn new(window: u32) -> Pace {
        Pace {
            window: window.max(1),
            idle: Duration::from_millis(20),
        }
    }
}

/// One session's place on the shared scale (kept in its state, under its lock).
#[derive(Debug, Default)]
pub(crate) struct Share {
    /// Grants counted on the shared scale.
    count: u64,
    /// Slots taken back and held while the session is ahead.
    pub(crate) held: Vec<u32>,
    /// When it last submitted.
    last_submit: Option<Instant>,
}

impl Share {
    /// A submit at `now`: a session coming back from idle (or new) starts at `floor`.
    pub(crate) fn submitted(&mut self, now: Instant, floor: u64, pace: &Pace) {
        if !self.recent(now, pace) {
            self.count = self.count.max(floor);
        }
        self.last_submit = Some(now);
    }

    fn recent(&self, now: Instant, pace: &Pace) -> bool {
        self.last_submit
            .is_some_and(|t| now.saturating_duration_since(t) < pace.idle)
    }

    /// Whether it counts toward the floor at `now`.
    pub(crate) fn is_active(&self, now: Instant, pace: &Pace) -> bool {
        !self.held.is_empty() || self.recent(now, pace)
    }

    /// Whether one more grant may go now (then counted), with the floor at `floor`.
    pub(crate) fn may_grant(&mut self, floor: u64, pace: &Pace) -> bool {
        if self.count < floor.saturating_add(pace.window as u64) {
            self.count += 1;
            true
        } else {
            false
        }
    }

    /// Its count on the shared scale.
    pub(crate) fn count(&self) -> u64 {
        self.count
    }
}

/// The shared floor, and when it was last recomputed.
pub(crate) struct Pacer {
    pub(crate) pace: Pace,
    floor: AtomicU64,
    /// Nanoseconds after `epoch` of the last recomputation.
    last_tick: AtomicU64,
    epoch: Instant,
    /// Sessions with slots held back at the last look (consumers then sleep in short steps).
    holding: AtomicUsize,
}

impl Pacer {
    pub(crate) fn new(pace: Pace) -> Pacer {
        Pacer {
            pace: Pace {
                window: pace.window.max(1),
                ..pace
            },
            floor: AtomicU64::new(0),
            last_tick: AtomicU64::new(0),
            epoch: Instant::now(),
            holding: AtomicUsize::new(0),
        }
    }

    /// The slowest active session's count.
    pub(crate) fn floor(&self) -> u64 {
        self.floor.load(Ordering::Acquire)
    }

    /// Whether a session held slots back at the last look, or one was held since.
    pub(crate) fn is_holding(&self) -> bool {
        self.holding.load(Ordering::Relaxed) > 0
    }

    /// A slot was held back.
    pub(crate) fn held_one(&self) {
        self.holding.fetch_add(1, Ordering::Relaxed);
    }

    /// Recomputes the floor and grants what may go, if [`TICK`] has passed since the last
    /// time (one caller at a time does it; the others return at once).
    pub(crate) fn tick(&self, sh: &Shared) {
        let now = Instant::now();
        let at = now.duration_since(self.epoch).as_nanos() as u64;
        let last = self.last_tick.load(Ordering::Relaxed);
        if at.saturating_sub(last) < TICK.as_nanos() as u64
            || self
                .last_tick
                .compare_exchange(last, at, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let sessions: Vec<Arc<Session>> = lock(&sh.sessions).values().cloned().collect();
        let floor = sessions
            .iter()
            .filter_map(|s| {
                let st = lock(&s.state);
                st.share
                    .is_active(now, &self.pace)
                    .then(|| st.share.count())
            })
            .min();
        let Some(floor) = floor else {
            self.holding.store(0, Ordering::Relaxed);
            return;
        };
        self.floor.fetch_max(floor, Ordering::AcqRel);
        let floor = self.floor();
        let mut holding = 0;
        // (A draining server grants nothing back; a gone session's slots go with its pool.)
        let granting = !sh.is_draining();
        for s in sessions.iter().filter(|s| granting && s.is_alive()) {
            let grants: Vec<SlotRef> = {
                let mut st = lock(&s.state);
                let mut out = Vec::new();
                while !st.share.held.is_empty() && st.share.may_grant(floor, &self.pace) {
                    let slot = st.share.held.pop().expect("not empty");
                    match st.slots.grant(slot) {
                        Ok(generation) => out.push(SlotRef { slot, generation }),
                        Err(e) => tracing::error!(session = s.id, "internal: granting {slot}: {e}"),
                    }
                }
                holding += !st.share.held.is_empty() as usize;
                out
            };
            for g in grants {
                s.grant(g);
            }
        }
        self.holding.store(holding, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pace() -> Pace {
        Pace {
            window: 2,
            idle: Duration::from_millis(20),
        }
    }

    #[test]
    fn a_session_ahead_by_the_window_is_held_until_the_floor_rises() {
        let p = pace();
        let now = Instant::now();
        let mut fast = Share::default();
        fast.submitted(now, 0, &p);
        assert!(fast.may_grant(0, &p));
        assert!(fast.may_grant(0, &p));
        assert!(!fast.may_grant(0, &p), "two ahead of a floor of 0");
        assert_eq!(fast.count(), 2);
        assert!(fast.may_grant(1, &p));
        assert!(!fast.may_grant(1, &p));
    }

    #[test]
    fn a_session_back_from_idle_starts_at_the_floor() {
        let p = pace();
        let t0 = Instant::now();
        let mut s = Share::default();
        s.submitted(t0, 0, &p);
        assert!(s.is_active(t0, &p));
        let later = t0 + Duration::from_millis(50);
        assert!(!s.is_active(later, &p), "idle after 20 ms without a submit");
        s.submitted(later, 100, &p);
        assert_eq!(s.count(), 100, "level with the floor, no credit");
        // Still active: a later floor does not lift it.
        s.submitted(later + Duration::from_millis(1), 200, &p);
        assert_eq!(s.count(), 100);
    }

    #[test]
    fn a_session_with_slots_held_stays_active() {
        let p = pace();
        let t0 = Instant::now();
        let mut s = Share::default();
        s.submitted(t0, 0, &p);
        s.held.push(3);
        assert!(s.is_active(t0 + Duration::from_secs(5), &p));
    }

    #[test]
    fn a_new_session_holds_nobody_back_before_it_submits() {
        let p = pace();
        let s = Share::default();
        assert!(!s.is_active(Instant::now(), &p));
    }
}
