//! The batch loop each model worker runs: take a batch of requests, build the model's input
//! (one copy on the CPU; DMA and fences on the GPU), give the slots back, run the model, answer
//! every request. Where the model runs on a device of its own (cuDNN), the next batch is taken
//! and gathered while the device runs the last one, whose answers go out once the next is on
//! its way.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tensorport::{Request, Responder, Server};
use tensorport_dfdx::dfdx::prelude::Device;
use tensorport_dfdx::{Classify, Submitted, Tensor4};

use super::metrics::Metrics;
use crate::error::Result;
use crate::record::scores_to_bytes;

/// A batch's model input, built from its requests.
pub struct Stacked<D: Device<f32>> {
    /// `[B, C, H, W]`, the images of `used` in order; `None` if no request fit.
    pub input: Option<Tensor4<D>>,
    /// Indices (into the requests) of the images in `input`, row by row.
    pub used: Vec<usize>,
    /// The requests the batch could not take, and why. A request may be here and in `used` (a
    /// late device tensor whose row stays in `input`, zeroed): it gets its rejection, and its
    /// row's result is skipped.
    pub rejected: Vec<(usize, Rejection)>,
}

impl<D: Device<f32>> From<tensorport_dfdx::Stacked<D>> for Stacked<D> {
    fn from(s: tensorport_dfdx::Stacked<D>) -> Stacked<D> {
        Stacked {
            input: s.input,
            used: s.used,
            rejected: s
                .rejected
                .into_iter()
                .map(|(i, e)| (i, Rejection::Input(e)))
                .collect(),
        }
    }
}

/// Why a request got no row of a batch.
#[derive(Debug)]
pub enum Rejection {
    /// It does not fit the model's input, or the batch failed: the request is failed.
    Input(tensorport_dfdx::Error),
    /// What the GPU gather found (a misfit, a late fence), answered as
    /// [`tensorport_cuda::Fault::answer`] says.
    Gather(tensorport_cuda::Fault),
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::Input(e) => e.fmt(f),
            Rejection::Gather(fault) => fault.fmt(f),
        }
    }
}

impl Rejection {
    fn answer(&self, r: Responder) -> tensorport::Result<()> {
        match self {
            Rejection::Input(e) => r.fail(e.to_string()),
            Rejection::Gather(fault) => fault.answer(r),
        }
    }
}

/// Builds each batch's model input from its requests: the one place a model worker's batches
/// are assembled. [`CpuBatcher`] stacks them on the host; on the GPU, `CudaBatcher` gathers
/// them into the batch with [`tensorport_cuda::RowBatcher`], which settles a batch's failures.
pub trait Batcher<D: Device<f32>> {
    /// The model input for `reqs`, row by row, with the requests it could not take and why. A
    /// batcher whose copy stream stalls keeps the requests (held for good: a copy may still
    /// read them), leaving `reqs` and the batch empty.
    fn stack(&mut self, dev: &D, reqs: &mut Vec<Request>, shape: [usize; 3]) -> Stacked<D>;

    /// Signals "released" for the device tensors among `reqs`, which a sink answers without
    /// reading (each producer's next write of its buffer waits for it); nothing on the CPU.
    fn release_unread(&mut self, reqs: &[Request]) -> Result<(), String>;
}

/// Batches on the host: one copy of each image (normalised if it came as 8-bit planes).
pub struct CpuBatcher;

impl<D: Device<f32>> Batcher<D> for CpuBatcher {
    fn stack(&mut self, dev: &D, reqs: &mut Vec<Request>, shape: [usize; 3]) -> Stacked<D> {
        tensorport_dfdx::stack_images(dev, reqs, shape).into()
    }

    fn release_unread(&mut self, _: &[Request]) -> Result<(), String> {
        Ok(())
    }
}

/// A worker's model.
pub type Model<D> = Box<dyn Classify<D>>;

/// What the model workers share: the server, the batching policy and the counters.
pub struct BatchLoop<'a> {
    pub server: &'a Server,
    pub max_batch: usize,
    /// How long a batch waits for more requests after its first.
    pub max_wait: Duration,
    /// Answer at once, without a model.
    pub sink: bool,
    /// The model's input `[C, H, W]`.
    pub shape: [usize; 3],
    /// Asked to stop: drain, then return.
    pub stop: &'a crate::process::Stop,
    pub metrics: Option<&'a Metrics>,
    /// Images answered, all workers together.
    pub images: &'a AtomicU64,
}

/// A batch whose scores the model is still computing: who to answer, row by row.
struct InFlight {
    responders: Vec<Option<Responder>>,
    used: Vec<usize>,
    size: usize,
    taken: Instant,
    model_started: Instant,
}

impl BatchLoop<'_> {
    /// One model worker: takes batches (from its share of the producers when there are several
    /// workers), runs the model, answers, until the server has drained.
    pub fn run<D: Device<f32>>(
        &self,
        dev: &D,
        batcher: &mut dyn Batcher<D>,
        mut model: Option<&mut Model<D>>,
    ) -> Result<()> {
        let mut draining = false;
        let mut in_flight: Option<InFlight> = None;
        let finish = |m: &mut Option<&mut Model<D>>, batch: Option<InFlight>| {
            if let (Some(batch), Some(m)) = (batch, m.as_deref_mut()) {
                let scores = m.collect();
                self.answer(batch, scores);
            }
        };
        loop {
            if self.stop.draining() && !draining {
                draining = true;
                self.server.drain();
            }
            // With a batch on the device, take only what is already queued: its answers wait for
            // this call.
            let (first, more) = match in_flight {
                Some(_) => (Duration::ZERO, Duration::ZERO),
                None => (Duration::from_millis(100), self.max_wait),
            };
            let Ok(batch) = self.server.recv_batch(self.max_batch, first, more) else {
                break; // stopped
            };
            if batch.is_empty() {
                finish(&mut model, in_flight.take());
                continue;
            }
            let taken = Instant::now();
            let size = batch.len();
            if self.sink {
                if let Err(e) = batcher.release_unread(&batch) {
                    // The producers' buffers are not released on the GPU: their requests fail
                    // (their next writes would wait for good).
                    tracing::error!("a sink could not release device tensors: {e}");
                    for r in batch {
                        let _ = r.fail_and_end_session(
                            tensorport::wire::ErrorCode::Internal,
                            format!("the server could not release this device tensor: {e}"),
                        );
                    }
                    continue;
                }
                let mut answers: Vec<_> = batch.into_iter().map(|r| (r, [0u8; 0])).collect();
                let _ = self.server.respond_all(&mut answers);
                self.images.fetch_add(size as u64, Ordering::Relaxed);
                self.record(size, Duration::ZERO, taken);
                continue;
            }
            let mut batch = batch;
            let stacked = batcher.stack(dev, &mut batch, self.shape);
            // The batch owns a copy of the pixels now: give the slots back before the model runs.
            let mut responders: Vec<Option<Responder>> =
                batch.into_iter().map(|r| Some(r.release())).collect();
            // (Before the results: a late device tensor's row is in the input, but it gets this.)
            reject(&mut responders, stacked.rejected);
            // This batch is on the device: the last one's scores are wanted now.
            finish(&mut model, in_flight.take());
            let Some(x) = stacked.input else {
                self.record(size, Duration::ZERO, taken);
                continue;
            };
            let batch = InFlight {
                responders,
                used: stacked.used,
                size,
                taken,
                model_started: Instant::now(),
            };
            match model.as_deref_mut() {
                Some(m) => match m.submit(x) {
                    Ok(Submitted::InFlight) => in_flight = Some(batch),
                    Ok(Submitted::Ready(scores)) => self.answer(batch, Ok(scores)),
                    Err(e) => self.answer(batch, Err(e)),
                },
                // No model: the batch is on the device; that was the job.
                None => {
                    let rows = batch.used.len();
                    self.answer(batch, Ok(vec![Vec::new(); rows]));
                }
            }
        }
        finish(&mut model, in_flight.take());
        Ok(())
    }

    /// Answers `batch`'s requests from `scores` (row `k` for request `used[k]`), or each with the
    /// model's error, and records the batch.
    fn answer(&self, batch: InFlight, scores: tensorport_dfdx::Result<Vec<Vec<f32>>>) {
        let InFlight {
            mut responders,
            used,
            size,
            taken,
            model_started,
        } = batch;
        let model_time = model_started.elapsed();
        match scores {
            Ok(scores) => {
                for (row, i) in scores.iter().zip(used) {
                    if let Some(r) = responders[i].take() {
                        let _ = r.respond(&scores_to_bytes(row));
                    }
                    self.images.fetch_add(1, Ordering::Relaxed);
                }
            }
            // The model failed: this batch's requests get the error, unless the CUDA context
            // of an engine the server owns is lost, when the process ends unanswered and a new
            // server redoes them (a model of the caller's own reports its own errors).
            Err(e) => {
                if !matches!(e, tensorport_dfdx::Error::Model(_)) {
                    super::end_if_context_lost(&e);
                }
                tracing::error!("the model failed on a batch of {size}: {e}");
                for i in used {
                    if let Some(r) = responders[i].take() {
                        let _ = r.fail(e.to_string());
                    }
                }
            }
        }
        self.record(size, model_time, taken);
    }

    fn record(&self, size: usize, model: Duration, taken: Instant) {
        if let Some(m) = self.metrics {
            m.record_batch(size, model, taken.elapsed());
        }
    }
}

/// Answers the requests the batch could not take.
fn reject(responders: &mut [Option<Responder>], rejected: Vec<(usize, Rejection)>) {
    for (i, why) in rejected {
        tracing::warn!("{why}");
        if let Some(r) = responders.get_mut(i).and_then(Option::take) {
            let _ = why.answer(r);
        }
    }
}
