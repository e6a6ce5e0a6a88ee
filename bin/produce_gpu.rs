//! `tensorport produce --nvjpeg`: a producer that decodes and prepares on the GPU.
//!
//! Inputs come from the same reader thread as the CPU producer's. They are taken a batch at a
//! time: nvJPEG decodes the batch's JPEGs, one kernel resizes, crops and normalises each into its
//! own device buffer, and each buffer is fenced and handed over through the device path (CUDA
//! IPC or a VMM file descriptor, timeline fences). Files the batched decoder does not take (PNG,
//! progressive JPEG on the hardware engines) — or a whole batch nvJPEG refuses — are prepared on
//! the CPU as `produce` does and copied into their buffers.

use std::collections::HashMap;
use std::io::Write;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport::TensorSpec;
use tensorport_cuda::{DeviceBuffer, Gpu, GpuJpeg, GpuProducer, JpegJob, JpegWindow, PinnedBuffer};
use tensorport_vision::{Preprocessor, Source, Transform, IMAGENET_MEAN, IMAGENET_STD};

use crate::common::{CliError, CliResult, PixelsArg, ResultLine, StageTimes};
use crate::produce::{ms, result_line, Args, Item};

/// Decoded bytes one batch may need on the GPU before it is cut short (32 ImageNet-sized images
/// need about 20 MB; one image at the 16,384-pixel limit 805 MB).
const SCRATCH_BUDGET: u64 = 1 << 30;

/// The GPU pipeline's job for a JPEG of `size` (as `GpuJpeg::probe` gave it), prepared with
/// `transform` into `dst`.
pub(crate) fn jpeg_job<'a>(
    transform: &Transform,
    data: &'a [u8],
    size: (u32, u32),
    dst: (&'a DeviceBuffer, usize),
) -> JpegJob<'a> {
    let win = transform.window(size.0, size.1);
    JpegJob {
        data,
        size,
        window: JpegWindow {
            left: win.left,
            top: win.top,
            width: win.width,
            height: win.height,
            out: win.out,
        },
        dst,
    }
}

fn cuda(e: tensorport_cuda::Error) -> CliError {
    CliError::new(e.to_string())
}

/// What one submitted input is waiting for: its index, its name, when it was taken, when it
/// was submitted, its stage times.
type Pending = (u64, String, Instant, Instant, StageTimes);

/// An input of the batch being prepared, and where it goes.
struct Taken {
    index: u64,
    source: Source,
    bytes: Option<Vec<u8>>,
    st: StageTimes,
    /// Size, if nvJPEG's batched decoder takes it.
    gpu: Option<(u32, u32)>,
    buffer: usize,
}

pub fn run(
    a: &Args,
    rx: mpsc::Receiver<Item>,
    spent: mpsc::Sender<Vec<u8>>,
    out: &mut Box<dyn Write>,
) -> CliResult<()> {
    let size = a.image_size;
    let gpu: Arc<Gpu> = Gpu::open(a.gpu as i32).map_err(cuda)?;
    let mut jpeg = GpuJpeg::new(&gpu, IMAGENET_MEAN, IMAGENET_STD).map_err(cuda)?;
    jpeg.set_u8_output(a.pixels == PixelsArg::U8);
    tracing::info!(backend = %jpeg.backend(), library = jpeg.library(), gpu = a.gpu, "decoding on the GPU");
    // One device buffer per request in flight; a session may register at most 64.
    let depth = (a.in_flight.max(1) as usize).min(tensorport_wire::MAX_DEVICE_BUFFERS as usize);
    let batch = a.batch.clamp(1, depth);
    let image_bytes = 3 * size * size * a.pixels.bytes();
    let mut p = GpuProducer::connect_best(a.socket.path(), &a.name, &gpu, depth, image_bytes)
        .map_err(cuda)?;
    let transform = a.transform.for_size(size as u32);
    let mut prep = Preprocessor::new(transform);
    prep.set_max_pixels(crate::common::pixels_of(a.max_megapixels));
    prep.set_dct_scaling(a.dct_scaling.on());
    let mut staging = PinnedBuffer::new(&gpu, image_bytes).map_err(cuda)?;
    let mut cpu_px = vec![0f32; 3 * size * size];
    let spec = TensorSpec::new(a.pixels.dtype(), &[3, size as u64, size as u64]);
    let timeout = Duration::from_secs(a.timeout.max(1));
    let mut pending: HashMap<u64, Pending> = HashMap::new();
    // Read buffers of the last batch: nvJPEG may read them until its decode has run.
    let mut held: Vec<Vec<u8>> = Vec::new();
    let mut eof = false;
    let emit = |out: &mut Box<dyn Write>, line: ResultLine| -> CliResult<()> {
        writeln!(
            out,
            "{}",
            serde_json::to_string(&line).expect("serializable")
        )?;
        out.flush()?;
        Ok(())
    };
    let failed = |index: u64, source: &Source, error: String| ResultLine {
        index,
        input: source.to_string(),
        class: None,
        scores: None,
        error: Some(error),
        latency_ms: 0.0,
        producer: a.name.clone(),
        stages: None,
    };
    loop {
        // Take up to a batch, as much as there are free buffers for: wait for the first only
        // when nothing is in flight, then take what is already read.
        let mut taken: Vec<Taken> = Vec::new();
        let room = depth - pending.len();
        // Decoded bytes the batch will need on the GPU: a batch ends early past the budget, so
        // a few huge images cannot make the scratch buffer huge.
        let mut scratch = 0u64;
        while !eof && taken.len() < batch.min(room) && scratch < SCRATCH_BUDGET {
            let next = if taken.is_empty() && pending.is_empty() {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(it) => Some(it),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        eof = true;
                        None
                    }
                }
            } else {
                match rx.try_recv() {
                    Ok(it) => Some(it),
                    Err(mpsc::TryRecvError::Empty) => None,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        eof = true;
                        None
                    }
                }
            };
            let Some((index, source, bytes)) = next else {
                break;
            };
            let in_batch = taken.iter().any(|t| t.index == index);
            if in_batch || pending.contains_key(&index) {
                if let Some((Ok(buf), _)) = bytes {
                    let _ = spent.send(buf);
                }
                let why = format!("input {index} was given again while in flight");
                emit(out, failed(index, &source, why))?;
                continue;
            }
            let mut st = StageTimes::default();
            let bytes = match bytes {
                Some((Ok(buf), read)) => {
                    st.read_ms = ms(read);
                    Some(buf)
                }
                Some((Err(e), _)) => {
                    emit(out, failed(index, &source, e.to_string()))?;
                    continue;
                }
                None => None,
            };
            let gpu_size = bytes.as_deref().and_then(|b| jpeg.probe(b));
            if let Some((w, h)) = gpu_size {
                scratch += 3 * u64::from(w) * u64::from(h);
            }
            taken.push(Taken {
                index,
                source,
                bytes,
                st,
                gpu: gpu_size,
                buffer: usize::MAX,
            });
        }
        if !taken.is_empty() {
            let t0 = Instant::now();
            for t in &mut taken {
                t.buffer = p.acquire(timeout).map_err(cuda)?;
                t.st.lease_ms = ms(t0.elapsed());
            }
            let leased = Instant::now();
            // The batch on the GPU.
            let on_gpu: Vec<usize> = (0..taken.len())
                .filter(|&i| taken[i].gpu.is_some())
                .collect();
            let mut gpu_ok = false;
            if !on_gpu.is_empty() {
                let jobs: Vec<JpegJob<'_>> = on_gpu
                    .iter()
                    .map(|&i| {
                        let t = &taken[i];
                        jpeg_job(
                            &transform,
                            t.bytes.as_deref().expect("probed bytes"),
                            t.gpu.expect("filtered"),
                            (p.buffer(t.buffer), 0),
                        )
                    })
                    .collect();
                // SAFETY: the bytes are held (`held`) until the next batch's `run` or
                // `wait_idle` below has waited for this one, and the buffers are the
                // producer's, allocated for its life.
                match unsafe { jpeg.run(&jobs, p.stream()) } {
                    Ok(()) => gpu_ok = true,
                    Err(e) => tracing::warn!(
                        images = jobs.len(),
                        "nvJPEG refused the batch ({e}); preparing it on the CPU"
                    ),
                }
            }
            // The last batch's decode has run (a successful `run` waited for it; otherwise wait
            // here): its bytes can be reused.
            if !gpu_ok && !held.is_empty() {
                jpeg.wait_idle().map_err(cuda)?;
            }
            for b in held.drain(..) {
                let _ = spent.send(b);
            }
            let per_image = ms(leased.elapsed()) / on_gpu.len().max(1) as f64;
            for t in &mut taken {
                if t.gpu.is_some() && gpu_ok {
                    t.st.decode_ms = per_image;
                    continue;
                }
                // On the CPU, then up into the buffer.
                let px: &mut [u8] = bytemuck::cast_slice_mut(&mut cpu_px);
                let px = &mut px[..image_bytes];
                let r = match (&t.bytes, &t.source) {
                    (Some(b), Source::File(path)) => {
                        prep.prepare_encoded_into(b, path, a.pixels.planes(px)?)
                    }
                    _ => prep.prepare_into(&t.source, a.pixels.planes(px)?),
                };
                let s = prep.last_stages();
                t.st.decode_ms = ms(s.decode);
                t.st.resize_ms = ms(s.resize);
                t.st.normalise_ms = ms(s.normalise);
                if let Err(e) = r {
                    t.gpu = None;
                    t.bytes = None;
                    emit(out, failed(t.index, &t.source, e.to_string()))?;
                    t.index = u64::MAX;
                    continue;
                }
                let host = &mut staging.as_mut_slice()[..image_bytes];
                host.copy_from_slice(&bytemuck::cast_slice(&cpu_px)[..image_bytes]);
                // SAFETY: the buffer is ours (acquired above) and holds `image_bytes`; the
                // staging memory is pinned and not touched again until the copy has run (the
                // stream is synchronised right after).
                unsafe {
                    p.stream()
                        .copy_host_to_device_async(p.buffer(t.buffer).ptr(), host)
                        .map_err(cuda)?;
                }
                p.stream().synchronize().map_err(cuda)?;
            }
            for mut t in taken {
                if let Some(b) = t.bytes.take() {
                    held.push(b);
                }
                if t.index == u64::MAX {
                    // Failed to prepare (its line is written): the buffer was acquired but is
                    // not submitted, so it stays free for a later acquire.
                    continue;
                }
                // The request id is the input's index, as with CPU producers (a Python `Loader`
                // yields the indices with the batch).
                let before = Instant::now();
                p.submit_as(t.buffer, &spec, t.index).map_err(cuda)?;
                let submitted = Instant::now();
                t.st.submit_ms = ms(submitted - before);
                pending.insert(
                    t.index,
                    (t.index, t.source.to_string(), t0, submitted, t.st),
                );
            }
        }
        if pending.is_empty() {
            if eof {
                break;
            }
            continue;
        }
        // Results: all that are there; wait when every buffer is out or the input ran dry.
        let mut got = 0;
        loop {
            let c = if got == 0 && (pending.len() >= depth || eof) {
                Some(p.producer().recv_result(timeout)?)
            } else if got == 0 {
                match p.producer().recv_result(Duration::from_millis(1)) {
                    Ok(c) => Some(c),
                    Err(tensorport::Error::Timeout(..)) => None,
                    Err(e) => return Err(e.into()),
                }
            } else {
                p.producer().try_recv_result()?
            };
            let Some(c) = c else { break };
            got += 1;
            let Some((index, input, t0, submitted, mut st)) = pending.remove(&c.request_id) else {
                continue;
            };
            st.result_ms = ms(submitted.elapsed());
            emit(out, result_line(a, index, input, t0, st, c.result))?;
            if pending.is_empty() {
                break;
            }
        }
        if got == 0 {
            if let Some(oldest) = pending.values().map(|v| v.3).min() {
                if oldest.elapsed() > timeout {
                    return Err(CliError::new(format!(
                        "no result from the server within {}s",
                        timeout.as_secs()
                    )));
                }
            }
        }
    }
    p.close().map_err(cuda)?;
    Ok(())
}
