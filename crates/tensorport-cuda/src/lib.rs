//! tensorport's CUDA layer, on cudarc 0.19 loaded at run time (so it builds, and CI type-checks
//! it, on machines without CUDA).
//!
//! Floors, as in cudarc: [`driver`] wraps each driver call in one small function returning a
//! `Result` that names the call (all `unsafe` lives there); the types here own one resource each
//! and release it on drop.
//!
//! - [`probe`]: what the machine can do (driver, devices, compute capability, host registration,
//!   VMM with POSIX fds), or a clear [`Error::NoDriver`] where there is no usable driver.
//! - [`CudaPin`]: a [`tensorport_shm::PinHook`] that registers each producer pool with
//!   `cuMemHostRegister`, so copies from it to the device run at pinned (DMA) speed.
//! - [`CudaImporter`] and [`GpuProducer`]: the device path, over legacy CUDA IPC, with an event
//!   as the fence in each direction.
//! - [`Gatherer`]: a batch of device tensors copied into the server's memory with one batched
//!   wait, one kernel launch and one batched release; [`Gatherer::synchronize`] waits for the
//!   batch without letting a producer that never signals stall the server.
//! - [`RowBatcher`]: a batch of requests (host slots and device tensors) copied into rows of
//!   device memory its caller owns ([`DeviceMemoryMut`]), 8-bit images normalised there, waited
//!   for and settled ([`Fault`]), safely: what every GPU server builds its batches with.
//! - [`ExternalDevice`]: tensors another library allocated (PyTorch's caching allocator) handed
//!   over in place, their allocations found and registered through the driver.
//! - [`Kernel`]: CUDA C compiled with NVRTC for this GPU and launched on a stream (the
//!   kernels of this crate, and of `tensorport-cudnn`'s model).
//! - [`context_lost`]: whether a CUDA error leaves the process's context unusable (a kernel's
//!   fault, the MPS server gone), so only a new process can go on.
//! - [`bench_h2d`]: host-to-device bandwidth from a registered memfd pool, from `cuMemAllocHost`
//!   memory and from pageable memory, measured in one run.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod batcher;
mod buffer;
mod clock;
pub mod driver;
mod external;
mod gather;
mod gpu;
mod gpu_producer;
mod ipc;
mod kernel;
mod lost;
mod memory;
mod normalise;
mod pin;
mod probe;
mod rows;
mod stage;
mod stall;
mod stream;

pub use batcher::{BatchError, Fault, Filled, RowBatcher, RowKind};
pub use buffer::{DeviceBuffer, DevicePtr, PinnedBuffer};
pub use cudarc::driver::sys;
pub use driver::Driver;
pub use external::ExternalDevice;
pub use gather::Gatherer;
pub use gpu::Gpu;
pub use gpu_producer::{GpuProducer, GpuProducerConfig, Sharing};
pub use ipc::{live_imports, CudaImporter, Fence};
pub use kernel::{Kernel, Ptx};
pub use lost::context_lost;
pub use memory::{DeviceMemory, DeviceMemoryMut, DeviceRegion};
pub(crate) use normalise::GpuNormaliser;
pub use pin::{live_registrations, CudaPin};
pub use probe::{bench_h2d, probe, Capabilities, DeviceInfo, H2dBench};
pub use stage::{BatchStage, Staged};
pub use stall::{quarantine, DEFAULT_FENCE_TIMEOUT};
pub use stream::{Event, Stream};

use thiserror::Error;

/// Errors of this crate.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// libcuda cannot be loaded.
    #[error("no usable NVIDIA driver: libcuda.so could not be loaded (no GPU here, or the driver's libraries are not on LD_LIBRARY_PATH); run on a machine with an NVIDIA GPU and its driver")]
    NoDriver,
    /// A driver call failed.
    #[error("{call} failed: {message} (CUresult {code})")]
    Call {
        /// The driver function.
        call: &'static str,
        /// Its `CUresult`.
        code: i32,
        /// The driver's description.
        message: String,
    },
    /// The control connection failed.
    #[error(transparent)]
    Transport(#[from] tensorport::Error),
    /// No device with that ordinal.
    #[error("no CUDA device {0} (the machine has {1})")]
    NoDevice(i32, i32),
    /// The buffer cannot be exported as a file descriptor: it is not a VMM allocation.
    #[error("not a VMM buffer: only a DeviceBuffer::new_exportable can be exported as a file descriptor")]
    NotExportable,
    /// The host pool could not be made or pinned.
    #[error(transparent)]
    Host(#[from] tensorport_shm::ShmError),
    /// NVRTC (which compiles the GPU kernels at run time) cannot be loaded.
    #[error("{0}")]
    NoNvrtc(String),
    /// A stream of another GPU than the one the call works on.
    #[error(
        "the stream belongs to another GPU than {0}'s: pass a stream of the GPU it was made for"
    )]
    ForeignStream(&'static str),
    /// A stream still had not run its work a fence timeout after every late timeline fence
    /// of its tensors was let through: it waits on something this crate cannot signal (an
    /// event-fenced producer's, or a wait enqueued for tensors not passed in).
    #[error("the stream is still stalled {0:?} after its late timeline fences were let through: it waits on an event-fenced producer, or on tensors not passed to synchronize")]
    Stalled(std::time::Duration),
    /// The server answered something this crate cannot use (the protocol was broken).
    #[error("the server sent {0}")]
    BadAnswer(&'static str),
    /// A call's arguments do not fit what it works on (a buffer index, a byte range).
    #[error("refused: {0}")]
    Refused(&'static str),
}

// Each transport operation's error, through the transport's.
tensorport::from_operation_errors!(Error);

/// Results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
