//! Test support: the in-repo API server, the CRD schema checks, a fake node,
//! and helpers to run controllers and wait for outcomes.

pub mod admission;
pub mod apiserver;
pub mod fake;
pub mod kube_tools;
pub mod rbac;
pub mod schema;
pub mod ssa;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Node, Pod, PodCondition, PodSpec, PodStatus};
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::{Api, Client};
use tokio::task::JoinHandle;
use twig_controller::crd::{
    DeletionPolicy, Phase, Snapshot, SnapshotMode, SnapshotSpec, CLONE_LABEL,
};
use twig_controller::metrics::Metrics;
use twig_controller::Context;

use apiserver::TestApiServer;
use fake::FakeNode;

/// The namespace every helper works in.
pub const NS: &str = "default";

/// A test API server that admits objects against the checked-in CRDs.
pub async fn api_server() -> TestApiServer {
    api_server_with(schema::load()).await
}

/// A test API server that admits objects against `crds`.
pub async fn api_server_with(crds: schema::Crds) -> TestApiServer {
    let docs = crds
        .by_plural
        .iter()
        .map(|(plural, crd)| (plural.clone(), crd.doc.clone()))
        .collect();
    TestApiServer::start_with(Some(crds.validator()), docs).await
}

/// A controller process for `node`; aborting the handle is a crash.
pub struct Controller {
    /// The controller's task.
    pub task: JoinHandle<()>,
    /// Its metrics registry.
    pub metrics: Arc<Metrics>,
    /// Its context (traits, timings).
    pub ctx: Arc<Context>,
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The actor name of controller clients in [`TestApiServer::accesses`].
pub const CONTROLLER: &str = "controller";

/// The chart's release namespace in the tests, and the username of its
/// controller's ServiceAccount there: every controller's requests carry it.
pub const CHART_NAMESPACE: &str = "twig-system";
/// See [`CHART_NAMESPACE`].
pub const CONTROLLER_USER: &str = "system:serviceaccount:twig-system:twig-controller";

/// Enforces the chart's ValidatingAdmissionPolicies (its `admission.yaml`,
/// rendered by the real Helm for namespace [`CHART_NAMESPACE`]) on
/// `server`: the controllers' writes must pass them as they would in a cluster.
pub fn enforce_chart_policies(server: &TestApiServer) {
    enforce_chart_policies_with(server, &[]);
}

/// [`enforce_chart_policies`] of the chart rendered with these values
/// (`key=value`, as `helm --set` takes them).
pub fn enforce_chart_policies_with(server: &TestApiServer, values: &[&str]) {
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/twig");
    let mut helm = std::process::Command::new(kube_tools::helm());
    helm.args(["template", "twig"])
        .arg(chart)
        .args(["--namespace", CHART_NAMESPACE])
        .args(["--show-only", "templates/admission.yaml"]);
    for value in values {
        helm.args(["--set", value]);
    }
    let rendered = kube_tools::succeed(&mut helm);
    let docs: Vec<serde_json::Value> = rendered
        .split("\n---")
        .filter(|doc| {
            doc.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .map(|doc| serde_saphyr::from_str(doc).expect("the chart's YAML"))
        .collect();
    let policies: Vec<&serde_json::Value> = docs
        .iter()
        .filter(|d| d["kind"] == "ValidatingAdmissionPolicy")
        .collect();
    assert!(!policies.is_empty(), "the chart has no policies");
    for policy in policies {
        let name = &policy["metadata"]["name"];
        let binding = docs
            .iter()
            .find(|d| {
                d["kind"] == "ValidatingAdmissionPolicyBinding" && d["spec"]["policyName"] == *name
            })
            .unwrap_or_else(|| panic!("policy {name} is not bound"));
        server.enforce(policy.clone(), binding.clone());
    }
}

/// Starts a controller for `node` against `server`, behind the fake node `fake`, with short retry, recheck, orphan-check, network- and store-refresh and backoff periods.
/// Its requests are [`CONTROLLER`]'s, as [`CONTROLLER_USER`] with a token
/// bound to a pod on `node` (`authentication.kubernetes.io/node-name`).
pub fn start_controller(server: &TestApiServer, node: &str, fake: &Arc<FakeNode>) -> Controller {
    start_controller_with(server, node, fake, |ctx| ctx)
}

/// [`start_controller`] with its context changed by `configure` first
/// (e.g. `|c| c.with_registry(…)`).
pub fn start_controller_with(
    server: &TestApiServer,
    node: &str,
    fake: &Arc<FakeNode>,
    configure: impl FnOnce(Context) -> Context,
) -> Controller {
    let pod = format!("twig-controller-{node}");
    let client = server.client_as_user(
        CONTROLLER,
        CONTROLLER_USER,
        &[
            ("authentication.kubernetes.io/node-name", node),
            ("authentication.kubernetes.io/pod-name", &pod),
        ],
    );
    let (locator, shim, node_service) = fake::as_traits(fake);
    let metrics = Arc::new(Metrics::new());
    let ctx = Context::new(
        client.clone(),
        node.to_string(),
        locator,
        shim,
        node_service,
        metrics.clone(),
    )
    .with_retry(Duration::from_millis(200))
    .with_recheck(Duration::from_millis(300))
    .with_orphan_check(Duration::from_millis(200))
    .with_network_refresh(Duration::from_millis(200))
    .with_store_refresh(Duration::from_millis(200))
    .with_backoff(Duration::from_millis(100), Duration::from_millis(800));
    let ctx = Arc::new(configure(ctx));
    let task = tokio::spawn(twig_controller::run(ctx.clone()));
    Controller { task, metrics, ctx }
}

/// The pods of Clone `clone` in [`NS`], once there are `replicas` of them.
pub async fn clone_pods(client: &Client, clone: &str, replicas: usize) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let selector = format!("{CLONE_LABEL}={clone}");
    eventually(&format!("{replicas} pods of {clone}"), || {
        let pods = pods.clone();
        let selector = selector.clone();
        async move {
            let l = pods
                .list(&ListParams::default().labels(&selector))
                .await
                .ok()?;
            (l.items.len() == replicas).then_some(l.items)
        }
    })
    .await
}

/// Polls `check` until it returns `Some`, failing the test after 30 s.
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Creates a running, Ready Twig pod on `node` (as the scheduler and kubelet would).
pub async fn running_pod(client: &Client, name: &str, node: &str) -> Pod {
    running_pod_with(client, name, node, true, &[]).await
}

/// Creates a running, Ready pod on `node` with label `app: redis` and these
/// annotations, under RuntimeClass `twig` when `twig` (else runc's default).
pub async fn running_pod_with(
    client: &Client,
    name: &str,
    node: &str,
    twig: bool,
    annotations: &[(&str, String)],
) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some([("app".to_string(), "redis".to_string())].into()),
            annotations: (!annotations.is_empty()).then(|| {
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.clone()))
                    .collect()
            }),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.to_string()),
            runtime_class_name: twig.then(|| "twig".to_string()),
            containers: vec![Container {
                name: "redis".to_string(),
                image: Some("redis:7".to_string()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    };
    let created = pods
        .create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    mark_ready(client, &created).await
}

/// Sets a pod Running and Ready, as its kubelet would.
pub async fn mark_ready(client: &Client, pod: &Pod) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut pod = pod.clone();
    pod.status = Some(PodStatus {
        phase: Some("Running".to_string()),
        conditions: Some(vec![PodCondition {
            type_: "Ready".to_string(),
            status: "True".to_string(),
            ..Default::default()
        }]),
        ..Default::default()
    });
    let name = pod.metadata.name.clone().expect("pod name");
    pods.replace_status(&name, &PostParams::default(), &pod)
        .await
        .expect("pod status")
}

/// Reasons of the Events about the object named `name`, in creation order.
pub async fn event_reasons(client: &Client, name: &str) -> Vec<String> {
    events_about(client, name)
        .await
        .into_iter()
        .filter_map(|e| e.reason)
        .collect()
}

/// Waits until the Events about `name` have exactly these reasons, in order.
pub async fn expect_reasons(client: &Client, name: &str, expected: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = event_reasons(client, name).await;
        if seen == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "events about {name}: expected {expected:?}, saw {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The Events about the object named `name`, oldest first.
pub async fn events_about(client: &Client, name: &str) -> Vec<Event> {
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let mut list: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .expect("list events")
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .collect();
    list.sort_by_key(|e| {
        e.metadata
            .resource_version
            .as_ref()
            .and_then(|rv| rv.parse::<u64>().ok())
    });
    list
}

/// Creates a namespaced object in [`NS`].
pub async fn create<K>(client: &Client, obj: &K) -> K
where
    K: kube::Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), NS);
    api.create(&PostParams::default(), obj)
        .await
        .expect("create")
}

/// Waits until the object `name` in [`NS`] satisfies `done`, and returns it.
pub async fn wait_for<K>(client: &Client, name: &str, what: &str, done: impl Fn(&K) -> bool) -> K
where
    K: kube::Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), NS);
    let done = &done;
    eventually(&format!("{name}: {what}"), || {
        let api = api.clone();
        async move { api.get(name).await.ok().filter(|o| done(o)) }
    })
    .await
}

/// Waits until the object `name` in [`NS`] no longer exists.
pub async fn wait_gone<K>(client: &Client, name: &str)
where
    K: kube::Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), NS);
    eventually(&format!("{name} deleted"), || {
        let api = api.clone();
        async move { matches!(api.get_opt(name).await, Ok(None)).then_some(()) }
    })
    .await;
}

/// Registers a Node object, as a kubelet does.
pub async fn register_node(client: &Client, name: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    let node = Node {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        ..Default::default()
    };
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create node");
}

/// Deletes a Node object, as the cloud's node lifecycle controller does when the machine is gone.
pub async fn delete_node(client: &Client, name: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .delete(name, &kube::api::DeleteParams::default())
        .await
        .expect("delete node");
}

/// A Snapshot `name` of pod `pod` with the defaults: incremental, its data
/// deleted with it, no TTL, no deadline, the pod's UID pinned by the
/// controller.
pub fn snapshot(name: &str, pod: &str) -> Snapshot {
    Snapshot::new(
        name,
        SnapshotSpec {
            pod_name: pod.to_string(),
            pod_uid: None,
            mode: SnapshotMode::Incremental,
            deletion_policy: DeletionPolicy::Delete,
            ttl_seconds_after_ready: None,
            failure_deadline_seconds: None,
            export: false,
        },
    )
}

/// The Snapshot `name` once it is in `phase`.
pub async fn snapshot_in(client: &Client, name: &str, phase: Phase) -> Snapshot {
    wait_for(client, name, &format!("{phase}"), |s: &Snapshot| {
        s.status.as_ref().is_some_and(|st| st.phase == phase)
    })
    .await
}
