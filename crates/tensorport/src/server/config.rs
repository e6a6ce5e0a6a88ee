//! How a server is set up.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tensorport_shm::PinHook;

use crate::device::DeviceImporter;
use crate::server::pace::Pace;

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
    /// Time a producer's output may wait unread before the producer is dropped as stalled.
    /// Nothing waits for it meanwhile: what the socket does not take is queued.
    pub write_timeout: Duration,
    /// Bytes of output that may wait for one producer to read them (results, grants, errors
    /// its socket did not take yet); a producer past this is dropped as not reading.
    pub max_queued_output: usize,
    /// When every producer place is taken and another producer asks for one, a session with
    /// nothing in flight and no submit or answer for this long is closed to make room (the
    /// longest idle first). `Duration::ZERO`: never.
    pub idle_eviction: Duration,
    /// Refused messages (invalid descriptors, stale slots, forged queue entries …) one session
    /// may send; the next one ends the session with `TooManyRefusals`. Only the first few
    /// refusals of a session, then every power of two, are logged.
    pub max_refusals: u64,
    /// Uids allowed to connect besides the server's own.
    pub allowed_uids: Vec<u32>,
    /// Pins each pool (the CUDA build registers it with `cuMemHostRegister`).
    pub pin: Option<Arc<dyn PinHook>>,
    /// Opens device buffers producers register (the device path); `None` refuses them.
    pub device: Option<Arc<dyn DeviceImporter>>,
    /// Offer protocol-2 producers the shared-memory queues (on by default; off, every tensor
    /// travels on the socket as in protocol 1).
    pub rings: bool,
    /// Consumers: threads that may call [`Server::recv_batch`] / [`Server::recv_timeout`] at
    /// once, each taking the requests of its own share of the sessions (a new session joins
    /// the share with the fewest). 1: one consumer sees every session.
    ///
    /// [`Server::recv_batch`]: crate::Server::recv_batch
    /// [`Server::recv_timeout`]: crate::Server::recv_timeout
    pub consumers: usize,
    /// How long [`crate::Server::recv_timeout`] polls the queues before it sleeps on the doorbells:
    /// longer spins cost CPU and save the wake-up (a few microseconds) when work comes soon.
    pub spin: Duration,
    /// Fair pacing: hold back the slots of producers that run ahead of the slowest active one
    /// (see [`Pace`]); `None` (the default): every slot is granted back as soon as its request
    /// is answered.
    pub pace: Option<Pace>,
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
    /// hello, 5 s for a producer to read what it is sent (at most 4 MiB waiting), 1,024 refused
    /// messages per session, own uid only, no pinning.
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
            max_queued_output: 4 << 20,
            idle_eviction: Duration::from_secs(30),
            max_refusals: 1024,
            allowed_uids: Vec::new(),
            pin: None,
            device: None,
            rings: true,
            consumers: 1,
            spin: Duration::from_micros(50),
            pace: None,
        }
    }
}
