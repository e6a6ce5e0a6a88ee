//! Kernels: CUDA C compiled at run time with NVRTC (loaded like libcuda, so nothing here needs
//! CUDA at build time), loaded into the device's primary context. This crate's, and those of
//! crates on it (`tensorport-cudnn`'s model).

use std::ffi::{CStr, CString};
use std::sync::Arc;

use cudarc::driver::sys;

use crate::{Error, Gpu, Result, Stream};

/// One compiled kernel and its module, unloaded on drop.
pub struct Kernel {
    gpu: Arc<Gpu>,
    module: sys::CUmodule,
    func: sys::CUfunction,
}

// SAFETY: module and function handles are identifiers valid in the context on any thread; every
// use binds the context first.
unsafe impl Send for Kernel {}
// SAFETY: the only use through `&Kernel` is `launch`, and the driver API is thread-safe: a
// function handle may be launched from several threads at once (each launch binds the context
// and passes its own parameters and stream). Nothing in `Kernel` changes after `compile`.
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Compiles `src` for `gpu`'s architecture and loads its `entry` function.
    pub fn compile(gpu: &Arc<Gpu>, src: &str, file: &str, entry: &CStr) -> Result<Kernel> {
        Kernel::from_ptx(gpu, &Ptx::compile(gpu, src, file)?, entry)
    }

    /// Loads `entry` from `ptx` (compiled for this `gpu`, on any thread) into `gpu`'s context.
    pub fn from_ptx(gpu: &Arc<Gpu>, ptx: &Ptx, entry: &CStr) -> Result<Kernel> {
        gpu.bind()?;
        Kernel::load(gpu, &ptx.0, entry)
    }

    /// Compiles `src` once and loads each of `entries` from it (each kernel its own module).
    pub fn compile_all<const N: usize>(
        gpu: &Arc<Gpu>,
        src: &str,
        file: &str,
        entries: [&CStr; N],
    ) -> Result<[Kernel; N]> {
        gpu.bind()?;
        let ptx = Ptx::compile(gpu, src, file)?.0;
        let kernels = entries
            .iter()
            .map(|e| Kernel::load(gpu, &ptx, e))
            .collect::<Result<Vec<_>>>()?;
        Ok(kernels
            .try_into()
            .unwrap_or_else(|_| unreachable!("one kernel per entry")))
    }

    /// Loads `entry` from `ptx` into `gpu`'s context (bound by the caller).
    fn load(gpu: &Arc<Gpu>, ptx: &CStr, entry: &CStr) -> Result<Kernel> {
        let d = gpu.driver();
        // SAFETY: the context is bound; `ptx` is NUL-terminated PTX text.
        let module = unsafe { d.module_load_data(ptx.to_bytes_with_nul())? };
        // SAFETY: a live module.
        let func = match unsafe { d.module_get_function(module, entry) } {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: loaded above, nothing launched from it.
                let _ = unsafe { d.module_unload(module) };
                return Err(e);
            }
        };
        Ok(Kernel {
            gpu: gpu.clone(),
            module,
            func,
        })
    }

    /// Launches the kernel on `stream`.
    ///
    /// # Safety
    /// `params` must point at values matching the kernel's parameters in number, order and
    /// types, and every memory the kernel touches must stay valid until it has run.
    pub unsafe fn launch(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        stream: &Stream,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        self.gpu.bind()?;
        // SAFETY: the caller's contract; the function is live in the bound context.
        unsafe {
            self.gpu
                .driver()
                .launch(self.func, grid, block, stream.raw().cast(), params)
        }
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: loaded in `compile`; owners wait for their launches before dropping.
        let _ = unsafe { self.gpu.driver().module_unload(self.module) };
    }
}

/// CUDA C compiled to PTX for one GPU's architecture. NVRTC needs no context, so a caller may
/// compile on a thread of its own while the context's other set-up goes on, and load the
/// result with [`Kernel::from_ptx`].
#[derive(Debug, Clone)]
pub struct Ptx(CString);

impl Ptx {
    /// `src` (named `file` in NVRTC's messages) compiled by NVRTC for `gpu`'s architecture.
    pub fn compile(gpu: &Gpu, src: &str, file: &str) -> Result<Ptx> {
        compile(gpu, src, file).map(Ptx)
    }
}

/// `src` as PTX for `gpu`'s architecture, compiled by NVRTC.
fn compile(gpu: &Gpu, src: &str, file: &str) -> Result<CString> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::NoNvrtc(
            "libnvrtc could not be loaded (the GPU kernels are compiled at run time); install \
             the CUDA toolkit or `pip install nvidia-cuda-nvrtc` and put its lib folder on \
             LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let d = gpu.driver();
    let major = d.attribute(
        gpu.dev(),
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
    )?;
    let minor = d.attribute(
        gpu.dev(),
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    )?;
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        name: Some(file.into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| Error::Call {
        call: "nvrtcCompileProgram",
        code: -1,
        message: format!("{e:?}"),
    })?;
    CString::new(ptx.to_src()).map_err(|_| Error::BadAnswer("PTX with a NUL byte"))
}
