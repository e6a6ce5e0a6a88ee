//! Device memory a caller names (`DeviceMemory`) is checked with the driver before a copy or a
//! kernel touches it: a region past its allocation's end, and a batch larger than the memory it
//! is staged from, are refused; memory that is what it says is staged.

use super::*;
use tensorport_cuda::{BatchStage, DeviceBuffer, DeviceMemory, DeviceRegion};

/// Memory that claims more than its allocation holds.
struct Claims(DeviceRegion);

// SAFETY: deliberately false (the region runs past its allocation): the checks under test
// refuse it before anything reads or writes it.
unsafe impl DeviceMemory for Claims {
    fn device_memory(&self) -> DeviceRegion {
        self.0
    }
}

pub(crate) fn device_regions_are_checked_before_use() {
    const LEN: usize = 1 << 20;
    let gpu = Gpu::open(0).unwrap();
    let buf = DeviceBuffer::new(&gpu, LEN).unwrap();
    gpu.check_region(buf.device_memory()).unwrap();
    let past = Claims(DeviceRegion {
        addr: buf.ptr().offset(4096),
        len: LEN,
    });
    let e = gpu.check_region(past.device_memory()).unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
    let mut stage = BatchStage::new(&gpu, false).unwrap();
    let floats = LEN / 4;
    let e = stage.stage(&past, 1, 1, floats).unwrap_err();
    assert!(e.to_string().contains("past the end"), "{e}");
    let e = stage.stage(&buf, 2, 2, floats).unwrap_err();
    assert!(e.to_string().contains("larger than the memory"), "{e}");
    let staged = stage.stage(&buf, 1, 2, floats).unwrap();
    assert_eq!(staged.rows(), 2);
    assert!(staged.device_memory().len >= 2 * LEN);
    stage.give_back(staged);
    println!("  a region 4 KiB past its allocation and a batch of 2 MiB from 1 MiB refused; 1 MiB staged into 2 rows");
}
