//! `tensorport-bridge token`: writes a new shared token.

use std::path::PathBuf;
use std::process::ExitCode;

use tensorport_bridge::auth::Token;

use super::CliResult;

/// Write a new random token (32 bytes from the kernel, as hex) to FILE, readable only by you.
/// Copy the file to the gateway's host and each producer host over a channel you trust (scp,
/// your secret store); never overwrites a file.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Where to write it.
    pub file: PathBuf,
}

pub fn run(a: Args) -> CliResult<ExitCode> {
    Token::generate(&a.file)?;
    eprintln!("wrote a new token to {} (mode 0600)", a.file.display());
    Ok(ExitCode::SUCCESS)
}
