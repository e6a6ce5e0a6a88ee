//! nvJPEG's hybrid decoders on a GPU producer's host threads: each thread parses a JPEG and
//! Huffman-decodes it on the CPU (nvJPEG's host phase), copies the coefficients to the GPU and
//! runs the rest (IDCT, colour conversion) on CUDA cores, on a stream of its own — or, for a
//! large image ([`Huffman::Gpu`]), copies its bitstream and Huffman-decodes it on CUDA cores
//! too, since a core takes tens of milliseconds over a photo of several megapixels. The
//! threads take a batch's images one at a time from a shared counter, so a large file does not
//! hold the others back, while the calling thread drives the JPEG engines with the rest of the
//! batch.
//!
//! Each thread alternates two pinned buffers: the host phase of one image fills one while the
//! image before is copied and decoded on the GPU; a buffer is refilled once the GPU is done
//! with the image that used it, so a thread's time follows its GPU work as well as its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tensorport_cuda::{Event, Gpu, Stream};

use crate::nvjpeg::{self, Nvjpeg};
use crate::{Error, Result};

/// Where a hybrid job's Huffman decoding runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Huffman {
    /// On the thread's core (`NVJPEG_BACKEND_HYBRID`).
    Cpu = 0,
    /// On CUDA cores (`NVJPEG_BACKEND_GPU_HYBRID`).
    Gpu = 1,
}

impl Huffman {
    /// Images of at least this many pixels are Huffman-decoded on the GPU (DALI's default
    /// threshold between the two backends).
    pub(crate) const GPU_FROM_PIXELS: u64 = 1_000_000;

    /// Where an image of `width` × `height` is Huffman-decoded.
    pub(crate) fn for_size(width: u32, height: u32) -> Huffman {
        if u64::from(width) * u64::from(height) >= Self::GPU_FROM_PIXELS {
            Huffman::Gpu
        } else {
            Huffman::Cpu
        }
    }
}

/// One image for the hybrid decoders: its bytes, its RGB planes in the batch's scratch, its
/// size in megasamples and where it is Huffman-decoded.
pub(crate) struct HybridJob<'a> {
    pub data: &'a [u8],
    pub planes: nvjpeg::Image,
    pub size: f64,
    pub huffman: Huffman,
}

/// Milliseconds of thread time and megasamples decoded, by [`Huffman`] kind.
pub(crate) type Spent = [(f64, f64); 2];

// SAFETY: the plane pointers are device addresses, written only by the GPU work one thread
// enqueues for this job; the job itself is read by that thread alone.
unsafe impl Send for HybridJob<'_> {}
// SAFETY: as above; threads only read a job to take it.
unsafe impl Sync for HybridJob<'_> {}

/// The handle and decoders (by [`Huffman`] kind) every thread decodes with.
#[derive(Clone, Copy)]
struct Shared {
    handle: nvjpeg::Handle,
    decoders: [nvjpeg::Decoder; 2],
}

// SAFETY: nvJPEG's handle and decoder may be used by several threads at once (each with its
// own state); they outlive the threads (scoped to a call of `&mut Hybrid`).
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// A thread's decoder states (one per [`Huffman`] kind, each with its device buffer), pinned
/// buffers and stream.
struct Worker {
    states: [nvjpeg::State; 2],
    parsed: nvjpeg::JpegStream,
    params: nvjpeg::Params,
    pinned: [nvjpeg::PinnedBuf; 2],
    devices: [nvjpeg::DeviceBuf; 2],
    stream: Stream,
    /// Recorded after the GPU phase of the image that used each pinned buffer: waited on
    /// before the buffer is refilled.
    done: [Option<Event>; 2],
    next: usize,
}

// SAFETY: a worker's nvJPEG objects are used by one thread at a time (`&mut`), which binds the
// context first; nvJPEG's per-thread objects may move between threads.
unsafe impl Send for Worker {}

/// The hybrid decoder and its threads' states.
pub(crate) struct Hybrid {
    lib: Arc<Nvjpeg>,
    gpu: Arc<Gpu>,
    handle: nvjpeg::Handle,
    decoders: [nvjpeg::Decoder; 2],
    workers: Vec<Worker>,
    /// The threads' time and megasamples by kind, and images decoded, since made.
    spent: Spent,
    images: u64,
}

// SAFETY: used through `&mut self` only; the handle and decoder may be used from any thread.
unsafe impl Send for Hybrid {}

impl Hybrid {
    /// A hybrid decoder for `threads` host threads.
    pub(crate) fn new(lib: &Arc<Nvjpeg>, gpu: &Arc<Gpu>, threads: usize) -> Result<Hybrid> {
        gpu.bind()?;
        let handle = lib.create(nvjpeg::BACKEND_DEFAULT, nvjpeg::FLAGS_DEFAULT)?;
        let mut me = Hybrid {
            lib: lib.clone(),
            gpu: gpu.clone(),
            handle,
            decoders: [std::ptr::null_mut(); 2],
            workers: Vec::new(),
            spent: Spent::default(),
            images: 0,
        };
        for (k, backend) in [nvjpeg::BACKEND_HYBRID, nvjpeg::BACKEND_GPU_HYBRID]
            .into_iter()
            .enumerate()
        {
            // SAFETY: `handle` is live; what is made is kept in `me`, whose drop frees it.
            me.decoders[k] = unsafe { me.lib.decoder_create(handle, backend)? };
        }
        for _ in 0..threads {
            let w = me.worker()?;
            me.workers.push(w);
        }
        Ok(me)
    }

    /// One thread's objects (freed again if any of them cannot be made).
    fn worker(&self) -> Result<Worker> {
        let lib = &self.lib;
        let stream = Stream::new(&self.gpu)?;
        let mut w = Worker {
            states: [std::ptr::null_mut(); 2],
            parsed: std::ptr::null_mut(),
            params: std::ptr::null_mut(),
            pinned: [std::ptr::null_mut(); 2],
            devices: [std::ptr::null_mut(); 2],
            stream,
            done: [None, None],
            next: 0,
        };
        // SAFETY: `handle` and the decoders are live; each object is attached to a state made
        // from them; on an error `free` destroys what was made.
        let made = unsafe {
            (|| -> Result<()> {
                for k in 0..2 {
                    w.states[k] = lib.decoder_state_create(self.handle, self.decoders[k])?;
                    w.devices[k] = lib.device_buffer_create(self.handle)?;
                    lib.attach_device(w.states[k], w.devices[k])?;
                }
                w.parsed = lib.stream_create(self.handle)?;
                w.params = lib.params_create(self.handle, nvjpeg::OUTPUT_RGB)?;
                for p in &mut w.pinned {
                    *p = lib.pinned_create(self.handle)?;
                }
                Ok(())
            })()
        };
        match made {
            Ok(()) => Ok(w),
            Err(e) => {
                // SAFETY: nothing was enqueued with these objects.
                unsafe { free(lib, &mut w) };
                Err(e)
            }
        }
    }

    /// Host threads.
    pub(crate) fn threads(&self) -> usize {
        self.workers.len()
    }

    /// The threads' milliseconds and megasamples by [`Huffman`] kind, and images decoded,
    /// since made.
    pub(crate) fn spent(&self) -> (Spent, u64) {
        (self.spent, self.images)
    }

    /// Decodes `jobs` on the threads while `alongside` runs on the calling thread, then makes
    /// `after` wait (on the GPU) for all of the threads' work; gives the threads' time and
    /// megasamples for this batch. The first error fails the batch; the wait is set up whatever
    /// happens, so nothing reads the planes' memory early.
    ///
    /// # Safety
    /// Each job's bytes stay unchanged until its host phase has run (this returns after it) and
    /// its planes are device memory of this GPU large enough for the image, valid until `after`
    /// has run past the wait.
    pub(crate) unsafe fn decode<R>(
        &mut self,
        jobs: &[HybridJob<'_>],
        after: &Stream,
        alongside: impl FnOnce() -> R,
    ) -> (Result<Spent>, R) {
        if jobs.is_empty() {
            return (Ok(Spent::default()), alongside());
        }
        let taken = AtomicUsize::new(0);
        let used = self.workers.len().min(jobs.len());
        let (lib, gpu) = (&*self.lib, &self.gpu);
        let shared = Shared {
            handle: self.handle,
            decoders: self.decoders,
        };
        let (results, theirs): (Vec<(Result<()>, Spent, u64)>, R) = std::thread::scope(|s| {
            let running: Vec<_> = self.workers[..used]
                .iter_mut()
                .map(|w| {
                    let taken = &taken;
                    s.spawn(move || {
                        let mut spent = Spent::default();
                        let mut n = 0;
                        let r = gpu.bind().map_err(Error::from).and_then(|()| loop {
                            let i = taken.fetch_add(1, Ordering::Relaxed);
                            let Some(job) = jobs.get(i) else {
                                break Ok(());
                            };
                            let start = Instant::now();
                            // SAFETY: the caller's contract for the job; the worker is ours.
                            unsafe { w.decode(lib, shared, job)? };
                            let k = job.huffman as usize;
                            spent[k].0 += start.elapsed().as_secs_f64() * 1e3;
                            spent[k].1 += job.size;
                            n += 1;
                        });
                        (r, spent, n)
                    })
                })
                .collect();
            let theirs = alongside();
            let results = running
                .into_iter()
                .map(|t| {
                    t.join().unwrap_or((
                        Err(Error::Refused("a hybrid decoder thread panicked")),
                        Spent::default(),
                        0,
                    ))
                })
                .collect();
            (results, theirs)
        });
        let mut first = Ok(());
        let mut batch = Spent::default();
        for (r, spent, n) in results {
            for (k, (ms, mega)) in spent.into_iter().enumerate() {
                for total in [&mut self.spent[k], &mut batch[k]] {
                    total.0 += ms;
                    total.1 += mega;
                }
            }
            self.images += n;
            if first.is_ok() {
                first = r;
            }
        }
        for w in &self.workers[..used] {
            let waited = w.stream.record().and_then(|e| after.wait_event(&e));
            if let Err(e) = waited {
                // Without the wait nothing may reuse the planes before this worker is done.
                let _ = w.stream.synchronize();
                if first.is_ok() {
                    first = Err(e.into());
                }
            }
        }
        (first.map(|()| batch), theirs)
    }
}

impl Worker {
    /// Enqueues one image's decode on this worker's stream.
    ///
    /// # Safety
    /// As [`Hybrid::decode`] for `job`; `shared` is what this worker's objects were made
    /// from; the context is bound.
    unsafe fn decode(&mut self, lib: &Nvjpeg, shared: Shared, job: &HybridJob<'_>) -> Result<()> {
        let k = job.huffman as usize;
        let (handle, decoder, state) = (shared.handle, shared.decoders[k], self.states[k]);
        let b = self.next;
        if let Some(e) = self.done[b].take() {
            e.wait()?;
        }
        let mut planes = job.planes;
        // SAFETY: the objects are this worker's and live; the pinned buffer attached has no
        // copy in flight (its image's GPU phase is done, waited on above); the caller's
        // contract for the bytes and planes.
        unsafe {
            lib.attach_pinned(state, self.pinned[b])?;
            if !lib.parse_for(handle, decoder, self.params, self.parsed, job.data)? {
                return Err(Error::Refused(
                    "a JPEG nvJPEG's hybrid decoder does not take",
                ));
            }
            lib.decode_host(handle, decoder, state, self.params, self.parsed)?;
            lib.transfer_to_device(handle, decoder, state, self.parsed, self.stream.raw())?;
            let decoded = lib.decode_device(handle, decoder, state, &mut planes, self.stream.raw());
            // Recorded whatever happened: the copy out of the pinned buffer was enqueued.
            self.done[b] = Some(self.stream.record()?);
            decoded?;
        }
        self.next = 1 - b;
        Ok(())
    }
}

/// Destroys what of `w` was made.
///
/// # Safety
/// No work using `w`'s objects is pending (its stream is synchronised).
unsafe fn free(lib: &Nvjpeg, w: &mut Worker) {
    // SAFETY: the caller's contract; each object is destroyed once (null ones are skipped).
    unsafe {
        for st in w.states {
            if !st.is_null() {
                let _ = lib.state_destroy(st);
            }
        }
        if !w.parsed.is_null() {
            let _ = lib.stream_destroy(w.parsed);
        }
        if !w.params.is_null() {
            let _ = lib.params_destroy(w.params);
        }
        for p in w.pinned {
            if !p.is_null() {
                let _ = lib.pinned_destroy(p);
            }
        }
        for d in w.devices {
            if !d.is_null() {
                let _ = lib.device_buffer_destroy(d);
            }
        }
    }
}

impl Drop for Hybrid {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        for mut w in std::mem::take(&mut self.workers) {
            let _ = w.stream.synchronize();
            // SAFETY: the worker's stream is synchronised: nothing of it is pending.
            unsafe { free(&self.lib, &mut w) };
        }
        // SAFETY: the states made from them are destroyed above.
        unsafe {
            for d in self.decoders {
                if !d.is_null() {
                    let _ = self.lib.decoder_destroy(d);
                }
            }
            let _ = self.lib.destroy(self.handle);
        }
    }
}
