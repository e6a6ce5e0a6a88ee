//! The server's model interface, shaped like ONNX Runtime's I/O binding: an [`Engine`] lends the
//! memory a batch's input goes into ([`Engine::lend`]: host rows, or a region of its GPU), the
//! batcher writes each image into its row in place, and the engine runs the filled batch
//! ([`Engine::submit`]), answering one row of scores per image, at once or later
//! ([`Engine::collect`]). The engines are adapters beside this: the bundled network on dfdx
//! (the CPU) or cuDNN (a GPU), ONNX Runtime, a model of the caller's own, and none (the batch is
//! only moved).

use std::time::Duration;

use tensorport_vision::request::Pixels;

pub use super::pace::RunTimes;

/// Scores, one row per image of the batch.
pub type Scores = Vec<Vec<f32>>;

/// What went wrong in an engine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The engine the server owns failed (its device, its runtime): where the error says the
    /// CUDA context is lost, the server ends and its farm starts another.
    #[error("{0}")]
    Failed(String),
    /// A model of the caller's own failed on a batch (or panicked): that batch's requests get
    /// the error, and the server goes on.
    #[error("the model failed: {0}")]
    Model(String),
}

impl EngineError {
    /// The engine's own failure, described by `e`.
    pub(super) fn failed(e: impl std::fmt::Display) -> EngineError {
        EngineError::Failed(e.to_string())
    }
}

/// What [`Engine::submit`] did with a batch.
#[derive(Debug)]
pub enum Submitted {
    /// Its scores, one row per image.
    Ready(Scores),
    /// It runs; [`Engine::collect`] waits for its scores.
    InFlight,
}

/// A model the server runs: it lends each batch's input memory and runs the batch written
/// into it. One per model worker, used from that worker's thread only.
pub trait Engine {
    /// The largest batch it runs.
    fn max_batch(&self) -> usize;

    /// Memory for the input of a batch of `rows` images (`1..=max_batch`) of the server's
    /// image shape, for the batcher to fill: host rows on the CPU, device memory on a GPU.
    fn lend(&mut self, rows: usize) -> Result<Input, EngineError>;

    /// Starts on the filled batch `input` (lent by this engine) and, where the engine runs on a
    /// device or thread of its own, returns before its scores are ready
    /// ([`Submitted::InFlight`]), so that the next batch is gathered meanwhile. With
    /// [`Engine::depth`] batches in flight already, the oldest is collected (its scores
    /// dropped) first.
    fn submit(&mut self, input: Input) -> Result<Submitted, EngineError>;

    /// The scores of the oldest batch in flight (none when there is none).
    fn collect(&mut self) -> Result<Scores, EngineError> {
        Ok(Vec::new())
    }

    /// How many batches it holds in flight at once: with 2, a batch submitted while another
    /// runs waits for it and starts as it ends, so the device does not wait for the worker.
    fn depth(&self) -> usize {
        1
    }

    /// How long a batch of `rows` takes it to run, as measured on its recent batches where it
    /// runs them (`None` until measured, or where it does not say): the worker takes requests
    /// for its next batch until the running one is about to end ([`super::pace::Pace`]).
    fn run_time(&self, rows: usize) -> Option<Duration> {
        let _ = rows;
        None
    }

    /// Its runs so far and the time they took, where it measures them.
    fn runs(&self) -> Option<RunTimes> {
        None
    }
}

/// A batch's input, lent by its engine.
#[derive(Debug)]
pub enum Input {
    /// Rows in host memory.
    Host(HostInput),
    /// Rows in GPU memory.
    #[cfg(feature = "cuda")]
    Device(DeviceInput),
}

impl Input {
    /// Its host rows; `what` names the engine in the error for GPU memory.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub fn into_host(self, what: &str) -> Result<HostInput, EngineError> {
        match self {
            Input::Host(h) => Ok(h),
            #[cfg(feature = "cuda")]
            Input::Device(_) => Err(EngineError::Failed(format!(
                "GPU memory for {what}, which takes host rows"
            ))),
        }
    }

    /// The images it holds (or is lent for).
    pub fn rows(&self) -> usize {
        match self {
            Input::Host(h) => h.rows,
            #[cfg(feature = "cuda")]
            Input::Device(d) => d.rows,
        }
    }
}

/// Host rows: `rows` images of `[C, H, W]` normalised `f32`, one after another, written by
/// [`HostInput::push`].
#[derive(Debug)]
pub struct HostInput {
    pixels: Vec<f32>,
    rows: usize,
    shape: [usize; 3],
}

impl HostInput {
    /// Rows for `rows` images of `shape`, in `buffer`'s allocation (an engine's, reused from an
    /// earlier batch; its contents are dropped).
    pub fn new(mut buffer: Vec<f32>, rows: usize, shape: [usize; 3]) -> HostInput {
        buffer.clear();
        buffer.reserve(rows * shape.iter().product::<usize>());
        HostInput {
            pixels: buffer,
            rows,
            shape,
        }
    }

    /// Writes the next image (normalising 8-bit planes); refused once every row is written or
    /// when the image is not one row's size.
    pub fn push(&mut self, px: Pixels<'_>) -> Result<(), EngineError> {
        let per = self.image_len();
        let len = match px {
            Pixels::F32(p) => p.len(),
            Pixels::U8(p) => p.len(),
        };
        if len != per || self.pixels.len() + per > self.rows * per {
            return Err(EngineError::Failed(format!(
                "an image of {len} values for rows of {per}, {} of {} written",
                self.pixels.len() / per.max(1),
                self.rows
            )));
        }
        px.extend_normalised(&mut self.pixels);
        Ok(())
    }

    /// Whether every row is written.
    pub fn is_full(&self) -> bool {
        self.pixels.len() == self.rows * self.image_len()
    }

    /// The images.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// One image's shape `[C, H, W]`.
    pub fn shape(&self) -> [usize; 3] {
        self.shape
    }

    /// The values written, row by row.
    pub fn pixels(&self) -> &[f32] {
        &self.pixels
    }

    /// The values, to run on (the engine's allocation back, for its next batch).
    pub fn into_pixels(self) -> Vec<f32> {
        self.pixels
    }

    fn image_len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// GPU rows: `rows` images of `[C, H, W]` normalised `f32` in memory the engine lent, which the
/// GPU batcher writes (`tensorport_cuda::RowBatcher::gather`) and the engine reads in place.
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct DeviceInput {
    /// The images the batch holds (the memory may hold more rows: an engine's padding).
    pub rows: usize,
    /// The memory.
    pub memory: DeviceRows,
}

/// GPU memory an engine lends.
#[cfg(feature = "cuda")]
pub enum DeviceRows {
    /// A dfdx tensor the bundled network runs on (cuDNN, or dfdx's own kernels).
    Tensor(tensorport_dfdx::GpuInput),
    /// A buffer an engine keeps between batches (ONNX Runtime's sessions; no model).
    Buffer(tensorport_cuda::DeviceBuffer),
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for DeviceRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceRows::Tensor(_) => f.write_str("DeviceRows::Tensor"),
            DeviceRows::Buffer(b) => write!(f, "DeviceRows::Buffer({} bytes)", b.len()),
        }
    }
}

/// Checks that `scores` has a row per image of a batch of `rows`.
pub(super) fn check_rows(scores: Scores, rows: usize) -> Result<Scores, EngineError> {
    match scores.len() == rows {
        true => Ok(scores),
        false => Err(EngineError::Failed(format!(
            "the engine answered {} rows for a batch of {rows}",
            scores.len()
        ))),
    }
}

/// No model: each batch is written into the engine's memory (the host rows, or the GPU, as a
/// model's would be: a transport benchmark, like PyTorch's DataLoader one) and answered with
/// empty scores.
pub(super) struct NoModel {
    pub(super) shape: [usize; 3],
    /// The largest batch the server takes.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) max_batch: usize,
    /// Host rows kept between batches.
    pub(super) host: Vec<f32>,
    /// On a GPU: its buffer, kept between batches (grown to the largest batch).
    #[cfg(feature = "cuda")]
    pub(super) gpu: Option<(
        std::sync::Arc<tensorport_cuda::Gpu>,
        Option<tensorport_cuda::DeviceBuffer>,
    )>,
}

impl NoModel {
    /// On the CPU.
    pub(super) fn on_cpu(shape: [usize; 3]) -> NoModel {
        NoModel {
            shape,
            max_batch: 1,
            host: Vec::new(),
            #[cfg(feature = "cuda")]
            gpu: None,
        }
    }
}

#[cfg(feature = "cuda")]
impl NoModel {
    /// On `gpu`.
    pub(super) fn on_gpu(
        shape: [usize; 3],
        max_batch: usize,
        gpu: &std::sync::Arc<tensorport_cuda::Gpu>,
    ) -> NoModel {
        NoModel {
            shape,
            max_batch,
            host: Vec::new(),
            gpu: Some((gpu.clone(), None)),
        }
    }
}

impl Engine for NoModel {
    fn max_batch(&self) -> usize {
        usize::MAX
    }

    fn lend(&mut self, rows: usize) -> Result<Input, EngineError> {
        #[cfg(feature = "cuda")]
        if let Some((gpu, kept)) = &mut self.gpu {
            let row = self.shape.iter().product::<usize>() * 4;
            let buf = match kept.take().filter(|b| b.len() >= rows * row) {
                Some(b) => b,
                // Grown in powers of two up to the largest batch: a freed buffer synchronises
                // the GPU, so not at every larger batch; nor sized for a largest batch that
                // may never come.
                None => {
                    let room = rows.next_power_of_two().min(self.max_batch).max(rows);
                    tensorport_cuda::DeviceBuffer::new(gpu, room * row)
                        .map_err(|e| EngineError::Failed(e.to_string()))?
                }
            };
            return Ok(Input::Device(DeviceInput {
                rows,
                memory: DeviceRows::Buffer(buf),
            }));
        }
        let buf = std::mem::take(&mut self.host);
        Ok(Input::Host(HostInput::new(buf, rows, self.shape)))
    }

    fn submit(&mut self, input: Input) -> Result<Submitted, EngineError> {
        let rows = input.rows();
        match input {
            Input::Host(h) => self.host = h.into_pixels(),
            #[cfg(feature = "cuda")]
            Input::Device(DeviceInput {
                memory: DeviceRows::Buffer(b),
                ..
            }) => {
                if let Some((_, kept)) = &mut self.gpu {
                    *kept = Some(b);
                }
            }
            #[cfg(feature = "cuda")]
            Input::Device(_) => {}
        }
        Ok(Submitted::Ready(vec![Vec::new(); rows]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_rows_take_exactly_their_images_and_normalise_bytes() {
        let shape = [3, 2, 2];
        let mut h = HostInput::new(vec![9.0; 40], 2, shape);
        assert!(
            h.pixels().is_empty(),
            "an earlier batch's values are dropped"
        );
        assert!(!h.is_full());
        h.push(Pixels::F32(&[1.0; 12])).unwrap();
        let planes = [0u8, 255, 128, 64, 0, 255, 128, 64, 0, 255, 128, 64];
        h.push(Pixels::U8(&planes)).unwrap();
        assert!(h.is_full());
        let e = h.push(Pixels::F32(&[1.0; 12])).unwrap_err();
        assert!(e.to_string().contains("2 of 2 written"), "{e}");
        let mut want = vec![0f32; 12];
        tensorport_vision::request::normaliser().normalise_planes(&planes, 4, &mut want);
        assert_eq!(&h.pixels()[12..], &want[..]);
        let mut short = HostInput::new(Vec::new(), 1, shape);
        assert!(short.push(Pixels::F32(&[0.0; 11])).is_err());
    }

    #[test]
    fn no_model_answers_an_empty_row_per_image_and_keeps_its_rows() {
        let mut m = NoModel::on_cpu([3, 1, 1]);
        let Ok(mut h) = m.lend(2).unwrap().into_host("a test") else {
            panic!("host rows on the CPU")
        };
        h.push(Pixels::F32(&[0.0; 3])).unwrap();
        h.push(Pixels::F32(&[1.0; 3])).unwrap();
        match m.submit(Input::Host(h)).unwrap() {
            Submitted::Ready(s) => assert_eq!(s, vec![Vec::<f32>::new(); 2]),
            Submitted::InFlight => panic!("no model answers at once"),
        }
        assert!(
            m.host.capacity() >= 6,
            "the rows come back for the next batch"
        );
        assert!(m.collect().unwrap().is_empty());
    }

    #[test]
    fn an_engine_must_answer_a_row_per_image() {
        assert!(check_rows(vec![vec![1.0]; 3], 3).is_ok());
        let e = check_rows(vec![vec![1.0]; 2], 3).unwrap_err();
        assert_eq!(e.to_string(), "the engine answered 2 rows for a batch of 3");
    }
}
