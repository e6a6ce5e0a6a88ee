//! The `tensorport` command line as a library: the inference server, the producer, the farm
//! that runs both, a control tool and the measuring tools a user needs (`model-bench`, `prep`),
//! each a thin face over `tensorport-farm`. The `tensorport` executable runs [`run`] on its
//! arguments; so does the Python package's extension (`python -m tensorport`, the `tensorport`
//! command a wheel installs), which starts its child processes through Python instead of an
//! executable of its own. The developer tools (`gpu`, `soak`) are another crate,
//! `tensorport-dev`, built on [`support`]; the Python extension does not link them.

mod common;
mod ctl;
mod error;
mod farm;
mod model_bench;
mod prep;
mod produce;
mod serve;
mod tools;
mod view;

use std::ffi::OsString;
use std::sync::OnceLock;

use clap::{Parser, Subcommand};
use tensorport_farm::config::Launcher;

/// Zero-copy tensor hand-off between processes on one machine.
///
/// Producers prepare tensors straight into shared memory that the inference process reads in
/// place; one process owns the model (and the GPU), many feed it. Start with `tensorport farm
/// --synthetic 512`, which runs a server and producers together and prints a summary.
#[derive(Parser, Debug)]
#[command(name = "tensorport", version, propagate_version = true)]
struct Cli {
    /// Log level for messages on stderr: off, error, warn, info, debug, trace, or a filter such
    /// as `warn,tensorport=debug` [default: info].
    #[arg(long, global = true, env = "TENSORPORT_LOG", value_parser = common::parse_log_filter)]
    log: Option<String>,
    #[command(subcommand)]
    command: Command,
}

/// The user's commands first, then the tools that measure and check.
#[derive(Subcommand, Debug)]
enum Command {
    /// Run a server and N supervised producers over a set of images; print progress and a summary.
    Farm(farm::Args),
    /// Run the inference server: serve the bundled image classifier (dfdx on the CPU, cuDNN on
    /// the GPU) or an ONNX model (ONNX Runtime) to producers over the socket.
    Serve(serve::Args),
    /// Run one producer: preprocess images into shared memory, submit them, write the scores.
    Produce(produce::Args),
    /// Ask a running server for its status, or tell it to drain.
    Ctl(ctl::Args),
    /// Write sample PNG and JPEG images (a small input set to try things on).
    Images(tools::ImagesArgs),
    /// Write a weights file for the model (safetensors), from a seed.
    Weights(tools::WeightsArgs),
    /// The model alone on its device (the bundled one, or an ONNX file): a table of images/s
    /// per batch size, engine and precision.
    ModelBench(model_bench::Args),
    /// The producers' preprocessing alone on one thread: cost per step, and its tensors
    /// (--dump), to check against another pipeline's.
    Prep(prep::Args),
}

/// How child processes start this command line again (set once by [`run`]).
static LAUNCHER: OnceLock<Launcher> = OnceLock::new();

/// How to start this command line again, for child processes.
pub(crate) fn launcher() -> Launcher {
    LAUNCHER
        .get()
        .cloned()
        .unwrap_or_else(Launcher::this_executable)
}

/// Runs the command line `args` (the program's name first, as `std::env::args_os` gives it) and
/// returns the process's exit status: 0 on success, 2 for a usage error (after printing it), else
/// the failed command's own code (after printing `error: …` on stderr). `launcher` is how this
/// process's children (a farm's servers and producers) start the same command line;
/// the first call's stays for the life of the process.
pub fn run<I, T>(args: I, launcher: Launcher) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return usage(e),
    };
    let _ = LAUNCHER.set(launcher);
    common::init_logging(cli.log.as_deref().unwrap_or("info"));
    tensorport_farm::process::die_with_farm();
    finish(match cli.command {
        Command::Serve(a) => serve::run(a),
        Command::Produce(a) => produce::run(a),
        Command::Farm(a) => farm::run(a),
        Command::ModelBench(a) => model_bench::run(a),
        Command::Ctl(a) => ctl::run(a),
        Command::Prep(a) => prep::run(a),
        Command::Weights(a) => tools::weights(a),
        Command::Images(a) => tools::images(a),
    })
}

/// What another command line over this one (the developer tools, `tensorport-dev`) shares with
/// it: errors and their exit codes, the log filter, how children start this command line.
pub mod support {
    pub use crate::common::{arg_name, init_logging, parse_log_filter, CliError, CliResult};

    /// Sets how child processes start the `tensorport` command line (the first call's stays).
    pub fn set_launcher(l: tensorport_farm::config::Launcher) {
        let _ = super::LAUNCHER.set(l);
    }

    /// How child processes start the `tensorport` command line.
    pub fn launcher() -> tensorport_farm::config::Launcher {
        super::launcher()
    }

    /// Prints a usage error (or --help, --version: status 0) and returns its status.
    pub fn usage(e: clap::Error) -> u8 {
        super::usage(e)
    }

    /// The status of a command's result, after printing its error.
    pub fn finish(r: CliResult<u8>) -> u8 {
        super::finish(r)
    }
}

/// Prints a usage error (or --help, --version: status 0) and returns its status.
fn usage(e: clap::Error) -> u8 {
    let _ = e.print();
    u8::try_from(e.exit_code()).unwrap_or(2)
}

/// The status of a command's result, after printing its error.
fn finish(r: common::CliResult<u8>) -> u8 {
    let code = match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            e.exit_code()
        }
    };
    // A process that embeds this (Python's) may end without Rust's exit-time flush.
    let _ = std::io::Write::flush(&mut std::io::stdout());
    code
}
