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

mod errors;
mod producer;
mod request;
mod server;

pub(crate) use errors::*;
pub(crate) use producer::*;
pub(crate) use request::*;
pub(crate) use server::*;

/// The thread finishing the interpreter, once its exit handlers run (`_interpreter_exiting`).
static FINALIZING: std::sync::OnceLock<std::thread::ThreadId> = std::sync::OnceLock::new();

/// Called by the package's `atexit` handler, on the thread that finishes the interpreter.
#[pyfunction]
fn _interpreter_exiting() {
    let _ = FINALIZING.set(std::thread::current().id());
}

/// Runs `f` with the GIL released. Once the interpreter is exiting, a call returning on any
/// thread but the one finishing it (a daemon thread in `recv_batch`, say) never takes the GIL
/// back: Python would end such a thread with a forced unwind through these frames, which
/// aborts the process. It parks instead, and ends with the process.
pub(crate) fn without_gil<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    py.allow_threads(|| {
        let r = f();
        if FINALIZING
            .get()
            .is_some_and(|&t| t != std::thread::current().id())
        {
            loop {
                std::thread::park();
            }
        }
        r
    })
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
    m.add_function(wrap_pyfunction!(_interpreter_exiting, m)?)?;
    m.add_class::<Producer>()?;
    m.add_class::<Loan>()?;
    m.add_class::<producer::Mapping>()?;
    m.add_class::<Server>()?;
    m.add_class::<Request>()?;
    m.add("TensorportError", m.py().get_type::<TensorportError>())?;
    m.add("PROTOCOL_VERSION", tensorport::protocol_version())?;
    Ok(())
}
