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

/// The oldest ONNX Runtime this runs models with: the oldest that passes the ONNX tests
/// (older ones abort the process on the sessions this opens).
pub const MIN_VERSION: &str = "1.23.2";

/// `a.b.c` as numbers, for comparing (a part that is not a number counts as 0).
fn parts(v: &str) -> [u64; 3] {
    let mut out = [0; 3];
    for (o, p) in out.iter_mut().zip(v.trim().split('.')) {
        *o = p
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap_or(0);
    }
    out
}

/// Whether version `v` is [`MIN_VERSION`] or newer.
pub fn new_enough(v: &str) -> bool {
    parts(v) >= parts(MIN_VERSION)
}

/// The version the library at `path` says it is, read before ONNX Runtime is set up (a library
/// too old for the sessions this opens is refused before it can abort the process).
fn library_version(path: &std::path::Path) -> std::result::Result<String, String> {
    let shown = path.display();
    // SAFETY: loading a shared library runs its initialisers; the file is the ONNX Runtime the
    // user chose (or the one beside the executable), which the binding loads next all the same.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| format!("{shown}: {e}"))?;
    type GetBase = unsafe extern "C" fn() -> *const ort::sys::OrtApiBase;
    // SAFETY: `OrtGetApiBase` takes nothing and returns a pointer to a static table (ONNX
    // Runtime's C API, stable across versions), or null.
    let version = unsafe {
        let get: libloading::Symbol<GetBase> = lib
            .get(b"OrtGetApiBase\0")
            .map_err(|_| format!("{shown} is no ONNX Runtime (no OrtGetApiBase)"))?;
        let base = get();
        if base.is_null() {
            return Err(format!("{shown}: OrtGetApiBase gave nothing"));
        }
        let s = ((*base).GetVersionString)();
        if s.is_null() {
            return Err(format!("{shown}: no version string"));
        }
        std::ffi::CStr::from_ptr(s).to_string_lossy().into_owned()
    };
    // The binding loads the same library next: it stays loaded for the process.
    std::mem::forget(lib);
    Ok(version)
}

static ENV: OnceLock<std::result::Result<ort::environment::Environment, Failure>> = OnceLock::new();

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

/// Where TensorRT's engines and timing caches are kept: `$XDG_CACHE_HOME/tensorport/tensorrt`
/// (else `~/.cache/tensorport/tensorrt`), a folder of this user's alone (0700: an engine is
/// code TensorRT loads, so no one else may put one there). `None`, with a warning, where it
/// cannot be had: engines are then built anew by every run.
pub fn tensorrt_cache() -> Option<&'static std::path::Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = std::env::var_os("XDG_CACHE_HOME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        let dir = base.join("tensorport").join("tensorrt");
        match private_dir(&dir) {
            Ok(()) => Some(dir),
            Err(why) => {
                tracing::warn!(
                    "TensorRT's engines are not cached ({}: {why}); each run builds them anew",
                    dir.display()
                );
                None
            }
        }
    })
    .as_deref()
}

/// Makes `dir` (and its parents) if need be, and checks that it is a folder of this user's
/// that no one else may write to.
fn private_dir(dir: &std::path::Path) -> std::result::Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| e.to_string())?;
    let meta = std::fs::symlink_metadata(dir).map_err(|e| e.to_string())?;
    if !meta.is_dir() {
        return Err("not a folder".into());
    }
    if meta.uid() != nix::unistd::geteuid().as_raw() {
        return Err(format!("owned by uid {}, not this user", meta.uid()));
    }
    if meta.permissions().mode() & 0o022 != 0 {
        return Err(format!(
            "others may write to it (mode {:o})",
            meta.permissions().mode() & 0o777
        ));
    }
    Ok(())
}

/// Why the library could not be set up (kept for the process: each caller gets the same).
#[derive(Debug, Clone)]
enum Failure {
    Missing(String),
    Old { path: PathBuf, version: String },
}

/// The process's ONNX Runtime environment, loading the library the first time.
pub fn environment() -> Result<ort::environment::Environment> {
    ENV.get_or_init(|| {
        let path = library().map_err(|e| match e {
            Error::NoRuntime { why } => Failure::Missing(why),
            e => Failure::Missing(e.to_string()),
        })?;
        let version = library_version(&path).map_err(Failure::Missing)?;
        if !new_enough(&version) {
            return Err(Failure::Old { path, version });
        }
        let builder = ort::init_from(&path)
            .map_err(|e| Failure::Missing(format!("{}: {e}", path.display())))?;
        let env = builder
            .with_name("tensorport")
            .build()
            .map_err(|e| Failure::Missing(format!("{}: {e}", path.display())))?;
        // What goes wrong in a run comes back as its error. ONNX Runtime's own lines — on a GPU
        // an "error" for each cuDNN plan tried and passed over, at every new batch shape — are
        // left out, for the sessions (`OnnxModel::open`) and the execution providers alike.
        env.set_log_level(ort::logging::LogLevel::Fatal);
        Ok(env)
    })
    .clone()
    .map_err(|f| match f {
        Failure::Missing(why) => Error::NoRuntime { why },
        Failure::Old { path, version } => Error::OldRuntime { path, version },
    })
}

/// ONNX Runtime's version, loading it if need be.
pub fn version() -> Result<String> {
    environment()?;
    Ok(ort::info().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_folder_must_be_this_users_alone() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("a/b/tensorrt");
        private_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(private_dir(&dir).unwrap_err().contains("others may write"));
        let file = d.path().join("f");
        std::fs::write(&file, b"").unwrap();
        assert!(private_dir(&file).is_err());
    }

    #[test]
    fn versions_compare_as_numbers() {
        assert!(new_enough(MIN_VERSION));
        for v in ["1.31.1", "1.24.1", "2.0.0", "1.23.10", "1.100.0-dev"] {
            assert!(new_enough(v), "{v}");
        }
        for v in ["1.22.0", "1.23.1", "1.9.9", "0.99.0", "", "garbage"] {
            assert!(!new_enough(v), "{v}");
        }
    }
}
