//! End-to-end: the real `tensorport` binary running a farm, checked against the same model run
//! in-process, with and without a producer killed by SIGKILL mid-run.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport_dfdx::dfdx::prelude::Cpu;
use tensorport_dfdx::{ImageClassifier, ModelConfig};
use tensorport_vision::{JpegDecoder, Preprocessor, Source, Transform};

mod cli;
mod faults;
mod inputs;
mod onnx;
mod ops;
mod results;

const EXE: &str = env!("CARGO_BIN_EXE_tensorport");
/// The developer tools' executable, beside it.
const DEV_EXE: &str = env!("CARGO_BIN_EXE_tensorport-dev");

const SIZE: usize = 32;

fn config() -> ModelConfig {
    ModelConfig {
        image_size: SIZE,
        classes: 10,
        width: 16,
    }
}

#[derive(serde::Deserialize)]
struct Line {
    index: u64,
    input: String,
    scores: Option<Vec<f32>>,
    error: Option<String>,
}

fn read_results(path: &Path) -> Vec<Line> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

/// Every index 0..n exactly once, and every score bitwise equal to the model run in-process on
/// the same preprocessed tensor.
fn check_results(path: &Path, n: u64) {
    check_results_decoded_with(path, n, JpegDecoder::default());
}

/// [`check_results`], the in-process preprocessing decoding JPEG with `decoder`.
fn check_results_decoded_with(path: &Path, n: u64, decoder: JpegDecoder) {
    let lines = read_results(path);
    assert_eq!(lines.len() as u64, n, "one line per input");
    let mut seen = HashMap::new();
    for l in &lines {
        assert!(
            seen.insert(l.index, ()).is_none(),
            "index {} twice",
            l.index
        );
    }
    assert!(
        (0..n).all(|i| seen.contains_key(&i)),
        "an input has no line"
    );
    let dev = Cpu::default();
    let model = ImageClassifier::from_seed(&dev, config(), 0).unwrap();
    let mut px = vec![0f32; 3 * SIZE * SIZE];
    let mut prep = Preprocessor::new(Transform::standard(SIZE as u32));
    prep.set_jpeg_decoder(decoder).unwrap();
    for l in &lines {
        assert!(l.error.is_none(), "input {}: {:?}", l.index, l.error);
        let src: Source = l.input.parse().unwrap();
        prep.prepare(&src, &mut px).unwrap();
        let want = &model.forward_flat(px.clone(), 1)[0];
        let got = l.scores.as_ref().unwrap();
        let wb: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
        let gb: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
        assert_eq!(
            gb, wb,
            "input {} ({}) differs from the in-process model",
            l.index, l.input
        );
    }
}

fn farm_cmd(out: &Path, n: u64, producers: usize) -> Command {
    let mut c = Command::new(EXE);
    c.args([
        "farm",
        "--synthetic",
        &n.to_string(),
        "--image-size",
        &SIZE.to_string(),
    ])
    .args([
        "--producers",
        &producers.to_string(),
        "--in-flight",
        "4",
        "--progress",
        "never",
    ])
    .arg("--output")
    .arg(out)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c
}

fn tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("tp-farm-test-")
        .tempdir()
        .unwrap()
}

/// Pids of the processes whose parent is `ppid` and whose command line has `needle` as one of
/// its arguments (`serve`, `produce`: a child's subcommand), or contains it where it holds a NUL.
fn children(ppid: u32, needle: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Field 4 (after the command in parentheses) is the parent pid.
        let Some(rest) = stat.rsplit_once(')').map(|x| x.1) else {
            continue;
        };
        let parent: u32 = rest
            .split_whitespace()
            .nth(1)
            .and_then(|x| x.parse().ok())
            .unwrap_or(0);
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let matches = if needle.contains('\0') {
            String::from_utf8_lossy(&cmd).contains(needle)
        } else {
            cmd.split(|b| *b == 0).any(|arg| arg == needle.as_bytes())
        };
        if parent == ppid && matches {
            out.push(pid);
        }
    }
    out
}

fn count_lines(p: &Path) -> usize {
    std::fs::read_to_string(p)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

fn run(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(EXE)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A failure is one line on stderr, starting with `error:`, that contains `hint`.
fn assert_one_line_error(args: &[&str], hint: &str) {
    let (ok, _out, err) = run(args);
    assert!(!ok, "{args:?} succeeded");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one line, got:\n{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(lines[0].contains(hint), "{args:?}: {err} lacks {hint:?}");
}

/// Runs `cmd` to its end, killing it after `limit` (the test then fails on its status).
pub(crate) fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let finished = Arc::new(AtomicBool::new(false));
    let f = finished.clone();
    std::thread::spawn(move || {
        let start = Instant::now();
        while !f.load(Ordering::SeqCst) {
            if start.elapsed() > limit {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let o = child.wait_with_output().unwrap();
    finished.store(true, Ordering::SeqCst);
    o
}

/// Whether process `pid` is gone (or a zombie) within a minute.
fn eventually_gone(pid: i32) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(60) {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return true,
            Ok(s)
                if s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z')) =>
            {
                return true
            }
            Ok(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    false
}

/// Starts a server (`cmd` runs `serve`), waits for its `ready` line, and returns it with the
/// rest of its stdout.
fn serve_until_ready(
    cmd: &mut Command,
) -> (
    std::process::Child,
    std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
) {
    use std::io::BufRead;
    let mut server = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(server.stdout.take().unwrap()).lines();
    let ready = lines.next().unwrap().unwrap();
    assert!(ready.starts_with("ready"), "{ready}");
    (server, lines)
}

/// `ctl drain` on socket `s`, then the server must exit cleanly.
fn drain_and_wait(s: &str, server: &mut std::process::Child) {
    let (ok, _, err) = run(&["ctl", "drain", "--socket", s]);
    assert!(ok, "{err}");
    assert!(server.wait().unwrap().success());
}
