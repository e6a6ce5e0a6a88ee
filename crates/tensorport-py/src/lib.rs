//! The native part of the `tensorport` Python package (`tensorport._native`): producers,
//! their loans, and a server with its requests, over the Rust library.
//!
//! Views: a loan's or a request's bytes are handed to Python as an address and a length, which
//! the package's Python side turns into a numpy array over a ctypes buffer that references the
//! loan or request object. Each object holds its pool (`mapping()`), so the memory stays mapped
//! for as long as any view of it lives, whatever happens to the session. Blocking calls release
//! the GIL.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tensorport::wire::ErrorCode;
use tensorport::{DType, HostPool, ProducerConfig, ServerConfig, TensorSpec};

mod errors;
mod mps;
mod producer;
mod request;
mod server;

pub(crate) use errors::*;
pub(crate) use mps::*;
pub(crate) use producer::*;
pub(crate) use request::*;
pub(crate) use server::*;

/// Set (with the finishing thread's id) once the interpreter's exit handlers run
/// (`_interpreter_exiting`).
static EXITING: AtomicBool = AtomicBool::new(false);
static FINALIZING: std::sync::OnceLock<std::thread::ThreadId> = std::sync::OnceLock::new();
/// Native calls between the end of their work and having the GIL back.
static RETURNING: AtomicUsize = AtomicUsize::new(0);

/// Called by the package's `atexit` handler, on the thread that finishes the interpreter, with
/// the GIL: from now on a native call returning on another thread parks instead of taking the
/// GIL back; then the GIL is let go until every call already on its way back has it, so none
/// is left waiting for it when the interpreter ends its daemon threads.
#[pyfunction]
fn _interpreter_exiting(py: Python<'_>) {
    let _ = FINALIZING.set(std::thread::current().id());
    EXITING.store(true, Ordering::SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while RETURNING.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < deadline {
        py.allow_threads(|| std::thread::sleep(Duration::from_millis(1)));
    }
}

/// Runs the `tensorport` command line (`args`: the program's name first) in this process, with
/// the GIL released, and returns its exit status; `launcher` is the command its child processes
/// run it with (`[sys.executable, "-m", "tensorport"]`). For `python -m tensorport` and the
/// installed `tensorport` command only: it sets up logging and signal handling for the whole
/// process, and a farm's children die with it.
#[pyfunction]
fn _cli_main(
    py: Python<'_>,
    args: Vec<std::ffi::OsString>,
    launcher: Vec<std::ffi::OsString>,
) -> PyResult<u8> {
    let mut launcher = launcher.into_iter();
    let program = launcher
        .next()
        .ok_or_else(|| PyValueError::new_err("the launcher needs a program"))?;
    let launcher = tensorport_farm::config::Launcher {
        program: program.into(),
        args: launcher.map(|a| a.to_string_lossy().into_owned()).collect(),
    };
    Ok(py.allow_threads(move || tensorport_cli::run(args, launcher)))
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
    let r = py.allow_threads(|| {
        let r = f();
        // Counted before the flag is read, and the flag set before the count is read
        // (`_interpreter_exiting`): either this call sees the flag, or the exiting thread
        // waits for it to have the GIL.
        RETURNING.fetch_add(1, Ordering::SeqCst);
        if EXITING.load(Ordering::SeqCst)
            && FINALIZING
                .get()
                .is_some_and(|&t| t != std::thread::current().id())
        {
            RETURNING.fetch_sub(1, Ordering::SeqCst);
            loop {
                std::thread::park();
            }
        }
        r
    });
    RETURNING.fetch_sub(1, Ordering::SeqCst);
    r
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
    m.add_function(wrap_pyfunction!(_cli_main, m)?)?;
    m.add_class::<Producer>()?;
    m.add_class::<Loan>()?;
    m.add_class::<producer::Mapping>()?;
    m.add_class::<Server>()?;
    m.add_class::<Mps>()?;
    m.add_class::<Request>()?;
    m.add("TensorportError", m.py().get_type::<TensorportError>())?;
    m.add("PROTOCOL_VERSION", tensorport::protocol_version())?;
    Ok(())
}
