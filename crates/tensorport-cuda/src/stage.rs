//! A model's batch staged for a framework that runs it on the GPU (ONNX Runtime): the rows the
//! server gathered, copied — or converted to `f16` (round to nearest even, as PyTorch's
//! `.half()`) for an `f16` model — into a buffer of a padded row count (the row count of the
//! framework's session that takes it), so the batch stays on the device.

use std::sync::Arc;

use crate::kernel::Kernel;
use crate::{DeviceBuffer, DevicePtr, Gpu, Result, Stream};

/// `dst[i] = (half)src[i]` over `n` values, with the PTX conversion instruction (no header).
const KERNEL: &str = include_str!("kernels/stage.cu");

/// The staging buffer, its stream, and the conversion kernel for an `f16` model.
pub struct BatchStage {
    gpu: Arc<Gpu>,
    half: Option<Kernel>,
    stream: Stream,
    buf: Option<DeviceBuffer>,
}

impl std::fmt::Debug for BatchStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchStage")
            .field("half", &self.half.is_some())
            .finish_non_exhaustive()
    }
}

impl BatchStage {
    /// A stage on `gpu` that writes `f16` values if `half` (compiling the kernel), else `f32`.
    pub fn new(gpu: &Arc<Gpu>, half: bool) -> Result<BatchStage> {
        let half = match half {
            true => Some(Kernel::compile(
                gpu,
                KERNEL,
                "tensorport_stage.cu",
                c"tp_f32_to_f16",
            )?),
            false => None,
        };
        Ok(BatchStage {
            gpu: gpu.clone(),
            half,
            stream: Stream::new(gpu)?,
            buf: None,
        })
    }

    /// Copies (or converts) `rows` images of `len` floats each from `src` into the buffer,
    /// which holds `padded` images (rows past `rows` keep an earlier batch's images, or zeros:
    /// their results are the caller's to drop), waits for it, and returns its address, valid
    /// until the next call.
    ///
    /// # Safety
    /// `src` must be device memory of this GPU's primary context holding `rows × len` floats,
    /// written before this is called, and valid until it returns.
    pub unsafe fn stage(
        &mut self,
        src: DevicePtr,
        rows: usize,
        padded: usize,
        len: usize,
    ) -> Result<DevicePtr> {
        let size = if self.half.is_some() { 2 } else { 4 };
        let need = padded.max(rows) * len * size;
        if self.buf.as_ref().is_none_or(|b| b.len() < need) {
            self.buf = None;
            let buf = DeviceBuffer::new(&self.gpu, need.max(size))?;
            // Zeros in the padding rows until real images have been there.
            let zeros = vec![0u8; buf.len()];
            // SAFETY: `buf` holds exactly these bytes; the copy is waited for below, before
            // `zeros` goes.
            unsafe { self.stream.copy_host_to_device_async(buf.ptr(), &zeros)? };
            self.stream.synchronize()?;
            self.buf = Some(buf);
        }
        let dst = self.buf.as_ref().expect("just set").ptr();
        let n = rows * len;
        match &self.half {
            // SAFETY: the caller's contract covers `src`; `dst` holds `need` bytes, ours until
            // the next call.
            None => unsafe { self.stream.copy_device_to_device_async(dst, src, n * 4)? },
            Some(kernel) => {
                let threads = 256u32;
                let blocks = u32::try_from((n as u64).div_ceil(u64::from(threads)))
                    .map_err(|_| crate::Error::BadAnswer("a batch too large to convert"))?;
                let (mut s, mut d, mut count) = (src.raw(), dst.raw(), n as u64);
                let mut params: [*mut std::ffi::c_void; 3] = [
                    (&mut s as *mut u64).cast(),
                    (&mut d as *mut u64).cast(),
                    (&mut count as *mut u64).cast(),
                ];
                // SAFETY: the parameters match the kernel's (two pointers, a 64-bit count);
                // the caller's contract covers `src`, and `dst` holds `2 n` bytes or more.
                unsafe {
                    kernel.launch((blocks, 1, 1), (threads, 1, 1), &self.stream, &mut params)?
                };
            }
        }
        self.stream.synchronize()?;
        Ok(dst)
    }
}
