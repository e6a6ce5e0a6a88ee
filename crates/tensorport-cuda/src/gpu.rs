//! One type per resource: the device's primary context, device and pinned buffers, streams,
//! events, pool registrations.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use tensorport_shm::{HostPool, PinHook, PinRegistration};

use crate::{Driver, Error, Result};

/// A device and its retained primary context (the context dfdx/cudarc also use, so memory and
/// registrations made here are valid there).
#[derive(Debug)]
pub struct Gpu {
    driver: Driver,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    ordinal: i32,
}

// SAFETY: the CUDA driver API is thread-safe; a context handle may be made current on any thread
// (every method here does so before use), and the handle itself is just an identifier.
unsafe impl Send for Gpu {}
// SAFETY: as above; `&Gpu` only allows calls that bind the context first.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Loads the driver, retains device `ordinal`'s primary context and makes it current here.
    pub fn open(ordinal: i32) -> Result<Arc<Gpu>> {
        let driver = Driver::load()?;
        let n = driver.device_count()?;
        if ordinal < 0 || ordinal >= n {
            return Err(Error::NoDevice(ordinal, n));
        }
        let dev = driver.device(ordinal)?;
        let ctx = driver.primary_ctx_retain(dev)?;
        let gpu = Gpu {
            driver,
            dev,
            ctx,
            ordinal,
        };
        gpu.bind()?;
        Ok(Arc::new(gpu))
    }

    pub(crate) fn dev(&self) -> sys::CUdevice {
        self.dev
    }

    /// Whether VMM allocations can be exported as POSIX file descriptors on this device.
    pub fn supports_posix_fd(&self) -> Result<bool> {
        Ok(self.driver.attribute(
            self.dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
        )? != 0)
    }

    /// (free, total) bytes of device memory.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        self.driver.mem_get_info()
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `ctx` was retained in `open` and is released only in `drop`.
        unsafe { self.driver.ctx_set_current(self.ctx) }
    }

    /// The driver calls.
    pub fn driver(&self) -> &Driver {
        &self.driver
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.driver.primary_ctx_release(self.dev);
    }
}

/// Device memory from `cuMemAlloc`, or exportable VMM memory (`cuMemCreate`), freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// VMM: the allocation handle and the mapped size (a multiple of the granularity).
    vmm: Option<(sys::CUmemGenericAllocationHandle, usize)>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on `gpu`.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<DeviceBuffer> {
        gpu.bind()?;
        let ptr = gpu.driver.mem_alloc(len.max(1))?;
        Ok(DeviceBuffer {
            gpu: gpu.clone(),
            ptr,
            len,
            vmm: None,
        })
    }

    /// Allocates at least `len` bytes of VMM memory that can be exported as a POSIX fd
    /// ([`DeviceBuffer::export_fd`]), mapped for `gpu`.
    pub fn new_exportable(gpu: &Arc<Gpu>, len: usize) -> Result<DeviceBuffer> {
        gpu.bind()?;
        let d = &gpu.driver;
        let size = len.max(1).next_multiple_of(d.vmm_granularity(gpu.dev)?);
        let h = d.vmm_create(gpu.dev, size)?;
        let ptr = match d.vmm_map(gpu.dev, h, size) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: nothing maps the allocation; released once.
                unsafe { sys::cuMemRelease(h) };
                return Err(e);
            }
        };
        Ok(DeviceBuffer {
            gpu: gpu.clone(),
            ptr,
            len: size,
            vmm: Some((h, size)),
        })
    }

    /// A POSIX fd for this VMM buffer, to pass to another process (`SCM_RIGHTS`).
    pub fn export_fd(&self) -> Result<std::os::fd::OwnedFd> {
        let (h, _) = self.vmm.ok_or(crate::Error::NotExportable)?;
        self.gpu.driver.vmm_export_fd(h)
    }
    /// Device address.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Copies `src` to the start of this buffer on `stream` (asynchronously).
    ///
    /// # Safety
    ///
    /// The copy reads `src` after this returns, while the borrow has ended: the caller must keep
    /// those bytes allocated and unchanged until the stream has passed this point — wait for an
    /// event recorded after this call ([`Stream::copy_done`]) or synchronize the stream — before
    /// freeing, reusing or writing them. (Safe code could otherwise free the slice mid-DMA.)
    pub unsafe fn copy_from_host_async(&self, src: &[u8], stream: &Stream) -> Result<()> {
        assert!(src.len() <= self.len, "copy larger than the buffer");
        self.gpu.bind()?;
        // SAFETY: dst is this buffer (long enough, checked); src is valid now, and the caller
        // keeps it valid until the stream passes this point (documented above).
        unsafe {
            self.gpu
                .driver
                .memcpy_htod_async(self.ptr, src.as_ptr(), src.len(), stream.raw)
        }
    }
    /// Fills the buffer with the 32-bit word `value` on `stream` (asynchronously).
    pub fn fill_u32_async(&self, value: u32, stream: &Stream) -> Result<()> {
        self.fill_u32_range_async(0, self.len / 4 * 4, value, stream)
    }

    /// Fills `bytes` bytes from byte `offset` with the 32-bit word `value` on `stream`.
    pub fn fill_u32_range_async(
        &self,
        offset: usize,
        bytes: usize,
        value: u32,
        stream: &Stream,
    ) -> Result<()> {
        assert!(
            offset.is_multiple_of(4) && offset + bytes <= self.len,
            "range outside the buffer"
        );
        self.gpu.bind()?;
        // SAFETY: the range lies in the buffer (checked), on a live stream of its context.
        unsafe {
            self.gpu
                .driver
                .memset_d32_async(self.ptr + offset as u64, value, bytes / 4, stream.raw)
        }
    }

    /// Copies `len` bytes from device address `src` into the start of this buffer on `stream`.
    ///
    /// # Safety
    /// `src..src+len` must be device memory of this context that stays valid (and is not
    /// written) until the copy has run, e.g. a `tensorport::DeviceTensor` after `wait_ready`.
    pub unsafe fn copy_from_device_async(
        &self,
        src: u64,
        len: usize,
        stream: &Stream,
    ) -> Result<()> {
        assert!(len <= self.len, "copy larger than the buffer");
        self.gpu.bind()?;
        // SAFETY: dst is this buffer (checked); src is the caller's contract.
        unsafe {
            self.gpu
                .driver
                .memcpy_dtod_async(self.ptr, src, len, stream.raw)
        }
    }

    /// Copies the first `dst.len()` bytes back to the host (synchronously).
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        self.copy_to_host_at(0, dst)
    }

    /// Copies `dst.len()` bytes from `offset` on back to the host (synchronously).
    pub fn copy_to_host_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        assert!(
            offset
                .checked_add(dst.len())
                .is_some_and(|end| end <= self.len),
            "copy past the buffer's end"
        );
        self.gpu.bind()?;
        // SAFETY: both ranges are valid and sized as checked.
        unsafe {
            self.gpu
                .driver
                .memcpy_dtoh(dst.as_mut_ptr(), self.ptr + offset as u64, dst.len())
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        if let Some((h, size)) = self.vmm {
            // SAFETY: mapped and created in `new_exportable`; callers synchronise before
            // dropping buffers with pending work, and nothing uses the range after this.
            let _ = unsafe { self.gpu.driver.vmm_unmap_release(self.ptr, size, h) };
            return;
        }
        // SAFETY: allocated by mem_alloc; callers synchronise streams before dropping buffers
        // they are copying into (cuMemFree also synchronises the device).
        let _ = unsafe { self.gpu.driver.mem_free(self.ptr) };
    }
}

/// Page-locked host memory from `cuMemAllocHost` (the reference for pinned bandwidth).
#[derive(Debug)]
pub struct PinnedBuffer {
    gpu: Arc<Gpu>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory owned by this value.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` page-locked bytes.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<PinnedBuffer> {
        gpu.bind()?;
        let ptr = gpu.driver.mem_alloc_host(len.max(1))?;
        Ok(PinnedBuffer {
            gpu: gpu.clone(),
            ptr,
            len,
        })
    }
    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes allocated by cuMemAllocHost, owned exclusively via `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: allocated by mem_alloc_host; no view outlives `self`.
        let _ = unsafe { self.gpu.driver.mem_free_host(self.ptr) };
    }
}

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
            raw: gpu.driver.stream_create()?,
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
        unsafe { self.gpu.driver.stream_sync(self.raw) }
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
        unsafe { self.gpu.driver.stream_query(self.raw) }
    }
    /// Copies `src` to device address `dst` on this stream (asynchronously; from pinned memory,
    /// e.g. a registered pool slot, this is a DMA).
    ///
    /// # Safety
    /// `dst..dst+src.len()` must be device memory of this context, and `src` must stay valid
    /// and unchanged until the copy has run (synchronise before releasing it).
    pub unsafe fn copy_host_to_device_async(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: the caller's contract.
        unsafe {
            self.gpu
                .driver
                .memcpy_htod_async(dst, src.as_ptr(), src.len(), self.raw)
        }
    }

    /// Copies `len` bytes from device address `src` to `dst` on this stream (asynchronously).
    ///
    /// # Safety
    /// Both ranges must be device memory of (or imported into) this context, valid until the
    /// copy has run.
    pub unsafe fn copy_device_to_device_async(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: the caller's contract.
        unsafe { self.gpu.driver.memcpy_dtod_async(dst, src, len, self.raw) }
    }

    /// Makes this stream wait (on the GPU) for the work enqueued so far on `other`, a stream of
    /// the same context that another library owns (torch's current stream, say).
    ///
    /// # Safety
    /// `other` must be a live stream of this context (or null: the legacy default stream).
    pub unsafe fn wait_for_raw(&self, other: *mut std::ffi::c_void) -> Result<()> {
        self.gpu.bind()?;
        let d = &self.gpu.driver;
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

    /// Records an event now and returns it; [`Event::wait`] blocks until the work before it ran.
    pub fn record(&self) -> Result<Event> {
        self.gpu.bind()?;
        let e = Event {
            gpu: self.gpu.clone(),
            raw: self.gpu.driver.event_create()?,
        };
        // SAFETY: both handles are live and belong to the bound context.
        unsafe { self.gpu.driver.event_record(e.raw, self.raw)? };
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
        let _ = unsafe { self.gpu.driver.stream_sync(self.raw) };
        // SAFETY: a live stream, synchronised above, not used again.
        let _ = unsafe { self.gpu.driver.stream_destroy(self.raw) };
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
        unsafe { self.gpu.driver.event_sync(self.raw) }
    }
    /// Milliseconds between `start` and this event (both completed).
    /// Both events must have completed ([`Event::wait`] on the later one).
    pub fn elapsed_since(&self, start: &Event) -> Result<f32> {
        // SAFETY: both events are live; the driver reports an error (not UB) if one has not
        // completed.
        unsafe { self.gpu.driver.event_elapsed_ms(start.raw, self.raw) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: a live event not used again.
        let _ = unsafe { self.gpu.driver.event_destroy(self.raw) };
    }
}

static LIVE_REGISTRATIONS: AtomicUsize = AtomicUsize::new(0);

/// Pools currently registered with `cuMemHostRegister` by this process.
pub fn live_registrations() -> usize {
    LIVE_REGISTRATIONS.load(Ordering::SeqCst)
}

struct HostRegistration {
    gpu: Arc<Gpu>,
    ptr: *mut u8,
}

// SAFETY: the registration is an address and a context; unregistering works from any thread
// once the context is bound.
unsafe impl Send for HostRegistration {}
// SAFETY: as above; it exposes nothing.
unsafe impl Sync for HostRegistration {}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: registered in `CudaPin::pin`; HostPool drops this before unmapping.
        let _ = unsafe { self.gpu.driver.host_unregister(self.ptr) };
        LIVE_REGISTRATIONS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Registers producer pools with `cuMemHostRegister` (the server's [`PinHook`]).
#[derive(Debug, Clone)]
pub struct CudaPin {
    gpu: Arc<Gpu>,
}

impl CudaPin {
    /// Pins for `gpu`.
    pub fn new(gpu: Arc<Gpu>) -> CudaPin {
        CudaPin { gpu }
    }
}

impl PinHook for CudaPin {
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> std::result::Result<PinRegistration, String> {
        self.gpu.bind().map_err(|e| e.to_string())?;
        // SAFETY: the trait's contract: the mapping outlives the registration, which
        // unregisters on drop.
        unsafe { self.gpu.driver.host_register(ptr, len) }.map_err(|e| e.to_string())?;
        LIVE_REGISTRATIONS.fetch_add(1, Ordering::SeqCst);
        Ok(PinRegistration::new(HostRegistration {
            gpu: self.gpu.clone(),
            ptr,
        }))
    }
}

/// One device as the probe sees it.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: i32,
    /// Marketing name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem: usize,
    /// `cuMemHostRegister` supported.
    pub host_register: bool,
    /// Virtual memory management (`cuMemCreate` …) supported.
    pub vmm: bool,
    /// VMM allocations exportable as POSIX file descriptors.
    pub posix_fd_handles: bool,
    /// Legacy CUDA IPC (`cuIpcGetMemHandle`): Linux with unified addressing.
    pub legacy_ipc: bool,
}

/// What the machine's CUDA can do.
#[derive(Debug, Clone)]
pub struct Capabilities {
    /// `cuDriverGetVersion`.
    pub driver_version: i32,
    /// Every device.
    pub devices: Vec<DeviceInfo>,
}

/// Probes the driver and every device. [`Error::NoDriver`] where libcuda cannot be loaded.
pub fn probe() -> Result<Capabilities> {
    use sys::CUdevice_attribute as A;
    let d = Driver::load()?;
    let n = d.device_count()?;
    let mut devices = Vec::new();
    for i in 0..n {
        let dev = d.device(i)?;
        let attr = |a| d.attribute(dev, a);
        devices.push(DeviceInfo {
            ordinal: i,
            name: d.device_name(dev)?,
            compute_capability: (
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            total_mem: d.total_mem(dev)?,
            host_register: attr(A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED)? != 0,
            vmm: attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? != 0,
            posix_fd_handles: attr(
                A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )? != 0,
            legacy_ipc: cfg!(target_os = "linux")
                && attr(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)? != 0,
        });
    }
    Ok(Capabilities {
        driver_version: d.version()?,
        devices,
    })
}

/// Host-to-device bandwidth of three sources, measured in one run with CUDA events.
#[derive(Debug, Clone)]
pub struct H2dBench {
    /// Bytes per copy.
    pub bytes: usize,
    /// Copies timed per source.
    pub iters: usize,
    /// From a sealed memfd pool registered with `cuMemHostRegister` (tensorport's host path).
    pub registered_pool_gbps: f64,
    /// From `cuMemAllocHost` memory (the pinned ceiling).
    pub alloc_host_gbps: f64,
    /// From ordinary pageable memory.
    pub pageable_gbps: f64,
    /// Time `cuMemHostRegister` took on the pool, in milliseconds.
    pub register_ms: f64,
}

fn time_copies(gpu: &Arc<Gpu>, dst: &DeviceBuffer, src: &[u8], iters: usize) -> Result<f64> {
    let stream = Stream::new(gpu)?;
    let timed = || -> Result<f64> {
        // One warm-up copy.
        // SAFETY: `src` is borrowed for this whole function, which synchronizes the stream
        // before it returns, on every path (below), so no DMA outlives the bytes.
        unsafe { dst.copy_from_host_async(src, &stream)? };
        stream.synchronize()?;
        let start = stream.record()?;
        for _ in 0..iters {
            // SAFETY: as above.
            unsafe { dst.copy_from_host_async(src, &stream)? };
        }
        let end = stream.record()?;
        end.wait()?;
        Ok(end.elapsed_since(&start)? as f64)
    };
    let ms = timed();
    // Also after a failure part way: copies already queued still read `src`.
    stream.synchronize()?;
    Ok((src.len() * iters) as f64 / (ms? / 1e3) / 1e9)
}

/// Measures host-to-device bandwidth from a registered pool, `cuMemAllocHost` memory and
/// pageable memory, `iters` copies of `bytes` each, on device `gpu`.
pub fn bench_h2d(gpu: &Arc<Gpu>, bytes: usize, iters: usize) -> Result<H2dBench> {
    let dst = DeviceBuffer::new(gpu, bytes)?;
    // The pool: one slot of `bytes`, created and sealed as the server does, then pinned.
    let mut pool = HostPool::create("tensorport-pool", 1, bytes as u64)?;
    // SAFETY: we are the only user of the pool's single slot.
    unsafe { pool.slot_bytes_mut(0) }
        .expect("slot 0")
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8);
    let t = Instant::now();
    pool.pin_with(&CudaPin::new(gpu.clone()))?;
    let register_ms = t.elapsed().as_secs_f64() * 1e3;
    // SAFETY: as above; nobody writes the slot while we copy from it.
    let pool_src = unsafe { pool.slot_bytes(0, 0, bytes as u64) }.expect("slot 0");
    let registered_pool_gbps = time_copies(gpu, &dst, pool_src, iters)?;
    let mut pinned = PinnedBuffer::new(gpu, bytes)?;
    pinned
        .as_mut_slice()
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8);
    let alloc_host_gbps = time_copies(gpu, &dst, &pinned.as_mut_slice()[..], iters)?;
    let pageable: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let pageable_gbps = time_copies(gpu, &dst, &pageable, iters.clamp(1, 5))?;
    Ok(H2dBench {
        bytes,
        iters,
        registered_pool_gbps,
        alloc_host_gbps,
        pageable_gbps,
        register_ms,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_says_no_driver_cleanly_or_reports_devices() {
        match super::probe() {
            Err(crate::Error::NoDriver) => {
                let msg = crate::Error::NoDriver.to_string();
                // The library names no CLI option (the CLI adds its own advice).
                assert!(msg.contains("libcuda.so") && !msg.contains("--"), "{msg}");
            }
            Ok(c) => {
                assert!(c.driver_version > 0);
                for d in c.devices {
                    assert!(!d.name.is_empty());
                    assert!(d.compute_capability.0 > 0);
                }
            }
            Err(e) => panic!("probe failed: {e}"),
        }
    }
}
