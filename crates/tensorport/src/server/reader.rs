//! A producer session's own thread, after the handshake: reads its messages (socket
//! submissions, returns, device registrations, status), writes the output its socket did not
//! take at once, and reclaims the session when the producer leaves or is dropped.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tensorport_wire::{ClientMsg, ErrorCode, RawDeviceHandle, ServerMsg, WireError};

use crate::conn::FrameReader;
use crate::lock;
use crate::server::admission::{admit, register_device};
use crate::server::session::Session;
use crate::server::shared::Shared;

/// The most descriptors one client message carries (`RegisterDevice` with a VMM handle).
const MAX_FDS_PER_MESSAGE: usize = 1;

/// Reads a producer's messages until it leaves. Returns whether it left cleanly (`Goodbye`).
pub(crate) fn serve_producer(
    shared: &Arc<Shared>,
    session: &Arc<Session>,
    reader: &mut FrameReader,
) -> bool {
    let mut truncated = false;
    loop {
        loop {
            let msg = match reader.next_payload() {
                Ok(Some(p)) => tensorport_wire::decode_client_naming(p),
                Ok(None) => break,
                Err(e) => {
                    fatal(session, e);
                    return false;
                }
            };
            let msg = match msg {
                Ok(m) => m,
                Err((e, _)) if e.is_fatal() => {
                    fatal(session, e);
                    return false;
                }
                // A Submit refused for its sizes (rank over 8, say) names its request.
                Err((e, request_id)) => {
                    session.refuse(e.code(), request_id, e.to_string());
                    continue;
                }
            };
            match msg {
                ClientMsg::Submit { request_id, tensor } => {
                    match admit(shared, session, request_id, &tensor.view()) {
                        Ok(req) => {
                            // The receiver lives as long as the Server; if it is being dropped,
                            // the request is dropped too (and released).
                            let shard = &shared.shards[session.shard];
                            let _ = shard.tx.send(req);
                            shard.wake_consumer();
                        }
                        Err((code, message)) => session.refuse(code, Some(request_id), message),
                    }
                }
                ClientMsg::Return(s) => {
                    let r = lock(&session.state).slots.give_back(s.slot, s.generation);
                    if let Err(e) = r {
                        session.refuse(ErrorCode::SlotNotLeased, None, e.to_string());
                    }
                }
                ClientMsg::Status => {
                    let _ = session.post(&ServerMsg::Status(shared.status()));
                }
                // Draining is the operator's (a control session: `tensorport ctl drain`), not
                // any producer's: one producer could otherwise stop everyone's work.
                ClientMsg::Drain => {
                    tracing::warn!(
                        session = session.id,
                        "refused Drain from a producer session"
                    );
                    session.refuse(
                        ErrorCode::PermissionDenied,
                        None,
                        "Drain is for control sessions (`tensorport ctl drain`), not producers"
                            .into(),
                    );
                }
                ClientMsg::Goodbye => return true,
                ClientMsg::RegisterDevice {
                    buffer,
                    len,
                    handle,
                } => {
                    // A VMM handle is the one message that carries a descriptor.
                    let fd = match handle {
                        RawDeviceHandle::VmmPosixFd => reader.take_fd(),
                        _ => None,
                    };
                    if let Err((code, message)) =
                        register_device(shared, session, buffer, len, &handle, fd)
                    {
                        session.refuse(code, None, message);
                    }
                }
                ClientMsg::Hello(_) => session.refuse(
                    ErrorCode::HandshakeRequired,
                    None,
                    "Hello sent twice".into(),
                ),
            }
        }
        // Descriptors no message claimed are closed and refused — unless the frame they came
        // with is still arriving (they travel with its first bytes).
        // A frame still arriving carries at most one descriptor: more, held for a message that
        // may never come, would let one peer fill the server's descriptor table, so the session
        // ends and they are closed with it. So does a frame whose descriptors the kernel cut
        // short (the table was full): what it carried is lost, and a session sending such
        // frames while the table is full would otherwise wait for the rest unnoticed.
        if reader.pending() > 0 && (reader.fds_waiting() > MAX_FDS_PER_MESSAGE || truncated) {
            let n = reader.drop_fds();
            let message = if truncated {
                format!(
                    "file descriptor(s) sent with an unfinished frame did not fit the server's \
                     descriptor table ({n} arrived); closed them and the session"
                )
            } else {
                format!(
                    "{n} file descriptor(s) sent with an unfinished frame, which carries at most \
                     {MAX_FDS_PER_MESSAGE}; closed them and the session"
                )
            };
            session.close_with(ErrorCode::FdsNotExpected, message);
            return false;
        }
        if reader.pending() == 0 && (reader.fds_waiting() > 0 || truncated) {
            let n = reader.drop_fds();
            truncated = false;
            session.refuse(
                ErrorCode::FdsNotExpected,
                None,
                format!(
                    "{n} file descriptor(s) attached to a message that carries none; closed them"
                ),
            );
        }
        if !session.is_alive() || shared.stopping.load(Ordering::SeqCst) {
            return false;
        }
        // Output the socket did not take is written while waiting for input; a producer that
        // reads none of it for the write timeout is dropped.
        if let Err(e) = session
            .outbox
            .wait_readable(shared.config.write_timeout, &|| session.note_socket_write())
        {
            tracing::warn!(session = session.id, producer = %session.name, "dropping session: {e}");
            session.kill();
            return false;
        }
        match reader.fill() {
            Ok(info) if info.bytes == 0 => return false,
            Ok(info) => truncated |= info.truncated,
            Err(e) => {
                tracing::debug!(session = session.id, "read failed: {e}");
                return false;
            }
        }
    }
}

fn fatal(session: &Session, e: WireError) {
    session.close_with(e.code(), e.to_string());
}

pub(crate) fn close_session(shared: &Shared, session: &Arc<Session>, clean: bool) {
    let was_alive = session.alive.swap(false, Ordering::SeqCst);
    // Counted before the socket closes and the session leaves the table, so whoever sees either
    // also sees the count.
    if !clean {
        shared
            .counters
            .sessions_reclaimed
            .fetch_add(1, Ordering::SeqCst);
    }
    let shard = &shared.shards[session.shard];
    {
        // The place is given back under the table's lock: whoever sees the session gone (a
        // status report) also finds its place free (a newcomer is not refused meanwhile).
        let mut sessions = lock(&shared.sessions);
        if sessions.remove(&session.id).is_some() {
            shared.producers.fetch_sub(1, Ordering::SeqCst);
            shard.sessions.fetch_sub(1, Ordering::SeqCst);
        }
    }
    if let Some(r) = &session.ring {
        let _ = shard.epoll.delete(&r.to_server);
        shard.ring_generation.fetch_add(1, Ordering::SeqCst);
    }
    session.outbox.close();
    // Nobody signals this producer's device fences any more: waits still pending on them are
    // let through (outside the lock: that takes driver calls).
    let devices: Vec<_> = lock(&session.state)
        .devices
        .values()
        .map(|d| d.imported.clone())
        .collect();
    for d in devices {
        d.abandon();
    }
    let st = session.status();
    if clean {
        tracing::info!(session = session.id, producer = %session.name, "producer left");
    } else {
        tracing::warn!(
            session = session.id,
            producer = %session.name,
            pid = session.pid,
            granted = st.granted,
            in_flight = st.in_flight,
            killed_by_server = !was_alive,
            "producer gone; reclaiming its pool and slots"
        );
    }
}
