//! One remote producer's thread: its batches become leases, copies and submissions of a local
//! producer session; its results go back as result batches.

use std::collections::{HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use tensorport::wire::MAX_DEVICE_BUFFERS;
use tensorport::{Completion, Loan, Producer, ProducerConfig, TensorSpec};
use tensorport_cuda::{Fence, Gpu, GpuProducer, GpuProducerConfig, Sharing};
use tensorport_nixl::Memory;
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tonic::Status;

use super::{Counters, GatewayConfig};
use crate::nixl::{slot_rows, DeviceInbound, Hello, Inbound};
use crate::schema::{results_batch, ResultRow, TensorLayout, TensorRows};

mod nixl_read;

/// Why a NIXL stream is refused by a gateway that was not told which interface NIXL may use.
const NO_NIXL_DEVICE: &str = "this gateway takes no NIXL streams of GPU memory: they are read in \
    the gateway's own process, where a set-up that makes UCX abort ends it; send from host memory \
    (produce without --gpu), or start the gateway with --nixl-device to take them from producers \
    you trust";
const NO_NIXL_INTERFACE: &str = "this gateway takes no NIXL streams: it listens on every \
     address and was not told which interface NIXL may use (gateway --nixl-interface)";

/// What the reader hands the session thread.
#[derive(Debug)]
pub enum Input {
    /// A batch of tensors, not yet checked.
    Batch(RecordBatch),
    /// The stream broke (the remote producer died or the connection failed).
    Broken(String),
    /// The remote producer sent something that does not decode.
    Invalid(String),
}

/// Why a session ends early.
enum End {
    /// The remote producer did something wrong or the local server failed: it is told why.
    Tell(Status),
    /// The remote producer is gone, or stopped reading: nobody to tell.
    Gone(String),
}

type Out = mpsc::Sender<Result<RecordBatch, Status>>;

/// A NIXL read that has landed, ready to submit: the pool slot on loan, or the device buffer.
enum Landed {
    Slot(Loan),
    Buffer(usize),
}

/// The gateway's session with its local server for one stream (one per stream, for its life:
/// its size does not matter).
#[allow(clippy::large_enum_variant)]
enum Local {
    /// A session with a pool, for a stream of tensors.
    Host(Producer),
    /// A session with a pool that a NIXL stream's host tensors are read into. (Fields drop in
    /// order: the reader, which finishes its reads, before the session.)
    Pool { inbound: Inbound, p: Producer },
    /// A GPU producer session: a NIXL stream of device tensors, read into its device buffers.
    Device(DeviceInbound),
}

impl Local {
    fn producer(&mut self) -> &mut Producer {
        match self {
            Local::Host(p) | Local::Pool { p, .. } => p,
            Local::Device(d) => d.reader().producer(),
        }
    }

    /// Whether the stream's tensors travel by NIXL.
    fn is_nixl(&self) -> bool {
        !matches!(self, Local::Host(_))
    }

    /// Ends the session with the server cleanly, once NIXL's reads have finished (or been
    /// given up, their memory kept).
    fn close(self) {
        match self {
            Local::Host(p) => drop(p.close()),
            Local::Pool { inbound, p } => {
                drop(inbound);
                drop(p.close());
            }
            Local::Device(d) => drop(d.close()),
        }
    }
}

/// The session thread's state.
pub(super) struct Session {
    cfg: Arc<GatewayConfig>,
    who: String,
    /// The address the producer connected from: the only one a NIXL stream's reads may
    /// connect to.
    peer: Option<IpAddr>,
    input: mpsc::Receiver<Input>,
    out: Out,
    rt: Handle,
    counters: Arc<Counters>,
    /// The local session, once the first batch gave the layout.
    local: Option<(Local, TensorLayout, TensorSpec)>,
    /// The schema the layout was read from: later batches that share it are not parsed again.
    schema: Option<arrow_schema::SchemaRef>,
    /// Request ids submitted and not yet answered.
    pending: HashSet<u64>,
    /// A NIXL stream's reads in flight, oldest first: each request and the pool slot (or device
    /// buffer) its read lands in (the reader holds it until the read has finished).
    reads: VecDeque<(u64, u32)>,
}

impl Session {
    pub(super) fn new(
        cfg: Arc<GatewayConfig>,
        who: String,
        peer: Option<IpAddr>,
        input: mpsc::Receiver<Input>,
        out: Out,
        rt: Handle,
        counters: Arc<Counters>,
    ) -> Session {
        Session {
            cfg,
            who,
            peer,
            input,
            out,
            rt,
            counters,
            local: None,
            schema: None,
            pending: HashSet::new(),
            reads: VecDeque::new(),
        }
    }

    /// Serves the stream to its end, then closes the local session.
    pub(super) fn run(mut self) {
        tracing::info!(remote = %self.who, "remote producer connected");
        let t0 = Instant::now();
        match self.serve() {
            Ok(n) => tracing::info!(
                remote = %self.who,
                tensors = n,
                seconds = t0.elapsed().as_secs_f64(),
                "remote producer finished"
            ),
            Err(End::Tell(status)) => {
                tracing::warn!(remote = %self.who, "ending the stream: {}", status.message());
                let _ = self.send(Err(status));
            }
            Err(End::Gone(why)) => {
                if !self.pending.is_empty() {
                    self.counters.broken.fetch_add(1, Ordering::Relaxed);
                }
                tracing::warn!(
                    remote = %self.who,
                    in_flight = self.pending.len(),
                    "remote producer gone ({why}); its session is closed and its requests in flight dropped"
                );
            }
        }
        // Closing the local session finishes NIXL's reads first; the server reclaims its pool.
        self.reads.clear();
        if let Some((local, _, _)) = self.local.take() {
            local.close();
        }
    }

    /// Returns the number of tensors submitted.
    fn serve(&mut self) -> Result<u64, End> {
        let mut submitted = 0u64;
        loop {
            let next = if self.pending.is_empty() {
                // A stream with nothing in flight that sends nothing for the peer timeout gives
                // its place back (its producer reconnects when it has work again).
                let wait = self.cfg.peer_timeout;
                let input = &mut self.input;
                match self
                    .rt
                    .block_on(async { tokio::time::timeout(wait, input.recv()).await })
                {
                    Ok(next) => next,
                    Err(_) => {
                        return Err(End::Tell(Status::deadline_exceeded(format!(
                            "nothing sent for {} s with nothing in flight: the stream gives its place back",
                            wait.as_secs()
                        ))))
                    }
                }
            } else {
                match self.input.try_recv() {
                    Ok(i) => Some(i),
                    Err(mpsc::error::TryRecvError::Empty) => {
                        if self.reads.is_empty() {
                            self.collect(Duration::from_millis(1))?;
                        } else if self.submit_landed()? == 0 {
                            // Each poll of a read drives UCX's progress (over TCP, a segment
                            // at a time): keep polling while reads are in flight.
                            self.collect(Duration::ZERO)?;
                            std::thread::yield_now();
                        }
                        continue;
                    }
                    Err(mpsc::error::TryRecvError::Disconnected) => None,
                }
            };
            match next {
                Some(Input::Batch(b)) => {
                    submitted += self.submit(&b)?;
                    self.submit_landed()?;
                    self.collect(Duration::ZERO)?;
                }
                // Nothing in flight: the producer left with everything answered.
                Some(Input::Broken(why)) if self.pending.is_empty() => {
                    tracing::info!(remote = %self.who, "remote producer left ({why}) with nothing in flight");
                    return Ok(submitted);
                }
                Some(Input::Broken(why)) => return Err(End::Gone(why)),
                Some(Input::Invalid(why)) => {
                    return Err(End::Tell(Status::invalid_argument(format!(
                        "the stream does not decode: {why}"
                    ))))
                }
                None => break,
            }
        }
        // The producer sent everything: land its last reads, answer what is in flight.
        while !self.reads.is_empty() {
            self.land_oldest()?;
        }
        while !self.pending.is_empty() {
            self.collect(self.cfg.peer_timeout)?;
        }
        Ok(submitted)
    }

    /// The local session for a batch's schema (connected on the first batch), and for a NIXL
    /// stream the reader of the producer's slots.
    fn local_for(&mut self, batch: &RecordBatch) -> Result<(), End> {
        if let Some((local, layout, _)) = &self.local {
            // The decoder hands every batch of a stream the one schema it read: compare the
            // pointer, and parse only a schema that is not that one.
            let known = self
                .schema
                .as_ref()
                .is_some_and(|s| std::sync::Arc::ptr_eq(s, batch.schema_ref()));
            let same = known
                || if local.is_nixl() {
                    self.schema.as_deref() == Some(batch.schema_ref().as_ref())
                } else {
                    TensorLayout::from_schema(&batch.schema(), self.cfg.max_tensor_bytes)
                        .map(|l| &l == layout)
                        .unwrap_or(false)
                };
            return if same {
                Ok(())
            } else {
                Err(End::Tell(Status::invalid_argument(
                    "a stream's tensors keep the dtype and shape of its first batch",
                )))
            };
        }
        let invalid =
            |e: crate::schema::SchemaError| End::Tell(Status::invalid_argument(e.to_string()));
        let hello =
            Hello::from_schema(&batch.schema(), self.cfg.max_tensor_bytes).map_err(invalid)?;
        let layout = match &hello {
            Some(h) => h.layout.clone(),
            None => TensorLayout::from_schema(&batch.schema(), self.cfg.max_tensor_bytes)
                .map_err(invalid)?,
        };
        let spec = TensorSpec::new(layout.dtype, &layout.shape);
        if let Some(h) = hello.as_ref().filter(|h| h.slots.memory != Memory::Host) {
            let inbound = self.device_inbound(h, &layout)?;
            tracing::info!(remote = %self.who, agent = %h.agent, slots = h.slots.slots, gpu = self.cfg.gpu, "NIXL stream: reading the producer's GPU slots into device memory");
            self.local = Some((Local::Device(inbound), layout, spec));
            self.schema = Some(batch.schema());
            return Ok(());
        }
        let mut c = ProducerConfig::new(local_name(&self.who));
        c.slots = self.cfg.in_flight.max(1);
        c.slot_size = layout.bytes() as u64;
        if hello.is_some() {
            // NIXL fills the slots, not this core: nothing to gain from waiting for a warm one.
            c.warm_wait = Duration::ZERO;
        }
        let p = Producer::connect(&self.cfg.socket, c).map_err(|e| {
            End::Tell(Status::unavailable(format!(
                "the gateway cannot reach its tensorport server: {e}"
            )))
        })?;
        if p.slot_size() < layout.bytes() as u64 {
            return Err(End::Tell(Status::failed_precondition(format!(
                "the server's slots hold {} bytes, this stream's tensors {}; start the server with a larger --slot-size",
                p.slot_size(),
                layout.bytes()
            ))));
        }
        if hello.is_some() && self.cfg.nixl_interface.is_none() {
            return Err(End::Tell(Status::failed_precondition(NO_NIXL_INTERFACE)));
        }
        let local = match &hello {
            Some(h) => {
                // The producer's slots are read straight into the local session's pool.
                let peer = self.peer.ok_or_else(|| {
                    End::Tell(Status::failed_precondition(
                        "the gateway cannot tell this stream's address, and reads a NIXL stream only from the address it came from",
                    ))
                })?;
                let inbound =
                    Inbound::open(h, &gateway_agent_name(), p.pool(), peer).map_err(|e| {
                        End::Tell(Status::failed_precondition(format!(
                            "the gateway cannot read this stream's tensors with NIXL: {e}"
                        )))
                    })?;
                tracing::info!(remote = %self.who, agent = %h.agent, slots = h.slots.slots, "NIXL stream: reading the producer's slots");
                Local::Pool { inbound, p }
            }
            None => Local::Host(p),
        };
        self.local = Some((local, layout, spec));
        self.schema = Some(batch.schema());
        Ok(())
    }

    /// Leases, fills and submits one slot per tensor of `batch`.
    fn submit(&mut self, batch: &RecordBatch) -> Result<u64, End> {
        self.local_for(batch)?;
        if self.local.as_ref().is_some_and(|(l, _, _)| l.is_nixl()) {
            return self.submit_read(batch);
        }
        let Some((Local::Host(p), layout, spec)) = self.local.as_mut() else {
            unreachable!("a tensor stream has a host session")
        };
        let rows = TensorRows::new(layout, batch)
            .map_err(|e| End::Tell(Status::invalid_argument(e.to_string())))?;
        let timeout = self.cfg.peer_timeout;
        for i in 0..rows.len() {
            let (id, bytes) = rows.get(i);
            if !self.pending.insert(id) {
                return Err(End::Tell(Status::invalid_argument(format!(
                    "request id {id} is already in flight on this stream"
                ))));
            }
            let mut lease = p.lease(timeout).map_err(local_failed)?;
            lease.bytes_mut()[..bytes.len()].copy_from_slice(bytes);
            lease.submit_as(id, spec).map_err(local_failed)?;
            self.counters.tensors.fetch_add(1, Ordering::Relaxed);
            self.counters
                .bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        Ok(rows.len() as u64)
    }

    /// Sends back every result that has arrived, waiting up to `wait` for the first.
    fn collect(&mut self, wait: Duration) -> Result<(), End> {
        let Some((local, _, _)) = self.local.as_mut() else {
            return Ok(());
        };
        let p = local.producer();
        let mut rows = Vec::new();
        let first = if wait.is_zero() {
            p.try_recv_result().map_err(local_failed)?
        } else {
            match p.recv_result(wait) {
                Ok(c) => Some(c),
                Err(tensorport::RecvError::Timeout(..)) if wait < self.cfg.peer_timeout => None,
                Err(e) => return Err(local_failed(e)),
            }
        };
        let mut next = first;
        while let Some(c) = next {
            if let Some(row) = answer(&mut self.pending, c) {
                rows.push(row);
            }
            next = p.try_recv_result().map_err(local_failed)?;
            if rows.len() >= 256 {
                break;
            }
        }
        if rows.is_empty() {
            return Ok(());
        }
        let n = rows.len() as u64;
        self.send(Ok(results_batch(&rows)))?;
        self.counters.results.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }

    /// Sends on the stream; a remote producer that leaves its results unread for the peer
    /// timeout is dropped.
    fn send(&self, item: Result<RecordBatch, Status>) -> Result<(), End> {
        let sent = self.rt.block_on(async {
            tokio::time::timeout(self.cfg.peer_timeout, self.out.send(item)).await
        });
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(End::Gone("the stream closed".into())),
            Err(_) => Err(End::Gone(format!(
                "it left its results unread for {} s",
                self.cfg.peer_timeout.as_secs()
            ))),
        }
    }
}

/// A name for a gateway session's NIXL agent, unique among this gateway's.
fn gateway_agent_name() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!(
        "tensorport-gateway-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The local session's name: `bridge: NAME from ADDR`, cut to the protocol's limit on a
/// character boundary (a long name or an IPv6 address would otherwise be refused).
fn local_name(who: &str) -> String {
    let mut name = format!("bridge: {who}");
    let max = tensorport::wire::MAX_NAME_LEN;
    if name.len() > max {
        let mut end = max;
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        name.truncate(end);
    }
    name
}

/// The row for a completion, if it answers a request of this stream.
fn answer(pending: &mut HashSet<u64>, c: Completion) -> Option<ResultRow> {
    if !pending.remove(&c.request_id) {
        return None;
    }
    Some(ResultRow {
        id: c.request_id,
        outcome: c.result.map_err(|e| (e.code.as_u16(), e.message)),
    })
}

/// A NIXL read that failed or did not land in time (the producer gone, a slot it never
/// registered), told to the remote producer as retryable.
fn read_failed(why: String) -> End {
    End::Tell(Status::unavailable(format!(
        "a NIXL read of this stream's slots failed: {why}"
    )))
}

/// A failure of the local session, told to the remote producer as retryable.
fn local_failed(e: impl std::fmt::Display) -> End {
    End::Tell(Status::unavailable(format!(
        "the gateway's tensorport server failed this stream: {e}"
    )))
}

#[cfg(test)]
mod tests {
    use super::local_name;

    #[test]
    fn local_names_fit_the_protocol_on_a_character_boundary() {
        assert_eq!(
            local_name("a from 127.0.0.1:9"),
            "bridge: a from 127.0.0.1:9"
        );
        let long = format!("{} from [2001:db8::1]:40000", "é".repeat(40));
        let n = local_name(&long);
        assert!(n.len() <= tensorport::wire::MAX_NAME_LEN, "{n}");
        assert!(n.starts_with("bridge: éé"));
    }
}
