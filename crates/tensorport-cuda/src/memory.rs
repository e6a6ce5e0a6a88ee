//! Device memory other libraries own (a dfdx tensor, a torch tensor) or this crate owns (a
//! [`DeviceBuffer`]), named once, where it is owned, so that the code that copies into it or
//! hands it to a framework needs no `unsafe` of its own: [`DeviceMemory`] is memory a value
//! keeps allocated while it lives; [`DeviceMemoryMut`] is memory only its owner uses.
//! [`Gpu::check_region`] asks the driver that a region is what it claims before a copy or a
//! kernel touches it.

use crate::{DeviceBuffer, DevicePtr, Gpu, Result};

/// `len` bytes of device memory at `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRegion {
    /// The first byte.
    pub addr: DevicePtr,
    /// The size in bytes.
    pub len: usize,
}

/// A value that keeps device memory allocated while it lives.
///
/// # Safety
/// [`DeviceMemory::device_memory`] must name memory of one GPU's primary context, allocated as
/// long as the value lives (and for good if it is leaked), always the same region; and nothing
/// may write that memory while a shared borrow of the value is live (as dfdx's tensors, which
/// copy their storage before writing one that is shared).
pub unsafe trait DeviceMemory {
    /// The memory.
    fn device_memory(&self) -> DeviceRegion;
}

/// A [`DeviceMemory`] that only its owner reads or writes: whoever holds the value (or a
/// mutable borrow of it) may write the memory.
///
/// # Safety
/// As for [`DeviceMemory`], and no other value or library reads, writes or frees the memory
/// while this value lives (a tensor made for the purpose and never shared).
pub unsafe trait DeviceMemoryMut: DeviceMemory {}

// SAFETY: the buffer's allocation, freed only when it drops; it hands out its address only
// through `unsafe` calls, whose callers promise not to race its owner.
unsafe impl DeviceMemory for DeviceBuffer {
    fn device_memory(&self) -> DeviceRegion {
        DeviceRegion {
            addr: self.ptr(),
            len: self.len(),
        }
    }
}

// SAFETY: as above; the buffer is its owner's alone.
unsafe impl DeviceMemoryMut for DeviceBuffer {}

impl Gpu {
    /// Whether `region` lies inside one allocation on this GPU, as the driver sees it (a
    /// region of another GPU, or past its allocation's end, is refused).
    pub fn check_region(&self, region: DeviceRegion) -> Result<()> {
        self.bind()?;
        let d = self.driver();
        // The driver knows no such device address: host memory, or memory already freed.
        let ordinal = d
            .pointer_ordinal(region.addr.raw())
            .map_err(|_| crate::Error::Refused("not device memory (host memory, or freed)"))?;
        if ordinal != self.ordinal() {
            return Err(crate::Error::Refused("device memory of another GPU"));
        }
        let (base, size) = d.mem_address_range(region.addr.raw())?;
        let end = (region.addr.raw() - base)
            .checked_add(region.len as u64)
            .ok_or(crate::Error::Refused("a device region past 2^64"))?;
        if end > size as u64 {
            return Err(crate::Error::Refused(
                "a device region past the end of its allocation",
            ));
        }
        Ok(())
    }
}
