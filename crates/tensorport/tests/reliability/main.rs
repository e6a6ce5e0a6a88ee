//! Reliability and hostile-peer tests with real processes: a chaos run of hundreds of SIGKILLs,
//! hand-written protocol abuse, another uid, connection floods, in-flight limits, and a producer
//! that stops reading its results.

#[path = "../support/mod.rs"]
mod support;

mod authority;
mod chaos;
mod hostile;
mod limits;
mod stalls;

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use authority::*;
use chaos::*;
use hostile::*;
use limits::*;
use stalls::*;
use support::*;
use tensorport::wire::{
    encode_frame, ClientMsg, ErrorCode, RawLocation, RawTensorDesc, ServerMsg, SlotRef,
};
use tensorport::{DType, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};

fn main() {
    support::main(
        &[
            ("chaos_200_sigkills_at_random_moments", chaos),
            ("hostile_slot_abuse_and_fd_floods", hostile_slots),
            ("truncated_and_lying_frames", lying_frames),
            ("device_registrations_on_a_cpu_server", device_on_cpu),
            ("many_descriptors_per_message_all_closed", many_fds),
            (
                "descriptors_in_unfinished_frames_end_the_session_and_are_closed",
                fds_in_unfinished_frames,
            ),
            ("a_queue_full_of_refused_entries_is_bounded", refusal_flood),
            (
                "idle_sessions_give_back_memory_for_newcomers",
                idle_memory_eviction,
            ),
            ("silent_connections_cannot_lock_producers_out", silent_flood),
            ("drain_is_the_operators_not_a_producers", drain_authority),
            ("memory_budget_holds_against_a_hello_flood", memory_budget),
            (
                "a_refused_socket_submit_names_its_request",
                refused_submit_named,
            ),
            ("idle_sessions_make_room_for_newcomers", idle_eviction),
            ("another_uid_is_refused", other_uid),
            ("a_server_of_another_uid_is_not_trusted", untrusted_server),
            ("connection_flood_is_bounded", flood),
            ("in_flight_limit_holds", in_flight_limit),
            ("stalled_reader_is_dropped_memory_flat", stalled_reader),
            ("a_peer_that_stops_reading_stalls_nobody_else", head_of_line),
            ("hostile_ring_entries_and_positions", hostile_ring),
            (
                "random_message_sequences_answer_each_request_once",
                sequences,
            ),
            ("protocol_1_clients_still_served", protocol_1_client),
        ],
        child,
    );
}

fn child(role: &str, socket: &str) {
    match role {
        "chaos-producer" => chaos_producer(socket),
        "other-uid" => other_uid_client(socket),
        "other-uid-server" => other_uid_server(socket),
        "sink-server" => sink_server_child(socket),
        r => panic!("unknown role {r}"),
    }
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A server whose consumer verifies every tensor and answers with its checksum.
fn checking_server(
    cfg: ServerConfig,
) -> (Arc<Server>, Arc<AtomicU64>, Arc<AtomicU64>, Arc<AtomicBool>) {
    let server = Arc::new(Server::bind(cfg).unwrap());
    let (ok, torn, stop) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let (s, o, t, st) = (server.clone(), ok.clone(), torn.clone(), stop.clone());
    std::thread::spawn(move || {
        while !st.load(Ordering::SeqCst) {
            match s.recv_timeout(Duration::from_millis(50)) {
                Ok(Some(r)) => {
                    if verify(r.bytes()) {
                        o.fetch_add(1, Ordering::SeqCst);
                    } else {
                        t.fetch_add(1, Ordering::SeqCst);
                    }
                    let sum = checksum(r.bytes());
                    let _ = r.respond(&sum.to_le_bytes());
                }
                Ok(None) => {}
                Err(_) => break,
            }
        }
    });
    (server, ok, torn, stop)
}

fn submit(slot: SlotRef, id: u64) -> ClientMsg {
    ClientMsg::Submit {
        request_id: id,
        tensor: RawTensorDesc {
            dtype: DType::U8 as u8,
            shape: vec![64],
            strides: None,
            offset: 0,
            len: 64,
            location: RawLocation::HostSlot(slot),
            fence: None,
        },
    }
}

/// A new producer connects and gets one tensor through: the server is still serving.
fn assert_still_served(sock: &std::path::Path, seed: u64) {
    let mut p = Producer::connect(sock, ProducerConfig::new("after")).unwrap();
    let mut l = p.lease(Duration::from_secs(2)).unwrap();
    fill(seed, &mut l.bytes_mut()[..64]);
    l.submit(&TensorSpec::new(DType::U8, &[64])).unwrap();
    let c = p.recv_result(Duration::from_secs(2)).unwrap();
    assert!(c.result.is_ok(), "{:?}", c.result);
}

/// Receives the `Welcome` frame alone (its length peeked first) with the descriptors on it.
fn welcome_with_fds(r: &Raw) -> (tensorport::wire::Welcome, Vec<std::os::fd::OwnedFd>) {
    use nix::sys::socket::{recv, recvmsg, ControlMessageOwned, MsgFlags};
    use std::os::fd::FromRawFd;
    let mut h = [0u8; 4];
    assert_eq!(
        recv(r.s.as_raw_fd(), &mut h, MsgFlags::MSG_PEEK).unwrap(),
        4
    );
    let mut buf = vec![0u8; 4 + u32::from_le_bytes(h) as usize];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 8]);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(
        r.s.as_raw_fd(),
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .unwrap();
    let mut fds = Vec::new();
    for c in msg.cmsgs().unwrap() {
        if let ControlMessageOwned::ScmRights(v) = c {
            // SAFETY: the kernel just installed these descriptors for this process alone.
            fds.extend(
                v.into_iter()
                    .map(|fd| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    assert_eq!(msg.bytes, buf.len());
    match tensorport::wire::decode_server(&buf[4..]).unwrap() {
        ServerMsg::Welcome(w) => (w, fds),
        other => panic!("expected Welcome, got {other:?}"),
    }
}

/// A submission-queue entry for a 64-byte u8 tensor in `slot`, as request `request_id`.
fn u8_entry(request_id: u64, slot: SlotRef) -> tensorport_shm::ring::SqEntry {
    let mut e = tensorport_shm::ring::SqEntry {
        request_id,
        slot: slot.slot,
        generation: slot.generation,
        dtype: DType::U8 as u8,
        rank: 1,
        len: 64,
        ..Default::default()
    };
    e.shape[0] = 64;
    e
}
