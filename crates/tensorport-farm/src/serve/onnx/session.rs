//! An ONNX model's session on a thread of its own, shared by the CPU and GPU engines: the model's
//! files read once ([`OnnxFile`]), the batches sent to the session's thread and back with their
//! scores ([`Runner`]), and what a loaded model decides of the server's configuration.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tensorport_onnx::{OnnxModel, OnnxOptions};

use crate::config::ModelOptions;
use crate::error::{ConfigError, Result};
use crate::serve::engine::{EngineError, RunTimes, Scores, Submitted};

/// A model's files, read once for every session a server opens.
pub(in crate::serve) struct OnnxFile {
    path: PathBuf,
    read: tensorport_onnx::external::ModelBytes,
}

impl OnnxFile {
    /// Reads the model at `path` and the external data it names, once ONNX Runtime is found.
    pub(in crate::serve) fn read(path: &Path) -> Result<OnnxFile> {
        // Without ONNX Runtime nothing of the file matters: that is said first.
        tensorport_onnx::runtime::environment().map_err(ConfigError::from)?;
        let read = tensorport_onnx::external::read_model(path).map_err(ConfigError::from)?;
        Ok(OnnxFile {
            path: path.to_owned(),
            read,
        })
    }

    /// A session with `opts`.
    pub(super) fn open(&self, opts: &OnnxOptions) -> tensorport_onnx::Result<OnnxModel> {
        OnnxModel::from_read(&self.path, &self.read, opts)
    }
}

/// A batch for the session's thread, which sends it back with its scores.
pub(super) enum Job {
    /// `rows` images in host memory.
    Host(Vec<f32>, usize),
    /// Images on the model's GPU, of which the first `keep` are wanted.
    #[cfg(feature = "cuda")]
    Device { input: OnDevice, keep: usize },
}

/// A GPU batch as ONNX Runtime reads it.
#[cfg(feature = "cuda")]
pub(super) enum OnDevice {
    /// Converted into a buffer of a session's row count in the model's type (`f16`).
    Staged(tensorport_cuda::Staged),
    /// The lent buffer itself: a session's row count, `f32`.
    InPlace(tensorport_cuda::DeviceBuffer, usize),
}

#[cfg(feature = "cuda")]
impl OnDevice {
    pub(super) fn memory(&self) -> &dyn tensorport_cuda::DeviceMemory {
        match self {
            OnDevice::Staged(s) => s,
            OnDevice::InPlace(b, _) => b,
        }
    }

    pub(super) fn rows(&self) -> usize {
        match self {
            OnDevice::Staged(s) => s.rows(),
            OnDevice::InPlace(_, rows) => *rows,
        }
    }
}

pub(super) type Ran = tensorport_onnx::Result<Scores>;

/// A batch back from the session's thread: its scores, the job (its memory, to reuse), and how
/// long ONNX Runtime took to run it.
type Done = (Ran, Job, Duration);

/// The session on its thread, and the batches sent to it and not yet collected (run in order).
pub(super) struct Runner {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Done>,
    thread: Option<std::thread::JoinHandle<()>>,
    in_flight: usize,
    /// The runs collected so far.
    runs: RunTimes,
}

impl Runner {
    /// The session's thread for `model`, whose device batches are memory of `gpu`.
    pub(super) fn start(
        mut model: OnnxModel,
        gpu: Option<std::sync::Arc<tensorport_cuda::Gpu>>,
    ) -> std::io::Result<Runner> {
        let (jobs, todo) = mpsc::channel::<Job>();
        let (done, finished) = mpsc::channel::<Done>();
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
                    let t0 = Instant::now();
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
                    if done.send((r, job, t0.elapsed())).is_err() {
                        break;
                    }
                }
                drop(gpu);
            })?;
        Ok(Runner {
            jobs: Some(jobs),
            done: finished,
            thread: Some(thread),
            in_flight: 0,
            runs: RunTimes::default(),
        })
    }

    /// Sends `job` to the session's thread, which runs it after those sent before it.
    pub(super) fn submit(&mut self, job: Job) -> std::result::Result<Submitted, EngineError> {
        let gone = || EngineError::failed("the ONNX session's thread ended");
        let sent = match self.jobs.as_ref() {
            Some(jobs) => jobs.send(job).map_err(|_| gone()),
            None => Err(gone()),
        };
        if sent.is_ok() {
            self.in_flight += 1;
        }
        sent.map(|()| Submitted::InFlight)
    }

    /// The scores of the oldest batch in flight (none when there is none), and the batch.
    pub(super) fn collect(&mut self) -> (std::result::Result<Scores, EngineError>, Option<Job>) {
        if self.in_flight == 0 {
            return (Ok(Vec::new()), None);
        }
        self.in_flight -= 1;
        match self.done.recv() {
            Ok((r, job, took)) => {
                if r.is_ok() {
                    self.runs.record(took);
                }
                (r.map_err(EngineError::failed), Some(job))
            }
            Err(_) => (
                Err(EngineError::failed("the ONNX session's thread ended")),
                None,
            ),
        }
    }

    /// Batches sent and not collected.
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// What its runs took, those collected so far.
    pub(super) fn runs(&self) -> RunTimes {
        self.runs
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

/// What a loaded model decides of the server's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::serve) struct OnnxModelInfo {
    pub input: String,
    pub image_size: usize,
    pub classes: usize,
}

impl OnnxModelInfo {
    /// What `m` decides, refused where the server cannot take it ([`ModelOptions::adopt_onnx`]).
    pub(super) fn of(m: &OnnxModel, options: &ModelOptions) -> Result<OnnxModelInfo> {
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
pub(super) fn log_loaded(model: &OnnxModel, how: &str) {
    tracing::info!(
        model = %model.path().display(),
        input = %model.spec().input,
        dtype = model.spec().input_elem.name(),
        image_size = model.image_size(),
        classes = model.spec().classes,
        "{how}"
    );
}

pub(super) fn session_thread(e: std::io::Error) -> crate::error::Error {
    crate::error::Error::Other(format!("cannot start the ONNX session's thread: {e}"))
}
