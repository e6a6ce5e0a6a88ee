//! The device path's producer side: [`GpuProducer`] allocates exportable buffers, registers
//! them with the server once, and hands tensors in them over, each fenced by a [`Fence`] (see
//! `ipc.rs` for the server side).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use tensorport::wire::RawDeviceHandle;
use tensorport::{Producer, ProducerConfig, TensorSpec};

use crate::ipc::Fence;
use crate::{DeviceBuffer, Gpu, Stream};
use crate::{Error, Result};

struct OwnBuffer {
    mem: DeviceBuffer,
    /// Bytes of tensor data (in timeline mode the two semaphores follow them).
    len: usize,
    /// Event mode: our interprocess "ready" event. Timeline mode: null.
    ready: sys::CUevent,
    /// Event mode: the server's "released" event. Timeline mode: null.
    released: sys::CUevent,
    /// Timeline mode: the last value submitted with this buffer.
    seq: u64,
}

/// A producer whose tensors live in device memory: it owns `count` exportable buffers, shared
/// with the server once, and hands tensors in them over with a fence.
///
/// ```no_run
/// # fn f(gpu: std::sync::Arc<tensorport_cuda::Gpu>) -> tensorport_cuda::Result<()> {
/// # use tensorport::{DType, TensorSpec};
/// use tensorport_cuda::{Fence, GpuProducer, GpuProducerConfig, Sharing};
/// let cfg = GpuProducerConfig::new("gpu-prep", 4, 1 << 20).sharing(Sharing::Ipc(Fence::Timeline));
/// let mut p = GpuProducer::connect("/run/tp.sock", &gpu, &cfg)?;
/// let b = p.acquire(std::time::Duration::from_secs(5))?; // a buffer the server is done with
/// p.buffer(b).fill_u32_range_async(0, p.buffer_len(), 7, p.stream())?; // GPU work on p.stream()
/// let id = p.submit(b, &TensorSpec::new(DType::I32, &[1 << 18]))?; // fences and sends
/// # Ok(()) }
/// ```
pub struct GpuProducer {
    producer: Producer,
    gpu: Arc<Gpu>,
    fence: Fence,
    stream: Stream,
    buffers: Vec<OwnBuffer>,
    order: VecDeque<usize>,
}

impl std::fmt::Debug for GpuProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuProducer")
            .field("buffers", &self.buffers.len())
            .field("fence", &self.fence)
            .finish()
    }
}

/// How a GPU producer shares its buffers with the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Sharing {
    /// VMM allocations sent as POSIX file descriptors where the device supports them, legacy
    /// CUDA IPC handles otherwise; timeline fences either way.
    #[default]
    Best,
    /// VMM allocations (`cuMemCreate`) exported as POSIX file descriptors and sent with
    /// `SCM_RIGHTS`, fenced by timelines: no legacy IPC, and nothing for another process to
    /// open unless it was sent the descriptor.
    Vmm,
    /// Legacy CUDA IPC handles of `cuMemAlloc` buffers, with this fence.
    Ipc(Fence),
}

/// A GPU producer's session: its name, its buffers, and how they are shared.
#[derive(Debug, Clone)]
pub struct GpuProducerConfig {
    /// The producer's name (the server's logs and status show it).
    pub name: String,
    /// Device buffers, one per request in flight (a session may register at most
    /// [`tensorport::wire::MAX_DEVICE_BUFFERS`]).
    pub buffers: usize,
    /// Bytes of tensor data each buffer holds at least.
    pub len: usize,
    /// How the buffers are shared with the server.
    pub sharing: Sharing,
}

impl GpuProducerConfig {
    /// `buffers` buffers of `len` bytes, shared the best way the device allows.
    pub fn new(name: impl Into<String>, buffers: usize, len: usize) -> GpuProducerConfig {
        GpuProducerConfig {
            name: name.into(),
            buffers,
            len,
            sharing: Sharing::Best,
        }
    }

    /// The same, shared as `sharing` says.
    pub fn sharing(mut self, sharing: Sharing) -> GpuProducerConfig {
        self.sharing = sharing;
        self
    }
}

impl GpuProducer {
    /// Connects to the server at `socket`, allocates `cfg.buffers` buffers of at least
    /// `cfg.len` bytes of tensor data on `gpu` (each its own allocation, rounded up to 2 MiB so
    /// no other allocation shares its mapping), and registers them with the server, shared as
    /// `cfg.sharing` says.
    pub fn connect(
        socket: impl AsRef<Path>,
        gpu: &Arc<Gpu>,
        cfg: &GpuProducerConfig,
    ) -> Result<GpuProducer> {
        let (fence, vmm) = match cfg.sharing {
            Sharing::Best if gpu.supports_posix_fd()? => (Fence::Timeline, true),
            Sharing::Best => (Fence::Timeline, false),
            Sharing::Vmm => (Fence::Timeline, true),
            Sharing::Ipc(fence) => (fence, false),
        };
        Self::connect_inner(socket, gpu, cfg, fence, vmm)
    }

    fn connect_inner(
        socket: impl AsRef<Path>,
        gpu: &Arc<Gpu>,
        g: &GpuProducerConfig,
        fence: Fence,
        vmm: bool,
    ) -> Result<GpuProducer> {
        let (count, len) = (g.buffers, g.len);
        let mut cfg = ProducerConfig::new(&g.name);
        // No host slots are used, but the session's in-flight limit (twice its slots) must
        // cover every buffer: one small slot per buffer.
        cfg.slots = count.max(1) as u32;
        cfg.slot_size = 4096;
        let mut producer = Producer::connect(socket, cfg)?;
        let stream = Stream::new(gpu)?;
        // Event mode: the whole allocation is tensor data. Timeline mode: 16 bytes of
        // semaphores follow the data, zeroed before the server sees them.
        let alloc = (len + 16).next_multiple_of(2 << 20);
        let len = match fence {
            Fence::Event => alloc,
            Fence::Timeline => alloc - 16,
        };
        let d = gpu.driver();
        let mut buffers = Vec::with_capacity(count);
        for i in 0..count {
            if vmm {
                // Data, then the two semaphores, rounded up to the granularity; the server
                // computes the same size from the registered length.
                let mem = DeviceBuffer::new_exportable(gpu, len + 16)?;
                let data = mem.len() - 16;
                mem.fill_u32_range_async(data, 16, 0, &stream)?;
                stream.synchronize()?;
                let fd = mem.export_fd()?;
                producer.register_device(
                    i as u32,
                    data as u64,
                    RawDeviceHandle::VmmPosixFd,
                    Some(std::os::fd::AsFd::as_fd(&fd)),
                    Duration::from_secs(10),
                )?;
                buffers.push(OwnBuffer {
                    mem,
                    len: data,
                    ready: std::ptr::null_mut(),
                    released: std::ptr::null_mut(),
                    seq: 0,
                });
                continue;
            }
            let mem = DeviceBuffer::new(gpu, alloc)?;
            let memory = d.ipc_get_mem_handle(mem.ptr().raw())?.to_vec();
            let (ready, handle) = match fence {
                Fence::Event => {
                    let ready = d.event_create_interprocess()?;
                    // SAFETY: `ready` was just created as an interprocess event.
                    let event = unsafe { d.ipc_get_event_handle(ready)? }.to_vec();
                    (ready, RawDeviceHandle::LegacyIpc { memory, event })
                }
                Fence::Timeline => {
                    mem.fill_u32_range_async(len, 16, 0, &stream)?;
                    stream.synchronize()?;
                    (
                        std::ptr::null_mut(),
                        RawDeviceHandle::LegacyIpcTimeline { memory },
                    )
                }
            };
            let rel = producer.register_device(
                i as u32,
                len as u64,
                handle,
                None,
                Duration::from_secs(10),
            )?;
            let released = match fence {
                Fence::Event => {
                    let rel: [u8; 64] = rel.as_slice().try_into().map_err(|_| {
                        Error::BadAnswer("a release event handle that is not 64 bytes")
                    })?;
                    d.ipc_open_event_handle(&rel)?
                }
                Fence::Timeline => std::ptr::null_mut(),
            };
            buffers.push(OwnBuffer {
                mem,
                len,
                ready,
                released,
                seq: 0,
            });
        }
        Ok(GpuProducer {
            producer,
            gpu: gpu.clone(),
            fence,
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
        let b = &self.buffers[i];
        let d = self.gpu.driver();
        // SAFETY: our stream, the server's release event (opened in `connect`) and the
        // buffer's "released" semaphore (inside our own allocation) are live.
        unsafe {
            match self.fence {
                Fence::Event => d.stream_wait_event(self.stream.raw().cast(), b.released)?,
                Fence::Timeline if b.seq > 0 => d.stream_wait_value64(
                    self.stream.raw().cast(),
                    b.mem.ptr().offset(b.len + 8).raw(),
                    b.seq,
                )?,
                Fence::Timeline => {}
            }
        }
        Ok(i)
    }

    /// Buffer `i` (its first [`GpuProducer::buffer_len`] bytes are tensor data).
    pub fn buffer(&self, i: usize) -> &DeviceBuffer {
        &self.buffers[i].mem
    }

    /// Copies `src[range]` into the start of buffer `i` on [`GpuProducer::stream`]
    /// (asynchronously, a DMA), ordered after the server's reads of the buffer (as everything
    /// after [`GpuProducer::acquire`]); `src` records the copy, so its bytes are not written
    /// again until it has run. Submit the buffer afterwards: its fence follows the copy.
    pub fn upload(
        &mut self,
        i: usize,
        src: &mut crate::PinnedBuffer,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let b = self
            .buffers
            .get(i)
            .ok_or(Error::Refused("no such buffer"))?;
        let bytes = src
            .as_slice()
            .get(range)
            .filter(|bytes| bytes.len() <= b.len)
            .ok_or(Error::Refused("the range is not inside both buffers"))?;
        // SAFETY: buffer `i` holds `b.len` bytes of our context and lives as long as `self`
        // (whose drop synchronises the stream first); `src` stays allocated and unwritten until
        // the copy has run (the event recorded below, which its writes and its drop wait for).
        unsafe {
            self.stream.copy_host_to_device_async(b.mem.ptr(), bytes)?;
        }
        src.record_read(&self.stream)
    }

    /// How many buffers it has.
    pub fn buffer_count(&self) -> usize {
        self.buffers.len()
    }

    /// Bytes of tensor data in each buffer.
    pub fn buffer_len(&self) -> usize {
        self.buffers[0].len
    }

    /// The stream to write buffers on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Fences buffer `i` after the work enqueued so far (records "ready", or writes the next
    /// timeline value) and submits `spec` in it; returns the request id.
    pub fn submit(&mut self, i: usize, spec: &TensorSpec) -> Result<u64> {
        self.submit_inner(i, spec, None)
    }

    /// Like [`GpuProducer::submit`] with a request id of the caller's choosing (unique among its
    /// requests in flight; a consumer sees it, e.g. an input's index).
    pub fn submit_as(&mut self, i: usize, spec: &TensorSpec, request_id: u64) -> Result<()> {
        self.submit_inner(i, spec, Some(request_id)).map(|_| ())
    }

    fn submit_inner(&mut self, i: usize, spec: &TensorSpec, id: Option<u64>) -> Result<u64> {
        self.gpu.bind()?;
        let d = self.gpu.driver();
        let stream = self.stream.raw().cast();
        let b = &mut self.buffers[i];
        let timeline = match self.fence {
            Fence::Event => {
                // SAFETY: both handles are live and belong to the bound context.
                unsafe { d.event_record(b.ready, stream)? };
                None
            }
            Fence::Timeline => {
                b.seq += 1;
                // SAFETY: the semaphore is inside our own live allocation.
                unsafe { d.stream_write_value64(stream, b.mem.ptr().offset(b.len).raw(), b.seq)? };
                Some(b.seq)
            }
        };
        Ok(match id {
            Some(id) => {
                self.producer
                    .submit_device_as(i as u32, id, spec, timeline)?;
                id
            }
            None => self.producer.submit_device(i as u32, spec, timeline)?,
        })
    }

    /// The underlying producer (results, status).
    pub fn producer(&mut self) -> &mut Producer {
        &mut self.producer
    }

    /// Waits for this producer's GPU work, then ends the session cleanly (`Goodbye`); the
    /// server closes the buffers. Dropping without it works too, but counts as a crash.
    pub fn close(mut self) -> Result<()> {
        self.stream.synchronize()?;
        Ok(self.producer.goodbye()?)
    }
}

impl Drop for GpuProducer {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        let d = self.gpu.driver();
        for b in &self.buffers {
            // SAFETY: created/opened in `connect` (or null), not used after this.
            unsafe {
                if !b.ready.is_null() {
                    let _ = d.event_destroy(b.ready);
                }
                if !b.released.is_null() {
                    let _ = d.event_destroy(b.released);
                }
            }
        }
    }
}
