//! A NIXL stream's side of a session: the GPU producer session its device tensors go into,
//! and the reads of the remote producer's slots into a pool slot on loan, each submitted once
//! it has landed.

use super::*;

impl Session {
    /// A GPU producer session with the local server on the gateway's GPU, reading the
    /// producer's device slots (`h`) into its buffers.
    pub(super) fn device_inbound(
        &self,
        h: &Hello,
        layout: &TensorLayout,
    ) -> Result<DeviceInbound, End> {
        if self.cfg.nixl_interface.is_none() {
            return Err(End::Tell(Status::failed_precondition(NO_NIXL_INTERFACE)));
        }
        if !self.cfg.nixl_device {
            return Err(End::Tell(Status::failed_precondition(NO_NIXL_DEVICE)));
        }
        let unable = |e: String| {
            End::Tell(Status::failed_precondition(format!(
                "the gateway cannot take this stream's device tensors: {e}"
            )))
        };
        let gpu = Gpu::open(self.cfg.gpu as i32)
            .map_err(|e| unable(format!("its GPU {}: {e}", self.cfg.gpu)))?;
        let buffers = (self.cfg.in_flight.max(1) as usize).min(MAX_DEVICE_BUFFERS as usize);
        let c = GpuProducerConfig::new(local_name(&self.who), buffers, layout.bytes())
            .sharing(Sharing::Ipc(Fence::Timeline));
        let producer = GpuProducer::connect(&self.cfg.socket, &gpu, &c).map_err(|e| {
            End::Tell(Status::unavailable(format!(
                "the gateway cannot hand device tensors to its tensorport server (is it `serve --device cuda`?): {e}"
            )))
        })?;
        DeviceInbound::open(h, &gateway_agent_name(), producer).map_err(unable)
    }

    /// A NIXL stream's batch: starts reading each named slot of the producer into a pool slot
    /// on loan; each is submitted once its read has landed ([`Session::submit_landed`]). Reads
    /// of later batches run while earlier ones land; when the pool has no free slot the oldest
    /// read is waited for first.
    pub(super) fn submit_read(&mut self, batch: &RecordBatch) -> Result<u64, End> {
        let rows =
            slot_rows(batch).map_err(|e| End::Tell(Status::invalid_argument(e.to_string())))?;
        let slots = match &self.local {
            Some((Local::Pool { inbound, .. }, _, _)) => inbound.slots(),
            Some((Local::Device(d), _, _)) => d.slots(),
            _ => unreachable!("a NIXL stream"),
        };
        for &(id, slot) in &rows {
            if slot >= slots {
                return Err(End::Tell(Status::invalid_argument(format!(
                    "slot {slot} is not one of the {slots} this stream's set-up registered"
                ))));
            }
            if !self.pending.insert(id) {
                return Err(End::Tell(Status::invalid_argument(format!(
                    "request id {id} is already in flight on this stream"
                ))));
            }
        }
        let timeout = self.cfg.peer_timeout;
        for &(id, slot) in &rows {
            while !self.reads.is_empty() && !self.room_for_a_read() {
                self.land_oldest()?;
            }
            let into = match self.local.as_mut().expect("connected") {
                (Local::Pool { inbound, p }, _, _) => {
                    let loan = p.loan(timeout).map_err(local_failed)?;
                    inbound.start(slot, loan).map_err(read_failed)?
                }
                (Local::Device(d), _, _) => {
                    d.reader()
                        .start(slot, timeout)
                        .map_err(|e| read_failed(e.to_string()))? as u32
                }
                _ => unreachable!("a NIXL stream"),
            };
            self.reads.push_back((id, into));
        }
        Ok(rows.len() as u64)
    }

    /// Whether another read can start without waiting for one to land (a pool slot can be
    /// lent without waiting for a result, or a device buffer holds no read).
    pub(super) fn room_for_a_read(&mut self) -> bool {
        match self.local.as_mut().expect("connected") {
            (Local::Host(p) | Local::Pool { p, .. }, _, _) => {
                let submitted = p.in_flight() - p.ready();
                p.free_slots() > 0 && submitted + self.reads.len() < p.max_in_flight() as usize
            }
            (Local::Device(d), _, _) => d.reader().has_room(),
        }
    }

    /// Submits the reads that have landed, oldest first, up to the first still in flight;
    /// returns how many.
    pub(super) fn submit_landed(&mut self) -> Result<usize, End> {
        let mut n = 0;
        while let Some(&(id, into)) = self.reads.front() {
            let Some(landed) = self.landed(into, None)? else {
                break;
            };
            self.reads.pop_front();
            self.submit_landing(id, landed)?;
            n += 1;
        }
        Ok(n)
    }

    /// Waits for the oldest read to land and submits it.
    pub(super) fn land_oldest(&mut self) -> Result<(), End> {
        let Some((id, into)) = self.reads.pop_front() else {
            return Ok(());
        };
        let landed = self
            .landed(into, Some(self.cfg.peer_timeout))?
            .expect("a wait that returns has landed");
        self.submit_landing(id, landed)
    }

    /// The read into `into`, if it has landed, waiting up to `wait` if given (then it has, or
    /// it is an error).
    pub(super) fn landed(
        &mut self,
        into: u32,
        wait: Option<Duration>,
    ) -> Result<Option<Landed>, End> {
        match self.local.as_mut().expect("connected") {
            (Local::Pool { inbound, .. }, _, _) => Ok(match wait {
                Some(t) => Some(inbound.wait(into, t).map_err(read_failed)?),
                None => inbound.poll(into).map_err(read_failed)?,
            }
            .map(Landed::Slot)),
            (Local::Device(d), _, _) => {
                let r = d.reader();
                let done = match wait {
                    Some(t) => r.wait(into as usize, t).map(|()| true),
                    None => r.poll(into as usize),
                }
                .map_err(|e| read_failed(e.to_string()))?;
                Ok(done.then_some(Landed::Buffer(into as usize)))
            }
            _ => unreachable!("a NIXL stream"),
        }
    }

    /// Submits request `id`, whose read has landed.
    pub(super) fn submit_landing(&mut self, id: u64, landed: Landed) -> Result<(), End> {
        let (local, layout, spec) = self.local.as_mut().expect("connected");
        match (local, landed) {
            (Local::Pool { p, .. }, Landed::Slot(loan)) => {
                p.submit_loan_as(loan, id, spec).map_err(local_failed)?
            }
            (Local::Device(d), Landed::Buffer(i)) => {
                d.reader().submit_as(i, spec, id).map_err(|e| {
                    End::Tell(Status::unavailable(format!(
                        "the gateway's tensorport server failed this stream: {e}"
                    )))
                })?
            }
            _ => unreachable!("a stream's reads land where its session is"),
        }
        self.counters.tensors.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes
            .fetch_add(layout.bytes() as u64, Ordering::Relaxed);
        Ok(())
    }
}
