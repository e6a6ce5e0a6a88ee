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
        .filter(|w| w.starts_with("bench/peers/") || w.starts_with("crates/"))
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

/// A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn every_link_between_the_docs_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs: Vec<std::path::PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.extend([root.join("README.md"), root.join("CHANGELOG.md")]);
    let anchors = |p: &Path| -> Vec<String> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix('#'))
            .map(|l| anchor_of(l.trim_start_matches('#')))
            .collect()
    };
    let mut broken = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        for link in text.split("](").skip(1) {
            let Some(end) = link.find(')') else { continue };
            let link = &link[..end];
            if link.contains("://") || link.contains(char::is_whitespace) {
                continue;
            }
            let (file, anchor) = link.split_once('#').unwrap_or((link, ""));
            let target = if file.is_empty() {
                doc.clone()
            } else {
                doc.parent().unwrap().join(file)
            };
            if !target.exists() {
                broken.push(format!("{}: {link} (no such file)", doc.display()));
            } else if !anchor.is_empty()
                && target.extension().is_some_and(|e| e == "md")
                && !anchors(&target).iter().any(|a| a == anchor)
            {
                broken.push(format!("{}: {link} (no such heading)", doc.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}
