//! The remote producer's side: connect to a gateway, open an exchange, send batches of tensors,
//! read results.

use std::time::Duration;

use arrow_array::RecordBatch;
use arrow_flight::decode::FlightRecordBatchStream;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::{FlightClient, FlightDescriptor};
use futures::StreamExt;
use tokio::sync::mpsc;
use tonic::transport::Endpoint;
use tonic::Code;

use crate::auth::{Token, HEADER};
use crate::schema::{read_results, ResultRow, SchemaError, TensorLayout};
use crate::tls::{ClientTls, PemError};

/// Largest gRPC message a client builds from a batch (a larger tensor goes alone).
const FLIGHT_DATA_BYTES: usize = 8 << 20;

/// How a remote producer reaches its gateway.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// The gateway's address: `http://host:port`, or `https://host:port` with TLS.
    pub gateway: String,
    /// The gateway's secret.
    pub token: Token,
    /// TLS settings for an `https` address.
    pub tls: Option<ClientTls>,
    /// The name the gateway and the server show for this producer.
    pub name: String,
    /// How long to wait for the connection.
    pub connect_timeout: Duration,
    /// Send the token over plain `http://` to a host other than this one (it can then be read
    /// by anyone on the path): only on a network where that is acceptable.
    pub allow_plaintext: bool,
}

/// What went wrong between a remote producer and its gateway.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// The address is not a URL.
    #[error("bad gateway address {0:?}: {1}")]
    Address(String, String),
    /// A TLS file could not be read.
    #[error(transparent)]
    Pem(#[from] PemError),
    /// The connection could not be made or was lost.
    #[error("cannot reach the gateway at {0}: {1}")]
    Connect(String, String),
    /// The gateway ended the call with a status.
    #[error("the gateway said {code:?}: {message}")]
    Status {
        /// gRPC's code.
        code: Code,
        /// Its message.
        message: String,
    },
    /// The gateway's answers did not have the bridge's format.
    #[error("the gateway's answer: {0}")]
    Format(#[from] SchemaError),
    /// The settings would send the token where it can be read: refused before connecting.
    #[error("{0}")]
    Insecure(String),
}

impl RemoteError {
    /// Whether trying again (on a new connection) can help: not for a refused token, a bad
    /// request or a tensor the gateway does not take.
    pub fn retryable(&self) -> bool {
        match self {
            RemoteError::Connect(..) => true,
            RemoteError::Status { code, .. } => matches!(
                code,
                Code::Unavailable
                    | Code::ResourceExhausted
                    | Code::Aborted
                    | Code::Internal
                    | Code::Unknown
                    | Code::Cancelled
                    | Code::DeadlineExceeded
            ),
            _ => false,
        }
    }
}

impl From<FlightError> for RemoteError {
    fn from(e: FlightError) -> RemoteError {
        match e {
            FlightError::Tonic(s) => RemoteError::from(*s),
            other => RemoteError::Status {
                code: Code::Internal,
                message: other.to_string(),
            },
        }
    }
}

impl From<tonic::Status> for RemoteError {
    fn from(s: tonic::Status) -> RemoteError {
        RemoteError::Status {
            code: s.code(),
            message: s.message().to_string(),
        }
    }
}

/// Checks that `cfg` does not send the token in clear where others may read it: TLS settings
/// with an `http://` address (they would be ignored) are refused, and so is `http://` to a host
/// other than this one unless `allow_plaintext` says so. Nothing is sent.
pub fn check_transport(cfg: &RemoteConfig) -> Result<(), RemoteError> {
    let uri = cfg
        .gateway
        .parse::<tonic::codegen::http::Uri>()
        .map_err(|e| RemoteError::Address(cfg.gateway.clone(), e.to_string()))?;
    match uri.scheme_str() {
        Some("https") => Ok(()),
        Some("http") => {
            let tls_given = cfg
                .tls
                .as_ref()
                .is_some_and(|t| t.ca.is_some() || t.domain.is_some() || t.identity.is_some());
            if tls_given {
                return Err(RemoteError::Insecure(format!(
                    "TLS settings were given for {}, an http:// address, where they would be ignored and the token sent in clear: use https://",
                    cfg.gateway
                )));
            }
            let host = uri.host().unwrap_or_default();
            if !is_loopback(host) && !cfg.allow_plaintext {
                return Err(RemoteError::Insecure(format!(
                    "{} is plain http:// to another host: the token would travel in clear and anyone on the path could read it. Use https:// (with the gateway's --tls-cert/--tls-key), or allow plaintext explicitly on a network you trust",
                    cfg.gateway
                )));
            }
            Ok(())
        }
        other => Err(RemoteError::Address(
            cfg.gateway.clone(),
            format!("the scheme must be http or https, not {other:?}"),
        )),
    }
}

/// Whether `host` (a URI's host: a name, an IPv4 address or a bracketed IPv6 one) is this host's
/// loopback.
fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost")
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A connected client whose calls carry the token.
pub async fn connect(cfg: &RemoteConfig) -> Result<FlightClient, RemoteError> {
    check_transport(cfg)?;
    let bad = |e: &dyn std::fmt::Display| RemoteError::Address(cfg.gateway.clone(), e.to_string());
    let mut ep = Endpoint::from_shared(cfg.gateway.clone())
        .map_err(|e| bad(&e))?
        .connect_timeout(cfg.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20))
        .initial_stream_window_size(Some(crate::gateway::WINDOW))
        .initial_connection_window_size(Some(2 * crate::gateway::WINDOW))
        .max_frame_size(Some(crate::gateway::FRAME));
    if cfg.gateway.starts_with("https://") {
        let tls = cfg.tls.clone().unwrap_or_default().config()?;
        ep = ep.tls_config(tls).map_err(|e| bad(&e))?;
    }
    let channel = ep
        .connect()
        .await
        .map_err(|e| RemoteError::Connect(cfg.gateway.clone(), source_chain(&e)))?;
    let mut client = FlightClient::new(channel);
    client
        .add_header(HEADER, &cfg.token.bearer())
        .map_err(RemoteError::from)?;
    // Fail fast on a wrong token, before any tensor is prepared.
    client.handshake(bytes::Bytes::new()).await?;
    Ok(client)
}

/// An error and its causes, on one line.
fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// One open stream to the gateway.
pub struct Exchange {
    tx: Option<mpsc::Sender<RecordBatch>>,
    results: FlightRecordBatchStream,
}

impl Exchange {
    /// Opens a stream for tensors of `layout`, with room for `queue` batches waiting to be
    /// sent.
    pub async fn open(
        client: &mut FlightClient,
        layout: &TensorLayout,
        name: &str,
        queue: usize,
    ) -> Result<Exchange, RemoteError> {
        Exchange::open_with(client, layout.schema(), name, queue).await
    }

    /// Opens a stream whose batches have `schema`: a tensor layout's, or a NIXL set-up's
    /// ([`crate::nixl::Hello::schema`]).
    pub async fn open_with(
        client: &mut FlightClient,
        schema: arrow_schema::SchemaRef,
        name: &str,
        queue: usize,
    ) -> Result<Exchange, RemoteError> {
        let (tx, rx) = mpsc::channel::<RecordBatch>(queue.max(1));
        let batches =
            futures::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|b| (Ok(b), rx)) },
            );
        let data = FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .with_flight_descriptor(Some(FlightDescriptor::new_path(vec![name.to_string()])))
            .with_max_flight_data_size(FLIGHT_DATA_BYTES)
            .build(batches);
        let results = client.do_exchange(data).await?;
        Ok(Exchange {
            tx: Some(tx),
            results,
        })
    }

    /// Queues a batch of tensors for sending; waits while `queue` batches wait.
    pub async fn send(&self, batch: RecordBatch) -> Result<(), RemoteError> {
        let tx = self.tx.as_ref().ok_or_else(|| RemoteError::Status {
            code: Code::FailedPrecondition,
            message: "send after finish".into(),
        })?;
        tx.send(batch).await.map_err(|_| RemoteError::Status {
            code: Code::Unavailable,
            message: "the stream to the gateway closed".into(),
        })
    }

    /// Says there are no more tensors; results keep coming until every request is answered.
    pub fn finish(&mut self) {
        self.tx = None;
    }

    /// The next answers; `None` when the gateway ended the stream.
    pub async fn results(&mut self) -> Option<Result<Vec<ResultRow>, RemoteError>> {
        let batch = self.results.next().await?;
        Some(
            batch
                .map_err(RemoteError::from)
                .and_then(|b| Ok(read_results(&b)?)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(gateway: &str, tls: Option<ClientTls>, allow_plaintext: bool) -> RemoteConfig {
        RemoteConfig {
            gateway: gateway.into(),
            token: Token::new("0123456789abcdef0123").unwrap(),
            tls,
            name: "t".into(),
            connect_timeout: Duration::from_secs(1),
            allow_plaintext,
        }
    }

    #[test]
    fn the_token_is_never_sent_in_clear_off_this_host_unless_allowed() {
        let ca = ClientTls {
            ca: Some("ca.pem".into()),
            ..ClientTls::default()
        };
        for ok in [
            "http://127.0.0.1:1",
            "http://localhost:1",
            "http://[::1]:1",
            "https://example.invalid:1",
        ] {
            assert!(check_transport(&cfg(ok, None, false)).is_ok(), "{ok}");
        }
        assert!(
            check_transport(&cfg("https://example.invalid:1", Some(ca.clone()), false)).is_ok()
        );
        let e = check_transport(&cfg("http://example.invalid:1", None, false)).unwrap_err();
        assert!(
            matches!(e, RemoteError::Insecure(_)) && e.to_string().contains("https://"),
            "{e}"
        );
        assert!(!e.retryable());
        assert!(check_transport(&cfg("http://example.invalid:1", None, true)).is_ok());
        // TLS settings with http:// are refused, even to loopback and with plaintext allowed.
        for url in ["http://127.0.0.1:1", "http://example.invalid:1"] {
            let e = check_transport(&cfg(url, Some(ca.clone()), true)).unwrap_err();
            assert!(e.to_string().contains("TLS settings"), "{e}");
        }
        assert!(matches!(
            check_transport(&cfg("ftp://127.0.0.1:1", None, false)),
            Err(RemoteError::Address(..))
        ));
    }
}
