//! The native part of the `tensorport` Python package (`tensorport._native`): producers,
//! their loans, and a server with its requests, over the Rust library.
//!
//! Views: a loan's or a request's bytes are handed to Python as an address and a length, which
//! the package's Python side turns into a numpy array over a ctypes buffer that references the
//! loan or request object. Each object holds its pool (`mapping()`), so the memory stays mapped
//! for as long as any view of it lives, whatever happens to the session. Blocking calls release
//! the GIL.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tensorport::wire::ErrorCode;
use tensorport::{DType, HostPool, ProducerConfig, ServerConfig, TensorSpec};

create_exception!(
    tensorport,
    TensorportError,
    PyException,
    "A tensorport failure; `code` is the protocol's error code (a number) and `code_name` its name, where there is one."
);

/// `recv_many` met the result of a CUDA tensor, which `recv` must take (it orders the
/// tensor's reuse after the server's reads).
fn cuda_waits() -> PyErr {
    coded(
        "the next result is a CUDA tensor's: take it with recv (recv_many takes host tensors' only)".into(),
        None,
    )
}

/// A failed request's result as `TensorportError`, its `request_id` attribute set.
fn failed(py: Python<'_>, c: &tensorport::Completion) -> PyErr {
    let (message, code) = match &c.result {
        Err(e) => (e.message.as_str(), Some(e.code)),
        Ok(_) => ("", None),
    };
    let err = coded(format!("request {} failed: {message}", c.request_id), code);
    let _ = err.value(py).setattr("request_id", c.request_id);
    err
}

/// A Rust error as a Python exception: a timeout as `TimeoutError`, everything else as
/// `TensorportError` with the protocol code when one applies.
fn py_err(e: tensorport::Error) -> PyErr {
    use tensorport::Error as E;
    let code = match &e {
        E::Timeout(..) => return PyTimeoutError::new_err(e.to_string()),
        E::Refused { code, .. } => Some(*code),
        E::InvalidTensor(w) => Some(w.code()),
        E::DuplicateRequest(_) => Some(ErrorCode::DuplicateRequest),
        E::Draining => Some(ErrorCode::Draining),
        E::ResultTooLarge(_) => Some(ErrorCode::FrameTooLarge),
        _ => None,
    };
    coded(e.to_string(), code)
}

fn coded(message: String, code: Option<ErrorCode>) -> PyErr {
    let err = TensorportError::new_err(message);
    Python::with_gil(|py| {
        let v = err.value(py);
        let _ = v.setattr("code", code.map(|c| c.as_u16()));
        let _ = v.setattr("code_name", code.map(|c| format!("{c:?}")));
    });
    err
}

fn secs(t: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(t)
        .map_err(|_| PyValueError::new_err(format!("a timeout of {t} s: give seconds, >= 0")))
}

fn dtype(name: &str) -> PyResult<DType> {
    DType::ALL
        .iter()
        .copied()
        .find(|d| d.name() == name)
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "dtype {name:?}: one of {}",
                DType::ALL
                    .iter()
                    .map(|d| d.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A producer session: `Producer(socket, name="python", slots=0, slot_size=0)` (0: the
/// server's defaults).
#[pyclass(module = "tensorport._native")]
struct Producer {
    inner: Mutex<Option<tensorport::Producer>>,
    /// Allocations of other libraries registered as device buffers, per device ordinal, and
    /// the device and stream of each device request in flight.
    cuda: Mutex<CudaState>,
    /// A failed result `recv_many` took after others: raised by the next `recv`/`recv_many`.
    stashed: Mutex<Option<tensorport::Completion>>,
}

#[derive(Default)]
struct CudaState {
    devices: std::collections::HashMap<i32, tensorport_cuda::ExternalDevice>,
    in_flight: std::collections::HashMap<u64, (i32, usize)>,
}

fn cuda_err(e: tensorport_cuda::Error) -> PyErr {
    match e {
        tensorport_cuda::Error::Transport(t) => py_err(t),
        e => coded(e.to_string(), None),
    }
}

impl Producer {
    fn with<R>(
        &self,
        f: impl FnOnce(&mut tensorport::Producer) -> tensorport::Result<R>,
    ) -> PyResult<R> {
        let mut g = lock(&self.inner);
        let p = g
            .as_mut()
            .ok_or_else(|| coded("the producer is closed".into(), None))?;
        f(p).map_err(py_err)
    }
}

impl Producer {
    fn has_cuda_in_flight(&self, request_id: u64) -> bool {
        lock(&self.cuda).in_flight.contains_key(&request_id)
    }
}

#[pymethods]
impl Producer {
    #[new]
    #[pyo3(signature = (socket, name = "python", slots = 0, slot_size = 0, rings = true, connect_timeout = 10.0))]
    fn new(
        py: Python<'_>,
        socket: std::path::PathBuf,
        name: &str,
        slots: u32,
        slot_size: u64,
        rings: bool,
        connect_timeout: f64,
    ) -> PyResult<Producer> {
        let mut cfg = ProducerConfig::new(name);
        cfg.slots = slots;
        cfg.slot_size = slot_size;
        cfg.rings = rings;
        cfg.connect_timeout = secs(connect_timeout)?;
        let p = py
            .allow_threads(|| tensorport::Producer::connect(&socket, cfg))
            .map_err(py_err)?;
        Ok(Producer {
            inner: Mutex::new(Some(p)),
            cuda: Mutex::new(CudaState::default()),
            stashed: Mutex::new(None),
        })
    }

    /// A free slot to write (waits up to `timeout` seconds): a `Loan`. Several may be out.
    #[pyo3(signature = (timeout = 10.0))]
    fn loan(&self, py: Python<'_>, timeout: f64) -> PyResult<Loan> {
        let t = secs(timeout)?;
        let mut loan = py.allow_threads(|| self.with(|p| p.loan(t)))?;
        let len = loan.len();
        let address = loan.bytes_mut().as_mut_ptr() as usize;
        Ok(Loan {
            pool: loan.mapping(),
            slot: loan.slot().slot,
            address,
            len,
            inner: Mutex::new(Some(loan)),
        })
    }

    /// Hands `loan` to the server as a tensor of `dtype` (`"f32"`, `"u8"`, …) and `shape`
    /// (row-major unless `strides`, in elements, are given) starting at byte `offset`; returns
    /// the request id. The loan is spent, whatever comes of it.
    #[pyo3(signature = (loan, dtype, shape, strides = None, offset = 0))]
    fn submit(
        &self,
        loan: &Loan,
        dtype: &str,
        shape: Vec<u64>,
        strides: Option<Vec<u64>>,
        offset: u64,
    ) -> PyResult<u64> {
        let mut spec = TensorSpec::new(self::dtype(dtype)?, &shape).at_offset(offset);
        if let Some(s) = strides {
            spec = spec.with_strides(&s);
        }
        let l = lock(&loan.inner)
            .take()
            .ok_or_else(|| coded("this loan was already submitted".into(), None))?;
        self.with(|p| p.submit_loan(l, &spec))
    }

    /// (Internal: `Producer.submit_tensor`.) Hands over the CUDA tensor whose first element is
    /// at device address `ptr` on device `device`, written by work on `stream` (a `CUstream`
    /// as an integer; 0: the default stream): its allocation is found with the driver and
    /// registered once; "ready" is recorded on `stream`. The caller keeps the tensor alive
    /// and unwritten until its result has come back.
    #[pyo3(signature = (ptr, device, dtype, shape, strides = None, stream = 0, timeout = 10.0))]
    #[allow(clippy::too_many_arguments)]
    fn _submit_cuda(
        &self,
        py: Python<'_>,
        ptr: u64,
        device: i32,
        dtype: &str,
        shape: Vec<u64>,
        strides: Option<Vec<u64>>,
        stream: usize,
        timeout: f64,
    ) -> PyResult<u64> {
        let t = secs(timeout)?;
        let mut spec = TensorSpec::new(self::dtype(dtype)?, &shape);
        if let Some(s) = strides {
            spec = spec.with_strides(&s);
        }
        py.allow_threads(|| {
            let mut cuda = lock(&self.cuda);
            let CudaState { devices, in_flight } = &mut *cuda;
            let ext = match devices.entry(device) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let gpu = tensorport_cuda::Gpu::open(device).map_err(cuda_err)?;
                    v.insert(tensorport_cuda::ExternalDevice::new(gpu))
                }
            };
            let mut g = lock(&self.inner);
            let p = g
                .as_mut()
                .ok_or_else(|| coded("the producer is closed".into(), None))?;
            // SAFETY: the package passes torch's current stream of the tensor's device (or 0)
            // and holds the tensor until its result has come back (`Producer._held`).
            let id = unsafe { ext.submit(p, ptr, &spec, stream as *mut std::ffi::c_void, t) }
                .map_err(cuda_err)?;
            in_flight.insert(id, (device, stream));
            Ok(id)
        })
    }

    /// The next result, waiting up to `timeout` seconds: `(request_id, bytes)`, or the server's
    /// refusal of that request raised as `TensorportError` (its `request_id` attribute set).
    #[pyo3(signature = (timeout = 10.0))]
    fn recv(&self, py: Python<'_>, timeout: f64) -> PyResult<(u64, Py<PyBytes>)> {
        let t = secs(timeout)?;
        let stashed = lock(&self.stashed).take();
        let c = match stashed {
            Some(c) => c,
            None => py.allow_threads(|| self.with(|p| p.recv_result(t)))?,
        };
        // A CUDA tensor's memory is the caller's again once the server's reads are done: the
        // stream it was submitted from waits for them.
        {
            let mut cuda = lock(&self.cuda);
            if let Some((device, stream)) = cuda.in_flight.remove(&c.request_id) {
                if let Some(ext) = cuda.devices.get_mut(&device) {
                    // SAFETY: the stream the tensor was submitted from, still the caller's.
                    unsafe { ext.released(c.request_id, stream as *mut std::ffi::c_void) }
                        .map_err(cuda_err)?;
                }
            }
        }
        match c.result {
            Ok(bytes) => Ok((c.request_id, PyBytes::new(py, &bytes).unbind())),
            Err(e) => {
                let err = coded(
                    format!("request {} failed: {}", c.request_id, e.message),
                    Some(e.code),
                );
                let _ = err.value(py).setattr("request_id", c.request_id);
                Err(err)
            }
        }
    }

    /// (Internal: `Producer.send`.) Copies `nbytes` at `address` (a C-contiguous numpy array
    /// the package holds for the call) into a free slot, waiting up to `timeout` seconds for
    /// one, and submits it as `dtype` and `shape`: one call per tensor instead of a loan's few.
    #[pyo3(signature = (address, nbytes, dtype, shape, timeout = 10.0))]
    fn _send(
        &self,
        address: usize,
        nbytes: usize,
        dtype: &str,
        shape: Vec<u64>,
        timeout: f64,
    ) -> PyResult<u64> {
        let t = secs(timeout)?;
        let spec = TensorSpec::new(self::dtype(dtype)?, &shape);
        let want = spec
            .extent()
            .ok_or_else(|| coded(format!("shape {shape:?} overflows"), None))?;
        if want != nbytes as u64 {
            return Err(coded(
                format!(
                    "{nbytes} bytes given for a {dtype} tensor of shape {shape:?} ({want} bytes)"
                ),
                None,
            ));
        }
        // SAFETY: the package passes the data address and size of a C-contiguous numpy array it
        // holds until this call returns; the GIL is held, so no Python code writes it meanwhile.
        let src = unsafe { std::slice::from_raw_parts(address as *const u8, nbytes) };
        let slot_size = self.with(|p| Ok(p.slot_size()))?;
        if nbytes as u64 > slot_size {
            return Err(coded(
                format!(
                    "a tensor of {nbytes} bytes does not fit this producer's slots of {slot_size}"
                ),
                Some(ErrorCode::OutOfBounds),
            ));
        }
        self.with(|p| {
            let mut lease = p.lease(t)?;
            lease.bytes_mut()[..nbytes].copy_from_slice(src);
            lease.submit(&spec)
        })
    }

    /// Every result that has arrived, up to `max`, waiting up to `timeout` seconds for the
    /// first: a list of `(request_id, bytes)`. A failed request raises `TensorportError` (with
    /// its `request_id`); the results received before it stay queued for the next call.
    #[pyo3(signature = (max = 256, timeout = 0.0))]
    fn recv_many(
        &self,
        py: Python<'_>,
        max: usize,
        timeout: f64,
    ) -> PyResult<Vec<(u64, Py<PyBytes>)>> {
        let t = secs(timeout)?;
        let mut out = Vec::new();
        {
            let mut st = lock(&self.stashed);
            match st.as_ref().map(|c| c.result.is_err()) {
                Some(true) => return Err(failed(py, &st.take().expect("just seen"))),
                Some(false) => return Err(cuda_waits()),
                None => {}
            }
        }
        while out.len() < max.max(1) {
            let next = if out.is_empty() && !t.is_zero() {
                match py.allow_threads(|| self.with(|p| p.recv_result(t))) {
                    Ok(c) => Some(c),
                    Err(e) if e.is_instance_of::<pyo3::exceptions::PyTimeoutError>(py) => None,
                    Err(e) => return Err(e),
                }
            } else {
                self.with(|p| p.try_recv_result())?
            };
            let Some(c) = next else { break };
            if self.has_cuda_in_flight(c.request_id) {
                // A CUDA tensor's result needs its release handled by `recv`: kept for it.
                *lock(&self.stashed) = Some(c);
                if out.is_empty() {
                    return Err(cuda_waits());
                }
                break;
            }
            match &c.result {
                Ok(bytes) => out.push((c.request_id, PyBytes::new(py, bytes).unbind())),
                Err(_) if out.is_empty() => return Err(failed(py, &c)),
                Err(_) => {
                    // Hand over what came before it; the failure is raised next time.
                    *lock(&self.stashed) = Some(c);
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Requests submitted whose result has not been received.
    fn in_flight(&self) -> PyResult<usize> {
        self.with(|p| Ok(p.in_flight()))
    }

    /// Bytes in each slot.
    fn slot_size(&self) -> PyResult<u64> {
        self.with(|p| Ok(p.slot_size()))
    }

    /// Whether the session hands tensors over on the shared-memory queues.
    fn uses_rings(&self) -> PyResult<bool> {
        self.with(|p| Ok(p.uses_rings()))
    }

    /// Ends the session cleanly (idempotent).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let p = lock(&self.inner).take();
        match p {
            Some(p) => py.allow_threads(|| p.close()).map_err(py_err),
            None => Ok(()),
        }
    }
}

/// A slot lent by `Producer.loan`: write it (its `address` and `len`, which the package turns
/// into a numpy view), then `Producer.submit` it. Dropped unsubmitted, the slot goes back.
#[pyclass(module = "tensorport._native")]
struct Loan {
    inner: Mutex<Option<tensorport::Loan>>,
    /// Keeps the pool mapped while any view of the slot lives.
    #[allow(dead_code)]
    pool: Arc<HostPool>,
    #[pyo3(get)]
    slot: u32,
    #[pyo3(get)]
    address: usize,
    #[pyo3(get)]
    len: usize,
}

#[pymethods]
impl Loan {
    /// Whether it was submitted (a view of it may still exist; writing it now tears the tensor).
    #[getter]
    fn submitted(&self) -> bool {
        lock(&self.inner).is_none()
    }
}

/// A server in this process: `Server(socket, slots=8, slot_size=1 MiB, consumers=1)`.
#[pyclass(module = "tensorport._native")]
struct Server {
    inner: Arc<tensorport::Server>,
    /// With `cuda_device`: the GPU device tensors are opened in, and a stream for the copies.
    cuda: Option<(Arc<tensorport_cuda::Gpu>, tensorport_cuda::Stream)>,
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
                Some((gpu, stream))
            }
        };
        Ok(Server {
            inner: Arc::new(tensorport::Server::bind(cfg).map_err(py_err)?),
            cuda,
        })
    }

    /// (Internal: `tensorport.Loader`'s batch step on a GPU.) Receives a batch as `recv_batch`
    /// does and copies each request of exactly `row` bytes — a host slot by DMA, a producer's
    /// device buffer after waiting on its fence — into row k of the `capacity` bytes of device
    /// memory at `address` (a torch CUDA tensor the package allocated for it), after the work
    /// already on torch's `stream`; waits for the copies, answers each request with an empty
    /// result (releasing slots and buffers), and returns `(request_id, row k)` for the rows
    /// written. A request of another size is failed, saying so. The GIL is released throughout.
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
        let Some((_, ours)) = &self.cuda else {
            return Err(PyValueError::new_err(
                "this server was made without cuda_device: it cannot write into GPU memory",
            ));
        };
        let rows = batch_rows(address as usize, capacity, row, max)?;
        let server = self.inner.clone();
        py.allow_threads(move || {
            let batch = server.recv_batch(rows, t, w).map_err(py_err)?;
            if batch.is_empty() {
                return Ok(Vec::new());
            }
            let dev = |e: String| coded(e, None);
            // SAFETY: `stream` is torch's current stream of this device (the package passes
            // `torch.cuda.current_stream().cuda_stream`); the rows may be memory torch just
            // freed and reused, so our copies wait for its work first.
            unsafe { ours.wait_for_raw(stream as *mut std::ffi::c_void) }.map_err(cuda_err)?;
            let mut kept = Vec::with_capacity(batch.len());
            let mut written = Vec::with_capacity(batch.len());
            let copy = |r: &tensorport::Request, dst: u64| -> PyResult<()> {
                // SAFETY: `dst` is a row of the `capacity` bytes of device memory the package
                // allocated for this call and holds until it returns; host slots stay
                // unreleased and device buffers fenced until the stream is synchronised below
                // (on every path); a device tensor was bounds-checked against its registration.
                unsafe {
                    match r.device() {
                        None => ours
                            .copy_host_to_device_async(dst, &r.bytes()[..row])
                            .map_err(cuda_err),
                        Some(dt) => {
                            dt.wait_ready(ours.raw()).map_err(dev)?;
                            ours.copy_device_to_device_async(dst, dt.ptr(), row)
                                .map_err(cuda_err)?;
                            dt.record_release(ours.raw()).map_err(dev)
                        }
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
                    if let Err(e) = copy(&r, address + (k * row) as u64) {
                        failed = Some(e);
                    }
                }
                written.push((r.request_id(), k));
                kept.push(r);
            }
            // The copies read the slots and buffers: they are answered (released) only after.
            let synced = ours.synchronize().map_err(cuda_err);
            if let Some(e) = failed.or(synced.err()) {
                // Dropped unanswered: each producer gets a failure for its request.
                drop(kept);
                return Err(e);
            }
            for r in kept {
                let _ = r.respond(&[]);
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

/// A submitted tensor, seen in place (`address`, `nbytes`: the package makes a read-only numpy
/// view). Answer it once with `respond` or `fail`; dropped unanswered, the producer gets a
/// failure.
#[pyclass(module = "tensorport._native")]
struct Request {
    inner: Mutex<Option<tensorport::Request>>,
    /// Keeps the pool mapped while any view lives.
    #[allow(dead_code)]
    pool: Option<Arc<HostPool>>,
    #[pyo3(get)]
    request_id: u64,
    #[pyo3(get)]
    producer: String,
    #[pyo3(get)]
    dtype: &'static str,
    #[pyo3(get)]
    shape: Vec<u64>,
    /// Strides in elements.
    #[pyo3(get)]
    strides: Vec<u64>,
    /// A host address, or (with `device`) a device address in this process's CUDA context.
    #[pyo3(get)]
    address: usize,
    #[pyo3(get)]
    nbytes: usize,
    /// In a producer's device buffer (opened by a server made with `cuda_device`).
    #[pyo3(get)]
    device: bool,
}

impl Request {
    fn new(r: tensorport::Request) -> Request {
        let d = *r.desc();
        let (address, nbytes, device) = match r.device() {
            Some(dt) => (dt.ptr() as usize, dt.len() as usize, true),
            None => (r.bytes().as_ptr() as usize, r.bytes().len(), false),
        };
        Request {
            pool: r.mapping(),
            request_id: r.request_id(),
            producer: r.producer().to_string(),
            dtype: d.dtype().name(),
            shape: d.shape().to_vec(),
            strides: d.strides().to_vec(),
            address,
            nbytes,
            device,
            inner: Mutex::new(Some(r)),
        }
    }

    fn take(&self) -> PyResult<tensorport::Request> {
        lock(&self.inner)
            .take()
            .ok_or_else(|| coded("this request was already answered".into(), None))
    }
}

#[pymethods]
impl Request {
    /// (Device tensors.) Makes `stream` (a CUDA stream of the server's device context, e.g.
    /// torch's current stream; 0: the legacy default stream) wait for the producer's writes
    /// (its fence) before the work enqueued on it next.
    fn _wait_ready(&self, stream: usize) -> PyResult<()> {
        let g = lock(&self.inner);
        let r = g
            .as_ref()
            .ok_or_else(|| coded("this request was already answered".into(), None))?;
        let dt = r
            .device()
            .ok_or_else(|| coded("not a device tensor".into(), None))?;
        // SAFETY: the package passes torch's current stream of the device whose context the
        // server opened the buffer in (or 0, the legacy default stream).
        unsafe { dt.wait_ready(stream as *mut std::ffi::c_void) }.map_err(|e| coded(e, None))
    }

    /// Sends `data` as the result (and gives the slot or device buffer back). For a device
    /// tensor the buffer is released after the work enqueued so far on `stream` (the reads of
    /// it), so the producer's next writes wait for them.
    #[pyo3(signature = (data, stream = 0))]
    fn respond(&self, py: Python<'_>, data: &[u8], stream: usize) -> PyResult<()> {
        let r = self.take()?;
        release_after(&r, stream)?;
        py.allow_threads(|| r.respond(data)).map_err(py_err)
    }

    /// Answers with a failure carrying `message` (a device buffer is released as in
    /// `respond`).
    #[pyo3(signature = (message, stream = 0))]
    fn fail(&self, py: Python<'_>, message: String, stream: usize) -> PyResult<()> {
        let r = self.take()?;
        release_after(&r, stream)?;
        py.allow_threads(|| r.fail(message)).map_err(py_err)
    }

    /// Whether it was answered.
    #[getter]
    fn answered(&self) -> bool {
        lock(&self.inner).is_none()
    }
}

/// How many rows of `row` bytes a batch copied into `capacity` bytes at `address` may have (at
/// most `max`), or why none.
fn batch_rows(address: usize, capacity: usize, row: usize, max: usize) -> PyResult<usize> {
    if row == 0 || address == 0 {
        return Err(PyValueError::new_err("a row of 0 bytes, or no buffer"));
    }
    match (capacity / row).min(max.max(1)) {
        0 => Err(PyValueError::new_err("the buffer holds no row")),
        rows => Ok(rows),
    }
}

/// `r` if its tensor is exactly one row of `row` bytes; otherwise it is failed, saying so.
fn one_row(r: tensorport::Request, row: usize) -> Option<tensorport::Request> {
    let n = r.desc().byte_len();
    if n == row as u64 {
        return Some(r);
    }
    let _ = r.fail(format!("a tensor of {n} bytes; this consumer takes {row}"));
    None
}

/// For a device tensor: its release recorded on `stream` (after the consumer's reads there).
fn release_after(r: &tensorport::Request, stream: usize) -> PyResult<()> {
    match r.device() {
        // SAFETY: as in `_wait_ready`: a stream of the server's device context, or 0.
        Some(dt) => unsafe { dt.record_release(stream as *mut std::ffi::c_void) }
            .map_err(|e| coded(e, None)),
        None => Ok(()),
    }
}

/// The socket path a server listens on by default (`TENSORPORT_SOCKET`, else
/// `$XDG_RUNTIME_DIR/tensorport/tensorport.sock`, else `/tmp/tensorport-<uid>/tensorport.sock`).
#[pyfunction]
fn default_socket() -> std::path::PathBuf {
    tensorport::path::default_socket_path()
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(default_socket, m)?)?;
    m.add_class::<Producer>()?;
    m.add_class::<Loan>()?;
    m.add_class::<Server>()?;
    m.add_class::<Request>()?;
    m.add("TensorportError", m.py().get_type::<TensorportError>())?;
    m.add("PROTOCOL_VERSION", tensorport::protocol_version())?;
    Ok(())
}
