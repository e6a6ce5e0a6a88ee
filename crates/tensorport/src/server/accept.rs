//! The acceptor thread and each connection's thread up to its role: credentials, `Hello`,
//! version, then a control session or a producer session (which this thread then serves until
//! the producer leaves).

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport_wire::{
    clip_message, decode_client, negotiate, ClientMsg, ErrorCode, Hello, Role, ServerMsg,
    MAX_FRAME_LEN,
};

use crate::conn::{peer_credentials, FrameReader, FrameWriter};
use crate::server::admission::open_session;
use crate::server::control::serve_control;
use crate::server::reader::{close_session, serve_producer};
use crate::server::shared::{Handshakes, Shared};

pub(crate) fn accept_loop(shared: Arc<Shared>, listener: UnixListener) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut last_warn: Option<Instant> = None;
    while !shared.stopping.load(Ordering::SeqCst) {
        let mut pfd = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        if let Ok(0) | Err(_) = poll(&mut pfd, PollTimeout::from(100u16)) {
            continue;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_write_timeout(Some(shared.config.write_timeout));
        // Connections in handshake count too, so a flood of idle connections is bounded; they
        // have places of their own (`Handshakes`), so they cannot take the producers'.
        let limit = shared
            .config
            .max_sessions
            .saturating_add(2 * Handshakes::PLACES as u32);
        // Handshake places first, then connection places: a silent or departed handshake makes
        // room before a newcomer is refused.
        let make_room = |sh: &Shared| match sh.handshakes.evict_one(&sh.connections) {
            Some(old) => {
                sh.counters
                    .connections_refused
                    .fetch_add(1, Ordering::Relaxed);
                // A client whose Hello was merely late is told to try again (it does); its
                // thread reads the end and leaves.
                refuse(
                    &old,
                    ErrorCode::HandshakeTimeout,
                    "closed before its Hello arrived, to make room for newer connections; try again"
                        .into(),
                );
                true
            }
            None => false,
        };
        if shared.handshakes.full() {
            make_room(&shared);
        }
        if shared.connections.load(Ordering::SeqCst) >= limit && !make_room(&shared) {
            shared
                .counters
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            // Once a second at most: a flood must not flood the log too.
            if last_warn.is_none_or(|t: Instant| t.elapsed() >= Duration::from_secs(1)) {
                tracing::warn!("refusing connections: {limit} connections open");
                last_warn = Some(Instant::now());
            }
            refuse(
                &stream,
                ErrorCode::TooManySessions,
                "too many connections".into(),
            );
            continue;
        }
        // In the handshake places from the moment it is counted, so that it can be made room
        // for even before its thread runs.
        let Ok(entry) = stream.try_clone() else {
            continue;
        };
        shared.connections.fetch_add(1, Ordering::SeqCst);
        let ticket = shared.handshakes.enter(entry);
        let sh = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("tensorport-session".into())
            .spawn(move || {
                if serve_connection(&sh, stream, ticket) == Counted::Yes {
                    sh.connections.fetch_sub(1, Ordering::SeqCst);
                }
            });
        if let Err(e) = spawned {
            if shared.handshakes.leave(ticket) {
                shared.connections.fetch_sub(1, Ordering::SeqCst);
            }
            tracing::error!("cannot spawn session thread: {e}");
        }
    }
}

fn refuse(stream: &UnixStream, code: ErrorCode, message: String) {
    if let Ok(s) = stream.try_clone() {
        let _ = s.set_write_timeout(Some(Duration::from_millis(200)));
        let mut w = FrameWriter::new(s);
        let _ = w.send(
            &ServerMsg::Error {
                code: code.as_u16(),
                request_id: None,
                fatal: true,
                message: clip_message(message),
            },
            &[],
        );
        w.shutdown();
    }
}

enum Handshake {
    Hello(Hello),
    Refused(ErrorCode, String),
    Gone,
}

fn read_hello(reader: &mut FrameReader, timeout: Duration) -> Handshake {
    let deadline = Instant::now() + timeout;
    loop {
        match reader.next_payload() {
            Ok(Some(p)) => {
                return match decode_client(p) {
                    Ok(ClientMsg::Hello(h)) => Handshake::Hello(h),
                    Ok(other) => Handshake::Refused(
                        ErrorCode::HandshakeRequired,
                        format!("first message must be Hello, got {}", other.name()),
                    ),
                    Err(e) => Handshake::Refused(e.code(), e.to_string()),
                };
            }
            Ok(None) => {}
            Err(e) => return Handshake::Refused(e.code(), e.to_string()),
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match reader.wait(Some(left)) {
            Ok(true) => {}
            Ok(false) => {
                return Handshake::Refused(
                    ErrorCode::HandshakeTimeout,
                    format!("no Hello within {timeout:?}"),
                )
            }
            Err(_) => return Handshake::Gone,
        }
        match reader.fill() {
            Ok(info) if info.bytes == 0 => return Handshake::Gone,
            Ok(info) if info.fds > 0 || info.truncated => {
                let n = reader.drop_fds();
                return Handshake::Refused(
                    ErrorCode::FdsNotExpected,
                    format!("{n} file descriptor(s) attached to the handshake, which carries none; closed them"),
                );
            }
            Ok(_) => {}
            Err(_) => return Handshake::Gone,
        }
    }
}

/// Whether a connection still counts among the server's connections when its thread ends.
#[derive(Debug, PartialEq, Eq)]
enum Counted {
    Yes,
    /// Closed in its handshake to make room, and uncounted then.
    No,
}

/// Serves one connection whose handshake place is `ticket`.
fn serve_connection(shared: &Arc<Shared>, stream: UnixStream, ticket: u64) -> Counted {
    // Ends the handshake: still counted, unless it was closed to make room meanwhile.
    let left = |sh: &Shared| {
        if sh.handshakes.leave(ticket) {
            Counted::Yes
        } else {
            Counted::No
        }
    };
    let creds = match peer_credentials(&stream) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("no peer credentials: {e}");
            return left(shared);
        }
    };
    let me = nix::unistd::geteuid().as_raw();
    if creds.uid() != me && !shared.config.allowed_uids.contains(&creds.uid()) {
        shared
            .counters
            .connections_refused
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            pid = creds.pid(),
            uid = creds.uid(),
            "refusing connection from another user"
        );
        refuse(
            &stream,
            ErrorCode::PermissionDenied,
            format!("uid {} may not use this server", creds.uid()),
        );
        return left(shared);
    }
    let Ok(wstream) = stream.try_clone() else {
        return left(shared);
    };
    let mut reader = FrameReader::new(stream, MAX_FRAME_LEN);
    let said = read_hello(&mut reader, shared.config.handshake_timeout);
    if left(shared) == Counted::No {
        return Counted::No;
    }
    let hello = match said {
        Handshake::Hello(h) => h,
        Handshake::Gone => return Counted::Yes,
        Handshake::Refused(code, message) => {
            shared
                .counters
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pid = creds.pid(), ?code, "handshake refused: {message}");
            refuse(reader.stream(), code, message);
            return Counted::Yes;
        }
    };
    let version = match negotiate(&hello) {
        Ok(v) => v,
        Err(e) => {
            shared
                .counters
                .connections_refused
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(pid = creds.pid(), "handshake refused: {e}");
            refuse(reader.stream(), e.code(), e.to_string());
            return Counted::Yes;
        }
    };
    match hello.role {
        Role::Control => {
            let writer = FrameWriter::new(wstream);
            serve_control(shared, reader, writer, version, &creds, &hello.name)
        }
        Role::Producer => {
            let session = match open_session(shared, &hello, creds.pid() as u32, version, wstream) {
                Ok(s) => s,
                Err((code, message)) => {
                    shared
                        .counters
                        .connections_refused
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pid = creds.pid(), ?code, "session refused: {message}");
                    refuse(reader.stream(), code, message);
                    return Counted::Yes;
                }
            };
            let clean = serve_producer(shared, &session, &mut reader);
            close_session(shared, &session, clean);
        }
    }
    Counted::Yes
}
