//! The examples run and do what they say (cargo builds them before the tests).

use std::path::PathBuf;
use std::process::Command;

fn example(name: &str) -> PathBuf {
    // target/<profile>/deps/<this test> → target/<profile>/examples/<name>
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}

fn run(name: &str, args: &[&str]) -> String {
    let path = example(name);
    assert!(path.exists(), "{} not built", path.display());
    let o = Command::new(&path).args(args).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{name} failed:\n{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

#[test]
fn minimal_pair_sums_ten_tensors() {
    let out = run("minimal", &[]);
    assert_eq!(out.lines().count(), 10, "{out}");
    // 32x32 tensor of 9s sums to 9216.
    assert!(out.contains("of 9s = 9216"), "{out}");
}

#[test]
fn pipeline_classifies_every_image_once() {
    let out = run("pipeline", &["3", "48"]);
    let classified = out.lines().filter(|l| l.starts_with("image")).count();
    assert_eq!(classified, 48, "{out}");
    assert!(out.contains("48 images from 3 producer processes"), "{out}");
}

#[test]
fn async_batches_serves_all() {
    let out = run("async_batches", &["2", "40"]);
    assert!(out.contains("served 80 images"), "{out}");
    assert_eq!(out.matches(": 40 answers").count(), 2, "{out}");
}

#[test]
fn own_model_serves_a_model_written_in_the_example_to_a_farm() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/images");
    let want = std::fs::read_dir(&dir).unwrap().count();
    let out = run("own_model", &[]);
    assert!(
        out.contains(&format!("{want} images classified by your model")),
        "{out}"
    );
    let mut classified = 0;
    for line in out.lines().filter(|l| l.starts_with("sample-")) {
        // `NAME: COLOUR [r,g,b]`: the class is the largest score's.
        let (_, rest) = line.split_once(": ").unwrap();
        let (colour, scores) = rest.split_once(' ').unwrap();
        let scores: Vec<f32> = serde_json::from_str(scores).unwrap();
        let best = (0..3)
            .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
            .unwrap();
        assert_eq!(colour, ["red", "green", "blue"][best], "{line}");
        classified += 1;
    }
    assert_eq!(classified, want, "{out}");
}

#[test]
fn examples_refuse_arguments_they_do_not_understand() {
    for (name, args, says) in [
        ("minimal", &["--fast"][..], "unexpected argument '--fast'"),
        (
            "pipeline",
            &["three"][..],
            "'three' is not a positive count",
        ),
        (
            "pipeline",
            &["3", "48", "extra"][..],
            "unexpected argument 'extra'",
        ),
        ("async_batches", &["0"][..], "'0' is not a positive count"),
        ("own_model", &["a", "b"][..], "unexpected argument 'b'"),
        ("own_model", &["--fast"][..], "unexpected argument '--fast'"),
    ] {
        let o = Command::new(example(name)).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{name} {args:?} should exit 2 with its usage; stderr:\n{err}"
        );
        assert!(
            err.contains("usage: ") && err.contains(says),
            "{name} {args:?}: expected the usage line and {says:?}, got:\n{err}"
        );
    }
}
