//! What producer and control clients share: connecting and the handshake.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::{Duration, Instant};

use tensorport_wire::{
    decode_server, ClientMsg, ErrorCode, Hello, Role, ServerMsg, Welcome, MAGIC, MAX_FRAME_LEN,
    MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};

use crate::conn::{FrameReader, FrameWriter};
use crate::{path, ConnectError, Error, Result};

/// A connected, greeted client.
pub(crate) struct Connected {
    pub reader: FrameReader,
    pub writer: FrameWriter,
    pub welcome: Welcome,
    /// The descriptors `Welcome` carried, in order (pool; then queues and doorbells).
    pub fds: Vec<OwnedFd>,
}

/// Reads the next message, waiting until `deadline` (`None`: forever). `Ok(None)` on timeout;
/// [`Error::ServerGone`] when the server closed the connection.
pub(crate) fn next_msg(
    reader: &mut FrameReader,
    deadline: Option<Instant>,
) -> Result<Option<ServerMsg>> {
    loop {
        if let Some(p) = reader.next_payload()? {
            return Ok(Some(decode_server(p)?));
        }
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if !reader.wait(left)? {
            return Ok(None);
        }
        let info = reader.fill()?;
        if info.bytes == 0 {
            return Err(Error::ServerGone);
        }
    }
}

/// Connects to `socket`, sends `Hello`, and waits (at most `timeout`) for `Welcome`. A server
/// that closed the handshake before the Hello arrived (under a flood of connections it makes
/// room by closing the oldest silent ones) is tried again until `timeout`.
pub(crate) fn connect(
    socket: &Path,
    role: Role,
    name: &str,
    want_slots: u32,
    want_slot_size: u64,
    max_version: u16,
    timeout: Duration,
) -> std::result::Result<Connected, ConnectError> {
    let mut name = name.to_owned();
    name.truncate(tensorport_wire::MAX_NAME_LEN);
    while !name.is_char_boundary(name.len()) {
        name.pop();
    }
    let hello = ClientMsg::Hello(Hello {
        magic: MAGIC,
        min_version: MIN_PROTOCOL_VERSION,
        max_version: max_version.clamp(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION),
        role,
        name,
        want_slots,
        want_slot_size,
    });
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match connect_once(socket, &hello, left) {
            Err(ConnectError::Refused {
                code: ErrorCode::HandshakeTimeout,
                ..
            }) if Instant::now() + pause < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            r => return r,
        }
    }
}

/// One try of [`connect`]: sends `hello`, waits at most `timeout` for `Welcome`.
fn connect_once(
    socket: &Path,
    hello: &ClientMsg,
    timeout: Duration,
) -> std::result::Result<Connected, ConnectError> {
    let stream = path::connect(socket)?;
    // The server must be us (or root): a process of another user listening on the path gets
    // nothing, not even the Hello.
    let server = crate::conn::peer_credentials(&stream).map_err(ConnectError::failed)?;
    let me = nix::unistd::geteuid().as_raw();
    if server.uid() != me && server.uid() != 0 {
        return Err(ConnectError::UntrustedServer {
            path: socket.to_owned(),
            uid: server.uid(),
        });
    }
    let wstream = stream
        .try_clone()
        .map_err(Error::io("clone socket"))
        .map_err(ConnectError::failed)?;
    let mut writer = FrameWriter::new(wstream);
    let mut reader = FrameReader::new(stream, MAX_FRAME_LEN);
    let sent = writer.send(hello, &[]);
    let deadline = Instant::now() + timeout;
    // A server that refuses at once (uid, limits) may close before our Hello is written: its
    // error frame is still readable, and says more than EPIPE.
    let answer = match (sent, next_msg(&mut reader, Some(deadline))) {
        (_, Ok(Some(m))) => Some(m),
        (Err(e), _) => return Err(ConnectError::failed(e)),
        (Ok(()), r) => r.map_err(ConnectError::failed)?,
    };
    match answer {
        Some(ServerMsg::Welcome(welcome)) => {
            let mut fds = Vec::with_capacity(welcome.fds as usize);
            for _ in 0..welcome.fds {
                match reader.take_fd() {
                    Some(fd) => fds.push(fd),
                    None => return Err(ConnectError::Refused {
                        code: ErrorCode::Malformed,
                        message: format!("Welcome announced {} file descriptors but {} arrived (were they dropped at the fd limit? check `ulimit -n`)", welcome.fds, fds.len()),
                    }),
                }
            }
            Ok(Connected {
                reader,
                writer,
                welcome,
                fds,
            })
        }
        Some(ServerMsg::Error { code, message, .. }) => Err(ConnectError::Refused {
            code: ErrorCode::from_u16(code),
            message,
        }),
        Some(_) => Err(ConnectError::Refused {
            code: ErrorCode::Malformed,
            message: "the server's first message was not Welcome".into(),
        }),
        None => Err(ConnectError::Timeout(timeout)),
    }
}
