//! The device path's server side: [`CudaImporter`] opens what producers register (legacy CUDA
//! IPC handles, or VMM allocations sent as file descriptors), checking each claimed length
//! against the allocation behind it. Each hand-off is fenced in both directions without
//! blocking the host, by one of two [`Fence`]s: interprocess events ("ready" from the producer,
//! "released" from the server), or two 64-bit semaphores after the buffer's bytes that each
//! side's GPU writes and the other's waits on. See `tensorport::DeviceTensor`; the producer side
//! is `crate::GpuProducer` (`gpu_producer.rs`).

use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;
use tensorport::wire::RawDeviceHandle;
use tensorport::{DeviceImporter, DeviceTensor, ImportError, ImportedDevice};

use crate::gpu::Gpu;
use crate::{Error, Stream};

static LIVE_IMPORTS: AtomicUsize = AtomicUsize::new(0);

/// Producer buffers currently open in this (server) process.
pub fn live_imports() -> usize {
    LIVE_IMPORTS.load(Ordering::SeqCst)
}

fn handle64(v: &[u8]) -> std::result::Result<[u8; 64], ImportError> {
    v.try_into()
        .map_err(|_| ImportError::BadHandle(format!("handle of {} bytes, expected 64", v.len())))
}

/// Bytes after a timeline buffer's data: the "ready" and "released" semaphores.
const SEMAPHORE_BYTES: u64 = 16;

/// How a buffer's hand-offs are fenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// Interprocess CUDA events ("ready" from the producer, "released" from the server).
    Event,
    /// Two 64-bit semaphores after the buffer's bytes, written and waited on by the GPUs
    /// (`cuStreamWriteValue64` / `cuStreamWaitValue64`).
    Timeline,
}

/// Opens producers' device buffers in the server's context (the server's
/// `ServerConfig::device`).
#[derive(Debug, Clone)]
pub struct CudaImporter {
    gpu: Arc<Gpu>,
    fence_timeout: std::time::Duration,
}

impl CudaImporter {
    /// Imports into `gpu`'s primary context; an event-fenced tensor not signalled ready within
    /// [`crate::DEFAULT_FENCE_TIMEOUT`] is not waited for.
    pub fn new(gpu: Arc<Gpu>) -> CudaImporter {
        CudaImporter {
            gpu,
            fence_timeout: crate::DEFAULT_FENCE_TIMEOUT,
        }
    }

    /// How long an event-fenced tensor's "ready" event is polled from the host before a
    /// stream is made to wait on it (the wait is enqueued only once it has fired, so a producer
    /// that never signals cannot stall a stream); past it the tensor is late.
    pub fn with_fence_timeout(mut self, timeout: std::time::Duration) -> CudaImporter {
        self.fence_timeout = timeout;
        self
    }
}

pub(crate) struct Imported {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: u64,
    pub(crate) fence: Fence,
    /// Event mode: the producer's "ready" event. Timeline mode: null.
    ready: sys::CUevent,
    /// Event mode: our interprocess "released" event. Timeline mode: a plain event recorded
    /// with each release, so closing the buffer can wait for the last read.
    pub(crate) release: sys::CUevent,
    release_handle: Vec<u8>,
    /// VMM imports: the allocation handle and the mapped size; legacy IPC imports: `None`.
    vmm: Option<(sys::CUmemGenericAllocationHandle, usize)>,
    /// Timeline mode: the highest "ready" value a server stream was made to wait for.
    awaited: AtomicU64,
    /// The producer's session ended: its "ready" fence is not waited on any more (`abandon`).
    abandoned: AtomicBool,
    /// The last tick of each stream clock after which a `Gatherer` read the buffer: closing
    /// waits until each clock has passed it (as it waits on `release` for the per-tensor path).
    read_by: std::sync::Mutex<Vec<(Arc<crate::clock::Clock>, u64)>>,
    /// Event mode: how long "ready" is polled before the tensor is late.
    fence_timeout: std::time::Duration,
    /// Event mode: the tensor in flight was not signalled ready in time, and no stream was made
    /// to wait for it (taken by `Gatherer::synchronize`, which reports it late).
    pub(crate) late: AtomicBool,
}

impl Imported {
    /// Event mode: polls "ready" until it has fired (true) or the fence timeout passes, or the
    /// producer's session has ended (false).
    fn await_event(&self) -> std::result::Result<bool, String> {
        let d = self.gpu.driver();
        let start = std::time::Instant::now();
        loop {
            if self.abandoned.load(Ordering::SeqCst) {
                return Ok(false);
            }
            // SAFETY: `ready` was opened in `import` and lives with `self`.
            if unsafe { d.event_query(self.ready) }.map_err(|e| e.to_string())? {
                return Ok(true);
            }
            let waited = start.elapsed();
            if waited >= self.fence_timeout {
                return Ok(false);
            }
            if waited < std::time::Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// The "ready" semaphore (timeline mode): right after the registered bytes.
    pub(crate) fn ready_addr(&self) -> sys::CUdeviceptr {
        self.ptr + self.len
    }

    /// The "released" semaphore (timeline mode): after the "ready" one.
    pub(crate) fn released_addr(&self) -> sys::CUdeviceptr {
        self.ptr + self.len + 8
    }

    /// Whether a server stream should wait for "ready" to reach `value` (not once the buffer
    /// is abandoned: nobody would signal it); notes the value, for [`Imported::abandon`].
    pub(crate) fn await_ready(&self, value: u64) -> bool {
        self.awaited.fetch_max(value, Ordering::SeqCst);
        !self.abandoned.load(Ordering::SeqCst)
    }

    /// The highest "ready" value a server stream waited for.
    pub(crate) fn awaited(&self) -> u64 {
        self.awaited.load(Ordering::SeqCst)
    }

    /// A stream read the buffer before its clock's tick `value`.
    pub(crate) fn read_before(&self, clock: &Arc<crate::clock::Clock>, value: u64) {
        let mut r = self.read_by.lock().unwrap_or_else(|p| p.into_inner());
        match r.iter_mut().find(|(c, _)| Arc::ptr_eq(c, clock)) {
            Some(e) => e.1 = e.1.max(value),
            None => r.push((clock.clone(), value)),
        }
    }
}

// SAFETY: the handles are identifiers usable from any thread once the context is bound, which
// every method does first.
unsafe impl Send for Imported {}
// SAFETY: as above; the methods only enqueue driver work.
unsafe impl Sync for Imported {}

impl DeviceImporter for CudaImporter {
    fn import(
        &self,
        len: u64,
        handle: &RawDeviceHandle,
        fd: Option<std::os::fd::OwnedFd>,
    ) -> std::result::Result<Arc<dyn ImportedDevice>, ImportError> {
        let d = self.gpu.driver();
        self.gpu
            .bind()
            .map_err(|e| ImportError::Driver(e.to_string()))?;
        // Opening a handle fails for a handle that is not a live allocation of this device.
        let bad = |e: Error| ImportError::BadHandle(e.to_string());
        let driver = |e: Error| ImportError::Driver(e.to_string());
        let extra = match handle {
            RawDeviceHandle::LegacyIpc { .. } => 0,
            _ => SEMAPHORE_BYTES,
        };
        // A timeline's semaphores follow the data, and the driver writes them 8 bytes at a
        // time: misaligned, every wait on them would fail (and with it every batch it is in).
        if extra > 0 && !len.is_multiple_of(8) {
            return Err(ImportError::BadHandle(format!(
                "a timeline-fenced buffer's length must be a multiple of 8 bytes (its semaphores follow it, 8-byte aligned); {len} is not"
            )));
        }
        let registered = len
            .checked_add(extra)
            .ok_or(ImportError::LongerThanAllocation {
                registered: u64::MAX,
                available: 0,
            })?;
        let (ptr, vmm, event, fence) = match handle {
            RawDeviceHandle::LegacyIpc { memory, event } => {
                let ptr = d.ipc_open_mem_handle(&handle64(memory)?).map_err(bad)?;
                (ptr, None, Some(handle64(event)?), Fence::Event)
            }
            RawDeviceHandle::LegacyIpcTimeline { memory } => {
                let ptr = d.ipc_open_mem_handle(&handle64(memory)?).map_err(bad)?;
                (ptr, None, None, Fence::Timeline)
            }
            RawDeviceHandle::VmmPosixFd => {
                let fd = fd.ok_or_else(|| {
                    ImportError::BadHandle("a VMM handle without its file descriptor".into())
                })?;
                // The producer allocated the data, then the semaphores, rounded up to the
                // granularity: the same size (one device), which must be mapped whole. The
                // driver refuses to map more than the allocation holds.
                let gran = d.vmm_granularity(self.gpu.dev()).map_err(driver)?;
                let size = usize::try_from(registered)
                    .ok()
                    .and_then(|r| r.checked_next_multiple_of(gran))
                    .ok_or(ImportError::LongerThanAllocation {
                        registered,
                        available: 0,
                    })?;
                let h = d
                    .vmm_import_fd(std::os::fd::AsFd::as_fd(&fd))
                    .map_err(bad)?;
                match d.vmm_map(self.gpu.dev(), h, size) {
                    Ok(ptr) => (ptr, Some((h, size)), None, Fence::Timeline),
                    Err(e) => {
                        // SAFETY: imported above and mapped nowhere; released once.
                        unsafe { sys::cuMemRelease(h) };
                        return Err(ImportError::BadHandle(format!(
                            "mapping {size} bytes of the VMM allocation failed ({e}); is the registered length ({len}) more than the allocation holds?"
                        )));
                    }
                }
                // `fd` closes here: the imported handle keeps the memory.
            }
        };
        let mut made = Imported {
            gpu: self.gpu.clone(),
            ptr,
            len,
            fence,
            ready: std::ptr::null_mut(),
            release: std::ptr::null_mut(),
            release_handle: Vec::new(),
            vmm,
            awaited: AtomicU64::new(0),
            abandoned: AtomicBool::new(false),
            read_by: std::sync::Mutex::new(Vec::new()),
            fence_timeout: self.fence_timeout,
            late: AtomicBool::new(false),
        };
        LIVE_IMPORTS.fetch_add(1, Ordering::SeqCst);
        // From here `made` cleans up whatever was opened if a later step fails.
        // The producer's length is a claim: the allocation behind the handle must hold it (and
        // the semaphores after it), or every read past its end would fault our context.
        let (base, size) = d.mem_address_range(ptr).map_err(driver)?;
        let available = (base + size as u64).saturating_sub(ptr);
        if registered > available {
            return Err(ImportError::LongerThanAllocation {
                registered,
                available,
            });
        }
        let err = |e: Error| ImportError::Driver(e.to_string());
        match event {
            Some(event) => {
                made.ready = d.ipc_open_event_handle(&event).map_err(bad)?;
                made.release = d.event_create_interprocess().map_err(err)?;
                // SAFETY: `release` was just created as an interprocess event.
                made.release_handle = unsafe { d.ipc_get_event_handle(made.release) }
                    .map_err(err)?
                    .to_vec();
            }
            None => made.release = d.event_create().map_err(err)?,
        }
        Ok(Arc::new(made))
    }
}

impl ImportedDevice for Imported {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn release_event_handle(&self) -> Vec<u8> {
        self.release_handle.clone()
    }
    fn timeline(&self) -> bool {
        self.fence == Fence::Timeline
    }
    unsafe fn wait_ready(
        &self,
        stream: *mut c_void,
        value: Option<u64>,
    ) -> std::result::Result<(), String> {
        self.gpu.bind().map_err(|e| e.to_string())?;
        let d = self.gpu.driver();
        if self.fence == Fence::Event && value.is_none() {
            // Polled from the host first: a stream made to wait on an event that never fires
            // would stall every batch behind it for good (events cannot be let through as a
            // timeline can).
            self.late.store(false, Ordering::SeqCst);
            if !self.await_event()? {
                self.late.store(true, Ordering::SeqCst);
                return Err(format!(
                    "the producer's tensor was not signalled ready within {:?}",
                    self.fence_timeout
                ));
            }
        }
        // SAFETY: the caller passes a live stream of this context; `ready` lives with `self`;
        // the "ready" semaphore is the 8 bytes right after the `len` bytes the producer
        // registered, inside its allocation (descriptors were checked against `len` only).
        unsafe {
            match (self.fence, value) {
                (Fence::Event, None) => d.stream_wait_event(stream.cast(), self.ready),
                (Fence::Timeline, Some(v)) if self.await_ready(v) => {
                    d.stream_wait_value64(stream.cast(), self.ready_addr(), v)
                }
                (Fence::Timeline, Some(_)) => Ok(()),
                _ => return Err("the fence does not match the buffer's kind".into()),
            }
        }
        .map_err(|e| e.to_string())
    }
    unsafe fn record_release(
        &self,
        stream: *mut c_void,
        value: Option<u64>,
    ) -> std::result::Result<(), String> {
        self.gpu.bind().map_err(|e| e.to_string())?;
        let d = self.gpu.driver();
        // SAFETY: as above; the "released" semaphore follows the "ready" one.
        unsafe {
            match (self.fence, value) {
                (Fence::Event, None) => d.event_record(self.release, stream.cast()),
                (Fence::Timeline, Some(v)) => d
                    .stream_write_value64(stream.cast(), self.released_addr(), v)
                    .and_then(|()| d.event_record(self.release, stream.cast())),
                _ => return Err("the fence does not match the buffer's kind".into()),
            }
        }
        .map_err(|e| e.to_string())
    }
    fn abandon(&self) {
        if self.abandoned.swap(true, Ordering::SeqCst) || self.fence != Fence::Timeline {
            // Event fences cannot be signalled from here (see `stall.rs`).
            return;
        }
        match self.let_through_abandoned() {
            Ok(Some((was, now))) => tracing::warn!(
                "a gone producer's buffer was still awaited (ready {was}, awaited {now}): its wait was let through"
            ),
            Ok(None) => {}
            Err(e) => tracing::error!("letting a gone producer's fence through failed: {e}"),
        }
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        let d = self.gpu.driver();
        let _ = self.gpu.bind();
        // The gatherers' reads: each stream clock past its tick after them (as long as the
        // context works; a broken one runs nothing more, as `event_sync` below then says).
        let read_by = std::mem::take(self.read_by.get_mut().unwrap_or_else(|p| p.into_inner()));
        let release = self.release;
        // SAFETY: `release` lives until destroyed below.
        let broken = || !release.is_null() && unsafe { d.event_query(release) }.is_err();
        for (clock, value) in read_by {
            clock.wait_for(value, broken);
        }
        // SAFETY: every handle below was created or opened in `import` (null ones are skipped)
        // and is not used after this. The release event was recorded after the last read, so
        // waiting on it makes sure no copy still reads the mapping when it is closed.
        unsafe {
            if !self.release.is_null() {
                let _ = d.event_sync(self.release);
                let _ = d.event_destroy(self.release);
            }
            if !self.ready.is_null() {
                let _ = d.event_destroy(self.ready);
            }
            match self.vmm {
                Some((h, size)) => {
                    let _ = d.vmm_unmap_release(self.ptr, size, h);
                }
                None => {
                    let _ = d.ipc_close_mem_handle(self.ptr);
                }
            }
        }
        LIVE_IMPORTS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Letting a gone or late producer's wait through (see `stall.rs`): the buffer's "ready"
/// semaphore read and written from a side stream that no fence wait blocks.
impl Imported {
    /// For an abandoned buffer (its producer's session ended): if a server stream was made to wait
    /// for a "ready" value the semaphore has not reached, writes that value. Returns the value
    /// found and the one written, if it wrote.
    pub(crate) fn let_through_abandoned(&self) -> crate::Result<Option<(u64, u64)>> {
        let awaited = self.awaited();
        if awaited == 0 {
            return Ok(None);
        }
        let side = Stream::new(&self.gpu)?;
        let now = self.ready_value(&side)?;
        if now >= awaited {
            return Ok(None);
        }
        self.signal_ready(&side, awaited)?;
        side.synchronize()?;
        Ok(Some((now, awaited)))
    }

    /// The buffer's "ready" semaphore as it is now, read on `side` (a stream of the buffer's
    /// context that no fence wait blocks).
    pub(crate) fn ready_value(&self, side: &Stream) -> crate::Result<u64> {
        let mut v = [0u8; 8];
        // SAFETY: the semaphore is the 8 bytes after the registered ones, inside the allocation
        // (checked at import) and open while `imp` lives; `v` is 8 writable bytes that outlive
        // the copy (synchronised before it is read).
        unsafe {
            self.gpu.driver().memcpy_dtoh_async(
                v.as_mut_ptr(),
                self.ready_addr(),
                8,
                side.raw().cast(),
            )?;
        }
        side.synchronize()?;
        Ok(u64::from_le_bytes(v))
    }

    /// Writes `value` into the buffer's "ready" semaphore on `side`.
    pub(crate) fn signal_ready(&self, side: &Stream, value: u64) -> crate::Result<()> {
        // SAFETY: as in `ready_value`; `side` is a live stream of the buffer's context.
        unsafe {
            self.gpu
                .driver()
                .stream_write_value64(side.raw().cast(), self.ready_addr(), value)
        }
    }
}

/// Whether `t` is an event-fenced tensor of `gpu`'s importer that was not signalled ready in
/// time (nothing was made to wait for it).
pub(crate) fn event_late(t: &DeviceTensor, gpu: &Arc<Gpu>) -> bool {
    let any: &dyn Any = t.buffer();
    any.downcast_ref::<Imported>().is_some_and(|imp| {
        imp.fence == Fence::Event && Arc::ptr_eq(&imp.gpu, gpu) && imp.late.load(Ordering::SeqCst)
    })
}

/// Takes the late mark of `t` (see [`event_late`]): whether it was set.
pub(crate) fn take_event_late(t: &DeviceTensor, gpu: &Arc<Gpu>) -> bool {
    let any: &dyn Any = t.buffer();
    any.downcast_ref::<Imported>().is_some_and(|imp| {
        imp.fence == Fence::Event
            && Arc::ptr_eq(&imp.gpu, gpu)
            && imp.late.swap(false, Ordering::SeqCst)
    })
}

/// A tensor whose fence is a timeline semaphore of a buffer our importer opened in `gpu`'s
/// context, with the value to wait for; `None` for the others (fenced one by one).
pub(crate) fn timeline<'a>(t: &'a DeviceTensor, gpu: &Arc<Gpu>) -> Option<(&'a Imported, u64)> {
    let any: &dyn Any = t.buffer();
    let imp = any.downcast_ref::<Imported>()?;
    let v = t.timeline()?;
    (imp.fence == Fence::Timeline && Arc::ptr_eq(&imp.gpu, gpu)).then_some((imp, v))
}
