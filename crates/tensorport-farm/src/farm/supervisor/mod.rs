//! The farm's supervisor: which inputs are handed to whom, what each event means (a result, a
//! child that ended, the server ready), when a child is restarted or given up on, and when the
//! run is over. It decides; `view` shows; `children` starts processes. Its state and the
//! starting of children are here; each other job is a file of its own: `handout` (who gets
//! which input, and second copies at the end of the queue), `events` (results, ends, readiness),
//! `ending` (moves by demand, stalls, the end of the run, shutting down), `report` (the live
//! snapshot and the summary).

use std::io::Write;
use std::process::Child;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use tensorport_vision::Source;

use super::balance::{pick_move, Load, Window, MIN_RESULTS};
use super::bound::Pace;
use super::children::{describe, unfixable_start, Ev, Farm, State, Worker};
use super::ledger::Ledger;
use super::lifecycle::{Restarts, Verdict};
use super::lines::{self, Line};
use super::route::{cpu_takes, CpuTakes, GpuState, Queue, Side};
use super::stats::RunStats;
use super::{ChildRow, ChildState, ResultsFile, Snapshot, Summary};
use crate::error::{Error, Result};
use crate::record::ResultLine;

mod ending;
mod events;
mod handout;
mod report;

/// One server of the farm (one per `--servers` / `--devices` entry).
pub(super) struct ServerSlot {
    child: Option<Child>,
    generation: u64,
    ready: bool,
    /// Whether it has listened once: producers first start when every server has (so they
    /// spread over all of them, not onto the one that came up first).
    ever_ready: bool,
    /// Its restarts; a server that keeps dying without ever serving is given up on, one that
    /// serves between its deaths is not.
    restarts: Restarts,
    wait_until: Option<Instant>,
    /// Someone else's server: never started, restarted or drained by the farm.
    attached: bool,
}

pub(super) struct Supervisor {
    pub(super) farm: Farm,
    inputs: Vec<Source>,
    /// More inputs, while they may come (a stream of them: `run_with`).
    more: Option<Receiver<Source>>,
    servers: Vec<ServerSlot>,
    workers: Vec<Worker>,
    stall: Duration,
    /// Inputs each producer may hold: twice its in-flight requests, so the next are ready.
    depth: usize,
    /// Inputs not handed out yet, by the kind of producer they suit.
    queue: Queue,
    /// Which inputs have their result, and which were given twice.
    ledger: Ledger,
    stats: RunStats,
    /// Set by the first Ctrl-C: no new work, finish what is in flight by then.
    stopping: Option<Instant>,
    /// Why the run ends early, if it does.
    pub(super) failure: Option<Error>,
    /// Results per server since the last look at the servers' demand.
    window: Window,
    /// Producers moved to another server by demand.
    moves: u32,
    /// The results of the GPU producers and of the CPU producers, for their rates.
    pace: [Pace; 2],
}

impl Supervisor {
    /// Starts the server; producers follow once it listens.
    pub(super) fn start(
        farm: Farm,
        inputs: Vec<Source>,
        more: Option<Receiver<Source>>,
    ) -> Result<Supervisor> {
        let n = inputs.len() as u64;
        let attached = matches!(farm.cfg.servers, crate::config::Servers::Attach { .. });
        let servers = (0..farm.sockets.len())
            .map(|k| {
                Ok(ServerSlot {
                    child: if attached {
                        None
                    } else {
                        Some(farm.start_server(k, 1)?)
                    },
                    generation: 1,
                    ready: attached,
                    ever_ready: attached,
                    restarts: Restarts::default(),
                    wait_until: None,
                    attached,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let workers = (0..farm.cfg.producers)
            .map(|i| Worker::new(format!("producer-{i}"), false))
            .chain(
                (0..farm.cfg.gpu_producers).map(|i| Worker::new(format!("gpu-producer-{i}"), true)),
            )
            .collect();
        let farm_servers = servers.len();
        // With both kinds of producers, each gets the inputs it prepares best.
        let routing = farm.cfg.producers > 0 && farm.cfg.gpu_producers > 0;
        Ok(Supervisor {
            stall: farm.cfg.stall.max(Duration::from_millis(100)),
            depth: (farm.cfg.in_flight.max(1) * 2) as usize,
            farm,
            inputs,
            more,
            servers,
            workers,
            queue: Queue::new(n, routing),
            ledger: Ledger::new(n),
            stats: RunStats::new(n),
            stopping: None,
            failure: None,
            window: Window::new(farm_servers),
            moves: 0,
            pace: [Pace::default(); 2],
        })
    }

    /// Takes the inputs that have come on the stream since the last look; the stream's end
    /// means no more will.
    pub(super) fn take_new_inputs(&mut self) {
        let Some(rx) = &self.more else { return };
        loop {
            match rx.try_recv() {
                Ok(source) => {
                    let i = self.ledger.len();
                    self.inputs.push(source);
                    self.ledger.push();
                    self.queue.push_new(i);
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => return,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    self.more = None;
                    return;
                }
            }
        }
    }

    /// Every input has its result and no more will come.
    fn all_done(&self) -> bool {
        self.ledger.done_count() >= self.ledger.len() && self.more.is_none()
    }

    /// The first Ctrl-C: hand out nothing more, give the work in flight 15 s.
    pub(super) fn stop(&mut self) {
        if self.stopping.is_none() {
            self.stopping = Some(Instant::now() + Duration::from_secs(15));
            self.farm
                .report
                .log("stopping: finishing the work in flight (Ctrl-C again to quit at once)");
        }
    }

    /// Inputs handed out and not answered yet.
    pub(super) fn in_flight(&self) -> usize {
        self.workers.iter().map(|w| w.assigned.len()).sum()
    }

    /// Whether any server listens.
    pub(super) fn any_ready(&self) -> bool {
        self.servers.iter().any(|s| s.ready)
    }

    /// Server restarts, all servers together.
    pub(super) fn server_restarts(&self) -> u32 {
        self.servers.iter().map(|s| s.restarts.total).sum()
    }

    /// The server with the fewest running producers (ties: the lowest number), for a producer
    /// about to start: one that listens, or one starting for the first time — at the farm's
    /// start producers start beside their servers (a producer waits for its server to listen,
    /// `ProduceConfig::wait_for_server`), so that the two starts overlap.
    fn least_loaded_server(&self) -> Option<usize> {
        (0..self.servers.len())
            .filter(|&k| {
                let s = &self.servers[k];
                s.ready || (!s.ever_ready && s.child.is_some())
            })
            .min_by_key(|&k| {
                self.workers
                    .iter()
                    .filter(|w| w.server == k && matches!(w.state, State::Running { .. }))
                    .count()
            })
    }

    /// Restarts servers whose back-off is over, and starts producers that are due against the
    /// server with the fewest producers ([`Supervisor::least_loaded_server`]).
    pub(super) fn start_due(&mut self) -> Result<()> {
        if self.stopping.is_some() {
            return Ok(());
        }
        let now = Instant::now();
        for k in 0..self.servers.len() {
            let s = &mut self.servers[k];
            if s.child.is_none() && s.wait_until.is_some_and(|t| now >= t) {
                s.generation += 1;
                s.wait_until = None;
                let generation = s.generation;
                self.servers[k].child = Some(self.farm.start_server(k, generation)?);
            }
        }
        if !self.all_done() {
            // GPU producers (the slots after the CPU producers') first, as their start — CUDA
            // context, decoders — is the longest.
            let cpu = self.farm.cfg.producers.min(self.workers.len());
            for slot in (cpu..self.workers.len()).chain(0..cpu) {
                if matches!(self.workers[slot].state, State::Waiting { until } if now >= until) {
                    let wanted = self.workers[slot]
                        .next_server
                        .take()
                        .filter(|&k| self.servers[k].ready);
                    let Some(k) = wanted.or_else(|| self.least_loaded_server()) else {
                        break;
                    };
                    self.farm.start_producer(slot, &mut self.workers[slot], k)?;
                }
            }
        }
        Ok(())
    }
}
