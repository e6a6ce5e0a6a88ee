//! The arithmetic and memory layout a [`ConvNet`](super::ConvNet) runs in.

use crate::cudnn::{DataType, Format, MathType};

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

    pub(super) fn data_type(self) -> DataType {
        match self {
            Precision::F32 | Precision::Tf32 => DataType::CUDNN_DATA_FLOAT,
            Precision::Bf16 => DataType::CUDNN_DATA_BFLOAT16,
            Precision::F16 => DataType::CUDNN_DATA_HALF,
        }
    }

    pub(super) fn math(self) -> MathType {
        match self {
            Precision::F32 => MathType::CUDNN_FMA_MATH,
            Precision::Tf32 => MathType::CUDNN_DEFAULT_MATH,
            Precision::Bf16 | Precision::F16 => MathType::CUDNN_TENSOR_OP_MATH,
        }
    }

    /// Bytes per activation or weight.
    pub(super) fn bytes(self) -> usize {
        match self {
            Precision::F32 | Precision::Tf32 => 4,
            Precision::Bf16 | Precision::F16 => 2,
        }
    }

    /// The element type's loads and stores, for the kernels.
    pub(super) fn kernel_prelude(self) -> &'static str {
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

    pub(super) fn format(self) -> Format {
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
