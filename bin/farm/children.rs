//! The farm's child processes: how the server and a producer are started, their output turned
//! into events, their stderr shown, and how an exit is described.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::view::Console;
use super::Args;
use crate::common::{CliError, CliResult, Device};

pub(super) enum Ev {
    Line { slot: usize, line: String },
    Eof { slot: usize, generation: u64 },
    ServerReady { server: usize, generation: u64 },
    ServerEof { server: usize, generation: u64 },
}

/// Output slots from `SERVER` up are the servers' (`SERVER + k` is server k).
pub(super) const SERVER: usize = usize::MAX / 2;

pub(super) enum State {
    Running {
        child: Child,
        stdin: Option<ChildStdin>,
    },
    Waiting {
        until: Instant,
    },
    GaveUp,
}

pub(super) struct Worker {
    pub(super) name: String,
    pub(super) state: State,
    pub(super) generation: u64,
    pub(super) assigned: BTreeSet<u64>,
    pub(super) done: u64,
    pub(super) restarts: u32,
    pub(super) failures_in_row: u32,
    pub(super) last_exit: Option<String>,
    /// When it last returned a result, started, or the server became ready.
    pub(super) last_progress: Instant,
    /// The server it was last started against.
    pub(super) server: usize,
    /// It prepares on the GPU (`produce --nvjpeg`).
    pub(super) gpu: bool,
    /// It is finishing the inputs it holds (its worklist closed), to restart against
    /// `next_server`: a move by demand, not a failure.
    pub(super) moving: bool,
    /// The server to start against next, if not the one with the fewest producers.
    pub(super) next_server: Option<usize>,
}

/// A GPU producer's requests in flight (its device buffers; the protocol allows 64 per
/// session) and the images it decodes per batch.
pub(super) const GPU_IN_FLIGHT: u32 = 64;
pub(super) const GPU_BATCH: u32 = 32;

impl Worker {
    pub(super) fn new(name: String, gpu: bool) -> Worker {
        Worker {
            gpu,
            name,
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
            server: 0,
            moving: false,
            next_server: None,
        }
    }
}

pub(super) fn describe(st: ExitStatus) -> String {
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (_, Some(9)) => "killed by SIGKILL".into(),
        (_, Some(s)) => format!("killed by signal {s}"),
        _ => "ended".into(),
    }
}

pub(super) fn backoff(failures: u32) -> Duration {
    Duration::from_millis((100u64 << failures.min(6)).min(5_000))
}

/// Sends each line of `r` as an event, then EOF.
pub(super) fn pump_lines(
    r: impl std::io::Read + Send + 'static,
    tx: Sender<Ev>,
    slot: usize,
    generation: u64,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            let ev = if slot >= SERVER {
                if line.starts_with("ready") {
                    Ev::ServerReady {
                        server: slot - SERVER,
                        generation,
                    }
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
        let _ = tx.send(if slot >= SERVER {
            Ev::ServerEof {
                server: slot - SERVER,
                generation,
            }
        } else {
            Ev::Eof { slot, generation }
        });
    });
}

/// Shows a child's stderr lines on the console, prefixed with its name; keeps the last one in
/// `last` (the server's, so a startup failure can be quoted).
pub(super) fn forward_stderr(
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
pub(super) fn unfixable_start(status: &ExitStatus, was_ready: bool) -> bool {
    !was_ready && status.code() == Some(2)
}

/// What starting children needs: the binary, the options, the servers' sockets and devices,
/// where their output goes.
pub(super) struct Farm {
    pub(super) exe: PathBuf,
    pub(super) args: Args,
    /// Server k listens at `sockets[k]`, its model on `devices[k]`.
    pub(super) sockets: Vec<PathBuf>,
    pub(super) devices: Vec<Device>,
    pub(super) console: Arc<Console>,
    pub(super) tx: Sender<Ev>,
    /// Each server's last stderr line.
    pub(super) server_said: Vec<Arc<Mutex<String>>>,
}

impl Farm {
    fn command(&self, sub: &str, server: usize) -> Command {
        let mut c = Command::new(&self.exe);
        c.arg("--log")
            .arg(&self.args.child_log)
            .arg(sub)
            .arg("--socket")
            .arg(&self.sockets[server])
            .env("TENSORPORT_FARM_PID", std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Their own process group: a terminal's Ctrl-C reaches only the farm, which drains.
            .process_group(0);
        c
    }

    /// A server's name in messages: "server", or "server-k" when there are several.
    pub(super) fn server_name(&self, k: usize) -> String {
        if self.sockets.len() == 1 {
            "server".into()
        } else {
            format!("server-{k}")
        }
    }

    pub(super) fn start_server(&self, k: usize, generation: u64) -> CliResult<Child> {
        let a = &self.args;
        let mut c = self.command("serve", k);
        let mut model = a.model.clone();
        model.device = self.devices[k];
        c.args(model.to_args())
            .arg("--slots")
            .arg(a.in_flight.to_string())
            .arg("--max-sessions")
            .arg((a.producers + a.gpu_producers + 4).to_string());
        if let Some(t) = a.threads {
            c.arg("--threads").arg(t.to_string());
        }
        if a.workers > 1 {
            c.arg("--workers").arg(a.workers.to_string());
        }
        let mut child = c
            .spawn()
            .map_err(|e| CliError::new(format!("cannot start the server: {e}")))?;
        pump_lines(
            child.stdout.take().expect("piped"),
            self.tx.clone(),
            SERVER + k,
            generation,
        );
        self.server_said[k].lock().unwrap().clear();
        forward_stderr(
            child.stderr.take().expect("piped"),
            self.server_name(k),
            self.console.clone(),
            Some(self.server_said[k].clone()),
        );
        Ok(child)
    }

    /// Starts producer `slot` against server `server`.
    pub(super) fn start_producer(
        &self,
        slot: usize,
        w: &mut Worker,
        server: usize,
    ) -> CliResult<()> {
        let a = &self.args;
        let mut c = self.command("produce", server);
        c.arg("--worklist")
            .arg("--name")
            .arg(&w.name)
            .arg("--image-size")
            .arg(a.model.image_size.to_string())
            .stdin(Stdio::piped());
        if w.gpu {
            let gpu = match self.devices[server] {
                Device::Cuda(n) => n,
                Device::Cpu => 0,
            };
            c.args(["--nvjpeg", "--gpu", &gpu.to_string()])
                .args(["--in-flight", &GPU_IN_FLIGHT.to_string()])
                .args(["--batch", &GPU_BATCH.to_string()]);
        } else {
            c.arg("--in-flight").arg(a.in_flight.to_string());
        }
        if a.ready {
            c.arg("--ready");
        }
        c.arg("--transform").arg(a.transform.name());
        c.arg("--jpeg-decoder")
            .arg(crate::common::arg_name(&a.jpeg_decoder));
        c.arg("--max-megapixels").arg(a.max_megapixels.to_string());
        c.arg("--dct-scaling")
            .arg(crate::common::arg_name(&a.dct_scaling));
        c.arg("--pixels").arg(crate::common::arg_name(&a.pixels));
        if a.profile {
            c.arg("--profile");
        }
        let mut child = c
            .spawn()
            .map_err(|e| CliError::new(format!("cannot start {}: {e}", w.name)))?;
        w.generation += 1;
        w.server = server;
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
