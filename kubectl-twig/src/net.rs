//! `kubectl twig net POD`: the pod's network counters, as the Twig
//! controller on the pod's node exports them (`twig_pod_network_packets_total`
//! and `twig_pod_network_bytes_total{namespace, pod, verdict, reason}`).
//!
//! The route is the API server's: the controller runs on every node
//! (a DaemonSet) and each one exports only its own node's pods, so the
//! plugin picks the endpoint of the controller's Service on the pod's node
//! (its EndpointSlices, `kubernetes.io/service-name`) and reads that pod's
//! `/metrics` through the pod proxy
//! (`/api/v1/namespaces/NS/pods/POD:PORT/proxy/metrics`). The Service proxy
//! would answer from any node's controller; the Service stays the way to
//! find the controllers (EndpointSlices: core `Endpoints` are deprecated
//! since Kubernetes 1.33). The price: `get pods/proxy` cannot be limited to
//! the controller's pods by name (a DaemonSet's pod names are generated),
//! so it reaches every pod of the controller's namespace, which holds only
//! Twig's own pods. A 503 through the proxy (the controller not answering)
//! is reported at once, never retried: kube's default retry policy would
//! back off for minutes.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use kube::Client;
use serde::Serialize;

use crate::cli::{DataOutput, NetArgs};
use crate::create::require_pod;
use crate::error::Error;
use crate::output::{print, table};
use crate::prom::{self, Sample};

/// The sample name of the packet counters.
const PACKETS: &str = "twig_pod_network_packets_total";
/// The sample name of the byte counters.
const BYTES: &str = "twig_pod_network_bytes_total";
/// How often the controller reads a pod's counters from its shim (its default).
const REFRESH: &str = "15 s";
/// What the metrics endpoint is asked for: OpenMetrics, else the Prometheus text format.
const ACCEPT: &str = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";

/// One row: the frames and bytes of one verdict and reason (`None`: no such series).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Counter {
    /// `pass` or `drop`.
    pub verdict: String,
    /// The rule or check that decided.
    pub reason: String,
    /// Frames.
    pub packets: Option<u64>,
    /// Bytes of those frames.
    pub bytes: Option<u64>,
}

/// What `-o json|yaml` prints.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Report<'a> {
    namespace: &'a str,
    pod: &'a str,
    node: &'a str,
    /// `NAMESPACE/POD` of the controller that answered.
    controller: String,
    counters: Vec<Counter>,
}

/// The controller pod on `node` behind the Service, and the port number of its metrics.
struct Backend {
    pod: String,
    port: i32,
}

/// `kubectl twig net POD`.
pub async fn net(client: Client, namespace: &str, args: NetArgs) -> Result<(), Error> {
    let pod = require_pod(&client, namespace, &args.pod).await?;
    let node = node_of(&pod, &args.pod)?;
    let backend = backend(&client, &args, &node).await?;
    let ctl_ns = &args.controller_namespace;
    let path = format!(
        "/api/v1/namespaces/{ctl_ns}/pods/{}:{}/proxy/metrics",
        backend.pod, backend.port
    );
    let request = http_get(&path)?;
    let text = client
        .request_text(request)
        .await
        .map_err(|e| proxy_error(e, ctl_ns))?;
    let samples = prom::parse(&text).map_err(|e| {
        Error::Client(format!(
            "the /metrics of controller {ctl_ns}/{} is not Prometheus text: {e}",
            backend.pod
        ))
    })?;
    let counters = counters_of(&samples, namespace, &args.pod);
    if counters.is_empty() {
        return Err(Error::NotFound(format!(
            "no network counters for pod {namespace}/{} yet: the controller on node {node} \
             ({ctl_ns}/{}) reads them from the pod's VM every {REFRESH}, from when its \
             network path is set up",
            args.pod, backend.pod
        )));
    }
    let text = match args.output {
        None => render_table(&counters),
        Some(format) => {
            let report = Report {
                namespace,
                pod: &args.pod,
                node: &node,
                controller: format!("{ctl_ns}/{}", backend.pod),
                counters,
            };
            match format {
                DataOutput::Json => serde_json::to_string_pretty(&report)
                    .map(|json| json + "\n")
                    .map_err(|e| Error::Output(e.to_string()))?,
                DataOutput::Yaml => {
                    serde_saphyr::to_string(&report).map_err(|e| Error::Output(e.to_string()))?
                }
            }
        }
    };
    print(&text)
}

/// The node the pod runs on.
fn node_of(pod: &Pod, name: &str) -> Result<String, Error> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .ok_or_else(|| {
            Error::Usage(format!(
                "pod {name} is not scheduled to a node yet: it has no network counters"
            ))
        })
}

/// The ready endpoint of the controller's Service on `node`.
async fn backend(client: &Client, args: &NetArgs, node: &str) -> Result<Backend, Error> {
    let ctl_ns = &args.controller_namespace;
    let service = &args.controller_service;
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), ctl_ns)
        .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={service}")))
        .await?;
    let mut ready = 0;
    for slice in &slices.items {
        let port = slice.ports.iter().flatten().find_map(|p| {
            let name = p.name.as_deref().unwrap_or_default();
            let matches = name == args.controller_port
                || p.port
                    .is_some_and(|n| n.to_string() == args.controller_port);
            matches.then_some(p.port).flatten()
        });
        for endpoint in slice.endpoints.iter().flatten() {
            let is_ready = endpoint
                .conditions
                .as_ref()
                .and_then(|c| c.ready)
                .unwrap_or(true);
            if !is_ready {
                continue;
            }
            ready += 1;
            let target = endpoint
                .target_ref
                .as_ref()
                .filter(|t| t.kind.as_deref() == Some("Pod"))
                .and_then(|t| t.name.clone());
            if let (Some(pod), Some(port), Some(true)) =
                (target, port, endpoint.node_name.as_ref().map(|n| n == node))
            {
                return Ok(Backend { pod, port });
            }
        }
    }
    let reason = if ready == 0 {
        format!(
            "the controller's Service {ctl_ns}/{service} has no ready endpoints: is Twig \
             installed in {ctl_ns} (--controller-namespace) and its controller running? \
             (kubectl -n {ctl_ns} get pods -l app.kubernetes.io/name=twig-controller)"
        )
    } else {
        format!(
            "no ready endpoint of the controller's Service {ctl_ns}/{service} with port {} \
             on node {node}, where the pod runs: its counters are only served there",
            args.controller_port
        )
    };
    Err(Error::Unavailable(reason))
}

fn http_get(path: &str) -> Result<http::Request<Vec<u8>>, Error> {
    http::Request::get(path)
        .header(http::header::ACCEPT, ACCEPT)
        .body(Vec::new())
        .map_err(|e| Error::Client(format!("the request for {path}: {e}")))
}

/// The API server's refusal, with what to grant when it is RBAC's.
fn proxy_error(error: kube::Error, ctl_ns: &str) -> Error {
    match error {
        kube::Error::Api(mut status) if status.code == 403 => {
            status.message = format!(
                "{} (kubectl twig net needs get on pods/proxy and list on \
                 endpointslices.discovery.k8s.io in namespace {ctl_ns}: the chart's Role \
                 twig-network-viewer)",
                status.message
            );
            Error::Server(status)
        }
        other => other.into(),
    }
}

/// The rows of `pod` in `namespace`, sorted by verdict and reason.
fn counters_of(samples: &[Sample], namespace: &str, pod: &str) -> Vec<Counter> {
    let mut rows: BTreeMap<(String, String), Counter> = BTreeMap::new();
    for sample in samples {
        let is_packets = match sample.name.as_str() {
            PACKETS => true,
            BYTES => false,
            _ => continue,
        };
        let label = |name: &str| sample.labels.get(name).map(String::as_str);
        if label("namespace") != Some(namespace) || label("pod") != Some(pod) {
            continue;
        }
        let verdict = label("verdict").unwrap_or_default().to_string();
        let reason = label("reason").unwrap_or_default().to_string();
        let row = rows
            .entry((verdict.clone(), reason.clone()))
            .or_insert(Counter {
                verdict,
                reason,
                packets: None,
                bytes: None,
            });
        if is_packets {
            row.packets = sample.count();
        } else {
            row.bytes = sample.count();
        }
    }
    rows.into_values().collect()
}

fn render_table(counters: &[Counter]) -> String {
    let count = |c: Option<u64>| c.map_or_else(|| "-".to_string(), |n| n.to_string());
    let mut rows = vec![vec![
        "VERDICT".to_string(),
        "REASON".to_string(),
        "PACKETS".to_string(),
        "BYTES".to_string(),
    ]];
    rows.extend(counters.iter().map(|c| {
        vec![
            c.verdict.clone(),
            c.reason.clone(),
            count(c.packets),
            count(c.bytes),
        ]
    }));
    table(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_pods_rows_sorted() {
        let text = "\
twig_pod_network_packets_total{namespace=\"a\",pod=\"p\",verdict=\"pass\",reason=\"allowed\"} 10\n\
twig_pod_network_bytes_total{namespace=\"a\",pod=\"p\",verdict=\"pass\",reason=\"allowed\"} 1000\n\
twig_pod_network_packets_total{namespace=\"a\",pod=\"p\",verdict=\"drop\",reason=\"metadata\"} 2\n\
twig_pod_network_packets_total{namespace=\"a\",pod=\"q\",verdict=\"drop\",reason=\"metadata\"} 5\n\
twig_pod_network_packets_total{namespace=\"b\",pod=\"p\",verdict=\"drop\",reason=\"metadata\"} 6\n\
twig_operation_duration_seconds_count{operation=\"snapshot\",result=\"success\"} 1\n";
        let samples = prom::parse(text).expect("parse");
        let rows = counters_of(&samples, "a", "p");
        assert_eq!(
            rows,
            vec![
                Counter {
                    verdict: "drop".into(),
                    reason: "metadata".into(),
                    packets: Some(2),
                    bytes: None
                },
                Counter {
                    verdict: "pass".into(),
                    reason: "allowed".into(),
                    packets: Some(10),
                    bytes: Some(1000)
                },
            ]
        );
        assert_eq!(
            render_table(&rows),
            "VERDICT   REASON     PACKETS   BYTES\n\
             drop      metadata   2         -\n\
             pass      allowed    10        1000\n"
        );
    }
}
