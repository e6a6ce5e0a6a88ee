//! The gateway: an Arrow Flight server on the inference host whose remote producers become local
//! producer sessions of a tensorport server.
//!
//! Each `DoExchange` stream is one remote producer. Its record batches of tensors are read here
//! (the async side) and handed to a thread of its own (the `session` module) that holds a local
//! [`tensorport::Producer`]: it leases a slot of that session's pool for each tensor, copies the
//! tensor in, and submits it under the remote producer's request id. The server sees an ordinary
//! producer, so its descriptor checks, backpressure and results routing apply unchanged. Results
//! go back on the same stream. A stream that breaks is a dead producer: its session is closed and
//! the server reclaims its slots, as for a local `SIGKILL`.
//!
//! Backpressure is the pool: while every slot is in flight the session thread does not take the
//! next batch, the reader stops reading, and HTTP/2 flow control stops the remote producer.

mod conn;
mod ipc;
mod session;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use tokio::sync::{mpsc, Semaphore};
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{Token, HEADER};
use crate::schema::results_schema;
use crate::tls::ServerTls;

pub use conn::ConnLimits;
pub use session::Input;

/// HTTP/2 flow-control window per stream, in bytes.
pub const WINDOW: u32 = 8 << 20;
/// Largest HTTP/2 frame taken, in bytes.
pub const FRAME: u32 = 1 << 20;
/// Streams one connection may have open at once.
const MAX_STREAMS_PER_CONNECTION: u32 = 32;

/// How a gateway runs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The local tensorport server's socket.
    pub socket: PathBuf,
    /// The secret remote producers must present.
    pub token: Token,
    /// TLS; `None` is plaintext (for loopback and trusted networks only).
    pub tls: Option<ServerTls>,
    /// Remote producers connected at once; more are refused.
    pub max_remotes: usize,
    /// Slots (requests in flight) per remote producer.
    pub in_flight: u32,
    /// Largest tensor taken, in bytes.
    pub max_tensor_bytes: u64,
    /// Largest gRPC message taken (one record batch), in bytes.
    pub max_message_bytes: usize,
    /// How long a remote producer may leave its results unread, or the local server leave a
    /// request unanswered, before its stream is ended.
    pub peer_timeout: Duration,
    /// Connections at once (in all, per peer address) and the time each has to make a call
    /// with the token.
    pub connections: ConnLimits,
    /// The GPU (ordinal) whose memory a NIXL stream's device tensors are read into, and handed
    /// to the local server from.
    pub gpu: u32,
    /// The network interface UCX (under NIXL) may use, which the caller has confined it to
    /// (`UCX_NET_DEVICES`); `None` refuses NIXL streams (a gateway listening on every address
    /// that was not told which one NIXL may use).
    pub nixl_interface: Option<String>,
    /// Whether NIXL streams of GPU memory are taken. They are read by the gateway process
    /// itself (host-memory streams in a reader process of their own), where a set-up that makes
    /// UCX abort ends the gateway and every stream on it: off unless the operator trusts its
    /// producers.
    pub nixl_device: bool,
}

/// What the gateway has done, for its logs and summary.
#[derive(Debug, Default)]
pub struct Counters {
    /// Streams accepted.
    pub streams: AtomicU64,
    /// Calls refused for want of the token.
    pub refused: AtomicU64,
    /// Tensors submitted to the local server.
    pub tensors: AtomicU64,
    /// Tensor bytes submitted.
    pub bytes: AtomicU64,
    /// Results sent back.
    pub results: AtomicU64,
    /// Streams that broke with requests in flight (their sessions reclaimed).
    pub broken: AtomicU64,
}

/// Why a gateway could not serve.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// Its TLS certificate or key could not be read.
    #[error(transparent)]
    Pem(#[from] crate::tls::PemError),
    /// gRPC failed (a bad certificate or key, or the listener).
    #[error("gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// The Flight service.
#[derive(Clone)]
pub struct Gateway {
    cfg: Arc<GatewayConfig>,
    permits: Arc<Semaphore>,
    counters: Arc<Counters>,
    admissions: Arc<conn::Admissions>,
}

impl Gateway {
    /// A gateway for `cfg`.
    pub fn new(cfg: GatewayConfig) -> Gateway {
        Gateway {
            permits: Arc::new(Semaphore::new(cfg.max_remotes.max(1))),
            cfg: Arc::new(cfg),
            counters: Arc::default(),
            admissions: Arc::default(),
        }
    }

    /// Its counters.
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// TCP connections open now.
    pub fn connections(&self) -> usize {
        self.admissions.open()
    }

    /// Serves on `listener` until `shutdown` completes.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        let mut builder = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .http2_keepalive_timeout(Some(Duration::from_secs(20)))
            // HTTP/2's default 64 KiB window would cost a round trip per 64 KiB of tensor; a
            // remote producer may have WINDOW bytes unread here (bounded by --max-remotes).
            .initial_stream_window_size(Some(WINDOW))
            .initial_connection_window_size(Some(2 * WINDOW))
            .max_frame_size(Some(FRAME))
            // One connection cannot open streams without bound (each is refused beyond
            // --max-remotes anyway, after its headers).
            .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
            .tcp_nodelay(true);
        if let Some(tls) = &self.cfg.tls {
            builder = builder.tls_config(tls.config()?)?;
        }
        let max = self.cfg.max_message_bytes;
        let incoming = conn::incoming(listener, self.cfg.connections, self.admissions.clone());
        let svc = FlightServiceServer::new(self)
            .max_decoding_message_size(max)
            .max_encoding_message_size(max);
        builder
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await?;
        Ok(())
    }

    /// Refuses a call without the token.
    fn authorize<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let header = req.metadata().get(HEADER).map(|v| v.as_bytes());
        if self.cfg.token.admits(header) {
            // The connection has shown the token: no deadline for it from now on.
            self.admissions.admit(req.remote_addr());
            return Ok(());
        }
        self.counters.refused.fetch_add(1, Ordering::Relaxed);
        // The first to make room should a cap be reached.
        self.admissions.refuse(req.remote_addr());
        let peer = peer_of(req);
        tracing::warn!(%peer, "refused a call without the gateway's token");
        Err(Status::unauthenticated(
            "this gateway needs its token: send `authorization: Bearer <token>` (tensorport-bridge produce --token-file)",
        ))
    }
}

fn peer_of<T>(req: &Request<T>) -> String {
    req.remote_addr()
        .map(|a: SocketAddr| a.to_string())
        .unwrap_or_else(|| "unknown peer".into())
}

/// A remote producer's name, from its first message's descriptor: printable, at most 64
/// characters.
fn name_of(d: Option<&FlightDescriptor>) -> String {
    let raw = d
        .and_then(|d| d.path.first().cloned())
        .unwrap_or_else(|| "remote".into());
    let clean: String = raw.chars().filter(|c| !c.is_control()).take(64).collect();
    if clean.is_empty() {
        "remote".into()
    } else {
        clean
    }
}

type Stream<T> = BoxStream<'static, Result<T, Status>>;

#[tonic::async_trait]
impl FlightService for Gateway {
    type HandshakeStream = Stream<HandshakeResponse>;
    type ListFlightsStream = Stream<FlightInfo>;
    type DoGetStream = Stream<FlightData>;
    type DoPutStream = Stream<PutResult>;
    type DoActionStream = Stream<arrow_flight::Result>;
    type ListActionsStream = Stream<ActionType>;
    type DoExchangeStream = Stream<FlightData>;

    /// Checks the token: a client can learn whether its credentials work before it streams.
    async fn handshake(
        &self,
        req: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        self.authorize(&req)?;
        let ok = HandshakeResponse {
            protocol_version: 0,
            payload: bytes::Bytes::from_static(b"tensorport-bridge"),
        };
        Ok(Response::new(futures::stream::iter([Ok(ok)]).boxed()))
    }

    /// One remote producer: tensors in, results out.
    async fn do_exchange(
        &self,
        req: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        self.authorize(&req)?;
        let peer = peer_of(&req);
        let peer_ip = req.remote_addr().map(|a| a.ip());
        let permit = self.permits.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "the gateway serves at most {} remote producers at once (--max-remotes); retry later",
                self.cfg.max_remotes
            ))
        })?;
        // The place is held by the reader and the session thread together: it is given back
        // when both have let go, so that what either still holds (a message half received, a
        // batch) is counted against a place.
        let permit = Arc::new(permit);
        self.counters.streams.fetch_add(1, Ordering::Relaxed);
        let mut input = req.into_inner();
        // Batches wait here for the session thread: one at a time, so that a full pool stops
        // the reading (the lease is the backpressure).
        let (in_tx, in_rx) = mpsc::channel::<Input>(1);
        let (out_tx, out_rx) = mpsc::channel::<Result<arrow_array::RecordBatch, Status>>(64);
        let cfg = self.cfg.clone();
        let counters = self.counters.clone();
        tokio::spawn(async move {
            // The descriptor of the first message names the producer. A stream that sends
            // nothing does not hold its place among --max-remotes for longer than the timeout.
            let first = match tokio::time::timeout(cfg.peer_timeout, input.message()).await {
                Ok(Ok(Some(m))) => m,
                Ok(Ok(None)) => return,
                Ok(Err(e)) => {
                    tracing::info!(%peer, "stream broke before its first message: {e}");
                    return;
                }
                Err(_) => {
                    tracing::warn!(%peer, "stream sent nothing for {} s; closed", cfg.peer_timeout.as_secs());
                    let _ = out_tx
                        .send(Err(Status::deadline_exceeded(
                            "no message within the gateway's --peer-timeout",
                        )))
                        .await;
                    return;
                }
            };
            let name = name_of(first.flight_descriptor.as_ref());
            let data = futures::stream::iter([Ok(first)]).chain(input);
            let reader = ipc::IpcReader::new(cfg.max_tensor_bytes);
            let handle = tokio::runtime::Handle::current();
            let who = format!("{name} from {peer}");
            let held = permit.clone();
            std::thread::Builder::new()
                .name("tp-bridge-session".into())
                .spawn(move || {
                    // Made on its thread: a session of device tensors stays on it.
                    session::Session::new(cfg, who, peer_ip, in_rx, out_tx, handle, counters).run();
                    drop(held);
                })
                .expect("spawn a session thread");
            forward(data, reader, in_tx).await;
            drop(permit);
        });
        let results = futures::stream::unfold(out_rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|item| (item.map_err(FlightError::from), rx))
        });
        let flight = FlightDataEncoderBuilder::new()
            .with_schema(results_schema())
            .build(results)
            .map_err(Status::from);
        Ok(Response::new(flight.boxed()))
    }

    async fn list_flights(
        &self,
        req: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        self.authorize(&req)?;
        Err(Status::unimplemented(
            "a tensorport gateway only takes DoExchange streams",
        ))
    }

    async fn get_flight_info(
        &self,
        req: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        self.authorize(&req)?;
        Err(Status::unimplemented(
            "a tensorport gateway only takes DoExchange streams",
        ))
    }

    async fn poll_flight_info(
        &self,
        req: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        self.authorize(&req)?;
        Err(Status::unimplemented(
            "a tensorport gateway only takes DoExchange streams",
        ))
    }

    async fn get_schema(
        &self,
        req: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        self.authorize(&req)?;
        Err(Status::unimplemented(
            "a tensorport gateway only takes DoExchange streams",
        ))
    }

    async fn do_get(&self, req: Request<Ticket>) -> Result<Response<Self::DoGetStream>, Status> {
        self.authorize(&req)?;
        Err(Status::unimplemented(
            "a tensorport gateway only takes DoExchange streams",
        ))
    }

    async fn do_put(
        &self,
        req: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        self.authorize(&req)?;
        Err(Status::unimplemented(
            "a tensorport gateway takes DoExchange streams (results come back on them)",
        ))
    }

    async fn do_action(
        &self,
        req: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        self.authorize(&req)?;
        Err(Status::unimplemented("a tensorport gateway has no actions"))
    }

    async fn list_actions(
        &self,
        req: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        self.authorize(&req)?;
        Ok(Response::new(futures::stream::empty().boxed()))
    }
}

/// Reads a stream's messages, each looked at before it is decoded ([`ipc::IpcReader`]), and
/// hands its batches to the session thread's channel until the stream ends (the channel closes:
/// a clean end) or breaks or sends what a tensor stream does not (the session is told, and
/// drops what is in flight).
async fn forward(
    mut data: impl futures::Stream<Item = Result<FlightData, Status>> + Unpin,
    mut reader: ipc::IpcReader,
    to: mpsc::Sender<Input>,
) {
    loop {
        // The session may end first (a refused batch, an idle stream): the stream is then
        // dropped at once, with whatever part of a message it holds.
        let next = tokio::select! {
            biased;
            _ = to.closed() => return,
            next = data.next() => next,
        };
        let item = match next {
            Some(Ok(m)) => match reader.read(&m) {
                Ok(Some(batch)) => Input::Batch(batch),
                Ok(None) => continue,
                Err(why) => Input::Invalid(why),
            },
            Some(Err(s)) => Input::Broken(s.message().to_string()),
            None => return,
        };
        let broken = !matches!(item, Input::Batch(_));
        if to.send(item).await.is_err() || broken {
            return;
        }
    }
}
