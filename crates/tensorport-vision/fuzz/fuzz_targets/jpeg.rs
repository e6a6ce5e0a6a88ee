//! Arbitrary bytes as an input file through a producer's preprocessing: the decoders (libjpeg-turbo
//! through the C shim, deciding which window to decode; zune-jpeg and `image` as fallbacks)
//! must refuse or decode, never crash, hang or write out of bounds, and a decoded tensor must be
//! finite. The first byte picks the transform (the standard one at 224 or 32, or a square 48).
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use tensorport_vision::{Preprocessor, Transform};

fuzz_target!(|data: &[u8]| {
    let Some((&pick, file)) = data.split_first() else {
        return;
    };
    let transform = match pick % 3 {
        0 => Transform::standard(224),
        1 => Transform::standard(32),
        _ => Transform::Square { size: 48 },
    };
    let mut p = Preprocessor::new(transform);
    let mut out = vec![0f32; p.out_len()];
    if p.prepare_encoded(file, Path::new("fuzz.jpg"), &mut out).is_ok() {
        assert!(out.iter().all(|v| v.is_finite()));
    }
});
