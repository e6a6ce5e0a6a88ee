//! Multi-process tests of the host transport: real producer and server processes, real SIGKILLs.
//!
//! The test binary re-runs itself as the child processes (see `support::main`), so every test
//! here exercises the library across a real process boundary: fd passing, shared mappings,
//! dead-peer detection by the kernel closing sockets.

#[path = "../support/mod.rs"]
mod support;

mod checking;
mod device;
mod input;
mod leasing;
mod lifecycle;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use checking::*;
use device::*;
use input::*;
use leasing::*;
use lifecycle::*;
use support::*;
use tensorport::wire::{ClientMsg, ErrorCode, RawLocation, RawTensorDesc, ServerMsg, SlotRef};
use tensorport::{DType, Error, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};

fn main() {
    support::main(
        &[
            (
                "four_producers_mixed_tensors_intact_no_leaks",
                four_producers,
            ),
            (
                "sigkilled_producer_is_reclaimed_others_served",
                killed_producer,
            ),
            ("sigkilled_server_unblocks_producers_at_once", killed_server),
            (
                "bad_input_gets_error_frames_server_keeps_serving",
                bad_input,
            ),
            ("pool_fd_is_sealed_against_truncation", sealed_pool),
            ("handshake_timeout_and_session_limit", limits),
            ("stale_socket_replaced_live_socket_kept", socket_file),
            ("a_grant_past_the_pool_is_refused", bad_grant),
            ("several_loans_out_written_on_threads", loans),
            (
                "three_consumers_share_six_producers_none_starved",
                several_consumers,
            ),
            (
                "device_hand_offs_and_releases_travel_on_the_queues",
                device_on_queues,
            ),
            (
                "large_slots_leased_warm_intact_and_a_held_slot_blocks_no_lease",
                warm_lease,
            ),
            (
                "paced_producer_stays_within_its_window_of_the_slowest",
                paced_producers,
            ),
            (
                "paced_server_ignores_device_only_producers",
                paced_server_ignores_device_producers,
            ),
        ],
        child,
    );
}

fn child(role: &str, socket: &str) {
    match role {
        "producer" => checked_producer(socket),
        "slow-producer" => child_slow_producer(socket),
        "server-hold" => child_server_hold(socket),
        other => panic!("unknown child role {other}"),
    }
}
