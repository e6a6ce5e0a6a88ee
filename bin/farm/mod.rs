//! `tensorport farm`: one inference server and N supervised producers over a set of inputs.
//!
//! `run` sets up (checks, results file, socket directory, signals) and loops: the
//! [`Supervisor`] decides (hand out inputs, react to events, restart, give up), `view` shows
//! (progress, summary), `children` starts the processes.

mod balance;
mod children;
mod rundir;
mod supervisor;
mod view;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tensorport_vision::Source;

use crate::common::{CliError, CliResult, Device, ModelArgs, TransformArg};
use children::{Ev, Farm};
use supervisor::Supervisor;
use view::Console;

/// When to draw live progress.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// On a terminal.
    Auto,
    /// Always (even into a file or pipe).
    Always,
    /// Never.
    Never,
}

/// Classify a set of images with one inference server and N producer processes. The farm starts
/// the server and the producers, hands inputs to producers as they have room, restarts a
/// producer (or the server) that dies — with back-off — and redoes its unfinished inputs, so
/// every input gets exactly one line in --output. Ctrl-C finishes the work in flight and stops;
/// a second Ctrl-C stops at once. Shows live progress on a terminal, stays quiet otherwise, and
/// ends with a summary.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Folder of PNG/JPEG images to classify.
    #[arg(long, conflicts_with = "synthetic")]
    pub input: Option<PathBuf>,
    /// Classify N generated images instead of files.
    #[arg(long, value_name = "N")]
    pub synthetic: Option<u64>,
    /// Number of producer processes (preparing on the CPU).
    #[arg(long, short = 'p', default_value_t = 3)]
    pub producers: usize,
    /// Producers that decode and prepare on the GPU (`produce --nvjpeg`: batches of JPEGs
    /// decoded by nvJPEG, resized and normalised by a kernel, handed over in device memory),
    /// besides the --producers CPU ones; each works on its server's GPU. Needs --device cuda
    /// (or --devices).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub gpu_producers: usize,
    /// Inference servers, each with its own socket (and model); producers are spread over the
    /// ones that listen, the least loaded first. A server that dies has its producers' inputs
    /// redone through the others while it restarts.
    #[arg(long, default_value_t = 1, conflicts_with = "devices")]
    pub servers: usize,
    /// One server per listed GPU (e.g. `--devices 0,1`: a server on cuda:0 and one on cuda:1);
    /// overrides --device and --servers.
    #[arg(long, value_delimiter = ',', value_name = "GPU,...")]
    pub devices: Vec<u32>,
    /// Where to write the results, one JSON line per input.
    #[arg(long, short, default_value = "results.jsonl")]
    pub output: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Requests each producer keeps in flight. The farm hands each producer up to twice as many
    /// inputs, so the next ones are ready; progress shows them as "handed out".
    #[arg(long, default_value_t = 8)]
    pub in_flight: u32,
    /// Model workers per server (`serve --workers`): threads that each run their own copy of
    /// the model on their share of the producers.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Threads for the server's model [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Socket path [default: a fresh private directory, removed afterwards].
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Live progress: auto (on a terminal), always, never.
    #[arg(long, value_enum, default_value_t = Progress::Auto)]
    pub progress: Progress,
    /// Restarts of one producer (or of the server) in a row without a result in between before
    /// the farm gives up on it.
    #[arg(long, default_value_t = 8)]
    pub max_restarts: u32,
    /// A producer that holds inputs but returns no result for this many seconds, while the
    /// server runs, is taken as hung (stopped, deadlocked in its preprocessing): the farm kills
    /// it, restarts it and hands its inputs out again.
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    pub stall_secs: f64,
    /// Producers hand over a ready tensor for every input instead of preparing each (see
    /// `produce --ready`).
    #[arg(long)]
    pub ready: bool,
    /// The producers' preprocessing.
    #[arg(long, value_enum, default_value_t)]
    pub transform: TransformArg,
    /// The CPU's JPEG decoder (the default: libjpeg-turbo where it was built in).
    #[arg(long, value_enum, default_value_t)]
    pub jpeg_decoder: crate::common::JpegDecoderArg,
    /// Images over this many megapixels are refused (an error line naming the file) before
    /// anything is allocated for them: a small file can declare an image of gigabytes.
    #[arg(long, default_value_t = 64.0, value_name = "MP")]
    pub max_megapixels: f64,
    /// Decode large JPEGs at 1/2, 1/4 or 1/8 of their size with libjpeg-turbo's DCT scaling
    /// whenever that still leaves a source pixel for each output pixel (as PIL's `draft`
    /// does): less work on big photos, but the tensors differ from torchvision's full decode
    /// by more than the default's bound (docs/operations.md), so it is off unless asked for.
    #[arg(long, value_enum, default_value_t = crate::common::Switch::Off)]
    pub dct_scaling: crate::common::Switch,
    /// What producers hand over per image: normalised f32, or u8 planes (4× fewer bytes) that
    /// the server normalises to the same floats (on the GPU in the CUDA build).
    #[arg(long, value_enum, default_value_t)]
    pub pixels: crate::common::PixelsArg,
    /// Time every step of every input (read, decode, resize, normalise, lease, submit, result)
    /// and print the mean of each in the summary; the result lines carry them as "stages".
    #[arg(long)]
    pub profile: bool,
    /// Log level of the server and producers (their stderr is shown prefixed with their name).
    #[arg(long, default_value = "warn", value_parser = crate::common::parse_log_filter)]
    pub child_log: String,
}

pub fn run(args: Args) -> CliResult<ExitCode> {
    check(&args)?;
    let inputs = inputs(&args)?;
    let n = inputs.len() as u64;
    let mut out = crate::results::ResultsFile::create(&args.output)?;
    // A results write past the file size limit then fails (and the file is cut back to whole
    // lines) instead of killing the farm.
    crate::common::catch_sigxfsz();
    let tty = match args.progress {
        Progress::Always => true,
        Progress::Never => false,
        Progress::Auto => std::io::stderr().is_terminal(),
    };
    let console = Arc::new(Console::new(tty, n));
    // A private directory for the socket, unless one was given (removed when this returns).
    let tmp;
    let base_socket = match &args.socket {
        Some(s) => s.clone(),
        None => {
            let base = std::env::var_os("XDG_RUNTIME_DIR")
                .map(PathBuf::from)
                .filter(|p| p.is_dir())
                .unwrap_or_else(std::env::temp_dir);
            tmp = rundir::create(&base)?;
            tmp.path().join("tensorport.sock")
        }
    };
    let (sockets, devices) = servers(&args, &base_socket);
    let (tx, rx): (Sender<Ev>, Receiver<Ev>) = mpsc::channel();
    let exe = std::env::current_exe()?;
    let farm = Farm {
        exe,
        args,
        server_said: sockets
            .iter()
            .map(|_| Arc::new(Mutex::new(String::new())))
            .collect(),
        sockets,
        devices,
        console: console.clone(),
        tx,
    };
    let signals = count_signals()?;
    let stopped = || signals.load(Ordering::SeqCst) >= 1;
    let quit_now = || signals.load(Ordering::SeqCst) >= 2;
    let started = Instant::now();
    let mut sup = Supervisor::start(farm, inputs)?;
    let mut batches = drive(&mut sup, &rx, &mut out, (&stopped, &quit_now), tty, started)?;
    if let Err(e) = out.flush() {
        sup.failure.get_or_insert(e);
    }
    console.clear();
    // Producers first (end of their worklists), then the server: drained, or on a second
    // Ctrl-C killed, with no summary; the socket directory goes with this function's return.
    if let Some(b) = sup.shut_down(&quit_now) {
        batches = b;
    }
    if quit_now() {
        console.log("stopped at once (second signal)");
        return Ok(ExitCode::from(130));
    }
    if let Some(f) = sup.failure.as_ref().filter(|f| f.code == 2) {
        // Nothing ran: a summary of zeros would only bury the one line that matters.
        return Err(CliError::usage(f.message.clone()));
    }
    view::print_summary(&mut sup, started, batches);
    if let Some(f) = sup.failure {
        return Err(f);
    }
    if sup.done_count < sup.n {
        return Ok(ExitCode::from(if stopped() { 130 } else { 1 }));
    }
    Ok(ExitCode::SUCCESS)
}

/// Refuses options that cannot work together, before anything starts.
fn check(args: &Args) -> CliResult<()> {
    if args.producers + args.gpu_producers == 0 {
        return Err(CliError::usage(
            "--producers must be at least 1 (or give --gpu-producers)",
        ));
    }
    if args.gpu_producers > 0 && !args.model.device.is_cuda() && args.devices.is_empty() {
        return Err(CliError::usage(
            "--gpu-producers hand over device memory: run the servers on a GPU (--device cuda \
             or --devices 0,1,...)",
        ));
    }
    args.model.check()?;
    if (args.model.device.is_cuda() || !args.devices.is_empty()) && !cfg!(feature = "cuda") {
        return Err(CliError::usage(
            "--device cuda: this tensorport was built without CUDA; rebuild with `--features cuda` \
             (see docs/operations.md), or use --device cpu",
        ));
    }
    if let Some(w) = &args.model.weights {
        if !w.is_file() {
            return Err(CliError::usage(format!(
                "weights file {} does not exist; write one with `tensorport weights --out FILE`, or leave --weights out to use --seed",
                w.display()
            )));
        }
    }
    Ok(())
}

/// What to classify: the images in `--input`, or `--synthetic` made-up ones.
fn inputs(args: &Args) -> CliResult<Vec<Source>> {
    Ok(match (&args.input, args.synthetic) {
        (Some(dir), _) => crate::common::list_inputs(dir)?
            .into_iter()
            .map(Source::File)
            .collect(),
        (None, Some(n)) => (0..n).map(Source::Synthetic).collect(),
        (None, None) => {
            return Err(CliError::usage(
                "say what to classify: --input DIR (PNG/JPEG files) or --synthetic N",
            ))
        }
    })
}

/// One socket and one device per server: `--devices` lists GPUs; else `--servers` copies of
/// `--device`. Server k > 0 listens beside the first (`tensorport-k.sock`).
fn servers(args: &Args, base_socket: &Path) -> (Vec<PathBuf>, Vec<Device>) {
    let devices: Vec<Device> = if args.devices.is_empty() {
        vec![args.model.device; args.servers.max(1)]
    } else {
        args.devices.iter().map(|&g| Device::Cuda(g)).collect()
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

/// SIGINT/SIGTERM, counted: the first drains, the second quits at once — but through the
/// farm's own exit, so the children are ended and the socket directory removed.
fn count_signals() -> CliResult<Arc<std::sync::atomic::AtomicUsize>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let signals = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut it = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .map_err(|e| CliError::new(format!("cannot handle SIGINT/SIGTERM: {e}")))?;
    let count = signals.clone();
    std::thread::spawn(move || {
        for _ in it.forever() {
            count.fetch_add(1, Ordering::SeqCst);
        }
    });
    Ok(signals)
}

/// The supervisor's loop: start, hand out, collect, restart and rebalance until the work is
/// over or a signal says stop; draws the progress on a terminal. Returns the servers' batch
/// counts (batches, requests batched) as last seen, or the error of a process that could not
/// be started.
fn drive(
    sup: &mut Supervisor,
    rx: &Receiver<Ev>,
    out: &mut crate::results::ResultsFile,
    (stopped, quit_now): (&dyn Fn() -> bool, &dyn Fn() -> bool),
    tty: bool,
    started: Instant,
) -> CliResult<(u64, u64)> {
    let mut last_draw = Instant::now() - Duration::from_secs(1);
    let mut batches = (0u64, 0u64);
    loop {
        if quit_now() {
            break;
        }
        if stopped() {
            sup.stop();
        }
        sup.start_due()?;
        sup.hand_out();
        sup.handle_events(rx, Duration::from_millis(50), out);
        sup.kill_stalled();
        sup.rebalance();
        if sup.is_over() {
            break;
        }
        if last_draw.elapsed() >= Duration::from_millis(250) {
            last_draw = Instant::now();
            // Results reach the file at least four times a second.
            if let Err(e) = out.flush() {
                sup.failure = Some(e);
                break;
            }
            if tty {
                if sup.any_ready() {
                    batches = batch_counts(&sup.farm.sockets);
                }
                let (summary, rows) = view::progress(sup, started, batches);
                sup.farm.console.draw(sup.done_count, summary, &rows);
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
