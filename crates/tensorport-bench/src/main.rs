//! `tensorport-bench`: tensorport's host hand-off against its peers (iceoryx2, a Unix-socket
//! copy, memcpy) on the same payloads, in one run. See docs/benchmarks.md.
//!
//! ```sh
//! cargo run --release -p tensorport-bench -- --quick
//! ```

mod plot;
mod suite;

use std::process::ExitCode;

use clap::Parser;

/// Why the benchmark stopped: the arguments (exit code 2), or a run that failed (1).
#[derive(Debug)]
pub enum CliError {
    Usage(String),
    Failed(String),
}

impl CliError {
    pub fn new(message: impl Into<String>) -> CliError {
        CliError::Failed(message.into())
    }
    pub fn usage(message: impl Into<String>) -> CliError {
        CliError::Usage(message.into())
    }
    fn exit_code(&self) -> ExitCode {
        ExitCode::from(match self {
            CliError::Usage(_) => 2,
            CliError::Failed(_) => 1,
        })
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Usage(m) | CliError::Failed(m) => f.write_str(m),
        }
    }
}

/// The transport's and the system's errors end the run as they are.
macro_rules! failed_from {
    ($($t:ty),*) => {$(
        impl From<$t> for CliError {
            fn from(e: $t) -> CliError {
                CliError::Failed(e.to_string())
            }
        }
    )*};
}
failed_from!(tensorport::Error, std::io::Error);
tensorport::from_operation_errors!(CliError);

pub type CliResult<T> = Result<T, CliError>;

#[derive(Parser, Debug)]
#[command(
    name = "tensorport-bench",
    version,
    about,
    long_about = None,
    after_help = "Fairness (several producers) is the slowest producer's rate while it streamed, \
against the mean. TENSORPORT_BENCH_TRACE=1 in the environment makes every streaming child print \
on stderr where its time went: waiting for a slot or sample, filling it, handing it over. \
Tables and commands: docs/benchmarks.md."
)]
struct Cli {
    /// Log level for messages on stderr (the tables go to stdout): off, error, warn, info,
    /// debug, trace, or a filter such as `warn,tensorport=debug`.
    #[arg(long, env = "TENSORPORT_LOG", default_value = "warn")]
    log: String,
    #[command(flatten)]
    args: suite::Args,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match tracing_subscriber::EnvFilter::try_new(&cli.log) {
        Ok(filter) => {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_target(false)
                .try_init();
        }
        Err(e) => {
            eprintln!("error: --log {}: {e}", cli.log);
            return ExitCode::from(2);
        }
    }
    let plots = cli.args.plots.clone();
    let r = suite::run(cli.args).and_then(|results| match (results, plots) {
        (Some(results), Some(dir)) => plot::write(&dir, &results),
        _ => Ok(()),
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}
