//! An ONNX model as the server's model: each worker opens its own ONNX Runtime session, run on
//! a thread of its own so that the worker gathers the next batch while ONNX Runtime runs this
//! one ([`Submitted::InFlight`]); each batch goes to that thread and comes back with its
//! scores. The batch the server stacked (`[B, 3, S, S]`, normalised
//! `f32`) is run as it is: on the CPU from host memory; on a GPU where the server gathered it,
//! staged on the device into a buffer of a padded row count (converted to `f16` there for an
//! `f16` model), only the scores coming back to the host.

use std::path::Path;
use std::sync::mpsc;

use tensorport_dfdx::dfdx::prelude::{Cpu, HasShape};
use tensorport_dfdx::{Classify, Submitted, Tensor4};
use tensorport_onnx::{OnnxModel, OnnxOptions, Provider};

use super::Model;
use crate::error::{ConfigError, Result};

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
    /// Staged into a buffer of a session's row count (and type).
    Staged(tensorport_cuda::Staged),
    /// The gathered batch itself: of a session's row count, in the model's type.
    InPlace(tensorport_dfdx::GpuTensor),
}

#[cfg(feature = "cuda")]
impl OnDevice {
    fn memory(&self) -> &dyn tensorport_cuda::DeviceMemory {
        match self {
            OnDevice::Staged(s) => s,
            OnDevice::InPlace(t) => t,
        }
    }

    fn rows(&self) -> usize {
        match self {
            OnDevice::Staged(s) => s.rows(),
            OnDevice::InPlace(t) => t.rows(),
        }
    }
}

type Scores = tensorport_onnx::Result<Vec<Vec<f32>>>;

/// The session on its thread, and the batch it runs, if any.
struct Runner {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<(Scores, Job)>,
    thread: Option<std::thread::JoinHandle<()>>,
    in_flight: bool,
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

    /// Starts `job` (collecting, and dropping, the scores of a batch still in flight first).
    fn submit(&mut self, job: Job) -> tensorport_dfdx::Result<Submitted> {
        if self.in_flight {
            let _ = self.collect();
        }
        let gone = || tensorport_dfdx::Error::Device("the ONNX session's thread ended".into());
        self.jobs
            .as_ref()
            .ok_or_else(gone)?
            .send(job)
            .map_err(|_| gone())?;
        self.in_flight = true;
        Ok(Submitted::InFlight)
    }

    /// The scores of the batch in flight (none when there is none), and the batch.
    fn collect(&mut self) -> (tensorport_dfdx::Result<Vec<Vec<f32>>>, Option<Job>) {
        if !std::mem::replace(&mut self.in_flight, false) {
            return (Ok(Vec::new()), None);
        }
        match self.done.recv() {
            Ok((r, job)) => (
                r.map_err(|e| tensorport_dfdx::Error::Device(e.to_string())),
                Some(job),
            ),
            Err(_) => (
                Err(tensorport_dfdx::Error::Device(
                    "the ONNX session's thread ended".into(),
                )),
                None,
            ),
        }
    }

    /// Runs `job` and waits for its scores.
    fn run(&mut self, job: Job) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        self.submit(job)?;
        self.collect().0
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        // The session's thread ends with its queue; a batch it runs is waited for, so no
        // staging buffer goes while ONNX Runtime reads it.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An ONNX model on ONNX Runtime's CPU execution provider.
struct OnCpu(Runner);

impl Classify<Cpu> for OnCpu {
    fn classify(&mut self, x: Tensor4<Cpu>) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        let rows = x.shape().0;
        self.0.run(Job::Host(x.as_vec(), rows))
    }

    fn submit(&mut self, x: Tensor4<Cpu>) -> tensorport_dfdx::Result<Submitted> {
        let rows = x.shape().0;
        self.0.submit(Job::Host(x.as_vec(), rows))
    }

    fn collect(&mut self) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        self.0.collect().0
    }
}

/// Opens the model at `path` for a worker on the CPU (`threads`: its operators' threads).
pub(super) fn load_on_cpu(
    path: &Path,
    image_size: usize,
    threads: Option<usize>,
) -> Result<Model<Cpu>> {
    let opts = OnnxOptions {
        provider: Provider::Cpu,
        threads,
        image_size: Some(image_size),
        ..OnnxOptions::default()
    };
    let model = OnnxModel::open(path, &opts).map_err(ConfigError::from)?;
    log_loaded(&model, "ONNX model loaded (ONNX Runtime, CPU)");
    Ok(Box::new(OnCpu(
        Runner::start(model, None).map_err(session_thread)?,
    )))
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

/// An ONNX model on a GPU (CUDA or TensorRT execution provider), fed the gathered batch on the
/// device: a session per batch shape ([`session_rows`]); a batch of exactly a session's rows in
/// the model's type runs where it lies (its storage goes to the session's thread); otherwise it
/// is staged into a buffer of that many rows, and converted to `f16` there for an `f16` model.
#[cfg(feature = "cuda")]
struct OnCuda {
    /// Each session's rows and its runner, smallest first.
    sessions: Vec<(usize, Runner)>,
    /// The session with a batch in flight.
    busy: Option<usize>,
    stage: tensorport_cuda::BatchStage,
    half: bool,
    image_len: usize,
}

#[cfg(feature = "cuda")]
impl OnCuda {
    /// Stages `x` (after collecting a batch still in flight, whose staging buffer comes back
    /// with it) and starts it in the session of its shape.
    fn start(
        &mut self,
        x: Tensor4<tensorport_dfdx::dfdx::prelude::Cuda>,
    ) -> tensorport_dfdx::Result<Submitted> {
        if self.busy.is_some() {
            let _ = self.collect();
        }
        let rows = x.shape().0;
        let Some(k) = self.sessions.iter().position(|(n, _)| *n >= rows) else {
            let max = self.sessions.last().map_or(0, |(n, _)| *n);
            return Err(tensorport_dfdx::Error::Device(format!(
                "a batch of {rows} images; this worker's largest batch is {max}"
            )));
        };
        let padded = self.sessions[k].0;
        let x = tensorport_dfdx::GpuTensor::new(x)?;
        let input = match padded == rows && !self.half {
            // A batch of the session's shape, in the model's type: run where it lies.
            true => OnDevice::InPlace(x),
            false => OnDevice::Staged(
                self.stage
                    .stage(&x, rows, padded, self.image_len)
                    .map_err(|e| tensorport_dfdx::Error::Device(e.to_string()))?,
            ),
        };
        let submitted = self.sessions[k]
            .1
            .submit(Job::Device { input, keep: rows })?;
        self.busy = Some(k);
        Ok(submitted)
    }

    /// The scores of the batch in flight; its staging buffer goes back to the stage.
    fn collect(&mut self) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        let Some(k) = self.busy.take() else {
            return Ok(Vec::new());
        };
        let (scores, job) = self.sessions[k].1.collect();
        if let Some(Job::Device {
            input: OnDevice::Staged(staged),
            ..
        }) = job
        {
            self.stage.give_back(staged);
        }
        scores
    }
}

#[cfg(feature = "cuda")]
impl Classify<tensorport_dfdx::dfdx::prelude::Cuda> for OnCuda {
    fn classify(
        &mut self,
        x: Tensor4<tensorport_dfdx::dfdx::prelude::Cuda>,
    ) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        self.start(x)?;
        OnCuda::collect(self)
    }

    fn submit(
        &mut self,
        x: Tensor4<tensorport_dfdx::dfdx::prelude::Cuda>,
    ) -> tensorport_dfdx::Result<Submitted> {
        self.start(x)
    }

    fn collect(&mut self) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        OnCuda::collect(self)
    }
}

/// Opens the model at `path` for a worker on GPU `gpu` with `provider` (`tf32`: an f32
/// model's arithmetic): a session for each of [`session_rows`]`(max_batch)`, opened side by side
/// and each run once on its shape before the server takes work, so that what ONNX Runtime plans
/// for it (cuDNN's measured convolution algorithms) is paid at start, not by the first batches.
#[cfg(feature = "cuda")]
pub(super) fn load_on_cuda(
    path: &Path,
    image_size: usize,
    max_batch: usize,
    gpu: &std::sync::Arc<tensorport_cuda::Gpu>,
    (provider, tf32): (Provider, bool),
) -> Result<Model<tensorport_dfdx::dfdx::prelude::Cuda>> {
    let opts = OnnxOptions {
        provider,
        threads: None,
        image_size: Some(image_size),
        tf32,
    };
    let rows = session_rows(max_batch);
    let t0 = std::time::Instant::now();
    // The model's files read once for all its sessions.
    let read = tensorport_onnx::external::read_model(path).map_err(ConfigError::from)?;
    let read = &read;
    let opened: Vec<tensorport_onnx::Result<OnnxModel>> = std::thread::scope(|s| {
        let each: Vec<_> = rows
            .iter()
            .map(|&n| {
                s.spawn(move || {
                    let mut m = OnnxModel::from_read(path, read, &opts)?;
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
        if tf32 { ", TF32" } else { "" },
        t0.elapsed().as_secs_f64()
    );
    log_loaded(&sessions[0].1, &how);
    let first = &sessions[0].1;
    let half = first.spec().input_elem == tensorport_onnx::Elem::F16;
    let image_len = first.image_len();
    let stage = tensorport_cuda::BatchStage::new(gpu, half)?;
    let sessions = sessions
        .into_iter()
        .map(|(n, m)| {
            Ok((
                n,
                Runner::start(m, Some(gpu.clone())).map_err(session_thread)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Box::new(OnCuda {
        sessions,
        busy: None,
        stage,
        half,
        image_len,
    }))
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
