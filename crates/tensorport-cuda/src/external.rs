//! Device buffers the producer did not allocate: tensors of another library (PyTorch's caching
//! allocator) handed over in place.
//!
//! A tensor lives somewhere inside an allocation (a cached segment). [`ExternalDevice::submit`]
//! finds that allocation with the driver (`cuMemGetAddressRange`, not the library's private
//! API), registers it once as a device buffer (legacy CUDA IPC, event-fenced: the length
//! registered is the allocation's, which the server checks again), and submits the tensor at
//! its offset inside, with the "ready" event recorded on the caller's stream. A buffer has one
//! hand-off in flight at a time: a second tensor in the same allocation waits for the first's
//! release. [`ExternalDevice::released`] makes the caller's stream wait for the server's reads
//! before the caller reuses the memory.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use tensorport::wire::RawDeviceHandle;
use tensorport::{Producer, TensorSpec};

use crate::gpu::Gpu;
use crate::{Error, Result};

/// One registered allocation: its base, its number, and its two events.
struct Registered {
    buffer: u32,
    /// The allocation's buffer id: another allocation later made at the same base has another.
    id: u64,
    ready: sys::CUevent,
    released: sys::CUevent,
}

// SAFETY: event handles are identifiers the driver accepts from any thread once the context is
// bound, which every method does first; nothing here is thread-affine.
unsafe impl Send for Registered {}

/// Allocations of one device registered with one producer session.
pub struct ExternalDevice {
    gpu: Arc<Gpu>,
    by_base: HashMap<u64, Registered>,
    /// The number the next registration gets (never reused in a session).
    next_buffer: u32,
    /// Request id → the buffer it holds.
    in_flight: HashMap<u64, u32>,
}

impl std::fmt::Debug for ExternalDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalDevice")
            .field("device", &self.gpu.ordinal())
            .field("registered", &self.by_base.len())
            .finish()
    }
}

impl ExternalDevice {
    /// For tensors on `gpu` (its primary context, which PyTorch uses too).
    pub fn new(gpu: Arc<Gpu>) -> ExternalDevice {
        ExternalDevice {
            gpu,
            by_base: HashMap::new(),
            next_buffer: 0,
            in_flight: HashMap::new(),
        }
    }

    /// Hands over the tensor `spec` (its offset ignored) whose first element is at device
    /// address `ptr`, written by work on `stream` (a `CUstream` of this device; null: the
    /// default stream): registers its allocation on first use, waits until that allocation's
    /// previous hand-off is released, records "ready" on `stream`, submits. Returns the request
    /// id.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context (or null), and the
    /// memory at `ptr` must stay allocated, and unwritten, until the result of this request has
    /// come back and [`ExternalDevice::released`] was called for it.
    pub unsafe fn submit(
        &mut self,
        producer: &mut Producer,
        ptr: u64,
        spec: &TensorSpec,
        stream: *mut std::ffi::c_void,
        timeout: Duration,
    ) -> Result<u64> {
        self.gpu.bind()?;
        let d = self.gpu.driver();
        let (base, size) = d.mem_address_range(ptr)?;
        let id = d.buffer_id(base)?;
        // The allocation registered at this base was freed and another made there: its
        // registration would show the server the old memory. It is forgotten here (the
        // server keeps the old buffer's number until the session ends), once it is not in
        // flight.
        if self.by_base.get(&base).is_some_and(|r| r.id != id) {
            let old = self.by_base[&base].buffer;
            if self.in_flight.values().any(|&b| b == old) {
                return Err(Error::BadAnswer(
                    "a tensor's allocation was freed while its hand-off was in flight",
                ));
            }
            if let Some(r) = self.by_base.remove(&base) {
                // SAFETY: created or opened in an earlier `submit`, not in flight, used no more.
                unsafe {
                    let _ = d.event_destroy(r.ready);
                    let _ = d.event_destroy(r.released);
                }
            }
        }
        if !self.by_base.contains_key(&base) {
            let buffer = self.next_buffer;
            self.next_buffer += 1;
            let memory = d.ipc_get_mem_handle(base)?.to_vec();
            let ready = d.event_create_interprocess()?;
            // SAFETY: `ready` was just created as an interprocess event.
            let event = match unsafe { d.ipc_get_event_handle(ready) } {
                Ok(e) => e.to_vec(),
                Err(e) => {
                    // SAFETY: created above, used nowhere.
                    unsafe { d.event_destroy(ready)? };
                    return Err(e);
                }
            };
            let registered = producer.register_device(
                buffer,
                size as u64,
                RawDeviceHandle::LegacyIpc { memory, event },
                None,
                timeout,
            );
            let released = registered
                .map_err(Error::from)
                .and_then(|rel| {
                    let rel: [u8; 64] = rel.as_slice().try_into().map_err(|_| {
                        Error::BadAnswer("a release event handle that is not 64 bytes")
                    })?;
                    d.ipc_open_event_handle(&rel)
                })
                .inspect_err(|_| {
                    // SAFETY: created above, used nowhere.
                    let _ = unsafe { d.event_destroy(ready) };
                })?;
            self.by_base.insert(
                base,
                Registered {
                    buffer,
                    id,
                    ready,
                    released,
                },
            );
        }
        let r = &self.by_base[&base];
        producer.wait_device(r.buffer, timeout)?;
        // SAFETY: the caller vouches for `stream`; the events are ours and live. Waiting on
        // "released" orders this hand-off after the server's reads of the previous one.
        unsafe {
            d.stream_wait_event(stream.cast(), r.released)?;
            d.event_record(r.ready, stream.cast())?;
        }
        let spec = spec.clone().at_offset(ptr - base);
        let id = producer.submit_device(r.buffer, &spec, None)?;
        self.in_flight.insert(id, r.buffer);
        Ok(id)
    }

    /// After request `request_id`'s result came back: makes `stream` wait until the server's
    /// reads of that tensor are done (its "released" event), so work enqueued on `stream` from
    /// now on may overwrite the memory. A request this did not submit is ignored.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context (or null).
    pub unsafe fn released(
        &mut self,
        request_id: u64,
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        let Some(buffer) = self.in_flight.remove(&request_id) else {
            return Ok(());
        };
        let Some(r) = self.by_base.values().find(|r| r.buffer == buffer) else {
            return Ok(());
        };
        self.gpu.bind()?;
        // SAFETY: the caller vouches for `stream`; the event is ours and live.
        unsafe {
            self.gpu
                .driver()
                .stream_wait_event(stream.cast(), r.released)
        }
    }
}

impl Drop for ExternalDevice {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        let d = self.gpu.driver();
        for r in self.by_base.values() {
            // SAFETY: created or opened in `submit`, not used after this.
            unsafe {
                let _ = d.event_destroy(r.ready);
                let _ = d.event_destroy(r.released);
            }
        }
    }
}
