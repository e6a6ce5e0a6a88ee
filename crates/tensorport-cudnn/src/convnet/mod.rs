//! A small convolutional network run with cuDNN: a chain of convolutions, each followed by its
//! bias, an optional residual (an earlier activation added) and a ReLU, then the last
//! activation averaged over its height and width. The convolutions are cuDNN's (the algorithm
//! measured fastest for each layer and batch size), with the bias, residual and ReLU in the
//! same cuDNN call or in one small kernel of ours after it; the average is a kernel of ours.
//! A first layer that cuts the image into patches (kernel side = stride, no padding, as the
//! bundled classifier's stem) is a kernel of ours too: it reads the producers' NCHW floats
//! directly and writes the network's type and layout, so the input is never converted apart.
//!
//! Precision: `F32` keeps every multiply in fp32 (no TF32), as PyTorch does with TF32 off;
//! `Tf32` lets the convolutions use TF32 tensor cores; `F16` and `Bf16` keep the activations
//! and weights in 16 bits, accumulating in fp32. Biases, residual sums, the average and the
//! scores are always fp32.

use std::collections::HashMap;
use std::sync::Arc;

use crate::cudnn::{self, Algo, ConvDesc, DataType, FilterDesc, Handle, Relu, TensorDesc};
use crate::cudnn_graph::{ConvShape, GraphConv};
use crate::{Error, Result};
use tensorport_cuda::{DeviceBuffer, Gpu, Kernel, PinnedBuffer, Stream};

mod plan;
mod precision;
mod run;

pub use precision::{Layout, Precision};

/// The kernels, for one element type `T`. The stem kernel's shape (`STEM_K` output channels,
/// `STEM_C` input channels, `STEM_S` the kernel side and stride) is defined before this.
const KERNELS: &str = include_str!("../kernels/convnet.cu");

/// One convolution of a [`ConvNet`], with its weights in PyTorch's layouts.
#[derive(Debug, Clone)]
pub struct ConvLayer {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// Kernel side (square kernels).
    pub kernel: usize,
    /// Stride, both ways.
    pub stride: usize,
    /// Zero padding on every side.
    pub padding: usize,
    /// `[out_channels, in_channels, kernel, kernel]`.
    pub weight: Vec<f32>,
    /// `[out_channels]`.
    pub bias: Vec<f32>,
    /// An earlier activation added before the ReLU: `0` is the network's input, `i` the
    /// output of layer `i - 1`. It must have this layer's output shape.
    pub residual: Option<usize>,
}

/// A layer on the device.
struct Layer {
    spec: ConvLayer,
    /// Output `[C, H, W]`.
    out: [usize; 3],
    weight: DeviceBuffer,
    /// fp32, for the epilogue kernel.
    bias: DeviceBuffer,
    /// In the element type, for cuDNN's fused call (`None`: `bias` is that).
    bias_t: Option<DeviceBuffer>,
    /// `[1, C, 1, 1]` in the element type.
    bias_desc: TensorDesc,
    filter: FilterDesc,
    conv: ConvDesc,
    /// Whether cuDNN's fused convolution + bias + residual + ReLU runs this layer (else the
    /// convolution, then the epilogue kernel). Cleared the first time cuDNN refuses it.
    fused: bool,
}

/// Descriptors and algorithms for one batch size.
struct Plan {
    /// `descs[i]` is activation `i`'s (`0`: the input).
    descs: Vec<TensorDesc>,
    algos: Vec<(Algo, usize)>,
    /// Layer `i`'s convolution as a graph-API plan, where that was measured the faster.
    graphs: Vec<Option<GraphConv>>,
}

/// A convolutional network on one GPU, run with cuDNN on its own stream (see the module docs).
/// Not `Sync`: one thread runs it at a time.
pub struct ConvNet {
    gpu: Arc<Gpu>,
    // Dropped before the stream (fields drop in order).
    handle: Handle,
    stream: Stream,
    precision: Precision,
    layout: Layout,
    input: [usize; 3],
    layers: Vec<Layer>,
    convert: Kernel,
    epilogue: Kernel,
    mean: Kernel,
    mean_nhwc: Kernel,
    mean_sum: Kernel,
    /// The first layer as a kernel of ours, where it cuts the image into patches: its fp32
    /// weights and the kernel.
    stem: Option<(DeviceBuffer, Kernel)>,
    /// Whether `stem` runs the first layer (else cuDNN does, after the input is converted).
    own_stem: bool,
    relu: Relu,
    plans: HashMap<usize, Plan>,
    /// Which layers run on graph-API plans, decided by timing at the first batch size planned.
    graph_chosen: Option<Vec<bool>>,
    /// The fastest algorithms, per layer, measured for a power-of-two batch size.
    found: HashMap<usize, Vec<Algo>>,
    /// `acts[0]` is the input in the network's type and layout (unused for NCHW fp32), `acts[i]` the
    /// output of layer `i - 1`; each sized for `capacity` images.
    acts: Vec<DeviceBuffer>,
    capacity: usize,
    workspace: Option<DeviceBuffer>,
    pooled: Option<DeviceBuffer>,
    /// NHWC: the mean's partial sums (`MEAN_CHUNK` pixels each) for `capacity` images.
    partial: Option<DeviceBuffer>,
    /// Page-locked host memory the pooled rows are copied into (so the copy is asynchronous).
    pooled_host: Option<PinnedBuffer>,
    /// A launched batch not yet collected: its rows, and the layers cuDNN refused to fuse.
    in_flight: Option<(usize, Vec<usize>)>,
}

impl std::fmt::Debug for ConvNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConvNet")
            .field("precision", &self.precision)
            .field("layout", &self.layout)
            .field("input", &self.input)
            .field("layers", &self.layers.len())
            .finish_non_exhaustive()
    }
}

/// Launch shape for `n` elements, 256 threads a block.
fn blocks(n: usize) -> Result<(u32, u32, u32)> {
    let b = u32::try_from(n.div_ceil(256))
        .map_err(|_| Error::TooLarge("a tensor too large for one launch"))?;
    Ok((b.max(1), 1, 1))
}

impl ConvNet {
    /// Uploads `layers` to `gpu` for inputs `[C, H, W]` = `input`, checking that each layer's
    /// input is the previous one's output and each residual matches its layer's output.
    /// Fails with [`Error::NoCudnn`] where cuDNN cannot be loaded, and with a cuDNN error
    /// where the device does not support `precision` (bf16 needs compute capability 8.0).
    pub fn new(
        gpu: &Arc<Gpu>,
        input: [usize; 3],
        layers: Vec<ConvLayer>,
        precision: Precision,
        layout: Layout,
    ) -> Result<ConvNet> {
        cudnn::available()?;
        let bad = |m: String| Error::Cudnn {
            call: "ConvNet::new",
            status: m,
        };
        if layers.is_empty() {
            return Err(bad("a network needs at least one layer".into()));
        }
        // Shapes: activation i is [C, H, W].
        let mut shapes = vec![input];
        for (i, l) in layers.iter().enumerate() {
            let [c, h, w] = shapes[i];
            if l.in_channels != c {
                return Err(bad(format!(
                    "layer {i} takes {} channels, its input has {c}",
                    l.in_channels
                )));
            }
            if l.kernel == 0 || l.stride == 0 || h + 2 * l.padding < l.kernel {
                return Err(bad(format!("layer {i}: kernel, stride or input too small")));
            }
            if l.weight.len() != l.out_channels * l.in_channels * l.kernel * l.kernel
                || l.bias.len() != l.out_channels
            {
                return Err(bad(format!("layer {i}: weights or bias of the wrong size")));
            }
            let ho = (h + 2 * l.padding - l.kernel) / l.stride + 1;
            let wo = (w + 2 * l.padding - l.kernel) / l.stride + 1;
            let out = [l.out_channels, ho, wo];
            if let Some(r) = l.residual {
                if r > i || shapes[r] != out {
                    return Err(bad(format!(
                        "layer {i}: residual {r} is not an earlier activation of its output's shape"
                    )));
                }
            }
            shapes.push(out);
        }
        if shapes
            .iter()
            .any(|s| u32::try_from(s.iter().product::<usize>()).is_err())
        {
            return Err(bad("an activation too large for one image".into()));
        }
        let stem_shape = stem_shape(&layers[0]);
        let stream = Stream::new(gpu)?;
        let handle = Handle::new(gpu, &stream)?;
        let (k, c, s) = stem_shape.unwrap_or((1, 1, 1));
        let src = format!(
            "{}#define STEM_K {k}\n#define STEM_C {c}\n#define STEM_S {s}\n{KERNELS}",
            precision.kernel_prelude()
        );
        let file = format!("tensorport_net_{}.cu", precision.name());
        let [convert, epilogue, mean, mean_nhwc, mean_sum, stem_kernel] = Kernel::compile_all(
            gpu,
            &src,
            &file,
            [
                c"tp_net_convert",
                c"tp_net_epilogue",
                c"tp_net_mean",
                c"tp_net_mean_nhwc",
                c"tp_net_mean_sum",
                c"tp_net_stem",
            ],
        )?;
        let stem = match stem_shape {
            Some(_) => {
                let w: Vec<u8> = layers[0]
                    .weight
                    .iter()
                    .flat_map(|x| x.to_ne_bytes())
                    .collect();
                let buf = DeviceBuffer::new(gpu, w.len())?;
                // SAFETY: `buf` holds exactly `w`'s bytes; the stream is synchronised right
                // after, before `w` goes.
                unsafe { stream.copy_host_to_device_async(buf.ptr(), &w)? };
                stream.synchronize()?;
                Some((buf, stem_kernel))
            }
            None => None,
        };
        let dtype = precision.data_type();
        let mut on_device = Vec::with_capacity(layers.len());
        for (i, spec) in layers.into_iter().enumerate() {
            let wbytes: Vec<u8> = spec.weight.iter().flat_map(|x| x.to_ne_bytes()).collect();
            let bbytes: Vec<u8> = spec.bias.iter().flat_map(|x| x.to_ne_bytes()).collect();
            let bias = DeviceBuffer::new(gpu, bbytes.len())?;
            let weight = DeviceBuffer::new(gpu, spec.weight.len() * precision.bytes())?;
            // Other types and layouts are converted on the device from an fp32 copy.
            let f32s = if as_given(precision, layout) {
                None
            } else {
                Some(DeviceBuffer::new(gpu, wbytes.len())?)
            };
            // SAFETY: each buffer holds exactly its bytes; the stream is synchronised below,
            // before the host bytes and the fp32 copy go.
            unsafe {
                stream.copy_host_to_device_async(bias.ptr(), &bbytes)?;
                match &f32s {
                    None => stream.copy_host_to_device_async(weight.ptr(), &wbytes)?,
                    Some(f) => {
                        stream.copy_host_to_device_async(f.ptr(), &wbytes)?;
                        launch_convert(
                            &convert,
                            &stream,
                            (f.ptr().raw(), weight.ptr().raw()),
                            spec.out_channels,
                            (spec.in_channels, spec.kernel * spec.kernel),
                            layout,
                        )?;
                    }
                }
            }
            let bias_t = if precision.bytes() == 4 {
                None
            } else {
                let t = DeviceBuffer::new(gpu, spec.bias.len() * precision.bytes())?;
                // SAFETY: `bias` holds the layer's channels in fp32, `t` as many elements; both
                // live past the synchronisation below.
                unsafe {
                    launch_convert(
                        &convert,
                        &stream,
                        (bias.ptr().raw(), t.ptr().raw()),
                        spec.bias.len(),
                        (1, 1),
                        Layout::Nchw,
                    )?
                };
                Some(t)
            };
            stream.synchronize()?;
            drop(f32s);
            let bias_desc = TensorDesc::new(dtype, layout.format(), [1, spec.out_channels, 1, 1])?;
            let filter = FilterDesc::new(
                dtype,
                layout.format(),
                [
                    spec.out_channels,
                    spec.in_channels,
                    spec.kernel,
                    spec.kernel,
                ],
            )?;
            let conv = ConvDesc::new(
                spec.padding,
                spec.stride,
                DataType::CUDNN_DATA_FLOAT,
                precision.math(),
            )?;
            on_device.push(Layer {
                out: shapes[i + 1],
                spec,
                weight,
                bias,
                bias_t,
                bias_desc,
                filter,
                conv,
                fused: true,
            });
        }
        Ok(ConvNet {
            gpu: gpu.clone(),
            handle,
            stream,
            precision,
            layout,
            input,
            layers: on_device,
            convert,
            epilogue,
            mean,
            mean_nhwc,
            mean_sum,
            stem,
            own_stem: true,
            relu: Relu::new()?,
            plans: HashMap::new(),
            found: HashMap::new(),
            graph_chosen: None,
            acts: Vec::new(),
            capacity: 0,
            workspace: None,
            pooled: None,
            partial: None,
            pooled_host: None,
            in_flight: None,
        })
    }

    /// The most images a batch may hold: the kernels take the images as a grid's second
    /// dimension.
    pub const MAX_BATCH: usize = 65_535;

    /// The network's precision.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The network's memory layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// How many layers cuDNN may run fused (convolution, bias, residual and ReLU in one call:
    /// in 32 bits, and in 16 bits for batches of 128 or more, where it is the faster); the
    /// others run the convolution and then a kernel of ours.
    pub fn fused_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.fused).count()
    }

    /// Whether to fuse (the default): cuDNN's fused call where it is the faster, and a first
    /// layer that cuts the image into patches run by a kernel of ours straight from the input;
    /// or to run every convolution with cuDNN and the epilogue kernel apart (to compare).
    pub fn set_fused(&mut self, fused: bool) {
        for l in &mut self.layers {
            l.fused = fused;
        }
        self.own_stem = fused;
    }

    /// How many layers run on cuDNN graph-API plans (chosen by timing when the first batch
    /// size is planned; 0 before).
    pub fn graph_layers(&self) -> usize {
        self.graph_chosen
            .as_ref()
            .map_or(0, |c| c.iter().filter(|&&g| g).count())
    }

    /// Whether a kernel of ours runs the first layer (see [`ConvNet::set_fused`]).
    pub fn stem_kernel(&self) -> bool {
        self.own_stem && self.stem.is_some()
    }

    /// Whether the input is converted into the network's type and layout before the first
    /// layer (into `acts[0]`): unless it is taken as given, or the stem kernel reads it and no
    /// later layer adds it as its residual.
    pub(super) fn converts_input(&self) -> bool {
        !as_given(self.precision, self.layout)
            && (!self.stem_kernel() || self.layers.iter().any(|l| l.spec.residual == Some(0)))
    }

    /// How many `MEAN_CHUNK`-pixel parts the NHWC mean sums each image's last activation in.
    pub(super) fn mean_chunks(&self) -> usize {
        self.layers
            .last()
            .map_or(1, |l| (l.out[1] * l.out[2]).div_ceil(MEAN_CHUNK))
    }

    /// Channels of the last activation (the length of each image's pooled row).
    pub fn out_channels(&self) -> usize {
        self.layers.last().map_or(0, |l| l.out[0])
    }

    /// The loaded cuDNN's version, e.g. 91400 for 9.14.0.
    pub fn cudnn_version() -> Result<usize> {
        cudnn::available()?;
        Ok(cudnn::version())
    }
}

/// Whether cuDNN's fused call is the faster for `batch` images at `precision`: always in 32
/// bits; in 16 bits only for large batches (measured on an H200, docs/benchmarks.md: at 32
/// images the convolutions run apart were 9–35% faster, at 256 the fused call 18–44%).
fn fuse_at(precision: Precision, batch: usize) -> bool {
    precision.bytes() == 4 || batch >= 128
}

/// Whether a network of `precision` and `layout` takes its input (NCHW fp32) as it is.
fn as_given(precision: Precision, layout: Layout) -> bool {
    precision.bytes() == 4 && layout == Layout::Nchw
}

/// Enqueues `images` × `(channels, plane)` NCHW floats at `src` converted into the element
/// type and `layout` at `dst`.
///
/// # Safety
/// `src` and `dst` must hold `images × channels × plane` elements each, valid until `stream`
/// has run the kernel.
unsafe fn launch_convert(
    convert: &Kernel,
    stream: &Stream,
    (src, dst): (u64, u64),
    images_: usize,
    (channels, plane): (usize, usize),
    layout: Layout,
) -> Result<()> {
    let too_large = |_| Error::TooLarge("a tensor too large for one launch");
    let (mut s, mut d) = (src, dst);
    let (mut c, mut p, mut nhwc) = (
        u32::try_from(channels).map_err(too_large)?,
        u32::try_from(plane).map_err(too_large)?,
        i32::from(layout == Layout::Nhwc),
    );
    let mut params: [*mut std::ffi::c_void; 5] = [
        (&mut s as *mut u64).cast(),
        (&mut d as *mut u64).cast(),
        (&mut c as *mut u32).cast(),
        (&mut p as *mut u32).cast(),
        (&mut nhwc as *mut i32).cast(),
    ];
    let grid = (blocks(plane)?.0, images(images_)?, 1);
    // SAFETY: the parameters match `tp_net_convert`'s; the caller's contract covers the memory.
    Ok(unsafe { convert.launch(grid, (256, 1, 1), stream, &mut params) }?)
}

/// Runs of a layer timed to choose between cuDNN's legacy call and a graph plan.
const TIMING_RUNS: usize = 3;

/// Pixels of the last activation each block of the NHWC mean sums (`tp_net_mean_nhwc`'s 64).
const MEAN_CHUNK: usize = 64;

/// `n` images as a grid's second dimension.
fn images(n: usize) -> Result<u32> {
    if n > ConvNet::MAX_BATCH {
        return Err(Error::TooLarge("a batch of more than 65,535 images"));
    }
    Ok(n as u32)
}

/// The stem kernel's `(STEM_K, STEM_C, STEM_S)` for `l`, where a kernel of ours runs it: a
/// convolution that cuts the image into patches (kernel side = stride, no padding, no
/// residual), with few enough output channels and weights for registers and shared memory.
fn stem_shape(l: &ConvLayer) -> Option<(usize, usize, usize)> {
    let fits = l.kernel == l.stride
        && l.padding == 0
        && l.residual.is_none()
        && (1..=64).contains(&l.out_channels)
        && l.out_channels * l.in_channels * l.kernel * l.kernel <= 4096;
    fits.then_some((l.out_channels, l.in_channels, l.kernel))
}

impl Drop for ConvNet {
    fn drop(&mut self) {
        // The buffers must not be freed under running work.
        let _ = self.stream.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preferred_layout_follows_the_measured_table() {
        for batch in [1, 32, 127, 128, 256] {
            assert_eq!(Layout::preferred(Precision::F32, batch), Layout::Nchw);
            assert_eq!(Layout::preferred(Precision::F16, batch), Layout::Nhwc);
            assert_eq!(Layout::preferred(Precision::Bf16, batch), Layout::Nhwc);
        }
        assert_eq!(Layout::preferred(Precision::Tf32, 127), Layout::Nchw);
        assert_eq!(Layout::preferred(Precision::Tf32, 128), Layout::Nhwc);
    }
}
