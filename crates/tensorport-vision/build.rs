//! Builds the libjpeg shim (`csrc/tp_jpeg.c`) when libjpeg(-turbo)'s header is there, and links
//! libjpeg statically when its archive is found, so the binaries run on machines without it
//! (the GPU machines among them). Without the header the crate decodes JPEG with zune-jpeg only,
//! and says so once in the build output.
//!
//! With the `shared-libjpeg` feature libjpeg is linked as a shared library even where its
//! archive is found: distributions build that archive without position-independent code, so it
//! cannot go into a shared object (the Python package's extension).
//!
//! `TENSORPORT_LIBJPEG=0` builds without libjpeg; `TENSORPORT_LIBJPEG_DIR` names a folder
//! holding `include/jpeglib.h` and `lib/libjpeg.a` (a libjpeg-turbo built elsewhere).

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(tp_libjpeg)");
    println!("cargo::rerun-if-changed=csrc/tp_jpeg.c");
    println!("cargo::rerun-if-env-changed=TENSORPORT_LIBJPEG");
    println!("cargo::rerun-if-env-changed=TENSORPORT_LIBJPEG_DIR");
    if std::env::var("TENSORPORT_LIBJPEG").as_deref() == Ok("0") {
        println!("cargo::warning=TENSORPORT_LIBJPEG=0: JPEG decoding with zune-jpeg only");
        return;
    }
    let root = std::env::var_os("TENSORPORT_LIBJPEG_DIR").map(PathBuf::from);
    let multiarch = format!(
        "/usr/lib/{}-linux-gnu",
        std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default()
    );
    let (includes, lib_dirs): (Vec<PathBuf>, Vec<PathBuf>) = match &root {
        Some(r) => (
            vec![r.join("include")],
            vec![r.join("lib"), r.join("lib64")],
        ),
        None => (
            vec![],
            [
                multiarch.as_str(),
                "/usr/lib64",
                "/usr/lib",
                "/usr/local/lib",
            ]
            .iter()
            .map(PathBuf::from)
            .collect(),
        ),
    };
    let mut build = cc::Build::new();
    build.file("csrc/tp_jpeg.c").warnings(true);
    for i in &includes {
        build.include(i);
    }
    if root.is_none() {
        // After the compiler's own folders: a compiler that brings its own C library's headers
        // (zig's, for an older glibc) still finds the system's libjpeg headers, and nothing else.
        let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
        for d in [
            format!("/usr/include/{arch}-linux-gnu"),
            "/usr/include".into(),
        ] {
            build.flag(format!("-idirafter{d}"));
        }
    }
    if let Err(e) = build.try_compile("tp_jpeg") {
        println!(
            "cargo::warning=libjpeg's header (jpeglib.h) not found or the shim did not build \
             ({e}); JPEG decoding with zune-jpeg only. Install libjpeg-turbo's development \
             files (Debian: libjpeg62-turbo-dev) for the faster decoder."
        );
        return;
    }
    let shared = std::env::var_os("CARGO_FEATURE_SHARED_LIBJPEG").is_some();
    let archive = lib_dirs
        .iter()
        .find(|d| !shared && d.join("libjpeg.a").is_file());
    match archive {
        Some(dir) => {
            println!("cargo::rustc-link-search=native={}", dir.display());
            println!("cargo::rustc-link-lib=static=jpeg");
        }
        None => {
            // The folder of the shared library, for linkers that search only their own (zig's).
            let found = lib_dirs.iter().find(|d| d.join("libjpeg.so").exists());
            if let Some(d) = found.or(root.as_ref().and(lib_dirs.first())) {
                println!("cargo::rustc-link-search=native={}", Path::new(d).display());
            }
            println!("cargo::rustc-link-lib=dylib=jpeg");
        }
    }
    println!("cargo::rustc-cfg=tp_libjpeg");
}
