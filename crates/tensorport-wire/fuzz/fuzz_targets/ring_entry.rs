//! Arbitrary words as a peer's shared-memory queue entries: any submission decodes, its view is
//! refused (rank) or validated like any descriptor, and an accepted one lies inside its slot;
//! any completion header decodes with its inline length within the entry. Entries round-trip.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorport_wire::entry::{
    CqHeader, SqEntry, CQ_HEADER_WORDS, CQ_INLINE_BYTES, SQ_ENTRY_WORDS,
};
use tensorport_wire::{validate_view, PoolBounds, WireError, MAX_DIMS};

fn words<const N: usize>(data: &[u8]) -> [u64; N] {
    let mut w = [0u64; N];
    for (i, v) in w.iter_mut().enumerate() {
        let mut b = [0u8; 8];
        for (k, x) in b.iter_mut().enumerate() {
            *x = data.get(i * 8 + k).copied().unwrap_or(0);
        }
        // Mix small and huge values: small ones make valid descriptors likely.
        let v0 = u64::from_le_bytes(b);
        *v = if v0 & 1 == 0 { v0 >> 44 } else { v0 };
    }
    w
}

fuzz_target!(|data: &[u8]| {
    let w: [u64; SQ_ENTRY_WORDS] = words(data);
    let e = SqEntry::from_words(&w);
    assert_eq!(SqEntry::from_words(&e.to_words()), e);
    let pool = PoolBounds {
        slot_count: 8,
        slot_size: 1 << 20,
    };
    let loc = e.location();
    let fence = e.fence();
    match e.view(&loc, fence.as_ref()) {
        Err(WireError::BadRank(r)) => assert!(r > MAX_DIMS),
        Err(other) => panic!("unexpected {other:?}"),
        Ok(v) => {
            // Two registered device buffers of 1 MiB.
            if let Ok(d) = validate_view(&v, &pool, &|b| (b < 2).then_some(1 << 20)) {
                if d.is_device() {
                    assert!(d.offset() + d.byte_len() <= 1 << 20);
                } else {
                    assert!(d.offset() + d.byte_len() <= pool.slot_size);
                    assert!(d.slot().slot < pool.slot_count);
                }
            }
        }
    }
    let h: [u64; CQ_HEADER_WORDS] = words(data.get(SQ_ENTRY_WORDS * 8..).unwrap_or(&[]));
    let c = CqHeader::from_words(&h);
    assert!(c.len as usize <= CQ_INLINE_BYTES);
    assert_eq!(CqHeader::from_words(&c.to_words()), c);
});
