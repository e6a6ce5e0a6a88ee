//! The tests' in-process GPU server: pools pinned, device buffers imported, every tensor
//! copied through the device and checked.

use super::*;

/// A server whose pools are registered with the GPU, and whose consumer copies every tensor to
/// the device (async, on a stream), releases the slot only after that copy completed, copies it
/// back and checks it: a slot released before its DMA finished would show as a torn tensor,
/// since producers rewrite a slot as soon as it is granted again.
pub(crate) struct GpuServer {
    pub(crate) server: Arc<Server>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) verified: Arc<AtomicU64>,
    pub(crate) torn: Arc<AtomicU64>,
    pub(crate) thread: Option<std::thread::JoinHandle<()>>,
}

impl GpuServer {
    pub(crate) fn start(sock: &std::path::Path) -> GpuServer {
        GpuServer::start_with(sock, false)
    }

    /// `gathered`: the consumer takes up to 8 requests at once and moves their device tensors
    /// with one `tensorport_cuda::Gatherer::gather` (host tensors as above).
    pub(crate) fn start_with(sock: &std::path::Path, gathered: bool) -> GpuServer {
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
                        dev.copy_from_device_async(tensorport_cuda::DevicePtr::of(&dt), n, &stream)
                            .unwrap();
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
pub(crate) fn gathered_loop(
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
                (t, rows.ptr().offset(k * ROW))
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
pub(crate) fn check_copy(back: &[u8], verified: &AtomicU64, torn: &AtomicU64) -> Vec<u8> {
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
