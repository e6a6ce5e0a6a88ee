//! NIXL's C API (`libnixl_capi.so`), loaded at run time: one function pointer per call, and
//! [`Capi::check`] turning a status into an error that names the call. Everything that touches a
//! raw handle lives here and in the RAII types of `agent.rs` and `read.rs`.
//!
//! The types below are transcribed from NIXL's `wrapper.h` (the C API its Rust bindings use, built
//! into the `nixl-cu13` wheel as `libnixl_capi.so`): every handle is an opaque pointer, every call
//! returns an `int` status (0 done, 1 still in progress, negative an error), and the blobs it
//! returns (metadata, agent names) are `malloc`ed for the caller to `free`.

use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// An opaque NIXL handle.
pub(crate) type Handle = *mut c_void;

pub(crate) const MEM_DRAM: c_int = 0;
pub(crate) const MEM_VRAM: c_int = 1;
pub(crate) const OP_READ: c_int = 0;
/// `NIXL_WRITE`: local memory into the peer's.
pub(crate) const OP_WRITE: c_int = 1;
pub(crate) const IN_PROGRESS: c_int = 1;

type CreateAgent = unsafe extern "C" fn(*const c_char, *mut Handle) -> c_int;
type CreateConfiguredAgent =
    unsafe extern "C" fn(*const c_char, *const AgentConfig, *mut Handle) -> c_int;

/// `nixl_capi_agent_config_t` (NIXL 1.5), then zeroes: a library whose struct has grown reads
/// defaults, never past ours.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct AgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    /// `nixl_capi_thread_sync_t`: 0, NIXL's default (none).
    pub thread_sync: c_int,
    pub num_workers: std::ffi::c_uint,
    /// How long the progress thread waits for an event before progressing every worker anyway
    /// (0: it never waits, and spins a core).
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
    pub zeroes: [u64; 8],
}
type Destroy = unsafe extern "C" fn(Handle) -> c_int;
type GetLocalMd = unsafe extern "C" fn(Handle, *mut *mut c_void, *mut usize) -> c_int;
type LoadRemoteMd = unsafe extern "C" fn(Handle, *const c_void, usize, *mut *mut c_char) -> c_int;
type InvalidateRemoteMd = unsafe extern "C" fn(Handle, *const c_char) -> c_int;
type GetPluginParams =
    unsafe extern "C" fn(Handle, *const c_char, *mut Handle, *mut Handle) -> c_int;
type ParamsAdd = unsafe extern "C" fn(Handle, *const c_char, *const c_char) -> c_int;
type CreateBackend = unsafe extern "C" fn(Handle, *const c_char, Handle, *mut Handle) -> c_int;
type CreateDlist = unsafe extern "C" fn(c_int, *mut Handle) -> c_int;
type RegAddDesc = unsafe extern "C" fn(Handle, usize, usize, u64, *const c_void, usize) -> c_int;
type XferAddDesc = unsafe extern "C" fn(Handle, usize, usize, u64) -> c_int;
type RegisterMem = unsafe extern "C" fn(Handle, Handle, Handle) -> c_int;
type PrepDlist = unsafe extern "C" fn(Handle, *const c_char, Handle, *mut Handle, Handle) -> c_int;
type ReleaseWith = unsafe extern "C" fn(Handle, Handle) -> c_int;
type MakeXferReq = unsafe extern "C" fn(
    Handle,
    c_int,
    Handle,
    *const c_int,
    usize,
    Handle,
    *const c_int,
    usize,
    *mut Handle,
    Handle,
) -> c_int;
type PostXferReq = unsafe extern "C" fn(Handle, Handle, Handle) -> c_int;

extern "C" {
    fn free(p: *mut c_void);
}

/// The loaded library: proof that every call below exists.
pub struct Capi {
    path: PathBuf,
    pub(crate) create_agent: CreateAgent,
    /// Where the library has it (NIXL 1.5 does).
    pub(crate) create_configured_agent: Option<CreateConfiguredAgent>,
    pub(crate) destroy_agent: Destroy,
    pub(crate) get_local_md: GetLocalMd,
    pub(crate) load_remote_md: LoadRemoteMd,
    pub(crate) invalidate_remote_md: InvalidateRemoteMd,
    pub(crate) get_plugin_params: GetPluginParams,
    pub(crate) destroy_mem_list: Destroy,
    pub(crate) destroy_params: Destroy,
    pub(crate) params_add: ParamsAdd,
    pub(crate) create_backend: CreateBackend,
    pub(crate) destroy_backend: Destroy,
    pub(crate) create_reg_dlist: CreateDlist,
    pub(crate) reg_dlist_add_desc: RegAddDesc,
    pub(crate) destroy_reg_dlist: Destroy,
    pub(crate) register_mem: RegisterMem,
    pub(crate) deregister_mem: RegisterMem,
    pub(crate) create_xfer_dlist: CreateDlist,
    pub(crate) xfer_dlist_add_desc: XferAddDesc,
    pub(crate) destroy_xfer_dlist: Destroy,
    pub(crate) prep_xfer_dlist: PrepDlist,
    pub(crate) release_xfer_dlist_handle: ReleaseWith,
    pub(crate) make_xfer_req: MakeXferReq,
    pub(crate) post_xfer_req: PostXferReq,
    pub(crate) get_xfer_status: ReleaseWith,
    pub(crate) release_xfer_req: ReleaseWith,
    pub(crate) destroy_xfer_req: Destroy,
    // Keeps the code behind the pointers above mapped.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Capi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capi").field("path", &self.path).finish()
    }
}

/// Where NIXL's C API may be: `$TENSORPORT_NIXL` (the library file, or the folder of an
/// unpacked `nixl-cu13` wheel), this checkout's `target/nixl` (`scripts/fetch-nixl.sh`), the
/// wheel in `$VIRTUAL_ENV`, then the loader's path.
fn candidates() -> Vec<PathBuf> {
    const IN_WHEEL: &str = ".nixl_cu13.mesonpy.libs/libnixl_capi.so";
    let mut c = Vec::new();
    if let Some(p) = std::env::var_os("TENSORPORT_NIXL") {
        let p = PathBuf::from(p);
        c.push(p.join(IN_WHEEL));
        c.push(p);
    }
    c.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/nixl")
            .join(IN_WHEEL),
    );
    if let Some(prefix) = std::env::var_os("VIRTUAL_ENV") {
        if let Ok(entries) = std::fs::read_dir(PathBuf::from(prefix).join("lib")) {
            for e in entries.flatten() {
                c.push(e.path().join("site-packages").join(IN_WHEEL));
            }
        }
    }
    c.push("libnixl_capi.so".into());
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
        .map_err(|e| Error::NotLoaded(format!("the NIXL C API lacks {name}: {e}")))
}

impl Capi {
    /// Finds and loads NIXL's C API, or says where it looked and how to get it.
    pub fn load() -> Result<Capi> {
        for path in candidates() {
            if path.is_absolute() && !path.is_file() {
                continue;
            }
            // SAFETY: loading the library runs NIXL's and UCX's initialisers, which set up their
            // own state only.
            let Ok(lib) = (unsafe { libloading::Library::new(&path) }) else {
                continue;
            };
            // SAFETY: each type is transcribed from NIXL's wrapper.h (see the module docs).
            return unsafe {
                Ok(Capi {
                    create_agent: sym(&lib, "nixl_capi_create_agent")?,
                    create_configured_agent: sym(&lib, "nixl_capi_create_configured_agent").ok(),
                    destroy_agent: sym(&lib, "nixl_capi_destroy_agent")?,
                    get_local_md: sym(&lib, "nixl_capi_get_local_md")?,
                    load_remote_md: sym(&lib, "nixl_capi_load_remote_md")?,
                    invalidate_remote_md: sym(&lib, "nixl_capi_invalidate_remote_md")?,
                    get_plugin_params: sym(&lib, "nixl_capi_get_plugin_params")?,
                    destroy_mem_list: sym(&lib, "nixl_capi_destroy_mem_list")?,
                    destroy_params: sym(&lib, "nixl_capi_destroy_params")?,
                    params_add: sym(&lib, "nixl_capi_params_add")?,
                    create_backend: sym(&lib, "nixl_capi_create_backend")?,
                    destroy_backend: sym(&lib, "nixl_capi_destroy_backend")?,
                    create_reg_dlist: sym(&lib, "nixl_capi_create_reg_dlist")?,
                    reg_dlist_add_desc: sym(&lib, "nixl_capi_reg_dlist_add_desc")?,
                    destroy_reg_dlist: sym(&lib, "nixl_capi_destroy_reg_dlist")?,
                    register_mem: sym(&lib, "nixl_capi_register_mem")?,
                    deregister_mem: sym(&lib, "nixl_capi_deregister_mem")?,
                    create_xfer_dlist: sym(&lib, "nixl_capi_create_xfer_dlist")?,
                    xfer_dlist_add_desc: sym(&lib, "nixl_capi_xfer_dlist_add_desc")?,
                    destroy_xfer_dlist: sym(&lib, "nixl_capi_destroy_xfer_dlist")?,
                    prep_xfer_dlist: sym(&lib, "nixl_capi_prep_xfer_dlist")?,
                    release_xfer_dlist_handle: sym(&lib, "nixl_capi_release_xfer_dlist_handle")?,
                    make_xfer_req: sym(&lib, "nixl_capi_make_xfer_req")?,
                    post_xfer_req: sym(&lib, "nixl_capi_post_xfer_req")?,
                    get_xfer_status: sym(&lib, "nixl_capi_get_xfer_status")?,
                    release_xfer_req: sym(&lib, "nixl_capi_release_xfer_req")?,
                    destroy_xfer_req: sym(&lib, "nixl_capi_destroy_xfer_req")?,
                    path,
                    _lib: lib,
                })
            };
        }
        Err(Error::NotLoaded(
            "NIXL's C API (libnixl_capi.so) could not be loaded: run scripts/fetch-nixl.sh (it \
             unpacks PyPI's nixl-cu13 wheel into target/nixl), `pip install nixl-cu13` in the \
             active virtual environment, or set TENSORPORT_NIXL to the library or the unpacked \
             wheel"
                .into(),
        ))
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `Ok` for a call that is done, an error naming `call` otherwise.
    pub(crate) fn check(call: &'static str, status: c_int) -> Result<()> {
        match status {
            0 => Ok(()),
            s => Err(Error::Call { call, status: s }),
        }
    }

    /// Copies and frees a blob the library `malloc`ed.
    ///
    /// # Safety
    /// `data` must be null or a `malloc`ed block of `len` bytes that nothing else frees.
    pub(crate) unsafe fn take_blob(data: *mut c_void, len: usize) -> Vec<u8> {
        if data.is_null() {
            return Vec::new();
        }
        // SAFETY: the caller's contract: `len` readable bytes at `data`, ours to free.
        let v = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) }.to_vec();
        // SAFETY: as above.
        unsafe { free(data) };
        v
    }

    /// Copies and frees a NUL-terminated string the library `malloc`ed.
    ///
    /// # Safety
    /// `s` must be null or a `malloc`ed NUL-terminated string that nothing else frees.
    pub(crate) unsafe fn take_string(s: *mut c_char) -> String {
        if s.is_null() {
            return String::new();
        }
        // SAFETY: the caller's contract.
        let out = unsafe { std::ffi::CStr::from_ptr(s) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: as above.
        unsafe { free(s.cast()) };
        out
    }
}
