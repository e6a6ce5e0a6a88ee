//! The inference side: accepts producer sessions, hands their tensors to the caller as zero-copy
//! views, and sends each result back to the producer that asked.
//!
//! Threads: one acceptor, one reader per connection. Requests from every session arrive on one
//! channel that the caller drains with [`Server::recv_timeout`]. Results, grants and errors are
//! written by whichever thread produces them, under a per-session lock, with a write timeout: a
//! producer that stops reading is disconnected rather than allowed to make the server buffer.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::fence;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use tensorport_shm::ring::{
    CqHeader, CqWriter, SqEntry, SqReader, CQ_GRANT, CQ_INLINE_BYTES, CQ_RESULT,
};
use tensorport_shm::{HostPool, PinHook, SlotState, SlotTable};
use tensorport_wire::{
    clip_message, decode_client, negotiate, validate_view, ClientMsg, Counters, ErrorCode, Hello,
    Outcome, PoolBounds, PoolLayout, RawDeviceHandle, RawLocation, RawTensorView, Role, ServerMsg,
    SessionStatus, SlotRef, StatusReport, TensorDesc, Welcome, WireError, MAX_DEVICE_BUFFERS,
    MAX_FRAME_LEN, PROTOCOL_VERSION,
};

use crate::fast::{Doorbell, IdSet, ServerRing};

use crate::device::{DeviceImporter, DeviceTensor, ImportedDevice};

use crate::conn::{peer_credentials, FrameReader, FrameWriter};
use crate::{path, Error, Result};

/// How a server is set up. [`ServerConfig::new`] gives sensible defaults.
#[derive(Clone)]
pub struct ServerConfig {
    /// Where to listen.
    pub socket: PathBuf,
    /// Slots in each producer's pool, unless the producer asks for fewer (or more, up to
    /// `max_slots_per_session`).
    pub slots_per_session: u32,
    /// Bytes per slot unless the producer asks otherwise (rounded up to the page size).
    pub slot_size: u64,
    /// Most slots a producer may ask for.
    pub max_slots_per_session: u32,
    /// Largest slot a producer may ask for.
    pub max_slot_size: u64,
    /// Most requests a session may have in flight; 0 means twice its slot count.
    pub max_in_flight: u32,
    /// Most producer sessions at once.
    pub max_sessions: u32,
    /// Bytes all producers' pools may reserve together; 0: a quarter of physical memory.
    pub memory_budget: u64,
    /// Bytes one producer's pool may reserve; 0: a quarter of the budget.
    pub max_session_bytes: u64,
    /// Time a new connection has to send `Hello`.
    pub handshake_timeout: Duration,
    /// Time a write to a producer may block before the producer is dropped as stalled.
    pub write_timeout: Duration,
    /// When every producer place is taken and another producer asks for one, a session with
    /// nothing in flight and no submit or answer for this long is closed to make room (the
    /// longest idle first). `Duration::ZERO`: never.
    pub idle_eviction: Duration,
    /// Uids allowed to connect besides the server's own.
    pub allowed_uids: Vec<u32>,
    /// Pins each pool (the CUDA build registers it with `cuMemHostRegister`).
    pub pin: Option<Arc<dyn PinHook>>,
    /// Opens device buffers producers register (the device path); `None` refuses them.
    pub device: Option<Arc<dyn DeviceImporter>>,
    /// Offer protocol-2 producers the shared-memory queues (on by default; off, every tensor
    /// travels on the socket as in protocol 1).
    pub rings: bool,
    /// How long [`Server::recv_timeout`] polls the queues before it sleeps on the doorbells:
    /// longer spins cost CPU and save the wake-up (a few microseconds) when work comes soon.
    pub spin: Duration,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("socket", &self.socket)
            .field("slots_per_session", &self.slots_per_session)
            .field("slot_size", &self.slot_size)
            .field("max_sessions", &self.max_sessions)
            .field("pinned", &self.pin.is_some())
            .field("device", &self.device.is_some())
            .finish_non_exhaustive()
    }
}

impl ServerConfig {
    /// Defaults: 8 slots of 1 MiB per producer (at most 256 slots of 256 MiB), 64 producers,
    /// pools within a quarter of physical memory together (a quarter of that each), 2 s to say
    /// hello, 5 s write timeout, own uid only, no pinning.
    pub fn new(socket: impl Into<PathBuf>) -> ServerConfig {
        ServerConfig {
            socket: socket.into(),
            slots_per_session: 8,
            slot_size: 1 << 20,
            max_slots_per_session: 256,
            max_slot_size: 256 << 20,
            max_in_flight: 0,
            max_sessions: 64,
            memory_budget: 0,
            max_session_bytes: 0,
            handshake_timeout: Duration::from_secs(2),
            write_timeout: Duration::from_secs(5),
            idle_eviction: Duration::from_secs(30),
            allowed_uids: Vec::new(),
            pin: None,
            device: None,
            rings: true,
            spin: Duration::from_micros(50),
        }
    }
}

#[derive(Default)]
struct AtomicCounters {
    submitted: AtomicU64,
    completed: AtomicU64,
    bytes: AtomicU64,
    protocol_errors: AtomicU64,
    sessions_opened: AtomicU64,
    sessions_reclaimed: AtomicU64,
    connections_refused: AtomicU64,
    batches: AtomicU64,
    batched: AtomicU64,
}

impl AtomicCounters {
    fn snapshot(&self) -> Counters {
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

struct Shared {
    config: ServerConfig,
    /// What the pools may reserve together, and the per-session cap.
    budget: crate::budget::MemoryBudget,
    max_session_bytes: u64,
    started: Instant,
    next_session: AtomicU64,
    sessions: Mutex<HashMap<u64, Arc<Session>>>,
    connections: AtomicU32,
    producers: AtomicU32,
    counters: AtomicCounters,
    draining: AtomicBool,
    stopping: AtomicBool,
    tx: Sender<Request>,
    /// The consumer sleeps on this: every session's "to server" doorbell (data: session id) and
    /// `wake` (data 0), rung for requests that arrive on a socket and for new sessions.
    epoll: Epoll,
    wake: Doorbell,
    consumer_sleeping: AtomicBool,
    /// Bumped whenever a session with queues opens or closes, so the consumer refreshes its list.
    ring_generation: AtomicU64,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain bookkeeping behind, still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Wakes the consumer if it sleeps (after a request went into the channel, or a session
    /// opened).
    fn wake_consumer(&self) {
        fence(Ordering::SeqCst);
        if self.consumer_sleeping.load(Ordering::SeqCst) {
            self.wake.ring();
        }
    }

    fn status(&self) -> StatusReport {
        let sessions = lock(&self.sessions);
        let mut list: Vec<SessionStatus> =
            sessions.values().take(256).map(|s| s.status()).collect();
        list.sort_by_key(|s| s.session_id);
        StatusReport {
            pid: std::process::id(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            draining: self.draining.load(Ordering::SeqCst),
            sessions: list,
            totals: self.counters.snapshot(),
        }
    }
}

/// A registered device buffer: open in the server, generation, whether a request holds it.
struct DeviceEntry {
    imported: Arc<dyn ImportedDevice>,
    generation: u32,
    in_flight: bool,
}

struct SessionState {
    slots: SlotTable,
    /// The server's end of the completion queue (unused without one).
    cq: CqWriter,
    devices: HashMap<u32, DeviceEntry>,
    in_flight: IdSet,
    submitted: u64,
    completed: u64,
    errors: u64,
    /// The session's last submit or answer (its opening, before either).
    last_active: Instant,
}

impl SessionState {
    /// Whether `request_id` was still owed its answer (it is not any more).
    fn settle(&mut self, request_id: u64) -> bool {
        let owed = self.in_flight.remove(&request_id);
        self.completed += owed as u64;
        self.last_active = Instant::now();
        owed
    }
}

/// The completion that answers `request_id` with `payload` (inline) and gives `grant` back.
fn answer_header(request_id: u64, payload: &[u8], grant: Option<SlotRef>) -> CqHeader {
    CqHeader {
        flags: CQ_RESULT | if grant.is_some() { CQ_GRANT } else { 0 },
        len: payload.len() as u32,
        request_id,
        slot: grant.map_or(0, |g| g.slot),
        generation: grant.map_or(0, |g| g.generation),
    }
}

struct Session {
    id: u64,
    name: String,
    pid: u32,
    pool: Arc<HostPool>,
    /// The pool's share of the memory budget, given back when the session's last reference
    /// (and so the pool's mapping here) goes.
    _charge: crate::budget::Charge,
    bounds: PoolBounds,
    max_in_flight: u32,
    state: Mutex<SessionState>,
    writer: Mutex<FrameWriter>,
    alive: AtomicBool,
    /// The shared-memory queues (protocol 2), if the session has them.
    ring: Option<ServerRing>,
}

impl Session {
    fn status(&self) -> SessionStatus {
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

    fn send(&self, msg: &ServerMsg) -> Result<()> {
        if !self.alive.load(Ordering::SeqCst) {
            return Err(Error::SessionGone);
        }
        let r = lock(&self.writer).send(msg, &[]);
        match &r {
            Ok(()) => {
                if let Some(ring) = &self.ring {
                    ring.mem.note_socket_message();
                }
            }
            Err(e) => {
                tracing::warn!(session = self.id, producer = %self.name, "dropping session: {e}");
                self.kill();
            }
        }
        r
    }

    /// Marks the session dead and closes its socket; its reader thread then reclaims it.
    fn kill(&self) {
        self.alive.store(false, Ordering::SeqCst);
        lock(&self.writer).shutdown();
    }

    fn send_error(
        &self,
        shared: &Shared,
        code: ErrorCode,
        request_id: Option<u64>,
        message: String,
    ) {
        shared
            .counters
            .protocol_errors
            .fetch_add(1, Ordering::Relaxed);
        lock(&self.state).errors += 1;
        tracing::warn!(session = self.id, producer = %self.name, ?code, request_id, "refused: {message}");
        let _ = self.send(&ServerMsg::Error {
            code: code.as_u16(),
            request_id,
            fatal: false,
            message: clip_message(message),
        });
    }

    /// Gives a device buffer back to its producer under the next generation.
    fn release_device(&self, buffer: SlotRef) {
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
        if let Some(r) = released {
            let _ = self.send(&ServerMsg::DeviceReleased(r));
        }
    }

    /// Gives a request's bytes back: a host slot (granted again at once unless the server
    /// drains) or a device buffer.
    fn release(&self, shared: &Shared, desc: &TensorDesc) {
        if desc.is_device() {
            self.release_device(desc.slot());
        } else {
            self.release_slot(shared, desc.slot());
        }
    }

    /// Takes a submitted slot back and, unless the server drains, grants it again at once.
    fn release_slot(&self, shared: &Shared, slot: SlotRef) {
        if let Some(g) = self.take_back(shared, slot) {
            self.send_grant(g);
        }
    }

    /// Grants a slot: on the completion queue if there is one, else on the socket.
    fn send_grant(&self, g: SlotRef) {
        let h = CqHeader {
            flags: CQ_GRANT,
            slot: g.slot,
            generation: g.generation,
            ..CqHeader::default()
        };
        if !self.complete(&h, &[]) {
            let _ = self.send(&ServerMsg::Grant(vec![g]));
        }
    }

    /// Publishes a completion on the queue; `false` if there is none or it is full (then the
    /// caller uses the socket). A corrupted queue kills the session.
    fn complete(&self, h: &CqHeader, payload: &[u8]) -> bool {
        let Some(ring) = &self.ring else {
            return false;
        };
        if !self.alive.load(Ordering::SeqCst) {
            return true;
        }
        let r = lock(&self.state).cq.push(&ring.mem, h, payload);
        self.published(r)
    }

    /// What a publish came to: wakes the producer after a push; a corrupted queue kills the
    /// session (and counts as done).
    fn published(&self, r: std::result::Result<bool, tensorport_shm::RingError>) -> bool {
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

    /// The hot path of `Request::respond`, under one lock: takes the slot back, settles the
    /// request, and publishes grant and result in one completion. `None` if it was published;
    /// otherwise what the caller must still send (the grant, whether an answer is owed).
    fn settle_and_publish(
        &self,
        shared: &Shared,
        slot: SlotRef,
        request_id: u64,
        payload: &[u8],
    ) -> Option<(Option<SlotRef>, bool)> {
        let mut st = lock(&self.state);
        let grant = self.regrant(&mut st, shared, slot);
        let owed = st.settle(request_id);
        let ring = match &self.ring {
            Some(r) if owed && payload.len() <= CQ_INLINE_BYTES => r,
            _ => return Some((grant, owed)),
        };
        if !self.alive.load(Ordering::SeqCst) {
            return Some((grant, owed));
        }
        let r = st.cq.push(
            &ring.mem,
            &answer_header(request_id, payload, grant),
            payload,
        );
        drop(st);
        if self.published(r) {
            shared.counters.completed.fetch_add(1, Ordering::Relaxed);
            None
        } else {
            Some((grant, owed))
        }
    }

    /// Takes a submitted slot back; returns the grant to send unless the server drains.
    fn take_back(&self, shared: &Shared, slot: SlotRef) -> Option<SlotRef> {
        self.regrant(&mut lock(&self.state), shared, slot)
    }

    fn regrant(&self, st: &mut SessionState, shared: &Shared, slot: SlotRef) -> Option<SlotRef> {
        if let Err(e) = st.slots.release(slot.slot, slot.generation) {
            tracing::error!(session = self.id, "internal: releasing {slot:?}: {e}");
            return None;
        }
        if self.alive.load(Ordering::SeqCst) && !shared.draining.load(Ordering::SeqCst) {
            st.slots.grant(slot.slot).ok().map(|generation| SlotRef {
                slot: slot.slot,
                generation,
            })
        } else {
            None
        }
    }
}

/// A tensor a producer submitted: a zero-copy view into its pool, valid until released.
///
/// Dropping a `Request` releases its slot (the producer may reuse it) and, if no result was
/// sent, sends the producer a `HandlerFailed` result, so every request gets exactly one answer.
pub struct Request {
    desc: TensorDesc,
    device: Option<DeviceTensor>,
    responder: Option<Responder>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request").field("desc", &self.desc).finish()
    }
}

impl Request {
    fn session(&self) -> &Arc<Session> {
        &self
            .responder
            .as_ref()
            .expect("responder present until drop")
            .session
    }

    /// The checked descriptor.
    pub fn desc(&self) -> &TensorDesc {
        &self.desc
    }

    /// The producer's id for this request.
    pub fn request_id(&self) -> u64 {
        self.responder.as_ref().map(|r| r.request_id).unwrap_or(0)
    }

    /// The session it came from.
    pub fn session_id(&self) -> u64 {
        self.session().id
    }

    /// The producer's name (from its `Hello`).
    pub fn producer(&self) -> &str {
        &self.session().name
    }

    /// For a tensor in a producer's device buffer (`desc().is_device()`): where it is, and the
    /// events that order the GPU work around it.
    pub fn device(&self) -> Option<&DeviceTensor> {
        self.device.as_ref()
    }

    /// The tensor's bytes, in place in the producer's pool (no copy was made). Empty for a
    /// device tensor (see [`Request::device`]).
    pub fn bytes(&self) -> &[u8] {
        if self.desc.is_device() {
            return &[];
        }
        let s = self.session();
        let slot = self.desc.slot();
        // SAFETY: the slot is in state Submitted in the session's table until this request
        // releases it (in `release` or `drop`), so the honest producer does not write it; the
        // descriptor was validated against this pool's bounds; the `Arc<HostPool>` held through
        // the session keeps the mapping alive for the borrow of `self`.
        unsafe {
            s.pool
                .slot_bytes(slot.slot, self.desc.offset(), self.desc.byte_len())
        }
        .expect("validated descriptor lies inside the pool")
    }

    /// The tensor's elements as `T`, if it is contiguous and `T` has the dtype's size.
    pub fn as_slice<T: bytemuck::Pod>(&self) -> Option<&[T]> {
        if self.desc.is_device()
            || !self.desc.is_contiguous()
            || std::mem::size_of::<T>() as u64 != self.desc.dtype().size()
        {
            return None;
        }
        let bytes = &self.bytes()[..(self.desc.numel() * self.desc.dtype().size()) as usize];
        bytemuck::try_cast_slice(bytes).ok()
    }

    /// Releases the slot now (the producer gets it back) and returns what answers the request.
    pub fn release(mut self) -> Responder {
        let r = self.responder.take().expect("responder present until drop");
        r.session.release(&r.shared, &self.desc);
        r
    }

    /// Releases the slot and sends `payload` as the result. On the shared-memory queues a
    /// result of up to 232 bytes travels in one completion with the slot's grant (no system
    /// call, no allocation); longer results go on the socket.
    pub fn respond(mut self, payload: &[u8]) -> Result<()> {
        let mut r = self.responder.take().expect("responder present until drop");
        if self.desc.is_device() {
            r.session.release_device(self.desc.slot());
            return r.answer(payload);
        }
        if payload.len() > MAX_FRAME_LEN as usize - 64 {
            r.session.release_slot(&r.shared, self.desc.slot());
            return r.answer(payload);
        }
        r.answered = true;
        match r
            .session
            .settle_and_publish(&r.shared, self.desc.slot(), r.request_id, payload)
        {
            None => Ok(()),
            Some((grant, owed)) => r.deliver(Ok(payload), grant, owed),
        }
    }

    /// Releases the slot and sends a failure as the result.
    pub fn fail(self, message: impl Into<String>) -> Result<()> {
        self.release().fail(message)
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if let Some(r) = self.responder.take() {
            r.session.release(&r.shared, &self.desc);
        }
    }
}

/// Answers one request, after its slot was released. Dropping it unanswered sends a failure.
pub struct Responder {
    session: Arc<Session>,
    shared: Arc<Shared>,
    request_id: u64,
    answered: bool,
}

impl std::fmt::Debug for Responder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Responder")
            .field("session", &self.session.id)
            .field("request_id", &self.request_id)
            .finish()
    }
}

impl Responder {
    /// The producer's id for this request.
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// The session it came from.
    pub fn session_id(&self) -> u64 {
        self.session.id
    }

    /// Whether the producer is still connected.
    pub fn is_alive(&self) -> bool {
        self.session.alive.load(Ordering::SeqCst)
    }

    /// Sends the answer, once; the slot was released before.
    fn finish(&mut self, answer: std::result::Result<&[u8], (ErrorCode, String)>) -> Result<()> {
        self.answered = true;
        let owed = lock(&self.session.state).settle(self.request_id);
        self.deliver(answer, None, owed)
    }

    /// Sends the answer (and `grant`, a slot given back with it): one completion on the
    /// shared-memory queue when the session has one and the result fits, else socket messages.
    /// `counted`: the request was still owed its answer.
    fn deliver(
        &mut self,
        answer: std::result::Result<&[u8], (ErrorCode, String)>,
        grant: Option<SlotRef>,
        counted: bool,
    ) -> Result<()> {
        if counted {
            self.shared
                .counters
                .completed
                .fetch_add(1, Ordering::Relaxed);
        }
        if let (true, Ok(payload)) = (counted, answer.as_ref()) {
            if payload.len() <= CQ_INLINE_BYTES {
                if !self.session.alive.load(Ordering::SeqCst) {
                    return Err(Error::SessionGone);
                }
                let h = answer_header(self.request_id, payload, grant);
                if self.session.complete(&h, payload) {
                    return Ok(());
                }
            }
        }
        if let Some(g) = grant {
            self.session.send_grant(g);
        }
        if !counted {
            return Ok(());
        }
        let outcome = match answer {
            Ok(payload) => Outcome::Ok(payload.to_vec()),
            Err((code, message)) => Outcome::Err {
                code: code.as_u16(),
                message,
            },
        };
        self.session.send(&ServerMsg::Result {
            request_id: self.request_id,
            outcome,
        })
    }

    fn answer(&mut self, payload: &[u8]) -> Result<()> {
        if payload.len() > MAX_FRAME_LEN as usize - 64 {
            let n = payload.len();
            self.finish(Err((
                ErrorCode::HandlerFailed,
                format!("result of {n} bytes is over the frame limit"),
            )))?;
            return Err(Error::ResultTooLarge(n));
        }
        self.finish(Ok(payload))
    }

    /// Sends `payload` as the result. Fails with [`Error::SessionGone`] if the producer left.
    pub fn respond(mut self, payload: &[u8]) -> Result<()> {
        self.answer(payload)
    }

    /// Sends a failure as the result.
    pub fn fail(mut self, message: impl Into<String>) -> Result<()> {
        self.finish(Err((
            ErrorCode::HandlerFailed,
            clip_message(message.into()),
        )))
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if !self.answered {
            let _ = self.finish(Err((
                ErrorCode::HandlerFailed,
                "the server dropped the request without a result".into(),
            )));
        }
    }
}

/// A session the consumer polls, with its submission-queue cursor (the consumer's alone: no
/// lock on the hot path).
struct Polled {
    session: Arc<Session>,
    sq: SqReader,
}

/// What the one consumer at a time (the caller of `recv_*`) keeps between calls.
struct Consumer {
    rx: Receiver<Request>,
    /// Sessions with queues, refreshed when `ring_generation` moves.
    sessions: Vec<Polled>,
    generation: u64,
    /// Where the next round-robin pass starts.
    next: usize,
    /// Requests taken in a row from the session at `next`.
    burst: u32,
    events: Vec<EpollEvent>,
}

/// A running server. Dropping it stops accepting, disconnects every session and removes the
/// socket file.
pub struct Server {
    shared: Arc<Shared>,
    consumer: Mutex<Consumer>,
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
    pub fn bind(config: ServerConfig) -> Result<Server> {
        let listener = path::bind_listener(&config.socket)?;
        listener
            .set_nonblocking(true)
            .map_err(Error::io("set listener non-blocking"))?;
        let (tx, rx) = mpsc::channel();
        let socket = config.socket.clone();
        let epoll =
            Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(Error::sys("epoll_create"))?;
        let wake = Doorbell::new()?;
        epoll
            .add(&wake, EpollEvent::new(EpollFlags::EPOLLIN, 0))
            .map_err(Error::sys("epoll_ctl"))?;
        let budget = match config.memory_budget {
            0 => crate::budget::physical_memory().map_or(u64::MAX, |m| m / 4),
            b => b,
        };
        let max_session_bytes = match config.max_session_bytes {
            0 => budget / 4,
            b => b.min(budget),
        };
        tracing::debug!(budget, max_session_bytes, "memory budget for pools");
        let shared = Arc::new(Shared {
            budget: crate::budget::MemoryBudget::new(budget),
            max_session_bytes,
            config,
            started: Instant::now(),
            next_session: AtomicU64::new(1),
            sessions: Mutex::new(HashMap::new()),
            connections: AtomicU32::new(0),
            producers: AtomicU32::new(0),
            counters: AtomicCounters::default(),
            draining: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            tx,
            epoll,
            wake,
            consumer_sleeping: AtomicBool::new(false),
            ring_generation: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("tensorport-accept".into())
            .spawn(move || accept_loop(sh, listener))
            .map_err(Error::io("spawn acceptor thread"))?;
        tracing::info!(socket = %socket.display(), "tensorport server listening");
        Ok(Server {
            shared,
            consumer: Mutex::new(Consumer {
                rx,
                sessions: Vec::new(),
                generation: u64::MAX,
                next: 0,
                burst: 0,
                events: vec![EpollEvent::empty(); 64],
            }),
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
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<Request>> {
        let mut c = lock(&self.consumer);
        self.next_request(&mut c, Instant::now() + timeout)
    }

    /// A batch: waits up to `timeout` for a first request, then collects more until there are
    /// `max` or `max_wait` has passed since the first arrived (like `ready_chunks(max)` with a
    /// deadline). Empty on timeout; `Err(Error::Stopped)` as for [`Server::recv_timeout`].
    pub fn recv_batch(
        &self,
        max: usize,
        timeout: Duration,
        max_wait: Duration,
    ) -> Result<Vec<Request>> {
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
    ) -> Result<()> {
        out.clear();
        let mut c = lock(&self.consumer);
        let Some(first) = self.next_request(&mut c, Instant::now() + timeout)? else {
            return Ok(());
        };
        out.push(first);
        let deadline = (!max_wait.is_zero()).then(|| Instant::now() + max_wait);
        while out.len() < max {
            match (self.try_take(&mut c), deadline) {
                (Some(r), _) => out.push(r),
                (None, None) => break,
                (None, Some(d)) if Instant::now() >= d => break,
                (None, Some(d)) => match self.next_request(&mut c, d) {
                    Ok(Some(r)) => out.push(r),
                    Ok(None) | Err(Error::Stopped) => break,
                    Err(e) => return Err(e),
                },
            }
        }
        drop(c);
        let k = &self.shared.counters;
        k.batches.fetch_add(1, Ordering::Relaxed);
        k.batched.fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn next_request(&self, c: &mut Consumer, deadline: Instant) -> Result<Option<Request>> {
        let spin = self.shared.config.spin;
        // The clock is first read after 32 empty looks: a request already waiting costs none.
        let (mut start, mut checked) = (None, None);
        let mut spins = 0u32;
        loop {
            if let Some(r) = self.try_take(c) {
                return Ok(Some(r));
            }
            // A few quick looks between reads of the clock.
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(32) {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                if self.is_finished() {
                    return Err(Error::Stopped);
                }
                return Ok(None);
            }
            if now.duration_since(*start.get_or_insert(now)) < spin {
                // Look at the (locked) session table only now and then while spinning.
                if now.duration_since(*checked.get_or_insert(now)) > Duration::from_millis(5) {
                    checked = Some(now);
                    if self.is_finished() {
                        return Err(Error::Stopped);
                    }
                }
                if spins.is_multiple_of(256) {
                    // Now and then give the core away (producers sharing it get to run).
                    std::thread::yield_now();
                }
                continue;
            }
            if self.is_finished() {
                return Err(Error::Stopped);
            }
            let step = deadline
                .saturating_duration_since(now)
                .min(Duration::from_millis(50));
            if let Some(r) = self.sleep(c, step) {
                return Ok(Some(r));
            }
        }
    }

    /// One request from the queues (one per session per pass, round robin) or the channel.
    fn try_take(&self, c: &mut Consumer) -> Option<Request> {
        let g = self.shared.ring_generation.load(Ordering::SeqCst);
        if g != c.generation {
            c.generation = g;
            // Sessions that stay keep their queue cursor; new ones start at the beginning.
            let mut old = std::mem::take(&mut c.sessions);
            c.sessions = lock(&self.shared.sessions)
                .values()
                .filter(|s| s.ring.is_some())
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
        const BURST: u32 = 16;
        let n = c.sessions.len();
        for k in 0..n {
            let i = (c.next + k) % n;
            let p = &mut c.sessions[i];
            if let Some(r) = take_from_ring(&self.shared, &p.session, &mut p.sq) {
                if k > 0 {
                    c.burst = 0;
                }
                c.burst += 1;
                if c.burst >= BURST {
                    c.burst = 0;
                    c.next = (i + 1) % n;
                } else {
                    c.next = i;
                }
                return Some(r);
            }
        }
        c.burst = 0;
        loop {
            match c.rx.try_recv() {
                Ok(r) if r.session().alive.load(Ordering::SeqCst) => return Some(r),
                Ok(_) => continue,
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return None,
            }
        }
    }

    /// Says it sleeps (to every queue and the socket readers), looks once more, then waits on
    /// the doorbells for at most `step`.
    fn sleep(&self, c: &mut Consumer, step: Duration) -> Option<Request> {
        let sh = &self.shared;
        sh.consumer_sleeping.store(true, Ordering::SeqCst);
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
            let n = sh
                .epoll
                .wait(&mut c.events, EpollTimeout::from(ms))
                .unwrap_or(0);
            for ev in &c.events[..n] {
                match ev.data() {
                    0 => sh.wake.clear(),
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
        sh.consumer_sleeping.store(false, Ordering::SeqCst);
        for p in &c.sessions {
            if let Some(ring) = &p.session.ring {
                ring.mem.set_server_waiting(false);
            }
        }
        got.or_else(|| self.try_take(c))
    }

    fn is_finished(&self) -> bool {
        self.shared.stopping.load(Ordering::SeqCst)
            || (self.shared.draining.load(Ordering::SeqCst)
                && lock(&self.shared.sessions).is_empty())
    }

    /// Figures for `tensorport ctl status`.
    pub fn status(&self) -> StatusReport {
        self.shared.status()
    }

    /// Stops taking new work: new producers are refused, open sessions are told to finish, and
    /// [`Server::recv_timeout`] returns [`Error::Stopped`] once they have all left.
    pub fn drain(&self) {
        drain(&self.shared);
    }

    /// Bytes the producers' pools reserve now, and the budget they share
    /// ([`ServerConfig::memory_budget`]).
    pub fn pool_memory(&self) -> (u64, u64) {
        (self.shared.budget.used(), self.shared.budget.limit())
    }

    /// Whether [`Server::drain`] was called (here or by a control client).
    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::SeqCst)
    }
}

fn drain(shared: &Shared) {
    if !shared.draining.swap(true, Ordering::SeqCst) {
        tracing::info!("draining: finishing work in flight, refusing new producers");
        let sessions: Vec<_> = lock(&shared.sessions).values().cloned().collect();
        for s in sessions {
            let _ = s.send(&ServerMsg::Draining);
        }
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

fn accept_loop(shared: Arc<Shared>, listener: UnixListener) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    while !shared.stopping.load(Ordering::SeqCst) {
        let mut pfd = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        if let Ok(0) | Err(_) = poll(&mut pfd, PollTimeout::from(100u16)) {
            continue;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_write_timeout(Some(shared.config.write_timeout));
        // Connections in handshake count too, so a flood of idle connections is bounded.
        let limit = shared.config.max_sessions.saturating_add(16);
        if shared.connections.load(Ordering::SeqCst) >= limit {
            shared
                .counters
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!("refusing connection: {limit} connections open");
            refuse(
                &stream,
                ErrorCode::TooManySessions,
                "too many connections".into(),
            );
            continue;
        }
        shared.connections.fetch_add(1, Ordering::SeqCst);
        let sh = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("tensorport-session".into())
            .spawn(move || {
                serve_connection(&sh, stream);
                sh.connections.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            shared.connections.fetch_sub(1, Ordering::SeqCst);
            tracing::error!("cannot spawn session thread: {e}");
        }
    }
}

fn refuse(stream: &UnixStream, code: ErrorCode, message: String) {
    if let Ok(s) = stream.try_clone() {
        let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
        let mut w = FrameWriter::new(s);
        let _ = w.send(
            &ServerMsg::Error {
                code: code.as_u16(),
                request_id: None,
                fatal: true,
                message: clip_message(message),
            },
            &[],
        );
        w.shutdown();
    }
}

enum Handshake {
    Hello(Hello),
    Refused(ErrorCode, String),
    Gone,
}

fn read_hello(reader: &mut FrameReader, timeout: Duration) -> Handshake {
    let deadline = Instant::now() + timeout;
    loop {
        match reader.next_payload() {
            Ok(Some(p)) => {
                return match decode_client(p) {
                    Ok(ClientMsg::Hello(h)) => Handshake::Hello(h),
                    Ok(other) => Handshake::Refused(
                        ErrorCode::HandshakeRequired,
                        format!("first message must be Hello, got {}", msg_name(&other)),
                    ),
                    Err(e) => Handshake::Refused(e.code(), e.to_string()),
                };
            }
            Ok(None) => {}
            Err(e) => return Handshake::Refused(e.code(), e.to_string()),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match reader.wait(Some(left)) {
            Ok(true) => {}
            Ok(false) => {
                return Handshake::Refused(
                    ErrorCode::HandshakeTimeout,
                    format!("no Hello within {timeout:?}"),
                )
            }
            Err(_) => return Handshake::Gone,
        }
        match reader.fill() {
            Ok(info) if info.bytes == 0 => return Handshake::Gone,
            Ok(info) if info.fds > 0 || info.truncated => {
                let n = reader.drop_fds();
                return Handshake::Refused(
                    ErrorCode::FdsNotExpected,
                    format!("{n} file descriptor(s) attached to the handshake, which carries none; closed them"),
                );
            }
            Ok(_) => {}
            Err(_) => return Handshake::Gone,
        }
    }
}

fn msg_name(m: &ClientMsg) -> &'static str {
    match m {
        ClientMsg::Hello(_) => "Hello",
        ClientMsg::Submit { .. } => "Submit",
        ClientMsg::Return(_) => "Return",
        ClientMsg::Status => "Status",
        ClientMsg::Drain => "Drain",
        ClientMsg::Goodbye => "Goodbye",
        ClientMsg::RegisterDevice { .. } => "RegisterDevice",
    }
}

fn serve_connection(shared: &Arc<Shared>, stream: UnixStream) {
    let creds = match peer_credentials(&stream) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("no peer credentials: {e}");
            return;
        }
    };
    let me = nix::unistd::geteuid().as_raw();
    if creds.uid() != me && !shared.config.allowed_uids.contains(&creds.uid()) {
        shared
            .counters
            .connections_refused
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            pid = creds.pid(),
            uid = creds.uid(),
            "refusing connection from another user"
        );
        refuse(
            &stream,
            ErrorCode::PermissionDenied,
            format!("uid {} may not use this server", creds.uid()),
        );
        return;
    }
    let Ok(wstream) = stream.try_clone() else {
        return;
    };
    let mut reader = FrameReader::new(stream, MAX_FRAME_LEN);
    let hello = match read_hello(&mut reader, shared.config.handshake_timeout) {
        Handshake::Hello(h) => h,
        Handshake::Gone => return,
        Handshake::Refused(code, message) => {
            shared
                .counters
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pid = creds.pid(), ?code, "handshake refused: {message}");
            refuse(reader.stream(), code, message);
            return;
        }
    };
    let version = match negotiate(&hello) {
        Ok(v) => v,
        Err(e) => {
            shared
                .counters
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pid = creds.pid(), "handshake refused: {e}");
            refuse(reader.stream(), e.code(), e.to_string());
            return;
        }
    };
    let writer = FrameWriter::new(wstream);
    match hello.role {
        Role::Control => serve_control(shared, reader, writer, version, &creds, &hello.name),
        Role::Producer => {
            let session = match open_session(shared, &hello, creds.pid() as u32, version, writer) {
                Ok(s) => s,
                Err((code, message)) => {
                    shared
                        .counters
                        .connections_refused
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pid = creds.pid(), ?code, "session refused: {message}");
                    refuse(reader.stream(), code, message);
                    return;
                }
            };
            let clean = serve_producer(shared, &session, &mut reader);
            close_session(shared, &session, clean);
        }
    }
}

/// Releases a reservation in `Shared::producers` when dropped, unless disarmed.
struct Reservation<'a>(&'a AtomicU32, bool);

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.1 {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Closes the producer session that has been idle longest, if one has been idle (nothing in
/// flight, no submit or answer) for `idle_eviction`; returns whether it did.
fn evict_idle(shared: &Shared) -> bool {
    let after = shared.config.idle_eviction;
    if after.is_zero() {
        return false;
    }
    let victim = lock(&shared.sessions)
        .values()
        .filter(|s| s.alive.load(Ordering::SeqCst))
        .filter_map(|s| {
            let st = lock(&s.state);
            let idle = st.last_active.elapsed();
            (st.in_flight.is_empty() && idle >= after).then(|| (idle, s.clone()))
        })
        .max_by_key(|(idle, _)| *idle);
    let Some((idle, s)) = victim else {
        return false;
    };
    tracing::warn!(
        session = s.id,
        producer = %s.name,
        idle_s = idle.as_secs_f64(),
        "closing an idle session to make room for a new producer"
    );
    let _ = s.send(&ServerMsg::Error {
        code: ErrorCode::TooManySessions.as_u16(),
        request_id: None,
        fatal: true,
        message: format!(
            "closed: idle for {:.0} s while every producer place was taken and another producer asked for one",
            idle.as_secs_f64()
        ),
    });
    s.kill();
    true
}

/// Creates the pool, registers the session, sends `Welcome` (with the fd) and the first grant.
fn open_session(
    shared: &Arc<Shared>,
    hello: &Hello,
    pid: u32,
    version: u16,
    mut writer: FrameWriter,
) -> std::result::Result<Arc<Session>, (ErrorCode, String)> {
    let cfg = &shared.config;
    if shared.draining.load(Ordering::SeqCst) {
        return Err((ErrorCode::Draining, "the server is draining".into()));
    }
    // Reserve a place among the producers before building anything; when all are taken, an
    // idle session may give its place up (it leaves through its reader thread, so wait for it).
    let max = cfg.max_sessions;
    let take = || {
        shared
            .producers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    };
    let mut placed = take();
    if !placed && evict_idle(shared) {
        let deadline = Instant::now() + Duration::from_secs(2);
        while !placed && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
            placed = take();
        }
    }
    if !placed {
        return Err((
            ErrorCode::TooManySessions,
            format!("the server has its maximum of {max} producers; try again later or raise --max-sessions"),
        ));
    }
    let mut reservation = Reservation(&shared.producers, true);
    let slots = match hello.want_slots {
        0 => cfg.slots_per_session,
        n => n.min(cfg.max_slots_per_session),
    }
    .max(1);
    let slot_size = match hello.want_slot_size {
        0 => cfg.slot_size,
        n => n.min(cfg.max_slot_size),
    };
    // Charge the budget before a byte is reserved: the pool's size as HostPool will make it.
    let want = HostPool::size_for(slots, slot_size).map_or(u64::MAX, |(_, len)| len);
    if want > shared.max_session_bytes {
        return Err((
            ErrorCode::MemoryBudget,
            format!(
                "a pool of {want} bytes ({slots} slots of {slot_size}) is over the {} bytes one producer may have; ask for fewer or smaller slots",
                shared.max_session_bytes
            ),
        ));
    }
    let charge = shared.budget.charge(want).map_err(|used| {
        (
            ErrorCode::MemoryBudget,
            format!(
                "the server's memory for pools is spent ({used} of {} bytes reserved; this pool needs {want}); try again later, or start the server with a larger --memory-budget",
                shared.budget.limit()
            ),
        )
    })?;
    let id = shared.next_session.fetch_add(1, Ordering::SeqCst);
    let mut pool = HostPool::create("tensorport-pool", slots, slot_size)
        .map_err(|e| (ErrorCode::Internal, e.to_string()))?;
    if let Some(pin) = &cfg.pin {
        pool.pin_with(pin.as_ref())
            .map_err(|e| (ErrorCode::Internal, e.to_string()))?;
    }
    let layout = PoolLayout {
        slot_count: pool.slot_count(),
        slot_size: pool.slot_size(),
        pool_len: pool.len(),
    };
    let max_in_flight = match cfg.max_in_flight {
        0 => slots.saturating_mul(2),
        n => n,
    };
    let mut table = SlotTable::new(slots);
    let grant: Vec<SlotRef> = table
        .grant_free()
        .into_iter()
        .map(|(slot, generation)| SlotRef { slot, generation })
        .collect();
    // Protocol 2: the hot path moves to shared-memory queues. Every submission occupies at most
    // one submission entry until the server takes it, and every completion entry answers a
    // request in flight or grants a slot, so these sizes never make a side wait on the other.
    let ring = if version >= 2 && cfg.rings {
        let cq = slots.saturating_add(max_in_flight).saturating_add(8);
        Some(
            ServerRing::create(max_in_flight.max(8), cq)
                .map_err(|e| (ErrorCode::Internal, e.to_string()))?,
        )
    } else {
        None
    };
    let mut fds = vec![pool.fd()];
    if let Some(r) = &ring {
        fds.extend(r.fds());
    }
    let welcome = ServerMsg::Welcome(Welcome {
        version,
        session_id: id,
        pool: layout,
        max_in_flight,
        fds: fds.len() as u8,
    });
    writer
        .send(&welcome, &fds)
        .map_err(|e| (ErrorCode::Internal, format!("sending Welcome: {e}")))?;
    drop(fds);
    // The slot table is not shared until registration below, so the grant cannot race a submit.
    for chunk in grant.chunks(tensorport_wire::MAX_GRANT) {
        writer
            .send(&ServerMsg::Grant(chunk.to_vec()), &[])
            .map_err(|e| (ErrorCode::Internal, format!("sending Grant: {e}")))?;
    }
    let session = Arc::new(Session {
        id,
        name: hello.name.clone(),
        pid,
        bounds: PoolBounds {
            slot_count: layout.slot_count,
            slot_size: layout.slot_size,
        },
        pool: Arc::new(pool),
        _charge: charge,
        max_in_flight,
        state: Mutex::new(SessionState {
            slots: table,
            cq: CqWriter::default(),
            devices: HashMap::new(),
            in_flight: IdSet::with_capacity_and_hasher(
                max_in_flight.min(4096) as usize,
                Default::default(),
            ),
            submitted: 0,
            last_active: Instant::now(),
            completed: 0,
            errors: 0,
        }),
        writer: Mutex::new(writer),
        alive: AtomicBool::new(true),
        ring,
    });
    lock(&shared.sessions).insert(id, session.clone());
    if let Some(r) = &session.ring {
        if let Err(e) = shared
            .epoll
            .add(&r.to_server, EpollEvent::new(EpollFlags::EPOLLIN, id))
        {
            lock(&shared.sessions).remove(&id);
            return Err((ErrorCode::Internal, format!("epoll_ctl: {e}")));
        }
        shared.ring_generation.fetch_add(1, Ordering::SeqCst);
        shared.wake_consumer();
    }
    // From here the reservation is released by `close_session`.
    reservation.1 = false;
    shared
        .counters
        .sessions_opened
        .fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        session = id,
        producer = %hello.name,
        pid,
        slots,
        slot_size = layout.slot_size,
        "producer connected"
    );
    Ok(session)
}

/// Reads a producer's messages until it leaves. Returns whether it left cleanly (`Goodbye`).
fn serve_producer(shared: &Arc<Shared>, session: &Arc<Session>, reader: &mut FrameReader) -> bool {
    let mut truncated = false;
    loop {
        loop {
            let msg = match reader.next_payload() {
                Ok(Some(p)) => tensorport_wire::decode_client_naming(p),
                Ok(None) => break,
                Err(e) => {
                    fatal(shared, session, e);
                    return false;
                }
            };
            let msg = match msg {
                Ok(m) => m,
                Err((e, _)) if e.is_fatal() => {
                    fatal(shared, session, e);
                    return false;
                }
                // A Submit refused for its sizes (rank over 8, say) names its request.
                Err((e, request_id)) => {
                    session.send_error(shared, e.code(), request_id, e.to_string());
                    continue;
                }
            };
            match msg {
                ClientMsg::Submit { request_id, tensor } => {
                    match admit(shared, session, request_id, &tensor.view()) {
                        Ok(req) => {
                            // The receiver lives as long as the Server; if it is being dropped,
                            // the request is dropped too (and released).
                            let _ = shared.tx.send(req);
                            shared.wake_consumer();
                        }
                        Err((code, message)) => {
                            session.send_error(shared, code, Some(request_id), message)
                        }
                    }
                }
                ClientMsg::Return(s) => {
                    let r = lock(&session.state).slots.give_back(s.slot, s.generation);
                    if let Err(e) = r {
                        session.send_error(shared, ErrorCode::SlotNotLeased, None, e.to_string());
                    }
                }
                ClientMsg::Status => {
                    let _ = session.send(&ServerMsg::Status(shared.status()));
                }
                // Draining is the operator's (a control session: `tensorport ctl drain`), not
                // any producer's: one producer could otherwise stop everyone's work.
                ClientMsg::Drain => {
                    tracing::warn!(
                        session = session.id,
                        "refused Drain from a producer session"
                    );
                    session.send_error(
                        shared,
                        ErrorCode::PermissionDenied,
                        None,
                        "Drain is for control sessions (`tensorport ctl drain`), not producers"
                            .into(),
                    );
                }
                ClientMsg::Goodbye => return true,
                ClientMsg::RegisterDevice {
                    buffer,
                    len,
                    handle,
                } => {
                    // A VMM handle is the one message that carries a descriptor.
                    let fd = match handle {
                        RawDeviceHandle::VmmPosixFd => reader.take_fd(),
                        _ => None,
                    };
                    if let Err((code, message)) =
                        register_device(shared, session, buffer, len, &handle, fd)
                    {
                        session.send_error(shared, code, None, message);
                    }
                }
                ClientMsg::Hello(_) => session.send_error(
                    shared,
                    ErrorCode::HandshakeRequired,
                    None,
                    "Hello sent twice".into(),
                ),
            }
        }
        // Descriptors no message claimed are closed and refused — unless the frame they came
        // with is still arriving (they travel with its first bytes).
        if reader.pending() == 0 && (reader.fds_waiting() > 0 || truncated) {
            let n = reader.drop_fds();
            truncated = false;
            session.send_error(
                shared,
                ErrorCode::FdsNotExpected,
                None,
                format!(
                    "{n} file descriptor(s) attached to a message that carries none; closed them"
                ),
            );
        }
        if !session.alive.load(Ordering::SeqCst) || shared.stopping.load(Ordering::SeqCst) {
            return false;
        }
        match reader.fill() {
            Ok(info) if info.bytes == 0 => return false,
            Ok(info) => truncated |= info.truncated,
            Err(e) => {
                tracing::debug!(session = session.id, "read failed: {e}");
                return false;
            }
        }
    }
}

fn fatal(shared: &Shared, session: &Session, e: WireError) {
    shared
        .counters
        .protocol_errors
        .fetch_add(1, Ordering::Relaxed);
    tracing::warn!(session = session.id, producer = %session.name, code = ?e.code(), "closing session: {e}");
    let _ = session.send(&ServerMsg::Error {
        code: e.code().as_u16(),
        request_id: None,
        fatal: true,
        message: clip_message(e.to_string()),
    });
}

/// The next valid submission on `session`'s queue, if any. Invalid ones are refused on the
/// socket, one error each, as on the socket path; a corrupted queue closes the session.
fn take_from_ring(
    shared: &Arc<Shared>,
    session: &Arc<Session>,
    sq: &mut SqReader,
) -> Option<Request> {
    let ring = session.ring.as_ref()?;
    if !session.alive.load(Ordering::SeqCst) {
        return None;
    }
    loop {
        let e: SqEntry = match sq.pop(&ring.mem) {
            Ok(Some(e)) => e,
            Ok(None) => return None,
            Err(err) => {
                shared
                    .counters
                    .protocol_errors
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(session = session.id, producer = %session.name, "closing session: {err}");
                let _ = session.send(&ServerMsg::Error {
                    code: ErrorCode::Malformed.as_u16(),
                    request_id: None,
                    fatal: true,
                    message: clip_message(err.to_string()),
                });
                session.kill();
                return None;
            }
        };
        let rank = e.rank as usize;
        if rank > tensorport_wire::MAX_DIMS {
            let w = WireError::BadRank(rank);
            session.send_error(shared, w.code(), Some(e.request_id), w.to_string());
            continue;
        }
        let location = RawLocation::HostSlot(SlotRef {
            slot: e.slot,
            generation: e.generation,
        });
        let view = RawTensorView {
            dtype: e.dtype,
            shape: &e.shape[..rank],
            strides: e.has_strides.then_some(&e.strides[..rank]),
            offset: e.offset,
            len: e.len,
            location: &location,
            fence: None,
        };
        match admit(shared, session, e.request_id, &view) {
            Ok(r) => return Some(r),
            Err((code, message)) => session.send_error(shared, code, Some(e.request_id), message),
        }
    }
}

/// Checks a submission against the session (descriptor, slot state, limits) and makes it a
/// [`Request`].
fn admit(
    shared: &Arc<Shared>,
    session: &Arc<Session>,
    request_id: u64,
    tensor: &RawTensorView<'_>,
) -> std::result::Result<Request, (ErrorCode, String)> {
    if shared.draining.load(Ordering::SeqCst) {
        return Err((ErrorCode::Draining, "the server is draining".into()));
    }
    let mut st = lock(&session.state);
    let desc = {
        let devices = &st.devices;
        validate_view(tensor, &session.bounds, &|b| {
            devices.get(&b).map(|e| e.imported.len())
        })
        .map_err(|e| (e.code(), e.to_string()))?
    };
    let slot = desc.slot();
    let mut device = None;
    {
        if st.in_flight.contains(&request_id) {
            return Err((
                ErrorCode::DuplicateRequest,
                format!("request {request_id} is already in flight"),
            ));
        }
        if st.in_flight.len() >= session.max_in_flight as usize {
            return Err((
                ErrorCode::TooManyInFlight,
                format!("{} requests already in flight", st.in_flight.len()),
            ));
        }
        if desc.is_device() {
            let e = st
                .devices
                .get_mut(&slot.slot)
                .expect("validated: registered");
            if e.in_flight || e.generation != slot.generation {
                return Err((
                    ErrorCode::SlotNotLeased,
                    format!(
                        "device buffer {} is {} at generation {}, not free at {}",
                        slot.slot,
                        if e.in_flight { "in flight" } else { "free" },
                        e.generation,
                        slot.generation
                    ),
                ));
            }
            if e.imported.timeline() != desc.timeline().is_some() {
                let why = if e.imported.timeline() {
                    "is timeline-fenced: each submit needs a Timeline fence"
                } else {
                    "is event-fenced: submits carry no fence"
                };
                return Err((
                    ErrorCode::Unsupported,
                    format!("device buffer {} {why}", slot.slot),
                ));
            }
            e.in_flight = true;
            device = Some(DeviceTensor {
                buffer: e.imported.clone(),
                offset: desc.offset(),
                len: desc.byte_len(),
                timeline: desc.timeline(),
            });
        } else {
            st.slots
                .submit(slot.slot, slot.generation)
                .map_err(|e| (ErrorCode::SlotNotLeased, e.to_string()))?;
        }
        st.in_flight.insert(request_id);
        st.submitted += 1;
        st.last_active = Instant::now();
    }
    drop(st);
    shared.counters.submitted.fetch_add(1, Ordering::Relaxed);
    shared
        .counters
        .bytes
        .fetch_add(desc.byte_len(), Ordering::Relaxed);
    Ok(Request {
        desc,
        device,
        responder: Some(Responder {
            session: session.clone(),
            shared: shared.clone(),
            request_id,
            answered: false,
        }),
    })
}

fn register_device(
    shared: &Arc<Shared>,
    session: &Arc<Session>,
    buffer: u32,
    len: u64,
    handle: &RawDeviceHandle,
    fd: Option<std::os::fd::OwnedFd>,
) -> std::result::Result<(), (ErrorCode, String)> {
    let importer = shared.config.device.as_ref().ok_or((
        ErrorCode::Unsupported,
        "this server takes no device buffers (it was started without a GPU)".to_string(),
    ))?;
    if buffer >= MAX_DEVICE_BUFFERS || len == 0 {
        return Err((
            ErrorCode::OutOfBounds,
            format!("device buffer {buffer} of {len} bytes (buffers 0..{MAX_DEVICE_BUFFERS}, non-empty)"),
        ));
    }
    if lock(&session.state).devices.contains_key(&buffer) {
        return Err((
            ErrorCode::DuplicateRequest,
            format!("device buffer {buffer} is already registered"),
        ));
    }
    if matches!(handle, RawDeviceHandle::VmmPosixFd) && fd.is_none() {
        return Err((
            ErrorCode::Malformed,
            format!("device buffer {buffer}: a VMM handle needs its file descriptor attached"),
        ));
    }
    let imported = importer.import(len, handle, fd).map_err(|e| {
        (
            ErrorCode::Internal,
            format!("cannot open device buffer {buffer}: {e}"),
        )
    })?;
    let release_event = imported.release_event_handle();
    lock(&session.state).devices.insert(
        buffer,
        DeviceEntry {
            imported,
            generation: 0,
            in_flight: false,
        },
    );
    tracing::info!(
        session = session.id,
        buffer,
        len,
        "device buffer registered"
    );
    let _ = session.send(&ServerMsg::DeviceRegistered {
        buffer,
        release_event,
    });
    Ok(())
}

fn close_session(shared: &Shared, session: &Arc<Session>, clean: bool) {
    let was_alive = session.alive.swap(false, Ordering::SeqCst);
    // Counted before the socket closes and the session leaves the table, so whoever sees either
    // also sees the count.
    if !clean {
        shared
            .counters
            .sessions_reclaimed
            .fetch_add(1, Ordering::SeqCst);
    }
    if lock(&shared.sessions).remove(&session.id).is_some() {
        shared.producers.fetch_sub(1, Ordering::SeqCst);
    }
    if let Some(r) = &session.ring {
        let _ = shared.epoll.delete(&r.to_server);
        shared.ring_generation.fetch_add(1, Ordering::SeqCst);
    }
    lock(&session.writer).shutdown();
    let st = session.status();
    if clean {
        tracing::info!(session = session.id, producer = %session.name, "producer left");
    } else {
        tracing::warn!(
            session = session.id,
            producer = %session.name,
            pid = session.pid,
            granted = st.granted,
            in_flight = st.in_flight,
            killed_by_server = !was_alive,
            "producer gone; reclaiming its pool and slots"
        );
    }
}

fn serve_control(
    shared: &Arc<Shared>,
    mut reader: FrameReader,
    mut writer: FrameWriter,
    version: u16,
    creds: &nix::sys::socket::UnixCredentials,
    name: &str,
) {
    let welcome = ServerMsg::Welcome(Welcome {
        version,
        session_id: 0,
        pool: PoolLayout {
            slot_count: 0,
            slot_size: 0,
            pool_len: 0,
        },
        max_in_flight: 0,
        fds: 0,
    });
    if writer.send(&welcome, &[]).is_err() {
        return;
    }
    loop {
        let msg = match reader.next_payload() {
            Ok(Some(p)) => decode_client(p),
            Ok(None) => match reader.fill() {
                Ok(info) if info.bytes > 0 && info.fds == 0 => continue,
                _ => return,
            },
            Err(_) => return,
        };
        let reply = match msg {
            Ok(ClientMsg::Status) => ServerMsg::Status(shared.status()),
            Ok(ClientMsg::Drain) => {
                tracing::info!(
                    pid = creds.pid(),
                    uid = creds.uid(),
                    client = name,
                    "drain asked by a control session"
                );
                drain(shared);
                ServerMsg::Draining
            }
            Ok(ClientMsg::Goodbye) => return,
            Ok(other) => ServerMsg::Error {
                code: ErrorCode::Unsupported.as_u16(),
                request_id: None,
                fatal: false,
                message: format!("{} is not for control sessions", msg_name(&other)),
            },
            Err(e) => ServerMsg::Error {
                code: e.code().as_u16(),
                request_id: None,
                fatal: true,
                message: clip_message(e.to_string()),
            },
        };
        let fatal = matches!(reply, ServerMsg::Error { fatal: true, .. });
        if writer.send(&reply, &[]).is_err() || fatal {
            return;
        }
    }
}

/// The version this server speaks (for logs and `--version`).
pub fn protocol_version() -> u16 {
    PROTOCOL_VERSION
}
