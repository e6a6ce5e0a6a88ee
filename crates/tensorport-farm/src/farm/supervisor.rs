//! The farm's supervisor: which inputs are handed to whom, what each event means (a result, a
//! child that ended, the server ready), when a child is restarted or given up on, and when the
//! run is over. It decides; `view` shows; `children` starts processes.

use std::io::Write;
use std::process::Child;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use tensorport_vision::Source;

use super::balance::{pick_move, Load, Window, MIN_RESULTS};
use super::children::{describe, unfixable_start, Ev, Farm, State, Worker};
use super::ledger::Ledger;
use super::lifecycle::{Restarts, Verdict};
use super::lines::{self, Line};
use super::route::{cpu_takes_plain, GpuState, Queue, Side};
use super::stats::RunStats;
use super::{ChildRow, ChildState, ResultsFile, Snapshot, Summary};
use crate::error::{Error, Result};
use crate::record::ResultLine;

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
    started: Instant,
    /// Why the run ends early, if it does.
    pub(super) failure: Option<Error>,
    /// Results per server since the last look at the servers' demand.
    window: Window,
    /// Producers moved to another server by demand.
    moves: u32,
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
            started: Instant::now(),
            failure: None,
            window: Window::new(farm_servers),
            moves: 0,
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

    /// The listening server with the fewest running producers (ties: the lowest number), for a
    /// producer about to start.
    fn least_loaded_server(&self) -> Option<usize> {
        (0..self.servers.len())
            .filter(|&k| self.servers[k].ready)
            .min_by_key(|&k| {
                self.workers
                    .iter()
                    .filter(|w| w.server == k && matches!(w.state, State::Running { .. }))
                    .count()
            })
    }

    /// Restarts servers whose back-off is over, and starts producers that are due against the
    /// listening server with the fewest producers.
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
        // At start-up, wait until every server listens (or has ended trying), for at most a
        // minute: producers that started against the first one up would all stay on it.
        let starting = self.started.elapsed() < Duration::from_secs(60)
            && self
                .servers
                .iter()
                .any(|s| !s.ever_ready && s.child.is_some());
        if !self.all_done() && !starting {
            for slot in 0..self.workers.len() {
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

    /// Gives each running producer inputs up to its depth, on its worklist (stdin): the GPU
    /// producers first, so that CPU producers sharing plain JPEGs take only what the GPU
    /// producers have no room for.
    pub(super) fn hand_out(&mut self) {
        if self.stopping.is_some() {
            return;
        }
        let gpu_depth = 2 * self.farm.cfg.gpu_in_flight as usize;
        // GPU producers first (the flag matters only to CPU producers).
        for slot in 0..self.workers.len() {
            if self.workers[slot].gpu {
                self.give(slot, gpu_depth, false);
            }
        }
        let gpus = self
            .workers
            .iter()
            .filter(|w| w.gpu)
            .map(|w| match w.state {
                State::Running { .. } => GpuState::Running {
                    warm: w.warm,
                    full: w.assigned.len() >= gpu_depth,
                },
                State::GaveUp => GpuState::GaveUp,
                _ => GpuState::Starting,
            });
        let cpu_takes_plain = cpu_takes_plain(self.farm.cfg.routing, gpus);
        for slot in 0..self.workers.len() {
            if !self.workers[slot].gpu {
                self.give(slot, self.depth, cpu_takes_plain);
            }
        }
        if self.queue.is_empty() {
            self.hedge(gpu_depth);
        }
    }

    /// Once every input is handed out, a producer with nothing to do also takes inputs that
    /// another holds and has likely not started (the last it was given, from the one holding
    /// the most), so the end of a run never waits on a slow or stopped producer while another
    /// idles. Each input is given a second time at most; its first result counts, and the
    /// other producer is told to leave it out ([`crate::record::withdraw_record`]).
    fn hedge(&mut self, gpu_depth: usize) {
        for slot in 0..self.workers.len() {
            let w = &self.workers[slot];
            let idle = matches!(w.state, State::Running { stdin: Some(_), .. })
                && w.warm
                && w.assigned.is_empty();
            if !idle {
                continue;
            }
            let room = if w.gpu { gpu_depth } else { self.depth };
            let ledger = &self.ledger;
            let unhedged = |d: usize| {
                self.workers[d]
                    .assigned
                    .iter()
                    .rev()
                    .filter(|&&i| !ledger.is_hedged(i) && !ledger.is_done(i))
            };
            let Some(donor) = (0..self.workers.len())
                .filter(|&d| d != slot)
                .map(|d| (unhedged(d).count(), d))
                .filter(|&(n, _)| n > 0)
                .max()
                .map(|(_, d)| d)
            else {
                return;
            };
            let take: Vec<u64> = unhedged(donor).take(room).copied().collect();
            let mut batch = Vec::new();
            for &i in &take {
                batch.extend(crate::record::work_record(i, &self.inputs[i as usize]));
            }
            let w = &mut self.workers[slot];
            let State::Running {
                stdin: Some(stdin), ..
            } = &mut w.state
            else {
                continue;
            };
            if stdin.write_all(&batch).and_then(|_| stdin.flush()).is_ok() {
                w.assigned.extend(take.iter().copied());
                for i in take {
                    self.ledger.hedge(i);
                }
            }
        }
    }

    /// Gives producer `slot`, if it runs, inputs up to `depth` held.
    fn give(&mut self, slot: usize, depth: usize, cpu_takes_plain: bool) {
        let w = &mut self.workers[slot];
        let State::Running {
            stdin: Some(stdin), ..
        } = &mut w.state
        else {
            return;
        };
        let mut batch = Vec::new();
        let mut given = Vec::new();
        let side = if w.gpu { Side::Gpu } else { Side::Cpu };
        while w.assigned.len() + given.len() < depth {
            let next = self
                .queue
                .next(side, cpu_takes_plain, |i| suits(&self.inputs[i as usize]));
            let Some(i) = next else {
                break;
            };
            if self.ledger.is_done(i) {
                continue;
            }
            batch.extend(crate::record::work_record(i, &self.inputs[i as usize]));
            given.push(i);
        }
        if given.is_empty() {
            return;
        }
        if stdin.write_all(&batch).and_then(|_| stdin.flush()).is_ok() {
            w.assigned.extend(given);
        } else {
            // It is dying; its EOF will come. Keep the inputs for someone else.
            for i in given.into_iter().rev() {
                self.queue.push_front(i);
            }
        }
    }

    /// Handles the events that came within `wait` (all that are queued once one has).
    pub(super) fn handle_events(
        &mut self,
        rx: &Receiver<Ev>,
        wait: Duration,
        out: &mut ResultsFile,
    ) {
        let Ok(first) = rx.recv_timeout(wait) else {
            return;
        };
        let mut next = Some(first);
        while let Some(ev) = next {
            match ev {
                Ev::Line { slot, line, whole } => self.on_line(slot, &line, whole, out),
                Ev::Eof { slot, generation } => self.on_producer_end(slot, generation),
                Ev::ServerReady { server, generation } => self.on_server_ready(server, generation),
                Ev::ServerEof { server, generation } => self.on_server_end(server, generation),
            }
            if self.failure.is_some() {
                return;
            }
            next = rx.try_recv().ok();
        }
    }

    fn on_line(&mut self, slot: usize, line: &str, whole: bool, out: &mut ResultsFile) {
        let (r, line) = match lines::read(line, whole) {
            Line::Result(r) => (r, std::borrow::Cow::Borrowed(line)),
            Line::Torn => return, // cut by a kill: the input is redone
            Line::Unreadable { index, why } => {
                let w = &self.workers[slot];
                let Some(index) = index.filter(|i| w.assigned.contains(i)) else {
                    self.farm.report.log(&format!(
                        "{} wrote a line that is no result line ({why}); left out",
                        w.name
                    ));
                    return;
                };
                let name = crate::record::InputName::of(&self.inputs[index as usize]);
                let r = ResultLine {
                    index,
                    input: name.input,
                    input_bytes: name.input_bytes,
                    class: None,
                    scores: None,
                    top_k: None,
                    error: Some(format!(
                        "{} wrote a result for this input that the farm cannot read: {why}",
                        w.name
                    )),
                    latency_ms: 0.0,
                    producer: w.name.clone(),
                    stages: None,
                };
                let text = serde_json::to_string(&r).expect("a result line serialises");
                (r, std::borrow::Cow::Owned(text))
            }
        };
        let (first, withdraw) = self.ledger.result(r.index);
        for (k, w) in self.workers.iter_mut().enumerate() {
            if w.assigned.remove(&r.index) && withdraw && k != slot {
                // Another producer holds it too: it leaves it out if it has not started it.
                if let State::Running {
                    stdin: Some(stdin), ..
                } = &mut w.state
                {
                    let rec = crate::record::withdraw_record(r.index);
                    let _ = stdin.write_all(&rec).and_then(|_| stdin.flush());
                }
            }
        }
        if !first {
            return;
        }
        self.stats.record(&r);
        if let Err(e) = out.push(&line) {
            self.failure = Some(e);
            return;
        }
        let w = &mut self.workers[slot];
        if let Some(r) = self.window.results.get_mut(w.server) {
            *r += 1;
        }
        w.done += 1;
        w.warm = true;
        w.restarts.served();
        w.last_progress = Instant::now();
        if let Some(s) = self.servers.get_mut(w.server) {
            s.restarts.served();
        }
    }

    /// A producer's output ended: its unfinished inputs go back to the front of the queue, and
    /// it is restarted after a back-off, or given up on after too many failures in a row.
    fn on_producer_end(&mut self, slot: usize, generation: u64) {
        let w = &mut self.workers[slot];
        if generation != w.generation {
            return;
        }
        let status = match std::mem::replace(&mut w.state, State::GaveUp) {
            State::Running { mut child, stdin } => {
                drop(stdin);
                child.wait().map(describe).unwrap_or_else(|e| e.to_string())
            }
            _ => "ended".into(),
        };
        for i in std::mem::take(&mut w.assigned).into_iter().rev() {
            if !self.ledger.is_done(i) {
                self.queue.push_front(i);
            }
        }
        w.last_exit = Some(status.clone());
        let all_done = self.ledger.done_count() >= self.ledger.len() && self.more.is_none();
        if std::mem::take(&mut w.moving) && !all_done && self.stopping.is_none() {
            // It finished its inputs to move: start it again at once, against its new server.
            w.state = State::Waiting {
                until: Instant::now(),
            };
            return;
        }
        if all_done || self.stopping.is_some() {
            w.state = State::Waiting {
                until: Instant::now() + Duration::from_secs(3600),
            };
            return;
        }
        let report = &self.farm.report;
        match w.restarts.failed(self.farm.cfg.max_restarts) {
            Verdict::GiveUp(times) => {
                report.log(&format!(
                    "{} failed {times} times in a row ({status}); giving up on it",
                    w.name
                ));
                w.state = State::GaveUp;
            }
            Verdict::Restart(d) => {
                report.log(&format!(
                    "{} ended ({status}); restarting in {:.1}s, its unfinished inputs are redone",
                    w.name,
                    d.as_secs_f64()
                ));
                w.state = State::Waiting {
                    until: Instant::now() + d,
                };
            }
        }
    }

    fn on_server_ready(&mut self, k: usize, generation: u64) {
        if generation == self.servers[k].generation {
            self.servers[k].ready = true;
            self.servers[k].ever_ready = true;
            // Time without a server is nobody's stall.
            let now = Instant::now();
            for w in self.workers.iter_mut().filter(|w| w.server == k) {
                w.last_progress = now;
            }
        }
    }

    /// A server ended: stop at once if restarting cannot help, else restart it after a
    /// back-off (its producers reconnect and redo their inputs), unless it keeps failing.
    fn on_server_end(&mut self, k: usize, generation: u64) {
        if generation != self.servers[k].generation {
            return;
        }
        let name = self.farm.server_name(k);
        let s = &mut self.servers[k];
        let was_ready = std::mem::replace(&mut s.ready, false);
        let exit = s.child.take().and_then(|mut c| c.wait().ok());
        let status = exit.map(describe).unwrap_or_else(|| "ended".into());
        if exit.is_some_and(|st| unfixable_start(&st, was_ready)) {
            let said = self.farm.server_said[k].lock().unwrap().clone();
            self.failure = Some(Error::ServerCannotStart {
                name,
                status,
                said: said.trim_start_matches("error: ").to_string(),
            });
            return;
        }
        if (self.ledger.done_count() >= self.ledger.len() && self.more.is_none())
            || self.stopping.is_some()
        {
            return;
        }
        match s.restarts.failed(self.farm.cfg.max_restarts) {
            Verdict::GiveUp(times) => {
                self.failure = Some(Error::ServerKeepsFailing {
                    name,
                    times,
                    status,
                });
            }
            Verdict::Restart(d) => {
                s.wait_until = Some(Instant::now() + d);
                self.farm.report.log(&format!(
                    "{name} ended ({status}); restarting in {:.1}s, its producers reconnect and redo their inputs",
                    d.as_secs_f64()
                ));
            }
        }
    }

    /// Every few seconds, with two servers or more: if one server's producers got clearly fewer
    /// results each than another's, one of them (a CPU producer) finishes the inputs it holds
    /// and restarts against the faster server (see `balance`).
    pub(super) fn rebalance(&mut self) {
        if self.servers.len() < 2 || self.stopping.is_some() || !self.window.is_due() {
            return;
        }
        if self.window.results.iter().sum::<u64>() < MIN_RESULTS {
            return; // the window grows until there is enough to judge
        }
        let loads: Vec<Load> = (0..self.servers.len())
            .map(|k| {
                let running = || {
                    self.workers
                        .iter()
                        .filter(move |w| w.server == k && matches!(w.state, State::Running { .. }))
                };
                Load {
                    ready: self.servers[k].ready,
                    movable: running().filter(|w| !w.gpu && !w.moving).count(),
                    producers: running().count(),
                    results: self.window.results[k],
                }
            })
            .collect();
        if let Some((from, to)) = pick_move(&loads) {
            // The producer on the slow server holding the fewest inputs moves.
            let slot = (0..self.workers.len())
                .filter(|&i| {
                    let w = &self.workers[i];
                    w.server == from
                        && !w.gpu
                        && !w.moving
                        && matches!(w.state, State::Running { .. })
                })
                .min_by_key(|&i| self.workers[i].assigned.len());
            if let Some(slot) = slot {
                let rate = |l: &Load| l.results as f64 / l.producers.max(1) as f64;
                let secs = self.window.began.elapsed().as_secs_f64();
                let w = &mut self.workers[slot];
                if let State::Running { stdin, .. } = &mut w.state {
                    // Its worklist ends: it finishes what it holds and exits.
                    stdin.take();
                }
                w.moving = true;
                w.next_server = Some(to);
                self.moves += 1;
                self.farm.report.log(&format!(
                    "moving {} from server {from} to server {to}: its producers got {:.1} results/s each, server {to}'s {:.1}",
                    w.name,
                    rate(&loads[from]) / secs,
                    rate(&loads[to]) / secs
                ));
            }
        }
        self.window.reset();
    }

    /// Hung producers: inputs held, no result for the stall time, with the server up. SIGKILL
    /// works on a stopped process too; its end of output then restarts it like any other death.
    pub(super) fn kill_stalled(&mut self) {
        if self.stopping.is_some() {
            return;
        }
        for w in self.workers.iter_mut() {
            let server_up = self.servers.get(w.server).is_some_and(|s| s.ready);
            if let State::Running { child, .. } = &mut w.state {
                if server_up && !w.assigned.is_empty() && w.last_progress.elapsed() > self.stall {
                    self.farm.report.log(&format!(
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

    /// Whether the run is over: every input done, a failure, every producer given up on, or
    /// stopping with nothing left in flight (or out of time).
    pub(super) fn is_over(&mut self) -> bool {
        if self.failure.is_some() || self.all_done() {
            return true;
        }
        if self
            .workers
            .iter()
            .all(|w| matches!(w.state, State::GaveUp))
        {
            self.failure = Some(Error::ProducersKeepFailing);
            return true;
        }
        self.stopping
            .is_some_and(|deadline| self.in_flight() == 0 || Instant::now() >= deadline)
    }

    /// Ends the producers (end of their worklists, then a kill after 10 s) and, unless `now`,
    /// drains the server; `now` kills it at once. Returns the server's last batch counters.
    pub(super) fn shut_down(&mut self, now: &dyn Fn() -> bool) -> Option<(u64, u64)> {
        for w in self.workers.iter_mut() {
            if let State::Running { stdin, .. } = &mut w.state {
                stdin.take();
            }
        }
        // A producer holding inputs gets 10 s to finish them; one holding none (its inputs were
        // answered by others, or withdrawn) has nothing left worth waiting for.
        let started = Instant::now();
        for w in self.workers.iter_mut() {
            let grace = if w.assigned.is_empty() { 2 } else { 10 };
            let deadline = started + Duration::from_secs(grace);
            if let State::Running { child, .. } = &mut w.state {
                while Instant::now() < deadline && !now() {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let mut batches = None;
        let ours = !self.servers.iter().any(|s| s.attached);
        if !now() && ours {
            for socket in &self.farm.sockets {
                if let Ok(mut c) = tensorport::Control::connect(socket, Duration::from_secs(2)) {
                    if let Ok(s) = c.status() {
                        let (b, n) = batches.unwrap_or((0, 0));
                        batches = Some((b + s.totals.batches, n + s.totals.batched));
                    }
                    let _ = c.drain();
                }
            }
        }
        for slot in self.servers.iter_mut() {
            let Some(mut s) = slot.child.take() else {
                continue;
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match s.try_wait() {
                    Ok(Some(_)) => break,
                    _ if now() || Instant::now() >= deadline => {
                        let _ = s.kill();
                        let _ = s.wait();
                        break;
                    }
                    _ => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        batches
    }

    /// The farm as it is now, for a front end's progress display.
    pub(super) fn snapshot(&self, started: Instant, batches: (u64, u64)) -> Snapshot {
        let servers = self
            .servers
            .iter()
            .enumerate()
            .map(|(k, s)| ChildRow {
                name: self.farm.server_name(k),
                state: match (&s.child, s.ready) {
                    _ if s.attached => ChildState::Attached,
                    (Some(c), true) => ChildState::Running { pid: c.id() },
                    (Some(c), false) => ChildState::Starting { pid: Some(c.id()) },
                    (None, _) => ChildState::Restarting {
                        after: None,
                        last_exit: None,
                    },
                },
                done: 0,
                handed_out: 0,
                restarts: s.restarts.total,
            })
            .collect();
        let producers = self
            .workers
            .iter()
            .map(|w| ChildRow {
                name: w.name.clone(),
                state: match &w.state {
                    State::Running { child, .. } => ChildState::Running { pid: child.id() },
                    State::Waiting { .. } if w.generation == 0 => {
                        ChildState::Starting { pid: None }
                    }
                    State::Waiting { until } => ChildState::Restarting {
                        after: Some(until.saturating_duration_since(Instant::now())),
                        last_exit: w.last_exit.clone(),
                    },
                    State::GaveUp => ChildState::GaveUp {
                        last_exit: w.last_exit.clone(),
                    },
                },
                done: w.done,
                handed_out: w.assigned.len(),
                restarts: w.restarts.total,
            })
            .collect();
        Snapshot {
            inputs: self.ledger.len(),
            done: self.ledger.done_count(),
            errors: self.stats.errors,
            handed_out: self.in_flight(),
            batches,
            elapsed: started.elapsed(),
            servers,
            producers,
        }
    }

    /// How many producers of a kind there are, and the results they returned.
    fn results_of(&self, gpu: bool) -> (usize, u64) {
        self.workers
            .iter()
            .filter(|w| w.gpu == gpu)
            .fold((0, 0), |(n, done), w| (n + 1, done + w.done))
    }

    /// The run's summary.
    pub(super) fn summary(&mut self, started: Instant, batches: (u64, u64)) -> Summary {
        let (first_result, last_result) = self.stats.span(started);
        Summary {
            inputs: self.ledger.len(),
            done: self.ledger.done_count(),
            errors: self.stats.errors,
            elapsed: started.elapsed(),
            first_result,
            last_result,
            latency_ms: self.stats.latency_ms(),
            batches,
            max_batch: self.farm.cfg.model.max_batch,
            server_restarts: self.server_restarts(),
            producers: self.results_of(false),
            gpu_producers: self.results_of(true),
            producer_restarts: self.workers.iter().map(|w| w.restarts.total).sum(),
            moves: self.moves,
            output: self.farm.cfg.output.clone(),
            stages: self.stats.stages(),
        }
    }
}

/// Plain JPEGs of this many pixels or more suit either kind of producer.
const EITHER_PIXELS: u64 = 2_000_000;

/// The kind of producer that prepares `source` best: GPU producers decode plain JPEGs on the
/// GPU's engines and anything else on the CPU; large plain JPEGs cost both about the same per
/// pixel, so whoever has room takes them.
fn suits(source: &Source) -> Side {
    let Source::File(p) = source else {
        return Side::Cpu;
    };
    match tensorport_vision::sniff::jpeg_file_frame(p) {
        Some(f) if f.is_plain() => {
            if u64::from(f.width) * u64::from(f.height) >= EITHER_PIXELS {
                Side::Either
            } else {
                Side::Gpu
            }
        }
        _ => Side::Cpu,
    }
}
