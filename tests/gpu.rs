//! GPU tests of the pinned host path. Without an NVIDIA driver they are skipped, and say so; on
//! the GPU machine they run against the real device (see docs/benchmarks.md for the record).

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::*;
use tensorport::{DType, TensorSpec};
use tensorport::{Server, ServerConfig};
use tensorport_cuda::{
    live_imports, live_registrations, CudaImporter, CudaPin, DeviceBuffer, Fence, Gpu, GpuProducer,
    Stream,
};

fn main() {
    if std::env::var(CHILD_ENV).is_err() {
        if let Err(e) = tensorport_cuda::probe() {
            println!("skipped: 18 GPU tests: {e}");
            println!("\n0 passed, 0 failed, 18 skipped");
            return;
        }
    }
    support::main(
        &[
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
            ("nvjpeg_tensors_match_the_cpu_preprocessing", nvjpeg_tensors),
            (
                "farm_with_gpu_decoding_producers_every_input_once",
                farm_gpu_producers,
            ),
            ("device_tensors_into_the_cuda_model", device_into_model),
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
                "device_registrations_that_lie_about_their_length_are_refused",
                lying_registrations,
            ),
            (
                "device_fence_never_signalled_fails_that_request_and_ends_only_that_session",
                fence_never_signalled,
            ),
            (
                "device_killed_producer_with_an_unsignalled_tensor_stalls_no_other",
                killed_with_unsignalled_tensor,
            ),
        ],
        child,
    );
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

/// A server whose pools are registered with the GPU, and whose consumer copies every tensor to
/// the device (async, on a stream), releases the slot only after that copy completed, copies it
/// back and checks it: a slot released before its DMA finished would show as a torn tensor,
/// since producers rewrite a slot as soon as it is granted again.
struct GpuServer {
    server: Arc<Server>,
    stop: Arc<AtomicBool>,
    verified: Arc<AtomicU64>,
    torn: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GpuServer {
    fn start(sock: &std::path::Path) -> GpuServer {
        GpuServer::start_with(sock, false)
    }

    /// `gathered`: the consumer takes up to 8 requests at once and moves their device tensors
    /// with one `tensorport_cuda::Gatherer::gather` (host tensors as above).
    fn start_with(sock: &std::path::Path, gathered: bool) -> GpuServer {
        let gpu = Gpu::open(0).unwrap();
        let mut cfg = ServerConfig::new(sock);
        cfg.pin = Some(Arc::new(CudaPin::new(gpu.clone())));
        cfg.device = Some(Arc::new(CudaImporter::new(gpu.clone())));
        let server = Arc::new(Server::bind(cfg).unwrap());
        let (stop, verified, torn) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let (s, st, v, t) = (server.clone(), stop.clone(), verified.clone(), torn.clone());
        let thread = std::thread::spawn(move || {
            gpu.bind().unwrap();
            let stream = Stream::new(&gpu).unwrap();
            let dev = DeviceBuffer::new(&gpu, 1 << 20).unwrap();
            let mut back = vec![0u8; 1 << 20];
            if gathered {
                gathered_loop(&s, &st, &v, &t, &gpu, &stream);
                return;
            }
            while !st.load(Ordering::SeqCst) {
                let req = match s.recv_timeout(Duration::from_millis(50)) {
                    Ok(Some(r)) => r,
                    Ok(None) => continue,
                    Err(_) => break,
                };
                if let Some(dt) = req.device().cloned() {
                    // The device path: wait on the producer's "ready" event on our stream, copy,
                    // record "released", give the buffer back; then check what we copied.
                    let n = dt.len() as usize;
                    // SAFETY: our stream is live and in the server's context; the tensor's
                    // bounds were checked against the registered buffer.
                    unsafe {
                        dt.wait_ready(stream.raw()).unwrap();
                        dev.copy_from_device_async(dt.ptr(), n, &stream).unwrap();
                        dt.record_release(stream.raw()).unwrap();
                    }
                    let responder = req.release();
                    stream.synchronize().unwrap();
                    dev.copy_to_host(&mut back[..n]).unwrap();
                    let _ = responder.respond(&check_copy(&back[..n], &v, &t));
                    continue;
                }
                let n = req.bytes().len();
                let answer = encode_answer(
                    checksum(req.bytes()),
                    req.desc().numel(),
                    req.desc().dtype(),
                );
                // SAFETY: `req` holds the slot (and its bytes unchanged) until it is answered
                // below, after the event recorded behind the copy has completed.
                unsafe { dev.copy_from_host_async(req.bytes(), &stream).unwrap() };
                stream.copy_done().unwrap().wait().unwrap(); // the DMA has read the slot
                                                             // Now the slot may be reused. A producer killed meanwhile: SessionGone, fine.
                let _ = req.respond(&answer);
                dev.copy_to_host(&mut back[..n]).unwrap();
                if verify(&back[..n]) {
                    v.fetch_add(1, Ordering::SeqCst);
                } else {
                    t.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        GpuServer {
            server,
            stop,
            verified,
            torn,
            thread: Some(thread),
        }
    }
}

/// The consumer of [`GpuServer::start_with`] `gathered`: batches of up to 8, their device
/// tensors copied into rows of one buffer by one `Gatherer::gather`, each row then checked.
fn gathered_loop(
    s: &Server,
    stop: &AtomicBool,
    verified: &AtomicU64,
    torn: &AtomicU64,
    gpu: &Arc<Gpu>,
    stream: &Stream,
) {
    const ROW: usize = 1 << 20;
    let rows = DeviceBuffer::new(gpu, 8 * ROW).unwrap();
    let gatherer = tensorport_cuda::Gatherer::new(gpu);
    assert!(gatherer.uses_kernel(), "the copy kernel did not compile");
    let mut back = vec![0u8; ROW];
    let (mut batches, mut most) = (0u64, 0usize);
    while !stop.load(Ordering::SeqCst) {
        let reqs = match s.recv_batch(8, Duration::from_millis(50), Duration::from_micros(200)) {
            Ok(b) if b.is_empty() => continue,
            Ok(b) => b,
            Err(_) => break,
        };
        let (dev, host): (Vec<_>, Vec<_>) = reqs.into_iter().partition(|r| r.device().is_some());
        assert!(host.is_empty(), "this server takes device tensors only");
        let copies: Vec<_> = dev
            .iter()
            .enumerate()
            .map(|(k, r)| {
                let t = r.device().unwrap();
                assert!(t.len() as usize <= ROW);
                (t, rows.ptr() + (k * ROW) as u64)
            })
            .collect();
        // SAFETY: our stream is in the server's context, where the buffers were imported; row
        // k of `rows` holds ROW bytes, at least each tensor's (checked), and only we write it.
        unsafe { gatherer.gather(stream, &copies).unwrap() };
        let lens: Vec<usize> = copies.iter().map(|c| c.0.len() as usize).collect();
        let responders: Vec<_> = dev.into_iter().map(|r| r.release()).collect();
        stream.synchronize().unwrap();
        batches += 1;
        most = most.max(responders.len());
        for (k, (r, n)) in responders.into_iter().zip(lens).enumerate() {
            rows.copy_to_host_at(k * ROW, &mut back[..n]).unwrap();
            let _ = r.respond(&check_copy(&back[..n], verified, torn));
        }
    }
    println!("  gathered in {batches} batches, the largest of {most}");
}

/// A GPU producer's tensor as copied back: every 4-byte word must be the first (the producer
/// filled it with one value). Counts it as verified or torn, and returns the answer the
/// producer checks: the word, then 1 if the tensor was uniform.
fn check_copy(back: &[u8], verified: &AtomicU64, torn: &AtomicU64) -> Vec<u8> {
    let first = [back[0], back[1], back[2], back[3]];
    let uniform = back.chunks_exact(4).all(|c| c == first);
    if uniform {
        verified.fetch_add(1, Ordering::SeqCst);
    } else {
        torn.fetch_add(1, Ordering::SeqCst);
    }
    let mut answer = first.to_vec();
    answer.push(uniform as u8);
    answer
}

impl Drop for GpuServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn pinned_four_producers() {
    let (_dir, sock) = socket_dir();
    let maps0 = pool_mappings();
    let srv = GpuServer::start(&sock);
    let mut kids = spawn_checked_producers(&sock, 4, 1000);
    assert!(eventually(PATIENCE, || live_registrations() == 4));
    wait_all_ok(&mut kids, Duration::from_secs(120));
    println!(
        "  {} tensors through the GPU, {} torn",
        srv.verified.load(Ordering::SeqCst),
        srv.torn.load(Ordering::SeqCst)
    );
    assert_eq!(srv.verified.load(Ordering::SeqCst), 4000);
    assert_eq!(srv.torn.load(Ordering::SeqCst), 0);
    assert!(eventually(PATIENCE, || srv
        .server
        .status()
        .sessions
        .is_empty()
        && live_registrations() == 0
        && pool_mappings() == maps0));
}

fn killed_producer() {
    let (_dir, sock) = socket_dir();
    let maps0 = pool_mappings();
    let srv = GpuServer::start(&sock);
    let mut k = spawn_child(
        "producer",
        &[
            socket_env(&sock),
            ("TP_ID", "9".into()),
            ("TP_COUNT", "100000".into()),
        ],
    );
    assert!(eventually(PATIENCE, || srv.verified.load(Ordering::SeqCst) > 200));
    assert_eq!(live_registrations(), 1);
    k.kill9();
    assert!(
        eventually(PATIENCE, || live_registrations() == 0
            && pool_mappings() == maps0),
        "registrations {} mappings {}",
        live_registrations(),
        pool_mappings()
    );
    assert_eq!(srv.torn.load(Ordering::SeqCst), 0);
    assert_eq!(srv.server.status().totals.sessions_reclaimed, 1);
}

/// The farm with `--device cuda` (a dfdx `Cuda` model fed from pinned pools) gives the CPU
/// model's scores, within 1e-3 (relative) — different kernels sum in different orders — and
/// the same classes.
fn farm_on_cuda() {
    for pixels in ["f32", "u8"] {
        farm_on_cuda_with(pixels);
    }
}

/// The farm on the CUDA model, producers handing over `pixels` (u8 planes are normalised on the
/// GPU), against the CPU model in-process.
fn farm_on_cuda_with(pixels: &str) {
    use tensorport_dfdx::dfdx::prelude::Cpu;
    use tensorport_dfdx::{ImageClassifier, ModelConfig};
    let exe = tensorport_exe();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gpu.jsonl");
    let n = 256;
    let size = 64usize;
    let o = std::process::Command::new(&exe)
        .args(["farm", "--device", "cuda", "--synthetic", &n.to_string()])
        .args([
            "--image-size",
            &size.to_string(),
            "--producers",
            "4",
            "--progress",
            "never",
            "--pixels",
            pixels,
        ])
        .arg("--output")
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "farm --device cuda failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    println!(
        "{}",
        stdout
            .lines()
            .map(|l| format!("  {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let cfg = ModelConfig {
        image_size: size,
        classes: 10,
        width: 16,
    };
    let model = ImageClassifier::from_seed(&Cpu::default(), cfg, 0).unwrap();
    let mut px = vec![0f32; 3 * size * size];
    let (mut worst, mut same_class, mut lines) = (0f32, 0, 0);
    for line in std::fs::read_to_string(&out).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let src: tensorport_vision::Source = v["input"].as_str().unwrap().parse().unwrap();
        tensorport_vision::prepare(&src, size as u32, &mut px).unwrap();
        let want = &model.forward_flat(px.clone(), 1)[0];
        let got: Vec<f32> = v["scores"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        for (g, w) in got.iter().zip(want) {
            worst = worst.max((g - w).abs() / (1.0 + w.abs()));
        }
        let argmax = |s: &[f32]| {
            s.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0
        };
        same_class += (argmax(&got) == argmax(want)) as usize;
        lines += 1;
    }
    println!("  --pixels {pixels}: {lines} results; max relative difference from the CPU model {worst:.2e}; same class {same_class}/{lines}");
    assert_eq!(lines, n);
    assert!(
        worst <= 1e-3,
        "GPU scores differ from the CPU model by {worst}"
    );
    assert_eq!(same_class, n);
}

/// A GPU producer process: two buffers of `TP_MIB` MiB, `TP_COUNT` hand-offs, each buffer
/// filled on the GPU with a word unique to the hand-off and reused as soon as it is released.
fn gpu_producer(socket: &str) {
    let id: u32 = env_or("TP_ID", "0").parse().unwrap();
    let count: u32 = env_or("TP_COUNT", "200").parse().unwrap();
    let mib: usize = env_or("TP_MIB", "1").parse().unwrap();
    let gpu = Gpu::open(env_or("TP_GPU", "0").parse().unwrap()).unwrap();
    let name = format!("gpu-producer-{id}");
    let mut p = match env_or("TP_FENCE", "event").as_str() {
        "vmm" => GpuProducer::connect_vmm(socket, &name, &gpu, 2, mib << 20),
        "timeline" => GpuProducer::connect_with(socket, &name, &gpu, 2, mib << 20, Fence::Timeline),
        _ => GpuProducer::connect_with(socket, &name, &gpu, 2, mib << 20, Fence::Event),
    }
    .unwrap();
    // Tensors of this many 32-bit words (1 MiB by default) from the start of each buffer, less
    // the offset.
    let words: u64 = env_or("TP_WORDS", "262144").parse().unwrap();
    // Bytes into the buffer where the tensor starts (a multiple of 4; not of 16 takes the copy
    // kernels' byte paths).
    let offset: u64 = env_or("TP_OFFSET", "0").parse().unwrap();
    let mut expected = std::collections::HashMap::new();
    let (mut ok, mut bad) = (0u32, 0u32);
    let mut check = |c: tensorport::Completion,
                     expected: &mut std::collections::HashMap<u64, u32>| {
        let want = expected.remove(&c.request_id);
        match (want, c.result) {
            (Some(w), Ok(b)) if b.len() == 5 && b[..4] == w.to_le_bytes() && b[4] == 1 => ok += 1,
            (w, r) => {
                bad += 1;
                eprintln!("request {}: wanted {w:?}, got {r:?}", c.request_id);
            }
        }
    };
    for seq in 0..count {
        let b = p.acquire(Duration::from_secs(20)).unwrap();
        let value = (id << 24) | (seq & 0xff_ffff);
        p.buffer(b)
            .fill_u32_range_async(0, 1 << 20, value, p.stream())
            .unwrap();
        let rid = p
            .submit(
                b,
                &TensorSpec::new(DType::I32, &[words - offset / 4]).at_offset(offset),
            )
            .unwrap();
        expected.insert(rid, value);
        while let Some(c) = p.producer().try_recv_result().unwrap() {
            check(c, &mut expected);
        }
    }
    while p.producer().in_flight() > 0 {
        let c = p.producer().recv_result(Duration::from_secs(20)).unwrap();
        check(c, &mut expected);
    }
    println!("ok={ok} bad={bad}");
    std::process::exit(if ok == count && bad == 0 { 0 } else { 1 });
}

fn device_four_producers() {
    four_gpu_producers("event");
}

fn device_four_producers_timeline() {
    four_gpu_producers("timeline");
}

fn device_four_producers_vmm() {
    four_gpu_producers("vmm");
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

/// Producers on GPU 1 hand their buffers to a server on GPU 0: legacy IPC opened with peer
/// access, VMM mapped for the server's device, fences waited on across the two.
fn device_cross_gpu() {
    if !two_gpus() {
        return;
    }
    for fence in ["event", "timeline", "vmm"] {
        println!("  producers on GPU 1, server on GPU 0, {fence} fences:");
        four_gpu_producers_on(fence, 1);
    }
}

fn four_gpu_producers(fence: &str) {
    four_gpu_producers_on(fence, 0);
}

/// Four producers with three kinds of fences (two timeline, one event, one VMM) into a server
/// that takes batches and moves them with one `Gatherer::gather` each: the timeline fences
/// batched, the event ones alone, every tensor checked intact. The second producer's tensors
/// start 4 bytes into its buffers (the kernel's byte-by-byte path).
fn device_gathered_mixed_fences() {
    four_producers(&["timeline", "timeline", "event", "vmm"], 0, true);
}

fn four_gpu_producers_on(fence: &str, gpu: u32) {
    four_producers(&[fence; 4], gpu, false);
}

fn four_producers(fences: &[&str; 4], gpu: u32, gathered: bool) {
    let (_dir, sock) = socket_dir();
    let srv = GpuServer::start_with(&sock, gathered);
    let mut kids: Vec<ChildGuard> = (0..4)
        .map(|i| {
            spawn_child(
                "gpu-producer",
                &[
                    socket_env(&sock),
                    ("TP_ID", i.to_string()),
                    ("TP_COUNT", "500".into()),
                    ("TP_FENCE", fences[i].into()),
                    ("TP_GPU", gpu.to_string()),
                    (
                        "TP_OFFSET",
                        if gathered && i == 1 { "4" } else { "0" }.into(),
                    ),
                    // Gathered: the two timeline producers' tensors are small (4 KiB, and
                    // 63,996 bytes from 4 bytes in) beside the others' 1 MiB.
                    (
                        "TP_WORDS",
                        match (gathered, i) {
                            (true, 0) => "1024",
                            (true, 1) => "16000",
                            _ => "262144",
                        }
                        .into(),
                    ),
                ],
            )
        })
        .collect();
    assert!(
        eventually(PATIENCE, || live_imports() == 8),
        "imports {}",
        live_imports()
    );
    wait_all_ok(&mut kids, Duration::from_secs(120));
    println!(
        "  {} device hand-offs copied and checked, {} torn or stale",
        srv.verified.load(Ordering::SeqCst),
        srv.torn.load(Ordering::SeqCst)
    );
    assert_eq!(srv.verified.load(Ordering::SeqCst), 2000);
    assert_eq!(srv.torn.load(Ordering::SeqCst), 0);
    assert!(
        eventually(PATIENCE, || live_imports() == 0),
        "imports {}",
        live_imports()
    );
}

fn device_killed_producer() {
    killed_gpu_producer("event");
}

fn device_vmm_killed_producer() {
    killed_gpu_producer("vmm");
}

fn killed_gpu_producer(sharing: &str) {
    let (_dir, sock) = socket_dir();
    let srv = GpuServer::start(&sock);
    let gpu = Gpu::open(0).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let free0 = gpu.mem_info().unwrap().0;
    let mut k = spawn_child(
        "gpu-producer",
        &[
            socket_env(&sock),
            ("TP_ID", "5".into()),
            ("TP_COUNT", "1000000".into()),
            ("TP_MIB", "512".into()),
            ("TP_FENCE", sharing.into()),
        ],
    );
    assert!(eventually(PATIENCE, || srv.verified.load(Ordering::SeqCst) > 50));
    let free_busy = gpu.mem_info().unwrap().0;
    assert_eq!(live_imports(), 2);
    k.kill9();
    assert!(
        eventually(PATIENCE, || live_imports() == 0
            && srv.server.status().totals.sessions_reclaimed == 1),
        "imports {}",
        live_imports()
    );
    // The producer's memory (and context) return to the device once nothing maps them.
    let mut free1 = 0;
    assert!(
        eventually(PATIENCE, || {
            free1 = gpu.mem_info().unwrap().0;
            free1 + (64 << 20) >= free0
        }),
        "free device memory {free0} before, {free1} after"
    );
    println!(
        "  free device memory: {} MiB before, {} MiB with the producer's 2 x 512 MiB buffers, {} MiB after its SIGKILL",
        free0 >> 20,
        free_busy >> 20,
        free1 >> 20
    );
    assert_eq!(srv.torn.load(Ordering::SeqCst), 0);
}

/// The image side of the `serve --device cuda` tests.
const MODEL_SIZE: usize = 32;

/// `tensorport serve --device cuda` for [`MODEL_SIZE`] images on `sock`, with `extra`
/// arguments; returns once it listens.
fn start_cuda_serve(sock: &std::path::Path, extra: &[&str]) -> ChildGuard {
    let mut server = ChildGuard(Some(
        std::process::Command::new(tensorport_exe())
            .args([
                "serve",
                "--device",
                "cuda",
                "--image-size",
                &MODEL_SIZE.to_string(),
            ])
            .args(extra)
            .arg("--socket")
            .arg(sock)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    ));
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(server.0.as_mut().unwrap().stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.starts_with("ready"), "{line}");
    server
}

/// A timeline-fenced GPU producer of [`MODEL_SIZE`] f32 images, connected to `sock`.
fn image_producer(sock: &std::path::Path, name: &str, gpu: &Arc<Gpu>) -> GpuProducer {
    GpuProducer::connect_with(sock, name, gpu, 2, image_bytes(), Fence::Timeline).unwrap()
}

fn image_bytes() -> usize {
    3 * MODEL_SIZE * MODEL_SIZE * 4
}

fn image_spec() -> TensorSpec {
    TensorSpec::new(DType::F32, &[3, MODEL_SIZE as u64, MODEL_SIZE as u64])
}

/// Submits an image of `v` everywhere (filled on the producer's GPU).
fn submit_image(p: &mut GpuProducer, v: f32) -> u64 {
    let b = p.acquire(Duration::from_secs(20)).unwrap();
    p.buffer(b)
        .fill_u32_range_async(0, image_bytes(), v.to_bits(), p.stream())
        .unwrap();
    p.submit(b, &image_spec()).unwrap()
}

/// How far a result's scores are from the CPU model's on an image of `v` everywhere (the
/// largest relative difference).
fn score_error(c: tensorport::Completion, v: f32) -> f32 {
    use tensorport_dfdx::dfdx::prelude::Cpu;
    use tensorport_dfdx::{scores_from_bytes, ImageClassifier, ModelConfig};
    let cfg = ModelConfig {
        image_size: MODEL_SIZE,
        classes: 10,
        width: 16,
    };
    let model = ImageClassifier::from_seed(&Cpu::default(), cfg, 0).unwrap();
    let got = scores_from_bytes(&c.result.unwrap()).unwrap();
    let want = &model.forward_flat(vec![v; 3 * MODEL_SIZE * MODEL_SIZE], 1)[0];
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(0f32, f32::max)
}

/// `n` images, one at a time, each answered with the CPU model's scores; the worst error.
fn images_answered_right(p: &mut GpuProducer, n: usize) -> f32 {
    let mut worst = 0f32;
    for k in 0..n {
        let v = -1.0 + 0.3 * k as f32;
        submit_image(p, v);
        let c = p.producer().recv_result(Duration::from_secs(30)).unwrap();
        worst = worst.max(score_error(c, v));
    }
    assert!(worst <= 1e-3, "{worst}");
    worst
}

/// A GPU producer hands device tensors to `tensorport serve --device cuda`, which copies them
/// device-to-device into the model's input: the scores equal the CPU model's on the same images.
fn device_into_model() {
    let (_dir, sock) = socket_dir();
    let _server = start_cuda_serve(&sock, &[]);
    let gpu = Gpu::open(0).unwrap();
    let mut p = image_producer(&sock, "gpu-images", &gpu);
    let worst = images_answered_right(&mut p, 8);
    println!("  8 device images through the CUDA model; max relative difference from the CPU model {worst:.2e}");
}

/// A GPU producer that submits a timeline value it never writes: `serve --device cuda` lets
/// the wait through after its fence timeout, fails that request (FenceTimeout) and ends that
/// session only; an honest producer's images, held up meanwhile or sent after, are all
/// answered with the model's scores.
fn fence_never_signalled() {
    use tensorport::wire::ErrorCode;
    let (_dir, sock) = socket_dir();
    let _server = start_cuda_serve(&sock, &["--fence-timeout-ms", "1000"]);
    let gpu = Gpu::open(0).unwrap();
    let mut liar = image_producer(&sock, "liar", &gpu);
    let mut honest = image_producer(&sock, "honest", &gpu);
    let b = liar.acquire(Duration::from_secs(20)).unwrap();
    let t0 = std::time::Instant::now();
    // Its GPU never writes this value.
    let id = liar
        .producer()
        .submit_device(b as u32, &image_spec(), Some(1 << 40))
        .unwrap();
    // The first of these wait behind the liar's batch until the fence timeout.
    let worst = images_answered_right(&mut honest, 8);
    let c = liar.producer().recv_result(PATIENCE).unwrap();
    let waited = t0.elapsed();
    assert_eq!(c.request_id, id);
    let e = c
        .result
        .expect_err("a tensor never signalled ready is not answered with scores");
    assert_eq!(e.code, ErrorCode::FenceTimeout, "{e}");
    assert!(waited >= Duration::from_secs(1), "failed after {waited:?}");
    // Its session is over: a question to the server gets no answer but the end.
    let next = liar.producer().status(Duration::from_secs(30));
    assert!(next.is_err(), "the liar's session goes on: {next:?}");
    // The server goes on for the others, with nothing held up.
    let after = images_answered_right(&mut honest, 8);
    println!(
        "  the unsignalled tensor failed after {:.2} s ({e}); the session then: {}",
        waited.as_secs_f64(),
        next.unwrap_err()
    );
    println!(
        "  the honest producer's 16 images answered right (worst relative difference {:.2e})",
        worst.max(after)
    );
}

/// The child of [`killed_with_unsignalled_tensor`]: submits a tensor whose "ready" value its GPU
/// never writes, says so on stdout, and waits to be killed.
fn silent_gpu_producer(socket: &str) {
    let gpu = Gpu::open(0).unwrap();
    let mut p = image_producer(std::path::Path::new(socket), "silent", &gpu);
    let b = p.acquire(Duration::from_secs(20)).unwrap();
    p.producer()
        .submit_device(b as u32, &image_spec(), Some(1 << 40))
        .unwrap();
    println!("submitted");
    std::thread::sleep(Duration::from_secs(600));
}

/// A producer killed (SIGKILL) with a tensor its GPU never signalled: with a fence timeout far
/// beyond the test (10 min), only the end of its session can let the server's wait through, and
/// it does: an image held up behind it is answered once the producer is killed, and more after.
fn killed_with_unsignalled_tensor() {
    let (_dir, sock) = socket_dir();
    let _server = start_cuda_serve(&sock, &["--fence-timeout-ms", "600000"]);
    let gpu = Gpu::open(0).unwrap();
    let mut silent = spawn_child("silent-gpu-producer", &[socket_env(&sock)]);
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(silent.0.as_mut().unwrap().stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "submitted");
    let mut honest = image_producer(&sock, "honest", &gpu);
    // Images until one is held up (the server took the silent tensor first, or soon after).
    let mut held = None;
    for k in 0..5 {
        let v = 0.25 * k as f32;
        submit_image(&mut honest, v);
        match honest.producer().recv_result(Duration::from_secs(2)) {
            Ok(c) => assert!(score_error(c, v) <= 1e-3),
            Err(tensorport::Error::Timeout(..)) => {
                held = Some(v);
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let v = held.expect("no image was held up behind the unsignalled tensor in 5 tries");
    silent.kill9();
    let c = honest.producer().recv_result(PATIENCE).unwrap();
    let worst = score_error(c, v).max(images_answered_right(&mut honest, 8));
    assert!(worst <= 1e-3, "{worst}");
    println!(
        "  an image held up behind the silent producer's tensor was answered after its SIGKILL, and 8 more (worst relative difference {worst:.2e})"
    );
}

/// The CUDA `tensorport` binary these tests start: `TENSORPORT_BIN` if set, else a `tensorport`
/// beside this test binary (bin/build-gpu.sh puts `gpu-tests` and `tensorport` together in
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

/// A producer that registers device buffers with lengths longer than their allocations (legacy
/// IPC and VMM), and one past any GPU: each is refused, saying why, and the honest registration
/// of the same buffer after it is accepted.
fn lying_device(socket: &str) {
    use std::os::fd::AsRawFd;
    use tensorport::wire::{ClientMsg, ErrorCode, RawDeviceHandle, ServerMsg};
    let gpu = Gpu::open(0).unwrap();
    gpu.bind().unwrap();
    let mut r = Raw::connect(std::path::Path::new(socket));
    r.hello(1);
    let register =
        |r: &mut Raw, buffer: u32, len: u64, handle: RawDeviceHandle, fd: Option<i32>| {
            let msg = ClientMsg::RegisterDevice {
                buffer,
                len,
                handle,
            };
            match fd {
                None => r.send(&msg),
                Some(fd) => {
                    let frame = tensorport::wire::encode_frame(&msg).unwrap();
                    nix::sys::socket::sendmsg::<()>(
                        r.s.as_raw_fd(),
                        &[std::io::IoSlice::new(&frame)],
                        &[nix::sys::socket::ControlMessage::ScmRights(&[fd])],
                        nix::sys::socket::MsgFlags::empty(),
                        None,
                    )
                    .unwrap();
                }
            }
            match r.recv() {
                Some(ServerMsg::DeviceRegistered { .. }) => Ok(()),
                Some(ServerMsg::Error { code, message, .. }) => {
                    Err((ErrorCode::from_u16(code), message))
                }
                other => panic!("unexpected {other:?}"),
            }
        };
    // Legacy IPC, timeline-fenced: 1 MiB allocated (data, then 16 bytes of semaphores).
    let mem = DeviceBuffer::new(&gpu, 1 << 20).unwrap();
    let handle = gpu.driver().ipc_get_mem_handle(mem.ptr()).unwrap();
    let ipc = || RawDeviceHandle::LegacyIpcTimeline {
        memory: handle.to_vec(),
    };
    let (code, why) = register(&mut r, 0, 64 << 20, ipc(), None).unwrap_err();
    println!("  64 MiB claimed for a 1 MiB IPC allocation: {code:?}: {why}");
    assert_eq!(code, ErrorCode::OutOfBounds);
    assert!(why.contains("register its true length"), "{why}");
    // One byte too many for what the driver says the allocation holds: the semaphores would
    // not fit. Its true length is accepted.
    let (_, held) = gpu.driver().mem_address_range(mem.ptr()).unwrap();
    let (code, _) = register(&mut r, 0, held as u64 - 15, ipc(), None).unwrap_err();
    assert_eq!(code, ErrorCode::OutOfBounds);
    register(&mut r, 0, held as u64 - 16, ipc(), None).unwrap();
    // Past any GPU (and near overflowing the arithmetic): refused before the driver is asked.
    let (code, _) = register(&mut r, 1, u64::MAX - 8, ipc(), None).unwrap_err();
    assert_eq!(code, ErrorCode::OutOfBounds);
    // VMM: the allocation is one granule; a length of 64 MiB cannot be mapped from it.
    let vmm = DeviceBuffer::new_exportable(&gpu, 1 << 20).unwrap();
    let fd = vmm.export_fd().unwrap();
    let (code, why) = register(
        &mut r,
        2,
        64 << 20,
        RawDeviceHandle::VmmPosixFd,
        Some(fd.as_raw_fd()),
    )
    .unwrap_err();
    println!(
        "  64 MiB claimed for a {} byte VMM allocation: {code:?}: {why}",
        vmm.len()
    );
    assert!(
        matches!(code, ErrorCode::OutOfBounds | ErrorCode::Malformed),
        "{code:?}"
    );
    register(
        &mut r,
        2,
        vmm.len() as u64 - 16,
        RawDeviceHandle::VmmPosixFd,
        Some(fd.as_raw_fd()),
    )
    .unwrap();
    println!("ok");
}

fn lying_registrations() {
    let (_dir, sock) = socket_dir();
    let srv = GpuServer::start(&sock);
    let mut k = spawn_child("lying-device", &[socket_env(&sock)]);
    let out = k.wait_ok(PATIENCE);
    print!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok"));
    // Only the two honest registrations were ever open, and they close with the session.
    assert!(eventually(PATIENCE, || live_imports() == 0));
    srv.stop.store(true, Ordering::SeqCst);
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

/// `prep --nvjpeg --dump` against `prep --dump` (the CPU producers' tensors) on the same JPEGs:
/// the two decoders and resamplers agree to within a few 8-bit levels.
fn nvjpeg_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let (_, jpegs) = sample_images(dir.path(), 48);
    let (g, c) = (dir.path().join("g.st"), dir.path().join("c.st"));
    let said = tp(&[
        "prep",
        "--input",
        &jpegs,
        "--nvjpeg",
        "--batch",
        "8",
        "--repeat",
        "1",
        "--dump",
        g.to_str().unwrap(),
    ]);
    println!("  {}", said.trim().replace('\n', "\n  "));
    tp(&[
        "prep",
        "--input",
        &jpegs,
        "--repeat",
        "1",
        "--dump",
        c.to_str().unwrap(),
    ]);
    let (gb, cb) = (std::fs::read(&g).unwrap(), std::fs::read(&c).unwrap());
    let (gt, ct) = (
        safetensors::SafeTensors::deserialize(&gb).unwrap(),
        safetensors::SafeTensors::deserialize(&cb).unwrap(),
    );
    let (mut sum, mut n, mut worst) = (0f64, 0usize, 0f32);
    let names = ct.names();
    assert_eq!(names.len(), 24);
    for name in names {
        let a: &[f32] = bytemuck::cast_slice(gt.tensor(name).unwrap().data());
        let b: &[f32] = bytemuck::cast_slice(ct.tensor(name).unwrap().data());
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            let d = (x - y).abs();
            sum += f64::from(d);
            n += 1;
            worst = worst.max(d);
        }
    }
    let mean = sum / n as f64;
    println!("  24 files: mean |GPU - CPU| {mean:.4}, largest {worst:.3} (one 8-bit level is about 0.017)");
    assert!(mean <= 0.02, "mean difference {mean}");
    assert!(worst <= 0.5, "largest difference {worst}");
}

/// A farm whose producers decode on the GPU (and one on the CPU) over JPEGs, PNGs and a broken
/// file: every input gets exactly one line, the GPU producers did most of them, the broken file
/// an error, and the scores agree with a CPU-producer farm's.
/// A farm over two GPUs (a server on each) with the server on GPU 1 SIGKILLed mid-run: its
/// producers redo their inputs through the other server while it restarts, and every input gets
/// exactly one line.
fn farm_two_gpus_server_killed() {
    if !two_gpus() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.jsonl");
    let sock = dir.path().join("f.sock");
    let inputs = 20_000u64;
    let child = std::process::Command::new(tensorport_exe())
        .args([
            "--log",
            "warn",
            "farm",
            "--devices",
            "0,1",
            "--ready",
            "-p",
            "8",
        ])
        .args(["--synthetic", &inputs.to_string(), "--progress", "never"])
        .arg("--socket")
        .arg(&sock)
        .arg("--output")
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = || {
        std::fs::read_to_string(&out)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    };
    let t = std::time::Instant::now();
    while lines() < 2000 {
        assert!(
            t.elapsed().as_secs() < 120,
            "the farm wrote no 2,000 results in 2 minutes"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // The server on GPU 1 listens on f-1.sock.
    let victim = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    let c = String::from_utf8_lossy(&c);
                    c.contains("serve") && c.contains("f-1.sock")
                })
                .unwrap_or(false)
        })
        .expect("the server on GPU 1");
    let before = lines();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let o = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "farm failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut seen = std::collections::HashSet::new();
    let text = std::fs::read_to_string(&out).unwrap();
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v.get("error").is_none(), "{l}");
        assert!(
            seen.insert(v["index"].as_u64().unwrap()),
            "an input answered twice"
        );
    }
    assert_eq!(seen.len() as u64, inputs, "every input once");
    assert!(stdout.contains("server restarts 1"), "{stdout}");
    println!(
        "  {inputs} inputs over two GPUs, the server on GPU 1 SIGKILLed after {before} results: {} lines, {} distinct",
        text.lines().count(),
        seen.len()
    );
}

fn farm_gpu_producers() {
    let dir = tempfile::tempdir().unwrap();
    let (all, _) = sample_images(dir.path(), 96);
    std::fs::write(
        std::path::Path::new(&all).join("zz-broken.jpg"),
        b"\xff\xd8\xff\xe0 not a JPEG",
    )
    .unwrap();
    let run = |extra: &[&str], out: &str| {
        let mut args = vec![
            "farm",
            "--device",
            "cuda",
            "--input",
            &all,
            "--progress",
            "never",
            "--output",
            out,
        ];
        args.extend_from_slice(extra);
        let said = tp(&args);
        println!(
            "  farm {extra:?}: {}",
            said.lines()
                .find(|l| l.contains("throughput"))
                .unwrap_or("")
                .trim()
        );
        let mut lines = std::collections::BTreeMap::new();
        for l in std::fs::read_to_string(out).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let prev = lines.insert(v["index"].as_u64().unwrap(), v);
            assert!(prev.is_none(), "an input answered twice");
        }
        lines
    };
    let g = dir.path().join("g.jsonl");
    let c = dir.path().join("c.jsonl");
    let gpu = run(
        &["--gpu-producers", "2", "--producers", "1"],
        g.to_str().unwrap(),
    );
    let cpu = run(&["--producers", "2"], c.to_str().unwrap());
    assert_eq!(gpu.len(), 97);
    assert_eq!(cpu.len(), 97);
    // u8 planes from the GPU producers, normalised by the server: the same scores.
    let u = dir.path().join("u.jsonl");
    let gpu_u8 = run(
        &["--gpu-producers", "2", "--producers", "0", "--pixels", "u8"],
        u.to_str().unwrap(),
    );
    assert_eq!(gpu_u8.len(), 97);
    let mut u8_worst = 0f64;
    // Inputs a GPU producer prepared in both runs (in the first, the CPU producer took some).
    let by_gpu_both = |i: &u64| gpu[i]["producer"].as_str().unwrap().starts_with("gpu-");
    for (i, v) in gpu_u8.iter().filter(|(i, _)| by_gpu_both(i)) {
        let (Some(a), Some(b)) = (v["scores"].as_array(), gpu[i]["scores"].as_array()) else {
            assert!(v["error"].is_string() && gpu[i]["error"].is_string(), "{v}");
            continue;
        };
        for (a, b) in a.iter().zip(b) {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            u8_worst = u8_worst.max((a - b).abs() / (1.0 + b.abs()));
        }
    }
    println!(
        "  --pixels u8 from the GPU producers: largest relative score difference from f32 {u8_worst:.2e} over the {} inputs GPU producers prepared in both runs",
        gpu.keys().filter(|i| by_gpu_both(i)).count()
    );
    assert!(u8_worst <= 1e-4, "{u8_worst}");
    let by_gpu = gpu
        .values()
        .filter(|v| v["producer"].as_str().unwrap().starts_with("gpu-"))
        .count();
    let (mut same, mut worst, mut errors) = (0, 0f64, 0);
    for (i, v) in &gpu {
        let w = &cpu[i];
        assert_eq!(v["input"], w["input"]);
        if v["input"].as_str().unwrap().ends_with("zz-broken.jpg") {
            assert!(
                v["error"].is_string() && w["error"].is_string(),
                "{v} / {w}"
            );
            errors += 1;
            continue;
        }
        assert!(v["error"].is_null(), "{v}");
        same += (v["class"] == w["class"]) as usize;
        for (a, b) in v["scores"]
            .as_array()
            .unwrap()
            .iter()
            .zip(w["scores"].as_array().unwrap())
        {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            worst = worst.max((a - b).abs() / (1.0 + b.abs()));
        }
    }
    println!("  97 inputs once each; {by_gpu} by GPU producers; same class as the CPU producers' farm {same}/96; largest relative score difference {worst:.3}; broken file: an error line");
    assert_eq!(errors, 1);
    assert!(by_gpu >= 24, "the GPU producers did only {by_gpu}");
    assert!(same >= 86, "only {same}/96 classes agree");
    assert!(worst <= 0.1, "scores differ by {worst}");
}
