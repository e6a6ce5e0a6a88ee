//! The consumer: whoever calls `Server::recv_*` polls every session's submission queue (round
//! robin, a burst at a time) and the channel the socket readers feed, then sleeps on the
//! doorbells. The queue cursors are the consumer's alone: no lock on the hot path.

use std::sync::atomic::{fence, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::epoll::{EpollEvent, EpollTimeout};
use tensorport_shm::ring::{SqEntry, SqReader};
use tensorport_wire::ErrorCode;

use crate::lock;
use crate::server::admission::{admit_locked, count_submitted};
use crate::server::request::Request;
use crate::server::session::{Session, SessionState};
use crate::server::shared::Shared;

/// A session the consumer polls, with its submission-queue cursor.
struct Polled {
    session: Arc<Session>,
    sq: SqReader,
}

/// What the one consumer at a time (the caller of `recv_*`) keeps between calls.
pub(crate) struct Consumer {
    /// Which shard of the sessions it serves.
    shard: usize,
    rx: Receiver<Request>,
    /// Sessions with queues, refreshed when `ring_generation` moves.
    sessions: Vec<Polled>,
    generation: u64,
    /// Where the next round-robin pass starts.
    next: usize,
    /// Requests taken in a row from the session at `next`.
    burst: usize,
    events: Vec<EpollEvent>,
    /// Where [`Consumer::try_take`] takes its one request (kept: no allocation per call).
    one: Vec<Request>,
}

impl Consumer {
    pub(crate) fn new(shard: usize, rx: Receiver<Request>) -> Consumer {
        Consumer {
            shard,
            rx,
            sessions: Vec::new(),
            generation: u64::MAX,
            next: 0,
            burst: 0,
            events: vec![EpollEvent::empty(); 64],
            one: Vec::with_capacity(1),
        }
    }

    /// The next request, or `None` at `deadline`; `Err(Stopped)` once the server is finished.
    pub(crate) fn next_request(
        &mut self,
        sh: &Arc<Shared>,
        deadline: Instant,
    ) -> std::result::Result<Option<Request>, crate::Stopped> {
        let spin = sh.config.spin;
        if let Some(p) = &sh.pacer {
            p.tick(sh);
        }
        // The clock is first read after 32 empty looks: a request already waiting costs none.
        let (mut start, mut checked) = (None, None);
        let mut spins = 0u32;
        loop {
            if let Some(r) = self.try_take(sh) {
                return Ok(Some(r));
            }
            // A few quick looks between reads of the clock.
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(32) {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            if let Some(p) = &sh.pacer {
                p.tick(sh);
            }
            if now >= deadline {
                if sh.is_finished() {
                    return Err(crate::Stopped);
                }
                return Ok(None);
            }
            if now.duration_since(*start.get_or_insert(now)) < spin {
                // Look at the (locked) session table only now and then while spinning.
                if now.duration_since(*checked.get_or_insert(now)) > Duration::from_millis(5) {
                    checked = Some(now);
                    if sh.is_finished() {
                        return Err(crate::Stopped);
                    }
                }
                if spins.is_multiple_of(256) {
                    // Now and then give the core away (producers sharing it get to run).
                    std::thread::yield_now();
                }
                continue;
            }
            if sh.is_finished() {
                return Err(crate::Stopped);
            }
            // Held-back slots are granted by the pacer's ticks: sleep in short steps meanwhile.
            let longest = match &sh.pacer {
                Some(p) if p.is_holding() => Duration::from_millis(1),
                _ => Duration::from_millis(50),
            };
            let step = deadline.saturating_duration_since(now).min(longest);
            if let Some(r) = self.sleep(sh, step) {
                return Ok(Some(r));
            }
        }
    }

    /// One request from the queues (one per session per pass, round robin) or the channel.
    pub(crate) fn try_take(&mut self, sh: &Arc<Shared>) -> Option<Request> {
        let mut one = std::mem::take(&mut self.one);
        let r = (self.try_take_into(sh, &mut one, 1) > 0)
            .then(|| one.pop())
            .flatten();
        self.one = one;
        r
    }

    /// Up to `max` requests into `out` (at least one if any is waiting): from the queues, the
    /// session at the turn giving up to its burst's remainder, admitted under one lock of its
    /// state; else one from the channel. Returns how many.
    pub(crate) fn try_take_into(
        &mut self,
        sh: &Arc<Shared>,
        out: &mut Vec<Request>,
        max: usize,
    ) -> usize {
        let c = self;
        if max == 0 {
            return 0;
        }
        let me = c.shard;
        let g = sh.shards[me].ring_generation.load(Ordering::SeqCst);
        if g != c.generation {
            c.generation = g;
            // Sessions that stay keep their queue cursor; new ones start at the beginning.
            let mut old = std::mem::take(&mut c.sessions);
            c.sessions = lock(&sh.sessions)
                .values()
                .filter(|s| s.ring.is_some() && s.shard == me)
                .map(|s| {
                    let sq = old
                        .iter_mut()
                        .find(|o| o.session.id == s.id)
                        .map(|o| std::mem::take(&mut o.sq))
                        .unwrap_or_default();
                    // Awake and about to poll it: its producer need not ring (a new ring starts
                    // with the flag set, for a consumer that was asleep when it opened).
                    if let Some(r) = &s.ring {
                        r.mem.set_server_waiting(false);
                    }
                    Polled {
                        session: s.clone(),
                        sq,
                    }
                })
                .collect();
            c.sessions.sort_by_key(|p| p.session.id);
        }
        // Up to BURST requests from one session before the next one's turn: its queue, slots
        // and lock stay in cache, and no session waits more than (sessions − 1) × BURST.
        const BURST: usize = 16;
        let n = c.sessions.len();
        for k in 0..n {
            let i = (c.next + k) % n;
            if k > 0 {
                c.burst = 0;
            }
            let p = &mut c.sessions[i];
            let got = take_from_ring(sh, &p.session, &mut p.sq, out, max.min(BURST - c.burst));
            if got > 0 {
                // A busy turn starts: the next session's queue head starts arriving while this
                // one's burst is taken and answered (its producer's core wrote those lines). Not
                // while idle: a consumer looking at empty queues fetches nothing ahead.
                if c.burst == 0 && n > 1 {
                    let q = &c.sessions[(i + 1) % n];
                    if let Some(ring) = &q.session.ring {
                        q.sq.prefetch_head(&ring.mem);
                    }
                }
                c.burst += got;
                if c.burst >= BURST {
                    c.burst = 0;
                    c.next = (i + 1) % n;
                } else {
                    c.next = i;
                }
                return got;
            }
        }
        c.burst = 0;
        loop {
            match c.rx.try_recv() {
                Ok(r) if r.session().is_alive() => {
                    out.push(r);
                    return 1;
                }
                Ok(_) => continue,
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return 0,
            }
        }
    }

    /// Says it sleeps (to every queue and the socket readers), looks once more, then waits on
    /// the doorbells for at most `step`.
    fn sleep(&mut self, sh: &Arc<Shared>, step: Duration) -> Option<Request> {
        let c = &mut *self;
        let shard = &sh.shards[c.shard];
        shard.sleeping.store(true, Ordering::SeqCst);
        for p in &c.sessions {
            if let Some(ring) = &p.session.ring {
                ring.mem.set_server_waiting(true);
            }
        }
        fence(Ordering::SeqCst);
        let got = if c.sessions.iter_mut().any(|p| {
            p.session
                .ring
                .as_ref()
                .is_some_and(|r| r.has_work(&mut p.sq))
        }) {
            None
        } else {
            let ms = step.as_millis().clamp(1, 1000) as u16;
            let n = shard
                .epoll
                .wait(&mut c.events, EpollTimeout::from(ms))
                .unwrap_or(0);
            for ev in &c.events[..n] {
                match ev.data() {
                    0 => shard.wake.clear(),
                    id => {
                        if let Some(ring) = c
                            .sessions
                            .iter()
                            .find(|p| p.session.id == id)
                            .and_then(|p| p.session.ring.as_ref())
                        {
                            ring.to_server.clear();
                        }
                    }
                }
            }
            None
        };
        shard.sleeping.store(false, Ordering::SeqCst);
        for p in &c.sessions {
            if let Some(ring) = &p.session.ring {
                ring.mem.set_server_waiting(false);
            }
        }
        got.or_else(|| self.try_take(sh))
    }
}

/// Up to `max` valid submissions from `session`'s queue into `out`, admitted under one lock of
/// its state; returns how many. Invalid ones are refused on the socket, one error each, as on
/// the socket path; a corrupted queue closes the session.
fn take_from_ring(
    shared: &Arc<Shared>,
    session: &Arc<Session>,
    sq: &mut SqReader,
    out: &mut Vec<Request>,
    max: usize,
) -> usize {
    let Some(ring) = session.ring.as_ref() else {
        return 0;
    };
    if !session.is_alive() {
        return 0;
    }
    let mut st: Option<MutexGuard<'_, SessionState>> = None;
    // Refused entries count against the burst as taken ones do: a queue kept full of invalid
    // entries gets its turn and then waits for the others', like any other.
    let (mut taken, mut refusals, mut bytes) = (0usize, 0usize, 0u64);
    while taken + refusals < max && session.is_alive() {
        let e: SqEntry = match sq.pop(&ring.mem) {
            Ok(Some(e)) => e,
            Ok(None) => break,
            Err(err) => {
                drop(st.take());
                session.close_with(ErrorCode::Malformed, err.to_string());
                break;
            }
        };
        let (location, fence) = (e.location(), e.fence());
        let refused = match e.view(&location, fence.as_ref()) {
            Err(w) => Some((w.code(), w.to_string())),
            Ok(view) => {
                let guard = st.get_or_insert_with(|| lock(&session.state));
                match admit_locked(shared, session, guard, e.request_id, &view) {
                    Ok(r) => {
                        bytes += r.desc().byte_len();
                        out.push(r);
                        taken += 1;
                        None
                    }
                    Err(why) => Some(why),
                }
            }
        };
        if let Some((code, message)) = refused {
            // Refusing posts on the socket and counts the error under the lock: not held.
            drop(st.take());
            session.refuse(code, Some(e.request_id), message);
            refusals += 1;
        }
    }
    drop(st);
    if taken > 0 {
        count_submitted(shared, taken as u64, bytes);
    }
    taken
}
