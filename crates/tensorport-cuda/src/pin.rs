//! Producer pools registered with the device (`cuMemHostRegister`), for DMA from them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tensorport_shm::{PinHook, PinRegistration};

use crate::Gpu;

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
        let _ = unsafe { self.gpu.driver().host_unregister(self.ptr) };
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
        unsafe { self.gpu.driver().host_register(ptr, len) }.map_err(|e| e.to_string())?;
        LIVE_REGISTRATIONS.fetch_add(1, Ordering::SeqCst);
        Ok(PinRegistration::new(HostRegistration {
            gpu: self.gpu.clone(),
            ptr,
        }))
    }
}
