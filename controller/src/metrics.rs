//! Prometheus metrics: operation durations and counts by result, served as
//! OpenMetrics text on `GET /metrics`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

/// Labels of every operation metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    /// snapshot, rollback, clone, template, delete_snapshot, delete_template.
    pub operation: String,
    /// success or failure.
    pub result: String,
}

type HistogramFamily = Family<OperationLabels, Histogram, fn() -> Histogram>;

fn new_histogram() -> Histogram {
    // 1 ms … ~33 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// The controller's metrics.
pub struct Metrics {
    registry: Registry,
    durations: HistogramFamily,
    operations: Family<OperationLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Empty metrics, registered under the `twig` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("twig");
        let durations: HistogramFamily = Family::new_with_constructor(new_histogram);
        let operations = Family::<OperationLabels, Counter>::default();
        registry.register(
            "operation_duration_seconds",
            "Duration of snapshot, rollback, clone and template operations",
            durations.clone(),
        );
        registry.register(
            "operations",
            "Operations finished, by result",
            operations.clone(),
        );
        Self {
            registry,
            durations,
            operations,
        }
    }

    /// Records one finished operation.
    pub fn observe(&self, operation: &str, success: bool, seconds: f64) {
        let labels = OperationLabels {
            operation: operation.to_string(),
            result: if success { "success" } else { "failure" }.to_string(),
        };
        self.durations.get_or_create(&labels).observe(seconds);
        self.operations.get_or_create(&labels).inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

fn respond(metrics: &Metrics, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => match metrics.encode() {
            Ok(text) => (
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                text,
            ),
            Err(e) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain",
                e.to_string(),
            ),
        },
        (&Method::GET, "/healthz") => (StatusCode::OK, "text/plain", "ok\n".to_string()),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found\n".to_string(),
        ),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        resp.headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    resp
}

/// Pause after a failed `accept` (e.g. out of file descriptors), so the
/// loop does not spin while the condition lasts.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Serves `/metrics` and `/healthz` on `listener` until the task is dropped.
/// A failed `accept` (the process out of file descriptors, a connection
/// reset before it was accepted) is logged and the server goes on.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a metrics connection failed; going on");
                tokio::time::sleep(ACCEPT_RETRY).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let resp = respond(&metrics, &req);
                async move { Ok::<_, Infallible>(resp) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, error = %e, "metrics connection ended");
            }
        });
    }
}
