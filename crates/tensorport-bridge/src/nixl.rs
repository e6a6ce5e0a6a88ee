//! Tensors that travel by NIXL instead of inside the stream: the remote producer registers its
//! slots with a NIXL agent and sends, on the authenticated Flight stream, only its agent's
//! metadata (once, in the stream's schema) and which slot holds which request; the gateway
//! reads each slot with a one-sided NIXL read straight into a slot of its local session's pool
//! and submits it there as any other tensor. Results go back on the stream as before, and a result is also the producer's sign
//! that its slot has been read and may be written again.
//!
//! - **Set-up** (schema metadata [`KEY`], JSON, at most [`MAX_HELLO`] bytes): the producer's
//!   agent name, its metadata (hex), its slots (`base`, `slot_len`, `slots`) and the tensors'
//!   dtype and shape. Every field is checked before the metadata reaches NIXL; NIXL checks each
//!   read against the registrations the metadata lists.
//! - **Batches**: `id: UInt64` (the request id) and `slot: UInt32` (the producer's slot).
//!
//! NIXL and UCX carry no authentication: the set-up travels only on the gateway's authenticated
//! stream, and only from the producer (whose memory is read) to the gateway; the gateway's own
//! memory is never described to anyone.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arrow_array::cast::AsArray;
use arrow_array::types::{UInt32Type, UInt64Type};
use arrow_array::{ArrayRef, RecordBatch, UInt32Array, UInt64Array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use serde::{Deserialize, Serialize};
use tensorport::DType;
use tensorport::{HostPool, Loan};
use tensorport_cuda::{Gpu, GpuProducer};
use tensorport_nixl::{Agent, Capi, GpuReader, Memory, Region, SlotLayout, MAX_METADATA};

use crate::nixl_reader::ReaderProcess;
use crate::schema::{SchemaError, TensorLayout, ID};

/// The schema metadata key of a NIXL stream's set-up.
pub const KEY: &str = "tensorport.nixl";
/// The slot column.
pub const SLOT: &str = "slot";
/// Longest set-up read: the metadata in hex and a few hundred bytes more.
pub const MAX_HELLO: usize = 2 * MAX_METADATA + 4096;

/// A NIXL stream's set-up, as the producer sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The producer's NIXL agent.
    pub agent: String,
    /// Its NIXL metadata (what a reader loads to reach its registrations).
    pub metadata: Vec<u8>,
    /// Where its slots are.
    pub slots: SlotLayout,
    /// The tensors every slot holds.
    pub layout: TensorLayout,
}

#[derive(Serialize, Deserialize)]
struct HelloJson {
    agent: String,
    metadata: String,
    base: u64,
    slot_len: u64,
    slots: u32,
    /// The GPU (by ordinal on the producer's host) whose memory holds the slots; absent for
    /// host memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    device: Option<u32>,
    dtype: u8,
    shape: Vec<u64>,
}

impl Hello {
    /// The schema of a stream with this set-up.
    pub fn schema(&self) -> SchemaRef {
        Arc::new(Schema::new_with_metadata(
            vec![
                Field::new(ID, DataType::UInt64, false),
                Field::new(SLOT, DataType::UInt32, false),
            ],
            HashMap::from([(KEY.to_string(), self.to_json())]),
        ))
    }

    /// The set-up as the JSON text the schema carries under [`KEY`].
    pub fn to_json(&self) -> String {
        serde_json::to_string(&HelloJson {
            agent: self.agent.clone(),
            metadata: hex(&self.metadata),
            base: self.slots.base,
            slot_len: self.slots.slot_len,
            slots: self.slots.slots,
            device: match self.slots.memory {
                Memory::Host => None,
                Memory::Device(gpu) => Some(gpu),
            },
            dtype: self.layout.dtype as u8,
            shape: self.layout.shape.clone(),
        })
        .expect("serialisable")
    }

    /// The set-up a peer's schema declares: `None` for a schema without [`KEY`] (a stream of
    /// tensors), an error for one whose set-up or columns do not check out or whose tensors are
    /// over `max_bytes` or not one slot's length.
    pub fn from_schema(schema: &Schema, max_bytes: u64) -> Result<Option<Hello>, SchemaError> {
        let Some(raw) = schema.metadata().get(KEY) else {
            return Ok(None);
        };
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        let types: Vec<&DataType> = schema.fields().iter().map(|f| f.data_type()).collect();
        if names != [ID, SLOT] || types != [&DataType::UInt64, &DataType::UInt32] {
            return Err(SchemaError::Schema(format!(
                "a NIXL stream's columns are \"{ID}\": UInt64 and \"{SLOT}\": UInt32, not {names:?}"
            )));
        }
        Hello::from_json(raw, max_bytes).map(Some)
    }

    /// The set-up in `raw` (the JSON text of [`Hello::to_json`]), checked as
    /// [`Hello::from_schema`] checks it.
    pub fn from_json(raw: &str, max_bytes: u64) -> Result<Hello, SchemaError> {
        if raw.len() > MAX_HELLO {
            return Err(SchemaError::Schema(format!(
                "a NIXL set-up of {} bytes (at most {MAX_HELLO})",
                raw.len()
            )));
        }
        let j: HelloJson = serde_json::from_str(raw)
            .map_err(|e| SchemaError::Schema(format!("the NIXL set-up does not parse: {e}")))?;
        if j.agent.is_empty() || j.agent.len() > 256 || j.agent.contains('\0') {
            return Err(SchemaError::Schema(
                "the NIXL agent's name is empty, over 256 bytes or holds a NUL".into(),
            ));
        }
        let metadata = unhex(&j.metadata).ok_or_else(|| {
            SchemaError::Schema("the NIXL metadata is not hex of at most 64 KiB".into())
        })?;
        let dtype = DType::from_u8(j.dtype)
            .ok_or_else(|| SchemaError::DType(format!("wire number {}", j.dtype)))?;
        let layout = TensorLayout::new(dtype, &j.shape)?;
        if layout.bytes() as u64 > max_bytes {
            return Err(SchemaError::TooLarge {
                bytes: layout.bytes() as u64,
                limit: max_bytes,
            });
        }
        let slots = SlotLayout {
            base: j.base,
            slot_len: j.slot_len,
            slots: j.slots,
            memory: j.device.map_or(Memory::Host, Memory::Device),
        };
        if slots.slot_len != layout.bytes() as u64 {
            return Err(SchemaError::Shape(format!(
                "slots of {} bytes for tensors of {}",
                slots.slot_len,
                layout.bytes()
            )));
        }
        slots
            .check()
            .map_err(|e| SchemaError::Schema(format!("the NIXL slots: {e}")))?;
        Ok(Hello {
            agent: j.agent,
            metadata,
            slots,
            layout,
        })
    }
}

/// A batch of `(request id, slot)` rows.
pub fn slot_batch(schema: &SchemaRef, rows: &[(u64, u32)]) -> Result<RecordBatch, SchemaError> {
    let ids: ArrayRef = Arc::new(UInt64Array::from_iter_values(rows.iter().map(|r| r.0)));
    let slots: ArrayRef = Arc::new(UInt32Array::from_iter_values(rows.iter().map(|r| r.1)));
    Ok(RecordBatch::try_new(schema.clone(), vec![ids, slots])?)
}

/// The `(request id, slot)` rows of a peer's batch on a NIXL stream (no nulls).
pub fn slot_rows(batch: &RecordBatch) -> Result<Vec<(u64, u32)>, SchemaError> {
    if batch.num_columns() != 2
        || batch.column(0).data_type() != &DataType::UInt64
        || batch.column(1).data_type() != &DataType::UInt32
    {
        return Err(SchemaError::Batch(
            "a NIXL stream's batch has an id and a slot column".into(),
        ));
    }
    if batch.column(0).null_count() > 0 || batch.column(1).null_count() > 0 {
        return Err(SchemaError::Batch("null ids or slots".into()));
    }
    let ids = batch.column(0).as_primitive::<UInt64Type>().values();
    let slots = batch.column(1).as_primitive::<UInt32Type>().values();
    Ok(ids.iter().copied().zip(slots.iter().copied()).collect())
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(2 * b.len());
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.is_empty() || !s.len().is_multiple_of(2) || s.len() > 2 * MAX_METADATA {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// NIXL's library, loaded once per process; the error says why it cannot be.
pub fn capi() -> Result<Arc<Capi>, String> {
    static CAPI: OnceLock<Result<Arc<Capi>, String>> = OnceLock::new();
    CAPI.get_or_init(|| Capi::load().map(Arc::new).map_err(|e| e.to_string()))
        .clone()
}

/// The gateway's side of a NIXL stream: a reader of the producer's slots straight into the
/// slots of the local session's pool, in a process of its own ([`ReaderProcess`]: the
/// producer's metadata never reaches this process's NIXL).
pub struct Inbound {
    reader: ReaderProcess,
}

/// The producer's metadata loaded into an agent of the gateway's own, named `name`.
pub(crate) fn peer_of(hello: &Hello, name: &str) -> Result<(Agent, tensorport_nixl::Peer), String> {
    let capi = capi()?;
    let agent = Agent::new(&capi, name).map_err(|e| e.to_string())?;
    let peer = agent
        .add_peer(&hello.metadata, &hello.agent, hello.slots)
        .map_err(|e| format!("the producer's NIXL metadata: {e}"))?;
    Ok((agent, peer))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        let layout = TensorLayout::new(DType::F32, &[3, 4]).unwrap();
        Hello {
            agent: "producer".into(),
            metadata: vec![1, 2, 0xab, 0xff],
            slots: SlotLayout {
                base: 4096,
                slot_len: layout.bytes() as u64,
                slots: 8,
                memory: Memory::Host,
            },
            layout,
        }
    }

    #[test]
    fn a_set_up_goes_through_its_schema_and_back() {
        let h = hello();
        let back = Hello::from_schema(&h.schema(), 1 << 20).unwrap().unwrap();
        assert_eq!(back, h);
        let mut on_gpu = hello();
        on_gpu.slots.memory = Memory::Device(3);
        let back = Hello::from_schema(&on_gpu.schema(), 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(back, on_gpu);
        let rows = [(7u64, 3u32), (9, 0)];
        let b = slot_batch(&h.schema(), &rows).unwrap();
        assert_eq!(slot_rows(&b).unwrap(), rows);
        // A tensor stream's schema has no set-up.
        let tensors = TensorLayout::new(DType::F32, &[3, 4]).unwrap().schema();
        assert_eq!(Hello::from_schema(&tensors, 1 << 20).unwrap(), None);
    }

    fn with(f: impl FnOnce(&mut HelloJson)) -> Schema {
        let h = hello();
        let s = h.schema();
        let mut j: HelloJson = serde_json::from_str(&s.metadata()[KEY]).unwrap();
        f(&mut j);
        Schema::new_with_metadata(
            s.fields().clone(),
            HashMap::from([(KEY.to_string(), serde_json::to_string(&j).unwrap())]),
        )
    }

    #[test]
    fn a_set_up_that_does_not_check_out_is_refused_before_nixl_sees_it() {
        let limit = 1 << 20;
        let bad = [
            with(|j| j.metadata = "abc".into()),
            with(|j| j.metadata = "zz".into()),
            with(|j| j.metadata = "ab".repeat(MAX_METADATA + 1)),
            with(|j| j.agent = String::new()),
            with(|j| j.agent = "a\0b".into()),
            with(|j| j.dtype = 200),
            with(|j| j.shape = vec![]),
            with(|j| j.shape = vec![u64::MAX, 2]),
            with(|j| j.slot_len += 1),
            with(|j| j.slots = 0),
            with(|j| j.slots = tensorport_nixl::MAX_SLOTS + 1),
            with(|j| j.base = u64::MAX - 8),
            with(|j| j.shape = vec![1 << 20]),
            with(|j| j.device = Some(tensorport_nixl::MAX_GPU + 1)),
        ];
        for (i, s) in bad.iter().enumerate() {
            assert!(Hello::from_schema(s, limit).is_err(), "case {i} accepted");
        }
        // Not JSON, too long, or the wrong columns.
        let h = hello().schema();
        let garbage = Schema::new_with_metadata(
            h.fields().clone(),
            HashMap::from([(KEY.to_string(), "{".to_string())]),
        );
        assert!(Hello::from_schema(&garbage, limit).is_err());
        let long = Schema::new_with_metadata(
            h.fields().clone(),
            HashMap::from([(KEY.to_string(), " ".repeat(MAX_HELLO + 1))]),
        );
        assert!(Hello::from_schema(&long, limit).is_err());
        let columns = Schema::new_with_metadata(
            vec![Field::new(ID, DataType::UInt64, false)],
            h.metadata().clone(),
        );
        assert!(Hello::from_schema(&columns, limit).is_err());
    }

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&b)).unwrap(), b);
        assert_eq!(unhex("0g"), None);
        assert_eq!(unhex("é1"), None);
        assert_eq!(unhex(""), None);
    }
}
