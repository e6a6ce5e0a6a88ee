//! The farm: one or more inference servers and N supervised producer processes over a set of
//! inputs, every input answered exactly once in the results file.
//!
//! [`run`] sets up (checks, results file, socket directory, signals) and loops: the
//! [`Supervisor`](supervisor) decides (hand out inputs, react to events, restart, give up),
//! `children` starts the processes, and a front end's [`Report`] shows what happens: log lines,
//! a [`Snapshot`] four times a second, and the [`Summary`] at the end.

mod balance;
mod bound;
mod children;
mod ledger;
mod lifecycle;
mod lines;
mod results;
mod route;
#[cfg(test)]
mod route_sim;
mod rundir;
mod stats;
mod supervisor;

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::config::defaults::{
    default_gpu_batch, default_in_flight, DEFAULT_GPU_BATCH, DEFAULT_GPU_IN_FLIGHT,
    DEFAULT_IN_FLIGHT, DEFAULT_IN_FLIGHT_ONNX_GPU,
};
use crate::config::{Device, FarmConfig, Servers};
use crate::error::{Error, Result};
use crate::process::Stop;
use crate::record::StageTimes;
use children::{Ev, Farm};
pub use results::ResultsFile;
use supervisor::Supervisor;

/// What a front end shows of a running farm.
pub trait Report: Send + Sync {
    /// A line for the user: a child's stderr line (prefixed with its name), a restart, a move.
    fn log(&self, line: &str);
    /// Whether to take [`Snapshot`]s (each asks the servers for their batch counts).
    fn wants_progress(&self) -> bool;
    /// The farm as it is now, about four times a second when [`Report::wants_progress`].
    fn progress(&self, snapshot: &Snapshot);
}

/// What a child process is doing.
#[derive(Debug, Clone, PartialEq)]
pub enum ChildState {
    /// Not started yet, or started and not listening yet (a server).
    Starting {
        pid: Option<u32>,
    },
    Running {
        pid: u32,
    },
    /// Waiting to restart after it ended (`after`: how long still, where known).
    Restarting {
        after: Option<Duration>,
        last_exit: Option<String>,
    },
    GaveUp {
        last_exit: Option<String>,
    },
    /// Someone else's server the farm attached to.
    Attached,
}

/// One row of the snapshot: a server or a producer.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildRow {
    pub name: String,
    pub state: ChildState,
    /// Results returned (producers).
    pub done: u64,
    /// Inputs held (producers).
    pub handed_out: usize,
    pub restarts: u32,
}

/// The farm at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub inputs: u64,
    pub done: u64,
    pub errors: u64,
    /// Inputs handed to producers and not answered yet.
    pub handed_out: usize,
    /// The servers' batches and the requests in them, as last asked.
    pub batches: (u64, u64),
    pub elapsed: Duration,
    pub servers: Vec<ChildRow>,
    pub producers: Vec<ChildRow>,
}

/// A finished run.
#[derive(Debug, Clone)]
pub struct Summary {
    pub inputs: u64,
    pub done: u64,
    pub errors: u64,
    pub elapsed: Duration,
    /// When the first and the last result came, from the start (the rate between them leaves
    /// the start-up out, as the DataLoader's benchmark leaves its workers' start-up out).
    pub first_result: Option<Duration>,
    pub last_result: Option<Duration>,
    /// When every producer had returned a result, from the start, and the results after that
    /// moment (their rate, to the last result, leaves out the time when only the producers
    /// that start fastest ran).
    pub all_running: Option<(Duration, u64)>,
    /// Latency (lease to result) at the 50th and 99th percentiles, in milliseconds.
    pub latency_ms: (f64, f64),
    /// The servers' batches and the requests in them (since the last server start).
    pub batches: (u64, u64),
    pub max_batch: usize,
    pub server_restarts: u32,
    /// CPU producers, and the results they returned.
    pub producers: (usize, u64),
    /// GPU producers, and the results they returned.
    pub gpu_producers: (usize, u64),
    pub producer_restarts: u32,
    /// Producers moved to a faster server.
    pub moves: u32,
    pub output: PathBuf,
    /// The stage times summed over the profiled inputs, and how many there were.
    pub stages: Option<(StageTimes, u64)>,
}

/// How a run ended.
#[derive(Debug)]
pub struct Outcome {
    /// `None` when a second signal stopped it at once.
    pub summary: Option<Summary>,
    /// Why it ended early, if it did.
    pub failure: Option<Error>,
    /// A signal asked it to stop.
    pub stopped: bool,
}

impl Outcome {
    /// Every input has its line.
    pub fn complete(&self) -> bool {
        self.failure.is_none() && self.summary.as_ref().is_some_and(|s| s.done >= s.inputs)
    }
}

/// Runs the farm until every input has its line, it fails, or `stop` stops it (the first
/// request drains: the work in flight finishes; a second ends the children at once). The farm
/// ends its children and removes its socket directory either way. Configuration errors (and a
/// server that cannot start) come back as `Err`, before any summary.
pub fn run(cfg: FarmConfig, report: Arc<dyn Report>, stop: &Stop) -> Result<Outcome> {
    run_with(cfg, report, None, stop)
}

/// [`run`], with inputs that keep coming: each `Source` sent on `more` is input
/// `cfg.inputs.len() + k` (its result line's index), handed out as it comes; producers are kept
/// (waiting for work) while nothing is left to do, and the farm ends once every input has its
/// result and `more`'s sender is gone. A Python `Loader` with persistent producers feeds its
/// epochs this way.
pub fn run_with(
    cfg: FarmConfig,
    report: Arc<dyn Report>,
    more: Option<mpsc::Receiver<tensorport_vision::Source>>,
    stop: &Stop,
) -> Result<Outcome> {
    cfg.check()?;
    let mut cfg = cfg;
    if !matches!(cfg.servers, Servers::Attach { .. }) {
        // An ONNX model sets the producers' image size; one the server cannot run is refused
        // here, before any process starts.
        cfg.model.resolve()?;
    }
    let inputs = cfg.inputs.clone();
    let mut out = ResultsFile::create(&cfg.output)?;
    // A results write past the file size limit then fails (and the file is cut back to whole
    // lines) instead of killing the farm.
    crate::process::catch_sigxfsz();
    // A private directory for the socket, unless one was given (removed when this returns).
    let tmp;
    let base_socket = match (&cfg.servers, &cfg.socket) {
        (Servers::Attach { socket, .. }, _) => socket.clone(),
        (_, Some(s)) => s.clone(),
        (_, None) => {
            let base = std::env::var_os("XDG_RUNTIME_DIR")
                .map(PathBuf::from)
                .filter(|p| p.is_dir())
                .unwrap_or_else(std::env::temp_dir);
            tmp = rundir::create(&base)?;
            tmp.path().join("tensorport.sock")
        }
    };
    let (sockets, devices) = servers(&cfg, &base_socket);
    // Where two or more of the run's processes share a GPU and MPS pays, they share it through
    // MPS (quit with this function's return, where the daemon is the run's own).
    let shared = cfg.mps_gpus();
    let mut mps = match shared.is_empty() {
        true => crate::mps::Mps::off(),
        false => {
            let m = crate::mps::Mps::start(cfg.run.mps, &crate::mps::Tools::find(), &shared)?;
            report.log(&m.describe());
            m
        }
    };
    let (tx, rx) = mpsc::channel();
    let mut farm = Farm::new(cfg, sockets, devices, report.clone(), tx);
    farm.child_env = mps.env();
    let stopped = || stop.draining();
    let quit_now = || stop.at_once();
    let started = Instant::now();
    let mut sup = Supervisor::start(farm, inputs, more)?;
    let mut batches = drive(
        &mut sup,
        &rx,
        &mut out,
        (&stopped, &quit_now),
        (started, &mut mps),
    )?;
    if let Err(e) = out.flush() {
        sup.failure.get_or_insert(e);
    }
    // Producers first (end of their worklists), then the server: drained, or on a second
    // signal killed; the socket directory goes with this function's return.
    if let Some(b) = sup.shut_down(&quit_now) {
        batches = b;
    }
    if quit_now() {
        return Ok(Outcome {
            summary: None,
            failure: sup.failure.take(),
            stopped: true,
        });
    }
    if let Some(f) = sup.failure.take_if(|f| f.is_config()) {
        // Nothing ran: a summary of zeros would only bury the one line that matters.
        return Err(f);
    }
    Ok(Outcome {
        summary: Some(sup.summary(started, batches)),
        failure: sup.failure.take(),
        stopped: stopped(),
    })
}

/// One socket and one device per server: GPUs listed, or copies of the model's device. Server
/// k > 0 listens beside the first (`tensorport-k.sock`).
fn servers(cfg: &FarmConfig, base_socket: &Path) -> (Vec<PathBuf>, Vec<Device>) {
    let devices: Vec<Device> = match &cfg.servers {
        Servers::Copies(n) => vec![cfg.model.device; (*n).max(1)],
        Servers::Gpus(g) => g.iter().map(|&g| Device::Cuda(g)).collect(),
        Servers::Attach { gpu, .. } => vec![Device::Cuda(gpu.unwrap_or(0))],
    };
    let sockets = (0..devices.len())
        .map(|k| match k {
            0 => base_socket.to_owned(),
            k => {
                let stem = base_socket
                    .file_stem()
                    .map_or("tensorport".into(), |s| s.to_string_lossy().into_owned());
                base_socket.with_file_name(format!("{stem}-{k}.sock"))
            }
        })
        .collect();
    (sockets, devices)
}

/// The supervisor's loop: start, hand out, collect, restart and rebalance until the work is
/// over or a signal says stop; reports progress. Returns the servers' batch counts (batches,
/// requests batched) as last seen, or the error of a process that could not be started.
fn drive(
    sup: &mut Supervisor,
    rx: &Receiver<Ev>,
    out: &mut ResultsFile,
    (stopped, quit_now): (&dyn Fn() -> bool, &dyn Fn() -> bool),
    (started, mps): (Instant, &mut crate::mps::Mps),
) -> Result<(u64, u64)> {
    let mut last_draw = Instant::now() - Duration::from_secs(1);
    let mut last_mps = Instant::now();
    let mut batches = (0u64, 0u64);
    let live = sup.farm.report.wants_progress();
    loop {
        if quit_now() {
            break;
        }
        if stopped() {
            sup.stop();
        }
        sup.take_new_inputs();
        sup.start_due()?;
        sup.hand_out();
        sup.handle_events(rx, Duration::from_millis(50), out);
        sup.kill_stalled();
        sup.rebalance();
        if sup.is_over() {
            break;
        }
        if last_mps.elapsed() >= Duration::from_secs(1) {
            last_mps = Instant::now();
            // A private MPS daemon that died is started again; the GPU processes it took down
            // are restarted as any that end, and their inputs redone.
            if let Some(what) = mps.revive() {
                sup.farm.report.log(&what);
            }
        }
        if last_draw.elapsed() >= Duration::from_millis(250) {
            last_draw = Instant::now();
            // Results reach the file at least four times a second.
            if let Err(e) = out.flush() {
                sup.failure = Some(e);
                break;
            }
            if live {
                if sup.any_ready() {
                    batches = batch_counts(&sup.farm.sockets);
                }
                let snapshot = sup.snapshot(started, batches);
                sup.farm.report.progress(&snapshot);
            }
        }
    }
    Ok(batches)
}

/// The servers' batch counts together (batches, requests batched), from their status.
fn batch_counts(sockets: &[PathBuf]) -> (u64, u64) {
    let mut sum = (0, 0);
    for socket in sockets {
        if let Ok(mut c) = tensorport::Control::connect(socket, Duration::from_millis(200)) {
            if let Ok(s) = c.status() {
                sum.0 += s.totals.batches;
                sum.1 += s.totals.batched;
            }
        }
    }
    sum
}
