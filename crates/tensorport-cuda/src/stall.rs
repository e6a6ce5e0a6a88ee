//! Producers that never signal. A timeline-fenced tensor's wait (`cuStreamWaitValue64`) has no
//! timeout: a producer that submits a value it never writes (a bug, a hostile peer, or one
//! killed before its GPU got there) would stall the server's stream for good, and every other
//! producer's tensor behind the wait with it. The server gets out two ways:
//!
//! - [`Gatherer::synchronize`] waits for a stream at most a fence timeout; a tensor whose
//!   "ready" semaphore is still short of its value then is let through (the server writes the
//!   awaited value into it from a side stream, which no wait blocks) and reported, so that its
//!   request is failed and its producer's session ended
//!   (`tensorport::Request::fail_and_end_session` with `ErrorCode::FenceTimeout`).
//! - When a session ends, the server abandons its buffers (`ImportedDevice::abandon`): a wait
//!   still pending on one is let through at once, and later ones are not enqueued.
//!
//! A tensor let through holds whatever its buffer held: its request is never answered with a
//! result. Event-fenced buffers (legacy IPC events) cannot be signalled from another process,
//! so a stream is never made to wait on one that has not fired: its "ready" event is polled
//! from the host first (for the importer's fence timeout), and a tensor whose event has not
//! fired by then is not waited for and is reported late like a timeline let through.

use std::time::{Duration, Instant};

use tensorport::DeviceTensor;

use crate::ipc::{take_event_late, timeline};
use crate::{Error, Gatherer, Result, Stream};

/// How long a server waits by default for a producer's "ready" fence before it lets the wait
/// through and ends the producer's session: far beyond any honest producer's GPU work between
/// its submit and its signal, short enough that the other producers recover.
pub const DEFAULT_FENCE_TIMEOUT: Duration = Duration::from_secs(10);

/// Polling the stream: with a yield between looks for this long, then with short sleeps.
const SPIN: Duration = Duration::from_millis(2);
const NAP: Duration = Duration::from_micros(50);

impl Gatherer {
    /// Waits until `stream` has run its work, as [`Stream::synchronize`] does, but lets no
    /// producer stall it: if the stream has not run by `timeout`, every timeline-fenced tensor
    /// of `tensors` whose producer has not yet signalled it ready is let through (see the
    /// module's notes), and the stream is given another `timeout`. Returns the indices in
    /// `tensors` of those let through: their bytes are not the producer's tensor; fail their
    /// requests and end their sessions (`Request::fail_and_end_session`).
    ///
    /// `tensors` must name every device tensor the stream was made to wait for since it last
    /// ran dry (a batch's). Fails with [`Error::Stalled`] if the stream still has not run after
    /// the second `timeout` (it waits on an event fence, or on a tensor not passed here).
    pub fn synchronize(
        &self,
        stream: &Stream,
        tensors: &[&DeviceTensor],
        timeout: Duration,
    ) -> Result<Vec<usize>> {
        self.check_stream(stream)?;
        // Event-fenced tensors not signalled in time were never waited for: late already.
        let skipped: Vec<usize> = (0..tensors.len())
            .filter(|&i| take_event_late(tensors[i], &self.gpu))
            .collect();
        let start = Instant::now();
        let mut deadline = start + timeout;
        let mut let_through: Option<Vec<usize>> = None;
        loop {
            if stream.is_idle()? {
                let mut late = let_through.unwrap_or_default();
                late.extend(skipped);
                late.sort_unstable();
                late.dedup();
                return Ok(late);
            }
            let now = Instant::now();
            if now >= deadline {
                if let_through.is_some() {
                    return Err(Error::Stalled(now - start));
                }
                let_through = Some(self.let_late_through(tensors)?);
                deadline = now + timeout;
                continue;
            }
            if now - start < SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(NAP);
            }
        }
    }

    /// Lets through every timeline-fenced tensor of `tensors` whose "ready" semaphore is short
    /// of its value; returns their indices.
    fn let_late_through(&self, tensors: &[&DeviceTensor]) -> Result<Vec<usize>> {
        let side = Stream::new(&self.gpu)?;
        let mut late = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            if let Some((imp, v)) = timeline(t, &self.gpu) {
                let now = imp.ready_value(&side)?;
                if now < v {
                    tracing::warn!(
                        ready = now,
                        awaited = v,
                        "a producer's device tensor was not signalled ready in time: letting its wait through"
                    );
                    imp.signal_ready(&side, v)?;
                    late.push(i);
                }
            }
        }
        side.synchronize()?;
        Ok(late)
    }
}

/// Keeps `held` until the process ends. What a stream that never drained may still read or
/// write — a batch's destination memory, the requests whose buffers it copies — must never be
/// freed, reused or released: it is held here instead (and the error that led here says so).
pub fn quarantine(held: impl Send + 'static) {
    static HELD: std::sync::Mutex<Vec<Box<dyn Send>>> = std::sync::Mutex::new(Vec::new());
    tracing::error!(
        "a GPU stream did not drain: its batch's memory is held until the process ends"
    );
    HELD.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Box::new(held));
}
