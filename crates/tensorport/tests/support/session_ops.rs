//! A producer session driven by arbitrary bytes: each byte pair becomes a message (a submit of
//! some slot and generation, a return, a status, a drain, a device registration, a second
//! Hello, garbage, goodbye), sent on a real socket to a real server whose consumer answers,
//! drops or releases what it admits. Afterwards the server must have answered every request it
//! admitted exactly once and given every pool back. Shared by the CI property test
//! (`tests/reliability/hostile.rs`) and the fuzz target (`crates/tensorport/fuzz`), which includes this
//! file by path; it uses only `tensorport` and `std`.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport::wire::{
    encode_frame, ClientMsg, Hello, RawDeviceHandle, RawLocation, RawTensorDesc, Role, SlotRef,
    MAGIC,
};
use tensorport::{Server, ServerConfig};

/// A server for sequences: 4 slots of 4 KiB per session, and a consumer that answers requests
/// by their id (respond, drop unanswered, or release first and answer later).
pub fn sequence_server(socket: &Path) -> (Arc<Server>, Arc<AtomicBool>) {
    let mut cfg = ServerConfig::new(socket);
    cfg.slots_per_session = 4;
    cfg.slot_size = 4096;
    cfg.handshake_timeout = Duration::from_secs(30);
    let server = Arc::new(Server::bind(cfg).expect("bind"));
    let stop = Arc::new(AtomicBool::new(false));
    let (s, st) = (server.clone(), stop.clone());
    std::thread::spawn(move || {
        while !st.load(Ordering::SeqCst) {
            match s.recv_timeout(Duration::from_millis(20)) {
                Ok(Some(r)) => match r.request_id() % 3 {
                    0 => {
                        let head = r.bytes()[..8].to_vec();
                        let _ = r.respond(&head);
                    }
                    1 => drop(r),
                    _ => {
                        let _ = r.release().respond(b"late");
                    }
                },
                Ok(None) => {}
                Err(_) => break,
            }
        }
    });
    (server, stop)
}

fn submit(request_id: u64, slot: SlotRef, rank: usize, len: u64) -> ClientMsg {
    ClientMsg::Submit {
        request_id,
        tensor: RawTensorDesc {
            dtype: 0,
            shape: vec![2; rank],
            strides: None,
            offset: 0,
            len,
            location: RawLocation::HostSlot(slot),
            fence: None,
        },
    }
}

/// Plays `ops` as one producer session; returns how many messages were sent.
pub fn play(socket: &Path, ops: &[u8]) -> usize {
    let Ok(mut s) = UnixStream::connect(socket) else {
        return 0;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(1)));
    let hello = ClientMsg::Hello(Hello {
        magic: MAGIC,
        min_version: 1,
        max_version: 1,
        role: Role::Producer,
        name: "sequence".into(),
        want_slots: 4,
        want_slot_size: 4096,
    });
    let mut sent = 0;
    let send = |s: &mut UnixStream, bytes: &[u8]| s.write_all(bytes).is_ok();
    if !send(&mut s, &encode_frame(&hello).unwrap()) {
        return 0;
    }
    let mut sink = [0u8; 4096];
    for (i, pair) in ops.chunks(2).enumerate() {
        let (op, arg) = (pair[0], pair.get(1).copied().unwrap_or(0));
        let slot = SlotRef {
            slot: u32::from(arg & 7),
            generation: u32::from(arg >> 3 & 3),
        };
        let id = u64::from(op >> 4) % 8;
        let msg = match op % 16 {
            0..=7 => submit(id, slot, 3, 32),
            8 => submit(id, slot, (arg % 12) as usize, u64::from(arg) * 512),
            9 => ClientMsg::Return(slot),
            10 => ClientMsg::Status,
            11 => ClientMsg::Drain,
            12 => ClientMsg::RegisterDevice {
                buffer: u32::from(arg),
                len: 4096,
                handle: RawDeviceHandle::LegacyIpcTimeline {
                    memory: vec![0; 64],
                },
            },
            13 => hello.clone(),
            14 if arg % 8 == 0 => ClientMsg::Goodbye,
            15 if arg % 8 == 0 => {
                // Bytes that may not be a message at all (fatal when they are not).
                let junk = [4, 0, 0, 0, op, arg, op ^ arg, 0xff];
                if !send(&mut s, &junk[..4 + (arg as usize % 5)]) {
                    break;
                }
                sent += 1;
                continue;
            }
            _ => ClientMsg::Return(slot),
        };
        if !send(&mut s, &encode_frame(&msg).unwrap()) {
            break;
        }
        sent += 1;
        if matches!(msg, ClientMsg::Goodbye) {
            break;
        }
        // Read what came back now and then, so the session is not dropped for not reading.
        if i % 4 == 3 {
            while let Ok(n) = s.read(&mut sink) {
                if n == 0 {
                    break;
                }
            }
        }
    }
    sent
}

/// After every session has ended: each admitted request was answered exactly once, and every
/// pool went back to the budget. Waits up to `patience` for the consumer to finish.
pub fn assert_settled(server: &Server, patience: Duration) {
    let deadline = Instant::now() + patience;
    loop {
        let st = server.status();
        let t = &st.totals;
        let settled =
            st.sessions.is_empty() && t.submitted == t.completed && server.pool_memory().0 == 0;
        if settled {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not settled: {} sessions, {} submitted, {} completed, {} bytes of pools",
            st.sessions.len(),
            t.submitted,
            t.completed,
            server.pool_memory().0
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
