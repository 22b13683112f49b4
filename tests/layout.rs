//! The layout: no Rust file of the workspace over 500 lines (issue 32 split every file that had
//! grown past it; the import graph's rules are tests/architecture.rs).

use std::path::{Path, PathBuf};

/// Every Rust file of the workspace under `dir`, skipping build output and hidden directories.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the workspace") {
        let path = entry.expect("dir entry").path();
        let name = path.file_name().map(|n| n.to_string_lossy().to_string());
        if path.is_dir() {
            if !matches!(name.as_deref(), Some("target") | Some("fixtures"))
                && !name.is_some_and(|n| n.starts_with('.'))
            {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// A file the reader can hold in mind: past 500 lines a file owns more than one concern, and
/// the layout stops showing the architecture (issue 32 split every file that had grown past it).
#[test]
fn no_rust_file_of_the_workspace_is_over_500_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "crates", "tests", "examples", "benches"] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 100, "found only {} files", files.len());
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f)
                .expect("read a source file")
                .lines()
                .count();
            (lines > 500).then(|| {
                format!(
                    "{} ({lines} lines)",
                    f.strip_prefix(root).unwrap_or(f).display()
                )
            })
        })
        .collect();
    assert!(long.is_empty(), "files over 500 lines: {long:#?}");
}
