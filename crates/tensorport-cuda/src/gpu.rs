//! The device and its retained primary context; the other resources are in `buffer.rs`,
//! `stream.rs`, `pin.rs` and `probe.rs`, one type per resource.

use std::sync::Arc;

use cudarc::driver::sys;

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
