//! Lengths are bounded while decoding: a hostile frame of up to the frame limit cannot make the
//! decoder allocate more than a small, fixed amount before it is refused. Allocations are
//! counted on this thread while each frame is decoded.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use tensorport_wire::{
    decode_client_naming, decode_server, ClientMsg, Hello, RawLocation, RawTensorDesc, Role,
    ServerMsg, SlotRef, WireError, MAGIC,
};

struct Counting;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
    static BYTES: Cell<usize> = const { Cell::new(0) };
}

fn note(n: usize) {
    // `try_with`: the thread-locals may be gone while a thread exits.
    let _ = ON.try_with(|on| {
        if on.get() {
            let _ = BYTES.try_with(|b| b.set(b.get() + n));
        }
    });
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting touches only
// const-initialised thread-local cells (which do not allocate).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        // SAFETY: forwarded with the caller's layout, under the caller's contract.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System.alloc` with this layout.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        note(n);
        // SAFETY: as for `dealloc`; the caller guarantees `n` is valid for `l`'s alignment.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Bytes allocated on this thread while `f` runs.
fn allocated<T>(f: impl FnOnce() -> T) -> (T, usize) {
    BYTES.with(|b| b.set(0));
    ON.with(|o| o.set(true));
    let r = f();
    ON.with(|o| o.set(false));
    (r, BYTES.with(|b| b.get()))
}

/// Most a refused frame may cost the decoder: the error's text and a few small things.
const SMALL: usize = 4096;

fn payload<T: serde::Serialize>(m: &T) -> Vec<u8> {
    let f = tensorport_wire::encode_frame(m).unwrap();
    f[4..].to_vec()
}

fn submit(shape: Vec<u64>, strides: Option<Vec<u64>>) -> ClientMsg {
    ClientMsg::Submit {
        request_id: 4242,
        tensor: RawTensorDesc {
            dtype: 0,
            shape,
            strides,
            offset: 0,
            len: 1,
            location: RawLocation::HostSlot(SlotRef {
                slot: 0,
                generation: 0,
            }),
            fence: None,
        },
    }
}

#[test]
fn a_shape_of_a_million_dimensions_is_refused_before_it_is_kept() {
    // ~1 MiB of one-byte varints: the most one frame can hold.
    let n = 1_000_000;
    let p = payload(&submit(vec![1; n], None));
    assert!(p.len() <= tensorport_wire::MAX_FRAME_LEN as usize);
    // What plain serde would have done with that list.
    let list = &p[1 + 2 + 1..]; // variant, request_id (a 2-byte varint), dtype, then the shape
    let (plain, plain_bytes) = allocated(|| postcard::take_from_bytes::<Vec<u64>>(list).is_ok());
    assert!(plain);
    let (r, bytes) = allocated(|| decode_client_naming(&p));
    println!(
        "a {n}-dimension shape: plain Vec decoding allocates {plain_bytes} bytes, bounded {bytes}"
    );
    assert!(
        matches!(r, Err((WireError::BadRank(m), Some(4242))) if m == n),
        "{r:?}"
    );
    assert!(bytes < SMALL, "{bytes} bytes allocated");
    assert!(plain_bytes > 8 * n, "the baseline measured nothing");
}

#[test]
fn every_bounded_list_and_string_is_refused_while_decoding() {
    let big = 1 << 19;
    let hello = |name: String| {
        ClientMsg::Hello(Hello {
            magic: MAGIC,
            min_version: 1,
            max_version: 2,
            role: Role::Producer,
            name,
            want_slots: 0,
            want_slot_size: 0,
        })
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("strides", payload(&submit(vec![1], Some(vec![1; big])))),
        ("client name", payload(&hello("x".repeat(big)))),
        (
            "IPC handle",
            payload(&ClientMsg::RegisterDevice {
                buffer: 0,
                len: 1,
                handle: tensorport_wire::RawDeviceHandle::LegacyIpcTimeline {
                    memory: vec![0; big],
                },
            }),
        ),
    ];
    for (what, p) in cases {
        let (r, bytes) = allocated(|| decode_client_naming(&p));
        match r {
            Err((WireError::TooLong { what: w, len, .. }, _)) => {
                assert_eq!((w, len), (what, big), "{what}")
            }
            other => panic!("{what}: {other:?}"),
        }
        assert!(bytes < SMALL, "{what}: {bytes} bytes allocated");
    }
    // From a server (a producer checks what it is sent, too).
    let grant = payload(&ServerMsg::Grant(vec![
        SlotRef {
            slot: 0,
            generation: 0
        };
        big / 4
    ]));
    let (r, bytes) = allocated(|| decode_server(&grant));
    assert!(
        matches!(r, Err(WireError::TooLong { what: "grant", .. })),
        "{r:?}"
    );
    assert!(bytes < SMALL, "grant: {bytes} bytes allocated");
    let msg = payload(&ServerMsg::Error {
        code: 1,
        request_id: None,
        fatal: false,
        message: "y".repeat(big),
    });
    let (r, bytes) = allocated(|| decode_server(&msg));
    assert!(
        matches!(
            r,
            Err(WireError::TooLong {
                what: "error message",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(bytes < SMALL, "message: {bytes} bytes allocated");
}

#[test]
fn lists_within_their_bounds_decode_as_before() {
    let p = payload(&submit(vec![2, 3, 4], Some(vec![12, 4, 1])));
    match decode_client_naming(&p).unwrap() {
        ClientMsg::Submit { tensor, .. } => {
            assert_eq!(tensor.shape, [2, 3, 4]);
            assert_eq!(tensor.strides.as_deref(), Some(&[12, 4, 1][..]));
        }
        other => panic!("{other:?}"),
    }
    // Exactly at the bound is fine; one over is not.
    let at = payload(&submit(vec![1; tensorport_wire::MAX_DIMS], None));
    assert!(decode_client_naming(&at).is_ok());
    let over = payload(&submit(vec![1; tensorport_wire::MAX_DIMS + 1], None));
    assert!(matches!(
        decode_client_naming(&over),
        Err((WireError::BadRank(9), Some(4242)))
    ));
}
