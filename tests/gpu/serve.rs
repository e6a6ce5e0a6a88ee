//! `tensorport serve --device cuda` fed device tensors: the model's scores, and producers
//! that never signal their tensors ready.

use super::*;

/// The image side of the `serve --device cuda` tests.
pub(crate) const MODEL_SIZE: usize = 32;

/// `tensorport serve --device cuda` for [`MODEL_SIZE`] images on `sock`, with `extra`
/// arguments; returns once it listens.
pub(crate) fn start_cuda_serve(sock: &std::path::Path, extra: &[&str]) -> ChildGuard {
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
pub(crate) fn image_producer(sock: &std::path::Path, name: &str, gpu: &Arc<Gpu>) -> GpuProducer {
    GpuProducer::connect(
        sock,
        gpu,
        &GpuProducerConfig::new(name, 2, image_bytes()).sharing(Sharing::Ipc(Fence::Timeline)),
    )
    .unwrap()
}

pub(crate) fn image_bytes() -> usize {
    3 * MODEL_SIZE * MODEL_SIZE * 4
}

pub(crate) fn image_spec() -> TensorSpec {
    TensorSpec::new(DType::F32, &[3, MODEL_SIZE as u64, MODEL_SIZE as u64])
}

/// Submits an image of `v` everywhere (filled on the producer's GPU).
pub(crate) fn submit_image(p: &mut GpuProducer, v: f32) -> u64 {
    let b = p.acquire(Duration::from_secs(20)).unwrap();
    p.buffer(b)
        .fill_u32_range_async(0, image_bytes(), v.to_bits(), p.stream())
        .unwrap();
    p.submit(b, &image_spec()).unwrap()
}

/// How far a result's scores are from the CPU model's on an image of `v` everywhere (the
/// largest relative difference).
pub(crate) fn score_error(c: tensorport::Completion, v: f32) -> f32 {
    use tensorport_dfdx::dfdx::prelude::Cpu;
    use tensorport_dfdx::{ImageClassifier, ModelConfig};
    use tensorport_farm::record::scores_from_bytes;
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
pub(crate) fn images_answered_right(p: &mut GpuProducer, n: usize) -> f32 {
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
pub(crate) fn device_into_model() {
    let (_dir, sock) = socket_dir();
    let _server = start_cuda_serve(&sock, &[]);
    let gpu = Gpu::open(0).unwrap();
    let mut p = image_producer(&sock, "gpu-images", &gpu);
    let worst = images_answered_right(&mut p, 8);
    println!("  8 device images through the CUDA model; max relative difference from the CPU model {worst:.2e}");
}

/// `serve --device cuda --sink` answers device tensors without reading them, and still signals
/// each buffer "released" on the GPU: a timeline-fenced producer that reuses its two buffers
/// eight times sees its stream drain (a sink that skipped the release would leave it waiting
/// for good).
pub(crate) fn sink_releases_device_tensors() {
    let (_dir, sock) = socket_dir();
    let _server = start_cuda_serve(&sock, &["--sink"]);
    let gpu = Gpu::open(0).unwrap();
    let mut p = image_producer(&sock, "gpu-sink", &gpu);
    for k in 0..8 {
        submit_image(&mut p, k as f32);
        let c = p.producer().recv_result(Duration::from_secs(30)).unwrap();
        assert!(c.result.is_ok(), "{:?}", c.result);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !p.stream().is_idle().unwrap() {
        assert!(
            std::time::Instant::now() < deadline,
            "the producer's stream still waits for a release after 10 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("  8 device tensors through a sink on 2 buffers; the producer's stream drained");
}

/// A GPU producer that submits a timeline value it never writes: `serve --device cuda` lets
/// the wait through after its fence timeout, fails that request (FenceTimeout) and ends that
/// session only; an honest producer's images, held up meanwhile or sent after, are all
/// answered with the model's scores.
pub(crate) fn fence_never_signalled() {
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
pub(crate) fn silent_gpu_producer(socket: &str) {
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
pub(crate) fn killed_with_unsignalled_tensor() {
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
            Err(tensorport::RecvError::Timeout(..)) => {
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

/// An event-fenced GPU producer whose "ready" event fires only after the server's fence
/// timeout (its stream waits on a flag this test sets later): the server never makes its stream
/// wait on that event (it polls it first), fails that request (FenceTimeout) and ends that
/// session after the timeout; an honest producer's images are answered meanwhile and after,
/// and the late signal harms nothing.
pub(crate) fn event_fence_signalled_late() {
    use tensorport::wire::ErrorCode;
    let (_dir, sock) = socket_dir();
    let _server = start_cuda_serve(&sock, &["--fence-timeout-ms", "1000"]);
    let gpu = Gpu::open(0).unwrap();
    let mut late = GpuProducer::connect(
        &sock,
        &gpu,
        &GpuProducerConfig::new("late-event", 2, image_bytes()).sharing(Sharing::Ipc(Fence::Event)),
    )
    .unwrap();
    let mut honest = image_producer(&sock, "honest", &gpu);
    let flag = tensorport_cuda::DeviceBuffer::new(&gpu, 8).unwrap();
    let side = tensorport_cuda::Stream::new(&gpu).unwrap();
    let d = gpu.driver();
    // SAFETY: both streams and the 8-byte flag are live allocations of this context.
    unsafe {
        d.stream_write_value64(side.raw().cast(), flag.ptr().raw(), 0)
            .unwrap();
    }
    side.synchronize().unwrap();
    let b = late.acquire(Duration::from_secs(20)).unwrap();
    // SAFETY: as above; the producer's stream waits until the flag reaches 1.
    unsafe {
        d.stream_wait_value64(late.stream().raw().cast(), flag.ptr().raw(), 1)
            .unwrap();
    }
    let t0 = std::time::Instant::now();
    let id = late.submit(b, &image_spec()).unwrap();
    let worst = images_answered_right(&mut honest, 8);
    let c = late.producer().recv_result(PATIENCE).unwrap();
    let waited = t0.elapsed();
    assert_eq!(c.request_id, id);
    let e = c
        .result
        .expect_err("a tensor signalled after the timeout is not answered with scores");
    assert_eq!(e.code, ErrorCode::FenceTimeout, "{e}");
    assert!(waited >= Duration::from_secs(1), "failed after {waited:?}");
    // Now the event fires, long after: nothing of the server's waits for it any more.
    // SAFETY: as above.
    unsafe {
        d.stream_write_value64(side.raw().cast(), flag.ptr().raw(), 1)
            .unwrap();
    }
    side.synchronize().unwrap();
    late.stream().synchronize().unwrap();
    let after = images_answered_right(&mut honest, 8);
    println!(
        "  an event signalled after the 1 s fence timeout: its request failed after {:.2} s ({e}); the honest producer's 16 images answered right (worst {:.2e})",
        waited.as_secs_f64(),
        worst.max(after)
    );
}
