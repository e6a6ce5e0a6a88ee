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
use tensorport_shm::ring::{SqEntry, CQ_DEVICE_RELEASED, CQ_GRANT, CQ_INLINE_BYTES, CQ_RESULT};
use tensorport_shm::HostPool;
use tensorport_wire::{
    validate_view, ClientMsg, DType, ErrorCode, Outcome, PoolBounds, PoolLayout, RawDeviceHandle,
    RawLocation, RawTensorDesc, RawTensorView, Role, ServerMsg, SlotRef, StatusReport, WireError,
    MAX_DIMS, PROTOCOL_VERSION,
};

use crate::client::{self, next_msg};
use crate::conn::{FrameReader, FrameWriter};
use crate::fast::{IdMap, ProducerRing};
use crate::{Error, Result};
use tensorport_wire::decode_server;

/// How a producer connects.
#[derive(Debug, Clone)]
pub struct ProducerConfig {
    /// A name for the server's logs and status.
    pub name: String,
    /// Slots to ask for (0: the server's default).
    pub slots: u32,
    /// Bytes per slot to ask for (0: the server's default).
    pub slot_size: u64,
    /// How long to wait for the server's `Welcome`.
    pub connect_timeout: Duration,
    /// Use the shared-memory queues if the server offers them (protocol 2; on by default). Off,
    /// every submission and result travels on the socket (protocol 1).
    pub rings: bool,
    /// How long a wait (lease, result) polls the queues before it sleeps on the doorbell:
    /// longer spins cost CPU and save the wake-up when the server answers soon.
    pub spin: Duration,
}

impl ProducerConfig {
    /// Server defaults for the pool, 5 s to connect.
    pub fn new(name: impl Into<String>) -> ProducerConfig {
        ProducerConfig {
            name: name.into(),
            slots: 0,
            slot_size: 0,
            connect_timeout: Duration::from_secs(5),
            rings: true,
            spin: Duration::from_micros(20),
        }
    }
}

/// Shape, dtype and placement of a tensor inside a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// Strides in elements (`None`: row-major contiguous).
    pub strides: Option<Vec<u64>>,
    /// Byte offset of element 0 in the slot.
    pub offset: u64,
}

impl TensorSpec {
    /// A contiguous tensor at the start of the slot.
    pub fn new(dtype: DType, shape: &[u64]) -> TensorSpec {
        TensorSpec {
            dtype,
            shape: shape.to_vec(),
            strides: None,
            offset: 0,
        }
    }

    /// Places element 0 at `offset` bytes into the slot.
    pub fn at_offset(mut self, offset: u64) -> TensorSpec {
        self.offset = offset;
        self
    }

    /// Uses these strides (in elements).
    pub fn with_strides(mut self, strides: &[u64]) -> TensorSpec {
        self.strides = Some(strides.to_vec());
        self
    }

    /// Bytes the tensor spans from its offset, or `None` on overflow or with more than
    /// [`MAX_DIMS`] dimensions.
    pub fn extent(&self) -> Option<u64> {
        let elem = self.dtype.size();
        if self.shape.len() > MAX_DIMS {
            return None;
        }
        if self.shape.contains(&0) {
            return Some(0);
        }
        let natural;
        let strides: &[u64] = match &self.strides {
            Some(s) => s,
            None => {
                natural = tensorport_wire::desc::contiguous_strides(&self.shape)?;
                &natural[..self.shape.len()]
            }
        };
        let mut last: u64 = 0;
        for (d, s) in self.shape.iter().zip(strides.iter()) {
            last = last.checked_add((d - 1).checked_mul(*s)?)?;
        }
        last.checked_add(1)?.checked_mul(elem)
    }

    /// The byte length a descriptor of this spec announces.
    fn byte_len(&self) -> Result<u64> {
        if self.shape.len() > MAX_DIMS {
            return Err(Error::InvalidTensor(WireError::BadRank(self.shape.len())));
        }
        self.extent()
            .ok_or_else(|| Error::InvalidTensor(WireError::ShapeOverflow(self.shape.clone())))
    }

    fn to_raw(&self, location: RawLocation) -> Result<RawTensorDesc> {
        Ok(RawTensorDesc {
            dtype: self.dtype as u8,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            offset: self.offset,
            len: self.byte_len()?,
            location,
            fence: None,
        })
    }
}

/// What a request in flight holds until the server gives it back.
#[derive(Debug, Clone, Copy)]
enum Held {
    Host(SlotRef),
    Device(u32),
}

/// A device buffer this producer registered.
#[derive(Debug, Clone)]
struct DeviceState {
    len: u64,
    generation: u32,
    in_flight: bool,
}

/// A failure the server reported for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteError {
    /// Protocol code.
    pub code: ErrorCode,
    /// The server's explanation.
    pub message: String,
}

impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

impl std::error::Error for RemoteError {}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The request's id, as returned by `submit`.
    pub request_id: u64,
    /// The result bytes, or why there are none.
    pub result: std::result::Result<Vec<u8>, RemoteError>,
}

/// A result received and not yet taken: inline, as it came on the queue (no allocation), or a
/// socket message's.
#[derive(Debug)]
// Inline on purpose: boxing the bytes is the allocation this type exists to avoid.
#[allow(clippy::large_enum_variant)]
enum Done {
    Inline {
        request_id: u64,
        len: u8,
        bytes: [u8; CQ_INLINE_BYTES],
    },
    Message(Completion),
}

impl Done {
    fn into_completion(self) -> Completion {
        match self {
            Done::Inline {
                request_id,
                len,
                bytes,
            } => Completion {
                request_id,
                result: Ok(bytes[..len as usize].to_vec()),
            },
            Done::Message(c) => c,
        }
    }
}

/// A connected producer session with its own pool.
pub struct Producer {
    reader: FrameReader,
    writer: FrameWriter,
    pool: Arc<HostPool>,
    /// The protocol version negotiated.
    version: u16,
    /// Where dropped [`Loan`]s leave their slots; also what makes a loan ours.
    home: Arc<LoanHome>,
    /// Loans out (not yet submitted or given back).
    loaned: usize,
    layout: PoolLayout,
    session_id: u64,
    max_in_flight: u32,
    free: VecDeque<SlotRef>,
    in_flight: IdMap<Held>,
    devices: HashMap<u32, DeviceState>,
    registered: Option<(u32, Vec<u8>)>,
    done: VecDeque<Done>,
    status: Option<StatusReport>,
    draining: bool,
    next_id: u64,
    /// The shared-memory queues, if the server gave us some.
    ring: Option<ProducerRing>,
    spin: Duration,
    /// When the socket was last looked at without sleeping on it (a system call, so only every
    /// [`SOCKET_LOOK_EVERY`] on the queue path).
    socket_looked: Instant,
    /// The server's socket-message counter when we last looked.
    socket_seen: u64,
}

/// Looks at the queue between two reads of the clock while spinning.
const SPINS_PER_LOOK: u32 = 32;

/// How often a producer on the queues looks at its socket while it is busy or spinning (errors,
/// draining and long results travel there; it sleeps on the socket too).
const SOCKET_LOOK_EVERY: Duration = Duration::from_micros(100);

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("session_id", &self.session_id)
            .field("layout", &self.layout)
            .field("free", &self.free.len())
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

impl Producer {
    /// Connects to the server at `socket`, receives and maps the session's pool.
    pub fn connect(socket: impl AsRef<Path>, config: ProducerConfig) -> Result<Producer> {
        let c = client::connect(
            socket.as_ref(),
            Role::Producer,
            &config.name,
            config.slots,
            config.slot_size,
            if config.rings { PROTOCOL_VERSION } else { 1 },
            config.connect_timeout,
        )?;
        let layout = c.welcome.pool;
        let mut fds = c.fds.into_iter();
        let fd = fds.next().ok_or_else(|| Error::Refused {
            code: ErrorCode::Malformed,
            message: "a producer Welcome without a pool".into(),
        })?;
        let pool = HostPool::open(fd, layout.slot_count, layout.slot_size)?;
        let ring = match (fds.next(), fds.next(), fds.next()) {
            (None, None, None) => None,
            (Some(r), Some(a), Some(b)) if c.welcome.version >= 2 => {
                Some(ProducerRing::open(r, a, b)?)
            }
            _ => {
                return Err(Error::Refused {
                    code: ErrorCode::Malformed,
                    message: format!(
                        "a protocol-{} Welcome with {} descriptors",
                        c.welcome.version, c.welcome.fds
                    ),
                })
            }
        };
        Ok(Producer {
            reader: c.reader,
            writer: c.writer,
            pool: Arc::new(pool),
            version: c.welcome.version,
            home: Arc::new(LoanHome::default()),
            loaned: 0,
            layout,
            session_id: c.welcome.session_id,
            max_in_flight: c.welcome.max_in_flight.max(1),
            free: VecDeque::new(),
            in_flight: IdMap::default(),
            devices: HashMap::new(),
            registered: None,
            done: VecDeque::new(),
            status: None,
            draining: false,
            next_id: 1,
            ring,
            spin: config.spin,
            socket_looked: Instant::now() - SOCKET_LOOK_EVERY * 2,
            socket_seen: 0,
        })
    }

    /// Whether this session hands tensors over on the shared-memory queues (protocol 2).
    pub fn uses_rings(&self) -> bool {
        self.ring.is_some()
    }

    /// The session id the server gave us.
    pub fn session_id(&self) -> u64 {
        self.session_id
    }

    /// The pool's layout.
    pub fn layout(&self) -> PoolLayout {
        self.layout
    }

    /// Bytes per slot.
    pub fn slot_size(&self) -> u64 {
        self.layout.slot_size
    }

    /// The pool's memfd (sealed: it can be neither shrunk nor grown).
    pub fn pool_fd(&self) -> BorrowedFd<'_> {
        self.pool.fd()
    }

    /// Requests submitted whose result has not been taken (still with the server, or received
    /// and waiting in [`Producer::ready`]).
    pub fn in_flight(&self) -> usize {
        self.in_flight.len() + self.done.len()
    }

    /// Results received and not yet taken.
    pub fn ready(&self) -> usize {
        self.done.len()
    }

    /// Slots granted to us and not leased.
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Whether the server told us it drains.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Most requests in flight the server allows this session.
    pub fn max_in_flight(&self) -> u32 {
        self.max_in_flight
    }

    fn handle(&mut self, msg: ServerMsg) -> Result<()> {
        match msg {
            ServerMsg::Grant(slots) => {
                // A client checks what the server says too: a slot past the pool would index
                // outside the mapping (the queue path drops such grants the same way).
                if let Some(bad) = slots.iter().find(|s| s.slot >= self.layout.slot_count) {
                    return Err(Error::Protocol(WireError::Malformed(format!(
                        "the server granted slot {} of a pool of {}",
                        bad.slot, self.layout.slot_count
                    ))));
                }
                self.free.extend(slots)
            }
            ServerMsg::Result {
                request_id,
                outcome,
            } => {
                if self.in_flight.remove(&request_id).is_some() {
                    self.done.push_back(Done::Message(Completion {
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
                    if let Some(held) = self.in_flight.remove(&id) {
                        match held {
                            Held::Host(slot) => self.free.push_back(slot),
                            Held::Device(b) => {
                                if let Some(d) = self.devices.get_mut(&b) {
                                    d.in_flight = false;
                                }
                            }
                        }
                        self.done.push_back(Done::Message(Completion {
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
            } => self.registered = Some((buffer, release_event)),
            ServerMsg::DeviceReleased(r) => {
                if let Some(d) = self.devices.get_mut(&r.slot) {
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
        if self.ring.is_none() {
            return match next_msg(&mut self.reader, deadline)? {
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
            let buffered = match self.reader.next_payload()? {
                Some(p) => Some(decode_server(p)?),
                None => None,
            };
            if let Some(m) = buffered {
                self.handle(m)?;
                return Ok(true);
            }
            let now = Instant::now();
            let expired = deadline.is_some_and(|d| now >= d);
            if self.socket_news() || now.duration_since(self.socket_looked) > SOCKET_LOOK_EVERY {
                self.socket_looked = now;
                if let Some(m) = next_msg(&mut self.reader, Some(now))? {
                    self.handle(m)?;
                    return Ok(true);
                }
            }
            if expired {
                return self.drain_ring();
            }
            if now.duration_since(*start.get_or_insert(now)) < self.spin {
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
        let ring = self.ring.as_mut().expect("only with a ring");
        ring.mem.set_producer_waiting(true);
        fence(Ordering::SeqCst);
        if ring.has_work() {
            ring.mem.set_producer_waiting(false);
            return Ok(());
        }
        let ring = self.ring.as_ref().expect("only with a ring");
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let timeout = match left {
            None => PollTimeout::NONE,
            Some(l) => PollTimeout::try_from(l.as_millis().clamp(1, i32::MAX as u128) as i32)
                .unwrap_or(PollTimeout::MAX),
        };
        let mut pfd = [
            PollFd::new(self.reader.stream().as_fd(), PollFlags::POLLIN),
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
        if sock && self.reader.fill()?.bytes == 0 {
            return Err(Error::ServerGone);
        }
        Ok(())
    }

    /// Whether the server wrote to the socket since we last looked (its counter in the queue
    /// header moved). Dead servers write nothing: waits also look at the socket on a timer and
    /// sleep on it.
    fn socket_news(&mut self) -> bool {
        let Some(ring) = &self.ring else {
            return false;
        };
        let n = ring.mem.socket_messages();
        if n == self.socket_seen {
            return false;
        }
        self.socket_seen = n;
        true
    }

    /// Handles every completion on the queue; returns whether there was any.
    fn drain_ring(&mut self) -> Result<bool> {
        let Some(ring) = self.ring.as_mut() else {
            return Ok(false);
        };
        let mut any = false;
        let mut bytes = [0u8; CQ_INLINE_BYTES];
        while let Some(h) = ring.next(&mut bytes)? {
            any = true;
            if h.flags & CQ_GRANT != 0 && h.slot < self.layout.slot_count {
                self.free.push_back(SlotRef {
                    slot: h.slot,
                    generation: h.generation,
                });
            }
            if h.flags & CQ_DEVICE_RELEASED != 0 {
                if let Some(d) = self.devices.get_mut(&h.slot) {
                    d.generation = h.generation;
                    d.in_flight = false;
                }
            }
            if h.flags & CQ_RESULT != 0 && self.in_flight.remove(&h.request_id).is_some() {
                // `pop` bounds the length by CQ_INLINE_BYTES (232).
                self.done.push_back(Done::Inline {
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
        if self.loaned > 0 {
            self.reclaim_loans();
        }
        if self.ring.is_none() {
            while self.pump(Some(Instant::now()))? {}
            return Ok(());
        }
        // The queue path makes no system call and reads no clock: the socket is read when the
        // server's message counter in the queue header says it wrote something.
        self.drain_ring()?;
        while let Some(p) = self.reader.next_payload()? {
            let m = decode_server(p)?;
            self.handle(m)?;
        }
        if self.socket_news() {
            let now = Instant::now();
            self.socket_looked = now;
            while let Some(m) = next_msg(&mut self.reader, Some(now))? {
                self.handle(m)?;
            }
        }
        Ok(())
    }

    /// A free slot to write, waiting up to `timeout` for one (backpressure: all slots are in
    /// flight, or the session has its maximum of requests in flight).
    pub fn lease(&mut self, timeout: Duration) -> Result<SlotLease<'_>> {
        let slot = self.take_slot(timeout)?;
        Ok(SlotLease {
            producer: self,
            slot: Some(slot),
        })
    }

    /// A free slot to write that does not borrow the producer: hold several at once, write
    /// them on other threads, and submit each with [`Producer::submit_loan`] (as iceoryx2's
    /// loans). Waits up to `timeout` as [`Producer::lease`] does; loans out count against the
    /// in-flight limit.
    pub fn loan(&mut self, timeout: Duration) -> Result<Loan> {
        let slot = self.take_slot(timeout)?;
        self.loaned += 1;
        Ok(Loan {
            slot,
            pool: self.pool.clone(),
            home: self.home.clone(),
            submitted: false,
        })
    }

    /// Hands a loaned slot to the server as the tensor `spec`; returns the request id.
    pub fn submit_loan(&mut self, loan: Loan, spec: &TensorSpec) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        self.submit_loan_as(loan, id, spec)?;
        Ok(id)
    }

    /// [`Producer::submit_loan`] with a request id of the caller's choosing.
    pub fn submit_loan_as(
        &mut self,
        mut loan: Loan,
        request_id: u64,
        spec: &TensorSpec,
    ) -> Result<()> {
        if !Arc::ptr_eq(&loan.home, &self.home) {
            return Err(Error::ForeignLoan);
        }
        loan.submitted = true;
        self.loaned -= 1;
        let slot = loan.slot;
        self.submit_slot(slot, request_id, spec).inspect_err(|_| {
            self.free.push_back(slot);
        })
    }

    /// Slots of loans dropped unsubmitted go back to the free list.
    fn reclaim_loans(&mut self) {
        let back = std::mem::take(&mut *crate::lock(&self.home.returned));
        self.loaned -= back.len();
        self.free.extend(back);
    }

    /// A free slot, within the in-flight limit, waiting up to `timeout`.
    fn take_slot(&mut self, timeout: Duration) -> Result<SlotRef> {
        // The clock is read only if no slot is free at once.
        let mut deadline = None;
        loop {
            if self.draining {
                return Err(Error::Draining);
            }
            if self.loaned > 0 {
                self.reclaim_loans();
            }
            if self.in_flight.len() + self.loaned < self.max_in_flight as usize {
                // The slot given back last: its pages are the likeliest to be in cache.
                if let Some(slot) = self.free.pop_back() {
                    return Ok(slot);
                }
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + timeout);
            if !self.pump(Some(deadline))? && Instant::now() >= deadline {
                return Err(Error::Timeout(
                    timeout,
                    "a free slot (every slot is in flight: wait for results, or ask for more slots)",
                ));
            }
        }
    }

    /// The next result, waiting up to `timeout`.
    pub fn recv_result(&mut self, timeout: Duration) -> Result<Completion> {
        Ok(self.next_done(timeout)?.into_completion())
    }

    /// [`Producer::recv_result`] without allocating: the result's bytes are copied into `out`
    /// (cleared first; it grows only for a result longer than its capacity). Returns the
    /// request id, and the result's length or the server's error.
    pub fn recv_result_into(
        &mut self,
        timeout: Duration,
        out: &mut Vec<u8>,
    ) -> Result<(u64, std::result::Result<usize, RemoteError>)> {
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

    fn next_done(&mut self, timeout: Duration) -> Result<Done> {
        let mut deadline = None;
        loop {
            if let Some(c) = self.done.pop_front() {
                return Ok(c);
            }
            if self.in_flight.is_empty() {
                return Err(Error::NothingInFlight);
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + timeout);
            if !self.pump(Some(deadline))? && Instant::now() >= deadline {
                return Err(Error::Timeout(timeout, "a result"));
            }
        }
    }

    /// A result if one is ready, without waiting for the server.
    pub fn try_recv_result(&mut self) -> Result<Option<Completion>> {
        if self.done.is_empty() {
            self.poll()?;
        }
        Ok(self.done.pop_front().map(Done::into_completion))
    }

    /// The server's status.
    pub fn status(&mut self, timeout: Duration) -> Result<StatusReport> {
        self.status = None;
        self.writer.send(&ClientMsg::Status, &[])?;
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
        self.writer.send(&ClientMsg::Goodbye, &[])
    }

    /// Shares a device buffer of `len` bytes with the server (once per buffer number), and
    /// returns the handle of the server's "released" event (see `tensorport_cuda::GpuProducer`,
    /// which does all of this).
    /// `fd` is attached for a `VmmPosixFd` handle (and must be `None` otherwise).
    pub fn register_device(
        &mut self,
        buffer: u32,
        len: u64,
        handle: RawDeviceHandle,
        fd: Option<BorrowedFd<'_>>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        self.registered = None;
        let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
        self.writer.send(
            &ClientMsg::RegisterDevice {
                buffer,
                len,
                handle,
            },
            &fds,
        )?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((b, ev)) = self.registered.take() {
                if b == buffer {
                    self.devices.insert(
                        buffer,
                        DeviceState {
                            len,
                            generation: 0,
                            in_flight: false,
                        },
                    );
                    return Ok(ev);
                }
            }
            if !self.pump(Some(deadline))? && Instant::now() >= deadline {
                return Err(Error::Timeout(
                    timeout,
                    "the server to open a device buffer",
                ));
            }
        }
    }

    /// Whether a registered device buffer is ours to write (not in flight).
    pub fn device_free(&self, buffer: u32) -> bool {
        self.devices.get(&buffer).is_some_and(|d| !d.in_flight)
    }

    /// Waits until the server releases device `buffer` and the session is below its in-flight
    /// limit (the caller must then make its stream wait on the server's "released" event before
    /// writing the buffer).
    pub fn wait_device(&mut self, buffer: u32, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.devices.get(&buffer) {
                None => return Err(Error::UnknownDevice(buffer)),
                Some(d) if !d.in_flight && self.in_flight.len() < self.max_in_flight as usize => {
                    return Ok(())
                }
                Some(_) => {}
            }
            if !self.pump(Some(deadline))? && Instant::now() >= deadline {
                return Err(Error::Timeout(
                    timeout,
                    "the server to release a device buffer",
                ));
            }
        }
    }

    /// Submits the tensor `spec` in device `buffer`, which the caller has written and fenced:
    /// recorded its "ready" event after the writes (`timeline: None`), or written `timeline`'s
    /// value to its "ready" semaphore (a timeline buffer). Returns the request id.
    pub fn submit_device(
        &mut self,
        buffer: u32,
        spec: &TensorSpec,
        timeline: Option<u64>,
    ) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        self.submit_device_as(buffer, id, spec, timeline)?;
        Ok(id)
    }

    /// Like [`Producer::submit_device`] with a request id of the caller's choosing (unique among
    /// its requests in flight).
    pub fn submit_device_as(
        &mut self,
        buffer: u32,
        request_id: u64,
        spec: &TensorSpec,
        timeline: Option<u64>,
    ) -> Result<()> {
        let id = request_id;
        let d = self
            .devices
            .get(&buffer)
            .cloned()
            .ok_or(Error::UnknownDevice(buffer))?;
        if d.in_flight {
            return Err(Error::DeviceInFlight(buffer));
        }
        let location = RawLocation::DeviceBuffer(SlotRef {
            slot: buffer,
            generation: d.generation,
        });
        if self.ring.is_some() && self.version >= tensorport_wire::DEVICE_QUEUES_VERSION {
            // Protocol 3: device hand-offs take the queue too.
            self.submit_on_ring(location, id, spec, timeline, Held::Device(buffer))?;
        } else {
            let mut raw = spec.to_raw(location)?;
            raw.fence = timeline.map(|value| tensorport_wire::RawFence::Timeline {
                semaphore: 0,
                value,
            });
            self.check_and_send(id, raw, Held::Device(buffer))?;
        }
        if let Some(d) = self.devices.get_mut(&buffer) {
            d.in_flight = true;
        }
        Ok(())
    }

    fn submit_slot(&mut self, slot: SlotRef, request_id: u64, spec: &TensorSpec) -> Result<()> {
        if self.ring.is_some() {
            return self.submit_on_ring(
                RawLocation::HostSlot(slot),
                request_id,
                spec,
                None,
                Held::Host(slot),
            );
        }
        let raw = spec.to_raw(RawLocation::HostSlot(slot))?;
        self.check_and_send(request_id, raw, Held::Host(slot))
    }

    /// The hot path: the descriptor goes into the submission queue (no system call unless the
    /// server sleeps, no allocation), checked here first with the server's own rules.
    fn submit_on_ring(
        &mut self,
        location: RawLocation,
        request_id: u64,
        spec: &TensorSpec,
        timeline: Option<u64>,
        held: Held,
    ) -> Result<()> {
        let len = spec.byte_len()?;
        let fence = timeline.map(|value| tensorport_wire::RawFence::Timeline {
            semaphore: 0,
            value,
        });
        self.check(
            request_id,
            &RawTensorView {
                dtype: spec.dtype as u8,
                shape: &spec.shape,
                strides: spec.strides.as_deref(),
                offset: spec.offset,
                len,
                location: &location,
                fence: fence.as_ref(),
            },
        )?;
        let (slot, device) = match location {
            RawLocation::HostSlot(s) => (s, false),
            RawLocation::DeviceBuffer(s) => (s, true),
        };
        // Checked: at most MAX_DIMS dimensions, and as many strides if any.
        let rank = spec.shape.len();
        let mut e = SqEntry {
            request_id,
            slot: slot.slot,
            generation: slot.generation,
            dtype: spec.dtype as u8,
            rank: rank as u8,
            has_strides: spec.strides.is_some(),
            device,
            timeline,
            offset: spec.offset,
            len,
            ..SqEntry::default()
        };
        e.shape[..rank].copy_from_slice(&spec.shape);
        if let Some(st) = &spec.strides {
            e.strides[..rank].copy_from_slice(st);
        }
        let ring = self.ring.as_mut().expect("checked by the caller");
        if !ring.submit(&e)? {
            // The queue is full (the server is behind): the socket carries this one.
            let mut tensor = spec.to_raw(location)?;
            tensor.fence = fence;
            self.writer
                .send(&ClientMsg::Submit { request_id, tensor }, &[])?;
        }
        self.in_flight.insert(request_id, held);
        Ok(())
    }

    /// Checks a submission locally with the server's own rules, so a bad spec fails here,
    /// clearly.
    fn check(&self, request_id: u64, tensor: &RawTensorView<'_>) -> Result<()> {
        let devices = &self.devices;
        validate_view(
            tensor,
            &PoolBounds {
                slot_count: self.layout.slot_count,
                slot_size: self.layout.slot_size,
            },
            &|b| devices.get(&b).map(|d| d.len),
        )
        .map_err(Error::InvalidTensor)?;
        if self.in_flight.contains_key(&request_id) {
            return Err(Error::DuplicateRequest(request_id));
        }
        Ok(())
    }

    fn check_and_send(&mut self, request_id: u64, raw: RawTensorDesc, held: Held) -> Result<()> {
        self.check(request_id, &raw.view())?;
        self.writer.send(
            &ClientMsg::Submit {
                request_id,
                tensor: raw,
            },
            &[],
        )?;
        self.in_flight.insert(request_id, held);
        Ok(())
    }
}

/// Where loans dropped unsubmitted leave their slots, for the producer to take back.
#[derive(Debug, Default)]
struct LoanHome {
    returned: std::sync::Mutex<Vec<SlotRef>>,
}

/// A slot of the pool lent by [`Producer::loan`]: ours to write until it is submitted with
/// [`Producer::submit_loan`]. It does not borrow the producer, so several can be out at once
/// and be written on other threads. Dropped unsubmitted, its slot goes back to the producer.
pub struct Loan {
    slot: SlotRef,
    pool: Arc<HostPool>,
    home: Arc<LoanHome>,
    submitted: bool,
}

impl std::fmt::Debug for Loan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loan").field("slot", &self.slot).finish()
    }
}

impl Loan {
    /// The slot's bytes, to write in place.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the server granted this slot to us and it is not submitted; the producer took
        // it off its free list for this loan alone, so no other loan, lease or (honest) server
        // code touches it, and `&mut self` makes this the only view of it in this process. The
        // `Arc<HostPool>` keeps the mapping alive for the borrow.
        unsafe { self.pool.slot_bytes_mut(self.slot.slot) }.expect("granted slot is in the pool")
    }

    /// Bytes in the slot.
    pub fn len(&self) -> usize {
        self.pool.slot_size() as usize
    }

    /// Whether the slot has no bytes (never).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Which slot (and generation) this is.
    pub fn slot(&self) -> SlotRef {
        self.slot
    }

    /// The pool the slot is in. Holding it keeps the pool mapped in this process (for
    /// bindings whose views of the slot may outlive the loan); writing the slot after it was
    /// submitted tears the submitted tensor, as for any shared memory.
    pub fn mapping(&self) -> Arc<HostPool> {
        self.pool.clone()
    }
}

impl Drop for Loan {
    fn drop(&mut self) {
        if !self.submitted {
            crate::lock(&self.home.returned).push(self.slot);
        }
    }
}

/// A slot of the pool, ours to write until [`SlotLease::submit`]. Dropped unsubmitted, it goes
/// back to the producer's free list.
pub struct SlotLease<'p> {
    producer: &'p mut Producer,
    slot: Option<SlotRef>,
}

impl std::fmt::Debug for SlotLease<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotLease")
            .field("slot", &self.slot)
            .finish()
    }
}

impl SlotLease<'_> {
    /// The slot's bytes, to write in place.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let slot = self.slot.expect("slot present until submit");
        // SAFETY: the server granted this slot to us and we have not submitted it, so no one
        // else (honest) reads or writes it; `&mut self` makes this the only view in this process.
        unsafe { self.producer.pool.slot_bytes_mut(slot.slot) }
            .expect("granted slot is in the pool")
    }

    /// Bytes in the slot.
    pub fn len(&self) -> usize {
        self.producer.layout.slot_size as usize
    }

    /// Whether the slot has no bytes (never).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Which slot (and generation) this is.
    pub fn slot(&self) -> SlotRef {
        self.slot.expect("slot present until submit")
    }

    /// Copies `data` into the slot at byte `offset`. Panics if it does not fit.
    pub fn write_pod<T: bytemuck::Pod>(&mut self, offset: usize, data: &[T]) {
        let src: &[u8] = bytemuck::cast_slice(data);
        self.bytes_mut()[offset..offset + src.len()].copy_from_slice(src);
    }

    /// Hands the slot to the server as the tensor `spec`; returns the request id.
    pub fn submit(self, spec: &TensorSpec) -> Result<u64> {
        let id = self.producer.next_id;
        self.producer.next_id += 1;
        self.submit_as(id, spec)?;
        Ok(id)
    }

    /// Like [`SlotLease::submit`] with a request id of the caller's choosing (unique among its
    /// requests in flight).
    pub fn submit_as(mut self, request_id: u64, spec: &TensorSpec) -> Result<()> {
        let slot = self.slot.take().expect("slot present until submit");
        match self.producer.submit_slot(slot, request_id, spec) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.producer.free.push_back(slot);
                Err(e)
            }
        }
    }
}

impl Drop for SlotLease<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.producer.free.push_back(slot);
        }
    }
}

/// The control socket. With the shared-memory queues ([`Producer::uses_rings`]) results and
/// grants do not make it readable: wait with [`Producer::recv_result`] or [`Producer::lease`].
impl AsFd for Producer {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.reader.stream().as_fd()
    }
}
