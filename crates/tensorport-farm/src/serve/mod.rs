//! The inference server: binds the socket, loads the model once per worker (before it
//! listens, so a model that cannot load fails at once), and runs a [`BatchLoop`] per worker
//! until a signal drains it.
//!
//! On the GPU, pools are registered with the device (pinned), each request's slot is copied by
//! DMA into a device tensor (or a GPU producer's device tensor is fenced and copied), the batch
//! is stacked on the device, and the model runs there: cuDNN at the configured precision, or
//! dfdx's own kernels where cuDNN cannot be loaded.

mod batch;
mod bundled;
#[cfg(feature = "cuda")]
mod cuda_batch;
pub mod engine;
pub mod metrics;
mod onnx;
mod own;
mod pace;

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport::{DeviceImporter, PinHook, Server, ServerConfig};
use tensorport_dfdx::dfdx::prelude::Cpu;

pub use batch::{BatchLoop, Batcher, CpuBatcher, Rejection, Stacked};
#[cfg(feature = "cuda")]
pub use cuda_batch::CudaBatcher;
pub use engine::{Engine, EngineError, HostInput, Input, Scores, Submitted};
pub use own::{HostBatch, HostModel};

use crate::config::{Device, ModelKind, ModelOptions, ServeConfig};
use crate::error::{ConfigError, Error, Result};
use crate::process::Stop;

/// The exit status of a server whose CUDA context was lost ([`end_if_context_lost`]).
pub const EXIT_CONTEXT_LOST: i32 = 75;

/// Ends this server's process at once, answering nothing more, where `error` says its CUDA
/// context is lost (a kernel's fault, or the MPS server it ran on gone:
/// [`tensorport_cuda::context_lost`]). Every later call in the context would fail the same way,
/// so answering each request with the error would turn a fault that a new process recovers
/// from into an error line per input; ended, the server is restarted by its farm, which redoes
/// what it had not answered (a server run alone says why and exits with [`EXIT_CONTEXT_LOST`]).
pub(crate) fn end_if_context_lost(error: &dyn std::fmt::Display) {
    let text = error.to_string();
    if tensorport_cuda::context_lost(&text) {
        tracing::error!(
            "the server's CUDA context is lost ({text}); ending the process so that a new \
             server takes its work (exit status {EXIT_CONTEXT_LOST})"
        );
        std::process::exit(EXIT_CONTEXT_LOST);
    }
}

/// Runs the server until `stop` has drained it: once it listens, a stop request drains (the
/// work in flight finishes, new producers are refused), and the function returns once every
/// producer has left. Prints `ready <socket>` on stdout once it listens (and `metrics
/// http://…/metrics` if configured).
pub fn run(cfg: &ServeConfig, stop: &Stop) -> Result<()> {
    if let Some(n) = cfg.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
            .map_err(|e| ConfigError::Threads(e.to_string()))?;
    }
    cfg.check()?;
    let mut cfg = cfg.clone();
    // An ONNX model's files are read once, for every worker's session; its input decides the
    // image size (taken from the first worker's session, before the socket listens).
    let onnx = match &cfg.model.kind {
        ModelKind::Onnx(_) if cfg.sink => {
            // Only its image size is wanted.
            cfg.model.resolve()?;
            None
        }
        ModelKind::Onnx(path) => Some(onnx::OnnxFile::read(path)?),
        _ => None,
    };
    if let Device::Cuda(n) = cfg.model.device {
        return run_cuda(&mut cfg, n, onnx.as_ref(), stop);
    }
    let (threads, sink) = (cfg.threads, cfg.sink);
    let make = |model: &ModelOptions| -> Result<Worker> {
        let shape = model.config.input_shape();
        let engine: Box<dyn Engine> = match (&model.kind, &onnx) {
            _ if sink => Box::new(engine::NoModel::on_cpu(shape)),
            (ModelKind::None, _) => Box::new(engine::NoModel::on_cpu(shape)),
            (ModelKind::Onnx(_), Some(file)) => {
                let (engine, info) = onnx::load_on_cpu(file, model, threads)?;
                return Ok((Box::new(CpuBatcher), engine, Some(info)));
            }
            _ => Box::new(dfdx_on_cpu(model)?),
        };
        Ok((Box::new(CpuBatcher), engine, None))
    };
    serve_on(&mut cfg, stop, Hooks::default(), &make)
}

/// A worker: its batcher and engine, and what an ONNX model decided of the configuration.
type Worker = (
    Box<dyn Batcher>,
    Box<dyn Engine>,
    Option<onnx::OnnxModelInfo>,
);

/// Makes one worker (on the worker's own thread; the first before the socket listens).
type WorkerFn<'a> = dyn Fn(&ModelOptions) -> Result<Worker> + Sync + 'a;

/// The bundled model on dfdx's CPU kernels.
fn dfdx_on_cpu(model: &ModelOptions) -> Result<bundled::DfdxOnCpu> {
    let dev = Cpu::default();
    let net = model.dfdx_model(&dev)?;
    Ok(bundled::DfdxOnCpu {
        dev,
        net,
        shape: model.config.input_shape(),
    })
}

/// Runs the server, as [`run`], with a model of your own on the CPU instead of `cfg.model`'s:
/// `load` makes each model worker's (on that worker's thread; the first before the socket
/// listens, so a model that cannot load fails at once). The producers, batching (`cfg.model`'s
/// image size, largest batch and wait) and fault handling are the server's. `cfg.model`'s device
/// must be the CPU; its kind is not used.
///
/// ```no_run
/// use tensorport_farm::serve::{HostBatch, HostModel};
/// use tensorport_farm::{ModelOptions, ServeConfig};
///
/// struct Brightness;
/// impl HostModel for Brightness {
///     fn run(&mut self, batch: HostBatch<'_>) -> Result<Vec<Vec<f32>>, String> {
///         Ok((0..batch.rows)
///             .map(|i| vec![batch.image(i).iter().sum::<f32>()])
///             .collect())
///     }
/// }
/// let cfg = ServeConfig::new("/tmp/my.sock", ModelOptions::default());
/// let stop = tensorport_farm::process::Stop::new(); // `stop.request()` drains it
/// tensorport_farm::serve::run_with(&cfg, &stop, || Ok(Box::new(Brightness)))?;
/// # Ok::<(), tensorport_farm::Error>(())
/// ```
pub fn run_with<F>(cfg: &ServeConfig, stop: &Stop, load: F) -> Result<()>
where
    F: Fn() -> std::result::Result<Box<dyn HostModel>, String> + Sync,
{
    if cfg.model.device != Device::Cpu {
        return Err(ConfigError::OwnModelOnCpu.into());
    }
    let mut cfg = cfg.clone();
    // The model is the caller's: nothing of `cfg.model`'s own is loaded.
    cfg.model.kind = ModelKind::Classifier;
    cfg.check()?;
    let sink = cfg.sink;
    let make = |model: &ModelOptions| -> Result<Worker> {
        let shape = model.config.input_shape();
        let engine: Box<dyn Engine> = match sink {
            true => Box::new(engine::NoModel::on_cpu(shape)),
            false => {
                let own =
                    load().map_err(|e| Error::Other(format!("cannot load the model: {e}")))?;
                Box::new(own::Own::new(own, shape))
            }
        };
        Ok((Box::new(CpuBatcher), engine, None))
    };
    serve_on(&mut cfg, stop, Hooks::default(), &make)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &mut ServeConfig, _: u32, _: Option<&onnx::OnnxFile>, _: &Stop) -> Result<()> {
    Err(ConfigError::NoCudaBuild.into())
}

#[cfg(feature = "cuda")]
fn run_cuda(
    cfg: &mut ServeConfig,
    ordinal: u32,
    onnx: Option<&onnx::OnnxFile>,
    stop: &Stop,
) -> Result<()> {
    // No driver, or no such device: configuration a restart cannot fix.
    let gpu = tensorport_cuda::Gpu::open(ordinal as i32).map_err(|e| match e {
        tensorport_cuda::Error::NoDriver | tensorport_cuda::Error::NoDevice(..) => {
            Error::Config(ConfigError::NoGpu(e))
        }
        e => Error::Cuda(e),
    })?;
    let fence_timeout = cfg.fence_timeout.max(Duration::from_millis(1));
    let hooks = Hooks {
        pin: Some(Arc::new(tensorport_cuda::CudaPin::new(gpu.clone()))),
        device: Some(Arc::new(
            tensorport_cuda::CudaImporter::new(gpu.clone()).with_fence_timeout(fence_timeout),
        )),
    };
    // GPU producers' tensors of a batch are fenced and copied together; the copy kernel is
    // compiled once and launched from every worker (launches are thread-safe).
    let gatherer = Arc::new(tensorport_cuda::Gatherer::new(&gpu));
    let sink = cfg.sink;
    // Each worker makes its own batcher and engine (neither may be shared).
    let make = |model: &ModelOptions| -> Result<Worker> {
        let batcher = Box::new(CudaBatcher::new(&gpu, gatherer.clone(), fence_timeout)?);
        let shape = model.config.input_shape();
        let (engine, info): (Box<dyn Engine>, _) = match (&model.kind, onnx) {
            _ if sink => (
                Box::new(engine::NoModel::on_gpu(shape, model.max_batch, &gpu)),
                None,
            ),
            (ModelKind::None, _) => (
                Box::new(engine::NoModel::on_gpu(shape, model.max_batch, &gpu)),
                None,
            ),
            (ModelKind::Onnx(_), Some(file)) => {
                let (engine, info) = onnx::load_on_cuda(file, model, &gpu)?;
                (engine, Some(info))
            }
            _ => (Box::new(bundled_on_gpu(&gpu, model)?), None),
        };
        Ok((batcher as Box<dyn Batcher>, engine, info))
    };
    serve_on(cfg, stop, hooks, &make)
}

/// What the CUDA server plugs into the transport: pool pinning, device-buffer import.
#[derive(Default)]
struct Hooks {
    pin: Option<Arc<dyn PinHook>>,
    device: Option<Arc<dyn DeviceImporter>>,
}

/// The transport's settings for this server.
fn server_config(cfg: &ServeConfig, hooks: Hooks, image_bytes: u64) -> ServerConfig {
    let mut sc = ServerConfig::new(&cfg.socket);
    sc.slots_per_session = cfg.slots.max(1);
    sc.slot_size = cfg.slot_size.unwrap_or(image_bytes);
    sc.max_sessions = cfg.max_sessions;
    if let Some(b) = cfg.memory_budget {
        sc.memory_budget = b;
    }
    if let Some(b) = cfg.max_session_memory {
        sc.max_session_bytes = b;
    }
    sc.spin = cfg.spin;
    sc.pin = hooks.pin;
    sc.device = hooks.device;
    sc.consumers = cfg.workers.max(1);
    sc
}

fn serve_on(cfg: &mut ServeConfig, stop: &Stop, hooks: Hooks, make: &WorkerFn<'_>) -> Result<()> {
    let workers = cfg.workers.max(1);
    // The first worker is made here, so a model that cannot load fails before the socket
    // listens, not in a thread; an ONNX model's first session decides the image size.
    let (first_batcher, first_engine, info) = make(&cfg.model)?;
    if let Some(info) = info {
        cfg.model
            .adopt_onnx(&info.input, info.image_size, info.classes)?;
    }
    let most = first_engine.max_batch();
    if cfg.model.max_batch > most {
        return Err(ConfigError::EngineBatch {
            asked: cfg.model.max_batch,
            most,
        }
        .into());
    }
    let cfg = &*cfg;
    let mc = cfg.model.config;
    let shape = mc.input_shape();
    let image_bytes = (shape.iter().product::<usize>() * 4) as u64;
    let server = Arc::new(Server::bind(server_config(cfg, hooks, image_bytes))?);
    let metrics = match &cfg.metrics {
        Some(addr) => Some(metrics::start(addr, server.clone())?),
        None => None,
    };
    println!("ready {}", cfg.socket.display());
    if let Some((_, at)) = &metrics {
        println!("metrics http://{at}/metrics");
    }
    std::io::stdout().flush().ok();
    let metrics = metrics.map(|(m, _)| m);
    tracing::info!(
        image_size = mc.image_size,
        classes = mc.classes,
        max_batch = cfg.model.max_batch,
        workers,
        sink = cfg.sink,
        "serving the model"
    );
    let started = Instant::now();
    let images = AtomicU64::new(0);
    let shared = BatchLoop {
        server: &server,
        max_batch: cfg.model.max_batch,
        // A sink answers what it has at once.
        max_wait: if cfg.sink {
            Duration::ZERO
        } else {
            cfg.model.max_wait
        },
        sink: cfg.sink,
        shape,
        stop,
        metrics: metrics.as_ref(),
        images: &images,
    };
    let work = |mut batcher: Box<dyn Batcher>, mut engine: Box<dyn Engine>| {
        shared.run(&mut *batcher, &mut *engine)
    };
    std::thread::scope(|s| -> Result<()> {
        let others: Vec<_> = (1..workers)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    let (batcher, engine, _) = make(&cfg.model)?;
                    work(batcher, engine)
                })
            })
            .collect();
        let mine = work(first_batcher, first_engine);
        for t in others {
            t.join()
                .map_err(|_| Error::Other("a model worker panicked".into()))??;
        }
        mine
    })?;
    let images = images.load(Ordering::Relaxed);
    let secs = started.elapsed().as_secs_f64();
    let st = server.status();
    let fill = if st.totals.batches > 0 {
        st.totals.batched as f64 / st.totals.batches as f64
    } else {
        0.0
    };
    tracing::info!(
        images,
        batches = st.totals.batches,
        mean_batch = format!("{fill:.1}"),
        seconds = format!("{secs:.1}"),
        "drained; exiting"
    );
    Ok(())
}

/// The bundled model on a GPU: cuDNN's convolutions at the configured precision, their
/// algorithms measured for the largest batch before the socket listens; dfdx's own kernels
/// (fp32, several times slower) where cuDNN cannot be loaded, with a warning that says so. Its
/// dfdx device (the worker's own: it may not be shared) makes the tensors it lends.
#[cfg(feature = "cuda")]
fn bundled_on_gpu(
    gpu: &Arc<tensorport_cuda::Gpu>,
    model: &ModelOptions,
) -> Result<bundled::gpu::OnGpu> {
    use bundled::gpu::{Net, OnGpu};
    let ordinal = gpu.ordinal() as usize;
    let dev = tensorport_dfdx::dfdx::prelude::Cuda::try_build(ordinal, model.seed)
        .map_err(|e| Error::Other(format!("cannot start dfdx on CUDA device {ordinal}: {e:?}")))?;
    let precision = model.precision.unwrap_or_default();
    let net = match tensorport_cudnn::ConvNet::cudnn_version() {
        Ok(_) => {
            let layout = tensorport_cudnn::Layout::preferred(precision, model.max_batch);
            let mut m = model.cudnn_model(&dev, gpu, (precision, layout))?;
            m.prepare(model.max_batch)?;
            Net::Cudnn(Box::new(m))
        }
        Err(e) if precision != tensorport_cudnn::Precision::F32 => {
            return Err(ConfigError::PrecisionNeedsCudnn(precision, e).into());
        }
        Err(e) => {
            tracing::warn!("{e}; the model runs on dfdx's own CUDA kernels, several times slower");
            Net::Dfdx(Box::new(model.dfdx_model(&dev)?))
        }
    };
    Ok(OnGpu {
        dev,
        net,
        shape: model.config.input_shape(),
        in_flight: None,
    })
}
