//! The shared-memory queues' entries (protocol 2), as words: the sibling of the socket's frames.
//!
//! A submission is 24 little-endian `u64` words, a completion 3 words and up to 232 bytes of
//! inline result. Decoding is total — any words make an entry — and bounded: a rank over
//! [`MAX_DIMS`] is refused by [`SqEntry::view`] before a dimension is used, and an inline length
//! over [`CQ_INLINE_BYTES`] is clipped by [`CqHeader::from_words`]. What an entry says is then
//! checked like any descriptor from a peer ([`crate::validate_view`]). The queues themselves
//! (positions, the mapping) are `tensorport-shm`'s.

use crate::{RawFence, RawLocation, RawTensorView, SlotRef, WireError, MAX_DIMS};

/// Words in a submission entry.
pub const SQ_ENTRY_WORDS: usize = 24;
/// Words in a completion entry.
pub const CQ_ENTRY_WORDS: usize = 32;
/// Completion words before its inline bytes.
pub const CQ_HEADER_WORDS: usize = 3;
/// Result bytes a completion carries inline.
pub const CQ_INLINE_BYTES: usize = (CQ_ENTRY_WORDS - CQ_HEADER_WORDS) * 8;
/// Completion flag: the slot in the entry is granted.
pub const CQ_GRANT: u32 = 1;
/// Completion flag: the entry answers its request, with its inline bytes as the result.
pub const CQ_RESULT: u32 = 2;
/// Completion flag (protocol 3): the device buffer in the entry (`slot`) is the producer's
/// again under `generation` — `DeviceReleased` on the queue.
pub const CQ_DEVICE_RELEASED: u32 = 4;

/// One submission: a request id and a full tensor descriptor in a host slot, raw (the server
/// validates it like any descriptor from a peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SqEntry {
    /// The producer's id for the request.
    pub request_id: u64,
    /// Slot index.
    pub slot: u32,
    /// Slot generation.
    pub generation: u32,
    /// DType number.
    pub dtype: u8,
    /// Number of dimensions (more than [`MAX_DIMS`] is refused).
    pub rank: u8,
    /// Whether `strides` are given (otherwise row-major).
    pub has_strides: bool,
    /// Protocol 3: the tensor is in the registered device buffer `slot` (at `generation`),
    /// not in a host slot.
    pub device: bool,
    /// Protocol 3, device buffers fenced by timeline: the "ready" value to wait for.
    pub timeline: Option<u64>,
    /// Byte offset of element 0 in the slot.
    pub offset: u64,
    /// Bytes covered from `offset`.
    pub len: u64,
    /// Dimensions, the first `rank` used.
    pub shape: [u64; MAX_DIMS],
    /// Strides in elements, the first `rank` used if `has_strides`.
    pub strides: [u64; MAX_DIMS],
}

/// Word 2's fields: dtype (bits 0-7), rank (8-15), strides given (bit 16), a device buffer
/// (bit 17), a timeline value in word 21 (bit 18).
const W2_RANK_SHIFT: u32 = 8;
const W2_STRIDES_BIT: u32 = 16;
const W2_DEVICE_BIT: u32 = 17;
const W2_TIMELINE_BIT: u32 = 18;
/// The timeline value's word.
pub const TIMELINE_WORD: usize = STRIDES_AT + MAX_DIMS;
/// Where the shape and the strides start.
const SHAPE_AT: usize = 5;
const STRIDES_AT: usize = SHAPE_AT + MAX_DIMS;

impl SqEntry {
    /// The entry as its words.
    pub fn to_words(&self) -> [u64; SQ_ENTRY_WORDS] {
        let mut w = [0u64; SQ_ENTRY_WORDS];
        w[0] = self.request_id;
        w[1] = self.slot as u64 | (self.generation as u64) << 32;
        w[2] = self.dtype as u64
            | (self.rank as u64) << W2_RANK_SHIFT
            | (self.has_strides as u64) << W2_STRIDES_BIT
            | (self.device as u64) << W2_DEVICE_BIT
            | (self.timeline.is_some() as u64) << W2_TIMELINE_BIT;
        w[TIMELINE_WORD] = self.timeline.unwrap_or(0);
        w[3] = self.offset;
        w[4] = self.len;
        w[SHAPE_AT..STRIDES_AT].copy_from_slice(&self.shape);
        w[STRIDES_AT..STRIDES_AT + MAX_DIMS].copy_from_slice(&self.strides);
        w
    }

    /// Which words a reader needs, from word 2 alone: the first five, then `rank` (clipped to
    /// [`MAX_DIMS`]) of the shape and, if strides are given, as many of them (and word
    /// [`TIMELINE_WORD`] if [`SqEntry::has_timeline`]). A reader copies only these out of the
    /// shared mapping and leaves the rest zero.
    pub fn words_used(w2: u64) -> (usize, bool) {
        let rank = ((w2 >> W2_RANK_SHIFT) as u8 as usize).min(MAX_DIMS);
        (rank, (w2 >> W2_STRIDES_BIT) & 1 == 1)
    }

    /// Whether word 2 says a timeline value follows (word [`TIMELINE_WORD`]).
    pub fn has_timeline(w2: u64) -> bool {
        (w2 >> W2_TIMELINE_BIT) & 1 == 1
    }

    /// The word index of dimension `i`'s size, and of its stride.
    pub fn dim_words(i: usize) -> (usize, usize) {
        (SHAPE_AT + i, STRIDES_AT + i)
    }

    /// The entry its words say (any words decode; [`SqEntry::view`] checks the rank).
    pub fn from_words(w: &[u64; SQ_ENTRY_WORDS]) -> SqEntry {
        let mut e = SqEntry {
            request_id: w[0],
            slot: w[1] as u32,
            generation: (w[1] >> 32) as u32,
            dtype: w[2] as u8,
            rank: (w[2] >> W2_RANK_SHIFT) as u8,
            has_strides: (w[2] >> W2_STRIDES_BIT) & 1 == 1,
            device: (w[2] >> W2_DEVICE_BIT) & 1 == 1,
            timeline: SqEntry::has_timeline(w[2]).then_some(w[TIMELINE_WORD]),
            offset: w[3],
            len: w[4],
            ..SqEntry::default()
        };
        e.shape.copy_from_slice(&w[SHAPE_AT..STRIDES_AT]);
        e.strides
            .copy_from_slice(&w[STRIDES_AT..STRIDES_AT + MAX_DIMS]);
        e
    }

    /// Where the entry says the tensor is: a host slot, or (protocol 3) a device buffer.
    pub fn location(&self) -> RawLocation {
        let r = SlotRef {
            slot: self.slot,
            generation: self.generation,
        };
        if self.device {
            RawLocation::DeviceBuffer(r)
        } else {
            RawLocation::HostSlot(r)
        }
    }

    /// The fence the entry carries: a timeline value (device buffers), or none.
    pub fn fence(&self) -> Option<RawFence> {
        self.timeline.map(|value| RawFence::Timeline {
            semaphore: 0,
            value,
        })
    }

    /// The descriptor the entry holds, as a view for [`crate::validate_view`]; a rank over
    /// [`MAX_DIMS`] is refused here. `location` is [`SqEntry::location`], `fence`
    /// [`SqEntry::fence`].
    pub fn view<'a>(
        &'a self,
        location: &'a RawLocation,
        fence: Option<&'a RawFence>,
    ) -> Result<RawTensorView<'a>, WireError> {
        let rank = self.rank as usize;
        if rank > MAX_DIMS {
            return Err(WireError::BadRank(rank));
        }
        Ok(RawTensorView {
            dtype: self.dtype,
            shape: &self.shape[..rank],
            strides: self.has_strides.then_some(&self.strides[..rank]),
            offset: self.offset,
            len: self.len,
            location,
            fence,
        })
    }
}

/// The fixed part of a completion (its inline result bytes travel after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CqHeader {
    /// [`CQ_GRANT`] and/or [`CQ_RESULT`].
    pub flags: u32,
    /// Result bytes inline (at most [`CQ_INLINE_BYTES`]).
    pub len: u32,
    /// The request answered (with [`CQ_RESULT`]).
    pub request_id: u64,
    /// Slot granted (with [`CQ_GRANT`]).
    pub slot: u32,
    /// Its generation.
    pub generation: u32,
}

impl CqHeader {
    /// The header's words.
    pub fn to_words(&self) -> [u64; CQ_HEADER_WORDS] {
        [
            self.flags as u64 | (self.len as u64) << 32,
            self.request_id,
            self.slot as u64 | (self.generation as u64) << 32,
        ]
    }

    /// The header its words say, its inline length clipped to [`CQ_INLINE_BYTES`].
    pub fn from_words(w: &[u64; CQ_HEADER_WORDS]) -> CqHeader {
        CqHeader {
            flags: w[0] as u32,
            len: ((w[0] >> 32) as usize).min(CQ_INLINE_BYTES) as u32,
            request_id: w[1],
            slot: w[2] as u32,
            generation: (w[2] >> 32) as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{validate_view, PoolBounds};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_words_decode_and_a_valid_view_lies_inside_the_pool(
            w in proptest::array::uniform24(any::<u64>()),
            rank in 0u64..12,
        ) {
            let mut w = w;
            w[2] = (w[2] & !0xff00) | rank << 8;
            let e = SqEntry::from_words(&w);
            let loc = e.location();
            let fence = e.fence();
            let pool = PoolBounds { slot_count: 8, slot_size: 1 << 16 };
            match e.view(&loc, fence.as_ref()) {
                Err(WireError::BadRank(r)) => prop_assert!(r > MAX_DIMS),
                Err(other) => prop_assert!(false, "{other:?}"),
                Ok(v) => {
                    if let Ok(d) = validate_view(&v, &pool, &|b| (b < 2).then_some(1 << 20)) {
                        if d.is_device() {
                            prop_assert!(d.offset() + d.byte_len() <= 1 << 20);
                            prop_assert!(d.slot().slot < 2);
                        } else {
                            prop_assert!(d.offset() + d.byte_len() <= pool.slot_size);
                            prop_assert!(d.slot().slot < pool.slot_count);
                        }
                    }
                }
            }
        }

        #[test]
        fn entries_round_trip(
            request_id in any::<u64>(), slot in any::<u32>(), generation in any::<u32>(),
            dtype in any::<u8>(), rank in any::<u8>(), has_strides in any::<bool>(),
            device in any::<bool>(), timeline in proptest::option::of(any::<u64>()),
            offset in any::<u64>(), len in any::<u64>(),
            shape in proptest::array::uniform8(any::<u64>()),
            strides in proptest::array::uniform8(any::<u64>()),
        ) {
            let e = SqEntry { request_id, slot, generation, dtype, rank, has_strides, device, timeline, offset, len, shape, strides };
            prop_assert_eq!(SqEntry::from_words(&e.to_words()), e);
        }

        #[test]
        fn completion_headers_round_trip_and_clip(
            flags in any::<u32>(), len in any::<u32>(), request_id in any::<u64>(),
            slot in any::<u32>(), generation in any::<u32>(),
        ) {
            let h = CqHeader { flags, len, request_id, slot, generation };
            let back = CqHeader::from_words(&h.to_words());
            prop_assert_eq!(back.len as usize, (len as usize).min(CQ_INLINE_BYTES));
            prop_assert_eq!((back.flags, back.request_id, back.slot, back.generation), (flags, request_id, slot, generation));
        }
    }
}
