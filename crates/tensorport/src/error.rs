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
    #[error("timed out after {0:?} waiting for a free slot")]
    Timeout(Duration),
    /// The server is draining and takes no new work.
    #[error("the server is draining and takes no new work")]
    Draining,
    /// The server closed the connection: connect again (to a restarted server).
    #[error("the tensorport server closed the connection (it exited, was killed, or dropped this session)")]
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
    #[error("the tensorport server closed the connection (it exited, was killed, or dropped this session)")]
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
    #[error("the tensorport server closed the connection (it exited, was killed, or dropped this session)")]
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

impl From<Error> for ConnectError {
    fn from(e: Error) -> ConnectError {
        match e {
            Error::NoServer { path, source } => ConnectError::NoServer { path, source },
            Error::UntrustedServer { path, uid } => ConnectError::UntrustedServer { path, uid },
            Error::Refused { code, message } => ConnectError::Refused { code, message },
            Error::Timeout(d, _) => ConnectError::Timeout(d),
            e => ConnectError::Failed(Box::new(e)),
        }
    }
}

impl From<Error> for LeaseError {
    fn from(e: Error) -> LeaseError {
        match e {
            Error::Timeout(d, _) => LeaseError::Timeout(d),
            Error::Draining => LeaseError::Draining,
            Error::ServerGone => LeaseError::ServerGone,
            e => LeaseError::Failed(Box::new(e)),
        }
    }
}

impl From<Error> for SubmitError {
    fn from(e: Error) -> SubmitError {
        match e {
            Error::InvalidTensor(w) => SubmitError::InvalidTensor(w),
            Error::DuplicateRequest(id) => SubmitError::DuplicateRequest(id),
            Error::ForeignLoan => SubmitError::ForeignLoan,
            Error::UnknownDevice(b) => SubmitError::UnknownDevice(b),
            Error::DeviceInFlight(b) => SubmitError::DeviceInFlight(b),
            Error::ServerGone => SubmitError::ServerGone,
            e => SubmitError::Failed(Box::new(e)),
        }
    }
}

impl From<Error> for RecvError {
    fn from(e: Error) -> RecvError {
        match e {
            Error::Timeout(d, _) => RecvError::Timeout(d),
            Error::NothingInFlight => RecvError::NothingInFlight,
            Error::ServerGone => RecvError::ServerGone,
            e => RecvError::Failed(Box::new(e)),
        }
    }
}

impl From<Error> for BindError {
    fn from(e: Error) -> BindError {
        match e {
            Error::AddrInUse(p) => BindError::AddrInUse(p),
            Error::NotASocket(p) => BindError::NotASocket(p),
            Error::UnsafeDir { path, problem } => BindError::UnsafeDir { path, problem },
            e => BindError::Failed(Box::new(e)),
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

// Back into the crate-wide error, for callers that keep one type.
impl From<ConnectError> for Error {
    fn from(e: ConnectError) -> Error {
        match e {
            ConnectError::NoServer { path, source } => Error::NoServer { path, source },
            ConnectError::UntrustedServer { path, uid } => Error::UntrustedServer { path, uid },
            ConnectError::Refused { code, message } => Error::Refused { code, message },
            ConnectError::Timeout(d) => Error::Timeout(d, "the server's Welcome"),
            ConnectError::Failed(e) => *e,
        }
    }
}

impl From<LeaseError> for Error {
    fn from(e: LeaseError) -> Error {
        match e {
            LeaseError::Timeout(d) => Error::Timeout(d, "a free slot"),
            LeaseError::Draining => Error::Draining,
            LeaseError::ServerGone => Error::ServerGone,
            LeaseError::Failed(e) => *e,
        }
    }
}

impl From<SubmitError> for Error {
    fn from(e: SubmitError) -> Error {
        match e {
            SubmitError::InvalidTensor(w) => Error::InvalidTensor(w),
            SubmitError::DuplicateRequest(id) => Error::DuplicateRequest(id),
            SubmitError::ForeignLoan => Error::ForeignLoan,
            SubmitError::UnknownDevice(b) => Error::UnknownDevice(b),
            SubmitError::DeviceInFlight(b) => Error::DeviceInFlight(b),
            SubmitError::ServerGone => Error::ServerGone,
            SubmitError::Failed(e) => *e,
        }
    }
}

impl From<RecvError> for Error {
    fn from(e: RecvError) -> Error {
        match e {
            RecvError::Timeout(d) => Error::Timeout(d, "a result"),
            RecvError::NothingInFlight => Error::NothingInFlight,
            RecvError::ServerGone => Error::ServerGone,
            RecvError::Failed(e) => *e,
        }
    }
}

impl From<BindError> for Error {
    fn from(e: BindError) -> Error {
        match e {
            BindError::AddrInUse(p) => Error::AddrInUse(p),
            BindError::NotASocket(p) => Error::NotASocket(p),
            BindError::UnsafeDir { path, problem } => Error::UnsafeDir { path, problem },
            BindError::Failed(e) => *e,
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
    fn each_operations_error_keeps_what_a_caller_acts_on() {
        let t = Duration::from_millis(250);
        assert!(matches!(
            RecvError::from(Error::Timeout(t, "a result")),
            RecvError::Timeout(d) if d == t
        ));
        assert!(matches!(
            LeaseError::from(Error::ServerGone),
            LeaseError::ServerGone
        ));
        assert!(matches!(
            SubmitError::from(Error::DuplicateRequest(7)),
            SubmitError::DuplicateRequest(7)
        ));
        assert!(matches!(
            BindError::from(Error::AddrInUse("/s".into())),
            BindError::AddrInUse(_)
        ));
        // The rest travels whole, and back.
        let e = RecvError::from(Error::Protocol(WireError::BadMagic));
        assert!(matches!(&e, RecvError::Failed(b) if matches!(**b, Error::Protocol(_))));
        assert!(matches!(
            Error::from(e),
            Error::Protocol(WireError::BadMagic)
        ));
        assert_eq!(
            Error::from(LeaseError::Timeout(t)).to_string(),
            "timed out after 250ms waiting for a free slot"
        );
    }
}
