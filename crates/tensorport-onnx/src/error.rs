//! What can go wrong with an ONNX model, by what the caller can do about it.

use std::path::PathBuf;

use crate::runtime::MIN_VERSION;

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No ONNX Runtime library could be loaded: get one, or point at one.
    #[error(
        "ONNX Runtime is needed for ONNX models and was not found ({why}); run \
         scripts/fetch-onnxruntime.sh (add --gpu for CUDA), or set TENSORPORT_ORT to a \
         libonnxruntime.so ({MIN_VERSION} or newer)"
    )]
    NoRuntime { why: String },
    /// The model file cannot be read.
    #[error("{path}: {source}")]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The ONNX Runtime library found is older than the oldest this runs with.
    #[error(
        "{path}: ONNX Runtime {version} is older than {MIN_VERSION}, the oldest tensorport runs \
         models with; run scripts/fetch-onnxruntime.sh (add --gpu for CUDA), or set \
         TENSORPORT_ORT to a libonnxruntime.so of {MIN_VERSION} or newer"
    )]
    OldRuntime { path: PathBuf, version: String },
    /// The model, with its external data, is larger than any model this takes.
    #[error(
        "{path}: {size} bytes with its external data, over the limit of {limit} (protobuf's \
         limit for one model)"
    )]
    TooLarge {
        path: PathBuf,
        size: u64,
        limit: u64,
    },
    /// The file is not well-formed protobuf, so not an ONNX model.
    #[error("{path}: cannot load it: not a well-formed ONNX model ({why})")]
    Malformed { path: PathBuf, why: String },
    /// A tensor's external data is refused: a file outside the model's folder, not a regular
    /// file, missing, or too short.
    #[error("{path}: tensor {tensor:?}: {why}")]
    ExternalData {
        path: PathBuf,
        tensor: String,
        why: String,
    },
    /// ONNX Runtime could not load the file (corrupt, truncated, not ONNX, an operator it lacks).
    #[error("{path}: ONNX Runtime cannot load it: {why}")]
    Invalid { path: PathBuf, why: String },
    /// The graph does not fit the server: its input or output is not what a batch of images
    /// needs.
    #[error("{path}: {why}")]
    Unfit { path: PathBuf, why: String },
    /// An execution provider could not be set up (its libraries missing, say).
    #[error("ONNX Runtime's {provider} execution provider: {why}")]
    Provider { provider: &'static str, why: String },
    /// A batch does not match the model (a bug of the caller's).
    #[error("a batch of {got} floats is not {rows} images of {per} floats each")]
    BatchSize { got: usize, rows: usize, per: usize },
    /// ONNX Runtime failed while running a batch.
    #[error("ONNX Runtime failed on a batch: {0}")]
    Run(String),
}

/// This crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;
