//! What every server thread sees: the configuration, the session table, the counters, the
//! memory budget and the consumer's doorbells.

use std::collections::{HashMap, VecDeque};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use nix::sys::epoll::Epoll;
use tensorport_wire::{Counters, ServerMsg, SessionStatus, StatusReport};

use crate::fast::Doorbell;
use crate::lock;
use crate::server::budget::MemoryBudget;
use crate::server::request::Request;
use crate::server::session::Session;
use crate::server::ServerConfig;

#[derive(Default)]
pub(crate) struct AtomicCounters {
    pub(crate) submitted: AtomicU64,
    pub(crate) completed: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) protocol_errors: AtomicU64,
    pub(crate) sessions_opened: AtomicU64,
    pub(crate) sessions_reclaimed: AtomicU64,
    pub(crate) connections_refused: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) batched: AtomicU64,
}

impl AtomicCounters {
    pub(crate) fn snapshot(&self) -> Counters {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters {
            submitted: l(&self.submitted),
            completed: l(&self.completed),
            bytes: l(&self.bytes),
            protocol_errors: l(&self.protocol_errors),
            sessions_opened: l(&self.sessions_opened),
            sessions_reclaimed: l(&self.sessions_reclaimed),
            connections_refused: l(&self.connections_refused),
            batches: l(&self.batches),
            batched: l(&self.batched),
        }
    }
}

pub(crate) struct Shared {
    pub(crate) config: ServerConfig,
    /// What the pools may reserve together, and the per-session cap.
    pub(crate) budget: MemoryBudget,
    pub(crate) max_session_bytes: u64,
    pub(crate) started: Instant,
    pub(crate) next_session: AtomicU64,
    /// Producer sessions by id. Locked before any session's state (see the lock order in
    /// `server/mod.rs`).
    pub(crate) sessions: Mutex<HashMap<u64, Arc<Session>>>,
    /// Connections with a thread: handshaking, control and producer.
    pub(crate) connections: AtomicU32,
    /// Producer places taken (reserved before a pool is built).
    pub(crate) producers: AtomicU32,
    /// Connections that have not yet said `Hello`, oldest first.
    pub(crate) handshakes: Handshakes,
    pub(crate) counters: AtomicCounters,
    pub(crate) draining: AtomicBool,
    pub(crate) stopping: AtomicBool,
    /// One per consumer ([`ServerConfig::consumers`]); each session belongs to one.
    pub(crate) shards: Vec<Shard>,
    /// Fair pacing, if [`ServerConfig::pace`] asks for it.
    pub(crate) pacer: Option<crate::server::pace::Pacer>,
}

/// What one consumer takes requests from: its sessions' queues (their doorbells in its
/// `epoll`) and the channel their socket readers feed.
pub(crate) struct Shard {
    pub(crate) tx: Sender<Request>,
    /// The consumer sleeps on this: its sessions' "to server" doorbells (data: session id) and
    /// `wake` (data 0), rung for requests that arrive on a socket and for new sessions.
    pub(crate) epoll: Epoll,
    pub(crate) wake: Doorbell,
    pub(crate) sleeping: AtomicBool,
    /// Bumped whenever one of its sessions with queues opens or closes, so the consumer
    /// refreshes its list.
    pub(crate) ring_generation: AtomicU64,
    /// Its producer sessions now (new sessions go to the shard with the fewest).
    pub(crate) sessions: AtomicU32,
}

impl Shard {
    /// Wakes the shard's consumer if it sleeps (after a request went into its channel, or one
    /// of its sessions opened).
    pub(crate) fn wake_consumer(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake.ring();
        }
    }
}

impl Shared {
    /// The shard with the fewest sessions, for a new one.
    pub(crate) fn least_loaded_shard(&self) -> usize {
        (0..self.shards.len())
            .min_by_key(|&k| self.shards[k].sessions.load(Ordering::SeqCst))
            .unwrap_or(0)
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// The consumer is done: the server stops, or it drains and every producer has left.
    pub(crate) fn is_finished(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
            || (self.is_draining() && lock(&self.sessions).is_empty())
    }

    pub(crate) fn status(&self) -> StatusReport {
        let sessions = lock(&self.sessions);
        let mut list: Vec<SessionStatus> =
            sessions.values().take(256).map(|s| s.status()).collect();
        list.sort_by_key(|s| s.session_id);
        StatusReport {
            pid: std::process::id(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            draining: self.is_draining(),
            sessions: list,
            totals: self.counters.snapshot(),
        }
    }

    /// Stops taking new work and tells every producer to finish (once).
    pub(crate) fn drain(&self) {
        if !self.draining.swap(true, Ordering::SeqCst) {
            tracing::info!("draining: finishing work in flight, refusing new producers");
            let sessions: Vec<_> = lock(&self.sessions).values().cloned().collect();
            for s in sessions {
                let _ = s.post(&ServerMsg::Draining);
            }
        }
    }
}

/// The connections still in their handshake: a few places of their own, so connections that
/// never say `Hello` cannot take every place. When those are full (or every connection place
/// is), the oldest connection that has sent nothing — or has already gone — gives its place to
/// the newest: a producer sends `Hello` as it connects, so its bytes are there before it is
/// accepted, and a flood of silent connections only ever pushes out its own.
#[derive(Default)]
pub(crate) struct Handshakes {
    open: Mutex<VecDeque<(u64, UnixStream)>>,
    next: AtomicU64,
}

impl Handshakes {
    /// Places for connections in their handshake.
    pub(crate) const PLACES: usize = 16;

    /// Whether every handshake place is taken.
    pub(crate) fn full(&self) -> bool {
        lock(&self.open).len() >= Self::PLACES
    }

    /// Enters `stream` (a clone of the connection's socket); returns its ticket.
    pub(crate) fn enter(&self, stream: UnixStream) -> u64 {
        let ticket = self.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.open).push_back((ticket, stream));
        ticket
    }

    /// Takes out the oldest handshake that has sent nothing or whose peer has gone, and takes it
    /// off `connections` at once (its thread will find its ticket gone and not count it off
    /// again); returns its socket, for the caller to tell it why and close it.
    pub(crate) fn evict_one(&self, connections: &AtomicU32) -> Option<UnixStream> {
        let mut open = lock(&self.open);
        let i = open.iter().position(|(_, s)| sent_nothing_or_gone(s))?;
        let (_, s) = open.remove(i)?;
        connections.fetch_sub(1, Ordering::SeqCst);
        Some(s)
    }

    /// The handshake with `ticket` is over, whichever way; false if it had been closed to make
    /// room (and its connection already counted off).
    pub(crate) fn leave(&self, ticket: u64) -> bool {
        let mut open = lock(&self.open);
        let before = open.len();
        open.retain(|(t, _)| *t != ticket);
        open.len() < before
    }
}

/// Whether `stream` has no byte waiting: nothing was sent, or the peer has closed it.
fn sent_nothing_or_gone(stream: &UnixStream) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use nix::sys::socket::{recv, MsgFlags};
    use std::os::fd::{AsFd, AsRawFd};
    let mut pfd = [PollFd::new(stream.as_fd(), PollFlags::POLLIN)];
    match poll(&mut pfd, PollTimeout::ZERO) {
        Ok(0) => true,
        // Readable: bytes (a Hello under way: keep it) or the end (gone: make room).
        Ok(_) => {
            let mut b = [0u8; 1];
            matches!(
                recv(
                    stream.as_raw_fd(),
                    &mut b,
                    MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT
                ),
                Ok(0) | Err(_)
            )
        }
        Err(_) => false,
    }
}
