//! `serve --metrics ADDR`: the server's counters and histograms for Prometheus to scrape.
//!
//! The text is written by `prometheus-client` (the Prometheus project's Rust client), served over
//! HTTP by `tiny_http` on a thread of its own: `GET /metrics` answers, anything else is a 404.
//! Counters and gauges are read from [`Server::status`] at each scrape (the same figures as `ctl
//! status`); the histograms are filled by the serving loop as batches run.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tensorport::Server;

use crate::error::{ConfigError, Error, Result};

/// What the serving loop records.
#[derive(Clone)]
pub struct Metrics {
    batch_size: Histogram,
    batch_seconds: Histogram,
    request_seconds: Histogram,
}

impl Metrics {
    /// One batch of `size` requests ran in `model`; its requests had waited `service` each, from
    /// the consumer taking them to their results being sent.
    pub fn record_batch(&self, size: usize, model: Duration, service: Duration) {
        self.batch_size.observe(size as f64);
        self.batch_seconds.observe(model.as_secs_f64());
        for _ in 0..size {
            self.request_seconds.observe(service.as_secs_f64());
        }
    }
}

/// The counters and gauges of [`Server::status`], read at each scrape.
struct StatusCollector(Arc<Server>);

impl std::fmt::Debug for StatusCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatusCollector")
    }
}

impl Collector for StatusCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.0.status();
        let t = &s.totals;
        for (name, help, v) in [
            (
                "tensorport_requests_submitted",
                "Requests accepted.",
                t.submitted,
            ),
            (
                "tensorport_requests_completed",
                "Results sent.",
                t.completed,
            ),
            (
                "tensorport_tensor_bytes",
                "Tensor bytes handed over.",
                t.bytes,
            ),
            (
                "tensorport_protocol_errors",
                "Error frames sent for bad messages.",
                t.protocol_errors,
            ),
            (
                "tensorport_sessions_opened",
                "Producer sessions opened.",
                t.sessions_opened,
            ),
            (
                "tensorport_sessions_reclaimed",
                "Sessions whose peer died or broke the protocol, reclaimed.",
                t.sessions_reclaimed,
            ),
            (
                "tensorport_connections_refused",
                "Connections refused (limit, uid, handshake).",
                t.connections_refused,
            ),
            (
                "tensorport_batches",
                "Batches handed to the model.",
                t.batches,
            ),
            (
                "tensorport_batched_requests",
                "Requests in those batches.",
                t.batched,
            ),
        ] {
            let c = ConstCounter::new(v);
            c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let sum = |f: fn(&tensorport::wire::SessionStatus) -> u32| -> i64 {
            s.sessions.iter().map(|x| i64::from(f(x))).sum()
        };
        for (name, help, v) in [
            (
                "tensorport_sessions",
                "Open producer sessions.",
                s.sessions.len() as i64,
            ),
            (
                "tensorport_in_flight",
                "Requests submitted, result not sent yet.",
                sum(|x| x.in_flight),
            ),
            (
                "tensorport_slots_granted",
                "Slots with the producers now.",
                sum(|x| x.granted),
            ),
            (
                "tensorport_draining",
                "1 while the server drains.",
                i64::from(s.draining),
            ),
        ] {
            let g = ConstGauge::new(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        let up = ConstGauge::new(s.uptime_ms as f64 / 1e3);
        up.encode(enc.encode_descriptor(
            "tensorport_uptime_seconds",
            "Seconds since the server started.",
            None,
            up.metric_type(),
        )?)?;
        Ok(())
    }
}

/// Starts the endpoint on `addr` (port 0: any free port); returns what the serving loop records
/// into, and the address it listens on.
pub fn start(addr: &str, server: Arc<Server>) -> Result<(Metrics, SocketAddr)> {
    let m = Metrics {
        batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
        batch_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 18)),
        request_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 18)),
    };
    let mut reg = Registry::default();
    reg.register(
        "tensorport_batch_size",
        "Requests per batch the model ran",
        m.batch_size.clone(),
    );
    reg.register(
        "tensorport_batch_model_seconds",
        "Time the model took per batch",
        m.batch_seconds.clone(),
    );
    reg.register(
        "tensorport_request_service_seconds",
        "From the consumer taking a request to its result being sent",
        m.request_seconds.clone(),
    );
    reg.register_collector(Box::new(StatusCollector(server)));
    let http = tiny_http::Server::http(addr).map_err(|e| ConfigError::Metrics {
        addr: addr.to_string(),
        why: format!("cannot listen there ({e}); give a free HOST:PORT such as 127.0.0.1:9464"),
    })?;
    let bound = http
        .server_addr()
        .to_ip()
        .ok_or_else(|| ConfigError::Metrics {
            addr: addr.to_string(),
            why: "not a TCP address".into(),
        })?;
    // The registry moves into the thread that serves it; the histograms are shared handles.
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for req in http.incoming_requests() {
                let reply = if req.url() == "/metrics" {
                    let mut text = String::new();
                    let encoded = prometheus_client::encoding::text::encode(&mut text, &reg);
                    match encoded {
                        Ok(()) => tiny_http::Response::from_string(text).with_header(
                            tiny_http::Header::from_bytes(
                                "Content-Type",
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            )
                            .expect("a valid header"),
                        ),
                        Err(_) => tiny_http::Response::from_string("encoding failed\n")
                            .with_status_code(500),
                    }
                } else {
                    tiny_http::Response::from_string("try /metrics\n").with_status_code(404)
                };
                let _ = req.respond(reply);
            }
        })
        .map_err(|e| Error::Other(format!("cannot start the metrics thread: {e}")))?;
    Ok((m, bound))
}
