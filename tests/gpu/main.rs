//! GPU tests of the pinned host path. Without an NVIDIA driver they are skipped, and say so; on
//! the GPU machine they run against the real device (see docs/benchmarks.md for the record).

// The transport's test helpers (its harness, guards, leak counters), shared with its own tests.
#[path = "../../crates/tensorport/tests/support/mod.rs"]
mod support;

mod checking;
mod device;
mod farm;
mod memory;
#[cfg(feature = "cuda")]
mod model;
/// The in-process model tests need the CUDA build of tensorport-dfdx.
#[cfg(not(feature = "cuda"))]
mod model {
    pub(crate) fn cudnn_model_matches_the_cpu_model() {
        println!("  skipped: needs the CUDA build (scripts/build-gpu.sh)");
    }
}
mod nixl;
mod onnx;
mod pinned;
mod serve;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use checking::*;
use device::*;
use farm::*;
use memory::*;
use model::*;
use nixl::*;
use onnx::*;
use pinned::*;
use serve::*;
use support::*;
use tensorport::{DType, TensorSpec};
use tensorport::{Server, ServerConfig};
use tensorport_cuda::{
    live_imports, live_registrations, CudaImporter, CudaPin, DeviceBuffer, Fence, Gpu, GpuProducer,
    GpuProducerConfig, Sharing, Stream,
};

fn main() {
    let tests: &[(&str, fn())] = &[
        ("probe_sees_the_device", probe),
        (
            "pinned_pools_four_producers_intact_through_the_gpu",
            pinned_four_producers,
        ),
        (
            "killed_producer_leaves_no_registration_or_mapping",
            killed_producer,
        ),
        ("farm_on_cuda_matches_the_cpu_model", farm_on_cuda),
        (
            "cudnn_model_matches_the_cpu_model_at_every_precision",
            cudnn_model_matches_the_cpu_model,
        ),
        ("nvjpeg_tensors_match_the_cpu_preprocessing", nvjpeg_tensors),
        (
            "nvjpeg_hybrid_decoders_on_444_match_the_engines",
            nvjpeg_hybrid_444,
        ),
        (
            "nvjpeg_split_replicating_420_matches_the_engines",
            nvjpeg_split_420,
        ),
        (
            "nvjpeg_batches_of_mixed_chroma_match_the_cpu_preprocessing",
            nvjpeg_mixed_chroma,
        ),
        (
            "farm_with_gpu_decoding_producers_every_input_once",
            farm_gpu_producers,
        ),
        ("device_tensors_into_the_cuda_model", device_into_model),
        (
            "device_tensors_through_a_sink_are_released",
            sink_releases_device_tensors,
        ),
        (
            "device_ipc_four_gpu_producers_intact_and_fenced",
            device_four_producers,
        ),
        (
            "device_ipc_timeline_fenced_four_gpu_producers_intact",
            device_four_producers_timeline,
        ),
        (
            "device_vmm_fd_four_gpu_producers_intact",
            device_four_producers_vmm,
        ),
        (
            "device_gathered_batches_of_mixed_fences_intact",
            device_gathered_mixed_fences,
        ),
        (
            "device_cross_gpu_producers_intact_and_fenced",
            device_cross_gpu,
        ),
        (
            "farm_over_two_gpus_survives_a_sigkilled_server_every_input_once",
            farm_two_gpus_server_killed,
        ),
        (
            "device_ipc_killed_producer_frees_gpu_memory",
            device_killed_producer,
        ),
        (
            "device_vmm_killed_producer_frees_gpu_memory",
            device_vmm_killed_producer,
        ),
        (
            "device_regions_are_checked_before_use",
            device_regions_are_checked_before_use,
        ),
        (
            "device_registrations_that_lie_about_their_length_are_refused",
            lying_registrations,
        ),
        (
            "device_fence_never_signalled_fails_that_request_and_ends_only_that_session",
            fence_never_signalled,
        ),
        (
            "device_event_signalled_after_the_timeout_stalls_nothing",
            event_fence_signalled_late,
        ),
        (
            "device_killed_producer_with_an_unsignalled_tensor_stalls_no_other",
            killed_with_unsignalled_tensor,
        ),
        (
            "nixl_device_tensors_through_the_gateway_intact_and_reclaimed",
            nixl_device_tensors_through_the_gateway,
        ),
        (
            "onnx_models_on_the_gpu_score_as_onnxruntime_on_the_cpu",
            onnx_on_gpu,
        ),
        (
            "farm_under_mps_every_input_once_when_its_mps_server_dies",
            farm_under_mps_server_killed,
        ),
        (
            "farm_under_mps_every_input_once_when_a_client_faults",
            farm_under_mps_client_fault,
        ),
    ];
    if std::env::var(CHILD_ENV).is_err() {
        if let Err(e) = tensorport_cuda::probe() {
            let n = tests.len();
            println!("skipped: {n} GPU tests: {e}");
            println!("\n0 passed, 0 failed, {n} skipped");
            return;
        }
    }
    support::main(tests, child);
}

fn child(role: &str, socket: &str) {
    match role {
        "producer" => checked_producer(socket),
        "gpu-producer" => gpu_producer(socket),
        "lying-device" => lying_device(socket),
        "silent-gpu-producer" => silent_gpu_producer(socket),
        r => panic!("unknown role {r}"),
    }
}

fn probe() {
    let c = tensorport_cuda::probe().unwrap();
    println!("  driver {}; {:?}", c.driver_version, c.devices);
    let d = &c.devices[0];
    assert!(d.host_register, "cuMemHostRegister unsupported");
    assert!(d.compute_capability.0 >= 7);
}

/// Whether this machine has two GPUs; if not, says the test is skipped.
fn two_gpus() -> bool {
    let n = tensorport_cuda::probe()
        .map(|c| c.devices.len())
        .unwrap_or(0);
    if n < 2 {
        println!("  skipped: this machine has {n} GPU (run on a two-GPU machine)");
    }
    n >= 2
}

/// The CUDA `tensorport` binary these tests start: `TENSORPORT_BIN` if set, else a `tensorport`
/// beside this test binary (scripts/build-gpu.sh puts `gpu-tests` and `tensorport` together in
/// dist/gpu), else the one cargo built with this test.
fn tensorport_exe() -> String {
    if let Ok(p) = std::env::var("TENSORPORT_BIN") {
        return p;
    }
    let sibling = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("tensorport")))
        .filter(|p| p.is_file());
    match sibling {
        Some(p) => p.display().to_string(),
        None => env!("CARGO_BIN_EXE_tensorport").into(),
    }
}

/// Runs the CUDA `tensorport` with `args`; panics with its output if it fails.
fn tp(args: &[&str]) -> String {
    let o = std::process::Command::new(tensorport_exe())
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "tensorport {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

/// Sample images: `tensorport images` (half PNG, half JPEG) and a file that only looks like a
/// JPEG; returns the folder and a folder with only the JPEGs.
/// A result line's scores.
fn line_scores(v: &serde_json::Value) -> Vec<f32> {
    v["scores"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn sample_images(dir: &std::path::Path, count: u32) -> (String, String) {
    let all = dir.join("images");
    tp(&[
        "images",
        "--out",
        all.to_str().unwrap(),
        "--count",
        &count.to_string(),
    ]);
    let jpegs = dir.join("jpegs");
    std::fs::create_dir_all(&jpegs).unwrap();
    for e in std::fs::read_dir(&all).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "jpg") {
            std::fs::copy(&p, jpegs.join(p.file_name().unwrap())).unwrap();
        }
    }
    (all.display().to_string(), jpegs.display().to_string())
}
