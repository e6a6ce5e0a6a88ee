//! The NIXL reader confines where UCX connects by this executable's own `connect` (src/confine.rs);
//! UCX is loaded at run time, so the symbol must be in the executable's dynamic symbol table for
//! it to bind there rather than in the C library.
fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg-bin=tensorport-bridge=-Wl,--export-dynamic-symbol=connect");
    }
}
