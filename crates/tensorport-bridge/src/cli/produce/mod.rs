//! `tensorport-bridge produce`: a remote producer.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use tensorport::DType;
use tensorport_bridge::auth::Token;
use tensorport_bridge::nixl::{slot_batch, Outbound};
use tensorport_bridge::remote::{connect, Exchange, RemoteConfig, RemoteError};
use tensorport_bridge::schema::{TensorLayout, TensorRows};
use tensorport_bridge::tls::ClientTls;

use tensorport_farm::config::{Pixels, TransformKind};

use super::inputs::{Plan, Prepared};
use super::{CliError, CliResult, TokenArg};

mod ledger;
use ledger::{Pending, Run};

/// Prepare images on this host and have a tensorport server on another classify them, through
/// its `tensorport-bridge gateway`. Images are decoded, resized, cropped and normalised like
/// `tensorport produce` does, gathered into Arrow batches of --batch tensors, and streamed to the
/// gateway with up to --in-flight requests outstanding. If the connection is lost, it connects
/// again and sends what has no result yet: every input gets exactly one line. Writes one JSON
/// line per input, as `tensorport produce` does: {"index", "input", "class", "scores",
/// "latency_ms", "producer"} (or "error"); a summary goes to stderr.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The gateway: http://HOST:PORT, or https://HOST:PORT for TLS.
    #[arg(long, env = "TENSORPORT_GATEWAY", value_name = "URL")]
    pub gateway: String,
    #[command(flatten)]
    pub token: TokenArg,
    /// CA certificate (PEM) that signed the gateway's certificate [default: the system's roots
    /// are not used; give this for https].
    #[arg(long, value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// The name the gateway's certificate carries, if not the URL's host.
    #[arg(long, value_name = "NAME")]
    pub tls_domain: Option<String>,
    /// This producer's certificate (PEM), for a gateway that requires one (mutual TLS).
    #[arg(long, requires = "tls_key", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// This producer's private key (PEM).
    #[arg(long, requires = "tls_cert", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
    /// Send the token over plain http:// to another host. Without it, an http:// gateway must
    /// be this host (the token would travel in clear); use https:// across a network.
    #[arg(long)]
    pub allow_plaintext: bool,
    /// Folder of PNG/JPEG images to classify.
    #[arg(long, conflicts_with = "synthetic")]
    pub input: Option<PathBuf>,
    /// Classify N generated images instead of files.
    #[arg(long, value_name = "N")]
    pub synthetic: Option<u64>,
    /// The tensors are ready: prepare the first input once and send a copy for every input
    /// (measures the bridge without the preprocessing).
    #[arg(long)]
    pub ready: bool,
    /// With --ready: send zero tensors of this shape (comma-separated, f32) instead of images;
    /// for a server that takes any tensor (`serve --model none`).
    #[arg(long, value_delimiter = ',', requires = "ready", value_name = "DIMS")]
    pub shape: Option<Vec<u64>>,
    /// Side of the square images the server's model takes, in pixels.
    #[arg(long, default_value_t = tensorport_farm::ModelOptions::default().config.image_size as u32)]
    pub image_size: u32,
    /// The resize.
    #[arg(long, value_enum, default_value_t)]
    pub transform: TransformKind,
    /// What to send per image.
    #[arg(long, value_enum, default_value_t)]
    pub pixels: Pixels,
    /// Requests outstanding at once.
    #[arg(long, default_value_t = 64)]
    pub in_flight: usize,
    /// Tensors per Arrow batch (per gRPC message, up to 8 MiB).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Where to write the JSON lines (`-` for stdout).
    #[arg(long, short, default_value = "-")]
    pub output: PathBuf,
    /// Name shown in the gateway's and the server's logs and status.
    #[arg(long, default_value = "remote")]
    pub name: String,
    /// Connections tried again, one after another, when the gateway cannot be reached or the
    /// stream breaks, before giving up (a refused token or tensor is not retried).
    #[arg(long, default_value_t = 5)]
    pub retries: u32,
    /// Seconds to wait for a connection.
    #[arg(long, default_value_t = 10)]
    pub connect_timeout: u64,
    /// How tensors reach the gateway: inside the Flight stream, or read by the gateway from
    /// this process's NIXL-registered memory (one-sided reads over UCX: RDMA where the network
    /// has it, TCP otherwise; the stream then carries only which slot holds which request).
    /// NIXL comes from PyPI's nixl-cu13 wheel (scripts/fetch-nixl.sh) on both hosts; its data
    /// path is not authenticated, so use it only on a network you trust.
    #[arg(long, value_enum, default_value_t = Transport::Flight)]
    pub transport: Transport,
    /// With --transport nixl: keep the slots in this GPU's memory (by ordinal), as a producer
    /// that prepares its tensors on the GPU does (each tensor is copied there before it is
    /// named). The gateway then reads them over UCX's CUDA transports (CUDA IPC on one host,
    /// GPUDirect RDMA where the network has it) into its own GPU's memory and hands them to its
    /// server as device tensors; its server must run on a GPU (`serve --device cuda`).
    #[arg(long, value_name = "ORDINAL", requires = "transport")]
    pub gpu: Option<u32>,
    /// With --transport nixl: the network interface NIXL's UCX may listen and connect on (its
    /// `UCX_NET_DEVICES`, unless that is set) [default: the interface this host reaches the
    /// gateway by; `lo` for a gateway on loopback]. UCX left alone listens on every interface.
    #[arg(long, value_name = "IFACE", requires = "transport")]
    pub nixl_interface: Option<String>,
}

/// How tensors travel.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// In the Flight stream (Arrow IPC over gRPC).
    Flight,
    /// NIXL one-sided reads of this process's registered slots.
    Nixl,
}

/// A batch of tensors put into NIXL slots: the `(id, slot)` batch that names them.
fn into_slots(
    n: &mut Outbound,
    layout: &TensorLayout,
    schema: &arrow_schema::SchemaRef,
    b: &RecordBatch,
) -> CliResult<RecordBatch> {
    let rows = TensorRows::new(layout, b).map_err(|e| CliError::new(e.to_string()))?;
    let mut slots = Vec::with_capacity(rows.len());
    for i in 0..rows.len() {
        let (id, bytes) = rows.get(i);
        slots.push((id, placed(n.put(id, bytes))?));
    }
    slot_batch(schema, &slots).map_err(|e| CliError::new(e.to_string()))
}

/// The slot a tensor was put into. The window never holds more requests than there are slots,
/// so a full set of slots is a bug.
fn placed(put: Result<Option<u32>, String>) -> CliResult<u32> {
    put.map_err(|e| CliError::new(format!("--transport nixl: {e}")))?
        .ok_or_else(|| CliError::new("every NIXL slot is held (a bug: the window is the slots)"))
}

/// Inputs whose tensor is the one ready tensor, put into NIXL slots (written only into a slot
/// that does not hold it yet): the `(id, slot)` batch that names them.
fn ready_into_slots(
    n: &mut Outbound,
    schema: &arrow_schema::SchemaRef,
    items: &[(u64, String)],
    tensor: &[u8],
) -> CliResult<RecordBatch> {
    let mut slots = Vec::with_capacity(items.len());
    for &(id, _) in items {
        slots.push((id, placed(n.put_ready(id, tensor))?));
    }
    slot_batch(schema, &slots).map_err(|e| CliError::new(e.to_string()))
}

pub fn run(a: Args) -> CliResult<ExitCode> {
    let token = Token::read(&a.token.token_file)?;
    if a.gpu.is_some() && a.transport != Transport::Nixl {
        return Err(CliError::usage(
            "--gpu keeps NIXL slots on a GPU: add --transport nixl",
        ));
    }
    if a.image_size == 0 || a.in_flight == 0 || a.batch == 0 {
        return Err(CliError::usage(
            "--image-size, --in-flight and --batch must be positive",
        ));
    }
    let raw = a.shape.is_some();
    let layout = match &a.shape {
        Some(shape) => TensorLayout::new(DType::F32, shape)?,
        None => {
            let s = a.image_size as u64;
            TensorLayout::new(a.pixels.dtype(), &[3, s, s])?
        }
    };
    let inputs = Plan::inputs(a.input.as_ref(), a.synthetic)?;
    let total = inputs.len();
    let tls = ClientTls {
        ca: a.tls_ca.clone(),
        domain: a.tls_domain.clone(),
        identity: a.tls_cert.clone().zip(a.tls_key.clone()),
    };
    let cfg = RemoteConfig {
        gateway: a.gateway.clone(),
        token,
        tls: Some(tls),
        name: a.name.clone(),
        connect_timeout: Duration::from_secs(a.connect_timeout.max(1)),
        allow_plaintext: a.allow_plaintext,
    };
    // Refused before anything is prepared or sent.
    tensorport_bridge::remote::check_transport(&cfg).map_err(|e| CliError::usage(e.to_string()))?;
    if a.transport == Transport::Nixl {
        // Before NIXL's agent (and any thread) starts.
        let iface = a
            .nixl_interface
            .clone()
            .or_else(|| super::ucx::interface_towards(&a.gateway));
        if iface.is_none() && std::env::var_os("UCX_NET_DEVICES").is_none() {
            return Err(CliError::usage(format!(
                "--transport nixl: cannot tell which network interface reaches {}; give \
                 --nixl-interface (UCX would listen on every one)",
                a.gateway
            )));
        }
        super::ucx::confine(iface.as_deref());
    }
    let out: Box<dyn Write> = if a.output.as_os_str() == "-" {
        Box::new(std::io::stdout().lock())
    } else {
        Box::new(std::io::BufWriter::new(
            std::fs::File::create(&a.output).map_err(|e| {
                CliError::usage(format!("cannot create {}: {e}", a.output.display()))
            })?,
        ))
    };
    let batch = a.batch.min(a.in_flight);
    let plan = Plan {
        inputs,
        layout: layout.clone(),
        transform: a.transform.for_size(a.image_size),
        pixels: a.pixels,
        ready: a.ready,
        raw,
        shared_ready: a.transport == Transport::Nixl,
        batch,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("tp-bridge-io")
        .build()?;
    let mut run = Run {
        out,
        name: a.name.clone(),
        pending: HashMap::new(),
        unanswered: VecDeque::new(),
        lines: 0,
        errors: 0,
        bytes: 0,
        nixl: match a.transport {
            Transport::Flight => None,
            Transport::Nixl => {
                let slots = u32::try_from(a.in_flight.max(batch))
                    .map_err(|_| CliError::usage("--in-flight is too large"))?;
                let name = format!("{}-{}", a.name, std::process::id());
                Some(
                    Outbound::new(&name, slots, &layout, a.gpu)
                        .map_err(|e| CliError::new(format!("--transport nixl: {e}")))?,
                )
            }
        },
    };
    let t0 = Instant::now();
    let r = rt.block_on(stream_all(&cfg, &layout, plan, &a, &mut run));
    let secs = t0.elapsed().as_secs_f64();
    let reconnects = match &r {
        Ok(n) => *n,
        Err(_) => 0,
    };
    if let Err(e) = r {
        // Every input sent still gets its line.
        let why = format!("not answered: {e}");
        let pending: Vec<(u64, String)> = run.pending.drain().map(|(i, p)| (i, p.input)).collect();
        for (i, input) in pending {
            run.emit(i, &input, Err(why.clone()), 0.0)?;
        }
        run.out.flush()?;
        return Err(e);
    }
    eprintln!(
        "{} of {total} inputs answered ({} with errors) in {secs:.2} s: {:.1} tensors/s, {:.1} MB/s sent; {reconnects} reconnects",
        run.lines,
        run.errors,
        run.lines as f64 / secs,
        run.bytes as f64 / 1e6 / secs,
    );
    Ok(ExitCode::SUCCESS)
}

/// Streams every input, reconnecting as needed; returns the number of reconnections.
async fn stream_all(
    cfg: &RemoteConfig,
    layout: &TensorLayout,
    plan: Plan,
    a: &Args,
    run: &mut Run,
) -> CliResult<u32> {
    let batch = plan.batch;
    let window = a.in_flight.max(batch);
    // Queued batches never exceed the window, so sending never waits on the gateway.
    let queue = window / batch + 2;
    let mut prepared = plan.start(2);
    let mut prepared_done = false;
    let mut failures = 0u32;
    let mut reconnects = 0u32;
    let mut last_error: Option<RemoteError> = None;
    'connect: loop {
        if failures > 0 {
            let e = last_error.take().expect("set with each failure");
            if !e.retryable() || failures > a.retries {
                return Err(CliError::new(e.to_string()));
            }
            let pause = Duration::from_millis(200 << (failures - 1).min(5));
            tracing::warn!("{e}; connecting again in {:.1} s", pause.as_secs_f64());
            tokio::time::sleep(pause).await;
            reconnects += 1;
        }
        let mut client = match connect(cfg).await {
            Ok(c) => c,
            Err(e) => {
                failures += 1;
                last_error = Some(e);
                continue 'connect;
            }
        };
        let schema = match &run.nixl {
            Some(n) => n.hello().schema(),
            None => layout.schema(),
        };
        let mut ex = match Exchange::open_with(&mut client, schema.clone(), &cfg.name, queue).await
        {
            Ok(x) => x,
            Err(e) => {
                failures += 1;
                last_error = Some(e);
                continue 'connect;
            }
        };
        for b in run.resend() {
            if let Err(e) = ex.send(b).await {
                failures += 1;
                last_error = Some(e);
                continue 'connect;
            }
        }
        if prepared_done {
            ex.finish();
        }
        loop {
            if prepared_done && run.pending.is_empty() {
                // Let the gateway end the stream, so that it sees a clean end, not a reset.
                let _ = tokio::time::timeout(Duration::from_secs(5), async {
                    while let Some(Ok(_)) = ex.results().await {}
                })
                .await;
                return Ok(reconnects);
            }
            let room = run.pending.len() + batch <= window;
            tokio::select! {
                item = prepared.recv(), if room && !prepared_done => match item {
                    Some(p @ (Prepared::Batch { .. } | Prepared::Ready { .. })) => {
                        let (b, items) = match (p, run.nixl.as_mut()) {
                            (Prepared::Batch { batch: b, items }, Some(n)) => {
                                (into_slots(n, layout, &schema, &b)?, items)
                            }
                            (Prepared::Batch { batch: b, items }, None) => (b, items),
                            (Prepared::Ready { items, tensor }, Some(n)) => {
                                (ready_into_slots(n, &schema, &items, &tensor)?, items)
                            }
                            _ => unreachable!("shared ready tensors only with --transport nixl"),
                        };
                        let now = Instant::now();
                        for (i, input) in items {
                            run.pending.insert(i, Pending { input, sent: now });
                        }
                        run.bytes += (b.num_rows() * layout.bytes()) as u64;
                        run.unanswered.push_back(b.clone());
                        if let Err(e) = ex.send(b).await {
                            failures += 1;
                            last_error = Some(e);
                            continue 'connect;
                        }
                    }
                    Some(Prepared::Failed { index, input, error }) => {
                        run.emit(index, &input, Err(error), 0.0)?;
                    }
                    None => {
                        prepared_done = true;
                        ex.finish();
                    }
                },
                res = ex.results() => match res {
                    Some(Ok(rows)) => {
                        if !rows.is_empty() {
                            failures = 0;
                        }
                        run.answer(rows)?;
                    }
                    Some(Err(e)) => {
                        failures += 1;
                        last_error = Some(e);
                        continue 'connect;
                    }
                    None => {
                        if prepared_done && run.pending.is_empty() {
                            return Ok(reconnects);
                        }
                        failures += 1;
                        last_error = Some(RemoteError::Connect(
                            cfg.gateway.clone(),
                            format!("the stream ended with {} requests unanswered", run.pending.len()),
                        ));
                        continue 'connect;
                    }
                },
            }
        }
    }
}
