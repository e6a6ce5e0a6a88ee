//! The bundled classifier on cuDNN: the same network and weights as [`ImageClassifier`], its
//! convolutions run by cuDNN at a chosen [`Precision`] and [`Layout`] (see
//! `tensorport_cudnn::ConvNet`), the
//! head on the host as on the CPU.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use dfdx::prelude::*;
use tensorport_cuda::Gpu;
use tensorport_cudnn::{ConvLayer, ConvNet, Layout, Precision};

use crate::model::{head, load_params, seeded_params};
use crate::{Error, ModelConfig, Result, Tensor4};

/// The classifier's convolutions for cuDNN (see `model.rs` for the network).
fn layers(c: &ModelConfig, p: &HashMap<&'static str, Vec<f32>>) -> Vec<ConvLayer> {
    let (w, w2) = (c.width, c.width * 2);
    let conv = |name: &str, cin, cout, kernel, stride, padding, residual| ConvLayer {
        in_channels: cin,
        out_channels: cout,
        kernel,
        stride,
        padding,
        weight: p[format!("{name}.weight").as_str()].clone(),
        bias: p[format!("{name}.bias").as_str()].clone(),
        residual,
    };
    vec![
        // Activation 1: relu(stem(x)).
        conv("stem", 3, w, 4, 4, 0, None),
        conv("res1.0", w, w, 3, 1, 1, None),
        // relu(x + conv(relu(conv(x)))), x being activation 1.
        conv("res1.1", w, w, 3, 1, 1, Some(1)),
        // Activation 4.
        conv("down", w, w2, 2, 2, 0, None),
        conv("res2.0", w2, w2, 3, 1, 1, None),
        conv("res2.1", w2, w2, 3, 1, 1, Some(4)),
    ]
}

/// The bundled classifier with cuDNN convolutions (see the module docs).
pub struct CudnnClassifier {
    dev: Cuda,
    config: ModelConfig,
    // Before `input`: dropping the network waits for the device, which may still read it.
    net: ConvNet,
    /// The batch in flight ([`CudnnClassifier::submit`]), kept until it is collected.
    input: Option<Tensor4<Cuda>>,
    head_w: Vec<f32>,
    head_b: Vec<f32>,
}

impl std::fmt::Debug for CudnnClassifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudnnClassifier")
            .field("config", &self.config)
            .field("precision", &self.net.precision())
            .field("layout", &self.net.layout())
            .finish_non_exhaustive()
    }
}

impl CudnnClassifier {
    /// The model with weights drawn from `seed` (the same as [`ImageClassifier::from_seed`]'s),
    /// on `gpu` (the device `dev` runs on), at a precision, in a memory layout
    /// ([`Layout::preferred`] is the faster for each precision and batch size).
    pub fn from_seed(
        dev: &Cuda,
        gpu: &Arc<Gpu>,
        config: ModelConfig,
        seed: u64,
        (precision, layout): (Precision, Layout),
    ) -> Result<Self> {
        config.check()?;
        Self::from_params(
            dev,
            gpu,
            config,
            seeded_params(&config, seed),
            (precision, layout),
        )
    }

    /// The model with weights from a safetensors file (as [`ImageClassifier::load`]).
    pub fn load(
        dev: &Cuda,
        gpu: &Arc<Gpu>,
        config: ModelConfig,
        path: &Path,
        (precision, layout): (Precision, Layout),
    ) -> Result<Self> {
        Self::from_params(
            dev,
            gpu,
            config,
            load_params(config, path)?,
            (precision, layout),
        )
    }

    fn from_params(
        dev: &Cuda,
        gpu: &Arc<Gpu>,
        config: ModelConfig,
        p: HashMap<&'static str, Vec<f32>>,
        (precision, layout): (Precision, Layout),
    ) -> Result<Self> {
        let net = ConvNet::new(
            gpu,
            config.input_shape(),
            layers(&config, &p),
            precision,
            layout,
        )
        .map_err(|e| Error::Device(e.to_string()))?;
        Ok(CudnnClassifier {
            dev: dev.clone(),
            config,
            net,
            input: None,
            head_w: p["head.weight"].clone(),
            head_b: p["head.bias"].clone(),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> ModelConfig {
        self.config
    }

    /// The convolutions' precision.
    pub fn precision(&self) -> Precision {
        self.net.precision()
    }

    /// The activations' memory layout.
    pub fn layout(&self) -> Layout {
        self.net.layout()
    }

    /// Whether to fuse (the default): each convolution with its bias, residual and ReLU in one
    /// cuDNN call where that is the faster, and the stem in a kernel of ours that reads the
    /// input as it comes; or to run every convolution on cuDNN apart from them (to compare).
    pub fn set_fused(&mut self, fused: bool) {
        self.net.set_fused(fused)
    }

    /// How many convolutions run on cuDNN graph-API plans, chosen by timing against its
    /// legacy calls (16-bit only; 0 before the first batch is planned).
    pub fn graph_layers(&self) -> usize {
        self.net.graph_layers()
    }

    /// Whether a kernel of ours runs the stem (see [`CudnnClassifier::set_fused`]).
    pub fn stem_kernel(&self) -> bool {
        self.net.stem_kernel()
    }

    /// How many of the model's convolutions cuDNN runs fused.
    pub fn fused_layers(&self) -> usize {
        self.net.fused_layers()
    }

    /// Chooses cuDNN's algorithms for batches of `batch` images now (it measures them; every
    /// batch size then uses them), rather than when the first batch comes.
    pub fn prepare(&mut self, batch: usize) -> Result<()> {
        self.net
            .prepare(batch)
            .map_err(|e| Error::Device(e.to_string()))
    }

    /// Class scores for images `[B, 3, S, S]` on the model's device, one row per image.
    pub fn forward(&mut self, x: &Tensor4<Cuda>) -> Result<Vec<Vec<f32>>> {
        self.collect()?;
        self.check(x)?;
        // SAFETY: `x` is a live [b, 3, S, S] f32 tensor of this device's primary context (dfdx
        // and tensorport-cuda share it), its writers are done (`check` synchronised dfdx's
        // stream), and it is borrowed — so neither freed nor written — until `pooled` returns,
        // which it does only once the device is done with it.
        let feats = unsafe { self.net.pooled(x.tensorport_device_ptr(), x.shape().0) }
            .map_err(|e| Error::Device(e.to_string()))?;
        Ok(self.head(&feats))
    }

    /// Starts on the batch `x` and returns before its scores are ready; [`CudnnClassifier::collect`]
    /// waits for them. The model keeps `x` until then. A batch still in flight is collected
    /// (its scores dropped) first.
    pub fn submit(&mut self, x: Tensor4<Cuda>) -> Result<()> {
        self.collect()?;
        self.check(&x)?;
        // SAFETY: as in `forward`; `x` is kept in `self.input`, neither freed nor written,
        // until `collect` has waited for the device (or the network, dropped first, has).
        unsafe { self.net.launch(x.tensorport_device_ptr(), x.shape().0) }
            .map_err(|e| Error::Device(e.to_string()))?;
        self.input = Some(x);
        Ok(())
    }

    /// The scores of the batch [`CudnnClassifier::submit`] started (none if none is in flight).
    pub fn collect(&mut self) -> Result<Vec<Vec<f32>>> {
        let feats = self.net.collect().map_err(|e| Error::Device(e.to_string()));
        // The device is done with the input (or failed): it may go.
        self.input = None;
        Ok(self.head(&feats?))
    }

    /// Refuses an input of the wrong shape, and waits for dfdx's stream (which may still be
    /// writing it: dfdx's ops run on a stream of their own).
    fn check(&self, x: &Tensor4<Cuda>) -> Result<()> {
        let (_, c, h, w) = *x.shape();
        if [c, h, w] != self.config.input_shape() {
            return Err(Error::Config(format!(
                "input [{c}, {h}, {w}] for a model of {:?}",
                self.config.input_shape()
            )));
        }
        self.dev
            .try_synchronize()
            .map_err(|e| Error::Device(format!("{e:?}")))
    }

    fn head(&self, feats: &[f32]) -> Vec<Vec<f32>> {
        head(feats, self.net.out_channels(), &self.head_w, &self.head_b)
    }
}
