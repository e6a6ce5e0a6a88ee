//! Moving producers to the server with demand, killing a stalled producer, knowing when the
//! run is over, and shutting it down: producers first, then the servers.

use super::*;

impl Supervisor {
    /// Every few seconds, with two servers or more: if one server's producers got clearly fewer
    /// results each than another's, one of them (a CPU producer) finishes the inputs it holds
    /// and restarts against the faster server (see `balance`).
    pub(in crate::farm) fn rebalance(&mut self) {
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
    pub(in crate::farm) fn kill_stalled(&mut self) {
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
    pub(in crate::farm) fn is_over(&mut self) -> bool {
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
    pub(in crate::farm) fn shut_down(&mut self, now: &dyn Fn() -> bool) -> Option<(u64, u64)> {
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
}
