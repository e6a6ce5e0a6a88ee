//! The gateway's TCP connections before they have earned anything: a cap on connections in all
//! and per peer address, a deadline by which a connection must have made a call with the token
//! (the TLS handshake and HTTP/2's preface included), and a pause in accepting when the process
//! is out of descriptors instead of a loop of failing `accept`s.
//!
//! Each accepted connection is a [`Guarded`] stream: it counts against the caps until dropped,
//! and until [`Admissions::admit`] marks it (the first call that carries the token), any read or
//! write after its deadline fails, which ends the connection wherever it is — in the TLS
//! handshake, waiting for the HTTP/2 preface, or idle after calls that carried no token.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Caps and deadlines for connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Connections open at once, in all.
    pub total: usize,
    /// Connections open at once from one peer address.
    pub per_peer: usize,
    /// Time a connection has to make its first call with the token.
    pub auth_deadline: Duration,
}

impl Default for ConnLimits {
    /// 256 connections, 64 per peer address, 10 s to authenticate.
    fn default() -> ConnLimits {
        ConnLimits {
            total: 256,
            per_peer: 64,
            auth_deadline: Duration::from_secs(10),
        }
    }
}

/// The open connections: counts per peer address, and which ones have made a call with the
/// token (by peer socket address, unique among open connections).
#[derive(Default)]
pub(crate) struct Admissions {
    inner: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
    by_addr: HashMap<SocketAddr, Arc<AtomicBool>>,
}

impl Admissions {
    fn lock(&self) -> MutexGuard<'_, Open> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the connection from `peer` as authenticated: no deadline from now on.
    pub(crate) fn admit(&self, peer: Option<SocketAddr>) {
        if let Some(flag) = peer.and_then(|p| self.lock().by_addr.get(&p).cloned()) {
            flag.store(true, Ordering::Relaxed);
        }
    }

    /// Connections open now.
    pub(crate) fn open(&self) -> usize {
        self.lock().total
    }

    /// Takes a place for a connection from `peer`, or says which cap is reached.
    fn enter(
        &self,
        peer: SocketAddr,
        limits: &ConnLimits,
    ) -> Result<Arc<AtomicBool>, &'static str> {
        let mut o = self.lock();
        if o.total >= limits.total {
            return Err("the gateway's connection limit");
        }
        let n = o.per_ip.entry(peer.ip()).or_default();
        if *n >= limits.per_peer {
            return Err("the limit of connections from one address");
        }
        *n += 1;
        o.total += 1;
        let flag = Arc::new(AtomicBool::new(false));
        o.by_addr.insert(peer, flag.clone());
        Ok(flag)
    }

    fn leave(&self, peer: SocketAddr) {
        let mut o = self.lock();
        o.total = o.total.saturating_sub(1);
        if let Some(n) = o.per_ip.get_mut(&peer.ip()) {
            *n -= 1;
            if *n == 0 {
                o.per_ip.remove(&peer.ip());
            }
        }
        o.by_addr.remove(&peer);
    }
}

/// A connection that holds its place until dropped and fails once its deadline passes
/// unauthenticated.
pub(crate) struct Guarded {
    stream: TcpStream,
    peer: SocketAddr,
    authed: Arc<AtomicBool>,
    deadline: Pin<Box<Sleep>>,
    admissions: Arc<Admissions>,
}

impl Guarded {
    /// `Err` once the deadline has passed without a call carrying the token; registers the
    /// deadline's wake-up otherwise.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.authed.load(Ordering::Relaxed) {
            return Ok(());
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no call with the gateway's token before the deadline",
            )),
            Poll::Pending => Ok(()),
        }
    }
}

use std::future::Future;

impl Drop for Guarded {
    fn drop(&mut self) {
        self.admissions.leave(self.peer);
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Err(e) = self.check(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Err(e) = self.check(cx) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl Connected for Guarded {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

/// Accepts connections on `listener` within `limits`: one over a cap is closed at once (logged
/// at most once a second); out of descriptors (`EMFILE`, `ENFILE`), accepting pauses for 100 ms
/// instead of spinning.
pub(crate) fn incoming(
    listener: TcpListener,
    limits: ConnLimits,
    admissions: Arc<Admissions>,
) -> impl Stream<Item = io::Result<Guarded>> + Send {
    futures::stream::unfold(
        (listener, admissions, None::<Instant>),
        move |(listener, admissions, mut last_log)| async move {
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        if matches!(
                            e.raw_os_error(),
                            Some(nix::libc::EMFILE | nix::libc::ENFILE)
                        ) {
                            if last_log.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
                                tracing::warn!("accept: {e}; pausing new connections for 100 ms");
                                last_log = Some(Instant::now());
                            }
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                match admissions.enter(peer, &limits) {
                    Ok(authed) => {
                        let guarded = Guarded {
                            stream,
                            peer,
                            authed,
                            deadline: Box::pin(tokio::time::sleep(limits.auth_deadline)),
                            admissions: admissions.clone(),
                        };
                        return Some((Ok(guarded), (listener, admissions, last_log)));
                    }
                    Err(which) => {
                        if last_log.is_none_or(|t| t.elapsed() > Duration::from_secs(1)) {
                            tracing::warn!(%peer, "refused a connection: {which} is reached");
                            last_log = Some(Instant::now());
                        }
                        drop(stream);
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_counted_per_peer_and_in_all_and_given_back() {
        let a = Admissions::default();
        let limits = ConnLimits {
            total: 3,
            per_peer: 2,
            auth_deadline: Duration::from_secs(1),
        };
        let p = |ip: [u8; 4], port| SocketAddr::from((ip, port));
        assert!(a.enter(p([127, 0, 0, 1], 1), &limits).is_ok());
        assert!(a.enter(p([127, 0, 0, 1], 2), &limits).is_ok());
        assert!(a
            .enter(p([127, 0, 0, 1], 3), &limits)
            .unwrap_err()
            .contains("one address"));
        let flag = a.enter(p([127, 0, 0, 2], 1), &limits).unwrap();
        assert!(a
            .enter(p([127, 0, 0, 3], 1), &limits)
            .unwrap_err()
            .contains("connection limit"));
        a.admit(Some(p([127, 0, 0, 2], 1)));
        assert!(flag.load(Ordering::Relaxed));
        a.leave(p([127, 0, 0, 1], 1));
        assert_eq!(a.open(), 2);
        assert!(a.enter(p([127, 0, 0, 1], 4), &limits).is_ok());
    }
}
