//! `tensorport gpu`: the CUDA probe and the host-to-device benchmark.

use std::process::ExitCode;

use crate::common::{CliError, CliResult};

/// Inspect the machine's CUDA support.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand, Debug)]
pub enum What {
    /// Driver version, devices, compute capability, host registration, VMM/POSIX-fd and IPC support.
    Probe,
    /// Host-to-device bandwidth from a registered tensorport pool, from cuMemAllocHost memory (the
    /// pinned ceiling) and from pageable memory, measured in one run.
    BenchH2d {
        /// MiB per copy.
        #[arg(long, default_value_t = 256)]
        mib: usize,
        /// Copies timed per source.
        #[arg(long, default_value_t = 20)]
        iters: usize,
        /// Device ordinal.
        #[arg(long, default_value_t = 0)]
        device: i32,
    },
    /// CUDA IPC hand-off, producer process to usable in the server's stream: a producer fills one
    /// of 4 device buffers on its GPU stream and hands it over; the server waits on its event,
    /// copies device-to-device, releases it (with an event), and synchronises. Measured like
    /// PyTorch's torch.multiprocessing benchmark (bench/peers/torch_ipc.py cuda).
    BenchIpc {
        /// Hand-offs per size.
        #[arg(long, default_value_t = 2000)]
        handoffs: usize,
        /// Tensor sizes in bytes (default: 4 KiB, and a [32,3,224,224] f32 batch).
        #[arg(long, value_delimiter = ',', default_value = "4096,19267584")]
        bytes: Vec<usize>,
        /// Fences to measure: event (interprocess CUDA events), timeline (semaphores in IPC
        /// memory), or both; or staged (no device hand-off: through host memory, to compare).
        #[arg(long, value_enum, default_value_t = FenceArg::Both)]
        fence: FenceArg,
        /// What the producer's GPU does per hand-off: fill the tensor (as PyTorch's benchmark
        /// does), or nothing (the tensor is ready; only the hand-off is measured).
        #[arg(long, value_enum, default_value_t = Work::Fill)]
        producer_work: Work,
        /// The GPU the producer works on (the server uses GPU 0): another one measures the
        /// cross-GPU hand-off (IPC opened with peer access, fences across the two devices).
        #[arg(long, default_value_t = 0, value_name = "ORDINAL")]
        producer_gpu: i32,
        /// The server takes up to N hand-offs at once (those that have arrived), waits on each
        /// one's fence, copies each, and synchronises its stream once for them all, as a server
        /// that batches does; 1: one at a time, a synchronisation each. Device hand-offs only.
        #[arg(long, default_value_t = 1, value_name = "N")]
        server_batch: usize,
        /// When the server answers: after synchronising its stream once per batch (each copy
        /// has run), or at once (none): the wait, copy and release are enqueued and the release
        /// fence alone orders the producer's reuse after the copy, so the host never waits for
        /// the GPU; the stream is synchronised once at the end, inside the timed span.
        #[arg(long, value_enum, default_value_t = ServerSync::Batch)]
        server_sync: ServerSync,
        /// How the server fences and copies the device tensors of a batch: each one alone
        /// (wait, copy, release: three driver calls per tensor), or all together
        /// (`tensorport_cuda::Gatherer`: one batched wait, one kernel launch for the copies,
        /// one batched release).
        #[arg(long, value_enum, default_value_t = ServerFences::Gather)]
        server_fences: ServerFences,
        /// Device buffers in the producer's pool (how many hand-offs may be in flight).
        #[arg(long, default_value_t = 4, value_name = "N")]
        pool: usize,
        /// (internal) run as the benchmark's producer on this socket.
        #[arg(long, hide = true)]
        producer_socket: Option<std::path::PathBuf>,
    },
}

/// When `bench-ipc`'s server answers a batch of device hand-offs.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerSync {
    /// After one synchronisation of its stream for the batch.
    Batch,
    /// At once, the GPU-ordered release standing for the synchronisation.
    None,
}

/// How `bench-ipc`'s server fences and copies a batch of device tensors.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerFences {
    /// Each tensor alone: wait, copy, release.
    Each,
    /// The batch together (`tensorport_cuda::Gatherer`).
    Gather,
}

/// Which fences `bench-ipc` measures.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceArg {
    /// Interprocess CUDA events.
    Event,
    /// Semaphores in the IPC memory.
    Timeline,
    /// Both, one after the other.
    Both,
    /// No device hand-off, for comparison: the producer copies each tensor from its GPU into
    /// its pool slot (pinned in its context), the server copies it from the slot (pinned in
    /// its context) onto GPU 0: the path staged through host memory.
    Staged,
}

/// What the benchmark's producer GPU does per hand-off.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Fills the tensor, as PyTorch's benchmark does.
    Fill,
    /// Nothing: only the hand-off is measured.
    None,
}

fn cuda(e: tensorport_cuda::Error) -> CliError {
    CliError::new(e.to_string())
}

pub fn run(a: Args) -> CliResult<ExitCode> {
    match a.what {
        What::Probe => {
            let c = tensorport_cuda::probe().map_err(cuda)?;
            println!(
                "driver: CUDA {}.{}",
                c.driver_version / 1000,
                c.driver_version % 1000 / 10
            );
            for d in &c.devices {
                println!(
                    "device {}: {}, compute {}.{}, {:.1} GiB; host register {}; VMM {}; POSIX-fd handles {}; legacy IPC {}",
                    d.ordinal,
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.total_mem as f64 / (1u64 << 30) as f64,
                    yes(d.host_register),
                    yes(d.vmm),
                    yes(d.posix_fd_handles),
                    yes(d.legacy_ipc)
                );
            }
            if c.devices.is_empty() {
                return Err(CliError::new("the driver sees no CUDA device"));
            }
        }
        What::BenchH2d { mib, iters, device } => {
            let gpu = tensorport_cuda::Gpu::open(device).map_err(cuda)?;
            let r = tensorport_cuda::bench_h2d(&gpu, mib << 20, iters.max(1)).map_err(cuda)?;
            println!(
                "host-to-device, {} MiB per copy, {} copies each (CUDA events):",
                mib, r.iters
            );
            println!(
                "  registered tensorport pool  {:>6.1} GB/s  ({:.0}% of cuMemAllocHost; registering took {:.1} ms)",
                r.registered_pool_gbps,
                100.0 * r.registered_pool_gbps / r.alloc_host_gbps,
                r.register_ms
            );
            println!(
                "  cuMemAllocHost (pinned)     {:>6.1} GB/s",
                r.alloc_host_gbps
            );
            println!(
                "  pageable memory             {:>6.1} GB/s",
                r.pageable_gbps
            );
        }
        What::BenchIpc {
            handoffs,
            bytes,
            fence,
            producer_work,
            producer_gpu,
            server_batch,
            server_sync,
            server_fences,
            pool,
            producer_socket,
        } => match producer_socket {
            Some(sock) => {
                let gpu = tensorport_cuda::Gpu::open(producer_gpu).map_err(cuda)?;
                if fence == FenceArg::Staged {
                    staged_producer(&gpu, &sock, handoffs, bytes[0], producer_work)?
                } else {
                    ipc_producer(&gpu, &sock, handoffs, bytes[0], fence, producer_work, pool)?
                }
            }
            None => {
                let gpu = tensorport_cuda::Gpu::open(0).map_err(cuda)?;
                let batch = server_batch.max(1);
                println!(
                    "CUDA IPC hand-off, producer process on GPU {producer_gpu} -> usable in the server's stream on GPU 0 (pool of {pool} buffers; the server takes up to {batch} at once, fences and copies them {}, and answers {}):",
                    match server_fences {
                        ServerFences::Each => "one by one",
                        ServerFences::Gather => "together",
                    },
                    match server_sync {
                        ServerSync::Batch => "after synchronising its stream",
                        ServerSync::None => "without waiting for its stream",
                    }
                );
                let fences = match fence {
                    FenceArg::Both => vec![FenceArg::Event, FenceArg::Timeline],
                    f => vec![f],
                };
                for f in fences {
                    for &b in &bytes {
                        ipc_server(
                            &gpu,
                            handoffs,
                            b,
                            f,
                            producer_work,
                            producer_gpu,
                            batch,
                            server_sync,
                            server_fences,
                            pool,
                        )?;
                    }
                }
            }
        },
    }
    Ok(ExitCode::SUCCESS)
}

fn ipc_producer(
    gpu: &std::sync::Arc<tensorport_cuda::Gpu>,
    sock: &std::path::Path,
    handoffs: usize,
    bytes: usize,
    fence: FenceArg,
    work: Work,
    pool: usize,
) -> CliResult<()> {
    use std::time::Duration;
    use tensorport::{DType, TensorSpec};
    use tensorport_cuda::{Fence, GpuProducer};
    let fence = match fence {
        FenceArg::Timeline => Fence::Timeline,
        _ => Fence::Event,
    };
    let mut p = GpuProducer::connect_with(sock, "bench-ipc", gpu, pool.max(1), bytes, fence)
        .map_err(cuda)?;
    let words_bytes = bytes / 4 * 4;
    let spec = TensorSpec::new(DType::U8, &[bytes as u64]);
    let mut tr = StepTrace::new(["acquire", "fill", "submit", "results"]);
    for i in 0..handoffs {
        tr.start();
        let b = p.acquire(Duration::from_secs(30)).map_err(cuda)?;
        tr.step(0);
        if work == Work::Fill {
            p.buffer(b)
                .fill_u32_range_async(0, words_bytes, i as u32, p.stream())
                .map_err(cuda)?;
        }
        tr.step(1);
        p.submit(b, &spec).map_err(cuda)?;
        tr.step(2);
        while p.producer().try_recv_result()?.is_some() {}
        tr.step(3);
    }
    while p.producer().in_flight() > 0 {
        p.producer().recv_result(Duration::from_secs(30))?;
    }
    tr.report("producer", handoffs);
    Ok(())
}

/// The producer of `--fence staged`: fills a device buffer, copies it into a pinned slot,
/// submits the host tensor.
fn staged_producer(
    gpu: &std::sync::Arc<tensorport_cuda::Gpu>,
    sock: &std::path::Path,
    handoffs: usize,
    bytes: usize,
    work: Work,
) -> CliResult<()> {
    use std::time::Duration;
    use tensorport::{DType, PinHook, Producer, ProducerConfig, TensorSpec};
    let mut cfg = ProducerConfig::new("bench-staged");
    cfg.slots = 4;
    cfg.slot_size = bytes as u64;
    let mut p = Producer::connect(sock, cfg)?;
    let stream = tensorport_cuda::Stream::new(gpu).map_err(cuda)?;
    let src = tensorport_cuda::DeviceBuffer::new(gpu, bytes).map_err(cuda)?;
    let pool = p.loan(Duration::from_secs(30))?.mapping();
    // SAFETY: `pool` holds the mapping and is declared before `_pinned`, so the registration is
    // dropped (unpinned) before the mapping can go.
    let _pinned = unsafe {
        tensorport_cuda::CudaPin::new(gpu.clone())
            .pin(pool.mapping().as_ptr(), pool.mapping().len())
    }
    .map_err(CliError::new)?;
    let spec = TensorSpec::new(DType::U8, &[bytes as u64]);
    for i in 0..handoffs {
        let mut lease = p.lease(Duration::from_secs(30))?;
        if work == Work::Fill {
            src.fill_u32_range_async(0, bytes / 4 * 4, i as u32, &stream)
                .map_err(cuda)?;
        }
        stream.synchronize().map_err(cuda)?;
        src.copy_to_host(&mut lease.bytes_mut()[..bytes])
            .map_err(cuda)?;
        lease.submit(&spec)?;
        while p.try_recv_result()?.is_some() {}
    }
    while p.in_flight() > 0 {
        p.recv_result(Duration::from_secs(30))?;
    }
    Ok(())
}

// The benchmark's settings, passed on as they came from the command line.
#[allow(clippy::too_many_arguments)]
fn ipc_server(
    gpu: &std::sync::Arc<tensorport_cuda::Gpu>,
    handoffs: usize,
    bytes: usize,
    fence: FenceArg,
    work: Work,
    producer_gpu: i32,
    batch: usize,
    sync: ServerSync,
    fences: ServerFences,
    pool: usize,
) -> CliResult<()> {
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let tmp = tempfile::Builder::new()
        .prefix("tensorport-bench-")
        .tempdir()?;
    let sock = tmp.path().join("tp.sock");
    let mut cfg = tensorport::ServerConfig::new(&sock);
    cfg.device = Some(Arc::new(tensorport_cuda::CudaImporter::new(gpu.clone())));
    let staged = fence == FenceArg::Staged;
    if staged {
        cfg.pin = Some(Arc::new(tensorport_cuda::CudaPin::new(gpu.clone())));
        cfg.slot_size = bytes as u64;
        cfg.max_slot_size = cfg.max_slot_size.max(bytes as u64);
    }
    let server = tensorport::Server::bind(cfg)?;
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args([
            "--log",
            "warn",
            "gpu",
            "bench-ipc",
            "--handoffs",
            &handoffs.to_string(),
        ])
        .args([
            "--bytes",
            &bytes.to_string(),
            "--fence",
            &crate::common::arg_name(&fence),
            "--producer-work",
            &crate::common::arg_name(&work),
            "--producer-gpu",
            &producer_gpu.to_string(),
            "--pool",
            &pool.max(1).to_string(),
            "--producer-socket",
        ])
        .arg(&sock)
        .spawn()?;
    let stream = tensorport_cuda::Stream::new(gpu).map_err(cuda)?;
    // One row per tensor of a batch.
    let dst = tensorport_cuda::DeviceBuffer::new(gpu, bytes * batch).map_err(cuda)?;
    let gatherer = tensorport_cuda::Gatherer::new(gpu);
    let mut lat = Vec::with_capacity(handoffs);
    let mut started: Option<Instant> = None;
    // Hand-offs after the clock started (it starts after the first batch: process start-up,
    // cuInit and registration are not hand-offs).
    let mut counted = 0usize;
    let mut done = 0usize;
    let mut tr = StepTrace::new(["receive", "wait", "copy", "release", "answer"]);
    while done < handoffs {
        let t1 = Instant::now();
        tr.start();
        let reqs = if batch > 1 && !staged {
            let b = server.recv_batch(batch, Duration::from_secs(60), Duration::ZERO)?;
            if b.is_empty() {
                return Err(CliError::new(
                    "the benchmark producer sent nothing for 60 s",
                ));
            }
            b
        } else {
            vec![server
                .recv_timeout(Duration::from_secs(60))?
                .ok_or_else(|| CliError::new("the benchmark producer sent nothing for 60 s"))?]
        };
        tr.step(0);
        let mut responders = Vec::with_capacity(reqs.len());
        let reqs = if !staged && fences == ServerFences::Gather {
            let copies = reqs
                .iter()
                .enumerate()
                .map(|(k, r)| {
                    r.device()
                        .map(|t| (t, dst.ptr() + (k * bytes) as u64))
                        .ok_or_else(|| CliError::new("expected a device tensor"))
                })
                .collect::<CliResult<Vec<_>>>()?;
            // SAFETY: our stream is live in the server's context, where the importer opened the
            // buffers; row k of `dst` holds `bytes` (each tensor is `bytes` long, checked against
            // its buffer), and nothing else writes `dst`.
            let tensors: Vec<_> = copies.iter().map(|c| c.0).collect();
            // (The three steps of `Gatherer::gather`, each timed.)
            unsafe {
                gatherer.wait_ready_all(&stream, &tensors).map_err(cuda)?;
                tr.step(1);
                gatherer.copy_all(&stream, &copies).map_err(cuda)?;
                tr.step(2);
                gatherer.release_all(&stream, &tensors).map_err(cuda)?;
                tr.step(3);
            }
            responders.extend(reqs.into_iter().map(|r| r.release()));
            Vec::new()
        } else {
            reqs
        };
        for req in reqs {
            if staged {
                // SAFETY: `dst` holds `bytes` on this context; the slot stays ours until the
                // release below, after the copy has run (the stream is synchronised first).
                unsafe { stream.copy_host_to_device_async(dst.ptr(), req.bytes()) }
                    .map_err(cuda)?;
                stream.synchronize().map_err(cuda)?;
                responders.push(req.release());
                continue;
            }
            let dt = req
                .device()
                .cloned()
                .ok_or_else(|| CliError::new("expected a device tensor"))?;
            // SAFETY: our stream is live in the server's context; the tensor was bounds-checked
            // against the registered buffer, and `dst` holds `bytes`. The release is recorded
            // on the stream after the copy, so the producer reuses the buffer only after it.
            unsafe {
                dt.wait_ready(stream.raw()).map_err(CliError::new)?;
                tr.step(1);
                dst.copy_from_device_async(dt.ptr(), dt.len() as usize, &stream)
                    .map_err(cuda)?;
                tr.step(2);
                dt.record_release(stream.raw()).map_err(CliError::new)?;
                tr.step(3);
            }
            responders.push(req.release());
        }
        // One synchronisation for the batch: every copy in it has run (staged copies were
        // waited for one by one: their slots are host memory, with no GPU-ordered release).
        if sync == ServerSync::Batch || staged {
            stream.synchronize().map_err(cuda)?;
        }
        let l = t1.elapsed().as_secs_f64() * 1e6;
        let n = responders.len();
        for r in responders {
            lat.push(l);
            let _ = r.respond(&[]);
        }
        tr.step(4);
        done += n;
        if started.is_some() {
            counted += n;
        }
        started.get_or_insert_with(Instant::now);
    }
    // Every copy has run before the clock stops.
    stream.synchronize().map_err(cuda)?;
    let secs = started.map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
    let _ = child.wait();
    tr.report("server", handoffs);
    let first = lat.remove(0);
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| lat[((lat.len() - 1) as f64 * p).round() as usize];
    println!(
        "  {:>8} fence, producer {:>4}, {bytes:>9} B: {:>8.0} hand-offs/s, {:>6.2} GB/s; latency p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us (first, with start-up: {:.0} us)",
        crate::common::arg_name(&fence),
        crate::common::arg_name(&work),
        counted as f64 / secs,
        counted as f64 * bytes as f64 / secs / 1e9,
        pct(0.5),
        pct(0.99),
        pct(0.999),
        first
    );
    Ok(())
}

/// With `TENSORPORT_BENCH_TRACE=1`, `bench-ipc`'s two sides say where their time went: the
/// mean time per hand-off in each step (every step's clock reads included), on stderr.
struct StepTrace<const N: usize> {
    on: bool,
    names: [&'static str; N],
    spent: [std::time::Duration; N],
    last: std::time::Instant,
}

impl<const N: usize> StepTrace<N> {
    fn new(names: [&'static str; N]) -> Self {
        StepTrace {
            on: std::env::var_os("TENSORPORT_BENCH_TRACE").is_some_and(|v| v == "1"),
            names,
            spent: [std::time::Duration::ZERO; N],
            last: std::time::Instant::now(),
        }
    }

    fn start(&mut self) {
        if self.on {
            self.last = std::time::Instant::now();
        }
    }

    /// Step `k` ended now (it began at the last step's end or at `start`).
    fn step(&mut self, k: usize) {
        if self.on {
            let now = std::time::Instant::now();
            self.spent[k] += now - self.last;
            self.last = now;
        }
    }

    fn report(&self, who: &str, n: usize) {
        if self.on {
            let per = |d: std::time::Duration| d.as_secs_f64() * 1e6 / n.max(1) as f64;
            let steps: Vec<String> = self
                .names
                .iter()
                .zip(self.spent)
                .map(|(name, d)| format!("{name} {:.2} us", per(d)))
                .collect();
            eprintln!("trace bench-ipc {who}, per hand-off: {}", steps.join(", "));
        }
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}
