//! The repository stands alone: no doc, help text, script or source file points at files outside
//! it (a user who clones it must be able to rerun every command it shows).

use std::path::Path;

/// Files a user reads or runs: docs, sources (help text lives there), scripts, manifests.
fn checked(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("md" | "rs" | "sh" | "py" | "toml")
    ) || path.file_name().is_some_and(|n| n == "run")
}

fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let name = e.file_name();
        let name = name.to_string_lossy();
        if p.is_dir() {
            // Build outputs and fetched or generated material are not the project's text.
            if !matches!(
                name.as_ref(),
                "target" | ".git" | "dist" | "corpus" | "artifacts"
            ) {
                walk(&p, out);
            }
        } else if checked(&p) {
            out.push(p);
        }
    }
}

#[test]
fn nothing_points_outside_the_repository() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    walk(root, &mut files);
    assert!(
        files.iter().any(|f| f.ends_with("README.md")) && files.len() > 40,
        "expected to read the README and the sources, read {} files",
        files.len()
    );
    // Split so this file does not match itself.
    let outside = ["..", "/shared"].concat();
    let mut hits = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        for (i, line) in text.lines().enumerate() {
            if line.contains(&outside) {
                hits.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        hits.is_empty(),
        "expected no reference to {outside} (the project keeps its own peer scripts in \
         bench/peers and GPU helpers in scripts/), found:\n{}",
        hits.join("\n")
    );
}

#[test]
fn every_peer_script_the_docs_name_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let docs = std::fs::read_to_string(root.join("docs/benchmarks.md")).unwrap();
    let named: Vec<&str> = docs
        .split(|c: char| c.is_whitespace() || c == '`' || c == '(' || c == ')')
        .filter(|w| w.starts_with("bench/peers/") || w.starts_with("cli/"))
        .map(|w| w.trim_end_matches([',', '.', ':', ';']))
        .collect();
    assert!(
        named.iter().any(|w| w.starts_with("bench/peers/")),
        "expected docs/benchmarks.md to name its peer scripts"
    );
    for w in named {
        assert!(
            root.join(w).exists(),
            "docs/benchmarks.md names {w}, which is not in the repository"
        );
    }
}
