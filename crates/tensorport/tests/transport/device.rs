//! Device hand-offs on the queues, with a fake importer (no GPU needed).

use super::*;

/// A device "importer" for a CPU test: every registration opens, nothing is read; the device
/// path's bookkeeping (generations, fences, releases) is what is exercised.
pub(crate) struct FakeImporter;

pub(crate) struct FakeBuffer(u64);

impl tensorport::ImportedDevice for FakeBuffer {
    fn device_ptr(&self) -> u64 {
        0x1000
    }
    fn len(&self) -> u64 {
        self.0
    }
    fn release_event_handle(&self) -> Vec<u8> {
        Vec::new()
    }
    fn timeline(&self) -> bool {
        true
    }
    unsafe fn wait_ready(
        &self,
        _stream: *mut std::ffi::c_void,
        _value: Option<u64>,
    ) -> std::result::Result<(), String> {
        Ok(())
    }
    unsafe fn record_release(
        &self,
        _stream: *mut std::ffi::c_void,
        _value: Option<u64>,
    ) -> std::result::Result<(), String> {
        Ok(())
    }
}

impl tensorport::DeviceImporter for FakeImporter {
    fn import(
        &self,
        len: u64,
        _handle: &tensorport::wire::RawDeviceHandle,
        _fd: Option<std::os::fd::OwnedFd>,
    ) -> std::result::Result<Arc<dyn tensorport::ImportedDevice>, tensorport::ImportError> {
        Ok(Arc::new(FakeBuffer(len)))
    }
}

/// Registers device buffer `b` of 4096 bytes, timeline-fenced, for [`FakeImporter`] to open.
pub(crate) fn register_fake_buffer(p: &mut Producer, b: u32) {
    p.register_device(
        b,
        4096,
        tensorport::wire::RawDeviceHandle::LegacyIpcTimeline {
            memory: vec![0; 64],
        },
        None,
        PATIENCE,
    )
    .unwrap();
}

/// Protocol 3: device submissions (with their timeline values) and their releases go on the
/// shared-memory queues. 500 hand-offs of two buffers in turn, each waiting for its release.
pub(crate) fn device_on_queues() {
    let (_dir, sock) = socket_dir();
    let mut cfg = ServerConfig::new(&sock);
    cfg.device = Some(Arc::new(FakeImporter));
    let server = Arc::new(Server::bind(cfg).unwrap());
    let (s, stop) = (server.clone(), Arc::new(AtomicBool::new(false)));
    let st = stop.clone();
    let consumer = std::thread::spawn(move || {
        let mut seen = 0u64;
        while !st.load(Ordering::SeqCst) {
            if let Ok(Some(r)) = s.recv_timeout(Duration::from_millis(20)) {
                let d = r.device().expect("a device tensor").clone();
                let value = r.desc().timeline().expect("a timeline fence");
                assert_eq!(d.len(), 4096);
                let _ = r.respond(&value.to_le_bytes());
                seen += 1;
            }
        }
        seen
    });
    let mut p = Producer::connect(&sock, ProducerConfig::new("device")).unwrap();
    assert!(p.uses_rings());
    for b in 0..2u32 {
        register_fake_buffer(&mut p, b);
    }
    let spec = TensorSpec::new(DType::U8, &[4096]);
    for k in 1..=500u64 {
        let b = (k % 2) as u32;
        p.wait_device(b, PATIENCE).unwrap();
        let id = p.submit_device(b, &spec, Some(k)).unwrap();
        let c = p.recv_result(PATIENCE).unwrap();
        assert_eq!(c.request_id, id);
        assert_eq!(c.result.unwrap(), k.to_le_bytes());
    }
    // Both buffers come back released.
    p.wait_device(0, PATIENCE).unwrap();
    p.wait_device(1, PATIENCE).unwrap();
    stop.store(true, Ordering::SeqCst);
    assert_eq!(consumer.join().unwrap(), 500);
    let t = server.status().totals;
    assert_eq!((t.submitted, t.completed, t.protocol_errors), (500, 500, 0));
}
