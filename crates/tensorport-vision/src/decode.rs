//! Reading and decoding an input into a reused RGB buffer. JPEG goes through zune-jpeg straight
//! into the buffer; PNG (and any JPEG zune-jpeg refuses) through the `image` crate.

use std::io::Read;
use std::path::Path;

use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use crate::{Error, Result};

/// The largest side a file may declare: a decompression bomb is refused before it allocates.
pub const MAX_SIDE: usize = 16_384;

/// An 8-bit interleaved RGB image in a buffer that is kept and reused.
#[derive(Default)]
pub struct RgbBuf {
    /// Pixels, `3 * width * height` of them valid (the buffer may be longer).
    pub data: Vec<u8>,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

impl RgbBuf {
    /// Makes room for a `w`×`h` image (growing only) and sets the size.
    pub fn reshape(&mut self, w: u32, h: u32) -> &mut [u8] {
        let n = 3 * w as usize * h as usize;
        if self.data.len() < n {
            self.data.resize(n, 0);
        }
        self.width = w;
        self.height = h;
        &mut self.data[..n]
    }

    /// The valid pixels.
    pub fn pixels(&self) -> &[u8] {
        &self.data[..3 * self.width as usize * self.height as usize]
    }
}

/// Reads the whole file at `path` into `buf` (cleared first; its capacity is reused).
pub fn read_file(path: &Path, buf: &mut Vec<u8>) -> Result<()> {
    buf.clear();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(buf))
        .map_err(|e| Error::Image {
            path: path.display().to_string(),
            problem: e.to_string(),
        })?;
    Ok(())
}

fn is_jpeg(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0xFF, 0xD8, 0xFF])
}

/// Decodes the encoded image in `bytes` (JPEG or PNG, told by its first bytes) into `out`.
/// `name` is used in errors.
pub fn decode_into(bytes: &[u8], name: &Path, out: &mut RgbBuf) -> Result<()> {
    if is_jpeg(bytes) && decode_jpeg(bytes, out).is_ok() {
        return Ok(());
    }
    // PNG, or a JPEG zune-jpeg would not take (an unusual colour space): the general path.
    let err = |problem: String| Error::Image {
        path: name.display().to_string(),
        problem,
    };
    let img = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| err(e.to_string()))?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_SIDE as u32);
    limits.max_image_height = Some(MAX_SIDE as u32);
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

fn decode_jpeg(bytes: &[u8], out: &mut RgbBuf) -> std::result::Result<(), ()> {
    let options = DecoderOptions::default()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_max_width(MAX_SIDE)
        .set_max_height(MAX_SIDE);
    let mut d = JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    d.decode_headers().map_err(|_| ())?;
    if d.output_colorspace() != Some(ColorSpace::RGB) {
        return Err(());
    }
    let (w, h) = d.dimensions().ok_or(())?;
    if w == 0 || h == 0 || w > MAX_SIDE || h > MAX_SIDE {
        return Err(());
    }
    let buf = out.reshape(w as u32, h as u32);
    if Some(buf.len()) != d.output_buffer_size() {
        return Err(());
    }
    d.decode_into(buf).map_err(|_| ())
}
