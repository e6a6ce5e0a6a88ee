//! Inputs that are not what they seem: file names with newlines or bytes that are not UTF-8,
//! a FIFO or a folder named like an image, a JPEG whose scans ask for far more decoding than
//! its pixels need. Each gets exactly one line (scores or an error naming it), in its place,
//! and nothing blocks: every run here has a watchdog.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{output_within, run, tmp, EXE, SIZE};

/// The result lines of `path`, in the order written.
fn lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A baseline JPEG with `extra` more one-component scans (each an AC refinement of the first
/// component: a full pass over its blocks) before its end marker.
fn with_extra_scans(jpeg: &[u8], extra: usize) -> Vec<u8> {
    let mut v = jpeg[..jpeg.len() - 2].to_vec();
    let first = jpeg
        .windows(2)
        .position(|w| w[0] == 0xFF && matches!(w[1], 0xC0..=0xC2))
        .expect("a frame");
    let comp = jpeg[first + 10];
    for _ in 0..extra {
        v.extend_from_slice(&[0xFF, 0xDA, 0, 8, 1, comp, 0, 1, 63, 0x10, 0x00]);
    }
    v.extend_from_slice(&[0xFF, 0xD9]);
    v
}

/// `jpeg` (a small sample) declaring a progressive frame of `side`² pixels: a file of a few
/// kilobytes whose decoder would hold the coefficients of the whole frame.
fn as_huge_progressive(jpeg: &[u8], side: u16) -> Vec<u8> {
    let mut v = jpeg.to_vec();
    let sof = v
        .windows(2)
        .position(|w| w[0] == 0xFF && matches!(w[1], 0xC0..=0xC2))
        .expect("a frame");
    v[sof + 1] = 0xC2;
    v[sof + 5..sof + 9].copy_from_slice(&[
        (side >> 8) as u8,
        side as u8,
        (side >> 8) as u8,
        side as u8,
    ]);
    v
}

/// A folder of sample images plus: a copy of a sample JPEG whose name holds a newline (what a
/// line-per-path list would split in two), one whose name is not UTF-8, a FIFO and a folder
/// named `.jpg`, a JPEG with 200 extra scans and one of a few kilobytes declaring a progressive
/// frame of 62 megapixels. One line each, in a farm that ends; the
/// renamed copies get the scores of the file they copy; the others say why they were refused.
#[test]
fn awkward_names_and_things_that_are_not_images_get_one_line_each() {
    let dir = tmp();
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "4"]);
    assert!(ok, "{err}");
    let original = images.join("sample-001.jpg");
    let jpeg = std::fs::read(&original).unwrap();
    let newline = images.join("sample-001 copy\nsample-999.jpg");
    let not_utf8 = images.join(OsStr::from_bytes(b"sample-001-\xff\xfe.jpg"));
    std::fs::write(&newline, &jpeg).unwrap();
    std::fs::write(&not_utf8, &jpeg).unwrap();
    nix::unistd::mkfifo(
        &images.join("fifo.jpg"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    std::fs::create_dir(images.join("folder.jpg")).unwrap();
    std::fs::write(images.join("scans.jpg"), with_extra_scans(&jpeg, 200)).unwrap();
    std::fs::write(images.join("huge.jpg"), as_huge_progressive(&jpeg, 7900)).unwrap();

    let out = dir.path().join("r.jsonl");
    let o = output_within(
        Command::new(EXE)
            .args([
                "farm",
                "--input",
                images.to_str().unwrap(),
                "--model",
                "none",
            ])
            .args([
                "--image-size",
                &SIZE.to_string(),
                "-p",
                "2",
                "--stall-secs",
                "20",
            ])
            .args(["--progress", "never", "--output"])
            .arg(&out)
            .stdin(Stdio::null()),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got = lines(&out);
    // 4 samples, the 2 copies, the FIFO, the folder, the scans, the huge frame.
    assert_eq!(got.len(), 10, "{got:?}");
    let mut indices: Vec<u64> = got.iter().map(|l| l["index"].as_u64().unwrap()).collect();
    indices.sort();
    assert_eq!(indices, (0..10).collect::<Vec<u64>>());
    let by_name = |needle: &str| {
        got.iter()
            .find(|l| l["input"].as_str().unwrap().contains(needle))
            .unwrap_or_else(|| panic!("no line for {needle}: {got:?}"))
    };
    let error = |needle: &str| by_name(needle)["error"].as_str().map(str::to_string);
    assert!(
        error("fifo.jpg").is_some_and(|e| e.contains("a FIFO")),
        "{got:?}"
    );
    assert!(error("folder.jpg").is_some_and(|e| e.contains("a directory")));
    assert!(error("scans.jpg").is_some_and(|e| e.contains("decoding-work bomb")));
    assert!(
        error("huge.jpg").is_some_and(|e| e.contains("memory bomb") && e.contains("357 MiB")),
        "{got:?}"
    );
    // `--model none` answers with empty scores: the copies are simply not errors, and each has
    // one line under its own name.
    assert_eq!(error("copy\nsample-999.jpg"), None);
    assert_eq!(error("sample-001-\u{fffd}\u{fffd}.jpg"), None);
    // The name that is not UTF-8 is shown lossily, and kept exactly in "input_bytes".
    let exact: Vec<u8> =
        serde_json::from_value(by_name("sample-001-\u{fffd}\u{fffd}.jpg")["input_bytes"].clone())
            .unwrap();
    assert_eq!(exact, not_utf8.as_os_str().as_bytes());
    assert_eq!(
        got.iter()
            .filter(|l| l.get("input_bytes").is_some())
            .count(),
        1,
        "{got:?}"
    );
    assert_eq!(
        got.iter()
            .filter(|l| l["input"].as_str().unwrap().contains("sample-001"))
            .count(),
        3
    );
}

/// `--input-list FILE --null` (and `-` with `--null`): paths end with a NUL, so a name with a
/// newline is one input in its place, and the indices follow the list.
#[test]
fn a_nul_separated_input_list_keeps_every_name_whole_and_in_place() {
    let dir = tmp();
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "3"]);
    assert!(ok, "{err}");
    let jpeg = std::fs::read(images.join("sample-001.jpg")).unwrap();
    let tricky = images.join("a\nb.jpg");
    std::fs::write(&tricky, &jpeg).unwrap();
    let listed: Vec<PathBuf> = vec![
        images.join("sample-000.png"),
        tricky.clone(),
        images.join("sample-002.png"),
        tricky,
    ];
    let mut list = Vec::new();
    for p in &listed {
        list.extend_from_slice(p.as_os_str().as_bytes());
        list.push(0);
    }
    let list_file = dir.path().join("list");
    std::fs::write(&list_file, &list).unwrap();
    for from_stdin in [false, true] {
        let out = dir.path().join(format!("r-{from_stdin}.jsonl"));
        let mut cmd = Command::new(EXE);
        cmd.args(["farm", "--null", "--input-list"])
            .arg(if from_stdin {
                Path::new("-")
            } else {
                &list_file
            })
            .args(["--image-size", &SIZE.to_string(), "-p", "2"])
            .args(["--progress", "never", "--output"])
            .arg(&out)
            .stdin(match from_stdin {
                true => Stdio::from(std::fs::File::open(&list_file).unwrap()),
                false => Stdio::null(),
            });
        let o = output_within(&mut cmd, Duration::from_secs(120));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let mut got = lines(&out);
        got.sort_by_key(|l| l["index"].as_u64().unwrap());
        let inputs: Vec<&str> = got.iter().map(|l| l["input"].as_str().unwrap()).collect();
        let want: Vec<String> = listed.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(inputs, want, "stdin: {from_stdin}");
        assert!(got.iter().all(|l| l.get("error").is_none()), "{got:?}");
        // The same file listed twice: the same scores.
        assert_eq!(got[1]["scores"], got[3]["scores"]);
        assert_ne!(got[0]["scores"], got[1]["scores"]);
    }
}

/// `prep` over a folder with a FIFO among its images leaves the FIFO out with a warning naming
/// it, instead of waiting on it for ever.
#[test]
fn prep_leaves_out_a_fifo_instead_of_blocking_on_it() {
    let dir = tmp();
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "2"]);
    assert!(ok, "{err}");
    nix::unistd::mkfifo(
        &images.join("pipe.jpg"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let o = output_within(
        Command::new(EXE)
            .args(["prep", "--input", images.to_str().unwrap()])
            .args(["--image-size", "32", "--repeat", "1"])
            .stdin(Stdio::null()),
        Duration::from_secs(120),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("left out") && stderr.contains("pipe.jpg") && stderr.contains("a FIFO"),
        "{stderr}"
    );
}

/// A file named `synthetic:5` in an input list is a file: its line says `./synthetic:5` (the
/// same file), never what a generated image's line says.
#[test]
fn a_file_named_like_a_generated_image_is_not_taken_for_one() {
    let dir = tmp();
    let images = dir.path().join("images");
    let (ok, _, err) = run(&["images", "--out", images.to_str().unwrap(), "--count", "1"]);
    assert!(ok, "{err}");
    let first = std::fs::read_dir(&images).unwrap().next().unwrap().unwrap();
    std::fs::copy(first.path(), images.join("synthetic:5")).unwrap();
    std::fs::write(dir.path().join("list"), "synthetic:5\n").unwrap();
    let out = dir.path().join("r.jsonl");
    let o = output_within(
        Command::new(EXE)
            .current_dir(&images)
            .args(["farm", "--input-list"])
            .arg(dir.path().join("list"))
            .args(["--image-size", &SIZE.to_string(), "-p", "1"])
            .args(["--progress", "never", "--output"])
            .arg(&out)
            .stdin(Stdio::null()),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let got = lines(&out);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["input"], "./synthetic:5", "{got:?}");
    assert!(got[0].get("error").is_none(), "{got:?}");
    // A generated image keeps its name.
    let o = output_within(
        Command::new(EXE)
            .args([
                "farm",
                "--synthetic",
                "6",
                "--image-size",
                &SIZE.to_string(),
            ])
            .args(["-p", "1", "--progress", "never", "--output"])
            .arg(&out)
            .stdin(Stdio::null()),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(lines(&out).iter().any(|l| l["input"] == "synthetic:5"));
}
