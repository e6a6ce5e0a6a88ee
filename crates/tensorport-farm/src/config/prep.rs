//! How producers prepare an image: the transform, the pixels they hand over, the decoders'
//! options.

use serde::{Deserialize, Serialize};
use tensorport_vision::{JpegDecoder, Transform};

use super::bounds::within;
use super::data;
use crate::error::{ConfigError, Result};

/// What producers hand over per image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Pixels {
    /// Normalised `f32` planes, ready for the model.
    #[default]
    F32,
    /// 8-bit planes (a quarter of the bytes in the pool and over PCIe); the server normalises
    /// them, on the GPU in the CUDA build, to the same floats bit for bit.
    U8,
}

impl Pixels {
    pub fn name(self) -> &'static str {
        match self {
            Pixels::F32 => "f32",
            Pixels::U8 => "u8",
        }
    }

    pub fn dtype(self) -> tensorport::DType {
        match self {
            Pixels::F32 => tensorport::DType::F32,
            Pixels::U8 => tensorport::DType::U8,
        }
    }

    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            Pixels::F32 => 4,
            Pixels::U8 => 1,
        }
    }

    /// A view of `slot` to prepare an image into.
    pub fn planes(self, slot: &mut [u8]) -> Result<tensorport_vision::Planes<'_>> {
        Ok(match self {
            Pixels::U8 => tensorport_vision::Planes::U8(slot),
            Pixels::F32 => tensorport_vision::Planes::F32(
                bytemuck::try_cast_slice_mut(slot)
                    .map_err(|e| crate::Error::Other(format!("slot is not f32-aligned: {e}")))?,
            ),
        })
    }
}

/// The preprocessing a producer applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum TransformKind {
    /// Resize the shorter side to size/0.875 (256 for 224), antialiased; centre-crop size×size
    /// (torchvision's standard evaluation transform).
    #[default]
    Standard,
    /// Resize the whole image to size×size, whatever its aspect ratio.
    Square,
}

impl TransformKind {
    pub fn for_size(self, size: u32) -> Transform {
        match self {
            TransformKind::Standard => Transform::standard(size),
            TransformKind::Square => Transform::Square { size },
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TransformKind::Standard => "standard",
            TransformKind::Square => "square",
        }
    }
}

/// How a producer prepares an image on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrepOptions {
    pub transform: TransformKind,
    #[serde(with = "data::jpeg_decoder")]
    pub jpeg_decoder: JpegDecoder,
    /// Images over this many pixels are refused before anything is allocated for them.
    pub max_pixels: u64,
    /// Decode large JPEGs at 1/2, 1/4 or 1/8 of their size where that still leaves a source
    /// pixel for each output pixel.
    pub dct_scaling: bool,
    /// Decode progressive JPEGs that the transform shrinks 8 times or more without their AC
    /// refinement scans (on by default).
    pub coarse_progressive: bool,
    pub pixels: Pixels,
    /// How GPU producers' JPEG engines upsample subsampled chroma.
    #[serde(with = "data::upsampling")]
    pub gpu_upsampling: tensorport_nvjpeg::Upsampling,
    /// How GPU producers share their JPEGs between the JPEG engines and nvJPEG's hybrid
    /// decoder on their host threads.
    #[serde(with = "data::gpu_decode")]
    pub gpu_decode: tensorport_nvjpeg::GpuDecode,
}

impl Default for PrepOptions {
    fn default() -> PrepOptions {
        PrepOptions {
            transform: TransformKind::Standard,
            jpeg_decoder: JpegDecoder::default(),
            max_pixels: tensorport_vision::DEFAULT_MAX_PIXELS,
            dct_scaling: false,
            coarse_progressive: true,
            pixels: Pixels::F32,
            gpu_upsampling: tensorport_nvjpeg::Upsampling::default(),
            gpu_decode: tensorport_nvjpeg::GpuDecode::default(),
        }
    }
}

impl PrepOptions {
    /// Refuses options out of their bounds.
    pub fn check(&self) -> Result<(), ConfigError> {
        within("max_pixels", self.max_pixels, 1, 1 << 40)
    }

    /// A CPU preprocessor for images of `size`×`size`.
    pub fn preprocessor(&self, size: u32) -> Result<tensorport_vision::Preprocessor, ConfigError> {
        let mut p = self.cpu_preprocessor(size);
        p.set_jpeg_decoder(self.jpeg_decoder)
            .map_err(ConfigError::JpegDecoder)?;
        Ok(p)
    }

    /// A CPU preprocessor with the default JPEG decoder (the GPU producer's fallback).
    pub fn cpu_preprocessor(&self, size: u32) -> tensorport_vision::Preprocessor {
        let mut p = tensorport_vision::Preprocessor::new(self.transform.for_size(size));
        p.set_max_pixels(self.max_pixels);
        p.set_dct_scaling(self.dct_scaling);
        p.set_coarse_progressive(self.coarse_progressive);
        p
    }
}
