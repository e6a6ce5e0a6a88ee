//! The bundled network as the server's [`Engine`]: on dfdx's kernels (the CPU; a GPU where
//! cuDNN cannot be loaded), or on cuDNN at a precision (a GPU). Each lends its input as the
//! network takes it: host rows that become the dfdx tensor without a copy, or a dfdx tensor on
//! the GPU that the batcher gathers into.

use tensorport_dfdx::dfdx::prelude::{Cpu, TensorFromVec};
use tensorport_dfdx::ImageClassifier;

use super::engine::{check_rows, Engine, EngineError, HostInput, Input, Submitted};

/// The bundled network on dfdx's CPU kernels.
pub(super) struct DfdxOnCpu {
    pub(super) dev: Cpu,
    pub(super) net: ImageClassifier<Cpu>,
    pub(super) shape: [usize; 3],
}

impl Engine for DfdxOnCpu {
    fn max_batch(&self) -> usize {
        crate::MAX_BATCH
    }

    fn lend(&mut self, rows: usize) -> Result<Input, EngineError> {
        // The rows become the tensor's storage: a new allocation each batch.
        Ok(Input::Host(HostInput::new(Vec::new(), rows, self.shape)))
    }

    fn submit(&mut self, input: Input) -> Result<Submitted, EngineError> {
        let h = input.into_host("the network on the CPU")?;
        if !h.is_full() {
            return Err(EngineError::failed("a batch with rows left unwritten"));
        }
        let (rows, [c, hh, w]) = (h.rows(), h.shape());
        let x = self.dev.tensor_from_vec(h.into_pixels(), (rows, c, hh, w));
        check_rows(self.net.forward(x), rows).map(Submitted::Ready)
    }
}

/// The bundled network on a GPU: lent dfdx tensors, run by cuDNN or by dfdx's own kernels.
#[cfg(feature = "cuda")]
pub(super) mod gpu {
    use tensorport_dfdx::dfdx::prelude::Cuda;
    use tensorport_dfdx::{CudnnClassifier, GpuInput, ImageClassifier};

    use super::super::engine::{DeviceInput, DeviceRows, Scores};
    use super::*;

    /// Which network runs the lent tensors.
    pub(in crate::serve) enum Net {
        /// cuDNN's convolutions, started and collected apart (the next batch is gathered
        /// while the GPU runs this one).
        Cudnn(Box<CudnnClassifier>),
        /// dfdx's own kernels (fp32, several times slower), where cuDNN cannot be loaded.
        Dfdx(Box<ImageClassifier<Cuda>>),
    }

    /// The bundled network on a GPU.
    pub(in crate::serve) struct OnGpu {
        pub(in crate::serve) dev: Cuda,
        pub(in crate::serve) net: Net,
        pub(in crate::serve) shape: [usize; 3],
        /// Rows of the batch in flight.
        pub(in crate::serve) in_flight: Option<usize>,
    }

    impl Engine for OnGpu {
        fn max_batch(&self) -> usize {
            tensorport_cudnn::ConvNet::MAX_BATCH
        }

        fn lend(&mut self, rows: usize) -> Result<Input, EngineError> {
            let t = GpuInput::zeros(&self.dev, rows, self.shape).map_err(EngineError::failed)?;
            Ok(Input::Device(DeviceInput {
                rows,
                memory: DeviceRows::Tensor(t),
            }))
        }

        fn submit(&mut self, input: Input) -> Result<Submitted, EngineError> {
            let Input::Device(DeviceInput {
                rows,
                memory: DeviceRows::Tensor(t),
            }) = input
            else {
                return Err(EngineError::failed("a batch not lent by this engine"));
            };
            let x = t.into_tensor();
            match &mut self.net {
                Net::Cudnn(m) => {
                    self.in_flight = None;
                    m.submit(x).map_err(EngineError::failed)?;
                    self.in_flight = Some(rows);
                    Ok(Submitted::InFlight)
                }
                Net::Dfdx(m) => check_rows(m.forward(x), rows).map(Submitted::Ready),
            }
        }

        fn collect(&mut self) -> Result<Scores, EngineError> {
            let (Net::Cudnn(m), Some(rows)) = (&mut self.net, self.in_flight.take()) else {
                return Ok(Vec::new());
            };
            check_rows(m.collect().map_err(EngineError::failed)?, rows)
        }
    }
}
