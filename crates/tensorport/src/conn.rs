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
/// Not fewer: when the control buffer is too small the message comes back with `MSG_CTRUNC`
/// (as it also does when the table is full, `EMFILE`), and the descriptors that were installed
/// must then be read out of the truncated buffer by hand ([`truncated_fds`]).
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
            // A stale header must never be read back as this read's (see `truncated_fds`).
            self.cmsg[..CMSG_HEADER].fill(0);
            let spare = self.buf.spare();
            let mut iov = [IoSliceMut::new(spare)];
            let mut unreadable = false;
            let (bytes, mut received, truncated) = match recvmsg::<()>(
                self.stream.as_raw_fd(),
                &mut iov,
                Some(&mut self.cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(msg) => {
                    let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
                    let mut received = Vec::new();
                    match msg.cmsgs() {
                        Ok(cmsgs) => {
                            for c in cmsgs {
                                if let ControlMessageOwned::ScmRights(fds) = c {
                                    received.extend(fds);
                                }
                            }
                        }
                        // nix will not walk a truncated control buffer, yet the kernel installed
                        // the descriptors that fit (or all it could before `EMFILE`) and wrote
                        // a well-formed header saying how many: they are read out by hand, to
                        // be owned and closed like any others.
                        Err(_) => unreadable = true,
                    }
                    (msg.bytes, received, truncated)
                }
                Err(nix::Error::EINTR) => continue,
                Err(nix::Error::ECONNRESET) => (0, Vec::new(), false),
                Err(e) => return Err(Error::sys("recvmsg")(e)),
            };
            if unreadable {
                received = truncated_fds(&self.cmsg);
            }
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

/// Bytes of a `cmsghdr` (`size_t` length, `int` level, `int` type) before its data, aligned as
/// `CMSG_LEN(0)` aligns it.
const CMSG_HEADER: usize = {
    let word = std::mem::size_of::<usize>();
    (word + 8).div_ceil(word) * word
};

/// The descriptors in the first `SCM_RIGHTS` header of a control buffer that came back with
/// `MSG_CTRUNC`. The kernel writes a complete header for the descriptors it did install (all that
/// fit, or all before `EMFILE`); the buffer's header was zeroed before the read, so a buffer the
/// kernel left alone yields none.
fn truncated_fds(cmsg: &[u8]) -> Vec<RawFd> {
    let word = std::mem::size_of::<usize>();
    if cmsg.len() < CMSG_HEADER {
        return Vec::new();
    }
    let len = usize::from_ne_bytes(cmsg[..word].try_into().unwrap_or_default());
    let level = i32::from_ne_bytes(cmsg[word..word + 4].try_into().unwrap_or_default());
    let kind = i32::from_ne_bytes(cmsg[word + 4..word + 8].try_into().unwrap_or_default());
    if level != nix::libc::SOL_SOCKET || kind != nix::libc::SCM_RIGHTS || len < CMSG_HEADER {
        return Vec::new();
    }
    let data = &cmsg[CMSG_HEADER..len.min(cmsg.len())];
    data.chunks_exact(4)
        .map(|c| RawFd::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .filter(|&fd| fd >= 0)
        .collect()
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
