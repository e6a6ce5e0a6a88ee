//! An ONNX model as the server's model: each worker opens its own ONNX Runtime session, and
//! the batch the server stacked (`[B, 3, S, S]`, normalised `f32`) is run as it is.

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
