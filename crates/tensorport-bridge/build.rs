//! The NIXL reader confines where UCX connects by this executable's own `connect` (src/confine.rs);
//! UCX is loaded at run time, so the symbol must be in the executable's dynamic symbol table for
//! it to bind there rather than in the C library. A dynamic list (older than
//! `--export-dynamic-symbol`, so every GNU ld and lld take it) names it.
fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let list = out.join("exported.list");
    std::fs::write(&list, "{ connect; };\n").expect("write the dynamic list");
    println!(
        "cargo:rustc-link-arg-bin=tensorport-bridge=-Wl,--dynamic-list={}",
        list.display()
    );
    println!("cargo:rerun-if-changed=build.rs");
}
