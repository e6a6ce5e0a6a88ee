//! `Producer` (a session with a server, its CUDA registrations) and `Loan` (a leased slot).

use crate::*;

/// A producer session: `Producer(socket, name="python", slots=0, slot_size=0)` (0: the
/// server's defaults).
#[pyclass(module = "tensorport._native")]
pub(crate) struct Producer {
    inner: Mutex<Option<tensorport::Producer>>,
    /// Allocations of other libraries registered as device buffers, per device ordinal, and
    /// the device and stream of each device request in flight.
    cuda: Mutex<CudaState>,
    /// A failed result `recv_many` took after others: raised by the next `recv`/`recv_many`.
    stashed: Mutex<Option<tensorport::Completion>>,
}

#[derive(Default)]
pub(crate) struct CudaState {
    devices: std::collections::HashMap<i32, tensorport_cuda::ExternalDevice>,
    in_flight: std::collections::HashMap<u64, (i32, usize)>,
}

pub(crate) fn cuda_err(e: tensorport_cuda::Error) -> PyErr {
    match e {
        tensorport_cuda::Error::Transport(t) => py_err(t),
        e => coded(e.to_string(), None),
    }
}

/// Why a call on the producer failed, before it becomes a Python exception.
enum Failure {
    Closed,
    Transport(tensorport::Error),
    Cuda(tensorport_cuda::Error),
}

impl Failure {
    /// The Python exception (this takes the GIL: never call it with a lock held).
    fn raise(self) -> PyErr {
        match self {
            Failure::Closed => coded("the producer is closed".into(), None),
            Failure::Transport(e) => py_err(e),
            Failure::Cuda(e) => cuda_err(e),
        }
    }
}

impl Producer {
    /// Runs `f` on the producer under its lock, with the GIL released while the lock is waited
    /// for and held; an error becomes a Python exception only once the lock is let go and the
    /// GIL taken back: holding the lock while waiting for the GIL (to build an exception)
    /// would deadlock against a thread holding the GIL and waiting for the lock.
    fn with<R: Send, E: Into<tensorport::Error>>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut tensorport::Producer) -> Result<R, E> + Send,
    ) -> PyResult<R> {
        crate::without_gil(py, || {
            let mut g = lock(&self.inner);
            match g.as_mut() {
                None => Err(Failure::Closed),
                Some(p) => f(p).map_err(|e| Failure::Transport(e.into())),
            }
        })
        .map_err(Failure::raise)
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
        let p = crate::without_gil(py, || tensorport::Producer::connect(&socket, cfg))
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
        let mut loan = self.with(py, |p| p.loan(t))?;
        let len = loan.len();
        let address = loan.bytes_mut().as_mut_ptr() as usize;
        let mapping = Py::new(
            py,
            Mapping {
                _pool: loan.mapping(),
            },
        )?;
        Ok(Loan {
            pool: mapping,
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
        py: Python<'_>,
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
        self.with(py, |p| p.submit_loan(l, &spec))
    }

    /// (Internal: `Producer.submit_tensor`.) Hands over the CUDA tensor whose first element is
    /// at device address `ptr` on device `device`, of `spec` = `(dtype, shape, strides or
    /// None)`, written by work on `stream` (a `CUstream` as an integer; 0: the default
    /// stream): its allocation is found with the driver and registered once; "ready" is
    /// recorded on `stream`. The caller keeps the tensor alive and unwritten until its result
    /// has come back.
    #[pyo3(signature = (ptr, device, spec, stream = 0, timeout = 10.0))]
    fn _submit_cuda(
        &self,
        py: Python<'_>,
        ptr: u64,
        device: i32,
        spec: (String, Vec<u64>, Option<Vec<u64>>),
        stream: usize,
        timeout: f64,
    ) -> PyResult<u64> {
        let (dtype, shape, strides) = spec;
        let dtype = dtype.as_str();
        let t = secs(timeout)?;
        let mut spec = TensorSpec::new(self::dtype(dtype)?, &shape);
        if let Some(s) = strides {
            spec = spec.with_strides(&s);
        }
        // Errors leave the closure as `Failure`s and become exceptions after the locks are let
        // go (building one takes the GIL).
        crate::without_gil(py, || {
            let mut cuda = lock(&self.cuda);
            let CudaState { devices, in_flight } = &mut *cuda;
            let ext = match devices.entry(device) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let gpu = tensorport_cuda::Gpu::open(device).map_err(Failure::Cuda)?;
                    v.insert(tensorport_cuda::ExternalDevice::new(gpu))
                }
            };
            let mut g = lock(&self.inner);
            let p = g.as_mut().ok_or(Failure::Closed)?;
            // SAFETY: the package passes torch's current stream of the tensor's device (or 0)
            // and holds the tensor until its result has come back (`Producer._held`).
            let id = unsafe { ext.submit(p, ptr, &spec, stream as *mut std::ffi::c_void, t) }
                .map_err(Failure::Cuda)?;
            in_flight.insert(id, (device, stream));
            Ok(id)
        })
        .map_err(Failure::raise)
    }

    /// The next result, waiting up to `timeout` seconds: `(request_id, bytes)`, or the server's
    /// refusal of that request raised as `TensorportError` (its `request_id` attribute set).
    #[pyo3(signature = (timeout = 10.0))]
    fn recv(&self, py: Python<'_>, timeout: f64) -> PyResult<(u64, Py<PyBytes>)> {
        let t = secs(timeout)?;
        let stashed = lock(&self.stashed).take();
        let c = match stashed {
            Some(c) => c,
            None => self.with(py, |p| p.recv_result(t))?,
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
        py: Python<'_>,
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
        let slot_size = self.with(py, |p| Ok::<_, tensorport::Error>(p.slot_size()))?;
        if nbytes as u64 > slot_size {
            return Err(coded(
                format!(
                    "a tensor of {nbytes} bytes does not fit this producer's slots of {slot_size}"
                ),
                Some(ErrorCode::OutOfBounds),
            ));
        }
        // The wait for a free slot (up to `timeout`) happens without the GIL, so the server's
        // answers and other Python threads go on meanwhile.
        self.with(py, |p| {
            let mut lease = p.lease(t).map_err(tensorport::Error::from)?;
            // SAFETY: the package passes the data address and size of a C-contiguous numpy
            // array it holds (alive, not resized) until this call returns; `send` is
            // documented to read it during the call, as any copy would.
            let src = unsafe { std::slice::from_raw_parts(address as *const u8, nbytes) };
            lease.bytes_mut()[..nbytes].copy_from_slice(src);
            lease.submit(&spec).map_err(tensorport::Error::from)
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
                match self.with(py, |p| p.recv_result(t)) {
                    Ok(c) => Some(c),
                    Err(e) if e.is_instance_of::<pyo3::exceptions::PyTimeoutError>(py) => None,
                    Err(e) => return Err(e),
                }
            } else {
                self.with(py, |p| p.try_recv_result())?
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
    fn in_flight(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |p| Ok::<_, tensorport::Error>(p.in_flight()))
    }

    /// Bytes in each slot.
    fn slot_size(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |p| Ok::<_, tensorport::Error>(p.slot_size()))
    }

    /// Whether the session hands tensors over on the shared-memory queues.
    fn uses_rings(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |p| Ok::<_, tensorport::Error>(p.uses_rings()))
    }

    /// Ends the session cleanly (idempotent).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let p = lock(&self.inner).take();
        match p {
            Some(p) => crate::without_gil(py, || p.close()).map_err(py_err),
            None => Ok(()),
        }
    }
}

/// A slot lent by `Producer.loan`: write it (its `address` and `len`, which the package turns
/// into a numpy view), then `Producer.submit` it. Dropped unsubmitted, the slot goes back.
#[pyclass(module = "tensorport._native")]
pub(crate) struct Loan {
    inner: Mutex<Option<tensorport::Loan>>,
    /// The pool's mapping, which views of the slot hold (not the loan: a view never keeps a
    /// slot leased).
    pool: Py<Mapping>,
    #[pyo3(get)]
    slot: u32,
    #[pyo3(get)]
    address: usize,
    #[pyo3(get)]
    len: usize,
}

#[pymethods]
impl Loan {
    /// Whether it was submitted or given back (a view of it may still exist; the package
    /// revokes the ones it handed out).
    #[getter]
    fn submitted(&self) -> bool {
        lock(&self.inner).is_none()
    }

    /// The pool's mapping, for views to hold: it stays mapped while they live.
    #[getter]
    fn mapping(&self, py: Python<'_>) -> Py<Mapping> {
        self.pool.clone_ref(py)
    }

    /// Gives the slot back unsubmitted (idempotent; a submitted loan is left as it is).
    fn release(&self) {
        drop(lock(&self.inner).take());
    }
}

/// A producer's pool mapping, held by the views of its slots so that none ever points at
/// unmapped memory.
#[pyclass(module = "tensorport._native", frozen)]
pub(crate) struct Mapping {
    _pool: Arc<HostPool>,
}
