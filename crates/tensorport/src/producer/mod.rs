//! The producer side: lease a slot, write the tensor into it, submit, collect the result.
//!
//! ```no_run
//! # use tensorport::{Producer, ProducerConfig, TensorSpec};
//! # use tensorport_wire::DType;
//! # use std::time::Duration;
//! let mut p = Producer::connect("/run/user/1000/tensorport/tensorport.sock", ProducerConfig::new("prep-0"))?;
//! let mut lease = p.lease(Duration::from_secs(5))?;       // a slot of the shared pool, ours alone
//! lease.write_pod(0, &[0.5f32; 3 * 224 * 224]);           // fill it in place
//! let id = lease.submit(&TensorSpec::new(DType::F32, &[3, 224, 224]))?; // the lease is gone now
//! let done = p.recv_result(Duration::from_secs(5))?;      // the server's answer
//! assert_eq!(done.request_id, id);
//! # Ok::<(), tensorport::Error>(())
//! ```
//!
//! A lease borrows the producer mutably and `submit` consumes it, so a slot cannot be written
//! after it was handed over. A lease dropped without `submit` goes back to the free list.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use tensorport_shm::ring::{CQ_DEVICE_RELEASED, CQ_GRANT, CQ_INLINE_BYTES, CQ_RESULT};
use tensorport_shm::HostPool;
use tensorport_wire::{
    ClientMsg, ErrorCode, Outcome, PoolLayout, Role, ServerMsg, SlotRef, StatusReport, WireError,
    PROTOCOL_VERSION,
};

use crate::client::{self, next_msg};
use crate::conn::{FrameReader, FrameWriter};
use crate::fast::{IdMap, ProducerRing};
use crate::{ConnectError, RecvError};
use crate::{Error, Result};
use tensorport_wire::decode_server;

mod completion;
mod device;
mod lease;
mod spec;
mod submit;
mod warm;

use completion::Done;
pub use completion::{Completion, RemoteError};
use device::DeviceState;
use lease::LoanHome;
pub use lease::{Loan, SlotLease};
pub use spec::{ProducerConfig, TensorSpec};
use submit::Held;
use warm::WarmLease;
pub use warm::{WARM_MIN_SLOT, WARM_SKIP_AFTER_MISS};

/// A connected producer session with its own pool.
pub struct Producer {
    link: Link,
    slots: Slots,
    requests: Requests,
    /// The last status the server sent (control sessions ask for it).
    status: Option<StatusReport>,
    /// The server said it is draining: no new work.
    draining: bool,
}

/// The connection to the server: the socket, the queues, and how they are watched.
struct Link {
    reader: FrameReader,
    writer: FrameWriter,
    /// The protocol version negotiated.
    version: u16,
    session_id: u64,
    /// The shared-memory queues, if the server gave us some.
    ring: Option<ProducerRing>,
    spin: Duration,
    /// When the socket was last looked at without sleeping on it (a system call, so only every
    /// [`SOCKET_LOOK_EVERY`] on the queue path).
    socket_looked: Instant,
    /// The server's socket-message counter when we last looked.
    socket_seen: u64,
}

/// This producer's pool and the slots it holds.
struct Slots {
    pool: Arc<HostPool>,
    layout: PoolLayout,
    /// Where dropped [`Loan`]s leave their slots; also what makes a loan ours.
    home: Arc<LoanHome>,
    /// Loans out (not yet submitted or given back).
    loaned: usize,
    free: VecDeque<SlotRef>,
    /// The warm lease (large slots): see [`warm`].
    warm: WarmLease,
}

/// The requests in flight, and what came back for them.
struct Requests {
    in_flight: IdMap<Held>,
    max_in_flight: u32,
    next_id: u64,
    done: VecDeque<Done>,
    devices: HashMap<u32, DeviceState>,
    registered: Option<(u32, Vec<u8>)>,
}

/// Looks at the queue between two reads of the clock while spinning.
const SPINS_PER_LOOK: u32 = 32;

/// How often a producer on the queues looks at its socket while it is busy or spinning (errors,
/// draining and long results travel there; it sleeps on the socket too).
const SOCKET_LOOK_EVERY: Duration = Duration::from_micros(100);

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("session_id", &self.link.session_id)
            .field("layout", &self.slots.layout)
            .field("free", &self.slots.free.len())
            .field("in_flight", &self.requests.in_flight.len())
            .finish()
    }
}

impl Producer {
    /// Connects to the server at `socket`, receives and maps the session's pool.
    pub fn connect(
        socket: impl AsRef<Path>,
        config: ProducerConfig,
    ) -> std::result::Result<Producer, ConnectError> {
        Self::open(socket.as_ref(), config)
    }

    fn open(socket: &Path, config: ProducerConfig) -> std::result::Result<Producer, ConnectError> {
        let c = client::connect(
            socket,
            Role::Producer,
            &config.name,
            config.slots,
            config.slot_size,
            if config.rings { PROTOCOL_VERSION } else { 1 },
            config.connect_timeout,
        )?;
        let layout = c.welcome.pool;
        let mut fds = c.fds.into_iter();
        let fd = fds.next().ok_or_else(|| ConnectError::Refused {
            code: ErrorCode::Malformed,
            message: "a producer Welcome without a pool".into(),
        })?;
        let pool = HostPool::open(fd, layout.slot_count, layout.slot_size)
            .map_err(|e| ConnectError::failed(e.into()))?;
        let ring = match (fds.next(), fds.next(), fds.next()) {
            (None, None, None) => None,
            (Some(r), Some(a), Some(b)) if c.welcome.version >= 2 => {
                Some(ProducerRing::open(r, a, b).map_err(ConnectError::failed)?)
            }
            _ => {
                return Err(ConnectError::Refused {
                    code: ErrorCode::Malformed,
                    message: format!(
                        "a protocol-{} Welcome with {} descriptors",
                        c.welcome.version, c.welcome.fds
                    ),
                })
            }
        };
        Ok(Producer {
            link: Link {
                reader: c.reader,
                writer: c.writer,
                version: c.welcome.version,
                session_id: c.welcome.session_id,
                ring,
                spin: config.spin,
                socket_looked: Instant::now() - SOCKET_LOOK_EVERY * 2,
                socket_seen: 0,
            },
            slots: Slots {
                pool: Arc::new(pool),
                layout,
                home: Arc::new(LoanHome::default()),
                loaned: 0,
                free: VecDeque::new(),
                warm: WarmLease::new(layout.slot_size, config.warm_wait),
            },
            requests: Requests {
                in_flight: IdMap::default(),
                max_in_flight: c.welcome.max_in_flight.max(1),
                next_id: 1,
                done: VecDeque::new(),
                devices: HashMap::new(),
                registered: None,
            },
            status: None,
            draining: false,
        })
    }

    /// Whether this session hands tensors over on the shared-memory queues (protocol 2).
    pub fn uses_rings(&self) -> bool {
        self.link.ring.is_some()
    }

    /// The session id the server gave us.
    pub fn session_id(&self) -> u64 {
        self.link.session_id
    }

    /// The pool's layout.
    pub fn layout(&self) -> PoolLayout {
        self.slots.layout
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> u64 {
        self.slots.layout.slot_size
    }

    /// The pool's memfd (sealed: it can be neither shrunk nor grown).
    pub fn pool_fd(&self) -> BorrowedFd<'_> {
        self.slots.pool.fd()
    }

    /// The pool, mapped in this process: to register its memory with a transfer engine that
    /// writes tensors straight into slots this producer holds on [`Producer::loan`]. Holding it
    /// keeps the mapping alive; writing a slot not on loan tears another request's tensor.
    pub fn pool(&self) -> Arc<HostPool> {
        self.slots.pool.clone()
    }

    /// Requests submitted whose result has not been taken (still with the server, or received
    /// and waiting in [`Producer::ready`]).
    pub fn in_flight(&self) -> usize {
        self.requests.in_flight.len() + self.requests.done.len()
    }

    /// Results received and not yet taken.
    pub fn ready(&self) -> usize {
        self.requests.done.len()
    }

    /// Slots granted to us and not leased.
    pub fn free_slots(&self) -> usize {
        self.slots.free.len()
    }

    /// Whether the server told us it drains.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Most requests in flight the server allows this session.
    pub fn max_in_flight(&self) -> u32 {
        self.requests.max_in_flight
    }

    fn handle(&mut self, msg: ServerMsg) -> Result<()> {
        match msg {
            ServerMsg::Grant(slots) => {
                // A client checks what the server says too: a slot past the pool would index
                // outside the mapping (the queue path drops such grants the same way).
                if let Some(bad) = slots
                    .iter()
                    .find(|s| s.slot >= self.slots.layout.slot_count)
                {
                    return Err(Error::Protocol(WireError::Malformed(format!(
                        "the server granted slot {} of a pool of {}",
                        bad.slot, self.slots.layout.slot_count
                    ))));
                }
                self.slots.free.extend(slots)
            }
            ServerMsg::Result {
                request_id,
                outcome,
            } => {
                if self.requests.in_flight.remove(&request_id).is_some() {
                    self.requests.done.push_back(Done::Message(Completion {
                        request_id,
                        result: match outcome {
                            Outcome::Ok(b) => Ok(b),
                            Outcome::Err { code, message } => Err(RemoteError {
                                code: ErrorCode::from_u16(code),
                                message,
                            }),
                        },
                    }));
                }
            }
            ServerMsg::Error {
                code,
                request_id,
                fatal,
                message,
            } => {
                let code = ErrorCode::from_u16(code);
                if let Some(id) = request_id.filter(|_| !fatal) {
                    // The submit was refused before the server took the slot: it is still ours.
                    if let Some(held) = self.requests.in_flight.remove(&id) {
                        match held {
                            Held::Host(slot) => self.slots.free.push_back(slot),
                            Held::Device(b) => {
                                if let Some(d) = self.requests.devices.get_mut(&b) {
                                    d.in_flight = false;
                                }
                            }
                        }
                        self.requests.done.push_back(Done::Message(Completion {
                            request_id: id,
                            result: Err(RemoteError { code, message }),
                        }));
                    }
                } else {
                    return Err(Error::Refused { code, message });
                }
            }
            ServerMsg::Status(s) => self.status = Some(s),
            ServerMsg::DeviceRegistered {
                buffer,
                release_event,
            } => self.requests.registered = Some((buffer, release_event)),
            ServerMsg::DeviceReleased(r) => {
                if let Some(d) = self.requests.devices.get_mut(&r.slot) {
                    d.generation = r.generation;
                    d.in_flight = false;
                }
            }
            ServerMsg::Draining => self.draining = true,
            ServerMsg::Welcome(_) => {
                return Err(Error::Refused {
                    code: ErrorCode::Malformed,
                    message: "a second Welcome".into(),
                })
            }
        }
        Ok(())
    }

    /// Handles what arrives — completions on the queue, messages on the socket — until
    /// something did or `deadline` passes; returns whether something did.
    fn pump(&mut self, deadline: Option<Instant>) -> Result<bool> {
        if self.link.ring.is_none() {
            return match next_msg(&mut self.link.reader, deadline)? {
                Some(m) => {
                    self.handle(m)?;
                    Ok(true)
                }
                None => Ok(false),
            };
        }
        let mut start = None;
        let mut spins = 0u32;
        loop {
            if self.drain_ring()? {
                return Ok(true);
            }
            // Between clock reads, a few quick looks at the queue.
            if start.is_some() && !spins.is_multiple_of(SPINS_PER_LOOK) {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            spins = spins.wrapping_add(1);
            // The socket carries errors, draining and results too long for the queue: frames
            // already read are handled at once; the socket itself is looked at every 100 µs
            // while spinning, once more at the deadline, and slept on with the doorbell.
            let buffered = match self.link.reader.next_payload()? {
                Some(p) => Some(decode_server(p)?),
                None => None,
            };
            if let Some(m) = buffered {
                self.handle(m)?;
                return Ok(true);
            }
            let now = Instant::now();
            let expired = deadline.is_some_and(|d| now >= d);
            if self.socket_news() || now.duration_since(self.link.socket_looked) > SOCKET_LOOK_EVERY
            {
                self.link.socket_looked = now;
                if let Some(m) = next_msg(&mut self.link.reader, Some(now))? {
                    self.handle(m)?;
                    return Ok(true);
                }
            }
            if expired {
                return self.drain_ring();
            }
            if now.duration_since(*start.get_or_insert(now)) < self.link.spin {
                if spins % (SPINS_PER_LOOK * 8) == 1 {
                    // Now and then give the core away (a consumer sharing it gets to run).
                    std::thread::yield_now();
                }
                continue;
            }
            self.sleep(deadline)?;
            start = None;
        }
    }

    /// Says we sleep, looks at the queue once more, then waits for the doorbell or the socket.
    fn sleep(&mut self, deadline: Option<Instant>) -> Result<()> {
        let ring = self.link.ring.as_mut().expect("only with a ring");
        ring.mem.set_producer_waiting(true);
        fence(Ordering::SeqCst);
        if ring.has_work() {
            ring.mem.set_producer_waiting(false);
            return Ok(());
        }
        let ring = self.link.ring.as_ref().expect("only with a ring");
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let timeout = match left {
            None => PollTimeout::NONE,
            Some(l) => PollTimeout::try_from(l.as_millis().clamp(1, i32::MAX as u128) as i32)
                .unwrap_or(PollTimeout::MAX),
        };
        let mut pfd = [
            PollFd::new(self.link.reader.stream().as_fd(), PollFlags::POLLIN),
            PollFd::new(ring.to_producer.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut pfd, timeout) {
            Ok(_) | Err(nix::Error::EINTR) => {}
            Err(e) => {
                ring.mem.set_producer_waiting(false);
                return Err(Error::sys("poll")(e));
            }
        }
        let readable = |p: &PollFd| p.revents().is_some_and(|r| !r.is_empty());
        let (sock, bell) = (readable(&pfd[0]), readable(&pfd[1]));
        if bell {
            ring.to_producer.clear();
        }
        ring.mem.set_producer_waiting(false);
        if sock && self.link.reader.fill()?.bytes == 0 {
            return Err(Error::ServerGone);
        }
        Ok(())
    }

    /// Whether the server wrote to the socket since we last looked (its counter in the queue
    /// header moved). Dead servers write nothing: waits also look at the socket on a timer and
    /// sleep on it.
    fn socket_news(&mut self) -> bool {
        let Some(ring) = &self.link.ring else {
            return false;
        };
        let n = ring.mem.socket_messages();
        if n == self.link.socket_seen {
            return false;
        }
        self.link.socket_seen = n;
        true
    }

    /// Handles every completion on the queue; returns whether there was any.
    fn drain_ring(&mut self) -> Result<bool> {
        let Some(ring) = self.link.ring.as_mut() else {
            return Ok(false);
        };
        let mut any = false;
        let mut bytes = [0u8; CQ_INLINE_BYTES];
        while let Some(h) = ring.next(&mut bytes)? {
            any = true;
            if h.flags & CQ_GRANT != 0 && h.slot < self.slots.layout.slot_count {
                self.slots.free.push_back(SlotRef {
                    slot: h.slot,
                    generation: h.generation,
                });
            }
            if h.flags & CQ_DEVICE_RELEASED != 0 {
                if let Some(d) = self.requests.devices.get_mut(&h.slot) {
                    d.generation = h.generation;
                    d.in_flight = false;
                }
            }
            if h.flags & CQ_RESULT != 0 && self.requests.in_flight.remove(&h.request_id).is_some() {
                // `pop` bounds the length by CQ_INLINE_BYTES (232).
                self.requests.done.push_back(Done::Inline {
                    request_id: h.request_id,
                    len: h.len as u8,
                    bytes,
                });
            }
        }
        Ok(any)
    }

    /// Handles everything already received, without waiting.
    pub fn poll(&mut self) -> Result<()> {
        if self.slots.loaned > 0 {
            self.reclaim_loans();
        }
        if self.link.ring.is_none() {
            while self.pump(Some(Instant::now()))? {}
            return Ok(());
        }
        // The queue path makes no system call and reads no clock: the socket is read when the
        // server's message counter in the queue header says it wrote something.
        self.drain_ring()?;
        while let Some(p) = self.link.reader.next_payload()? {
            let m = decode_server(p)?;
            self.handle(m)?;
        }
        if self.socket_news() {
            let now = Instant::now();
            self.link.socket_looked = now;
            while let Some(m) = next_msg(&mut self.link.reader, Some(now))? {
                self.handle(m)?;
            }
        }
        Ok(())
    }

    /// The next result, waiting up to `timeout`.
    pub fn recv_result(&mut self, timeout: Duration) -> std::result::Result<Completion, RecvError> {
        Ok(self.next_done(timeout)?.into_completion())
    }

    /// [`Producer::recv_result`] without allocating: the result's bytes are copied into `out`
    /// (cleared first; it grows only for a result longer than its capacity). Returns the
    /// request id, and the result's length or the server's error.
    pub fn recv_result_into(
        &mut self,
        timeout: Duration,
        out: &mut Vec<u8>,
    ) -> std::result::Result<(u64, std::result::Result<usize, RemoteError>), RecvError> {
        out.clear();
        Ok(match self.next_done(timeout)? {
            Done::Inline {
                request_id,
                len,
                bytes,
            } => {
                out.extend_from_slice(&bytes[..len as usize]);
                (request_id, Ok(len as usize))
            }
            Done::Message(c) => match c.result {
                Ok(v) => {
                    out.extend_from_slice(&v);
                    (c.request_id, Ok(v.len()))
                }
                Err(e) => (c.request_id, Err(e)),
            },
        })
    }

    fn next_done(&mut self, timeout: Duration) -> std::result::Result<Done, RecvError> {
        let mut deadline = None;
        loop {
            if let Some(c) = self.requests.done.pop_front() {
                return Ok(c);
            }
            if self.requests.in_flight.is_empty() {
                return Err(RecvError::NothingInFlight);
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + timeout);
            let news = self.pump(Some(deadline)).map_err(RecvError::broken)?;
            if !news && Instant::now() >= deadline {
                return Err(RecvError::Timeout(timeout));
            }
        }
    }

    /// A result if one is ready, without waiting for the server.
    pub fn try_recv_result(&mut self) -> std::result::Result<Option<Completion>, RecvError> {
        if self.requests.done.is_empty() {
            self.poll().map_err(RecvError::broken)?;
        }
        Ok(self.requests.done.pop_front().map(Done::into_completion))
    }

    /// The server's status.
    pub fn status(&mut self, timeout: Duration) -> Result<StatusReport> {
        self.status = None;
        self.link.writer.send(&ClientMsg::Status, &[])?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.status.take() {
                return Ok(s);
            }
            if !self.pump(Some(deadline))? && Instant::now() >= deadline {
                return Err(Error::Timeout(timeout, "the server's status"));
            }
        }
    }

    /// Ends the session cleanly. Results not yet received are lost.
    pub fn close(mut self) -> Result<()> {
        self.goodbye()
    }

    /// Ends the session cleanly without consuming the producer (for owners that cannot move it
    /// out); nothing may be sent after it.
    pub fn goodbye(&mut self) -> Result<()> {
        self.link.writer.send(&ClientMsg::Goodbye, &[])
    }
}

/// The control socket. With the shared-memory queues ([`Producer::uses_rings`]) results and
/// grants do not make it readable: wait with [`Producer::recv_result`] or [`Producer::lease`].
impl AsFd for Producer {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.link.reader.stream().as_fd()
    }
}
