//! The resize kernel's CUDA source compiled for the CPU (`kernel_cpu/resize.cpp`: a few macros
//! stand in for CUDA's qualifiers and thread indices) against PIL's two antialiased passes
//! written out directly: every pixel the same, bit for bit, in 8-bit and normalised f32 output,
//! for enlargements, mild and strong shrinks and off-centre windows. Built once plainly and, on
//! a CPU with fused multiply-add, once with it (as the GPU computes `a * b + c`). Needs a C++
//! compiler (`$CXX`, else `c++`); says it is skipped, and why, without one.

use std::path::Path;
use std::process::Command;

#[test]
fn the_kernel_resizes_as_pils_two_passes_written_out() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().expect("a temporary folder");
    let fma = std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|s| s.contains(" fma"));
    let mut builds = vec![("plain", None)];
    if fma && cfg!(target_arch = "x86_64") {
        builds.push(("fused multiply-add", Some("-mfma")));
    }
    for (name, flag) in builds {
        let exe = dir
            .path()
            .join(format!("resize-{}", flag.unwrap_or("plain")));
        let mut cmd = Command::new(&cxx);
        cmd.args(["-O2", "-w", "-o"]).arg(&exe);
        cmd.args(flag);
        cmd.arg(here.join("tests/kernel_cpu/resize.cpp"))
            .arg("-I")
            .arg(here.join("src/kernels"));
        match cmd.output() {
            Err(e) => {
                eprintln!("SKIPPED: no C++ compiler to build the kernel for the CPU ({cxx}: {e})");
                return;
            }
            Ok(o) if !o.status.success() => panic!(
                "compiling the kernel for the CPU ({name}) failed:\n{}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Ok(_) => {}
        }
        let out = Command::new(&exe).output().expect("the check runs");
        let said = String::from_utf8_lossy(&out.stdout);
        println!("{name}: {said}");
        assert!(
            out.status.success() && said.contains("PASS"),
            "the kernel's pixels differ from PIL's two passes ({name}):\n{said}"
        );
    }
}
