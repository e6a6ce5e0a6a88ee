//! A model worker's batches on the GPU, without a CPU copy: each request's bytes go straight
//! into its row of the model input — a DMA from its (registered, pinned) host slot, or a
//! device-to-device copy from a GPU producer's buffer after its fence
//! ([`tensorport_cuda::Gatherer::gather_rows`]) — and 8-bit images are normalised into their
//! rows on the GPU. This is where a gathered batch's failures are settled: a request that does
//! not fit the model is rejected; a device tensor whose fence does not come within the timeout
//! keeps its (zeroed) row and is rejected with [`Error::FenceTimeout`] (its producer's session
//! ends); a copy stream that does not drain quarantines the batch — its requests and its input
//! are held for good, since a copy may still write them — and the worker takes no more GPU
//! batches. Needs the build-time dfdx patch that exposes a tensor's device address
//! (`scripts/build-gpu.sh`).

use std::sync::Arc;
use std::time::Duration;

use tensorport::{DType, Request};
use tensorport_cuda::{DevicePtr, Gatherer, Gpu, GpuNormaliser, Place, Rows, RowsError, Stream};
use tensorport_dfdx::dfdx::prelude::*;
use tensorport_dfdx::{check_shape, Error, Stacked, Tensor4};

use super::Batcher;

/// One worker's GPU batcher: its copy stream, its normaliser and its share of the server's
/// [`Gatherer`].
pub struct CudaBatcher {
    gpu: Arc<Gpu>,
    stream: Stream,
    /// A stream of its own for a sink's releases (nothing else queues behind them).
    releases: Stream,
    norm: GpuNormaliser,
    gatherer: Arc<Gatherer>,
    fence_timeout: Duration,
    /// Inputs a stream that never drained may still write: never freed (see `Drop`).
    held: Vec<Tensor4<Cuda>>,
}

impl CudaBatcher {
    /// A batcher on `gpu` (the primary context, the one the server's importer opens producers'
    /// buffers in), with the server's `gatherer`, waiting at most `fence_timeout` for a
    /// producer's fence.
    pub fn new(
        gpu: &Arc<Gpu>,
        gatherer: Arc<Gatherer>,
        fence_timeout: Duration,
    ) -> tensorport_cuda::Result<CudaBatcher> {
        Ok(CudaBatcher {
            gpu: gpu.clone(),
            stream: Stream::new(gpu)?,
            releases: Stream::new(gpu)?,
            // u8 images are normalised on the GPU with the producers' table.
            norm: GpuNormaliser::new(gpu, tensorport_dfdx::normaliser().table())?,
            gatherer,
            fence_timeout,
            held: Vec::new(),
        })
    }

    /// Copies the requests at `used` (of kinds `dtypes`) into `input`'s rows; the batch's error,
    /// and whether the stream stalled (the input must then be held).
    fn gather(
        &mut self,
        dev: &Cuda,
        input: &Tensor4<Cuda>,
        reqs: &mut Vec<Request>,
        used: &[usize],
        dtypes: &[DType],
        shape: [usize; 3],
    ) -> std::result::Result<tensorport_cuda::Gathered, (String, bool)> {
        let failed = |e: String| (e, false);
        let plane = shape[1] * shape[2];
        let row = shape.iter().product::<usize>() * 4;
        let row_u8 = row / 4;
        // The zeros are written on dfdx's stream; our copies must come after them.
        dev.try_synchronize()
            .map_err(|e| failed(format!("{e:?}")))?;
        let at = DevicePtr::new(input.tensorport_device_ptr())
            .ok_or_else(|| failed("a batch with no device memory".into()))?;
        // SAFETY: `input` is this batch's alone, `used.len()` rows of `row` bytes, and is never
        // freed should the stream stall (held by the batcher for good).
        let rows = unsafe { Rows::from_raw(&self.gpu, at, used.len() * row) };
        // 8-bit images land in the staging buffer at their row's place, and each run of
        // consecutive 8-bit rows is normalised into the batch by one kernel launch (usually one
        // per batch: producers hand over one kind).
        let staging = match dtypes.contains(&DType::U8) {
            true => {
                let buf = self
                    .norm
                    .staging(used.len() * row_u8)
                    .map_err(|e| failed(e.to_string()))?;
                // SAFETY: the normaliser's staging buffer, which only this batcher's batches
                // use, one at a time; a stalled stream ends this batcher's GPU batches (its
                // normaliser is never used again).
                Some(unsafe { Rows::from_raw(&self.gpu, buf.ptr(), buf.len()) })
            }
            false => None,
        };
        let mut places = vec![None; reqs.len()];
        for (k, (&i, &dtype)) in used.iter().zip(dtypes).enumerate() {
            places[i] = Some(match (dtype, &staging) {
                (DType::U8, Some(s)) => Place {
                    rows: s,
                    offset: k * row_u8,
                    len: row_u8,
                },
                _ => Place {
                    rows: &rows,
                    offset: k * row,
                    len: row,
                },
            });
        }
        let norm = &mut self.norm;
        let normalise = |stream: &Stream| -> tensorport_cuda::Result<()> {
            let Some(s) = &staging else { return Ok(()) };
            let mut k = 0;
            while k < dtypes.len() {
                if dtypes[k] != DType::U8 {
                    k += 1;
                    continue;
                }
                let run = dtypes[k..].iter().take_while(|&&d| d == DType::U8).count();
                // SAFETY: rows k..k+run of the staging buffer hold those images' bytes (copied
                // just before, on the same stream), and rows k..k+run of `input` are theirs.
                unsafe {
                    norm.normalise(
                        s.addr().offset(k * row_u8),
                        rows.addr().offset(k * row),
                        plane,
                        run,
                        stream,
                    )?
                };
                k += run;
            }
            Ok(())
        };
        self.gatherer
            .gather_rows(&self.stream, reqs, &places, self.fence_timeout, normalise)
            .map_err(|e| {
                let stalled = matches!(e, RowsError::Stalled(_));
                (e.to_string(), stalled)
            })
    }
}

impl Batcher<Cuda> for CudaBatcher {
    /// The `[B, C, H, W]` input on `dev` from `reqs`, the copies waited for, so the requests'
    /// slots and buffers may be released as soon as this returns.
    fn stack(&mut self, dev: &Cuda, reqs: &mut Vec<Request>, shape: [usize; 3]) -> Stacked<Cuda> {
        let mut used = Vec::with_capacity(reqs.len());
        let mut dtypes = Vec::with_capacity(reqs.len());
        let mut rejected = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            match check_shape(r, shape) {
                Ok(dtype) => {
                    used.push(i);
                    dtypes.push(dtype);
                }
                Err(e) => rejected.push((i, e)),
            }
        }
        if !self.held.is_empty() {
            // Its copies may still run: the stream, the staging buffer and the normaliser are
            // never used again.
            let msg = "this model worker's copy stream stalled on an earlier batch; it takes no more GPU batches (restart the server)";
            rejected.extend(used.drain(..).map(|i| (i, Error::Device(msg.into()))));
        }
        if used.is_empty() {
            return Stacked {
                input: None,
                used,
                rejected,
            };
        }
        let input: Tensor4<Cuda> = dev.zeros_like(&(used.len(), shape[0], shape[1], shape[2]));
        match self.gather(dev, &input, reqs, &used, &dtypes, shape) {
            Ok(g) => {
                // A late tensor's row stays in the input (zeroed), so `used` still lines up
                // row by row; its request is failed.
                for i in g.late {
                    rejected.push((
                        i,
                        Error::FenceTimeout {
                            request_id: reqs[i].request_id(),
                            producer: reqs[i].producer().to_string(),
                            timeout: self.fence_timeout,
                        },
                    ));
                }
                rejected.extend(g.misfits.into_iter().map(|(i, m)| (i, Error::Device(m))));
                Stacked {
                    input: Some(input),
                    used,
                    rejected,
                }
            }
            Err((msg, stalled)) => {
                if stalled {
                    // Copies may still write `input`: it is never freed or reused.
                    self.held.push(input);
                }
                rejected.extend(used.drain(..).map(|i| (i, Error::Device(msg.clone()))));
                Stacked {
                    input: None,
                    used,
                    rejected,
                }
            }
        }
    }

    /// Signals "released" for the device tensors among `reqs`: each producer's next write of
    /// its buffer waits for that signal on its GPU, so a sink that skipped it would stall every
    /// GPU producer once its buffers were used.
    fn release_unread(&mut self, reqs: &[Request]) -> std::result::Result<(), String> {
        let tensors: Vec<&tensorport::DeviceTensor> =
            reqs.iter().filter_map(|r| r.device()).collect();
        if tensors.is_empty() {
            return Ok(());
        }
        // SAFETY: the stream is of the gatherer's GPU (`release_all` refuses another's), where
        // the server's importer opened its producers' buffers; the releases read nothing.
        unsafe { self.gatherer.release_all(&self.releases, &tensors) }.map_err(|e| e.to_string())
    }
}

impl Drop for CudaBatcher {
    fn drop(&mut self) {
        // A held input may still be written by copies that never ran: leaked, never freed.
        for input in self.held.drain(..) {
            std::mem::forget(input);
        }
    }
}
