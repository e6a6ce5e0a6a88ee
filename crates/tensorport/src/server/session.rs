//! One producer session: its pool, slot table, requests in flight, device buffers, queues and
//! outbox, and the two ways the server speaks to it — [`Session::answer`] (a request's one
//! result, with the slot given back) and [`Session::post`] (any other message).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tensorport_shm::ring::{CqHeader, CqWriter, CQ_GRANT, CQ_INLINE_BYTES, CQ_RESULT};
use tensorport_shm::{HostPool, RingError, SlotState, SlotTable};
use tensorport_wire::{
    clip_message, ErrorCode, Outcome, PoolBounds, ServerMsg, SessionStatus, SlotRef, TensorDesc,
    MAX_FRAME_LEN,
};

use crate::device::ImportedDevice;
use crate::fast::{IdSet, ServerRing};
use crate::lock;
use crate::server::budget::Charge;
use crate::server::outbox::Outbox;
use crate::server::pace::Share;
use crate::server::shared::Shared;
use crate::{Error, Result};

/// Refusals of one session that are all logged; past them, only every power of two.
const LOGGED_REFUSALS: u64 = 8;

/// The largest result a request may have: it must fit one frame with its envelope.
pub(crate) const MAX_RESULT_LEN: usize = MAX_FRAME_LEN as usize - 64;

/// A registered device buffer: open in the server, generation, whether a request holds it.
pub(crate) struct DeviceEntry {
    pub(crate) imported: Arc<dyn ImportedDevice>,
    pub(crate) generation: u32,
    pub(crate) in_flight: bool,
}

/// A session's bookkeeping, under one lock.
pub(crate) struct SessionState {
    pub(crate) slots: SlotTable,
    /// The server's end of the completion queue (unused without one).
    pub(crate) cq: CqWriter,
    pub(crate) devices: HashMap<u32, DeviceEntry>,
    pub(crate) in_flight: IdSet,
    pub(crate) submitted: u64,
    pub(crate) completed: u64,
    pub(crate) errors: u64,
    /// The session's last submit or answer (its opening, before either).
    pub(crate) last_active: Instant,
    /// Its place on the fair pacing's scale (unused without pacing).
    pub(crate) share: Share,
}

impl SessionState {
    /// Whether `request_id` was still owed its answer (it is not any more).
    /// (The caller stamps `last_active`.)
    pub(crate) fn settle(&mut self, request_id: u64) -> bool {
        let owed = self.in_flight.remove(&request_id);
        self.completed += owed as u64;
        owed
    }
}

/// What a request is answered with.
#[derive(Debug)]
pub(crate) enum Answer<'a> {
    Ok(&'a [u8]),
    Failed(ErrorCode, String),
}

pub(crate) struct Session {
    pub(crate) id: u64,
    /// The consumer shard that takes its requests.
    pub(crate) shard: usize,
    /// The protocol version negotiated (3: device releases go on the completion queue).
    pub(crate) version: u16,
    pub(crate) name: String,
    pub(crate) pid: u32,
    pub(crate) pool: Arc<HostPool>,
    /// The pool's share of the memory budget, given back when the session's last reference
    /// (and so the pool's mapping here) goes.
    pub(crate) _charge: Charge,
    pub(crate) bounds: PoolBounds,
    pub(crate) max_in_flight: u32,
    pub(crate) state: Mutex<SessionState>,
    pub(crate) outbox: Outbox,
    pub(crate) alive: AtomicBool,
    /// The shared-memory queues (protocol 2), if the session has them.
    pub(crate) ring: Option<ServerRing>,
    /// The server's state (counters, draining, pacing), which this session's methods use, so
    /// a request answering through the session holds one reference, not two. The server's
    /// session table holds the session in turn: that cycle ends when the session leaves the
    /// table (`close_session`, or the server's drop), after which only requests and threads
    /// still in flight keep either alive.
    pub(crate) shared: Arc<Shared>,
}

impl Session {
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    pub(crate) fn status(&self) -> SessionStatus {
        let st = lock(&self.state);
        SessionStatus {
            session_id: self.id,
            name: self.name.clone(),
            pid: self.pid,
            slots: st.slots.len(),
            granted: st.slots.count(SlotState::Granted),
            in_flight: st.in_flight.len() as u32,
            submitted: st.submitted,
            completed: st.completed,
            errors: st.errors,
        }
    }

    /// Sends `msg` on the socket without waiting for the producer to read it. A producer that
    /// does not read is dropped here (its output is over the limit) or by its own thread (its
    /// output waited for the write timeout).
    pub(crate) fn post(&self, msg: &ServerMsg) -> Result<()> {
        if !self.is_alive() {
            return Err(Error::SessionGone);
        }
        match self.outbox.post(msg) {
            Ok(wrote) => {
                if wrote.0 {
                    self.note_socket_write();
                }
                Ok(())
            }
            Err(e @ Error::ResultTooLarge(_)) => Err(e),
            Err(e) => {
                tracing::warn!(session = self.id, producer = %self.name, "dropping session: {e}");
                self.kill();
                Err(e)
            }
        }
    }

    /// Tells a producer polling its queues that the socket has news.
    pub(crate) fn note_socket_write(&self) {
        if let Some(ring) = &self.ring {
            ring.mem.note_socket_message();
        }
    }

    /// Marks the session dead and closes its socket; its own thread then reclaims it.
    pub(crate) fn kill(&self) {
        self.alive.store(false, Ordering::SeqCst);
        self.outbox.close();
    }

    /// Refuses something the producer sent, with an error it may act on (not fatal).
    pub(crate) fn refuse(&self, code: ErrorCode, request_id: Option<u64>, message: String) {
        self.shared
            .counters
            .protocol_errors
            .fetch_add(1, Ordering::Relaxed);
        let errors = {
            let mut st = lock(&self.state);
            st.errors += 1;
            st.errors
        };
        let limit = self.shared.config.max_refusals;
        if errors > limit {
            if errors > limit + 1 {
                return; // closed already
            }
            self.close_with(
                ErrorCode::TooManyRefusals,
                format!("{errors} messages refused in this session (the server takes {limit}); the last: {message}"),
            );
            return;
        }
        // A peer refused in a loop must not flood the log: the first few, then powers of two.
        if errors <= LOGGED_REFUSALS || errors.is_power_of_two() {
            tracing::warn!(session = self.id, producer = %self.name, ?code, request_id, refusals = errors, "refused: {message}");
        }
        let _ = self.post(&ServerMsg::Error {
            code: code.as_u16(),
            request_id,
            fatal: false,
            message: clip_message(message),
        });
    }

    /// Tells the producer why the session ends, then ends it.
    pub(crate) fn close_with(&self, code: ErrorCode, message: String) {
        self.shared
            .counters
            .protocol_errors
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(session = self.id, producer = %self.name, ?code, "closing session: {message}");
        let _ = self.post(&ServerMsg::Error {
            code: code.as_u16(),
            request_id: None,
            fatal: true,
            message: clip_message(message),
        });
        self.kill();
    }

    /// Answers `request_id`, once: settles it and sends the result — with `slot` (a host slot
    /// the request held) taken back and granted again unless the server drains. One completion
    /// on the shared-memory queue when the session has one and the result fits inline (no
    /// system call, no allocation); socket messages otherwise. A result over the frame limit is
    /// answered with a failure and returned as [`Error::ResultTooLarge`].
    pub(crate) fn answer(
        &self,
        request_id: u64,
        answer: Answer<'_>,
        slot: Option<SlotRef>,
    ) -> Result<()> {
        self.answer_all(std::iter::once((request_id, answer, slot)))
    }

    /// Answers several of this session's requests, each as [`Session::answer`] does, under one
    /// lock, with one publication on the completion queue and at most one wake-up for all the
    /// results that go there. Every request is answered (or its producer is gone) whatever it
    /// returns: the first error, if any.
    pub(crate) fn answer_all<'a>(
        &self,
        answers: impl IntoIterator<Item = (u64, Answer<'a>, Option<SlotRef>)>,
    ) -> Result<()> {
        let mut first_err = None;
        let (mut completed, mut staged) = (0u64, false);
        let mut st = lock(&self.state);
        for (request_id, answer, slot) in answers {
            let (answer, too_large) = match answer {
                Answer::Ok(p) if p.len() > MAX_RESULT_LEN => (
                    Answer::Failed(
                        ErrorCode::HandlerFailed,
                        format!("result of {} bytes is over the frame limit", p.len()),
                    ),
                    Some(p.len()),
                ),
                a => (a, None),
            };
            let grant = slot.and_then(|s| self.regrant(&mut st, s));
            let owed = st.settle(request_id);
            completed += owed as u64;
            if !self.is_alive() {
                first_err.get_or_insert(Error::SessionGone);
                continue;
            }
            if let (Some(ring), Answer::Ok(payload), true) = (&self.ring, &answer, owed) {
                if payload.len() <= CQ_INLINE_BYTES {
                    let h = CqHeader {
                        flags: CQ_RESULT | if grant.is_some() { CQ_GRANT } else { 0 },
                        len: payload.len() as u32,
                        request_id,
                        slot: grant.map_or(0, |g| g.slot),
                        generation: grant.map_or(0, |g| g.generation),
                    };
                    match st.cq.stage(&ring.mem, &h, payload) {
                        Ok(true) => {
                            staged = true;
                            continue;
                        }
                        // Full: the socket carries it, below.
                        Ok(false) => {}
                        // A corrupted queue: the session is closed.
                        Err(e) => {
                            drop(st);
                            self.published(Err(e));
                            st = lock(&self.state);
                            continue;
                        }
                    }
                }
            }
            // On the socket, after what is staged (so the producer sees the results in order),
            // without the lock.
            if std::mem::take(&mut staged) {
                if let Some(ring) = &self.ring {
                    st.cq.publish(&ring.mem);
                }
                drop(st);
                self.published(Ok(true));
            } else {
                drop(st);
            }
            if let Some(g) = grant {
                self.grant(g);
            }
            if owed {
                let outcome = match answer {
                    Answer::Ok(payload) => Outcome::Ok(payload.to_vec()),
                    Answer::Failed(code, message) => Outcome::Err {
                        code: code.as_u16(),
                        message: clip_message(message),
                    },
                };
                if let Err(e) = self.post(&ServerMsg::Result {
                    request_id,
                    outcome,
                }) {
                    first_err.get_or_insert(e);
                }
            }
            if let Some(n) = too_large {
                first_err.get_or_insert(Error::ResultTooLarge(n));
            }
            st = lock(&self.state);
        }
        st.last_active = Instant::now();
        if staged {
            if let Some(ring) = &self.ring {
                st.cq.publish(&ring.mem);
            }
        }
        drop(st);
        if staged {
            self.published(Ok(true));
        }
        if completed > 0 {
            self.shared
                .counters
                .completed
                .fetch_add(completed, Ordering::Relaxed);
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Gives a request's bytes back without answering it: a host slot (granted again at once
    /// unless the server drains) or a device buffer.
    pub(crate) fn give_back(&self, desc: &TensorDesc) {
        if desc.is_device() {
            self.release_device(desc.slot());
        } else {
            let g = self.regrant(&mut lock(&self.state), desc.slot());
            if let Some(g) = g {
                self.grant(g);
            }
        }
    }

    /// Gives a device buffer back to its producer under the next generation.
    pub(crate) fn release_device(&self, buffer: SlotRef) {
        let released = {
            let mut st = lock(&self.state);
            match st.devices.get_mut(&buffer.slot) {
                Some(e) if e.in_flight && e.generation == buffer.generation => {
                    e.in_flight = false;
                    e.generation = e.generation.wrapping_add(1);
                    Some(SlotRef {
                        slot: buffer.slot,
                        generation: e.generation,
                    })
                }
                _ => {
                    tracing::error!(session = self.id, "internal: releasing device {buffer:?}");
                    None
                }
            }
        };
        let Some(r) = released else {
            return;
        };
        if let (Some(ring), true) = (
            &self.ring,
            self.version >= tensorport_wire::DEVICE_QUEUES_VERSION,
        ) {
            let h = CqHeader {
                flags: tensorport_shm::ring::CQ_DEVICE_RELEASED,
                slot: r.slot,
                generation: r.generation,
                ..CqHeader::default()
            };
            let pushed = lock(&self.state).cq.push(&ring.mem, &h, &[]);
            if self.published(pushed) {
                return;
            }
        }
        let _ = self.post(&ServerMsg::DeviceReleased(r));
    }

    /// Grants a slot: on the completion queue if there is one and it has room, else on the
    /// socket.
    pub(crate) fn grant(&self, g: SlotRef) {
        if let Some(ring) = &self.ring {
            if !self.is_alive() {
                return;
            }
            let h = CqHeader {
                flags: CQ_GRANT,
                slot: g.slot,
                generation: g.generation,
                ..CqHeader::default()
            };
            let r = lock(&self.state).cq.push(&ring.mem, &h, &[]);
            if self.published(r) {
                return;
            }
        }
        let _ = self.post(&ServerMsg::Grant(vec![g]));
    }

    /// What a push on the completion queue came to: `true` when it is done with (published, and
    /// the producer woken; or the queue was corrupted and the session is closed), `false` when
    /// the queue was full and the socket must carry it.
    fn published(&self, r: std::result::Result<bool, RingError>) -> bool {
        match r {
            Ok(true) => {
                if let Some(ring) = &self.ring {
                    ring.wake();
                }
                true
            }
            Ok(false) => false,
            Err(e) => {
                tracing::warn!(session = self.id, producer = %self.name, "closing session: {e}");
                self.kill();
                true
            }
        }
    }

    /// Takes a submitted slot back; the grant to send, unless the session is gone or the server
    /// drains.
    fn regrant(&self, st: &mut SessionState, slot: SlotRef) -> Option<SlotRef> {
        if let Err(e) = st.slots.release(slot.slot, slot.generation) {
            tracing::error!(session = self.id, "internal: releasing {slot:?}: {e}");
            return None;
        }
        if self.is_alive() && !self.shared.is_draining() {
            // Fair pacing: held back while this session is ahead (the pacer grants it later).
            if let Some(p) = &self.shared.pacer {
                if !st.share.may_grant(p.floor(), &p.pace) {
                    st.share.held.push(slot.slot);
                    p.held_one();
                    return None;
                }
            }
            st.slots.grant(slot.slot).ok().map(|generation| SlotRef {
                slot: slot.slot,
                generation,
            })
        } else {
            None
        }
    }
}
