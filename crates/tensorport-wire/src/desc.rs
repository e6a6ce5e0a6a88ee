//! Tensor descriptors: what a peer says about a tensor (raw), and what we have checked (checked).

use serde::{Deserialize, Serialize};

use crate::msg::{RawFence, RawLocation, RawTensorDesc, SlotRef};
use crate::WireError;

/// Most dimensions a tensor may have.
pub const MAX_DIMS: usize = 8;

numbered! {
/// Element types. The numbers are the wire encoding and never change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType: u8 {
    /// IEEE 754 binary32.
    F32 = 0,
    /// IEEE 754 binary16.
    F16 = 1,
    /// bfloat16.
    BF16 = 2,
    /// Unsigned byte.
    U8 = 3,
    /// Signed 32-bit integer.
    I32 = 4,
    /// Signed 64-bit integer.
    I64 = 5,
    /// IEEE 754 binary64.
    F64 = 6,
    /// Signed byte.
    I8 = 7,
}
}

impl DType {
    /// The dtype for a wire number, if known.
    pub fn from_u8(v: u8) -> Option<DType> {
        DType::from_number(v)
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Lower-case name, as used in docs and CLIs.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F64 => "f64",
            DType::I8 => "i8",
        }
    }
}

/// Where a checked tensor's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Location {
    /// In a slot of the session's host pool.
    HostSlot(SlotRef),
    /// In a device buffer the client registered.
    DeviceBuffer(SlotRef),
}

/// What the validator checks a descriptor against: the layout of the session's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolBounds {
    /// Number of slots in the pool.
    pub slot_count: u32,
    /// Bytes per slot.
    pub slot_size: u64,
}

/// A tensor descriptor that passed [`validate`]: every byte it describes lies inside its slot.
///
/// Fields are private so that no unchecked descriptor can be built outside this module. It is
/// kept small (it travels inside every request a server hands out): strides are stored only
/// when the peer gave ones other than the row-major strides of the shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    dtype: DType,
    rank: u8,
    contiguous: bool,
    device: bool,
    slot: SlotRef,
    offset: u64,
    len: u64,
    numel: u64,
    timeline: Option<u64>,
    shape: [u64; MAX_DIMS],
    /// The strides given, where they differ from the shape's row-major strides.
    strides: Option<Box<[u64; MAX_DIMS]>>,
}

/// A tensor's strides in elements, one per dimension: [`TensorDesc::strides`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    values: [u64; MAX_DIMS],
    rank: u8,
}

impl std::ops::Deref for Strides {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        &self.values[..self.rank as usize]
    }
}

impl TensorDesc {
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[u64] {
        &self.shape[..self.rank as usize]
    }
    /// Strides in elements, one per dimension: the ones the peer gave, or the row-major
    /// strides of the shape.
    pub fn strides(&self) -> Strides {
        let values = match &self.strides {
            Some(s) => **s,
            // Validation checked that these do not overflow.
            None => contiguous_strides(self.shape()).unwrap_or([0; MAX_DIMS]),
        };
        Strides {
            values,
            rank: self.rank,
        }
    }
    /// Whether the strides are the row-major (C) strides of the shape.
    pub fn is_contiguous(&self) -> bool {
        self.contiguous
    }
    /// Byte offset of element 0 inside the slot.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Bytes the descriptor covers, from `offset`.
    pub fn byte_len(&self) -> u64 {
        self.len
    }
    /// Number of elements (product of the shape).
    pub fn numel(&self) -> u64 {
        self.numel
    }
    /// Where the bytes are.
    pub fn location(&self) -> Location {
        if self.device {
            Location::DeviceBuffer(self.slot)
        } else {
            Location::HostSlot(self.slot)
        }
    }
    /// The slot (host) or buffer (device) and its generation.
    pub fn slot(&self) -> SlotRef {
        self.slot
    }

    /// The `Timeline` fence value a device tensor carries, if any.
    pub fn timeline(&self) -> Option<u64> {
        self.timeline
    }

    /// Whether the bytes are in device memory.
    pub fn is_device(&self) -> bool {
        self.device
    }
}

/// Row-major strides (in elements) for `shape`, or `None` if they overflow.
pub fn contiguous_strides(shape: &[u64]) -> Option<[u64; MAX_DIMS]> {
    let mut strides = [0u64; MAX_DIMS];
    let mut acc: u64 = 1;
    for (i, &d) in shape.iter().enumerate().rev() {
        strides[i] = acc;
        acc = acc.checked_mul(d.max(1))?;
    }
    Some(strides)
}

/// Checks every field of a raw descriptor against the pool, and returns the checked descriptor.
///
/// This is the only way to make a [`TensorDesc`]. It refuses: an unknown dtype; more than
/// [`MAX_DIMS`] dimensions; an element count or byte size that overflows `u64`; strides of the
/// wrong length; an offset not aligned to the element size; a byte length smaller than the
/// tensor's extent; `offset + len` past the end of the slot; a slot index outside the pool; and
/// any location or fence this version does not support on the host path.
pub fn validate(raw: &RawTensorDesc, pool: &PoolBounds) -> Result<TensorDesc, WireError> {
    validate_in(raw, pool, &|_| None)
}

/// [`validate`], where `device_len(buffer)` gives the length of each registered device buffer
/// (`None`: not registered). A device descriptor must lie inside its buffer.
pub fn validate_in(
    raw: &RawTensorDesc,
    pool: &PoolBounds,
    device_len: &dyn Fn(u32) -> Option<u64>,
) -> Result<TensorDesc, WireError> {
    validate_view(&raw.view(), pool, device_len)
}

impl RawTensorDesc {
    /// This descriptor by reference, for [`validate_view`].
    pub fn view(&self) -> RawTensorView<'_> {
        RawTensorView {
            dtype: self.dtype,
            shape: &self.shape,
            strides: self.strides.as_deref(),
            offset: self.offset,
            len: self.len,
            location: &self.location,
            fence: self.fence.as_ref(),
        }
    }
}

/// A raw descriptor by reference: what the shared-memory submission queue carries (no
/// allocation), checked by [`validate_view`] exactly as [`validate_in`] checks a message's.
#[derive(Debug, Clone, Copy)]
pub struct RawTensorView<'a> {
    /// [`DType`] number.
    pub dtype: u8,
    /// Dimensions, outermost first.
    pub shape: &'a [u64],
    /// Strides in elements; `None` means row-major contiguous.
    pub strides: Option<&'a [u64]>,
    /// Byte offset of element 0 inside the slot.
    pub offset: u64,
    /// Bytes covered from `offset`.
    pub len: u64,
    /// Where the bytes are.
    pub location: &'a RawLocation,
    /// What to wait on before reading.
    pub fence: Option<&'a RawFence>,
}

/// [`validate_in`] for a [`RawTensorView`]. Allocates only to describe an error.
pub fn validate_view(
    raw: &RawTensorView<'_>,
    pool: &PoolBounds,
    device_len: &dyn Fn(u32) -> Option<u64>,
) -> Result<TensorDesc, WireError> {
    let dtype = DType::from_u8(raw.dtype).ok_or(WireError::UnknownDType(raw.dtype))?;
    let rank = raw.shape.len();
    if rank > MAX_DIMS {
        return Err(WireError::BadRank(rank));
    }
    let elem = dtype.size();
    // The element count, and the product of the dimensions with zeros counted as ones (the
    // row-major strides' largest): neither may overflow, even for an empty tensor.
    let (mut numel, mut span): (u64, u64) = (1, 1);
    for &d in raw.shape {
        numel = numel
            .checked_mul(d)
            .ok_or_else(|| WireError::ShapeOverflow(raw.shape.to_vec()))?;
        span = span
            .checked_mul(d.max(1))
            .ok_or_else(|| WireError::ShapeOverflow(raw.shape.to_vec()))?;
    }
    let bytes = numel
        .checked_mul(elem)
        .ok_or_else(|| WireError::ShapeOverflow(raw.shape.to_vec()))?;

    // Filled word by word to its full width (the unused dimensions zero), not copied as a
    // slice of the rank's length: the descriptor is then moved out in wide loads, which a
    // variable-length copy's narrow stores just before would stall.
    let shape: [u64; MAX_DIMS] = std::array::from_fn(|i| raw.shape.get(i).copied().unwrap_or(0));
    // Strides other than the row-major ones are kept; the extent of row-major ones is the
    // byte size.
    let (strides, contiguous, extent) = match raw.strides {
        None => (None, true, bytes),
        Some(s) => {
            if s.len() != rank {
                return Err(WireError::BadStrides(format!(
                    "{} strides for {} dimensions",
                    s.len(),
                    rank
                )));
            }
            let natural = contiguous_strides(raw.shape)
                .ok_or_else(|| WireError::ShapeOverflow(raw.shape.to_vec()))?;
            if s == &natural[..rank] {
                (None, true, bytes)
            } else {
                let mut st = [0u64; MAX_DIMS];
                st[..rank].copy_from_slice(s);
                (
                    Some(Box::new(st)),
                    numel <= 1,
                    strided_extent(&shape[..rank], s, numel, elem)?,
                )
            }
        }
    };
    if raw.len < extent {
        return Err(WireError::OutOfBounds(format!(
            "byte length {} is less than the tensor's extent {}",
            raw.len, extent
        )));
    }
    // Element sizes are powers of two: a mask, not a division.
    debug_assert!(elem.is_power_of_two());
    if raw.offset & (elem - 1) != 0 {
        return Err(WireError::Misaligned {
            offset: raw.offset,
            elem,
        });
    }
    let end = raw
        .offset
        .checked_add(raw.len)
        .ok_or_else(|| WireError::OutOfBounds("offset + length overflows".into()))?;
    let location = match raw.location {
        RawLocation::HostSlot(s) => {
            if s.slot >= pool.slot_count {
                return Err(WireError::OutOfBounds(format!(
                    "slot {} of a pool of {} slots",
                    s.slot, pool.slot_count
                )));
            }
            if end > pool.slot_size {
                return Err(WireError::OutOfBounds(format!(
                    "bytes {}..{} leave the slot of {} bytes",
                    raw.offset, end, pool.slot_size
                )));
            }
            Location::HostSlot(*s)
        }
        RawLocation::DeviceBuffer(s) => {
            let len = device_len(s.slot).ok_or_else(|| {
                WireError::OutOfBounds(format!("device buffer {} is not registered", s.slot))
            })?;
            if end > len {
                return Err(WireError::OutOfBounds(format!(
                    "bytes {}..{} leave device buffer {} of {} bytes",
                    raw.offset, end, s.slot, len
                )));
            }
            Location::DeviceBuffer(*s)
        }
    };
    // Device buffers are fenced by the event registered with them, or by a timeline value on
    // the buffer's own semaphore (semaphore 0); nothing else is supported.
    let timeline = match (raw.fence, location) {
        (None, _) => None,
        (
            Some(RawFence::Timeline {
                semaphore: 0,
                value,
            }),
            Location::DeviceBuffer(_),
        ) => Some(*value),
        (Some(RawFence::Timeline { .. }), Location::DeviceBuffer(_)) => {
            return Err(WireError::Unsupported(
                "a timeline fence on a semaphore other than the buffer's own (0)".into(),
            ))
        }
        (Some(RawFence::Timeline { .. }), Location::HostSlot(_)) => {
            return Err(WireError::Unsupported(
                "a timeline fence on a host slot".into(),
            ))
        }
        (Some(RawFence::CudaIpcEvent(_)), _) => {
            return Err(WireError::Unsupported(
                "a per-descriptor CUDA IPC event fence".into(),
            ))
        }
    };
    let (device, slot) = match location {
        Location::HostSlot(s) => (false, s),
        Location::DeviceBuffer(s) => (true, s),
    };
    Ok(TensorDesc {
        dtype,
        rank: rank as u8,
        contiguous,
        device,
        slot,
        offset: raw.offset,
        len: raw.len,
        numel,
        timeline,
        shape,
        strides,
    })
}

/// Bytes a strided tensor reaches from element 0: (1 + sum((d_i - 1) * s_i)) * elem, or 0 for
/// an empty tensor.
fn strided_extent(shape: &[u64], strides: &[u64], numel: u64, elem: u64) -> Result<u64, WireError> {
    if numel == 0 {
        return Ok(0);
    }
    let mut last: u64 = 0;
    for (&d, &s) in shape.iter().zip(strides) {
        last = (d - 1)
            .checked_mul(s)
            .and_then(|x| last.checked_add(x))
            .ok_or_else(|| WireError::BadStrides("strided extent overflows".into()))?;
    }
    last.checked_add(1)
        .and_then(|n| n.checked_mul(elem))
        .ok_or_else(|| WireError::BadStrides("strided extent overflows".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorCode;

    const POOL: PoolBounds = PoolBounds {
        slot_count: 4,
        slot_size: 4096,
    };

    fn raw(dtype: u8, shape: &[u64], offset: u64, len: u64) -> RawTensorDesc {
        RawTensorDesc {
            dtype,
            shape: shape.to_vec(),
            strides: None,
            offset,
            len,
            location: RawLocation::HostSlot(SlotRef {
                slot: 1,
                generation: 0,
            }),
            fence: None,
        }
    }

    fn code(r: &RawTensorDesc) -> ErrorCode {
        validate(r, &POOL).unwrap_err().code()
    }

    #[test]
    fn accepts_a_plain_tensor() {
        let d = validate(&raw(0, &[2, 3, 4], 64, 96), &POOL).unwrap();
        assert_eq!(d.numel(), 24);
        assert_eq!(&*d.strides(), &[12, 4, 1]);
        assert!(d.is_contiguous());
        assert_eq!(d.slot().slot, 1);
    }

    #[test]
    fn refuses_each_bad_field() {
        assert_eq!(code(&raw(99, &[4], 0, 16)), ErrorCode::UnknownDType);
        assert_eq!(code(&raw(0, &[1; 9], 0, 4)), ErrorCode::BadRank);
        assert_eq!(
            code(&raw(0, &[u64::MAX, 2], 0, 16)),
            ErrorCode::ShapeOverflow
        );
        assert_eq!(
            code(&raw(0, &[1 << 62, 1], 0, 16)),
            ErrorCode::ShapeOverflow,
            "byte size overflows"
        );
        assert_eq!(code(&raw(0, &[4], 4088, 16)), ErrorCode::OutOfBounds);
        assert_eq!(code(&raw(0, &[4], u64::MAX - 2, 16)), ErrorCode::Misaligned);
        assert_eq!(
            code(&raw(0, &[4], u64::MAX - 7, 16)),
            ErrorCode::OutOfBounds
        );
        assert_eq!(
            code(&raw(0, &[8], 0, 16)),
            ErrorCode::OutOfBounds,
            "len < extent"
        );
        assert_eq!(code(&raw(0, &[4], 2, 16)), ErrorCode::Misaligned);
        let mut r = raw(0, &[4], 0, 16);
        r.location = RawLocation::HostSlot(SlotRef {
            slot: 4,
            generation: 0,
        });
        assert_eq!(code(&r), ErrorCode::OutOfBounds, "slot past the pool");
        let mut r = raw(0, &[4], 0, 16);
        r.fence = Some(RawFence::Timeline {
            semaphore: 0,
            value: 1,
        });
        assert_eq!(code(&r), ErrorCode::Unsupported);
    }

    #[test]
    fn strides_are_bounded() {
        let mut r = raw(0, &[2, 2], 0, 16);
        r.strides = Some(vec![2]);
        assert_eq!(code(&r), ErrorCode::BadStrides);
        // Transposed view of a 2x2: extent 4 elements, fits in 16 bytes.
        r.strides = Some(vec![1, 2]);
        let d = validate(&r, &POOL).unwrap();
        assert!(!d.is_contiguous());
        // A stride that reaches past the bytes given.
        r.strides = Some(vec![100, 1]);
        assert_eq!(code(&r), ErrorCode::OutOfBounds);
        r.strides = Some(vec![u64::MAX, 1]);
        assert_eq!(code(&r), ErrorCode::BadStrides);
    }

    #[test]
    fn strides_are_kept_only_where_they_differ_from_row_major() {
        // Row-major strides given explicitly: the same descriptor as none given.
        let mut r = raw(0, &[2, 3, 4], 0, 96);
        r.strides = Some(vec![12, 4, 1]);
        let given = validate(&r, &POOL).unwrap();
        assert_eq!(given, validate(&raw(0, &[2, 3, 4], 0, 96), &POOL).unwrap());
        assert!(given.is_contiguous());
        assert_eq!(&*given.strides(), &[12, 4, 1]);
        // Others are kept as given: extent (1·1 + 2·2 + 3·6 + 1) elements of 4 bytes = 96.
        r.strides = Some(vec![1, 2, 6]);
        let d = validate(&r, &POOL).unwrap();
        assert_eq!(&*d.strides(), &[1, 2, 6]);
        assert_eq!(d.shape(), &[2, 3, 4]);
        assert!(!d.is_contiguous());
        // A single element is contiguous whatever its strides say.
        let mut one = raw(0, &[1, 1], 0, 4);
        one.strides = Some(vec![7, 9]);
        assert!(validate(&one, &POOL).unwrap().is_contiguous());
        // Every request the server hands out carries one: it stays small.
        let size = std::mem::size_of::<TensorDesc>();
        assert!(size <= 128, "TensorDesc is {size} bytes");
    }

    #[test]
    fn device_descriptors_are_bounded_by_their_buffer() {
        let lens = |b: u32| (b == 3).then_some(1024u64);
        let mut r = raw(0, &[256], 0, 1024);
        r.location = RawLocation::DeviceBuffer(SlotRef {
            slot: 3,
            generation: 0,
        });
        let d = validate_in(&r, &POOL, &lens).unwrap();
        assert!(d.is_device());
        r.len = 1028;
        r.shape = vec![257];
        assert_eq!(
            validate_in(&r, &POOL, &lens).unwrap_err().code(),
            ErrorCode::OutOfBounds
        );
        r.location = RawLocation::DeviceBuffer(SlotRef {
            slot: 4,
            generation: 0,
        });
        r.len = 16;
        r.shape = vec![4];
        assert_eq!(
            validate_in(&r, &POOL, &lens).unwrap_err().code(),
            ErrorCode::OutOfBounds
        );
        // Without registered buffers (plain `validate`), device descriptors are refused.
        assert!(validate(&r, &POOL).is_err());
    }

    #[test]
    fn empty_tensor_is_fine() {
        let d = validate(&raw(5, &[0, 7], 8, 0), &POOL).unwrap();
        assert_eq!(d.numel(), 0);
        assert_eq!(d.byte_len(), 0);
    }
}
