//! dfdx tensors as device memory for tensorport's CUDA layer, named here, where the tensor's
//! storage is known, so that the code that gathers a batch into a tensor needs no `unsafe` of
//! its own.

use dfdx::prelude::*;
use tensorport_cuda::{DeviceMemory, DeviceMemoryMut, DevicePtr, DeviceRegion};

use crate::{Error, Result, Tensor4};

/// A batch's model input on the GPU that nothing else holds yet: what a gather writes its
/// rows into ([`DeviceMemoryMut`]), then handed to the model with [`GpuInput::into_tensor`].
pub struct GpuInput(Tensor4<Cuda>);

impl GpuInput {
    /// `rows` images of `shape` (`[C, H, W]`), zeros, on `dev`: written before this returns,
    /// so copies on another stream come after them.
    pub fn zeros(dev: &Cuda, rows: usize, shape: [usize; 3]) -> Result<GpuInput> {
        let t: Tensor4<Cuda> = dev.zeros_like(&(rows, shape[0], shape[1], shape[2]));
        dev.try_synchronize()
            .map_err(|e| Error::Device(format!("{e:?}")))?;
        // A tensor of no elements has no storage to name.
        region(&t).ok_or_else(|| Error::Device("a batch with no device memory".into()))?;
        Ok(GpuInput(t))
    }

    /// The tensor, for the model.
    pub fn into_tensor(self) -> Tensor4<Cuda> {
        self.0
    }
}

// SAFETY: the tensor's storage, held (and never written by dfdx: the tensor is not shared)
// while the `GpuInput` lives; `zeros` refused a tensor without storage.
unsafe impl DeviceMemory for GpuInput {
    fn device_memory(&self) -> DeviceRegion {
        region(&self.0).expect("checked in GpuInput::zeros")
    }
}

// SAFETY: made by `zeros` and never cloned: its storage is this value's alone until
// `into_tensor` gives it up.
unsafe impl DeviceMemoryMut for GpuInput {}

/// The tensor's storage, if it has any.
fn region(t: &Tensor4<Cuda>) -> Option<DeviceRegion> {
    Some(DeviceRegion {
        addr: DevicePtr::new(t.tensorport_device_ptr())?,
        len: t.tensorport_num_bytes(),
    })
}
