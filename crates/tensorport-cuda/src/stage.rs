//! A model's batch staged for a framework that runs it on the GPU (ONNX Runtime): the rows the
//! server gathered, copied — or converted to `f16` (round to nearest even, as PyTorch's
//! `.half()`) for an `f16` model — into a buffer of a padded row count (the row count of the
//! framework's session that takes it), so the batch stays on the device.

use std::sync::Arc;

use crate::kernel::Kernel;
use crate::{DeviceBuffer, DeviceMemory, DeviceRegion, Gpu, Result, Stream};

/// `dst[i] = (half)src[i]` over `n` values, with the PTX conversion instruction (no header).
const KERNEL: &str = include_str!("kernels/stage.cu");

/// The staging buffers kept for reuse: one per batch a framework may hold at once (one
/// running, one queued behind it, one being staged), and a spare.
const KEPT: usize = 4;

/// The staging buffers, their stream, and the conversion kernel for an `f16` model.
pub struct BatchStage {
    gpu: Arc<Gpu>,
    half: Option<Kernel>,
    stream: Stream,
    /// Buffers given back, to reuse (at most [`KEPT`]).
    bufs: Vec<DeviceBuffer>,
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
            bufs: Vec::new(),
        })
    }

    /// Copies (or converts) `rows` images of `len` floats each from the start of `src` into
    /// a buffer of `padded` images (rows past `rows` hold an earlier batch's images, or zeros:
    /// their results are the caller's to drop), waits for it, and returns the buffer. Give it
    /// back ([`BatchStage::give_back`]) once read, and a later batch reuses it.
    pub fn stage(
        &mut self,
        src: &impl DeviceMemory,
        rows: usize,
        padded: usize,
        len: usize,
    ) -> Result<Staged> {
        let from = src.device_memory();
        if rows
            .checked_mul(len)
            .and_then(|n| n.checked_mul(4))
            .is_none_or(|n| n > from.len)
        {
            return Err(crate::Error::Refused(
                "a batch larger than the memory it is staged from",
            ));
        }
        self.gpu.check_region(from)?;
        let size = if self.half.is_some() { 2 } else { 4 };
        let need = padded.max(rows) * len * size;
        let mut buf = self
            .bufs
            .iter()
            .position(|b| b.len() >= need)
            .map(|i| self.bufs.swap_remove(i));
        if buf.is_none() {
            let fresh = DeviceBuffer::new(&self.gpu, need.max(size))?;
            // Zeros in the padding rows until real images have been there.
            let zeros = vec![0u8; fresh.len()];
            // SAFETY: `fresh` holds exactly these bytes; the copy is waited for below, before
            // `zeros` goes.
            unsafe { self.stream.copy_host_to_device_async(fresh.ptr(), &zeros)? };
            self.stream.synchronize()?;
            buf = Some(fresh);
        }
        let buf = buf.expect("just set");
        let (dst, src) = (buf.ptr(), from.addr);
        let n = rows * len;
        let copied = (|| match &self.half {
            // SAFETY: `src` holds `n` floats of this GPU (checked above), allocated while the
            // borrow lasts (`DeviceMemory`), which outlasts the copy (waited for below); `dst`
            // holds `need` bytes and is ours.
            None => unsafe { self.stream.copy_device_to_device_async(dst, src, n * 4) },
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
                // `src` as above, and `dst` holds `2 n` bytes or more.
                unsafe { kernel.launch((blocks, 1, 1), (threads, 1, 1), &self.stream, &mut params) }
            }
        })()
        .and_then(|()| self.stream.synchronize());
        if let Err(e) = copied {
            // Kept (not freed) should a copy into it still be pending.
            self.bufs.push(buf);
            return Err(e);
        }
        Ok(Staged { buf, rows: padded })
    }

    /// Takes back a staged batch's buffer for a later batch (with [`KEPT`] kept already, the
    /// smallest of them goes, if smaller: freeing waits for the GPU, so rarely).
    pub fn give_back(&mut self, staged: Staged) {
        if self.bufs.len() < KEPT {
            self.bufs.push(staged.buf);
            return;
        }
        if let Some((i, _)) = self
            .bufs
            .iter()
            .enumerate()
            .min_by_key(|(_, b)| b.len())
            .filter(|(_, b)| b.len() < staged.buf.len())
        {
            self.bufs[i] = staged.buf;
        }
    }
}

/// A batch staged on the device: its buffer (a framework reads it in place), owned until given
/// back to its [`BatchStage`].
#[derive(Debug)]
pub struct Staged {
    buf: DeviceBuffer,
    rows: usize,
}

impl Staged {
    /// The images it holds (the padded count).
    pub fn rows(&self) -> usize {
        self.rows
    }
}

// SAFETY: the buffer's allocation, owned by the `Staged` and written by nothing once staged.
unsafe impl DeviceMemory for Staged {
    fn device_memory(&self) -> DeviceRegion {
        self.buf.device_memory()
    }
}
