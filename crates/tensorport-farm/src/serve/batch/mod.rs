//! The batch loop each model worker runs: take a batch of requests, write them into the input
//! memory the worker's engine lends (one copy on the CPU; DMA and fences on the GPU), give the
//! slots back, run the engine, answer every request. Where the engine runs on a device or
//! thread of its own (cuDNN, ONNX Runtime), the next batch is taken and gathered while it runs
//! the last one, whose answers go out once the next is on its way.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tensorport::{Request, Responder, Server};
use tensorport_vision::request::{check_image, Misfit};

use super::engine::{Engine, EngineError, Input, Scores, Submitted};
use super::metrics::Metrics;
use super::pace::{Pace, RunTimes};
use crate::error::Result;
use crate::record::scores_to_bytes;

/// A batch's model input, written into the memory its engine lent.
#[derive(Debug)]
pub struct Stacked {
    /// The images of `used` in order, row by row; `None` if no request fit.
    pub input: Option<Input>,
    /// Indices (into the requests) of the images in `input`, row by row.
    pub used: Vec<usize>,
    /// The requests the batch could not take, and why. A request may be here and in `used` (a
    /// late device tensor whose row stays in `input`, zeroed): it gets its rejection, and its
    /// row's result is skipped.
    pub rejected: Vec<(usize, Rejection)>,
}

/// The requests' indices that passed their checks, each request's checked value (`None` where
/// it failed), and why each that failed did.
pub(super) type Sorted<T> = (Vec<usize>, Vec<Option<T>>, Vec<(usize, Rejection)>);

/// Checks each request with `check`: the indices of those that pass, each request's checked
/// value (`None` for one that failed), and why each that failed did.
pub(super) fn sort_requests<'r, T>(
    reqs: &'r [Request],
    check: impl Fn(&'r Request) -> Result<T, Misfit>,
) -> Sorted<T> {
    let mut used = Vec::with_capacity(reqs.len());
    let mut checked = Vec::with_capacity(reqs.len());
    let mut rejected = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        match check(r) {
            Ok(v) => {
                used.push(i);
                checked.push(Some(v));
            }
            Err(e) => {
                checked.push(None);
                rejected.push((i, Rejection::Misfit(e)));
            }
        }
    }
    (used, checked, rejected)
}

impl Stacked {
    /// No input: no request fit, and `rejected` says why.
    pub(super) fn none(used: Vec<usize>, rejected: Vec<(usize, Rejection)>) -> Stacked {
        Stacked {
            input: None,
            used,
            rejected,
        }
    }

    /// No input: every request in `used` is rejected with `why` (or, where `why` says the
    /// CUDA context is lost, the process ends: [`super::end_if_context_lost`]).
    pub(super) fn failed(
        mut used: Vec<usize>,
        mut rejected: Vec<(usize, Rejection)>,
        why: &str,
    ) -> Stacked {
        // The engine could not lend its memory, or the gather failed: where the CUDA context
        // is lost, the server ends here rather than failing every batch from now on.
        super::end_if_context_lost(&why);
        rejected.extend(
            used.drain(..)
                .map(|i| (i, Rejection::Batch(why.to_string()))),
        );
        Stacked {
            input: None,
            used,
            rejected,
        }
    }
}

/// Why a request got no row of a batch.
#[derive(Debug)]
pub enum Rejection {
    /// It does not fit the model's input: the request is failed.
    Misfit(Misfit),
    /// Its batch could not be built (the engine lent no memory, a copy failed): failed.
    Batch(String),
    /// What the GPU gather found (a misfit, a late fence), answered as
    /// [`tensorport_cuda::Fault::answer`] says.
    Gather(tensorport_cuda::Fault),
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::Misfit(e) => e.fmt(f),
            Rejection::Batch(why) => f.write_str(why),
            Rejection::Gather(fault) => fault.fmt(f),
        }
    }
}

impl Rejection {
    fn answer(&self, r: Responder) -> tensorport::Result<()> {
        match self {
            Rejection::Misfit(_) | Rejection::Batch(_) => r.fail(self.to_string()),
            Rejection::Gather(fault) => fault.answer(r),
        }
    }
}

/// Builds each batch's model input from its requests, in the memory the worker's engine lends:
/// the one place a model worker's batches are assembled. [`CpuBatcher`] writes host rows; on
/// the GPU, `CudaBatcher` gathers into device memory with [`tensorport_cuda::RowBatcher`],
/// which settles a batch's failures.
pub trait Batcher {
    /// The model input for `reqs` (images of `shape`), row by row, in memory `engine` lends,
    /// with the requests it could not take and why. A batcher whose copy stream stalls keeps
    /// the requests (held for good: a copy may still read them), leaving `reqs` and the batch
    /// empty.
    fn stack(
        &mut self,
        reqs: &mut Vec<Request>,
        shape: [usize; 3],
        engine: &mut dyn Engine,
    ) -> Stacked;

    /// Signals "released" for the device tensors among `reqs`, which a sink answers without
    /// reading (each producer's next write of its buffer waits for it); nothing on the CPU.
    fn release_unread(&mut self, reqs: &[Request]) -> Result<(), String>;
}

/// Batches on the host: each image written once into the engine's rows (normalised if it came
/// as 8-bit planes).
pub struct CpuBatcher;

impl Batcher for CpuBatcher {
    fn stack(
        &mut self,
        reqs: &mut Vec<Request>,
        shape: [usize; 3],
        engine: &mut dyn Engine,
    ) -> Stacked {
        let (used, images, rejected) = sort_requests(reqs, |r| check_image(r, shape));
        if used.is_empty() {
            return Stacked::none(used, rejected);
        }
        let lent = engine.lend(used.len());
        let mut rows = match lent.and_then(|input| input.into_host("a batch built on the host")) {
            Ok(rows) => rows,
            Err(e) => return Stacked::failed(used, rejected, &e.to_string()),
        };
        for px in images.into_iter().flatten() {
            if let Err(e) = rows.push(px) {
                return Stacked::failed(used, rejected, &e.to_string());
            }
        }
        Stacked {
            input: Some(Input::Host(rows)),
            used,
            rejected,
        }
    }

    fn release_unread(&mut self, _: &[Request]) -> Result<(), String> {
        Ok(())
    }
}

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
    /// When it was submitted, and when its engine could start it (the batch before it ended).
    model_started: Instant,
    /// How long its engine expects to run it.
    run: Option<Duration>,
}

impl BatchLoop<'_> {
    /// One model worker: takes batches (from its share of the producers when there are several
    /// workers), runs the model, answers, until the server has drained. While its engine runs a
    /// batch, the worker takes requests for the next one until that one must be gathered to be
    /// ready as the engine ends ([`Pace`]); the next batch is submitted before the last one's
    /// answers go out, and with an engine that holds two ([`Engine::depth`]), before the last
    /// one ends.
    pub fn run(&self, batcher: &mut dyn Batcher, engine: &mut dyn Engine) -> Result<()> {
        let mut draining = false;
        let mut pending: VecDeque<InFlight> = VecDeque::new();
        let mut pace = Pace::default();
        let depth = engine.depth().max(1);
        // From the first batch taken; and the runs of an engine that answers at once.
        let mut first: Option<Instant> = None;
        let mut ran_here = RunTimes::default();
        // The oldest batch in flight, collected: its scores, and the pace told that the one
        // behind it (if any) runs now.
        let collect = |engine: &mut dyn Engine,
                       pending: &mut VecDeque<InFlight>,
                       pace: &mut Pace|
         -> Option<(InFlight, Result<Scores, EngineError>)> {
            let batch = pending.pop_front()?;
            let scores = engine.collect();
            let now = Instant::now();
            pace.collected(now, pending.front().map(|b| b.run));
            // The one queued behind it starts now: its model time counts from here.
            if let Some(next) = pending.front_mut() {
                next.model_started = next.model_started.max(now);
            }
            Some((batch, scores))
        };
        loop {
            if self.stop.draining() && !draining {
                draining = true;
                self.server.drain();
            }
            let batch = match (pending.is_empty(), pace.take_until(Instant::now())) {
                (true, _) => self.server.recv_batch(
                    self.max_batch,
                    Duration::from_millis(100),
                    self.max_wait,
                ),
                // The engine runs a batch: requests for the next one until it must be gathered.
                (false, Some(by)) => self.server.recv_batch_until(self.max_batch, by),
                // Its answers wait for this call: only what is already queued.
                (false, None) => {
                    self.server
                        .recv_batch(self.max_batch, Duration::ZERO, Duration::ZERO)
                }
            };
            let Ok(batch) = batch else {
                break; // stopped
            };
            if batch.is_empty() {
                if let Some((b, scores)) = collect(engine, &mut pending, &mut pace) {
                    self.answer(b, scores);
                }
                continue;
            }
            let taken = Instant::now();
            first.get_or_insert(taken);
            let size = batch.len();
            if self.sink {
                self.sink(batcher, batch, taken);
                continue;
            }
            let mut batch = batch;
            let stacked = batcher.stack(&mut batch, self.shape, engine);
            pace.gathered(taken.elapsed());
            // The engine's memory holds the pixels now: give the slots back before it runs.
            let mut responders: Vec<Option<Responder>> =
                batch.into_iter().map(|r| Some(r.release())).collect();
            // (Before the results: a late device tensor's row is in the input, but it gets this.)
            reject(&mut responders, stacked.rejected);
            let Some(x) = stacked.input else {
                self.record(size, Duration::ZERO, taken);
                continue;
            };
            // Room in the engine: the oldest batches collected, answered once this one runs.
            let mut done = Vec::new();
            while pending.len() >= depth {
                done.extend(collect(engine, &mut pending, &mut pace));
            }
            let rows = x.rows();
            let batch = InFlight {
                responders,
                used: stacked.used,
                size,
                taken,
                model_started: Instant::now(),
                run: engine.run_time(rows),
            };
            match engine.submit(x) {
                Ok(Submitted::InFlight) => {
                    pace.submitted(batch.model_started, batch.run);
                    pending.push_back(batch);
                }
                Ok(Submitted::Ready(scores)) => {
                    ran_here.record(batch.model_started.elapsed());
                    done.push((batch, Ok(scores)));
                }
                Err(e) => done.push((batch, Err(e))),
            }
            for (b, scores) in done {
                self.answer(b, scores);
            }
            // A batch queued behind a running one: the running one's answers go out as it ends
            // (its producers wait for them), while the next batch's requests arrive.
            if pending.len() > 1 {
                if let Some((b, scores)) = collect(engine, &mut pending, &mut pace) {
                    self.answer(b, scores);
                }
            }
        }
        while let Some((b, scores)) = collect(engine, &mut pending, &mut pace) {
            self.answer(b, scores);
        }
        if let Some(first) = first {
            let runs = engine.runs().unwrap_or(ran_here);
            report(&pace.gathers(), &runs, first.elapsed());
        }
        Ok(())
    }

    /// A sink's batch: the device tensors released, every request answered at once.
    fn sink(&self, batcher: &mut dyn Batcher, batch: Vec<Request>, taken: Instant) {
        let size = batch.len();
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
            return;
        }
        let mut answers: Vec<_> = batch.into_iter().map(|r| (r, [0u8; 0])).collect();
        let _ = self.server.respond_all(&mut answers);
        self.images.fetch_add(size as u64, Ordering::Relaxed);
        self.record(size, Duration::ZERO, taken);
    }

    /// Answers `batch`'s requests from `scores` (row `k` for request `used[k]`), or each with the
    /// model's error, and records the batch.
    fn answer(&self, batch: InFlight, scores: Result<Scores, EngineError>) {
        let InFlight {
            mut responders,
            used,
            size,
            taken,
            model_started,
            ..
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
                if let EngineError::Failed(_) = e {
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

/// Says, once a worker ends, where its time went since its first batch (`wall`): gathering
/// `gathers`, and the engine's `runs` (a worker whose engine ran nearly all the time is bound by
/// the model; one whose engine waited, by the producers).
fn report(gathers: &RunTimes, runs: &RunTimes, wall: Duration) {
    let per = |t: Duration, n: u64| t.as_secs_f64() * 1e3 / n.max(1) as f64;
    let wall = wall.as_secs_f64();
    let busy = 100.0 * runs.total.as_secs_f64() / wall.max(1e-9);
    tracing::info!(
        batches = gathers.count,
        gather_ms = format!("{:.2}", per(gathers.total, gathers.count)),
        run_ms = format!("{:.2}", per(runs.total, runs.count)),
        seconds = format!("{wall:.1}"),
        "model worker done: the engine ran {busy:.0}% of the {wall:.1} s since its first batch"
    );
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

#[cfg(test)]
mod tests;
