//! The binary's subcommands.

pub mod gateway;
pub mod inputs;
pub mod produce;
pub mod token;
pub mod ucx;

use std::path::PathBuf;
use std::process::ExitCode;

/// A failure, with the exit code it gets: 2 for a usage mistake, 1 for the rest.
#[derive(Debug)]
pub struct CliError {
    message: String,
    usage: bool,
}

impl CliError {
    pub fn new(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            usage: false,
        }
    }

    pub fn usage(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            usage: true,
        }
    }

    pub fn exit_code(&self) -> ExitCode {
        ExitCode::from(if self.usage { 2 } else { 1 })
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

macro_rules! from_error {
    ($($t:ty),*) => {$(
        impl From<$t> for CliError {
            fn from(e: $t) -> CliError {
                CliError::new(e.to_string())
            }
        }
    )*};
}
from_error!(
    std::io::Error,
    tensorport_bridge::auth::TokenError,
    tensorport_bridge::remote::RemoteError,
    tensorport_bridge::gateway::ServeError,
    tensorport_bridge::schema::SchemaError,
    tensorport_vision::Error
);

pub type CliResult<T> = Result<T, CliError>;

/// The token file option, shared by both sides.
#[derive(clap::Args, Debug)]
pub struct TokenArg {
    /// File holding the shared token (one line, mode 0600; `tensorport-bridge token FILE`
    /// writes one). Remote producers send it with every call; the gateway refuses calls without
    /// it.
    #[arg(long, env = "TENSORPORT_BRIDGE_TOKEN_FILE", value_name = "FILE")]
    pub token_file: PathBuf,
}
