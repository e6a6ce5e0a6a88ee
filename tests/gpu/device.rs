//! The device path: GPU producers' buffers (legacy IPC, timeline fences, VMM) handed over,
//! fenced, gathered, killed, and lied about.

use super::*;

/// A GPU producer process: two buffers of `TP_MIB` MiB, `TP_COUNT` hand-offs, each buffer
/// filled on the GPU with a word unique to the hand-off and reused as soon as it is released.
pub(crate) fn gpu_producer(socket: &str) {
    let id: u32 = env_or("TP_ID", "0").parse().unwrap();
    let count: u32 = env_or("TP_COUNT", "200").parse().unwrap();
    let mib: usize = env_or("TP_MIB", "1").parse().unwrap();
    let gpu = Gpu::open(env_or("TP_GPU", "0").parse().unwrap()).unwrap();
    let cfg = GpuProducerConfig::new(format!("gpu-producer-{id}"), 2, mib << 20);
    let mut p = match env_or("TP_FENCE", "event").as_str() {
        "vmm" => GpuProducer::connect(socket, &gpu, &cfg.sharing(Sharing::Vmm)),
        "timeline" => {
            GpuProducer::connect(socket, &gpu, &cfg.sharing(Sharing::Ipc(Fence::Timeline)))
        }
        _ => GpuProducer::connect(socket, &gpu, &cfg.sharing(Sharing::Ipc(Fence::Event))),
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

pub(crate) fn device_four_producers() {
    four_gpu_producers("event");
}

pub(crate) fn device_four_producers_timeline() {
    four_gpu_producers("timeline");
}

pub(crate) fn device_four_producers_vmm() {
    four_gpu_producers("vmm");
}

/// Producers on GPU 1 hand their buffers to a server on GPU 0: legacy IPC opened with peer
/// access, VMM mapped for the server's device, fences waited on across the two.
pub(crate) fn device_cross_gpu() {
    if !two_gpus() {
        return;
    }
    for fence in ["event", "timeline", "vmm"] {
        println!("  producers on GPU 1, server on GPU 0, {fence} fences:");
        four_gpu_producers_on(fence, 1);
    }
}

pub(crate) fn four_gpu_producers(fence: &str) {
    four_gpu_producers_on(fence, 0);
}

/// Four producers with three kinds of fences (two timeline, one event, one VMM) into a server
/// that takes batches and moves them with one `Gatherer::gather` each: the timeline fences
/// batched, the event ones alone, every tensor checked intact. The second producer's tensors
/// start 4 bytes into its buffers (the kernel's byte-by-byte path).
pub(crate) fn device_gathered_mixed_fences() {
    four_producers(&["timeline", "timeline", "event", "vmm"], 0, true);
}

pub(crate) fn four_gpu_producers_on(fence: &str, gpu: u32) {
    four_producers(&[fence; 4], gpu, false);
}

pub(crate) fn four_producers(fences: &[&str; 4], gpu: u32, gathered: bool) {
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

pub(crate) fn device_killed_producer() {
    killed_gpu_producer("event");
}

pub(crate) fn device_vmm_killed_producer() {
    killed_gpu_producer("vmm");
}

pub(crate) fn killed_gpu_producer(sharing: &str) {
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

/// A producer that registers device buffers with lengths longer than their allocations (legacy
/// IPC and VMM), and one past any GPU: each is refused, saying why, and the honest registration
/// of the same buffer after it is accepted.
pub(crate) fn lying_device(socket: &str) {
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
    let handle = gpu.driver().ipc_get_mem_handle(mem.ptr().raw()).unwrap();
    let ipc = || RawDeviceHandle::LegacyIpcTimeline {
        memory: handle.to_vec(),
    };
    let (code, why) = register(&mut r, 0, 64 << 20, ipc(), None).unwrap_err();
    println!("  64 MiB claimed for a 1 MiB IPC allocation: {code:?}: {why}");
    assert_eq!(code, ErrorCode::OutOfBounds);
    assert!(why.contains("register its true length"), "{why}");
    // Eight bytes too many for what the driver says the allocation holds: the semaphores would
    // not fit. Its true length is accepted.
    let (_, held) = gpu.driver().mem_address_range(mem.ptr().raw()).unwrap();
    let (code, _) = register(&mut r, 0, held as u64 - 8, ipc(), None).unwrap_err();
    assert_eq!(code, ErrorCode::OutOfBounds);
    register(&mut r, 0, held as u64 - 16, ipc(), None).unwrap();
    // A timeline buffer whose length is not a multiple of 8: its semaphores would be
    // misaligned, failing every batch it is in. Refused at registration.
    let (code, why) = register(&mut r, 3, 1001, ipc(), None).unwrap_err();
    println!("  a timeline buffer of 1001 bytes: {code:?}: {why}");
    assert_eq!(code, ErrorCode::Malformed);
    assert!(why.contains("multiple of 8"), "{why}");
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

pub(crate) fn lying_registrations() {
    let (_dir, sock) = socket_dir();
    let srv = GpuServer::start(&sock);
    let mut k = spawn_child("lying-device", &[socket_env(&sock)]);
    let out = k.wait_ok(PATIENCE);
    print!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ok"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Only the two honest registrations were ever open, and they close with the session.
    assert!(eventually(PATIENCE, || live_imports() == 0));
    srv.stop.store(true, Ordering::SeqCst);
}
