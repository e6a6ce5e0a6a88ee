//! 8-bit images normalised on the GPU: producers that hand over `u8` planes (a quarter of the
//! bytes of `f32`) are normalised by the server with the producers' own table, so the model sees
//! the same floats, bit for bit, as from an `f32` producer.

use std::sync::Arc;

use crate::kernel::Kernel;
use crate::rows::Rows;
use crate::{DeviceBuffer, Gpu, Result, Stream};

/// `out[i] = lut[c][in[i]]`, `c = (i / plane) % 3`, over `n` values (whole images of three
/// planes each, one after the other).
const KERNEL: &str = include_str!("kernels/normalise.cu");

/// The normalising kernel, the table on the device, and a staging buffer for the bytes.
pub(crate) struct GpuNormaliser {
    gpu: Arc<Gpu>,
    kernel: Kernel,
    lut: DeviceBuffer,
    staging: Option<DeviceBuffer>,
}

impl std::fmt::Debug for GpuNormaliser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuNormaliser").finish_non_exhaustive()
    }
}

impl GpuNormaliser {
    /// Compiles the kernel for `gpu` and uploads `table` (`table[c][v]`: byte `v` of channel
    /// `c`, normalised).
    pub(crate) fn new(gpu: &Arc<Gpu>, table: &[[f32; 256]; 3]) -> Result<GpuNormaliser> {
        let kernel = Kernel::compile(gpu, KERNEL, "tensorport_normalise.cu", c"tp_normalise_u8")?;
        let lut = DeviceBuffer::new(gpu, 3 * 256 * 4)?;
        let bytes: Vec<u8> = table
            .iter()
            .flatten()
            .flat_map(|x| x.to_ne_bytes())
            .collect();
        let stream = Stream::new(gpu)?;
        // SAFETY: `lut` holds exactly these bytes; the copy is waited for before `bytes` goes.
        unsafe { stream.copy_host_to_device_async(lut.ptr(), &bytes)? };
        stream.synchronize()?;
        Ok(GpuNormaliser {
            gpu: gpu.clone(),
            kernel,
            lut,
            staging: None,
        })
    }

    /// Makes the staging buffer for a batch's 8-bit images at least `len` bytes (reused;
    /// grown when too small — the caller must have waited for the previous batch's kernels).
    pub(crate) fn reserve_staging(&mut self, len: usize) -> Result<()> {
        if self.staging.as_ref().is_none_or(|b| b.len() < len) {
            self.staging = None;
            self.staging = Some(DeviceBuffer::new(&self.gpu, len.max(1))?);
        }
        Ok(())
    }

    /// The staging buffer as rows to gather into (after [`GpuNormaliser::reserve_staging`]).
    pub(crate) fn staging(&self) -> Option<Rows<'_>> {
        self.staging.as_ref().map(Rows::of_buffer)
    }

    /// Enqueues on `stream`: `images` images of `3 × plane` bytes at `src_offset` of `src`,
    /// normalised into as many images of floats at `dst_offset` of `dst` (one launch).
    ///
    /// # Safety
    /// The rows must stay allocated, and be used by nothing else, until the kernel has run on
    /// `stream` (a gather waits for its stream, or holds the rows for good).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn normalise_rows(
        &self,
        src: &Rows<'_>,
        src_offset: usize,
        dst: &Rows<'_>,
        dst_offset: usize,
        plane: usize,
        images: usize,
        stream: &Stream,
    ) -> Result<()> {
        let bytes = images * 3 * plane;
        let fits = |rows: &Rows<'_>, offset: usize, len: usize| {
            offset.checked_add(len).is_some_and(|end| end <= rows.len())
        };
        if !fits(src, src_offset, bytes) || !fits(dst, dst_offset, bytes * 4) {
            return Err(crate::Error::Refused(
                "images to normalise past the end of their rows",
            ));
        }
        let (src, dst) = (src.addr().offset(src_offset), dst.addr().offset(dst_offset));
        let n = bytes as u64;
        let threads = 256u32;
        let blocks = u32::try_from(n.div_ceil(u64::from(threads)))
            .map_err(|_| crate::Error::BadAnswer("an image too large to normalise"))?;
        let (mut s, mut d, mut l, mut p, mut count) =
            (src.raw(), dst.raw(), self.lut.ptr().raw(), plane as u64, n);
        let mut params: [*mut std::ffi::c_void; 5] = [
            (&mut s as *mut u64).cast(),
            (&mut d as *mut u64).cast(),
            (&mut l as *mut u64).cast(),
            (&mut p as *mut u64).cast(),
            (&mut count as *mut u64).cast(),
        ];
        // SAFETY: the parameters match the kernel's (three pointers, two 64-bit counts); both
        // ranges lie inside their rows (checked above), which the caller keeps until the kernel
        // has run; the table lives as long as `self`.
        unsafe {
            self.kernel
                .launch((blocks, 1, 1), (threads, 1, 1), stream, &mut params)
        }
    }
}
