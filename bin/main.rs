//! `tensorport`: the command line (`tensorport_cli::main_with`) as an executable.

fn main() -> std::process::ExitCode {
    let launcher = tensorport_cli::Launcher::this_executable();
    std::process::ExitCode::from(tensorport_cli::main_with(std::env::args_os(), launcher))
}
