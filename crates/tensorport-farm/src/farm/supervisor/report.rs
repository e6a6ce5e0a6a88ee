//! What the supervisor reports: the live snapshot and the run's summary.

use super::*;

impl Supervisor {
    /// The farm as it is now, for a front end's progress display.
    pub(in crate::farm) fn snapshot(&self, started: Instant, batches: (u64, u64)) -> Snapshot {
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
    pub(super) fn results_of(&self, gpu: bool) -> (usize, u64) {
        self.workers
            .iter()
            .filter(|w| w.gpu == gpu)
            .fold((0, 0), |(n, done), w| (n + 1, done + w.done))
    }

    /// The run's summary.
    pub(in crate::farm) fn summary(&mut self, started: Instant, batches: (u64, u64)) -> Summary {
        let (first_result, last_result) = self.stats.span(started);
        Summary {
            inputs: self.ledger.len(),
            done: self.ledger.done_count(),
            errors: self.stats.errors,
            elapsed: started.elapsed(),
            first_result,
            last_result,
            all_running: self.stats.since_all_running(started),
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
