//! `tensorport serve`: the inference process (its batch loop lives in `tensorport_farm::serve`).

use std::time::Duration;

use tensorport_farm::ServeConfig;

use crate::common::{CliResult, ModelArgs, SocketArg};

/// Serve a dfdx image classifier. Producers connect to the socket, write [3, S, S] f32 images
/// into shared memory, and get the class scores back. Requests are batched: up to --max-batch, or
/// whatever arrived within --max-wait-ms of the first. SIGINT/SIGTERM drains (finishes the work in
/// flight, refuses new producers, exits once they have left); a second signal exits at once.
/// Prints `ready <socket>` on stdout once it listens.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub socket: SocketArg,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Slots per producer, unless the producer asks otherwise.
    #[arg(long, default_value_t = ServeConfig::DEFAULT_SLOTS)]
    pub slots: u32,
    /// Bytes per slot, unless the producer asks otherwise [default: one input image].
    #[arg(long)]
    pub slot_size: Option<u64>,
    /// Most producers at once.
    #[arg(long, default_value_t = ServeConfig::DEFAULT_MAX_SESSIONS)]
    pub max_sessions: u32,
    /// Memory all producers' pools may reserve together, e.g. 8G [default: a quarter of
    /// physical memory]. A producer whose pool does not fit is refused (MemoryBudget) until
    /// another leaves.
    #[arg(long, value_name = "SIZE", value_parser = crate::common::parse_size)]
    pub memory_budget: Option<u64>,
    /// Memory one producer's pool may reserve, e.g. 1G [default: a quarter of the budget].
    #[arg(long, value_name = "SIZE", value_parser = crate::common::parse_size)]
    pub max_session_memory: Option<u64>,
    /// Threads for the model's matrix products [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Microseconds to poll the producers' queues before sleeping on their doorbells: more costs
    /// CPU while idle and saves the wake-up (tens of µs) when work comes soon.
    #[arg(long, default_value_t = ServeConfig::DEFAULT_SPIN.as_micros() as u64, value_parser = clap::value_parser!(u64).range(0..=crate::common::MAX_SPIN_US))]
    pub spin_us: u64,
    /// Serve Prometheus metrics on http://ADDR/metrics (e.g. 127.0.0.1:9464; port 0 picks a free
    /// one): the counters of `ctl status`, batch sizes, model time per batch and request service
    /// time histograms. Prints `metrics http://…/metrics` on stdout after `ready`.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Model workers: threads that each take batches from their own share of the producers and
    /// run their own copy of the model (on the GPU: each its own dfdx device and stream, since a
    /// dfdx `Cuda` device cannot be shared between threads). More than one helps when one
    /// thread's per-batch work, not the device, is the bound.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// A sink instead of a model: answer every request at once with an empty result, whatever
    /// its dtype and shape (the transport's checks still apply). For measuring producers and the
    /// transport, e.g. Python producers of any tensor (bench/python_ipc.py --server rust); set
    /// the slots with --slot-size.
    #[arg(long)]
    pub sink: bool,
    /// GPU producers' device tensors (--device cuda): milliseconds a batch waits for a
    /// producer's "ready" fence. A tensor still not signalled then is failed (FenceTimeout) and
    /// its producer's session ended, so a producer that never signals cannot stall the others.
    #[arg(long, default_value_t = ServeConfig::DEFAULT_FENCE_TIMEOUT.as_millis() as u64, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..=crate::common::MAX_MS))]
    pub fence_timeout_ms: u64,
    /// The whole configuration as one JSON document, in place of the flags above (how
    /// `tensorport farm` starts its servers).
    #[arg(long, value_name = "JSON", hide = true)]
    pub config_data: Option<String>,
}

impl Args {
    /// The server's configuration.
    pub fn config(&self) -> ServeConfig {
        ServeConfig {
            socket: self.socket.path(),
            model: self.model.options(),
            slots: self.slots,
            slot_size: self.slot_size,
            max_sessions: self.max_sessions,
            memory_budget: self.memory_budget,
            max_session_memory: self.max_session_memory,
            threads: self.threads,
            spin: Duration::from_micros(self.spin_us),
            metrics: self.metrics.clone(),
            workers: self.workers,
            sink: self.sink,
            fence_timeout: Duration::from_millis(self.fence_timeout_ms),
        }
    }
}

pub fn run(a: Args) -> CliResult<u8> {
    let cfg = match &a.config_data {
        Some(data) => ServeConfig::from_data(data).map_err(tensorport_farm::Error::from)?,
        None => a.config(),
    };
    // A pool over the file size limit is then one producer refused, not the server killed.
    tensorport_farm::process::catch_sigxfsz();
    // The first SIGINT/SIGTERM drains the server, a second exits at once.
    let stop = tensorport_farm::process::Stop::new();
    stop.on_signals(true)
        .map_err(|e| crate::common::CliError::new(format!("cannot handle SIGINT/SIGTERM: {e}")))?;
    tensorport_farm::serve::run(&cfg, &stop)?;
    Ok(0)
}
