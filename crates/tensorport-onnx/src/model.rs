//! An ONNX model's session: opened once per server worker, checked against [`ModelSpec`], then
//! run on batches of normalised `f32` images (`[rows, 3, S, S]`, row after row), each image
//! answered with its `K` scores as `f32`. An `f16` model gets its input converted on the way
//! in and its scores on the way out; its arithmetic is its own.

use std::path::{Path, PathBuf};

use half::f16;
use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
use ort::session::builder::GraphOptimizationLevel;
use ort::session::{Session, SessionOutputs};
use ort::value::{Shape, TensorRef, TensorRefMut};

use crate::spec::{self, Elem, ModelSpec};
use crate::{Error, Result};

/// Where ONNX Runtime runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Provider {
    /// The CPU execution provider.
    #[default]
    Cpu,
    /// A GPU's execution provider, on the GPU of this ordinal.
    Gpu(GpuProvider, u32),
}

impl Provider {
    pub fn name(self) -> &'static str {
        match self {
            Provider::Cpu => "CPU",
            Provider::Gpu(p, _) => p.label(),
        }
    }
}

/// ONNX Runtime's execution provider for a model on a GPU (the server's `--ort-provider`). A
/// provider is added here alone: its variant, its names and its execution providers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum GpuProvider {
    /// The CUDA execution provider (cuDNN's convolutions).
    #[default]
    Cuda,
    /// The TensorRT execution provider (TensorRT's libraries must be present), with CUDA for
    /// what it does not take.
    Tensorrt,
}

impl GpuProvider {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            GpuProvider::Cuda => "cuda",
            GpuProvider::Tensorrt => "tensorrt",
        }
    }

    /// Its name in ONNX Runtime's words (errors, logs).
    fn label(self) -> &'static str {
        match self {
            GpuProvider::Cuda => "CUDA",
            GpuProvider::Tensorrt => "TensorRT",
        }
    }

    /// The provider on GPU `ordinal`.
    pub fn on(self, ordinal: u32) -> Provider {
        Provider::Gpu(self, ordinal)
    }

    /// ONNX Runtime's execution providers for it on GPU `gpu`, in order of preference; each
    /// fails the session if it cannot be set up.
    fn execution_providers(self, gpu: u32, tf32: bool) -> Vec<ort::ep::ExecutionProviderDispatch> {
        let cuda = cuda(gpu, tf32).build().error_on_failure();
        match self {
            GpuProvider::Cuda => vec![cuda],
            GpuProvider::Tensorrt => vec![tensorrt(gpu).build().error_on_failure(), cuda],
        }
    }
}

/// How to open a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OnnxOptions {
    pub provider: Provider,
    /// Threads for the CPU provider's operators [default: ONNX Runtime's, one per core].
    pub threads: Option<usize>,
    /// The side of the images, where the graph leaves it dynamic.
    pub image_size: Option<usize>,
    /// On a GPU, an f32 model's convolutions and matrix products on TF32 tensor cores (ONNX
    /// Runtime's and PyTorch's default for convolutions); off for results as exact as the CPU's.
    pub tf32: bool,
    /// ONNX Runtime's graph optimisations, every level; off for a session opened only to check
    /// the model and read its interface, which then opens in a fraction of the time (the graph
    /// is still loaded and its operators' kernels found).
    pub optimize: bool,
}

impl Default for OnnxOptions {
    /// The CPU, ONNX Runtime's threads, the graph's image size, TF32 on a GPU, the graph
    /// optimised.
    fn default() -> OnnxOptions {
        OnnxOptions {
            provider: Provider::Cpu,
            threads: None,
            image_size: None,
            tf32: true,
            optimize: true,
        }
    }
}

/// A model ready to run batches.
pub struct OnnxModel {
    session: Session,
    spec: ModelSpec,
    provider: Provider,
    /// The side of the images it takes (the graph's, or the options' where it is dynamic).
    image_size: usize,
    path: PathBuf,
    /// The files it was read from, as they were then; `true` once a change is reported.
    files: Vec<(crate::external::Stamp, bool)>,
    /// An f16 model's input, converted (kept between batches).
    staging: Vec<f16>,
}

impl std::fmt::Debug for OnnxModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnnxModel")
            .field("path", &self.path)
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl OnnxModel {
    /// Loads ONNX Runtime if need be, opens the model at `path` and checks that it fits the
    /// server. Every refusal is one line naming the file and the problem. The model and its
    /// external data are read into memory first ([`crate::external`]): ONNX Runtime opens no
    /// file.
    pub fn open(path: &Path, opts: &OnnxOptions) -> Result<OnnxModel> {
        let env = crate::runtime::environment()?;
        let model = crate::external::read_model(path)?;
        OnnxModel::session(env, path, &model, opts)
    }

    /// [`OnnxModel::open`] on a model already read from `path` ([`crate::external::read_model`]):
    /// several sessions of one model (a GPU worker's, one per batch shape) read its files once.
    pub fn from_read(
        path: &Path,
        model: &crate::external::ModelBytes,
        opts: &OnnxOptions,
    ) -> Result<OnnxModel> {
        let env = crate::runtime::environment()?;
        OnnxModel::session(env, path, model, opts)
    }

    fn session(
        env: ort::environment::Environment,
        path: &Path,
        model: &crate::external::ModelBytes,
        opts: &OnnxOptions,
    ) -> Result<OnnxModel> {
        let invalid = |why: String| Error::Invalid {
            path: path.to_owned(),
            why,
        };
        let mut builder = Session::builder(&env)
            .map_err(|e| invalid(e.to_string()))?
            .with_optimization_level(match opts.optimize {
                true => GraphOptimizationLevel::All,
                false => GraphOptimizationLevel::Disable,
            })
            .map_err(|e| invalid(e.to_string()))?
            // What goes wrong in a run comes back as its error; ONNX Runtime's own log lines
            // (cuDNN's refused plans, tried and passed over, each an "error") are left out.
            .with_log_level(ort::logging::LogLevel::Fatal)
            .map_err(|e| invalid(e.to_string()))?;
        // On a GPU the operators run there: one host thread issues them, and none spins
        // waiting for work (ONNX Runtime's default, a spinning thread per core, would take the
        // cores the farm's producers prepare images on).
        let threads = match opts.provider {
            Provider::Cpu => opts.threads,
            Provider::Gpu(..) => Some(opts.threads.unwrap_or(1)),
        };
        if let Some(n) = threads {
            builder = builder
                .with_intra_threads(n.max(1))
                .map_err(|e| invalid(e.to_string()))?;
        }
        if opts.provider != Provider::Cpu {
            builder = builder
                .with_intra_op_spinning(false)
                .map_err(|e| invalid(e.to_string()))?;
        }
        if let Provider::Gpu(p, gpu) = opts.provider {
            builder = builder
                .with_execution_providers(p.execution_providers(gpu, opts.tf32))
                .map_err(|e| provider_error(opts.provider, e))?;
        }
        let session = builder
            .commit_from_memory(&model.bytes)
            .map_err(|e| invalid(e.to_string()))?;
        let files = model.files.iter().map(|s| (s.clone(), false)).collect();
        let declared = |outlets: &[ort::value::Outlet]| -> Vec<(String, ort::value::ValueType)> {
            outlets
                .iter()
                .map(|o| (o.name().to_string(), o.dtype().clone()))
                .collect()
        };
        let (inputs, outputs) = (declared(session.inputs()), declared(session.outputs()));
        let spec = spec::check(path, (&inputs, &outputs))?;
        let image_size = match (spec.image_size, opts.image_size) {
            (Some(s), _) => s,
            (None, Some(s)) => s,
            (None, None) => {
                return Err(Error::Unfit {
                    path: path.to_owned(),
                    why: format!(
                        "input {:?} leaves the image size open; say which (--image-size)",
                        spec.input
                    ),
                })
            }
        };
        Ok(OnnxModel {
            session,
            spec,
            provider: opts.provider,
            image_size,
            path: path.to_owned(),
            files,
            staging: Vec::new(),
        })
    }

    /// The files the model was read from that changed since (rewritten, truncated, replaced,
    /// removed), each named with how, once: the model runs on as it was read.
    pub fn changed_files(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        for (stamp, told) in self.files.iter_mut().filter(|(_, told)| !told) {
            if let Some(how) = stamp.change() {
                *told = true;
                out.push(format!("{}: {how}", stamp.path.display()));
            }
        }
        out
    }

    /// The model's interface.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The side of the square images it takes.
    pub fn image_size(&self) -> usize {
        self.image_size
    }

    /// Floats per image: `3 * S * S`.
    pub fn image_len(&self) -> usize {
        3 * self.image_size * self.image_size
    }

    /// The file it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `rows` images, `batch` holding them one after the other (NCHW, normalised), and
    /// returns each image's scores.
    pub fn run(&mut self, batch: &[f32], rows: usize) -> Result<Vec<Vec<f32>>> {
        let per = self.image_len();
        if rows == 0 || batch.len() != rows * per {
            return Err(Error::BatchSize {
                got: batch.len(),
                rows,
                per,
            });
        }
        let s = self.image_size;
        let shape = [rows, 3, s, s];
        let run = |e: ort::Error| Error::Run(e.to_string());
        let outputs = match self.spec.input_elem {
            Elem::F32 => {
                let x = TensorRef::from_array_view((shape, batch)).map_err(run)?;
                self.session.run(ort::inputs![x]).map_err(run)?
            }
            Elem::F16 => {
                self.staging.clear();
                self.staging.extend(batch.iter().map(|&v| f16::from_f32(v)));
                let x = TensorRef::from_array_view((shape, &self.staging[..])).map_err(run)?;
                self.session.run(ort::inputs![x]).map_err(run)?
            }
        };
        scores_of(&outputs, &self.spec, rows)
    }

    /// Runs a batch of `rows` zero images once, so that what ONNX Runtime plans for that shape
    /// (on a GPU, cuDNN's measured convolution algorithms) is done before the first real batch.
    pub fn warm_up(&mut self, rows: usize) -> Result<()> {
        let zeros = vec![0f32; rows.max(1) * self.image_len()];
        self.run(&zeros, rows.max(1)).map(drop)
    }

    /// The GPU the model runs on, if it does.
    pub fn gpu(&self) -> Option<u32> {
        match self.provider {
            Provider::Cpu => None,
            Provider::Gpu(_, g) => Some(g),
        }
    }

    /// Runs the first `rows` images of `input` (NCHW, of the model's input type,
    /// [`ModelSpec::input_elem`], every write to them finished), device memory of the model's
    /// GPU (`gpu`), in place: ONNX Runtime reads them there, and only the scores come back to
    /// the host.
    pub fn run_on_device(
        &mut self,
        gpu: &tensorport_cuda::Gpu,
        input: &dyn tensorport_cuda::DeviceMemory,
        rows: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let run = |e: ort::Error| Error::Run(e.to_string());
        let Some(ordinal) = self.gpu() else {
            return Err(Error::Run(
                "the model runs on the CPU: hand it the batch in host memory".into(),
            ));
        };
        if rows == 0 {
            return Err(Error::BatchSize {
                got: 0,
                rows,
                per: self.image_len(),
            });
        }
        let region = input.device_memory();
        let elem = match self.spec.input_elem {
            Elem::F32 => 4,
            Elem::F16 => 2,
        };
        if rows
            .checked_mul(self.image_len() * elem)
            .is_none_or(|n| n > region.len)
        {
            return Err(Error::Run(format!(
                "{rows} images do not fit the {} bytes of device memory given",
                region.len
            )));
        }
        if i64::from(gpu.ordinal()) != i64::from(ordinal) {
            return Err(Error::Run(format!(
                "memory of GPU {} for a model on GPU {ordinal}",
                gpu.ordinal()
            )));
        }
        gpu.check_region(region)
            .map_err(|e| Error::Run(e.to_string()))?;
        let s = self.image_size as i64;
        let shape = Shape::new([rows as i64, 3, s, s]);
        let on_gpu = MemoryInfo::new(
            AllocationDevice::CUDA,
            ordinal as i32,
            AllocatorType::Device,
            MemoryType::Default,
        )
        .map_err(run)?;
        let data = region.addr.raw() as usize as *mut ort::sys::c_void;
        // The input is given to `run` as a view of device memory (ONNX Runtime uses it where
        // it lies, and returns the outputs in host memory). Not through `IoBinding`: binding
        // clones the value, and ort 2.0.0-rc.15 deadlocks cloning a tensor in device memory.
        //
        // SAFETY: `rows` images of the input's type lie in `input`'s memory, on this model's
        // GPU (both checked above), allocated and unwritten while `input` is borrowed
        // (`DeviceMemory`), which outlasts the run (the views live only within this call).
        let outputs = match self.spec.input_elem {
            Elem::F32 => {
                let x =
                    unsafe { TensorRefMut::<f32>::from_raw(on_gpu, data, shape) }.map_err(run)?;
                self.session.run(ort::inputs![x]).map_err(run)?
            }
            Elem::F16 => {
                let x =
                    unsafe { TensorRefMut::<f16>::from_raw(on_gpu, data, shape) }.map_err(run)?;
                self.session.run(ort::inputs![x]).map_err(run)?
            }
        };
        scores_of(&outputs, &self.spec, rows)
    }
}

/// The first output's scores, `K` per image, as `f32`.
fn scores_of(outputs: &SessionOutputs<'_>, spec: &ModelSpec, rows: usize) -> Result<Vec<Vec<f32>>> {
    let run = |e: ort::Error| Error::Run(e.to_string());
    let first = outputs
        .values()
        .next()
        .ok_or_else(|| Error::Run("the model gave no output".into()))?;
    let k = spec.classes;
    let scores: Vec<f32> = match spec.output_elem {
        Elem::F32 => first.try_extract_tensor::<f32>().map_err(run)?.1.to_vec(),
        Elem::F16 => first
            .try_extract_tensor::<f16>()
            .map_err(run)?
            .1
            .iter()
            .map(|v| v.to_f32())
            .collect(),
    };
    if scores.len() != rows * k {
        return Err(Error::Run(format!(
            "the model gave {} scores for {rows} images of {k} each",
            scores.len()
        )));
    }
    Ok(scores.chunks_exact(k).map(<[f32]>::to_vec).collect())
}

/// The CUDA execution provider as the server runs it: on GPU `gpu`; an f32 model's
/// convolutions on TF32 tensor cores where `tf32`; activations in NHWC, the tensor cores' own
/// layout (ONNX Runtime transposes at the graph's edges); cuDNN's convolution algorithms
/// measured (every one tried, with the largest workspace) the first time a session sees its
/// shape, which [`OnnxModel::warm_up`] does before the server takes work, since each session only
/// ever runs one shape.
fn cuda(gpu: u32, tf32: bool) -> ort::ep::CUDA {
    ort::ep::CUDA::default()
        .with_device_id(gpu as i32)
        .with_tf32(tf32)
        .with_prefer_nhwc(true)
        .with_conv_algorithm_search(ort::ep::cuda::ConvAlgorithmSearch::Exhaustive)
        .with_conv_max_workspace(true)
}

/// The TensorRT execution provider on GPU `gpu`, its engines and timings cached
/// ([`crate::runtime::tensorrt_cache`]) so that only a run that meets a model (and batch shape)
/// for the first time pays TensorRT's build.
fn tensorrt(gpu: u32) -> ort::ep::TensorRT {
    let ep = ort::ep::TensorRT::default().with_device_id(gpu as i32);
    match crate::runtime::tensorrt_cache() {
        Some(dir) => {
            let dir = dir.display().to_string();
            ep.with_engine_cache(true)
                .with_engine_cache_path(&dir)
                .with_timing_cache(true)
                .with_timing_cache_path(&dir)
        }
        None => ep,
    }
}

fn provider_error<T>(p: Provider, e: ort::Error<T>) -> Error {
    Error::Provider {
        provider: p.name(),
        why: format!(
            "{e} (onnxruntime-gpu's library and CUDA 13 with cuDNN 9 are needed: \
             scripts/fetch-onnxruntime.sh --gpu)"
        ),
    }
}
