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

/// An ONNX model on a GPU (CUDA or TensorRT execution provider), fed the gathered batch in
/// place.
#[cfg(feature = "cuda")]
struct OnCuda {
    model: OnnxModel,
    /// For an `f16` model: the conversion and the stream it runs on.
    half: Option<(tensorport_cuda::HalfCast, tensorport_cuda::Stream)>,
}

#[cfg(feature = "cuda")]
impl Classify<tensorport_dfdx::dfdx::prelude::Cuda> for OnCuda {
    fn classify(
        &mut self,
        x: Tensor4<tensorport_dfdx::dfdx::prelude::Cuda>,
    ) -> tensorport_dfdx::Result<Vec<Vec<f32>>> {
        let rows = x.shape().0;
        let device = |e: String| tensorport_dfdx::Error::Device(e);
        // The server's gather has finished writing `x` (it waits for its copies) and nothing
        // writes it again while this runs.
        let mut input = x.tensorport_device_ptr();
        if let Some((cast, stream)) = self.half.as_mut() {
            // SAFETY: `x` holds `rows` images of floats on this GPU, finished, alive for this
            // call.
            input = unsafe { cast.to_f16(input, rows * self.model.image_len(), stream) }
                .map_err(|e| device(e.to_string()))?;
        }
        // SAFETY: `input` is `rows` images of the model's input type on its GPU, finished and
        // unchanged until the run returns (`x`, or the caster's buffer, lives until then).
        let scores = unsafe { self.model.run_on_device(input, rows) };
        drop(x);
        scores.map_err(|e| device(e.to_string()))
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
    let half = match model.spec().input_elem {
        tensorport_onnx::Elem::F16 => Some((
            tensorport_cuda::HalfCast::new(gpu)?,
            tensorport_cuda::Stream::new(gpu)?,
        )),
        tensorport_onnx::Elem::F32 => None,
    };
    tracing::info!(
        model = %path.display(),
        input = %model.spec().input,
        dtype = model.spec().input_elem.name(),
        image_size = model.image_size(),
        classes = model.spec().classes,
        provider = provider.name(),
        "ONNX model loaded (ONNX Runtime, GPU; the batch bound in place)"
    );
    Ok(Box::new(OnCuda { model, half }))
}
