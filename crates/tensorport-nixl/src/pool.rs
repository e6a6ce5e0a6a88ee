//! Reads that land straight in a tensorport producer's pool: each read writes a slot the reader
//! holds on loan ([`tensorport::Loan`]) and hands the loan back only once the read has finished,
//! so nothing in this process sees a slot a transfer is writing, and the server sees it only
//! once the caller submits the loan.

use std::sync::Arc;
use std::time::Duration;

use tensorport::{HostPool, Loan};

use crate::agent::{Agent, Peer};
use crate::error::{Error, Result};
use crate::read::{wait_for, Reader, DROP_WAIT};

/// Reads a peer's slots into the slots of one pool, one read per slot at a time.
pub struct PoolReader {
    reader: Reader,
    pool: Arc<HostPool>,
    /// Per pool slot: the loan a read is writing.
    landing: Vec<Option<Loan>>,
}

impl std::fmt::Debug for PoolReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolReader")
            .field("reader", &self.reader)
            .finish_non_exhaustive()
    }
}

impl PoolReader {
    /// Registers `pool` with `agent` and reads `peer`'s slots (of one tensor each, at most the
    /// pool's slot size) into it. The reader keeps the pool mapped until it is dropped, or for
    /// ever if a read into it could not be finished.
    pub fn new(agent: &Agent, pool: Arc<HostPool>, peer: Peer) -> Result<PoolReader> {
        let tensor = peer.layout().slot_len;
        if tensor > pool.slot_size() {
            return Err(Error::Refused(
                "the peer's slots are larger than the pool's",
            ));
        }
        let (base, stride, slots) = (pool.mapping().as_ptr(), pool.slot_size(), pool.slot_count());
        // SAFETY: the pool's mapping spans `slots` slots of `stride` bytes from `base` and stays
        // mapped while the `Arc` the region keeps lives. A slot is written only by a read this
        // reader starts into a slot whose loan it holds (`start`): the loan is the only way this
        // process reaches the slot and the server reads it only once it is submitted, which
        // needs the loan back, which `poll` and `wait` give only once the read has finished. A
        // loan whose read never finishes is never given back (see `Drop`).
        let region = unsafe { agent.register_external(base, stride, tensor, slots, pool.clone()) }?;
        Ok(PoolReader {
            reader: Reader::new(region, peer)?,
            landing: (0..slots).map(|_| None).collect(),
            pool,
        })
    }

    /// The peer read from.
    pub fn peer(&self) -> &Peer {
        self.reader.peer()
    }

    /// Starts reading the peer's slot `from` into `loan`'s slot (a loan of this pool's);
    /// returns the pool slot to [`PoolReader::poll`] or [`PoolReader::wait`] for. The loan is
    /// dropped (its slot back to its producer) if the read cannot start.
    pub fn start(&mut self, from: u32, loan: Loan) -> Result<u32> {
        if !Arc::ptr_eq(&loan.mapping(), &self.pool) {
            return Err(Error::Refused("a loan of another pool"));
        }
        let into = loan.slot().slot;
        self.reader.start(from, into)?;
        self.landing[into as usize] = Some(loan);
        Ok(into)
    }

    /// The loan of pool slot `into` once its read has finished (`None` while it runs); a failed
    /// read is an error (its loan is dropped, its slot back to its producer).
    pub fn poll(&mut self, into: u32) -> Result<Option<Loan>> {
        let done = self.reader.poll(into);
        let slot = self
            .landing
            .get_mut(into as usize)
            .ok_or(Error::Refused("no such pool slot"))?;
        match done {
            Ok(true) => slot
                .take()
                .map(Some)
                .ok_or(Error::Refused("no read into that slot")),
            Ok(false) => Ok(None),
            Err(e) => {
                slot.take();
                Err(e)
            }
        }
    }

    /// Waits at most `timeout` for the read into pool slot `into` and gives its loan back. A
    /// read that does not finish in time keeps its loan (it may still write the slot).
    pub fn wait(&mut self, into: u32, timeout: Duration) -> Result<Loan> {
        let peer = self.reader.peer().name().to_owned();
        wait_for(&peer, timeout, || self.poll(into))
    }
}

impl Reader {
    /// A reader of `peer`'s slots straight into the slots of `pool` (registered with `agent`),
    /// for a process whose only job is these reads: it owns its mapping of the pool, so nothing
    /// else in this process reaches those bytes. Other processes that map the same pool (the
    /// one holding its slots on loan) must keep off a slot while a read into it runs — their
    /// protocol with this process, not this process's memory safety.
    pub fn into_owned_pool(agent: &Agent, pool: HostPool, peer: Peer) -> Result<Reader> {
        let tensor = peer.layout().slot_len;
        if tensor > pool.slot_size() {
            return Err(Error::Refused(
                "the peer's slots are larger than the pool's",
            ));
        }
        let (base, stride, slots) = (pool.mapping().as_ptr(), pool.slot_size(), pool.slot_count());
        // SAFETY: the pool's mapping spans `slots` slots of `stride` bytes from `base` and stays
        // mapped while the region keeps the pool; the pool was moved in, so nothing else in this
        // process reads or writes it.
        let region = unsafe { agent.register_external(base, stride, tensor, slots, pool) }?;
        Reader::new(region, peer)
    }
}

impl Drop for PoolReader {
    fn drop(&mut self) {
        // A slot whose read still runs is never given back to its producer; the others' loans
        // go back as they drop.
        for into in self.reader.settle(DROP_WAIT) {
            std::mem::forget(self.landing[into as usize].take());
        }
    }
}
