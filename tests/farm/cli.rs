//! The command line: help that explains, one-line errors that say what to do, configurations
//! that cannot work failing at once.

use super::*;

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
                "--gpu-in-flight",
                "--gpu-batch",
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
    for bad in [
        &["--gpu-batch", "0"][..],
        &["--gpu-in-flight", "257"],
        &["--gpu-in-flight", "16", "--gpu-batch", "32"],
    ] {
        let args: Vec<&str> = ["farm", "--synthetic", "4"]
            .iter()
            .chain(bad)
            .copied()
            .collect();
        assert_one_line_error(&args, "--gpu-in-flight must be 1 to 256");
    }
    assert_one_line_error(
        &["farm", "--synthetic", "4", "--max-batch", "65536"],
        "--max-batch must be 1 to 65535",
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
        "`tensorport serve` starts one",
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
    assert!(out.contains("image size"), "{out}");
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
    // `tensorport-dev gpu probe` without a driver names no option it does not have.
    let o = Command::new(DEV_EXE)
        .args(["gpu", "probe"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (ok, err) = (o.status.success(), String::from_utf8_lossy(&o.stderr));
    if !ok {
        assert!(
            err.contains("libcuda") && !err.contains("--device"),
            "expected the missing-driver explanation without a foreign option:\n{err}"
        );
    }
}

#[test]
fn gpu_in_flight_alone_takes_a_batch_that_fits_it() {
    // --gpu-batch's default is half of --gpu-in-flight (at most 64), so a smaller
    // --gpu-in-flight alone is not refused.
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let mut farm = farm_cmd(&out, 4, 1)
        .args(["--gpu-in-flight", "16"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("err")).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(status) = farm.try_wait().unwrap() {
            break status;
        }
        if t.elapsed() > Duration::from_secs(120) {
            let _ = farm.kill();
            panic!("the farm was still running after 2 minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = std::fs::read_to_string(dir.path().join("err")).unwrap();
    assert!(status.success(), "`farm --gpu-in-flight 16` failed:\n{err}");
    check_results(&out, 4);
}

/// The developer tools are an executable of their own: `tensorport` neither lists nor takes
/// them, `tensorport-dev` explains them.
#[test]
fn developer_tools_are_their_own_executable() {
    let (ok, out, _) = run(&["--help"]);
    assert!(ok);
    for tool in ["soak", "gpu "] {
        assert!(
            !out.contains(&format!("  {tool}")),
            "tensorport --help lists {tool}:\n{out}"
        );
    }
    let (ok, _, err) = run(&["soak"]);
    assert!(!ok && err.contains("unrecognized subcommand"), "{err}");
    for (sub, needles) in [
        (vec![], vec!["gpu", "soak"]),
        (vec!["gpu"], vec!["probe", "bench-h2d", "bench-ipc"]),
        (
            vec!["soak"],
            vec!["--seconds", "--kill-every-ms", "tensorport"],
        ),
    ] {
        let mut args = sub.clone();
        args.push("--help");
        let o = Command::new(DEV_EXE).args(&args).output().unwrap();
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{args:?}");
        for n in needles {
            assert!(
                out.contains(n),
                "`tensorport-dev {}` --help does not mention {n}",
                sub.join(" ")
            );
        }
    }
}

/// Durations and counts at the ends of their types, or not numbers at all, are refused as they
/// are read — exit 2 with a sentence saying what to give — never a panic further in; a
/// configuration document goes through the same checks and names a field it does not know.
#[test]
fn durations_and_counts_out_of_range_are_refused_not_panics() {
    let max = "18446744073709551615";
    let cases: &[(&[&str], &str)] = &[
        (
            &["produce", "--synthetic", "1", "--timeout", max],
            "1..=604800",
        ),
        (
            &["produce", "--synthetic", "1", "--spin-us", max],
            "0..=1000000",
        ),
        (
            &["produce", "--synthetic", "1", "--read-timeout", "inf"],
            "give seconds",
        ),
        (
            &["farm", "--synthetic", "4", "--stall-secs", "1e30"],
            "give seconds",
        ),
        (
            &["farm", "--synthetic", "4", "--stall-secs", "inf"],
            "give seconds",
        ),
        (
            &["farm", "--synthetic", "4", "--stall-secs", "NaN"],
            "give seconds",
        ),
        (&["model-bench", "--seconds", "inf"], "give seconds"),
        (&["serve", "--fence-timeout-ms", max], "1..=604800000"),
        (&["serve", "--max-wait-ms", max], "0..=604800000"),
        (&["ctl", "--timeout", max, "status"], "1..=604800"),
        (
            &["serve", "--image-size", "16384"],
            "image size 16384 is out of range",
        ),
        (
            &["farm", "--synthetic", "4", "--image-size", "1099511627776"],
            "out of range",
        ),
    ];
    for (args, want) in cases {
        let o = Command::new(EXE)
            .args(*args)
            .env("TENSORPORT_SOCKET", "/nonexistent/tp.sock")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(want) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
    // A document with a field the configuration lacks, or a timeout past the end of time.
    let doc = r#"{"socket":"/nonexistent/tp.sock","inputs":{"Synthetic":1},"output":"Stdout","image_size":32,"in_flight":2,"ready":false,"prep":{"transform":"Standard","jpeg_decoder":"zune-jpeg","max_pixels":64000000,"dct_scaling":false,"coarse_progressive":true,"pixels":"F32","gpu_upsampling":"replicate","gpu_decode":"engines"},"profile":false,"keep":"All","name":"p","timeout":{"secs":60,"nanos":0},"spin":{"secs":0,"nanos":20000},"read_timeout":{"secs":10,"nanos":0},"gpu":null}"#;
    let huge = doc.replace(
        r#""timeout":{"secs":60,"nanos":0}"#,
        r#""timeout":{"secs":18446744073709551615,"nanos":0}"#,
    );
    let unknown = doc.replacen('{', r#"{"slotz":4,"#, 1);
    for (data, want) in [(huge, "timeout"), (unknown, "unknown field `slotz`")] {
        let o = Command::new(EXE)
            .args(["produce", "--config-data", &data])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(want) && !err.contains("panicked"), "{err}");
    }
    // The document itself is sound: only the socket is missing.
    let o = Command::new(EXE)
        .args(["produce", "--config-data", doc])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no tensorport server"), "{err}");
}
