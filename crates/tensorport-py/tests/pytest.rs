//! Runs the Python package's pytest suite (`python/tests`) the way a Python user meets the
//! package: as a wheel (maturin, abi3) that carries the `tensorport` executable this build made,
//! installed into a virtual environment with no cargo on its `PATH`, with no `TENSORPORT_BIN` and
//! no `PYTHONPATH`.
//!
//! The first run makes two virtual environments under `target/` (one to build with: maturin; one
//! to install into: numpy, pytest and mypy; all from PyPI); later runs reuse them. The wheel's
//! extension is built in a target folder of its own (`target/wheel-build`): cargo holds this
//! build's folder for as long as the tests run.

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

/// A virtual environment at `dir` with `packages` from PyPI, made once (a marker file names
/// what it holds). Returns its python.
fn venv(dir: &Path, packages: &[&str]) -> PathBuf {
    let python = dir.join("bin/python");
    let ready = dir.join(".tensorport-ready");
    let want = packages.join(" ");
    if std::fs::read_to_string(&ready).ok().as_deref() != Some(want.as_str()) {
        if !python.is_file() {
            let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
            run(
                Command::new(&py).args(["-m", "venv"]).arg(dir),
                "making a virtual environment (needs python3 with venv)",
            );
        }
        run(
            Command::new(&python)
                .args(["-m", "pip", "install", "--quiet"])
                .args(["--disable-pip-version-check", "--retries", "5"])
                .args(packages),
            &format!("installing {want} from PyPI"),
        );
        std::fs::write(&ready, &want).expect("mark the environment ready");
    }
    python
}

/// `PATH` without the folders that hold a `cargo`, with `first` in front.
fn path_without_cargo(first: &Path) -> String {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let kept = std::env::split_paths(&path).filter(|d| !d.join("cargo").exists());
    std::env::join_paths(std::iter::once(first.to_path_buf()).chain(kept))
        .expect("a PATH")
        .to_string_lossy()
        .into_owned()
}

/// Stages the wheel's sources under `stage`: pyproject.toml (its manifest pointing back into the
/// repository), the package's files (Python, stubs, `py.typed`), and `bin` as
/// `tensorport/bin/tensorport`.
fn stage_sources(repo: &Path, stage: &Path, bin: &Path) {
    let _ = std::fs::remove_dir_all(stage);
    let pkg = stage.join("python/tensorport");
    std::fs::create_dir_all(pkg.join("bin")).expect("stage dir");
    let manifest = repo
        .join("crates/tensorport-py/Cargo.toml")
        .canonicalize()
        .expect("the extension's manifest");
    let pyproject = std::fs::read_to_string(repo.join("pyproject.toml")).expect("pyproject.toml");
    let pyproject = pyproject.replace(
        "manifest-path = \"crates/tensorport-py/Cargo.toml\"",
        &format!("manifest-path = {:?}", manifest.display().to_string()),
    );
    assert!(
        pyproject.contains(&*manifest.to_string_lossy()),
        "pyproject.toml's manifest-path moved"
    );
    std::fs::write(stage.join("pyproject.toml"), pyproject).expect("stage pyproject.toml");
    for entry in std::fs::read_dir(repo.join("python/tensorport")).expect("python/tensorport") {
        let p = entry.expect("entry").path();
        // The Python files, the extension's stubs and the marker that the package is typed.
        let kept = p.extension().is_some_and(|e| e == "py" || e == "pyi")
            || p.file_name().is_some_and(|n| n == "py.typed");
        if kept {
            std::fs::copy(&p, pkg.join(p.file_name().unwrap())).expect("copy a package file");
        }
    }
    let staged = pkg.join("bin/tensorport");
    std::fs::copy(bin, &staged).expect("copy the executable");
    // Debug builds carry hundreds of megabytes of symbols; the wheel does not need them.
    let _ = Command::new("strip").arg(&staged).output();
}

#[test]
fn the_python_package_passes_its_pytest_suite_as_an_installed_wheel() {
    let profile = profile_dir();
    let target = profile.parent().expect("target dir").to_path_buf();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let bin = profile.join("tensorport");
    assert!(
        bin.is_file(),
        "{} is missing: run the whole suite (`cargo test --workspace`), which builds it",
        bin.display()
    );
    let builder = venv(&target.join("pyenv-build"), &["maturin>=1.5,<2"]);
    let user = venv(&target.join("pyenv-user"), &["numpy", "pytest", "mypy"]);

    // The wheel, built from staged sources.
    let stage = target.join("wheel-src");
    stage_sources(&repo, &stage, &bin);
    let wheels = target.join("wheel-out");
    let _ = std::fs::remove_dir_all(&wheels);
    let maturin = builder.parent().expect("venv bin").join("maturin");
    let cargo_profile = if profile.ends_with("release") {
        "release"
    } else {
        "dev"
    };
    run(
        Command::new(&maturin)
            .args(["build", "--quiet", "--profile", cargo_profile, "-o"])
            .arg(&wheels)
            .current_dir(&stage)
            .env("CARGO_TARGET_DIR", target.join("wheel-build")),
        "building the wheel with maturin",
    );
    let wheel = std::fs::read_dir(&wheels)
        .expect("wheel dir")
        .map(|e| e.expect("entry").path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .expect("maturin made no wheel");

    // Installed where no cargo is, as a user would.
    let path = path_without_cargo(user.parent().expect("venv bin"));
    run(
        Command::new(&user)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(["--force-reinstall", "--no-deps"])
            .arg(&wheel),
        "installing the wheel",
    );
    let clean = |c: &mut Command| {
        c.env("PATH", &path)
            .env_remove("TENSORPORT_BIN")
            .env_remove("PYTHONPATH")
            .current_dir(&target);
    };
    let mut check = Command::new(&user);
    check.args([
        "-c",
        "import shutil, sys; sys.exit(shutil.which('cargo') is not None)",
    ]);
    clean(&mut check);
    run(&mut check, "checking that cargo is not on the PATH");
    let mut pytest = Command::new(&user);
    pytest
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
        .arg(
            repo.join("python/tests")
                .canonicalize()
                .expect("python/tests"),
        );
    clean(&mut pytest);
    let out = pytest.output().expect("run pytest");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{report}");
    assert!(out.status.success(), "pytest failed:\n{report}");
}
