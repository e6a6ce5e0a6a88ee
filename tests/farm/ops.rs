//! Operating a running farm: Prometheus metrics, `ctl status`.

use super::*;

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
    // last batch may land a moment after the producer has its results; and a scrape reads one
    // histogram after another while the loop records, so one may show the last batch and an
    // earlier one not yet: scrape until both the batches and the requests add up to five.
    let t = Instant::now();
    let page = loop {
        let page = http_get(&addr, "/metrics");
        if (page.contains("tensorport_request_service_seconds_count 5")
            && page.contains("tensorport_batch_size_sum 5"))
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
fn farm_attached_to_a_running_server_feeds_it_every_input_once_and_leaves_it_running() {
    let dir = tmp();
    let sock = dir.path().join("s.sock");
    let s = sock.to_str().unwrap();
    let (mut server, _lines) =
        serve_until_ready(Command::new(EXE).args(["serve", "--socket", s, "--image-size", "32"]));
    // A list with a file twice and a file that is not there: each line is an input.
    let mut files = sample_images(dir.path(), 4);
    files.push(files[0].clone());
    files.push(dir.path().join("missing.jpg").display().to_string());
    let list = dir.path().join("inputs.txt");
    std::fs::write(&list, files.join("\n") + "\n").unwrap();
    let out = dir.path().join("r.jsonl");
    let (ok, text, err) = run(&[
        "farm",
        "--attach",
        s,
        "--input-list",
        list.to_str().unwrap(),
        "-p",
        "2",
        "--image-size",
        "32",
        "--progress",
        "never",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{text}{err}");
    let lines = read_results(&out);
    let mut indices: Vec<u64> = lines.iter().map(|l| l.index).collect();
    indices.sort();
    assert_eq!(indices, (0..6).collect::<Vec<u64>>(), "{text}");
    let errors: Vec<_> = lines.iter().filter(|l| l.error.is_some()).collect();
    assert_eq!(errors.len(), 1, "{text}");
    assert!(errors[0].input.ends_with("missing.jpg"));
    // The same file twice: two lines, the same scores.
    let by = |i: u64| lines.iter().find(|l| l.index == i).unwrap();
    assert_eq!(by(0).scores, by(4).scores);
    assert!(by(0).scores.as_ref().is_some_and(|s| s.len() == 10));
    // The attached server was not drained: it still serves.
    let (ok, out2, err) = run(&[
        "produce",
        "--socket",
        s,
        "--synthetic",
        "2",
        "--image-size",
        "32",
    ]);
    assert!(ok && out2.lines().count() == 2, "{out2}{err}");
    drain_and_wait(s, &mut server);
}

#[test]
fn farm_with_inputs_on_stdin_hands_each_out_as_it_comes_and_ends_with_stdin() {
    use std::io::Write;
    let dir = tmp();
    let files = sample_images(dir.path(), 5);
    let out = dir.path().join("r.jsonl");
    let mut farm = Command::new(EXE)
        .args(["--log", "warn", "farm", "--input-list", "-", "-p", "2"])
        .args(["--image-size", "32", "--progress", "never", "--output"])
        .arg(&out)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Watchdog: a farm that never ends is killed, and the test then fails on its status.
    let pid = farm.id() as i32;
    let finished = Arc::new(AtomicBool::new(false));
    let f = finished.clone();
    std::thread::spawn(move || {
        let start = Instant::now();
        while !f.load(Ordering::SeqCst) {
            if start.elapsed() > Duration::from_secs(120) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let mut stdin = farm.stdin.take().unwrap();
    writeln!(stdin, "{}\n{}\n{}", files[0], files[1], files[2]).unwrap();
    stdin.flush().unwrap();
    // The first three are done while standard input is still open, and the farm waits on.
    let first = Instant::now();
    while count_lines(&out) < 3 && first.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(count_lines(&out), 3);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        farm.try_wait().unwrap().is_none(),
        "the farm ended before its input did"
    );
    // More, one of them again (each line is an input), then the end.
    writeln!(stdin, "{}\n{}\n{}", files[3], files[4], files[0]).unwrap();
    drop(stdin);
    let st = farm.wait().unwrap();
    finished.store(true, Ordering::SeqCst);
    assert!(st.success(), "{st}");
    let lines = read_results(&out);
    let mut indices: Vec<u64> = lines.iter().map(|l| l.index).collect();
    indices.sort();
    assert_eq!(indices, (0..6).collect::<Vec<u64>>());
    assert!(lines.iter().all(|l| l.scores.is_some()));
    let by = |i: u64| lines.iter().find(|l| l.index == i).unwrap();
    assert_eq!(by(0).scores, by(5).scores);
    assert_eq!(by(5).input, files[0]);
}

/// `count` sample images written under `dir/images` by `tensorport images`, their paths sorted.
fn sample_images(dir: &Path, count: u32) -> Vec<String> {
    let images = dir.join("images");
    let n = count.to_string();
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", &n]);
    assert!(ok, "{err}");
    let mut files: Vec<String> = std::fs::read_dir(&images)
        .unwrap()
        .map(|e| e.unwrap().path().display().to_string())
        .collect();
    files.sort();
    files
}

#[test]
fn a_producer_told_to_wait_for_its_server_connects_once_the_server_listens() {
    let dir = tmp();
    let sock = dir.path().join("s.sock");
    let s = sock.to_str().unwrap();
    let produce = |wait: &str| {
        let mut c = Command::new(EXE);
        c.args(["produce", "--socket", s, "--synthetic", "6"])
            .args(["--image-size", "32", "--wait-for-server", wait]);
        c
    };
    // Without waiting, nothing listening is a one-line error at once.
    assert_one_line_error(
        &[
            "produce",
            "--socket",
            s,
            "--synthetic",
            "1",
            "--wait-for-server",
            "0",
        ],
        "no tensorport server at",
    );
    // Told to wait, a producer started before its server answers every input once it listens.
    let producer = produce("60")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let (mut server, _lines) =
        serve_until_ready(Command::new(EXE).args(["serve", "--socket", s, "--image-size", "32"]));
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (done, pid) = (done.clone(), producer.id() as i32);
        std::thread::spawn(move || {
            let t = Instant::now();
            while !done.load(Ordering::SeqCst) && t.elapsed() < Duration::from_secs(120) {
                std::thread::sleep(Duration::from_millis(50));
            }
            if !done.load(Ordering::SeqCst) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        })
    };
    let o = producer.wait_with_output().unwrap();
    done.store(true, Ordering::SeqCst);
    watchdog.join().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.lines().count() == 6,
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    drain_and_wait(s, &mut server);
    // Bounded: with nothing ever listening, a short wait ends in the same error.
    let t = Instant::now();
    let o = produce("0.3").output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no tensorport server at"));
    assert!(t.elapsed() >= Duration::from_millis(300));
}

/// The children of `parent` whose command line holds `word`, with their nice values.
fn children_nice(parent: u32, word: &str) -> Vec<(u32, i32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let (Ok(stat), Ok(cmd)) = (
            std::fs::read_to_string(format!("/proc/{pid}/stat")),
            std::fs::read(format!("/proc/{pid}/cmdline")),
        ) else {
            continue;
        };
        // Fields after the command's parentheses: state (3rd) onwards; ppid is the 4th, nice
        // the 19th.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let is_word = cmd.split(|&b| b == 0).any(|a| a == word.as_bytes());
        if f.len() > 16 && f[1] == parent.to_string() && is_word {
            out.push((pid, f[16].parse().unwrap()));
        }
    }
    out
}

#[test]
fn producers_run_at_the_lower_priority_asked_and_the_server_at_its_own() {
    let mut farm = Command::new(EXE)
        .args([
            "farm",
            "--model",
            "none",
            "--synthetic",
            "10000000",
            "-p",
            "2",
        ])
        .args([
            "--producer-nice",
            "7",
            // CPU producers go lower again only beside GPU producers: not here.
            "--cpu-producer-nice",
            "5",
            "--progress",
            "never",
            "-o",
            "/dev/null",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Bounded: the producers start within seconds; the farm is killed whatever happens.
    let t = Instant::now();
    let (mut producers, mut servers) = (Vec::new(), Vec::new());
    while t.elapsed() < Duration::from_secs(60) && (producers.len() < 2 || servers.is_empty()) {
        producers = children_nice(farm.id(), "produce");
        servers = children_nice(farm.id(), "serve");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(farm.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    );
    let ended = Instant::now();
    while farm.try_wait().unwrap().is_none() && ended.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = farm.kill();
    let _ = farm.wait();
    let ours: i32 = std::fs::read_to_string("/proc/self/stat")
        .unwrap()
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(16)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(producers.len(), 2, "two producers found: {producers:?}");
    for (pid, nice) in &producers {
        assert_eq!(*nice, (ours + 7).min(19), "producer {pid}");
    }
    assert_eq!(servers.len(), 1, "{servers:?}");
    assert_eq!(servers[0].1, ours, "the server keeps the farm's priority");
}
