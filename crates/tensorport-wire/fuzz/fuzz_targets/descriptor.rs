//! Structured descriptors built from raw bytes (any dtype, rank, shape, strides, offset, length,
//! slot): validation must refuse or accept, and an accepted descriptor's every byte must lie in
//! its slot.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorport_wire::{validate_in, PoolBounds, RawFence, RawLocation, RawTensorDesc, SlotRef};

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
    let on_device = data[2] & 2 == 2;
    let fence = match data[2] >> 2 & 3 {
        1 => Some(RawFence::Timeline {
            semaphore: (data[2] >> 4) as u32 & 1,
            value: 7,
        }),
        2 => Some(RawFence::CudaIpcEvent(vec![0; 64])),
        _ => None,
    };
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
        location: if on_device {
            RawLocation::DeviceBuffer(SlotRef { slot, generation: 0 })
        } else {
            RawLocation::HostSlot(SlotRef { slot, generation: 0 })
        },
        fence,
    };
    let pool = PoolBounds {
        slot_count: 8,
        slot_size,
    };
    // Device buffers 0..4 are registered, with lengths unlike the slot size.
    let device_len = |b: u32| (b < 4).then(|| 1000 + 4096 * b as u64);
    if let Ok(d) = validate_in(&raw, &pool, &device_len) {
        let end = d.offset().checked_add(d.byte_len()).expect("no overflow once checked");
        if d.is_device() {
            assert!(end <= device_len(d.slot().slot).expect("registered"));
        } else {
            assert!(end <= pool.slot_size);
            assert!(d.slot().slot < pool.slot_count);
            assert!(d.timeline().is_none());
        }
        assert_eq!(d.offset() % d.dtype().size(), 0);
        // The strided extent fits in the bytes described.
        if d.numel() > 0 {
            let mut last = 0u64;
            for (dim, st) in d.shape().iter().zip(d.strides().iter()) {
                last += (dim - 1) * st;
            }
            assert!((last + 1) * d.dtype().size() <= d.byte_len());
        }
    }
});
