//! ONNX models on the GPU server (ONNX Runtime's CUDA provider, the batch handed over where the
//! server gathered it) score as onnxruntime's Python API does on the CPU, on the same prepared
//! tensors. Needs `TENSORPORT_ORT` naming onnxruntime-gpu's library (CUDA 13 and cuDNN 9 on
//! `LD_LIBRARY_PATH`) and a python3 with `onnx` and `onnxruntime`; skipped, saying so, without.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{tensorport_exe, tp};

/// The repository's file `rel`: from the working folder (the GPU machine runs a copy of the
/// tree there), else where this test was built.
fn repo_file(rel: &str) -> PathBuf {
    let here = PathBuf::from(rel);
    match here.is_file() {
        true => here,
        false => Path::new(env!("CARGO_MANIFEST_DIR")).join(rel),
    }
}

fn python(args: &[&str]) -> Option<String> {
    let o = Command::new("python3").args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

pub(crate) fn onnx_on_gpu() {
    let Some(lib) = std::env::var_os("TENSORPORT_ORT").filter(|p| Path::new(p).is_file()) else {
        println!("  skipped: TENSORPORT_ORT names no onnxruntime-gpu library");
        return;
    };
    if python(&["-c", "import onnx, onnxruntime, numpy"]).is_none() {
        println!("  skipped: python3 lacks onnx, onnxruntime or numpy");
        return;
    }
    println!("  ONNX Runtime: {}", Path::new(&lib).display());
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().join("models");
    let images = dir.path().join("images");
    let dump = dir.path().join("images.safetensors");
    let make = repo_file("tests/onnx/make_models.py");
    python(&[make.to_str().unwrap(), models.to_str().unwrap(), "32"]).expect("the models");
    tp(&["images", "--out", images.to_str().unwrap(), "--count", "64"]);
    tp(&[
        "prep",
        "--input",
        images.to_str().unwrap(),
        "--image-size",
        "32",
        "--repeat",
        "1",
        "--dump",
        dump.to_str().unwrap(),
    ]);
    let reference = repo_file("tests/onnx/reference.py");
    for (name, bound) in [("classifier", 1e-5f32), ("classifier_f16", 1e-2)] {
        let model = models.join(format!("{name}.onnx"));
        let want: std::collections::HashMap<String, Vec<f32>> = serde_json::from_str(
            &python(&[
                reference.to_str().unwrap(),
                model.to_str().unwrap(),
                dump.to_str().unwrap(),
            ])
            .expect("the reference scores"),
        )
        .unwrap();
        // CPU producers prepare as `prep` does; the default mix's GPU producers decode on the
        // GPU (other tensors), so for them only every input once, without an error, is checked.
        for mix in [&["-p", "2", "--gpu-producers", "0"][..], &[]] {
            let out = dir.path().join(format!("{name}.jsonl"));
            let o = Command::new(tensorport_exe())
                .args([
                    "farm",
                    "--device",
                    "cuda",
                    "--model",
                    model.to_str().unwrap(),
                ])
                .args(["--input", images.to_str().unwrap(), "--progress", "never"])
                // Scores as exact as the CPU's, to compare with them.
                .args(["--tf32", "off"])
                .args(mix)
                .arg("--output")
                .arg(&out)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            let mut idx: Vec<u64> = lines.iter().map(|l| l["index"].as_u64().unwrap()).collect();
            idx.sort_unstable();
            assert_eq!(
                idx,
                (0..64).collect::<Vec<u64>>(),
                "{name}: every input once"
            );
            assert!(
                lines.iter().all(|l| l.get("error").is_none()),
                "{name}: {lines:?}"
            );
            if mix.is_empty() {
                continue;
            }
            let mut worst = 0f32;
            for l in &lines {
                let file = Path::new(l["input"].as_str().unwrap()).file_name().unwrap();
                let expect = &want[file.to_str().unwrap()];
                let got = super::line_scores(l);
                for (a, b) in got.iter().zip(expect) {
                    worst = worst.max((a - b).abs());
                }
            }
            println!("  {name}: largest difference from onnxruntime on the CPU {worst:.3e}");
            assert!(worst <= bound, "{name}: {worst} over {bound}");
        }
    }
    tensorrt_engines_are_cached(&models, &images, &dir.path().join("trt-cache"));
}

/// The classifier through ONNX Runtime's TensorRT provider (`--ort-provider tensorrt`): every
/// input once, without an error, and TensorRT's engines kept in the cache folder for the next
/// run (`XDG_CACHE_HOME` pointed at `cache` here). Skipped, saying so, where TensorRT's
/// libraries are not installed.
fn tensorrt_engines_are_cached(models: &Path, images: &Path, cache: &Path) {
    let out = cache.with_extension("jsonl");
    let o = Command::new(tensorport_exe())
        .env("XDG_CACHE_HOME", cache)
        .args([
            "farm",
            "--device",
            "cuda",
            "--ort-provider",
            "tensorrt",
            "--model",
        ])
        .arg(models.join("classifier.onnx"))
        .arg("--input")
        .arg(images)
        .args([
            "--progress",
            "never",
            "--gpu-producers",
            "0",
            "-p",
            "2",
            "--output",
        ])
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    if !o.status.success() && (err.contains("nvinfer") || err.contains("TensorRT")) {
        println!(
            "  TensorRT: skipped, its libraries are not installed ({})",
            err.lines().last().unwrap_or("")
        );
        return;
    }
    assert!(o.status.success(), "{err}");
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(text.lines().count(), 64, "every input once");
    assert!(!text.contains("\"error\""), "{text}");
    let engines = std::fs::read_dir(cache.join("tensorport/tensorrt"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert!(engines > 0, "no engine was cached");
    println!("  TensorRT: 64 inputs, {engines} files in the engine cache");
}
