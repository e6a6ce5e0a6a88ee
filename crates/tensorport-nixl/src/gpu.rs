//! Reads that land straight in a server's device memory: the reader owns a
//! [`tensorport_cuda::GpuProducer`] (a session with the local server whose device buffers the
//! server imports), registers its buffers with NIXL, reads a peer's slots (on a GPU or in host
//! memory) into them, and submits each buffer only once its read has finished.

use std::time::{Duration, Instant};

use tensorport::{Producer, TensorSpec};
use tensorport_cuda::GpuProducer;

use crate::agent::{Agent, Peer};
use crate::error::{Error, Result};
use crate::read::{wait_for, Reader, DROP_WAIT};

/// Reads a peer's slots into a GPU producer's device buffers, one read per buffer at a time.
pub struct GpuReader {
    // Dropped before `producer` (see `Drop`): the registration goes before the buffers.
    reader: Option<Reader>,
    producer: Option<GpuProducer>,
    /// Per buffer: whether a read into it has started and its buffer is not yet submitted
    /// (`Some(false)` while the read runs, `Some(true)` once it has landed).
    landing: Vec<Option<bool>>,
    /// The producer's stream waits for a release the server never signalled: dropping the
    /// producer would wait for it for good, so it is never dropped.
    stalled: bool,
}

impl std::fmt::Debug for GpuReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuReader")
            .field("reader", &self.reader)
            .finish_non_exhaustive()
    }
}

impl GpuReader {
    /// Registers `producer`'s device buffers with `agent` and reads `peer`'s slots (of one tensor
    /// each, at most a buffer's length) into them.
    pub fn new(agent: &Agent, producer: GpuProducer, peer: Peer) -> Result<GpuReader> {
        let tensor = peer.layout().slot_len;
        if tensor > producer.buffer_len() as u64 {
            return Err(Error::Refused(
                "the peer's slots are larger than the device buffers",
            ));
        }
        let n = producer.buffer_count();
        let addrs = (0..n).map(|i| producer.buffer(i).ptr().raw()).collect();
        let gpu = producer.stream().gpu().ordinal() as u32;
        // SAFETY: the buffers belong to `producer`, which this reader owns from now on and drops
        // only after the region (or never, if a read into them could not be finished: `Drop`).
        let region = unsafe { agent.register_device_external(gpu, addrs, tensor) }?;
        Ok(GpuReader {
            reader: Some(Reader::new(region, peer)?),
            producer: Some(producer),
            landing: vec![None; n],
            stalled: false,
        })
    }

    fn reader(&mut self) -> &mut Reader {
        self.reader.as_mut().expect("until dropped")
    }

    fn gpu(&mut self) -> &mut GpuProducer {
        self.producer.as_mut().expect("until dropped")
    }

    /// The peer read from.
    pub fn peer(&self) -> &Peer {
        self.reader.as_ref().expect("until dropped").peer()
    }

    /// The session's producer (for its results).
    pub fn producer(&mut self) -> &mut Producer {
        self.gpu().producer()
    }

    /// Whether a buffer is free for another read (none is held by a read not yet submitted).
    pub fn has_room(&self) -> bool {
        self.landing.iter().any(Option::is_none)
    }

    /// Takes the next buffer (waiting up to `timeout` for the server to release it, and for the
    /// GPU to pass the release) and starts reading the peer's slot `from` into it; returns the
    /// buffer. Refused when every buffer holds a read not yet submitted.
    pub fn start(&mut self, from: u32, timeout: Duration) -> Result<usize> {
        if !self.has_room() {
            return Err(Error::Refused("every device buffer holds a read"));
        }
        let cuda = |e: tensorport_cuda::Error| Error::Cuda(e.to_string());
        let started = Instant::now();
        let gpu = self.gpu();
        let i = gpu.acquire(timeout).map_err(cuda)?;
        // The acquire queued the wait for the server's release on the stream; the read is not on
        // it, so wait here (at most what is left of `timeout`) until the server's last read of
        // the buffer is done.
        while !self.gpu().stream().is_idle().map_err(cuda)? {
            if started.elapsed() > timeout {
                self.stalled = true;
                return Err(Error::Cuda(format!(
                    "the server did not release device buffer {i} on the GPU within {} ms",
                    timeout.as_millis()
                )));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        if self.landing[i].is_some() {
            return Err(Error::Refused("the buffer acquired holds a read"));
        }
        self.reader().start(from, i as u32)?;
        self.landing[i] = Some(false);
        Ok(i)
    }

    /// Whether the read into buffer `i` has landed; a failed read is an error (and the buffer
    /// is free again, unsubmitted).
    pub fn poll(&mut self, i: usize) -> Result<bool> {
        match self.landing.get(i) {
            Some(Some(true)) => return Ok(true),
            Some(Some(false)) => {}
            _ => return Err(Error::Refused("no read into that buffer")),
        }
        match self.reader().poll(i as u32) {
            Ok(done) => {
                if done {
                    self.landing[i] = Some(true);
                }
                Ok(done)
            }
            Err(e) => {
                self.landing[i] = None;
                Err(e)
            }
        }
    }

    /// Waits at most `timeout` for the read into buffer `i`.
    pub fn wait(&mut self, i: usize, timeout: Duration) -> Result<()> {
        let peer = self.peer().name().to_owned();
        wait_for(&peer, timeout, || Ok(self.poll(i)?.then_some(())))
    }

    /// Submits buffer `i`, whose read has landed, as `spec` under request `id`.
    pub fn submit_as(&mut self, i: usize, spec: &TensorSpec, id: u64) -> Result<()> {
        if self.landing.get(i) != Some(&Some(true)) {
            return Err(Error::Refused("that buffer's read has not landed"));
        }
        self.landing[i] = None;
        self.gpu()
            .submit_as(i, spec, id)
            .map_err(|e| Error::Cuda(e.to_string()))
    }

    /// Ends the session with the server cleanly, once every read has landed or been given up.
    pub fn close(mut self) -> Result<()> {
        self.finish_reads();
        self.reader = None;
        match self.producer.take() {
            Some(p) if !self.stalled => p.close().map_err(|e| Error::Cuda(e.to_string())),
            p => {
                std::mem::forget(p);
                Err(Error::Cuda(
                    "the server never released a device buffer: its session is left open".into(),
                ))
            }
        }
    }

    /// Waits (a bounded time) for the reads in flight; the buffers of any that do not finish
    /// are never freed.
    fn finish_reads(&mut self) {
        let stuck = !self.reader().settle(DROP_WAIT).is_empty();
        if stuck || self.stalled {
            // The reader leaks its region (it cannot release a transfer in flight), and the
            // buffers stay allocated with it; or the producer's stream would wait for good.
            std::mem::forget(self.producer.take());
        }
    }
}

impl Drop for GpuReader {
    fn drop(&mut self) {
        if self.reader.is_some() {
            self.finish_reads();
        }
        self.reader = None;
        self.producer = None;
    }
}
