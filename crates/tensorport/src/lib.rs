//! tensorport: zero-copy tensor hand-off between processes on one machine.
//!
//! An inference process runs a [`Server`]; producer processes connect with a [`Producer`].
//! Each producer gets its own sealed shared-memory pool (a memfd passed over the control
//! socket), leases a slot, writes a tensor into it in place, and submits it. The server sees the
//! tensor as a zero-copy view ([`Request`]), releases the slot when done with the bytes, and
//! sends a result back to the producer that asked. A closed socket is a dead peer: its pool and
//! slots are reclaimed at once.
//!
//! See `docs/architecture.md` for the data flow and `docs/protocol.md` for the wire protocol.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod client;
mod conn;
mod control;
mod device;
mod error;
mod fast;
pub mod path;
mod producer;
mod server;
#[cfg(feature = "tokio")]
pub mod stream;

pub use control::Control;

/// Locks `m`, whatever a panicking holder left: every lock in this crate guards plain
/// bookkeeping that stays usable.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
pub use device::{DeviceImporter, DeviceTensor, ImportError, ImportedDevice};
pub use error::{
    BindError, ConnectError, Error, LeaseError, RecvError, Result, Stopped, SubmitError,
};
pub use producer::{
    Completion, Loan, Producer, ProducerConfig, RemoteError, SlotLease, TensorSpec, WARM_MIN_SLOT,
    WARM_SKIP_AFTER_MISS,
};
pub use server::{protocol_version, Pace, Request, Responder, Server, ServerConfig};
pub use tensorport_shm::{HostPool, PinHook, PinRegistration};
pub use tensorport_wire::{self as wire, DType, StatusReport, TensorDesc};
