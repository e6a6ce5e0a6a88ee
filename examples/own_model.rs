//! Your own network behind tensorport's server: the producers, batching, slot hand-back and
//! fault handling are tensorport's; the model is yours.
//!
//! `cargo run --release --example own_model -- [DIR]` serves `Brightest`, a model written here
//! (its three scores are an image's mean red, green and blue, normalised), with
//! `tensorport_farm::serve::run_with`, and runs a farm attached to it over the images in DIR
//! (default: `examples/images`). The farm and its producer processes are this program again: it
//! carries the `tensorport` command line (`tensorport_cli::run`). Each image's class is printed.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tensorport_farm::config::Launcher;
use tensorport_farm::process::Stop;
use tensorport_farm::serve::{HostBatch, HostModel};
use tensorport_farm::{ModelOptions, ServeConfig};

const SIZE: usize = 64;
const COLOURS: [&str; 3] = ["red", "green", "blue"];

/// The model: one score per colour channel, the channel's mean over the image.
struct Brightest;

impl HostModel for Brightest {
    fn run(&mut self, batch: HostBatch<'_>) -> Result<Vec<Vec<f32>>, String> {
        let [c, h, w] = batch.shape;
        let plane = h * w;
        Ok((0..batch.rows)
            .map(|i| {
                let image = batch.image(i);
                (0..c)
                    .map(|k| image[k * plane..(k + 1) * plane].iter().sum::<f32>() / plane as f32)
                    .collect()
            })
            .collect())
    }
}

/// How the farm starts its children: this program, as `tensorport`.
fn as_tensorport() -> Launcher {
    Launcher {
        args: vec!["tensorport".into()],
        ..Launcher::this_executable()
    }
}

fn usage_error(problem: &str) -> ExitCode {
    eprintln!("error: {problem}\nusage: own_model [DIR]");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    // Started again as the farm, or as one of its producers (`own_model tensorport ARGS…`): the
    // `tensorport` command line.
    if args.get(1).is_some_and(|a| a == "tensorport") {
        return ExitCode::from(tensorport_cli::run(&args[1..], as_tensorport()));
    }
    let dir = match &args[1..] {
        [] => Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/images"),
        [d] if !d.to_string_lossy().starts_with('-') => PathBuf::from(d),
        [d] => return usage_error(&format!("unexpected argument '{}'", d.to_string_lossy())),
        [_, extra, ..] => {
            return usage_error(&format!(
                "unexpected argument '{}'",
                extra.to_string_lossy()
            ))
        }
    };
    match run(&dir) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let work = tempfile::tempdir()?;
    let socket = work.path().join("own.sock");
    let results = work.path().join("results.jsonl");
    let mut model = ModelOptions::default();
    model.config.image_size = SIZE;
    let cfg = ServeConfig::new(&socket, model);
    let t0 = Instant::now();
    let stop = Stop::new();
    let server = std::thread::spawn({
        let stop = stop.clone();
        move || tensorport_farm::serve::run_with(&cfg, &stop, || Ok(Box::new(Brightest)))
    });
    // `run_with` prints `ready SOCKET` once it listens.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        if server.is_finished() || Instant::now() > deadline {
            return Err(match server.join() {
                Ok(Err(e)) => format!("the server did not start: {e}").into(),
                _ => "the server did not start within 30 s".into(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let farm = as_tensorport()
        .command()
        .args(["--log", "warn", "farm", "--attach"])
        .arg(&socket)
        .arg("--input")
        .arg(dir)
        .args(["--producers", "2", "--image-size", &SIZE.to_string()])
        .args(["--progress", "never", "--output"])
        .arg(&results)
        .output()?;
    if !farm.status.success() {
        return Err(format!(
            "the farm failed ({}):\n{}",
            farm.status,
            String::from_utf8_lossy(&farm.stderr)
        )
        .into());
    }
    // Drained: the server returns once its producers have left.
    stop.request();
    server.join().map_err(|_| "the server panicked")??;

    let mut lines: Vec<serde_json::Value> = std::fs::read_to_string(&results)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    lines.sort_by_key(|l| l["index"].as_u64());
    for l in &lines {
        let input = l["input"].as_str().unwrap_or("?");
        let name = Path::new(input)
            .file_name()
            .map_or(input.into(), |n| n.to_string_lossy());
        match (l["class"].as_u64(), l["error"].as_str()) {
            (Some(c), _) => println!("{name}: {} {}", COLOURS[c as usize], l["scores"]),
            (None, e) => println!("{name}: error {}", e.unwrap_or("?")),
        }
    }
    println!(
        "{} images classified by your model in {:.2} s",
        lines.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
