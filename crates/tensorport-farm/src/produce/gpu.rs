//! The GPU producer: inputs are taken a batch at a time; nvJPEG decodes the batch's JPEGs, one
//! kernel resizes, crops and normalises each into its own device buffer, and each buffer is
//! fenced and handed over through the device path (CUDA IPC or a VMM file descriptor, timeline
//! fences). Files the batched decoder does not take (PNG, progressive JPEG on the hardware
//! engines) — or a whole batch nvJPEG refuses — are prepared on the CPU as the CPU producer
//! does, on `GpuPrep::cpu_threads` threads while the GPU decodes the rest of the batch, and
//! copied into their buffers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport::TensorSpec;
use tensorport_cuda::{DeviceBuffer, Gpu, GpuJpeg, GpuProducer, JpegJob, JpegWindow, PinnedBuffer};
use tensorport_vision::{Preprocessor, Source, Transform, IMAGENET_MEAN, IMAGENET_STD};

use super::{refuse_again, submitted, Outstanding};
use crate::config::{GpuPrep, Pixels, ProduceConfig};
use crate::error::Result;
use crate::feed::{Feed, Next};
use crate::record::{ms, LineWriter, StageTimes};

/// Decoded bytes one batch may need on the GPU before it is cut short (32 ImageNet-sized images
/// need about 20 MB; one image at the 16,384-pixel limit 805 MB).
const SCRATCH_BUDGET: u64 = 1 << 30;

/// The GPU pipeline's job for a JPEG of `size` (as `GpuJpeg::probe` gave it), prepared with
/// `transform` into `dst`.
pub fn jpeg_job<'a>(
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

/// An input of the batch being prepared, and where it goes.
struct Taken {
    index: u64,
    source: Source,
    bytes: Option<Vec<u8>>,
    st: StageTimes,
    /// Size, if nvJPEG's batched decoder takes it.
    gpu: Option<(u32, u32)>,
    /// Its device buffer, once acquired.
    buffer: Option<usize>,
    /// It could not be prepared (its line is written).
    failed: bool,
}

/// The GPU producer's state between batches.
struct GpuLoop<'a> {
    cfg: &'a ProduceConfig,
    feed: &'a Feed,
    p: GpuProducer,
    jpeg: GpuJpeg,
    transform: Transform,
    /// The CPU's preparation, for what nvJPEG does not take: one per thread.
    preps: Vec<Preprocessor>,
    /// Page-locked room for a batch of CPU-prepared images on their way up.
    staging: PinnedBuffer,
    spec: TensorSpec,
    image_bytes: usize,
    depth: usize,
    batch: usize,
    timeout: Duration,
    out: Outstanding,
    /// Read buffers of the last batch: nvJPEG may read them until its decode has run.
    held: Vec<Vec<u8>>,
    eof: bool,
}

pub(super) fn run(
    cfg: &ProduceConfig,
    g: GpuPrep,
    feed: &Feed,
    lines: &mut LineWriter,
) -> Result<()> {
    let size = cfg.image_size;
    let gpu: Arc<Gpu> = Gpu::open(g.ordinal as i32)?;
    let mut jpeg = GpuJpeg::new(&gpu, IMAGENET_MEAN, IMAGENET_STD)?;
    jpeg.set_u8_output(cfg.prep.pixels == Pixels::U8);
    tracing::info!(backend = %jpeg.backend(), library = jpeg.library(), gpu = g.ordinal, "decoding on the GPU");
    // One device buffer per request in flight; a session may register at most 64.
    let depth = (cfg.in_flight.max(1) as usize).min(tensorport_wire::MAX_DEVICE_BUFFERS as usize);
    let image_bytes = 3 * size * size * cfg.prep.pixels.bytes();
    let p = GpuProducer::connect_best(&cfg.socket, &cfg.name, &gpu, depth, image_bytes)?;
    let timeout = cfg.timeout.max(Duration::from_secs(1));
    let mut l = GpuLoop {
        cfg,
        feed,
        p,
        jpeg,
        transform: cfg.prep.transform.for_size(size as u32),
        preps: (0..g.cpu_threads.max(1))
            .map(|_| cfg.prep.cpu_preprocessor(size as u32))
            .collect(),
        staging: PinnedBuffer::new(&gpu, image_bytes * g.batch.clamp(1, depth))?,
        spec: TensorSpec::new(cfg.prep.pixels.dtype(), &[3, size as u64, size as u64]),
        image_bytes,
        depth,
        batch: g.batch.clamp(1, depth),
        timeout,
        out: Outstanding::new(timeout),
        held: Vec::new(),
        eof: false,
    };
    loop {
        let mut taken = l.take(lines)?;
        if !taken.is_empty() {
            let t0 = Instant::now();
            for t in &mut taken {
                t.buffer = Some(l.p.acquire(timeout)?);
                t.st.lease_ms = ms(t0.elapsed());
            }
            l.prepare(&mut taken, lines)?;
            l.submit(taken, t0)?;
        }
        if l.out.is_empty() {
            if l.eof {
                break;
            }
            continue;
        }
        l.collect(lines)?;
    }
    l.p.close()?;
    Ok(())
}

impl GpuLoop<'_> {
    /// Takes up to a batch, as much as there are free buffers for: waits for the first only
    /// when nothing is in flight, then takes what is already read. A batch ends early past the
    /// scratch budget, so a few huge images cannot make the decoder's scratch buffer huge.
    fn take(&mut self, lines: &mut LineWriter) -> Result<Vec<Taken>> {
        let mut taken: Vec<Taken> = Vec::new();
        let room = self.depth - self.out.len();
        let mut scratch = 0u64;
        while !self.eof && taken.len() < self.batch.min(room) && scratch < SCRATCH_BUDGET {
            let wait = if taken.is_empty() && self.out.is_empty() {
                Duration::from_millis(200)
            } else {
                Duration::ZERO
            };
            let mut input = match self.feed.next(wait) {
                Next::Input(it) => it,
                Next::Wait => break,
                Next::Done => {
                    self.eof = true;
                    break;
                }
            };
            let held = taken.iter().any(|t| t.index == input.index) || self.out.holds(input.index);
            if refuse_again(&mut input, held, self.feed, lines)? {
                continue;
            }
            let mut st = StageTimes::default();
            let bytes = match input.bytes {
                Some((Ok(buf), read)) => {
                    st.read_ms = ms(read);
                    Some(buf)
                }
                Some((Err(e), _)) => {
                    lines.failed(input.index, &input.source, e.to_string(), None, None)?;
                    continue;
                }
                None => None,
            };
            let gpu_size = bytes.as_deref().and_then(|b| self.jpeg.probe(b));
            if let Some((w, h)) = gpu_size {
                scratch += 3 * u64::from(w) * u64::from(h);
            }
            taken.push(Taken {
                index: input.index,
                source: input.source,
                bytes,
                st,
                gpu: gpu_size,
                buffer: None,
                failed: false,
            });
        }
        Ok(taken)
    }

    /// Prepares the batch into its buffers: nvJPEG for what it takes, the CPU for the rest (and
    /// for all of it if nvJPEG refuses the batch).
    fn prepare(&mut self, taken: &mut [Taken], lines: &mut LineWriter) -> Result<()> {
        let leased = Instant::now();
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
                        &self.transform,
                        t.bytes.as_deref().expect("probed bytes"),
                        t.gpu.expect("filtered"),
                        (self.p.buffer(t.buffer.expect("acquired")), 0),
                    )
                })
                .collect();
            // SAFETY: the bytes are held (`held`) until the next batch's `run` or `wait_idle`
            // below has waited for this one, and the buffers are the producer's, allocated for
            // its life.
            match unsafe { self.jpeg.run(&jobs, self.p.stream()) } {
                Ok(()) => gpu_ok = true,
                Err(e) => tracing::warn!(
                    images = jobs.len(),
                    "nvJPEG refused the batch ({e}); preparing it on the CPU"
                ),
            }
        }
        // The last batch's decode has run (a successful `run` waited for it; otherwise wait
        // here): its bytes can be reused.
        if !gpu_ok && !self.held.is_empty() {
            self.jpeg.wait_idle()?;
        }
        for b in self.held.drain(..) {
            self.feed.reuse(b);
        }
        let per_image = ms(leased.elapsed()) / on_gpu.len().max(1) as f64;
        let batch = taken.len();
        let mut on_cpu: Vec<&mut Taken> = Vec::new();
        for t in taken.iter_mut() {
            if t.gpu.is_some() && gpu_ok {
                t.st.decode_ms = per_image;
            } else {
                on_cpu.push(t);
            }
        }
        let (gpu_images, cpu_images) = (batch - on_cpu.len(), on_cpu.len());
        let enqueued = Instant::now();
        if !on_cpu.is_empty() {
            let errors = self.prepare_on_cpu(&mut on_cpu)?;
            for (t, e) in on_cpu.into_iter().zip(errors) {
                if let Some(e) = e {
                    t.failed = true;
                    lines.failed(t.index, &t.source, e, None, None)?;
                }
            }
        }
        tracing::debug!(
            gpu_images,
            cpu_images,
            nvjpeg_refused = !on_gpu.is_empty() && !gpu_ok,
            enqueue_ms = ms(enqueued - leased),
            cpu_ms = ms(enqueued.elapsed()),
            "batch prepared"
        );
        for t in taken.iter_mut() {
            if let Some(b) = t.bytes.take() {
                self.held.push(b);
            }
        }
        Ok(())
    }

    /// Prepares `items` on the CPU — on up to one thread per preprocessor, while the GPU works
    /// on the rest of the batch — and copies each up into its buffer. Returns, per item, why it
    /// could not be prepared.
    fn prepare_on_cpu(&mut self, items: &mut [&mut Taken]) -> Result<Vec<Option<String>>> {
        let pixels = self.cfg.prep.pixels;
        let ib = self.image_bytes;
        let n = items.len();
        let threads = self.preps.len().min(n);
        let staging = &mut self.staging.as_mut_slice()[..ib * n];
        let work: Vec<(&mut Taken, &mut [u8])> = items
            .iter_mut()
            .map(|t| &mut **t)
            .zip(staging.chunks_exact_mut(ib))
            .collect();
        let queue = std::sync::Mutex::new(work.into_iter().enumerate());
        let errors = std::sync::Mutex::new(vec![None; n]);
        // Each thread takes the next item until none is left.
        let drain = |prep: &mut Preprocessor| loop {
            let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
            let Some((k, (t, px))) = next else { break };
            if let Err(e) = prepare_one(prep, pixels, t, px) {
                errors.lock().unwrap_or_else(|p| p.into_inner())[k] = Some(e.to_string());
            }
        };
        match &mut self.preps[..threads] {
            // One item (or one thread): no thread to start.
            [prep] => drain(prep),
            preps => std::thread::scope(|s| {
                for prep in preps {
                    s.spawn(|| drain(prep));
                }
            }),
        }
        let errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
        let staging = &self.staging.as_mut_slice()[..ib * n];
        for ((t, host), e) in items.iter().zip(staging.chunks_exact(ib)).zip(&errors) {
            if e.is_some() {
                continue;
            }
            let buffer = self.p.buffer(t.buffer.expect("acquired"));
            // SAFETY: the buffer is ours (acquired) and holds `image_bytes`; the staging memory
            // is pinned and not touched again until the copies have run (the stream is
            // synchronised below, before this returns).
            unsafe {
                self.p
                    .stream()
                    .copy_host_to_device_async(buffer.ptr(), host)?;
            }
        }
        self.p.stream().synchronize()?;
        Ok(errors)
    }

    /// Submits the prepared inputs. One that failed keeps its buffer unsubmitted, so it stays
    /// free for a later acquire.
    fn submit(&mut self, taken: Vec<Taken>, t0: Instant) -> Result<()> {
        for mut t in taken.into_iter().filter(|t| !t.failed) {
            let before = Instant::now();
            self.p
                .submit_as(t.buffer.expect("acquired"), &self.spec, t.index)?;
            t.st.submit_ms = ms(before.elapsed());
            self.out.insert(submitted(t.index, &t.source, t0, t.st));
        }
        Ok(())
    }

    /// Results: all that are there; waits when every buffer is out or the input ran dry.
    fn collect(&mut self, lines: &mut LineWriter) -> Result<()> {
        let mut got = 0;
        loop {
            let c = if got == 0 && (self.out.len() >= self.depth || self.eof) {
                Some(self.p.producer().recv_result(self.timeout)?)
            } else if got == 0 {
                match self.p.producer().recv_result(Duration::from_millis(1)) {
                    Ok(c) => Some(c),
                    Err(tensorport::Error::Timeout(..)) => None,
                    Err(e) => return Err(e.into()),
                }
            } else {
                self.p.producer().try_recv_result()?
            };
            let Some(c) = c else { break };
            got += 1;
            self.out.answer(c, lines)?;
            if self.out.is_empty() {
                break;
            }
        }
        if got == 0 {
            self.out.check_overdue()?;
        }
        Ok(())
    }
}

/// Prepares `t` on the CPU into `px` (its image's room in the staging buffer), timing the steps.
fn prepare_one(
    prep: &mut Preprocessor,
    pixels: Pixels,
    t: &mut Taken,
    px: &mut [u8],
) -> Result<()> {
    let r = match (&t.bytes, &t.source) {
        (Some(b), Source::File(path)) => prep.prepare_encoded_into(b, path, pixels.planes(px)?),
        _ => prep.prepare_into(&t.source, pixels.planes(px)?),
    };
    let s = prep.last_stages();
    t.st.decode_ms = ms(s.decode);
    t.st.resize_ms = ms(s.resize);
    t.st.normalise_ms = ms(s.normalise);
    Ok(r?)
}
