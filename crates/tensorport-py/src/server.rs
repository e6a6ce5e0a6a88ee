//! `Server`: a tensorport server in this process, and the batches it hands to Python (into
//! host rows or torch's device memory).

use crate::*;

/// A server in this process: `Server(socket, slots=8, slot_size=1 MiB, consumers=1)`.
#[pyclass(module = "tensorport._native")]
pub(crate) struct Server {
    /// Always `Some` but while it is dropped (`Drop` takes it, to end it without the GIL).
    inner: Option<Arc<tensorport::Server>>,
    /// With `cuda_device`: what builds and settles the batches on the GPU the producers'
    /// device tensors are opened in.
    cuda: Option<std::sync::Mutex<tensorport_cuda::RowBatcher>>,
}

impl Server {
    fn server(&self) -> &Arc<tensorport::Server> {
        self.inner
            .as_ref()
            .expect("a Server's server is taken only as it is dropped")
    }
}

impl Drop for Server {
    /// Ends the server — its sessions, the producers' pools unmapped (and unpinned), their
    /// device buffers closed, the GPU batcher's stream — with the GIL released: on a GPU that
    /// takes tens to hundreds of milliseconds, which the caller's other threads keep.
    fn drop(&mut self) {
        let ending = (self.inner.take(), self.cuda.take());
        Python::with_gil(|py| crate::without_gil(py, move || drop(ending)));
    }
}

/// Device memory torch allocated for one `_recv_into_device` call.
struct TorchRows(tensorport_cuda::DeviceRegion);

impl TorchRows {
    /// # Safety
    /// `region` must be device memory of one GPU that the caller allocated for this batch and
    /// holds, unused by anything else, until the batch has been gathered — and for good should
    /// the gather stall (the package keeps the tensor in `_QUARANTINED` once a "quarantined"
    /// error is raised) — with the work already queued on it put before the copies.
    unsafe fn new(region: tensorport_cuda::DeviceRegion) -> TorchRows {
        TorchRows(region)
    }
}

// SAFETY: `TorchRows::new`'s contract.
unsafe impl tensorport_cuda::DeviceMemory for TorchRows {
    fn device_memory(&self) -> tensorport_cuda::DeviceRegion {
        self.0
    }
}

// SAFETY: `TorchRows::new`'s contract: the memory is this batch's alone.
unsafe impl tensorport_cuda::DeviceMemoryMut for TorchRows {}

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
                let gatherer = Arc::new(tensorport_cuda::Gatherer::new(&gpu));
                let timeout = tensorport_cuda::DEFAULT_FENCE_TIMEOUT;
                let batcher = tensorport_cuda::RowBatcher::new(&gpu, gatherer, timeout, None)
                    .map_err(cuda_err)?;
                Some(std::sync::Mutex::new(batcher))
            }
        };
        Ok(Server {
            inner: Some(Arc::new(tensorport::Server::bind(cfg).map_err(py_err)?)),
            cuda,
        })
    }

    /// (Internal: `tensorport.Loader`'s batch step on a GPU.) Receives a batch as `recv_batch`
    /// does, at most `rows`, and copies each request of exactly `row` bytes — a host slot by
    /// DMA, a producer's device buffer after waiting on its fence — into row k of the
    /// `rows × row` bytes of device memory at `address` (a torch CUDA tensor the package
    /// allocated for it), after the work already on torch's `stream`; waits for the copies,
    /// answers each request with an empty result (releasing slots and buffers), and returns
    /// `(request_id, row k)` for the rows written. A request of another size is failed, saying
    /// so; so is a GPU producer's tensor not signalled ready within
    /// `tensorport_cuda::DEFAULT_FENCE_TIMEOUT` (its row is left out, and its producer's
    /// session ended). The GIL is released throughout.
    #[pyo3(signature = (address, rows, row, stream, timeout = 1.0, max_wait = 0.005))]
    fn _recv_into_device(
        slf: PyRef<'_, Self>,
        address: u64,
        rows: usize,
        row: usize,
        stream: usize,
        timeout: f64,
        max_wait: f64,
    ) -> PyResult<Vec<(u64, usize)>> {
        let (t, w) = (secs(timeout)?, secs(max_wait)?);
        let this: &Server = &slf;
        let Some(batcher) = &this.cuda else {
            return Err(PyValueError::new_err(
                "this server was made without cuda_device: it cannot write into GPU memory",
            ));
        };
        let lock = || batcher.lock().unwrap_or_else(|p| p.into_inner());
        if lock().is_quarantined() {
            return Err(coded(
                format!(
                    "{}: make a new Server",
                    tensorport_cuda::BatchError::Quarantined
                ),
                None,
            ));
        }
        let rows = batch_rows(address as usize, rows, row)?;
        let region = tensorport_cuda::DeviceRegion {
            // Not null: `batch_rows` refused an address of 0.
            addr: tensorport_cuda::DevicePtr::new(address).expect("checked above"),
            len: rows * row,
        };
        // SAFETY: the `rows × row` bytes at `address` are device memory the package allocated
        // for this call (a torch CUDA tensor) and holds until it returns, and for good once it
        // raises a "quarantined" error (`_QUARANTINED`); torch's work on it is put before the
        // copies below.
        let target = unsafe { TorchRows::new(region) };
        // Memory that is not one allocation of this GPU is refused before a batch is taken
        // (the batcher checks again; a batch taken and then refused would fail its requests).
        lock().gpu().check_region(region).map_err(|e| {
            PyValueError::new_err(format!("address {address:#x}, {} bytes: {e}", region.len))
        })?;
        let server = this.server().clone();
        crate::without_gil(slf.py(), move || {
            let batch = server.recv_batch(rows, t, w).map_err(py_err)?;
            let mut batch: Vec<_> = batch.into_iter().filter_map(|r| one_row(r, row)).collect();
            if batch.is_empty() {
                return Ok(Vec::new());
            }
            let mut batcher = lock();
            // SAFETY: `stream` is torch's current stream of this device (the package passes
            // `torch.cuda.current_stream().cuda_stream`); the rows may be memory torch just
            // freed and reused, so our copies wait for its work first.
            unsafe {
                batcher
                    .stream()
                    .wait_for_raw(stream as *mut std::ffi::c_void)
            }
            .map_err(cuda_err)?;
            let kinds = vec![Some(tensorport_cuda::RowKind::Bytes); batch.len()];
            // On an error the batch is dropped unanswered (each producer gets a failure for its
            // request), or held for good if the stream stalled.
            let filled = batcher
                .gather(target, &mut batch, &kinds, row)
                .map_err(|e| match e {
                    tensorport_cuda::BatchError::Stalled(_) => {
                        coded(format!("{e}: make a new Server"), None)
                    }
                    e => coded(e.to_string(), None),
                })?;
            drop(batcher);
            let mut written = Vec::with_capacity(batch.len());
            for (k, r) in batch.into_iter().enumerate() {
                match filled.faults.iter().find(|(i, _)| *i == k) {
                    Some((_, fault)) => {
                        let _ = fault.answer(r.release());
                    }
                    None => {
                        written.push((r.request_id(), k));
                        let _ = r.respond(&[]);
                    }
                }
            }
            Ok(written)
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
        let server = self.server().clone();
        let batch =
            crate::without_gil(py, move || server.recv_batch(max.max(1), t, w)).map_err(py_err)?;
        Ok(batch.into_iter().map(Request::new).collect())
    }

    /// (Internal: `tensorport.Loader`'s batch step.) Receives a batch as `recv_batch` does,
    /// at most `rows`, copies each request of exactly `row` bytes into row k of the
    /// `rows × row` bytes at `address` (a numpy array the package allocated for it), answers each with an empty
    /// result, and returns `(request_id, row k)` for the rows written. A request of another
    /// size is failed, saying so. The GIL is released throughout.
    #[pyo3(signature = (address, rows, row, timeout = 1.0, max_wait = 0.005))]
    fn _recv_into_address(
        &self,
        py: Python<'_>,
        address: usize,
        rows: usize,
        row: usize,
        timeout: f64,
        max_wait: f64,
    ) -> PyResult<Vec<(u64, usize)>> {
        let (t, w) = (secs(timeout)?, secs(max_wait)?);
        let rows = batch_rows(address, rows, row)?;
        let capacity = rows * row;
        let server = self.server().clone();
        crate::without_gil(py, move || {
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
        let server = self.server().clone();
        crate::without_gil(py, move || {
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
        self.server().status().sessions.len()
    }

    /// Server-wide counts: `{"submitted": …, "completed": …, "protocol_errors": …, …}`.
    fn totals(&self) -> std::collections::HashMap<&'static str, u64> {
        let t = self.server().status().totals;
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
        self.server().drain();
    }

    /// The socket path.
    #[getter]
    fn socket(&self) -> std::path::PathBuf {
        self.server().socket_path().to_path_buf()
    }
}

/// `rows`, if `rows` rows of `row` bytes at `address` make a destination; else why not.
pub(crate) fn batch_rows(address: usize, rows: usize, row: usize) -> PyResult<usize> {
    if row == 0 || address == 0 || rows == 0 {
        return Err(PyValueError::new_err(
            "no rows, a row of 0 bytes, or no buffer",
        ));
    }
    rows.checked_mul(row)
        .map(|_| rows)
        .ok_or_else(|| PyValueError::new_err("rows × row overflows"))
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
