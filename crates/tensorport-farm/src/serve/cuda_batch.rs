//! A model worker's batches on the GPU, without a CPU copy: each request goes straight into
//! its row of the GPU memory the worker's engine lends through [`tensorport_cuda::RowBatcher`], which
//! copies host slots by DMA and GPU producers' tensors after their fences, normalises 8-bit
//! images on the GPU, and says what became of each request (a misfit, a late fence) or of the
//! batch (a stalled copy stream quarantines it, and the worker takes no more GPU batches).

use std::sync::Arc;
use std::time::Duration;

use tensorport::{DType, Request};
use tensorport_cuda::{BatchError, Gatherer, Gpu, RowBatcher, RowKind};
use tensorport_vision::request::check_shape;

use super::batch::sort_requests;
use super::engine::{DeviceInput, DeviceRows, Engine, Input};
use super::{Batcher, Rejection, Stacked};

/// One worker's GPU batcher: a [`RowBatcher`] with the producers' normalisation table.
pub struct CudaBatcher(RowBatcher);

impl CudaBatcher {
    /// A batcher on `gpu` (the primary context, the one the server's importer opens producers'
    /// buffers in), with the server's `gatherer`, waiting at most `fence_timeout` for a
    /// producer's fence.
    pub fn new(
        gpu: &Arc<Gpu>,
        gatherer: Arc<Gatherer>,
        fence_timeout: Duration,
    ) -> tensorport_cuda::Result<CudaBatcher> {
        let table = tensorport_vision::request::normaliser().table();
        RowBatcher::new(gpu, gatherer, fence_timeout, Some(table)).map(CudaBatcher)
    }
}

impl Batcher for CudaBatcher {
    /// The `[B, C, H, W]` input from `reqs` in the GPU memory `engine` lends, the copies
    /// waited for, so the requests' slots and buffers may be released as soon as this returns.
    fn stack(
        &mut self,
        reqs: &mut Vec<Request>,
        shape: [usize; 3],
        engine: &mut dyn Engine,
    ) -> Stacked {
        let (used, rows, mut rejected) = sort_requests(reqs, |r| {
            check_shape(r, shape).map(|dtype| match dtype {
                DType::U8 => RowKind::U8,
                _ => RowKind::Bytes,
            })
        });
        if used.is_empty() {
            return Stacked::none(used, rejected);
        }
        let row = shape.iter().product::<usize>() * 4;
        // A quarantined batcher takes nothing: no memory is lent for it.
        if self.0.is_quarantined() {
            return Stacked::failed(used, rejected, &what_to_do(BatchError::Quarantined));
        }
        let lent = match engine.lend(used.len()) {
            Ok(Input::Device(d)) => d,
            Ok(_) => {
                let why = "the model lent host memory to a batch built on the GPU";
                return Stacked::failed(used, rejected, why);
            }
            Err(e) => return Stacked::failed(used, rejected, &e.to_string()),
        };
        let count = lent.rows;
        let gathered = match lent.memory {
            DeviceRows::Tensor(t) => self
                .0
                .gather(t, reqs, &rows, row)
                .map(|f| (DeviceRows::Tensor(f.memory), f.faults)),
            DeviceRows::Buffer(b) => self
                .0
                .gather(b, reqs, &rows, row)
                .map(|f| (DeviceRows::Buffer(f.memory), f.faults)),
        };
        match gathered {
            Ok((memory, faults)) => {
                // A late tensor's row stays in the input (zeroed), so `used` still lines up
                // row by row; its request gets its fault.
                rejected.extend(faults.into_iter().map(|(i, f)| (i, Rejection::Gather(f))));
                Stacked {
                    input: Some(Input::Device(DeviceInput {
                        rows: count,
                        memory,
                    })),
                    used,
                    rejected,
                }
            }
            Err(e) => {
                let why = what_to_do(e);
                // A stalled stream took the requests (held for good): `reqs` is empty then,
                // and failing their indices answers nothing.
                Stacked::failed(used, rejected, &why)
            }
        }
    }

    /// Signals "released" for the device tensors among `reqs`: each producer's next write of
    /// its buffer waits for that signal on its GPU, so a sink that skipped it would stall every
    /// GPU producer once its buffers were used.
    fn release_unread(&mut self, reqs: &[Request]) -> std::result::Result<(), String> {
        self.0.release_unread(reqs).map_err(|e| e.to_string())
    }
}

/// A batch error as the worker's requests get it: after a stall, what the operator does.
fn what_to_do(e: BatchError) -> String {
    match e {
        BatchError::Stalled(_) | BatchError::Quarantined => format!("{e} (restart the server)"),
        e => e.to_string(),
    }
}
