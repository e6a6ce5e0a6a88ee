//! The JPEG engines' batched decoders, one call each for the images of a batch routed to them.

use tensorport_cuda::Stream;

use crate::jpeg::JpegJob;
use crate::nvjpeg::{self, Nvjpeg};
use crate::route::Route;
use crate::Result;

/// The engines' batched decoders of a [`GpuJpeg`], borrowed for one batch.
pub(crate) struct Batched<'a> {
    pub lib: &'a Nvjpeg,
    pub main: (nvjpeg::Handle, nvjpeg::State),
    pub plain: Option<(nvjpeg::Handle, nvjpeg::State)>,
}

impl Batched<'_> {
    /// The batched calls for the jobs routed to them (one call per decoder with any).
    ///
    /// # Safety
    /// Each job's planes (`images[i]`) are device memory large enough for its image, valid
    /// until the decode has run on `stream`; the jobs' bytes unchanged until then.
    pub(crate) unsafe fn decode(
        &self,
        jobs: &[JpegJob<'_>],
        images: &[nvjpeg::Image],
        routes: &[Route],
        stream: &Stream,
    ) -> Result<()> {
        for which in [Route::Batched, Route::BatchedPlain] {
            let (handle, state) = match (which, self.plain) {
                (Route::BatchedPlain, Some(p)) => p,
                (Route::BatchedPlain, None) => continue,
                _ => self.main,
            };
            let picked = picked(routes, which);
            if picked.is_empty() {
                continue;
            }
            let data: Vec<*const u8> = picked.iter().map(|&i| jobs[i].data.as_ptr()).collect();
            let lengths: Vec<usize> = picked.iter().map(|&i| jobs[i].data.len()).collect();
            let mut out: Vec<nvjpeg::Image> = picked.iter().map(|&i| images[i]).collect();
            // SAFETY: handle and state are live and the batch's alone; the caller's contract
            // for the planes and bytes.
            unsafe {
                self.lib
                    .batched_initialize(handle, state, data.len(), nvjpeg::OUTPUT_RGB)?;
                self.lib
                    .decode_batched(handle, state, &data, &lengths, &mut out, stream.raw())?;
            }
        }
        Ok(())
    }
}

/// The indices of the images routed to `which`, in batch order.
fn picked(routes: &[Route], which: Route) -> Vec<usize> {
    (0..routes.len()).filter(|&i| routes[i] == which).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_splits_between_the_decoders_in_order() {
        use Route::*;
        let routes = [Batched, BatchedPlain, Hybrid, Batched, BatchedPlain];
        assert_eq!(picked(&routes, Batched), vec![0, 3]);
        assert_eq!(picked(&routes, BatchedPlain), vec![1, 4]);
        assert_eq!(picked(&routes, Hybrid), vec![2]);
        assert!(picked(&[Batched; 3], BatchedPlain).is_empty());
    }
}
