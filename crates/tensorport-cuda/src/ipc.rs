//! The device path over legacy CUDA IPC: [`CudaImporter`] opens what producers register (server
//! side), [`GpuProducer`] allocates exportable buffers and hands tensors in them over (producer
//! side). Each buffer carries two interprocess events — "ready" (the producer's, recorded after
//! its writes) and "released" (the server's, recorded after its reads) — so neither side ever
//! blocks the host to order the GPU work. See `tensorport::DeviceTensor`.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use tensorport::wire::RawDeviceHandle;
use tensorport::{DeviceImporter, ImportedDevice, Producer, ProducerConfig, TensorSpec};

use crate::gpu::{DeviceBuffer, Gpu, Stream};
use crate::{Error, Result};

static LIVE_IMPORTS: AtomicUsize = AtomicUsize::new(0);

/// Producer buffers currently open in this (server) process.
pub fn live_imports() -> usize {
    LIVE_IMPORTS.load(Ordering::SeqCst)
}

fn handle64(v: &[u8]) -> std::result::Result<[u8; 64], String> {
    v.try_into()
        .map_err(|_| format!("handle of {} bytes, expected 64", v.len()))
}

/// Opens producers' device buffers in the server's context (the server's
/// `ServerConfig::device`).
#[derive(Debug, Clone)]
pub struct CudaImporter {
    gpu: Arc<Gpu>,
}

impl CudaImporter {
    /// Imports into `gpu`'s primary context.
    pub fn new(gpu: Arc<Gpu>) -> CudaImporter {
        CudaImporter { gpu }
    }
}

struct Imported {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: u64,
    ready: sys::CUevent,
    release: sys::CUevent,
    release_handle: [u8; 64],
}

// SAFETY: the handles are identifiers usable from any thread once the context is bound, which
// every method does first.
unsafe impl Send for Imported {}
// SAFETY: as above; the methods only enqueue driver work.
unsafe impl Sync for Imported {}

impl DeviceImporter for CudaImporter {
    fn import(
        &self,
        len: u64,
        handle: &RawDeviceHandle,
    ) -> std::result::Result<Arc<dyn ImportedDevice>, String> {
        let RawDeviceHandle::LegacyIpc { memory, event } = handle;
        let (memory, event) = (handle64(memory)?, handle64(event)?);
        let d = self.gpu.driver();
        self.gpu.bind().map_err(|e| e.to_string())?;
        let ptr = d.ipc_open_mem_handle(&memory).map_err(|e| e.to_string())?;
        let mut made = Imported {
            gpu: self.gpu.clone(),
            ptr,
            len,
            ready: std::ptr::null_mut(),
            release: std::ptr::null_mut(),
            release_handle: [0; 64],
        };
        LIVE_IMPORTS.fetch_add(1, Ordering::SeqCst);
        // From here `made` cleans up whatever was opened if a later step fails.
        made.ready = d.ipc_open_event_handle(&event).map_err(|e| e.to_string())?;
        made.release = d.event_create_interprocess().map_err(|e| e.to_string())?;
        // SAFETY: `release` was just created as an interprocess event.
        made.release_handle =
            unsafe { d.ipc_get_event_handle(made.release) }.map_err(|e| e.to_string())?;
        Ok(Arc::new(made))
    }
}

impl ImportedDevice for Imported {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> u64 {
        self.len
    }
    fn release_event_handle(&self) -> Vec<u8> {
        self.release_handle.to_vec()
    }
    unsafe fn wait_ready(&self, stream: *mut c_void) -> std::result::Result<(), String> {
        self.gpu.bind().map_err(|e| e.to_string())?;
        // SAFETY: the caller passes a live stream of this context; `ready` lives with `self`.
        unsafe {
            self.gpu
                .driver()
                .stream_wait_event(stream.cast(), self.ready)
        }
        .map_err(|e| e.to_string())
    }
    unsafe fn record_release(&self, stream: *mut c_void) -> std::result::Result<(), String> {
        self.gpu.bind().map_err(|e| e.to_string())?;
        // SAFETY: as above.
        unsafe { self.gpu.driver().event_record(self.release, stream.cast()) }
            .map_err(|e| e.to_string())
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        let d = self.gpu.driver();
        let _ = self.gpu.bind();
        // SAFETY: every handle below was created or opened in `import` (null ones are skipped)
        // and is not used after this. The release event was recorded after the last read, so
        // waiting on it makes sure no copy still reads the mapping when it is closed.
        unsafe {
            if !self.release.is_null() {
                let _ = d.event_sync(self.release);
                let _ = d.event_destroy(self.release);
            }
            if !self.ready.is_null() {
                let _ = d.event_destroy(self.ready);
            }
            let _ = d.ipc_close_mem_handle(self.ptr);
        }
        LIVE_IMPORTS.fetch_sub(1, Ordering::SeqCst);
    }
}

struct OwnBuffer {
    mem: DeviceBuffer,
    ready: sys::CUevent,
    released: sys::CUevent,
}

/// A producer whose tensors live in device memory: it owns `count` exportable buffers, shared
/// with the server once, and hands tensors in them over with an event as the fence.
///
/// ```no_run
/// # fn f(gpu: std::sync::Arc<tensorport_cuda::Gpu>) -> tensorport_cuda::Result<()> {
/// # use tensorport::{DType, TensorSpec};
/// let mut p = tensorport_cuda::GpuProducer::connect("/run/tp.sock", "gpu-prep", &gpu, 4, 1 << 20)?;
/// let b = p.acquire(std::time::Duration::from_secs(5))?; // a buffer the server is done with
/// p.buffer(b).fill_u32_async(7, p.stream())?;            // GPU work on p.stream()
/// let id = p.submit(b, &TensorSpec::new(DType::I32, &[1 << 18]))?; // records "ready", sends
/// # Ok(()) }
/// ```
pub struct GpuProducer {
    producer: Producer,
    gpu: Arc<Gpu>,
    stream: Stream,
    buffers: Vec<OwnBuffer>,
    order: VecDeque<usize>,
}

impl std::fmt::Debug for GpuProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuProducer")
            .field("buffers", &self.buffers.len())
            .finish()
    }
}

impl GpuProducer {
    /// Connects, allocates `count` buffers of at least `len` bytes (rounded up to 2 MiB, so no
    /// other allocation shares their IPC mapping), and registers them with the server.
    pub fn connect(
        socket: impl AsRef<Path>,
        name: &str,
        gpu: &Arc<Gpu>,
        count: usize,
        len: usize,
    ) -> Result<GpuProducer> {
        let mut cfg = ProducerConfig::new(name);
        // No host slots are used, but the session's in-flight limit (twice its slots) must
        // cover every buffer: one small slot per buffer.
        cfg.slots = count.max(1) as u32;
        cfg.slot_size = 4096;
        let mut producer = Producer::connect(socket, cfg)?;
        let stream = Stream::new(gpu)?;
        let len = len.next_multiple_of(2 << 20);
        let d = gpu.driver();
        let mut buffers = Vec::with_capacity(count);
        for i in 0..count {
            let mem = DeviceBuffer::new(gpu, len)?;
            let ready = d.event_create_interprocess()?;
            let memory = d.ipc_get_mem_handle(mem.ptr())?;
            // SAFETY: `ready` was just created as an interprocess event.
            let event = unsafe { d.ipc_get_event_handle(ready)? };
            let rel = producer.register_device(
                i as u32,
                len as u64,
                RawDeviceHandle::LegacyIpc {
                    memory: memory.to_vec(),
                    event: event.to_vec(),
                },
                Duration::from_secs(10),
            )?;
            let rel: [u8; 64] = rel.as_slice().try_into().map_err(|_| Error::Call {
                call: "DeviceRegistered",
                code: 0,
                message: "release event handle is not 64 bytes".into(),
            })?;
            let released = d.ipc_open_event_handle(&rel)?;
            buffers.push(OwnBuffer {
                mem,
                ready,
                released,
            });
        }
        Ok(GpuProducer {
            producer,
            gpu: gpu.clone(),
            stream,
            order: (0..count).collect(),
            buffers,
        })
    }

    /// A buffer to write: the least recently submitted one, once the server has released it.
    /// Work enqueued on [`GpuProducer::stream`] from now on runs after the server's reads of it.
    pub fn acquire(&mut self, timeout: Duration) -> Result<usize> {
        let i = *self.order.front().expect("at least one buffer");
        self.producer.wait_device(i as u32, timeout)?;
        self.order.rotate_left(1);
        self.gpu.bind()?;
        // SAFETY: our stream and the server's release event (opened in `connect`) are live.
        unsafe {
            self.gpu
                .driver()
                .stream_wait_event(self.stream.raw().cast(), self.buffers[i].released)?
        };
        Ok(i)
    }

    /// Buffer `i`.
    pub fn buffer(&self, i: usize) -> &DeviceBuffer {
        &self.buffers[i].mem
    }

    /// The stream to write buffers on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Records buffer `i`'s "ready" event after the work enqueued so far and submits `spec` in
    /// it; returns the request id.
    pub fn submit(&mut self, i: usize, spec: &TensorSpec) -> Result<u64> {
        self.gpu.bind()?;
        // SAFETY: both handles are live and belong to the bound context.
        unsafe {
            self.gpu
                .driver()
                .event_record(self.buffers[i].ready, self.stream.raw().cast())?
        };
        Ok(self.producer.submit_device(i as u32, spec)?)
    }

    /// The underlying producer (results, status).
    pub fn producer(&mut self) -> &mut Producer {
        &mut self.producer
    }
}

impl Drop for GpuProducer {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        let d = self.gpu.driver();
        for b in &self.buffers {
            // SAFETY: created/opened in `connect`, not used after this.
            unsafe {
                let _ = d.event_destroy(b.ready);
                let _ = d.event_destroy(b.released);
            }
        }
    }
}
