//! nvJPEG's hybrid decoder on a GPU producer's host threads: each thread parses a JPEG and
//! Huffman-decodes it on the CPU (nvJPEG's host phase), copies the coefficients to the GPU and
//! runs the rest (IDCT, colour conversion) on CUDA cores, on a stream of its own. The threads
//! take a batch's images one at a time from a shared counter, so a large file does not hold
//! the others back, while the calling thread drives the JPEG engines with the rest of the batch.
//!
//! Each thread alternates two pinned buffers: the host phase of one image fills one while the
//! copy of the image before reads the other.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tensorport_cuda::{Event, Gpu, Stream};

use crate::nvjpeg::{self, Nvjpeg};
use crate::{Error, Result};

/// One image for the hybrid decoder: its bytes and its RGB planes in the batch's scratch.
pub(crate) struct HybridJob<'a> {
    pub data: &'a [u8],
    pub planes: nvjpeg::Image,
}

// SAFETY: the plane pointers are device addresses, written only by the GPU work one thread
// enqueues for this job; the job itself is read by that thread alone.
unsafe impl Send for HybridJob<'_> {}
// SAFETY: as above; threads only read a job to take it.
unsafe impl Sync for HybridJob<'_> {}

/// The handle and decoder every thread decodes with.
#[derive(Clone, Copy)]
struct Shared {
    handle: nvjpeg::Handle,
    decoder: nvjpeg::Decoder,
}

// SAFETY: nvJPEG's handle and decoder may be used by several threads at once (each with its
// own state); they outlive the threads (scoped to a call of `&mut Hybrid`).
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// A thread's decoder state, buffers and stream.
struct Worker {
    state: nvjpeg::State,
    parsed: nvjpeg::JpegStream,
    params: nvjpeg::Params,
    pinned: [nvjpeg::PinnedBuf; 2],
    device: nvjpeg::DeviceBuf,
    stream: Stream,
    /// Recorded after the copy out of each pinned buffer: waited on before it is refilled.
    copied: [Option<Event>; 2],
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
    decoder: nvjpeg::Decoder,
    workers: Vec<Worker>,
    /// Host time spent in the threads' nvJPEG calls, and images decoded, since made.
    host_ms: f64,
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
            decoder: std::ptr::null_mut(),
            workers: Vec::new(),
            host_ms: 0.0,
            images: 0,
        };
        // SAFETY: `handle` is live; what is made is kept in `me`, whose drop frees it.
        me.decoder = unsafe { me.lib.decoder_create(handle, nvjpeg::BACKEND_HYBRID)? };
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
            state: std::ptr::null_mut(),
            parsed: std::ptr::null_mut(),
            params: std::ptr::null_mut(),
            pinned: [std::ptr::null_mut(); 2],
            device: std::ptr::null_mut(),
            stream,
            copied: [None, None],
            next: 0,
        };
        // SAFETY: `handle` and `decoder` are live; each object is attached to a state made
        // from them; on an error `free` destroys what was made.
        let made = unsafe {
            (|| -> Result<()> {
                w.state = lib.decoder_state_create(self.handle, self.decoder)?;
                w.parsed = lib.stream_create(self.handle)?;
                w.params = lib.params_create(self.handle, nvjpeg::OUTPUT_RGB)?;
                for p in &mut w.pinned {
                    *p = lib.pinned_create(self.handle)?;
                }
                w.device = lib.device_buffer_create(self.handle)?;
                lib.attach_device(w.state, w.device)
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

    /// Host milliseconds in the threads' nvJPEG calls and images decoded, since made.
    pub(crate) fn host_time(&self) -> (f64, u64) {
        (self.host_ms, self.images)
    }

    /// Decodes `jobs` on the threads while `alongside` runs on the calling thread, then makes
    /// `after` wait (on the GPU) for all of the threads' work. The first error fails the batch;
    /// the wait is set up whatever happens, so nothing reads the planes' memory early.
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
    ) -> (Result<()>, R) {
        if jobs.is_empty() {
            return (Ok(()), alongside());
        }
        let taken = AtomicUsize::new(0);
        let used = self.workers.len().min(jobs.len());
        let (lib, gpu) = (&*self.lib, &self.gpu);
        let shared = Shared {
            handle: self.handle,
            decoder: self.decoder,
        };
        let (results, theirs): (Vec<(Result<()>, f64, u64)>, R) = std::thread::scope(|s| {
            let running: Vec<_> = self.workers[..used]
                .iter_mut()
                .map(|w| {
                    let taken = &taken;
                    s.spawn(move || {
                        let start = Instant::now();
                        let mut n = 0;
                        let r = gpu.bind().map_err(Error::from).and_then(|()| loop {
                            let i = taken.fetch_add(1, Ordering::Relaxed);
                            let Some(job) = jobs.get(i) else {
                                break Ok(());
                            };
                            // SAFETY: the caller's contract for the job; the worker is ours.
                            unsafe { w.decode(lib, shared, job)? };
                            n += 1;
                        });
                        (r, start.elapsed().as_secs_f64() * 1e3, n)
                    })
                })
                .collect();
            let theirs = alongside();
            let results = running
                .into_iter()
                .map(|t| {
                    t.join().unwrap_or((
                        Err(Error::Refused("a hybrid decoder thread panicked")),
                        0.0,
                        0,
                    ))
                })
                .collect();
            (results, theirs)
        });
        let mut first = Ok(());
        for (r, ms, n) in results {
            self.host_ms += ms;
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
        (first, theirs)
    }
}

impl Worker {
    /// Enqueues one image's decode on this worker's stream.
    ///
    /// # Safety
    /// As [`Hybrid::decode`] for `job`; `shared` is what this worker's objects were made
    /// from; the context is bound.
    unsafe fn decode(&mut self, lib: &Nvjpeg, shared: Shared, job: &HybridJob<'_>) -> Result<()> {
        let Shared { handle, decoder } = shared;
        let b = self.next;
        if let Some(e) = self.copied[b].take() {
            e.wait()?;
        }
        let mut planes = job.planes;
        // SAFETY: the objects are this worker's and live; the pinned buffer attached has no
        // copy in flight (waited on above); the caller's contract for the bytes and planes.
        unsafe {
            lib.attach_pinned(self.state, self.pinned[b])?;
            if !lib.parse_for(handle, decoder, self.params, self.parsed, job.data)? {
                return Err(Error::Refused(
                    "a JPEG nvJPEG's hybrid decoder does not take",
                ));
            }
            lib.decode_host(handle, decoder, self.state, self.params, self.parsed)?;
            lib.transfer_to_device(handle, decoder, self.state, self.parsed, self.stream.raw())?;
            self.copied[b] = Some(self.stream.record()?);
            lib.decode_device(handle, decoder, self.state, &mut planes, self.stream.raw())?;
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
        if !w.state.is_null() {
            let _ = lib.state_destroy(w.state);
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
        if !w.device.is_null() {
            let _ = lib.device_buffer_destroy(w.device);
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
            if !self.decoder.is_null() {
                let _ = self.lib.decoder_destroy(self.decoder);
            }
            let _ = self.lib.destroy(self.handle);
        }
    }
}
