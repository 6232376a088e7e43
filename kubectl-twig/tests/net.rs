//! `kubectl twig net POD` run by the real kubectl v1.30 against the test API
//! server, with the controller's own metrics server (`twig_controller::metrics`)
//! on 127.0.0.1 as the controller of each node, behind the chart's Service's
//! EndpointSlices and reached through the API server's pod proxy.

mod common;

use twig_controller_testkit as support;

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use kube::Client;
use serde_json::{json, Value};
use twig_controller::metrics::Metrics;
use twig_controller::shim::NetworkCounter;

use common::Plugin;
use support::NS;

/// The namespace of the controller (the plugin's default).
const CONTROLLER_NS: &str = "twig-system";

fn counter(reason: &str, dropped: bool, packets: u64, bytes: u64) -> NetworkCounter {
    NetworkCounter {
        reason: reason.to_string(),
        dropped,
        packets,
        bytes,
    }
}

/// The controller of one node: its metrics server, its pod, its endpoint.
struct Controller {
    metrics: Arc<Metrics>,
    pod: String,
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts the controller of `node`: its metrics server on 127.0.0.1, its pod
/// in the controller's namespace (with that IP and port), and, when `ready`
/// says so, its endpoint in an EndpointSlice of the Service `twig-controller`.
async fn controller(client: &Client, node: &str, ready: Option<bool>) -> Controller {
    let metrics = Arc::new(Metrics::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind metrics");
    let port = listener.local_addr().expect("metrics addr").port();
    let task = tokio::spawn(twig_controller::metrics::serve(listener, metrics.clone()));
    let pod = format!("twig-controller-{node}");
    let pods: Api<Pod> = Api::namespaced(client.clone(), CONTROLLER_NS);
    let created = pods
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": pod, "labels": {"app.kubernetes.io/name": "twig-controller"}},
                "spec": {"nodeName": node, "containers": [{
                    "name": "controller", "image": "twig-controller",
                    "ports": [{"name": "metrics", "containerPort": port}],
                }]},
            }))
            .expect("pod"),
        )
        .await
        .expect("create the controller pod");
    let mut with_ip = created.clone();
    with_ip.status =
        serde_json::from_value(json!({"phase": "Running", "podIP": "127.0.0.1"})).expect("status");
    pods.replace_status(&pod, &PostParams::default(), &with_ip)
        .await
        .expect("the controller pod's IP");
    if let Some(ready) = ready {
        endpoint_slice(client, node, &pod, port, ready).await;
    }
    Controller {
        metrics,
        pod,
        port,
        task,
    }
}

/// An EndpointSlice of the Service `twig-controller` with one endpoint, as
/// the EndpointSlice controller writes it (one slice per port set).
async fn endpoint_slice(client: &Client, node: &str, pod: &str, port: u16, ready: bool) {
    let slice: EndpointSlice = serde_json::from_value(json!({
        "metadata": {
            "name": format!("twig-controller-{node}"),
            "labels": {"kubernetes.io/service-name": "twig-controller"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": port, "protocol": "TCP"}],
        "endpoints": [{
            "addresses": ["127.0.0.1"],
            "nodeName": node,
            "conditions": {"ready": ready},
            "targetRef": {"kind": "Pod", "namespace": CONTROLLER_NS, "name": pod},
        }],
    }))
    .expect("slice");
    Api::<EndpointSlice>::namespaced(client.clone(), CONTROLLER_NS)
        .create(&PostParams::default(), &slice)
        .await
        .expect("create the EndpointSlice");
}

const TABLE: &str = "\
VERDICT   REASON      PACKETS   BYTES
drop      deny_rule   3         180
drop      metadata    7         420
pass      egress      42        4200
";

/// Two nodes, each with its controller; pod `redis` runs on node-b.
async fn two_nodes(client: &Client) -> (Controller, Controller) {
    let a = controller(client, "node-a", Some(true)).await;
    let b = controller(client, "node-b", Some(true)).await;
    support::running_pod(client, "redis", "node-b").await;
    // What node-b's controller read from the pod's shim, with another pod of
    // node-b and a pod of the same name in another namespace.
    b.metrics.set_pod_network(
        NS,
        "redis",
        vec![
            counter("egress", false, 42, 4200),
            counter("metadata", true, 7, 420),
            counter("deny_rule", true, 3, 180),
        ],
    );
    b.metrics
        .set_pod_network(NS, "web", vec![counter("egress", false, 1000, 99999)]);
    b.metrics
        .set_pod_network("other", "redis", vec![counter("spoofed_ip", true, 5, 5)]);
    a.metrics
        .set_pod_network(NS, "elsewhere", vec![counter("egress", false, 8, 8)]);
    (a, b)
}

#[tokio::test(flavor = "multi_thread")]
async fn net_shows_the_pods_counters_from_the_controller_of_its_node() {
    let server = support::api_server().await;
    let client = server.client();
    let _controllers = two_nodes(&client).await;
    let plugin = Plugin::new(&server);
    // The Service proxy would answer from either node's controller, one
    // request after the other; the pod proxy of node-b's always has them.
    for _ in 0..3 {
        assert_eq!(plugin.ok(&["net", "redis"]).await, TABLE);
    }
    assert_eq!(plugin.ok(&["net", "redis", "-n", NS]).await, TABLE);

    let json: Value =
        serde_json::from_str(&plugin.ok(&["net", "redis", "-o", "json"]).await).expect("json");
    assert_eq!(
        json,
        json!({
            "namespace": NS, "pod": "redis", "node": "node-b",
            "controller": "twig-system/twig-controller-node-b",
            "counters": [
                {"verdict": "drop", "reason": "deny_rule", "packets": 3, "bytes": 180},
                {"verdict": "drop", "reason": "metadata", "packets": 7, "bytes": 420},
                {"verdict": "pass", "reason": "egress", "packets": 42, "bytes": 4200},
            ],
        })
    );
    let yaml = plugin.ok(&["net", "redis", "-o", "yaml"]).await;
    let from_yaml: Value = serde_saphyr::from_str(&yaml).expect("yaml");
    assert_eq!(from_yaml, json);
}

#[tokio::test(flavor = "multi_thread")]
async fn net_follows_the_controllers_port_flags() {
    let server = support::api_server().await;
    let client = server.client();
    let (_a, b) = two_nodes(&client).await;
    let plugin = Plugin::new(&server);
    let port = b.port.to_string();
    assert_eq!(
        plugin
            .ok(&["net", "redis", "--controller-port", &port])
            .await,
        TABLE
    );
    plugin
        .run(&["net", "redis", "--controller-port", "http"])
        .await
        .assert_error("no ready endpoint of the controller's Service twig-system/twig-controller with port http on node node-b");
    plugin
        .run(&["net", "redis", "--controller-namespace", "twig"])
        .await
        .assert_error("the controller's Service twig/twig-controller has no ready endpoints");
    plugin
        .run(&["net", "redis", "--controller-service", "metrics"])
        .await
        .assert_error("the controller's Service twig-system/metrics has no ready endpoints");
}

#[tokio::test(flavor = "multi_thread")]
async fn net_refuses_unknown_and_non_twig_pods() {
    let server = support::api_server().await;
    let client = server.client();
    let _controllers = two_nodes(&client).await;
    support::running_pod_with(&client, "plain", "node-b", false, &[]).await;
    let plugin = Plugin::new(&server);
    let run = plugin.run(&["net", "nope"]).await;
    run.assert_error("Error from server (NotFound): pods");
    run.assert_error("\"nope\" not found");
    plugin
        .run(&["net", "plain"])
        .await
        .assert_error("pod plain is not a Twig pod: its runtimeClassName is unset, not twig");
}

#[tokio::test(flavor = "multi_thread")]
async fn net_says_when_no_controller_serves_the_pods_node() {
    let server = support::api_server().await;
    let client = server.client();
    support::running_pod(&client, "redis", "node-b").await;
    let plugin = Plugin::new(&server);
    // No endpoints at all: no controller runs.
    plugin.run(&["net", "redis"]).await.assert_error(
        "the controller's Service twig-system/twig-controller has no ready endpoints",
    );
    // A controller, but not on the pod's node; then one on it, not ready.
    let _a = controller(&client, "node-a", Some(true)).await;
    let _b = controller(&client, "node-b", Some(false)).await;
    plugin.run(&["net", "redis"]).await.assert_error(
        "no ready endpoint of the controller's Service twig-system/twig-controller with port metrics on node node-b, where the pod runs",
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn net_says_when_the_pod_has_no_series_yet() {
    let server = support::api_server().await;
    let client = server.client();
    let _controllers = two_nodes(&client).await;
    support::running_pod(&client, "fresh", "node-b").await;
    let plugin = Plugin::new(&server);
    plugin.run(&["net", "fresh"]).await.assert_error(
        "no network counters for pod default/fresh yet: the controller on node node-b \
         (twig-system/twig-controller-node-b) reads them from the pod's VM every 15 s",
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn net_names_the_rbac_the_proxy_needs() {
    let server = support::api_server().await;
    let client = server.client();
    let (_a, b) = two_nodes(&client).await;
    server.forbid("get", "", "pods/proxy");
    let plugin = Plugin::new(&server);
    let run = plugin.run(&["net", "redis"]).await;
    run.assert_error(&format!(
        "Error from server (Forbidden): pods \"{}:{}\" is forbidden: \
         User \"system:anonymous\" cannot get resource \"pods/proxy\" in API group \"\" \
         in the namespace \"twig-system\"",
        b.pod, b.port
    ));
    run.assert_error("kubectl twig net needs get on pods/proxy and list on endpointslices.discovery.k8s.io in namespace twig-system");
    assert!(run.stdout.is_empty(), "{run:?}");

    let server = support::api_server().await;
    let client = server.client();
    let _controllers = two_nodes(&client).await;
    server.forbid("list", "discovery.k8s.io", "endpointslices");
    Plugin::new(&server)
        .run(&["net", "redis"])
        .await
        .assert_error("cannot list resource \"endpointslices\" in API group \"discovery.k8s.io\"");
}

#[tokio::test(flavor = "multi_thread")]
async fn net_reports_a_controller_that_does_not_answer() {
    let server = support::api_server().await;
    let client = server.client();
    let (_a, b) = two_nodes(&client).await;
    b.task.abort();
    let plugin = Plugin::new(&server);
    support::eventually("the metrics server to stop", || async {
        tokio::net::TcpStream::connect(("127.0.0.1", b.port))
            .await
            .is_err()
            .then_some(())
    })
    .await;
    let run = plugin.run(&["net", "redis"]).await;
    run.assert_error("Error from server (ServiceUnavailable): error trying to reach service");
    run.assert_error(&format!("127.0.0.1:{}", b.port));
}
