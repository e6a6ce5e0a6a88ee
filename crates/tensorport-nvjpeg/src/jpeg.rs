//! JPEG batches decoded and prepared on the GPU: nvJPEG's batched decoder (the GPU's hardware
//! JPEG engines where it has them) writes planar RGB into a scratch buffer, and one kernel
//! resizes (antialiased bilinear, as PIL and torchvision do it), crops and normalises every
//! image of the batch into its own output buffer as NCHW `f32`.
//!
//! The kernel is compiled at run time with NVRTC (loaded like libcuda); nothing here needs CUDA
//! at build time. The geometry (which window of the source becomes the output) is the caller's:
//! `tensorport_vision::Transform::window` gives the same windows as the CPU path.

use std::sync::Arc;
use std::time::Instant;
use tensorport_vision::sniff::Chroma;
use tensorport_vision::transform::Window;

use crate::balance::{megasamples, Costs, Weighed};
use crate::batched::{Batched, Engine, POOL_BATCH};
use crate::hybrid::{Huffman, Hybrid, HybridJob, Spent};
use crate::nvjpeg::{self, Nvjpeg};
use crate::route::{chroma_of, Decoders, GpuDecode, Route};
use crate::{Error, Result};
use tensorport_cuda::{DeviceBuffer, Gpu, GpuProducer, Kernel, PinnedBuffer, Ptx, Stream};

/// The resize / crop / normalise kernel. One thread per output pixel (x), one block row per
/// output row (y), one grid layer per image (z). Two passes as PIL does them: each source row in
/// the vertical window is filtered horizontally and rounded to 8 bits, then the rows are
/// filtered vertically and rounded again; the 8-bit value is scaled and normalised in `f32`
/// exactly as torchvision's `ToDtype(scale=True)` + `Normalize` compute it (or, with `as_u8`,
/// written as 8-bit planes for the server to normalise).
const KERNEL: &str = include_str!("kernels/jpeg.cu");

/// One image's job, as the kernel reads it (`struct Job` above).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RawJob {
    src: u64,
    pitch: u64,
    plane: u64,
    w: i32,
    h: i32,
    left: f32,
    top: f32,
    sx: f32,
    sy: f32,
    dst: u64,
}

/// One image of a batch: its JPEG bytes, the window to keep, and where its `[3, out, out]`
/// tensor goes (`f32`, or `u8` after [`GpuJpeg::set_u8_output`]).
#[derive(Debug)]
pub struct JpegJob<'a> {
    /// The file's bytes (checked with [`GpuJpeg::probe`]).
    pub data: &'a [u8],
    /// The source's width and height, as [`GpuJpeg::probe`] gave them.
    pub size: (u32, u32),
    /// The window to keep.
    pub window: Window,
    /// The output buffer and the byte offset of the tensor in it.
    pub dst: (&'a DeviceBuffer, usize),
}

/// One image of a batch decoded into a GPU producer's buffer ([`GpuJpeg::decode_into`]): the
/// decoder holds its bytes until the batch has run.
#[derive(Debug)]
pub struct ProducerJpeg {
    /// The file's bytes (checked with [`GpuJpeg::probe`]).
    pub data: Vec<u8>,
    /// The source's width and height, as [`GpuJpeg::probe`] gave them.
    pub size: (u32, u32),
    /// The window to keep.
    pub window: Window,
    /// The producer's buffer its tensor goes into (from its start).
    pub buffer: usize,
}

/// A batch [`GpuJpeg::decode_into`] could not decode, given back whole.
#[derive(Debug)]
pub struct JpegRefused {
    /// Why.
    pub error: Error,
    /// The batch's jobs, bytes and all, in their order.
    pub jobs: Vec<ProducerJpeg>,
    /// Bytes of earlier batches that no batch reads any more.
    pub free: Vec<Vec<u8>>,
}

/// Which nvJPEG backend decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JpegBackend {
    /// The GPU's JPEG engines (`NVJPEG_BACKEND_HARDWARE`).
    Hardware {
        /// Engines.
        engines: u32,
        /// Cores per engine.
        cores: u32,
    },
    /// CUDA cores, Huffman decoding on the CPU or GPU as nvJPEG chooses (`NVJPEG_BACKEND_DEFAULT`).
    Cuda,
}

impl std::fmt::Display for JpegBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JpegBackend::Hardware { engines, cores } => write!(
                f,
                "nvJPEG hardware decoder ({engines} engines × {cores} cores)"
            ),
            JpegBackend::Cuda => write!(f, "nvJPEG on CUDA cores"),
        }
    }
}

/// How the GPU's JPEG decoder upsamples subsampled chroma (4:2:2, 4:2:0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Upsampling {
    /// Interpolated, as libjpeg-turbo's decode (torchvision's and PIL's on the CPU) does.
    #[default]
    Interpolate,
    /// Replicated: one decoder (one batched call) for every file, faster where a batch mixes
    /// 4:4:4 with subsampled JPEGs, but the tensors lie further from torchvision's
    /// (docs/benchmarks.md gives both).
    Replicate,
}

impl Upsampling {
    /// The name the command line uses.
    pub fn name(self) -> &'static str {
        match self {
            Upsampling::Interpolate => "interpolate",
            Upsampling::Replicate => "replicate",
        }
    }

    /// The value named `s` ([`Upsampling::name`]).
    pub fn parse(s: &str) -> Option<Upsampling> {
        match s {
            "interpolate" => Some(Upsampling::Interpolate),
            "replicate" => Some(Upsampling::Replicate),
            _ => None,
        }
    }
}

/// The decoder and the kernel, with scratch memory kept between batches.
pub struct GpuJpeg {
    gpu: Arc<Gpu>,
    lib: Arc<Nvjpeg>,
    handle: nvjpeg::Handle,
    state: nvjpeg::State,
    /// A second hardware decoder without interpolated upsampling, for the images with no
    /// chroma to upsample (4:4:4; all of them with [`Upsampling::Replicate`]): the engines
    /// decode those several times faster without the flag, to the same pixels.
    plain: Option<Engine>,
    /// Every hardware decoder has nvJPEG's memory pool ([`GpuJpeg::memory_pool`]).
    pooled: bool,
    upsampling: Upsampling,
    /// How files are shared between the decoders ([`GpuJpeg::set_decode`]).
    mode: GpuDecode,
    /// The hybrid decoder on host threads, once [`GpuJpeg::set_decode`] made it.
    hybrid: Option<Hybrid>,
    /// What each side has cost per megapixel (`balance.rs`).
    costs: Costs,
    parsed: nvjpeg::JpegStream,
    backend: JpegBackend,
    kernel: Option<Kernel>,
    mean: [f32; 3],
    std: [f32; 3],
    /// Write 8-bit planes instead of normalised floats.
    as_u8: bool,
    /// Decoded planes of the batch.
    scratch: Option<DeviceBuffer>,
    /// The jobs, on the host (pinned) and on the device.
    jobs_host: Option<PinnedBuffer>,
    jobs_dev: Option<DeviceBuffer>,
    /// Set after a batch's kernel; waited on before the scratch is reused.
    last: Option<tensorport_cuda::Event>,
    /// The bytes of the last batch [`GpuJpeg::decode_into`] enqueued: read until `last`.
    held: Vec<Vec<u8>>,
    /// Where the time goes, once [`GpuJpeg::set_timing`] asked.
    timing: Option<Timing>,
}

/// Where a decoder's time went, summed over its batches since [`GpuJpeg::set_timing`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct JpegTimes {
    /// Batches run.
    pub batches: u64,
    /// Images decoded.
    pub images: u64,
    /// Their source pixels.
    pub pixels: u64,
    /// Host time inside nvJPEG's batched calls (parsing, and whatever it waits for).
    pub host_ms: f64,
    /// Of the images, those the hybrid decoder took (on host threads and CUDA cores).
    pub hybrid_images: u64,
    /// The hybrid decoder's threads' time, summed over the threads (their nvJPEG calls and
    /// their waits for a pinned buffer).
    pub hybrid_host_ms: f64,
    /// GPU time from a batch's start on the stream to its decode's end.
    pub decode_ms: f64,
    /// GPU time of the resize / crop / normalise kernel (with its job table's copy).
    pub kernel_ms: f64,
}

/// The timing of the batch in flight, and the sums of those that ran.
#[derive(Debug, Default)]
struct Timing {
    /// Start, decoded and done events of the batch in flight.
    marks: Vec<tensorport_cuda::Event>,
    /// Its images and pixels.
    pending: (u64, u64),
    totals: JpegTimes,
}

impl Timing {
    /// Adds the batch in flight to the sums (its last event has been waited on).
    fn settle(&mut self) -> Result<()> {
        if let [start, decoded, done] = self.marks.as_slice() {
            self.totals.decode_ms += f64::from(decoded.elapsed_since(start)?);
            self.totals.kernel_ms += f64::from(done.elapsed_since(decoded)?);
            self.totals.batches += 1;
            self.totals.images += self.pending.0;
            self.totals.pixels += self.pending.1;
        }
        self.marks.clear();
        Ok(())
    }
}

impl std::fmt::Debug for GpuJpeg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuJpeg")
            .field("backend", &self.backend)
            .field("library", &self.lib.path())
            .finish()
    }
}

// SAFETY: the handles are used only through `&mut self`, after binding the context; nvJPEG
// handles and states may move between threads (they may not be used by two at once).
unsafe impl Send for GpuJpeg {}

impl GpuJpeg {
    /// Loads nvJPEG (the hardware backend if the GPU has JPEG engines, else the CUDA one) and
    /// compiles the kernel for `gpu`; outputs are normalised with `mean` and `std`. Files go to
    /// the engines alone ([`GpuJpeg::open`] makes the hybrid decoder alongside).
    pub fn new(gpu: &Arc<Gpu>, mean: [f32; 3], std: [f32; 3]) -> Result<GpuJpeg> {
        GpuJpeg::open(gpu, mean, std, GpuDecode::Engines, 0)
    }

    /// As [`GpuJpeg::new`], with files shared between the decoders as
    /// [`GpuJpeg::set_decode`]`(mode, threads)` says. The pieces are made at once, each on a
    /// thread of its own — the engines' two decoders, the hybrid decoder and the kernel's
    /// compile (NVRTC needs no context) — so the start costs the slowest of them, not their sum.
    pub fn open(
        gpu: &Arc<Gpu>,
        mean: [f32; 3],
        std: [f32; 3],
        mode: GpuDecode,
        threads: usize,
    ) -> Result<GpuJpeg> {
        gpu.bind()?;
        let started = Instant::now();
        let lib = Arc::new(Nvjpeg::load()?);
        let loaded = Instant::now();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let since = |t: Instant| ms(t.duration_since(loaded));
        let hybrid_wanted = mode != GpuDecode::Engines && threads > 0;
        let (me, plain, hybrid, ptx) = std::thread::scope(|s| {
            let ptx = s.spawn(|| {
                let ptx = Ptx::compile(gpu, KERNEL, "tensorport_jpeg.cu");
                (ptx, Instant::now())
            });
            // Made on the chance the GPU has engines; dropped below where it has none.
            let plain = s.spawn(|| {
                let plain = Engine::make(&lib, gpu, nvjpeg::FLAGS_DEFAULT);
                (plain, Instant::now())
            });
            let hybrid = hybrid_wanted.then(|| {
                s.spawn(|| {
                    let hybrid = Hybrid::new(&lib, gpu, threads);
                    (hybrid, Instant::now())
                })
            });
            let me = GpuJpeg::main_decoder(gpu, &lib, mean, std).map(|me| (me, Instant::now()));
            (me, join(plain), hybrid.map(join), join(ptx))
        });
        let (mut me, main_at) = me?;
        let engines = matches!(me.backend, JpegBackend::Hardware { .. });
        let (plain, plain_at) = plain;
        // A library that cannot make the second decoder decodes every file with the first.
        me.plain = plain.ok().filter(|_| engines);
        me.pooled &= me.plain.as_ref().is_none_or(|p| p.pooled);
        // The hybrid decoder serves only beside the engines (as `set_decode` decides).
        me.mode = mode;
        let mut hybrid_at = None;
        if let Some((h, at)) = hybrid {
            if engines {
                me.hybrid = Some(h?);
            }
            hybrid_at = Some(at);
        }
        let (ptx, ptx_at) = ptx;
        me.kernel = Some(Kernel::from_ptx(gpu, &ptx?, c"tp_resize_normalise")?);
        tracing::debug!(
            load_ms = ms(loaded - started),
            engine_ms = since(main_at),
            plain_ms = since(plain_at),
            hybrid_ms = hybrid_at.map(since),
            compile_ms = since(ptx_at),
            "nvJPEG decoders made in {:.0} ms (each after the library's load, side by side)",
            ms(started.elapsed())
        );
        Ok(me)
    }

    /// The first decoder (the engines', or the CUDA backend's on a GPU without them), without
    /// the plain decoder, the hybrid decoder or the kernel.
    fn main_decoder(
        gpu: &Arc<Gpu>,
        lib: &Arc<Nvjpeg>,
        mean: [f32; 3],
        std: [f32; 3],
    ) -> Result<GpuJpeg> {
        gpu.bind()?;
        let flags = nvjpeg::FLAGS_UPSAMPLING_WITH_INTERPOLATION;
        let (handle, backend) = match lib.create(nvjpeg::BACKEND_HARDWARE, flags) {
            Ok(h) => {
                // SAFETY: a live hardware-backend handle.
                let (engines, cores) = unsafe { lib.hardware_info(h) }.unwrap_or((0, 0));
                (h, JpegBackend::Hardware { engines, cores })
            }
            Err(_) => (
                lib.create(nvjpeg::BACKEND_DEFAULT, flags)?,
                JpegBackend::Cuda,
            ),
        };
        // From here on `Drop` frees what exists; build the value early.
        let mut me = GpuJpeg {
            gpu: gpu.clone(),
            lib: lib.clone(),
            handle,
            state: std::ptr::null_mut(),
            plain: None,
            pooled: false,
            upsampling: Upsampling::default(),
            mode: GpuDecode::Engines,
            hybrid: None,
            costs: Costs::default(),
            parsed: std::ptr::null_mut(),
            backend,
            kernel: None,
            mean,
            std,
            as_u8: false,
            scratch: None,
            jobs_host: None,
            jobs_dev: None,
            last: None,
            held: Vec::new(),
            timing: None,
        };
        // SAFETY: `handle` is live.
        me.state = unsafe { me.lib.state_create(me.handle)? };
        // SAFETY: as above.
        me.parsed = unsafe { me.lib.stream_create(me.handle)? };
        if matches!(me.backend, JpegBackend::Hardware { .. }) {
            // SAFETY: a live hardware-backend handle and its state, no batch yet. A library
            // that refuses (or lacks) the pool decodes as before, allocating per call.
            let pooled = unsafe {
                me.lib
                    .batched_pre_allocate(me.handle, me.state, POOL_BATCH, 1, 1)
            };
            me.pooled = matches!(pooled, Ok(true));
        }
        Ok(me)
    }

    /// How subsampled chroma is upsampled ([`Upsampling::Interpolate`] unless set).
    pub fn set_upsampling(&mut self, upsampling: Upsampling) {
        self.upsampling = upsampling;
    }

    /// How files are shared between the decoders: with [`GpuDecode::ByChroma`] (or
    /// [`GpuDecode::Split`]) and `threads` above 0 on a GPU with JPEG engines, 4:4:4 files (or
    /// any colour file) may go to nvJPEG's hybrid decoder on `threads` host threads of this
    /// decoder's own (made here). [`GpuDecode::Engines`] unless set.
    pub fn set_decode(&mut self, mode: GpuDecode, threads: usize) -> Result<()> {
        self.mode = mode;
        let wanted = mode != GpuDecode::Engines
            && threads > 0
            && matches!(self.backend, JpegBackend::Hardware { .. });
        if !wanted {
            self.hybrid = None;
        } else if self.hybrid.as_ref().is_none_or(|h| h.threads() != threads) {
            // The old decoder's threads are idle between batches; its streams are waited
            // on when it drops.
            self.hybrid = None;
            let started = std::time::Instant::now();
            self.hybrid = Some(Hybrid::new(&self.lib, &self.gpu, threads)?);
            tracing::debug!(
                threads,
                "nvJPEG hybrid decoders made in {:.0} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
        }
        Ok(())
    }

    /// Which decoder takes each kind of file, as set.
    pub fn decoders(&self) -> Decoders {
        Decoders {
            engines: matches!(self.backend, JpegBackend::Hardware { .. }),
            plain: self.plain.is_some(),
            hybrid_threads: self.hybrid.as_ref().map_or(0, Hybrid::threads),
            mode: self.mode,
            upsampling: self.upsampling,
        }
    }

    /// Write each image as `[3, out, out]` bytes (planar RGB, not normalised: the server
    /// normalises them) instead of normalised `f32`.
    pub fn set_u8_output(&mut self, as_u8: bool) {
        self.as_u8 = as_u8;
    }

    /// Times every batch from now on (GPU events around the decode and the kernel, which cost
    /// a little): [`GpuJpeg::times`] gives the sums.
    pub fn set_timing(&mut self, on: bool) {
        self.timing = on.then(Timing::default);
    }

    /// The sums of the timed batches that have run (after [`GpuJpeg::wait_idle`], all of them).
    pub fn times(&self) -> Option<JpegTimes> {
        let mut t = self.timing.as_ref()?.totals;
        if let Some(h) = &self.hybrid {
            let (spent, images) = h.spent();
            (t.hybrid_host_ms, t.hybrid_images) = (spent[0].0 + spent[1].0, images);
        }
        Some(t)
    }

    /// Waits until the last batch's decode and kernel have run (after which its JPEG bytes
    /// and output buffers are no longer read or written by this decoder).
    pub fn wait_idle(&mut self) -> Result<()> {
        if let Some(e) = self.last.take() {
            e.wait()?;
        }
        self.settle_timing()
    }

    fn settle_timing(&mut self) -> Result<()> {
        match self.timing.as_mut() {
            Some(t) => t.settle(),
            None => Ok(()),
        }
    }

    /// Records a timing event on `stream`, if timing.
    fn mark(&mut self, stream: &Stream) -> Result<()> {
        if let Some(t) = self.timing.as_mut() {
            t.marks.push(stream.record()?);
        }
        Ok(())
    }

    /// Decodes `jobs` as one batch into `producer`'s buffers on its stream (as
    /// [`GpuJpeg::run`], safely): the decoder keeps each job's bytes until the batch has run,
    /// and the producer's buffers outlive any work on its stream (its drop waits for it). Then
    /// fence and submit the buffers. Returns the bytes no batch reads any more (the last
    /// batch's: this one waited for it), to reuse. When nvJPEG refuses the batch, nothing of
    /// it is pending any more and it comes back whole ([`JpegRefused`]): prepare those images
    /// another way.
    pub fn decode_into(
        &mut self,
        producer: &GpuProducer,
        jobs: Vec<ProducerJpeg>,
    ) -> std::result::Result<Vec<Vec<u8>>, Box<JpegRefused>> {
        let refused = |me: &mut GpuJpeg, error: Error, jobs: Vec<ProducerJpeg>| {
            let _ = me.wait_idle();
            Box::new(JpegRefused {
                error,
                jobs,
                free: std::mem::take(&mut me.held),
            })
        };
        if jobs.iter().any(|j| j.buffer >= producer.buffer_count()) {
            return Err(refused(self, Error::Refused("no such buffer"), jobs));
        }
        let table: Vec<JpegJob<'_>> = jobs
            .iter()
            .map(|j| JpegJob {
                data: &j.data,
                size: j.size,
                window: j.window,
                dst: (producer.buffer(j.buffer), 0),
            })
            .collect();
        // SAFETY: the bytes are moved into `self.held` below and kept until the next `run`,
        // `decode_into`, `wait_idle` or drop has waited for this batch (on an error,
        // `refused` waits first); the output buffers are the producer's, which live until its
        // drop has synchronised the stream the work is enqueued on.
        let r = unsafe { self.run(&table, producer.stream()) };
        drop(table);
        match r {
            Ok(()) => {
                let done = std::mem::take(&mut self.held);
                self.held = jobs.into_iter().map(|j| j.data).collect();
                Ok(done)
            }
            Err(e) => Err(refused(self, e, jobs)),
        }
    }

    /// The largest side [`GpuJpeg::probe`] accepts (the CPU decoder's limit too).
    pub const MAX_SIDE: u32 = 16_384;
    /// The most pixels [`GpuJpeg::probe`] accepts (the CPU decoders' default limit too).
    pub const MAX_PIXELS: u64 = tensorport_vision::DEFAULT_MAX_PIXELS;
    /// Scratch memory kept between batches: more, left by an outsized batch, is given back.
    const SCRATCH_KEEP: usize = 256 << 20;

    /// The backend decoding.
    pub fn backend(&self) -> JpegBackend {
        self.backend
    }

    /// Whether the JPEG engines' decoders reuse nvJPEG's memory pool across batches
    /// (`nvjpegDecodeBatchedPreAllocate`), rather than allocating for each batch's images: false
    /// on CUDA cores, or where the library lacks or refuses the pool.
    pub fn memory_pool(&self) -> bool {
        self.pooled
    }

    /// Where nvJPEG was loaded from.
    pub fn library(&self) -> &str {
        self.lib.path()
    }

    /// The image's width and height if the batched decoder takes it (a JPEG nvJPEG can decode
    /// in a batch on this backend, e.g. baseline for the hardware engines), `None` otherwise
    /// (prepare it on the CPU instead).
    pub fn probe(&mut self, data: &[u8]) -> Option<(u32, u32)> {
        let info = self.header_info(data)?;
        let size = (info.width, info.height);
        // SAFETY: `handle` and `parsed` are live and used only through `&mut self`.
        let taken = !matches!(self.backend, JpegBackend::Hardware { .. })
            || unsafe { self.lib.batched_supported(self.handle, self.parsed, data) };
        taken.then_some(size)
    }

    /// What the header of `data` declares, if it is an image the decoder may be given: three
    /// components (the batched decode of a grayscale JPEG into RGB planes does not give its
    /// gray in all three: the CPU prepares those), within the side and pixel limits (beyond
    /// them the CPU path, which refuses such a file saying so, is the one to answer: a small
    /// file can declare gigabytes). What `run` checks each job against: cheaper than
    /// [`GpuJpeg::probe`].
    fn header_info(&mut self, data: &[u8]) -> Option<nvjpeg::ImageInfo> {
        // SAFETY: `handle` is live and used only through `&mut self`.
        let info = unsafe { self.lib.image_info(self.handle, data) }.ok()?;
        let (w, h) = (info.width, info.height);
        let fits = info.components == 3
            && w > 0
            && h > 0
            && w <= Self::MAX_SIDE
            && h <= Self::MAX_SIDE
            && u64::from(w) * u64::from(h) <= Self::MAX_PIXELS;
        fits.then_some(info)
    }

    /// Decodes `jobs` as one batch and writes each one's normalised `[3, out, out]` tensor into
    /// its buffer, all enqueued on `stream` (the caller fences and hands the buffers over after
    /// this returns). An error fails the whole batch: prepare its images another way. Each
    /// job's size is checked against its bytes (a wrong one would make nvJPEG write past its
    /// image's scratch), and the batch's wait point is recorded whatever happens once anything
    /// was enqueued.
    ///
    /// # Safety
    /// The GPU reads each job's bytes and writes its output buffer after this returns: both
    /// must stay allocated and unchanged until the next `run` or [`GpuJpeg::wait_idle`]
    /// returns (which wait for this batch).
    pub unsafe fn run(&mut self, jobs: &[JpegJob<'_>], stream: &Stream) -> Result<()> {
        if jobs.is_empty() {
            return Ok(());
        }
        self.gpu.bind()?;
        // The previous batch's kernel must be done with the scratch and the job table.
        if let Some(e) = self.last.take() {
            e.wait()?;
        }
        self.settle_timing()?;
        let out = jobs[0].window.out;
        if jobs.iter().any(|j| j.window.out != out) {
            return Err(Error::Refused("jobs of one batch with different sizes"));
        }
        // Planar RGB for every image, each image 256-byte aligned.
        let mut offsets = Vec::with_capacity(jobs.len());
        let mut routes = Vec::with_capacity(jobs.len());
        let mut weighed = Vec::with_capacity(jobs.len());
        let decoders = self.decoders();
        // Where a file goes when the hybrid threads do not take it.
        let without_threads = Decoders {
            hybrid_threads: 0,
            ..decoders
        };
        let mut total = 0usize;
        for j in jobs {
            let info = self.header_info(j.data);
            if info.map(|i| (i.width, i.height)) != Some(j.size) {
                return Err(Error::Refused(
                    "a job's size is not its JPEG's (or the JPEG is not one this decodes)",
                ));
            }
            let chroma = info.map_or(Chroma::Other, |i| chroma_of(i.subsampling));
            routes.push(decoders.route(chroma));
            weighed.push(Weighed {
                size: megasamples(j.size.0, j.size.1, chroma),
                first: chroma == Chroma::Full,
                huffman: Huffman::for_size(j.size.0, j.size.1),
                fallback: without_threads.route(chroma),
            });
            let (w, h) = (j.size.0 as usize, j.size.1 as usize);
            let need = (j.window.out as usize).pow(2) * 3 * if self.as_u8 { 1 } else { 4 };
            if j.dst
                .1
                .checked_add(need)
                .is_none_or(|end| end > j.dst.0.len())
            {
                return Err(Error::Refused("an output buffer too small for its tensor"));
            }
            offsets.push(total);
            total += (3 * w * h).next_multiple_of(256);
        }
        if let Some(h) = &self.hybrid {
            self.costs.share(&mut routes, &weighed, h.threads());
        }
        // An outsized batch's scratch is given back rather than kept for small ones.
        if self
            .scratch
            .as_ref()
            .is_some_and(|b| b.len() > Self::SCRATCH_KEEP && b.len() > 4 * total)
        {
            self.scratch = None;
        }
        grow(&self.gpu, &mut self.scratch, total)?;
        let bytes = std::mem::size_of::<RawJob>() * jobs.len();
        grow(&self.gpu, &mut self.jobs_dev, bytes)?;
        if self.jobs_host.as_ref().is_none_or(|b| b.len() < bytes) {
            self.jobs_host = Some(PinnedBuffer::new(&self.gpu, bytes.max(4096) * 2)?);
        }
        if let Some(t) = self.timing.as_mut() {
            let pixels = jobs
                .iter()
                .map(|j| u64::from(j.size.0) * u64::from(j.size.1));
            t.pending = (jobs.len() as u64, pixels.sum());
        }
        self.mark(stream)?;
        // From here work is enqueued: whatever happens, the next batch waits for it.
        let r = self.enqueue(jobs, &offsets, &routes, &weighed, stream);
        let last = stream.record()?;
        if let Some(t) = self.timing.as_mut() {
            if r.is_ok() {
                t.marks.push(stream.record()?);
            } else {
                t.marks.clear();
            }
        }
        self.last = Some(last);
        r
    }

    /// The part of [`GpuJpeg::run`] that enqueues work (the buffers are sized).
    /// `routes[i]`: the decoder of job `i`; `weighed[i]`: its size, for learning the costs.
    fn enqueue(
        &mut self,
        jobs: &[JpegJob<'_>],
        offsets: &[usize],
        routes: &[Route],
        weighed: &[Weighed],
        stream: &Stream,
    ) -> Result<()> {
        let base = self.scratch.as_ref().expect("sized by run").ptr();
        let images: Vec<nvjpeg::Image> = jobs
            .iter()
            .zip(offsets)
            .map(|(j, &off)| {
                let (w, h) = (j.size.0 as usize, j.size.1 as usize);
                let mut im = nvjpeg::Image::default();
                for c in 0..3 {
                    im.channel[c] = base.offset(off + c * w * h).raw() as *mut u8;
                    im.pitch[c] = w;
                }
                im
            })
            .collect();
        let hybrid_jobs: Vec<HybridJob<'_>> = jobs
            .iter()
            .zip(&images)
            .zip(routes.iter().zip(weighed))
            .filter(|(_, (r, _))| **r == Route::Hybrid)
            .map(|((j, im), (_, w))| HybridJob {
                data: j.data,
                planes: *im,
                size: w.size,
                huffman: w.huffman,
            })
            .collect();
        let batched = Batched {
            lib: &self.lib,
            main: (self.handle, self.state),
            plain: self.plain.as_ref().map(Engine::raw),
        };
        let run_batched = || -> (Result<()>, f64) {
            let host = std::time::Instant::now();
            // SAFETY: the planes lie inside the scratch buffer (sized from the widths and heights
            // nvJPEG reported), which lives until after `self.last` is waited on.
            let r = unsafe { batched.decode(jobs, &images, routes, stream) };
            (r, host.elapsed().as_secs_f64() * 1e3)
        };
        let (hybrid_r, batched_r) = match self.hybrid.as_mut() {
            // SAFETY: the jobs' bytes outlive this call (the caller's contract for `run`); their
            // planes are in the scratch buffer, read after `stream` waits for the threads' work.
            Some(h) => unsafe { h.decode(&hybrid_jobs, stream, run_batched) },
            None if hybrid_jobs.is_empty() => (Ok(Spent::default()), run_batched()),
            None => {
                return Err(Error::Refused(
                    "a job for a hybrid decoder that was not made",
                ))
            }
        };
        let (batched_r, batched_ms) = batched_r;
        batched_r?;
        let this_batch = hybrid_r?;
        if self.hybrid.is_some() {
            let on_engines: f64 = routes
                .iter()
                .zip(weighed)
                .filter(|(r, _)| **r != Route::Hybrid)
                .map(|(_, w)| w.size)
                .sum();
            self.costs.learn(this_batch, (batched_ms, on_engines));
        }
        if let Some(t) = self.timing.as_mut() {
            t.totals.host_ms += batched_ms;
        }
        self.mark(stream)?;
        let raw: Vec<RawJob> = jobs
            .iter()
            .zip(offsets)
            .map(|(j, &off)| {
                let (w, h) = (j.size.0 as usize, j.size.1 as usize);
                let out = f64::from(j.window.out);
                RawJob {
                    src: base.offset(off).raw(),
                    pitch: w as u64,
                    plane: (w * h) as u64,
                    w: w as i32,
                    h: h as i32,
                    left: j.window.left as f32,
                    top: j.window.top as f32,
                    sx: (j.window.width / out) as f32,
                    sy: (j.window.height / out) as f32,
                    dst: j.dst.0.ptr().offset(j.dst.1).raw(),
                }
            })
            .collect();
        let bytes = std::mem::size_of_val(raw.as_slice());
        let host = self.jobs_host.as_mut().expect("sized by run");
        let table = &mut host.as_mut_slice()[..bytes];
        for (chunk, r) in table
            .chunks_exact_mut(std::mem::size_of::<RawJob>())
            .zip(&raw)
        {
            chunk.copy_from_slice(job_bytes(r));
        }
        let dev = self.jobs_dev.as_ref().expect("sized by run");
        let out = jobs[0].window.out;
        // SAFETY: the table is pinned and unchanged until `self.last` is waited on; `dev` holds
        // `bytes`; the kernel's parameters match its signature (a pointer, two ints, six floats);
        // every pointer in the table is inside the scratch buffer or an output buffer checked
        // above to hold its tensor.
        unsafe {
            stream.copy_host_to_device_async(dev.ptr(), table)?;
            let mut table_ptr = dev.ptr().raw();
            let mut out_i = out as i32;
            let mut as_u8 = i32::from(self.as_u8);
            let [mut m0, mut m1, mut m2] = self.mean;
            let [mut s0, mut s1, mut s2] = self.std;
            let mut params: [*mut std::ffi::c_void; 9] = [
                (&mut table_ptr as *mut u64).cast(),
                (&mut out_i as *mut i32).cast(),
                (&mut as_u8 as *mut i32).cast(),
                (&mut m0 as *mut f32).cast(),
                (&mut m1 as *mut f32).cast(),
                (&mut m2 as *mut f32).cast(),
                (&mut s0 as *mut f32).cast(),
                (&mut s1 as *mut f32).cast(),
                (&mut s2 as *mut f32).cast(),
            ];
            let threads = out.min(256);
            self.kernel.as_ref().expect("made in new").launch(
                (out.div_ceil(threads), out, jobs.len() as u32),
                (threads, 1, 1),
                stream,
                &mut params,
            )?;
        }
        Ok(())
    }
}

/// A buffer of at least `len` bytes in `slot`, reallocated (with room to grow) when too small.
fn grow<'a>(
    gpu: &Arc<Gpu>,
    slot: &'a mut Option<DeviceBuffer>,
    len: usize,
) -> Result<&'a DeviceBuffer> {
    if slot.as_ref().is_none_or(|b| b.len() < len) {
        // The old one (if any) is unused: the caller waited for the last batch.
        *slot = None;
        *slot = Some(DeviceBuffer::new(gpu, len + len / 2)?);
    }
    Ok(slot.as_ref().expect("just set"))
}

fn job_bytes(r: &RawJob) -> &[u8] {
    // SAFETY: RawJob is plain old data (integers and floats, `repr(C)`, no padding: 56 bytes
    // of 8-, 4- and 8-byte fields in that order), so its bytes may be read.
    unsafe {
        std::slice::from_raw_parts((r as *const RawJob).cast(), std::mem::size_of::<RawJob>())
    }
}

impl Drop for GpuJpeg {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        if let Some(e) = self.last.take() {
            let _ = e.wait();
        }
        // Read by no batch any more.
        self.held.clear();
        // Its threads' streams are waited on.
        self.hybrid = None;
        self.kernel = None;
        self.plain = None;
        // SAFETY: each handle was made in `new` (or is null) and no work using it is pending.
        unsafe {
            if !self.parsed.is_null() {
                let _ = self.lib.stream_destroy(self.parsed);
            }
            if !self.state.is_null() {
                let _ = self.lib.state_destroy(self.state);
            }
            let _ = self.lib.destroy(self.handle);
        }
    }
}

/// A scoped thread's value; its panic goes on in the caller.
fn join<T>(h: std::thread::ScopedJoinHandle<'_, T>) -> T {
    h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upsampling_names_round_trip() {
        for u in [Upsampling::Interpolate, Upsampling::Replicate] {
            assert_eq!(Upsampling::parse(u.name()), Some(u));
        }
        assert_eq!(Upsampling::default(), Upsampling::Interpolate);
        assert_eq!(Upsampling::parse("bilinear"), None);
    }

    #[test]
    fn the_job_table_matches_the_kernels_struct() {
        // struct Job: 3 × 8-byte fields, 2 ints, 4 floats, 1 pointer = 56 bytes, no padding.
        assert_eq!(std::mem::size_of::<RawJob>(), 56);
        assert_eq!(std::mem::align_of::<RawJob>(), 8);
        let r = RawJob {
            src: 1,
            pitch: 2,
            plane: 3,
            w: 4,
            h: 5,
            left: 6.0,
            top: 7.0,
            sx: 8.0,
            sy: 9.0,
            dst: 10,
        };
        let b = job_bytes(&r);
        assert_eq!(&b[24..28], &4i32.to_ne_bytes());
        assert_eq!(&b[44..48], &9f32.to_ne_bytes());
        assert_eq!(&b[48..56], &10u64.to_ne_bytes());
    }
}
