//! Errors as Python exceptions (`TensorportError` with the protocol's code), and the small
//! conversions every class uses.

use crate::*;

create_exception!(
    tensorport,
    TensorportError,
    PyException,
    "A tensorport failure; `code` is the protocol's error code (a number) and `code_name` its name, where there is one."
);

/// `recv_many` met the result of a CUDA tensor, which `recv` must take (it orders the
/// tensor's reuse after the server's reads).
pub(crate) fn cuda_waits() -> PyErr {
    coded(
        "the next result is a CUDA tensor's: take it with recv (recv_many takes host tensors' only)".into(),
        None,
    )
}

/// A failed request's result as `TensorportError`, its `request_id` attribute set.
pub(crate) fn failed(py: Python<'_>, c: &tensorport::Completion) -> PyErr {
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
pub(crate) fn py_err(e: impl Into<tensorport::Error>) -> PyErr {
    use tensorport::SubmitError as S;
    use tensorport::{ConnectError as C, Error as E, LeaseError as L, RecvError as R};
    let e = e.into();
    let code = match &e {
        E::Timeout(..)
        | E::Connect(C::Timeout(_))
        | E::Lease(L::Timeout(_))
        | E::Recv(R::Timeout(_)) => return PyTimeoutError::new_err(e.to_string()),
        E::Refused { code, .. } | E::Connect(C::Refused { code, .. }) => Some(*code),
        E::Submit(S::InvalidTensor(w)) => Some(w.code()),
        E::Submit(S::DuplicateRequest(_)) => Some(ErrorCode::DuplicateRequest),
        E::Lease(L::Draining) => Some(ErrorCode::Draining),
        E::ResultTooLarge(_) => Some(ErrorCode::FrameTooLarge),
        _ => None,
    };
    coded(e.to_string(), code)
}

pub(crate) fn coded(message: String, code: Option<ErrorCode>) -> PyErr {
    let err = TensorportError::new_err(message);
    Python::with_gil(|py| {
        let v = err.value(py);
        let _ = v.setattr("code", code.map(|c| c.as_u16()));
        let _ = v.setattr("code_name", code.map(|c| format!("{c:?}")));
    });
    err
}

pub(crate) fn secs(t: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(t)
        .map_err(|_| PyValueError::new_err(format!("a timeout of {t} s: give seconds, >= 0")))
}

pub(crate) fn dtype(name: &str) -> PyResult<DType> {
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

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
