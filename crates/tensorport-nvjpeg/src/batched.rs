//! The JPEG engines' batched decoders, one call each for the images of a batch routed to them.

use std::sync::Arc;

use tensorport_cuda::{Gpu, Stream};

use crate::jpeg::JpegJob;
use crate::nvjpeg::{self, Nvjpeg};
use crate::route::Route;
use crate::Result;

/// The batch the engines' memory pool is first sized for; it grows with larger batches and
/// images (a 1 × 1 image hint, as the pool is reused rather than sized up front).
pub(crate) const POOL_BATCH: usize = 32;

/// A hardware-backend decoder of its own — handle and state — destroyed on drop.
pub(crate) struct Engine {
    lib: Arc<Nvjpeg>,
    handle: nvjpeg::Handle,
    state: nvjpeg::State,
    /// nvJPEG's memory pool was pre-allocated for it.
    pub pooled: bool,
}

// SAFETY: an nvJPEG handle and its state may move between threads; an `Engine` is used by one
// thread at a time (made on one, then owned by a `GpuJpeg`, which is used through `&mut`).
unsafe impl Send for Engine {}

impl Engine {
    /// A decoder on `gpu`'s JPEG engines with `flags`, its memory pool pre-allocated where the
    /// library can (a library that refuses, or lacks, the pool allocates per call instead).
    pub(crate) fn make(lib: &Arc<Nvjpeg>, gpu: &Gpu, flags: u32) -> Result<Engine> {
        gpu.bind()?;
        let handle = lib.create(nvjpeg::BACKEND_HARDWARE, flags)?;
        let mut me = Engine {
            lib: lib.clone(),
            handle,
            state: std::ptr::null_mut(),
            pooled: false,
        };
        // SAFETY: `handle` is live; the state is destroyed with it on drop.
        me.state = unsafe { lib.state_create(handle)? };
        // SAFETY: a live hardware-backend handle and its state, no batch yet.
        let pooled = unsafe { lib.batched_pre_allocate(handle, me.state, POOL_BATCH, 1, 1) };
        me.pooled = matches!(pooled, Ok(true));
        Ok(me)
    }

    /// Its handle and state, for a batch.
    pub(crate) fn raw(&self) -> (nvjpeg::Handle, nvjpeg::State) {
        (self.handle, self.state)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: made in `make`; the owner has waited for the batches that used them.
        unsafe {
            if !self.state.is_null() {
                let _ = self.lib.state_destroy(self.state);
            }
            let _ = self.lib.destroy(self.handle);
        }
    }
}

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
