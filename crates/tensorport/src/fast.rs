//! The shared-memory hot path (protocol 2): each session's submission and completion queues
//! (`tensorport_shm::ring`) and the two eventfd doorbells that wake a sleeping side.
//!
//! A side rings the other's doorbell only when the other said it sleeps (the ring's `waiting`
//! words), so a busy pipeline hands tensors over without a system call. The socket stays for
//! the handshake, control messages, errors and liveness: a closed socket is still a dead peer.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{fence, Ordering};

use nix::sys::eventfd::{EfdFlags, EventFd};
use tensorport_shm::ring::{CqHeader, CqReader, SqEntry, SqReader, SqWriter};

use tensorport_shm::ring::CQ_INLINE_BYTES;
use tensorport_shm::RingMem;

use crate::{Error, Result};

/// An eventfd one side writes to wake the other.
#[derive(Debug)]
pub(crate) struct Doorbell(OwnedFd);

impl Doorbell {
    pub(crate) fn new() -> Result<Doorbell> {
        let e = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .map_err(Error::sys("eventfd"))?;
        Ok(Doorbell(e.into()))
    }

    pub(crate) fn from_fd(fd: OwnedFd) -> Doorbell {
        Doorbell(fd)
    }

    /// Wakes the sleeper. A full counter (2^64 − 2 rings unread) already wakes it.
    pub(crate) fn ring(&self) {
        let _ = nix::unistd::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Resets the counter after waking (the fd is non-blocking: nothing to read is fine).
    pub(crate) fn clear(&self) {
        let mut b = [0u8; 8];
        let _ = nix::unistd::read(&self.0, &mut b);
    }
}

impl AsFd for Doorbell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// The server's side of a session's queues.
#[derive(Debug)]
pub(crate) struct ServerRing {
    pub(crate) mem: RingMem,
    /// The producer rings this when the server sleeps; the server polls it.
    pub(crate) to_server: Doorbell,
    /// The server rings this when the producer sleeps.
    pub(crate) to_producer: Doorbell,
}

impl ServerRing {
    pub(crate) fn create(sq_entries: u32, cq_entries: u32) -> Result<ServerRing> {
        let mem = RingMem::create(sq_entries, cq_entries)?;
        // Until the consumer first looks, a producer should ring: the consumer may be asleep.
        mem.set_server_waiting(true);
        Ok(ServerRing {
            mem,
            to_server: Doorbell::new()?,
            to_producer: Doorbell::new()?,
        })
    }

    /// What the `Welcome` carries after the pool: ring, server's bell, producer's bell.
    pub(crate) fn fds(&self) -> [BorrowedFd<'_>; 3] {
        [
            self.mem.fd(),
            self.to_server.as_fd(),
            self.to_producer.as_fd(),
        ]
    }

    /// Whether submissions are waiting for the consumer's cursor `sq` (a corrupted queue
    /// counts: the next pop reports it).
    pub(crate) fn has_work(&self, sq: &mut SqReader) -> bool {
        sq.available(&self.mem).map_or(true, |n| n > 0)
    }

    /// Wakes the producer if it sleeps (after a completion was published).
    pub(crate) fn wake(&self) {
        fence(Ordering::SeqCst);
        if self.mem.producer_waiting() {
            self.to_producer.ring();
        }
    }
}

/// The producer's side of its session's queues.
#[derive(Debug)]
pub(crate) struct ProducerRing {
    pub(crate) mem: RingMem,
    sq: SqWriter,
    cq: CqReader,
    to_server: Doorbell,
    pub(crate) to_producer: Doorbell,
}

impl ProducerRing {
    /// Maps the ring and adopts the doorbells sent with `Welcome`.
    pub(crate) fn open(ring: OwnedFd, to_server: OwnedFd, to_producer: OwnedFd) -> Result<Self> {
        Ok(ProducerRing {
            mem: RingMem::open(ring)?,
            sq: SqWriter::default(),
            cq: CqReader::default(),
            to_server: Doorbell::from_fd(to_server),
            to_producer: Doorbell::from_fd(to_producer),
        })
    }

    /// Publishes a submission and wakes the server if it sleeps; `Ok(false)` if the queue is
    /// full (send it on the socket instead).
    pub(crate) fn submit(&mut self, e: &SqEntry) -> Result<bool> {
        if !self.sq.push(&self.mem, e)? {
            return Ok(false);
        }
        fence(Ordering::SeqCst);
        if self.mem.server_waiting() {
            self.to_server.ring();
        }
        Ok(true)
    }

    /// Whether completions are waiting (a corrupted queue counts: the next read reports it).
    pub(crate) fn has_work(&mut self) -> bool {
        self.cq.available(&self.mem).map_or(true, |n| n > 0)
    }

    /// The next completion, its inline bytes in `payload`.
    pub(crate) fn next(&mut self, payload: &mut [u8; CQ_INLINE_BYTES]) -> Result<Option<CqHeader>> {
        Ok(self.cq.pop(&self.mem, payload)?)
    }
}

/// Hashes request ids (`u64`) with one multiply: SipHash would cost more than a hand-off, and
/// the ids a peer chooses can only slow its own session (in-flight sets are bounded).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n ^ (n >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A map keyed by request id.
pub(crate) type IdMap<V> =
    std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;
/// A set of request ids.
pub(crate) type IdSet = std::collections::HashSet<u64, std::hash::BuildHasherDefault<IdHasher>>;
