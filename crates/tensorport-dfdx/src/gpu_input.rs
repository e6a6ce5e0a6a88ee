//! dfdx tensors as device memory for tensorport's CUDA layer, named here, where the tensor's
//! storage is known, so that the code that gathers a batch into a tensor or hands one to
//! ONNX Runtime needs no `unsafe` of its own.

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

/// A batch on the GPU to be read in place, on any thread (ONNX Runtime's session thread): the
/// tensor's storage, held while the value lives. Reads see dfdx's finished work only: a batch a
/// gather wrote has none pending; synchronise dfdx's device before handing over a tensor it
/// still computes.
pub struct GpuTensor {
    storage: std::sync::Arc<dyn std::any::Any + Send + Sync>,
    region: DeviceRegion,
    rows: usize,
}

impl GpuTensor {
    /// `t`'s storage (the tensor itself is let go here, on the thread that owns its device).
    pub fn new(t: Tensor4<Cuda>) -> Result<GpuTensor> {
        let region =
            region(&t).ok_or_else(|| Error::Device("a batch with no device memory".into()))?;
        Ok(GpuTensor {
            storage: t.tensorport_storage(),
            region,
            rows: t.shape().0,
        })
    }

    /// Its images.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

// SAFETY: the storage is held while the `GpuTensor` lives, which keeps its allocation out of
// dfdx's cache; dfdx writes a storage only through a tensor that holds it alone (it copies a
// shared one first), and this one is shared for as long as it lives.
unsafe impl DeviceMemory for GpuTensor {
    fn device_memory(&self) -> DeviceRegion {
        let _held = &self.storage;
        self.region
    }
}

/// The tensor's storage, if it has any.
fn region(t: &Tensor4<Cuda>) -> Option<DeviceRegion> {
    Some(DeviceRegion {
        addr: DevicePtr::new(t.tensorport_device_ptr())?,
        len: t.tensorport_num_bytes(),
    })
}
