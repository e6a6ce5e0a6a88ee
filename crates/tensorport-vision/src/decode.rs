//! Reading and decoding an input into a reused RGB buffer. JPEG goes through libjpeg-turbo where
//! it is built in ([`decode_jpeg_window`]: only the window a transform needs) or zune-jpeg
//! (the whole image), straight into the buffer; PNG (and any JPEG both refuse) through the
//! `image` crate.

use std::io::Read;
use std::path::Path;

use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use crate::{Error, Result};

/// The largest side a file may declare: a decompression bomb is refused before it allocates.
pub const MAX_SIDE: usize = 16_384;

/// The most pixels an image may have unless a caller allows more
/// ([`crate::Preprocessor::set_max_pixels`]): 64 megapixels, above the largest phone photos'
/// usual 50. An image over it is refused before anything is allocated for it.
pub const DEFAULT_MAX_PIXELS: u64 = 64_000_000;

/// A decoded image buffer over this many bytes is given back after its image, not kept for the
/// next (an outsized file must not leave its memory behind).
const KEEP_BYTES: usize = 3 * 4096 * 3072;

/// The problem of an image over `max` pixels, for its error line.
pub(crate) fn too_many_pixels(w: u64, h: u64, max: u64) -> String {
    format!(
        "{w}x{h} is {:.1} megapixels, over the limit of {:.1} (a decompression-bomb guard; \
         raise the pixel limit to take it)",
        (w * h) as f64 / 1e6,
        max as f64 / 1e6
    )
}

/// An 8-bit interleaved RGB image in a buffer that is kept and reused: a whole image, or a
/// window of one (a decoder may leave out what a crop throws away).
#[derive(Default)]
pub struct RgbBuf {
    /// Pixels, `3 * width * height` of them valid (the buffer may be longer).
    pub data: Vec<u8>,
    /// Width in pixels of what the buffer holds.
    pub width: u32,
    /// Height in pixels of what the buffer holds.
    pub height: u32,
    /// Column of the whole image where the buffer's first column lies.
    pub left: u32,
    /// Row of the whole image where the buffer's first row lies.
    pub top: u32,
    /// Width of the whole image.
    pub full_width: u32,
    /// Height of the whole image.
    pub full_height: u32,
    /// The image was decoded at 1/`scale` of its size (DCT scaling; 1: at its size), which
    /// was `source`: a window of the source maps onto the decoded image divided by `scale`.
    pub scale: u32,
    /// The source image's size (the same as the whole image's when `scale` is 1).
    pub source: (u32, u32),
}

impl RgbBuf {
    /// Makes room for a whole `w`×`h` image (growing only) and sets the size.
    pub fn reshape(&mut self, w: u32, h: u32) -> &mut [u8] {
        let n = 3 * w as usize * h as usize;
        if self.data.len() < n {
            self.data.resize(n, 0);
        }
        (self.width, self.height, self.left, self.top) = (w, h, 0, 0);
        (self.full_width, self.full_height) = (w, h);
        (self.scale, self.source) = (1, (w, h));
        &mut self.data[..n]
    }

    /// Gives the memory back if an outsized image left it larger than a typical one needs.
    pub fn trim(&mut self) {
        if self.data.capacity() > KEEP_BYTES {
            self.data = Vec::new();
        }
    }

    /// Whether the buffer holds the whole image.
    pub fn is_whole(&self) -> bool {
        (self.width, self.height) == (self.full_width, self.full_height)
    }

    /// The valid pixels.
    pub fn pixels(&self) -> &[u8] {
        &self.data[..3 * self.width as usize * self.height as usize]
    }
}

/// The largest input file read: no image within the pixel limit needs more.
pub const MAX_FILE_BYTES: u64 = 256 << 20;

/// A read buffer over this many bytes is given back after its file ([`trim_file_buffer`]).
pub const KEEP_FILE_BYTES: usize = 4 << 20;

/// Reads the whole file at `path` into `buf` (cleared first; its capacity is reused), refusing
/// one over [`MAX_FILE_BYTES`] and anything that is not a regular file: the file is opened
/// without blocking and checked before a byte is read, so a FIFO, a device or a socket named
/// as an input gets its error at once instead of stalling the reader.
pub fn read_file(path: &Path, buf: &mut Vec<u8>) -> Result<()> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    buf.clear();
    let err = |problem: String| Error::Image {
        path: path.display().to_string(),
        problem,
    };
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| err(e.to_string()))?;
    let kind = f.metadata().map_err(|e| err(e.to_string()))?.file_type();
    if !kind.is_file() {
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        return Err(err(format!(
            "{what}, not an image file: refused without reading it"
        )));
    }
    (&mut f)
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(buf)
        .map_err(|e| err(e.to_string()))?;
    if buf.len() as u64 > MAX_FILE_BYTES {
        *buf = Vec::new();
        return Err(err(format!(
            "over {} MiB: not an image this reads",
            MAX_FILE_BYTES >> 20
        )));
    }
    Ok(())
}

/// Gives a read buffer's memory back if an outsized file left it over [`KEEP_FILE_BYTES`]
/// (a typical photo's buffer is kept for the next file).
pub fn trim_file_buffer(buf: &mut Vec<u8>) {
    if buf.capacity() > KEEP_FILE_BYTES {
        *buf = Vec::new();
    }
}

/// Whether `bytes` start like a JPEG file.
pub(crate) fn is_jpeg(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0xFF, 0xD8, 0xFF])
}

/// Decodes the encoded image in `bytes` (JPEG or PNG, told by its first bytes) into `out`,
/// refusing an image over [`DEFAULT_MAX_PIXELS`]. `name` is used in errors.
pub fn decode_into(bytes: &[u8], name: &Path, out: &mut RgbBuf) -> Result<()> {
    decode_into_within(bytes, name, out, DEFAULT_MAX_PIXELS)
}

/// [`decode_into`], refusing an image over `max_pixels` before allocating for it.
pub fn decode_into_within(
    bytes: &[u8],
    name: &Path,
    out: &mut RgbBuf,
    max_pixels: u64,
) -> Result<()> {
    let err = |problem: String| Error::Image {
        path: name.display().to_string(),
        problem: problem.trim_end().to_string(),
    };
    if bytes.is_empty() {
        return Err(err("the file is empty".into()));
    }
    if is_jpeg(bytes) {
        crate::scans::check_work(bytes).map_err(err)?;
        match decode_jpeg(bytes, out, max_pixels) {
            Ok(()) => return Ok(()),
            Err(Some(problem)) => return Err(err(problem)),
            Err(None) => {}
        }
    }
    // PNG, or a JPEG zune-jpeg would not take (an unusual colour space): the general path.
    let img = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| err(e.to_string()))?;
    let (w, h) = img
        .into_dimensions()
        .map_err(|e| err(format!("cannot decode: {e}")))?;
    if u64::from(w) * u64::from(h) > max_pixels {
        return Err(err(too_many_pixels(w.into(), h.into(), max_pixels)));
    }
    let img = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| err(e.to_string()))?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_SIDE as u32);
    limits.max_image_height = Some(MAX_SIDE as u32);
    // 16-bit RGBA is the widest a pixel decodes to.
    limits.max_alloc = Some(max_pixels.saturating_mul(8).max(64 << 20));
    let mut img = img;
    img.limits(limits);
    let rgb = img
        .decode()
        .map_err(|e| err(format!("cannot decode: {e}")))?
        .into_rgb8();
    let (w, h) = rgb.dimensions();
    out.reshape(w, h).copy_from_slice(rgb.as_raw());
    Ok(())
}

/// zune-jpeg into `out`: `Err(Some(why))` for an image refused outright (over `max_pixels`),
/// `Err(None)` for one the general path may still take.
fn decode_jpeg(
    bytes: &[u8],
    out: &mut RgbBuf,
    max_pixels: u64,
) -> std::result::Result<(), Option<String>> {
    let options = DecoderOptions::default()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_max_width(MAX_SIDE)
        .set_max_height(MAX_SIDE);
    let mut d = JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    d.decode_headers().map_err(|_| None)?;
    let (w, h) = d.dimensions().ok_or(None)?;
    if (w as u64) * (h as u64) > max_pixels {
        return Err(Some(too_many_pixels(w as u64, h as u64, max_pixels)));
    }
    if d.output_colorspace() != Some(ColorSpace::RGB) {
        return Err(None);
    }
    if w == 0 || h == 0 || w > MAX_SIDE || h > MAX_SIDE {
        return Err(None);
    }
    let buf = out.reshape(w as u32, h as u32);
    if Some(buf.len()) != d.output_buffer_size() {
        return Err(None);
    }
    d.decode_into(buf).map_err(|_| None)
}

/// Pixels the resampler may read beyond a window's edge, over the filter's own reach: room for
/// the decoder's handling of chroma at the edges of what it decodes.
#[cfg_attr(not(tp_libjpeg), allow(dead_code))]
const PAD: f64 = 16.0;

/// The source rows and columns, `(left, right, top, bottom)` (right and bottom exclusive), that
/// resampling `win` of a `w`×`h` image with the antialiased bilinear filter reads: the window
/// grown by the filter's reach (one output pixel's span in source pixels, at least one) and
/// [`PAD`], inside the image.
#[cfg_attr(not(tp_libjpeg), allow(dead_code))]
pub(crate) fn needed(win: &crate::transform::Window, w: u32, h: u32) -> (u32, u32, u32, u32) {
    let span = |start: f64, len: f64, out: u32, limit: u32| {
        let reach = (len / f64::from(out.max(1))).max(1.0) + PAD;
        let lo = (start - reach).floor().max(0.0) as u32;
        let hi = ((start + len + reach).ceil().min(f64::from(limit)) as u32).max(lo + 1);
        (lo.min(limit - 1), hi.min(limit))
    };
    let (l, r) = span(win.left, win.width, win.out, w);
    let (t, b) = span(win.top, win.height, win.out, h);
    (l, r, t, b)
}

/// Decodes the part of a JPEG file that `transform` needs (see [`needed`]) with libjpeg-turbo
/// into `out`, which then holds that window of the image.
#[cfg(tp_libjpeg)]
pub(crate) fn decode_jpeg_window(
    dec: &mut crate::libjpeg::LibJpeg,
    bytes: &[u8],
    transform: crate::transform::Transform,
    out: &mut RgbBuf,
    max_pixels: u64,
    dct_scaling: bool,
    coarse: Option<&mut Vec<u8>>,
) -> std::result::Result<(), crate::libjpeg::JpegError> {
    let bytes = match coarse {
        Some(copy) => coarse_bytes(bytes, &transform, copy),
        None => bytes,
    };
    let mut header = dec.header(bytes, MAX_SIDE as u32)?;
    let (w, h) = (header.width, header.height);
    if u64::from(w) * u64::from(h) > max_pixels {
        return Err(crate::libjpeg::JpegError::TooLarge(too_many_pixels(
            w.into(),
            h.into(),
            max_pixels,
        )));
    }
    let source = (w, h);
    let denom = if dct_scaling {
        dct_denominator(&transform, w, h)
    } else {
        1
    };
    if denom > 1 {
        header.scale(denom)?;
    }
    // From here the image is the (maybe scaled) one the decoder gives; the window is the
    // source's, divided by the scale (the decoded image's size is rounded up, its geometry
    // is not: pixel i of a 1/d decode covers source pixels i·d to i·d + d).
    let (w, h) = (header.width, header.height);
    let win = transform.window(source.0, source.1).scaled(denom);
    let (left, right, top, bottom) = needed(&win, w, h);
    let rows = bottom - top;
    // Room for whole rows: the decoder may widen the columns to its block boundaries.
    let buf = out.reshape(w, rows);
    let d = header.window(left, right - left, top, rows, buf)?;
    (out.width, out.height, out.left, out.top) = (d.cols, rows, d.left, top);
    (out.full_width, out.full_height) = (w, h);
    (out.scale, out.source) = (denom, source);
    Ok(())
}

/// Source pixels per output pixel, across and down, that the transform's window must shrink
/// by before a progressive JPEG's AC refinement scans are left out
/// ([`crate::Preprocessor::set_coarse_progressive`]). Photos shrunk less keep too much of what
/// the scans add: their tensors go over the bounds on the difference from torchvision's
/// (docs/benchmarks.md measures both sides of the threshold).
pub(crate) const COARSE_MIN_SHRINK: f64 = 8.0;

/// The bytes to decode `jpeg` from for `transform`: a progressive photo the transform shrinks
/// [`COARSE_MIN_SHRINK`] times or more, without its AC refinement scans (the copy made in
/// `copy`); any other file as it is.
#[cfg_attr(not(tp_libjpeg), allow(dead_code))]
pub(crate) fn coarse_bytes<'a>(
    jpeg: &'a [u8],
    transform: &crate::transform::Transform,
    copy: &'a mut Vec<u8>,
) -> &'a [u8] {
    if shrinks_enough(jpeg, transform) && crate::scans::without_ac_refinement(jpeg, copy) > 0 {
        copy
    } else {
        jpeg
    }
}

/// Whether `jpeg` is a progressive JPEG whose window `transform` shrinks by
/// [`COARSE_MIN_SHRINK`] or more, across and down.
#[cfg_attr(not(tp_libjpeg), allow(dead_code))]
fn shrinks_enough(jpeg: &[u8], transform: &crate::transform::Transform) -> bool {
    let Some(f) = crate::sniff::jpeg_frame(std::io::Cursor::new(jpeg)) else {
        return false;
    };
    if f.coding != crate::sniff::Coding::Progressive || f.width == 0 || f.height == 0 {
        return false;
    }
    let win = transform.window(f.width.into(), f.height.into());
    let out = f64::from(win.out.max(1));
    win.width / out >= COARSE_MIN_SHRINK && win.height / out >= COARSE_MIN_SHRINK
}

/// How many decoded pixels per output pixel, across and down, DCT scaling must leave: 1, as
/// PIL's `draft` chooses. (With 2 the resize after it averages more and the tensors come closer
/// to a full decode's — on a varied photo set, largest difference 0.21 against 0.77 — but the
/// scale is chosen so rarely that little time is saved.)
const DCT_MARGIN: f64 = 1.0;

/// The largest of 8, 4 and 2 by which a `w`×`h` image can be scaled down while decoding and
/// still give `transform` [`DCT_MARGIN`] source pixels for each output pixel, across and down;
/// 1 if none can.
pub(crate) fn dct_denominator(transform: &crate::transform::Transform, w: u32, h: u32) -> u32 {
    let win = transform.window(w, h);
    let out = f64::from(win.out) * DCT_MARGIN;
    for d in [8u32, 4, 2] {
        let s = win.scaled(d);
        if s.width >= out && s.height >= out {
            return d;
        }
    }
    1
}

/// Entropy-decodes a JPEG file with libjpeg-turbo down to the last row `transform` needs, but
/// turns only a 16×16 corner at that row into pixels: what decoding the file for `transform`
/// with libjpeg-turbo costs at least, since every row down to the last one needed must be
/// entropy-decoded.
#[cfg(tp_libjpeg)]
pub(crate) fn entropy_floor(
    dec: &mut crate::libjpeg::LibJpeg,
    bytes: &[u8],
    transform: crate::transform::Transform,
    scratch: &mut Vec<u8>,
) -> std::result::Result<(), crate::libjpeg::JpegError> {
    let header = dec.header(bytes, MAX_SIDE as u32)?;
    let (w, h) = (header.width, header.height);
    let (_, _, _, bottom) = needed(&transform.window(w, h), w, h);
    let rows = bottom.min(16);
    scratch.resize(3 * w as usize * rows as usize, 0);
    header.window(0, w.min(16), bottom - rows, rows, scratch)?;
    Ok(())
}
