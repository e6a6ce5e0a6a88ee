//! The nvJPEG floor: the library found and loaded at run time (like libcuda), and one small
//! function per call, each returning a `Result` that names the call. All of nvJPEG's FFI is
//! here; the crate's `jpeg` module builds the safe decoder on it.
//!
//! Where the library is looked for, in order: `$TENSORPORT_NVJPEG` (a file), `libnvjpeg.so.13`
//! and `libnvjpeg.so` on the loader's path (`LD_LIBRARY_PATH`, ldconfig), the CUDA toolkit
//! (`$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`), and the `nvidia-nvjpeg` wheel in the active
//! Python environment (`$VIRTUAL_ENV`, `$CONDA_PREFIX`).

use std::ffi::{c_int, c_uint, c_void};
use std::path::PathBuf;

use crate::{Error, Result};

mod decoupled;
pub use decoupled::{Decoder, DeviceBuf, Params, PinnedBuf, BACKEND_GPU_HYBRID, BACKEND_HYBRID};

/// `nvjpegStatus_t`.
pub type Status = c_int;
/// `nvjpegHandle_t`.
pub type Handle = *mut c_void;
/// `nvjpegJpegState_t`.
pub type State = *mut c_void;
/// `nvjpegJpegStream_t`.
pub type JpegStream = *mut c_void;

/// `NVJPEG_MAX_COMPONENT`.
pub const MAX_COMPONENT: usize = 4;
/// `NVJPEG_OUTPUT_RGB`: planar RGB, one plane per `channel`.
pub const OUTPUT_RGB: c_int = 3;
/// `NVJPEG_BACKEND_DEFAULT`.
pub const BACKEND_DEFAULT: c_int = 0;
/// `NVJPEG_BACKEND_HARDWARE`: the GPU's JPEG engines (A100, H100, H200…).
pub const BACKEND_HARDWARE: c_int = 3;
/// `NVJPEG_FLAGS_DEFAULT`.
pub const FLAGS_DEFAULT: c_uint = 0;
/// `NVJPEG_CSS_444`: chroma at full resolution (nothing to upsample).
pub const CSS_444: c_int = 0;
/// `NVJPEG_CSS_422`: chroma at half the width.
pub const CSS_422: c_int = 1;
/// `NVJPEG_CSS_420`: chroma at half the width and height.
pub const CSS_420: c_int = 2;
/// `NVJPEG_CSS_GRAY`: one component.
pub const CSS_GRAY: c_int = 6;

/// What `nvjpegGetImageInfo` tells of a JPEG.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageInfo {
    /// Colour components.
    pub components: c_int,
    /// `nvjpegChromaSubsampling_t`.
    pub subsampling: c_int,
    /// The first component's width.
    pub width: u32,
    /// The first component's height.
    pub height: u32,
}

/// `NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION`: chroma upsampled by interpolation, as
/// libjpeg-turbo's default ("fancy") upsampling does.
pub const FLAGS_UPSAMPLING_WITH_INTERPOLATION: c_uint = 1 << 5;

/// `nvjpegImage_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Image {
    /// Device pointers, one per plane.
    pub channel: [*mut u8; MAX_COMPONENT],
    /// Bytes per row of each plane.
    pub pitch: [usize; MAX_COMPONENT],
}

impl Default for Image {
    fn default() -> Image {
        Image {
            channel: [std::ptr::null_mut(); MAX_COMPONENT],
            pitch: [0; MAX_COMPONENT],
        }
    }
}

type Create = unsafe extern "C" fn(c_int, *mut c_void, *mut c_void, c_uint, *mut Handle) -> Status;
type Destroy = unsafe extern "C" fn(Handle) -> Status;
type StateCreate = unsafe extern "C" fn(Handle, *mut State) -> Status;
type StateDestroy = unsafe extern "C" fn(State) -> Status;
type GetImageInfo = unsafe extern "C" fn(
    Handle,
    *const u8,
    usize,
    *mut c_int,
    *mut c_int,
    *mut c_int,
    *mut c_int,
) -> Status;
type BatchedInit = unsafe extern "C" fn(Handle, State, c_int, c_int, c_int) -> Status;
type BatchedPreAllocate =
    unsafe extern "C" fn(Handle, State, c_int, c_int, c_int, c_int, c_int) -> Status;
type Batched = unsafe extern "C" fn(
    Handle,
    State,
    *const *const u8,
    *const usize,
    *mut Image,
    *mut c_void,
) -> Status;
type StreamCreate = unsafe extern "C" fn(Handle, *mut JpegStream) -> Status;
type StreamDestroy = unsafe extern "C" fn(JpegStream) -> Status;
type StreamParseHeader = unsafe extern "C" fn(Handle, *const u8, usize, JpegStream) -> Status;
type BatchedSupported = unsafe extern "C" fn(Handle, JpegStream, *mut c_int) -> Status;
type HwInfo = unsafe extern "C" fn(Handle, *mut c_uint, *mut c_uint) -> Status;

/// The loaded library and its entry points.
pub struct Nvjpeg {
    path: String,
    create: Create,
    destroy: Destroy,
    state_create: StateCreate,
    state_destroy: StateDestroy,
    get_image_info: GetImageInfo,
    batched_init: BatchedInit,
    /// Absent from libraries before CUDA 11.4.
    batched_pre_allocate: Option<BatchedPreAllocate>,
    batched: Batched,
    stream_create: StreamCreate,
    stream_destroy: StreamDestroy,
    stream_parse_header: StreamParseHeader,
    batched_supported: BatchedSupported,
    hw_info: HwInfo,
    decoupled: decoupled::Decoupled,
    // Keeps the code behind the pointers above mapped.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nvjpeg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvjpeg").field("path", &self.path).finish()
    }
}

fn candidates() -> Vec<PathBuf> {
    let mut c: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("TENSORPORT_NVJPEG") {
        c.push(p.into());
    }
    c.push("libnvjpeg.so.13".into());
    c.push("libnvjpeg.so.12".into());
    c.push("libnvjpeg.so".into());
    let roots = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .chain([PathBuf::from("/usr/local/cuda")]);
    for r in roots {
        for lib in ["lib64", "lib", "targets/x86_64-linux/lib"] {
            c.push(r.join(lib).join("libnvjpeg.so.13"));
            c.push(r.join(lib).join("libnvjpeg.so.12"));
        }
    }
    // The `nvidia-nvjpeg` wheel: site-packages/nvidia/{cu13,nvjpeg}/lib.
    for env in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        let Some(prefix) = std::env::var_os(env) else {
            continue;
        };
        let Ok(entries) = std::fs::read_dir(PathBuf::from(prefix).join("lib")) else {
            continue;
        };
        for e in entries.flatten() {
            let site = e.path().join("site-packages/nvidia");
            c.push(site.join("cu13/lib/libnvjpeg.so.13"));
            c.push(site.join("nvjpeg/lib/libnvjpeg.so.12"));
        }
    }
    c
}

/// Copies a symbol's address out of `lib`.
///
/// # Safety
/// `T` must be the symbol's true function type.
unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T> {
    // SAFETY: the caller's contract on `T`.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| Error::NoNvjpeg(format!("the nvJPEG library lacks {name}: {e}")))
}

impl Nvjpeg {
    /// Finds and loads nvJPEG, or says where it looked.
    pub fn load() -> Result<Nvjpeg> {
        let tried = candidates();
        for path in &tried {
            if path.is_absolute() && !path.exists() {
                continue;
            }
            // SAFETY: loading nvJPEG runs its initialisers, which only set up its own state.
            let Ok(lib) = (unsafe { libloading::Library::new(path) }) else {
                continue;
            };
            // SAFETY: each type below is transcribed from nvjpeg.h (CUDA 12 and 13 agree).
            return unsafe {
                Ok(Nvjpeg {
                    path: path.display().to_string(),
                    create: sym(&lib, "nvjpegCreateEx")?,
                    destroy: sym(&lib, "nvjpegDestroy")?,
                    state_create: sym(&lib, "nvjpegJpegStateCreate")?,
                    state_destroy: sym(&lib, "nvjpegJpegStateDestroy")?,
                    get_image_info: sym(&lib, "nvjpegGetImageInfo")?,
                    batched_init: sym(&lib, "nvjpegDecodeBatchedInitialize")?,
                    batched_pre_allocate: sym(&lib, "nvjpegDecodeBatchedPreAllocate").ok(),
                    batched: sym(&lib, "nvjpegDecodeBatched")?,
                    stream_create: sym(&lib, "nvjpegJpegStreamCreate")?,
                    stream_destroy: sym(&lib, "nvjpegJpegStreamDestroy")?,
                    stream_parse_header: sym(&lib, "nvjpegJpegStreamParseHeader")?,
                    batched_supported: sym(&lib, "nvjpegDecodeBatchedSupported")?,
                    hw_info: sym(&lib, "nvjpegGetHardwareDecoderInfo")?,
                    decoupled: decoupled::Decoupled::load(&lib)?,
                    _lib: lib,
                })
            };
        }
        Err(Error::NoNvjpeg(
            "libnvjpeg could not be loaded (tried $TENSORPORT_NVJPEG, the loader's path, the CUDA \
             toolkit and the nvidia-nvjpeg wheel of $VIRTUAL_ENV/$CONDA_PREFIX); install the CUDA \
             toolkit or `pip install nvidia-nvjpeg`, or set TENSORPORT_NVJPEG to the library file"
                .into(),
        ))
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    fn check(&self, call: &'static str, s: Status) -> Result<()> {
        if s == 0 {
            return Ok(());
        }
        let what = match s {
            1 => "not initialised",
            2 => "invalid parameter",
            3 => "bad JPEG",
            4 => "JPEG not supported",
            5 => "allocator failure",
            6 => "execution failed",
            7 => "architecture mismatch (no such backend on this GPU)",
            8 => "internal error",
            9 => "implementation not supported",
            10 => "incomplete bitstream",
            _ => "unknown status",
        };
        Err(Error::Call {
            call,
            code: s,
            message: what.into(),
        })
    }

    /// `nvjpegCreateEx` with nvJPEG's own allocators.
    pub fn create(&self, backend: c_int, flags: c_uint) -> Result<Handle> {
        let mut h = std::ptr::null_mut();
        // SAFETY: null allocators select the defaults; writes one handle.
        let s = unsafe {
            (self.create)(
                backend,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                flags,
                &mut h,
            )
        };
        self.check("nvjpegCreateEx", s)?;
        Ok(h)
    }

    /// `nvjpegDestroy`.
    ///
    /// # Safety
    /// `h` live, its states destroyed, not used afterwards.
    pub unsafe fn destroy(&self, h: Handle) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegDestroy", unsafe { (self.destroy)(h) })
    }

    /// `nvjpegJpegStateCreate`.
    ///
    /// # Safety
    /// `h` live.
    pub unsafe fn state_create(&self, h: Handle) -> Result<State> {
        let mut st = std::ptr::null_mut();
        // SAFETY: the caller's contract; writes one handle.
        self.check("nvjpegJpegStateCreate", unsafe {
            (self.state_create)(h, &mut st)
        })?;
        Ok(st)
    }

    /// `nvjpegJpegStateDestroy`.
    ///
    /// # Safety
    /// `st` live, no decode using it in flight, not used afterwards.
    pub unsafe fn state_destroy(&self, st: State) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegJpegStateDestroy", unsafe {
            (self.state_destroy)(st)
        })
    }

    /// `nvjpegGetImageInfo`: components, chroma subsampling, width and height of a JPEG, from
    /// its header.
    ///
    /// # Safety
    /// `h` live.
    pub unsafe fn image_info(&self, h: Handle, data: &[u8]) -> Result<ImageInfo> {
        let (mut n, mut css) = (0, 0);
        let (mut w, mut ht) = ([0 as c_int; MAX_COMPONENT], [0 as c_int; MAX_COMPONENT]);
        // SAFETY: reads `data`; writes two ints and two arrays of MAX_COMPONENT ints.
        let s = unsafe {
            (self.get_image_info)(
                h,
                data.as_ptr(),
                data.len(),
                &mut n,
                &mut css,
                w.as_mut_ptr(),
                ht.as_mut_ptr(),
            )
        };
        self.check("nvjpegGetImageInfo", s)?;
        Ok(ImageInfo {
            components: n,
            subsampling: css,
            width: w[0].max(0) as u32,
            height: ht[0].max(0) as u32,
        })
    }

    /// `nvjpegDecodeBatchedInitialize`.
    ///
    /// # Safety
    /// `h` and `st` live, no batch in flight on `st`.
    pub unsafe fn batched_initialize(
        &self,
        h: Handle,
        st: State,
        batch: usize,
        format: c_int,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegDecodeBatchedInitialize", unsafe {
            (self.batched_init)(h, st, batch as c_int, 1, format)
        })
    }

    /// `nvjpegDecodeBatchedPreAllocate`: gives the hardware decoder of `h`/`st` a memory pool
    /// sized for `batch` images of `width` × `height` at 4:4:4 in planar RGB, which then grows
    /// as batches need and is reused across calls, where without it each batched call whose
    /// size or images differ from the last allocates afresh. `Ok(false)` where the library
    /// lacks the call.
    ///
    /// # Safety
    /// `h` (a hardware-backend handle) and `st` live, no batch in flight on `st`.
    pub unsafe fn batched_pre_allocate(
        &self,
        h: Handle,
        st: State,
        batch: usize,
        width: u32,
        height: u32,
    ) -> Result<bool> {
        let Some(f) = self.batched_pre_allocate else {
            return Ok(false);
        };
        let int = |v: usize| c_int::try_from(v).unwrap_or(c_int::MAX).max(1);
        // SAFETY: the caller's contract; plain integers in.
        self.check("nvjpegDecodeBatchedPreAllocate", unsafe {
            f(
                h,
                st,
                int(batch),
                int(width as usize),
                int(height as usize),
                CSS_444,
                OUTPUT_RGB,
            )
        })?;
        Ok(true)
    }

    /// `nvjpegDecodeBatched`.
    ///
    /// # Safety
    /// `h`/`st` live and initialised for `data.len()` images; each `out` plane is device memory
    /// large enough for its image (pitch × height), valid until the decode has run on `stream`;
    /// the three slices have the same length.
    pub unsafe fn decode_batched(
        &self,
        h: Handle,
        st: State,
        data: &[*const u8],
        lengths: &[usize],
        out: &mut [Image],
        stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegDecodeBatched", unsafe {
            (self.batched)(
                h,
                st,
                data.as_ptr(),
                lengths.as_ptr(),
                out.as_mut_ptr(),
                stream,
            )
        })
    }

    /// Whether the batched decoder of `h` takes this JPEG (for the hardware backend: baseline,
    /// one scan, a supported subsampling), from its parsed header.
    ///
    /// # Safety
    /// `h` and `js` live.
    pub unsafe fn batched_supported(&self, h: Handle, js: JpegStream, data: &[u8]) -> bool {
        // SAFETY: the caller's contract; reads `data`, writes one int.
        unsafe {
            if (self.stream_parse_header)(h, data.as_ptr(), data.len(), js) != 0 {
                return false;
            }
            let mut not_supported: c_int = 1;
            (self.batched_supported)(h, js, &mut not_supported) == 0 && not_supported == 0
        }
    }

    /// `nvjpegJpegStreamCreate`.
    ///
    /// # Safety
    /// `h` live.
    pub unsafe fn stream_create(&self, h: Handle) -> Result<JpegStream> {
        let mut js = std::ptr::null_mut();
        // SAFETY: the caller's contract; writes one handle.
        self.check("nvjpegJpegStreamCreate", unsafe {
            (self.stream_create)(h, &mut js)
        })?;
        Ok(js)
    }

    /// `nvjpegJpegStreamDestroy`.
    ///
    /// # Safety
    /// `js` live, not used afterwards.
    pub unsafe fn stream_destroy(&self, js: JpegStream) -> Result<()> {
        // SAFETY: the caller's contract.
        self.check("nvjpegJpegStreamDestroy", unsafe {
            (self.stream_destroy)(js)
        })
    }

    /// `nvjpegGetHardwareDecoderInfo`: (engines, cores per engine).
    ///
    /// # Safety
    /// `h` live (a hardware-backend handle).
    pub unsafe fn hardware_info(&self, h: Handle) -> Result<(u32, u32)> {
        let (mut e, mut c) = (0, 0);
        // SAFETY: the caller's contract; writes two ints.
        self.check("nvjpegGetHardwareDecoderInfo", unsafe {
            (self.hw_info)(h, &mut e, &mut c)
        })?;
        Ok((e, c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_toolkit_and_the_wheel_are_searched_after_the_loaders_path() {
        let c = candidates();
        let pos = |p: &str| c.iter().position(|x| x == std::path::Path::new(p));
        let soname = pos("libnvjpeg.so.13").expect("the soname is tried");
        let toolkit = pos("/usr/local/cuda/lib64/libnvjpeg.so.13").expect("the toolkit is tried");
        assert!(soname < toolkit);
    }

    #[test]
    fn image_is_laid_out_as_nvjpeg_image_t() {
        // Four plane pointers, then four `size_t` pitches.
        assert_eq!(std::mem::size_of::<Image>(), 64);
        let im = Image::default();
        assert!(im.channel.iter().all(|p| p.is_null()));
    }
}
