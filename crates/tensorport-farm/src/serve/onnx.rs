//! An ONNX model as the server's model: each worker opens its own ONNX Runtime session, and
//! the batch the server stacked (`[B, 3, S, S]`, normalised `f32`) is run as it is: on the CPU
//! from host memory; on a GPU bound in place where the server gathered it (converted to `f16`
//! on the device first for an `f16` model), only the scores coming back to the host.

use std::path::Path;

use tensorport_dfdx::dfdx::prelude::{Cpu, HasShape};
use tensorport_dfdx::{Classify, Tensor4};
use tensorport_onnx::{OnnxModel, OnnxOptions, Provider};

use super::Model;
use crate::error::{ConfigError, Result};

/// An ONNX model on ONNX Runtime's CPU execution provider.
struct OnCpu(OnnxModel);

impl Classify<Cpu> for OnCpu {
    fn classify(&mut self, x: Tensor4<Cpu>) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        let rows = x.shape().0;
        let batch = x.as_vec();
        self.0
            .run(&batch, rows)
            .map_err(|e| tensorport_dfdx::Error::Device(e.to_string()))
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
    };
    let model = OnnxModel::open(path, &opts).map_err(ConfigError::from)?;
    tracing::info!(
        model = %path.display(),
        input = %model.spec().input,
        dtype = model.spec().input_elem.name(),
        image_size = model.image_size(),
        classes = model.spec().classes,
        "ONNX model loaded (ONNX Runtime, CPU)"
    );
    Ok(Box::new(OnCpu(model)))
}

/// An ONNX model on a GPU (CUDA or TensorRT execution provider), fed the gathered batch on the
/// device: staged into a buffer of a padded row count (`tensorport_cuda::padded_rows`: ONNX
/// Runtime plans each new batch shape anew, and a server's batches come in every size),
/// converted to `f16` there for an `f16` model.
#[cfg(feature = "cuda")]
struct OnCuda {
    model: OnnxModel,
    stage: tensorport_cuda::BatchStage,
}

#[cfg(feature = "cuda")]
impl Classify<tensorport_dfdx::dfdx::prelude::Cuda> for OnCuda {
    fn classify(
        &mut self,
        x: Tensor4<tensorport_dfdx::dfdx::prelude::Cuda>,
    ) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        let rows = x.shape().0;
        let padded = tensorport_cuda::padded_rows(rows);
        let device = |e: String| tensorport_dfdx::Error::Device(e);
        // SAFETY: the server's gather has finished writing `x` (it waits for its copies), which
        // holds `rows` images of floats on this GPU and lives until this returns.
        let input = unsafe {
            self.stage.stage(
                x.tensorport_device_ptr(),
                rows,
                padded,
                self.model.image_len(),
            )
        }
        .map_err(|e| device(e.to_string()))?;
        // SAFETY: the stage's buffer holds `padded` images of the model's input type on its
        // GPU, written and waited for, and unchanged until the stage is used again.
        let mut scores = unsafe { self.model.run_on_device(input, padded) }
            .map_err(|e| device(e.to_string()))?;
        // The padding rows' scores are not anyone's.
        scores.truncate(rows);
        Ok(scores)
    }
}

/// Opens the model at `path` for a worker on GPU `ordinal` with `provider`.
#[cfg(feature = "cuda")]
pub(super) fn load_on_cuda(
    path: &Path,
    image_size: usize,
    gpu: &std::sync::Arc<tensorport_cuda::Gpu>,
    provider: Provider,
) -> Result<Model<tensorport_dfdx::dfdx::prelude::Cuda>> {
    let opts = OnnxOptions {
        provider,
        threads: None,
        image_size: Some(image_size),
    };
    let model = OnnxModel::open(path, &opts).map_err(ConfigError::from)?;
    let half = model.spec().input_elem == tensorport_onnx::Elem::F16;
    let stage = tensorport_cuda::BatchStage::new(gpu, half)?;
    tracing::info!(
        model = %path.display(),
        input = %model.spec().input,
        dtype = model.spec().input_elem.name(),
        image_size = model.image_size(),
        classes = model.spec().classes,
        provider = provider.name(),
        "ONNX model loaded (ONNX Runtime, GPU; the batch stays on the device)"
    );
    Ok(Box::new(OnCuda { model, stage }))
}
