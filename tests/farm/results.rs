//! The farm's results against the same model run in process: f32 and 8-bit pixels, two
//! model workers, real JPEG and PNG files.

use super::*;

#[test]
fn farm_results_match_the_in_process_model_bitwise() {
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let o = farm_cmd(&out, 300, 3).output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "farm failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("done        300 (0 with errors)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("images/s") && stdout.contains("p99"),
        "{stdout}"
    );
    // Not a terminal: no progress drawing, no escape codes.
    assert!(
        !stderr.contains('\x1b') && !stderr.contains("tensorport farm"),
        "{stderr}"
    );
    check_results(&out, 300);
}

#[test]
fn top_k_lines_keep_the_highest_scores_of_the_full_lines() {
    // The same inputs with every score and with --top-k 3: each line's "top_k" is the three
    // highest of the full line's scores, highest first; "class" is the same; no "scores".
    let dir = tmp();
    let (full, top) = (dir.path().join("full.jsonl"), dir.path().join("top.jsonl"));
    for (out, extra) in [(&full, &[][..]), (&top, &["--top-k", "3"][..])] {
        let o = farm_cmd(out, 40, 2).args(extra).output().unwrap();
        assert!(
            o.status.success(),
            "farm {extra:?} failed:\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let by_index = |p: &Path| -> HashMap<u64, serde_json::Value> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|v| (v["index"].as_u64().unwrap(), v))
            .collect()
    };
    let (full, top) = (by_index(&full), by_index(&top));
    assert_eq!((full.len(), top.len()), (40, 40));
    for (i, t) in &top {
        let scores: Vec<f64> = full[i]["scores"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let mut best: Vec<(usize, f64)> = scores.iter().copied().enumerate().collect();
        best.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        best.truncate(3);
        let got: Vec<(usize, f64)> = t["top_k"]
            .as_array()
            .unwrap_or_else(|| panic!("input {i}: no top_k in {t}"))
            .iter()
            .map(|p| (p[0].as_u64().unwrap() as usize, p[1].as_f64().unwrap()))
            .collect();
        assert_eq!(got, best, "input {i}");
        assert!(t.get("scores").is_none(), "input {i}: {t}");
        assert_eq!(t["class"], full[i]["class"], "input {i}");
        assert_eq!(t["class"].as_u64(), Some(best[0].0 as u64), "input {i}");
    }
}

#[test]
fn two_model_workers_answer_as_the_in_process_model() {
    // serve --workers 2: two threads, each its own copy of the model, each its share of the
    // producers: every answer still equals the in-process model's, bit for bit.
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let o = farm_cmd(&out, 200, 4)
        .args(["--workers", "2"])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "farm failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    check_results(&out, 200);
}

#[test]
fn eight_bit_pixels_give_the_same_scores_bitwise() {
    // Producers hand over u8 planes (a quarter of the bytes); the server normalises them with
    // the same table, so every score equals the in-process model's on f32 input, bit for bit —
    // on generated images and on JPEG/PNG files.
    let dir = tmp();
    let out = dir.path().join("r.jsonl");
    let o = farm_cmd(&out, 60, 2)
        .args(["--pixels", "u8"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check_results(&out, 60);
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "12"]);
    assert!(ok, "{err}");
    let out = dir.path().join("f.jsonl");
    let o = Command::new(EXE)
        .args([
            "farm",
            "--input",
            images.to_str().unwrap(),
            "--pixels",
            "u8",
        ])
        .args(["--image-size", &SIZE.to_string(), "--producers", "2"])
        .args(["--progress", "never", "--output"])
        .arg(&out)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check_results(&out, 12);
    // What the server receives: u8 tensors holding the image's 8-bit planes.
    let sock = dir.path().join("s.sock");
    let server = tensorport::Server::bind(tensorport::ServerConfig::new(&sock)).unwrap();
    let size = SIZE.to_string();
    let mut child = Command::new(EXE)
        .args([
            "--log",
            "warn",
            "produce",
            "--socket",
            sock.to_str().unwrap(),
        ])
        .args(["--synthetic", "2", "--image-size", &size, "--pixels", "u8"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut prep =
        tensorport_vision::Preprocessor::new(tensorport_vision::Transform::standard(SIZE as u32));
    for _ in 0..2 {
        let req = server
            .recv_timeout(std::time::Duration::from_secs(30))
            .unwrap()
            .expect("a request");
        assert_eq!(req.desc().dtype(), tensorport::DType::U8);
        assert_eq!(req.desc().shape(), &[3, SIZE as u64, SIZE as u64]);
        let mut want = vec![0u8; 3 * SIZE * SIZE];
        let src = Source::Synthetic(req.request_id());
        prep.prepare_into(&src, tensorport_vision::Planes::U8(&mut want))
            .unwrap();
        assert_eq!(&req.bytes()[..want.len()], &want[..]);
        req.release()
            .respond(&tensorport_farm::record::scores_to_bytes(&[0.0; 10]))
            .unwrap();
    }
    assert!(child.wait().unwrap().success());
}

#[test]
fn farm_on_jpeg_and_png_files_profiles_every_stage() {
    let dir = tmp();
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "24"]);
    assert!(ok, "{err}");
    let out = dir.path().join("r.jsonl");
    let o = Command::new(EXE)
        .args(["farm", "--input", images.to_str().unwrap()])
        .args(["--image-size", &SIZE.to_string(), "--producers", "2"])
        .args(["--progress", "never", "--profile", "--output"])
        .arg(&out)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // The standard transform on real files, bitwise the same as in-process.
    check_results(&out, 24);
    for stage in [
        "decode",
        "resize",
        "normalise",
        "lease wait",
        "submit to result",
    ] {
        assert!(
            stdout.contains(stage),
            "expected the summary to give the {stage} stage:\n{stdout}"
        );
    }
    let first = std::fs::read_to_string(&out).unwrap();
    let v: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    assert!(
        v["stages"]["decode_ms"].as_f64().is_some_and(|x| x >= 0.0),
        "expected per-input stage times with --profile: {v}"
    );
    // `--jpeg-decoder zune-jpeg` reaches the producers: bitwise the in-process zune-jpeg path,
    // and (where libjpeg-turbo is the default) not the default's scores for every JPEG file.
    let zune = dir.path().join("zune.jsonl");
    let o = Command::new(EXE)
        .args(["farm", "--input", images.to_str().unwrap()])
        .args(["--image-size", &SIZE.to_string(), "--producers", "2"])
        .args([
            "--progress",
            "never",
            "--jpeg-decoder",
            "zune-jpeg",
            "--output",
        ])
        .arg(&zune)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    check_results_decoded_with(&zune, 24, JpegDecoder::ZuneJpeg);
    if JpegDecoder::default() == JpegDecoder::LibjpegTurbo {
        let scores = |p: &Path| -> HashMap<String, Vec<u32>> {
            read_results(p)
                .into_iter()
                .map(|l| {
                    let bits = l.scores.unwrap().iter().map(|x| x.to_bits()).collect();
                    (l.input, bits)
                })
                .collect()
        };
        let (a, b) = (scores(&out), scores(&zune));
        let differ = a
            .iter()
            .filter(|(k, v)| k.ends_with(".jpg") && b.get(*k) != Some(*v))
            .count();
        assert!(
            differ > 0,
            "the two decoders gave the same scores for every JPEG file"
        );
    }
}

/// A folder with a decompression bomb among real images (a 1 KB-class JPEG declaring
/// 10000×10000): the farm gives every input one line, the bomb's an error naming the file and
/// the limit, the others scores; `--max-megapixels` moves the limit (below the real images'
/// size, they are refused too).
#[test]
fn a_decompression_bomb_gets_an_error_line_that_says_why() {
    let dir = tmp();
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "6"]);
    assert!(ok, "{err}");
    let jpeg = std::fs::read_dir(&images)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "jpg"))
        .expect("a sample JPEG");
    let mut bomb = std::fs::read(&jpeg).unwrap();
    let sof = bomb.windows(2).position(|b| b == [0xFF, 0xC0]).unwrap();
    bomb[sof + 5..sof + 9].copy_from_slice(&[0x27, 0x10, 0x27, 0x10]);
    std::fs::write(images.join("bomb.jpg"), &bomb).unwrap();
    let farm = |out: &Path, extra: &[&str]| farm_lines(&images, out, extra);
    let lines = farm(&dir.path().join("a.jsonl"), &[]);
    assert_eq!(lines.len(), 7);
    for l in &lines {
        let input = l["input"].as_str().unwrap();
        if input.ends_with("bomb.jpg") {
            let e = l["error"].as_str().expect("the bomb's line is an error");
            assert!(
                e.contains("bomb.jpg") && e.contains("10000x10000") && e.contains("megapixels"),
                "{e}"
            );
        } else {
            assert!(l.get("error").is_none(), "{l}");
        }
    }
    // A limit below the samples' own size refuses every one of them, each with its line.
    let lines = farm(&dir.path().join("b.jsonl"), &["--max-megapixels", "0.001"]);
    assert_eq!(lines.len(), 7);
    assert!(lines.iter().all(|l| l["error"]
        .as_str()
        .is_some_and(|e| e.contains("megapixels"))));
}

/// Files that are not plain JPEGs among real images — a truncated JPEG, a JPEG header followed
/// by junk, an empty file, text named `.jpg`, a PNG named `.jpg`, a JPEG named `.png`, a JPEG
/// whose frame header says 12-bit samples — each get
/// exactly one line: scores where a decoder can make an image of it (a truncated scan is filled
/// in, as libjpeg does), otherwise an error that names the file and says why.
#[test]
fn odd_files_get_one_line_each_and_errors_name_the_file() {
    let dir = tmp();
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "4"]);
    assert!(ok, "{err}");
    let file = |ext: &str| {
        std::fs::read_dir(&images)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == ext))
            .unwrap()
    };
    let jpeg = std::fs::read(file("jpg")).unwrap();
    let png = std::fs::read(file("png")).unwrap();
    std::fs::write(images.join("truncated.jpg"), &jpeg[..jpeg.len() / 2]).unwrap();
    let mut junk = jpeg[..20].to_vec();
    junk.extend((0..4000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8));
    std::fs::write(images.join("junk.jpg"), &junk).unwrap();
    std::fs::write(images.join("empty.jpg"), b"").unwrap();
    std::fs::write(images.join("text.jpg"), b"not an image at all\n").unwrap();
    std::fs::write(images.join("png-named.jpg"), &png).unwrap();
    std::fs::write(images.join("jpeg-named.png"), &jpeg).unwrap();
    // The sample precision is the byte after a start-of-frame marker's length.
    let sof = jpeg
        .windows(2)
        .position(|w| w[0] == 0xFF && matches!(w[1], 0xC0..=0xC2))
        .expect("a start-of-frame marker");
    let mut twelve = jpeg.clone();
    twelve[sof + 4] = 12;
    std::fs::write(images.join("twelve-bit.jpg"), &twelve).unwrap();
    let lines = farm_lines(&images, &dir.path().join("odd.jsonl"), &[]);
    assert_eq!(lines.len(), 11, "one line per input");
    let mut seen = std::collections::HashSet::new();
    for l in &lines {
        let input = l["input"].as_str().unwrap().to_string();
        assert!(seen.insert(input.clone()), "{input} twice");
        let name = std::path::Path::new(&input)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let must_fail = matches!(
            name.as_str(),
            "junk.jpg" | "empty.jpg" | "text.jpg" | "twelve-bit.jpg"
        );
        let decodable = matches!(name.as_str(), "png-named.jpg" | "jpeg-named.png")
            || name.starts_with("sample-");
        match l.get("error").and_then(|e| e.as_str()) {
            Some(e) => {
                assert!(!decodable, "{name} failed: {e}");
                assert!(e.contains(&name), "the error must name the file: {e}");
                if name == "empty.jpg" {
                    assert!(e.contains("empty"), "{e}");
                }
            }
            None => assert!(!must_fail, "{name} was given scores"),
        }
    }
}

/// The result lines of a farm (`--model none`, two producers, `extra` options) over the files
/// in `images`, written to `out`; the farm must succeed.
fn farm_lines(images: &Path, out: &Path, extra: &[&str]) -> Vec<serde_json::Value> {
    let o = Command::new(EXE)
        .args([
            "farm",
            "--input",
            images.to_str().unwrap(),
            "--model",
            "none",
        ])
        .args(["--image-size", &SIZE.to_string(), "--producers", "2"])
        .args(extra)
        .args(["--progress", "never", "--output"])
        .arg(out)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read_to_string(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
