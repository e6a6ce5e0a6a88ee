//! The inference server: binds the socket, loads the model once per worker (before it
//! listens, so a model that cannot load fails at once), and runs a [`BatchLoop`] per worker
//! until a signal drains it.
//!
//! On the GPU, pools are registered with the device (pinned), each request's slot is copied by
//! DMA into a device tensor (or a GPU producer's device tensor is fenced and copied), the batch
//! is stacked on the device, and the model runs there: cuDNN at the configured precision, or
//! dfdx's own kernels where cuDNN cannot be loaded.

mod batch;
#[cfg(feature = "cuda")]
mod cuda_batch;
pub mod metrics;
mod onnx;
mod own;

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport::{DeviceImporter, PinHook, Server, ServerConfig};
use tensorport_dfdx::dfdx::prelude::{Cpu, Device as DfdxDevice};
use tensorport_dfdx::ImageClassifier;

pub use batch::{BatchLoop, Batcher, CpuBatcher, Model, Rejection, Stacked};
#[cfg(feature = "cuda")]
pub use cuda_batch::CudaBatcher;
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
    // An ONNX model decides the image size; a model that does not fit fails here, before the
    // socket listens.
    let mut cfg = cfg.clone();
    cfg.model.resolve()?;
    let cfg = &cfg;
    if let Device::Cuda(n) = cfg.model.device {
        return run_cuda(cfg, n, stop);
    }
    let model = cfg.model.clone();
    let threads = cfg.threads;
    serve_on(
        cfg,
        stop,
        Hooks::default(),
        &cpu_worker,
        &move |dev: &Cpu| match &model.kind {
            ModelKind::Onnx(path) => onnx::load_on_cpu(path, model.config.image_size, threads),
            _ => load_dfdx(dev, &model),
        },
    )
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
    serve_on(
        &cfg,
        stop,
        Hooks::default(),
        &cpu_worker,
        &|_: &Cpu| -> Result<Model<Cpu>> {
            let model = load().map_err(|e| Error::Other(format!("cannot load the model: {e}")))?;
            Ok(Box::new(own::Own(model)))
        },
    )
}

/// A worker on the CPU: its device and batcher.
fn cpu_worker() -> Result<(Cpu, Box<dyn Batcher<Cpu>>)> {
    Ok((Cpu::default(), Box::new(CpuBatcher)))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &ServeConfig, _: u32, _: &Stop) -> Result<()> {
    Err(ConfigError::NoCudaBuild.into())
}

#[cfg(feature = "cuda")]
fn run_cuda(cfg: &ServeConfig, ordinal: u32, stop: &Stop) -> Result<()> {
    use tensorport_dfdx::dfdx::prelude::Cuda;
    // No driver, or no such device: configuration a restart cannot fix.
    let gpu = tensorport_cuda::Gpu::open(ordinal as i32).map_err(|e| match e {
        tensorport_cuda::Error::NoDriver | tensorport_cuda::Error::NoDevice(..) => {
            Error::Config(ConfigError::NoGpu(e))
        }
        e => Error::Cuda(e),
    })?;
    let seed = cfg.model.seed;
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
    let model = cfg.model.clone();
    let model_gpu = gpu.clone();
    let load = move |dev: &Cuda| -> Result<Model<Cuda>> { load_cuda(dev, &model_gpu, &model) };
    // Each worker thread builds its own dfdx device and batcher (neither may be shared).
    serve_on(
        cfg,
        stop,
        hooks,
        &move || {
            let dev = Cuda::try_build(ordinal as usize, seed).map_err(|e| {
                Error::Other(format!("cannot start dfdx on CUDA device {ordinal}: {e:?}"))
            })?;
            let batcher: Box<dyn Batcher<Cuda>> =
                Box::new(CudaBatcher::new(&gpu, gatherer.clone(), fence_timeout)?);
            Ok((dev, batcher))
        },
        &load,
    )
}

/// What the CUDA server plugs into the transport: pool pinning, device-buffer import.
#[derive(Default)]
struct Hooks {
    pin: Option<Arc<dyn PinHook>>,
    device: Option<Arc<dyn DeviceImporter>>,
}

/// Makes one worker's device and batcher (called on the worker's own thread).
type WorkerFn<D> = dyn Fn() -> Result<(D, Box<dyn Batcher<D>>)> + Sync;

/// Loads one worker's model on its device (on the worker's own thread).
type LoadFn<'a, D> = dyn Fn(&D) -> Result<Model<D>> + Sync + 'a;

/// The bundled model on dfdx's own kernels (the CPU model; on the GPU where cuDNN is missing).
fn load_dfdx<D: DfdxDevice<f32>>(dev: &D, model: &ModelOptions) -> Result<Model<D>>
where
    ImageClassifier<D>: 'static,
{
    Ok(Box::new(model.dfdx_model(dev)?))
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

fn serve_on<D: DfdxDevice<f32>>(
    cfg: &ServeConfig,
    stop: &Stop,
    hooks: Hooks,
    make: &WorkerFn<D>,
    load_model: &LoadFn<'_, D>,
) -> Result<()> {
    let mc = cfg.model.config;
    let workers = cfg.workers.max(1);
    // The first worker's device is made here, so a model that cannot load fails before the
    // socket listens, not in a thread.
    let first = make()?;
    let load = |dev: &D| -> Result<Option<Model<D>>> {
        Ok(match cfg.model.kind {
            _ if cfg.sink => None,
            ModelKind::None => None,
            ModelKind::Classifier | ModelKind::Onnx(_) => Some(load_model(dev)?),
        })
    };
    let first_model = load(&first.0)?;
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
    let work = |(dev, mut batcher): (D, Box<dyn Batcher<D>>), mut model: Option<Model<D>>| {
        shared.run(&dev, &mut *batcher, model.as_mut())
    };
    std::thread::scope(|s| -> Result<()> {
        let others: Vec<_> = (1..workers)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    let worker = make()?;
                    let model = load(&worker.0)?;
                    work(worker, model)
                })
            })
            .collect();
        let mine = work(first, first_model);
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

/// The GPU model: cuDNN's convolutions at the configured precision, their algorithms measured
/// for the largest batch before the socket listens; dfdx's own kernels (fp32, several times
/// slower) where cuDNN cannot be loaded, with a warning that says so.
#[cfg(feature = "cuda")]
fn load_cuda(
    dev: &tensorport_dfdx::dfdx::prelude::Cuda,
    gpu: &Arc<tensorport_cuda::Gpu>,
    model: &ModelOptions,
) -> Result<Model<tensorport_dfdx::dfdx::prelude::Cuda>> {
    if let ModelKind::Onnx(path) = &model.kind {
        let provider = model.ort_provider.on(gpu.ordinal() as u32);
        return onnx::load_on_cuda(
            path,
            model.config.image_size,
            model.max_batch,
            gpu,
            (provider, model.tf32),
        );
    }
    let precision = model.precision.unwrap_or_default();
    if let Err(e) = tensorport_cudnn::ConvNet::cudnn_version() {
        if precision != tensorport_cudnn::Precision::F32 {
            return Err(ConfigError::PrecisionNeedsCudnn(precision, e).into());
        }
        tracing::warn!("{e}; the model runs on dfdx's own CUDA kernels, several times slower");
        return load_dfdx(dev, model);
    }
    let layout = tensorport_cudnn::Layout::preferred(precision, model.max_batch);
    let mut m = model.cudnn_model(dev, gpu, (precision, layout))?;
    m.prepare(model.max_batch)?;
    Ok(Box::new(m))
}
