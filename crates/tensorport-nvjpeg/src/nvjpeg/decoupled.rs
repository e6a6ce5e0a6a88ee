//! nvJPEG's decoupled decode, one image at a time in three phases: the host phase (parsing and,
//! on the hybrid backend, Huffman decoding on the calling thread's CPU), the copy of its
//! coefficients to the GPU, and the GPU phase (IDCT, colour conversion) on a CUDA stream. The
//! handle may be shared by threads; each thread has its own decoder state, parsed stream,
//! buffers and parameters.

use std::ffi::{c_int, c_void};

use super::{sym, Handle, Image, JpegStream, Nvjpeg, State, Status};
use crate::Result;

/// `nvjpegJpegDecoder_t`.
pub type Decoder = *mut c_void;
/// `nvjpegBufferPinned_t`.
pub type PinnedBuf = *mut c_void;
/// `nvjpegBufferDevice_t`.
pub type DeviceBuf = *mut c_void;
/// `nvjpegDecodeParams_t`.
pub type Params = *mut c_void;

/// `NVJPEG_BACKEND_HYBRID`: Huffman decoding on the CPU, the rest on CUDA cores.
pub const BACKEND_HYBRID: c_int = 1;
/// `NVJPEG_BACKEND_GPU_HYBRID`: parsing on the CPU, Huffman decoding and the rest on CUDA cores.
pub const BACKEND_GPU_HYBRID: c_int = 2;

type DecoderCreate = unsafe extern "C" fn(Handle, c_int, *mut Decoder) -> Status;
type DecoderDestroy = unsafe extern "C" fn(Decoder) -> Status;
type DecoderStateCreate = unsafe extern "C" fn(Handle, Decoder, *mut State) -> Status;
type PinnedCreate = unsafe extern "C" fn(Handle, *mut c_void, *mut PinnedBuf) -> Status;
type PinnedDestroy = unsafe extern "C" fn(PinnedBuf) -> Status;
type DeviceCreate = unsafe extern "C" fn(Handle, *mut c_void, *mut DeviceBuf) -> Status;
type DeviceDestroy = unsafe extern "C" fn(DeviceBuf) -> Status;
type AttachPinned = unsafe extern "C" fn(State, PinnedBuf) -> Status;
type AttachDevice = unsafe extern "C" fn(State, DeviceBuf) -> Status;
type ParamsCreate = unsafe extern "C" fn(Handle, *mut Params) -> Status;
type ParamsDestroy = unsafe extern "C" fn(Params) -> Status;
type ParamsFormat = unsafe extern "C" fn(Params, c_int) -> Status;
type StreamParse =
    unsafe extern "C" fn(Handle, *const u8, usize, c_int, c_int, JpegStream) -> Status;
type DecodeHost = unsafe extern "C" fn(Handle, Decoder, State, Params, JpegStream) -> Status;
type TransferToDevice =
    unsafe extern "C" fn(Handle, Decoder, State, JpegStream, *mut c_void) -> Status;
type DecodeDevice = unsafe extern "C" fn(Handle, Decoder, State, *mut Image, *mut c_void) -> Status;
type Supported = unsafe extern "C" fn(Decoder, JpegStream, Params, *mut c_int) -> Status;

/// The decoupled API's entry points (loaded with the library: [`Nvjpeg::decoupled`]).
#[derive(Clone, Copy)]
pub struct Decoupled {
    decoder_create: DecoderCreate,
    decoder_destroy: DecoderDestroy,
    decoder_state_create: DecoderStateCreate,
    pinned_create: PinnedCreate,
    pinned_destroy: PinnedDestroy,
    device_create: DeviceCreate,
    device_destroy: DeviceDestroy,
    attach_pinned: AttachPinned,
    attach_device: AttachDevice,
    params_create: ParamsCreate,
    params_destroy: ParamsDestroy,
    params_format: ParamsFormat,
    stream_parse: StreamParse,
    decode_host: DecodeHost,
    transfer: TransferToDevice,
    decode_device: DecodeDevice,
    supported: Supported,
}

impl Decoupled {
    /// The entry points in `lib`.
    ///
    /// # Safety
    /// `lib` is nvJPEG, and stays loaded while these are called.
    pub(super) unsafe fn load(lib: &libloading::Library) -> Result<Decoupled> {
        // SAFETY: each type above is transcribed from nvjpeg.h (CUDA 12 and 13 agree).
        unsafe {
            Ok(Decoupled {
                decoder_create: sym(lib, "nvjpegDecoderCreate")?,
                decoder_destroy: sym(lib, "nvjpegDecoderDestroy")?,
                decoder_state_create: sym(lib, "nvjpegDecoderStateCreate")?,
                pinned_create: sym(lib, "nvjpegBufferPinnedCreate")?,
                pinned_destroy: sym(lib, "nvjpegBufferPinnedDestroy")?,
                device_create: sym(lib, "nvjpegBufferDeviceCreate")?,
                device_destroy: sym(lib, "nvjpegBufferDeviceDestroy")?,
                attach_pinned: sym(lib, "nvjpegStateAttachPinnedBuffer")?,
                attach_device: sym(lib, "nvjpegStateAttachDeviceBuffer")?,
                params_create: sym(lib, "nvjpegDecodeParamsCreate")?,
                params_destroy: sym(lib, "nvjpegDecodeParamsDestroy")?,
                params_format: sym(lib, "nvjpegDecodeParamsSetOutputFormat")?,
                stream_parse: sym(lib, "nvjpegJpegStreamParse")?,
                decode_host: sym(lib, "nvjpegDecodeJpegHost")?,
                transfer: sym(lib, "nvjpegDecodeJpegTransferToDevice")?,
                decode_device: sym(lib, "nvjpegDecodeJpegDevice")?,
                supported: sym(lib, "nvjpegDecoderJpegSupported")?,
            })
        }
    }
}

/// Writes one handle through `f` and returns it, or the call's error.
fn made<T>(lib: &Nvjpeg, call: &'static str, f: impl FnOnce(*mut T) -> Status) -> Result<T>
where
    T: Copy,
{
    let mut out = std::mem::MaybeUninit::<T>::uninit();
    lib.check(call, f(out.as_mut_ptr()))?;
    // SAFETY: the call succeeded, so it wrote the handle.
    Ok(unsafe { out.assume_init() })
}

impl Nvjpeg {
    /// `nvjpegDecoderCreate`.
    ///
    /// # Safety
    /// `h` live.
    pub unsafe fn decoder_create(&self, h: Handle, backend: c_int) -> Result<Decoder> {
        // SAFETY: the caller's contract; writes one handle.
        made(self, "nvjpegDecoderCreate", |p| unsafe {
            (self.decoupled.decoder_create)(h, backend, p)
        })
    }

    /// `nvjpegDecoderDestroy`.
    ///
    /// # Safety
    /// `d` live, its states destroyed, not used afterwards.
    pub unsafe fn decoder_destroy(&self, d: Decoder) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegDecoderDestroy", unsafe {
            (self.decoupled.decoder_destroy)(d)
        })
    }

    /// `nvjpegDecoderStateCreate` (destroyed with [`Nvjpeg::state_destroy`]).
    ///
    /// # Safety
    /// `h` and `d` live.
    pub unsafe fn decoder_state_create(&self, h: Handle, d: Decoder) -> Result<State> {
        // SAFETY: the caller's contract; writes one handle.
        made(self, "nvjpegDecoderStateCreate", |p| unsafe {
            (self.decoupled.decoder_state_create)(h, d, p)
        })
    }

    /// `nvjpegBufferPinnedCreate` with nvJPEG's own allocator.
    ///
    /// # Safety
    /// `h` live.
    pub unsafe fn pinned_create(&self, h: Handle) -> Result<PinnedBuf> {
        // SAFETY: the caller's contract; a null allocator selects the default.
        made(self, "nvjpegBufferPinnedCreate", |p| unsafe {
            (self.decoupled.pinned_create)(h, std::ptr::null_mut(), p)
        })
    }

    /// `nvjpegBufferPinnedDestroy`.
    ///
    /// # Safety
    /// `b` live, no copy from it in flight, not used afterwards.
    pub unsafe fn pinned_destroy(&self, b: PinnedBuf) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegBufferPinnedDestroy", unsafe {
            (self.decoupled.pinned_destroy)(b)
        })
    }

    /// `nvjpegBufferDeviceCreate` with nvJPEG's own allocator.
    ///
    /// # Safety
    /// `h` live.
    pub unsafe fn device_buffer_create(&self, h: Handle) -> Result<DeviceBuf> {
        // SAFETY: the caller's contract; a null allocator selects the default.
        made(self, "nvjpegBufferDeviceCreate", |p| unsafe {
            (self.decoupled.device_create)(h, std::ptr::null_mut(), p)
        })
    }

    /// `nvjpegBufferDeviceDestroy`.
    ///
    /// # Safety
    /// `b` live, no work using it in flight, not used afterwards.
    pub unsafe fn device_buffer_destroy(&self, b: DeviceBuf) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegBufferDeviceDestroy", unsafe {
            (self.decoupled.device_destroy)(b)
        })
    }

    /// `nvjpegStateAttachPinnedBuffer`.
    ///
    /// # Safety
    /// `st` and `b` live; no copy from the buffer it replaces in flight.
    pub unsafe fn attach_pinned(&self, st: State, b: PinnedBuf) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegStateAttachPinnedBuffer", unsafe {
            (self.decoupled.attach_pinned)(st, b)
        })
    }

    /// `nvjpegStateAttachDeviceBuffer`.
    ///
    /// # Safety
    /// `st` and `b` live.
    pub unsafe fn attach_device(&self, st: State, b: DeviceBuf) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegStateAttachDeviceBuffer", unsafe {
            (self.decoupled.attach_device)(st, b)
        })
    }

    /// `nvjpegDecodeParamsCreate`, then its output format set to `format`.
    ///
    /// # Safety
    /// `h` live.
    pub unsafe fn params_create(&self, h: Handle, format: c_int) -> Result<Params> {
        // SAFETY: the caller's contract; writes one handle.
        let p = made(self, "nvjpegDecodeParamsCreate", |p| unsafe {
            (self.decoupled.params_create)(h, p)
        })?;
        // SAFETY: `p` was just made.
        let r = self.check("nvjpegDecodeParamsSetOutputFormat", unsafe {
            (self.decoupled.params_format)(p, format)
        });
        if let Err(e) = r {
            // SAFETY: `p` is live and not used again.
            let _ = unsafe { self.params_destroy(p) };
            return Err(e);
        }
        Ok(p)
    }

    /// `nvjpegDecodeParamsDestroy`.
    ///
    /// # Safety
    /// `p` live, not used afterwards.
    pub unsafe fn params_destroy(&self, p: Params) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegDecodeParamsDestroy", unsafe {
            (self.decoupled.params_destroy)(p)
        })
    }

    /// `nvjpegJpegStreamParse` of the whole file into `js`, without keeping a copy of its
    /// bytes (they must stay unchanged until the host phase has run), then whether `d` takes it.
    ///
    /// # Safety
    /// `h`, `d`, `p` and `js` live; `js` used by this thread only.
    pub unsafe fn parse_for(
        &self,
        h: Handle,
        d: Decoder,
        p: Params,
        js: JpegStream,
        data: &[u8],
    ) -> Result<bool> {
        // SAFETY: the caller's contract; reads `data`.
        self.check("nvjpegJpegStreamParse", unsafe {
            (self.decoupled.stream_parse)(h, data.as_ptr(), data.len(), 0, 0, js)
        })?;
        let mut not_supported: c_int = 1;
        // SAFETY: as above; writes one int.
        self.check("nvjpegDecoderJpegSupported", unsafe {
            (self.decoupled.supported)(d, js, p, &mut not_supported)
        })?;
        Ok(not_supported == 0)
    }

    /// `nvjpegDecodeJpegHost`: the host phase of the image parsed into `js`.
    ///
    /// # Safety
    /// All live; `st` has a pinned buffer attached that no copy is reading; the parsed bytes
    /// are unchanged.
    pub unsafe fn decode_host(
        &self,
        h: Handle,
        d: Decoder,
        st: State,
        p: Params,
        js: JpegStream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegDecodeJpegHost", unsafe {
            (self.decoupled.decode_host)(h, d, st, p, js)
        })
    }

    /// `nvjpegDecodeJpegTransferToDevice` on `stream`.
    ///
    /// # Safety
    /// All live, after [`Nvjpeg::decode_host`] of the same image; the pinned buffer unchanged
    /// until the copy has run on `stream`.
    pub unsafe fn transfer_to_device(
        &self,
        h: Handle,
        d: Decoder,
        st: State,
        js: JpegStream,
        stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegDecodeJpegTransferToDevice", unsafe {
            (self.decoupled.transfer)(h, d, st, js, stream)
        })
    }

    /// `nvjpegDecodeJpegDevice` into `out` on `stream`.
    ///
    /// # Safety
    /// All live, after [`Nvjpeg::transfer_to_device`] of the same image on the same stream;
    /// each `out` plane device memory large enough for its plane, valid until the decode has
    /// run on `stream`.
    pub unsafe fn decode_device(
        &self,
        h: Handle,
        d: Decoder,
        st: State,
        out: &mut Image,
        stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegDecodeJpegDevice", unsafe {
            (self.decoupled.decode_device)(h, d, st, out, stream)
        })
    }
}
