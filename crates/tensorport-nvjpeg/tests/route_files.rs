//! Each JPEG file goes to the decoder its header calls for: real files of each chroma layout,
//! written by an encoder and read back from disk as a farm reads them (no GPU needed).

use jpeg_encoder::{ColorType, Encoder, SamplingFactor};
use tensorport_nvjpeg::{Decoders, GpuDecode, Route, Upsampling};
use tensorport_vision::sniff::{jpeg_file_frame, Chroma};

/// A 96×64 photo-like gradient written as a JPEG with `sampling` (or grayscale) into `dir`.
fn write(
    dir: &std::path::Path,
    name: &str,
    sampling: Option<SamplingFactor>,
) -> std::path::PathBuf {
    let (w, h) = (96u16, 64u16);
    let path = dir.join(name);
    let mut enc = Encoder::new_file(&path, 90).expect("a file to write");
    match sampling {
        Some(s) => {
            enc.set_sampling_factor(s);
            let rgb: Vec<u8> = (0..u32::from(w) * u32::from(h))
                .flat_map(|i| [(i % 251) as u8, (i / 97 % 256) as u8, (i * 7 % 256) as u8])
                .collect();
            enc.encode(&rgb, w, h, ColorType::Rgb).expect("encoded");
        }
        None => {
            let gray: Vec<u8> = (0..u32::from(w) * u32::from(h))
                .map(|i| (i % 256) as u8)
                .collect();
            enc.encode(&gray, w, h, ColorType::Luma).expect("encoded");
        }
    }
    path
}

#[test]
fn files_go_to_the_decoder_their_chroma_calls_for() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let cases = [
        ("full.jpg", Some(SamplingFactor::R_4_4_4), Chroma::Full),
        ("half.jpg", Some(SamplingFactor::R_4_2_2), Chroma::HalfWidth),
        (
            "quarter.jpg",
            Some(SamplingFactor::R_4_2_0),
            Chroma::Quarter,
        ),
        ("tall.jpg", Some(SamplingFactor::R_4_4_0), Chroma::Other),
        ("gray.jpg", None, Chroma::Gray),
    ];
    let by_chroma = Decoders {
        engines: true,
        plain: true,
        hybrid_threads: 4,
        mode: GpuDecode::ByChroma,
        upsampling: Upsampling::Interpolate,
    };
    let engines_only = Decoders {
        mode: GpuDecode::Engines,
        ..by_chroma
    };
    let split = Decoders {
        mode: GpuDecode::Split,
        upsampling: Upsampling::Replicate,
        ..by_chroma
    };
    for (name, sampling, chroma) in cases {
        let frame = jpeg_file_frame(&write(dir.path(), name, sampling)).expect("a JPEG frame");
        assert_eq!(frame.chroma, chroma, "{name}");
        assert_eq!((frame.width, frame.height), (96, 64), "{name}");
        // `split` as set here replicates chroma: gray and 4:4:0 files stay on the engines'
        // replicating decoder.
        let (want_by_chroma, want_split, want_engines) = match chroma {
            Chroma::Full => (Route::Hybrid, Route::Hybrid, Route::BatchedPlain),
            Chroma::HalfWidth | Chroma::Quarter => (Route::Batched, Route::Hybrid, Route::Batched),
            _ => (Route::Batched, Route::BatchedPlain, Route::Batched),
        };
        assert_eq!(by_chroma.route(frame.chroma), want_by_chroma, "{name}");
        assert_eq!(split.route(frame.chroma), want_split, "{name}");
        assert_eq!(engines_only.route(frame.chroma), want_engines, "{name}");
    }
}
