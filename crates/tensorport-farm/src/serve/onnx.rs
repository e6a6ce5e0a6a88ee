//! An ONNX model as the server's [`Engine`]: each worker opens its own ONNX Runtime session(s),
//! run on a thread of their own so that the worker gathers the next batch while ONNX Runtime
//! runs this one ([`Submitted::InFlight`]). The engine lends the batch's input memory: on the
//! CPU host rows (the same allocation for every batch, handed to the session's thread and
//! back: no copy besides the batcher's); on a GPU a buffer of a session's row count, which the
//! GPU batcher fills in place and ONNX Runtime reads where it lies (converted to `f16` on the
//! device first for an `f16` model), only the scores coming back to the host. The model's files
//! are read once per server ([`OnnxFile`]); every session is made from those bytes.

use std::path::{Path, PathBuf};
use std::sync::mpsc;

use tensorport_onnx::{OnnxModel, OnnxOptions, Provider};

use super::engine::{Engine, EngineError, HostInput, Input, Scores, Submitted};
use crate::config::ModelOptions;
use crate::error::{ConfigError, Result};

/// A model's files, read once for every session a server opens.
pub(super) struct OnnxFile {
    path: PathBuf,
    read: tensorport_onnx::external::ModelBytes,
}

impl OnnxFile {
    /// Reads the model at `path` and the external data it names, once ONNX Runtime is found.
    pub(super) fn read(path: &Path) -> Result<OnnxFile> {
        // Without ONNX Runtime nothing of the file matters: that is said first.
        tensorport_onnx::runtime::environment().map_err(ConfigError::from)?;
        let read = tensorport_onnx::external::read_model(path).map_err(ConfigError::from)?;
        Ok(OnnxFile {
            path: path.to_owned(),
            read,
        })
    }

    /// A session with `opts`.
    fn open(&self, opts: &OnnxOptions) -> tensorport_onnx::Result<OnnxModel> {
        OnnxModel::from_read(&self.path, &self.read, opts)
    }
}

/// A batch for the session's thread, which sends it back with its scores.
enum Job {
    /// `rows` images in host memory.
    Host(Vec<f32>, usize),
    /// Images on the model's GPU, of which the first `keep` are wanted.
    #[cfg(feature = "cuda")]
    Device { input: OnDevice, keep: usize },
}

/// A GPU batch as ONNX Runtime reads it.
#[cfg(feature = "cuda")]
enum OnDevice {
    /// Converted into a buffer of a session's row count in the model's type (`f16`).
    Staged(tensorport_cuda::Staged),
    /// The lent buffer itself: a session's row count, `f32`.
    InPlace(tensorport_cuda::DeviceBuffer, usize),
}

#[cfg(feature = "cuda")]
impl OnDevice {
    fn memory(&self) -> &dyn tensorport_cuda::DeviceMemory {
        match self {
            OnDevice::Staged(s) => s,
            OnDevice::InPlace(b, _) => b,
        }
    }

    fn rows(&self) -> usize {
        match self {
            OnDevice::Staged(s) => s.rows(),
            OnDevice::InPlace(_, rows) => *rows,
        }
    }
}

type Ran = tensorport_onnx::Result<Scores>;

/// The session on its thread, and the batch it runs, if any.
struct Runner {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<(Ran, Job)>,
    thread: Option<std::thread::JoinHandle<()>>,
    in_flight: bool,
}

fn failed(e: impl std::fmt::Display) -> EngineError {
    EngineError::Failed(e.to_string())
}

impl Runner {
    /// The session's thread for `model`, whose device batches are memory of `gpu`.
    fn start(
        mut model: OnnxModel,
        gpu: Option<std::sync::Arc<tensorport_cuda::Gpu>>,
    ) -> std::io::Result<Runner> {
        let (jobs, todo) = mpsc::channel::<Job>();
        let (done, finished) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("onnx-session".into())
            .spawn(move || {
                for job in todo {
                    // The model was read into memory at start: a file changed since is named
                    // (a `stat` of each of its files per batch), and the model runs on as read.
                    for what in model.changed_files() {
                        tracing::warn!(
                            "the model's file changed under the running server ({what}); it \
                             runs the model as read at start: restart it to serve the new one"
                        );
                    }
                    let r = match &job {
                        Job::Host(batch, rows) => model.run(batch, *rows),
                        #[cfg(feature = "cuda")]
                        Job::Device { input, keep } => match &gpu {
                            Some(gpu) => model
                                .run_on_device(gpu, input.memory(), input.rows())
                                .map(|mut s| {
                                    s.truncate(*keep);
                                    s
                                }),
                            None => Err(tensorport_onnx::Error::Run(
                                "a device batch for a session on the CPU".into(),
                            )),
                        },
                    };
                    if done.send((r, job)).is_err() {
                        break;
                    }
                }
                drop(gpu);
            })?;
        Ok(Runner {
            jobs: Some(jobs),
            done: finished,
            thread: Some(thread),
            in_flight: false,
        })
    }

    /// Starts `job` (collecting, and dropping, the scores of a batch still in flight first:
    /// its job comes back too).
    fn submit(&mut self, job: Job) -> (std::result::Result<Submitted, EngineError>, Option<Job>) {
        let earlier = match self.in_flight {
            true => self.collect().1,
            false => None,
        };
        let gone = || failed("the ONNX session's thread ended");
        let sent = match self.jobs.as_ref() {
            Some(jobs) => jobs.send(job).map_err(|_| gone()),
            None => Err(gone()),
        };
        self.in_flight = sent.is_ok();
        (sent.map(|()| Submitted::InFlight), earlier)
    }

    /// The scores of the batch in flight (none when there is none), and the batch.
    fn collect(&mut self) -> (std::result::Result<Scores, EngineError>, Option<Job>) {
        if !std::mem::replace(&mut self.in_flight, false) {
            return (Ok(Vec::new()), None);
        }
        match self.done.recv() {
            Ok((r, job)) => (r.map_err(failed), Some(job)),
            Err(_) => (Err(failed("the ONNX session's thread ended")), None),
        }
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        // The session's thread ends with its queue; a batch it runs is waited for, so no
        // buffer goes while ONNX Runtime reads it.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

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
            return Err(failed("a batch with rows left unwritten"));
        }
        let rows = h.rows();
        let (r, earlier) = self.runner.submit(Job::Host(h.into_pixels(), rows));
        self.take_back(earlier);
        r
    }

    fn collect(&mut self) -> std::result::Result<Scores, EngineError> {
        let (r, job) = self.runner.collect();
        self.take_back(job);
        r
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

/// What a loaded model decides of the server's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct OnnxModelInfo {
    pub input: String,
    pub image_size: usize,
    pub classes: usize,
}

impl OnnxModelInfo {
    /// What `m` decides, refused where the server cannot take it ([`ModelOptions::adopt_onnx`]).
    fn of(m: &OnnxModel, options: &ModelOptions) -> Result<OnnxModelInfo> {
        let info = OnnxModelInfo {
            input: m.spec().input.clone(),
            image_size: m.image_size(),
            classes: m.spec().classes,
        };
        options
            .clone()
            .adopt_onnx(&info.input, info.image_size, info.classes)?;
        Ok(info)
    }
}

/// Says which model a worker runs, and how.
fn log_loaded(model: &OnnxModel, how: &str) {
    tracing::info!(
        model = %model.path().display(),
        input = %model.spec().input,
        dtype = model.spec().input_elem.name(),
        image_size = model.image_size(),
        classes = model.spec().classes,
        "{how}"
    );
}

fn session_thread(e: std::io::Error) -> crate::error::Error {
    crate::error::Error::Other(format!("cannot start the ONNX session's thread: {e}"))
}

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
    /// The session with a batch in flight.
    busy: Option<usize>,
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
                failed(format!(
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
            None => self.fresh(padded).map_err(failed)?,
        };
        Ok(Input::Device(super::engine::DeviceInput {
            rows,
            memory: super::engine::DeviceRows::Buffer(buf),
        }))
    }

    fn submit(&mut self, input: Input) -> std::result::Result<Submitted, EngineError> {
        use super::engine::{DeviceInput, DeviceRows};
        if self.busy.is_some() {
            let _ = Engine::collect(self);
        }
        let Input::Device(DeviceInput {
            rows,
            memory: DeviceRows::Buffer(buf),
        }) = input
        else {
            return Err(failed("a batch not lent by this engine"));
        };
        let k = self.session_for(rows)?;
        let padded = self.sessions[k].0;
        if buf.len() < padded * self.image_len * 4 {
            return Err(failed("a batch in a buffer smaller than its session's"));
        }
        let input = match self.half {
            false => OnDevice::InPlace(buf, padded),
            true => {
                let staged = self.stage.stage(&buf, rows, padded, self.image_len);
                // Staged (and waited for): the lent buffer is free again.
                self.sessions[k].2.push(buf);
                OnDevice::Staged(staged.map_err(failed)?)
            }
        };
        let (r, earlier) = self.sessions[k].1.submit(Job::Device { input, keep: rows });
        debug_assert!(earlier.is_none(), "collected above");
        if r.is_ok() {
            self.busy = Some(k);
        }
        r
    }

    fn collect(&mut self) -> std::result::Result<Scores, EngineError> {
        let Some(k) = self.busy.take() else {
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
pub(super) fn load_on_cuda(
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
            busy: None,
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
