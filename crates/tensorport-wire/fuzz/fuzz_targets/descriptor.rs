//! Structured descriptors built from raw bytes (any dtype, rank, shape, strides, offset, length,
//! slot): validation must refuse or accept, and an accepted descriptor's every byte must lie in
//! its slot.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorport_wire::{validate, PoolBounds, RawLocation, RawTensorDesc, SlotRef};

fn u64_at(d: &[u8], i: &mut usize) -> u64 {
    let mut b = [0u8; 8];
    for (k, x) in b.iter_mut().enumerate() {
        *x = d.get(*i + k).copied().unwrap_or(0);
    }
    *i += 8;
    // Mix small and huge values: small ones make valid descriptors likely.
    let v = u64::from_le_bytes(b);
    if v & 1 == 0 {
        v >> 40
    } else {
        v
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let mut i = 4;
    let dtype = data[0] % 10;
    let rank = (data[1] % 10) as usize;
    let with_strides = data[2] & 1 == 1;
    let slot_size = 4096 * (1 + (data[3] as u64 % 16));
    let shape: Vec<u64> = (0..rank).map(|_| u64_at(data, &mut i)).collect();
    let strides = with_strides.then(|| (0..rank).map(|_| u64_at(data, &mut i)).collect::<Vec<_>>());
    let offset = u64_at(data, &mut i);
    let len = u64_at(data, &mut i);
    let slot = (u64_at(data, &mut i) % 12) as u32;
    let raw = RawTensorDesc {
        dtype,
        shape,
        strides,
        offset,
        len,
        location: RawLocation::HostSlot(SlotRef { slot, generation: 0 }),
        fence: None,
    };
    let pool = PoolBounds {
        slot_count: 8,
        slot_size,
    };
    if let Ok(d) = validate(&raw, &pool) {
        let end = d.offset().checked_add(d.byte_len()).expect("no overflow once checked");
        assert!(end <= pool.slot_size);
        assert!(d.slot().slot < pool.slot_count);
        assert_eq!(d.offset() % d.dtype().size(), 0);
        // The strided extent fits in the bytes described.
        if d.numel() > 0 {
            let mut last = 0u64;
            for (dim, st) in d.shape().iter().zip(d.strides()) {
                last += (dim - 1) * st;
            }
            assert!((last + 1) * d.dtype().size() <= d.byte_len());
        }
    }
});
