//! Arbitrary bytes as a client (or server) byte stream: framing, decoding, and validation of any
//! descriptor that decodes must return errors, never panic, and never allocate past the limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorport_wire::{
    decode_client, decode_server, for_each_frame, validate, ClientMsg, PoolBounds, MAX_FRAME_LEN,
};

fuzz_target!(|data: &[u8]| {
    // The first byte picks the read size, so every split of the stream gets exercised.
    let (chunk, rest) = match data.split_first() {
        Some((c, r)) => ((*c as usize % 64) + 1, r),
        None => return,
    };
    let pool = PoolBounds {
        slot_count: 8,
        slot_size: 1 << 20,
    };
    let _ = for_each_frame(rest, chunk, MAX_FRAME_LEN, |payload| {
        assert!(payload.len() <= MAX_FRAME_LEN as usize);
        if let Ok(ClientMsg::Submit { tensor, .. }) = decode_client(payload) {
            if let Ok(d) = validate(&tensor, &pool) {
                assert!(d.offset() + d.byte_len() <= pool.slot_size);
                assert!(d.slot().slot < pool.slot_count);
            }
        }
        let _ = decode_server(payload);
    });
});
