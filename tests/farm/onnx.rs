//! ONNX models in the farm: small models written by `tests/onnx/make_models.py` (the `onnx`
//! package) run by the server through ONNX Runtime, their scores checked against onnxruntime's
//! Python API on the same prepared tensors (`prep --dump`), under a producer kill too; every
//! model the server cannot run refused in one line before anything starts; and without the
//! library, one line that says how to get it.
//!
//! The first run makes a virtual environment under `target/` with numpy, onnx and onnxruntime
//! from PyPI; the server loads that onnxruntime's own library (`TENSORPORT_ORT`), so both
//! sides run the same version. Without PyPI these tests say so and skip.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{children, count_lines, output_within, run, tmp, EXE};

/// The packages, pinned: the library the server loads is this onnxruntime's.
const PACKAGES: &[&str] = &["numpy", "onnx==1.23.2", "onnxruntime==1.31.1"];

const SIZE: &str = "32";

/// The test environment's python and ONNX Runtime library, made once per test process (and
/// kept under `target/` across runs); `None`, said on stderr, where it cannot be made.
fn onnx_env() -> Option<&'static (PathBuf, PathBuf)> {
    static ENV: OnceLock<Option<(PathBuf, PathBuf)>> = OnceLock::new();
    ENV.get_or_init(|| {
        let target = Path::new(EXE).parent()?.parent()?.to_path_buf();
        let dir = target.join("pyenv-onnx");
        let python = dir.join("bin/python");
        let ready = dir.join(".tensorport-ready");
        let want = PACKAGES.join(" ");
        if std::fs::read_to_string(&ready).ok().as_deref() != Some(want.as_str()) {
            let made = python.is_file()
                || Command::new("python3")
                    .args(["-m", "venv"])
                    .arg(&dir)
                    .status()
                    .is_ok_and(|s| s.success());
            let installed = made
                && Command::new(&python)
                    .args([
                        "-m",
                        "pip",
                        "install",
                        "--quiet",
                        "--disable-pip-version-check",
                    ])
                    .args(["--retries", "2"])
                    .args(PACKAGES)
                    .status()
                    .is_ok_and(|s| s.success());
            if !installed {
                eprintln!(
                    "skipped: no environment with {want} (python3 with venv and PyPI are needed)"
                );
                return None;
            }
            std::fs::write(&ready, &want).ok()?;
        }
        let out = Command::new(&python)
            .args([
                "-c",
                "import glob, os, onnxruntime; \
                 print(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), \
                 'capi', 'libonnxruntime.so*'))[0])",
            ])
            .output()
            .ok()?;
        let lib = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if !lib.is_file() {
            eprintln!(
                "skipped: onnxruntime's library was not found in {}",
                dir.display()
            );
            return None;
        }
        Some((python, lib))
    })
    .as_ref()
}

/// `tensorport` with the test environment's ONNX Runtime.
fn tp(lib: &Path) -> Command {
    let mut c = Command::new(EXE);
    c.env("TENSORPORT_ORT", lib).stdin(Stdio::null());
    c
}

/// A temporary folder with the models (`models/`) and 12 sample images (`images/`).
fn models_and_images(python: &Path) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tmp();
    let models = dir.path().join("models");
    make_models(python, &models);
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "12"]);
    assert!(ok, "{err}");
    (dir, models, images)
}

/// The models, written into `dir`.
fn make_models(python: &Path, dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/onnx/make_models.py");
    let o = Command::new(python)
        .arg(script)
        .arg(dir)
        .arg(SIZE)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// onnxruntime Python's scores of `model` for each file of `images`, from `prep --dump`'s
/// tensors, by file name.
fn reference(python: &Path, lib: &Path, model: &Path, images: &Path) -> HashMap<String, Vec<f32>> {
    let dump = images.with_extension("safetensors");
    let o = tp(lib)
        .args(["prep", "--input"])
        .arg(images)
        .args(["--image-size", SIZE, "--repeat", "1", "--dump"])
        .arg(&dump)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/onnx/reference.py");
    let o = Command::new(python)
        .arg(script)
        .arg(model)
        .arg(&dump)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Every input of `out` once (indices `0..n`), each with scores within `tol` of the reference
/// for its file.
fn check_against(out: &Path, n: usize, want: &HashMap<String, Vec<f32>>, tol: f32) {
    let text = std::fs::read_to_string(out).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), n, "one line per input");
    let mut seen = vec![false; n];
    for l in &lines {
        let i = l["index"].as_u64().unwrap() as usize;
        assert!(!std::mem::replace(&mut seen[i], true), "index {i} twice");
        assert!(l.get("error").is_none(), "{l}");
        let input = l["input"].as_str().unwrap();
        let name = Path::new(input).file_name().unwrap().to_string_lossy();
        let got: Vec<f32> = serde_json::from_value(l["scores"].clone()).unwrap();
        let expect = &want[name.as_ref()];
        assert_eq!(got.len(), expect.len(), "{input}");
        let worst = got
            .iter()
            .zip(expect)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst <= tol, "{input}: off by {worst} (more than {tol})");
        let class = l["class"].as_u64().unwrap() as usize;
        assert_eq!(got[class], got.iter().copied().fold(f32::MIN, f32::max));
    }
}

/// Each model the server takes, in a farm of two producers over real images: every score
/// within 1e-5 of onnxruntime Python's (f32; the f16 model's within its own precision).
#[test]
fn onnx_models_score_as_onnxruntime_python_does() {
    let Some((python, lib)) = onnx_env() else {
        return;
    };
    let (dir, models, images) = models_and_images(python);
    for (name, tol) in [
        ("classifier", 1e-5),
        ("classifier_f16", 1e-2),
        ("two_outputs", 1e-5),
        ("any_size", 1e-5),
        // Its weights in external.bin beside it: read by the server, put into the model.
        ("external", 1e-5),
    ] {
        let model = models.join(format!("{name}.onnx"));
        let want = reference(python, lib, &model, &images);
        let out = dir.path().join(format!("{name}.jsonl"));
        let o = tp(lib)
            .args(["farm", "--input", images.to_str().unwrap(), "--model"])
            .arg(&model)
            // The image size is the model's; `any_size` leaves it open and takes this one.
            .args([
                "--image-size",
                SIZE,
                "-p",
                "2",
                "--progress",
                "never",
                "--output",
            ])
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        check_against(&out, 12, &want, tol);
    }
    // model-bench times the model alone: a row per batch size.
    let o = tp(lib)
        .args(["model-bench", "--model"])
        .arg(models.join("classifier.onnx"))
        .args(["--batch", "1,4", "--seconds", "0.05"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.contains("| onnxruntime cpu | f32 |"))
        .collect();
    assert_eq!(rows.len(), 2, "{table}");
    assert!(
        rows[0].starts_with("| 1 |") && rows[1].starts_with("| 4 |"),
        "{table}"
    );
}

/// The files of `images`, sorted, listed `times` over in a file in `dir` (for `--input-list`).
fn list_of(images: &Path, times: usize, dir: &Path) -> PathBuf {
    let mut files: Vec<PathBuf> = std::fs::read_dir(images)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let list: String = (0..times)
        .flat_map(|_| files.iter())
        .map(|f| format!("{}\n", f.display()))
        .collect();
    let list_file = dir.join("list");
    std::fs::write(&list_file, list).unwrap();
    list_file
}

/// A farm of `model` over the inputs of `list_file`, with `producers` CPU producers keeping
/// `in_flight` requests each, its lines to `out`; its output and errors piped.
fn farm_of_list(
    lib: &Path,
    model: &Path,
    list_file: &Path,
    (producers, in_flight): (u32, u32),
    out: &Path,
) -> std::process::Child {
    tp(lib)
        .args(["farm", "--input-list"])
        .arg(list_file)
        .arg("--model")
        .arg(model)
        .args(["-p", &producers.to_string()])
        .args(["--in-flight", &in_flight.to_string()])
        .args(["--progress", "never", "--output"])
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The ONNX classifier in a farm of three producers over 12 images listed 40 times, one
/// producer SIGKILLed mid-run: every input still has exactly one line, with the reference's
/// scores.
#[test]
fn an_onnx_farm_survives_a_sigkilled_producer_every_input_once() {
    let Some((python, lib)) = onnx_env() else {
        return;
    };
    let (dir, models, images) = models_and_images(python);
    let model = models.join("classifier.onnx");
    let want = reference(python, lib, &model, &images);
    let list_file = list_of(&images, 40, dir.path());
    let out = dir.path().join("r.jsonl");
    let mut farm = farm_of_list(lib, &model, &list_file, (3, 4), &out);
    let t = Instant::now();
    let victim = loop {
        let kids = children(farm.id(), "\0produce\0");
        if kids.len() == 3 && count_lines(&out) >= 40 {
            break kids[1];
        }
        if t.elapsed() > Duration::from_secs(300) {
            let _ = farm.kill();
            panic!("the farm wrote no 40 results with its three producers up in 5 minutes");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let o = farm.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check_against(&out, 480, &want, 1e-5);
}

/// Every model the server cannot run is refused by `serve` and by `farm` in one line that
/// names the file and the problem, before anything starts (no producer, no socket).
#[test]
fn unfit_models_are_refused_in_one_line_before_anything_starts() {
    let Some((python, lib)) = onnx_env() else {
        return;
    };
    let dir = tmp();
    let models = dir.path().join("models");
    make_models(python, &models);
    let whole = std::fs::read(models.join("classifier.onnx")).unwrap();
    std::fs::write(models.join("truncated.onnx"), &whole[..whole.len() / 3]).unwrap();
    std::fs::write(models.join("corrupt.onnx"), b"\x08\x07not a model at all").unwrap();
    // Over the size limit, sparse: refused before a byte is read.
    let huge = std::fs::File::create(models.join("huge.onnx")).unwrap();
    huge.set_len(tensorport_onnx::MAX_MODEL_BYTES + 1).unwrap();
    drop(huge);
    let sock_dir = tempfile::Builder::new()
        .prefix("tp-onnx-")
        .tempdir()
        .unwrap();
    let sock = sock_dir.path().join("s.sock");
    for (name, hint) in [
        ("fixed_batch", "dynamic batch axis"),
        ("two_inputs", "2 inputs"),
        ("int_input", "i64"),
        ("rank3", "3 axes"),
        ("bad_output", "needs [N, K]"),
        (
            "huge_side",
            "16384×16384; the server takes sides up to 8192",
        ),
        ("truncated", "cannot load it"),
        ("corrupt", "cannot load it"),
        ("huge", "over the limit"),
        ("missing", "No such file"),
        // External data outside the model's folder: refused by the server itself, naming the
        // tensor, whatever ONNX Runtime's version would do.
        ("escape_absolute", "\"w1\": its data file"),
        ("escape_parent", "is not a path inside the model's folder"),
        ("escape_link", "leads outside the model's folder"),
    ] {
        let model = models.join(format!("{name}.onnx"));
        let m = model.to_str().unwrap();
        let serve = one_line_error(tp(lib).args(["serve", "--model", m, "--socket"]).arg(&sock));
        assert!(serve.contains(hint) && serve.contains(name), "{serve}");
        assert!(!sock.exists(), "{name}: the server listened");
        let farm = one_line_error(
            tp(lib)
                .args([
                    "farm",
                    "--synthetic",
                    "4",
                    "--model",
                    m,
                    "--progress",
                    "never",
                ])
                .arg("--output")
                .arg(dir.path().join("never.jsonl")),
        );
        assert!(farm.contains(hint) && farm.contains(name), "{farm}");
    }
}

/// Runs `cmd`, which must fail with one line on stderr starting `error: `; returns the line.
fn one_line_error(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{cmd:?} succeeded");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{cmd:?}: expected one line, got:\n{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    lines[0].to_string()
}

/// Without ONNX Runtime, asking for an ONNX model is one line that says how to get it; the
/// bundled model works as before.
#[test]
fn without_onnx_runtime_the_error_says_how_to_get_it() {
    let dir = tmp();
    let model = dir.path().join("m.onnx");
    std::fs::write(&model, b"not read: the library is looked for first").unwrap();
    let missing = dir.path().join("no/libonnxruntime.so");
    let m = model.to_str().unwrap();
    let farm = [
        "farm",
        "--model",
        m,
        "--synthetic",
        "4",
        "--progress",
        "never",
    ];
    for args in [&farm[..], &["serve", "--model", m]] {
        let line = one_line_error(
            tp(&missing)
                .args(args)
                .arg("--socket")
                .arg(dir.path().join("s.sock")),
        );
        assert!(
            line.contains("ONNX Runtime") && line.contains("scripts/fetch-onnxruntime.sh"),
            "{line}"
        );
    }
    let o = Command::new(EXE)
        .env("TENSORPORT_ORT", dir.path().join("no/libonnxruntime.so"))
        .args(["farm", "--synthetic", "4", "--image-size", SIZE, "-p", "1"])
        .args(["--progress", "never", "--output"])
        .arg(dir.path().join("r.jsonl"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(count_lines(&dir.path().join("r.jsonl")), 4);
}

/// A farm of `model` over `images`, to its end (a two-minute watchdog), with `extra` flags.
fn farm_over(lib: &Path, model: &Path, images: &Path, out: &Path, extra: &[&str]) -> Output {
    output_within(
        tp(lib)
            .args(["farm", "--input"])
            .arg(images)
            .arg("--model")
            .arg(model)
            .args(["-p", "2", "--stall-secs", "30", "--progress", "never"])
            .args(extra)
            .arg("--output")
            .arg(out),
        Duration::from_secs(120),
    )
}

/// A model whose every image's scores hold NaN, an infinity and a negative infinity: each
/// input gets its line at once, the non-finite scores written as "NaN", "Infinity" and
/// "-Infinity" among the numbers (no producer killed as stalled, no input redone); with
/// `--non-finite error`, an error line naming the first such score instead.
#[test]
fn non_finite_scores_are_written_as_data_not_taken_for_torn_lines() {
    let Some((python, lib)) = onnx_env() else {
        return;
    };
    let (dir, models, images) = models_and_images(python);
    let model = models.join("nonfinite.onnx");
    let want = reference(python, lib, &models.join("classifier.onnx"), &images);
    let out = dir.path().join("r.jsonl");
    let o = farm_over(lib, &model, &images, &out, &[]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        !stderr.contains("restarting"),
        "a producer was restarted:\n{stderr}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 12, "one line per input");
    for l in &lines {
        let s = l["scores"].as_array().unwrap_or_else(|| panic!("{l}"));
        assert_eq!(s[0], "NaN", "{l}");
        // The classifier's score times +inf and -inf: an infinity of either sign.
        for x in &s[1..3] {
            assert!(x == "Infinity" || x == "-Infinity", "{l}");
        }
        // The rest are the classifier's own.
        let name = Path::new(l["input"].as_str().unwrap()).file_name().unwrap();
        let expect = &want[name.to_string_lossy().as_ref()];
        for (got, exp) in s[3..].iter().zip(&expect[3..]) {
            assert!((got.as_f64().unwrap() as f32 - exp).abs() <= 1e-5, "{l}");
        }
        let class = l["class"].as_u64().unwrap() as usize;
        assert!(s[class] == "Infinity", "{l}");
    }
    let o = farm_over(lib, &model, &images, &out, &["--non-finite", "error"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(text.lines().count(), 12);
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        let e = v["error"].as_str().unwrap_or_else(|| panic!("{l}"));
        assert!(e.contains("not a finite number (NaN for class 0)"), "{e}");
        assert!(v.get("scores").is_none(), "{l}");
    }
}

/// The external-data model's weights file truncated while a farm serves it (as a deploy tool
/// rewriting it in place does): the server runs on the weights it read at start, every input
/// gets its line with the reference's scores, and the change is named in the farm's log.
#[test]
fn a_weights_file_truncated_under_a_running_farm_costs_nothing() {
    let Some((python, lib)) = onnx_env() else {
        return;
    };
    let (dir, models, images) = models_and_images(python);
    let model = models.join("external.onnx");
    let data = models.join("external.bin");
    let want = reference(python, lib, &model, &images);
    let list_file = list_of(&images, 60, dir.path());
    let out = dir.path().join("r.jsonl");
    let mut farm = farm_of_list(lib, &model, &list_file, (2, 2), &out);
    let t = Instant::now();
    while count_lines(&out) < 24 {
        if t.elapsed() > Duration::from_secs(120) {
            let _ = farm.kill();
            panic!("the farm wrote no 24 results in 2 minutes");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(0)
        .unwrap();
    let pid = farm.id() as i32;
    let watchdog = std::thread::spawn(move || {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(180) {
            if std::fs::metadata(format!("/proc/{pid}")).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    });
    let o = farm.wait_with_output().unwrap();
    let _ = watchdog.join();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        !stderr.contains("server-0 ended"),
        "the server died:\n{stderr}"
    );
    check_against(&out, 720, &want, 1e-5);
    assert!(
        stderr.contains("changed under the running server")
            && stderr.contains("external.bin: 0 bytes"),
        "the change was not named:\n{stderr}"
    );
}

/// An ONNX Runtime older than the oldest the server runs with is refused in one line, naming
/// its version and how to get a newer one, before it is set up (1.22 aborts the process on the
/// sessions the server opens). The library comes from PyPI's wheel; without PyPI the test says
/// so and skips.
#[test]
fn an_onnx_runtime_too_old_is_refused_in_one_line() {
    let Some((python, _)) = onnx_env() else {
        return;
    };
    let target = Path::new(EXE).parent().unwrap().parent().unwrap();
    let dir = target.join("onnxruntime-1.22.0");
    let lib = dir.join("libonnxruntime.so.1.22.0");
    if !lib.is_file() {
        let fetched = Command::new(python)
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
            ])
            .args(["--disable-pip-version-check", "--retries", "2", "-d"])
            .arg(&dir)
            .arg("onnxruntime==1.22.0")
            .status()
            .is_ok_and(|s| s.success());
        let unpacked = fetched
            && Command::new(python)
                .arg("-c")
                .arg(
                    "import glob, sys, zipfile\n\
                     w = zipfile.ZipFile(glob.glob(sys.argv[1] + '/onnxruntime-1.22.0-*.whl')[0])\n\
                     open(sys.argv[2], 'wb').write(w.read('onnxruntime/capi/libonnxruntime.so.1.22.0'))",
                )
                .arg(&dir)
                .arg(&lib)
                .status()
                .is_ok_and(|s| s.success());
        if !unpacked {
            eprintln!("skipped: onnxruntime 1.22.0's wheel could not be fetched from PyPI");
            return;
        }
    }
    let d = tmp();
    let models = d.path().join("models");
    make_models(python, &models);
    let m = models.join("classifier.onnx");
    let m = m.to_str().unwrap();
    for args in [
        &[
            "farm",
            "--synthetic",
            "4",
            "--model",
            m,
            "--progress",
            "never",
        ][..],
        &["serve", "--model", m],
    ] {
        let line = one_line_error(
            tp(&lib)
                .args(args)
                .arg("--socket")
                .arg(d.path().join("s.sock")),
        );
        assert!(
            line.contains("ONNX Runtime 1.22.0 is older than 1.23.2")
                && line.contains("scripts/fetch-onnxruntime.sh"),
            "{line}"
        );
    }
}
