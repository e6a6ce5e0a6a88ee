//! The runtime's one error type.

use std::path::PathBuf;
use std::time::Duration;

use tensorport_wire::{ErrorCode, WireError};
use thiserror::Error;

/// Everything the server and producer APIs can fail with. Each message says what to do where
/// there is something to do.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// Nothing listens at the socket path.
    #[error("no tensorport server at {path} ({source}); start a server there, or connect to the path one listens on ($TENSORPORT_SOCKET sets the default)")]
    NoServer {
        /// The socket path tried.
        path: PathBuf,
        /// What connect said.
        #[source]
        source: std::io::Error,
    },
    /// Another server listens at the path.
    #[error("a tensorport server is already listening at {0}; stop it (drain it), or listen on another path")]
    AddrInUse(PathBuf),
    /// The path exists and is not a socket.
    #[error("{0} exists and is not a socket; remove it, or use another path")]
    NotASocket(PathBuf),
    /// The socket's directory is not private to this user.
    #[error("socket directory {path} {problem}; use a directory only you can write (mode 0700)")]
    UnsafeDir {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// An I/O call failed.
    #[error("{what}: {source}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The process listening on the socket belongs to another user.
    #[error("the server at {path} runs as uid {uid}, neither you nor root; refusing to talk to it (check the socket path)")]
    UntrustedServer {
        /// The socket path.
        path: PathBuf,
        /// The server's uid.
        uid: u32,
    },
    /// The server closed the connection.
    #[error("the tensorport server closed the connection (it exited, was killed, or dropped this session)")]
    ServerGone,
    /// The producer whose request this is has left; its result has nowhere to go.
    #[error("the producer's session has ended")]
    SessionGone,
    /// The producer does not read what the server sends it, so it is being dropped.
    #[error("the producer is dropped: {0}")]
    PeerNotReading(String),
    /// `recv_result` was called with nothing in flight.
    #[error("no request is in flight, so no result will come")]
    NothingInFlight,
    /// A wait ran out.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, &'static str),
    /// The server refused something with an error frame.
    #[error("server refused ({code:?}): {message}")]
    Refused {
        /// The protocol code.
        code: ErrorCode,
        /// The server's explanation.
        message: String,
    },
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(#[from] WireError),
    /// Shared memory failed.
    #[error(transparent)]
    Shm(#[from] tensorport_shm::ShmError),
    /// The shared-memory queues were corrupted by the peer (the session cannot go on).
    #[error(transparent)]
    Ring(#[from] tensorport_shm::RingError),
    /// The server is draining and takes no new work.
    #[error("the server is draining and takes no new work")]
    Draining,
    /// The server has stopped: drained, or shut down.
    #[error("the server has stopped")]
    Stopped,
    /// A tensor spec that cannot be submitted, caught before sending with the server's own
    /// rules: the wire error it would have been refused with ([`WireError::code`] gives the
    /// protocol code).
    #[error("invalid tensor: {0}")]
    InvalidTensor(WireError),
    /// A request id already in flight in this session.
    #[error("request id {0} is already in flight")]
    DuplicateRequest(u64),
    /// A device buffer that was never registered.
    #[error("device buffer {0} is not registered")]
    UnknownDevice(u32),
    /// A device buffer still in flight (wait for `DeviceReleased` with `wait_device`).
    #[error("device buffer {0} is in flight; wait_device first")]
    DeviceInFlight(u32),
    /// A loan submitted to a producer that did not lend it.
    #[error("this loan is another producer's slot; submit it with the producer that lent it")]
    ForeignLoan,
    /// A result's payload is over the frame limit.
    #[error("result of {0} bytes is over the protocol's frame limit")]
    ResultTooLarge(usize),
}

impl Error {
    pub(crate) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> Error {
        move |source| Error::Io { what, source }
    }
    pub(crate) fn sys(what: &'static str) -> impl FnOnce(nix::Error) -> Error {
        move |e| Error::Io {
            what,
            source: std::io::Error::from(e),
        }
    }
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
