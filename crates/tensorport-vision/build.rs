//! Builds the libjpeg shim (`csrc/tp_jpeg.c`) when libjpeg(-turbo)'s header is there, and links
//! libjpeg statically when its archive is found, so the binaries run on machines without it
//! (the GPU machines among them). Without the header the crate decodes JPEG with zune-jpeg only,
//! and says so once in the build output.
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
    if let Err(e) = build.try_compile("tp_jpeg") {
        println!(
            "cargo::warning=libjpeg's header (jpeglib.h) not found or the shim did not build \
             ({e}); JPEG decoding with zune-jpeg only. Install libjpeg-turbo's development \
             files (Debian: libjpeg62-turbo-dev) for the faster decoder."
        );
        return;
    }
    match lib_dirs.iter().find(|d| d.join("libjpeg.a").is_file()) {
        Some(dir) => {
            println!("cargo::rustc-link-search=native={}", dir.display());
            println!("cargo::rustc-link-lib=static=jpeg");
        }
        None => {
            if let Some(r) = &root {
                for d in lib_dirs.iter().filter(|d| d.starts_with(r)) {
                    println!("cargo::rustc-link-search=native={}", Path::new(d).display());
                }
            }
            println!("cargo::rustc-link-lib=dylib=jpeg");
        }
    }
    println!("cargo::rustc-cfg=tp_libjpeg");
}
