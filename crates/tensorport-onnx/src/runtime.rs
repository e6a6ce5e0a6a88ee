//! Finding and loading ONNX Runtime, once per process:
//! - the file `TENSORPORT_ORT` (or else `ORT_DYLIB_PATH`) names, where one is set;
//! - otherwise `onnxruntime/lib/libonnxruntime.so` beside the folder of the running executable
//!   (what `scripts/fetch-onnxruntime.sh` makes in `target/`, next to `target/release`), or
//!   one or two folders further up (a test binary in `target/*/deps`).

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::{Error, Result};

/// The environment variable naming the library to load.
pub const ORT_ENV: &str = "TENSORPORT_ORT";

static ENV: OnceLock<std::result::Result<ort::environment::Environment, String>> = OnceLock::new();

/// The places looked at, in order: the path an environment variable names (only that one,
/// where one is set), else the copies beside the executable.
pub fn candidates() -> Vec<PathBuf> {
    if let Some(named) = [ORT_ENV, "ORT_DYLIB_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .find(|p| !p.is_empty())
    {
        return vec![named.into()];
    }
    std::env::current_exe()
        .map(|exe| {
            exe.ancestors()
                .skip(1)
                .take(3)
                .map(|up| up.join("onnxruntime/lib/libonnxruntime.so"))
                .collect()
        })
        .unwrap_or_default()
}

/// The library's path: the first candidate that exists.
pub fn library() -> Result<PathBuf> {
    let all = candidates();
    all.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        let looked: Vec<String> = all.iter().map(|p| p.display().to_string()).collect();
        Error::NoRuntime {
            why: format!("no file at {}", looked.join(", ")),
        }
    })
}

/// The process's ONNX Runtime environment, loading the library the first time.
pub fn environment() -> Result<ort::environment::Environment> {
    ENV.get_or_init(|| {
        let path = library().map_err(|e| match e {
            Error::NoRuntime { why } => why,
            e => e.to_string(),
        })?;
        let builder = ort::init_from(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let env = builder
            .with_name("tensorport")
            .build()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        // What goes wrong in a run comes back as its error. ONNX Runtime's own lines — on a GPU
        // an "error" for each cuDNN plan tried and passed over, at every new batch shape — are
        // left out, for the sessions (`OnnxModel::open`) and the execution providers alike.
        env.set_log_level(ort::logging::LogLevel::Fatal);
        Ok(env)
    })
    .clone()
    .map_err(|why| Error::NoRuntime { why })
}

/// ONNX Runtime's version, loading it if need be.
pub fn version() -> Result<String> {
    environment()?;
    Ok(ort::info().to_string())
}
