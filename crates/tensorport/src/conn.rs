//! Framed messages over a Unix stream socket, with file descriptors passed by `SCM_RIGHTS`.
//!
//! Every read is a `recvmsg` with room for as many descriptors as one message can carry, so
//! every descriptor a peer attaches is received, owned, and closed unless a message adopts it;
//! `MSG_CTRUNC` is still noticed. Every write is a
//! `sendmsg` with `MSG_NOSIGNAL`, so a dead peer is an `EPIPE` error, never a `SIGPIPE`.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{
    getsockopt, recvmsg, sendmsg, sockopt, ControlMessage, ControlMessageOwned, MsgFlags,
    UnixCredentials,
};
use serde::Serialize;
use tensorport_wire::{encode_frame_into, FrameBuffer, WireError};

use crate::{Error, Result};

/// Room for descriptors in one read: Linux's `SCM_MAX_FD`, the most one `sendmsg` can attach.
///
/// Not fewer: when the control buffer is too small the message comes back with `MSG_CTRUNC`, and
/// then the descriptors that did fit are installed in our table but cannot be read out of the
/// truncated buffer (nix refuses to iterate it), so each such message leaked them — a peer
/// sending five descriptors at a time could exhaust the server's table (`EMFILE`).
pub(crate) const MAX_FDS_PER_READ: usize = 253;

/// Sends frames. Cheap to put behind a mutex: one buffer, reused.
#[derive(Debug)]
pub(crate) struct FrameWriter {
    stream: UnixStream,
    buf: Vec<u8>,
}

impl FrameWriter {
    pub(crate) fn new(stream: UnixStream) -> FrameWriter {
        FrameWriter {
            stream,
            buf: Vec::with_capacity(256),
        }
    }

    /// Encodes and sends `msg`, attaching `fds` to its first byte.
    pub(crate) fn send<T: Serialize>(&mut self, msg: &T, fds: &[BorrowedFd<'_>]) -> Result<()> {
        let mut buf = std::mem::take(&mut self.buf);
        let r = encode_frame_into(msg, &mut buf)
            .map_err(|e| match e {
                WireError::FrameTooLarge { len, .. } => Error::ResultTooLarge(len as usize),
                e => Error::Protocol(e),
            })
            .and_then(|()| send_all(&self.stream, &buf, fds));
        self.buf = buf;
        r
    }

    /// Closes both directions; the peer's reads see EOF.
    pub(crate) fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

fn send_all(stream: &UnixStream, mut bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let mut first = true;
    while !bytes.is_empty() {
        let cmsg = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage<'_>] = if first && !raw.is_empty() { &cmsg } else { &[] };
        match sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(bytes)],
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => {
                bytes = &bytes[n..];
                first = false;
            }
            Err(nix::Error::EINTR) => continue,
            Err(nix::Error::EPIPE) | Err(nix::Error::ECONNRESET) => return Err(Error::ServerGone),
            Err(nix::Error::EAGAIN) => {
                return Err(Error::Timeout(
                    stream.write_timeout().ok().flatten().unwrap_or_default(),
                    "the peer to read (its socket buffer is full)",
                ))
            }
            Err(e) => return Err(Error::sys("sendmsg")(e)),
        }
    }
    Ok(())
}

/// What one read brought.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReadInfo {
    /// Bytes read; 0 means the peer closed.
    pub bytes: usize,
    /// Descriptors received with them.
    pub fds: usize,
    /// The kernel had to drop descriptors (more than we had room for).
    pub truncated: bool,
}

/// Receives frames and the descriptors attached to them.
#[derive(Debug)]
pub(crate) struct FrameReader {
    stream: UnixStream,
    buf: FrameBuffer,
    fds: VecDeque<OwnedFd>,
    /// Room for one read's control message (about 1 KiB), made once and reused by every read.
    cmsg: Vec<u8>,
}

impl FrameReader {
    pub(crate) fn new(stream: UnixStream, max_frame: u32) -> FrameReader {
        FrameReader {
            stream,
            buf: FrameBuffer::new(max_frame),
            fds: VecDeque::new(),
            cmsg: nix::cmsg_space!([RawFd; MAX_FDS_PER_READ]),
        }
    }

    /// Waits until the socket is readable or `timeout` passes (`None`: forever). Returns whether
    /// it is readable (or closed: a read will then say so).
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = match deadline {
                None => PollTimeout::NONE,
                Some(d) => {
                    let ms = d.saturating_duration_since(Instant::now()).as_millis();
                    PollTimeout::try_from(ms.min(i32::MAX as u128) as i32)
                        .unwrap_or(PollTimeout::MAX)
                }
            };
            let mut pfd = [PollFd::new(self.stream.as_fd(), PollFlags::POLLIN)];
            match poll(&mut pfd, left) {
                Ok(0) => return Ok(false),
                Ok(_) => return Ok(true),
                Err(nix::Error::EINTR) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Ok(false);
                    }
                }
                Err(e) => return Err(Error::sys("poll")(e)),
            }
        }
    }

    /// One `recvmsg` into the frame buffer. Blocks if nothing is there.
    pub(crate) fn fill(&mut self) -> Result<ReadInfo> {
        loop {
            let spare = self.buf.spare();
            let mut iov = [IoSliceMut::new(spare)];
            let (bytes, received, truncated) = match recvmsg::<()>(
                self.stream.as_raw_fd(),
                &mut iov,
                Some(&mut self.cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(msg) => {
                    let mut received = Vec::new();
                    match msg.cmsgs() {
                        Ok(cmsgs) => {
                            for c in cmsgs {
                                if let ControlMessageOwned::ScmRights(fds) = c {
                                    received.extend(fds);
                                }
                            }
                        }
                        // Only a control message over SCM_MAX_FD descriptors, which the kernel
                        // does not send: reported as truncated below.
                        Err(e) => tracing::warn!("unreadable control message: {e}"),
                    }
                    (
                        msg.bytes,
                        received,
                        msg.flags.contains(MsgFlags::MSG_CTRUNC),
                    )
                }
                Err(nix::Error::EINTR) => continue,
                Err(nix::Error::ECONNRESET) => (0, Vec::new(), false),
                Err(e) => return Err(Error::sys("recvmsg")(e)),
            };
            let nfds = received.len();
            self.fds.extend(received.into_iter().map(adopt_fd));
            self.buf.commit(bytes);
            return Ok(ReadInfo {
                bytes,
                fds: nfds,
                truncated,
            });
        }
    }

    /// The next complete frame payload in the buffer, if any.
    pub(crate) fn next_payload(&mut self) -> std::result::Result<Option<&[u8]>, WireError> {
        self.buf.next_frame()
    }

    /// Bytes received that are not yet part of a returned frame.
    pub(crate) fn pending(&self) -> usize {
        self.buf.pending()
    }

    /// Descriptors received and not yet taken.
    pub(crate) fn fds_waiting(&self) -> usize {
        self.fds.len()
    }

    /// Takes the oldest received descriptor.
    pub(crate) fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fds.pop_front()
    }

    /// Closes every received descriptor not yet taken; returns how many.
    pub(crate) fn drop_fds(&mut self) -> usize {
        let n = self.fds.len();
        self.fds.clear();
        n
    }

    pub(crate) fn stream(&self) -> &UnixStream {
        &self.stream
    }
}

/// Takes ownership of a descriptor the kernel just installed for us.
fn adopt_fd(fd: RawFd) -> OwnedFd {
    // SAFETY: `fd` was returned in an SCM_RIGHTS control message by recvmsg: the kernel installed
    // it in this process's table for us alone, and nothing else owns or closes it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// The peer's pid, uid and gid, from `SO_PEERCRED`.
pub(crate) fn peer_credentials(stream: &UnixStream) -> Result<UnixCredentials> {
    getsockopt(stream, sockopt::PeerCredentials).map_err(Error::sys("getsockopt(SO_PEERCRED)"))
}
