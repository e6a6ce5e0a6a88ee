//! Tools for developing tensorport, the `tensorport-dev` executable's command line: what this
//! machine's CUDA can do and the device path's hand-offs between processes (`gpu`), and long
//! load with random producer kills, watching the server for leaks (`soak`). They start the
//! product's `tensorport` executable beside their own. A crate of their own, so neither the
//! product nor its Python extension links them.

mod gpu;
mod soak;

use std::ffi::OsString;

use clap::{Parser, Subcommand};
use tensorport_cli::support::{finish, init_logging, parse_log_filter, set_launcher, usage};
use tensorport_farm::config::Launcher;

pub(crate) use tensorport_cli::support as common;

/// Tools for developing tensorport itself. They start the tensorport executable beside this one.
#[derive(Parser, Debug)]
#[command(name = "tensorport-dev", version, propagate_version = true)]
struct DevCli {
    /// Log level for messages on stderr: off, error, warn, info, debug, trace, or a filter such
    /// as `warn,tensorport=debug` [default: info].
    #[arg(long, global = true, env = "TENSORPORT_LOG", value_parser = parse_log_filter)]
    log: Option<String>,
    #[command(subcommand)]
    command: DevCommand,
}

#[derive(Subcommand, Debug)]
enum DevCommand {
    /// What this machine's CUDA can do, host-to-device bandwidth from pinned pools, and the
    /// device path's hand-offs between processes.
    Gpu(gpu::Args),
    /// Long load with random producer kills, checking the server for leaks (not for CI); runs
    /// the `tensorport` executable beside this one.
    Soak(soak::Args),
}

/// How the tools start the product's commands (`soak`'s server and producers).
pub(crate) fn launcher() -> Launcher {
    tensorport_cli::support::launcher()
}

/// Runs the `tensorport-dev` command line `args` (the program's name first) and returns the
/// process's exit status, as `tensorport_cli::run` does for `tensorport`; `tensorport` is how
/// its tools start the product's commands.
pub fn run_dev<I, T>(args: I, tensorport: Launcher) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match DevCli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return usage(e),
    };
    set_launcher(tensorport);
    init_logging(cli.log.as_deref().unwrap_or("info"));
    finish(match cli.command {
        DevCommand::Gpu(a) => gpu::run(a),
        DevCommand::Soak(a) => soak::run(a),
    })
}
