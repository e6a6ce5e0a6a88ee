//! The "result" floor: one small function per CUDA driver call, each returning a `Result` whose
//! error names the call. All FFI of this crate is here; functions that take raw handles or
//! pointers are `unsafe fn` with their contract, which the RAII types in `gpu.rs` uphold.
//!
//! cudarc loads libcuda lazily and panics if it cannot; a [`Driver`] can only be made after
//! checking that the library loads and `cuInit` succeeds, and every call takes `&Driver`, so no
//! call can reach that panic.

use std::ffi::{c_void, CStr};

use cudarc::driver::sys;

use crate::{Error, Result};

/// A 64-bit semaphore operation for [`Driver::stream_batch_mem_op`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemOp {
    /// Later work waits until the word at `addr` is at least `value`.
    WaitGeq {
        /// Device address (8-byte aligned).
        addr: sys::CUdeviceptr,
        /// The value to reach.
        value: u64,
    },
    /// Writes `value` to the word at `addr` once earlier work has run.
    Write {
        /// Device address (8-byte aligned).
        addr: sys::CUdeviceptr,
        /// The value written.
        value: u64,
    },
}

/// Most operations one `cuStreamBatchMemOp` takes.
pub const MAX_MEM_OPS: usize = 255;

/// Proof that libcuda is loaded and initialised.
#[derive(Debug, Clone, Copy)]
pub struct Driver(());

fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut s: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string (or leaves it null).
    let msg = unsafe {
        if sys::cuGetErrorString(r, &mut s) == sys::CUresult::CUDA_SUCCESS && !s.is_null() {
            CStr::from_ptr(s).to_string_lossy().into_owned()
        } else {
            format!("{r:?}")
        }
    };
    Err(Error::Call {
        call,
        code: r as i32,
        message: msg,
    })
}

impl Driver {
    /// Loads libcuda and calls `cuInit`. Fails with [`Error::NoDriver`] where there is none.
    pub fn load() -> Result<Driver> {
        // SAFETY: only tries to dlopen the library; no CUDA call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoDriver);
        }
        // SAFETY: the library is present; cuInit has no preconditions.
        check("cuInit", unsafe { sys::cuInit(0) })?;
        Ok(Driver(()))
    }

    /// `cuDriverGetVersion` (e.g. 13000 for CUDA 13.0).
    pub fn version(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: writes one int.
        check("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut v)
        })?;
        Ok(v)
    }

    /// `cuDeviceGetCount`.
    pub fn device_count(&self) -> Result<i32> {
        let mut n = 0;
        // SAFETY: writes one int.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
        Ok(n)
    }

    /// `cuDeviceGet`.
    pub fn device(&self, ordinal: i32) -> Result<sys::CUdevice> {
        let mut d = 0;
        // SAFETY: writes one handle.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut d, ordinal) })?;
        Ok(d)
    }

    /// `cuDeviceGetName`.
    pub fn device_name(&self, dev: sys::CUdevice) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds 256 chars, as we say.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, dev)
        })?;
        // SAFETY: the driver NUL-terminates within the length given.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// `cuDeviceGetAttribute`.
    pub fn attribute(&self, dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
        let mut v = 0;
        // SAFETY: writes one int.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(&mut v, attr, dev)
        })?;
        Ok(v)
    }

    /// `cuDeviceTotalMem`.
    pub fn total_mem(&self, dev: sys::CUdevice) -> Result<usize> {
        let mut v = 0;
        // SAFETY: writes one size.
        check("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut v, dev)
        })?;
        Ok(v)
    }

    /// `cuDevicePrimaryCtxRetain`.
    pub fn primary_ctx_retain(&self, dev: sys::CUdevice) -> Result<sys::CUcontext> {
        let mut c = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut c, dev)
        })?;
        Ok(c)
    }

    /// `cuDevicePrimaryCtxRelease`.
    pub fn primary_ctx_release(&self, dev: sys::CUdevice) -> Result<()> {
        // SAFETY: balanced with a retain by the caller.
        check("cuDevicePrimaryCtxRelease", unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(dev)
        })
    }

    /// `cuCtxSetCurrent`: makes `ctx` current on the calling thread.
    ///
    /// # Safety
    /// `ctx` must be a context retained (and not yet released) by the caller.
    pub unsafe fn ctx_set_current(&self, ctx: sys::CUcontext) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })
    }

    /// `cuMemHostRegister` (portable): pins `len` bytes at `ptr` for fast device copies.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be a live mapping that outlives the registration, and
    /// [`Driver::host_unregister`] must be called before it is unmapped.
    pub unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
        })
    }

    /// `cuMemHostUnregister`.
    ///
    /// # Safety
    /// `ptr` must have been registered with [`Driver::host_register`].
    pub unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr.cast())
        })
    }

    /// `cuMemAlloc`.
    pub fn mem_alloc(&self, len: usize) -> Result<sys::CUdeviceptr> {
        let mut p = 0;
        // SAFETY: writes one device pointer.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, len) })?;
        Ok(p)
    }

    /// `cuMemFree`.
    ///
    /// # Safety
    /// `p` must come from [`Driver::mem_alloc`] and not be in use by pending work.
    pub unsafe fn mem_free(&self, p: sys::CUdeviceptr) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemFree", unsafe { sys::cuMemFree_v2(p) })
    }

    /// `cuMemAllocHost`: page-locked host memory.
    pub fn mem_alloc_host(&self, len: usize) -> Result<*mut u8> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer.
        check("cuMemAllocHost", unsafe {
            sys::cuMemAllocHost_v2(&mut p, len)
        })?;
        Ok(p.cast())
    }

    /// `cuMemHostGetDevicePointer`: the device address of page-locked host memory.
    ///
    /// # Safety
    /// `p` must come from [`Driver::mem_alloc_host`] (or be registered) in the current context.
    pub unsafe fn mem_host_device_pointer(&self, p: *mut u8) -> Result<sys::CUdeviceptr> {
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: the caller's contract; writes one address.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut d, p.cast(), 0)
        })?;
        Ok(d)
    }

    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `p` must come from [`Driver::mem_alloc_host`] and no view of it may remain.
    pub unsafe fn mem_free_host(&self, p: *mut u8) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(p.cast()) })
    }

    /// `cuStreamCreate` (non-blocking with respect to the legacy default stream).
    pub fn stream_create(&self) -> Result<sys::CUstream> {
        let mut s = std::ptr::null_mut();
        // SAFETY: writes one handle. Flag 1 = CU_STREAM_NON_BLOCKING.
        check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, 1) })?;
        Ok(s)
    }

    /// `cuStreamSynchronize`.
    ///
    /// # Safety
    /// `s` must be a live stream of the current context.
    pub unsafe fn stream_sync(&self, s: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s)
        })
    }

    /// `cuStreamQuery`: whether all work enqueued on `s` has run (`false`: some is pending).
    ///
    /// # Safety
    /// `s` must be a live stream of the current context.
    pub unsafe fn stream_query(&self, s: sys::CUstream) -> Result<bool> {
        // SAFETY: the caller's contract.
        match unsafe { sys::cuStreamQuery(s) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuStreamQuery", r).map(|()| true),
        }
    }

    /// `cuStreamDestroy`.
    ///
    /// # Safety
    /// `s` must be a live stream not used afterwards.
    pub unsafe fn stream_destroy(&self, s: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuStreamDestroy", unsafe { sys::cuStreamDestroy_v2(s) })
    }

    /// `cuMemcpyHtoDAsync`.
    ///
    /// # Safety
    /// `src..src+len` must stay valid and unchanged until the copy completes on `s`, and
    /// `dst..dst+len` must be device memory of this context.
    pub unsafe fn memcpy_htod_async(
        &self,
        dst: sys::CUdeviceptr,
        src: *const u8,
        len: usize,
        s: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, s)
        })
    }

    /// `cuMemcpyDtoH` (synchronous).
    ///
    /// # Safety
    /// `dst..dst+len` must be writable host memory; `src..src+len` device memory.
    pub unsafe fn memcpy_dtoh(
        &self,
        dst: *mut u8,
        src: sys::CUdeviceptr,
        len: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.cast(), src, len)
        })
    }

    /// `cuMemcpyDtoHAsync` on `s` (from pageable memory the call returns once the copy has
    /// run).
    ///
    /// # Safety
    /// `dst..dst+len` must be writable host memory that stays valid until the copy has run on
    /// `s`; `src..src+len` device memory of this context; `s` live.
    pub unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: sys::CUdeviceptr,
        len: usize,
        s: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, s)
        })
    }

    /// `cuEventCreate` (with timing).
    pub fn event_create(&self) -> Result<sys::CUevent> {
        let mut e = std::ptr::null_mut();
        // SAFETY: writes one handle. Flag 0 = default (timing enabled).
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, 0) })?;
        Ok(e)
    }

    /// `cuEventRecord`.
    ///
    /// # Safety
    /// `e` and `s` must be live handles of the current context.
    pub unsafe fn event_record(&self, e: sys::CUevent, s: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuEventRecord", unsafe { sys::cuEventRecord(e, s) })
    }

    /// `cuEventSynchronize`.
    ///
    /// # Safety
    /// `e` must be a live event.
    pub unsafe fn event_sync(&self, e: sys::CUevent) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(e) })
    }

    /// `cuEventQuery`: whether the work before the event's last record has run (`false`: not
    /// yet); an error where the context is broken.
    ///
    /// # Safety
    /// `e` must be a live event.
    pub unsafe fn event_query(&self, e: sys::CUevent) -> Result<bool> {
        // SAFETY: the caller's contract.
        match unsafe { sys::cuEventQuery(e) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| true),
        }
    }

    /// `cuEventElapsedTime`, in milliseconds.
    ///
    /// # Safety
    /// Both must be live events, recorded and completed.
    pub unsafe fn event_elapsed_ms(&self, start: sys::CUevent, end: sys::CUevent) -> Result<f32> {
        let mut ms = 0.0f32;
        // SAFETY: the caller's contract.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, start, end)
        })?;
        Ok(ms)
    }

    /// `cuEventDestroy`.
    ///
    /// # Safety
    /// `e` must be a live event not used afterwards.
    pub unsafe fn event_destroy(&self, e: sys::CUevent) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuEventDestroy", unsafe { sys::cuEventDestroy_v2(e) })
    }

    /// `cuMemGetInfo`: (free, total) bytes of the current context's device.
    pub fn mem_get_info(&self) -> Result<(usize, usize)> {
        let (mut f, mut t) = (0, 0);
        // SAFETY: writes two sizes.
        check("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut f, &mut t)
        })?;
        Ok((f, t))
    }

    /// `cuEventCreate(DISABLE_TIMING | INTERPROCESS)`: an event another process can open.
    pub fn event_create_interprocess(&self) -> Result<sys::CUevent> {
        let mut e = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        // SAFETY: writes one handle.
        check("cuEventCreate(INTERPROCESS)", unsafe {
            sys::cuEventCreate(&mut e, flags)
        })?;
        Ok(e)
    }

    /// `cuIpcGetMemHandle` of an allocation from `cuMemAlloc`.
    pub fn ipc_get_mem_handle(&self, p: sys::CUdeviceptr) -> Result<[u8; 64]> {
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: writes one handle; the driver checks that `p` is an allocation of this context.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, p)
        })?;
        Ok(h.reserved.map(|c| c as u8))
    }

    /// `cuIpcOpenMemHandle` (lazy peer access): maps another process's allocation here.
    pub fn ipc_open_mem_handle(&self, handle: &[u8; 64]) -> Result<sys::CUdeviceptr> {
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut p = 0;
        // SAFETY: writes one device pointer; the driver validates the handle's contents.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut p,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(p)
    }

    /// `cuMemGetAddressRange`: the allocation that contains `p` (its base and size).
    pub fn mem_address_range(&self, p: sys::CUdeviceptr) -> Result<(sys::CUdeviceptr, usize)> {
        let (mut base, mut size) = (0, 0);
        // SAFETY: writes one address and one size; the driver checks that `p` is mapped here.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, p)
        })?;
        Ok((base, size))
    }

    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_BUFFER_ID)`: a number unique to the
    /// allocation that contains `p` for the process's life (a new allocation at the same
    /// address gets another).
    pub fn buffer_id(&self, p: sys::CUdeviceptr) -> Result<u64> {
        let mut id: u64 = 0;
        // SAFETY: the attribute is a 64-bit integer, written into `id`; the driver checks `p`.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&mut id as *mut u64).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                p,
            )
        })?;
        Ok(id)
    }

    /// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)`: the GPU whose memory `p`
    /// is.
    pub fn pointer_ordinal(&self, p: sys::CUdeviceptr) -> Result<i32> {
        let mut ordinal: i32 = -1;
        // SAFETY: the attribute is a 32-bit integer, written into `ordinal`; the driver checks
        // `p`.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                p,
            )
        })?;
        Ok(ordinal)
    }

    /// `cuIpcCloseMemHandle`.
    ///
    /// # Safety
    /// `p` must come from [`Driver::ipc_open_mem_handle`], with no work pending on it.
    pub unsafe fn ipc_close_mem_handle(&self, p: sys::CUdeviceptr) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(p)
        })
    }

    /// `cuIpcGetEventHandle` of an interprocess event.
    ///
    /// # Safety
    /// `e` must be a live event created with [`Driver::event_create_interprocess`].
    pub unsafe fn ipc_get_event_handle(&self, e: sys::CUevent) -> Result<[u8; 64]> {
        let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
        // SAFETY: the caller's contract; writes one handle.
        check("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(&mut h, e)
        })?;
        Ok(h.reserved.map(|c| c as u8))
    }

    /// `cuIpcOpenEventHandle`: another process's interprocess event.
    pub fn ipc_open_event_handle(&self, handle: &[u8; 64]) -> Result<sys::CUevent> {
        let h = sys::CUipcEventHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut e = std::ptr::null_mut();
        // SAFETY: writes one handle; the driver validates the handle's contents.
        check("cuIpcOpenEventHandle", unsafe {
            sys::cuIpcOpenEventHandle(&mut e, h)
        })?;
        Ok(e)
    }

    /// `cuStreamWaitEvent`: later work on `s` waits for `e`'s latest record.
    ///
    /// # Safety
    /// Both must be live handles of the current context.
    pub unsafe fn stream_wait_event(&self, s: sys::CUstream, e: sys::CUevent) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(s, e, 0)
        })
    }

    /// `cuStreamWaitValue64(GEQ)`: later work on `s` waits until the 64-bit word at `addr` is
    /// at least `value`.
    ///
    /// # Safety
    /// `addr` must be 8-byte-aligned device memory of the current context (or imported into it)
    /// that stays valid while the wait is pending; `s` live.
    pub unsafe fn stream_wait_value64(
        &self,
        s: sys::CUstream,
        addr: sys::CUdeviceptr,
        value: u64,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuStreamWaitValue64", unsafe {
            sys::cuStreamWaitValue64_v2(
                s,
                addr,
                value,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        })
    }

    /// `cuStreamWriteValue64`: writes `value` to the 64-bit word at `addr` once earlier work on
    /// `s` has run.
    ///
    /// # Safety
    /// As for [`Driver::stream_wait_value64`].
    pub unsafe fn stream_write_value64(
        &self,
        s: sys::CUstream,
        addr: sys::CUdeviceptr,
        value: u64,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuStreamWriteValue64", unsafe {
            sys::cuStreamWriteValue64_v2(
                s,
                addr,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        })
    }

    /// `cuStreamBatchMemOp`: the 64-bit waits (GEQ) or writes of `ops` on `s`, in one call, in
    /// order. At most [`MAX_MEM_OPS`] at once.
    ///
    /// # Safety
    /// As for [`Driver::stream_wait_value64`], for every address.
    pub unsafe fn stream_batch_mem_op(&self, s: sys::CUstream, ops: &[MemOp]) -> Result<()> {
        assert!(
            ops.len() <= MAX_MEM_OPS,
            "at most {MAX_MEM_OPS} operations at once"
        );
        if ops.is_empty() {
            return Ok(());
        }
        let mut params: Vec<sys::CUstreamBatchMemOpParams> = ops
            .iter()
            .map(|op| {
                // SAFETY: a plain C union for which all-zero is a valid (empty) value.
                let mut p: sys::CUstreamBatchMemOpParams = unsafe { std::mem::zeroed() };
                match *op {
                    MemOp::WaitGeq { addr, value } => {
                        p.waitValue.operation =
                            sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WAIT_VALUE_64;
                        p.waitValue.address = addr;
                        p.waitValue.__bindgen_anon_1.value64 = value;
                        p.waitValue.flags =
                            sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
                    }
                    MemOp::Write { addr, value } => {
                        p.writeValue.operation =
                            sys::CUstreamBatchMemOpType::CU_STREAM_MEM_OP_WRITE_VALUE_64;
                        p.writeValue.address = addr;
                        p.writeValue.__bindgen_anon_1.value64 = value;
                        p.writeValue.flags =
                            sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
                    }
                }
                p
            })
            .collect();
        // SAFETY: `params` holds `ops.len()` (at most 255) initialised entries; the addresses
        // are the caller's contract.
        check("cuStreamBatchMemOp", unsafe {
            sys::cuStreamBatchMemOp_v2(s, params.len() as u32, params.as_mut_ptr(), 0)
        })
    }

    fn vmm_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct for which all-zero is a valid (empty) value.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev;
        prop
    }

    /// `cuMemGetAllocationGranularity` (minimum) for exportable device memory.
    pub fn vmm_granularity(&self, dev: sys::CUdevice) -> Result<usize> {
        let prop = Self::vmm_prop(dev);
        let mut g = 0;
        // SAFETY: reads `prop`, writes one size.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(g)
    }

    /// `cuMemCreate` of `size` bytes (a multiple of the granularity), exportable as a POSIX fd.
    pub fn vmm_create(
        &self,
        dev: sys::CUdevice,
        size: usize,
    ) -> Result<sys::CUmemGenericAllocationHandle> {
        let prop = Self::vmm_prop(dev);
        let mut h = 0;
        // SAFETY: reads `prop`, writes one handle.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut h, size, &prop, 0)
        })?;
        Ok(h)
    }

    /// `cuMemExportToShareableHandle` as a POSIX file descriptor (owned by the caller).
    pub fn vmm_export_fd(
        &self,
        h: sys::CUmemGenericAllocationHandle,
    ) -> Result<std::os::fd::OwnedFd> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for the POSIX-fd handle type the driver writes one int through the pointer.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                h,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the driver just created this descriptor for us; nothing else owns it.
        Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
    }

    /// `cuMemImportFromShareableHandle` of a POSIX fd another process exported.
    pub fn vmm_import_fd(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
    ) -> Result<sys::CUmemGenericAllocationHandle> {
        let mut h = 0;
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        // SAFETY: for the POSIX-fd handle type the "OS handle" is the fd number itself, passed
        // as a pointer-sized value; the driver duplicates what it needs.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                raw as isize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(h)
    }

    /// Reserves `size` bytes of device address space, maps `h` there, and allows this device to
    /// read and write it. Returns the address.
    pub fn vmm_map(
        &self,
        dev: sys::CUdevice,
        h: sys::CUmemGenericAllocationHandle,
        size: usize,
    ) -> Result<sys::CUdeviceptr> {
        let gran = self.vmm_granularity(dev)?;
        let mut va = 0;
        // SAFETY: writes one address; the range is new and ours.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut va, size, gran, 0, 0)
        })?;
        // SAFETY: maps the whole allocation into the range just reserved.
        if let Err(e) = check("cuMemMap", unsafe { sys::cuMemMap(va, size, 0, h, 0) }) {
            // SAFETY: the range was reserved above and nothing is mapped in it.
            unsafe { sys::cuMemAddressFree(va, size) };
            return Err(e);
        }
        // SAFETY: a plain C struct for which all-zero is valid; filled in below.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = dev;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the range is mapped above; reads one descriptor.
        if let Err(e) = check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(va, size, &desc, 1)
        }) {
            // SAFETY: undoes the map and the reservation above.
            unsafe {
                sys::cuMemUnmap(va, size);
                sys::cuMemAddressFree(va, size);
            }
            return Err(e);
        }
        Ok(va)
    }

    /// Unmaps and frees a range from [`Driver::vmm_map`], then releases the allocation handle.
    ///
    /// # Safety
    /// No work may be pending on the range, and nothing may use it afterwards.
    pub unsafe fn vmm_unmap_release(
        &self,
        va: sys::CUdeviceptr,
        size: usize,
        h: sys::CUmemGenericAllocationHandle,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            check("cuMemUnmap", sys::cuMemUnmap(va, size))?;
            check("cuMemAddressFree", sys::cuMemAddressFree(va, size))?;
            check("cuMemRelease", sys::cuMemRelease(h))
        }
    }

    /// `cuMemcpyDtoDAsync`.
    ///
    /// # Safety
    /// Both ranges must be device memory valid for `len` bytes until the copy runs; `s` live.
    pub unsafe fn memcpy_dtod_async(
        &self,
        dst: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        len: usize,
        s: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, len, s)
        })
    }

    /// `cuMemsetD32Async`: `n` 32-bit words of `value` at `dst`.
    ///
    /// # Safety
    /// `dst` must be device memory valid for `4·n` bytes until the set runs; `s` live.
    pub unsafe fn memset_d32_async(
        &self,
        dst: sys::CUdeviceptr,
        value: u32,
        n: usize,
        s: sys::CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(dst, value, n, s)
        })
    }

    /// `cuModuleLoadData`: loads a PTX (or cubin) image into the current context.
    ///
    /// # Safety
    /// A context must be current; `image` must be a complete PTX text (NUL-terminated) or cubin.
    pub unsafe fn module_load_data(&self, image: &[u8]) -> Result<sys::CUmodule> {
        let mut m = std::ptr::null_mut();
        // SAFETY: the caller's contract; the driver reads the image and writes one handle.
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut m, image.as_ptr().cast())
        })?;
        Ok(m)
    }

    /// `cuModuleGetFunction`.
    ///
    /// # Safety
    /// `m` must be a live module.
    pub unsafe fn module_get_function(
        &self,
        m: sys::CUmodule,
        name: &CStr,
    ) -> Result<sys::CUfunction> {
        let mut f = std::ptr::null_mut();
        // SAFETY: the caller's contract; `name` is NUL-terminated.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut f, m, name.as_ptr())
        })?;
        Ok(f)
    }

    /// `cuModuleUnload`.
    ///
    /// # Safety
    /// `m` must be a live module none of whose kernels is still running; not used afterwards.
    pub unsafe fn module_unload(&self, m: sys::CUmodule) -> Result<()> {
        // SAFETY: the caller's contract.
        check("cuModuleUnload", unsafe { sys::cuModuleUnload(m) })
    }

    /// `cuLaunchKernel` with `params` (pointers to each argument's value).
    ///
    /// # Safety
    /// `f` must be live in the current context, `params` must match the kernel's parameters in
    /// number, order and types, and every memory the kernel touches must stay valid until it
    /// has run on `s`.
    pub unsafe fn launch(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        s: sys::CUstream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's contract; the driver copies the argument values at launch.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                f,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                0,
                s,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}
