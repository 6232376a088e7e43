//! Prometheus metrics: operation durations and counts by result, the
//! network counters of this node's pods, and this node's store usage,
//! served as OpenMetrics text on `GET /metrics`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::shim::{NetworkCounter, StoreUsage};

/// Labels of every operation metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    /// snapshot, rollback, clone, template, delete_snapshot, delete_template.
    pub operation: String,
    /// success or failure.
    pub result: String,
}

/// Labels of the pod network counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodNetworkLabels {
    namespace: String,
    pod: String,
    /// `pass` or `drop`.
    verdict: &'static str,
    reason: String,
}

/// Labels of the node-store gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
}

type StoreGauge = Family<NodeLabels, Gauge<u64, AtomicU64>>;

/// The gauges of the node store, by node: what the node daemon last
/// answered to `GetStoreUsage`.
#[derive(Default)]
struct StoreGauges {
    bytes: StoreGauge,
    capacity_bytes: StoreGauge,
    free_bytes: StoreGauge,
    snapshots: StoreGauge,
    templates: StoreGauge,
}

impl StoreGauges {
    fn register(&self, registry: &mut Registry) {
        let gauges: [(&str, &str, &StoreGauge); 5] = [
            (
                "node_store_bytes",
                "Bytes allocated by the node store's files (st_blocks; a block shared by reflink counts in each file)",
                &self.bytes,
            ),
            (
                "node_store_capacity_bytes",
                "Size of the filesystem holding the node store",
                &self.capacity_bytes,
            ),
            (
                "node_store_free_bytes",
                "Bytes still available on the filesystem holding the node store",
                &self.free_bytes,
            ),
            (
                "node_store_snapshots",
                "Snapshots in the node store, templates not included",
                &self.snapshots,
            ),
            (
                "node_store_templates",
                "Templates in the node store",
                &self.templates,
            ),
        ];
        for (name, help, gauge) in gauges {
            registry.register(name, help, gauge.clone());
        }
    }

    fn all(&self) -> [&StoreGauge; 5] {
        [
            &self.bytes,
            &self.capacity_bytes,
            &self.free_bytes,
            &self.snapshots,
            &self.templates,
        ]
    }
}

/// Namespace and name of a pod.
type PodKey = (String, String);

/// A family of pod network counters: its name, its help and its value.
type NetworkFamily = (&'static str, &'static str, fn(&NetworkCounter) -> u64);

/// The last counters read from each pod's shim, encoded on every scrape as
/// `twig_pod_network_packets_total` and `twig_pod_network_bytes_total`.
/// The values are the shim's own running totals (a collector, not
/// `Counter`s: the controller mirrors them, it does not count).
#[derive(Debug, Default)]
struct PodNetworkCollector {
    pods: Mutex<BTreeMap<PodKey, Vec<NetworkCounter>>>,
}

impl PodNetworkCollector {
    fn pods(&self) -> MutexGuard<'_, BTreeMap<PodKey, Vec<NetworkCounter>>> {
        self.pods
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Collector for PodNetworkCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let pods = self.pods();
        let families: [NetworkFamily; 2] = [
            (
                "pod_network_packets",
                "Frames through a pod's network path, by verdict and reason",
                |c| c.packets,
            ),
            (
                "pod_network_bytes",
                "Bytes through a pod's network path, by verdict and reason",
                |c| c.bytes,
            ),
        ];
        for (name, help, value) in families {
            let counter_type = ConstCounter::new(0_u64).metric_type();
            let mut family = encoder.encode_descriptor(name, help, None, counter_type)?;
            for ((namespace, pod), counters) in pods.iter() {
                for counter in counters {
                    let labels = PodNetworkLabels {
                        namespace: namespace.clone(),
                        pod: pod.clone(),
                        verdict: if counter.dropped { "drop" } else { "pass" },
                        reason: counter.reason.clone(),
                    };
                    ConstCounter::new(value(counter)).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        Ok(())
    }
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
    pod_network: Arc<PodNetworkCollector>,
    store: StoreGauges,
    gc_reclaimed_bytes: Family<NodeLabels, Counter>,
    gc_deleted: Family<NodeLabels, Counter>,
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
        let pod_network = Arc::new(PodNetworkCollector::default());
        registry.register_collector(Box::new(pod_network.clone()));
        let store = StoreGauges::default();
        store.register(&mut registry);
        let gc_reclaimed_bytes = Family::<NodeLabels, Counter>::default();
        registry.register(
            "node_store_gc_reclaimed_bytes",
            "Bytes the node store's garbage collector gave back (allocated bytes of the snapshots it deleted)",
            gc_reclaimed_bytes.clone(),
        );
        let gc_deleted = Family::<NodeLabels, Counter>::default();
        registry.register(
            "node_store_gc_deleted_snapshots",
            "Snapshots the node store's garbage collector deleted (nothing referred to them)",
            gc_deleted.clone(),
        );
        Self {
            registry,
            durations,
            operations,
            pod_network,
            store,
            gc_reclaimed_bytes,
            gc_deleted,
        }
    }

    /// Records what node `node`'s daemon answered about its store.
    pub fn set_store_usage(&self, node: &str, usage: &StoreUsage) {
        let labels = NodeLabels {
            node: node.to_string(),
        };
        let g = &self.store;
        g.bytes.get_or_create(&labels).set(usage.allocated_bytes);
        g.capacity_bytes
            .get_or_create(&labels)
            .set(usage.capacity_bytes);
        g.free_bytes.get_or_create(&labels).set(usage.free_bytes);
        g.snapshots.get_or_create(&labels).set(usage.snapshots);
        g.templates.get_or_create(&labels).set(usage.templates);
    }

    /// Drops node `node`'s store series (its daemon did not answer: no
    /// stale numbers are exported).
    pub fn remove_store_usage(&self, node: &str) {
        let labels = NodeLabels {
            node: node.to_string(),
        };
        for gauge in self.store.all() {
            gauge.remove(&labels);
        }
    }

    /// Counts what one garbage collection of node `node`'s store deleted
    /// (the series exist from the first collection on, zero included).
    pub fn add_store_gc(&self, node: &str, deleted: u64, reclaimed_bytes: u64) {
        let labels = NodeLabels {
            node: node.to_string(),
        };
        self.gc_deleted.get_or_create(&labels).inc_by(deleted);
        self.gc_reclaimed_bytes
            .get_or_create(&labels)
            .inc_by(reclaimed_bytes);
    }

    /// Records the network counters last read from a pod's shim (they
    /// replace what was recorded for the pod before).
    pub fn set_pod_network(&self, namespace: &str, pod: &str, counters: Vec<NetworkCounter>) {
        self.pod_network
            .pods()
            .insert((namespace.to_string(), pod.to_string()), counters);
    }

    /// Drops a pod's network series (the pod is gone, or has no network path).
    pub fn remove_pod_network(&self, namespace: &str, pod: &str) {
        self.pod_network
            .pods()
            .remove(&(namespace.to_string(), pod.to_string()));
    }

    /// Keeps the network series only of the pods `keep(namespace, name)` is true for.
    pub fn retain_pod_network(&self, mut keep: impl FnMut(&str, &str) -> bool) {
        self.pod_network
            .pods()
            .retain(|(namespace, pod), _| keep(namespace, pod));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_collections_add_up_per_node() {
        let m = Metrics::new();
        m.add_store_gc("n1", 0, 0);
        let text = m.encode().unwrap();
        assert!(
            text.contains("twig_node_store_gc_reclaimed_bytes_total{node=\"n1\"} 0"),
            "{text}"
        );
        m.add_store_gc("n1", 2, 4096);
        m.add_store_gc("n1", 1, 1000);
        let text = m.encode().unwrap();
        assert!(
            text.contains("twig_node_store_gc_reclaimed_bytes_total{node=\"n1\"} 5096"),
            "{text}"
        );
        assert!(
            text.contains("twig_node_store_gc_deleted_snapshots_total{node=\"n1\"} 3"),
            "{text}"
        );
    }
}
