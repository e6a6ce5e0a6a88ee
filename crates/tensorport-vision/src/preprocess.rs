//! A producer's preprocessing, one image at a time into the caller's buffer: read, decode,
//! resize (only the window the crop keeps), normalise. The buffers between the steps are kept
//! and reused, so a steady stream of same-sized images allocates nothing of ours per image.

use std::path::Path;
use std::time::{Duration, Instant};

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use crate::decode::{decode_into, read_file, RgbBuf};
use crate::normalise::Normaliser;
use crate::transform::Transform;
use crate::{fill_synthetic, Error, Result, Source};

/// Time spent in each step, for one image or added up over many.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stages {
    /// Reading the file.
    pub read: Duration,
    /// Decoding it to RGB (or generating a synthetic image).
    pub decode: Duration,
    /// Resizing (and cropping).
    pub resize: Duration,
    /// Normalising into the output.
    pub normalise: Duration,
}

impl Stages {
    /// All steps together.
    pub fn total(&self) -> Duration {
        self.read + self.decode + self.resize + self.normalise
    }
}

impl std::ops::AddAssign for Stages {
    fn add_assign(&mut self, o: Stages) {
        self.read += o.read;
        self.decode += o.decode;
        self.resize += o.resize;
        self.normalise += o.normalise;
    }
}

/// Where a prepared image goes: normalised `f32` planes, or its 8-bit planes before normalising
/// (a quarter of the bytes to hand over; the consumer normalises them with the same table,
/// [`Normaliser::normalise_planes`], and gets the same floats bit for bit).
#[derive(Debug)]
pub enum Planes<'a> {
    /// `3 × S × S` normalised floats.
    F32(&'a mut [f32]),
    /// `3 × S × S` bytes, planar RGB.
    U8(&'a mut [u8]),
}

impl Planes<'_> {
    fn len(&self) -> usize {
        match self {
            Planes::F32(v) => v.len(),
            Planes::U8(v) => v.len(),
        }
    }
}

/// Turns inputs into normalised NCHW `f32` tensors of `3 × S × S` (S = the transform's output
/// side), written straight into a caller's buffer such as a leased slot.
pub struct Preprocessor {
    transform: Transform,
    norm: Normaliser,
    file: Vec<u8>,
    decoded: RgbBuf,
    resized: Vec<u8>,
    resizer: Resizer,
    last: Stages,
}

impl Preprocessor {
    /// A preprocessor for `transform` with the ImageNet normalisation.
    pub fn new(transform: Transform) -> Preprocessor {
        let s = transform.out_size() as usize;
        Preprocessor {
            transform,
            norm: Normaliser::imagenet(),
            file: Vec::new(),
            decoded: RgbBuf::default(),
            resized: vec![0; 3 * s * s],
            resizer: Resizer::new(),
            last: Stages::default(),
        }
    }

    /// The transform it applies.
    pub fn transform(&self) -> Transform {
        self.transform
    }

    /// Floats one output takes (`3 × S × S`).
    pub fn out_len(&self) -> usize {
        let s = self.transform.out_size() as usize;
        3 * s * s
    }

    /// How long each step took for the last image.
    pub fn last_stages(&self) -> Stages {
        self.last
    }

    /// Loads `source` and writes its tensor into `out[..self.out_len()]`.
    pub fn prepare(&mut self, source: &Source, out: &mut [f32]) -> Result<()> {
        self.prepare_into(source, Planes::F32(out))
    }

    /// [`Preprocessor::prepare`], into `f32` or 8-bit planes.
    pub fn prepare_into(&mut self, source: &Source, mut out: Planes<'_>) -> Result<()> {
        self.check(&out)?;
        let t0 = Instant::now();
        let t1;
        match source {
            Source::File(p) => {
                read_file(p, &mut self.file)?;
                t1 = Instant::now();
                decode_into(&self.file, p, &mut self.decoded)?;
            }
            Source::Synthetic(n) => {
                t1 = t0;
                fill_synthetic(*n, 256, 256, &mut self.decoded);
            }
        }
        let t2 = Instant::now();
        self.finish(&mut out)?;
        self.last.read = t1 - t0;
        self.last.decode = t2 - t1;
        Ok(())
    }

    /// Like [`Preprocessor::prepare`], for a file already read into memory (`name` is used in
    /// errors): the read can happen on another thread.
    pub fn prepare_encoded(&mut self, bytes: &[u8], name: &Path, out: &mut [f32]) -> Result<()> {
        self.prepare_encoded_into(bytes, name, Planes::F32(out))
    }

    /// [`Preprocessor::prepare_encoded`], into `f32` or 8-bit planes.
    pub fn prepare_encoded_into(
        &mut self,
        bytes: &[u8],
        name: &Path,
        mut out: Planes<'_>,
    ) -> Result<()> {
        self.check(&out)?;
        let t1 = Instant::now();
        decode_into(bytes, name, &mut self.decoded)?;
        let t2 = Instant::now();
        self.finish(&mut out)?;
        self.last.read = Duration::ZERO;
        self.last.decode = t2 - t1;
        Ok(())
    }

    /// Writes an RGB image (`3 × w × h` bytes, interleaved) into `out`.
    pub fn prepare_rgb(&mut self, rgb: &[u8], w: u32, h: u32, out: &mut [f32]) -> Result<()> {
        let mut out = Planes::F32(out);
        self.check(&out)?;
        let n = 3 * w as usize * h as usize;
        if rgb.len() < n || n == 0 {
            return Err(Error::Input(format!(
                "an RGB image of {w}x{h} needs {n} bytes, got {}",
                rgb.len()
            )));
        }
        self.decoded.reshape(w, h).copy_from_slice(&rgb[..n]);
        self.finish(&mut out)?;
        self.last.read = Duration::ZERO;
        self.last.decode = Duration::ZERO;
        Ok(())
    }

    fn check(&self, out: &Planes<'_>) -> Result<()> {
        if out.len() < self.out_len() {
            return Err(Error::Buffer {
                need: self.out_len(),
                have: out.len(),
            });
        }
        Ok(())
    }

    /// Resize the decoded image's window into `resized`, then normalise into `out` (or lay it
    /// out as planes).
    fn finish(&mut self, out: &mut Planes<'_>) -> Result<()> {
        let t2 = Instant::now();
        let (w, h) = (self.decoded.width, self.decoded.height);
        let win = self.transform.window(w, h);
        let s = win.out;
        let plane = s as usize * s as usize;
        let whole = win.left == 0.0
            && win.top == 0.0
            && win.width == f64::from(w)
            && win.height == f64::from(h);
        let rgb: &[u8] = if whole && w == s && h == s {
            self.decoded.pixels()
        } else {
            let src = ImageRef::new(w, h, self.decoded.pixels(), PixelType::U8x3)
                .map_err(|e| Error::Input(format!("decoded image: {e}")))?;
            let mut dst =
                Image::from_slice_u8(s, s, &mut self.resized[..3 * plane], PixelType::U8x3)
                    .map_err(|e| Error::Input(format!("resize buffer: {e}")))?;
            let opts = ResizeOptions::new()
                .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
                .crop(win.left, win.top, win.width, win.height);
            self.resizer
                .resize(&src, &mut dst, &opts)
                .map_err(|e| Error::Input(format!("resize: {e}")))?;
            &self.resized[..3 * plane]
        };
        let t3 = Instant::now();
        match out {
            Planes::F32(out) => self.norm.write_planes(rgb, plane, out),
            Planes::U8(out) => crate::normalise::split_planes(rgb, plane, out),
        }
        let t4 = Instant::now();
        self.last.resize = t3 - t2;
        self.last.normalise = t4 - t3;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic;

    /// The standard transform by the book: resize the whole image (shorter side to `resize`),
    /// then cut the centred window out of it.
    fn resize_then_crop(img: &image::RgbImage, resize: u32, crop: u32) -> Vec<u8> {
        let (w, h) = img.dimensions();
        let (rw, rh) = if w <= h {
            (
                resize,
                (u64::from(resize) * u64::from(h) / u64::from(w)) as u32,
            )
        } else {
            (
                (u64::from(resize) * u64::from(w) / u64::from(h)) as u32,
                resize,
            )
        };
        let src = ImageRef::new(w, h, img.as_raw(), PixelType::U8x3).unwrap();
        let mut full = Image::new(rw, rh, PixelType::U8x3);
        let opts = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::Bilinear));
        Resizer::new().resize(&src, &mut full, &opts).unwrap();
        let round_half_even = |x: u32| {
            let h = x / 2;
            if x % 2 == 1 && h % 2 == 1 {
                h + 1
            } else {
                h
            }
        };
        let (left, top) = (round_half_even(rw - crop), round_half_even(rh - crop));
        let mut out = Vec::new();
        for y in top..top + crop {
            let row = (y * rw + left) as usize * 3;
            out.extend_from_slice(&full.buffer()[row..row + crop as usize * 3]);
        }
        out
    }

    #[test]
    fn resizing_only_the_window_equals_resizing_all_then_cropping() {
        for (w, h) in [(500, 375), (375, 500), (333, 500), (640, 480), (300, 300)] {
            let img = synthetic(9, w, h);
            let want = resize_then_crop(&img, 256, 224);
            let mut p = Preprocessor::new(Transform::standard(224));
            let mut out = vec![0f32; p.out_len()];
            p.prepare_rgb(img.as_raw(), w, h, &mut out).unwrap();
            let mut expect = vec![0f32; p.out_len()];
            Normaliser::imagenet().write_planes(&want, 224 * 224, &mut expect);
            // One level of 8-bit rounding apart at most, on a few pixels: the window's
            // coefficients are computed from a fractional start.
            let level = 1.0 / 255.0 / IMAGENET_STD_MIN + 1e-6;
            let worst = out
                .iter()
                .zip(&expect)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let differing = out.iter().zip(&expect).filter(|(a, b)| a != b).count();
            assert!(
                worst <= level && differing * 100 <= out.len(),
                "{w}x{h}: worst difference {worst} (one level is {level}), {differing} of {} values differ",
                out.len()
            );
        }
    }

    const IMAGENET_STD_MIN: f32 = 0.224;

    #[test]
    fn jpeg_png_and_grey_jpeg_files_go_through_one_path() {
        let dir = std::env::temp_dir().join(format!("tp-prep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = synthetic(4, 300, 200);
        img.save(dir.join("a.jpg")).unwrap();
        img.save(dir.join("b.png")).unwrap();
        image::DynamicImage::ImageRgb8(img.clone())
            .into_luma8()
            .save(dir.join("grey.jpg"))
            .unwrap();
        let mut p = Preprocessor::new(Transform::standard(64));
        let mut out = vec![0f32; p.out_len()];
        for f in ["a.jpg", "b.png", "grey.jpg"] {
            p.prepare(&Source::File(dir.join(f)), &mut out).unwrap();
            assert!(out.iter().all(|v| v.is_finite()), "{f}");
            assert!(p.last_stages().total() > Duration::ZERO, "{f}");
        }
        // A grey image has equal channels before normalising: check through the decoder.
        let grey = crate::decode(&dir.join("grey.jpg")).unwrap();
        assert!(grey.pixels().all(|p| p[0] == p[1] && p[1] == p[2]));
        // A truncated JPEG is an error naming the file, not a panic.
        let bytes = std::fs::read(dir.join("a.jpg")).unwrap();
        std::fs::write(dir.join("cut.jpg"), &bytes[..bytes.len() / 3]).unwrap();
        std::fs::write(dir.join("junk.jpg"), [0xFF, 0xD8, 0xFF, 0, 1, 2]).unwrap();
        for f in ["cut.jpg", "junk.jpg"] {
            match p.prepare(&Source::File(dir.join(f)), &mut out) {
                Err(e) => assert!(e.to_string().contains(f), "{e}"),
                // zune-jpeg fills a truncated scan with grey, as libjpeg-turbo does.
                Ok(()) => assert_eq!(f, "cut.jpg"),
            }
        }
        let short = &mut [0f32; 10];
        assert!(matches!(
            p.prepare(&Source::Synthetic(1), short),
            Err(Error::Buffer { .. })
        ));
        std::fs::remove_dir_all(&dir).ok();
    }
}
