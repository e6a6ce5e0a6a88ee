//! Device buffers (`cuMemAlloc`, or exportable VMM memory) and page-locked host buffers.

use std::sync::Arc;

use cudarc::driver::sys;

use crate::{Gpu, Result, Stream};

/// An address in a GPU's memory (never null: `Option<DevicePtr>` where there may be none):
/// what device buffers and rows hand out and what copies and kernels take, so that a host
/// address, a length or a count cannot be passed for one. [`DevicePtr::raw`] gives the number
/// at the driver and kernel boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct DevicePtr(std::num::NonZeroU64);

impl DevicePtr {
    /// The address `raw`; `None` for null.
    pub fn new(raw: u64) -> Option<DevicePtr> {
        std::num::NonZeroU64::new(raw).map(DevicePtr)
    }
    /// The address of a device tensor another process handed over.
    pub fn of(t: &tensorport::DeviceTensor) -> DevicePtr {
        DevicePtr::new(t.ptr()).expect("an imported device tensor has an address")
    }
    /// The address as a number, for the driver and for kernel parameters.
    pub fn raw(self) -> u64 {
        self.0.get()
    }
    /// The address `bytes` further on.
    pub fn offset(self, bytes: usize) -> DevicePtr {
        let raw = self
            .raw()
            .checked_add(bytes as u64)
            .expect("a device address past 2^64");
        DevicePtr::new(raw).expect("a non-null address plus an offset is not null")
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
        let ptr = gpu.driver().mem_alloc(len.max(1))?;
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
        let d = &gpu.driver();
        let size = len.max(1).next_multiple_of(d.vmm_granularity(gpu.dev())?);
        let h = d.vmm_create(gpu.dev(), size)?;
        let ptr = match d.vmm_map(gpu.dev(), h, size) {
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
        self.gpu.driver().vmm_export_fd(h)
    }
    /// The GPU it was allocated on.
    pub(crate) fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    /// Device address.
    pub fn ptr(&self) -> DevicePtr {
        DevicePtr::new(self.ptr).expect("the driver allocates at non-null addresses")
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
            self.gpu.driver().memcpy_htod_async(
                self.ptr,
                src.as_ptr(),
                src.len(),
                stream.raw().cast(),
            )
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
            self.gpu.driver().memset_d32_async(
                self.ptr + offset as u64,
                value,
                bytes / 4,
                stream.raw().cast(),
            )
        }
    }

    /// Copies `len` bytes from device address `src` into the start of this buffer on `stream`.
    ///
    /// # Safety
    /// `src..src+len` must be device memory of this context that stays valid (and is not
    /// written) until the copy has run, e.g. a `tensorport::DeviceTensor` after `wait_ready`.
    pub unsafe fn copy_from_device_async(
        &self,
        src: DevicePtr,
        len: usize,
        stream: &Stream,
    ) -> Result<()> {
        assert!(len <= self.len, "copy larger than the buffer");
        self.gpu.bind()?;
        // SAFETY: dst is this buffer (checked); src is the caller's contract.
        unsafe {
            self.gpu
                .driver()
                .memcpy_dtod_async(self.ptr, src.raw(), len, stream.raw().cast())
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
                .driver()
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
            let _ = unsafe { self.gpu.driver().vmm_unmap_release(self.ptr, size, h) };
            return;
        }
        // SAFETY: allocated by mem_alloc; callers synchronise streams before dropping buffers
        // they are copying into (cuMemFree also synchronises the device).
        let _ = unsafe { self.gpu.driver().mem_free(self.ptr) };
    }
}

/// Page-locked host memory from `cuMemAllocHost` (the reference for pinned bandwidth). As
/// cudarc's host slices do, it records an event on the stream of each copy that reads it
/// ([`crate::GpuProducer::upload`]), and waits for that event before it is written again
/// ([`PinnedBuffer::as_mut_slice`]) or freed: a copy still running never sees its bytes change.
#[derive(Debug)]
pub struct PinnedBuffer {
    gpu: Arc<Gpu>,
    ptr: *mut u8,
    len: usize,
    /// Recorded after the last copy that read the bytes (made at the first such copy).
    read: sys::CUevent,
    /// A copy may still read the bytes.
    pending: bool,
}

// SAFETY: plain memory and an event owned by this value; the event is only used with the
// buffer's context bound.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` page-locked bytes.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<PinnedBuffer> {
        gpu.bind()?;
        let ptr = gpu.driver().mem_alloc_host(len.max(1))?;
        Ok(PinnedBuffer {
            gpu: gpu.clone(),
            ptr,
            len,
            read: std::ptr::null_mut(),
            pending: false,
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
    /// The bytes, to write: waits first for the copies that read them.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.settle();
        // SAFETY: `len` bytes allocated by cuMemAllocHost, owned exclusively via `&mut self`;
        // no copy reads them any more (settled).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    /// The bytes, to read (copies that read them may still run: reading alongside is fine).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated by cuMemAllocHost; written only through `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    /// Marks the bytes as read by the work enqueued on `stream` so far.
    pub(crate) fn record_read(&mut self, stream: &Stream) -> Result<()> {
        self.gpu.bind()?;
        if self.read.is_null() {
            self.read = self.gpu.driver().event_create()?;
        }
        // SAFETY: our live event and a live stream of our context (bound above).
        unsafe {
            self.gpu
                .driver()
                .event_record(self.read, stream.raw().cast())?
        };
        self.pending = true;
        Ok(())
    }
    /// Waits for the copies that read the bytes. Where the wait fails (a broken context runs
    /// nothing more) it gives up waiting.
    fn settle(&mut self) {
        if self.pending {
            let _ = self.gpu.bind();
            // SAFETY: our live event (made before `pending` was set).
            let _ = unsafe { self.gpu.driver().event_sync(self.read) };
            self.pending = false;
        }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        self.settle();
        let _ = self.gpu.bind();
        // SAFETY: allocated by mem_alloc_host, and no copy reads it any more (settled); the
        // event, if made, is ours and not used after this.
        unsafe {
            if !self.read.is_null() {
                let _ = self.gpu.driver().event_destroy(self.read);
            }
            let _ = self.gpu.driver().mem_free_host(self.ptr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::DevicePtr;

    #[test]
    fn a_device_address_is_never_null_and_moves_by_bytes() {
        assert_eq!(DevicePtr::new(0), None);
        let p = DevicePtr::new(0x7000_0000).unwrap();
        assert_eq!(p.raw(), 0x7000_0000);
        assert_eq!(p.offset(16).raw(), 0x7000_0010);
        assert_eq!(p.offset(0), p);
    }

    #[test]
    #[should_panic(expected = "past 2^64")]
    fn an_offset_past_the_address_space_is_a_bug() {
        let _ = DevicePtr::new(u64::MAX - 1).unwrap().offset(2);
    }
}
