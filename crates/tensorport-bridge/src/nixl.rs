//! Tensors that travel by NIXL instead of inside the stream: the remote producer registers its
//! slots with a NIXL agent and sends, on the authenticated Flight stream, only its agent's
//! metadata (once, in the stream's schema) and which slot holds which request; the gateway
//! reads each slot with a one-sided NIXL read straight into a slot of its local session's pool
//! and submits it there as any other tensor. Results go back on the stream as before, and a result is also the producer's sign
//! that its slot has been read and may be written again.
//!
//! - **Set-up** and **batches**: [`crate::nixl_setup`] ([`Hello`], [`slot_batch`]).
//!
//! NIXL and UCX carry no authentication: the set-up travels only on the gateway's authenticated
//! stream, and only from the producer (whose memory is read) to the gateway; the gateway's own
//! memory is never described to anyone.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tensorport::{HostPool, Loan};
use tensorport_cuda::{Gpu, GpuProducer};
use tensorport_nixl::{Agent, GpuReader, Region};

use crate::nixl_reader::ReaderProcess;
use crate::nixl_setup::peer_of;
pub use crate::nixl_setup::{capi, slot_batch, slot_rows, Hello, KEY, MAX_HELLO, SLOT};
use crate::schema::TensorLayout;

/// The gateway's side of a NIXL stream: a reader of the producer's slots straight into the
/// slots of the local session's pool, in a process of its own ([`ReaderProcess`]: the
/// producer's metadata never reaches this process's NIXL).
pub struct Inbound {
    reader: ReaderProcess,
}

impl Inbound {
    /// Starts a reader process that loads the producer's set-up into an agent of its own
    /// (named `name`) and reads into `pool` — the local session's, whose slots hold at least
    /// one of the set-up's tensors — connecting to the producer at `peer` alone.
    pub fn open(
        hello: &Hello,
        name: &str,
        pool: Arc<HostPool>,
        peer: std::net::IpAddr,
    ) -> Result<Inbound, String> {
        Ok(Inbound {
            reader: ReaderProcess::start(hello, name, &pool, peer)?,
        })
    }

    /// The producer's slots.
    pub fn slots(&self) -> u32 {
        self.reader.slots()
    }

    /// Starts reading the producer's slot `from` into `loan`'s pool slot; returns that slot.
    pub fn start(&mut self, from: u32, loan: Loan) -> Result<u32, String> {
        self.reader.start_read(from, loan)
    }

    /// The loan of pool slot `into` once its read has landed; a failed read is an error.
    pub fn poll(&mut self, into: u32) -> Result<Option<Loan>, String> {
        self.reader.poll(into)
    }

    /// Waits for the read into pool slot `into`, at most `timeout` (the producer gone, or a
    /// slot it never registered: an error), and gives its loan back.
    pub fn wait(&mut self, into: u32, timeout: Duration) -> Result<Loan, String> {
        self.reader.wait(into, timeout)
    }
}

/// The gateway's side of a NIXL stream whose slots are on a GPU: a GPU producer session with
/// the local server, whose device buffers the producer's slots are read into ([`GpuReader`]).
pub struct DeviceInbound {
    reader: GpuReader,
}

impl DeviceInbound {
    /// Loads the producer's set-up into an agent of its own (named `name`) and reads into the
    /// device buffers of `producer` (a session with the local server on the gateway's GPU).
    pub fn open(hello: &Hello, name: &str, producer: GpuProducer) -> Result<DeviceInbound, String> {
        let (agent, peer) = peer_of(hello, name)?;
        let reader = GpuReader::new(&agent, producer, peer).map_err(|e| e.to_string())?;
        Ok(DeviceInbound { reader })
    }

    /// The producer's slots.
    pub fn slots(&self) -> u32 {
        self.reader.peer().layout().slots
    }

    /// The reader (its buffers, reads and the session's results).
    pub fn reader(&mut self) -> &mut GpuReader {
        &mut self.reader
    }

    /// Ends the session with the server cleanly.
    pub fn close(self) -> Result<(), String> {
        self.reader.close().map_err(|e| e.to_string())
    }
}

/// The remote producer's side: registered slots, which request each holds, and the set-up to
/// send.
pub struct Outbound {
    agent: Agent,
    region: Region,
    free: Vec<u32>,
    held: HashMap<u64, u32>,
    /// Per slot: it holds the one ready tensor ([`Outbound::put_ready`]).
    holds_ready: Vec<bool>,
    hello: Hello,
}

impl Outbound {
    /// An agent named `name` with `slots` registered slots for tensors of `layout`, in host
    /// memory or on the GPU `gpu` (ordinal).
    pub fn new(
        name: &str,
        slots: u32,
        layout: &TensorLayout,
        gpu: Option<u32>,
    ) -> Result<Outbound, String> {
        let capi = capi()?;
        let agent = Agent::new(&capi, name).map_err(|e| e.to_string())?;
        let bytes = layout.bytes() as u64;
        let region = match gpu {
            None => agent.register(slots, bytes),
            Some(n) => {
                let gpu = Gpu::open(n as i32).map_err(|e| format!("GPU {n}: {e}"))?;
                agent.register_device(&gpu, slots, bytes)
            }
        }
        .map_err(|e| e.to_string())?;
        let metadata = agent.metadata().map_err(|e| e.to_string())?;
        let hello = Hello {
            agent: name.to_string(),
            metadata,
            slots: region.layout(),
            layout: layout.clone(),
        };
        Ok(Outbound {
            agent,
            region,
            free: (0..slots).rev().collect(),
            held: HashMap::new(),
            holds_ready: vec![false; slots as usize],
            hello,
        })
    }

    /// The set-up to send.
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        self.agent.name()
    }

    /// Puts request `id`'s tensor into a free slot (copied to the GPU for slots on one);
    /// `Ok(None)` when every slot is held.
    pub fn put(&mut self, id: u64, tensor: &[u8]) -> Result<Option<u32>, String> {
        self.put_inner(id, tensor, false)
    }

    /// [`Outbound::put`] of the one ready tensor every request of a `--ready` producer carries:
    /// a slot that holds it already is not written again.
    pub fn put_ready(&mut self, id: u64, tensor: &[u8]) -> Result<Option<u32>, String> {
        self.put_inner(id, tensor, true)
    }

    fn put_inner(&mut self, id: u64, tensor: &[u8], ready: bool) -> Result<Option<u32>, String> {
        if let Some(&s) = self.held.get(&id) {
            return Ok(Some(s));
        }
        let Some(s) = self.free.pop() else {
            return Ok(None);
        };
        if ready && self.holds_ready[s as usize] {
            self.held.insert(id, s);
            return Ok(Some(s));
        }
        self.holds_ready[s as usize] = false;
        let written = match self.region.slot_mut(s) {
            Some(slot) => {
                slot[..tensor.len()].copy_from_slice(tensor);
                Ok(())
            }
            None => self.region.upload(s, tensor).map_err(|e| e.to_string()),
        };
        if let Err(e) = written {
            self.free.push(s);
            return Err(e);
        }
        self.holds_ready[s as usize] = ready;
        self.held.insert(id, s);
        Ok(Some(s))
    }

    /// Request `id` is answered: its slot has been read and is free again.
    pub fn release(&mut self, id: u64) {
        if let Some(s) = self.held.remove(&id) {
            self.free.push(s);
        }
    }
}
