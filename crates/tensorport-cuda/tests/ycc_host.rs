//! The GPU's YCbCr kernel, compiled for the host with the system's C++ compiler, converts the
//! planes libjpeg-turbo decodes to the same RGB as libjpeg-turbo's own decode, bit for bit
//! (`ycc_host.cpp`). Skipped, saying so, where there is no C++ compiler or libjpeg header.

use std::path::Path;
use std::process::Command;

/// The kernel's CUDA C, as the crate compiles it at run time.
fn kernel_source() -> &'static str {
    let src = include_str!("../src/ycc.rs");
    let start = src.find("r#\"").expect("the kernel's raw string") + 3;
    let end = start + src[start..].find("\"#;").expect("its end");
    &src[start..end]
}

#[test]
fn the_ycc_kernel_matches_libjpeg_turbo_bit_for_bit() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let header = ["/usr/include/jpeglib.h", "/usr/local/include/jpeglib.h"]
        .iter()
        .any(|p| Path::new(p).exists());
    let has_cxx = Command::new(&cxx).arg("--version").output().is_ok();
    if !header || !has_cxx {
        eprintln!("SKIPPED: needs a C++ compiler ({cxx}) and libjpeg-turbo's header (libjpeg-turbo8-dev / libjpeg62-turbo-dev)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("kernel.inc"), kernel_source()).unwrap();
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ycc_host.cpp");
    std::fs::copy(&here, dir.path().join("ycc_host.cpp")).unwrap();
    let exe = dir.path().join("ycc_host");
    let built = Command::new(&cxx)
        .current_dir(dir.path())
        .args(["-O1", "-o"])
        .arg(&exe)
        .arg("ycc_host.cpp")
        .arg("-ljpeg")
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "compiling the kernel for the host failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let said = String::from_utf8_lossy(&run.stdout);
    println!("{said}");
    assert!(
        run.status.success(),
        "the kernel differs from libjpeg-turbo:\n{said}"
    );
    assert!(said.contains("96 cases, 0 differ"), "{said}");
}
