//! Bad input from a producer: error frames, and the server keeps serving; grants past the pool.

use super::*;

pub(crate) fn desc(dtype: u8, shape: &[u64], offset: u64, len: u64, slot: SlotRef) -> ClientMsg {
    ClientMsg::Submit {
        request_id: 77,
        tensor: RawTensorDesc {
            dtype,
            shape: shape.to_vec(),
            strides: None,
            offset,
            len,
            location: RawLocation::HostSlot(slot),
            fence: None,
        },
    }
}

pub(crate) fn bad_input() {
    let (_dir, sock) = socket_dir();
    let srv = CheckingServer::start(ServerConfig::new(&sock));
    // A well-behaved producer keeps working the whole time.
    let stop = Arc::new(AtomicBool::new(false));
    let good_done = Arc::new(AtomicU64::new(0));
    let good = {
        let (sock, stop, done) = (sock.clone(), stop.clone(), good_done.clone());
        std::thread::spawn(move || {
            let mut p = Producer::connect(&sock, ProducerConfig::new("good")).unwrap();
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let spec = spec_for(i);
                let n = spec.extent().unwrap() as usize;
                let off = spec.offset as usize;
                let mut l = p.lease(Duration::from_secs(5)).unwrap();
                fill(i, &mut l.bytes_mut()[off..off + n]);
                l.submit(&spec).unwrap();
                let c = p.recv_result(Duration::from_secs(5)).unwrap();
                assert!(c.result.is_ok());
                done.fetch_add(1, Ordering::SeqCst);
                i += 1;
            }
        })
    };

    // Non-fatal refusals on one session, which keeps working afterwards.
    let mut r = Raw::connect(&sock);
    let (slot_size, grant) = r.hello(4);
    let s0 = grant[0];
    r.send(&desc(0, &[4], slot_size - 4, 16, s0));
    r.expect_error(ErrorCode::OutOfBounds, false);
    r.send(&desc(0, &[u64::MAX, 2], 0, 16, s0));
    r.expect_error(ErrorCode::ShapeOverflow, false);
    r.send(&desc(200, &[4], 0, 16, s0));
    r.expect_error(ErrorCode::UnknownDType, false);
    r.send(&desc(
        0,
        &[4],
        0,
        16,
        SlotRef {
            slot: 99,
            generation: 0,
        },
    ));
    r.expect_error(ErrorCode::OutOfBounds, false);
    r.send(&ClientMsg::Return(SlotRef {
        slot: s0.slot,
        generation: s0.generation + 5,
    }));
    r.expect_error(ErrorCode::SlotNotLeased, false);
    // A real submit works; submitting the same (now stale) slot reference again does not.
    r.send(&desc(0, &[2], 0, 8, s0));
    loop {
        match r.recv() {
            Some(ServerMsg::Result { request_id: 77, .. }) => break,
            Some(ServerMsg::Grant(_)) => {}
            other => panic!("expected a result, got {other:?}"),
        }
    }
    r.send(&desc(0, &[2], 0, 8, s0));
    loop {
        match r.recv() {
            Some(ServerMsg::Grant(_)) => {}
            Some(ServerMsg::Error { code, fatal, .. }) => {
                assert_eq!(ErrorCode::from_u16(code), ErrorCode::SlotNotLeased);
                assert!(!fatal);
                break;
            }
            other => panic!("expected SlotNotLeased, got {other:?}"),
        }
    }
    // Descriptors attached to a frame that carries none are closed and refused.
    r.send_with_fds(&ClientMsg::Status, 1);
    let (mut saw_err, mut saw_status) = (false, false);
    while !(saw_err && saw_status) {
        match r.recv() {
            Some(ServerMsg::Error { code, fatal, .. }) => {
                assert_eq!(ErrorCode::from_u16(code), ErrorCode::FdsNotExpected);
                assert!(!fatal);
                saw_err = true;
            }
            Some(ServerMsg::Status(_)) => saw_status = true,
            other => panic!("unexpected {other:?}"),
        }
    }

    // Fatal ones: the connection is closed after the error frame.
    let mut r = Raw::connect(&sock);
    r.hello(4);
    r.send_bytes(&u32::MAX.to_le_bytes()); // 4 GiB frame: refused unread
    r.expect_error(ErrorCode::FrameTooLarge, true);
    let mut r = Raw::connect(&sock);
    r.hello(4);
    r.send_bytes(&[5, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 0x99]);
    r.expect_error(ErrorCode::Malformed, true);
    let mut r = Raw::connect(&sock);
    r.hello_with(7, 9, 4);
    r.expect_error(ErrorCode::VersionMismatch, true);
    let mut r = Raw::connect(&sock);
    r.send(&ClientMsg::Status);
    r.expect_error(ErrorCode::HandshakeRequired, true);
    let mut r = Raw::connect(&sock);
    r.send_bytes(b"\x10\0\0\0GET / HTTP/1.1\r\n\r\n");
    r.expect_error(ErrorCode::Malformed, true);

    // The good producer kept going through all of it, and still does.
    let before = good_done.load(Ordering::SeqCst);
    assert!(eventually(PATIENCE, || good_done.load(Ordering::SeqCst) > before + 10));
    stop.store(true, Ordering::SeqCst);
    good.join().unwrap();
    let st = srv.server.status();
    assert!(st.totals.protocol_errors >= 9, "{:?}", st.totals);
    assert!(st.totals.connections_refused >= 3, "{:?}", st.totals);
    assert_eq!(srv.torn.load(Ordering::SeqCst), 0);
    let log = logs();
    for needle in [
        "refused",
        "closing session",
        "handshake refused",
        "OutOfBounds",
        "FdsNotExpected",
    ] {
        assert!(log.contains(needle), "no log line with {needle:?}");
    }
}

/// A server that lies: it grants a slot past the pool it sent. The producer refuses the grant
/// with an error instead of indexing outside its mapping later.
pub(crate) fn bad_grant() {
    use std::os::fd::AsRawFd;
    use tensorport::wire::{encode_frame, PoolLayout, ServerMsg, Welcome};
    let (_dir, sock) = socket_dir();
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let liar = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let pool = tensorport_shm::HostPool::create("liar", 2, 4096).unwrap();
        let welcome = encode_frame(&ServerMsg::Welcome(Welcome {
            version: 1,
            session_id: 1,
            pool: PoolLayout {
                slot_count: pool.slot_count(),
                slot_size: pool.slot_size(),
                pool_len: pool.len(),
            },
            max_in_flight: 4,
            fds: 1,
        }))
        .unwrap();
        let fds = [pool.fd().as_raw_fd()];
        nix::sys::socket::sendmsg::<()>(
            s.as_raw_fd(),
            &[std::io::IoSlice::new(&welcome)],
            &[nix::sys::socket::ControlMessage::ScmRights(&fds)],
            nix::sys::socket::MsgFlags::empty(),
            None,
        )
        .unwrap();
        let grant = encode_frame(&ServerMsg::Grant(vec![SlotRef {
            slot: 7,
            generation: 1,
        }]))
        .unwrap();
        (&s).write_all(&grant).unwrap();
        // Hold the connection until the producer hangs up.
        let mut buf = [0u8; 256];
        while std::io::Read::read(&mut &s, &mut buf).is_ok_and(|n| n > 0) {}
    });
    let mut cfg = ProducerConfig::new("trusting");
    cfg.rings = false;
    let e: tensorport::Error = match Producer::connect(&sock, cfg) {
        Err(e) => e.into(),
        Ok(mut p) => p
            .lease(Duration::from_secs(10))
            .map(|_| ())
            .unwrap_err()
            .into(),
    };
    assert!(
        e.to_string().contains("granted slot 7 of a pool of 2"),
        "expected the bad grant refused by name, got: {e}"
    );
    liar.join().unwrap();
}
