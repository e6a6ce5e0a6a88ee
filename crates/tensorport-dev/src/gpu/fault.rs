//! `tensorport-dev gpu fault`: a CUDA client that launches a kernel writing out of bounds, for the
//! GPU harness's fault tests. Under MPS this is a fatal fault in one client of a server that
//! other processes share; alone it is a sticky error in this process's own context.

use std::sync::Arc;

use tensorport_cuda::{Gpu, Kernel, Stream};

use super::cuda;
use crate::common::{CliError, CliResult};

/// Writes through a null pointer: the GPU reports an illegal address.
const SRC: &str = r#"extern "C" __global__ void out_of_bounds(unsigned int *p) {
    p[threadIdx.x] = 0xdeadbeefu;
}"#;

/// Launches the faulting kernel on `device` and waits for it; `Ok` with the driver's error where
/// the fault was reported (the expected outcome), `Err` where the kernel ran without one.
pub fn run(device: i32) -> CliResult<String> {
    let gpu: Arc<Gpu> = Gpu::open(device).map_err(cuda)?;
    let kernel = Kernel::compile(&gpu, SRC, "fault.cu", c"out_of_bounds").map_err(cuda)?;
    let stream = Stream::new(&gpu).map_err(cuda)?;
    let mut null: u64 = 0;
    let mut params = [(&mut null as *mut u64).cast::<std::ffi::c_void>()];
    // SAFETY: one parameter, a device pointer, as the kernel declares; the write it makes is the
    // fault this tool exists to cause, reported by the driver and never reaching host memory.
    let launched = unsafe { kernel.launch((1, 1, 1), (32, 1, 1), &stream, &mut params) };
    let done = launched.and_then(|()| stream.synchronize());
    // The context is unusable after the fault; leak the handles rather than call into it again.
    std::mem::forget(kernel);
    std::mem::forget(stream);
    match done {
        Err(e) => Ok(e.to_string()),
        Ok(()) => Err(CliError::new(
            "the out-of-bounds kernel ran without a fault being reported",
        )),
    }
}
