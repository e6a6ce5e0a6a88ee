//! Runs the Python package's pytest suite (`python/tests`) against this build: the extension
//! this crate builds, and the `tensorport` binary as the Rust server and producers.
//!
//! It makes a virtual environment of its own under `target/` the first time (numpy and pytest
//! from PyPI; later runs reuse it), puts the package with the freshly built extension beside
//! it, and fails with pytest's own report if any test fails.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/debug` (or wherever this test binary's profile directory is).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_python_package_passes_its_pytest_suite() {
    let profile = profile_dir();
    let target = profile.parent().expect("target dir").to_path_buf();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // Built beside this test (deps/) when cargo builds it for the tests, or in the profile
    // folder by `cargo build`: the newer one.
    let ext = ["deps/libtensorport_native.so", "libtensorport_native.so"]
        .iter()
        .map(|p| profile.join(p))
        .filter(|p| p.is_file())
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .unwrap_or_else(|| profile.join("deps/libtensorport_native.so"));
    let bin = profile.join("tensorport");
    assert!(ext.is_file(), "{} was not built", ext.display());
    assert!(
        bin.is_file(),
        "{} is missing: run the whole suite (`cargo test --workspace`), which builds it",
        bin.display()
    );
    // The virtual environment, made once.
    let venv = target.join("pyenv");
    let python = venv.join("bin/python");
    let ready = venv.join(".tensorport-ready");
    if !ready.is_file() {
        let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        run(
            Command::new(&py).args(["-m", "venv"]).arg(&venv),
            "making the virtual environment (needs python3 with venv)",
        );
        run(
            Command::new(&python).args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--retries",
                "5",
                "numpy",
                "pytest",
            ]),
            "installing numpy and pytest from PyPI",
        );
        std::fs::write(&ready, b"numpy pytest\n").expect("mark the environment ready");
    }
    // The package: its Python files and the extension just built.
    let pkg = target.join("python-package");
    let dir = pkg.join("tensorport");
    let _ = std::fs::remove_dir_all(&pkg);
    std::fs::create_dir_all(&dir).expect("package dir");
    for entry in std::fs::read_dir(repo.join("python/tensorport")).expect("python/tensorport") {
        let p = entry.expect("entry").path();
        if p.extension().is_some_and(|e| e == "py") {
            std::fs::copy(&p, dir.join(p.file_name().unwrap())).expect("copy a .py");
        }
    }
    std::fs::copy(&ext, dir.join("_native.abi3.so")).expect("copy the extension");
    let out = Command::new(&python)
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
        .arg(repo.join("python/tests"))
        .current_dir(&pkg)
        .env("PYTHONPATH", &pkg)
        .env("TENSORPORT_BIN", &bin)
        .output()
        .expect("run pytest");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{report}");
    assert!(out.status.success(), "pytest failed:\n{report}");
}
