//! What can go wrong, per kind of cause, so a caller can act on it: configuration that cannot
//! work (fix it and run again), a library's error (transport, model, images, GPU), or a run that
//! failed part way. Messages speak of the configuration's fields, not of any command line's flags;
//! a front end adds which of its options helps.

use std::path::PathBuf;

/// Configuration that cannot work: nothing was started, and retrying the same will fail the
/// same way.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The image side is zero.
    #[error("the image size must be positive")]
    ImageSize,
    /// The largest batch is zero or over [`crate::MAX_BATCH`].
    #[error("the largest batch must be 1 to {}", crate::MAX_BATCH)]
    MaxBatch,
    /// A reduced precision was asked of a model on the CPU.
    #[error("precision {0}: reduced precision is for the GPU model")]
    PrecisionNeedsGpu(tensorport_cudnn::Precision),
    /// A reduced precision was asked where cuDNN cannot be loaded.
    #[error("precision {0}: {1}")]
    PrecisionNeedsCudnn(tensorport_cudnn::Precision, tensorport_cudnn::Error),
    /// A configuration document (`--config-data`) that is not one.
    #[error("not a configuration document: {0}")]
    Data(String),
    /// A model of the caller's own (`serve::run_with`) was given a GPU.
    #[error(
        "a model of your own runs on the CPU (serve::run_with): set the model's device to the CPU"
    )]
    OwnModelOnCpu,
    /// A GPU device was asked of a build without CUDA.
    #[error("this tensorport was built without CUDA")]
    NoCudaBuild,
    /// A GPU producer's requests in flight or its batch out of range.
    #[error(
        "a GPU producer keeps 1 to {} requests in flight and decodes 1 to that many per batch",
        tensorport::wire::MAX_DEVICE_BUFFERS
    )]
    GpuInFlight,
    /// A farm without producers.
    #[error("a farm needs at least one producer")]
    NoProducers,
    /// GPU producers with servers on the CPU.
    #[error("GPU producers hand over device memory: the servers must run on a GPU")]
    GpuProducersNeedGpu,
    /// The weights file does not exist.
    #[error("weights file {0} does not exist")]
    WeightsMissing(PathBuf),
    /// A producer was given nothing to classify.
    #[error("nothing to classify: give a folder, a number of synthetic images, or a worklist")]
    NoInputs,
    /// The output file cannot be created.
    #[error("cannot create {path}: {source}")]
    Output {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The chosen JPEG decoder is not built in.
    #[error("JPEG decoder: {0}")]
    JpegDecoder(tensorport_vision::Error),
    /// The server's slots are smaller than one image.
    #[error("the server gives slots of {given} bytes, an image of {size}×{size} needs {needed}")]
    SlotTooSmall {
        given: u64,
        needed: u64,
        size: usize,
    },
    /// The thread pool cannot be sized.
    #[error("cannot size the thread pool: {0}")]
    Threads(String),
    /// The metrics endpoint cannot listen at the address.
    #[error("metrics address {addr}: {why}")]
    Metrics { addr: String, why: String },
    /// The GPU cannot be used: no driver, or no such device.
    #[error("{0}")]
    NoGpu(tensorport_cuda::Error),
    /// The model's options are inconsistent, or its weights unreadable.
    #[error("{0}")]
    Model(tensorport_dfdx::Error),
    /// An ONNX model that cannot be run: no ONNX Runtime, or a file the server cannot take.
    #[error("{0}")]
    Onnx(#[from] tensorport_onnx::Error),
    /// MPS was required and cannot be had (no control program, a compute mode that refuses
    /// it, a daemon that will not start).
    #[error("MPS cannot be had: {0}")]
    Mps(String),
    /// A duration or count outside its bounds ([`crate::config::bounds`]).
    #[error("{field} {value} is out of range: give {range}")]
    OutOfRange {
        field: &'static str,
        value: String,
        range: String,
    },
    /// The largest batch is more than the model's engine runs.
    #[error("the largest batch is {asked}; this model's engine runs batches of up to {most}: give a largest batch it runs")]
    EngineBatch { asked: usize, most: usize },
    /// A weights file given with an ONNX model (whose weights are in the file).
    #[error("an ONNX model carries its own weights: give no weights file with it")]
    WeightsForOnnx,
}

/// The application layer's error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Configuration that cannot work (see [`ConfigError`]).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The input folder cannot be listed, or holds no images.
    #[error("{0}")]
    Inputs(tensorport_vision::Error),
    /// The transport (socket, shared memory, the server) failed.
    #[error(transparent)]
    Transport(#[from] tensorport::Error),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] tensorport_dfdx::Error),
    /// An image could not be prepared.
    #[error(transparent)]
    Vision(#[from] tensorport_vision::Error),
    /// The GPU failed.
    #[error(transparent)]
    Cuda(#[from] tensorport_cuda::Error),
    /// The GPU's JPEG pipeline (nvJPEG) failed, or cannot be loaded.
    #[error(transparent)]
    Jpeg(#[from] tensorport_nvjpeg::Error),
    /// A read or write failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The server returned no result within the producer's timeout.
    #[error("no result from the server within {0}s")]
    NoResult(u64),
    /// A farm's server exited before it listened, in a way a restart cannot fix.
    #[error("the {name} cannot start ({status}): {said}")]
    ServerCannotStart {
        name: String,
        status: String,
        said: String,
    },
    /// A farm's server kept dying without a result in between.
    #[error(
        "the {name} failed {times} times in a row without a result ({status}); see its messages above"
    )]
    ServerKeepsFailing {
        name: String,
        times: u32,
        status: String,
    },
    /// Every producer of a farm failed too often in a row.
    #[error("every producer failed repeatedly; see their messages above")]
    ProducersKeepFailing,
    /// A child process could not be started.
    #[error("cannot start {name}: {source}")]
    Spawn {
        name: String,
        source: std::io::Error,
    },
    /// The results file could not be written (it keeps its whole lines).
    #[error("{0}")]
    Results(String),
    /// Anything else, in words.
    #[error("{0}")]
    Other(String),
}

// Each transport operation's error, through the transport's.
tensorport::from_operation_errors!(Error);

impl Error {
    /// Whether the same run would fail the same way again: configuration, inputs, a model
    /// that cannot load, an image the options cannot prepare, a server that cannot start. Front
    /// ends exit with a usage status for these (the farm reads a server's exit status 2 this
    /// way).
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            Error::Config(_)
                | Error::Inputs(_)
                | Error::Model(_)
                | Error::Vision(_)
                | Error::ServerCannotStart { .. }
        )
    }
}

impl From<tensorport_dfdx::Error> for ConfigError {
    fn from(e: tensorport_dfdx::Error) -> ConfigError {
        ConfigError::Model(e)
    }
}

/// The application layer's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
