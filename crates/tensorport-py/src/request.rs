//! `Request`: one submitted tensor, its view and its answer.

use crate::*;

/// A submitted tensor, seen in place (`address`, `nbytes`: the package makes a read-only numpy
/// view). Answer it once with `respond` or `fail`; dropped unanswered, the producer gets a
/// failure.
#[pyclass(module = "tensorport._native")]
pub(crate) struct Request {
    inner: Mutex<Option<tensorport::Request>>,
    /// Keeps the pool mapped while any view lives.
    #[allow(dead_code)]
    pool: Option<Arc<HostPool>>,
    /// Keeps a device tensor's buffer open in this process while any view of it lives (the
    /// package's torch tensor holds this request), after the answer and the producer's end.
    #[allow(dead_code)]
    device_buffer: Option<Arc<dyn tensorport::ImportedDevice>>,
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
    pub(crate) fn new(r: tensorport::Request) -> Request {
        let d = r.desc();
        let (address, nbytes, device) = match r.device() {
            Some(dt) => (dt.ptr() as usize, dt.len() as usize, true),
            None => (r.bytes().as_ptr() as usize, r.bytes().len(), false),
        };
        Request {
            pool: r.mapping(),
            device_buffer: r.device().map(|dt| dt.shared_buffer()),
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
        crate::without_gil(py, || r.respond(data)).map_err(py_err)
    }

    /// Answers with a failure carrying `message` (a device buffer is released as in
    /// `respond`).
    #[pyo3(signature = (message, stream = 0))]
    fn fail(&self, py: Python<'_>, message: String, stream: usize) -> PyResult<()> {
        let r = self.take()?;
        release_after(&r, stream)?;
        crate::without_gil(py, || r.fail(message)).map_err(py_err)
    }

    /// Whether it was answered.
    #[getter]
    fn answered(&self) -> bool {
        lock(&self.inner).is_none()
    }
}

/// For a device tensor: its release recorded on `stream` (after the consumer's reads there).
pub(crate) fn release_after(r: &tensorport::Request, stream: usize) -> PyResult<()> {
    match r.device() {
        // SAFETY: as in `_wait_ready`: a stream of the server's device context, or 0.
        Some(dt) => unsafe { dt.record_release(stream as *mut std::ffi::c_void) }
            .map_err(|e| coded(e, None)),
        None => Ok(()),
    }
}
