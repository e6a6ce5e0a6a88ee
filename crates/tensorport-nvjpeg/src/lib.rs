//! JPEG batches decoded and prepared on the GPU: [`GpuJpeg`] decodes a batch with nvJPEG (the
//! GPU's hardware JPEG engines where it has them) and one kernel resizes, crops and normalises
//! every image into its own device buffer, the geometry being `tensorport_vision`'s (the CPU
//! path's windows); [`GpuJpeg::decode_into`] writes a GPU producer's buffers. On
//! `tensorport-cuda`'s GPU, streams, buffers and `Kernel`; nvJPEG is loaded at run time, like
//! libcuda, so this builds (and CI type-checks it) on machines without CUDA.
//!
//! [`nvjpeg`] is the floor: the library found and loaded, one small function per call (all of
//! nvJPEG's FFI); `jpeg` builds the safe decoder on it.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod balance;
mod batched;
mod hybrid;
mod jpeg;
pub mod nvjpeg;
mod route;

pub use jpeg::{GpuJpeg, JpegBackend, JpegJob, JpegRefused, JpegTimes, ProducerJpeg, Upsampling};
pub use route::{chroma_of, Decoders, GpuDecode, Route};

use thiserror::Error;

/// Errors of this crate.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// The GPU under the decoder failed (or has no usable driver, or NVRTC is missing).
    #[error(transparent)]
    Cuda(#[from] tensorport_cuda::Error),
    /// nvJPEG cannot be loaded.
    #[error("{0}")]
    NoNvjpeg(String),
    /// An nvJPEG call failed.
    #[error("{call} failed: {message} (nvjpegStatus_t {code})")]
    Call {
        /// The nvJPEG function.
        call: &'static str,
        /// Its status.
        code: i32,
        /// What the status means.
        message: String,
    },
    /// A call's arguments do not fit what it works on (a buffer, a batch of mixed sizes).
    #[error("refused: {0}")]
    Refused(&'static str),
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
