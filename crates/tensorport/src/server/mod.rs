//! The inference side: accepts producer sessions, hands their tensors to the caller as zero-copy
//! views, and sends each result back to the producer that asked.
//!
//! # Threads
//! - **The acceptor** (`accept.rs`) takes connections and gives each its own thread.
//! - **A connection's thread** checks credentials and `Hello`, then serves a control session
//!   (`control.rs`) or a producer session (`reader.rs`): it reads the producer's messages and
//!   writes the output its socket did not take at once, and reclaims the session at the end.
//! - **The consumers** — whoever calls [`Server::recv_timeout`] / [`Server::recv_batch`]
//!   (`consumer.rs`) — poll their sessions' shared-memory queues and the channel the readers
//!   feed, and answer through [`Request`] / [`Responder`] (`request.rs`). With
//!   [`ServerConfig::consumers`] = N the sessions are dealt out to N shards, and N threads may
//!   receive at once, each from its own shard (one thread alone takes the shards in turn).
//!
//! Nothing one session does makes another wait: every message to a producer goes through its
//! [`outbox`], which never blocks (the socket takes it, or it waits in a bounded queue that the
//! producer's own thread flushes; a producer that does not read is dropped).
//!
//! # Modules that name each other
//! `shared` (the session table every thread sees), `session` (one producer's state), `pace` (a
//! session's pacing, which reads the table to share the rate) and `request` (a tensor handed to
//! the caller, which answers through its session) refer to each other by design: a session
//! lives in the table and is paced against the others in it. Every other module of the server
//! depends on them and not back.
//!
//! # Lock order
//! a shard's `Consumer` (one at a time per thread) → `Shared::sessions` → `Session::state` →
//! `Outbox::queue`. A thread holding
//! one may take the ones after it, never those before; the outbox's lock is a leaf (nothing is
//! taken while it is held, and no system call under it can block).

mod accept;
mod admission;
mod budget;
mod config;
mod consumer;
mod control;
pub(crate) mod outbox;
mod pace;
mod reader;
mod request;
mod session;
mod shared;

use std::collections::HashMap;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use tensorport_wire::{StatusReport, PROTOCOL_VERSION};

use crate::fast::Doorbell;
use crate::{path, Error, Result};
use crate::{BindError, Stopped};

pub use config::ServerConfig;
pub use pace::Pace;
pub use request::{Request, Responder};

use crate::lock;
use accept::accept_loop;
use consumer::Consumer;
use shared::{AtomicCounters, Shard, Shared};

/// A running server. Dropping it stops accepting, disconnects every session and removes the
/// socket file.
pub struct Server {
    shared: Arc<Shared>,
    /// One per shard; a caller of `recv_*` takes the first that is free.
    consumers: Vec<Mutex<Consumer>>,
    next_consumer: std::sync::atomic::AtomicUsize,
    acceptor: Option<JoinHandle<()>>,
    socket: PathBuf,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("socket", &self.socket)
            .finish()
    }
}

impl Server {
    /// Binds the socket (see [`crate::path::bind_listener`]) and starts accepting producers.
    pub fn bind(config: ServerConfig) -> std::result::Result<Server, BindError> {
        let listener = path::bind_listener(&config.socket)?;
        Self::serve(config, listener).map_err(BindError::failed)
    }

    /// Starts accepting producers on `listener`.
    fn serve(config: ServerConfig, listener: UnixListener) -> Result<Server> {
        listener
            .set_nonblocking(true)
            .map_err(Error::io("set listener non-blocking"))?;
        let socket = config.socket.clone();
        let mut shards = Vec::new();
        let mut consumers = Vec::new();
        for k in 0..config.consumers.max(1) {
            let (tx, rx) = mpsc::channel();
            let epoll =
                Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(Error::sys("epoll_create"))?;
            let wake = Doorbell::new()?;
            epoll
                .add(&wake, EpollEvent::new(EpollFlags::EPOLLIN, 0))
                .map_err(Error::sys("epoll_ctl"))?;
            shards.push(Shard {
                tx,
                epoll,
                wake,
                sleeping: AtomicBool::new(false),
                ring_generation: AtomicU64::new(0),
                sessions: AtomicU32::new(0),
            });
            consumers.push(Mutex::new(Consumer::new(k, rx)));
        }
        let budget = match config.memory_budget {
            0 => budget::physical_memory().map_or(u64::MAX, |m| m / 4),
            b => b,
        };
        let max_session_bytes = match config.max_session_bytes {
            0 => budget / 4,
            b => b.min(budget),
        };
        tracing::debug!(budget, max_session_bytes, "memory budget for pools");
        let config_pace = config.pace;
        let shared = Arc::new(Shared {
            budget: budget::MemoryBudget::new(budget),
            max_session_bytes,
            config,
            started: Instant::now(),
            next_session: AtomicU64::new(1),
            sessions: Mutex::new(HashMap::new()),
            connections: AtomicU32::new(0),
            producers: AtomicU32::new(0),
            handshakes: Default::default(),
            counters: AtomicCounters::default(),
            draining: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            shards,
            pacer: config_pace.map(pace::Pacer::new),
        });
        let sh = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("tensorport-accept".into())
            .spawn(move || accept_loop(sh, listener))
            .map_err(Error::io("spawn acceptor thread"))?;
        tracing::info!(socket = %socket.display(), "tensorport server listening");
        Ok(Server {
            shared,
            consumers,
            next_consumer: std::sync::atomic::AtomicUsize::new(0),
            acceptor: Some(acceptor),
            socket,
        })
    }

    /// The socket path.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The next request, waiting at most `timeout`. `Ok(None)` on timeout;
    /// `Err(Error::Stopped)` once the server drains and every producer has left.
    ///
    /// Polls the sessions' shared-memory queues (round robin) and the socket path for
    /// [`ServerConfig::spin`], then sleeps on the doorbells. Requests from producers that died
    /// after submitting are skipped (and their slots freed).
    ///
    /// With [`ServerConfig::consumers`] above 1, as many threads may call this (or
    /// [`Server::recv_batch`]) at once, each then serving a different share of the sessions.
    pub fn recv_timeout(&self, timeout: Duration) -> std::result::Result<Option<Request>, Stopped> {
        self.consumer()
            .next_request(&self.shared, Instant::now() + timeout)
    }

    /// A shard's consumer for this call: the next in turn that no other thread holds (so one
    /// caller still serves every shard, in turn), or, when all are held, the next in turn.
    fn consumer(&self) -> std::sync::MutexGuard<'_, Consumer> {
        let n = self.consumers.len();
        if n == 1 {
            return lock(&self.consumers[0]);
        }
        let start = self.next_consumer.fetch_add(1, Ordering::Relaxed);
        for k in 0..n {
            if let Ok(c) = self.consumers[(start + k) % n].try_lock() {
                return c;
            }
        }
        lock(&self.consumers[start % n])
    }

    /// A batch: waits up to `timeout` for a first request, then collects more until there are
    /// `max` or `max_wait` has passed since the first arrived (like `ready_chunks(max)` with a
    /// deadline). Empty on timeout; `Err(Error::Stopped)` as for [`Server::recv_timeout`].
    pub fn recv_batch(
        &self,
        max: usize,
        timeout: Duration,
        max_wait: Duration,
    ) -> std::result::Result<Vec<Request>, Stopped> {
        let mut out = Vec::with_capacity(max);
        self.recv_batch_into(&mut out, max, timeout, max_wait)?;
        Ok(out)
    }

    /// [`Server::recv_batch`] into a vector the caller keeps (cleared first), so a serving
    /// loop allocates nothing per batch.
    pub fn recv_batch_into(
        &self,
        out: &mut Vec<Request>,
        max: usize,
        timeout: Duration,
        max_wait: Duration,
    ) -> std::result::Result<(), Stopped> {
        out.clear();
        let mut c = self.consumer();
        let Some(first) = c.next_request(&self.shared, Instant::now() + timeout)? else {
            return Ok(());
        };
        out.push(first);
        let deadline = (!max_wait.is_zero()).then(|| Instant::now() + max_wait);
        while out.len() < max {
            let room = max - out.len();
            match (c.try_take_into(&self.shared, out, room), deadline) {
                (1.., _) => {}
                (0, None) => break,
                (0, Some(d)) if Instant::now() >= d => break,
                (0, Some(d)) => match c.next_request(&self.shared, d) {
                    Ok(Some(r)) => out.push(r),
                    // Stopped with a batch in hand: it is served; the next call says stopped.
                    Ok(None) | Err(Stopped) => break,
                },
            }
        }
        drop(c);
        let k = &self.shared.counters;
        k.batches.fetch_add(1, Ordering::Relaxed);
        k.batched.fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// A batch of what arrives until `deadline`: up to `max` requests, returned once there are
    /// `max` or the deadline has passed (at once, with what is queued, if it already has).
    /// Empty if none came; `Err(Error::Stopped)` as for [`Server::recv_timeout`].
    pub fn recv_batch_until(
        &self,
        max: usize,
        deadline: Instant,
    ) -> std::result::Result<Vec<Request>, Stopped> {
        let mut out = Vec::with_capacity(max);
        let mut c = self.consumer();
        while out.len() < max {
            let room = max - out.len();
            if c.try_take_into(&self.shared, &mut out, room) > 0 {
                continue;
            }
            if Instant::now() >= deadline {
                break;
            }
            match c.next_request(&self.shared, deadline) {
                Ok(Some(r)) => out.push(r),
                Ok(None) => break,
                // Stopped with a batch in hand: it is served; the next call says stopped.
                Err(Stopped) if !out.is_empty() => break,
                Err(Stopped) => return Err(Stopped),
            }
        }
        drop(c);
        if !out.is_empty() {
            let k = &self.shared.counters;
            k.batches.fetch_add(1, Ordering::Relaxed);
            k.batched.fetch_add(out.len() as u64, Ordering::Relaxed);
        }
        Ok(out)
    }

    /// Answers a batch, each request with its payload, and empties `answers` (keep it for the
    /// next batch: nothing is allocated). The results go out as [`Request::respond`] sends
    /// them, but the requests of one session that follow each other are answered together: one
    /// lock, one publication on its completion queue and at most one wake-up for all of them,
    /// where answering one by one costs each of those per request. Every request is answered
    /// (or its producer is gone) whatever this returns: the first error, if any.
    pub fn respond_all<R: AsRef<[u8]>>(&self, answers: &mut Vec<(Request, R)>) -> Result<()> {
        let mut first = Ok(());
        let mut keep = |r: Result<()>| {
            if first.is_ok() {
                first = r;
            }
        };
        let mut i = 0;
        while i < answers.len() {
            let (req, payload) = &mut answers[i];
            let session = match req.answering_session() {
                Some(s) if !req.desc().is_device() => s.clone(),
                // Device tensors give their buffer back under the session's lock first: alone.
                Some(_) => {
                    keep(req.settle(session::Answer::Ok(payload.as_ref())));
                    i += 1;
                    continue;
                }
                None => {
                    i += 1;
                    continue;
                }
            };
            let run = answers[i..]
                .iter()
                .take_while(|(r, _)| {
                    !r.desc().is_device()
                        && r.answering_session()
                            .is_some_and(|s| Arc::ptr_eq(s, &session))
                })
                .count();
            keep(
                session.answer_all(answers[i..i + run].iter_mut().map(|(r, payload)| {
                    let (id, slot) = r.hand_over();
                    let payload: &R = payload;
                    (id, session::Answer::Ok(payload.as_ref()), slot)
                })),
            );
            i += run;
        }
        answers.clear();
        first
    }

    /// Figures for `tensorport ctl status`.
    pub fn status(&self) -> StatusReport {
        self.shared.status()
    }

    /// Stops taking new work: new producers are refused, open sessions are told to finish, and
    /// [`Server::recv_timeout`] returns [`Error::Stopped`] once they have all left.
    pub fn drain(&self) {
        self.shared.drain();
    }

    /// Bytes the producers' pools reserve now, and the budget they share
    /// ([`ServerConfig::memory_budget`]).
    pub fn pool_memory(&self) -> (u64, u64) {
        (self.shared.budget.used(), self.shared.budget.limit())
    }

    /// Whether [`Server::drain`] was called (here or by a control client).
    pub fn is_draining(&self) -> bool {
        self.shared.is_draining()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let sessions: Vec<_> = lock(&self.shared.sessions)
            .drain()
            .map(|(_, s)| s)
            .collect();
        for s in sessions {
            s.kill();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The version this server speaks (for logs and `--version`).
pub fn protocol_version() -> u16 {
    PROTOCOL_VERSION
}

#[cfg(test)]
mod tests;
