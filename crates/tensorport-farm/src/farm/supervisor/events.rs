//! What each event means: a result line (or a torn or unreadable one), a producer or server
//! that ended (restarted after a back-off, or given up on), a server ready.

use super::*;

impl Supervisor {
    /// Handles the events that came within `wait` (all that are queued once one has).
    pub(in crate::farm) fn handle_events(
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

    pub(super) fn on_line(&mut self, slot: usize, line: &str, whole: bool, out: &mut ResultsFile) {
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
                let r = ResultLine::failed(
                    index,
                    &self.inputs[index as usize],
                    format!(
                        "{} wrote a result for this input that the farm cannot read: {why}",
                        w.name
                    ),
                    w.name.clone(),
                );
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
        self.pace[usize::from(!w.gpu)].result(Instant::now());
        w.restarts.served();
        w.last_progress = Instant::now();
        if let Some(s) = self.servers.get_mut(w.server) {
            s.restarts.served();
        }
        if !self.stats.all_running_known() && self.workers.iter().all(|w| w.done > 0) {
            self.stats.all_running();
        }
    }

    /// A producer's output ended: its unfinished inputs go back to the front of the queue, and
    /// it is restarted after a back-off, or given up on after too many failures in a row.
    pub(super) fn on_producer_end(&mut self, slot: usize, generation: u64) {
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
        match w.restarts.failed(self.farm.cfg.run.max_restarts) {
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

    pub(super) fn on_server_ready(&mut self, k: usize, generation: u64) {
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
    pub(super) fn on_server_end(&mut self, k: usize, generation: u64) {
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
        match s.restarts.failed(self.farm.cfg.run.max_restarts) {
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
}
