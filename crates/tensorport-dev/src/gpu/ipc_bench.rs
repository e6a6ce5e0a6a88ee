//! `tensorport-dev gpu bench-ipc`: its settings, the producer process (`--producer-socket`) and the
//! server that times the hand-offs, and the per-step trace of both.

use crate::common::{CliError, CliResult};

use super::cuda;

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

pub(super) fn ipc_producer(
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
    use tensorport_cuda::{Fence, GpuProducer, GpuProducerConfig, Sharing};
    let fence = match fence {
        FenceArg::Timeline => Fence::Timeline,
        _ => Fence::Event,
    };
    let mut p = GpuProducer::connect(
        sock,
        gpu,
        &GpuProducerConfig::new("bench-ipc", pool.max(1), bytes).sharing(Sharing::Ipc(fence)),
    )
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
pub(super) fn staged_producer(
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

/// One run of the benchmark: its settings, as they came from the command line.
pub(super) struct IpcRun {
    pub handoffs: usize,
    pub bytes: usize,
    pub fence: FenceArg,
    pub work: Work,
    pub producer_gpu: i32,
    pub batch: usize,
    pub sync: ServerSync,
    pub fences: ServerFences,
    pub pool: usize,
}

pub(super) fn ipc_server(gpu: &std::sync::Arc<tensorport_cuda::Gpu>, run: IpcRun) -> CliResult<()> {
    let IpcRun {
        handoffs,
        bytes,
        fence,
        work,
        producer_gpu,
        batch,
        sync,
        fences,
        pool,
    } = run;
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
    // (Gathered, the fences and copies are one call: its time shows as "gather".)
    let mut tr = StepTrace::new(match fences {
        ServerFences::Gather if !staged => ["receive", "gather", "(none)", "(none)", "answer"],
        _ => ["receive", "wait", "copy", "release", "answer"],
    });
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
                        .map(|t| (t, dst.ptr().offset(k * bytes)))
                        .ok_or_else(|| CliError::new("expected a device tensor"))
                })
                .collect::<CliResult<Vec<_>>>()?;
            // SAFETY: our stream is live in the server's context, where the importer opened the
            // buffers; row k of `dst` holds `bytes` (each tensor is `bytes` long, checked against
            // its buffer), and nothing else writes `dst`.
            unsafe { gatherer.gather(&stream, &copies) }.map_err(cuda)?;
            tr.step(1);
            tr.step(2);
            tr.step(3);
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
                dst.copy_from_device_async(
                    tensorport_cuda::DevicePtr::of(&dt),
                    dt.len() as usize,
                    &stream,
                )
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
