//! An ONNX model as the server's [`Engine`]: each worker opens its own ONNX Runtime session(s),
//! run on a thread of their own so that the worker gathers the next batch while ONNX Runtime
//! runs this one ([`Submitted::InFlight`]). The engine lends the batch's input memory: on the
//! CPU host rows (the same allocation for every batch, handed to the session's thread and
//! back: no copy besides the batcher's); on a GPU a buffer of a session's row count, which the
//! GPU batcher fills in place and ONNX Runtime reads where it lies (converted to `f16` on the
//! device first for an `f16` model), only the scores coming back to the host. The model's files
//! are read once per server ([`OnnxFile`]); every session is made from those bytes.

use tensorport_onnx::{OnnxOptions, Provider};

use super::engine::{Engine, EngineError, HostInput, Input, RunTimes, Scores, Submitted};
use crate::config::ModelOptions;
use crate::error::{ConfigError, Result};

mod gpu;
mod session;
#[cfg(feature = "cuda")]
pub(super) use gpu::load_on_cuda;
use session::{log_loaded, session_thread, Job, Runner};
pub(super) use session::{OnnxFile, OnnxModelInfo};

/// An ONNX model on ONNX Runtime's CPU execution provider: host rows, one allocation reused.
struct OnCpu {
    runner: Runner,
    shape: [usize; 3],
    /// The rows of the last batch, back from the session's thread.
    rows: Vec<f32>,
}

impl OnCpu {
    fn take_back(&mut self, job: Option<Job>) {
        if let Some(Job::Host(rows, _)) = job {
            self.rows = rows;
        }
    }
}

impl Engine for OnCpu {
    fn max_batch(&self) -> usize {
        crate::MAX_BATCH
    }

    fn lend(&mut self, rows: usize) -> std::result::Result<Input, EngineError> {
        let buffer = std::mem::take(&mut self.rows);
        Ok(Input::Host(HostInput::new(buffer, rows, self.shape)))
    }

    fn submit(&mut self, input: Input) -> std::result::Result<Submitted, EngineError> {
        let h = input.into_host("a session on the CPU")?;
        if !h.is_full() {
            return Err(EngineError::failed("a batch with rows left unwritten"));
        }
        let rows = h.rows();
        // One batch at a time: one still in flight is collected (its scores dropped) first.
        if self.runner.in_flight() > 0 {
            let _ = Engine::collect(self);
        }
        self.runner.submit(Job::Host(h.into_pixels(), rows))
    }

    fn collect(&mut self) -> std::result::Result<Scores, EngineError> {
        let (r, job) = self.runner.collect();
        self.take_back(job);
        r
    }

    fn runs(&self) -> Option<RunTimes> {
        Some(self.runner.runs())
    }
}

/// Opens `file` for a worker on the CPU (`threads`: its operators' threads).
pub(super) fn load_on_cpu(
    file: &OnnxFile,
    options: &ModelOptions,
    threads: Option<usize>,
) -> Result<(Box<dyn Engine>, OnnxModelInfo)> {
    let opts = OnnxOptions {
        provider: Provider::Cpu,
        threads,
        image_size: Some(options.config.image_size),
        ..OnnxOptions::default()
    };
    let model = file.open(&opts).map_err(ConfigError::from)?;
    let info = OnnxModelInfo::of(&model, options)?;
    log_loaded(&model, "ONNX model loaded (ONNX Runtime, CPU)");
    let shape = [3, model.image_size(), model.image_size()];
    let runner = Runner::start(model, None).map_err(session_thread)?;
    Ok((
        Box::new(OnCpu {
            runner,
            shape,
            rows: Vec::new(),
        }),
        info,
    ))
}
