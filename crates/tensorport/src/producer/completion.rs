//! The answer to a request.

use tensorport_shm::ring::CQ_INLINE_BYTES;
use tensorport_wire::ErrorCode;

/// A failure the server reported for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteError {
    /// Protocol code.
    pub code: ErrorCode,
    /// The server's explanation.
    pub message: String,
}

impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

impl std::error::Error for RemoteError {}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The request's id, as returned by `submit`.
    pub request_id: u64,
    /// The result bytes, or why there are none.
    pub result: std::result::Result<Vec<u8>, RemoteError>,
}

/// A result received and not yet taken: inline, as it came on the queue (no allocation), or a
/// socket message's.
#[derive(Debug)]
// Inline on purpose: boxing the bytes is the allocation this type exists to avoid.
#[allow(clippy::large_enum_variant)]
pub(super) enum Done {
    Inline {
        request_id: u64,
        len: u8,
        bytes: [u8; CQ_INLINE_BYTES],
    },
    Message(Completion),
}

impl Done {
    pub(super) fn into_completion(self) -> Completion {
        match self {
            Done::Inline {
                request_id,
                len,
                bytes,
            } => Completion {
                request_id,
                result: Ok(bytes[..len as usize].to_vec()),
            },
            Done::Message(c) => c,
        }
    }
}
