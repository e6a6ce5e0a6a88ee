//! An async face for the server (feature `tokio`): its requests as a [`Stream`].
//!
//! A dedicated thread waits on the server and forwards requests into a bounded tokio channel, so
//! async code never blocks on the socket. Batch them with `futures::StreamExt::ready_chunks` and
//! run the model under `tokio::task::spawn_blocking`:
//!
//! ```no_run
//! # async fn f(server: tensorport::Server) {
//! use futures::StreamExt;
//! let mut batches = tensorport::stream::RequestStream::new(server, 64).ready_chunks(32);
//! while let Some(batch) = batches.next().await {
//!     let answers = tokio::task::spawn_blocking(move || {
//!         for req in batch { let _ = req.respond(b"ok"); }
//!     }).await;
//! }
//! # }
//! ```

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_core::Stream;
use tokio::sync::mpsc;

use crate::{Request, Server};

/// A server's requests as a [`Stream`]; ends when the server has drained and stopped.
pub struct RequestStream {
    rx: mpsc::Receiver<Request>,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for RequestStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RequestStream")
    }
}

impl RequestStream {
    /// Moves `server` to a forwarding thread; at most `buffer` requests wait in the stream.
    /// Dropping the stream stops the thread and, with it, the server.
    pub fn new(server: Server, buffer: usize) -> RequestStream {
        let (tx, rx) = mpsc::channel(buffer.max(1));
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        std::thread::Builder::new()
            .name("tensorport-stream".into())
            .spawn(move || {
                while !st.load(Ordering::SeqCst) {
                    match server.recv_timeout(Duration::from_millis(100)) {
                        Ok(Some(req)) => {
                            if tx.blocking_send(req).is_err() {
                                break;
                            }
                        }
                        Ok(None) => {}
                        Err(crate::Stopped) => break,
                    }
                }
            })
            .expect("spawn the stream thread");
        RequestStream { rx, stop }
    }
}

impl Stream for RequestStream {
    type Item = Request;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Request>> {
        self.rx.poll_recv(cx)
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}
