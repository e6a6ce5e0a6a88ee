//! The runtime's errors: each operation's own ([`ConnectError`], [`BindError`], [`LeaseError`],
//! [`SubmitError`], [`RecvError`], [`Stopped`]), which the code produces where the failure
//! happens, and [`Error`], built from them (and from a broken session's cause) for callers that
//! keep one type. No conversion runs the other way: a session's breakage reaches an operation's
//! error as its `ServerGone` or `Failed`.

use std::path::PathBuf;
use std::time::Duration;

use tensorport_wire::{ErrorCode, WireError};
use thiserror::Error;

/// Everything the server and producer APIs can fail with, for code that keeps one error type:
/// each operation's error as itself (`Error::Lease(LeaseError::Draining)`), a broken session as
/// its cause. Each message says what to do where there is something to do.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// Connecting to a server failed ([`ConnectError`]: nothing listens, another user's server,
    /// refused, no Welcome in time).
    #[error(transparent)]
    Connect(ConnectError),
    /// Listening failed ([`BindError`]: a server listens there, not a socket, an unsafe folder).
    #[error(transparent)]
    Bind(BindError),
    /// No slot was lent ([`LeaseError`]: backpressure, draining).
    #[error(transparent)]
    Lease(LeaseError),
    /// A submission was refused ([`SubmitError`]).
    #[error(transparent)]
    Submit(SubmitError),
    /// No result came ([`RecvError`]: a timeout, nothing in flight).
    #[error(transparent)]
    Recv(RecvError),
    /// An I/O call failed.
    #[error("{what}: {source}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The server closed the connection.
    #[error("{}", SERVER_GONE)]
    ServerGone,
    /// The producer whose request this is has left; its result has nowhere to go.
    #[error("the producer's session has ended")]
    SessionGone,
    /// The producer does not read what the server sends it, so it is being dropped.
    #[error("the producer is dropped: {0}")]
    PeerNotReading(String),
    /// A wait ran out (the server's answer to a control command, its status, a device
    /// buffer's release).
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
    /// The server has stopped: drained, or shut down.
    #[error("the server has stopped")]
    Stopped,
    /// A device buffer that was never registered.
    #[error("device buffer {0} is not registered")]
    UnknownDevice(u32),
    /// A result's payload is over the frame limit.
    #[error("result of {0} bytes is over the protocol's frame limit")]
    ResultTooLarge(usize),
}

/// What every operation's error says when the server has closed the connection.
const SERVER_GONE: &str =
    "the tensorport server closed the connection (it exited, was killed, or dropped this session)";

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

/// Why [`Producer::connect`](crate::Producer::connect) or
/// [`Control::connect`](crate::Control::connect) failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// Nothing listens at the socket path: start a server there, or connect to the path one
    /// listens on.
    #[error("no tensorport server at {path} ({source}); start a server there, or connect to the path one listens on ($TENSORPORT_SOCKET sets the default)")]
    NoServer {
        /// The socket path tried.
        path: PathBuf,
        /// What connect said.
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
    /// The server refused the session; `code` says why (another protocol version, no place,
    /// its memory budget, draining).
    #[error("server refused ({code:?}): {message}")]
    Refused {
        /// The protocol code.
        code: ErrorCode,
        /// The server's explanation.
        message: String,
    },
    /// The server did not finish the handshake in time.
    #[error("timed out after {0:?} waiting for the server's Welcome")]
    Timeout(Duration),
    /// The connection or its shared memory failed on the way (what, and why).
    #[error(transparent)]
    Failed(Box<Error>),
}

/// Why [`Producer::lease`](crate::Producer::lease) or [`Producer::loan`](crate::Producer::loan)
/// gave no slot.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// Every slot stayed in flight (or on loan) for the whole wait: backpressure. Receive
    /// results, or wait longer.
    #[error("timed out after {0:?} waiting for a free slot (every slot is in flight: wait for results, or ask for more slots)")]
    Timeout(Duration),
    /// The server is draining and takes no new work.
    #[error("the server is draining and takes no new work")]
    Draining,
    /// The server closed the connection: connect again (to a restarted server).
    #[error("{}", SERVER_GONE)]
    ServerGone,
    /// The session broke (the peer broke the protocol, or its queues): connect again.
    #[error(transparent)]
    Failed(Box<Error>),
}

/// Why a submission (a lease's, a loan's or a device buffer's) was refused.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The tensor's description breaks the server's rules (the wire error it would have been
    /// refused with; [`WireError::code`] gives the protocol code).
    #[error("invalid tensor: {0}")]
    InvalidTensor(WireError),
    /// The request id is already in flight in this session.
    #[error("request id {0} is already in flight")]
    DuplicateRequest(u64),
    /// The loan is another producer's slot.
    #[error("this loan is another producer's slot; submit it with the producer that lent it")]
    ForeignLoan,
    /// A device buffer that was never registered.
    #[error("device buffer {0} is not registered")]
    UnknownDevice(u32),
    /// A device buffer still in flight (wait for it with `wait_device`).
    #[error("device buffer {0} is in flight; wait_device first")]
    DeviceInFlight(u32),
    /// The server closed the connection: connect again.
    #[error("{}", SERVER_GONE)]
    ServerGone,
    /// The session broke on the way: connect again.
    #[error(transparent)]
    Failed(Box<Error>),
}

/// Why [`Producer::recv_result`](crate::Producer::recv_result) gave no result.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RecvError {
    /// No result came within the wait; the requests are still in flight.
    #[error("timed out after {0:?} waiting for a result")]
    Timeout(Duration),
    /// Nothing is in flight, so no result will come.
    #[error("no request is in flight, so no result will come")]
    NothingInFlight,
    /// The server closed the connection: the requests in flight will not be answered.
    #[error("{}", SERVER_GONE)]
    ServerGone,
    /// The session broke (the peer broke the protocol, or its queues): connect again.
    #[error(transparent)]
    Failed(Box<Error>),
}

/// Why [`Server::bind`](crate::Server::bind) could not listen.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum BindError {
    /// Another server listens at the path: stop (drain) it, or listen on another path.
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
    /// The configuration or the system refused (what, and why).
    #[error(transparent)]
    Failed(Box<Error>),
}

/// The server has stopped (drained, or shut down): no request will come. What
/// [`Server::recv_batch`](crate::Server::recv_batch) and
/// [`Server::recv_timeout`](crate::Server::recv_timeout) return then, an outcome rather than a
/// failure (a timeout is an empty batch, or `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("the server has stopped")]
pub struct Stopped;

impl ConnectError {
    /// The connection or its shared memory failed on the way.
    pub(crate) fn failed(e: Error) -> ConnectError {
        ConnectError::Failed(Box::new(e))
    }
}

impl BindError {
    /// The system refused (what, and why).
    pub(crate) fn failed(e: Error) -> BindError {
        BindError::Failed(Box::new(e))
    }
}

impl LeaseError {
    /// The session broke while waiting for a slot: the server gone, or the session unusable.
    pub(crate) fn broken(e: Error) -> LeaseError {
        match e {
            Error::ServerGone => LeaseError::ServerGone,
            e => LeaseError::Failed(Box::new(e)),
        }
    }
}

impl SubmitError {
    /// The session broke while submitting.
    pub(crate) fn broken(e: Error) -> SubmitError {
        match e {
            Error::ServerGone => SubmitError::ServerGone,
            e => SubmitError::Failed(Box::new(e)),
        }
    }
}

impl RecvError {
    /// The session broke while waiting for a result.
    pub(crate) fn broken(e: Error) -> RecvError {
        match e {
            Error::ServerGone => RecvError::ServerGone,
            e => RecvError::Failed(Box::new(e)),
        }
    }
}

/// Implements `From` each operation's error (and [`Stopped`]) for an error type that already
/// takes a [`tensorport::Error`](crate::Error), through it: a crate that keeps one error type
/// writes `tensorport::from_operation_errors!(MyError);` and `?` works on every call.
#[macro_export]
macro_rules! from_operation_errors {
    ($t:ty) => {
        $crate::from_operation_errors!(@each $t;
            $crate::ConnectError, $crate::LeaseError, $crate::SubmitError,
            $crate::RecvError, $crate::BindError, $crate::Stopped);
    };
    (@each $t:ty; $($op:ty),*) => {$(
        impl ::core::convert::From<$op> for $t {
            fn from(e: $op) -> $t {
                <$t>::from($crate::Error::from(e))
            }
        }
    )*};
}

// Into the crate-wide error, for callers that keep one type: a broken session as what broke
// it, the rest as the operation's error.
impl From<ConnectError> for Error {
    fn from(e: ConnectError) -> Error {
        match e {
            ConnectError::Failed(e) => *e,
            e => Error::Connect(e),
        }
    }
}

impl From<BindError> for Error {
    fn from(e: BindError) -> Error {
        match e {
            BindError::Failed(e) => *e,
            e => Error::Bind(e),
        }
    }
}

impl From<LeaseError> for Error {
    fn from(e: LeaseError) -> Error {
        match e {
            LeaseError::ServerGone => Error::ServerGone,
            LeaseError::Failed(e) => *e,
            e => Error::Lease(e),
        }
    }
}

impl From<SubmitError> for Error {
    fn from(e: SubmitError) -> Error {
        match e {
            SubmitError::ServerGone => Error::ServerGone,
            SubmitError::Failed(e) => *e,
            e => Error::Submit(e),
        }
    }
}

impl From<RecvError> for Error {
    fn from(e: RecvError) -> Error {
        match e {
            RecvError::ServerGone => Error::ServerGone,
            RecvError::Failed(e) => *e,
            e => Error::Recv(e),
        }
    }
}

impl From<Stopped> for Error {
    fn from(_: Stopped) -> Error {
        Error::Stopped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wide_error_is_built_from_each_operations_error() {
        let t = Duration::from_millis(250);
        // What a caller acts on stays the operation's, inside the wide error, saying the same.
        let e = Error::from(LeaseError::Timeout(t));
        assert!(matches!(e, Error::Lease(LeaseError::Timeout(d)) if d == t));
        assert!(e
            .to_string()
            .starts_with("timed out after 250ms waiting for a free slot"));
        assert!(matches!(
            Error::from(BindError::AddrInUse("/s".into())),
            Error::Bind(BindError::AddrInUse(_))
        ));
        assert!(matches!(
            Error::from(SubmitError::DuplicateRequest(7)),
            Error::Submit(SubmitError::DuplicateRequest(7))
        ));
        // A broken session comes back as what broke it.
        for gone in [
            Error::from(LeaseError::ServerGone),
            Error::from(SubmitError::ServerGone),
            Error::from(RecvError::ServerGone),
        ] {
            assert!(matches!(gone, Error::ServerGone));
        }
        let e = RecvError::broken(Error::Protocol(WireError::BadMagic));
        assert!(matches!(&e, RecvError::Failed(b) if matches!(**b, Error::Protocol(_))));
        assert!(matches!(
            Error::from(e),
            Error::Protocol(WireError::BadMagic)
        ));
        assert!(matches!(
            LeaseError::broken(Error::ServerGone),
            LeaseError::ServerGone
        ));
        assert_eq!(
            Error::ServerGone.to_string(),
            RecvError::ServerGone.to_string()
        );
    }
}
