//! What the subcommands share: logging, the socket option, the model's and the preparation's
//! options, the parsers of their values; the errors (`crate::error`) re-exported.

use std::path::PathBuf;

use tensorport_cudnn::Precision;
pub use tensorport_farm::config::{Device, ModelKind, OrtProvider, Pixels, TransformKind};
use tensorport_farm::{ModelOptions, PrepOptions};
use tensorport_vision::JpegDecoder;

pub use crate::error::{list_inputs, CliError, CliResult};

const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// Checks a `--log` value: comma-separated directives, each a level or `target=level`. A bare
/// word that is not a level (`--log bogus`) would be a valid tracing filter that enables one
/// unknown target and hides every line; it is refused instead.
/// A duration in seconds: a finite number from 0.001 to a day.
pub fn parse_seconds(s: &str) -> Result<f64, String> {
    tensorport_farm::config::bounds::seconds(s, std::time::Duration::from_millis(1))
        .map(|d| d.as_secs_f64())
}

/// As [`parse_seconds`], zero allowed.
pub fn parse_seconds_or_zero(s: &str) -> Result<f64, String> {
    tensorport_farm::config::bounds::seconds(s, std::time::Duration::ZERO).map(|d| d.as_secs_f64())
}

/// The longest duration a flag takes, in the unit a flag counts in.
pub const MAX_SECS: u64 = tensorport_farm::config::bounds::MAX_DURATION.as_secs();
/// [`MAX_SECS`] in milliseconds.
pub const MAX_MS: u64 = MAX_SECS * 1000;
/// The longest spin, in microseconds.
pub const MAX_SPIN_US: u64 = tensorport_farm::config::bounds::MAX_SPIN.as_micros() as u64;

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

/// `cpu`, `cuda` or `cuda:N`, for `--device`.
pub fn parse_device(s: &str) -> Result<Device, String> {
    s.parse()
}

/// `f32`, `tf32`, `bf16` or `f16`, for `--precision`.
pub fn parse_precision(s: &str) -> Result<Precision, String> {
    Precision::from_name(&s.to_ascii_lowercase()).ok_or_else(|| {
        let names: Vec<&str> = Precision::ALL.iter().map(|p| p.name()).collect();
        format!("{s:?}: say {}", names.join(", "))
    })
}

/// `libjpeg-turbo` or `zune-jpeg`, for `--jpeg-decoder`.
pub fn parse_jpeg_decoder(s: &str) -> Result<JpegDecoder, String> {
    [JpegDecoder::LibjpegTurbo, JpegDecoder::ZuneJpeg]
        .into_iter()
        .find(|d| d.name() == s)
        .ok_or_else(|| format!("{s:?}: say libjpeg-turbo or zune-jpeg"))
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
    /// What the server runs on each batch: `classifier` (the bundled image classifier), an ONNX
    /// file (`PATH.onnx`, run by ONNX Runtime: its input [N, 3, S, S] sets the image size, its
    /// first output [N, K] gives each image's scores; needs the library:
    /// scripts/fetch-onnxruntime.sh, or TENSORPORT_ORT), or `none` (the batch is only moved
    /// onto the device: a transport benchmark, like PyTorch's DataLoader one).
    #[arg(
        long,
        default_value_t = ModelOptions::default().kind,
        value_name = "classifier|none|PATH.onnx"
    )]
    pub model: ModelKind,
    /// Side of the square input images, in pixels (a multiple of 8).
    #[arg(long, default_value_t = tensorport_dfdx::ModelConfig::default().image_size)]
    pub image_size: usize,
    /// Number of output classes.
    #[arg(long, default_value_t = tensorport_dfdx::ModelConfig::default().classes)]
    pub classes: usize,
    /// Channels of the model's first stage (the second has twice as many).
    #[arg(long, default_value_t = tensorport_dfdx::ModelConfig::default().width)]
    pub width: usize,
    /// Weights file (safetensors, PyTorch layouts; see docs/model.md). Without it, weights come
    /// from --seed.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Seed for the weights when no --weights file is given.
    #[arg(long, default_value_t = ModelOptions::default().seed)]
    pub seed: u64,
    /// Run the model on this device: cpu, cuda (GPU 0) or cuda:N. CUDA needs a build with
    /// `--features cuda`.
    #[arg(long, default_value_t = ModelOptions::default().device, value_parser = parse_device)]
    pub device: Device,
    /// Largest batch the model runs. On a GPU a larger batch takes less of its time per image,
    /// time that GPU producers beside the model then have. [default: 32 on the CPU, 128 on a
    /// GPU]
    #[arg(long)]
    pub max_batch: Option<usize>,
    /// How long a batch waits for more requests after its first, in milliseconds.
    #[arg(
        long,
        default_value_t = ModelOptions::default().max_wait.as_millis() as u64,
        value_parser = clap::value_parser!(u64).range(0..=MAX_MS)
    )]
    pub max_wait_ms: u64,
    /// Arithmetic of the model's convolutions on the GPU (cuDNN): f32 (no TF32), tf32, bf16 or
    /// f16; the 16-bit ones keep fp32 sums, biases and scores. The CPU model is always f32.
    /// [default: f32; model-bench: every one]
    #[arg(long, value_parser = parse_precision, value_name = "f32|tf32|bf16|f16")]
    pub precision: Option<Precision>,
    /// With an ONNX model on a GPU: ONNX Runtime's execution provider (TensorRT needs its
    /// libraries beside onnxruntime-gpu's).
    #[arg(long, value_enum, default_value_t = ModelOptions::default().ort_provider)]
    pub ort_provider: OrtProvider,
    /// With an f32 ONNX model on a GPU: its convolutions and matrix products on TF32 tensor
    /// cores (ONNX Runtime's and PyTorch's default for convolutions); off for scores as exact
    /// as the CPU's.
    #[arg(long, value_enum, default_value_t = ModelOptions::default().tf32.into())]
    pub tf32: Switch,
}

impl ModelArgs {
    /// The model's configuration, for a model on `--device`.
    pub fn options(&self) -> ModelOptions {
        self.options_on(self.device)
    }

    /// The model's configuration for servers on `device` (the defaults that depend on it).
    pub fn options_on(&self, device: Device) -> ModelOptions {
        ModelOptions {
            kind: self.model.clone(),
            config: tensorport_dfdx::ModelConfig {
                image_size: self.image_size,
                classes: self.classes,
                width: self.width,
            },
            weights: self.weights.clone(),
            seed: self.seed,
            device: self.device,
            max_batch: self
                .max_batch
                .unwrap_or_else(|| ModelOptions::default_max_batch(device)),
            max_wait: std::time::Duration::from_millis(self.max_wait_ms),
            precision: self.precision,
            ort_provider: self.ort_provider,
            tf32: self.tf32.on(),
        }
    }
}

/// How producers prepare images on the CPU.
#[derive(clap::Args, Debug, Clone)]
pub struct PrepArgs {
    /// The preprocessing.
    #[arg(long, value_enum, default_value_t)]
    pub transform: TransformKind,
    /// The CPU's JPEG decoder: libjpeg-turbo (decodes only the part the transform keeps; the
    /// default where it was built in) or zune-jpeg (pure Rust, decodes the whole image).
    #[arg(long, value_parser = parse_jpeg_decoder, value_name = "libjpeg-turbo|zune-jpeg",
          default_value = PrepOptions::default().jpeg_decoder.name())]
    pub jpeg_decoder: JpegDecoder,
    /// Images over this many megapixels are refused (an error line naming the file) before
    /// anything is allocated for them: a small file can declare an image of gigabytes.
    #[arg(long, default_value_t = PrepOptions::default().max_pixels as f64 / 1e6, value_name = "MP")]
    pub max_megapixels: f64,
    /// Decode large JPEGs at 1/2, 1/4 or 1/8 of their size with libjpeg-turbo's DCT scaling
    /// whenever that still leaves a source pixel for each output pixel (as PIL's `draft`
    /// does): less work on big photos, but the tensors differ from torchvision's full decode
    /// by more than the default's bound (docs/operations.md), so it is off unless asked for.
    #[arg(long, value_enum, default_value_t = PrepOptions::default().dct_scaling.into())]
    pub dct_scaling: Switch,
    /// Decode a progressive JPEG without its AC refinement scans (the low bits of its AC
    /// coefficients: most of its bytes and of libjpeg-turbo's work on it) when the transform
    /// shrinks it 8 times or more across and down, e.g. a 12-megapixel photo to 224 pixels:
    /// half the decoding of such a file, with the tensors within the bounds on their
    /// difference from torchvision's full decode (docs/operations.md); off decodes every scan.
    #[arg(long, value_enum, default_value_t = PrepOptions::default().coarse_progressive.into())]
    pub coarse_progressive: Switch,
    /// How GPU producers (`--nvjpeg`, `--gpu-producers`) upsample the chroma of 4:2:2 and
    /// 4:2:0 JPEGs on the JPEG engines: interpolate (as libjpeg-turbo, and so torchvision's
    /// CPU decode, does) or replicate (one decoder for every file, faster where a folder mixes
    /// 4:4:4 with subsampled JPEGs, further from torchvision's tensors: docs/operations.md).
    /// 4:4:4 JPEGs have nothing to upsample either way.
    #[arg(long, value_parser = parse_upsampling, value_name = "interpolate|replicate",
          default_value = PrepOptions::default().gpu_upsampling.name())]
    pub gpu_upsampling: tensorport_nvjpeg::Upsampling,
    /// How GPU producers share their JPEGs between decoders: engines decodes every file on the
    /// JPEG engines; by-chroma sends 4:4:4 files (the engines' slow case) to nvJPEG's hybrid
    /// decoder, Huffman decoding on the producer's host threads (as many as its CPU threads) and
    /// the rest on CUDA cores; split offers it every colour file, 4:4:4 first (subsampled files
    /// decoded there have their chroma upsampled by nvJPEG's kernels, not interpolated). Either
    /// way the hybrid decoder takes as many as finish no later than the engines decode the
    /// others, measured batch by batch. On a GPU without JPEG engines all three are nvJPEG's
    /// CUDA backend.
    #[arg(long, value_parser = parse_gpu_decode, value_name = "engines|by-chroma|split",
          default_value = PrepOptions::default().gpu_decode.name())]
    pub gpu_decode: tensorport_nvjpeg::GpuDecode,
}

fn parse_gpu_decode(s: &str) -> Result<tensorport_nvjpeg::GpuDecode, String> {
    tensorport_nvjpeg::GpuDecode::parse(s)
        .ok_or_else(|| format!("{s:?}: expected engines, by-chroma or split"))
}

fn parse_upsampling(s: &str) -> Result<tensorport_nvjpeg::Upsampling, String> {
    tensorport_nvjpeg::Upsampling::parse(s)
        .ok_or_else(|| format!("{s:?}: expected interpolate or replicate"))
}

impl PrepArgs {
    /// The preparation's configuration, handing over `pixels`.
    pub fn options(&self, pixels: Pixels) -> PrepOptions {
        PrepOptions {
            transform: self.transform,
            jpeg_decoder: self.jpeg_decoder,
            max_pixels: pixels_of(self.max_megapixels),
            dct_scaling: self.dct_scaling.on(),
            coarse_progressive: self.coarse_progressive.on(),
            pixels,
            gpu_upsampling: self.gpu_upsampling,
            gpu_decode: self.gpu_decode,
        }
    }
}

/// What producers hand over per input, and how they prepare it.
#[derive(clap::Args, Debug, Clone)]
pub struct HandOverArgs {
    /// The tensors are ready: prepare the first input once, and hand a copy of it over for every
    /// input (measures the hand-off without the preprocessing).
    #[arg(long)]
    pub ready: bool,
    #[command(flatten)]
    pub prep: PrepArgs,
    /// What to hand over per image: normalised f32 planes, or u8 planes (4× fewer bytes) that
    /// the server normalises to the same floats (on the GPU in the CUDA build).
    #[arg(long, value_enum, default_value_t)]
    pub pixels: Pixels,
    /// Time every step of every input (read, decode, resize, normalise, lease, submit, result):
    /// each result line carries them as "stages", and a farm's summary their means.
    #[arg(long)]
    pub profile: bool,
    /// Keep only the K highest scores of each input, as "top_k": [[class, score], …] from the
    /// highest down, in place of "scores" (for models with many classes, or embeddings);
    /// "class" stays.
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(1..))]
    pub top_k: Option<u32>,
    /// Scores that are not finite numbers (NaN, infinities: an f16 model that overflows):
    /// `strings` writes each as "NaN", "Infinity" or "-Infinity" among the numbers; `error`
    /// gives that input an error line instead.
    #[arg(long, value_enum, default_value_t, value_name = "HOW")]
    pub non_finite: tensorport_farm::record::NonFinite,
}

impl HandOverArgs {
    /// Which of each input's scores a result line keeps.
    pub fn keep(&self) -> tensorport_farm::record::Keep {
        match self.top_k {
            Some(k) => tensorport_farm::record::Keep::Top(k as usize),
            None => tensorport_farm::record::Keep::All,
        }
    }

    /// The preparation's configuration.
    pub fn prep_options(&self) -> PrepOptions {
        self.prep.options(self.pixels)
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

impl From<bool> for Switch {
    fn from(on: bool) -> Switch {
        if on {
            Switch::On
        } else {
            Switch::Off
        }
    }
}

pub use tensorport_farm::config::pixels_of;

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
    fn the_model_flags_left_out_are_the_libraries_defaults() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            model: ModelArgs,
        }
        let given = Flags::parse_from(["tensorport"]).model;
        assert_eq!(given.options(), ModelOptions::default());
        let gpu = Flags::parse_from(["tensorport", "--device", "cuda:1"]).model;
        assert_eq!(
            gpu.options().max_batch,
            ModelOptions::default_max_batch(Device::Cuda(1))
        );
    }

    #[test]
    fn the_prep_flags_left_out_are_the_libraries_defaults() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            prep: PrepArgs,
        }
        let given = Flags::parse_from(["tensorport"]).prep;
        let want = PrepOptions::default();
        assert_eq!(given.options(want.pixels), want);
    }

    #[test]
    fn plural_says_one_restart() {
        assert_eq!(plural(1u32, "restart"), "1 restart");
        assert_eq!(plural(0u32, "restart"), "0 restarts");
        assert_eq!(plural(9u64, "restart"), "9 restarts");
    }
}
