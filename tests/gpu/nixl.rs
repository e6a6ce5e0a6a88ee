//! Remote GPU producers over NIXL: `tensorport-bridge produce --transport nixl --gpu 0` keeps its
//! slots in device memory, and the gateway reads them over UCX's CUDA transports into device
//! buffers it hands to `tensorport serve --device cuda` as a GPU producer's. Needs the
//! `tensorport-bridge` binary (beside this test binary, or `TENSORPORT_BRIDGE_BIN`) and NIXL
//! (`TENSORPORT_NIXL`, or the checkout's `target/nixl` from scripts/fetch-nixl.sh); without
//! either the test says so and is skipped.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::*;

/// The bridge binary and NIXL's folder, or why the test cannot run.
fn nixl_tools() -> Result<(PathBuf, PathBuf), String> {
    let bridge = match std::env::var_os("TENSORPORT_BRIDGE_BIN") {
        Some(p) => PathBuf::from(p),
        None => std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|d| d.join("tensorport-bridge")))
            .filter(|p| p.is_file())
            .ok_or("no tensorport-bridge beside this test binary (set TENSORPORT_BRIDGE_BIN)")?,
    };
    let nixl = match std::env::var_os("TENSORPORT_NIXL") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("target/nixl"),
    };
    if !nixl.join("VERSION").is_file() {
        return Err(format!(
            "no NIXL at {} (scripts/fetch-nixl.sh, or set TENSORPORT_NIXL)",
            nixl.display()
        ));
    }
    Ok((bridge, nixl))
}

/// A gateway in front of `sock`, with its token file; returns it and its URL.
fn start_gateway(bridge: &Path, nixl: &Path, dir: &Path, sock: &Path) -> (ChildGuard, String) {
    let token = dir.join("tok");
    let o = Command::new(bridge)
        .arg("token")
        .arg(&token)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut g = ChildGuard(Some(
        Command::new(bridge)
            .args([
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--in-flight",
                "32",
                "--nixl-device",
            ])
            .arg("--socket")
            .arg(sock)
            .arg("--token-file")
            .arg(&token)
            .env("TENSORPORT_NIXL", nixl)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("gateway.log")).unwrap())
            .spawn()
            .unwrap(),
    ));
    let mut line = String::new();
    std::io::BufReader::new(g.0.as_mut().unwrap().stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .strip_prefix("listening on ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("the gateway said {line:?}"))
        .to_string();
    (g, url)
}

/// `tensorport-bridge produce` of `n` synthetic images through the gateway at `url`, with
/// `extra` arguments and `env`.
fn producer(
    tools: &(PathBuf, PathBuf),
    dir: &Path,
    url: &str,
    name: &str,
    n: u64,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Command {
    let mut c = Command::new(&tools.0);
    c.args(["produce", "--gateway", url, "--name", name])
        .args(["--image-size", &MODEL_SIZE.to_string()])
        .args(["--synthetic", &n.to_string(), "--in-flight", "32"])
        .arg("--token-file")
        .arg(dir.join("tok"))
        .arg("--output")
        .arg(dir.join(format!("{name}.jsonl")))
        .args(extra)
        .env("TENSORPORT_NIXL", &tools.1)
        .env("UCX_WARN_UNUSED_ENV_VARS", "n")
        .stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// Runs `c` to its end; panics with its standard error if it fails.
fn run(mut c: Command) {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{:?} failed:\n{}",
        c,
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Each input's scores, from a producer's lines; panics unless every input in `0..n` has
/// exactly one line, without an error.
fn scores(dir: &Path, name: &str, n: u64) -> BTreeMap<u64, Vec<f32>> {
    let text = std::fs::read_to_string(dir.join(format!("{name}.jsonl"))).unwrap();
    let mut got = BTreeMap::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v.get("error").is_none(), "{name}: {line}");
        let i = v["index"].as_u64().unwrap();
        let s = line_scores(&v);
        assert!(got.insert(i, s).is_none(), "{name}: input {i} twice");
    }
    assert_eq!(
        got.keys().copied().collect::<Vec<_>>(),
        (0..n).collect::<Vec<_>>(),
        "{name}: every input once"
    );
    got
}

/// The largest difference between two runs' scores, relative to the largest score.
fn worst(a: &BTreeMap<u64, Vec<f32>>, b: &BTreeMap<u64, Vec<f32>>) -> f32 {
    let mut w = 0f32;
    for (i, x) in a {
        let y = &b[i];
        assert_eq!(x.len(), y.len());
        let scale = x.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (p, q) in x.iter().zip(y) {
            w = w.max((p - q).abs() / scale);
        }
    }
    w
}

/// Images from a remote GPU producer's device slots reach the CUDA model intact (the scores of
/// the same images sent inside the Flight stream, within 1e-4 relative), over UCX's CUDA IPC and
/// over TCP with the device memory staged by UCX (`UCX_TLS=tcp,cuda_copy`); a GPU producer
/// killed with SIGKILL mid-run is reclaimed and the next one served.
pub(crate) fn nixl_device_tensors_through_the_gateway() {
    let tools = match nixl_tools() {
        Ok(t) => t,
        Err(why) => {
            println!("  skipped: {why}");
            return;
        }
    };
    let (_tmp, sock) = socket_dir();
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let _server = start_cuda_serve(&sock, &[]);
    let (_gateway, url) = start_gateway(&tools.0, &tools.1, dir, &sock);
    let n = 200;
    run(producer(&tools, dir, &url, "flight", n, &[], &[]));
    let nixl = ["--transport", "nixl", "--gpu", "0"];
    run(producer(&tools, dir, &url, "gpu-ipc", n, &nixl, &[]));
    run(producer(
        &tools,
        dir,
        &url,
        "gpu-tcp",
        n,
        &nixl,
        &[("UCX_TLS", "tcp,cuda_copy")],
    ));
    let flight = scores(dir, "flight", n);
    for name in ["gpu-ipc", "gpu-tcp"] {
        let w = worst(&flight, &scores(dir, name, n));
        println!(
            "  {name}: {n} images answered once, worst relative difference from Flight {w:.2e}"
        );
        assert!(w <= 1e-4, "{name}: {w}");
    }
    let log = std::fs::read_to_string(dir.join("gateway.log")).unwrap();
    assert!(log.contains("into device memory"), "{log}");

    // A GPU producer killed mid-run: its session is reclaimed, the next is served.
    let mut victim = producer(&tools, dir, &url, "victim", 1_000_000, &nixl, &[])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        victim.try_wait().unwrap().is_none(),
        "the victim ended early"
    );
    victim.kill().unwrap();
    victim.wait().unwrap();
    run(producer(&tools, dir, &url, "next", 64, &nixl, &[]));
    scores(dir, "next", 64);
    println!(
        "  a SIGKILLed GPU producer's session reclaimed; the next one's 64 images answered once"
    );
}
