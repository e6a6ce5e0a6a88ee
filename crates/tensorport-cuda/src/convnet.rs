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

use crate::cudnn::{
    self, Algo, ConvDesc, DataType, FilterDesc, Format, Handle, MathType, Relu, TensorDesc,
};
use crate::cudnn_graph::{ConvShape, GraphConv};
use crate::kernel::Kernel;
use crate::{DeviceBuffer, Error, Gpu, PinnedBuffer, Result, Stream};

/// Arithmetic of a [`ConvNet`]'s convolutions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Precision {
    /// fp32 everywhere, FMA only (no TF32 tensor cores).
    #[default]
    F32,
    /// fp32 data; the convolutions may use TF32 tensor cores (10-bit mantissa products).
    Tf32,
    /// bfloat16 activations and weights, fp32 accumulation.
    Bf16,
    /// IEEE half activations and weights, fp32 accumulation.
    F16,
}

impl Precision {
    /// Every precision, in the order of the tables.
    pub const ALL: [Precision; 4] = [
        Precision::F32,
        Precision::Tf32,
        Precision::Bf16,
        Precision::F16,
    ];

    /// The name used on command lines and in tables.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// The precision named `s` (as [`Precision::name`] writes it).
    pub fn from_name(s: &str) -> Option<Precision> {
        Precision::ALL.into_iter().find(|p| p.name() == s)
    }

    fn data_type(self) -> DataType {
        match self {
            Precision::F32 | Precision::Tf32 => DataType::CUDNN_DATA_FLOAT,
            Precision::Bf16 => DataType::CUDNN_DATA_BFLOAT16,
            Precision::F16 => DataType::CUDNN_DATA_HALF,
        }
    }

    fn math(self) -> MathType {
        match self {
            Precision::F32 => MathType::CUDNN_FMA_MATH,
            Precision::Tf32 => MathType::CUDNN_DEFAULT_MATH,
            Precision::Bf16 | Precision::F16 => MathType::CUDNN_TENSOR_OP_MATH,
        }
    }

    /// Bytes per activation or weight.
    fn bytes(self) -> usize {
        match self {
            Precision::F32 | Precision::Tf32 => 4,
            Precision::Bf16 | Precision::F16 => 2,
        }
    }

    /// The element type's loads and stores, for the kernels.
    fn kernel_prelude(self) -> &'static str {
        match self {
            Precision::F32 | Precision::Tf32 => {
                "typedef float T;\n\
                 __device__ __forceinline__ float ld(const T* p, unsigned long long i) { return p[i]; }\n\
                 __device__ __forceinline__ void st(T* p, unsigned long long i, float v) { p[i] = v; }\n"
            }
            Precision::F16 => {
                "typedef unsigned short T;\n\
                 __device__ __forceinline__ float ld(const T* p, unsigned long long i) {\n\
                   float f; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(p[i])); return f; }\n\
                 __device__ __forceinline__ void st(T* p, unsigned long long i, float v) {\n\
                   unsigned short h; asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(v)); p[i] = h; }\n"
            }
            Precision::Bf16 => {
                "typedef unsigned short T;\n\
                 __device__ __forceinline__ float ld(const T* p, unsigned long long i) {\n\
                   return __uint_as_float(((unsigned int)p[i]) << 16); }\n\
                 __device__ __forceinline__ void st(T* p, unsigned long long i, float v) {\n\
                   unsigned short h; asm(\"cvt.rn.bf16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(v)); p[i] = h; }\n"
            }
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a [`ConvNet`] lays out its activations and weights in memory. The input is always NCHW
/// fp32 (as producers write it); an NHWC network converts it first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Layout {
    /// Channel planes (`[N, C, H, W]`), PyTorch's default.
    Nchw,
    /// Channels last (`[N, H, W, C]`), what tensor cores read without a transposition.
    Nhwc,
}

impl Layout {
    /// Both layouts.
    pub const ALL: [Layout; 2] = [Layout::Nchw, Layout::Nhwc];

    /// The faster layout for `precision` at batches of up to `batch` images (measured on an
    /// H200 with the bundled classifier, docs/benchmarks.md): NCHW for fp32, NHWC for the
    /// 16-bit types, and for TF32 NCHW below 128 images, NHWC from there.
    pub fn preferred(precision: Precision, batch: usize) -> Layout {
        match precision {
            Precision::F32 => Layout::Nchw,
            Precision::F16 | Precision::Bf16 => Layout::Nhwc,
            Precision::Tf32 if batch >= 128 => Layout::Nhwc,
            Precision::Tf32 => Layout::Nchw,
        }
    }

    /// `NCHW` or `NHWC`.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Nchw => "NCHW",
            Layout::Nhwc => "NHWC",
        }
    }

    fn format(self) -> Format {
        match self {
            Layout::Nchw => Format::CUDNN_TENSOR_NCHW,
            Layout::Nhwc => Format::CUDNN_TENSOR_NHWC,
        }
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The kernels, for one element type `T`. The stem kernel's shape (`STEM_K` output channels,
/// `STEM_C` input channels, `STEM_S` the kernel side and stride) is defined before this.
const KERNELS: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
// Images of `channels` planes of `plane` NCHW floats at x into y in the element type: the same
// order, or channels last (`nhwc`). Grid: (ceil(plane / 256), images).
extern "C" __global__ void tp_net_convert(const float* x, T* y, u32 channels, u32 plane,
                                          int nhwc) {
    u32 p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= plane) return;
    u64 base = (u64)blockIdx.y * channels * plane;
    const float* src = x + base + p;
    for (u32 c = 0; c < channels; c++)
        st(y, base + (nhwc ? (u64)p * channels + c : (u64)c * plane + p), src[(u64)c * plane]);
}
// y = relu(y + bias[channel] + z), z optional (0), for images of `channels` x `plane` values.
// Grid: (ceil(channels * plane / 256), images).
extern "C" __global__ void tp_net_epilogue(T* y, const float* bias, const T* z, u32 plane,
                                           u32 channels, int nhwc) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= channels * plane) return;
    u64 at = (u64)blockIdx.y * channels * plane + i;
    float v = ld(y, at) + bias[nhwc ? i % channels : i / plane];
    if (z) v += ld(z, at);
    st(y, at, v > 0.0f ? v : 0.0f);
}
// NCHW: one block of 256 threads per (image, channel) plane of `plane` values: its mean.
extern "C" __global__ void tp_net_mean(const T* x, float* out, u32 plane) {
    __shared__ float part[256];
    const T* row = x + (u64)blockIdx.x * plane;
    float s = 0.0f;
    for (u32 j = threadIdx.x; j < plane; j += blockDim.x) s += ld(row, j);
    part[threadIdx.x] = s;
    __syncthreads();
    for (u32 k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) part[threadIdx.x] += part[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = part[0] / (float)plane;
}
// NHWC, first pass: block (b, image) sums pixels [b * 64, b * 64 + 64) of the image, for
// every channel, into part[image][b][channel]. With at most 256 channels, thread t sums
// channel t % channels over every (256 / channels)-th of those pixels (neighbouring threads
// read neighbouring values); with more, thread t sums channels t, t + 256, ... Grid:
// (ceil(plane / 64), images), 256 threads.
extern "C" __global__ void tp_net_mean_nhwc(const T* x, float* part, u32 plane, u32 channels) {
    __shared__ float acc[256];
    const T* img = x + (u64)blockIdx.y * plane * channels;
    float* o = part + ((u64)blockIdx.y * gridDim.x + blockIdx.x) * channels;
    u32 first = blockIdx.x * 64, last = min(first + 64, plane);
    u32 t = threadIdx.x;
    if (channels > blockDim.x) {
        for (u32 c = t; c < channels; c += blockDim.x) {
            float s = 0.0f;
            for (u32 j = first; j < last; j++) s += ld(img, (u64)j * channels + c);
            o[c] = s;
        }
        return;
    }
    u32 groups = blockDim.x / channels;
    float s = 0.0f;
    if (t < groups * channels)
        for (u32 j = first + t / channels; j < last; j += groups)
            s += ld(img, (u64)j * channels + t % channels);
    acc[t] = s;
    __syncthreads();
    if (t < channels) {
        float a = 0.0f;
        for (u32 g = 0; g < groups; g++) a += acc[g * channels + t];
        o[t] = a;
    }
}
// NHWC, second pass: out[image][c] = the image's `chunks` partial sums of channel c, over
// `plane`. Grid: (ceil(channels / 256), images), 256 threads.
extern "C" __global__ void tp_net_mean_sum(const float* part, float* out, u32 chunks,
                                           u32 channels, u32 plane) {
    u32 c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const float* p = part + (u64)blockIdx.y * chunks * channels + c;
    float s = 0.0f;
    for (u32 b = 0; b < chunks; b++) s += p[(u64)b * channels];
    out[(u64)blockIdx.y * channels + c] = s / (float)plane;
}
// The first layer when it cuts the image into patches (kernel side = stride, no padding): from
// the NCHW floats x straight to y in the element type and layout, with the bias and ReLU,
// accumulating in fp32. w: [STEM_K][STEM_C][STEM_S][STEM_S] floats, bias: [STEM_K] floats.
// One thread per output pixel. Grid: (ceil(oh * ow / 128), images), 128 threads.
#define STEM_W (STEM_K * STEM_C * STEM_S * STEM_S)
extern "C" __global__ void tp_net_stem(const float* x, const float* w, const float* bias, T* y,
                                       u32 h, u32 wd, u32 oh, u32 ow, int nhwc) {
    // Weights as [c][r][s][k]: one input value meets its STEM_K weights side by side.
    __shared__ __align__(16) float ws[STEM_W];
    __shared__ float bs[STEM_K];
    for (u32 i = threadIdx.x; i < STEM_W; i += blockDim.x) {
        u32 k = i / (STEM_C * STEM_S * STEM_S), crs = i % (STEM_C * STEM_S * STEM_S);
        ws[crs * STEM_K + k] = w[i];
    }
    for (u32 i = threadIdx.x; i < STEM_K; i += blockDim.x) bs[i] = bias[i];
    __syncthreads();
    u32 npix = oh * ow;
    u32 p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= npix) return;
    u32 r0 = (p / ow) * STEM_S, c0 = (p % ow) * STEM_S;
    const float* img = x + (u64)blockIdx.y * STEM_C * h * wd;
    float acc[STEM_K];
#pragma unroll
    for (int k = 0; k < STEM_K; k++) acc[k] = bs[k];
    for (int c = 0; c < STEM_C; c++) {
#pragma unroll
        for (int r = 0; r < STEM_S; r++) {
            const float* row = img + ((u64)c * h + r0 + r) * wd + c0;
#pragma unroll
            for (int s = 0; s < STEM_S; s++) {
                float v = row[s];
                const float* wk = ws + ((c * STEM_S + r) * STEM_S + s) * STEM_K;
#pragma unroll
                for (int k = 0; k < STEM_K; k++) acc[k] = fmaf(v, wk[k], acc[k]);
            }
        }
    }
    u64 out = (u64)blockIdx.y * STEM_K * npix;
    if (nhwc) {
        T* dst = y + out + (u64)p * STEM_K;
        if ((STEM_K * sizeof(T)) % 16 == 0) {
            __align__(16) T tmp[STEM_K];
#pragma unroll
            for (int k = 0; k < STEM_K; k++) st(tmp, k, acc[k] > 0.0f ? acc[k] : 0.0f);
#pragma unroll
            for (int q = 0; q < (int)(STEM_K * sizeof(T) / 16); q++)
                ((uint4*)dst)[q] = ((const uint4*)tmp)[q];
        } else {
#pragma unroll
            for (int k = 0; k < STEM_K; k++) st(dst, k, acc[k] > 0.0f ? acc[k] : 0.0f);
        }
    } else {
#pragma unroll
        for (int k = 0; k < STEM_K; k++)
            st(y, out + (u64)k * npix + p, acc[k] > 0.0f ? acc[k] : 0.0f);
    }
}
"#;

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
        .map_err(|_| Error::BadAnswer("a tensor too large for one launch"))?;
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
                            (f.ptr(), weight.ptr()),
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
                        (bias.ptr(), t.ptr()),
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
    fn converts_input(&self) -> bool {
        !as_given(self.precision, self.layout)
            && (!self.stem_kernel() || self.layers.iter().any(|l| l.spec.residual == Some(0)))
    }

    /// How many `MEAN_CHUNK`-pixel parts the NHWC mean sums each image's last activation in.
    fn mean_chunks(&self) -> usize {
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

    /// Measures the algorithms for batches of `batch` images now (they then serve every
    /// batch size), rather than at the first batch.
    pub fn prepare(&mut self, batch: usize) -> Result<()> {
        // Growing replaces the buffers a batch in flight writes.
        self.collect()?;
        self.grow(batch)?;
        self.plan(batch).map(|_| ())
    }

    /// Makes room for `batch` images.
    fn grow(&mut self, batch: usize) -> Result<()> {
        let input: usize = self.input.iter().product();
        let elem = self.precision.bytes();
        let input_copy = |n: usize| {
            if self.converts_input() {
                n * input * elem
            } else {
                1
            }
        };
        if batch <= self.capacity
            && !self.acts.is_empty()
            && self.acts[0].len() >= input_copy(self.capacity)
        {
            return Ok(());
        }
        // The stream may still read the old buffers.
        self.stream.synchronize()?;
        let n = batch.max(self.capacity).max(1);
        let mut acts = Vec::with_capacity(self.layers.len() + 1);
        acts.push(DeviceBuffer::new(&self.gpu, input_copy(n))?);
        for l in &self.layers {
            acts.push(DeviceBuffer::new(
                &self.gpu,
                n * l.out.iter().product::<usize>() * elem,
            )?);
        }
        self.pooled = Some(DeviceBuffer::new(&self.gpu, n * self.out_channels() * 4)?);
        self.partial = match self.layout {
            Layout::Nhwc => Some(DeviceBuffer::new(
                &self.gpu,
                n * self.mean_chunks() * self.out_channels() * 4,
            )?),
            Layout::Nchw => None,
        };
        self.pooled_host = Some(PinnedBuffer::new(&self.gpu, n * self.out_channels() * 4)?);
        self.acts = acts;
        self.capacity = n;
        Ok(())
    }

    /// The plan for `batch` images, made (and its algorithms measured) the first time.
    fn plan(&mut self, batch: usize) -> Result<&Plan> {
        if !self.plans.contains_key(&batch) {
            let dtype = self.precision.data_type();
            let mut descs = vec![TensorDesc::new(
                dtype,
                self.layout.format(),
                [batch, self.input[0], self.input[1], self.input[2]],
            )?];
            for l in &self.layers {
                descs.push(TensorDesc::new(
                    dtype,
                    self.layout.format(),
                    [batch, l.out[0], l.out[1], l.out[2]],
                )?);
            }
            // Measuring takes cuDNN a tenth of a second or more — a stall in a serving loop — so
            // it is done once, for the first power of two asked for (`prepare`: the largest
            // batch), and its algorithms serve every other size where cuDNN accepts them; a
            // size that refuses one gets that layer measured for it.
            let bucket = match self.found.keys().filter(|&&b| b >= batch).min() {
                Some(&b) => b,
                None => match self.found.keys().max() {
                    Some(&b) => b,
                    None => {
                        let b = batch.next_power_of_two();
                        let found = self.measure(b)?;
                        self.found.insert(b, found);
                        b
                    }
                },
            };
            let mut algos = Vec::with_capacity(self.layers.len());
            for (i, l) in self.layers.iter().enumerate() {
                let algo = self.found[&bucket][i];
                let ws = match self.handle.workspace_size(
                    &descs[i],
                    &l.filter,
                    &l.conv,
                    &descs[i + 1],
                    algo,
                ) {
                    Ok(ws) => (algo, ws),
                    Err(_) => {
                        let best = self.fastest(&descs[i], l, &descs[i + 1])?;
                        let ws = self.handle.workspace_size(
                            &descs[i],
                            &l.filter,
                            &l.conv,
                            &descs[i + 1],
                            best,
                        )?;
                        (best, ws)
                    }
                };
                algos.push(ws);
            }
            let started = std::time::Instant::now();
            let candidates = self.graph_candidates(batch);
            if candidates.iter().any(|c| !c.is_empty()) {
                tracing::debug!(
                    batch,
                    plans = candidates.iter().map(Vec::len).sum::<usize>(),
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    "cuDNN graph plans made"
                );
            }
            let need = algos
                .iter()
                .map(|a| a.1)
                .chain(candidates.iter().flatten().map(GraphConv::workspace))
                .max()
                .unwrap_or(0);
            if self.workspace.as_ref().is_none_or(|w| w.len() < need) {
                self.stream.synchronize()?;
                self.workspace = None;
                self.workspace = Some(DeviceBuffer::new(&self.gpu, need.max(1))?);
            }
            let graphs = self.choose_graphs(batch, &descs, &algos, candidates)?;
            self.plans.insert(
                batch,
                Plan {
                    descs,
                    algos,
                    graphs,
                },
            );
        }
        Ok(&self.plans[&batch])
    }

    /// Each layer's graph-API plans for `batch` images (cuDNN's heuristics' order), where the
    /// graph API may run it: 16-bit layers cuDNN runs (not the stem kernel's), and once the
    /// first batch size has been measured, only the layers it found faster that way. Empty
    /// where none (a failure of the graph API leaves the layer to the legacy calls).
    fn graph_candidates(&self, batch: usize) -> Vec<Vec<GraphConv>> {
        let converts = self.converts_input();
        (0..self.layers.len())
            .map(|i| {
                let l = &self.layers[i];
                let eligible = self.precision.bytes() == 2
                    && l.fused
                    && (i > 0 || converts)
                    && self.graph_chosen.as_ref().is_none_or(|c| c[i]);
                if !eligible {
                    return Vec::new();
                }
                let [c, h, w] = if i == 0 {
                    self.input
                } else {
                    self.layers[i - 1].out
                };
                let shape = ConvShape {
                    x: [batch, c, h, w],
                    w: [l.spec.out_channels, c, l.spec.kernel, l.spec.kernel],
                    y: [batch, l.out[0], l.out[1], l.out[2]],
                    stride: l.spec.stride,
                    padding: l.spec.padding,
                    dtype: self.precision.data_type(),
                    nhwc: self.layout == Layout::Nhwc,
                };
                GraphConv::candidates(&self.handle, &shape).unwrap_or_else(|e| {
                    tracing::debug!(layer = i, "no cuDNN graph plans: {e}");
                    Vec::new()
                })
            })
            .collect()
    }

    /// Each layer's graph plan for `batch` images, if any. The first time, each candidate is
    /// timed against the legacy calls on this network's buffers, and a layer takes a graph
    /// plan only if it is at least 5% faster; later batch sizes take those layers' first
    /// candidate (the heuristics' choice) without timing.
    fn choose_graphs(
        &mut self,
        batch: usize,
        descs: &[TensorDesc],
        algos: &[(Algo, usize)],
        candidates: Vec<Vec<GraphConv>>,
    ) -> Result<Vec<Option<GraphConv>>> {
        if self.graph_chosen.is_some() || candidates.iter().all(Vec::is_empty) {
            return Ok(candidates
                .into_iter()
                .map(|c| c.into_iter().next())
                .collect());
        }
        let mut chosen = Vec::with_capacity(candidates.len());
        for (i, cands) in candidates.into_iter().enumerate() {
            if cands.is_empty() {
                chosen.push(None);
                continue;
            }
            let descs = (&descs[i], &descs[i + 1]);
            let legacy = self.time_layer(i, batch, descs, algos[i], None)?;
            let mut best: Option<(f32, GraphConv)> = None;
            for g in cands {
                // A plan that fails to run is passed over.
                let Ok(t) = self.time_layer(i, batch, descs, algos[i], Some(&g)) else {
                    continue;
                };
                if best.as_ref().is_none_or(|b| t < b.0) {
                    best = Some((t, g));
                }
            }
            tracing::debug!(
                layer = i,
                batch,
                legacy_ms = legacy,
                graph_ms = best.as_ref().map(|b| b.0),
                "cuDNN's legacy call against its graph API's best plan"
            );
            chosen.push(best.filter(|b| b.0 < 0.95 * legacy).map(|b| b.1));
        }
        let layers: Vec<usize> = (0..chosen.len()).filter(|&i| chosen[i].is_some()).collect();
        tracing::info!(?layers, batch, "convolutions on cuDNN's graph API plans");
        self.graph_chosen = Some(chosen.iter().map(Option::is_some).collect());
        Ok(chosen)
    }

    /// Milliseconds layer `i` takes on `batch` images with `graph` (or the legacy calls),
    /// after a run to warm up, over [`TIMING_RUNS`] runs on the network's own buffers.
    fn time_layer(
        &self,
        i: usize,
        batch: usize,
        descs: (&TensorDesc, &TensorDesc),
        algo: (Algo, usize),
        graph: Option<&GraphConv>,
    ) -> Result<f32> {
        let acts: Vec<u64> = self.acts.iter().map(|b| b.ptr()).collect();
        let l = &self.layers[i];
        let ptrs = (acts[i], acts[i + 1], l.spec.residual.map_or(0, |r| acts[r]));
        let workspace = self
            .workspace
            .as_ref()
            .map_or((0, 0), |w| (w.ptr(), w.len()));
        // SAFETY: the network's own activations, sized by `grow` for at least `batch` images
        // (activation i is layer i's input: `graph_candidates` leaves out a layer 0 that would
        // read the caller's input); the workspace was sized for every candidate; the stream
        // is waited for before this returns. What the runs compute is thrown away.
        let run = || unsafe { self.run_layer(i, batch, ptrs, descs, algo, graph, workspace) };
        let result = (|| {
            run()?;
            let start = self.stream.record()?;
            for _ in 0..TIMING_RUNS {
                run()?;
            }
            let end = self.stream.record()?;
            end.wait()?;
            end.elapsed_since(&start)
        })();
        // Whatever failed, nothing may still be running on the buffers.
        self.stream.synchronize()?;
        Ok(result? / TIMING_RUNS as f32)
    }

    /// The fastest algorithm of each layer for `batch` images.
    fn measure(&self, batch: usize) -> Result<Vec<Algo>> {
        let dtype = self.precision.data_type();
        let mut x = TensorDesc::new(
            dtype,
            self.layout.format(),
            [batch, self.input[0], self.input[1], self.input[2]],
        )?;
        let mut out = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let y = TensorDesc::new(
                dtype,
                self.layout.format(),
                [batch, l.out[0], l.out[1], l.out[2]],
            )?;
            out.push(self.fastest(&x, l, &y)?);
            x = y;
        }
        Ok(out)
    }

    /// The fastest algorithm cuDNN measures for `l` between `x` and `y`, keeping to the
    /// precision's arithmetic.
    fn fastest(&self, x: &TensorDesc, l: &Layer, y: &TensorDesc) -> Result<Algo> {
        let found = self.handle.find_algorithms(x, &l.filter, &l.conv, y)?;
        let math = self.precision.math();
        found
            .iter()
            .find(|f| f.1 == math)
            .or(found.first())
            .map(|f| f.0)
            .ok_or_else(|| Error::Cudnn {
                call: "cudnnFindConvolutionForwardAlgorithm",
                status: format!(
                    "no algorithm for a {}x{} convolution in {}",
                    l.spec.kernel, l.spec.kernel, self.precision
                ),
            })
    }

    /// Runs the network on `batch` images `[C, H, W]` of fp32 (NCHW) at device address `x`,
    /// and returns the last activation averaged over its height and width: `batch` rows of
    /// [`ConvNet::out_channels`] values, one after the other. Returns once the device is done
    /// (with `x`, too). [`ConvNet::launch`] and [`ConvNet::collect`] in one.
    ///
    /// # Safety
    /// `x` must be device memory of this GPU's context holding `batch × C × H × W` floats,
    /// written by work that has completed (or been ordered before this call by a
    /// synchronisation), and not written until this returns.
    pub unsafe fn pooled(&mut self, x: u64, batch: usize) -> Result<Vec<f32>> {
        // SAFETY: the caller's contract, which holds until `collect` has returned below.
        unsafe { self.launch(x, batch)? };
        self.collect()
    }

    /// Whether a batch was launched and not yet collected.
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Enqueues the network on `batch` images at `x` (as [`ConvNet::pooled`]) and returns
    /// without waiting: the host may prepare the next batch while the device runs this one.
    /// [`ConvNet::collect`] waits and returns the pooled rows. A batch still in flight is
    /// collected (and its rows dropped) first.
    ///
    /// # Safety
    /// As [`ConvNet::pooled`], until [`ConvNet::collect`] has returned (or the network is
    /// dropped, which waits for the device).
    pub unsafe fn launch(&mut self, x: u64, batch: usize) -> Result<()> {
        if self.in_flight.is_some() {
            self.collect()?;
        }
        if batch == 0 {
            self.in_flight = Some((0, Vec::new()));
            return Ok(());
        }
        // SAFETY: the caller's contract.
        let launched = unsafe { self.enqueue(x, batch) };
        if launched.is_err() {
            // What was enqueued before the failure may still read `x`, which the caller may
            // free as soon as this returns.
            let _ = self.stream.synchronize();
        }
        launched
    }

    /// The work of [`ConvNet::launch`] for a batch of at least one image.
    ///
    /// # Safety
    /// As [`ConvNet::launch`].
    unsafe fn enqueue(&mut self, x: u64, batch: usize) -> Result<()> {
        self.grow(batch)?;
        self.plan(batch)?;
        let plan = &self.plans[&batch];
        let acts: Vec<u64> = self.acts.iter().map(|b| b.ptr()).collect();
        // Activation 0: the caller's floats, or their copy in the network's type and layout.
        let converts = self.converts_input();
        let act = |i: usize| if i == 0 && !converts { x } else { acts[i] };
        if converts {
            // SAFETY: `x` holds batch × input floats (the caller's contract); acts[0] was
            // sized for `capacity` ≥ batch inputs in the element type (`grow`).
            unsafe {
                launch_convert(
                    &self.convert,
                    &self.stream,
                    (x, acts[0]),
                    batch,
                    (self.input[0], self.input[1] * self.input[2]),
                    self.layout,
                )?
            };
        }
        let stem = self.stem.as_ref().filter(|_| self.own_stem);
        let mut nhwc = i32::from(self.layout == Layout::Nhwc);
        let workspace = self
            .workspace
            .as_ref()
            .map_or((0, 0), |w| (w.ptr(), w.len()));
        let mut refused = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            if let (0, Some((weight, kernel))) = (i, stem) {
                let (mut src, mut w, mut b, mut y) = (x, weight.ptr(), l.bias.ptr(), act(1));
                let (mut h, mut wd) = (self.input[1] as u32, self.input[2] as u32);
                let (mut oh, mut ow) = (l.out[1] as u32, l.out[2] as u32);
                let mut params: [*mut std::ffi::c_void; 9] = [
                    (&mut src as *mut u64).cast(),
                    (&mut w as *mut u64).cast(),
                    (&mut b as *mut u64).cast(),
                    (&mut y as *mut u64).cast(),
                    (&mut h as *mut u32).cast(),
                    (&mut wd as *mut u32).cast(),
                    (&mut oh as *mut u32).cast(),
                    (&mut ow as *mut u32).cast(),
                    (&mut nhwc as *mut i32).cast(),
                ];
                let grid = ((oh * ow).div_ceil(128), images(batch)?, 1);
                // SAFETY: the parameters match `tp_net_stem`'s, compiled for this layer's
                // shape (`stem_shape`); `x` holds batch inputs of [C, h, wd] floats (the
                // caller's contract), activation 1 was sized for batch outputs of [K, oh, ow],
                // the weights and bias are the layer's fp32 values; the shapes fit in u32
                // (checked in `new`).
                unsafe { kernel.launch(grid, (128, 1, 1), &self.stream, &mut params)? };
                continue;
            }
            let ptrs = (act(i), act(i + 1), l.spec.residual.map_or(0, act));
            let descs = (&plan.descs[i], &plan.descs[i + 1]);
            let graph = plan.graphs[i].as_ref().filter(|_| l.fused);
            // SAFETY: activation i holds batch inputs of layer i (written by the work before,
            // on this stream); activation i + 1 was sized for them and is written only here;
            // the residual is an earlier activation of its shape (checked in `new`); the
            // workspace was sized for this plan.
            if unsafe { self.run_layer(i, batch, ptrs, descs, plan.algos[i], graph, workspace)? } {
                refused.push(i);
            }
        }
        let last = self.layers.last().expect("at least one layer");
        let rows = batch * last.out[0];
        let pooled = self.pooled.as_ref().expect("made by grow");
        let plane = (last.out[1] * last.out[2]) as u32;
        let channels = last.out[0] as u32;
        let too_large = |_| Error::BadAnswer("a batch too large");
        match self.layout {
            Layout::Nchw => {
                let (mut src, mut dst, mut plane) = (act(self.layers.len()), pooled.ptr(), plane);
                let mut params: [*mut std::ffi::c_void; 3] = [
                    (&mut src as *mut u64).cast(),
                    (&mut dst as *mut u64).cast(),
                    (&mut plane as *mut u32).cast(),
                ];
                let grid = (u32::try_from(rows).map_err(too_large)?, 1, 1);
                // SAFETY: the parameters match `tp_net_mean`'s; the last activation holds
                // `rows` planes of `plane` values and `pooled` `rows` floats.
                unsafe {
                    self.mean
                        .launch(grid, (256, 1, 1), &self.stream, &mut params)?
                };
            }
            Layout::Nhwc => {
                let partial = self.partial.as_ref().expect("made by grow for NHWC");
                let chunks = self.mean_chunks() as u32;
                let (mut src, mut part, mut plane_, mut channels_) =
                    (act(self.layers.len()), partial.ptr(), plane, channels);
                let mut params: [*mut std::ffi::c_void; 4] = [
                    (&mut src as *mut u64).cast(),
                    (&mut part as *mut u64).cast(),
                    (&mut plane_ as *mut u32).cast(),
                    (&mut channels_ as *mut u32).cast(),
                ];
                // SAFETY: the parameters match `tp_net_mean_nhwc`'s; the last activation
                // holds batch images of `plane` × `channels` values, and `partial` was sized
                // for `capacity` ≥ batch images of `chunks` × `channels` floats (`grow`).
                unsafe {
                    self.mean_nhwc.launch(
                        (chunks, images(batch)?, 1),
                        (256, 1, 1),
                        &self.stream,
                        &mut params,
                    )?
                };
                let (mut part, mut dst, mut chunks_, mut channels_, mut plane_) =
                    (partial.ptr(), pooled.ptr(), chunks, channels, plane);
                let mut params: [*mut std::ffi::c_void; 5] = [
                    (&mut part as *mut u64).cast(),
                    (&mut dst as *mut u64).cast(),
                    (&mut chunks_ as *mut u32).cast(),
                    (&mut channels_ as *mut u32).cast(),
                    (&mut plane_ as *mut u32).cast(),
                ];
                // SAFETY: the parameters match `tp_net_mean_sum`'s; `partial` holds what the
                // first pass wrote, `pooled` `rows` = batch × `channels` floats.
                unsafe {
                    self.mean_sum.launch(
                        (blocks(channels as usize)?.0, images(batch)?, 1),
                        (256, 1, 1),
                        &self.stream,
                        &mut params,
                    )?
                };
            }
        }
        self.gpu.bind()?;
        let host = self.pooled_host.as_mut().expect("made by grow");
        // SAFETY: `host` is page-locked memory of `capacity` rows ≥ `rows` floats, owned by
        // this network and read only in `collect`, after the stream has run the copy (the
        // network's drop waits for the stream too); `pooled` holds `rows` floats.
        unsafe {
            self.gpu.driver().memcpy_dtoh_async(
                host.as_mut_slice().as_mut_ptr(),
                pooled.ptr(),
                rows * 4,
                self.stream.raw().cast(),
            )?
        };
        self.in_flight = Some((rows, refused));
        Ok(())
    }

    /// Enqueues layer `i` on `batch` images: `x` → `y`, with `z` (0: none) as its residual.
    /// The convolution is the graph plan's where one is given, else cuDNN's fused call where
    /// the layer fuses at this batch size, else cuDNN's convolution; the bias, residual and
    /// ReLU then follow in the epilogue kernel. Returns whether cuDNN refused the fused call
    /// (the layer then ran apart).
    ///
    /// # Safety
    /// `x` must hold `batch` inputs of layer `i` in the network's type and layout, `y` room for
    /// its outputs (not overlapping), `z` an activation of its output's shape (or 0), the
    /// descriptors and algorithm this batch size's; `workspace` at least what the plan needs;
    /// all valid until the stream has run the work.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run_layer(
        &self,
        i: usize,
        batch: usize,
        (x, y, z): (u64, u64, u64),
        (x_desc, y_desc): (&TensorDesc, &TensorDesc),
        (algo, ws): (Algo, usize),
        graph: Option<&GraphConv>,
        workspace: (u64, usize),
    ) -> Result<bool> {
        let l = &self.layers[i];
        let mut refused = false;
        match graph {
            // SAFETY: the caller's contract; the plan was made for these shapes.
            Some(g) => unsafe { g.execute(&self.handle, (x, l.weight.ptr(), y), workspace.0)? },
            None => {
                let work = (workspace.0, ws.min(workspace.1));
                if l.fused && fuse_at(self.precision, batch) {
                    let bias = l.bias_t.as_ref().unwrap_or(&l.bias).ptr();
                    // SAFETY: the caller's contract; the weights and bias match their
                    // descriptors.
                    let done = unsafe {
                        self.handle.forward_bias_relu(
                            (x_desc, x),
                            (&l.filter, l.weight.ptr()),
                            (&l.conv, algo),
                            work,
                            ((z != 0).then_some(z), (&l.bias_desc, bias), &self.relu),
                            (y_desc, y),
                        )
                    };
                    match done {
                        Ok(()) => return Ok(false),
                        // cuDNN refused the combination (before enqueuing anything): this
                        // layer runs apart from now on.
                        Err(Error::Cudnn { .. }) => refused = true,
                        Err(e) => return Err(e),
                    }
                }
                // SAFETY: as above.
                unsafe {
                    self.handle.forward(
                        (x_desc, x),
                        (&l.filter, l.weight.ptr()),
                        &l.conv,
                        algo,
                        work,
                        (y_desc, y),
                    )?
                };
            }
        }
        let plane = l.out[1] * l.out[2];
        let per_image = l.out[0] * plane;
        let (mut y, mut b, mut z) = (y, l.bias.ptr(), z);
        let (mut p, mut c) = (plane as u32, l.out[0] as u32);
        let mut nhwc = i32::from(self.layout == Layout::Nhwc);
        let mut params: [*mut std::ffi::c_void; 6] = [
            (&mut y as *mut u64).cast(),
            (&mut b as *mut u64).cast(),
            (&mut z as *mut u64).cast(),
            (&mut p as *mut u32).cast(),
            (&mut c as *mut u32).cast(),
            (&mut nhwc as *mut i32).cast(),
        ];
        let grid = (blocks(per_image)?.0, images(batch)?, 1);
        // SAFETY: the parameters match `tp_net_epilogue`'s; `y` and `z` hold batch images of
        // `per_image` elements (checked shapes, which fit in u32), `b` the layer's channels.
        unsafe {
            self.epilogue
                .launch(grid, (256, 1, 1), &self.stream, &mut params)?
        };
        Ok(refused)
    }

    /// Waits for the batch [`ConvNet::launch`] enqueued and returns its pooled rows (nothing if
    /// none is in flight).
    pub fn collect(&mut self) -> Result<Vec<f32>> {
        let Some((rows, refused)) = self.in_flight.take() else {
            return Ok(Vec::new());
        };
        self.stream.synchronize()?;
        for i in refused {
            tracing::debug!(
                layer = i,
                "cuDNN refused the fused convolution; running it apart"
            );
            self.layers[i].fused = false;
        }
        let Some(host) = self.pooled_host.as_mut() else {
            return Ok(Vec::new());
        };
        Ok(host.as_mut_slice()[..rows * 4]
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
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
    let too_large = |_| Error::BadAnswer("a tensor too large for one launch");
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
    unsafe { convert.launch(grid, (256, 1, 1), stream, &mut params) }
}

/// Runs of a layer timed to choose between cuDNN's legacy call and a graph plan.
const TIMING_RUNS: usize = 3;

/// Pixels of the last activation each block of the NHWC mean sums (`tp_net_mean_nhwc`'s 64).
const MEAN_CHUNK: usize = 64;

/// `n` images as a grid's second dimension.
fn images(n: usize) -> Result<u32> {
    if n > ConvNet::MAX_BATCH {
        return Err(Error::BadAnswer("a batch of more than 65,535 images"));
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
