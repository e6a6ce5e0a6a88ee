//! Device buffers shared by GPU producers (the device path). The runtime knows no CUDA: the
//! server's [`DeviceImporter`] (from `tensorport-cuda`) opens what producers register, and the
//! consumer orders its GPU work with the two events each buffer carries:
//!
//! 1. The producer writes the buffer on its stream, records the buffer's "ready" event, submits.
//! 2. The consumer makes its stream wait on "ready" ([`DeviceTensor::wait_ready`]), enqueues its
//!    reads, records "released" ([`DeviceTensor::record_release`]) and releases the request; the
//!    producer gets `DeviceReleased`.
//! 3. The producer makes its stream wait on "released" before writing the buffer again.
//!
//! Nobody blocks on the host; the GPU orders the writes and reads.

use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use tensorport_wire::RawDeviceHandle;

/// Why a registered device buffer could not be opened; each says whose fault it is, so the
/// server answers with the right protocol code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// The producer said the buffer has more bytes than the allocation behind its handle holds
    /// (refused: reads past the allocation would fault the server's context).
    #[error("the buffer was registered as {registered} bytes, but the allocation behind its handle holds {available}; register its true length")]
    LongerThanAllocation {
        /// Bytes the producer registered (with the 16 bytes of semaphores a timeline needs).
        registered: u64,
        /// Bytes the allocation holds from the buffer's start.
        available: u64,
    },
    /// The handle is not one this server can open (wrong size, another device, a stale or
    /// forged handle, a missing descriptor).
    #[error("{0}")]
    BadHandle(String),
    /// The driver failed on our side (out of memory, a broken context).
    #[error("{0}")]
    Driver(String),
}

impl ImportError {
    /// The protocol code a refusal carries.
    pub fn code(&self) -> tensorport_wire::ErrorCode {
        use tensorport_wire::ErrorCode;
        match self {
            ImportError::LongerThanAllocation { .. } => ErrorCode::OutOfBounds,
            ImportError::BadHandle(_) => ErrorCode::Malformed,
            ImportError::Driver(_) => ErrorCode::Internal,
        }
    }
}

/// Opens device buffers that producers register (implemented by `tensorport_cuda::CudaImporter`).
pub trait DeviceImporter: Send + Sync {
    /// Opens a buffer of `len` bytes shared by `handle`, after checking that the allocation
    /// behind the handle really holds them. `fd` is the descriptor attached to the registration
    /// (VMM handles), if any.
    fn import(
        &self,
        len: u64,
        handle: &RawDeviceHandle,
        fd: Option<OwnedFd>,
    ) -> std::result::Result<Arc<dyn ImportedDevice>, ImportError>;
}

/// A producer's device buffer, open in the server. Dropping the last reference closes it.
pub trait ImportedDevice: Send + Sync + std::any::Any {
    /// The buffer's device address in the server's context.
    fn device_ptr(&self) -> u64;
    /// Bytes in the buffer.
    fn len(&self) -> u64;
    /// Whether the buffer has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The handle of the server's "released" event, for the producer (64 bytes).
    fn release_event_handle(&self) -> Vec<u8>;
    /// Whether the buffer is fenced by timeline values (each submit must carry one) rather than
    /// by its registered event (no submit may carry one).
    fn timeline(&self) -> bool;
    /// Makes `stream` wait for the producer's writes: its latest "ready" record, or the "ready"
    /// semaphore reaching `value`.
    ///
    /// # Safety
    /// `stream` must be a live CUDA stream of the context the buffer was imported into.
    unsafe fn wait_ready(
        &self,
        stream: *mut c_void,
        value: Option<u64>,
    ) -> std::result::Result<(), String>;
    /// Signals "released" on `stream` after the work that reads the buffer: records the event, or
    /// writes `value` to the "released" semaphore.
    ///
    /// # Safety
    /// As for [`ImportedDevice::wait_ready`].
    unsafe fn record_release(
        &self,
        stream: *mut c_void,
        value: Option<u64>,
    ) -> std::result::Result<(), String>;
    /// The producer's session ended: nobody signals this buffer's "ready" fence any more. A
    /// server stream still waiting on it must be let through (else it would wait for good, and
    /// every tensor behind the wait with it), and later waits on it skipped. The bytes then
    /// read are whatever the buffer held; their requests cannot be answered anyway. The server
    /// calls this for every device buffer of a session that ends, cleanly or not; the default
    /// does nothing (for importers whose fences cannot stall).
    fn abandon(&self) {}
}

/// A submitted tensor in a producer's device buffer, as the consumer sees it.
#[derive(Clone)]
pub struct DeviceTensor {
    pub(crate) buffer: Arc<dyn ImportedDevice>,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) timeline: Option<u64>,
}

impl std::fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceTensor")
            .field("ptr", &self.ptr())
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceTensor {
    /// Device address of the tensor's first byte (checked to lie in the buffer).
    pub fn ptr(&self) -> u64 {
        self.buffer.device_ptr() + self.offset
    }
    /// Bytes from [`DeviceTensor::ptr`].
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether it covers no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The producer's buffer the tensor lies in, as the server's importer opened it (an
    /// importer may batch the fences of several tensors: `tensorport_cuda::gather`).
    pub fn buffer(&self) -> &dyn ImportedDevice {
        &*self.buffer
    }
    /// The producer's buffer, shared: it stays open in the server (its mapping valid) while
    /// the returned handle lives, even after the request is answered and the producer gone.
    pub fn shared_buffer(&self) -> Arc<dyn ImportedDevice> {
        self.buffer.clone()
    }
    /// The value the buffer's "ready" semaphore must reach before the tensor may be read
    /// (timeline buffers); `None` for event-fenced buffers.
    pub fn timeline(&self) -> Option<u64> {
        self.timeline
    }
    /// Makes `stream` wait until the producer's writes are done. Enqueue reads after this.
    ///
    /// # Safety
    /// `stream` must be a live CUDA stream of the server's device context.
    pub unsafe fn wait_ready(&self, stream: *mut c_void) -> std::result::Result<(), String> {
        // SAFETY: the caller's contract.
        unsafe { self.buffer.wait_ready(stream, self.timeline) }
    }
    /// Records, on `stream`, that the reads enqueued so far are all the server does with the
    /// buffer. Call before releasing the request.
    ///
    /// # Safety
    /// As for [`DeviceTensor::wait_ready`].
    pub unsafe fn record_release(&self, stream: *mut c_void) -> std::result::Result<(), String> {
        // SAFETY: the caller's contract.
        unsafe { self.buffer.record_release(stream, self.timeline) }
    }
}
