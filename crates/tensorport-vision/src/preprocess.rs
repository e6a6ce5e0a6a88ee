//! A producer's preprocessing, one image at a time into the caller's buffer: read, decode,
//! resize (only the window the crop keeps), normalise. The buffers between the steps are kept
//! and reused, so a steady stream of same-sized images allocates nothing of ours per image.

use std::path::Path;
use std::time::{Duration, Instant};

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

use crate::decode::{read_file, RgbBuf};
use crate::normalise::Normaliser;
use crate::transform::Transform;
use crate::{fill_synthetic, Error, JpegDecoder, Result, Source};

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
    jpeg: JpegDecoder,
    max_pixels: u64,
    dct_scaling: bool,
    /// Leave out the AC refinement scans of progressive JPEGs shrunk enough.
    coarse_progressive: bool,
    /// The file without those scans, when they are left out.
    coarse: Vec<u8>,
    #[cfg(tp_libjpeg)]
    libjpeg: Option<crate::libjpeg::LibJpeg>,
}

/// The largest copy of a progressive file without its refinement scans kept for the next file.
#[cfg_attr(not(tp_libjpeg), allow(dead_code))]
const KEEP_COARSE_BYTES: usize = 16 << 20;

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
            jpeg: JpegDecoder::default(),
            max_pixels: crate::decode::DEFAULT_MAX_PIXELS,
            dct_scaling: false,
            coarse_progressive: true,
            coarse: Vec::new(),
            #[cfg(tp_libjpeg)]
            libjpeg: None,
        }
    }

    /// Refuses images over `max` pixels (default [`crate::DEFAULT_MAX_PIXELS`]) before
    /// decoding them: a small file can declare an image that would take gigabytes.
    pub fn set_max_pixels(&mut self, max: u64) {
        self.max_pixels = max.max(1);
    }

    /// The most pixels an image may have.
    pub fn max_pixels(&self) -> u64 {
        self.max_pixels
    }

    /// With libjpeg-turbo, decode a large JPEG at 1/2, 1/4 or 1/8 of its size (libjpeg's DCT
    /// scaling) whenever the scaled image still has at least one pixel for each output pixel
    /// of the transform's window, as PIL's `draft` does: far less to decode and resize, at a
    /// small difference from resizing the whole decode (docs/operations.md gives the bound).
    pub fn set_dct_scaling(&mut self, on: bool) {
        self.dct_scaling = on;
    }

    /// With libjpeg-turbo, decode a progressive JPEG without its AC refinement scans (the
    /// low bits of its AC coefficients, most of its bytes) when the transform shrinks the
    /// image's window 8 times or more across and down: half the decoding, at a small
    /// difference from decoding every scan, within the bounds on the difference from
    /// torchvision's decode (docs/operations.md). On by default; `false` decodes every scan.
    pub fn set_coarse_progressive(&mut self, on: bool) {
        self.coarse_progressive = on;
    }

    /// Chooses the JPEG decoder; an error if libjpeg-turbo is asked for and was not built in.
    pub fn set_jpeg_decoder(&mut self, d: JpegDecoder) -> Result<()> {
        if d == JpegDecoder::LibjpegTurbo && !JpegDecoder::LIBJPEG_TURBO_BUILT_IN {
            return Err(Error::Input(
                "this build has no libjpeg-turbo (its development files were not found when it \
                 was built: install them, e.g. Debian's libjpeg62-turbo-dev, and rebuild), so \
                 JPEG files are decoded with zune-jpeg"
                    .into(),
            ));
        }
        self.jpeg = d;
        Ok(())
    }

    /// The JPEG decoder in use.
    pub fn jpeg_decoder(&self) -> JpegDecoder {
        self.jpeg
    }

    /// Decodes `bytes` into `self.decoded`: with libjpeg-turbo only the part the transform needs,
    /// where that is the decoder; anything it does not take goes the general way.
    fn decode(&mut self, bytes: &[u8], name: &Path) -> Result<()> {
        if crate::decode::is_jpeg(bytes) {
            crate::scans::check_work(bytes).map_err(|problem| Error::Image {
                path: name.display().to_string(),
                problem,
            })?;
        }
        #[cfg(tp_libjpeg)]
        if self.jpeg == JpegDecoder::LibjpegTurbo && crate::decode::is_jpeg(bytes) {
            if self.libjpeg.is_none() {
                self.libjpeg = crate::libjpeg::LibJpeg::new();
            }
            if let Some(dec) = self.libjpeg.as_mut() {
                let r = crate::decode::decode_jpeg_window(
                    dec,
                    bytes,
                    self.transform,
                    &mut self.decoded,
                    self.max_pixels,
                    self.dct_scaling,
                    self.coarse_progressive.then_some(&mut self.coarse),
                );
                // The copy without refinement scans is needed only while decoding: an outsized
                // file's is not kept.
                if self.coarse.capacity() > KEEP_COARSE_BYTES {
                    self.coarse = Vec::new();
                }
                match r {
                    Ok(()) => return Ok(()),
                    // Too large for one decoder is too large for any: no other decoder tries.
                    Err(crate::libjpeg::JpegError::TooLarge(problem)) => {
                        return Err(Error::Image {
                            path: name.display().to_string(),
                            problem,
                        })
                    }
                    Err(_) => {}
                }
            }
        }
        crate::decode::decode_into_within(bytes, name, &mut self.decoded, self.max_pixels)
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
                let file = std::mem::take(&mut self.file);
                let r = self.decode(&file, p);
                self.file = file;
                crate::decode::trim_file_buffer(&mut self.file);
                if r.is_err() {
                    self.decoded.trim();
                }
                r?;
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
        self.decode(bytes, name)?;
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
        // The window is the whole image's; the buffer may hold only part of the image (the
        // part the decoder was asked for), starting at (left, top).
        let (fw, fh) = (self.decoded.full_width, self.decoded.full_height);
        let (w, h) = (self.decoded.width, self.decoded.height);
        let (x0, y0) = (f64::from(self.decoded.left), f64::from(self.decoded.top));
        let (sw, sh) = self.decoded.source;
        let win = self.transform.window(sw, sh).scaled(self.decoded.scale);
        let s = win.out;
        let plane = s as usize * s as usize;
        let whole = win.left == 0.0
            && win.top == 0.0
            && win.width == f64::from(fw)
            && win.height == f64::from(fh);
        let rgb: &[u8] = if whole && self.decoded.is_whole() && w == s && h == s {
            self.decoded.pixels()
        } else {
            let src = ImageRef::new(w, h, self.decoded.pixels(), PixelType::U8x3)
                .map_err(|e| Error::Input(format!("decoded image: {e}")))?;
            let mut dst =
                Image::from_slice_u8(s, s, &mut self.resized[..3 * plane], PixelType::U8x3)
                    .map_err(|e| Error::Input(format!("resize buffer: {e}")))?;
            let opts = ResizeOptions::new()
                .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
                .crop(win.left - x0, win.top - y0, win.width, win.height);
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
        self.decoded.trim();
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
            let (worst, differing) = differences(&out, &expect);
            assert!(
                worst <= level && differing * 100 <= out.len(),
                "{w}x{h}: worst difference {worst} (one level is {level}), {differing} of {} values differ",
                out.len()
            );
        }
    }

    const IMAGENET_STD_MIN: f32 = 0.224;

    /// The largest |a - b| over two tensors, and how many values differ at all.
    fn differences(a: &[f32], b: &[f32]) -> (f32, usize) {
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        (worst, a.iter().zip(b).filter(|(x, y)| x != y).count())
    }

    /// libjpeg-turbo decoding only the window the crop needs gives the tensor that decoding the
    /// whole image with it and resizing its window gives, for landscape, portrait, square and
    /// odd-sized images; and the window really is smaller than the image.
    #[cfg(tp_libjpeg)]
    #[test]
    fn libjpeg_window_decode_equals_whole_decode() {
        use crate::libjpeg::LibJpeg;
        for (w, h) in [
            (500, 375),
            (375, 500),
            (333, 500),
            (640, 480),
            (300, 300),
            (257, 999),
        ] {
            let jpeg = crate::tests::jpeg_of(synthetic(w as u64 ^ h as u64, w, h));
            let mut dec = LibJpeg::new().unwrap();
            let header = dec.header(&jpeg, 20_000).unwrap();
            assert_eq!((header.width, header.height), (w, h));
            let mut whole = vec![0u8; 3 * w as usize * h as usize];
            let d = header.window(0, w, 0, h, &mut whole).unwrap();
            assert_eq!((d.left, d.cols), (0, w));

            let mut p = Preprocessor::new(Transform::standard(224));
            p.set_jpeg_decoder(JpegDecoder::LibjpegTurbo).unwrap();
            let mut got = vec![0f32; p.out_len()];
            p.prepare_encoded(&jpeg, Path::new("x.jpg"), &mut got)
                .unwrap();
            let part = (p.decoded.width, p.decoded.height);
            let mut want = vec![0f32; p.out_len()];
            p.prepare_rgb(&whole, w, h, &mut want).unwrap();
            if w.max(h) >= 400 {
                assert!(
                    u64::from(part.0) * u64::from(part.1) < u64::from(w) * u64::from(h),
                    "{w}x{h}: decoded {part:?}, the whole image"
                );
            }
            let level = 1.0 / 255.0 / IMAGENET_STD_MIN + 1e-6;
            let (worst, differing) = differences(&got, &want);
            assert!(
                worst <= level && differing * 1000 <= got.len(),
                "{w}x{h}: worst difference {worst}, {differing} of {} values differ",
                got.len()
            );
        }
    }

    /// Files libjpeg refuses or cannot finish: errors naming the file (after the general path
    /// had its try), a truncated scan filled in; a header over the size limit refused before
    /// anything is allocated for it; the decoder goes on working after each.
    #[cfg(tp_libjpeg)]
    #[test]
    fn libjpeg_refuses_broken_and_oversized_files_and_recovers() {
        use crate::libjpeg::{JpegError, LibJpeg};
        let jpeg = crate::tests::jpeg_of(synthetic(2, 320, 240));
        let mut dec = LibJpeg::new().unwrap();
        // A header read but never decoded leaves the decoder ready for the next file.
        drop(dec.header(&jpeg, 20_000).unwrap());
        // The size limit.
        assert!(matches!(
            dec.header(&jpeg, 300),
            Err(JpegError::TooLarge(_))
        ));
        // A lying size in the frame header (SOF0: FF C0, length, precision, height, width).
        let mut big = jpeg.clone();
        let sof = big.windows(2).position(|b| b == [0xFF, 0xC0]).unwrap();
        big[sof + 5..sof + 9].copy_from_slice(&[0xEA, 0x60, 0xEA, 0x60]); // 60000 x 60000
        match dec.header(&big, crate::MAX_SIDE as u32) {
            Err(JpegError::TooLarge(m)) => assert!(m.contains("60000x60000"), "{m}"),
            other => panic!("{:?}", other.err()),
        }
        // Junk after the SOI marker.
        assert!(matches!(
            dec.header(&[0xFF, 0xD8, 0xFF, 0, 1, 2], 20_000),
            Err(JpegError::Corrupt(_))
        ));
        // A window outside the image, or a buffer too small, is the caller's mistake.
        let mut buf = vec![0u8; 3 * 320 * 240];
        let h = dec.header(&jpeg, 20_000).unwrap();
        assert!(matches!(
            h.window(300, 40, 0, 10, &mut buf),
            Err(JpegError::Misuse(_))
        ));
        // Wider than the image (an unsigned subtraction must not wrap into "inside").
        let h = dec.header(&jpeg, 20_000).unwrap();
        assert!(matches!(
            h.window(0, 400, 0, 10, &mut buf),
            Err(JpegError::Misuse(_))
        ));
        let h = dec.header(&jpeg, 20_000).unwrap();
        assert!(matches!(
            h.window(0, 320, 0, 240, &mut buf[..100]),
            Err(JpegError::Misuse(_))
        ));
        // Cut in the middle of the scan: libjpeg fills the rest, as torchvision's decoder does.
        let cut = &jpeg[..jpeg.len() * 2 / 3];
        let h = dec.header(cut, 20_000).unwrap();
        h.window(0, 320, 0, 240, &mut buf).unwrap();
        // Still a working decoder.
        let h = dec.header(&jpeg, 20_000).unwrap();
        assert_eq!(h.window(0, 320, 100, 20, &mut buf).unwrap().cols, 320);
        // Through the preprocessor: errors name the file.
        let mut p = Preprocessor::new(Transform::standard(64));
        let mut out = vec![0f32; p.out_len()];
        let e = p
            .prepare_encoded(&big, Path::new("big.jpg"), &mut out)
            .unwrap_err();
        assert!(e.to_string().contains("big.jpg"), "{e}");
        p.prepare_encoded(&jpeg, Path::new("ok.jpg"), &mut out)
            .unwrap();
    }

    /// A smooth, photo-like image: low-frequency waves and a little texture.
    fn smooth(w: u32, h: u32) -> image::RgbImage {
        image::RgbImage::from_fn(w, h, |x, y| {
            let (fx, fy) = (x as f32, y as f32);
            let v = |a: f32, b: f32, p: f32| {
                let s = (fx / a + p).sin() * (fy / b).cos() * 90.0 + 128.0;
                let t = ((x * 7 + y * 13) % 17) as f32 - 8.0;
                (s + t).clamp(0.0, 255.0) as u8
            };
            image::Rgb([v(41.0, 57.0, 0.0), v(67.0, 31.0, 1.0), v(23.0, 89.0, 2.0)])
        })
    }

    /// DCT-scaled decoding (libjpeg decoding a large JPEG at 1/2, 1/4 or 1/8) against decoding
    /// it whole and resizing, for landscape, portrait, wide and tall photo-like images: the
    /// scale chosen leaves at least one source pixel per output pixel, and the tensors differ
    /// by little (the bound docs/operations.md states is measured against torchvision on real
    /// photos; here, against this crate's own full decode).
    #[cfg(tp_libjpeg)]
    #[test]
    fn dct_scaled_decoding_is_close_to_the_full_decode() {
        let t = Transform::standard(224);
        let (mut sum, mut count, mut worst) = (0f64, 0usize, 0f32);
        for (w, h, want) in [
            (1600, 1200, 4),
            (1200, 1600, 4),
            (2400, 800, 2),
            (700, 2100, 2),
            (1000, 750, 2),
            (600, 450, 1),
            (300, 300, 1),
        ] {
            assert_eq!(crate::decode::dct_denominator(&t, w, h), want, "{w}x{h}");
            let jpeg = crate::tests::jpeg_of(smooth(w, h));
            let mut full = Preprocessor::new(t);
            full.set_jpeg_decoder(JpegDecoder::LibjpegTurbo).unwrap();
            let mut scaled = Preprocessor::new(t);
            scaled.set_jpeg_decoder(JpegDecoder::LibjpegTurbo).unwrap();
            scaled.set_dct_scaling(true);
            let mut a = vec![0f32; full.out_len()];
            let mut b = vec![0f32; full.out_len()];
            full.prepare_encoded(&jpeg, Path::new("x.jpg"), &mut a)
                .unwrap();
            scaled
                .prepare_encoded(&jpeg, Path::new("x.jpg"), &mut b)
                .unwrap();
            if want > 1 {
                assert!(
                    scaled.decoded.full_width <= w.div_ceil(want),
                    "{w}x{h}: decoded at {}",
                    scaled.decoded.full_width
                );
            }
            for (x, y) in a.iter().zip(&b) {
                let d = (x - y).abs();
                sum += f64::from(d);
                worst = worst.max(d);
            }
            count += a.len();
        }
        let mean = sum / count as f64;
        println!("DCT-scaled against full decodes: mean |diff| {mean:.4}, largest {worst:.4}");
        assert!(mean <= 0.01 && worst <= 0.1, "mean {mean}, largest {worst}");
    }

    /// A small file declaring an image over the pixel limit (100 megapixels, under the side
    /// limit) is refused with an error that names the file and says why, by every decoder and
    /// before anything is allocated for it; the preprocessor goes on working, and a caller can
    /// raise the limit.
    #[test]
    fn decompression_bombs_are_refused_by_every_decoder() {
        let jpeg = crate::tests::jpeg_of(synthetic(2, 320, 240));
        let mut bomb = jpeg.clone();
        let sof = bomb.windows(2).position(|b| b == [0xFF, 0xC0]).unwrap();
        bomb[sof + 5..sof + 9].copy_from_slice(&[0x27, 0x10, 0x27, 0x10]); // 10000 x 10000
        let mut decoders = vec![JpegDecoder::ZuneJpeg];
        if JpegDecoder::LIBJPEG_TURBO_BUILT_IN {
            decoders.push(JpegDecoder::LibjpegTurbo);
        }
        for d in decoders {
            let mut p = Preprocessor::new(Transform::standard(64));
            p.set_jpeg_decoder(d).unwrap();
            let mut out = vec![0f32; p.out_len()];
            let e = p
                .prepare_encoded(&bomb, Path::new("bomb.jpg"), &mut out)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("bomb.jpg") && e.contains("10000x10000") && e.contains("megapixels"),
                "{d:?}: {e}"
            );
            assert!(p.decoded.data.capacity() < 3 * 10_000 * 10_000, "{d:?}");
            p.prepare_encoded(&jpeg, Path::new("ok.jpg"), &mut out)
                .unwrap();
            // A limit below the good file's 76,800 pixels refuses it too.
            p.set_max_pixels(50_000);
            assert!(p
                .prepare_encoded(&jpeg, Path::new("ok.jpg"), &mut out)
                .is_err());
        }
    }

    #[test]
    fn asking_for_a_decoder_that_is_not_built_in_is_an_error_that_says_what_to_do() {
        let mut p = Preprocessor::new(Transform::standard(64));
        p.set_jpeg_decoder(JpegDecoder::ZuneJpeg).unwrap();
        assert_eq!(p.jpeg_decoder(), JpegDecoder::ZuneJpeg);
        let r = p.set_jpeg_decoder(JpegDecoder::LibjpegTurbo);
        if JpegDecoder::LIBJPEG_TURBO_BUILT_IN {
            r.unwrap();
        } else {
            assert!(r.unwrap_err().to_string().contains("libjpeg62-turbo-dev"));
        }
    }

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
