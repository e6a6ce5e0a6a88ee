//! The command line's errors: each library error with the options that help, and the exit code
//! it gets (2 for a usage mistake).

/// A command's failure: a message for the user and an exit code.
#[derive(Debug)]
pub struct CliError {
    pub message: String,
    pub code: u8,
}

impl CliError {
    /// Exit code 1: the command failed.
    pub fn new(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            code: 1,
        }
    }
    /// Exit code 2: usage or input errors.
    pub fn usage(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            code: 2,
        }
    }
    pub fn exit_code(&self) -> u8 {
        self.code
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The libraries' errors say what is wrong in their own terms; the command line adds which of
/// its options or commands helps.
impl From<tensorport::Error> for CliError {
    fn from(e: tensorport::Error) -> CliError {
        use tensorport::wire::ErrorCode;
        use tensorport::{BindError as B, ConnectError as C, Error as E};
        let refused = match &e {
            E::Refused { code, .. } | E::Connect(C::Refused { code, .. }) => Some(*code),
            _ => None,
        };
        let hint = match (&e, refused) {
            (E::Connect(C::NoServer { .. }), _) => {
                " (`tensorport serve` starts one; --socket names the path)".to_string()
            }
            (E::Bind(B::AddrInUse(p)), _) => format!(
                " (`tensorport ctl --socket {} drain` stops it; --socket picks another path)",
                p.display()
            ),
            (E::Bind(B::NotASocket(_) | B::UnsafeDir { .. }), _)
            | (E::Connect(C::UntrustedServer { .. }), _) => {
                " (--socket picks another path)".to_string()
            }
            (_, Some(ErrorCode::MemoryBudget)) => {
                " (`serve --memory-budget` sets the budget)".to_string()
            }
            (_, Some(ErrorCode::TooManySessions)) => {
                " (`serve --max-sessions` sets how many)".to_string()
            }
            _ => String::new(),
        };
        CliError::new(format!("{e}{hint}"))
    }
}
// Each transport operation's error, through the transport's.
tensorport::from_operation_errors!(CliError);

impl From<tensorport_dfdx::Error> for CliError {
    fn from(e: tensorport_dfdx::Error) -> CliError {
        let hint = match &e {
            tensorport_dfdx::Error::Weights { .. } => {
                " (--weights FILE, or leave it out for --seed's weights)"
            }
            _ => "",
        };
        CliError::usage(format!("{e}{hint}"))
    }
}
impl From<tensorport_vision::Error> for CliError {
    fn from(e: tensorport_vision::Error) -> CliError {
        CliError::usage(e.to_string())
    }
}
impl From<tensorport_cuda::Error> for CliError {
    fn from(e: tensorport_cuda::Error) -> CliError {
        CliError::new(e.to_string())
    }
}
impl From<tensorport_nvjpeg::Error> for CliError {
    fn from(e: tensorport_nvjpeg::Error) -> CliError {
        CliError::new(e.to_string())
    }
}
impl From<tensorport_cudnn::Error> for CliError {
    fn from(e: tensorport_cudnn::Error) -> CliError {
        CliError::new(e.to_string())
    }
}

/// The application layer's errors, with the options that help.
impl From<tensorport_farm::Error> for CliError {
    fn from(e: tensorport_farm::Error) -> CliError {
        use tensorport_farm::{ConfigError as C, Error as E};
        let usage = e.is_config();
        let message = match e {
            E::Transport(e) => return e.into(),
            E::Model(e) | E::Config(C::Model(e)) => return e.into(),
            E::Inputs(e) => format!("{e} (or --synthetic N for made-up images)"),
            E::Config(c) => match c {
                C::ImageSize => "--image-size must be positive".into(),
                C::MaxBatch => format!(
                    "--max-batch must be 1 to {} images",
                    tensorport_farm::MAX_BATCH
                ),
                C::GpuInFlight => format!(
                    "--gpu-in-flight must be 1 to {}, and --gpu-batch 1 to --gpu-in-flight",
                    tensorport::wire::MAX_DEVICE_BUFFERS
                ),
                C::PrecisionNeedsGpu(p) => format!(
                    "--precision {p}: reduced precision is for the GPU model; add --device cuda, \
                     or leave --precision out"
                ),
                C::PrecisionNeedsCudnn(p, e) => format!("--precision {p}: {e}"),
                C::NoCudaBuild => "--device cuda: this tensorport was built without CUDA; rebuild \
                     with `--features cuda` (see docs/operations.md), or use --device cpu"
                    .into(),
                C::NoProducers => "--producers must be at least 1 (or give --gpu-producers)".into(),
                C::GpuProducersNeedGpu => "--gpu-producers hand over device memory: run the \
                     servers on a GPU (--device cuda or --devices 0,1,...)"
                    .into(),
                C::WeightsMissing(w) => format!(
                    "weights file {} does not exist; write one with `tensorport weights --out \
                     FILE`, or leave --weights out to use --seed",
                    w.display()
                ),
                C::NoInputs => {
                    "say what to classify: --input DIR, --synthetic N, or --worklist".into()
                }
                C::JpegDecoder(e) => format!("--jpeg-decoder: {e}"),
                C::SlotTooSmall {
                    given,
                    needed,
                    size,
                } => format!(
                    "the server gives slots of {given} bytes, an image of {size}×{size} needs \
                     {needed}; start the server with a larger --slot-size"
                ),
                C::Metrics { addr, why } => format!("--metrics {addr}: {why}"),
                C::NoGpu(e) => format!("{e}, or use --device cpu"),
                c => c.to_string(),
            },
            e => e.to_string(),
        };
        if usage {
            CliError::usage(message)
        } else {
            CliError::new(message)
        }
    }
}

/// The images in `--input DIR`, for commands that also take `--synthetic N`.
pub fn list_inputs(dir: &std::path::Path) -> CliResult<Vec<std::path::PathBuf>> {
    tensorport_vision::list_images(dir)
        .map_err(|e| CliError::usage(format!("{e} (or --synthetic N for made-up images)")))
}
impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> CliError {
        CliError::new(e.to_string())
    }
}

pub type CliResult<T> = Result<T, CliError>;
