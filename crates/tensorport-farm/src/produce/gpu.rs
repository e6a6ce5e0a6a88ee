//! The GPU producer: inputs are taken a batch at a time; nvJPEG decodes the batch's JPEGs, one
//! kernel resizes, crops and normalises each into its own device buffer, and each buffer is
//! fenced and handed over through the device path (CUDA IPC or a VMM file descriptor, timeline
//! fences). Files the batched decoder does not take (PNG, progressive JPEG on the hardware
//! engines) — or a whole batch nvJPEG refuses — go to the CPU lane (`lane.rs`): prepared as the
//! CPU producer does, on `GpuPrep::cpu_threads` threads of their own, while the GPU decodes the
//! next batches; each is copied into a buffer and submitted when it is ready.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport::TensorSpec;
use tensorport_cuda::{DeviceBuffer, Gpu, GpuProducer, GpuProducerConfig, PinnedBuffer};
use tensorport_nvjpeg::{GpuJpeg, JpegJob, JpegRefused, ProducerJpeg};
use tensorport_vision::{Source, Transform, IMAGENET_MEAN, IMAGENET_STD};

use super::lane::{Done, Job, Lane};
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
    JpegJob {
        data,
        size,
        window: jpeg_window(transform, size),
        dst,
    }
}

/// The window of a `size` image that `transform` keeps.
pub fn jpeg_window(
    transform: &Transform,
    size: (u32, u32),
) -> tensorport_vision::transform::Window {
    transform.window(size.0, size.1)
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
    feed: &'a Feed,
    p: GpuProducer,
    jpeg: GpuJpeg,
    transform: Transform,
    /// The CPU's preparation, for what nvJPEG does not take.
    lane: Lane,
    /// Page-locked slots for the lane's images (one per input it may hold).
    slots: Vec<PinnedBuffer>,
    spec: TensorSpec,
    image_bytes: usize,
    depth: usize,
    batch: usize,
    timeout: Duration,
    out: Outstanding,
    eof: bool,
}

pub(super) fn run(
    cfg: &ProduceConfig,
    g: GpuPrep,
    feed: &Feed,
    lines: &mut LineWriter,
) -> Result<()> {
    let size = cfg.image_size;
    // When each step of the start ended, for the log line once ready.
    let started = Instant::now();
    let gpu: Arc<Gpu> = Gpu::open(g.ordinal as i32)?;
    let opened = Instant::now();
    // One device buffer per request in flight, up to what a session may register.
    let depth = (cfg.in_flight.max(1) as usize).min(tensorport_wire::MAX_DEVICE_BUFFERS as usize);
    let image_bytes = 3 * size * size * cfg.prep.pixels.bytes();
    let gpc = GpuProducerConfig::new(cfg.name.clone(), depth, image_bytes);
    // The decoders are made on a thread of their own while this one connects (allocating and
    // exporting the buffers the server imports): the start costs the slower of the two.
    let ((jpeg, decoded), p) = std::thread::scope(|s| {
        let decoders = s.spawn(|| {
            let jpeg = GpuJpeg::open(
                &gpu,
                IMAGENET_MEAN,
                IMAGENET_STD,
                cfg.prep.gpu_decode,
                g.cpu_threads,
            );
            (jpeg, Instant::now())
        });
        let p = super::connect_when_listening(
            cfg.wait_for_server,
            || GpuProducer::connect(&cfg.socket, &gpu, &gpc),
            |e| {
                matches!(
                    e,
                    tensorport_cuda::Error::Transport(tensorport::Error::Connect(
                        tensorport::ConnectError::NoServer { .. }
                    ))
                )
            },
        )
        .map(|p| (p, Instant::now()));
        let decoders = decoders
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (decoders, p)
    });
    // The decoders' error first: a producer that cannot decode says so, connected or not.
    let mut jpeg = jpeg?;
    let (p, connected) = p?;
    jpeg.set_u8_output(cfg.prep.pixels == Pixels::U8);
    jpeg.set_upsampling(cfg.prep.gpu_upsampling);
    tracing::info!(backend = %jpeg.backend(), library = jpeg.library(), gpu = g.ordinal, "decoding on the GPU");
    let timeout = cfg.timeout.max(Duration::from_secs(1));
    let lane = Lane::start(
        (0..g.cpu_threads.max(1))
            .map(|_| cfg.prep.cpu_preprocessor(size as u32))
            .collect(),
        cfg.prep.pixels,
        image_bytes,
    )?;
    let slots = (0..lane.capacity())
        .map(|_| PinnedBuffer::new(&gpu, image_bytes))
        .collect::<tensorport_cuda::Result<Vec<_>>>()?;
    let both = connected.max(decoded);
    tracing::info!(
        context_ms = ms(opened - started),
        decoders_ms = ms(decoded - opened),
        connect_ms = ms(connected - opened),
        buffers_ms = ms(both.elapsed()),
        "GPU producer ready in {:.0} ms",
        ms(started.elapsed())
    );
    let mut l = GpuLoop {
        feed,
        p,
        jpeg,
        transform: cfg.prep.transform.for_size(size as u32),
        lane,
        slots,
        spec: TensorSpec::new(cfg.prep.pixels.dtype(), &[3, size as u64, size as u64]),
        image_bytes,
        depth,
        batch: g.batch.clamp(1, depth),
        timeout,
        out: Outstanding::new(timeout),
        eof: false,
    };
    loop {
        let taken = l.take(lines)?;
        if !taken.is_empty() {
            let t0 = Instant::now();
            let (mut on_gpu, mut for_lane): (Vec<Taken>, Vec<Taken>) =
                taken.into_iter().partition(|t| t.gpu.is_some());
            for t in &mut on_gpu {
                t.buffer = Some(l.p.acquire(timeout)?);
                t.st.lease_ms = ms(t0.elapsed());
            }
            if !on_gpu.is_empty() && !l.decode(&mut on_gpu)? {
                // Refused: their buffers were not written, and stay free for later acquires.
                for_lane.extend(on_gpu.drain(..).map(|mut t| {
                    t.buffer = None;
                    t
                }));
            }
            l.submit(on_gpu, t0)?;
            for t in for_lane {
                l.send_to_lane(t, lines)?;
            }
        }
        l.take_from_lane(Duration::ZERO, lines)?;
        if l.out.is_empty() {
            if l.lane.len() > 0 {
                l.take_from_lane(Duration::from_millis(100), lines)?;
            } else if l.eof {
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
            let held = taken.iter().any(|t| t.index == input.index)
                || self.out.holds(input.index)
                || self.lane.holds(input.index);
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

    /// Decodes the batch into its buffers with nvJPEG; false if nvJPEG refused it (nothing
    /// was written; each input has its bytes back, no longer read).
    fn decode(&mut self, taken: &mut [Taken]) -> Result<bool> {
        let leased = Instant::now();
        let jobs: Vec<ProducerJpeg> = taken
            .iter_mut()
            .map(|t| {
                let size = t.gpu.expect("partitioned");
                ProducerJpeg {
                    data: t.bytes.take().expect("probed bytes"),
                    size,
                    window: jpeg_window(&self.transform, size),
                    buffer: t.buffer.expect("acquired"),
                }
            })
            .collect();
        let images = jobs.len();
        // The last batch's bytes come back (its decode has run): to be read into again.
        let ok = match self.jpeg.decode_into(&self.p, jobs) {
            Ok(free) => {
                free.into_iter().for_each(|b| self.feed.reuse(b));
                true
            }
            Err(refused) => {
                let JpegRefused { error, jobs, free } = *refused;
                tracing::warn!(
                    images,
                    "nvJPEG refused the batch ({error}); preparing it on the CPU"
                );
                for (t, j) in taken.iter_mut().zip(jobs) {
                    t.bytes = Some(j.data);
                }
                free.into_iter().for_each(|b| self.feed.reuse(b));
                false
            }
        };
        if ok {
            let per_image = ms(leased.elapsed()) / images.max(1) as f64;
            for t in taken.iter_mut() {
                t.st.decode_ms = per_image;
            }
        }
        tracing::debug!(
            images,
            nvjpeg_refused = !ok,
            enqueue_ms = ms(leased.elapsed()),
            "batch decoding"
        );
        Ok(ok)
    }

    /// Puts `t` into the CPU lane, first taking in what the lane has finished while it is full.
    fn send_to_lane(&mut self, t: Taken, lines: &mut LineWriter) -> Result<()> {
        while self.lane.is_full() || self.slots.is_empty() {
            self.take_from_lane(Duration::from_millis(100), lines)?;
        }
        let slot = self.slots.pop().expect("a slot per input the lane holds");
        self.lane.send(Job {
            index: t.index,
            source: t.source,
            bytes: t.bytes,
            st: t.st,
            slot,
        });
        Ok(())
    }

    /// Takes in what the CPU lane has finished (waiting up to `wait` for the first): each is
    /// copied from its slot into a buffer and submitted; one that could not be prepared gets
    /// its line.
    fn take_from_lane(&mut self, wait: Duration, lines: &mut LineWriter) -> Result<()> {
        let t0 = Instant::now();
        let mut taken = Vec::new();
        for Done { job, prepared } in self.lane.finished(wait) {
            let Job {
                index,
                source,
                mut st,
                mut slot,
                bytes,
            } = job;
            if let Some(b) = bytes {
                self.feed.reuse(b);
            }
            if let Err(e) = prepared {
                self.slots.push(slot);
                lines.failed(index, &source, e, None, None)?;
                continue;
            }
            let buffer = self.p.acquire(self.timeout)?;
            let uploaded = self.p.upload(buffer, &mut slot, 0..self.image_bytes);
            self.slots.push(slot);
            uploaded?;
            st.lease_ms = ms(t0.elapsed());
            taken.push(Taken {
                index,
                source,
                bytes: None,
                st,
                gpu: None,
                buffer: Some(buffer),
                failed: false,
            });
        }
        self.submit(taken, t0)
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
                    Err(tensorport::RecvError::Timeout(..)) => None,
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
