//! tensorport-bridge: remote producers for a tensorport server, over Apache Arrow Flight.
//!
//! tensorport's own transport stops at the host (shared memory, a Unix socket, CUDA IPC). To feed
//! an inference host from preprocessing hosts, the bridge stands on an existing engine rather than
//! a network layer of its own: Arrow Flight (gRPC over HTTP/2, TLS, Arrow's IPC format and its
//! canonical `arrow.fixed_shape_tensor` type). docs/scale-out.md says why this engine, and what
//! the bridge keeps of tensorport's guarantees.
//!
//! - A [`gateway::Gateway`] runs on the inference host. Each remote producer's `DoExchange`
//!   stream becomes a local producer session of the tensorport server: tensors land in that
//!   session's pool slots and are submitted with the producer's own request ids, so the server's
//!   checks, backpressure and results routing apply as to a local producer; results go back on
//!   the stream. A broken stream is a dead producer, reclaimed like a local one.
//! - A remote producer ([`remote`]) connects with the gateway's token, sends batches of tensors
//!   ([`schema`] is the format, also for other Flight clients such as `pyarrow.flight`), and
//!   reads results. The `tensorport-bridge produce` binary prepares images like `tensorport
//!   produce`, and on a lost connection sends again what has no result yet: every input gets
//!   exactly one result.
//! - [`auth`]: a bearer token on every call, checked before a byte of the stream is read;
//!   [`tls`]: TLS, and mutual TLS, through rustls.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod auth;
pub mod gateway;
pub mod nixl;
pub mod nixl_reader;
pub mod nixl_setup;
pub mod remote;
pub mod schema;
pub mod tls;
