//! `Server`: a tensorport server in this process, and the batches it hands to Python (into
//! host rows or torch's device memory).

use crate::*;

/// A server in this process: `Server(socket, slots=8, slot_size=1 MiB, consumers=1)`.
#[pyclass(module = "tensorport._native")]
pub(crate) struct Server {
    inner: Arc<tensorport::Server>,
    /// With `cuda_device`: the GPU device tensors are opened in, a stream for the copies, and
    /// what moves a batch's device tensors together.
    cuda: Option<(
        Arc<tensorport_cuda::Gpu>,
        tensorport_cuda::Stream,
        tensorport_cuda::Gatherer,
    )>,
    /// The copy stream did not drain once: a batch is quarantined and no more are taken.
    stalled: std::sync::atomic::AtomicBool,
}

#[pymethods]
impl Server {
    #[new]
    #[pyo3(signature = (socket, slots = 8, slot_size = 1 << 20, consumers = 1, max_sessions = 64, cuda_device = None))]
    fn new(
        socket: std::path::PathBuf,
        slots: u32,
        slot_size: u64,
        consumers: usize,
        max_sessions: u32,
        cuda_device: Option<i32>,
    ) -> PyResult<Server> {
        let mut cfg = ServerConfig::new(socket);
        cfg.slots_per_session = slots;
        cfg.slot_size = slot_size;
        cfg.consumers = consumers;
        cfg.max_sessions = max_sessions;
        // On a GPU: producers' pools pinned (their slots copy to the GPU by DMA) and their
        // device buffers opened in this process's context (the one torch uses).
        let cuda = match cuda_device {
            None => None,
            Some(n) => {
                let gpu = tensorport_cuda::Gpu::open(n).map_err(cuda_err)?;
                cfg.pin = Some(Arc::new(tensorport_cuda::CudaPin::new(gpu.clone())));
                cfg.device = Some(Arc::new(tensorport_cuda::CudaImporter::new(gpu.clone())));
                let stream = tensorport_cuda::Stream::new(&gpu).map_err(cuda_err)?;
                let gatherer = tensorport_cuda::Gatherer::new(&gpu);
                Some((gpu, stream, gatherer))
            }
        };
        Ok(Server {
            inner: Arc::new(tensorport::Server::bind(cfg).map_err(py_err)?),
            cuda,
            stalled: Default::default(),
        })
    }

    /// (Internal: `tensorport.Loader`'s batch step on a GPU.) Receives a batch as `recv_batch`
    /// does and copies each request of exactly `row` bytes — a host slot by DMA, a producer's
    /// device buffer after waiting on its fence — into row k of the `capacity` bytes of device
    /// memory at `address` (a torch CUDA tensor the package allocated for it), after the work
    /// already on torch's `stream`; waits for the copies, answers each request with an empty
    /// result (releasing slots and buffers), and returns `(request_id, row k)` for the rows
    /// written. A request of another size is failed, saying so; so is a GPU producer's tensor
    /// not signalled ready within `tensorport_cuda::DEFAULT_FENCE_TIMEOUT` (its row is left
    /// out, and its producer's session ended). The GIL is released throughout.
    #[pyo3(signature = (address, capacity, row, stream, max = 32, timeout = 1.0, max_wait = 0.005))]
    #[allow(clippy::too_many_arguments)]
    fn _recv_into_device(
        &self,
        py: Python<'_>,
        address: u64,
        capacity: usize,
        row: usize,
        stream: usize,
        max: usize,
        timeout: f64,
        max_wait: f64,
    ) -> PyResult<Vec<(u64, usize)>> {
        let (t, w) = (secs(timeout)?, secs(max_wait)?);
        let Some((_, ours, gatherer)) = &self.cuda else {
            return Err(PyValueError::new_err(
                "this server was made without cuda_device: it cannot write into GPU memory",
            ));
        };
        let stalled = &self.stalled;
        if stalled.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(coded(
                "this server's copy stream did not drain (a batch is quarantined): make a new Server".into(),
                None,
            ));
        }
        let rows = batch_rows(address as usize, capacity, row, max)?;
        let server = self.inner.clone();
        py.allow_threads(move || {
            let batch = server.recv_batch(rows, t, w).map_err(py_err)?;
            if batch.is_empty() {
                return Ok(Vec::new());
            }
            // SAFETY: `stream` is torch's current stream of this device (the package passes
            // `torch.cuda.current_stream().cuda_stream`); the rows may be memory torch just
            // freed and reused, so our copies wait for its work first.
            unsafe { ours.wait_for_raw(stream as *mut std::ffi::c_void) }.map_err(cuda_err)?;
            let mut kept = Vec::with_capacity(batch.len());
            let mut written = Vec::with_capacity(batch.len());
            // Device tensors are moved together after the loop (one batched fence wait, one
            // copy launch, one batched release); with the place in `kept` of each.
            let mut from_devices = Vec::new();
            let mut device_at = Vec::new();
            let mut copy = |r: &tensorport::Request, k: usize, dst: u64| -> PyResult<()> {
                match r.device() {
                    // SAFETY: `dst` is a row of the `capacity` bytes of device memory the
                    // package allocated for this call and holds until it returns; the slot
                    // stays unreleased until the stream is synchronised below (on every path).
                    None => unsafe { ours.copy_host_to_device_async(dst, &r.bytes()[..row]) }
                        .map_err(cuda_err),
                    // The gather copies the tensor's length: it must be the row's.
                    Some(dt) if dt.len() as usize != row => Err(coded(
                        format!("a device tensor of {} bytes for a row of {row}", dt.len()),
                        None,
                    )),
                    Some(dt) => {
                        from_devices.push((dt.clone(), dst));
                        device_at.push(k);
                        Ok(())
                    }
                }
            };
            let mut failed = None;
            for r in batch {
                let Some(r) = one_row(r, row) else {
                    continue;
                };
                let k = written.len();
                if failed.is_none() {
                    if let Err(e) = copy(&r, k, address + (k * row) as u64) {
                        failed = Some(e);
                    }
                }
                written.push((r.request_id(), k));
                kept.push(r);
            }
            if failed.is_none() {
                let copies: Vec<_> = from_devices.iter().map(|(t, d)| (t, *d)).collect();
                // SAFETY: each destination is a row of the package's device memory, `row`
                // bytes as checked; the buffers were bounds-checked against their
                // registrations and stay fenced (their requests unreleased) until the stream
                // is synchronised below; the gather orders the copies after the producers'
                // writes and after torch's work (waited for above).
                if let Err(e) = unsafe { gatherer.gather(ours, &copies) } {
                    failed = Some(cuda_err(e));
                }
            }
            // The copies read the slots and buffers: they are answered (released) only after. A
            // producer that never signals its tensor ready does not stall the rest: its wait is
            // let through after the fence timeout, and its row left out.
            let tensors: Vec<_> = from_devices.iter().map(|(t, _)| t).collect();
            let synced = gatherer
                .synchronize(ours, &tensors, tensorport_cuda::DEFAULT_FENCE_TIMEOUT)
                .map_err(cuda_err);
            let late = match (failed, synced) {
                (None, Ok(late)) => late,
                (Some(e), _) | (None, Err(e)) => {
                    if !ours.is_idle().unwrap_or(false) {
                        // Copies may still run: the requests (their slots and buffers) are
                        // never released, and the package keeps the destination; this server's
                        // stream takes no more batches.
                        stalled.store(true, std::sync::atomic::Ordering::SeqCst);
                        tensorport_cuda::quarantine(kept);
                        return Err(coded(
                            format!("{e}; the copy stream did not drain, so this batch and its destination memory are quarantined (held, never reused) and this server takes no more GPU batches: make a new Server"),
                            None,
                        ));
                    }
                    // Dropped unanswered: each producer gets a failure for its request.
                    drop(kept);
                    return Err(e);
                }
            };
            let late: Vec<usize> = late.iter().map(|&j| device_at[j]).collect();
            let mut rows = Vec::with_capacity(written.len());
            for (k, (r, w)) in kept.into_iter().zip(written).enumerate() {
                if late.contains(&k) {
                    let _ = r.fail_and_end_session(
                        tensorport::wire::ErrorCode::FenceTimeout,
                        format!(
                            "the device tensor was not signalled ready within {:?}",
                            tensorport_cuda::DEFAULT_FENCE_TIMEOUT
                        ),
                    );
                } else {
                    let _ = r.respond(&[]);
                    rows.push(w);
                }
            }
            Ok(rows)
        })
    }

    /// A batch of requests: waits up to `timeout` seconds for the first, then up to `max_wait`
    /// for more, at most `max`. Empty on timeout; raises once the server has stopped.
    #[pyo3(signature = (max = 32, timeout = 1.0, max_wait = 0.005))]
    fn recv_batch(
        &self,
        py: Python<'_>,
        max: usize,
        timeout: f64,
        max_wait: f64,
    ) -> PyResult<Vec<Request>> {
        let (t, w) = (secs(timeout)?, secs(max_wait)?);
        let server = self.inner.clone();
        let batch = py
            .allow_threads(move || server.recv_batch(max.max(1), t, w))
            .map_err(py_err)?;
        Ok(batch.into_iter().map(Request::new).collect())
    }

    /// (Internal: `tensorport.Loader`'s batch step.) Receives a batch as `recv_batch` does,
    /// copies each request of exactly `row` bytes into row k of the `capacity` bytes at
    /// `address` (a numpy array the package allocated for it), answers each with an empty
    /// result, and returns `(request_id, row k)` for the rows written. A request of another
    /// size is failed, saying so. The GIL is released throughout.
    #[pyo3(signature = (address, capacity, row, max = 32, timeout = 1.0, max_wait = 0.005))]
    #[allow(clippy::too_many_arguments)]
    fn _recv_into_address(
        &self,
        py: Python<'_>,
        address: usize,
        capacity: usize,
        row: usize,
        max: usize,
        timeout: f64,
        max_wait: f64,
    ) -> PyResult<Vec<(u64, usize)>> {
        let (t, w) = (secs(timeout)?, secs(max_wait)?);
        let rows = batch_rows(address, capacity, row, max)?;
        let server = self.inner.clone();
        py.allow_threads(move || {
            let batch = server.recv_batch(rows, t, w).map_err(py_err)?;
            // SAFETY: the package passes the data address and size of a numpy array it has
            // just allocated for this call and holds until it returns (`Loader`); rows are
            // written within `capacity` and nothing else writes the array meanwhile.
            let out = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, capacity) };
            let mut written = Vec::with_capacity(batch.len());
            for r in batch {
                let Some(r) = one_row(r, row) else {
                    continue;
                };
                let bytes = r.bytes();
                let k = written.len();
                out[k * row..(k + 1) * row].copy_from_slice(bytes);
                written.push((r.request_id(), k));
                let _ = r.respond(&[]);
            }
            Ok(written)
        })
    }

    /// (Benchmarks: a consumer with no Python work per tensor.) Receives a batch as
    /// `recv_batch` does, reads each tensor's first byte, answers each with an empty result;
    /// returns `(tensors, bytes)`. The GIL is released throughout.
    #[pyo3(signature = (max = 64, timeout = 1.0))]
    fn _ack_batch(&self, py: Python<'_>, max: usize, timeout: f64) -> PyResult<(usize, u64)> {
        let t = secs(timeout)?;
        let server = self.inner.clone();
        py.allow_threads(move || {
            let batch = server
                .recv_batch(max.max(1), t, Duration::ZERO)
                .map_err(py_err)?;
            let (n, mut bytes) = (batch.len(), 0u64);
            for r in batch {
                std::hint::black_box(r.bytes().first());
                bytes += r.desc().byte_len();
                let _ = r.respond(&[]);
            }
            Ok((n, bytes))
        })
    }

    /// Producer sessions open now.
    fn sessions(&self) -> usize {
        self.inner.status().sessions.len()
    }

    /// Server-wide counts: `{"submitted": …, "completed": …, "protocol_errors": …, …}`.
    fn totals(&self) -> std::collections::HashMap<&'static str, u64> {
        let t = self.inner.status().totals;
        [
            ("submitted", t.submitted),
            ("completed", t.completed),
            ("bytes", t.bytes),
            ("protocol_errors", t.protocol_errors),
            ("sessions_opened", t.sessions_opened),
            ("sessions_reclaimed", t.sessions_reclaimed),
        ]
        .into_iter()
        .collect()
    }

    /// Refuses new producers and tells the open ones to finish.
    fn drain(&self) {
        self.inner.drain();
    }

    /// The socket path.
    #[getter]
    fn socket(&self) -> std::path::PathBuf {
        self.inner.socket_path().to_path_buf()
    }
}

/// How many rows of `row` bytes a batch copied into `capacity` bytes at `address` may have (at
/// most `max`), or why none.
pub(crate) fn batch_rows(
    address: usize,
    capacity: usize,
    row: usize,
    max: usize,
) -> PyResult<usize> {
    if row == 0 || address == 0 {
        return Err(PyValueError::new_err("a row of 0 bytes, or no buffer"));
    }
    match (capacity / row).min(max.max(1)) {
        0 => Err(PyValueError::new_err("the buffer holds no row")),
        rows => Ok(rows),
    }
}

/// `r` if its tensor is exactly one row of `row` bytes; otherwise it is failed, saying so.
pub(crate) fn one_row(r: tensorport::Request, row: usize) -> Option<tensorport::Request> {
    let n = r.desc().byte_len();
    if n == row as u64 {
        return Some(r);
    }
    let _ = r.fail(format!("a tensor of {n} bytes; this consumer takes {row}"));
    None
}
