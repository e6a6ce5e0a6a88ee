//! CUDA's Multi-Process Service for a Python process and its `Loader`'s GPU producers
//! (`tensorport._native.Mps`): the farm's decision ([`tensorport_farm::mps`]) — join a running
//! daemon, else start a private one, else go without and say why — with the variables the
//! process and its children need to join it.

use std::collections::HashMap;

use crate::*;

/// MPS for this process and the farms it starts: `Mps("auto" | "on" | "off", [gpu, ...])`.
/// A private daemon is quit by `close()` (or when the object goes), once its clients end.
#[pyclass(module = "tensorport._native")]
pub(crate) struct Mps {
    inner: Option<tensorport_farm::mps::Mps>,
}

#[pymethods]
impl Mps {
    #[new]
    fn new(py: Python<'_>, mode: &str, gpus: Vec<u32>) -> PyResult<Mps> {
        use tensorport_farm::mps::MpsMode;
        let mode = match mode {
            "auto" => MpsMode::Auto,
            "on" => MpsMode::On,
            "off" => MpsMode::Off,
            other => {
                return Err(PyValueError::new_err(format!(
                    "mps={other:?}: give 'auto', 'on' or 'off'"
                )))
            }
        };
        let tools = tensorport_farm::mps::Tools::find();
        let m = py
            .allow_threads(|| tensorport_farm::mps::Mps::start(mode, &tools, &gpus))
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(Mps { inner: Some(m) })
    }

    /// The variables a CUDA process must have, before CUDA starts in it, to join the daemon
    /// (empty without MPS).
    #[getter]
    fn env(&self) -> HashMap<String, String> {
        self.inner
            .iter()
            .flat_map(|m| m.env())
            .map(|(k, v)| (k.to_string(), v.to_string_lossy().into_owned()))
            .collect()
    }

    /// One line saying how the processes share the GPU, and why not where they do not.
    fn describe(&self) -> String {
        self.inner
            .as_ref()
            .map_or_else(|| "MPS closed".to_string(), |m| m.describe())
    }

    /// Why MPS is not used where `auto` asked for it; `None` otherwise.
    #[getter]
    fn why_off(&self) -> Option<String> {
        self.inner
            .as_ref()
            .and_then(|m| m.why_off().map(str::to_string))
    }

    /// Quits a private daemon and waits for it (up to seconds: for a process that is not one
    /// of its clients); nothing for a daemon that was already running.
    fn close(&mut self, py: Python<'_>) {
        if let Some(m) = self.inner.take() {
            py.allow_threads(move || drop(m));
        }
    }

    /// Asks a private daemon to quit without waiting: it ends after its last client (this
    /// process, as it exits), and its folder is removed once it has.
    fn quit_at_exit(&mut self, py: Python<'_>) {
        if let Some(m) = self.inner.take() {
            py.allow_threads(move || m.quit_at_exit());
        }
    }
}
