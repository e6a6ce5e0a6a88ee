//! `tensorport serve`: the inference process.

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport::{DeviceImporter, PinHook, Request, Server, ServerConfig};
use tensorport_dfdx::dfdx::prelude::{Cpu, Device};
use tensorport_dfdx::{scores_to_bytes, stack_images, Classify, ImageClassifier, Stacked};

use crate::common::{CliError, CliResult, ModelArgs, SocketArg};

/// Serve a dfdx image classifier. Producers connect to the socket, write [3, S, S] f32 images
/// into shared memory, and get the class scores back. Requests are batched: up to --max-batch, or
/// whatever arrived within --max-wait-ms of the first. SIGINT/SIGTERM drains (finishes the work in
/// flight, refuses new producers, exits once they have left); a second signal exits at once.
/// Prints `ready <socket>` on stdout once it listens.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub socket: SocketArg,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Slots per producer, unless the producer asks otherwise.
    #[arg(long, default_value_t = 8)]
    pub slots: u32,
    /// Bytes per slot, unless the producer asks otherwise [default: one input image].
    #[arg(long)]
    pub slot_size: Option<u64>,
    /// Most producers at once.
    #[arg(long, default_value_t = 64)]
    pub max_sessions: u32,
    /// Memory all producers' pools may reserve together, e.g. 8G [default: a quarter of
    /// physical memory]. A producer whose pool does not fit is refused (MemoryBudget) until
    /// another leaves.
    #[arg(long, value_name = "SIZE", value_parser = crate::common::parse_size)]
    pub memory_budget: Option<u64>,
    /// Memory one producer's pool may reserve, e.g. 1G [default: a quarter of the budget].
    #[arg(long, value_name = "SIZE", value_parser = crate::common::parse_size)]
    pub max_session_memory: Option<u64>,
    /// Threads for the model's matrix products [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Microseconds to poll the producers' queues before sleeping on their doorbells: more costs
    /// CPU while idle and saves the wake-up (tens of µs) when work comes soon.
    #[arg(long, default_value_t = 50)]
    pub spin_us: u64,
    /// Serve Prometheus metrics on http://ADDR/metrics (e.g. 127.0.0.1:9464; port 0 picks a free
    /// one): the counters of `ctl status`, batch sizes, model time per batch and request service
    /// time histograms. Prints `metrics http://…/metrics` on stdout after `ready`.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Model workers: threads that each take batches from their own share of the producers and
    /// run their own copy of the model (on the GPU: each its own dfdx device and stream, since a
    /// dfdx `Cuda` device cannot be shared between threads). More than one helps when one
    /// thread's per-batch work, not the device, is the bound.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// A sink instead of a model: answer every request at once with an empty result, whatever
    /// its dtype and shape (the transport's checks still apply). For measuring producers and the
    /// transport, e.g. Python producers of any tensor (bench/python_ipc.py --server rust); set
    /// the slots with --slot-size.
    #[arg(long)]
    pub sink: bool,
    /// GPU producers' device tensors (--device cuda): milliseconds a batch waits for a
    /// producer's "ready" fence. A tensor still not signalled then is failed (FenceTimeout) and
    /// its producer's session ended, so a producer that never signals cannot stall the others.
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    pub fence_timeout_ms: u64,
}

pub fn run(a: Args) -> CliResult<ExitCode> {
    // A pool over the file size limit is then one producer refused, not the server killed.
    crate::common::catch_sigxfsz();
    if let Some(n) = a.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
            .map_err(|e| CliError::new(format!("cannot size the thread pool: {e}")))?;
    }
    if a.model.max_batch == 0 {
        return Err(CliError::usage("--max-batch must be at least 1"));
    }
    a.model.check()?;
    if let crate::common::Device::Cuda(n) = a.model.device {
        return run_cuda(a, n);
    }
    let model = a.model.clone();
    serve_on(
        a,
        Hooks::default(),
        &|| Ok((Cpu::default(), Box::new(stack_images) as Box<StackFn<Cpu>>)),
        &move |dev: &Cpu| load_dfdx(dev, &model),
    )
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_a: Args, _ordinal: u32) -> CliResult<ExitCode> {
    Err(CliError::usage(
        "this tensorport was built without CUDA; rebuild with `--features cuda` (see docs/operations.md), or use --device cpu",
    ))
}

/// The GPU server: pools are registered with the device (pinned), each request's slot is copied
/// by DMA into a device tensor, the batch is stacked on the device, and the model runs there.
#[cfg(feature = "cuda")]
fn run_cuda(a: Args, ordinal: u32) -> CliResult<ExitCode> {
    use tensorport_dfdx::dfdx::prelude::Cuda;
    let cuda = |e: tensorport_cuda::Error| CliError::new(e.to_string());
    // No driver, or no such device: configuration a restart cannot fix (exit 2; the farm stops).
    let gpu = tensorport_cuda::Gpu::open(ordinal as i32).map_err(|e| match e {
        tensorport_cuda::Error::NoDriver | tensorport_cuda::Error::NoDevice(..) => {
            CliError::usage(format!("{e}, or use --device cpu"))
        }
        e => cuda(e),
    })?;
    let seed = a.model.seed;
    let fence_timeout = Duration::from_millis(a.fence_timeout_ms.max(1));
    let hooks = Hooks {
        pin: Some(Arc::new(tensorport_cuda::CudaPin::new(gpu.clone()))),
        device: Some(Arc::new(
            tensorport_cuda::CudaImporter::new(gpu.clone()).with_fence_timeout(fence_timeout),
        )),
    };
    // GPU producers' tensors of a batch are fenced and copied together; the copy kernel is
    // compiled once and launched from every worker (launches are thread-safe).
    let gatherer = Arc::new(tensorport_cuda::Gatherer::new(&gpu));
    let model = a.model.clone();
    let max_batch = a.model.max_batch;
    let model_gpu = gpu.clone();
    let load = move |dev: &Cuda| -> CliResult<Model<Cuda>> {
        load_cuda(dev, &model_gpu, &model, max_batch)
    };
    // Each worker thread builds its own dfdx device and copy stream (neither may be shared).
    serve_on(
        a,
        hooks,
        &move || {
            let dev = Cuda::try_build(ordinal as usize, seed).map_err(|e| {
                CliError::new(format!("cannot start dfdx on CUDA device {ordinal}: {e:?}"))
            })?;
            let stream = tensorport_cuda::Stream::new(&gpu).map_err(cuda)?;
            // u8 images are normalised on the GPU with the producers' table.
            let norm =
                tensorport_cuda::GpuNormaliser::new(&gpu, tensorport_dfdx::normaliser().table())
                    .map_err(cuda)?;
            let norm = std::sync::Mutex::new(norm);
            let gatherer = gatherer.clone();
            let stack: Box<StackFn<Cuda>> = Box::new(move |dev: &Cuda, reqs: &[Request], shape| {
                let mut norm = norm.lock().unwrap_or_else(|p| p.into_inner());
                tensorport_dfdx::gather_on_device(
                    dev,
                    &stream,
                    &mut norm,
                    &gatherer,
                    reqs,
                    shape,
                    fence_timeout,
                )
            });
            Ok((dev, stack))
        },
        &load,
    )
}

/// Builds a batch's model input from its requests (on the CPU: one copy; on the GPU: DMA).
type StackFn<D> = dyn Fn(&D, &[Request], [usize; 3]) -> Stacked<D>;

/// What the CUDA server plugs into the transport: pool pinning, device-buffer import.
#[derive(Default)]
struct Hooks {
    pin: Option<Arc<dyn PinHook>>,
    device: Option<Arc<dyn DeviceImporter>>,
}

/// Makes one worker's device and batch stacker (called on the worker's own thread).
type WorkerFn<D> = dyn Fn() -> CliResult<(D, Box<StackFn<D>>)> + Sync;

/// A worker's model.
type Model<D> = Box<dyn Classify<D>>;

/// Loads one worker's model on its device (on the worker's own thread).
type LoadFn<D> = dyn Fn(&D) -> CliResult<Model<D>> + Sync;

/// The bundled model on dfdx's own kernels (the CPU model; on the GPU where cuDNN is missing).
fn load_dfdx<D: Device<f32>>(dev: &D, model: &ModelArgs) -> CliResult<Model<D>>
where
    ImageClassifier<D>: 'static,
{
    Ok(Box::new(model.dfdx_model(dev)?))
}

fn serve_on<D: Device<f32>>(
    a: Args,
    hooks: Hooks,
    make: &WorkerFn<D>,
    load_model: &LoadFn<D>,
) -> CliResult<ExitCode> {
    let cfg = a.model.config();
    let workers = a.workers.max(1);
    // The first worker's device is made here, so a model that cannot load fails before the
    // socket listens (exit 2 in the farm's terms), not in a thread.
    let first = make()?;
    let load = |dev: &D| -> CliResult<Option<Model<D>>> {
        Ok(match a.model.model {
            _ if a.sink => None,
            crate::common::ModelKind::None => None,
            crate::common::ModelKind::Classifier => Some(load_model(dev)?),
        })
    };
    let first_model = load(&first.0)?;
    let shape = cfg.input_shape();
    let image_bytes = (shape.iter().product::<usize>() * 4) as u64;
    let path = a.socket.path();
    let mut sc = ServerConfig::new(&path);
    sc.slots_per_session = a.slots.max(1);
    sc.slot_size = a.slot_size.unwrap_or(image_bytes);
    sc.max_sessions = a.max_sessions;
    sc.memory_budget = a.memory_budget.unwrap_or(0);
    sc.max_session_bytes = a.max_session_memory.unwrap_or(0);
    sc.spin = Duration::from_micros(a.spin_us);
    sc.pin = hooks.pin;
    sc.device = hooks.device;
    sc.consumers = workers;
    let server = Arc::new(Server::bind(sc)?);
    let metrics = match &a.metrics {
        Some(addr) => Some(crate::metrics::start(addr, server.clone())?),
        None => None,
    };
    let stop = crate::common::stop_flag();
    println!("ready {}", path.display());
    if let Some((_, at)) = &metrics {
        println!("metrics http://{at}/metrics");
    }
    std::io::stdout().flush().ok();
    let metrics = metrics.map(|(m, _)| m);
    tracing::info!(
        image_size = cfg.image_size,
        classes = cfg.classes,
        max_batch = a.model.max_batch,
        workers,
        sink = a.sink,
        "serving the model"
    );
    // A sink answers what it has at once.
    let max_wait = Duration::from_millis(if a.sink { 0 } else { a.model.max_wait_ms });
    let started = Instant::now();
    let images = std::sync::atomic::AtomicU64::new(0);
    let shared = Workers {
        server: &server,
        max_batch: a.model.max_batch,
        max_wait,
        sink: a.sink,
        shape,
        stop: &stop,
        metrics: &metrics,
        images: &images,
    };
    let work = |dev: D, stack: Box<StackFn<D>>, mut model: Option<Model<D>>| {
        shared.run(&dev, &*stack, model.as_mut())
    };
    std::thread::scope(|s| -> CliResult<()> {
        let others: Vec<_> = (1..workers)
            .map(|_| {
                s.spawn(|| -> CliResult<()> {
                    let (dev, stack) = make()?;
                    let model = load(&dev)?;
                    work(dev, stack, model)
                })
            })
            .collect();
        let mine = work(first.0, first.1, first_model);
        for t in others {
            t.join()
                .map_err(|_| CliError::new("a model worker panicked"))??;
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
    Ok(ExitCode::SUCCESS)
}

/// A batch whose scores the model is still computing: who to answer, row by row.
struct InFlight {
    responders: Vec<Option<tensorport::Responder>>,
    used: Vec<usize>,
    size: usize,
    taken: Instant,
    model_started: Instant,
}

/// Answers `batch`'s requests from `scores` (row `k` for request `used[k]`), or each with the
/// model's error, and records the batch.
fn answer(
    batch: InFlight,
    scores: tensorport_dfdx::Result<Vec<Vec<f32>>>,
    images: &std::sync::atomic::AtomicU64,
    metrics: &Option<crate::metrics::Metrics>,
) {
    let InFlight {
        mut responders,
        used,
        size,
        taken,
        model_started,
    } = batch;
    let model_time = model_started.elapsed();
    match scores {
        Ok(scores) => {
            for (row, i) in scores.iter().zip(used) {
                if let Some(r) = responders[i].take() {
                    let _ = r.respond(&scores_to_bytes(row));
                }
                images.fetch_add(1, Ordering::Relaxed);
            }
        }
        // The device failed: this batch's requests get the error; a device that stays broken
        // fails every batch the same way.
        Err(e) => {
            tracing::error!("the model failed on a batch of {size}: {e}");
            for i in used {
                if let Some(r) = responders[i].take() {
                    let _ = r.fail(e.to_string());
                }
            }
        }
    }
    if let Some(m) = metrics {
        m.record_batch(size, model_time, taken.elapsed());
    }
}

/// What the model workers share: the server, the batching policy and the counters.
struct Workers<'a> {
    server: &'a Server,
    max_batch: usize,
    /// How long a batch waits for more requests after its first.
    max_wait: Duration,
    /// Answer at once, without a model.
    sink: bool,
    /// The model's input `[C, H, W]`.
    shape: [usize; 3],
    stop: &'a std::sync::atomic::AtomicBool,
    metrics: &'a Option<crate::metrics::Metrics>,
    /// Images answered, all workers together.
    images: &'a std::sync::atomic::AtomicU64,
}

impl Workers<'_> {
    /// One model worker: takes batches (from its share of the producers when there are several
    /// workers), runs the model, answers, until the server has drained. Where the model runs on a
    /// device of its own (cuDNN), the next batch is taken and gathered while the device runs the
    /// last one, whose answers go out once the next is on its way.
    fn run<D: Device<f32>>(
        &self,
        dev: &D,
        stack: &StackFn<D>,
        mut model: Option<&mut Model<D>>,
    ) -> CliResult<()> {
        let Workers {
            server,
            max_batch,
            max_wait,
            sink,
            shape,
            stop,
            metrics,
            images,
        } = *self;
        let mut draining = false;
        let mut in_flight: Option<InFlight> = None;
        let finish = |m: &mut Option<&mut Model<D>>, batch: Option<InFlight>| {
            if let (Some(batch), Some(m)) = (batch, m.as_deref_mut()) {
                let scores = m.collect();
                answer(batch, scores, images, metrics);
            }
        };
        loop {
            if stop.load(Ordering::SeqCst) && !draining {
                draining = true;
                server.drain();
            }
            // With a batch on the device, take only what is already queued: its answers wait for
            // this call.
            let (first, more) = match in_flight {
                Some(_) => (Duration::ZERO, Duration::ZERO),
                None => (Duration::from_millis(100), max_wait),
            };
            let batch = match server.recv_batch(max_batch, first, more) {
                Ok(b) => b,
                Err(tensorport::Error::Stopped) => break,
                Err(e) => {
                    finish(&mut model, in_flight.take());
                    return Err(e.into());
                }
            };
            if batch.is_empty() {
                finish(&mut model, in_flight.take());
                continue;
            }
            let taken = Instant::now();
            let size = batch.len();
            if sink {
                let mut answers: Vec<_> = batch.into_iter().map(|r| (r, [0u8; 0])).collect();
                let _ = server.respond_all(&mut answers);
                images.fetch_add(size as u64, Ordering::Relaxed);
                if let Some(m) = metrics {
                    m.record_batch(size, Duration::ZERO, taken.elapsed());
                }
                continue;
            }
            let stacked = stack(dev, &batch, shape);
            // The batch owns a copy of the pixels now: give the slots back before the model runs.
            let mut responders: Vec<Option<tensorport::Responder>> =
                batch.into_iter().map(|r| Some(r.release())).collect();
            // (Before the results: a late device tensor's row is in the input, but it gets this.)
            for (i, e) in stacked.rejected {
                tracing::warn!("{e}");
                if let Some(r) = responders[i].take() {
                    let _ = match e {
                        // The producer broke the hand-off: its session ends.
                        tensorport_dfdx::Error::FenceTimeout { .. } => r.fail_and_end_session(
                            tensorport::wire::ErrorCode::FenceTimeout,
                            e.to_string(),
                        ),
                        e => r.fail(e.to_string()),
                    };
                }
            }
            // This batch is on the device: the last one's scores are wanted now.
            finish(&mut model, in_flight.take());
            let Some(x) = stacked.input else {
                if let Some(m) = &metrics {
                    m.record_batch(size, Duration::ZERO, taken.elapsed());
                }
                continue;
            };
            let batch = InFlight {
                responders,
                used: stacked.used,
                size,
                taken,
                model_started: Instant::now(),
            };
            match model.as_deref_mut() {
                Some(m) => match m.submit(x) {
                    Ok(tensorport_dfdx::Submitted::InFlight) => in_flight = Some(batch),
                    Ok(tensorport_dfdx::Submitted::Ready(scores)) => {
                        answer(batch, Ok(scores), images, metrics)
                    }
                    Err(e) => answer(batch, Err(e), images, metrics),
                },
                // No model: the batch is on the device; that was the job.
                None => {
                    let rows = batch.used.len();
                    answer(batch, Ok(vec![Vec::new(); rows]), images, metrics);
                }
            }
        }
        finish(&mut model, in_flight.take());
        Ok(())
    }
}

/// The GPU model: cuDNN's convolutions at `--precision`, their algorithms measured for
/// `--max-batch` before the socket listens; dfdx's own kernels (fp32, several times slower)
/// where cuDNN cannot be loaded, with a warning that says how to get it.
#[cfg(feature = "cuda")]
fn load_cuda(
    dev: &tensorport_dfdx::dfdx::prelude::Cuda,
    gpu: &Arc<tensorport_cuda::Gpu>,
    model: &ModelArgs,
    max_batch: usize,
) -> CliResult<Model<tensorport_dfdx::dfdx::prelude::Cuda>> {
    let precision = model.precision.unwrap_or_default().precision();
    if let Err(e) = tensorport_cuda::ConvNet::cudnn_version() {
        if precision != tensorport_cuda::Precision::F32 {
            return Err(CliError::usage(format!("--precision {precision}: {e}")));
        }
        tracing::warn!("{e}; the model runs on dfdx's own CUDA kernels, several times slower");
        return load_dfdx(dev, model);
    }
    let layout = tensorport_cuda::Layout::preferred(precision, max_batch);
    let mut m = model.cudnn_model(dev, gpu, (precision, layout))?;
    m.prepare(max_batch)?;
    Ok(Box::new(m))
}
