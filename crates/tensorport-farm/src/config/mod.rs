//! The configuration of a producer, a server and a farm, as types. A front end (the command
//! line, a test, another program) fills these in; a farm hands its children theirs as data
//! (`ProduceConfig::to_data`, `ServeConfig::to_data`: one JSON document each), never as flags.

use std::path::PathBuf;
use std::time::Duration;

use tensorport_vision::Source;

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, Result};
use crate::record::{Keep, NonFinite};

pub mod bounds;
mod data;
pub mod defaults;
mod model;
mod prep;
mod run;

pub use model::{
    Device, ModelKind, ModelOptions, OrtProvider, DEFAULT_MAX_BATCH_CPU, DEFAULT_MAX_BATCH_GPU,
};
pub use prep::{Pixels, PrepOptions, TransformKind};
pub use run::{Routing, RunOptions};

pub use defaults::{
    default_producers, LeftOpen, Machine, DEFAULT_CPU_PRODUCERS, DEFAULT_GPU_PRODUCERS_PER_GPU,
};

use bounds::{duration, within, MAX_DURATION, MAX_IMAGE_SIZE, MAX_IN_FLIGHT, MAX_THREADS};

/// What a producer classifies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Inputs {
    /// The PNG/JPEG files in a folder.
    Dir(#[serde(with = "data::path")] PathBuf),
    /// N generated images.
    Synthetic(u64),
    /// NUL-terminated `record::work_record`s on stdin, until end of input (how a farm drives
    /// producers).
    Worklist,
}

/// Where result lines go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Output {
    Stdout,
    File(#[serde(with = "data::path")] PathBuf),
}

/// Decoding on the GPU (nvJPEG), handing over device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuPrep {
    /// The GPU's ordinal.
    pub ordinal: u32,
    /// Images per nvJPEG batch (at most the requests in flight).
    pub batch: usize,
    /// Threads preparing on the CPU what nvJPEG does not take (progressive JPEGs on the
    /// hardware decoder, PNGs), while the GPU decodes the rest of the batch; as many again for
    /// nvJPEG's hybrid decoder where `PrepOptions::gpu_decode` shares 4:4:4 files with it.
    pub cpu_threads: usize,
}

/// How long a producer waits on one file's read before it gives up on that file, unless told
/// otherwise (a farm makes it shorter than its stall limit).
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// One producer process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProduceConfig {
    #[serde(with = "data::path")]
    pub socket: PathBuf,
    pub inputs: Inputs,
    pub output: Output,
    /// Side of the square images the server's model takes.
    pub image_size: usize,
    /// Requests outstanding at once (also the number of slots asked for).
    pub in_flight: u32,
    /// Prepare the first input once and hand a copy over for every input.
    pub ready: bool,
    pub prep: PrepOptions,
    /// Add each input's stage times to its line.
    pub profile: bool,
    /// Which of each input's scores its line keeps.
    pub keep: Keep,
    /// What its line holds for scores that are not finite numbers.
    #[serde(default)]
    pub non_finite: NonFinite,
    /// Name shown in the server's logs and status, and in the result lines.
    pub name: String,
    /// How long to wait for a free slot or a result before giving up.
    pub timeout: Duration,
    /// How long to poll for results before sleeping on the doorbell.
    pub spin: Duration,
    /// A file read not returned after this long is given up on, with an error line.
    pub read_timeout: Duration,
    /// Decode and prepare on the GPU instead of the CPU.
    pub gpu: Option<GpuPrep>,
    /// How long to keep trying to connect while nothing listens at the socket yet (a server
    /// still loading its model); zero: fail at once. A farm starts its producers beside its
    /// servers, so that their start (a GPU producer's CUDA context and decoder) overlaps the
    /// servers' (the model's sessions and plans).
    #[serde(default)]
    pub wait_for_server: Duration,
}

impl ProduceConfig {
    /// Refuses a configuration out of its bounds ([`bounds`]), before anything starts: what
    /// the command line and a configuration document give alike.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.image_size == 0 {
            return Err(ConfigError::ImageSize);
        }
        within("image size", self.image_size, 1, MAX_IMAGE_SIZE)?;
        within("in_flight", self.in_flight, 1, MAX_IN_FLIGHT)?;
        let ms = Duration::from_millis(1);
        duration("timeout", self.timeout, ms, MAX_DURATION)?;
        duration("read_timeout", self.read_timeout, ms, MAX_DURATION)?;
        duration(
            "wait_for_server",
            self.wait_for_server,
            Duration::ZERO,
            MAX_DURATION,
        )?;
        duration("spin", self.spin, Duration::ZERO, bounds::MAX_SPIN)?;
        within(
            "name length",
            self.name.len(),
            0,
            tensorport::wire::MAX_NAME_LEN,
        )?;
        if let Keep::Top(k) = self.keep {
            within("top_k", k, 1, usize::MAX)?;
        }
        self.prep.check()?;
        if let Some(g) = self.gpu {
            // A batch over the requests in flight is taken as that many.
            if !(1..=tensorport::wire::MAX_DEVICE_BUFFERS).contains(&self.in_flight) || g.batch == 0
            {
                return Err(ConfigError::GpuInFlight);
            }
            within("cpu_threads", g.cpu_threads, 0, MAX_THREADS)?;
        }
        Ok(())
    }

    /// How long a producer waits for a free slot or a result before giving up.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
    /// How long a producer polls for results before sleeping on its doorbell.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(20);
}

/// The inference server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    #[serde(with = "data::path")]
    pub socket: PathBuf,
    pub model: ModelOptions,
    /// Slots per producer, unless the producer asks otherwise.
    pub slots: u32,
    /// Bytes per slot, unless the producer asks otherwise [default: one input image].
    pub slot_size: Option<u64>,
    /// Most producers at once.
    pub max_sessions: u32,
    /// Memory all producers' pools may reserve together [default: the transport's].
    pub memory_budget: Option<u64>,
    /// Memory one producer's pool may reserve [default: the transport's].
    pub max_session_memory: Option<u64>,
    /// Threads for the model's matrix products [default: all cores].
    pub threads: Option<usize>,
    /// How long to poll the producers' queues before sleeping on their doorbells.
    pub spin: Duration,
    /// Serve Prometheus metrics on this address.
    pub metrics: Option<String>,
    /// Model workers, each with its own share of the producers and copy of the model.
    pub workers: usize,
    /// Answer every request at once with an empty result, without a model.
    pub sink: bool,
    /// How long a batch waits for a GPU producer's "ready" fence.
    pub fence_timeout: Duration,
}

impl ServeConfig {
    /// Refuses a configuration out of its bounds ([`bounds`]) or whose model options contradict
    /// each other, before anything starts: what the command line and a configuration document
    /// give alike.
    pub fn check(&self) -> Result<(), ConfigError> {
        self.model.check()?;
        within("slots", self.slots, 1, MAX_IN_FLIGHT)?;
        if let Some(b) = self.slot_size {
            within("slot_size", b, 1, 1 << 40)?;
        }
        within("max_sessions", self.max_sessions, 1, bounds::MAX_SESSIONS)?;
        for (field, b) in [
            ("memory_budget", self.memory_budget),
            ("max_session_memory", self.max_session_memory),
        ] {
            if let Some(b) = b {
                within(field, b, 1, u64::MAX)?;
            }
        }
        if let Some(t) = self.threads {
            within("threads", t, 1, MAX_THREADS)?;
        }
        within("workers", self.workers, 1, MAX_THREADS)?;
        duration("spin", self.spin, Duration::ZERO, bounds::MAX_SPIN)?;
        let ms = Duration::from_millis(1);
        duration("fence_timeout", self.fence_timeout, ms, MAX_DURATION)?;
        Ok(())
    }

    /// Slots per producer unless it asks otherwise.
    pub const DEFAULT_SLOTS: u32 = 8;
    /// Producers at once.
    pub const DEFAULT_MAX_SESSIONS: u32 = 64;
    /// Polling the producers' queues before sleeping on their doorbells.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
    /// A batch's wait for a GPU producer's "ready" fence.
    pub const DEFAULT_FENCE_TIMEOUT: Duration = Duration::from_secs(10);

    /// A server of `model` on `socket` with the defaults: 8 slots per producer of one image
    /// each, 64 producers, the transport's memory budget, all cores, one model worker, no
    /// metrics.
    pub fn new(socket: impl Into<PathBuf>, model: ModelOptions) -> ServeConfig {
        ServeConfig {
            socket: socket.into(),
            model,
            slots: Self::DEFAULT_SLOTS,
            slot_size: None,
            max_sessions: Self::DEFAULT_MAX_SESSIONS,
            memory_budget: None,
            max_session_memory: None,
            threads: None,
            spin: Self::DEFAULT_SPIN,
            metrics: None,
            workers: 1,
            sink: false,
            fence_timeout: Self::DEFAULT_FENCE_TIMEOUT,
        }
    }
}

/// How to start the `tensorport` command line in a child process: a program and the arguments
/// before the subcommand (the executable itself, or `python -m tensorport`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launcher {
    pub program: PathBuf,
    pub args: Vec<String>,
}

impl Launcher {
    /// This process's own executable.
    pub fn this_executable() -> Launcher {
        Launcher {
            program: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("tensorport")),
            args: Vec::new(),
        }
    }

    /// A command that runs `program args… extra…`.
    pub fn command(&self) -> std::process::Command {
        let mut c = std::process::Command::new(&self.program);
        c.args(&self.args);
        c
    }
}

/// The servers of a farm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Servers {
    /// This many servers on the model's device.
    Copies(usize),
    /// One server per listed GPU.
    Gpus(Vec<u32>),
    /// A server someone else runs (a Python `Loader`'s, say), listening at `socket`: the farm
    /// starts none, and never drains it; GPU producers work on GPU `gpu`.
    Attach { socket: PathBuf, gpu: Option<u32> },
}

/// A farm: servers and supervised producers over a set of inputs.
#[derive(Debug, Clone)]
pub struct FarmConfig {
    /// What to classify.
    pub inputs: Vec<Source>,
    /// Producers preparing on the CPU.
    pub producers: usize,
    /// Producers decoding and preparing on the GPU.
    pub gpu_producers: usize,
    pub servers: Servers,
    /// The results file, one JSON line per input.
    pub output: PathBuf,
    pub model: ModelOptions,
    /// Requests each CPU producer keeps in flight (each holds up to twice as many inputs).
    pub in_flight: u32,
    /// Requests each GPU producer keeps in flight: its device buffers, 1 to
    /// [`tensorport::wire::MAX_DEVICE_BUFFERS`] (each holds up to twice as many inputs).
    pub gpu_in_flight: u32,
    /// Images each GPU producer decodes per nvJPEG batch, 1 to `gpu_in_flight`.
    pub gpu_batch: u32,
    /// Threads for each server's model [default: all cores].
    pub threads: Option<usize>,
    /// The first server's socket [default: a fresh private directory, removed afterwards].
    pub socket: Option<PathBuf>,
    /// A producer holding inputs without a result this long, with the server up, is killed.
    pub stall: Duration,
    /// Producers hand over a ready tensor for every input.
    pub ready: bool,
    pub prep: PrepOptions,
    /// Time every step of every input.
    pub profile: bool,
    /// Which of each input's scores its line keeps.
    pub keep: Keep,
    /// What a line holds for scores that are not finite numbers.
    pub non_finite: NonFinite,
    /// Log filter of the children.
    pub child_log: String,
    /// How to start the children (`tensorport serve`, `tensorport produce`).
    pub launcher: Launcher,
    /// How it runs its processes: the options taken as given ([`RunOptions`]).
    pub run: RunOptions,
}

impl FarmConfig {
    /// The GPUs on which two or more of its processes run (a server and GPU producers, or
    /// several servers): those MPS lets share the GPU. None for an attached server (its
    /// process is someone else's).
    pub fn shared_gpus(&self) -> Vec<u32> {
        let mut on: Vec<u32> = match &self.servers {
            Servers::Gpus(list) => list.clone(),
            Servers::Copies(n) => match self.model.device {
                Device::Cuda(g) => vec![g; (*n).max(1)],
                Device::Cpu => Vec::new(),
            },
            Servers::Attach { .. } => return Vec::new(),
        };
        if on.is_empty() {
            return on;
        }
        let servers = on.len();
        on.sort_unstable();
        let mut shared: Vec<u32> = on.clone();
        shared.dedup();
        if self.gpu_producers == 0 && shared.len() == servers {
            return Vec::new();
        }
        shared
    }

    /// The GPUs to run under MPS ([`crate::mps`]), none where MPS is not wanted: with `on`,
    /// every GPU two or more of its processes share ([`FarmConfig::shared_gpus`]); with `auto`,
    /// those only where the servers run a network of the user's (an ONNX model), which MPS
    /// lets the GPU producers' decoding overlap. With the bundled classifier or no model the GPU
    /// producers' decoding is the bound, and MPS slows it (docs/benchmarks-detail.md), so `auto`
    /// leaves MPS out there.
    pub fn mps_gpus(&self) -> Vec<u32> {
        let wanted = match self.run.mps {
            crate::mps::MpsMode::Off => false,
            crate::mps::MpsMode::On => true,
            crate::mps::MpsMode::Auto => matches!(self.model.kind, ModelKind::Onnx(_)),
        };
        if wanted {
            self.shared_gpus()
        } else {
            Vec::new()
        }
    }

    /// The GPUs its servers run on (0 on the CPU; an attached server's: 1 if it names one).
    pub fn gpus(&self) -> usize {
        match &self.servers {
            Servers::Gpus(list) => list.len(),
            Servers::Copies(_) if self.model.device.is_cuda() => 1,
            Servers::Copies(_) => 0,
            Servers::Attach { gpu, .. } => usize::from(gpu.is_some()),
        }
    }

    /// Refuses options that cannot work together, before anything starts.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.producers + self.gpu_producers == 0 {
            return Err(ConfigError::NoProducers);
        }
        let attached = matches!(self.servers, Servers::Attach { .. });
        let on_gpu = self.model.device.is_cuda() || matches!(self.servers, Servers::Gpus(_));
        if self.gpu_producers > 0 && !on_gpu && !attached {
            return Err(ConfigError::GpuProducersNeedGpu);
        }
        if !(1..=tensorport::wire::MAX_DEVICE_BUFFERS).contains(&self.gpu_in_flight)
            || !(1..=self.gpu_in_flight).contains(&self.gpu_batch)
        {
            return Err(ConfigError::GpuInFlight);
        }
        self.model.check()?;
        self.prep.check()?;
        within("in_flight", self.in_flight, 1, MAX_IN_FLIGHT)?;
        within("workers", self.run.workers, 1, MAX_THREADS)?;
        if let Some(t) = self.threads {
            within("threads", t, 1, MAX_THREADS)?;
        }
        duration(
            "stall",
            self.stall,
            Duration::from_millis(100),
            MAX_DURATION,
        )?;
        if let Keep::Top(k) = self.keep {
            within("top_k", k, 1, usize::MAX)?;
        }
        // An attached server's model and device are its own business.
        if on_gpu && !attached && !cfg!(feature = "cuda") {
            return Err(ConfigError::NoCudaBuild);
        }
        if let Some(w) = &self.model.weights {
            if !w.is_file() {
                return Err(ConfigError::WeightsMissing(w.clone()));
            }
        }
        Ok(())
    }
}

/// Pixels from megapixels.
pub fn pixels_of(megapixels: f64) -> u64 {
    (megapixels.max(0.0) * 1e6) as u64
}
