//! A control session's thread (`tensorport ctl`): status and drain, answered in turn. Drain is
//! the operator's: producers are refused it (see `reader.rs`).

use std::sync::Arc;

use tensorport_wire::{
    clip_message, decode_client, ClientMsg, ErrorCode, PoolLayout, ServerMsg, Welcome,
};

use crate::conn::{FrameReader, FrameWriter};
use crate::server::shared::Shared;

pub(crate) fn serve_control(
    shared: &Arc<Shared>,
    mut reader: FrameReader,
    mut writer: FrameWriter,
    version: u16,
    creds: &nix::sys::socket::UnixCredentials,
    name: &str,
) {
    let welcome = ServerMsg::Welcome(Welcome {
        version,
        session_id: 0,
        pool: PoolLayout {
            slot_count: 0,
            slot_size: 0,
            pool_len: 0,
        },
        max_in_flight: 0,
        fds: 0,
    });
    if writer.send(&welcome, &[]).is_err() {
        return;
    }
    loop {
        let msg = match reader.next_payload() {
            Ok(Some(p)) => decode_client(p),
            Ok(None) => match reader.fill() {
                Ok(info) if info.bytes > 0 && info.fds == 0 => continue,
                _ => return,
            },
            Err(_) => return,
        };
        let reply = match msg {
            Ok(ClientMsg::Status) => ServerMsg::Status(shared.status()),
            Ok(ClientMsg::Drain) => {
                tracing::info!(
                    pid = creds.pid(),
                    uid = creds.uid(),
                    client = name,
                    "drain asked by a control session"
                );
                shared.drain();
                ServerMsg::Draining
            }
            Ok(ClientMsg::Goodbye) => return,
            Ok(other) => ServerMsg::Error {
                code: ErrorCode::Unsupported.as_u16(),
                request_id: None,
                fatal: false,
                message: format!("{} is not for control sessions", other.name()),
            },
            Err(e) => ServerMsg::Error {
                code: e.code().as_u16(),
                request_id: None,
                fatal: true,
                message: clip_message(e.to_string()),
            },
        };
        let fatal = matches!(reply, ServerMsg::Error { fatal: true, .. });
        if writer.send(&reply, &[]).is_err() || fatal {
            return;
        }
    }
}
