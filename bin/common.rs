//! What the subcommands share: errors, logging, the socket option, model options, result lines.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

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
        use tensorport::Error as E;
        let hint = match &e {
            E::NoServer { .. } => {
                " (`tensorport serve` starts one; --socket names the path)".to_string()
            }
            E::AddrInUse(p) => format!(
                " (`tensorport ctl --socket {} drain` stops it; --socket picks another path)",
                p.display()
            ),
            E::NotASocket(_) | E::UnsafeDir { .. } | E::UntrustedServer { .. } => {
                " (--socket picks another path)".to_string()
            }
            E::Refused {
                code: ErrorCode::MemoryBudget,
                ..
            } => " (`serve --memory-budget` sets the budget)".to_string(),
            E::Refused {
                code: ErrorCode::TooManySessions,
                ..
            } => " (`serve --max-sessions` sets how many)".to_string(),
            _ => String::new(),
        };
        CliError::new(format!("{e}{hint}"))
    }
}
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

const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// Checks a `--log` value: comma-separated directives, each a level or `target=level`. A bare
/// word that is not a level (`--log bogus`) would be a valid tracing filter that enables one
/// unknown target and hides every line; it is refused instead.
pub fn parse_log_filter(s: &str) -> Result<String, String> {
    let hint = "use off, error, warn, info, debug or trace, or directives such as \
                `warn,tensorport=debug`";
    if s.trim().is_empty() {
        return Err(format!("empty log filter; {hint}"));
    }
    for d in s.split(',').map(str::trim) {
        let level = match d.rsplit_once('=') {
            Some((target, level)) if !target.is_empty() => level,
            Some(_) => return Err(format!("'{d}' names no target; {hint}")),
            None => d,
        };
        if !LEVELS.contains(&level.to_ascii_lowercase().as_str()) {
            return Err(format!("'{level}' is not a log level; {hint}"));
        }
    }
    tracing_subscriber::EnvFilter::try_new(s).map_err(|e| format!("{e}; {hint}"))?;
    Ok(s.to_string())
}

pub fn init_logging(filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// The socket option every subcommand takes.
#[derive(clap::Args, Debug, Clone)]
pub struct SocketArg {
    /// Path of the server's Unix socket [default: $XDG_RUNTIME_DIR/tensorport/tensorport.sock,
    /// or /tmp/tensorport-<uid>/tensorport.sock].
    #[arg(long, global = true, env = "TENSORPORT_SOCKET")]
    pub socket: Option<PathBuf>,
}

impl SocketArg {
    pub fn path(&self) -> PathBuf {
        self.socket
            .clone()
            .unwrap_or_else(tensorport::path::default_socket_path)
    }
}

/// What the server runs on each batch.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// The bundled image classifier.
    Classifier,
    /// None: the batch is only moved onto the device (a transport benchmark, like PyTorch's
    /// DataLoader one).
    None,
}

/// The arithmetic of the model's convolutions on the GPU.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrecisionArg {
    /// fp32, FMA only (no TF32): the CPU model's results to about 1e-5.
    #[default]
    F32,
    /// fp32 data, TF32 tensor cores in the convolutions.
    Tf32,
    /// bfloat16 activations and weights, fp32 sums.
    Bf16,
    /// fp16 activations and weights, fp32 sums.
    F16,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl PrecisionArg {
    pub fn precision(self) -> tensorport_cuda::Precision {
        use tensorport_cuda::Precision as P;
        match self {
            PrecisionArg::F32 => P::F32,
            PrecisionArg::Tf32 => P::Tf32,
            PrecisionArg::Bf16 => P::Bf16,
            PrecisionArg::F16 => P::F16,
        }
    }
}

/// Where the model runs: `cpu`, `cuda` (GPU 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU.
    Cpu,
    /// CUDA GPU N (needs a build with `--features cuda`).
    Cuda(u32),
}

impl Device {
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// `cpu`, `cuda` or `cuda:N`, for `--device`.
pub fn parse_device(s: &str) -> Result<Device, String> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("{s:?}: say cpu, cuda (GPU 0) or cuda:N")),
    }
}

/// The name clap knows a value by, to pass an option on to a child process.
pub fn arg_name<T: clap::ValueEnum>(v: &T) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

/// The model, and how the server runs it; server and producers must agree on the image size.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// What the server runs on each batch: the bundled image classifier, or none (the batch is
    /// only moved onto the device: a transport benchmark, like PyTorch's DataLoader one).
    #[arg(long, value_enum, default_value_t = ModelKind::Classifier)]
    pub model: ModelKind,
    /// Side of the square input images, in pixels (a multiple of 8).
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    /// Number of output classes.
    #[arg(long, default_value_t = 10)]
    pub classes: usize,
    /// Channels of the model's first stage (the second has twice as many).
    #[arg(long, default_value_t = 16)]
    pub width: usize,
    /// Weights file (safetensors, PyTorch layouts; see docs/model.md). Without it, weights come
    /// from --seed.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Seed for the weights when no --weights file is given.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run the model on this device: cpu, cuda (GPU 0) or cuda:N. CUDA needs a build with
    /// `--features cuda`.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// Largest batch the model runs.
    #[arg(long, default_value_t = 32)]
    pub max_batch: usize,
    /// How long a batch waits for more requests after its first, in milliseconds.
    #[arg(long, default_value_t = 5)]
    pub max_wait_ms: u64,
    /// Arithmetic of the model's convolutions on the GPU (cuDNN): f32 (no TF32), tf32, bf16 or
    /// f16; the 16-bit ones keep fp32 sums, biases and scores. The CPU model is always f32.
    /// [default: f32; model-bench: every one]
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
}

/// What producers hand over per image.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PixelsArg {
    /// Normalised `f32` planes, ready for the model.
    #[default]
    F32,
    /// 8-bit planes (a quarter of the bytes in the pool and over PCIe); the server normalises
    /// them, on the GPU in the CUDA build, to the same floats bit for bit.
    U8,
}

impl PixelsArg {
    pub fn dtype(self) -> tensorport::DType {
        match self {
            PixelsArg::F32 => tensorport::DType::F32,
            PixelsArg::U8 => tensorport::DType::U8,
        }
    }

    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            PixelsArg::F32 => 4,
            PixelsArg::U8 => 1,
        }
    }

    /// A view of `slot` to prepare an image into.
    pub fn planes(self, slot: &mut [u8]) -> CliResult<tensorport_vision::Planes<'_>> {
        Ok(match self {
            PixelsArg::U8 => tensorport_vision::Planes::U8(slot),
            PixelsArg::F32 => tensorport_vision::Planes::F32(
                bytemuck::try_cast_slice_mut(slot)
                    .map_err(|e| CliError::new(format!("slot is not f32-aligned: {e}")))?,
            ),
        })
    }
}

impl ModelArgs {
    pub fn config(&self) -> tensorport_dfdx::ModelConfig {
        tensorport_dfdx::ModelConfig {
            image_size: self.image_size,
            classes: self.classes,
            width: self.width,
        }
    }

    /// Refuses options that contradict each other.
    pub fn check(&self) -> CliResult<()> {
        self.config().check()?;
        if let Some(p) = self.precision.filter(|&p| p != PrecisionArg::F32) {
            if !self.device.is_cuda() {
                return Err(CliError::usage(format!(
                    "--precision {}: reduced precision is for the GPU model; add --device cuda, \
                     or leave --precision out",
                    arg_name(&p)
                )));
            }
        }
        Ok(())
    }

    /// The bundled model on dfdx's kernels: from `--weights`, or from `--seed`.
    pub fn dfdx_model<D: tensorport_dfdx::dfdx::prelude::Device<f32>>(
        &self,
        dev: &D,
    ) -> CliResult<tensorport_dfdx::ImageClassifier<D>> {
        use tensorport_dfdx::ImageClassifier;
        Ok(match &self.weights {
            Some(p) => ImageClassifier::load(dev, self.config(), p)?,
            None => ImageClassifier::from_seed(dev, self.config(), self.seed)?,
        })
    }

    /// The bundled model on cuDNN at `how` (precision, layout): from `--weights`, or `--seed`.
    #[cfg(feature = "cuda")]
    pub fn cudnn_model(
        &self,
        dev: &tensorport_dfdx::dfdx::prelude::Cuda,
        gpu: &std::sync::Arc<tensorport_cuda::Gpu>,
        how: (tensorport_cuda::Precision, tensorport_cuda::Layout),
    ) -> CliResult<tensorport_dfdx::CudnnClassifier> {
        use tensorport_dfdx::CudnnClassifier;
        Ok(match &self.weights {
            Some(p) => CudnnClassifier::load(dev, gpu, self.config(), p, how)?,
            None => CudnnClassifier::from_seed(dev, gpu, self.config(), self.seed, how)?,
        })
    }

    /// The same options as command-line arguments, to pass to a child process.
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec![
            "--model".into(),
            arg_name(&self.model),
            "--image-size".into(),
            self.image_size.to_string(),
            "--classes".into(),
            self.classes.to_string(),
            "--width".into(),
            self.width.to_string(),
            "--seed".into(),
            self.seed.to_string(),
            "--device".into(),
            self.device.to_string(),
            "--max-batch".into(),
            self.max_batch.to_string(),
            "--max-wait-ms".into(),
            self.max_wait_ms.to_string(),
        ];
        if let Some(p) = &self.precision {
            v.push("--precision".into());
            v.push(arg_name(p));
        }
        if let Some(w) = &self.weights {
            v.push("--weights".into());
            v.push(w.display().to_string());
        }
        v
    }
}

/// One line of a producer's output: the answer for one input.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ResultLine {
    /// Position of the input in the input list.
    pub index: u64,
    /// The file, or `synthetic:N`.
    pub input: String,
    /// Index of the highest score (absent on error).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub class: Option<usize>,
    /// Class scores (logits), exactly as the model computed them.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub scores: Option<Vec<f32>>,
    /// What went wrong for this input, if anything.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
    /// From lease to result, in milliseconds.
    pub latency_ms: f64,
    /// Which producer did it.
    pub producer: String,
    /// Where the time went, with `--profile`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub stages: Option<StageTimes>,
}

/// One input's time in each step, in milliseconds (`produce --profile`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct StageTimes {
    /// Reading the file (on the producer's reader thread, overlapping the rest).
    pub read_ms: f64,
    /// Decoding to RGB.
    pub decode_ms: f64,
    /// Resizing and cropping.
    pub resize_ms: f64,
    /// Normalising into the slot.
    pub normalise_ms: f64,
    /// Waiting for a free slot.
    pub lease_ms: f64,
    /// Handing the slot over (`submit`).
    pub submit_ms: f64,
    /// From submit to the result: the server's queue, batch wait, model, and the answer.
    pub result_ms: f64,
}

impl std::ops::AddAssign for StageTimes {
    fn add_assign(&mut self, o: StageTimes) {
        self.read_ms += o.read_ms;
        self.decode_ms += o.decode_ms;
        self.resize_ms += o.resize_ms;
        self.normalise_ms += o.normalise_ms;
        self.lease_ms += o.lease_ms;
        self.submit_ms += o.submit_ms;
        self.result_ms += o.result_ms;
    }
}

/// The preprocessing a producer applies (`--transform`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransformArg {
    /// Resize the shorter side to size/0.875 (256 for 224), antialiased; centre-crop size×size
    /// (torchvision's standard evaluation transform).
    #[default]
    Standard,
    /// Resize the whole image to size×size, whatever its aspect ratio.
    Square,
}

impl TransformArg {
    pub fn for_size(self, size: u32) -> tensorport_vision::Transform {
        match self {
            TransformArg::Standard => tensorport_vision::Transform::standard(size),
            TransformArg::Square => tensorport_vision::Transform::Square { size },
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TransformArg::Standard => "standard",
            TransformArg::Square => "square",
        }
    }
}

/// The CPU's JPEG decoder (`--jpeg-decoder`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum JpegDecoderArg {
    /// libjpeg-turbo, linked in at build time where its development files were found: decodes
    /// only the part of the image the transform keeps. The default where built in.
    LibjpegTurbo,
    /// zune-jpeg (pure Rust): decodes the whole image.
    ZuneJpeg,
}

impl Default for JpegDecoderArg {
    fn default() -> JpegDecoderArg {
        match tensorport_vision::JpegDecoder::default() {
            tensorport_vision::JpegDecoder::LibjpegTurbo => JpegDecoderArg::LibjpegTurbo,
            tensorport_vision::JpegDecoder::ZuneJpeg => JpegDecoderArg::ZuneJpeg,
        }
    }
}

impl JpegDecoderArg {
    pub fn decoder(self) -> tensorport_vision::JpegDecoder {
        match self {
            JpegDecoderArg::LibjpegTurbo => tensorport_vision::JpegDecoder::LibjpegTurbo,
            JpegDecoderArg::ZuneJpeg => tensorport_vision::JpegDecoder::ZuneJpeg,
        }
    }

    /// A preprocessor for `transform` decoding with this decoder (an error naming what to do if
    /// it was not built in).
    pub fn preprocessor(
        self,
        transform: tensorport_vision::Transform,
        max_pixels: u64,
        dct_scaling: bool,
    ) -> CliResult<tensorport_vision::Preprocessor> {
        let mut p = tensorport_vision::Preprocessor::new(transform);
        p.set_max_pixels(max_pixels);
        p.set_dct_scaling(dct_scaling);
        p.set_jpeg_decoder(self.decoder())
            .map_err(|e| CliError::usage(format!("--jpeg-decoder: {e}")))?;
        Ok(p)
    }
}

/// An option that is on or off.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    /// On.
    On,
    /// Off.
    Off,
}

impl Switch {
    pub fn on(self) -> bool {
        self == Switch::On
    }
}

/// Pixels from `--max-megapixels`.
pub fn pixels_of(megapixels: f64) -> u64 {
    (megapixels.max(0.0) * 1e6) as u64
}

/// Index of the largest score.
pub fn argmax(v: &[f32]) -> Option<usize> {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
}

/// Installs SIGINT/SIGTERM handlers: the first sets the returned flag (drain), a second one
/// exits the process at once with status 130.
pub fn stop_flag() -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use signal_hook::flag;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM] {
        // Registered first, so it sees the flag as it was before this signal.
        let r = flag::register_conditional_shutdown(sig, 130, stop.clone())
            .and_then(|_| flag::register(sig, stop.clone()));
        if let Err(e) = r {
            tracing::warn!("cannot install a handler for signal {sig}: {e}");
        }
    }
    stop
}

/// A write past the file size limit (`ulimit -f`; memfd pools count) raises SIGXFSZ, whose
/// default action kills the process: catch it, so the call fails with EFBIG and the caller can
/// refuse or report it.
pub fn catch_sigxfsz() {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Err(e) = signal_hook::flag::register(signal_hook::consts::SIGXFSZ, flag) {
        tracing::warn!("cannot catch SIGXFSZ: {e}");
    }
}

/// When started by a farm (`TENSORPORT_FARM_PID` set), ask the kernel to send us SIGTERM if the
/// farm dies, so no producer or server outlives it.
pub fn die_with_farm() {
    let Some(pid) = std::env::var("TENSORPORT_FARM_PID")
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM) {
        tracing::warn!("cannot set the parent-death signal: {e}");
    }
    // The farm may have died before the line above took effect.
    if nix::unistd::getppid().as_raw() != pid {
        std::process::exit(1);
    }
}

/// A size in bytes: a number, optionally with K, M, G or T (powers of 1024; `KiB`, `MB`, `g`
/// all read alike).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size; give bytes, or a number with K, M, G or T"))?;
    let shift = match unit
        .trim()
        .to_ascii_lowercase()
        .trim_end_matches(['b', 'i'])
    {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(format!("'{s}': unknown unit '{unit}'; use K, M, G or T")),
    };
    let bytes = n * (1u64 << shift) as f64;
    if !(bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!("'{s}' is not a positive size"));
    }
    Ok(bytes as u64)
}

/// `n` and the noun, singular or plural: "1 restart", "3 restarts".
pub fn plural(n: impl Into<u64>, noun: &str) -> String {
    let n = n.into();
    if n == 1 {
        format!("{n} {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_filters_are_levels_or_target_directives() {
        for ok in [
            "info",
            "WARN",
            "off",
            "warn,tensorport=debug",
            "tensorport::server=trace",
        ] {
            assert_eq!(parse_log_filter(ok).as_deref(), Ok(ok), "{ok}");
        }
        for bad in ["bogus", "", "warn,loud", "=debug", "tensorport=loud"] {
            let e = parse_log_filter(bad).unwrap_err();
            assert!(e.contains("use off, error, warn"), "{bad}: {e}");
        }
    }

    #[test]
    fn sizes_take_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("64 KB"), Ok(64 << 10));
        for bad in ["", "lots", "0", "5X", "-3G"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn plural_says_one_restart() {
        assert_eq!(plural(1u32, "restart"), "1 restart");
        assert_eq!(plural(0u32, "restart"), "0 restarts");
        assert_eq!(plural(9u64, "restart"), "9 restarts");
    }
}
