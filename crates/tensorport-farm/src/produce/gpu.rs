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
use tensorport_cuda::{
    DeviceBuffer, Gpu, GpuJpeg, GpuProducer, GpuProducerConfig, JpegDecoder, JpegJob, JpegRefused,
    JpegWindow, PinnedBuffer, ProducerJpeg,
};
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

/// The window of a `size` image that `transform` keeps, as the GPU pipeline takes it.
pub fn jpeg_window(transform: &Transform, size: (u32, u32)) -> JpegWindow {
    let win = transform.window(size.0, size.1);
    JpegWindow {
        left: win.left,
        top: win.top,
        width: win.width,
        height: win.height,
        out: win.out,
    }
}

/// Decoded bytes `t` needs on the GPU.
fn scratch_of(t: &Taken) -> u64 {
    t.gpu.map_or(0, |(w, h)| 3 * u64::from(w) * u64::from(h))
}

/// Takes from `waiting` up to `limit` inputs for one decoder (the first waiting input's), in
/// order, and says which decoder that is.
fn batch_of_one_decoder(
    waiting: &mut Vec<Taken>,
    limit: usize,
) -> (Vec<Taken>, Option<JpegDecoder>) {
    let decoder = waiting.first().and_then(|t| t.decoder);
    let mut taken = Vec::new();
    let mut kept = Vec::with_capacity(waiting.len());
    for t in waiting.drain(..) {
        if taken.len() < limit && (t.decoder.is_none() || t.decoder == decoder) {
            taken.push(t);
        } else {
            kept.push(t);
        }
    }
    *waiting = kept;
    (taken, decoder)
}

/// An input of the batch being prepared, and where it goes.
struct Taken {
    index: u64,
    source: Source,
    bytes: Option<Vec<u8>>,
    st: StageTimes,
    /// Size, if nvJPEG's batched decoder takes it.
    gpu: Option<(u32, u32)>,
    /// Which of the GPU's decoders takes it (with `gpu`).
    decoder: Option<JpegDecoder>,
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
    /// Inputs for the GPU's other decoder, read while a batch was formed: the next batch's.
    waiting: Vec<Taken>,
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
    jpeg.set_upsampling(cfg.prep.gpu_upsampling);
    tracing::info!(backend = %jpeg.backend(), library = jpeg.library(), gpu = g.ordinal, "decoding on the GPU");
    // One device buffer per request in flight; a session may register at most 64.
    let depth = (cfg.in_flight.max(1) as usize).min(tensorport_wire::MAX_DEVICE_BUFFERS as usize);
    let image_bytes = 3 * size * size * cfg.prep.pixels.bytes();
    let p = GpuProducer::connect(
        &cfg.socket,
        &gpu,
        &GpuProducerConfig::new(cfg.name.clone(), depth, image_bytes),
    )?;
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
        waiting: Vec::new(),
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
            } else if l.eof && l.waiting.is_empty() {
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
    /// A batch's GPU images are all for one of the GPU's decoders (one batched call: a mixed
    /// batch is decoded in two, one after the other, at a third less of the rate on varied
    /// photos): images for the other decoder wait for the next batch, which takes them first,
    /// and a batch ends once a batch's worth of them wait.
    fn take(&mut self, lines: &mut LineWriter) -> Result<Vec<Taken>> {
        let room = self.depth - self.out.len();
        let limit = self.batch.min(room);
        let (mut taken, mut decoder) = batch_of_one_decoder(&mut self.waiting, limit);
        let mut scratch: u64 = taken.iter().map(scratch_of).sum();
        while !self.eof
            && taken.len() < limit
            && scratch < SCRATCH_BUDGET
            && self.waiting.len() < self.batch
        {
            let wait = if taken.is_empty() && self.out.is_empty() && self.waiting.is_empty() {
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
                || self.waiting.iter().any(|t| t.index == input.index)
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
            let probed = bytes.as_deref().and_then(|b| self.jpeg.probe_decoder(b));
            let t = Taken {
                index: input.index,
                source: input.source,
                bytes,
                st,
                gpu: probed.map(|(size, _)| size),
                decoder: probed.map(|(_, d)| d),
                buffer: None,
                failed: false,
            };
            match (t.decoder, decoder) {
                (Some(d), Some(batch)) if d != batch => self.waiting.push(t),
                (d, _) => {
                    decoder = decoder.or(d);
                    scratch += scratch_of(&t);
                    taken.push(t);
                }
            }
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
                decoder: None,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn taken(index: u64, decoder: Option<JpegDecoder>) -> Taken {
        Taken {
            index,
            source: Source::Synthetic(index),
            bytes: None,
            st: StageTimes::default(),
            gpu: decoder.map(|_| (640, 480)),
            decoder,
            buffer: None,
            failed: false,
        }
    }

    fn indices(v: &[Taken]) -> Vec<u64> {
        v.iter().map(|t| t.index).collect()
    }

    #[test]
    fn a_batch_takes_the_first_waiting_decoders_inputs_in_order() {
        use JpegDecoder::{Interpolating as I, Plain as P};
        let mut waiting = vec![
            taken(1, Some(P)),
            taken(2, Some(I)),
            taken(3, Some(P)),
            taken(4, Some(P)),
            taken(5, Some(I)),
        ];
        let (batch, decoder) = batch_of_one_decoder(&mut waiting, 2);
        assert_eq!(decoder, Some(P));
        assert_eq!(indices(&batch), [1, 3]);
        assert_eq!(indices(&waiting), [2, 4, 5]);
        let (batch, decoder) = batch_of_one_decoder(&mut waiting, 8);
        assert_eq!(decoder, Some(I));
        assert_eq!(indices(&batch), [2, 5]);
        assert_eq!(indices(&waiting), [4]);
        let (batch, _) = batch_of_one_decoder(&mut waiting, 8);
        assert_eq!(indices(&batch), [4]);
        assert!(waiting.is_empty());
        let (batch, decoder) = batch_of_one_decoder(&mut waiting, 8);
        assert!(batch.is_empty() && decoder.is_none());
        // No room: nothing taken, nothing lost.
        let mut waiting = vec![taken(7, Some(I))];
        let (batch, _) = batch_of_one_decoder(&mut waiting, 0);
        assert!(batch.is_empty());
        assert_eq!(indices(&waiting), [7]);
    }
}
