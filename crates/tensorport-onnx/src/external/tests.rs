//! External data files against crafted models: where they may be, how much of them is read.

use super::*;
use crate::proto::put_u64;

/// A tensor message named `name`, external at `location` (with `offset`, `length`), or
/// holding `raw`.
fn tensor(name: &str, location: Option<&str>, at: Option<(u64, u64)>, raw: &[u8]) -> Vec<u8> {
    let mut t = Vec::new();
    put_u64(&mut t, 1, raw.len().max(4) as u64 / 4); // dims
    put_u64(&mut t, 2, 1); // float
    put_bytes(&mut t, NAME, name.as_bytes());
    match location {
        Some(l) => {
            let mut entry = |k: &str, v: &str| {
                let mut e = Vec::new();
                put_bytes(&mut e, 1, k.as_bytes());
                put_bytes(&mut e, 2, v.as_bytes());
                put_bytes(&mut t, EXTERNAL_DATA, &e);
            };
            entry("location", l);
            if let Some((o, n)) = at {
                entry("offset", &o.to_string());
                entry("length", &n.to_string());
            }
            put_u64(&mut t, DATA_LOCATION, EXTERNAL);
        }
        None => put_bytes(&mut t, RAW_DATA, raw),
    }
    t
}

/// A model whose graph holds `init` as an initializer and, inside an `If` node's
/// subgraph, `nested`.
fn model(init: &[u8], nested: &[u8]) -> Vec<u8> {
    let mut sub = Vec::new();
    put_bytes(&mut sub, 5, nested);
    let mut attr = Vec::new();
    put_bytes(&mut attr, 1, b"then_branch");
    put_bytes(&mut attr, 6, &sub);
    let mut node = Vec::new();
    put_bytes(&mut node, 4, b"If");
    put_bytes(&mut node, 5, &attr);
    let mut graph = Vec::new();
    put_bytes(&mut graph, 1, &node);
    put_bytes(&mut graph, 5, init);
    put_bytes(&mut graph, 2, b"g");
    let mut m = Vec::new();
    put_u64(&mut m, 1, 8);
    put_bytes(&mut m, 7, &graph);
    m
}

/// Every tensor of `m`, as (name, raw_data, still external).
fn tensors(m: &[u8]) -> Vec<(String, Vec<u8>, bool)> {
    fn walk(kind: Kind, m: &[u8], out: &mut Vec<(String, Vec<u8>, bool)>) {
        let mut f = Fields::new(m);
        if kind == Kind::Tensor {
            let (mut n, mut raw, mut ext) = (String::new(), Vec::new(), false);
            while let Some(x) = f.next_field().unwrap() {
                match (x.number, x.value) {
                    (NAME, Value::Bytes(b)) => n = String::from_utf8_lossy(b).into(),
                    (RAW_DATA, Value::Bytes(b)) => raw = b.to_vec(),
                    (DATA_LOCATION | EXTERNAL_DATA, _) => ext = true,
                    _ => {}
                }
            }
            out.push((n, raw, ext));
            return;
        }
        while let Some(x) = f.next_field().unwrap() {
            if let (Some(k), Value::Bytes(b)) = (kind.child(x.number), x.value) {
                walk(k, b, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(Kind::Model, m, &mut out);
    out
}

#[test]
fn external_data_in_the_models_folder_is_read_in_and_anything_else_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("w.bin"), b"0123456789abcdef").unwrap();
    std::fs::create_dir(d.join("sub")).unwrap();
    std::fs::write(d.join("sub/n.bin"), b"WXYZ").unwrap();
    let m = model(
        &tensor("w", Some("w.bin"), Some((4, 8)), b""),
        &tensor("n", Some("./sub/n.bin"), None, b""),
    );
    let path = d.join("m.onnx");
    std::fs::write(&path, &m).unwrap();
    let got = read_model(&path).unwrap();
    let t = tensors(&got.bytes);
    assert_eq!(
        t,
        vec![
            ("n".into(), b"WXYZ".to_vec(), false),
            ("w".into(), b"456789ab".to_vec(), false)
        ]
    );
    let names: Vec<_> = got.files.iter().map(|s| s.path.clone()).collect();
    assert_eq!(
        names,
        [path.clone(), d.join("./sub/n.bin"), d.join("w.bin")]
    );
    assert!(got.files.iter().all(|s| s.change().is_none()));
    // A model without external data comes back as it was.
    let plain = model(
        &tensor("w", None, None, b"abcd"),
        &tensor("n", None, None, b"ef"),
    );
    std::fs::write(&path, &plain).unwrap();
    assert_eq!(read_model(&path).unwrap().bytes, plain);

    // What is refused, and what the refusal says.
    std::fs::create_dir(d.join("fifo-dir")).unwrap();
    nix::unistd::mkfifo(&d.join("pipe"), nix::sys::stat::Mode::S_IRWXU).unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), b"secret!!").unwrap();
    std::os::unix::fs::symlink(outside.path().join("secret"), d.join("link.bin")).unwrap();
    std::os::unix::fs::symlink("w.bin", d.join("inside-link.bin")).unwrap();
    for (location, at, want) in [
        ("/etc/passwd", None, "absolute path or one with .."),
        ("../../etc/passwd", None, "absolute path or one with .."),
        ("sub/../w.bin", None, "absolute path or one with .."),
        ("link.bin", None, "leads outside the model's folder"),
        ("pipe", None, "not a regular file"),
        ("fifo-dir", None, "not a regular file"),
        ("missing.bin", None, "No such file"),
        ("w.bin", Some((10, 7)), "runs past the end"),
        ("w.bin", Some((u64::MAX, 2)), "runs past the end"),
        ("", None, "no file name"),
    ] {
        let m = model(&tensor("bad", Some(location), at, b""), &[]);
        std::fs::write(&path, &m).unwrap();
        let e = read_model(&path).unwrap_err().to_string();
        assert!(e.contains(want) && e.contains("\"bad\""), "{location}: {e}");
        assert!(e.contains("m.onnx"), "{e}");
    }
    // A link that stays in the folder is the file it names.
    let m = model(
        &tensor("w", Some("inside-link.bin"), Some((0, 4)), b""),
        &[],
    );
    std::fs::write(&path, &m).unwrap();
    let t = tensors(&read_model(&path).unwrap().bytes);
    assert!(t.contains(&("w".into(), b"0123".to_vec(), false)), "{t:?}");
    // Data and a reference both.
    let mut both = tensor("both", Some("w.bin"), None, b"");
    put_bytes(&mut both, RAW_DATA, b"1234");
    std::fs::write(&path, model(&both, &[])).unwrap();
    let e = read_model(&path).unwrap_err().to_string();
    assert!(e.contains("names an external file too"), "{e}");
}

#[test]
fn files_are_checked_before_they_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let e = read_model(&dir.path().join("missing.onnx")).unwrap_err();
    assert!(matches!(e, Error::Unreadable { .. }), "{e}");
    let e = read_model(dir.path()).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    let fifo = dir.path().join("m.onnx");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
    let e = read_model(&fifo).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    // Over the limit, sparse: refused before a byte is read.
    let huge = dir.path().join("huge.onnx");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(MAX_MODEL_BYTES + 1)
        .unwrap();
    assert!(matches!(read_model(&huge), Err(Error::TooLarge { .. })));
}

#[test]
fn a_data_file_changed_after_reading_is_noticed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("w.bin"), b"0123456789abcdef").unwrap();
    let path = d.join("m.onnx");
    std::fs::write(&path, model(&tensor("w", Some("w.bin"), None, b""), &[])).unwrap();
    let got = read_model(&path).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("w.bin"))
        .unwrap()
        .set_len(3)
        .unwrap();
    let changes: Vec<_> = got.files.iter().filter_map(Stamp::change).collect();
    assert_eq!(changes, ["3 bytes, 16 when read"]);
    std::fs::remove_file(d.join("w.bin")).unwrap();
    assert!(got.files[1].change().unwrap().starts_with("it is gone"));
}

#[test]
fn hostile_models_are_errors_never_panics() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.onnx");
    // Nested subgraphs past the limit.
    let mut g = Vec::new();
    for _ in 0..(MAX_DEPTH + 2) {
        let mut attr = Vec::new();
        put_bytes(&mut attr, 6, &g);
        let mut node = Vec::new();
        put_bytes(&mut node, 5, &attr);
        g = Vec::new();
        put_bytes(&mut g, 1, &node);
    }
    let mut m = Vec::new();
    put_bytes(&mut m, 7, &g);
    std::fs::write(&path, &m).unwrap();
    let e = read_model(&path).unwrap_err().to_string();
    assert!(e.contains("nested"), "{e}");
    // Every prefix of a real model that cuts a message is refused as malformed.
    let good = model(
        &tensor("w", None, None, b"abcd"),
        &tensor("n", None, None, b"ef"),
    );
    for cut in 1..good.len() {
        std::fs::write(&path, &good[..cut]).unwrap();
        if let Err(e) = read_model(&path) {
            assert!(matches!(e, Error::Malformed { .. }), "{e}");
        }
    }
    std::fs::write(&path, &good[..good.len() - 1]).unwrap();
    let e = read_model(&path).unwrap_err().to_string();
    assert!(
        e.contains("cannot load it: not a well-formed ONNX model"),
        "{e}"
    );
}
