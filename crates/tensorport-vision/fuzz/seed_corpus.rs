//! `cargo +nightly run --bin seed-corpus` (from this folder) writes the seed corpus of the `jpeg`
//! target into `corpus/jpeg/`: JPEG and PNG files of a few shapes (landscape, portrait, odd,
//! tiny), each behind the byte that picks the transform.

fn main() {
    let dir = std::path::Path::new("corpus/jpeg");
    std::fs::create_dir_all(dir).expect("corpus folder");
    let tmp = std::env::temp_dir().join(format!("tp-seed-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("temporary folder");
    let mut n = 0u64;
    for (w, h) in [(320, 240), (240, 320), (257, 999), (17, 9), (1, 1), (64, 64)] {
        for ext in ["jpg", "png"] {
            let f = tmp.join(format!("s.{ext}"));
            tensorport_vision::synthetic(n, w, h)
                .save(&f)
                .expect("write a sample image");
            let mut bytes = vec![(n % 3) as u8];
            bytes.extend(std::fs::read(&f).expect("read it back"));
            std::fs::write(dir.join(format!("seed-{n}.{ext}")), bytes).expect("write a seed");
            n += 1;
        }
    }
    std::fs::remove_dir_all(&tmp).ok();
    println!("{n} seeds in {}", dir.display());
}
