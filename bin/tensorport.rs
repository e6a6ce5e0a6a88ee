//! The `tensorport` executable: the command line of [`tensorport_cli`], whose child processes
//! start this same executable.

use std::process::ExitCode;

use tensorport_farm::config::Launcher;

fn main() -> ExitCode {
    ExitCode::from(tensorport_cli::run(
        std::env::args_os(),
        Launcher::this_executable(),
    ))
}
