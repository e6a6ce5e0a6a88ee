//! A batch of `f32` values converted to `f16` on the GPU (round to nearest even, as PyTorch's
//! `.half()`), for a model whose input is `f16`: the batch stays on the device.

use std::sync::Arc;

use crate::kernel::Kernel;
use crate::{DeviceBuffer, Gpu, Result, Stream};

/// `dst[i] = (half)src[i]` over `n` values, with the PTX conversion instruction (no header).
const KERNEL: &str = r#"
extern "C" __global__ void tp_f32_to_f16(const float* src, unsigned short* dst,
                                         unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(src[i]));
    dst[i] = h;
}
"#;

/// The conversion kernel and the buffer it writes (kept, grown as batches need).
pub struct HalfCast {
    gpu: Arc<Gpu>,
    kernel: Kernel,
    out: Option<DeviceBuffer>,
}

impl std::fmt::Debug for HalfCast {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HalfCast").finish_non_exhaustive()
    }
}

impl HalfCast {
    /// Compiles the kernel for `gpu`.
    pub fn new(gpu: &Arc<Gpu>) -> Result<HalfCast> {
        Ok(HalfCast {
            gpu: gpu.clone(),
            kernel: Kernel::compile(gpu, KERNEL, "tensorport_cast.cu", c"tp_f32_to_f16")?,
            out: None,
        })
    }

    /// Converts the `n` floats at `src` into this caster's buffer on `stream`, waits for it,
    /// and returns the buffer's address (valid until the next call).
    ///
    /// # Safety
    /// `src` must be device memory of this GPU's primary context holding `n` floats, written
    /// before this is called, and valid until it returns.
    pub unsafe fn to_f16(&mut self, src: u64, n: usize, stream: &Stream) -> Result<u64> {
        if self.out.as_ref().is_none_or(|b| b.len() < 2 * n) {
            self.out = None;
            self.out = Some(DeviceBuffer::new(&self.gpu, (2 * n).max(2))?);
        }
        let dst = self.out.as_ref().expect("just set").ptr();
        let threads = 256u32;
        let blocks = u32::try_from((n as u64).div_ceil(u64::from(threads)))
            .map_err(|_| crate::Error::BadAnswer("a batch too large to convert"))?;
        let (mut s, mut d, mut count) = (src, dst, n as u64);
        let mut params: [*mut std::ffi::c_void; 3] = [
            (&mut s as *mut u64).cast(),
            (&mut d as *mut u64).cast(),
            (&mut count as *mut u64).cast(),
        ];
        // SAFETY: the parameters match the kernel's (two pointers, a 64-bit count); the
        // caller's contract covers `src`, and `dst` holds `2 n` bytes, ours until the next call.
        unsafe {
            self.kernel
                .launch((blocks, 1, 1), (threads, 1, 1), stream, &mut params)?;
        }
        stream.synchronize()?;
        Ok(dst)
    }
}
