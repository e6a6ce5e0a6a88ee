//! The control client: status and drain of a running server.

use std::path::Path;
use std::time::{Duration, Instant};

use tensorport_wire::{ClientMsg, ErrorCode, Role, ServerMsg, StatusReport};

use crate::client::{self, next_msg};
use crate::conn::{FrameReader, FrameWriter};
use crate::{Error, Result};

/// A control session: no pool, only status and drain.
pub struct Control {
    reader: FrameReader,
    writer: FrameWriter,
    timeout: Duration,
}

impl std::fmt::Debug for Control {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Control")
    }
}

impl Control {
    /// Connects as a control client; each call waits at most `timeout`.
    pub fn connect(socket: impl AsRef<Path>, timeout: Duration) -> Result<Control> {
        let c = client::connect(
            socket.as_ref(),
            Role::Control,
            "tensorport-ctl",
            0,
            0,
            tensorport_wire::PROTOCOL_VERSION,
            timeout,
        )?;
        Ok(Control {
            reader: c.reader,
            writer: c.writer,
            timeout,
        })
    }

    fn ask(&mut self, msg: &ClientMsg) -> Result<ServerMsg> {
        self.writer.send(msg, &[])?;
        let deadline = Instant::now() + self.timeout;
        match next_msg(&mut self.reader, Some(deadline))? {
            Some(ServerMsg::Error { code, message, .. }) => Err(Error::Refused {
                code: ErrorCode::from_u16(code),
                message,
            }),
            Some(m) => Ok(m),
            None => Err(Error::Timeout(self.timeout, "the server's answer")),
        }
    }

    /// The server's status.
    pub fn status(&mut self) -> Result<StatusReport> {
        match self.ask(&ClientMsg::Status)? {
            ServerMsg::Status(s) => Ok(s),
            _ => Err(Error::Refused {
                code: ErrorCode::Malformed,
                message: "unexpected answer to Status".into(),
            }),
        }
    }

    /// Tells the server to drain: finish what is in flight, refuse new producers, then exit.
    pub fn drain(&mut self) -> Result<()> {
        match self.ask(&ClientMsg::Drain)? {
            ServerMsg::Draining => Ok(()),
            _ => Err(Error::Refused {
                code: ErrorCode::Malformed,
                message: "unexpected answer to Drain".into(),
            }),
        }
    }
}
