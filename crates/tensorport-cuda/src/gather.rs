//! A batch of producers' device tensors made usable on one stream with few driver calls: a
//! server that takes several hand-offs at once pays for one batched wait, one kernel launch
//! that copies every tensor, and one batched release per batch, instead of three driver calls
//! per tensor (a device-to-device `cuMemcpyAsync` from an IPC mapping alone costs about 5 µs of
//! host time on an H200 host; see docs/benchmarks.md).

use std::sync::Arc;

use tensorport::DeviceTensor;

use crate::driver::{MemOp, MAX_MEM_OPS};
use crate::ipc::{event_late, timeline, Imported};
use crate::kernel::Kernel;
use crate::{DevicePtr, Error, Gpu, Result, Stream};

/// Copies per kernel launch (the launch's parameters carry them by value).
const PER_LAUNCH: usize = 32;

/// Copy `k` of a launch is `len[k]` bytes from `src[k]` to `dst[k]`; blocks along y take one
/// copy each, along x they share it (16 bytes per thread and step where all three are
/// multiples of 16, a byte otherwise).
const KERNEL: &str = include_str!("kernels/gather.cu");

/// The kernel's parameter, laid out as `TpCopies`.
#[repr(C)]
struct Copies {
    src: [u64; PER_LAUNCH],
    dst: [u64; PER_LAUNCH],
    len: [u64; PER_LAUNCH],
}

/// Moves batches of producers' device tensors into the server's memory (see
/// [`Gatherer::gather`]). One per server GPU; the kernel is compiled once, in
/// [`Gatherer::new`].
pub struct Gatherer {
    pub(crate) gpu: Arc<Gpu>,
    /// `None` where NVRTC cannot be loaded: the copies then go through the driver one by one.
    kernel: Option<Kernel>,
}

impl std::fmt::Debug for Gatherer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gatherer")
            .field("kernel", &self.kernel.is_some())
            .finish()
    }
}

impl Gatherer {
    /// Compiles the copy kernel for `gpu` (NVRTC, as the other kernels of this crate). Where
    /// NVRTC cannot be loaded or compile it, copies go through the driver, one call each, and
    /// a warning says so.
    pub fn new(gpu: &Arc<Gpu>) -> Gatherer {
        let kernel = match Kernel::compile(gpu, KERNEL, "tensorport_gather.cu", c"tp_gather") {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!("device tensors will be copied one driver call each: {e}");
                None
            }
        };
        Gatherer {
            gpu: gpu.clone(),
            kernel,
        }
    }

    /// Whether copies go through the kernel (else one driver call each).
    pub fn uses_kernel(&self) -> bool {
        self.kernel.is_some()
    }

    /// Copies each `(tensor, dst)` of `copies` (`tensor.len()` bytes to device address `dst`)
    /// on `stream`, ordered after each producer's writes, and releases every tensor's buffer
    /// after its copy: what [`DeviceTensor::wait_ready`], a device-to-device copy and
    /// [`DeviceTensor::record_release`] per tensor do, in fewer calls:
    ///
    /// - every timeline-fenced tensor's wait goes into one `cuStreamBatchMemOp`, and so do
    ///   their releases (each buffer's close event is recorded once per batch);
    /// - the copies are one kernel launch per 32 tensors;
    /// - event-fenced tensors, and tensors another importer opened, are fenced one by one.
    ///
    /// Nothing waits on the host. Release the requests (and answer them) after this returns:
    /// a producer reuses a buffer only after its "released" fence, which runs after the copy.
    ///
    /// # Safety
    /// `stream` must be a stream of this gatherer's GPU, the one the server's `CudaImporter`
    /// opened the tensors in; each `dst..dst + tensor.len()` must be device memory of that
    /// context that nothing else reads or writes until the copies have run.
    pub unsafe fn gather(
        &self,
        stream: &Stream,
        copies: &[(&DeviceTensor, DevicePtr)],
    ) -> Result<()> {
        let tensors: Vec<&DeviceTensor> = copies.iter().map(|c| c.0).collect();
        // SAFETY: the caller's contract, passed on.
        unsafe {
            self.wait_ready_all(stream, &tensors)?;
            self.copy_all(stream, copies)?;
            self.release_all(stream, &tensors)
        }
    }

    /// The first step of [`Gatherer::gather`] alone: `stream` waits for every tensor's
    /// producer writes (timeline fences in one batched call). For servers that read the
    /// tensors in place with their own kernels; enqueue those reads, then
    /// [`Gatherer::release_all`].
    ///
    /// # Safety
    /// `stream` must be a stream of this gatherer's GPU, where the tensors were imported.
    pub unsafe fn wait_ready_all(&self, stream: &Stream, tensors: &[&DeviceTensor]) -> Result<()> {
        self.check_stream(stream)?;
        let raw = stream.raw();
        let mut ops = Vec::with_capacity(tensors.len().min(MAX_MEM_OPS));
        for t in tensors {
            match timeline(t, &self.gpu) {
                Some((imp, v)) if imp.await_ready(v) => ops.push(MemOp::WaitGeq {
                    addr: imp.ready_addr(),
                    value: v,
                }),
                // Abandoned: nobody would signal it.
                Some(_) => {}
                // SAFETY: the caller's contract for `stream`.
                None => match unsafe { t.wait_ready(raw) } {
                    Ok(()) => {}
                    // An event that did not fire in time: nothing waits for it; the tensor is
                    // reported late by `synchronize`, and the rest of the batch goes on.
                    Err(_) if event_late(t, &self.gpu) => {}
                    Err(e) => return Err(fence_err(e)),
                },
            }
        }
        for chunk in ops.chunks(MAX_MEM_OPS) {
            // SAFETY: each address is the "ready" semaphore right after a buffer's registered
            // bytes, inside its allocation (checked at import), open while `tensors` holds it.
            unsafe { self.gpu.driver().stream_batch_mem_op(raw.cast(), chunk)? };
        }
        Ok(())
    }

    /// The last step of [`Gatherer::gather`] alone: every tensor's buffer is released after
    /// the work enqueued on `stream` so far (timeline fences in one batched call, which also
    /// ticks the stream's clock: closing a buffer waits for that tick, where each buffer's
    /// close event would cost a driver call). Then release the requests.
    ///
    /// # Safety
    /// As for [`Gatherer::wait_ready_all`].
    pub unsafe fn release_all(&self, stream: &Stream, tensors: &[&DeviceTensor]) -> Result<()> {
        self.check_stream(stream)?;
        let d = self.gpu.driver();
        let raw = stream.raw();
        let mut ops = Vec::with_capacity(tensors.len().min(MAX_MEM_OPS));
        let mut closing: Vec<&Imported> = Vec::new();
        for t in tensors {
            match timeline(t, &self.gpu) {
                Some((imp, v)) => {
                    ops.push(MemOp::Write {
                        addr: imp.released_addr(),
                        value: v,
                    });
                    if !closing.iter().any(|c| std::ptr::eq(*c, imp)) {
                        closing.push(imp);
                    }
                }
                // SAFETY: the caller's contract for `stream`.
                None => unsafe { t.record_release(raw) }.map_err(fence_err)?,
            }
        }
        // The close fence: one more write in the same call, ticking the stream's clock (each
        // buffer's event otherwise, where the clock cannot be made).
        let tick = match (closing.is_empty(), stream.clock()) {
            (false, Ok(clock)) => {
                let v = clock.next_value();
                ops.push(MemOp::Write {
                    addr: clock.addr,
                    value: v,
                });
                Some((clock, v))
            }
            _ => None,
        };
        for chunk in ops.chunks(MAX_MEM_OPS) {
            // SAFETY: each address is the "released" semaphore after the "ready" one, or the
            // stream's clock (page-locked memory of this context, live while the stream is).
            unsafe { d.stream_batch_mem_op(raw.cast(), chunk)? };
        }
        for imp in closing {
            match tick {
                Some((clock, v)) => imp.read_before(clock, v),
                // SAFETY: the buffer's own event, live while it is open; recorded after its
                // reads, so closing the buffer waits for them.
                None => unsafe { d.event_record(imp.release, raw.cast())? },
            }
        }
        Ok(())
    }

    /// Binds our context, and refuses a stream of another GPU.
    pub(crate) fn check_stream(&self, stream: &Stream) -> Result<()> {
        if !Arc::ptr_eq(stream.gpu(), &self.gpu) {
            return Err(Error::ForeignStream("the gatherer"));
        }
        self.gpu.bind()
    }

    /// The middle step of [`Gatherer::gather`] alone: the copies, one launch per
    /// 32 tensors (or one driver call each without the kernel), with no fences: call
    /// [`Gatherer::wait_ready_all`] first and [`Gatherer::release_all`] after.
    ///
    /// # Safety
    /// As for [`Gatherer::gather`], with the tensors' producers' writes already waited for.
    pub unsafe fn copy_all(
        &self,
        stream: &Stream,
        copies: &[(&DeviceTensor, DevicePtr)],
    ) -> Result<()> {
        self.check_stream(stream)?;
        let Some(kernel) = &self.kernel else {
            for (t, dst) in copies {
                // SAFETY: the caller's contract.
                unsafe {
                    stream.copy_device_to_device_async(*dst, DevicePtr::of(t), t.len() as usize)?
                };
            }
            return Ok(());
        };
        for chunk in copies.chunks(PER_LAUNCH) {
            let mut c = Copies {
                src: [0; PER_LAUNCH],
                dst: [0; PER_LAUNCH],
                len: [0; PER_LAUNCH],
            };
            for (k, (t, dst)) in chunk.iter().enumerate() {
                c.src[k] = t.ptr();
                c.dst[k] = dst.raw();
                c.len[k] = t.len();
            }
            // Enough blocks of 256 threads for the longest copy at 16 bytes a thread, at most
            // 1024 along x (the loop strides over the rest).
            let longest = c.len.iter().copied().max().unwrap_or(0);
            let blocks = longest.div_ceil(16 * 256).clamp(1, 1024) as u32;
            let mut params: [*mut std::ffi::c_void; 1] = [(&mut c as *mut Copies).cast()];
            // SAFETY: one parameter, laid out as the kernel's `TpCopies`; the ranges are the
            // caller's contract (sources checked against their buffers).
            unsafe {
                kernel.launch(
                    (blocks, chunk.len() as u32, 1),
                    (256, 1, 1),
                    stream,
                    &mut params,
                )?
            };
        }
        Ok(())
    }
}

fn fence_err(e: String) -> Error {
    Error::Call {
        call: "a device tensor's fence",
        code: 0,
        message: e,
    }
}
