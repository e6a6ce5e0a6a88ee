//! `tensorport-bridge`: remote producers for a tensorport server, over Apache Arrow Flight.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cli;
mod confine;

/// Feed a tensorport server from other hosts. On the inference host, `gateway` takes remote
/// producers' tensors over Arrow Flight (gRPC, TLS) into the local server's pools, as local
/// producer sessions; on a preprocessing host, `produce` prepares images and sends them to a
/// gateway. Every call carries a shared token (`token` writes one). See docs/scale-out.md.
#[derive(Parser, Debug)]
#[command(
    name = "tensorport-bridge",
    version,
    max_term_width = 100,
    args_override_self = true
)]
struct Cli {
    /// Log level (error, warn, info, debug, trace) or a tracing filter; RUST_LOG also works.
    #[arg(long, global = true)]
    log: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    Gateway(cli::gateway::Args),
    Produce(cli::produce::Args),
    Token(cli::token::Args),
    /// (The gateway's own: one NIXL stream's reads, in a process of their own.)
    #[command(hide = true)]
    NixlReader(NixlReaderArgs),
}

#[derive(clap::Args, Debug)]
struct NixlReaderArgs {
    #[arg(long)]
    pool: std::path::PathBuf,
    #[arg(long)]
    slots: u32,
    #[arg(long)]
    slot_size: u64,
    #[arg(long)]
    name: String,
    /// The only addresses it may connect to (the producer's).
    #[arg(long, required = true, value_delimiter = ',')]
    connect_only: Vec<std::net::IpAddr>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default = match cli.command {
        Command::Gateway(_) => "info",
        _ => "warn",
    };
    let filter = cli
        .log
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| default.to_string());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let r = match cli.command {
        Command::Gateway(a) => cli::gateway::run(a),
        Command::Produce(a) => cli::produce::run(a),
        Command::Token(a) => cli::token::run(a),
        Command::NixlReader(a) => {
            // Before NIXL loads: UCX connects where the producer's metadata says.
            confine::only(&a.connect_only);
            let allowed: Vec<String> = a.connect_only.iter().map(|ip| ip.to_string()).collect();
            let note = || {
                confine::refused().map(|to| {
                    format!(
                        "refused to connect to {to}, which the producer's NIXL metadata names: a NIXL stream is read only from the address it came from ({}); a producer with several network interfaces sets UCX_NET_DEVICES to the one it reaches the gateway on",
                        allowed.join(", ")
                    )
                })
            };
            return ExitCode::from(tensorport_bridge::nixl_reader::serve(
                &a.pool,
                a.slots,
                a.slot_size,
                &a.name,
                &note,
            ));
        }
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tensorport-bridge: {e}");
            e.exit_code()
        }
    }
}
