//! A stream's clock: a 64-bit counter in page-locked host memory that the stream itself
//! advances (`cuStreamWriteValue64`, in the batched calls the stream makes anyway), so the host
//! learns that the stream's work up to a point has run by reading memory, with no event: the
//! close fence of the buffers a `Gatherer` reads. One per stream (values from several streams
//! would not be ordered), made when first asked for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;

use crate::{Gpu, Result};

/// The counter, and the next value to write.
pub(crate) struct Clock {
    gpu: Arc<Gpu>,
    host: *mut u8,
    /// Its device address, for the stream's writes.
    pub(crate) addr: sys::CUdeviceptr,
    next: AtomicU64,
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clock").field("now", &self.now()).finish()
    }
}

// SAFETY: the counter is plain memory that the GPU writes and the host only reads (volatile);
// the handles are identifiers usable from any thread once the context is bound.
unsafe impl Send for Clock {}
// SAFETY: as above; `&Clock` only reads the counter or takes a value atomically.
unsafe impl Sync for Clock {}

impl Clock {
    pub(crate) fn new(gpu: &Arc<Gpu>) -> Result<Clock> {
        gpu.bind()?;
        let d = gpu.driver();
        let host = d.mem_alloc_host(8)?;
        // SAFETY: 8 bytes just allocated, page-locked; zeroed before the GPU may write them.
        unsafe { host.cast::<u64>().write_volatile(0) };
        // SAFETY: page-locked by `mem_alloc_host` in the bound context.
        let addr = match unsafe { d.mem_host_device_pointer(host) } {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: allocated above, no view of it kept.
                let _ = unsafe { d.mem_free_host(host) };
                return Err(e);
            }
        };
        Ok(Clock {
            gpu: gpu.clone(),
            host,
            addr,
            next: AtomicU64::new(1),
        })
    }

    /// A value the stream has not written yet, for its next tick.
    pub(crate) fn next_value(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    /// The last value the stream wrote.
    pub(crate) fn now(&self) -> u64 {
        // SAFETY: 8 aligned bytes of our own allocation, live while `self` is; the GPU writes
        // them whole (a 64-bit write), so a read sees the old or the new value.
        unsafe { self.host.cast::<u64>().read_volatile() }
    }

    /// Waits until the stream has written `value` (its work before that tick has run), or
    /// until `broken` says the context failed (its work will never run: nothing to wait for).
    pub(crate) fn wait_for(&self, value: u64, broken: impl Fn() -> bool) {
        while self.now() < value {
            if broken() {
                tracing::warn!("a stream's clock stopped short of {value}: its context failed");
                return;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Drop for Clock {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: allocated in `new`; the stream that writes it is gone or synchronised (a
        // `Stream` holds its clock and synchronises before it lets go), so nothing writes it.
        let _ = unsafe { self.gpu.driver().mem_free_host(self.host) };
    }
}
