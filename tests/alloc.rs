//! The hot path allocates nothing: in steady state, a hand-off on the shared-memory queues —
//! lease, fill, submit, receive, respond, result — makes no heap allocation on either side.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tensorport::{DType, Producer, ProducerConfig, Server, ServerConfig, TensorSpec};

/// Counts allocations made by threads that opted in.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    if COUNTING.with(|c| c.get()) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting touches only an
// atomic and a const-initialised thread-local `Cell` (neither allocates).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded with the caller's layout, under the caller's contract.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System.alloc` with this layout (every allocation goes there).
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count();
        // SAFETY: as for `dealloc`; the caller guarantees `n` is valid for `l`'s alignment.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const WARMUP: u64 = 2_000;
const MEASURED: u64 = 20_000;

#[test]
fn a_steady_hand_off_allocates_nothing() {
    // The counter counts: one deliberate allocation is seen.
    COUNTING.with(|c| c.set(true));
    drop(std::hint::black_box(Box::new(7u64)));
    COUNTING.with(|c| c.set(false));
    assert_eq!(ALLOCATIONS.swap(0, Ordering::SeqCst), 1);
    let dir = tempfile::Builder::new()
        .prefix("tp-alloc-")
        .tempdir()
        .unwrap();
    let sock = dir.path().join("tp.sock");
    let mut cfg = ServerConfig::new(&sock);
    cfg.slot_size = 4096;
    let server = Server::bind(cfg).unwrap();
    let producer = std::thread::spawn({
        let sock = sock.clone();
        move || {
            let mut p = Producer::connect(&sock, ProducerConfig::new("alloc")).unwrap();
            assert!(p.uses_rings(), "the test is about the shared-memory queues");
            let spec = TensorSpec::new(DType::F32, &[32, 32]);
            let mut result = Vec::with_capacity(64);
            for i in 0..WARMUP + MEASURED {
                if i == WARMUP {
                    COUNTING.with(|c| c.set(true));
                }
                let mut l = p.lease(Duration::from_secs(10)).unwrap();
                l.bytes_mut()[..4096].fill(i as u8);
                l.submit(&spec).unwrap();
                let (_, len) = p
                    .recv_result_into(Duration::from_secs(10), &mut result)
                    .unwrap();
                assert_eq!(len, Ok(1));
                assert_eq!(result, [i as u8]);
            }
            COUNTING.with(|c| c.set(false));
            p.close().unwrap();
        }
    });
    for i in 0..WARMUP + MEASURED {
        if i == WARMUP {
            COUNTING.with(|c| c.set(true));
        }
        let r = server
            .recv_timeout(Duration::from_secs(10))
            .unwrap()
            .expect("a request");
        let first = r.bytes()[0];
        r.respond(&[first]).unwrap();
    }
    COUNTING.with(|c| c.set(false));
    producer.join().unwrap();
    let n = ALLOCATIONS.load(Ordering::SeqCst);
    println!("{MEASURED} hand-offs after {WARMUP} warm-up ones: {n} allocations");
    assert_eq!(n, 0, "allocations on the hot path");
}
