//! The model a server runs and how: the bundled classifier, none, or an ONNX file; its device,
//! batches and arithmetic.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tensorport_cudnn::Precision;
use tensorport_dfdx::ModelConfig;

use super::bounds::{duration, within, MAX_DURATION, MAX_IMAGE_SIZE};
use super::data;
use crate::error::ConfigError;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Device {
    /// The CPU.
    Cpu,
    /// CUDA GPU N (needs a build with the `cuda` feature).
    Cuda(u32),
}

impl Device {
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("{s:?}: say cpu, cuda (GPU 0) or cuda:N")),
        }
    }
}

/// What the server runs on each batch.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ModelKind {
    /// The bundled image classifier.
    #[default]
    Classifier,
    /// None: the batch is only moved onto the device (a transport benchmark, like PyTorch's
    /// DataLoader one).
    None,
    /// An ONNX model file, run by ONNX Runtime: its input sets the image size.
    Onnx(#[serde(with = "data::path")] PathBuf),
}

impl ModelKind {
    /// The name a command line gives it: `classifier`, `none`, or the ONNX file's path.
    pub fn arg(&self) -> String {
        match self {
            ModelKind::Classifier => "classifier".into(),
            ModelKind::None => "none".into(),
            ModelKind::Onnx(p) => p.display().to_string(),
        }
    }
}

impl std::fmt::Display for ModelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.arg())
    }
}

impl std::str::FromStr for ModelKind {
    type Err = String;

    /// `classifier`, `none`, or a path ending in `.onnx`.
    fn from_str(s: &str) -> Result<ModelKind, String> {
        match s {
            "classifier" => Ok(ModelKind::Classifier),
            "none" => Ok(ModelKind::None),
            p if p.to_ascii_lowercase().ends_with(".onnx") => Ok(ModelKind::Onnx(p.into())),
            p => Err(format!(
                "{p:?}: give classifier (the bundled model), none, or an ONNX file (*.onnx)"
            )),
        }
    }
}

/// The model, and how the server runs it; server and producers must agree on the image size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelOptions {
    pub kind: ModelKind,
    /// Image size, classes, width.
    #[serde(with = "data::model_config")]
    pub config: ModelConfig,
    /// Weights file (safetensors); without it, weights come from `seed`.
    #[serde(with = "data::opt_path")]
    pub weights: Option<PathBuf>,
    pub seed: u64,
    pub device: Device,
    /// Largest batch the model runs ([`ModelOptions::default_max_batch`] unless told).
    pub max_batch: usize,
    /// How long a batch waits for more requests after its first.
    pub max_wait: Duration,
    /// The convolutions' arithmetic on the GPU; `None` is f32 (and, in benchmarks, every one).
    #[serde(with = "data::precision")]
    pub precision: Option<Precision>,
    /// ONNX Runtime's execution provider for an ONNX model on a GPU.
    pub ort_provider: OrtProvider,
    /// An ONNX model in f32 on a GPU: its convolutions and matrix products on TF32 tensor cores
    /// (ONNX Runtime's and PyTorch's default for convolutions); off for results as exact as
    /// the CPU's.
    #[serde(default = "data::yes")]
    pub tf32: bool,
}

/// ONNX Runtime's execution provider for an ONNX model on a GPU: `tensorport-onnx`'s, where
/// each provider is written once.
pub use tensorport_onnx::GpuProvider as OrtProvider;

impl Default for ModelOptions {
    fn default() -> ModelOptions {
        ModelOptions {
            kind: ModelKind::default(),
            config: ModelConfig::default(),
            weights: None,
            seed: 0,
            device: Device::Cpu,
            max_batch: DEFAULT_MAX_BATCH_CPU,
            max_wait: Duration::from_millis(5),
            precision: None,
            ort_provider: OrtProvider::default(),
            tf32: true,
        }
    }
}

/// The largest batch a model on the CPU runs unless told otherwise.
pub const DEFAULT_MAX_BATCH_CPU: usize = 32;
/// The largest batch a model on a GPU runs unless told otherwise: a larger batch takes less of
/// the GPU's time per image, which the GPU producers beside it then have (docs/benchmarks.md).
pub const DEFAULT_MAX_BATCH_GPU: usize = 128;

impl ModelOptions {
    /// The largest batch the model runs on `device` unless told otherwise.
    pub fn default_max_batch(device: Device) -> usize {
        if device.is_cuda() {
            DEFAULT_MAX_BATCH_GPU
        } else {
            DEFAULT_MAX_BATCH_CPU
        }
    }

    /// Refuses options that contradict each other.
    pub fn check(&self) -> Result<(), ConfigError> {
        match &self.kind {
            // An ONNX model's input sets the image size (see `resolve`).
            ModelKind::Onnx(_) if self.weights.is_some() => {
                return Err(ConfigError::WeightsForOnnx)
            }
            ModelKind::Onnx(_) if self.config.image_size == 0 => {
                return Err(ConfigError::ImageSize)
            }
            ModelKind::Onnx(_) => {}
            _ => self.config.check()?,
        }
        if !(1..=crate::MAX_BATCH).contains(&self.max_batch) {
            return Err(ConfigError::MaxBatch);
        }
        within("image size", self.config.image_size, 1, MAX_IMAGE_SIZE)?;
        duration("max_wait", self.max_wait, Duration::ZERO, MAX_DURATION)?;
        if let Some(p) = self.precision.filter(|&p| p != Precision::F32) {
            if !self.device.is_cuda() {
                return Err(ConfigError::PrecisionNeedsGpu(p));
            }
        }
        if self.device.is_cuda() && !cfg!(feature = "cuda") {
            return Err(ConfigError::NoCudaBuild);
        }
        Ok(())
    }

    /// Reads what an ONNX model decides: the image size (its input's, or `config.image_size`
    /// where the model leaves it open) and the classes. Refuses a model the server cannot run,
    /// with one line naming the problem, before anything starts. The other kinds are left as
    /// they are.
    pub fn resolve(&mut self) -> Result<(), ConfigError> {
        let ModelKind::Onnx(path) = &self.kind else {
            return Ok(());
        };
        // Opened only to check the model and read its interface: no graph optimisations.
        let opts = tensorport_onnx::OnnxOptions {
            threads: Some(1),
            image_size: Some(self.config.image_size),
            tf32: self.tf32,
            optimize: false,
            ..Default::default()
        };
        let model = tensorport_onnx::OnnxModel::open(path, &opts)?;
        self.adopt_onnx(
            &model.spec().input,
            model.image_size(),
            model.spec().classes,
        )
    }

    /// Takes what an opened ONNX model decides (its input named `input`, of images of
    /// `image_size`, `classes` scores per image), refusing an image size the server cannot
    /// take. A server takes it from its first worker's session ([`ModelOptions::resolve`]
    /// opens one of its own).
    pub fn adopt_onnx(
        &mut self,
        input: &str,
        image_size: usize,
        classes: usize,
    ) -> Result<(), ConfigError> {
        if image_size > MAX_IMAGE_SIZE {
            let path = match &self.kind {
                ModelKind::Onnx(p) => p.clone(),
                _ => PathBuf::new(),
            };
            // Its producers' slots would fit no memory budget: refused before any starts.
            return Err(tensorport_onnx::Error::Unfit {
                path,
                why: format!(
                    "input {input:?} takes images of {image_size}×{image_size}; the server \
                     takes sides up to {MAX_IMAGE_SIZE}"
                ),
            }
            .into());
        }
        self.config.image_size = image_size;
        self.config.classes = classes;
        Ok(())
    }

    /// The bundled model on dfdx's kernels: from the weights file, or from the seed.
    pub fn dfdx_model<D: tensorport_dfdx::dfdx::prelude::Device<f32>>(
        &self,
        dev: &D,
    ) -> Result<tensorport_dfdx::ImageClassifier<D>, ConfigError> {
        use tensorport_dfdx::ImageClassifier;
        Ok(match &self.weights {
            Some(p) => ImageClassifier::load(dev, self.config, p)?,
            None => ImageClassifier::from_seed(dev, self.config, self.seed)?,
        })
    }

    /// The bundled model on cuDNN at `how` (precision, layout): from the weights file, or the
    /// seed.
    #[cfg(feature = "cuda")]
    pub fn cudnn_model(
        &self,
        dev: &tensorport_dfdx::dfdx::prelude::Cuda,
        gpu: &std::sync::Arc<tensorport_cuda::Gpu>,
        how: (Precision, tensorport_cudnn::Layout),
    ) -> Result<tensorport_dfdx::CudnnClassifier, ConfigError> {
        use tensorport_dfdx::CudnnClassifier;
        Ok(match &self.weights {
            Some(p) => CudnnClassifier::load(dev, gpu, self.config, p, how)?,
            None => CudnnClassifier::from_seed(dev, gpu, self.config, self.seed, how)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_largest_batch_depends_on_the_device_and_passes_its_own_check() {
        let cpu = ModelOptions::default_max_batch(Device::Cpu);
        let gpu = ModelOptions::default_max_batch(Device::Cuda(0));
        assert_eq!(cpu, DEFAULT_MAX_BATCH_CPU);
        assert_eq!(gpu, DEFAULT_MAX_BATCH_GPU);
        assert_eq!(ModelOptions::default().max_batch, cpu);
        for max_batch in [cpu, gpu] {
            let o = ModelOptions {
                max_batch,
                ..ModelOptions::default()
            };
            assert!(o.check().is_ok(), "{max_batch}");
        }
        // A GPU producer's batch fills at most one of the model's.
        assert!(crate::farm::DEFAULT_GPU_BATCH as usize <= gpu);
    }

    #[test]
    fn the_largest_batch_is_bounded_both_ways() {
        let with = |max_batch| ModelOptions {
            max_batch,
            ..ModelOptions::default()
        };
        assert!(with(1).check().is_ok());
        assert!(with(crate::MAX_BATCH).check().is_ok());
        for bad in [0, crate::MAX_BATCH + 1] {
            let e = with(bad).check().unwrap_err();
            assert!(matches!(e, ConfigError::MaxBatch), "{bad}: {e}");
            assert_eq!(e.to_string(), "the largest batch must be 1 to 65535");
        }
    }

    /// Each GPU provider's flag value is its own name, it reaches a child's configuration and
    /// back as itself, and it runs on the GPU it was given.
    #[cfg(feature = "clap")]
    #[test]
    fn each_ort_provider_is_its_flag_value_and_survives_the_childs_configuration() {
        use clap::ValueEnum;
        assert_eq!(OrtProvider::default(), OrtProvider::Cuda);
        for &p in OrtProvider::value_variants() {
            let flag = p.to_possible_value().expect("every provider has a value");
            assert_eq!(flag.get_name(), p.name());
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(serde_json::from_str::<OrtProvider>(&json).unwrap(), p);
            assert_eq!(p.on(3), tensorport_onnx::Provider::Gpu(p, 3));
        }
    }
}
