//! libjpeg-turbo's decompressor, through the C shim in `csrc/tp_jpeg.c`: the raw calls, then a
//! safe [`LibJpeg`] that owns one decompressor and decodes a window of a file straight into a
//! caller's buffer. The only `unsafe` of this crate.
//!
//! Why libjpeg-turbo beside zune-jpeg: it decodes these files about 1.5× as fast on one core,
//! and it can leave out what the centre crop throws away: rows below the window are never
//! decoded, rows above it are only entropy-decoded, and columns outside it skip the inverse DCT,
//! upsampling and colour conversion. It is also the decoder torchvision uses, so the tensors
//! come closer to torchvision's.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::marker::PhantomData;
use std::os::raw::{c_char, c_int, c_uchar};
use std::ptr::NonNull;

mod sys {
    use super::*;

    /// The shim's decoder state (opaque).
    #[repr(C)]
    pub struct TpJpeg {
        _private: [u8; 0],
    }

    extern "C" {
        pub fn tp_jpeg_new() -> *mut TpJpeg;
        pub fn tp_jpeg_free(t: *mut TpJpeg);
        pub fn tp_jpeg_message(t: *const TpJpeg) -> *const c_char;
        pub fn tp_jpeg_header(
            t: *mut TpJpeg,
            data: *const c_uchar,
            len: usize,
            max_side: u32,
            width: *mut u32,
            height: *mut u32,
        ) -> c_int;
        pub fn tp_jpeg_window(
            t: *mut TpJpeg,
            left: u32,
            cols: u32,
            top: u32,
            rows: u32,
            out: *mut c_uchar,
            cap: usize,
            out_left: *mut u32,
            out_cols: *mut u32,
        ) -> c_int;
        pub fn tp_jpeg_abort(t: *mut TpJpeg);
        pub fn tp_jpeg_scale(
            t: *mut TpJpeg,
            denom: u32,
            width: *mut u32,
            height: *mut u32,
        ) -> c_int;
    }
}

/// Why libjpeg did not decode a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum JpegError {
    /// The file is broken (libjpeg's message).
    Corrupt(String),
    /// A colour space that does not become RGB here (CMYK, YCCK): another decoder may take it.
    Unsupported(String),
    /// Larger than allowed a side.
    TooLarge(String),
    /// A caller's mistake: a window outside the image, a buffer too small.
    Misuse(String),
}

/// One libjpeg decompressor, reused from file to file.
pub(crate) struct LibJpeg {
    raw: NonNull<sys::TpJpeg>,
}

// SAFETY: the decompressor has no thread affinity (no thread-local state, no locks); it is only
// reached through `&mut self`, so one thread at a time uses it.
unsafe impl Send for LibJpeg {}

impl LibJpeg {
    /// A decompressor, or `None` if libjpeg could not allocate one.
    pub(crate) fn new() -> Option<LibJpeg> {
        // SAFETY: no arguments; the result is null or a decoder this value now owns.
        NonNull::new(unsafe { sys::tp_jpeg_new() }).map(|raw| LibJpeg { raw })
    }

    fn message(&self) -> String {
        // SAFETY: the shim keeps a NUL-terminated message buffer inside the decoder, alive as
        // long as `self`; it is copied out before anything else touches the decoder.
        unsafe { CStr::from_ptr(sys::tp_jpeg_message(self.raw.as_ptr())) }
            .to_string_lossy()
            .into_owned()
    }

    fn error(&self, code: c_int) -> JpegError {
        let m = self.message();
        match code {
            2 => JpegError::Unsupported(m),
            3 => JpegError::TooLarge(m),
            4 | 5 => JpegError::Misuse(m),
            _ => JpegError::Corrupt(m),
        }
    }

    /// Reads the header of `bytes`, refusing images over `max_side` pixels a side. The returned
    /// [`Header`] keeps `bytes` and the decoder borrowed until the window is decoded.
    pub(crate) fn header<'a>(
        &'a mut self,
        bytes: &'a [u8],
        max_side: u32,
    ) -> Result<Header<'a>, JpegError> {
        let (mut w, mut h) = (0u32, 0u32);
        // SAFETY: `bytes` is valid for its length and stays borrowed by the returned Header,
        // the only way to reach the decoder (which keeps the pointer) until it is dropped or
        // consumed; the out-pointers are to locals.
        let rc = unsafe {
            sys::tp_jpeg_header(
                self.raw.as_ptr(),
                bytes.as_ptr(),
                bytes.len(),
                max_side,
                &mut w,
                &mut h,
            )
        };
        if rc != 0 {
            return Err(self.error(rc));
        }
        Ok(Header {
            dec: self,
            width: w,
            height: h,
            _bytes: PhantomData,
        })
    }
}

impl Drop for LibJpeg {
    fn drop(&mut self) {
        // SAFETY: `raw` came from tp_jpeg_new and is freed once, here.
        unsafe { sys::tp_jpeg_free(self.raw.as_ptr()) }
    }
}

/// A file whose header has been read: its size, and the decoder ready to decode a window.
pub(crate) struct Header<'a> {
    dec: &'a mut LibJpeg,
    /// Width in pixels.
    pub(crate) width: u32,
    /// Height in pixels.
    pub(crate) height: u32,
    _bytes: PhantomData<&'a [u8]>,
}

/// Where a decoded window lies in its image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Decoded {
    /// First column decoded (the requested left edge, moved left to an iMCU boundary).
    pub(crate) left: u32,
    /// Columns decoded: each row in the buffer is `3 * cols` bytes.
    pub(crate) cols: u32,
}

impl Header<'_> {
    /// Decodes at 1/`denom` of the size (1, 2, 4 or 8: libjpeg's DCT scaling): the header's
    /// size becomes the scaled one, which [`Header::window`]'s coordinates are then in.
    pub(crate) fn scale(&mut self, denom: u32) -> Result<(), JpegError> {
        let (mut w, mut h) = (0u32, 0u32);
        // SAFETY: the decoder holds a header read from bytes still borrowed; the out-pointers
        // are to locals.
        let rc = unsafe { sys::tp_jpeg_scale(self.dec.raw.as_ptr(), denom, &mut w, &mut h) };
        if rc != 0 {
            return Err(self.dec.error(rc));
        }
        (self.width, self.height) = (w, h);
        Ok(())
    }

    /// Decodes rows `top..top + rows` and at least columns `left..left + cols` as interleaved RGB
    /// into `out`, which must hold `3 * width * rows` bytes (the widest the column range can
    /// grow to).
    pub(crate) fn window(
        self,
        left: u32,
        cols: u32,
        top: u32,
        rows: u32,
        out: &mut [u8],
    ) -> Result<Decoded, JpegError> {
        let need = 3 * self.width as usize * rows as usize;
        if out.len() < need {
            return Err(JpegError::Misuse(format!(
                "buffer of {} bytes, {need} needed",
                out.len()
            )));
        }
        let (mut l, mut c) = (0u32, 0u32);
        let dec = self.dec.raw.as_ptr();
        // The shim ends the decode whatever happens, so Header's Drop must not abort again.
        std::mem::forget(self);
        // SAFETY: the header was read from bytes still borrowed (the lifetime 'a, held by the
        // decoder's borrow); `out` is valid for `out.len()` bytes and the shim writes no more
        // than `cap`; the out-pointers are to locals.
        let rc = unsafe {
            sys::tp_jpeg_window(
                dec,
                left,
                cols,
                top,
                rows,
                out.as_mut_ptr(),
                out.len(),
                &mut l,
                &mut c,
            )
        };
        if rc != 0 {
            // SAFETY: as in LibJpeg::message; `dec` is alive (still borrowed).
            let m = unsafe { CStr::from_ptr(sys::tp_jpeg_message(dec)) }
                .to_string_lossy()
                .into_owned();
            return Err(match rc {
                4 | 5 => JpegError::Misuse(m),
                _ => JpegError::Corrupt(m),
            });
        }
        Ok(Decoded { left: l, cols: c })
    }
}

impl Drop for Header<'_> {
    fn drop(&mut self) {
        // A header read but never decoded: reset the decoder for the next file.
        // SAFETY: the decoder is alive (borrowed); abort is valid in any state.
        unsafe { sys::tp_jpeg_abort(self.dec.raw.as_ptr()) }
    }
}
