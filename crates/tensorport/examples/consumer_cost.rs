//! The consumer's own cost per message, with no other core in the way: one producer and the
//! server's consumer take turns on one thread (16 submits, then `recv_batch_into` and
//! `respond_all` until all 16 are answered, then the producer reads its results), so every
//! line either side touches is already in this core's cache and what is left is instructions.
//!
//! `cargo run --release -p tensorport --example consumer_cost [ROUNDS]` (default 200,000 rounds
//! of 16 messages of 4 KiB) prints nanoseconds per message on each side. Run it pinned
//! (`taskset -c 1 …`) and several times: the figures move by 10-20% from run to run on a
//! shared machine. Where one consumer thread serves many producers on many cores, cache misses
//! on the queues add to this (docs/benchmarks.md).

use std::time::{Duration, Instant};

use tensorport::{DType, Producer, ProducerConfig, Request, Server, ServerConfig, TensorSpec};

/// Messages submitted before the consumer takes its turn.
const BURST: usize = 16;
const SLOT: u64 = 4096;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rounds: usize = match std::env::args().nth(1) {
        Some(s) => s
            .parse()
            .map_err(|_| format!("ROUNDS must be a whole number, not {s:?}"))?,
        None => 200_000,
    };
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("cost.sock");
    let mut cfg = ServerConfig::new(&socket);
    cfg.slot_size = SLOT;
    let server = Server::bind(cfg)?;
    let mut pc = ProducerConfig::new("cost");
    pc.slots = BURST as u32;
    pc.slot_size = SLOT;
    let mut producer = Producer::connect(&socket, pc)?;
    let spec = TensorSpec::new(DType::U8, &[SLOT]);
    let wait = Duration::from_secs(5);

    let mut batch: Vec<Request> = Vec::with_capacity(64);
    let mut answers: Vec<(Request, [u8; 0])> = Vec::with_capacity(64);
    let (mut producing, mut consuming) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let t0 = Instant::now();
        for _ in 0..BURST {
            producer.lease(wait)?.submit(&spec)?;
        }
        let t1 = Instant::now();
        let mut taken = 0;
        while taken < BURST {
            server.recv_batch_into(&mut batch, 64, wait, Duration::ZERO)?;
            if batch.is_empty() {
                return Err("the consumer found none of the submitted requests".into());
            }
            taken += batch.len();
            for r in batch.drain(..) {
                std::hint::black_box(r.bytes().first());
                answers.push((r, []));
            }
            server.respond_all(&mut answers)?;
        }
        let t2 = Instant::now();
        while producer.in_flight() > 0 {
            producer.recv_result(wait)?;
        }
        producing += t1 - t0;
        consuming += t2 - t1;
    }
    let per = |d: Duration| d.as_secs_f64() * 1e9 / (rounds * BURST) as f64;
    println!(
        "{} messages of {SLOT} B: producer {:.1} ns/msg (lease + submit), consumer {:.1} ns/msg (recv_batch_into + respond_all)",
        rounds * BURST,
        per(producing),
        per(consuming)
    );
    Ok(())
}
