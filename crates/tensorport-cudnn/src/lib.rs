//! The bundled model's GPU path: [`ConvNet`], a chain of convolutions (bias, residual, ReLU) and
//! a global average on cuDNN in fp32, TF32, bf16 or fp16 ([`Precision`]), each layer's
//! convolution chosen by timing ([`Layout`] NCHW or NHWC), on `tensorport-cuda`'s GPU, streams,
//! buffers and kernels. cuDNN is loaded at run time, like libcuda, so this builds (and CI
//! type-checks it) on machines without CUDA.
//!
//! Every `unsafe` call into cuDNN lives in `cudnn` (the legacy API: handles, descriptors,
//! algorithms) and `cudnn_graph` (the backend API's fused convolution graphs); RAII types
//! release what they create.
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod convnet;
mod cudnn;
mod cudnn_graph;

pub use convnet::{ConvLayer, ConvNet, Layout, Precision};

use thiserror::Error;

/// Errors of this crate.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// The GPU under the model failed (or has no usable driver).
    #[error(transparent)]
    Cuda(#[from] tensorport_cuda::Error),
    /// cuDNN cannot be loaded.
    #[error("{0}")]
    NoCudnn(String),
    /// A cuDNN call failed, or a network it was asked to run is malformed.
    #[error("{call}: {status}")]
    Cudnn {
        /// The cuDNN function (or the operation).
        call: &'static str,
        /// Its status, or what is wrong.
        status: String,
    },
    /// A batch or tensor larger than one kernel launch covers.
    #[error("{0}")]
    TooLarge(&'static str),
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
