//! End-to-end: the real `tensorport` binary running a farm, checked against the same model run
//! in-process, with and without a producer killed by SIGKILL mid-run.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport_dfdx::dfdx::prelude::Cpu;
use tensorport_dfdx::{ImageClassifier, ModelConfig};
use tensorport_vision::{JpegDecoder, Preprocessor, Source, Transform};

const EXE: &str = env!("CARGO_BIN_EXE_tensorport");
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

#[test]
fn farm_results_match_the_in_process_model_bitwise() {
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let o = farm_cmd(&out, 300, 3).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "farm failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("done        300 (0 with errors)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("images/s") && stdout.contains("p99"),
        "{stdout}"
    );
    // Not a terminal: no progress drawing, no escape codes.
    assert!(
        !stderr.contains('\x1b') && !stderr.contains("tensorport farm"),
        "{stderr}"
    );
    check_results(&out, 300);
}

#[test]
fn two_model_workers_answer_as_the_in_process_model() {
    // serve --workers 2: two threads, each its own copy of the model, each its share of the
    // producers: every answer still equals the in-process model's, bit for bit.
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let o = farm_cmd(&out, 200, 4)
        .args(["--workers", "2"])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "farm failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    check_results(&out, 200);
}

/// Pids of the processes whose parent is `ppid` and whose command line contains `needle`.
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
        if parent == ppid && String::from_utf8_lossy(&cmd).contains(needle) {
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

/// Runs a farm over 600 inputs, SIGKILLs one of its `children_expected` children whose command line contains
/// `needle` once results flow, and checks that every input still got exactly one right line.
/// Returns the farm's stdout and stderr.
fn farm_with_a_kill(needle: &str, children_expected: usize) -> (String, String) {
    farm_with_a_signal(
        needle,
        children_expected,
        nix::sys::signal::Signal::SIGKILL,
        &[],
    )
}

/// [`farm_with_a_kill`] with another signal, and more options for the farm.
fn farm_with_a_signal(
    needle: &str,
    children_expected: usize,
    signal: nix::sys::signal::Signal,
    extra: &[&str],
) -> (String, String) {
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let n = 600;
    let child = farm_cmd(&out, n, 3).args(extra).spawn().unwrap();
    let farm_pid = child.id();
    let t = Instant::now();
    let victim = loop {
        let kids = children(farm_pid, needle);
        if kids.len() == children_expected && count_lines(&out) >= 40 {
            break kids[children_expected / 2];
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the farm wrote no 40 results with all its children up in 5 minutes"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(victim), signal).unwrap();
    let o = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "farm failed:\n{stdout}\n{stderr}");
    check_results(&out, n);
    (stdout, stderr)
}

#[test]
fn farm_replaces_a_stopped_producer_every_input_once() {
    // SIGSTOP: the producer neither dies nor answers. The farm must notice on its own.
    let (stdout, stderr) = farm_with_a_signal(
        "produce",
        3,
        nix::sys::signal::Signal::SIGSTOP,
        &["--stall-secs", "3"],
    );
    assert!(
        stderr.contains("returned no result for") && stderr.contains("killing it"),
        "expected the farm to call the stopped producer hung:\n{stderr}"
    );
    // At least the stopped one was restarted (a producer slowed past 3 s by a loaded machine
    // would be replaced too, which costs time, never a result).
    assert!(
        !stdout.contains("(0 restarts)"),
        "expected a restart in the summary:\n{stdout}"
    );
}

#[test]
fn farm_survives_a_sigkilled_producer_every_input_once() {
    let (stdout, stderr) = farm_with_a_kill("produce", 3);
    assert!(
        stderr.contains("killed by SIGKILL"),
        "the farm did not notice: {stderr}"
    );
    assert!(stdout.contains("(1 restart)"), "{stdout}");
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

#[test]
fn help_explains_every_subcommand() {
    for (sub, needles) in [
        (vec![], vec!["serve", "produce", "farm", "ctl", "--log"]),
        (
            vec!["serve"],
            vec![
                "--socket",
                "--weights",
                "--seed",
                "--max-batch",
                "--max-wait-ms",
                "--slots",
                "--slot-size",
                "--threads",
                "--image-size",
                "--device",
            ],
        ),
        (
            vec!["produce"],
            vec![
                "--input",
                "--synthetic",
                "--worklist",
                "--output",
                "--in-flight",
                "--image-size",
                "--nvjpeg",
                "--pixels",
            ],
        ),
        (
            vec!["farm"],
            vec![
                "--producers",
                "--input",
                "--synthetic",
                "--output",
                "--progress",
                "--max-restarts",
                "--in-flight",
                "--gpu-producers",
                "--pixels",
            ],
        ),
        (vec!["ctl"], vec!["status", "drain", "--socket"]),
        // Global options show (and work) after the subcommand too.
        (
            vec!["ctl", "status"],
            vec!["--socket", "--log", "--json", "--farm"],
        ),
        (
            vec!["model-bench"],
            vec!["--device", "--batch", "--seconds"],
        ),
        (vec!["prep"], vec!["--nvjpeg", "--dump"]),
        (vec!["weights"], vec!["--out", "--seed"]),
    ] {
        let mut args: Vec<&str> = sub.clone();
        args.push("--help");
        let (ok, out, _) = run(&args);
        assert!(ok, "{args:?}");
        for n in needles {
            assert!(
                out.contains(n),
                "`{}` --help does not mention {n}",
                sub.join(" ")
            );
        }
    }
}

#[test]
fn errors_are_one_line_and_say_what_to_do() {
    let dir = tmp();
    let sock = dir.path().join("s.sock");
    let s = sock.to_str().unwrap();
    assert_one_line_error(
        &["produce", "--socket", s, "--input", "/nonexistent/images"],
        "--synthetic",
    );
    assert_one_line_error(&["farm", "--input", "/nonexistent/images"], "pass a folder");
    assert_one_line_error(
        &[
            "serve",
            "--socket",
            s,
            "--weights",
            "/nonexistent.safetensors",
        ],
        "--weights",
    );
    assert_one_line_error(
        &[
            "farm",
            "--synthetic",
            "4",
            "--weights",
            "/nonexistent.safetensors",
        ],
        "tensorport weights",
    );
    assert_one_line_error(
        &["farm", "--synthetic", "4", "--gpu-producers", "1"],
        "run the servers on a GPU",
    );
    // A GPU producer with no GPU (CI) says so; with one, it names what is missing (nvJPEG,
    // NVRTC) or goes on to find no server.
    let (ok, _, err) = run(&["produce", "--socket", s, "--synthetic", "3", "--nvjpeg"]);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        !ok && lines.len() == 1 && lines[0].starts_with("error: "),
        "{err}"
    );
    assert!(
        ["NVIDIA driver", "libnvjpeg", "libnvrtc", "tensorport serve"]
            .iter()
            .any(|n| lines[0].contains(n)),
        "{err}"
    );
    assert_one_line_error(&["ctl", "--socket", s, "status"], "tensorport serve");
    assert_one_line_error(
        &["produce", "--socket", s, "--synthetic", "3"],
        "start one with `tensorport serve`",
    );
    assert_one_line_error(&["produce", "--socket", s], "--synthetic N");
    // A socket already in use by a live server.
    let (mut server, _lines) =
        serve_until_ready(Command::new(EXE).args(["serve", "--socket", s, "--image-size", "32"]));
    assert_one_line_error(
        &["serve", "--socket", s, "--image-size", "32"],
        "already listening",
    );
    // A producer whose images do not match the server's model gets an error per input, not a hang.
    let (ok, out, err) = run(&[
        "produce",
        "--socket",
        s,
        "--synthetic",
        "2",
        "--image-size",
        "16",
    ]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 2);
    assert!(out.contains("--image-size"), "{out}");
    // ctl status and drain work, and drain makes the server exit. --socket goes before or
    // after the subcommand.
    let (ok, out, err) = run(&["ctl", "--socket", s, "status"]);
    assert!(ok && out.contains("requests"), "{out}{err}");
    let (ok, out, err) = run(&["ctl", "status", "--socket", s]);
    assert!(
        ok && out.contains("requests"),
        "`ctl status --socket PATH` should work:\n{out}{err}"
    );
    let (ok, _, err) = run(&["ctl", "--socket", s, "drain"]);
    assert!(ok, "{err}");
    let t = Instant::now();
    while server.try_wait().unwrap().is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the server was still running 2 minutes after drain"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(server.wait().unwrap().success());
    let _: PathBuf = sock;
}

#[test]
fn farm_survives_a_sigkilled_server_every_input_once() {
    let (stdout, stderr) = farm_with_a_kill("serve", 1);
    assert!(
        stderr.contains("server ended (killed by SIGKILL)"),
        "{stderr}"
    );
    assert!(stdout.contains("server restarts 1"), "{stdout}");
}

#[test]
fn farm_over_two_servers_survives_one_sigkilled_every_input_once() {
    // Two servers, four producers: the killed server's producers redo their inputs through the
    // other one (or through it again once it is back), and every input gets exactly one line.
    let (stdout, stderr) = farm_with_a_signal(
        "serve",
        2,
        nix::sys::signal::Signal::SIGKILL,
        &["--servers", "2"],
    );
    assert!(
        stderr.contains("server-1 ended (killed by SIGKILL)")
            || stderr.contains("server-0 ended (killed by SIGKILL)"),
        "{stderr}"
    );
    assert!(stdout.contains("server restarts 1"), "{stdout}");
}

#[test]
fn farm_moves_producers_off_a_stalled_server_every_input_once() {
    // Two servers, four producers; one server is stopped (SIGSTOP): its producers get no results
    // while the other's keep going, so the farm moves one of them to the other server. Then the
    // stopped server resumes and every input still gets exactly one line.
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    // The stopped server's producers hold inputs only it can answer, so the run cannot end
    // before it resumes: a small run is enough.
    let n = 600;
    let mut child = farm_cmd(&out, n, 4)
        .args(["--servers", "2"])
        .spawn()
        .unwrap();
    let farm_pid = child.id();
    let moved = Arc::new(AtomicBool::new(false));
    let stderr = {
        let (moved, err) = (moved.clone(), child.stderr.take().unwrap());
        std::thread::spawn(move || {
            let mut all = String::new();
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if line.contains("moving producer-") {
                    moved.store(true, Ordering::SeqCst);
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        })
    };
    let t = Instant::now();
    let server = loop {
        let kids = children(farm_pid, "serve");
        if kids.len() == 2 && count_lines(&out) >= 40 {
            break kids[1];
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the farm did not get going"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let pid = nix::unistd::Pid::from_raw(server);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let t = Instant::now();
    while !moved.load(Ordering::SeqCst) && t.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(20));
    }
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    let o = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    let stderr = stderr.join().unwrap();
    assert!(o.status.success(), "farm failed:\n{stdout}\n{stderr}");
    assert!(
        moved.load(Ordering::SeqCst),
        "no producer moved off the stopped server:\n{stderr}"
    );
    assert!(stdout.contains("moved to a faster server"), "{stdout}");
    check_results(&out, n);
}

/// Runs the farm on a few synthetic inputs with `extra` options, expecting it to fail; returns
/// its stderr and how many times it started a server.
fn farm_that_cannot_start(extra: &[&str]) -> String {
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let mut c = farm_cmd(&out, 4, 1);
    c.args(extra);
    let o = c.output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(
        !o.status.success(),
        "the farm should have failed with {extra:?}:\n{stderr}"
    );
    assert!(
        !stderr.contains("restarting in"),
        "a configuration a restart cannot fix should end the farm at once, not restart:\n{stderr}"
    );
    stderr
}

#[test]
fn impossible_configurations_fail_at_once() {
    // A CUDA model on a build without CUDA: refused before anything starts.
    if !cfg!(feature = "cuda") {
        let err = farm_that_cannot_start(&["--device", "cuda"]);
        assert!(
            err.contains("built without CUDA") && err.contains("--device cpu"),
            "expected the missing-CUDA explanation:\n{err}"
        );
        assert_eq!(
            err.matches("built without CUDA").count(),
            1,
            "expected the message once:\n{err}"
        );
    }
    // A weights file that exists but is not safetensors: only the server finds out, and the farm
    // stops with its words instead of restarting it.
    let dir = tmp();
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, b"not a safetensors file").unwrap();
    let err = farm_that_cannot_start(&["--weights", bad.to_str().unwrap()]);
    assert!(
        err.contains("the server cannot start (exit 2)"),
        "expected the farm to quote the server's refusal:\n{err}"
    );
    // An invalid log filter is refused, not taken as a filter that hides every line.
    for args in [
        &["--log", "bogus", "ctl", "status"][..],
        &["farm", "--child-log", "bogus"],
    ] {
        let (ok, _, err) = run(args);
        assert!(!ok, "{args:?} should be refused");
        assert!(
            err.contains("'bogus' is not a log level"),
            "{args:?}: expected a clear refusal, got:\n{err}"
        );
    }
    // `gpu probe` without a driver names no option it does not have.
    let (ok, _, err) = run(&["gpu", "probe"]);
    if !ok {
        assert!(
            err.contains("libcuda") && !err.contains("--device"),
            "expected the missing-driver explanation without a foreign option:\n{err}"
        );
    }
}

/// `GET path` on `addr` over plain HTTP/1.0; the whole response, headers and body.
fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn serve_metrics_endpoint_is_scraped() {
    let dir = tmp();
    let sock = dir.path().join("s.sock");
    let s = sock.to_str().unwrap();
    let (mut server, mut lines) = serve_until_ready(
        Command::new(EXE)
            .args(["serve", "--socket", s, "--image-size", "32"])
            .args(["--metrics", "127.0.0.1:0"]),
    );
    let announced = lines.next().unwrap().unwrap();
    let addr = announced
        .strip_prefix("metrics http://")
        .and_then(|r| r.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("expected `metrics http://ADDR/metrics`, got {announced:?}"))
        .to_string();
    let (ok, out, err) = run(&[
        "produce",
        "--socket",
        s,
        "--synthetic",
        "5",
        "--image-size",
        "32",
    ]);
    assert!(ok && out.lines().count() == 5, "{out}{err}");
    // The serving loop records a batch's histograms after it has answered the batch, so the
    // last batch may land a moment after the producer has its results: scrape until it has.
    let t = Instant::now();
    let page = loop {
        let page = http_get(&addr, "/metrics");
        if page.contains("tensorport_request_service_seconds_count 5")
            || t.elapsed() > Duration::from_secs(60)
        {
            break page;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        page.starts_with("HTTP/1.0 200") || page.starts_with("HTTP/1.1 200"),
        "{page}"
    );
    for want in [
        "tensorport_requests_submitted_total 5",
        "tensorport_requests_completed_total 5",
        "tensorport_sessions_opened_total 1",
        "tensorport_batch_size_count",
        "tensorport_batch_model_seconds_bucket{le=",
        "tensorport_request_service_seconds_count 5",
        "tensorport_sessions ",
        "tensorport_in_flight ",
        "# EOF",
    ] {
        assert!(
            page.contains(want),
            "expected {want:?} in the scrape:\n{page}"
        );
    }
    // The batches' sizes add up to the five requests.
    assert!(page.contains("tensorport_batch_size_sum 5"), "{page}");
    let other = http_get(&addr, "/");
    assert!(other.contains(" 404 "), "{other}");
    drain_and_wait(s, &mut server);
}

#[test]
fn eight_bit_pixels_give_the_same_scores_bitwise() {
    // Producers hand over u8 planes (a quarter of the bytes); the server normalises them with
    // the same table, so every score equals the in-process model's on f32 input, bit for bit —
    // on generated images and on JPEG/PNG files.
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let o = farm_cmd(&out, 60, 2)
        .args(["--pixels", "u8"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check_results(&out, 60);
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "12"]);
    assert!(ok, "{err}");
    let out = dir.path().join("f.jsonl");
    let o = Command::new(EXE)
        .args([
            "farm",
            "--input",
            images.to_str().unwrap(),
            "--pixels",
            "u8",
        ])
        .args(["--image-size", &SIZE.to_string(), "--producers", "2"])
        .args(["--progress", "never", "--output"])
        .arg(&out)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check_results(&out, 12);
    // What the server receives: u8 tensors holding the image's 8-bit planes.
    let sock = dir.path().join("s.sock");
    let server = tensorport::Server::bind(tensorport::ServerConfig::new(&sock)).unwrap();
    let size = SIZE.to_string();
    let mut child = Command::new(EXE)
        .args([
            "--log",
            "warn",
            "produce",
            "--socket",
            sock.to_str().unwrap(),
        ])
        .args(["--synthetic", "2", "--image-size", &size, "--pixels", "u8"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut prep =
        tensorport_vision::Preprocessor::new(tensorport_vision::Transform::standard(SIZE as u32));
    for _ in 0..2 {
        let req = server
            .recv_timeout(std::time::Duration::from_secs(30))
            .unwrap()
            .expect("a request");
        assert_eq!(req.desc().dtype(), tensorport::DType::U8);
        assert_eq!(req.desc().shape(), &[3, SIZE as u64, SIZE as u64]);
        let mut want = vec![0u8; 3 * SIZE * SIZE];
        let src = Source::Synthetic(req.request_id());
        prep.prepare_into(&src, tensorport_vision::Planes::U8(&mut want))
            .unwrap();
        assert_eq!(&req.bytes()[..want.len()], &want[..]);
        req.release()
            .respond(&tensorport_dfdx::scores_to_bytes(&[0.0; 10]))
            .unwrap();
    }
    assert!(child.wait().unwrap().success());
}

#[test]
fn ctl_status_farm_shows_every_server_of_a_farm() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let dir = tmp();
    let sock = dir.path().join("f.sock");
    let out = dir.path().join("r.jsonl");
    let mut farm = farm_cmd(&out, 1_000_000, 2)
        .args(["--servers", "2", "--socket", sock.to_str().unwrap()])
        .spawn()
        .unwrap();
    // Both servers listen and each has a producer (however long the machine takes to start
    // them); then the farm's view holds both and sums them.
    let s = sock.to_str().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let seen = loop {
        let (ok, stdout, err) = run(&["ctl", "--socket", s, "status", "--farm", "--json"]);
        let last = if ok {
            let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
            if v["totals"]["servers"] == 2 && v["totals"]["sessions"] == 2 {
                break v;
            }
            stdout
        } else {
            err
        };
        assert!(
            std::time::Instant::now() < deadline,
            "never saw both servers: {last}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let servers = seen["servers"].as_array().unwrap();
    assert!(servers[1]["socket"].as_str().unwrap().ends_with("f-1.sock"));
    for srv in servers {
        assert_eq!(
            srv["status"]["sessions"].as_array().unwrap().len(),
            1,
            "{srv}"
        );
    }
    let (ok, text, err) = run(&["ctl", "--socket", s, "status", "--farm"]);
    assert!(ok, "{err}");
    assert!(text.contains("farm      2 servers, 2 sessions"), "{text}");
    assert_eq!(text.matches("== ").count(), 2, "{text}");
    // Two signals: the farm stops at once, its children with it.
    let pid = Pid::from_raw(farm.id() as i32);
    kill(pid, Signal::SIGINT).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    kill(pid, Signal::SIGINT).unwrap();
    let st = farm.wait().unwrap();
    assert_eq!(st.code(), Some(130));
}

#[test]
fn farm_on_jpeg_and_png_files_profiles_every_stage() {
    let dir = tmp();
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "24"]);
    assert!(ok, "{err}");
    let out = dir.path().join("r.jsonl");
    let o = Command::new(EXE)
        .args(["farm", "--input", images.to_str().unwrap()])
        .args(["--image-size", &SIZE.to_string(), "--producers", "2"])
        .args(["--progress", "never", "--profile", "--output"])
        .arg(&out)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // The standard transform on real files, bitwise the same as in-process.
    check_results(&out, 24);
    for stage in [
        "decode",
        "resize",
        "normalise",
        "lease wait",
        "submit to result",
    ] {
        assert!(
            stdout.contains(stage),
            "expected the summary to give the {stage} stage:\n{stdout}"
        );
    }
    let first = std::fs::read_to_string(&out).unwrap();
    let v: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    assert!(
        v["stages"]["decode_ms"].as_f64().is_some_and(|x| x >= 0.0),
        "expected per-input stage times with --profile: {v}"
    );
    // `--jpeg-decoder zune-jpeg` reaches the producers: bitwise the in-process zune-jpeg path,
    // and (where libjpeg-turbo is the default) not the default's scores for every JPEG file.
    let zune = dir.path().join("zune.jsonl");
    let o = Command::new(EXE)
        .args(["farm", "--input", images.to_str().unwrap()])
        .args(["--image-size", &SIZE.to_string(), "--producers", "2"])
        .args([
            "--progress",
            "never",
            "--jpeg-decoder",
            "zune-jpeg",
            "--output",
        ])
        .arg(&zune)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check_results_decoded_with(&zune, 24, JpegDecoder::ZuneJpeg);
    if JpegDecoder::default() == JpegDecoder::LibjpegTurbo {
        let scores = |p: &Path| -> HashMap<String, Vec<u32>> {
            read_results(p)
                .into_iter()
                .map(|l| {
                    let bits = l.scores.unwrap().iter().map(|x| x.to_bits()).collect();
                    (l.input, bits)
                })
                .collect()
        };
        let (a, b) = (scores(&out), scores(&zune));
        let differ = a
            .iter()
            .filter(|(k, v)| k.ends_with(".jpg") && b.get(*k) != Some(*v))
            .count();
        assert!(
            differ > 0,
            "the two decoders gave the same scores for every JPEG file"
        );
    }
}

#[test]
fn a_pool_over_the_file_size_limit_is_refused_not_fatal() {
    let dir = tmp();
    let sock = dir.path().join("s.sock");
    let s = sock.to_str().unwrap();
    // 64 KiB of file size allowed; a producer's pool of 8 slots of 48 KiB is over it.
    let (mut server, _lines) = serve_until_ready(Command::new("bash").arg("-c").arg(format!(
        "ulimit -f 64 && exec {EXE} serve --socket {s} --image-size 64"
    )));
    let (ok, _, err) = run(&[
        "produce",
        "--socket",
        s,
        "--synthetic",
        "2",
        "--image-size",
        "64",
    ]);
    assert!(!ok, "the producer should have been refused");
    assert!(
        err.contains("file size limit (ulimit -f)"),
        "expected the refusal to name the limit:\n{err}"
    );
    assert!(
        server.try_wait().unwrap().is_none(),
        "the server died (SIGXFSZ?) instead of refusing one producer"
    );
    drain_and_wait(s, &mut server);
}

#[test]
fn a_results_file_that_cannot_grow_keeps_whole_lines_and_is_named() {
    // A file size limit stands in for a full disk: writes past it fail (EFBIG). 48 KiB holds
    // a couple of hundred lines; the pools (memfds count too) stay under it with 16x16 images.
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let o = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -f 48 && exec {EXE} farm --synthetic 2000 --image-size 16 --producers 2 \
             --progress never --output {}",
            out.display()
        ))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the farm should fail:\n{stderr}");
    assert!(
        stderr.contains(&format!("writing results to {} failed", out.display())),
        "expected the error to name the results file:\n{stderr}"
    );
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        !text.is_empty() && text.ends_with('\n'),
        "expected whole lines only, the file ends with {:?}",
        &text[text.len().saturating_sub(40)..]
    );
    for l in text.lines() {
        serde_json::from_str::<serde_json::Value>(l)
            .unwrap_or_else(|e| panic!("a torn line {l:?}: {e}"));
    }
}

#[test]
fn two_ctrl_c_stop_at_once_and_leave_nothing_behind() {
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    // No --socket: the farm makes (and must remove) a private socket directory.
    let mut c = farm_cmd(&out, 1_000_000, 2);
    let child = c.spawn().unwrap();
    let farm_pid = child.id();
    let t = Instant::now();
    let (server, socket_dir) = loop {
        let servers = children(farm_pid, "serve");
        if let (Some(&pid), true) = (servers.first(), count_lines(&out) >= 10) {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
            let args: Vec<String> = cmd
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let sock = args
                .iter()
                .position(|a| a == "--socket")
                .map(|i| PathBuf::from(&args[i + 1]))
                .expect("the server's --socket");
            break (pid, sock.parent().unwrap().to_path_buf());
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the farm wrote no results in 5 minutes"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let producers = children(farm_pid, "produce");
    assert!(socket_dir.is_dir(), "{}", socket_dir.display());
    // The directory is the farm's alone.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&socket_dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "socket directory mode {mode:o}");
    let pid = nix::unistd::Pid::from_raw(farm_pid as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{stderr}");
    assert!(
        !socket_dir.exists(),
        "the socket directory {} was left behind:\n{stderr}",
        socket_dir.display()
    );
    for p in producers.iter().chain([&server]) {
        assert!(
            eventually_gone(*p),
            "child {p} outlived the farm:\n{stderr}"
        );
    }
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
