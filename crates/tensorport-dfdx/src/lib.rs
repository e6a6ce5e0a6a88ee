//! tensorport requests as dfdx 0.13 tensors.
//!
//! - [`stack_images`]: a batch of received `[C, H, W]` f32 (or `u8`) requests, each checked as
//!   `tensorport_vision::request` says → one `[B, C, H, W]` tensor.
//!   Reading the slots into the batch is the only copy on the CPU path (on `Cuda` it is the
//!   host-to-device DMA, from pinned pools).
//! - [`ImageClassifier`]: a small ResNet-style CNN (conv stem, two residual stages, global
//!   average pool, linear head). dfdx 0.13 gates its `conv2d`/`pool2d` ops and `Conv2D` module
//!   behind its `nightly` feature, so the convolutions here are built from stable ops: patch
//!   convolutions as reshape → permute → matmul, 3×3 convolutions as nine shifted matmuls.
//!   Weights come from a safetensors file (PyTorch layouts) or a fixed seed.
//! - `CudnnClassifier` (CUDA build): the same network and weights with cuDNN convolutions, in
//!   fp32, TF32, bf16 or fp16 — the GPU server's model.
//! - `GpuInput` (CUDA build): a tensor's storage as `tensorport_cuda::DeviceMemoryMut`, a batch
//!   a gather writes into before the network reads it.
//!
//! The server's model interface (which engines implement, dfdx's among them) is
//! `tensorport_farm::serve::Engine`, not this crate's.
//!
//! Determinism: dfdx's CPU conv runs image by image and the head runs row by row, so an image's
//! scores are bitwise the same whatever batch it was in.
#![warn(missing_docs)]

mod model;

pub use dfdx;
pub use model::{ImageClassifier, ModelConfig};

use dfdx::prelude::*;
use tensorport::Request;
use tensorport_vision::request::check_image;
use thiserror::Error;

/// Errors of this crate.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// A request does not fit the model's input.
    #[error(transparent)]
    BadInput(#[from] tensorport_vision::request::Misfit),
    /// The weights file is missing, unreadable or does not match the model.
    #[error("weights {path}: {problem}")]
    Weights {
        /// The file.
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// A model configuration that cannot be built.
    #[error("model configuration: {0}")]
    Config(String),
    /// The device failed.
    #[error("device error: {0}")]
    Device(String),
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// A 4-d f32 tensor with runtime dimensions.
pub type Tensor4<D> = Tensor<(usize, usize, usize, usize), f32, D>;

#[cfg(feature = "cuda")]
mod cudnn_model;
#[cfg(feature = "cuda")]
pub use cudnn_model::CudnnClassifier;
#[cfg(feature = "cuda")]
mod gpu_input;
#[cfg(feature = "cuda")]
pub use gpu_input::GpuInput;
#[cfg(feature = "cuda")]
pub use tensorport_cudnn::{Layout, Precision};

/// A batch stacked from requests.
pub struct Stacked<D: Device<f32>> {
    /// `[B, C, H, W]`, the images of `used` in order; `None` if no request fit.
    pub input: Option<Tensor4<D>>,
    /// Indices (into the requests given) of the images in `input`, row by row.
    pub used: Vec<usize>,
    /// Indices of requests that do not fit the model, and why.
    pub rejected: Vec<(usize, Error)>,
}

/// Stacks images (each checked by `tensorport_vision::request::check_image`) into one
/// `[B, C, H, W]` tensor on `dev`.
/// Requests that do not fit are listed separately with the reason, so the caller can fail
/// just those.
pub fn stack_images<D: Device<f32>>(dev: &D, reqs: &[Request], shape: [usize; 3]) -> Stacked<D> {
    let per = shape.iter().product::<usize>();
    let mut data = Vec::with_capacity(per * reqs.len());
    let mut used = Vec::with_capacity(reqs.len());
    let mut bad = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        match check_image(r, shape) {
            Ok(px) => {
                px.extend_normalised(&mut data);
                used.push(i);
            }
            Err(e) => bad.push((i, e.into())),
        }
    }
    let input = (!used.is_empty())
        .then(|| dev.tensor_from_vec(data, (used.len(), shape[0], shape[1], shape[2])));
    Stacked {
        input,
        used,
        rejected: bad,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tensorport::{DType, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};
    use tensorport_vision::request::normaliser;

    #[test]
    fn stacking_takes_f32_and_u8_images_and_rejects_misfits() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        let server = Server::bind(ServerConfig::new(&sock)).unwrap();
        let mut p = Producer::connect(&sock, ProducerConfig::new("t")).unwrap();
        let shape = [3usize, 4, 4];
        for i in 0..3u64 {
            let mut l = p.lease(Duration::from_secs(2)).unwrap();
            let px: Vec<f32> = (0..48).map(|k| (k as f32) * 0.5 + i as f32).collect();
            l.write_pod(0, &px);
            l.submit(&TensorSpec::new(DType::F32, &[3, 4, 4])).unwrap();
        }
        // An 8-bit image (normalised by the server), then a misfit.
        let planes: Vec<u8> = (0..48).map(|k| (k * 5) as u8).collect();
        let mut l = p.lease(Duration::from_secs(2)).unwrap();
        l.write_pod(0, &planes);
        l.submit(&TensorSpec::new(DType::U8, &[3, 4, 4])).unwrap();
        let mut l = p.lease(Duration::from_secs(2)).unwrap();
        l.write_pod(0, &[0i32; 16]);
        l.submit(&TensorSpec::new(DType::I32, &[16])).unwrap();
        let mut batch = Vec::new();
        while batch.len() < 5 {
            batch.extend(
                server
                    .recv_batch(5, Duration::from_secs(2), Duration::from_millis(50))
                    .unwrap(),
            );
        }
        let dev = dfdx::prelude::Cpu::default();
        let a = stack_images(&dev, &batch, shape);
        assert_eq!(a.used, vec![0, 1, 2, 3]);
        assert_eq!(a.rejected.len(), 1);
        assert!(a.rejected[0].1.to_string().contains("dtype i32"));
        let a = a.input.unwrap().as_vec();
        for i in 0..3 {
            let want: Vec<f32> = (0..48).map(|k| (k as f32) * 0.5 + i as f32).collect();
            assert_eq!(&a[i * 48..(i + 1) * 48], &want[..]);
        }
        // The u8 image became the producers' normalised values.
        let mut want = vec![0f32; 48];
        normaliser().normalise_planes(&planes, 16, &mut want);
        assert_eq!(&a[3 * 48..], &want[..]);
        assert!(want[0] < 0.0 && want[47] > 0.0);
    }
}
