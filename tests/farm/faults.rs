//! Faults under a running farm: producers and servers SIGKILLed or stopped, Ctrl-C, a pool
//! over the file size limit, a results file that cannot grow.

use super::*;

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
    // Producers: as many as the children expected when those are the producers.
    let producers = if needle == "produce" {
        children_expected
    } else {
        3
    };
    let child = farm_cmd(&out, n, producers).args(extra).spawn().unwrap();
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
    // SIGSTOP: the producer neither dies nor answers. The farm must notice on its own: with
    // one producer, no other can take its inputs over at the end.
    let (stdout, stderr) = farm_with_a_signal(
        "produce",
        1,
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
fn a_stopped_producer_does_not_hold_up_the_end_of_a_run() {
    // Two producers, one SIGSTOPped once results flow, and a stall limit far beyond the test:
    // once the queue runs out, the other takes the stopped one's inputs over, so the run ends
    // with every input once and without waiting to call the stopped one hung.
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let n = 400;
    let mut child = farm_cmd(&out, n, 2)
        .args(["--stall-secs", "900"])
        .spawn()
        .unwrap();
    let farm_pid = child.id();
    let t = Instant::now();
    let victim = loop {
        let kids = children(farm_pid, "produce");
        if kids.len() == 2 && count_lines(&out) >= 40 {
            break kids[0];
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the farm wrote no 40 results with both producers up in 5 minutes"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    // Watchdog: far beyond any run of 400 small inputs, far below the 900 s stall limit.
    let deadline = Instant::now() + Duration::from_secs(300);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(victim),
                nix::sys::signal::Signal::SIGKILL,
            );
            panic!("the farm waited on its stopped producer for 5 minutes");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(status.success(), "farm failed:\n{stderr}");
    assert!(
        !stderr.contains("returned no result for"),
        "the farm waited to call the stopped producer hung:\n{stderr}"
    );
    check_results(&out, n);
    assert!(
        eventually_gone(victim),
        "the stopped producer outlived the farm"
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
    // stopped server resumes and every input still gets exactly one line. The inputs come on
    // the farm's stdin, which stays open until the move: the run cannot end before it (idle
    // producers would otherwise take the stopped server's inputs over at the end of the queue).
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/images");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&images)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let n = 600;
    let list = |range: std::ops::Range<usize>| -> String {
        range
            .map(|i| format!("{}\n", files[i % files.len()].display()))
            .collect()
    };
    let mut child = Command::new(EXE)
        .args([
            "farm",
            "--input-list",
            "-",
            "--image-size",
            &SIZE.to_string(),
        ])
        .args(["--producers", "4", "--in-flight", "4", "--servers", "2"])
        .args(["--progress", "never", "--output"])
        .arg(&out)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    std::io::Write::write_all(&mut stdin, list(0..n / 2).as_bytes()).unwrap();
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
    std::io::Write::write_all(&mut stdin, list(n / 2..n).as_bytes()).unwrap();
    drop(stdin);
    let o = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    let stderr = stderr.join().unwrap();
    assert!(o.status.success(), "farm failed:\n{stdout}\n{stderr}");
    assert!(
        moved.load(Ordering::SeqCst),
        "no producer moved off the stopped server:\n{stderr}"
    );
    assert!(stdout.contains("moved to a faster server"), "{stdout}");
    check_results(&out, n as u64);
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
            // The server's configuration comes as one JSON document.
            let data = args
                .iter()
                .position(|a| a == "--config-data")
                .map(|i| args[i + 1].clone())
                .expect("the server's --config-data");
            let cfg: serde_json::Value = serde_json::from_str(&data).unwrap();
            let sock = PathBuf::from(cfg["socket"].as_str().expect("a socket in it"));
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

/// A farm killed with SIGKILL cannot remove its socket directory; the next farm of the same user
/// removes it (and leaves none of its own once it is done).
#[test]
fn the_next_farm_removes_a_killed_farms_socket_directory() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tmp();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
    let farm_dirs = || -> Vec<String> {
        std::fs::read_dir(&run)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("tensorport-farm-"))
            .collect()
    };
    let out = dir.path().join("killed.jsonl");
    let mut first = farm_cmd(&out, 5000, 1)
        .env("XDG_RUNTIME_DIR", &run)
        .spawn()
        .unwrap();
    let pid = first.id() as i32;
    let t = Instant::now();
    while count_lines(&out) < 1 {
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the first farm wrote no result in 5 minutes"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    first.wait().unwrap();
    assert_eq!(farm_dirs().len(), 1, "the killed farm's directory");
    // Its children follow it (they are told by a parent-death signal).
    let t = Instant::now();
    while !orphans_of(&run).is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the killed farm's children outlived it by a minute"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = farm_cmd(&dir.path().join("next.jsonl"), 20, 1)
        .env("XDG_RUNTIME_DIR", &run)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        farm_dirs(),
        Vec::<String>::new(),
        "a socket directory was left behind"
    );
}

/// Processes whose command line names `dir` (the killed farm's server and producers).
fn orphans_of(dir: &Path) -> Vec<i32> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(&needle))
                .unwrap_or(false)
        })
        .collect()
}
