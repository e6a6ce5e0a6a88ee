//! What the machine's CUDA can do ([`probe`]), and the host-to-device bandwidth bench.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys;
use tensorport_shm::HostPool;

use crate::{CudaPin, DeviceBuffer, Driver, Gpu, PinnedBuffer, Result, Stream};

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

/// Probes the driver and every device. [`crate::Error::NoDriver`] where libcuda cannot be loaded.
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
