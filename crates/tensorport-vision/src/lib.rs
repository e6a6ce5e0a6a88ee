//! Image preprocessing for producers: decode (JPEG, PNG), resize and crop (the standard
//! evaluation transform by default, or a plain square resize), normalise with the ImageNet mean
//! and standard deviation, and write NCHW `f32` straight into a caller's buffer (a leased
//! slot), so the prepared tensor is never copied before the model reads it.
//!
//! [`Preprocessor`] does it with buffers it keeps between images; [`prepare`] is the one-shot
//! form. The steps live in their own modules: [`transform`] (geometry), `decode` (files to RGB),
//! `libjpeg` (libjpeg-turbo's decoder, where it was found at build time: the crate's only
//! `unsafe`), `normalise` (RGB to planes). [`request`] checks an image request as a server
//! takes it.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod decode;
#[cfg(tp_libjpeg)]
mod libjpeg;
mod normalise;
mod preprocess;
pub mod request;
mod scans;
pub mod sniff;
pub mod transform;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use image::RgbImage;
use thiserror::Error;

pub use decode::{
    decode_into_within, read_file, trim_file_buffer, RgbBuf, DEFAULT_MAX_PIXELS, KEEP_FILE_BYTES,
    MAX_FILE_BYTES, MAX_SIDE,
};
pub use normalise::{split_planes, Normaliser, IMAGENET_MEAN, IMAGENET_STD};
pub use preprocess::{Planes, Preprocessor, Stages};
pub use transform::Transform;

/// Errors of this crate.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read or decoded.
    #[error("{path}: {problem}")]
    Image {
        /// The file.
        path: String,
        /// What went wrong.
        problem: String,
    },
    /// The input folder is missing or holds no images.
    #[error("{0}")]
    Input(String),
    /// The output buffer is too small.
    #[error("output needs {need} floats, buffer has {have}")]
    Buffer {
        /// Floats needed.
        need: usize,
        /// Floats available.
        have: usize,
    },
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// The JPEG decoder a [`Preprocessor`] uses on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JpegDecoder {
    /// libjpeg-turbo (linked at build time where its development files were found): decodes only
    /// the part of the image the transform keeps. The default where built in.
    LibjpegTurbo,
    /// zune-jpeg (pure Rust, always built in): decodes the whole image.
    ZuneJpeg,
}

impl JpegDecoder {
    /// Whether libjpeg-turbo was built into this binary.
    pub const LIBJPEG_TURBO_BUILT_IN: bool = cfg!(tp_libjpeg);

    /// The name used on command lines and in reports.
    pub fn name(self) -> &'static str {
        match self {
            JpegDecoder::LibjpegTurbo => "libjpeg-turbo",
            JpegDecoder::ZuneJpeg => "zune-jpeg",
        }
    }
}

impl Default for JpegDecoder {
    fn default() -> JpegDecoder {
        if JpegDecoder::LIBJPEG_TURBO_BUILT_IN {
            JpegDecoder::LibjpegTurbo
        } else {
            JpegDecoder::ZuneJpeg
        }
    }
}

/// Where one input image comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Source {
    /// A PNG or JPEG file.
    File(PathBuf),
    /// A generated image, reproducible from its number.
    Synthetic(u64),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::File(p) => write!(f, "{}", p.display()),
            Source::Synthetic(n) => write!(f, "synthetic:{n}"),
        }
    }
}

impl FromStr for Source {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> std::result::Result<Source, Self::Err> {
        Ok(
            match s.strip_prefix("synthetic:").and_then(|n| n.parse().ok()) {
                Some(n) => Source::Synthetic(n),
                None => Source::File(PathBuf::from(s)),
            },
        )
    }
}

impl Source {
    /// Decodes (or generates) the image as 8-bit RGB.
    pub fn load(&self) -> Result<RgbImage> {
        match self {
            Source::File(p) => decode(p),
            Source::Synthetic(n) => Ok(synthetic(*n, 256, 256)),
        }
    }
}

/// Decodes a PNG or JPEG file to 8-bit RGB.
pub fn decode(path: &Path) -> Result<RgbImage> {
    let mut bytes = Vec::new();
    decode::read_file(path, &mut bytes)?;
    let mut rgb = RgbBuf::default();
    decode::decode_into(&bytes, path, &mut rgb)?;
    let (w, h) = (rgb.width, rgb.height);
    rgb.data.truncate(3 * w as usize * h as usize);
    Ok(RgbImage::from_raw(w, h, rgb.data).expect("sized by reshape"))
}

/// Times the least work libjpeg-turbo can do to decode each JPEG file of `files` for
/// `transform`: entropy-decode every row down to the last one the transform needs, turn only a
/// 16×16 corner into pixels (`tensorport prep --entropy-floor`); with `coarse_progressive`, a
/// progressive file the transform shrinks enough without its AC refinement scans, as
/// [`Preprocessor::set_coarse_progressive`] decodes it. The mean per file (the best of `passes`
/// passes), or `None` where libjpeg-turbo was not built in.
pub fn jpeg_entropy_floor(
    files: &[&[u8]],
    transform: Transform,
    passes: u32,
    coarse_progressive: bool,
) -> Option<Result<std::time::Duration>> {
    #[cfg(tp_libjpeg)]
    {
        let Some(mut dec) = libjpeg::LibJpeg::new() else {
            return Some(Err(Error::Input(
                "libjpeg could not allocate a decoder".into(),
            )));
        };
        let mut scratch = Vec::new();
        let mut copy = Vec::new();
        let mut best: Option<std::time::Duration> = None;
        for _ in 0..passes.max(1) {
            let t = std::time::Instant::now();
            for (i, f) in files.iter().enumerate() {
                let f = if coarse_progressive {
                    decode::coarse_bytes(f, &transform, &mut copy)
                } else {
                    f
                };
                if let Err(e) = decode::entropy_floor(&mut dec, f, transform, &mut scratch) {
                    return Some(Err(Error::Input(format!("file {i}: {e:?}"))));
                }
            }
            let d = t.elapsed() / files.len().max(1) as u32;
            best = Some(best.map_or(d, |b| b.min(d)));
        }
        best.map(Ok)
    }
    #[cfg(not(tp_libjpeg))]
    {
        let _ = (files, transform, passes, coarse_progressive);
        None
    }
}

/// A reproducible test image: colour gradients and a pattern that depend on `n`.
pub fn synthetic(n: u64, width: u32, height: u32) -> RgbImage {
    let mut buf = RgbBuf::default();
    fill_synthetic(n, width, height, &mut buf);
    buf.data.truncate(3 * width as usize * height as usize);
    RgbImage::from_raw(width, height, buf.data).expect("sized by reshape")
}

/// Writes [`synthetic`]'s image into a reused buffer.
pub fn fill_synthetic(n: u64, width: u32, height: u32, out: &mut RgbBuf) {
    let (a, b) = ((n % 7) as u32 + 1, (n / 7 % 5) as u32 + 1);
    let px = out.reshape(width, height);
    for (i, p) in px.chunks_exact_mut(3).enumerate() {
        let (x, y) = (i as u32 % width, i as u32 / width);
        p[0] = ((x * a + n as u32 * 13) % 256) as u8;
        p[1] = ((y * b + n as u32 * 29) % 256) as u8;
        p[2] = (((x ^ y) * (a + b)) % 256) as u8;
    }
}

/// The PNG and JPEG files in `dir`, sorted by name.
pub fn list_images(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir).map_err(|e| {
        Error::Input(format!(
            "cannot read input folder {}: {e}; pass a folder of PNG/JPEG files",
            dir.display()
        ))
    })?;
    let mut out: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .map(|e| matches!(e.to_ascii_lowercase().as_str(), "png" | "jpg" | "jpeg"))
                .unwrap_or(false)
        })
        .collect();
    out.sort();
    if out.is_empty() {
        return Err(Error::Input(format!(
            "no .png/.jpg/.jpeg files in {}",
            dir.display()
        )));
    }
    Ok(out)
}

/// Resizes all of `img` to `size`×`size` (antialiased bilinear, no crop) and writes it
/// normalised, NCHW, into `out[..3·size²]`.
pub fn to_nchw(img: &RgbImage, size: u32, out: &mut [f32]) -> Result<()> {
    Preprocessor::new(Transform::Square { size }).prepare_rgb(
        img.as_raw(),
        img.width(),
        img.height(),
        out,
    )
}

/// Loads `source` and writes the standard transform's tensor for a model input of `size` into
/// `out` (see [`Transform::standard`]): what `tensorport produce` does by default. For many
/// images, keep a [`Preprocessor`] instead.
pub fn prepare(source: &Source, size: u32, out: &mut [f32]) -> Result<()> {
    Preprocessor::new(Transform::standard(size)).prepare(source, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::Rgb;

    #[test]
    fn nchw_layout_and_normalisation() {
        let img = RgbImage::from_fn(2, 2, |x, _| {
            if x == 0 {
                Rgb([255, 0, 0])
            } else {
                Rgb([0, 0, 255])
            }
        });
        let mut out = vec![0.0; 12];
        to_nchw(&img, 2, &mut out).unwrap();
        let hi_r = (1.0 - IMAGENET_MEAN[0]) / IMAGENET_STD[0];
        let lo_r = (0.0 - IMAGENET_MEAN[0]) / IMAGENET_STD[0];
        assert_eq!(&out[0..4], &[hi_r, lo_r, hi_r, lo_r]);
        let hi_b = (1.0 - IMAGENET_MEAN[2]) / IMAGENET_STD[2];
        assert_eq!(out[9], hi_b);
        assert!(to_nchw(&img, 4, &mut out).is_err());
    }

    #[test]
    fn png_and_jpeg_decode_and_resize() {
        let dir = std::env::temp_dir().join(format!("tp-vision-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = synthetic(3, 40, 30);
        img.save(dir.join("a.png")).unwrap();
        img.save(dir.join("b.jpg")).unwrap();
        std::fs::write(dir.join("notes.txt"), "x").unwrap();
        let files = list_images(&dir).unwrap();
        assert_eq!(files.len(), 2);
        let mut out = vec![0.0; 3 * 16 * 16];
        for f in &files {
            prepare(&Source::File(f.clone()), 16, &mut out).unwrap();
            assert!(out.iter().all(|v| v.is_finite()));
        }
        std::fs::write(dir.join("c.png"), b"not a png").unwrap();
        let e = prepare(&Source::File(dir.join("c.png")), 16, &mut out).unwrap_err();
        assert!(e.to_string().contains("c.png"));
        std::fs::remove_dir_all(&dir).ok();
        assert!(list_images(&dir)
            .unwrap_err()
            .to_string()
            .contains("pass a folder of PNG/JPEG files"));
    }

    /// `img` encoded as a JPEG file (the `image` crate's encoder), for tests.
    pub(crate) fn jpeg_of(img: RgbImage) -> Vec<u8> {
        let mut jpeg = Vec::new();
        image::DynamicImage::ImageRgb8(img)
            .write_to(
                &mut std::io::Cursor::new(&mut jpeg),
                image::ImageFormat::Jpeg,
            )
            .unwrap();
        jpeg
    }

    #[test]
    fn entropy_floor_is_timed_where_libjpeg_is_built_in_and_refuses_broken_files() {
        let jpeg = jpeg_of(synthetic(1, 320, 240));
        let t = Transform::standard(224);
        match jpeg_entropy_floor(&[&jpeg, &jpeg], t, 2, true) {
            Some(r) => {
                assert_eq!(JpegDecoder::default(), JpegDecoder::LibjpegTurbo);
                assert!(r.unwrap() > std::time::Duration::ZERO);
                let broken: &[u8] = &[0xFF, 0xD8, 0xFF, 0, 1];
                let e = jpeg_entropy_floor(&[&jpeg, broken], t, 1, true).unwrap();
                assert!(e.unwrap_err().to_string().contains("file 1"));
            }
            None => assert_eq!(JpegDecoder::default(), JpegDecoder::ZuneJpeg),
        }
    }

    #[test]
    fn sources_parse_and_synthetic_is_reproducible() {
        assert_eq!(
            "synthetic:12".parse::<Source>().unwrap(),
            Source::Synthetic(12)
        );
        assert_eq!(
            "a/b.png".parse::<Source>().unwrap(),
            Source::File("a/b.png".into())
        );
        assert_eq!(synthetic(5, 8, 8), synthetic(5, 8, 8));
        assert_ne!(synthetic(5, 8, 8), synthetic(6, 8, 8));
    }
}
