//! `tensorport farm`: one inference server and N supervised producers over a set of inputs.

use std::collections::{BTreeSet, VecDeque};
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tensorport_vision::{list_images, Source};

use crate::common::{
    plural, CliError, CliResult, Device, ModelArgs, ResultLine, StageTimes, TransformArg,
};

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
    /// Number of producer processes.
    #[arg(long, short = 'p', default_value_t = 3)]
    pub producers: usize,
    /// Where to write the results, one JSON line per input.
    #[arg(long, short, default_value = "results.jsonl")]
    pub output: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Requests each producer keeps in flight. The farm hands each producer up to twice as many
    /// inputs, so the next ones are ready; progress shows them as "handed out".
    #[arg(long, default_value_t = 8)]
    pub in_flight: u32,
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
    /// Time every step of every input (read, decode, resize, normalise, lease, submit, result)
    /// and print the mean of each in the summary; the result lines carry them as "stages".
    #[arg(long)]
    pub profile: bool,
    /// Log level of the server and producers (their stderr is shown prefixed with their name).
    #[arg(long, default_value = "warn", value_parser = crate::common::parse_log_filter)]
    pub child_log: String,
}

/// Log lines and the live progress block. indicatif redraws the block in place and prints log
/// lines above it without tearing either; off a terminal the block is hidden and log lines go
/// straight to stderr.
struct Console {
    multi: MultiProgress,
    overall: ProgressBar,
    rows: Mutex<Vec<ProgressBar>>,
}

impl Console {
    fn new(draw: bool, inputs: u64) -> Console {
        let target = if draw {
            // Not `ProgressDrawTarget::stderr()`: that hides itself off a terminal, and
            // `--progress always` means always.
            ProgressDrawTarget::term_like_with_hz(Box::new(console::Term::stderr()), 4)
        } else {
            ProgressDrawTarget::hidden()
        };
        let multi = MultiProgress::with_draw_target(target);
        let style = ProgressStyle::with_template(
            "tensorport farm [{bar:30}] {pos}/{len} ({percent}%) {msg}",
        )
        .expect("a valid template")
        .progress_chars("=> ");
        let overall = multi.add(ProgressBar::new(inputs).with_style(style));
        Console {
            multi,
            overall,
            rows: Mutex::new(Vec::new()),
        }
    }

    fn log(&self, line: &str) {
        self.multi.suspend(|| eprintln!("{line}"));
    }

    /// Shows `done` inputs with `summary` beside the bar, and one line per entry of `rows`.
    fn draw(&self, done: u64, summary: String, rows: &[String]) {
        self.overall.set_position(done);
        self.overall.set_message(summary);
        let mut bars = self.rows.lock().unwrap();
        while bars.len() < rows.len() {
            let style = ProgressStyle::with_template("{msg}").expect("a valid template");
            bars.push(self.multi.add(ProgressBar::new(0).with_style(style)));
        }
        for (bar, row) in bars.iter().zip(rows) {
            bar.set_message(row.clone());
        }
    }

    fn clear(&self) {
        let _ = self.multi.clear();
    }
}

enum Ev {
    Line { slot: usize, line: String },
    Eof { slot: usize, generation: u64 },
    ServerReady { generation: u64 },
    ServerEof { generation: u64 },
}

/// `slot` of `usize::MAX` is the server.
const SERVER: usize = usize::MAX;

enum State {
    Running {
        child: Child,
        stdin: Option<ChildStdin>,
    },
    Waiting {
        until: Instant,
    },
    GaveUp,
}

struct Worker {
    name: String,
    state: State,
    generation: u64,
    assigned: BTreeSet<u64>,
    done: u64,
    restarts: u32,
    failures_in_row: u32,
    last_exit: Option<String>,
    /// When it last returned a result, started, or the server became ready.
    last_progress: Instant,
}

fn describe(st: ExitStatus) -> String {
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (_, Some(9)) => "killed by SIGKILL".into(),
        (_, Some(s)) => format!("killed by signal {s}"),
        _ => "ended".into(),
    }
}

fn backoff(failures: u32) -> Duration {
    Duration::from_millis((100u64 << failures.min(6)).min(5_000))
}

/// Sends each line of `r` as an event, then EOF.
fn pump_lines(
    r: impl std::io::Read + Send + 'static,
    tx: Sender<Ev>,
    slot: usize,
    generation: u64,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            let ev = if slot == SERVER {
                if line.starts_with("ready") {
                    Ev::ServerReady { generation }
                } else {
                    continue;
                }
            } else {
                Ev::Line { slot, line }
            };
            if tx.send(ev).is_err() {
                return;
            }
        }
        let _ = tx.send(if slot == SERVER {
            Ev::ServerEof { generation }
        } else {
            Ev::Eof { slot, generation }
        });
    });
}

/// Shows a child's stderr lines on the console, prefixed with its name; keeps the last one in
/// `last` (the server's, so a startup failure can be quoted).
fn forward_stderr(
    r: impl std::io::Read + Send + 'static,
    name: String,
    console: Arc<Console>,
    last: Option<Arc<Mutex<String>>>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            console.log(&format!("[{name}] {line}"));
            if let Some(last) = &last {
                *last.lock().unwrap() = line;
            }
        }
    });
}

/// Whether a server that ended this way, never having listened, would fail the same way again:
/// `serve` exits with 2 for configuration it refuses (a CUDA device on a build without CUDA, no
/// driver, a bad weights file, a socket path it will not use).
fn unfixable_start(status: &ExitStatus, was_ready: bool) -> bool {
    !was_ready && status.code() == Some(2)
}

struct Farm {
    exe: PathBuf,
    args: Args,
    socket: PathBuf,
    console: Arc<Console>,
    tx: Sender<Ev>,
    /// The server's last stderr line.
    server_said: Arc<Mutex<String>>,
}

impl Farm {
    fn command(&self, sub: &str) -> Command {
        let mut c = Command::new(&self.exe);
        c.arg("--log")
            .arg(&self.args.child_log)
            .arg(sub)
            .arg("--socket")
            .arg(&self.socket)
            .env("TENSORPORT_FARM_PID", std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Their own process group: a terminal's Ctrl-C reaches only the farm, which drains.
            .process_group(0);
        c
    }

    fn start_server(&self, generation: u64) -> CliResult<Child> {
        let a = &self.args;
        let mut c = self.command("serve");
        c.args(a.model.to_args())
            .arg("--slots")
            .arg(a.in_flight.to_string())
            .arg("--max-sessions")
            .arg((a.producers + 4).to_string());
        if let Some(t) = a.threads {
            c.arg("--threads").arg(t.to_string());
        }
        let mut child = c
            .spawn()
            .map_err(|e| CliError::new(format!("cannot start the server: {e}")))?;
        pump_lines(
            child.stdout.take().expect("piped"),
            self.tx.clone(),
            SERVER,
            generation,
        );
        self.server_said.lock().unwrap().clear();
        forward_stderr(
            child.stderr.take().expect("piped"),
            "server".into(),
            self.console.clone(),
            Some(self.server_said.clone()),
        );
        Ok(child)
    }

    fn start_producer(&self, slot: usize, w: &mut Worker) -> CliResult<()> {
        let a = &self.args;
        let mut c = self.command("produce");
        c.arg("--worklist")
            .arg("--name")
            .arg(&w.name)
            .arg("--image-size")
            .arg(a.model.image_size.to_string())
            .arg("--in-flight")
            .arg(a.in_flight.to_string())
            .stdin(Stdio::piped());
        if a.ready {
            c.arg("--ready");
        }
        c.arg("--transform").arg(a.transform.name());
        if a.profile {
            c.arg("--profile");
        }
        let mut child = c
            .spawn()
            .map_err(|e| CliError::new(format!("cannot start {}: {e}", w.name)))?;
        w.generation += 1;
        w.last_progress = Instant::now();
        pump_lines(
            child.stdout.take().expect("piped"),
            self.tx.clone(),
            slot,
            w.generation,
        );
        forward_stderr(
            child.stderr.take().expect("piped"),
            w.name.clone(),
            self.console.clone(),
            None,
        );
        let stdin = child.stdin.take();
        w.state = State::Running { child, stdin };
        Ok(())
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

pub fn run(args: Args) -> CliResult<ExitCode> {
    if args.producers == 0 {
        return Err(CliError::usage("--producers must be at least 1"));
    }
    args.model.config().check()?;
    if args.model.device == Device::Cuda && !cfg!(feature = "cuda") {
        return Err(CliError::usage(
            "--device cuda: this tensorport was built without CUDA; rebuild with `--features cuda` \
             (see docs/operations.md), or use --device cpu",
        ));
    }
    let inputs: Vec<Source> = match (&args.input, args.synthetic) {
        (Some(dir), _) => list_images(dir)?.into_iter().map(Source::File).collect(),
        (None, Some(n)) => (0..n).map(Source::Synthetic).collect(),
        (None, None) => {
            return Err(CliError::usage(
                "say what to classify: --input DIR (PNG/JPEG files) or --synthetic N",
            ))
        }
    };
    if let Some(w) = &args.model.weights {
        if !w.is_file() {
            return Err(CliError::usage(format!(
                "weights file {} does not exist; write one with `tensorport weights --out FILE`, or leave --weights out to use --seed",
                w.display()
            )));
        }
    }
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
    // A private directory for the socket, unless one was given.
    let tmp;
    let socket = match &args.socket {
        Some(s) => s.clone(),
        None => {
            let base = std::env::var_os("XDG_RUNTIME_DIR")
                .map(PathBuf::from)
                .filter(|p| p.is_dir())
                .unwrap_or_else(std::env::temp_dir);
            // 0700, as docs/operations.md says the socket's directory must be (tempfile would
            // leave it to the umask: 0755).
            tmp = tempfile::Builder::new()
                .prefix("tensorport-farm-")
                .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .tempdir_in(base)?;
            tmp.path().join("tensorport.sock")
        }
    };
    let (tx, rx): (Sender<Ev>, Receiver<Ev>) = mpsc::channel();
    let exe = std::env::current_exe()?;
    let farm = Farm {
        exe,
        args,
        socket,
        console: console.clone(),
        tx,
        server_said: Arc::new(Mutex::new(String::new())),
    };
    // SIGINT/SIGTERM, counted: the first drains, the second quits at once — but through this
    // function's own exit, so the children are ended and the socket directory removed (exiting
    // from the signal handler left both behind).
    let signals = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut it = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
            .map_err(|e| CliError::new(format!("cannot handle SIGINT/SIGTERM: {e}")))?;
        let count = signals.clone();
        std::thread::spawn(move || {
            for _ in it.forever() {
                count.fetch_add(1, Ordering::SeqCst);
            }
        });
    }
    let stopped = || signals.load(Ordering::SeqCst) >= 1;
    let quit_now = || signals.load(Ordering::SeqCst) >= 2;
    let started = Instant::now();

    let mut server_gen = 1u64;
    let mut server = Some(farm.start_server(server_gen)?);
    let mut server_ready = false;
    let mut server_restarts = 0u32;
    let mut server_wait_until: Option<Instant> = None;
    let mut workers: Vec<Worker> = (0..farm.args.producers)
        .map(|i| Worker {
            name: format!("producer-{i}"),
            state: State::Waiting {
                until: Instant::now(),
            },
            generation: 0,
            assigned: BTreeSet::new(),
            done: 0,
            restarts: 0,
            failures_in_row: 0,
            last_exit: None,
            last_progress: Instant::now(),
        })
        .collect();
    // Server restarts since the last result: a server that keeps dying without ever serving is
    // given up on; one that serves between its deaths is not.
    let mut server_failures_in_row = 0u32;
    let stall = Duration::from_secs_f64(farm.args.stall_secs.max(0.1));

    let depth = (farm.args.in_flight.max(1) * 2) as usize;
    let mut pending: VecDeque<u64> = (0..n).collect();
    let mut done = vec![false; n as usize];
    let mut done_count = 0u64;
    let mut errors = 0u64;
    let mut latencies: Vec<f64> = Vec::with_capacity(n as usize);
    let mut stage_sum = StageTimes::default();
    // The first and the last result: the rate between them leaves the start-up out (starting
    // the server and its device, the producers, their pools), as the DataLoader's benchmark
    // leaves its workers' start-up out.
    let mut first_result: Option<Instant> = None;
    let mut last_result = Instant::now();
    let mut profiled = 0u64;
    let mut stopping: Option<Instant> = None;
    let mut last_draw = Instant::now() - Duration::from_secs(1);
    let mut last_batches = (0u64, 0u64);
    let mut failure: Option<CliError> = None;

    loop {
        let now = Instant::now();
        if quit_now() {
            break;
        }
        if stopped() && stopping.is_none() {
            stopping = Some(now + Duration::from_secs(15));
            console.log("stopping: finishing the work in flight (Ctrl-C again to quit at once)");
        }
        // Restart the server if it died.
        if server.is_none() && stopping.is_none() {
            if let Some(t) = server_wait_until {
                if now >= t {
                    server_gen += 1;
                    server = Some(farm.start_server(server_gen)?);
                    server_wait_until = None;
                }
            }
        }
        // Start or restart producers once the server listens.
        if server_ready && stopping.is_none() {
            for (slot, w) in workers.iter_mut().enumerate() {
                if let State::Waiting { until } = w.state {
                    if now >= until && done_count < n {
                        farm.start_producer(slot, w)?;
                    }
                }
            }
        }
        // Hand out work.
        if stopping.is_none() {
            for w in workers.iter_mut() {
                if let State::Running {
                    stdin: Some(stdin), ..
                } = &mut w.state
                {
                    let mut batch = String::new();
                    let mut given = Vec::new();
                    while w.assigned.len() + given.len() < depth {
                        let Some(i) = pending.pop_front() else { break };
                        if done[i as usize] {
                            continue;
                        }
                        batch.push_str(&format!("{i}\t{}\n", inputs[i as usize]));
                        given.push(i);
                    }
                    if given.is_empty() {
                        continue;
                    }
                    if stdin
                        .write_all(batch.as_bytes())
                        .and_then(|_| stdin.flush())
                        .is_ok()
                    {
                        w.assigned.extend(given);
                    } else {
                        // It is dying; its EOF will come. Keep the inputs for someone else.
                        for i in given.into_iter().rev() {
                            pending.push_front(i);
                        }
                    }
                }
            }
        }
        // Events.
        let mut first = true;
        loop {
            let ev = if first {
                first = false;
                match rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(e) => e,
                    Err(_) => break,
                }
            } else {
                match rx.try_recv() {
                    Ok(e) => e,
                    Err(_) => break,
                }
            };
            match ev {
                Ev::Line { slot, line } => {
                    let Ok(r) = serde_json::from_str::<ResultLine>(&line) else {
                        continue; // a line torn by a kill: the input is redone
                    };
                    for w in workers.iter_mut() {
                        w.assigned.remove(&r.index);
                    }
                    if r.index >= n || done[r.index as usize] {
                        continue;
                    }
                    done[r.index as usize] = true;
                    done_count += 1;
                    last_result = Instant::now();
                    first_result.get_or_insert(last_result);
                    if r.error.is_some() {
                        errors += 1;
                    }
                    latencies.push(r.latency_ms);
                    if let Some(st) = r.stages {
                        stage_sum += st;
                        profiled += 1;
                    }
                    if let Err(e) = out.push(&line) {
                        failure = Some(e);
                        break;
                    }
                    let w = &mut workers[slot];
                    w.done += 1;
                    w.failures_in_row = 0;
                    w.last_progress = Instant::now();
                    server_failures_in_row = 0;
                }
                Ev::Eof { slot, generation } => {
                    let w = &mut workers[slot];
                    if generation != w.generation {
                        continue;
                    }
                    let status = match std::mem::replace(&mut w.state, State::GaveUp) {
                        State::Running { mut child, stdin } => {
                            drop(stdin);
                            child.wait().map(describe).unwrap_or_else(|e| e.to_string())
                        }
                        _ => "ended".into(),
                    };
                    // Its unfinished inputs go back to the front of the queue.
                    for i in std::mem::take(&mut w.assigned).into_iter().rev() {
                        if !done[i as usize] {
                            pending.push_front(i);
                        }
                    }
                    w.last_exit = Some(status.clone());
                    if done_count >= n || stopping.is_some() {
                        w.state = State::Waiting {
                            until: Instant::now() + Duration::from_secs(3600),
                        };
                        continue;
                    }
                    w.failures_in_row += 1;
                    w.restarts += 1;
                    if w.failures_in_row > farm.args.max_restarts {
                        console.log(&format!(
                            "{} failed {} times in a row ({status}); giving up on it",
                            w.name, w.failures_in_row
                        ));
                        w.state = State::GaveUp;
                    } else {
                        let d = backoff(w.failures_in_row - 1);
                        console.log(&format!(
                            "{} ended ({status}); restarting in {:.1}s, its unfinished inputs are redone",
                            w.name,
                            d.as_secs_f64()
                        ));
                        w.state = State::Waiting {
                            until: Instant::now() + d,
                        };
                    }
                }
                Ev::ServerReady { generation } => {
                    if generation == server_gen {
                        server_ready = true;
                        // Time without a server is nobody's stall.
                        let now = Instant::now();
                        for w in workers.iter_mut() {
                            w.last_progress = now;
                        }
                    }
                }
                Ev::ServerEof { generation } => {
                    if generation != server_gen {
                        continue;
                    }
                    let was_ready = std::mem::replace(&mut server_ready, false);
                    let exit = server.take().and_then(|mut c| c.wait().ok());
                    let status = exit.map(describe).unwrap_or_else(|| "ended".into());
                    if exit.is_some_and(|st| unfixable_start(&st, was_ready)) {
                        // Restarting cannot help: stop now, with the server's own words.
                        let said = farm.server_said.lock().unwrap().clone();
                        failure = Some(CliError::usage(format!(
                            "the server cannot start ({status}): {}",
                            said.trim_start_matches("error: ")
                        )));
                    } else if done_count < n && stopping.is_none() {
                        server_restarts += 1;
                        server_failures_in_row += 1;
                        if server_failures_in_row > farm.args.max_restarts {
                            failure = Some(CliError::new(format!(
                                "the server failed {server_failures_in_row} times in a row without a result ({status}); see its messages above"
                            )));
                        } else {
                            let d = backoff(server_failures_in_row - 1);
                            console.log(&format!(
                                "server ended ({status}); restarting in {:.1}s, producers reconnect and redo their inputs",
                                d.as_secs_f64()
                            ));
                            server_wait_until = Some(Instant::now() + d);
                        }
                    }
                }
            }
        }
        if failure.is_some() {
            break;
        }
        // Hung producers: inputs held, no result for `stall`, with the server up. SIGKILL works
        // on a stopped process too; its end of output then restarts it like any other death.
        if server_ready && stopping.is_none() {
            for w in workers.iter_mut() {
                if let State::Running { child, .. } = &mut w.state {
                    if !w.assigned.is_empty() && w.last_progress.elapsed() > stall {
                        console.log(&format!(
                            "{} returned no result for {:.0}s with {} inputs (stopped or hung?); killing it, its inputs are redone",
                            w.name,
                            w.last_progress.elapsed().as_secs_f64(),
                            w.assigned.len()
                        ));
                        let _ = child.kill();
                        // Once: its EOF restarts it and resets the clock.
                        w.last_progress = Instant::now();
                    }
                }
            }
        }
        if workers.iter().all(|w| matches!(w.state, State::GaveUp)) && done_count < n {
            failure = Some(CliError::new(
                "every producer failed repeatedly; see their messages above",
            ));
            break;
        }
        let in_flight: usize = workers.iter().map(|w| w.assigned.len()).sum();
        if done_count >= n {
            break;
        }
        if let Some(deadline) = stopping {
            if in_flight == 0 || Instant::now() >= deadline {
                break;
            }
        }
        if Instant::now().duration_since(last_draw) >= Duration::from_millis(250) {
            last_draw = Instant::now();
            // Results reach the file at least four times a second.
            if let Err(e) = out.flush() {
                failure = Some(e);
                break;
            }
            if tty {
                if server_ready {
                    if let Ok(mut c) =
                        tensorport::Control::connect(&farm.socket, Duration::from_millis(200))
                    {
                        if let Ok(s) = c.status() {
                            last_batches = (s.totals.batches, s.totals.batched);
                        }
                    }
                }
                let secs = started.elapsed().as_secs_f64();
                let summary = format!(
                    "{:.1} images/s  handed out {in_flight}  errors {errors}  batches {} (mean {:.1})  {:.1}s",
                    done_count as f64 / secs.max(1e-3),
                    last_batches.0,
                    if last_batches.0 > 0 { last_batches.1 as f64 / last_batches.0 as f64 } else { 0.0 },
                    secs
                );
                let mut lines = vec![format!(
                    "  server      {}  {}",
                    match (&server, server_ready) {
                        (Some(c), true) => format!("running, pid {}", c.id()),
                        (Some(c), false) => format!("starting, pid {}", c.id()),
                        (None, _) => "restarting".into(),
                    },
                    plural(server_restarts, "restart")
                )];
                for w in &workers {
                    let state = match &w.state {
                        State::Running { child, .. } => format!("running, pid {}", child.id()),
                        State::Waiting { until } if w.generation == 0 => {
                            let _ = until;
                            "starting".into()
                        }
                        State::Waiting { until } => format!(
                            "restarting in {:.1}s ({})",
                            until
                                .saturating_duration_since(Instant::now())
                                .as_secs_f64(),
                            w.last_exit.as_deref().unwrap_or("?")
                        ),
                        State::GaveUp => {
                            format!("gave up ({})", w.last_exit.as_deref().unwrap_or("?"))
                        }
                    };
                    lines.push(format!(
                        "  {:<11} {state:<40} done {:<6} handed out {:<3} {}",
                        w.name,
                        w.done,
                        w.assigned.len(),
                        plural(w.restarts, "restart")
                    ));
                }
                console.draw(done_count, summary, &lines);
            }
        }
    }
    if let Err(e) = out.flush() {
        failure.get_or_insert(e);
    }
    console.clear();

    // Shut down: producers first (end of their worklist), then drain the server.
    for w in workers.iter_mut() {
        if let State::Running { stdin, .. } = &mut w.state {
            stdin.take();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for w in workers.iter_mut() {
        if let State::Running { child, .. } = &mut w.state {
            while Instant::now() < deadline && !quit_now() {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
    if quit_now() {
        // The second Ctrl-C: no drain, no summary; the children go now, and the socket
        // directory with this function's return.
        if let Some(mut s) = server.take() {
            let _ = s.kill();
            let _ = s.wait();
        }
        console.log("stopped at once (second signal)");
        return Ok(ExitCode::from(130));
    }
    if let Ok(mut c) = tensorport::Control::connect(&farm.socket, Duration::from_secs(2)) {
        if let Ok(s) = c.status() {
            last_batches = (s.totals.batches, s.totals.batched);
        }
        let _ = c.drain();
    }
    if let Some(mut s) = server.take() {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match s.try_wait() {
                Ok(Some(_)) => break,
                _ if Instant::now() >= deadline || quit_now() => {
                    let _ = s.kill();
                    let _ = s.wait();
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    if let Some(f) = failure.as_ref().filter(|f| f.code == 2) {
        // Nothing ran: a summary of zeros would only bury the one line that matters.
        return Err(CliError::usage(f.message.clone()));
    }
    let secs = started.elapsed().as_secs_f64();
    latencies.sort_by(f64::total_cmp);
    let restarts: u32 = workers.iter().map(|w| w.restarts).sum();
    let fill = if last_batches.0 > 0 {
        last_batches.1 as f64 / last_batches.0 as f64
    } else {
        0.0
    };
    println!(
        "inputs      {n}\n\
         done        {done_count} ({errors} with errors){}\n\
         time        {secs:.2} s\n\
         throughput  {:.1} images/s{}\n\
         latency     p50 {:.1} ms, p99 {:.1} ms (lease to result)\n\
         batches     {} (mean fill {fill:.1} of {}){}\n\
         producers   {} ({}), server restarts {server_restarts}\n\
         results     {}",
        if done_count < n { "  INCOMPLETE" } else { "" },
        done_count as f64 / secs.max(1e-9),
        match first_result {
            Some(first) if done_count > 1 && last_result > first => format!(
                "; {:.1} after start-up ({:.2} s to the first result)",
                (done_count - 1) as f64 / (last_result - first).as_secs_f64(),
                (first - started).as_secs_f64()
            ),
            _ => String::new(),
        },
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        last_batches.0,
        farm.args.model.max_batch,
        if server_restarts > 0 {
            " since the last server start"
        } else {
            ""
        },
        farm.args.producers,
        plural(restarts, "restart"),
        farm.args.output.display()
    );
    if profiled > 0 {
        let k = profiled as f64;
        let s = stage_sum;
        println!(
            "stages      per input, mean ms: read {:.3} (read ahead), decode {:.3}, resize {:.3}, normalise {:.3}\n\
             \x20           hand-off: lease wait {:.3}, submit {:.3}; submit to result {:.2}\n\
             \x20           one producer prepares {:.0} inputs/s (decode + resize + normalise)",
            s.read_ms / k,
            s.decode_ms / k,
            s.resize_ms / k,
            s.normalise_ms / k,
            s.lease_ms / k,
            s.submit_ms / k,
            s.result_ms / k,
            k * 1e3 / (s.decode_ms + s.resize_ms + s.normalise_ms).max(1e-9),
        );
    }
    if let Some(f) = failure {
        return Err(f);
    }
    if done_count < n {
        return Ok(ExitCode::from(if stopped() { 130 } else { 1 }));
    }
    Ok(ExitCode::SUCCESS)
}
