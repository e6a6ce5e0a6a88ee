//! A producer session's way out: nothing that answers one producer waits on that producer's
//! socket.
//!
//! [`Outbox::post`] writes a frame at once when the socket takes it (`MSG_DONTWAIT`) and queues
//! what it does not take; the session's own thread flushes the queue when the socket is
//! writable ([`Outbox::wait_readable`]). A producer that stops reading is dropped when its queue
//! passes its limit (by whichever thread posts) or makes no progress for the write timeout (by
//! its own thread) — the consumer, the acceptor and other sessions never block on it.
//!
//! The queue's lock is a leaf: it is taken last and nothing is locked while it is held.

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{sendmsg, MsgFlags};
use serde::Serialize;
use tensorport_wire::{encode_frame_into, WireError};

use crate::fast::Doorbell;
use crate::lock;
use crate::{Error, Result};

/// Why a session's output cannot go on; the session is to be dropped.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum OutputError {
    /// The producer does not read: this many bytes wait, over the limit.
    Full { queued: usize },
    /// The producer read nothing for this long while this many bytes waited.
    Stalled { queued: usize, waited: Duration },
    /// The socket is gone (`EPIPE`, `ECONNRESET`) or failed.
    Gone(String),
}

impl std::fmt::Display for OutputError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OutputError::Full { queued } => write!(
                f,
                "it does not read its socket ({queued} bytes of results and messages wait for it)"
            ),
            OutputError::Stalled { queued, waited } => write!(
                f,
                "it read nothing for {:.1} s ({queued} bytes wait for it)",
                waited.as_secs_f64()
            ),
            OutputError::Gone(why) => write!(f, "its socket is gone ({why})"),
        }
    }
}

/// What a post or flush came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wrote(pub bool);

struct Queue {
    /// Encoded frames not yet written: `bytes[head..]`.
    bytes: Vec<u8>,
    head: usize,
    /// When the queue last moved (or stopped being empty).
    since: Instant,
    /// Where a frame is encoded.
    scratch: Vec<u8>,
    closed: bool,
}

impl Queue {
    fn pending(&self) -> usize {
        self.bytes.len() - self.head
    }
}

/// One session's output: its socket, what waits to go into it, and the doorbell that tells the
/// session's thread there is something to flush.
pub(crate) struct Outbox {
    stream: UnixStream,
    bell: Doorbell,
    limit: usize,
    queue: Mutex<Queue>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("limit", &self.limit)
            .field("pending", &self.pending())
            .finish()
    }
}

impl Outbox {
    /// An outbox writing to `stream` (the session's socket, shared with its reader), holding at
    /// most `limit` bytes that the socket has not taken.
    pub(crate) fn new(stream: UnixStream, limit: usize) -> Result<Outbox> {
        Ok(Outbox {
            stream,
            bell: Doorbell::new()?,
            limit,
            queue: Mutex::new(Queue {
                bytes: Vec::new(),
                head: 0,
                since: Instant::now(),
                scratch: Vec::with_capacity(256),
                closed: false,
            }),
        })
    }

    /// Sends `msg` without waiting: written now as far as the socket takes it, the rest queued.
    /// An error means the session must be dropped (or is being dropped).
    pub(crate) fn post<T: Serialize>(&self, msg: &T) -> Result<Wrote> {
        let mut guard = lock(&self.queue);
        let q = &mut *guard;
        if q.closed {
            return Err(Error::SessionGone);
        }
        encode_frame_into(msg, &mut q.scratch).map_err(|e| match e {
            WireError::FrameTooLarge { len, .. } => Error::ResultTooLarge(len as usize),
            e => Error::Protocol(e),
        })?;
        // Older output first: what waits goes before this frame.
        let mut wrote = self.flush_queue(q).map_err(output_error)?;
        if q.pending() > 0 {
            if q.pending() + q.scratch.len() > self.limit {
                return Err(output_error(OutputError::Full {
                    queued: q.pending() + q.scratch.len(),
                }));
            }
            q.bytes.extend_from_slice(&q.scratch);
            return Ok(wrote);
        }
        let n = send_now(&self.stream, &q.scratch).map_err(output_error)?;
        wrote.0 |= n > 0;
        if n < q.scratch.len() {
            // The socket is full: the rest waits, and the session's thread is told to flush.
            std::mem::swap(&mut q.bytes, &mut q.scratch);
            q.head = n;
            q.since = Instant::now();
            drop(guard);
            self.bell.ring();
        }
        Ok(wrote)
    }

    /// Writes what the socket takes of the queue, without waiting.
    fn flush_queue(&self, q: &mut Queue) -> std::result::Result<Wrote, OutputError> {
        let mut wrote = false;
        while q.pending() > 0 {
            let n = send_now(&self.stream, &q.bytes[q.head..])?;
            if n == 0 {
                break;
            }
            wrote = true;
            q.head += n;
            q.since = Instant::now();
        }
        if q.pending() == 0 && q.head > 0 {
            q.bytes.clear();
            q.head = 0;
            // Give a large backlog's memory back once it is written.
            if q.bytes.capacity() > 64 << 10 {
                q.bytes.shrink_to(64 << 10);
            }
        }
        Ok(Wrote(wrote))
    }

    /// Bytes waiting for the socket.
    pub(crate) fn pending(&self) -> usize {
        lock(&self.queue).pending()
    }

    /// Waits until the socket has something to read (or was closed), writing queued output
    /// whenever the socket takes it. `on_write` is called after each write that moved bytes.
    /// Fails when the output must give up: nothing of it was read for `stall`.
    pub(crate) fn wait_readable(
        &self,
        stall: Duration,
        on_write: &dyn Fn(),
    ) -> std::result::Result<(), OutputError> {
        loop {
            let (pending, since) = {
                let q = lock(&self.queue);
                if q.closed {
                    return Ok(());
                }
                (q.pending(), q.since)
            };
            let (flags, timeout) = if pending > 0 {
                let waited = since.elapsed();
                if waited >= stall {
                    return Err(OutputError::Stalled {
                        queued: pending,
                        waited,
                    });
                }
                (PollFlags::POLLIN | PollFlags::POLLOUT, stall - waited)
            } else {
                (PollFlags::POLLIN, Duration::MAX)
            };
            let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
            let timeout = if pending > 0 {
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            } else {
                PollTimeout::NONE
            };
            let mut pfd = [
                PollFd::new(self.stream.as_fd(), flags),
                PollFd::new(self.bell.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut pfd, timeout) {
                Ok(_) => {}
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(OutputError::Gone(format!("poll: {e}"))),
            }
            let (sock, bell) = (pfd[0].revents(), pfd[1].revents());
            if bell.is_some_and(|r| !r.is_empty()) {
                self.bell.clear();
            }
            let sock = sock.unwrap_or(PollFlags::empty());
            if sock.contains(PollFlags::POLLOUT) {
                let mut q = lock(&self.queue);
                if self.flush_queue(&mut q)?.0 {
                    drop(q);
                    on_write();
                }
            }
            if sock.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR) {
                return Ok(());
            }
        }
    }

    /// Drops what waits and closes both directions of the socket: the producer and the
    /// session's own thread see the end.
    pub(crate) fn close(&self) {
        {
            let mut q = lock(&self.queue);
            q.closed = true;
            q.bytes = Vec::new();
            q.head = 0;
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.bell.ring();
    }
}

fn output_error(e: OutputError) -> Error {
    match e {
        OutputError::Gone(_) => Error::SessionGone,
        other => Error::PeerNotReading(other.to_string()),
    }
}

/// One non-blocking `sendmsg`: how many bytes the socket took (0 when it is full).
fn send_now(stream: &UnixStream, bytes: &[u8]) -> std::result::Result<usize, OutputError> {
    loop {
        match sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(bytes)],
            &[],
            MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
            None,
        ) {
            Ok(n) => return Ok(n),
            Err(nix::Error::EINTR) => continue,
            Err(nix::Error::EAGAIN) => return Ok(0),
            Err(e) => return Err(OutputError::Gone(e.desc().to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use tensorport_wire::{decode_server, FrameBuffer, ServerMsg, MAX_FRAME_LEN};

    fn msg(n: usize) -> ServerMsg {
        ServerMsg::Result {
            request_id: n as u64,
            outcome: tensorport_wire::Outcome::Ok(vec![(n % 251) as u8; n]),
        }
    }

    /// Reads every whole frame from `peer` until `want` messages came.
    fn read_all(peer: &mut UnixStream, want: usize) -> Vec<ServerMsg> {
        let mut buf = FrameBuffer::new(MAX_FRAME_LEN);
        let mut out = Vec::new();
        while out.len() < want {
            let spare = buf.spare();
            let n = peer.read(spare).unwrap();
            assert!(n > 0, "closed after {} messages", out.len());
            buf.commit(n);
            while let Some(p) = buf.next_frame().unwrap() {
                out.push(decode_server(p).unwrap());
            }
        }
        out
    }

    #[test]
    fn posts_never_wait_and_arrive_in_order() {
        let (a, mut peer) = UnixStream::pair().unwrap();
        let ob = Outbox::new(a, 8 << 20).unwrap();
        // Far more than a socket buffer holds, posted while nobody reads: nothing blocks.
        let sizes: Vec<usize> = (0..40).map(|i| 50_000 + i * 1000).collect();
        for &n in &sizes {
            ob.post(&msg(n)).unwrap();
        }
        assert!(ob.pending() > 0, "the socket took everything?");
        let reader = std::thread::spawn(move || read_all(&mut peer, 40));
        // The session's thread flushes as the peer reads; it returns only on input or close.
        while ob.pending() > 0 {
            let _ = ob.wait_readable(Duration::from_secs(600), &|| {});
        }
        let got = reader.join().unwrap();
        let want: Vec<ServerMsg> = sizes.iter().map(|&n| msg(n)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_peer_that_does_not_read_fills_its_limit_and_is_refused() {
        let (a, _peer) = UnixStream::pair().unwrap();
        let ob = Outbox::new(a, 1 << 20).unwrap();
        let mut posted = 0usize;
        let err = loop {
            match ob.post(&msg(100_000)) {
                Ok(_) => posted += 1,
                Err(e) => break e,
            }
            assert!(posted < 1000, "the limit never held");
        };
        assert!(matches!(err, Error::PeerNotReading(_)), "{err}");
        assert!(ob.pending() <= 1 << 20);
    }

    #[test]
    fn output_nobody_reads_stalls_after_the_timeout() {
        let (a, _peer) = UnixStream::pair().unwrap();
        let ob = Outbox::new(a, 64 << 20).unwrap();
        while ob.pending() == 0 {
            ob.post(&msg(100_000)).unwrap();
        }
        match ob.wait_readable(Duration::from_millis(1), &|| {}) {
            Err(OutputError::Stalled { queued, .. }) => assert!(queued > 0),
            other => panic!("expected a stall, got {other:?}"),
        }
    }

    #[test]
    fn close_refuses_later_posts_and_ends_the_peer() {
        let (a, mut peer) = UnixStream::pair().unwrap();
        let ob = Outbox::new(a, 1 << 20).unwrap();
        ob.post(&msg(10)).unwrap();
        ob.close();
        assert!(matches!(ob.post(&msg(10)), Err(Error::SessionGone)));
        assert_eq!(ob.wait_readable(Duration::from_secs(1), &|| {}), Ok(()));
        let mut rest = Vec::new();
        peer.read_to_end(&mut rest).unwrap();
        assert!(!rest.is_empty(), "what was sent before the close arrives");
    }

    #[test]
    fn a_gone_peer_is_an_error_not_a_signal() {
        let (a, peer) = UnixStream::pair().unwrap();
        drop(peer);
        let ob = Outbox::new(a, 1 << 20).unwrap();
        assert!(matches!(ob.post(&msg(10)), Err(Error::SessionGone)));
    }
}
