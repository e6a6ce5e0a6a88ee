//! The one error type of this crate, and the numeric codes that travel in `Error` frames.

use thiserror::Error;

numbered! {
/// A numeric error code, as carried in an `Error` frame or a failed `Result`. The numbers are part
/// of the protocol (see `docs/protocol.md`); new codes are only ever appended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode: u16 {
    /// The bytes of a frame do not decode as a message of this protocol.
    Malformed = 1,
    /// A frame's length field is over the limit; the frame was not read.
    FrameTooLarge = 2,
    /// No protocol version is spoken by both peers.
    VersionMismatch = 3,
    /// The first message of a connection was not `Hello`, or `Hello` came twice.
    HandshakeRequired = 4,
    /// A descriptor names a dtype this version does not know.
    UnknownDType = 5,
    /// A shape's element count or byte size overflows 64 bits.
    ShapeOverflow = 6,
    /// A descriptor's bytes leave the slot (offset + length, or the strided extent).
    OutOfBounds = 7,
    /// Strides are missing for some dimension, or zero where they must not be.
    BadStrides = 8,
    /// The slot is not granted to this session, or its generation is stale.
    SlotNotLeased = 9,
    /// File descriptors were attached to a message that carries none.
    FdsNotExpected = 10,
    /// A feature (location, fence) this server does not support.
    Unsupported = 11,
    /// The server is at its session limit.
    TooManySessions = 12,
    /// The peer's uid is not allowed.
    PermissionDenied = 13,
    /// The server is draining and takes no new work.
    Draining = 14,
    /// The server failed for a reason of its own.
    Internal = 15,
    /// The handshake did not complete in time.
    HandshakeTimeout = 16,
    /// More than [`crate::MAX_DIMS`] dimensions.
    BadRank = 17,
    /// An offset is not a multiple of the dtype's size.
    Misaligned = 18,
    /// A request id is already in flight in this session.
    DuplicateRequest = 19,
    /// The model or handler failed on this request.
    HandlerFailed = 20,
    /// A string or list in a message is longer than the protocol allows.
    TooLong = 21,
    /// The session has too many requests in flight.
    TooManyInFlight = 22,
    /// The pool asked for is over the per-session cap, or the server's memory budget for pools
    /// is spent.
    MemoryBudget = 23,
    /// A device tensor's "ready" fence was not signalled within the server's fence timeout: its
    /// request failed and the session ends (its stalled wait would hold up other producers).
    FenceTimeout = 24,
    /// The session sent more refused messages than the server takes from one producer; the
    /// session ends (a producer refused that often is broken or hostile, and each refusal costs
    /// the server work other producers wait for).
    TooManyRefusals = 25,
    /// A code this version does not know (kept as received).
    Unknown = 0xFFFF,
}
}

impl ErrorCode {
    /// The code for a number received from a peer; unknown numbers map to [`ErrorCode::Unknown`].
    pub fn from_u16(v: u16) -> ErrorCode {
        ErrorCode::from_number(v).unwrap_or(ErrorCode::Unknown)
    }

    /// The number that travels on the wire.
    pub fn as_u16(self) -> u16 {
        self as u16
    }
}

/// Everything that can be wrong with bytes or a message received from a peer.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WireError {
    /// The payload is not a valid postcard encoding of the expected message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The frame length field exceeds the limit.
    #[error("frame of {len} bytes is over the limit of {max} bytes")]
    FrameTooLarge {
        /// The announced length.
        len: u64,
        /// The limit in force.
        max: u32,
    },
    /// A zero-length frame.
    #[error("empty frame")]
    EmptyFrame,
    /// Bad magic in `Hello`.
    #[error("not a tensorport peer (bad magic)")]
    BadMagic,
    /// No common protocol version.
    #[error("no common protocol version: peer speaks {peer_min}..={peer_max}, we speak {our_min}..={our_max}")]
    VersionMismatch {
        /// Peer's minimum.
        peer_min: u16,
        /// Peer's maximum.
        peer_max: u16,
        /// Our minimum.
        our_min: u16,
        /// Our maximum.
        our_max: u16,
    },
    /// Unknown dtype number.
    #[error("unknown dtype {0}")]
    UnknownDType(u8),
    /// Rank above the maximum.
    #[error("{0} dimensions, at most {max} allowed", max = crate::MAX_DIMS)]
    BadRank(usize),
    /// Element count or byte size overflows.
    #[error("shape {0:?} overflows 64-bit element or byte count")]
    ShapeOverflow(Vec<u64>),
    /// Strides malformed.
    #[error("bad strides: {0}")]
    BadStrides(String),
    /// Bytes leave the slot or the pool.
    #[error("out of bounds: {0}")]
    OutOfBounds(String),
    /// Offset not aligned to the element size.
    #[error("offset {offset} is not a multiple of the element size {elem}")]
    Misaligned {
        /// The byte offset.
        offset: u64,
        /// The element size in bytes.
        elem: u64,
    },
    /// A string or list is too long.
    #[error("{what} is {len} long, at most {max} allowed")]
    TooLong {
        /// What was too long.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Something this version does not support.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl WireError {
    /// The protocol code to report this error with.
    pub fn code(&self) -> ErrorCode {
        match self {
            WireError::Malformed(_) | WireError::EmptyFrame | WireError::BadMagic => {
                ErrorCode::Malformed
            }
            WireError::FrameTooLarge { .. } => ErrorCode::FrameTooLarge,
            WireError::VersionMismatch { .. } => ErrorCode::VersionMismatch,
            WireError::UnknownDType(_) => ErrorCode::UnknownDType,
            WireError::BadRank(_) => ErrorCode::BadRank,
            WireError::ShapeOverflow(_) => ErrorCode::ShapeOverflow,
            WireError::BadStrides(_) => ErrorCode::BadStrides,
            WireError::OutOfBounds(_) => ErrorCode::OutOfBounds,
            WireError::Misaligned { .. } => ErrorCode::Misaligned,
            WireError::TooLong { .. } => ErrorCode::TooLong,
            WireError::Unsupported(_) => ErrorCode::Unsupported,
        }
    }

    /// Whether the byte stream can no longer be trusted after this error (the connection must be
    /// closed), as opposed to one bad message in an otherwise sound stream.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            WireError::Malformed(_)
                | WireError::FrameTooLarge { .. }
                | WireError::EmptyFrame
                | WireError::BadMagic
                | WireError::VersionMismatch { .. }
        )
    }
}
