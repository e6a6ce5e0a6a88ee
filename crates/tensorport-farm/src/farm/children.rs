//! The farm's child processes: how the server and a producer are started, their output turned
//! into events, their stderr shown, and how an exit is described.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::Report;
use crate::config::{Device, FarmConfig, GpuPrep, Inputs, Output, ProduceConfig, ServeConfig};
use crate::error::{Error, Result};

pub(super) enum Ev {
    /// A line of producer `slot`'s output; `whole` if it ended with a newline.
    Line {
        slot: usize,
        line: String,
        whole: bool,
    },
    Eof {
        slot: usize,
        generation: u64,
    },
    ServerReady {
        server: usize,
        generation: u64,
    },
    ServerEof {
        server: usize,
        generation: u64,
    },
}

/// Whose output a pump reads.
#[derive(Debug, Clone, Copy)]
pub(super) enum OutputOf {
    /// Producer slot k: its result lines.
    Producer(usize),
    /// Server k: its `ready` line.
    Server(usize),
}

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
    pub(super) restarts: super::lifecycle::Restarts,
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
    /// It has returned a result since it was last started.
    pub(super) warm: bool,
}

/// A GPU producer's threads for the images nvJPEG does not take, where CPU producers take most
/// of those (see `route.rs`).
pub(super) const GPU_CPU_THREADS: usize = 4;

/// A GPU producer's CPU threads: [`GPU_CPU_THREADS`] beside CPU producers; without them, the
/// GPU producers prepare every file nvJPEG does not take, and share the machine's cores.
pub(super) fn gpu_cpu_threads(cpu_producers: usize, gpu_producers: usize, cores: usize) -> usize {
    match cpu_producers {
        0 => (cores.saturating_sub(1) / gpu_producers.max(1)).max(GPU_CPU_THREADS),
        _ => GPU_CPU_THREADS,
    }
}

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
            restarts: Default::default(),
            last_exit: None,
            last_progress: Instant::now(),
            server: 0,
            moving: false,
            next_server: None,
            warm: false,
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

/// Sends each line of `r` as an event (a last one without its newline too, marked as not
/// whole), then EOF.
pub(super) fn pump_lines(
    r: impl std::io::Read + Send + 'static,
    tx: Sender<Ev>,
    from: OutputOf,
    generation: u64,
) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(r);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let whole = buf.last() == Some(&b'\n');
            if whole {
                buf.pop();
            }
            let line = String::from_utf8_lossy(&buf).into_owned();
            let ev = match from {
                OutputOf::Server(server) if line.starts_with("ready") => {
                    Ev::ServerReady { server, generation }
                }
                OutputOf::Server(_) => continue,
                OutputOf::Producer(slot) => Ev::Line { slot, line, whole },
            };
            if tx.send(ev).is_err() {
                return;
            }
        }
        let _ = tx.send(match from {
            OutputOf::Server(server) => Ev::ServerEof { server, generation },
            OutputOf::Producer(slot) => Ev::Eof { slot, generation },
        });
    });
}

/// Reports a child's stderr lines, prefixed with its name; keeps the last one in `last` (the
/// server's, so a startup failure can be quoted).
pub(super) fn forward_stderr(
    r: impl std::io::Read + Send + 'static,
    name: String,
    report: Arc<dyn Report>,
    last: Option<Arc<Mutex<String>>>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            report.log(&format!("[{name}] {line}"));
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

/// What starting children needs: the configuration, the servers' sockets and devices, where
/// their output goes.
pub(super) struct Farm {
    pub(super) cfg: FarmConfig,
    /// Server k listens at `sockets[k]`, its model on `devices[k]`.
    pub(super) sockets: Vec<PathBuf>,
    pub(super) devices: Vec<Device>,
    pub(super) report: Arc<dyn Report>,
    pub(super) tx: Sender<Ev>,
    /// Each server's last stderr line.
    pub(super) server_said: Vec<Arc<Mutex<String>>>,
    /// Variables every child gets (the run's MPS daemon, [`crate::mps::Mps::env`]).
    pub(super) child_env: Vec<(&'static str, std::ffi::OsString)>,
}

impl Farm {
    pub(super) fn new(
        cfg: FarmConfig,
        sockets: Vec<PathBuf>,
        devices: Vec<Device>,
        report: Arc<dyn Report>,
        tx: Sender<Ev>,
    ) -> Farm {
        Farm {
            cfg,
            server_said: sockets
                .iter()
                .map(|_| Arc::new(Mutex::new(String::new())))
                .collect(),
            sockets,
            devices,
            report,
            tx,
            child_env: Vec::new(),
        }
    }

    fn command(&self, sub: &str) -> Command {
        let mut c = self.cfg.launcher.command();
        c.arg("--log")
            .arg(&self.cfg.child_log)
            .arg(sub)
            .env(crate::process::FARM_PID_ENV, std::process::id().to_string())
            .envs(self.child_env.iter().map(|(k, v)| (k, v)))
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

    /// Server k's configuration.
    pub(super) fn serve_config(&self, k: usize) -> ServeConfig {
        let cfg = &self.cfg;
        let mut model = cfg.model.clone();
        model.device = self.devices[k];
        ServeConfig {
            slots: cfg.in_flight,
            max_sessions: (cfg.producers + cfg.gpu_producers + 4) as u32,
            threads: cfg.threads,
            workers: cfg.run.workers,
            ..ServeConfig::new(self.sockets[k].clone(), model)
        }
    }

    /// A producer's configuration, started against server `server`.
    pub(super) fn produce_config(&self, name: &str, gpu: bool, server: usize) -> ProduceConfig {
        let cfg = &self.cfg;
        let gpu = gpu.then(|| GpuPrep {
            ordinal: match self.devices[server] {
                Device::Cuda(n) => n,
                Device::Cpu => 0,
            },
            batch: cfg.gpu_batch as usize,
            cpu_threads: gpu_cpu_threads(
                cfg.producers,
                cfg.gpu_producers,
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            ),
        });
        ProduceConfig {
            socket: self.sockets[server].clone(),
            inputs: Inputs::Worklist,
            output: Output::Stdout,
            image_size: cfg.model.config.image_size,
            in_flight: if gpu.is_some() {
                cfg.gpu_in_flight
            } else {
                cfg.in_flight
            },
            ready: cfg.ready,
            prep: cfg.prep,
            profile: cfg.profile,
            keep: cfg.keep,
            non_finite: cfg.non_finite,
            name: name.to_string(),
            timeout: ProduceConfig::DEFAULT_TIMEOUT,
            spin: ProduceConfig::DEFAULT_SPIN,
            // Given up on before the farm takes the producer as hung, so the file that held it
            // up has its line by then.
            read_timeout: crate::config::DEFAULT_READ_TIMEOUT.min(cfg.stall / 2),
            // Started beside a server that may still be loading its model.
            wait_for_server: crate::config::defaults::FARM_WAIT_FOR_SERVER,
            gpu,
        }
    }

    pub(super) fn start_server(&self, k: usize, generation: u64) -> Result<Child> {
        let mut c = self.command("serve");
        c.arg("--config-data").arg(self.serve_config(k).to_data());
        let mut child = c.spawn().map_err(|source| Error::Spawn {
            name: self.server_name(k),
            source,
        })?;
        pump_lines(
            child.stdout.take().expect("piped"),
            self.tx.clone(),
            OutputOf::Server(k),
            generation,
        );
        self.server_said[k].lock().unwrap().clear();
        forward_stderr(
            child.stderr.take().expect("piped"),
            self.server_name(k),
            self.report.clone(),
            Some(self.server_said[k].clone()),
        );
        Ok(child)
    }

    /// Starts producer `slot` against server `server`.
    pub(super) fn start_producer(&self, slot: usize, w: &mut Worker, server: usize) -> Result<()> {
        let mut c = self.command("produce");
        c.arg("--config-data")
            .arg(self.produce_config(&w.name, w.gpu, server).to_data())
            .stdin(Stdio::piped());
        let mut child = c.spawn().map_err(|source| Error::Spawn {
            name: w.name.clone(),
            source,
        })?;
        let lower = self
            .cfg
            .run
            .producer_nice_of(w.gpu, self.cfg.gpu_producers > 0);
        if lower > 0 {
            // Lowered as it starts (its own later threads inherit it), below the farm's own
            // priority; a refusal costs only the priority.
            let pid = rustix::process::Pid::from_child(&child);
            let ours = rustix::process::getpriority_process(None).unwrap_or(0);
            let nice = (ours + i32::from(lower)).min(19);
            if let Err(e) = rustix::process::setpriority_process(Some(pid), nice) {
                tracing::warn!("cannot lower {}'s CPU priority: {e}", w.name);
            }
        }
        w.generation += 1;
        w.warm = false;
        w.server = server;
        w.last_progress = Instant::now();
        pump_lines(
            child.stdout.take().expect("piped"),
            self.tx.clone(),
            OutputOf::Producer(slot),
            w.generation,
        );
        forward_stderr(
            child.stderr.take().expect("piped"),
            w.name.clone(),
            self.report.clone(),
            None,
        );
        let stdin = child.stdin.take();
        w.state = State::Running { child, stdin };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_producers_alone_share_the_cores() {
        // Beside CPU producers: the few files routed to them.
        assert_eq!(gpu_cpu_threads(14, 1, 16), GPU_CPU_THREADS);
        // Alone: the cores but the server's.
        assert_eq!(gpu_cpu_threads(0, 1, 16), 15);
        assert_eq!(gpu_cpu_threads(0, 2, 16), 7);
        // Never fewer than beside CPU producers.
        assert_eq!(gpu_cpu_threads(0, 2, 2), GPU_CPU_THREADS);
    }
}
