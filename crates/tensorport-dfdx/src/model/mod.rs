//! A small ResNet-style image classifier on dfdx tensors with runtime dimensions.

use std::collections::HashMap;
use std::path::Path;

use dfdx::prelude::*;
use safetensors::tensor::{Dtype as StDtype, TensorView};
use safetensors::SafeTensors;

use crate::{Error, Result, Tensor4};

/// Shape of the classifier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelConfig {
    /// Input images are `[3, image_size, image_size]`.
    pub image_size: usize,
    /// Number of output classes.
    pub classes: usize,
    /// Channels of the first stage (the second has twice as many).
    pub width: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            image_size: 224,
            classes: 10,
            width: 16,
        }
    }
}

impl ModelConfig {
    /// The input shape `[3, S, S]`.
    pub fn input_shape(&self) -> [usize; 3] {
        [3, self.image_size, self.image_size]
    }
}

/// Channel-last activations `[B, H, W, C]`.
type Act<D> = Tensor<(usize, usize, usize, usize), f32, D>;
type Mat<D> = Tensor<(usize, usize), f32, D>;
type Vector<D> = Tensor<(usize,), f32, D>;

/// A 3×3, stride-1, zero-padded convolution, as nine shifted 1×1 convolutions (matmuls over
/// channels). dfdx 0.13's own `conv2d` op is nightly-only; this uses only stable ops.
struct Conv3<D: Device<f32>> {
    /// `w[k]` is `[C_in, C_out]` for kernel position `k = 3·ky + kx`.
    w: Vec<Mat<D>>,
    b: Vector<D>,
}

impl<D: Device<f32>> Conv3<D> {
    fn forward(&self, dev: &D, x: Act<D>) -> Act<D> {
        let (b, h, w, c) = *x.shape();
        let cout = self.b.shape().0;
        // Zero-pad H and W by one on each side.
        let zr = dev.zeros_like(&(b, 1usize, w, c));
        let x = (zr.clone(), x).concat_along(Axis::<1>);
        let x = (x, zr).concat_along(Axis::<1>);
        let zc = dev.zeros_like(&(b, h + 2, 1usize, c));
        let x = (zc.clone(), x).concat_along(Axis::<2>);
        let x = (x, zc).concat_along(Axis::<2>);
        let m = b * h * w;
        let mut acc: Option<Mat<D>> = None;
        for ky in 0..3 {
            for kx in 0..3 {
                let win = x
                    .clone()
                    .slice((.., ky..ky + h, kx..kx + w, ..))
                    .reshape_like(&(m, c));
                let t = win.matmul(self.w[3 * ky + kx].clone());
                acc = Some(match acc {
                    None => t,
                    Some(a) => a + t,
                });
            }
        }
        let y = acc.expect("nine terms") + self.b.clone().broadcast_like::<_, Axis<0>>(&(m, cout));
        y.reshape_like(&(b, h, w, cout))
    }
}

/// A `p×p`, stride-`p` convolution (a patch embedding / downsampling layer) as
/// reshape → permute → matmul.
struct Patchify<D: Device<f32>> {
    /// `[p·p·C_in, C_out]`, rows in `(py, px, c)` order.
    w: Mat<D>,
    b: Vector<D>,
    p: usize,
}

impl<D: Device<f32>> Patchify<D> {
    /// `x` is `[B, H, W, C]` channel-last.
    fn forward(&self, x: Act<D>) -> Act<D> {
        let (b, h, w, c) = *x.shape();
        let (p, cout) = (self.p, self.b.shape().0);
        let (hp, wp) = (h / p, w / p);
        let t = x
            .reshape_like(&(b, hp, p, wp, p, c))
            .permute::<(usize, usize, usize, usize, usize, usize), Axes6<0, 1, 3, 2, 4, 5>>()
            .reshape_like(&(b * hp * wp, c * p * p));
        let y = t.matmul(self.w.clone())
            + self
                .b
                .clone()
                .broadcast_like::<_, Axis<0>>(&(b * hp * wp, cout));
        y.reshape_like(&(b, hp, wp, cout))
    }
}

/// The classifier: `patchify 4×4 (3→w) → res(w) → patchify 2×2 (w→2w) → res(2w) → mean → linear`,
/// each residual block being `relu(x + conv3(relu(conv3(x))))`.
pub struct ImageClassifier<D: Device<f32>> {
    dev: D,
    config: ModelConfig,
    stem: Patchify<D>,
    res1: [Conv3<D>; 2],
    down: Patchify<D>,
    res2: [Conv3<D>; 2],
    /// `[classes, 2w]` (PyTorch's layout), on the host: the head is a few hundred
    /// multiply-adds per image, cheaper here than a device round trip per image.
    head_w: Vec<f32>,
    head_b: Vec<f32>,
}

/// Names and shapes of every parameter, in PyTorch's layouts (conv `[out, in, kh, kw]`, linear
/// `[out, in]`), which are also the safetensors names and shapes.
pub(crate) fn param_shapes(c: &ModelConfig) -> Vec<(&'static str, Vec<usize>)> {
    let (w, w2) = (c.width, c.width * 2);
    vec![
        ("stem.weight", vec![w, 3, 4, 4]),
        ("stem.bias", vec![w]),
        ("res1.0.weight", vec![w, w, 3, 3]),
        ("res1.0.bias", vec![w]),
        ("res1.1.weight", vec![w, w, 3, 3]),
        ("res1.1.bias", vec![w]),
        ("down.weight", vec![w2, w, 2, 2]),
        ("down.bias", vec![w2]),
        ("res2.0.weight", vec![w2, w2, 3, 3]),
        ("res2.0.bias", vec![w2]),
        ("res2.1.weight", vec![w2, w2, 3, 3]),
        ("res2.1.bias", vec![w2]),
        ("head.weight", vec![c.classes, w2]),
        ("head.bias", vec![c.classes]),
    ]
}

/// A deterministic He-style initialisation from `seed` (splitmix64 + Box-Muller), independent of
/// dfdx's RNG so the same seed gives the same weights in any build.
pub(crate) fn seeded_params(c: &ModelConfig, seed: u64) -> HashMap<&'static str, Vec<f32>> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    };
    let mut out = HashMap::new();
    for (name, shape) in param_shapes(c) {
        let n: usize = shape.iter().product();
        let fan_in: usize = shape[1..].iter().product::<usize>().max(1);
        let scale = if name.ends_with("bias") {
            0.01
        } else {
            (2.0 / fan_in as f64).sqrt()
        };
        let v = (0..n)
            .map(|_| {
                let u1 = ((next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                let u2 = (next() >> 11) as f64 / (1u64 << 53) as f64;
                let g = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (g * scale) as f32
            })
            .collect();
        out.insert(name, v);
    }
    out
}

/// The parameters in a safetensors file, checked against `config` (see [`ImageClassifier::load`]).
pub(crate) fn load_params(
    config: ModelConfig,
    path: &Path,
) -> Result<HashMap<&'static str, Vec<f32>>> {
    config.check()?;
    let werr = |problem: String| Error::Weights {
        path: path.display().to_string(),
        problem,
    };
    let bytes = std::fs::read(path).map_err(|e| {
        werr(format!(
            "{e}; pass an existing weights file, or use seeded weights"
        ))
    })?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| werr(format!("not a safetensors file: {e}")))?;
    let mut params = HashMap::new();
    for (name, shape) in param_shapes(&config) {
        let t = st
            .tensor(name)
            .map_err(|_| werr(format!("has no tensor {name:?}")))?;
        if t.dtype() != StDtype::F32 {
            return Err(werr(format!("{name} is {:?}, expected F32", t.dtype())));
        }
        if t.shape() != shape.as_slice() {
            return Err(werr(format!(
                "{name} has shape {:?}, the model ({} classes, width {}) needs {:?}",
                t.shape(),
                config.classes,
                config.width,
                shape
            )));
        }
        let v: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        params.insert(name, v);
    }
    Ok(params)
}

/// The linear head on pooled features (`c` per image, one image after the other), on the host:
/// each score summed in the same order for every image, so a row's result does not depend on
/// the batch.
pub(crate) fn head(feats: &[f32], c: usize, head_w: &[f32], head_b: &[f32]) -> Vec<Vec<f32>> {
    feats
        .chunks_exact(c)
        .map(|f| {
            head_b
                .iter()
                .zip(head_w.chunks_exact(c))
                .map(|(&bias, w)| bias + f.iter().zip(w).map(|(a, b)| a * b).sum::<f32>())
                .collect()
        })
        .collect()
}

/// `[out, in, kh, kw]` → for each `(ky, kx)`, `[in, out]`.
fn conv3_taps(v: &[f32], cout: usize, cin: usize) -> Vec<Vec<f32>> {
    (0..9)
        .map(|k| {
            let mut m = vec![0.0; cin * cout];
            for o in 0..cout {
                for i in 0..cin {
                    m[i * cout + o] = v[(o * cin + i) * 9 + k];
                }
            }
            m
        })
        .collect()
}

/// `[out, in, p, p]` → `[(py, px, in), out]`, matching the patch layout built in
/// [`Patchify::forward`] (channel-last input, permuted to `(py, px, c)`).
fn patch_matrix(v: &[f32], cout: usize, cin: usize, p: usize) -> Vec<f32> {
    let mut m = vec![0.0; cin * p * p * cout];
    for o in 0..cout {
        for i in 0..cin {
            for py in 0..p {
                for px in 0..p {
                    let row = (py * p + px) * cin + i;
                    m[row * cout + o] = v[((o * cin + i) * p + py) * p + px];
                }
            }
        }
    }
    m
}

impl<D: Device<f32>> ImageClassifier<D> {
    /// A model with weights drawn from `seed`.
    pub fn from_seed(dev: &D, config: ModelConfig, seed: u64) -> Result<Self> {
        config.check()?;
        Ok(Self::from_params(dev, config, seeded_params(&config, seed)))
    }

    /// A model with weights from a safetensors file (f32 tensors named and shaped as
    /// PyTorch would: `stem.weight [w,3,4,4]`, …, `head.weight [classes, 2w]`; see
    /// `docs/model.md`).
    pub fn load(dev: &D, config: ModelConfig, path: &Path) -> Result<Self> {
        Ok(Self::from_params(dev, config, load_params(config, path)?))
    }

    /// Writes `seed`'s weights as a safetensors file (a starting point, or a fixture).
    pub fn save_seeded(config: ModelConfig, seed: u64, path: &Path) -> Result<()> {
        config.check()?;
        let params = seeded_params(&config, seed);
        let named: Vec<(String, Vec<usize>, Vec<u8>)> = param_shapes(&config)
            .into_iter()
            .map(|(n, s)| (n.to_string(), s, bytemuck::cast_slice(&params[n]).to_vec()))
            .collect();
        let views: Vec<(String, TensorView<'_>)> = named
            .iter()
            .map(|(n, s, d)| {
                (
                    n.clone(),
                    TensorView::new(StDtype::F32, s.clone(), d).expect("sizes match"),
                )
            })
            .collect();
        let werr = |e: String| Error::Weights {
            path: path.display().to_string(),
            problem: e,
        };
        let bytes = safetensors::serialize(views, None).map_err(|e| werr(e.to_string()))?;
        std::fs::write(path, bytes).map_err(|e| werr(e.to_string()))
    }

    fn from_params(dev: &D, config: ModelConfig, p: HashMap<&'static str, Vec<f32>>) -> Self {
        let (w, w2) = (config.width, config.width * 2);
        let vec1 = |name: &str, n: usize| dev.tensor_from_vec(p[name].clone(), (n,));
        let conv3 = |name: &str, bias: &str, cin: usize, cout: usize| Conv3 {
            w: conv3_taps(&p[name], cout, cin)
                .into_iter()
                .map(|m| dev.tensor_from_vec(m, (cin, cout)))
                .collect(),
            b: vec1(bias, cout),
        };
        let patch = |name: &str, bias: &str, cin: usize, cout: usize, pp: usize| Patchify {
            w: dev.tensor_from_vec(patch_matrix(&p[name], cout, cin, pp), (cin * pp * pp, cout)),
            b: vec1(bias, cout),
            p: pp,
        };
        ImageClassifier {
            dev: dev.clone(),
            config,
            stem: patch("stem.weight", "stem.bias", 3, w, 4),
            res1: [
                conv3("res1.0.weight", "res1.0.bias", w, w),
                conv3("res1.1.weight", "res1.1.bias", w, w),
            ],
            down: patch("down.weight", "down.bias", w, w2, 2),
            res2: [
                conv3("res2.0.weight", "res2.0.bias", w2, w2),
                conv3("res2.1.weight", "res2.1.bias", w2, w2),
            ],
            head_w: p["head.weight"].clone(),
            head_b: p["head.bias"].clone(),
        }
    }

    /// The model's configuration.
    pub fn config(&self) -> ModelConfig {
        self.config
    }

    /// Class scores (logits) for images `[B, 3, S, S]` (NCHW, as producers write them), one row
    /// per image.
    pub fn forward(&self, x: Tensor4<D>) -> Vec<Vec<f32>> {
        let dev = &self.dev;
        // NCHW → NHWC (one copy), the layout the matmul-based convolutions use.
        let (b, c, h, w) = *x.shape();
        let x: Act<D> = x
            .permute::<(usize, usize, usize, usize), Axes4<0, 2, 3, 1>>()
            .reshape_like(&(b, h, w, c));
        let x = self.stem.forward(x).relu();
        let y = self.res1[0].forward(dev, x.clone()).relu();
        let x = (self.res1[1].forward(dev, y) + x).relu();
        let x = self.down.forward(x).relu();
        let y = self.res2[0].forward(dev, x.clone()).relu();
        let x = (self.res2[1].forward(dev, y) + x).relu();
        let (b, h, w, c) = *x.shape();
        let pooled: Mat<D> = x
            .reshape_like(&(b, h * w, c))
            .mean::<(usize, usize), Axis<1>>();
        head(&pooled.as_vec(), c, &self.head_w, &self.head_b)
    }

    /// Scores for a batch given as one flat NCHW buffer `[B·3·S·S]` (for in-process runs).
    pub fn forward_flat(&self, data: Vec<f32>, batch: usize) -> Vec<Vec<f32>> {
        let s = self.config.image_size;
        self.forward(self.dev.tensor_from_vec(data, (batch, 3, s, s)))
    }
}

impl ModelConfig {
    /// Refuses shapes the model cannot take.
    pub fn check(&self) -> Result<()> {
        if self.image_size == 0 || !self.image_size.is_multiple_of(8) {
            return Err(Error::Config(format!(
                "image size {} must be a positive multiple of 8",
                self.image_size
            )));
        }
        if self.classes == 0 || self.width == 0 {
            return Err(Error::Config("classes and width must be positive".into()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
