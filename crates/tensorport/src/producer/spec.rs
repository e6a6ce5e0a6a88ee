//! How a producer connects, and what a tensor in a slot looks like.

use std::time::Duration;

use tensorport_wire::{DType, RawLocation, RawTensorDesc, WireError, MAX_DIMS};

use crate::SubmitError;

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
    /// How long a lease of a large slot (at least [`super::WARM_MIN_SLOT`] bytes, 1 MiB) may
    /// poll for the slot this producer submitted last, before it takes another free one (at
    /// most a sixteenth of the time since the last lease, too). That slot's bytes are the ones
    /// still in this core's caches; a producer that alternates between two large slots has
    /// twice the working set, and when many producers do, their fills overflow the shared cache
    /// and go to memory. A server that answers within microseconds gives the slot back well
    /// within this; one that holds slots longer costs one wait, after which the producer stops
    /// waiting for the next [`super::WARM_SKIP_AFTER_MISS`] leases. `Duration::ZERO`: never.
    pub warm_wait: Duration,
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
            warm_wait: Duration::from_micros(20),
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
    pub(super) fn byte_len(&self) -> Result<u64, SubmitError> {
        if self.shape.len() > MAX_DIMS {
            return Err(SubmitError::InvalidTensor(WireError::BadRank(
                self.shape.len(),
            )));
        }
        self.extent()
            .ok_or_else(|| SubmitError::InvalidTensor(WireError::ShapeOverflow(self.shape.clone())))
    }

    pub(super) fn to_raw(&self, location: RawLocation) -> Result<RawTensorDesc, SubmitError> {
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
