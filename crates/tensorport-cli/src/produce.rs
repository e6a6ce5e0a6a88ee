//! `tensorport produce`: one producer process (the loops live in `tensorport_farm::produce`).

use std::path::PathBuf;
use std::time::Duration;

use tensorport_farm::config::{GpuPrep, Inputs, Output};
use tensorport_farm::ProduceConfig;

use crate::common::{CliResult, HandOverArgs, SocketArg};

/// Preprocess images into shared memory and have the server classify them. Each image is decoded,
/// resized and cropped to --image-size (see --transform) and normalised straight into a slot of
/// this producer's pool (no copy), then submitted; up to --in-flight requests are outstanding at
/// once. Files are read ahead on a thread of their own. Writes one JSON line per input:
/// {"index", "input", "class", "scores", "latency_ms", "producer"} (or "error"), plus "stages"
/// with --profile.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub socket: SocketArg,
    /// Folder of PNG/JPEG images to classify.
    #[arg(long, conflicts_with_all = ["synthetic", "worklist"])]
    pub input: Option<PathBuf>,
    /// Classify N generated images instead of files.
    #[arg(long, value_name = "N", conflicts_with = "worklist")]
    pub synthetic: Option<u64>,
    /// Read inputs from stdin until end of input, each a record ending in a NUL byte:
    /// `INDEX<TAB>f<TAB>PATH` (the path's bytes as they are, newlines included) or
    /// `INDEX<TAB>s<TAB>N` (synthetic image N); `INDEX<TAB>x<TAB>` withdraws an input given
    /// earlier (left out unless already started). This is how `tensorport farm` drives
    /// producers.
    #[arg(long)]
    pub worklist: bool,
    /// Where to write the JSON lines (`-` for stdout).
    #[arg(long, short, default_value = "-")]
    pub output: PathBuf,
    /// Side of the square images the server's model takes, in pixels.
    #[arg(long, default_value_t = tensorport_dfdx::ModelConfig::default().image_size)]
    pub image_size: usize,
    /// Requests outstanding at once (also the number of slots asked for).
    #[arg(long, default_value_t = 4)]
    pub in_flight: u32,
    #[command(flatten)]
    pub hand_over: HandOverArgs,
    /// Name shown in the server's logs and status.
    #[arg(long, default_value = "producer")]
    pub name: String,
    /// How long to wait for a free slot or a result before giving up, in seconds.
    #[arg(long, default_value_t = ProduceConfig::DEFAULT_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..=crate::common::MAX_SECS))]
    pub timeout: u64,
    /// Microseconds to poll for results before sleeping on the doorbell (see `serve --spin-us`).
    #[arg(long, default_value_t = ProduceConfig::DEFAULT_SPIN.as_micros() as u64, value_parser = clap::value_parser!(u64).range(0..=crate::common::MAX_SPIN_US))]
    pub spin_us: u64,
    /// A file whose read has not returned after this many seconds (a hung network mount, say)
    /// gets an error line, "hung while reading"; the inputs after it wait for the read.
    #[arg(long, value_name = "SECONDS", default_value_t = tensorport_farm::config::DEFAULT_READ_TIMEOUT.as_secs_f64(), value_parser = crate::common::parse_seconds)]
    pub read_timeout: f64,
    /// Keep trying to connect for up to this many seconds while nothing listens at the socket
    /// yet (a server still loading its model); 0: fail at once.
    #[arg(long, value_name = "SECONDS", default_value_t = 0.0, value_parser = crate::common::parse_seconds_or_zero)]
    pub wait_for_server: f64,
    /// Decode and prepare on the GPU: JPEGs in batches with nvJPEG (the GPU's hardware JPEG
    /// decoder where it has one), resized, cropped and normalised by a kernel into device
    /// buffers handed over through CUDA IPC with fences (the server must run `--device cuda` on
    /// the same GPU). Other files (PNG, progressive JPEGs on the hardware decoder) are prepared
    /// on the CPU and copied up. Needs libnvjpeg and libnvrtc (CUDA toolkit or their wheels).
    #[arg(long, conflicts_with = "ready")]
    pub nvjpeg: bool,
    /// The GPU for --nvjpeg.
    #[arg(long, default_value_t = 0, value_name = "ORDINAL")]
    pub gpu: u32,
    /// Images per nvJPEG batch (at most --in-flight).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// With --nvjpeg: threads preparing on the CPU what nvJPEG does not take (progressive JPEGs
    /// on the hardware decoder, PNGs), while the GPU decodes the rest of the batch.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub cpu_threads: usize,
    /// The whole configuration as one JSON document, in place of the flags above (how
    /// `tensorport farm` starts its producers).
    #[arg(long, value_name = "JSON", hide = true)]
    pub config_data: Option<String>,
}

impl Args {
    /// The producer's configuration.
    pub fn config(&self) -> ProduceConfig {
        ProduceConfig {
            socket: self.socket.path(),
            inputs: match (&self.input, self.synthetic, self.worklist) {
                (Some(dir), _, _) => Inputs::Dir(dir.clone()),
                (None, Some(n), _) => Inputs::Synthetic(n),
                (None, None, _) => Inputs::Worklist,
            },
            output: if self.output.as_os_str() == "-" {
                Output::Stdout
            } else {
                Output::File(self.output.clone())
            },
            image_size: self.image_size,
            in_flight: self.in_flight,
            ready: self.hand_over.ready,
            prep: self.hand_over.prep_options(),
            profile: self.hand_over.profile,
            keep: self.hand_over.keep(),
            non_finite: self.hand_over.non_finite,
            name: self.name.clone(),
            timeout: Duration::from_secs(self.timeout),
            spin: Duration::from_micros(self.spin_us),
            read_timeout: Duration::from_secs_f64(self.read_timeout),
            wait_for_server: Duration::from_secs_f64(self.wait_for_server),
            gpu: self.nvjpeg.then_some(GpuPrep {
                ordinal: self.gpu,
                batch: self.batch,
                cpu_threads: self.cpu_threads,
            }),
        }
    }
}

pub fn run(a: Args) -> CliResult<u8> {
    let cfg = match &a.config_data {
        Some(data) => ProduceConfig::from_data(data).map_err(tensorport_farm::Error::from)?,
        None if a.input.is_none() && a.synthetic.is_none() && !a.worklist => {
            return Err(tensorport_farm::Error::from(tensorport_farm::ConfigError::NoInputs).into())
        }
        None => a.config(),
    };
    tensorport_farm::produce::run(&cfg)?;
    Ok(0)
}
