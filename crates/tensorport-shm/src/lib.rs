//! Host pools for tensorport: one sealed memfd per producer session, mapped by both sides.
//!
//! The model:
//! - The **server** creates a [`HostPool`] with [`HostPool::create`]: an anonymous `memfd`, sized,
//!   backed up front with `fallocate` (so a full tmpfs is an error now, not a `SIGBUS` later),
//!   sealed against shrinking, growing and further sealing, and mapped read-write.
//! - The pool's fd travels to the **producer** over the control socket; it maps it with
//!   [`HostPool::open`], which checks the seals and the size before mapping. Because the pool is
//!   sealed, neither side can truncate it under the other: no `SIGBUS` from a short file.
//! - The pool lives exactly as long as its fds and mappings: no name in `/dev/shm`, nothing left
//!   behind by a `SIGKILL`, nothing for systemd's `RemoveIPC` to reap.
//! - Slot bookkeeping ([`SlotTable`]) lives in the server's private memory, never in the shared
//!   mapping: a producer can scribble on its own pool's bytes, never on the server's state.
//!
//! `unsafe` is confined to the `map` module, which owns the one mapping call and the raw views.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod map;
mod pool;
pub mod ring;
mod slots;

pub use map::{Mapping, Prefetch};
pub use pool::{page_size, HostPool, PinHook, PinRegistration, REQUIRED_SEALS};
pub use ring::{RingError, RingMem};
pub use slots::{SlotError, SlotState, SlotTable};

use thiserror::Error;

/// Errors of this crate. Each names the call that failed and what to do where it can.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ShmError {
    /// A system call failed.
    #[error("{call} failed: {source}")]
    Sys {
        /// The call, e.g. `memfd_create`.
        call: &'static str,
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// The memory for the pool could not be set aside (tmpfs or memory limit).
    #[error("cannot reserve {bytes} bytes of shared memory ({source}); lower the slot size or count, or raise the memory limit")]
    NoSpace {
        /// Bytes asked for.
        bytes: u64,
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// The pool is larger than this process may make a file (`RLIMIT_FSIZE`, `ulimit -f`).
    #[error("cannot create a pool of {bytes} bytes: it is over this process's file size limit (ulimit -f); raise the limit (ulimit -f unlimited) or use fewer or smaller slots")]
    FileSizeLimit {
        /// Bytes asked for.
        bytes: u64,
    },
    /// The pool received from a peer is not sealed as required.
    #[error("pool fd is missing seals (has {have:#x}, needs {need:#x}); refusing to map memory the peer could truncate")]
    NotSealed {
        /// Seals present.
        have: i32,
        /// Seals required.
        need: i32,
    },
    /// The pool received from a peer is smaller than its announced layout.
    #[error("pool fd holds {actual} bytes but the layout needs {expected}")]
    TooSmall {
        /// Bytes in the file.
        actual: u64,
        /// Bytes the layout needs.
        expected: u64,
    },
    /// A layout that cannot be built (zero, overflow, unaligned).
    #[error("bad pool layout: {0}")]
    BadLayout(String),
    /// The pinning hook refused the pool.
    #[error("pinning the pool failed: {0}")]
    Pin(String),
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, ShmError>;

pub(crate) fn sys(call: &'static str) -> impl FnOnce(nix::Error) -> ShmError {
    move |source| ShmError::Sys { call, source }
}
