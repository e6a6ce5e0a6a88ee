//! Every default of a farm, decided in one place. [`FarmConfig::new`] sets each setting that
//! does not depend on the run; [`FarmConfig::resolve_defaults`] then decides, once, those that
//! do — the producer mix, the requests each producer keeps in flight, a GPU producer's batch —
//! from what the run holds (its GPUs, its model) and the [`Machine`] (cores, nvJPEG), for each
//! setting its front end (the command line, the Python `Loader`, a program) left open
//! ([`LeftOpen`]).

use std::path::PathBuf;
use std::time::Duration;

use tensorport_vision::Source;

use super::{FarmConfig, Launcher, ModelOptions, PrepOptions, RunOptions, Servers};
use crate::record::{Keep, NonFinite};

/// CPU producers a farm starts when the user names neither kind and its servers run on the CPU.
pub const DEFAULT_CPU_PRODUCERS: usize = 3;

/// GPU producers a farm starts per GPU when the user names neither kind.
pub const DEFAULT_GPU_PRODUCERS_PER_GPU: usize = 2;

/// The producers a farm starts when the user names neither kind: `(cpu, gpu)`. On the CPU,
/// [`DEFAULT_CPU_PRODUCERS`]. On `gpus` GPUs with nvJPEG, [`DEFAULT_GPU_PRODUCERS_PER_GPU`] GPU
/// producers per GPU and a CPU producer for every core but two and one per GPU producer (the
/// server's, and the GPU producers' own threads); with [`Routing::Shared`](super::Routing::Shared)
/// the CPU producers take the progressive files and PNGs and share the plain JPEGs the GPU producers have no
/// room for, which on the H200 machine beat the GPU producers alone by 9–23% on a folder of
/// small baseline JPEGs and matched them on a varied photo folder (docs/benchmarks.md).
/// Without nvJPEG, a CPU producer for every core but the server's.
pub fn default_producers(gpus: usize, cores: usize, nvjpeg: bool) -> (usize, usize) {
    match (gpus, nvjpeg) {
        (0, _) => (DEFAULT_CPU_PRODUCERS, 0),
        (_, false) => (cores.saturating_sub(1).max(1), 0),
        (g, true) => {
            let gpu = g * DEFAULT_GPU_PRODUCERS_PER_GPU;
            (cores.saturating_sub(2 + gpu), gpu)
        }
    }
}

/// A GPU producer's requests in flight (its device buffers) and the images it decodes per
/// batch, unless the farm is told otherwise (`FarmConfig::gpu_in_flight`, `gpu_batch`): two
/// batches in flight, each large enough that the server's GPU work comes in few, large batches.
pub const DEFAULT_GPU_IN_FLIGHT: u32 = 128;
pub const DEFAULT_GPU_BATCH: u32 = 64;

/// The images a GPU producer decodes per batch when only its requests in flight are given:
/// half of them (two batches in flight), at most [`DEFAULT_GPU_BATCH`].
pub fn default_gpu_batch(gpu_in_flight: u32) -> u32 {
    (gpu_in_flight / 2).clamp(1, DEFAULT_GPU_BATCH)
}
/// A CPU producer's requests in flight unless the farm is told otherwise
/// (`FarmConfig::in_flight`).
pub const DEFAULT_IN_FLIGHT: u32 = 8;
/// The same with an ONNX model on a GPU: a network that keeps the GPU busy (ResNet-50) runs
/// full batches only with about three batches outstanding across the producers (one running,
/// one gathered, one being prepared), and each CPU producer then takes more of the plain JPEGs
/// (it holds up to twice its requests), leaving the GPU to the model (docs/benchmarks.md).
pub const DEFAULT_IN_FLIGHT_ONNX_GPU: u32 = 32;

/// A CPU producer's requests in flight for a model of `kind`, on servers on a GPU or not,
/// unless the farm is told otherwise.
pub fn default_in_flight(kind: &crate::config::ModelKind, on_gpu: bool) -> u32 {
    match (kind, on_gpu) {
        (crate::config::ModelKind::Onnx(_), true) => DEFAULT_IN_FLIGHT_ONNX_GPU,
        _ => DEFAULT_IN_FLIGHT,
    }
}

/// The machine a farm runs on, as far as its defaults go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    /// Cores this process may use.
    pub cores: usize,
    /// nvJPEG can be loaded (GPU producers can run).
    pub nvjpeg: bool,
}

impl Machine {
    /// This machine, for a run on `gpus` GPUs (nvJPEG is looked for only where there are some).
    pub fn detect(gpus: usize) -> Machine {
        Machine {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            nvjpeg: gpus > 0 && tensorport_nvjpeg::nvjpeg::Nvjpeg::load().is_ok(),
        }
    }
}

/// Which of a farm's run-dependent settings its front end left to
/// [`FarmConfig::resolve_defaults`]; those not left open are kept as given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeftOpen {
    /// How many CPU and GPU producers (both left open: one was given, the other is 0).
    pub mix: bool,
    /// A CPU producer's requests in flight.
    pub in_flight: bool,
    /// A GPU producer's batch (half its requests in flight).
    pub gpu_batch: bool,
}

impl LeftOpen {
    /// Every one of them.
    pub const ALL: LeftOpen = LeftOpen {
        mix: true,
        in_flight: true,
        gpu_batch: true,
    };
}

impl FarmConfig {
    /// A farm of `inputs` for `servers` running `model`, its lines to `output`; every other
    /// setting at its default, those that depend on the run as if the servers ran on the CPU
    /// until [`FarmConfig::resolve_defaults`] decides them.
    pub fn new(
        inputs: Vec<Source>,
        servers: Servers,
        model: ModelOptions,
        output: impl Into<PathBuf>,
    ) -> FarmConfig {
        FarmConfig {
            inputs,
            producers: DEFAULT_CPU_PRODUCERS,
            gpu_producers: 0,
            servers,
            output: output.into(),
            model,
            in_flight: DEFAULT_IN_FLIGHT,
            gpu_in_flight: DEFAULT_GPU_IN_FLIGHT,
            gpu_batch: DEFAULT_GPU_BATCH,
            threads: None,
            socket: None,
            stall: DEFAULT_STALL,
            ready: false,
            prep: PrepOptions::default(),
            profile: false,
            keep: Keep::All,
            non_finite: NonFinite::Strings,
            child_log: "warn".into(),
            launcher: Launcher::this_executable(),
            run: RunOptions::default(),
        }
    }

    /// Decides the settings `open` leaves to the run, from what it holds and the machine
    /// (`machine`, asked for the run's GPU count only where the mix is left open: finding nvJPEG
    /// loads a library): the producer mix ([`default_producers`]), a CPU producer's requests in
    /// flight ([`default_in_flight`]), a GPU producer's batch ([`default_gpu_batch`]).
    pub fn resolve_defaults(&mut self, open: LeftOpen, machine: impl FnOnce(usize) -> Machine) {
        let gpus = self.gpus();
        if open.in_flight {
            self.in_flight = default_in_flight(&self.model.kind, gpus > 0);
        }
        if open.gpu_batch {
            self.gpu_batch = default_gpu_batch(self.gpu_in_flight);
        }
        if open.mix {
            let m = machine(gpus);
            (self.producers, self.gpu_producers) = default_producers(gpus, m.cores, m.nvjpeg);
        }
    }
}

/// How long a farm's producer keeps trying to connect while its server is not listening yet
/// (`ProduceConfig::wait_for_server`): producers start beside their servers, and a server may
/// take this long to load its model and plan its sessions before the producer is restarted.
pub const FARM_WAIT_FOR_SERVER: Duration = Duration::from_secs(120);

/// How long a producer may hold inputs without a result, with the server up, before the farm
/// takes it as hung.
pub const DEFAULT_STALL: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Device, ModelKind};

    #[test]
    fn the_default_producers_add_gpu_producers_where_nvjpeg_is() {
        assert_eq!(default_producers(0, 16, true), (DEFAULT_CPU_PRODUCERS, 0));
        assert_eq!(default_producers(1, 16, true), (12, 2));
        assert_eq!(default_producers(2, 16, true), (10, 4));
        assert_eq!(default_producers(1, 4, true), (0, 2));
        // No nvJPEG: the cores, on the CPU.
        assert_eq!(default_producers(1, 16, false), (15, 0));
        assert_eq!(default_producers(1, 1, false), (1, 0));
    }

    #[test]
    fn an_onnx_model_on_a_gpu_gets_more_requests_in_flight() {
        use crate::config::ModelKind;
        let onnx = ModelKind::Onnx("m.onnx".into());
        assert_eq!(default_in_flight(&onnx, true), 32);
        assert_eq!(default_in_flight(&onnx, false), 8);
        assert_eq!(default_in_flight(&ModelKind::Classifier, true), 8);
        assert_eq!(default_in_flight(&ModelKind::None, true), 8);
    }

    #[test]
    fn the_default_gpu_batch_keeps_two_batches_in_flight() {
        assert_eq!(default_gpu_batch(DEFAULT_GPU_IN_FLIGHT), DEFAULT_GPU_BATCH);
        assert_eq!(default_gpu_batch(64), 32);
        assert_eq!(default_gpu_batch(256), DEFAULT_GPU_BATCH);
        assert_eq!(default_gpu_batch(3), 1);
        assert_eq!(default_gpu_batch(1), 1);
    }

    #[test]
    fn mps_where_processes_share_a_gpu_and_auto_only_for_a_network_of_the_users() {
        use crate::mps::MpsMode;
        let on = |kind: ModelKind, device: Device| ModelOptions {
            kind,
            device,
            ..ModelOptions::default()
        };
        let onnx = ModelKind::Onnx("m.onnx".into());
        let farm = |model: ModelOptions, servers: Servers, gpu_producers: usize, mps| {
            let mut c = FarmConfig::new(Vec::new(), servers, model, "out");
            c.gpu_producers = gpu_producers;
            c.run.mps = mps;
            c.mps_gpus()
        };
        let gpu0 = Device::Cuda(0);
        // A server and GPU producers on GPU 0, an ONNX network: auto and on.
        for mode in [MpsMode::Auto, MpsMode::On] {
            assert_eq!(
                farm(on(onnx.clone(), gpu0), Servers::Copies(1), 2, mode),
                [0]
            );
        }
        assert!(farm(on(onnx.clone(), gpu0), Servers::Copies(1), 2, MpsMode::Off).is_empty());
        // The bundled model or none: auto leaves MPS out (slower there), on asks for it.
        for kind in [ModelKind::Classifier, ModelKind::None] {
            assert!(farm(on(kind.clone(), gpu0), Servers::Copies(1), 2, MpsMode::Auto).is_empty());
            assert_eq!(
                farm(on(kind, gpu0), Servers::Copies(1), 2, MpsMode::On),
                [0]
            );
        }
        // One process per GPU: nothing to share.
        assert!(farm(on(onnx.clone(), gpu0), Servers::Copies(1), 0, MpsMode::On).is_empty());
        assert!(farm(
            on(onnx.clone(), gpu0),
            Servers::Gpus(vec![0, 1]),
            0,
            MpsMode::On
        )
        .is_empty());
        // Two servers on one GPU, or GPU producers beside servers on two.
        assert_eq!(
            farm(on(onnx.clone(), gpu0), Servers::Copies(2), 0, MpsMode::On),
            [0]
        );
        assert_eq!(
            farm(
                on(onnx.clone(), gpu0),
                Servers::Gpus(vec![1, 0]),
                2,
                MpsMode::Auto
            ),
            [0, 1]
        );
        // On the CPU, or attached to someone else's server: never.
        assert!(farm(
            on(onnx.clone(), Device::Cpu),
            Servers::Copies(1),
            0,
            MpsMode::On
        )
        .is_empty());
        let attach = Servers::Attach {
            socket: "s".into(),
            gpu: Some(0),
        };
        assert!(farm(on(onnx, gpu0), attach, 2, MpsMode::On).is_empty());
    }

    #[test]
    fn run_dependent_defaults_are_decided_once_from_what_the_run_holds() {
        let gpu = ModelOptions {
            kind: ModelKind::Onnx("m.onnx".into()),
            device: Device::Cuda(0),
            ..ModelOptions::default()
        };
        let machine = Machine {
            cores: 16,
            nvjpeg: true,
        };
        let mut c = FarmConfig::new(Vec::new(), Servers::Copies(1), gpu.clone(), "out");
        c.resolve_defaults(LeftOpen::ALL, |_| machine);
        assert_eq!((c.producers, c.gpu_producers), (12, 2));
        assert_eq!(c.in_flight, DEFAULT_IN_FLIGHT_ONNX_GPU);
        assert_eq!(c.gpu_batch, DEFAULT_GPU_BATCH);
        // What the front end gave stays.
        let mut c = FarmConfig::new(Vec::new(), Servers::Copies(1), gpu, "out");
        (c.producers, c.in_flight, c.gpu_in_flight) = (5, 3, 16);
        c.resolve_defaults(
            LeftOpen {
                mix: false,
                in_flight: false,
                gpu_batch: true,
            },
            |_| -> Machine { panic!("the mix was given: the machine is not looked at") },
        );
        assert_eq!((c.producers, c.gpu_producers, c.in_flight), (5, 0, 3));
        assert_eq!(c.gpu_batch, 8);
        // On the CPU: three CPU producers, eight in flight, and the check passes.
        let mut c = FarmConfig::new(Vec::new(), Servers::Copies(1), ModelOptions::default(), "o");
        c.resolve_defaults(LeftOpen::ALL, |_| machine);
        assert_eq!((c.producers, c.gpu_producers, c.in_flight), (3, 0, 8));
        assert!(c.check().is_ok());
    }
}
