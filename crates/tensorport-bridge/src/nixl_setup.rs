//! A NIXL stream's set-up and slot batches, as they travel on the authenticated Flight stream:
//!
//! - **Set-up** (schema metadata [`KEY`], JSON, at most [`MAX_HELLO`] bytes): the producer's
//!   agent name, its metadata (hex), its slots (`base`, `slot_len`, `slots`) and the tensors'
//!   dtype and shape. Every field is checked before the metadata reaches NIXL; NIXL checks each
//!   read against the registrations the metadata lists.
//! - **Batches**: `id: UInt64` (the request id) and `slot: UInt32` (the producer's slot).
//!
//! Both the gateway's side ([`crate::nixl`]) and a stream's reader process
//! ([`crate::nixl_reader`]) read them from here, so neither depends on the other's module.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use arrow_array::cast::AsArray;
use arrow_array::types::{UInt32Type, UInt64Type};
use arrow_array::{ArrayRef, RecordBatch, UInt32Array, UInt64Array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use serde::{Deserialize, Serialize};
use tensorport::DType;
use tensorport_nixl::{Agent, Capi, Memory, SlotLayout, MAX_METADATA};

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

/// The producer's metadata loaded into an agent of the gateway's own, named `name`.
pub(crate) fn peer_of(hello: &Hello, name: &str) -> Result<(Agent, tensorport_nixl::Peer), String> {
    let capi = capi()?;
    let agent = Agent::new(&capi, name).map_err(|e| e.to_string())?;
    let peer = agent
        .add_peer(&hello.metadata, &hello.agent, hello.slots)
        .map_err(|e| format!("the producer's NIXL metadata: {e}"))?;
    Ok((agent, peer))
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
