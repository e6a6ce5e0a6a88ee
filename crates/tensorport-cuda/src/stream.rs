//! Streams and the events recorded on them.

use std::sync::Arc;

use cudarc::driver::sys;

use crate::{DevicePtr, Gpu, Result};

/// A CUDA stream.
#[derive(Debug)]
pub struct Stream {
    gpu: Arc<Gpu>,
    raw: sys::CUstream,
    /// Made when first asked for (`Stream::clock`); dropped after the stream is synchronised.
    clock: std::sync::OnceLock<Arc<crate::clock::Clock>>,
}

// SAFETY: stream handles may be used from any thread once the context is bound (we bind first).
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new non-blocking stream.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Stream> {
        gpu.bind()?;
        Ok(Stream {
            gpu: gpu.clone(),
            raw: gpu.driver().stream_create()?,
            clock: std::sync::OnceLock::new(),
        })
    }
    /// The GPU whose context the stream belongs to.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    /// The raw `CUstream`, for `tensorport::DeviceTensor::wait_ready` and friends.
    pub fn raw(&self) -> *mut std::ffi::c_void {
        self.raw.cast()
    }

    /// Waits for all work on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: `raw` lives until `drop`; its context is bound.
        unsafe { self.gpu.driver().stream_sync(self.raw) }
    }
    /// The stream's clock (see `clock.rs`), made the first time.
    pub(crate) fn clock(&self) -> Result<&Arc<crate::clock::Clock>> {
        if let Some(c) = self.clock.get() {
            return Ok(c);
        }
        let c = Arc::new(crate::clock::Clock::new(&self.gpu)?);
        Ok(self.clock.get_or_init(|| c))
    }
    /// Whether all work enqueued so far has run (no wait).
    pub fn is_idle(&self) -> Result<bool> {
        self.gpu.bind()?;
        // SAFETY: `raw` lives until `drop`; its context is bound.
        unsafe { self.gpu.driver().stream_query(self.raw) }
    }
    /// Copies `src` to device address `dst` on this stream (asynchronously; from pinned memory,
    /// e.g. a registered pool slot, this is a DMA).
    ///
    /// # Safety
    /// `dst..dst+src.len()` must be device memory of this context, and `src` must stay valid
    /// and unchanged until the copy has run (synchronise before releasing it).
    pub unsafe fn copy_host_to_device_async(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: the caller's contract.
        unsafe {
            self.gpu
                .driver()
                .memcpy_htod_async(dst.raw(), src.as_ptr(), src.len(), self.raw)
        }
    }

    /// Copies `len` bytes from device address `src` to `dst` on this stream (asynchronously).
    ///
    /// # Safety
    /// Both ranges must be device memory of (or imported into) this context, valid until the
    /// copy has run.
    pub unsafe fn copy_device_to_device_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
    ) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: the caller's contract.
        unsafe {
            self.gpu
                .driver()
                .memcpy_dtod_async(dst.raw(), src.raw(), len, self.raw)
        }
    }

    /// Makes this stream wait (on the GPU) for the work enqueued so far on `other`, a stream of
    /// the same context that another library owns (torch's current stream, say).
    ///
    /// # Safety
    /// `other` must be a live stream of this context (or null: the legacy default stream).
    pub unsafe fn wait_for_raw(&self, other: *mut std::ffi::c_void) -> Result<()> {
        self.gpu.bind()?;
        let d = &self.gpu.driver();
        let e = d.event_create()?;
        // SAFETY: the caller's contract for `other`; `e` and `raw` are ours and live. An event
        // may be destroyed while a wait on it is pending: the driver frees it after.
        unsafe {
            let r = d
                .event_record(e, other.cast())
                .and_then(|()| d.stream_wait_event(self.raw, e));
            let _ = d.event_destroy(e);
            r
        }
    }

    /// Makes this stream wait (on the GPU) for the work recorded before `e` on another stream of
    /// the same context.
    pub fn wait_event(&self, e: &Event) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: both handles are live (the event until after this call; a pending wait on an
        // event destroyed later is the driver's to keep).
        unsafe { self.gpu.driver().stream_wait_event(self.raw, e.raw) }
    }

    /// Records an event now and returns it; [`Event::wait`] blocks until the work before it ran.
    pub fn record(&self) -> Result<Event> {
        self.gpu.bind()?;
        let e = Event {
            gpu: self.gpu.clone(),
            raw: self.gpu.driver().event_create()?,
        };
        // SAFETY: both handles are live and belong to the bound context.
        unsafe { self.gpu.driver().event_record(e.raw, self.raw)? };
        Ok(e)
    }
    /// Alias of [`Stream::record`] for the copy-then-release pattern: release a slot only after
    /// `copy_done()?.wait()?`.
    pub fn copy_done(&self) -> Result<Event> {
        self.record()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: `raw` is live until the destroy below.
        let _ = unsafe { self.gpu.driver().stream_sync(self.raw) };
        // SAFETY: a live stream, synchronised above, not used again.
        let _ = unsafe { self.gpu.driver().stream_destroy(self.raw) };
    }
}

/// A recorded CUDA event.
#[derive(Debug)]
pub struct Event {
    gpu: Arc<Gpu>,
    raw: sys::CUevent,
}

// SAFETY: event handles may be used from any thread once the context is bound.
unsafe impl Send for Event {}

impl Event {
    /// Blocks until the work recorded before this event has run.
    pub fn wait(&self) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: `raw` lives until `drop`.
        unsafe { self.gpu.driver().event_sync(self.raw) }
    }
    /// Milliseconds between `start` and this event (both completed).
    /// Both events must have completed ([`Event::wait`] on the later one).
    pub fn elapsed_since(&self, start: &Event) -> Result<f32> {
        // SAFETY: both events are live; the driver reports an error (not UB) if one has not
        // completed.
        unsafe { self.gpu.driver().event_elapsed_ms(start.raw, self.raw) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: a live event not used again.
        let _ = unsafe { self.gpu.driver().event_destroy(self.raw) };
    }
}
