//! An ONNX model on a GPU: a session per batch shape, each lending a buffer of its rows that the
//! GPU batcher fills and ONNX Runtime reads in place.

#[cfg(feature = "cuda")]
use tensorport_onnx::{OnnxModel, OnnxOptions};

#[cfg(feature = "cuda")]
use super::session::{log_loaded, session_thread, Job, OnDevice, OnnxFile, OnnxModelInfo, Runner};
#[cfg(feature = "cuda")]
use crate::config::ModelOptions;
#[cfg(feature = "cuda")]
use crate::error::{ConfigError, Result};
#[cfg(feature = "cuda")]
use crate::serve::engine::{Engine, EngineError, Input, Scores, Submitted};

/// The batch shapes a GPU worker runs, smallest first: a batch of `rows` runs in a session of
/// the first that holds it. ONNX Runtime's CUDA convolutions plan anew whenever a session's
/// input shape differs from its last run's (for ResNet-50, about a hundred milliseconds), so
/// each shape has a session of its own that only ever sees it: up to 32 rows (what a lightly
/// loaded server's batches hold) and the largest batch.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn session_rows(max_batch: usize) -> Vec<usize> {
    let max = max_batch.max(1);
    match max <= SMALL_ROWS {
        true => vec![max],
        false => vec![SMALL_ROWS, max],
    }
}

/// The smaller GPU session's rows.
const SMALL_ROWS: usize = 32;

/// An ONNX model on a GPU (CUDA or TensorRT execution provider): a session per batch shape
/// ([`session_rows`]); a batch is lent a buffer of its session's rows (`f32`), which an `f32`
/// model reads in place and an `f16` one after a conversion on the device.
#[cfg(feature = "cuda")]
struct OnCuda {
    gpu: std::sync::Arc<tensorport_cuda::Gpu>,
    /// Each session's rows, its runner, and the input buffers it has lent and got back.
    sessions: Vec<(usize, Runner, Vec<tensorport_cuda::DeviceBuffer>)>,
    /// The sessions of the batches in flight, oldest first.
    busy: std::collections::VecDeque<usize>,
    stage: tensorport_cuda::BatchStage,
    half: bool,
    image_len: usize,
}

#[cfg(feature = "cuda")]
impl OnCuda {
    /// The session that runs a batch of `rows`.
    fn session_for(&self, rows: usize) -> std::result::Result<usize, EngineError> {
        self.sessions
            .iter()
            .position(|(n, ..)| *n >= rows && rows > 0)
            .ok_or_else(|| {
                EngineError::failed(format!(
                    "a batch of {rows} images; this worker runs batches of 1 to {}",
                    self.max_batch()
                ))
            })
    }

    /// A zeroed `f32` buffer for `rows` images.
    fn fresh(&self, rows: usize) -> tensorport_cuda::Result<tensorport_cuda::DeviceBuffer> {
        let buf = tensorport_cuda::DeviceBuffer::new(&self.gpu, rows * self.image_len * 4)?;
        let stream = tensorport_cuda::Stream::new(&self.gpu)?;
        buf.fill_u32_async(0, &stream)?;
        stream.synchronize()?;
        Ok(buf)
    }

    /// A job back from its session: its lent buffer (or its staging buffer) to reuse.
    fn take_back(&mut self, k: usize, job: Option<Job>) {
        match job {
            Some(Job::Device {
                input: OnDevice::Staged(staged),
                ..
            }) => self.stage.give_back(staged),
            Some(Job::Device {
                input: OnDevice::InPlace(buf, _),
                ..
            }) => self.sessions[k].2.push(buf),
            _ => {}
        }
    }
}

#[cfg(feature = "cuda")]
impl Engine for OnCuda {
    fn max_batch(&self) -> usize {
        self.sessions.last().map_or(0, |(n, ..)| *n)
    }

    fn lend(&mut self, rows: usize) -> std::result::Result<Input, EngineError> {
        let k = self.session_for(rows)?;
        let padded = self.sessions[k].0;
        let buf = match self.sessions[k].2.pop() {
            Some(b) => b,
            None => self.fresh(padded).map_err(EngineError::failed)?,
        };
        Ok(Input::Device(crate::serve::engine::DeviceInput {
            rows,
            memory: crate::serve::engine::DeviceRows::Buffer(buf),
        }))
    }

    /// Two batches in flight: the second waits on its session's thread for the first (or runs
    /// beside it, in a session of another shape), so ONNX Runtime starts it as the first ends.
    fn depth(&self) -> usize {
        2
    }

    fn run_time(&self, rows: usize) -> Option<std::time::Duration> {
        let k = self.session_for(rows).ok()?;
        self.sessions[k].1.runs().mean()
    }

    fn runs(&self) -> Option<crate::serve::engine::RunTimes> {
        let mut all = crate::serve::engine::RunTimes::default();
        for (_, runner, _) in &self.sessions {
            let r = runner.runs();
            all.total += r.total;
            all.count += r.count;
        }
        Some(all)
    }

    fn submit(&mut self, input: Input) -> std::result::Result<Submitted, EngineError> {
        use crate::serve::engine::{DeviceInput, DeviceRows};
        while self.busy.len() >= self.depth() {
            let _ = Engine::collect(self);
        }
        let Input::Device(DeviceInput {
            rows,
            memory: DeviceRows::Buffer(buf),
        }) = input
        else {
            return Err(EngineError::failed("a batch not lent by this engine"));
        };
        let k = self.session_for(rows)?;
        let padded = self.sessions[k].0;
        if buf.len() < padded * self.image_len * 4 {
            return Err(EngineError::failed(
                "a batch in a buffer smaller than its session's",
            ));
        }
        let input = match self.half {
            false => OnDevice::InPlace(buf, padded),
            true => {
                let staged = self.stage.stage(&buf, rows, padded, self.image_len);
                // Staged (and waited for): the lent buffer is free again.
                self.sessions[k].2.push(buf);
                OnDevice::Staged(staged.map_err(EngineError::failed)?)
            }
        };
        let r = self.sessions[k].1.submit(Job::Device { input, keep: rows });
        if r.is_ok() {
            self.busy.push_back(k);
        }
        r
    }

    fn collect(&mut self) -> std::result::Result<Scores, EngineError> {
        let Some(k) = self.busy.pop_front() else {
            return Ok(Vec::new());
        };
        let (scores, job) = self.sessions[k].1.collect();
        self.take_back(k, job);
        scores
    }
}

/// Opens `file` for a worker on GPU `gpu` with `options`' provider and TF32 setting: a session
/// for each of [`session_rows`]`(max_batch)`, opened side by side and each run once on its
/// shape before the server takes work, so that what ONNX Runtime plans for it (cuDNN's measured
/// convolution algorithms) is paid at start, not by the first batches.
#[cfg(feature = "cuda")]
pub(in crate::serve) fn load_on_cuda(
    file: &OnnxFile,
    options: &ModelOptions,
    gpu: &std::sync::Arc<tensorport_cuda::Gpu>,
) -> Result<(Box<dyn Engine>, OnnxModelInfo)> {
    let provider = options.ort_provider.on(gpu.ordinal() as u32);
    let opts = OnnxOptions {
        provider,
        threads: None,
        image_size: Some(options.config.image_size),
        tf32: options.tf32,
        ..OnnxOptions::default()
    };
    let rows = session_rows(options.max_batch);
    let t0 = std::time::Instant::now();
    let opened: Vec<tensorport_onnx::Result<OnnxModel>> = std::thread::scope(|s| {
        let each: Vec<_> = rows
            .iter()
            .map(|&n| {
                let opts = &opts;
                s.spawn(move || {
                    let mut m = file.open(opts)?;
                    m.warm_up(n)?;
                    Ok(m)
                })
            })
            .collect();
        each.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(tensorport_onnx::Error::Run(
                        "opening a session panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let mut sessions = Vec::with_capacity(rows.len());
    for (&n, m) in rows.iter().zip(opened) {
        sessions.push((n, m.map_err(ConfigError::from)?));
    }
    let how = format!(
        "ONNX model loaded (ONNX Runtime's {} provider{}, sessions for batches of {rows:?} \
         opened and planned in {:.1} s; the batch stays on the GPU)",
        provider.name(),
        if options.tf32 { ", TF32" } else { "" },
        t0.elapsed().as_secs_f64()
    );
    let first = &sessions[0].1;
    let info = OnnxModelInfo::of(first, options)?;
    log_loaded(first, &how);
    let half = first.spec().input_elem == tensorport_onnx::Elem::F16;
    let image_len = first.image_len();
    let stage = tensorport_cuda::BatchStage::new(gpu, half)?;
    let sessions = sessions
        .into_iter()
        .map(|(n, m)| {
            let runner = Runner::start(m, Some(gpu.clone())).map_err(session_thread)?;
            Ok((n, runner, Vec::new()))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((
        Box::new(OnCuda {
            gpu: gpu.clone(),
            sessions,
            busy: std::collections::VecDeque::new(),
            stage,
            half,
            image_len,
        }),
        info,
    ))
}

#[cfg(test)]
mod tests {
    use super::session_rows;

    #[test]
    fn a_gpu_worker_has_a_session_per_batch_shape() {
        assert_eq!(session_rows(128), [32, 128]);
        assert_eq!(session_rows(33), [32, 33]);
        assert_eq!(session_rows(32), [32]);
        assert_eq!(session_rows(8), [8]);
        assert_eq!(session_rows(0), [1]);
    }
}
