//! The gateway's TCP connections before they have earned anything: a cap on connections in all
//! and per peer address, a deadline by which a connection must have made a call with the token
//! (the TLS handshake and HTTP/2's preface included), a shorter one by which it must have sent
//! its first byte, and a pause in accepting when the process is out of descriptors instead of
//! a loop of failing `accept`s.
//!
//! Each accepted connection is a [`Guarded`] stream: it counts against the caps until dropped,
//! and until [`Admissions::admit`] marks it (the first call that carries the token), any read or
//! write after its deadline fails, which ends the connection wherever it is — in the TLS
//! handshake, waiting for the HTTP/2 preface, or idle after calls that carried no token.
//!
//! A cap never locks out a peer with the token: when one is reached, the oldest connection it
//! covers that has made no call with the token (one that has sent nothing first) is closed to
//! make room, as the Unix server does for handshakes. Only connections that have shown the
//! token keep their place whatever comes.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::task::AtomicWaker;
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
    /// Time a connection has to send its first byte (at most `auth_deadline`).
    pub silent_deadline: Duration,
}

impl Default for ConnLimits {
    /// 256 connections, 64 per peer address, 10 s to authenticate, 3 s to say anything.
    fn default() -> ConnLimits {
        ConnLimits {
            total: 256,
            per_peer: 64,
            auth_deadline: Duration::from_secs(10),
            silent_deadline: Duration::from_secs(3),
        }
    }
}

/// What the gateway knows of one open connection, shared by its stream and the admissions.
#[derive(Debug)]
pub(crate) struct Conn {
    /// It made a call with the token.
    authed: AtomicBool,
    /// It has sent at least one byte.
    heard: AtomicBool,
    /// It made a call without the token.
    refused: AtomicBool,
    /// It was closed to make room for another.
    evicted: AtomicBool,
    /// Wakes its stream's task when it is evicted.
    waker: AtomicWaker,
    opened: Instant,
}

impl Conn {
    pub(crate) fn authed(&self) -> bool {
        self.authed.load(Ordering::Relaxed)
    }
}

/// The open connections: counts per peer address, and each one's state (by peer socket
/// address, unique among open connections).
#[derive(Default)]
pub(crate) struct Admissions {
    inner: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    total: usize,
    per_ip: HashMap<IpAddr, usize>,
    by_addr: HashMap<SocketAddr, Arc<Conn>>,
}

impl Open {
    fn release(&mut self, ip: IpAddr) {
        self.total = self.total.saturating_sub(1);
        if let Some(n) = self.per_ip.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&ip);
            }
        }
    }

    /// Closes, of the connections `covered` that have not shown the token, one that made a
    /// call without it, else one that has sent nothing, else the one that has waited longest;
    /// its place is free at once (its stream ends when its task wakes). Whether there was one.
    /// A producer with the token, still in its handshake, is thus the last to go.
    fn evict(&mut self, covered: impl Fn(&SocketAddr) -> bool) -> bool {
        let victim = self
            .by_addr
            .iter()
            .filter(|(a, c)| covered(a) && !c.authed())
            .min_by_key(|(_, c)| {
                (
                    !c.refused.load(Ordering::Relaxed),
                    c.heard.load(Ordering::Relaxed),
                    c.opened,
                )
            })
            .map(|(a, _)| *a);
        let Some(addr) = victim else {
            return false;
        };
        let conn = self.by_addr.remove(&addr).expect("found above");
        self.release(addr.ip());
        conn.evicted.store(true, Ordering::Relaxed);
        conn.waker.wake();
        true
    }
}

impl Admissions {
    fn lock(&self) -> MutexGuard<'_, Open> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the connection from `peer` as authenticated: no deadline from now on, and no
    /// eviction.
    pub(crate) fn admit(&self, peer: Option<SocketAddr>) {
        if let Some(conn) = peer.and_then(|p| self.lock().by_addr.get(&p).cloned()) {
            conn.authed.store(true, Ordering::Relaxed);
        }
    }

    /// Marks the connection from `peer` as one that made a call without the token: the first
    /// to make room when a cap is reached.
    pub(crate) fn refuse(&self, peer: Option<SocketAddr>) {
        if let Some(conn) = peer.and_then(|p| self.lock().by_addr.get(&p).cloned()) {
            conn.refused.store(true, Ordering::Relaxed);
        }
    }

    /// Connections open now (those evicted and not yet ended left out).
    pub(crate) fn open(&self) -> usize {
        self.lock().total
    }

    /// Takes a place for a connection from `peer`, making room by eviction where a cap is
    /// reached, or says which cap is reached with no room to make.
    /// Whether room was made is returned beside the new connection.
    fn enter(
        &self,
        peer: SocketAddr,
        limits: &ConnLimits,
    ) -> Result<(Arc<Conn>, bool), &'static str> {
        let mut o = self.lock();
        let ip = peer.ip();
        let mut made_room = false;
        if o.per_ip.get(&ip).copied().unwrap_or(0) >= limits.per_peer {
            if !o.evict(|a| a.ip() == ip) {
                return Err("the limit of connections from one address");
            }
            made_room = true;
        }
        if o.total >= limits.total {
            if !o.evict(|_| true) {
                return Err("the gateway's connection limit");
            }
            made_room = true;
        }
        *o.per_ip.entry(ip).or_default() += 1;
        o.total += 1;
        let conn = Arc::new(Conn {
            authed: AtomicBool::new(false),
            heard: AtomicBool::new(false),
            refused: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            waker: AtomicWaker::new(),
            opened: Instant::now(),
        });
        o.by_addr.insert(peer, conn.clone());
        Ok((conn, made_room))
    }

    /// Gives back the place of `conn`, from `peer` (unless it was evicted: given back then).
    fn leave(&self, peer: SocketAddr, conn: &Arc<Conn>) {
        let mut o = self.lock();
        if o.by_addr.get(&peer).is_some_and(|c| Arc::ptr_eq(c, conn)) {
            o.by_addr.remove(&peer);
            o.release(peer.ip());
        }
    }
}

/// A connection that holds its place until dropped, and fails once evicted, or once a deadline
/// passes before it has authenticated.
pub(crate) struct Guarded {
    stream: TcpStream,
    peer: SocketAddr,
    conn: Arc<Conn>,
    /// The silent deadline until its first byte, then the authentication deadline.
    deadline: Pin<Box<Sleep>>,
    auth_deadline: Instant,
    admissions: Arc<Admissions>,
}

impl Guarded {
    /// `Err` once evicted, or once its deadline has passed without a call carrying the token;
    /// registers the wake-ups otherwise.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if self.conn.authed() {
            return Ok(());
        }
        self.conn.waker.register(cx.waker());
        if self.conn.evicted.load(Ordering::Relaxed) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room: a connection cap was reached and this one had not \
                 shown the gateway's token",
            ));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                if self.conn.heard.load(Ordering::Relaxed) {
                    "no call with the gateway's token before the deadline"
                } else {
                    "nothing sent before the deadline"
                },
            )),
            Poll::Pending => Ok(()),
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.admissions.leave(self.peer, &self.conn);
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
        let before = buf.filled().len();
        let r = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before && !self.conn.heard.swap(true, Ordering::Relaxed) {
            // Its first bytes: from now on, the time to authenticate.
            let at = self.auth_deadline;
            self.deadline.as_mut().reset(at);
        }
        r
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
                    Ok((conn, made_room)) => {
                        if made_room
                            && last_log.is_none_or(|t| t.elapsed() > Duration::from_secs(1))
                        {
                            tracing::warn!(
                                %peer,
                                "a connection cap is reached: closed the oldest connection \
                                 without the token to make room"
                            );
                            last_log = Some(Instant::now());
                        }
                        let now = Instant::now();
                        let silent = limits.silent_deadline.min(limits.auth_deadline);
                        let guarded = Guarded {
                            stream,
                            peer,
                            conn,
                            deadline: Box::pin(tokio::time::sleep_until(now + silent)),
                            auth_deadline: now + limits.auth_deadline,
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

    fn limits(total: usize, per_peer: usize) -> ConnLimits {
        ConnLimits {
            total,
            per_peer,
            ..ConnLimits::default()
        }
    }

    fn p(ip: [u8; 4], port: u16) -> SocketAddr {
        SocketAddr::from((ip, port))
    }

    #[test]
    fn places_are_counted_per_peer_and_in_all_and_given_back() {
        let a = Admissions::default();
        let limits = limits(3, 2);
        let first = a.enter(p([127, 0, 0, 1], 1), &limits).unwrap().0;
        a.admit(Some(p([127, 0, 0, 1], 1)));
        assert!(first.authed());
        let second = a.enter(p([127, 0, 0, 1], 2), &limits).unwrap().0;
        a.admit(Some(p([127, 0, 0, 1], 2)));
        // Both from this address have shown the token: no room is made for a third.
        assert!(a
            .enter(p([127, 0, 0, 1], 3), &limits)
            .unwrap_err()
            .contains("one address"));
        let other = a.enter(p([127, 0, 0, 2], 1), &limits).unwrap().0;
        a.admit(Some(p([127, 0, 0, 2], 1)));
        assert!(a
            .enter(p([127, 0, 0, 3], 1), &limits)
            .unwrap_err()
            .contains("connection limit"));
        a.leave(p([127, 0, 0, 1], 1), &first);
        assert_eq!(a.open(), 2);
        assert!(a.enter(p([127, 0, 0, 1], 4), &limits).is_ok());
        drop((second, other));
    }

    #[test]
    fn a_full_cap_makes_room_by_closing_the_oldest_that_has_not_shown_the_token() {
        let a = Admissions::default();
        let limits = limits(4, 3);
        let ip = [127, 0, 0, 1];
        let authed = a.enter(p(ip, 1), &limits).unwrap().0;
        a.admit(Some(p(ip, 1)));
        std::thread::sleep(Duration::from_millis(5));
        let talker = a.enter(p(ip, 2), &limits).unwrap().0;
        talker.heard.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(5));
        let silent = a.enter(p(ip, 3), &limits).unwrap().0;
        // The address's cap: the silent one goes first, though the talker is older.
        let newcomer = a.enter(p(ip, 4), &limits).unwrap().0;
        assert!(silent.evicted.load(Ordering::Relaxed));
        assert!(!talker.evicted.load(Ordering::Relaxed) && !authed.evicted.load(Ordering::Relaxed));
        assert_eq!(a.open(), 3);
        // Then the oldest that has not shown the token.
        newcomer.heard.store(true, Ordering::Relaxed);
        let next = a.enter(p(ip, 5), &limits).unwrap().0;
        assert!(talker.evicted.load(Ordering::Relaxed));
        assert!(!newcomer.evicted.load(Ordering::Relaxed));
        // The total cap makes room across addresses, silent connections first; an evicted
        // connection's own leaving later does not give its place back twice.
        std::thread::sleep(Duration::from_millis(5));
        let _far = a.enter(p([10, 0, 0, 1], 1), &limits).unwrap().0;
        assert_eq!(a.open(), 4);
        let _farther = a.enter(p([10, 0, 0, 2], 1), &limits).unwrap().0;
        assert!(next.evicted.load(Ordering::Relaxed));
        assert!(!newcomer.evicted.load(Ordering::Relaxed));
        a.leave(p(ip, 3), &silent);
        a.leave(p(ip, 5), &next);
        assert_eq!(a.open(), 4);
        assert!(!authed.evicted.load(Ordering::Relaxed));
    }

    #[test]
    fn a_connection_that_called_without_the_token_goes_before_one_still_in_its_handshake() {
        let a = Admissions::default();
        let limits = limits(8, 3);
        let ip = [127, 0, 0, 1];
        // A producer in its handshake, then two connections of a flood: one silent, one that
        // made its call without the token.
        let producer = a.enter(p(ip, 1), &limits).unwrap().0;
        producer.heard.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(5));
        let silent = a.enter(p(ip, 2), &limits).unwrap().0;
        let caller = a.enter(p(ip, 3), &limits).unwrap().0;
        caller.heard.store(true, Ordering::Relaxed);
        a.refuse(Some(p(ip, 3)));
        let _next = a.enter(p(ip, 4), &limits).unwrap().0;
        assert!(caller.evicted.load(Ordering::Relaxed));
        assert!(!silent.evicted.load(Ordering::Relaxed));
        let _after = a.enter(p(ip, 5), &limits).unwrap().0;
        assert!(silent.evicted.load(Ordering::Relaxed));
        assert!(!producer.evicted.load(Ordering::Relaxed));
    }
}
