//! `tensorport-bridge gateway`: remote producers into the local tensorport server.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tensorport_bridge::auth::Token;
use tensorport_bridge::gateway::{Gateway, GatewayConfig};
use tensorport_bridge::tls::ServerTls;

use super::{CliError, CliResult, TokenArg};

/// Take tensors from remote producers over Arrow Flight and hand them to the tensorport server on
/// this host. Each remote producer's stream becomes a producer session of the server (its tensors
/// land in that session's pool, with the producer's request ids), and its results go back on the
/// stream. Prints `listening on ADDR` once it accepts connections; SIGINT or SIGTERM stops it
/// and prints a summary.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to listen on (port 0: any free port, printed at start).
    #[arg(long, default_value = "127.0.0.1:7450")]
    pub listen: SocketAddr,
    /// The local tensorport server's socket [default: tensorport's default socket].
    #[arg(long, env = "TENSORPORT_SOCKET")]
    pub socket: Option<PathBuf>,
    #[command(flatten)]
    pub token: TokenArg,
    /// This gateway's TLS certificate chain (PEM). With --tls-key, clients connect with
    /// https://.
    #[arg(long, requires = "tls_key", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// This gateway's TLS private key (PEM).
    #[arg(long, requires = "tls_cert", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (mutual TLS), besides the token.
    #[arg(long, requires = "tls_cert", value_name = "PEM")]
    pub tls_client_ca: Option<PathBuf>,
    /// Listen without TLS on an address other hosts can reach. The token then crosses the
    /// network in clear: only on a network you trust.
    #[arg(long)]
    pub allow_plaintext: bool,
    /// Remote producers served at once; more are refused until one leaves.
    #[arg(long, default_value_t = 16)]
    pub max_remotes: usize,
    /// Requests in flight per remote producer (the slots of its session's pool).
    #[arg(long, default_value_t = 32)]
    pub in_flight: u32,
    /// Largest tensor taken, in MiB. With --max-remotes it bounds the gateway's memory for
    /// messages being received: each stream holds at most one message of a tensor (or batch)
    /// being decoded and one decoded batch waiting, plus its 8 MiB HTTP/2 window.
    #[arg(long, default_value_t = 64)]
    pub max_tensor_mib: u64,
    /// Threads that receive and decode the streams [default: the CPUs, at most 8]. Each remote
    /// producer also has a thread of its own that hands its tensors to the server.
    #[arg(long, value_name = "N")]
    pub io_threads: Option<usize>,
    /// Seconds a remote producer may leave its results unread (or the server a request
    /// unanswered) before its stream is ended and its session closed.
    #[arg(long, default_value_t = 60)]
    pub peer_timeout: u64,
    /// The GPU (ordinal) that device tensors of NIXL producers (`produce --transport nixl --gpu`)
    /// are read into and handed to the server from, as a GPU producer's; the server must run on
    /// a GPU (`serve --device cuda`).
    #[arg(long, default_value_t = 0, value_name = "ORDINAL")]
    pub gpu: u32,
    /// TCP connections open at once. At the cap, the oldest connection that has not shown the
    /// token (one that has sent nothing first) is closed to make room; a new one is refused only
    /// when every open one has.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// TCP connections open at once from one address (room is made as for --max-connections,
    /// among that address's connections).
    #[arg(long, default_value_t = 64)]
    pub max_connections_per_host: usize,
    /// Seconds a new connection has to make a call with the token (the TLS handshake
    /// included); one that has not by then is closed, and one that has sent nothing at all
    /// after 3 s (or this, if shorter).
    #[arg(long, default_value_t = 10)]
    pub auth_timeout: u64,
    /// The network interface NIXL's UCX may listen and connect on (its `UCX_NET_DEVICES`, unless
    /// that is set) [default: the interface of the --listen address; with an address that is
    /// every interface (0.0.0.0, ::), none, and NIXL streams are refused].
    #[arg(long, value_name = "IFACE")]
    pub nixl_interface: Option<String>,
    /// Take NIXL streams of GPU memory (`produce --transport nixl --gpu`). The gateway reads
    /// them in its own process (host-memory streams each get a process of their own), so a
    /// producer whose NIXL set-up makes UCX abort ends the gateway and every stream on it: give
    /// this only where every token holder is trusted.
    #[arg(long)]
    pub nixl_device: bool,
}

pub fn run(a: Args) -> CliResult<ExitCode> {
    let token = Token::read(&a.token.token_file)?;
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => Some(ServerTls {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: a.tls_client_ca.clone(),
        }),
        _ => None,
    };
    if tls.is_none() && !a.listen.ip().is_loopback() && !a.allow_plaintext {
        return Err(CliError::usage(format!(
            "{} is reachable from other hosts, and without TLS the token and tensors cross the network in clear; give --tls-cert and --tls-key, or --allow-plaintext on a network you trust",
            a.listen
        )));
    }
    let socket = a
        .socket
        .clone()
        .unwrap_or_else(tensorport::path::default_socket_path);
    let max_tensor_bytes = a.max_tensor_mib.max(1) << 20;
    let cfg = GatewayConfig {
        socket: socket.clone(),
        token,
        tls: tls.clone(),
        max_remotes: a.max_remotes.max(1),
        in_flight: a.in_flight.max(1),
        max_tensor_bytes,
        // A record batch holds at least one tensor, plus Arrow's framing.
        max_message_bytes: (max_tensor_bytes as usize).saturating_add(1 << 20),
        peer_timeout: Duration::from_secs(a.peer_timeout.max(1)),
        connections: tensorport_bridge::gateway::ConnLimits {
            total: a.max_connections.max(1),
            per_peer: a.max_connections_per_host.max(1),
            auth_deadline: Duration::from_secs(a.auth_timeout.max(1)),
            ..Default::default()
        },
        gpu: a.gpu,
        nixl_interface: a
            .nixl_interface
            .clone()
            .or_else(|| super::ucx::interface_of(a.listen.ip())),
        nixl_device: a.nixl_device,
    };
    super::ucx::confine(cfg.nixl_interface.as_deref());
    let io_threads = a.io_threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .min(8)
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(io_threads.max(1))
        .enable_all()
        .thread_name("tp-bridge-io")
        .build()?;
    let gateway = Gateway::new(cfg);
    let counters = gateway.counters();
    let t0 = Instant::now();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(a.listen)
            .await
            .map_err(|e| CliError::new(format!("cannot listen on {}: {e}", a.listen)))?;
        let addr = listener.local_addr()?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        println!(
            "listening on {scheme}://{addr} for remote producers, feeding the tensorport server at {}",
            socket.display()
        );
        std::io::stdout().flush()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let mut serving = tokio::spawn(gateway.serve(listener, async {
            let _ = stopped.await;
        }));
        tokio::select! {
            r = &mut serving => return r.map_err(|e| CliError::new(e.to_string()))?.map_err(CliError::from),
            _ = stop_signal() => {}
        }
        let _ = stop.send(());
        // Streams still open get a grace period to end.
        match tokio::time::timeout(Duration::from_secs(10), serving).await {
            Ok(r) => r.map_err(|e| CliError::new(e.to_string()))??,
            Err(_) => tracing::warn!("streams still open after 10 s; stopping anyway"),
        }
        Ok::<_, CliError>(())
    })?;
    let c = &counters;
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "gateway stopped after {secs:.1} s: {} streams, {} tensors ({:.1} MB) submitted, {} results sent, {} calls refused, {} streams broke with requests in flight",
        c.streams.load(Ordering::Relaxed),
        c.tensors.load(Ordering::Relaxed),
        c.bytes.load(Ordering::Relaxed) as f64 / 1e6,
        c.results.load(Ordering::Relaxed),
        c.refused.load(Ordering::Relaxed),
        c.broken.load(Ordering::Relaxed),
    );
    Ok(ExitCode::SUCCESS)
}

/// Completes on SIGINT or SIGTERM.
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => {},
        _ = term.recv() => {},
    }
    tracing::info!("stopping: no new streams; open ones end");
}
