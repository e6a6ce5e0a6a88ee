//! The `tensorport-dev` executable: tools for developing tensorport ([`tensorport_dev::run_dev`]),
//! which start the `tensorport` executable beside this one.

use std::path::PathBuf;
use std::process::ExitCode;

use tensorport_farm::config::Launcher;

fn main() -> ExitCode {
    let here = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.to_path_buf()))
        .unwrap_or_default();
    let tensorport = Launcher {
        program: here.join(PathBuf::from("tensorport")),
        args: Vec::new(),
    };
    ExitCode::from(tensorport_dev::run_dev(std::env::args_os(), tensorport))
}
