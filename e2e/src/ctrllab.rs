//! The controller against a real node, for the lab tests that drive Twig
//! through its Kubernetes objects: a CRI node ([`CriNode`]: containerd,
//! twig-snapshotter, twig-node, the twig shim), the controller testkit's
//! API server standing in for kube-apiserver (the controller's generated
//! CRDs admitted), the test kubelet ([`Kubelet`]) running the node's pods
//! through CRI, and twig-controller (`run`, with the real `TtrpcShim`,
//! `ContainerdLocator` on CRI's task directory and `TtrpcNode` on the
//! node's twig-node socket). Every wait polls with a deadline.

use std::future::Future;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use kube::api::{DeleteParams, ListParams, ObjectMeta};
use kube::{Api, Client, Resource};
use tokio::task::JoinHandle;
use twig_controller::crd::{
    DeletionPolicy, Phase, Snapshot, SnapshotMode, SnapshotSpec, SnapshotStatus, RUNTIME_CLASS,
};
use twig_controller::metrics::Metrics;
use twig_controller::sandbox::ContainerdLocator;
use twig_controller::shim::{TtrpcNode, TtrpcShim};
use twig_controller::Context;
use twig_controller_testkit::apiserver::TestApiServer;
use twig_controller_testkit::{self as testkit, schema, CONTROLLER, NS};
use twig_cri::CriClient;

use crate::cri::{CriNode, CRI_NAMESPACE};
use crate::kubelet::{container_id, sandbox_of, Kubelet};
use crate::IMAGE_REF;

/// The lab node's name in the API server.
pub const NODE: &str = "lab-node";
/// Deadline of a shim or node call (a full snapshot of the lab's 128 MiB
/// guest under TCG takes seconds).
pub const CALL: Duration = Duration::from_secs(300);
/// Deadline of a pod coming up or an object getting Ready (the node's first
/// twig pod builds the base template; the lab is 10–50× slower than a host).
pub const READY: Duration = Duration::from_secs(400);
/// Deadline of an exec in a container.
pub const EXEC: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(200);
/// How long a teardown wait runs before containerd's stacks are taken.
const STACKS_AFTER: Duration = Duration::from_secs(150);

/// A twig pod in the test namespace, bound to [`NODE`] (as the scheduler
/// binds it), with the one container `container`.
pub fn twig_pod(name: &str, container: Container) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(NODE.into()),
            runtime_class_name: Some(RUNTIME_CLASS.into()),
            containers: vec![container],
            ..Default::default()
        }),
        status: None,
    }
}

/// Puts `pod` on the node's network (`hostNetwork`: no CNI, no eBPF path
/// to load) and, since a VM cannot use the node's network, asks the twig
/// runtime for a VM without one (`twig.dev/network: none`).
pub fn offline(pod: &mut Pod) {
    if let Some(spec) = pod.spec.as_mut() {
        spec.host_network = Some(true);
    }
    pod.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(
            twig_controller::crd::NETWORK_ANNOTATION.into(),
            twig_controller::crd::NETWORK_NONE.into(),
        );
}

/// Polls `check` until it returns `Some`, failing after `within`.
pub async fn until<T, F, Fut>(what: &str, within: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    poll(within, check)
        .await
        .unwrap_or_else(|| panic!("timed out after {within:?} waiting for {what}"))
}

/// Polls `check` until it returns `Some`; `None` after `within`.
async fn poll<T, F, Fut>(within: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// A node, the API server, the kubelet and the controller; the controller
/// stops when this is dropped, then the node.
pub struct CtrlLab {
    /// The CRI node.
    pub node: CriNode,
    /// A CRI client on the node's containerd.
    pub cri: CriClient,
    /// An admin client of the API server.
    pub client: Client,
    /// The controller's metrics (its `/metrics` text).
    pub metrics: Arc<Metrics>,
    /// When the lab started (for [`CtrlLab::step`]).
    pub t0: Instant,
    name: &'static str,
    controller: JoinHandle<()>,
    kubelet: Kubelet,
    _server: TestApiServer,
}

impl CtrlLab {
    /// Starts everything; the kubelet runs [`IMAGE_REF`] and `images`
    /// (`(OCI archive, its reference)`), imported into CRI first. `name`
    /// prefixes the progress lines.
    pub async fn start(name: &'static str, images: &[(&Path, &str)]) -> CtrlLab {
        CtrlLab::start_with(name, images, CALL).await
    }

    /// [`CtrlLab::start`] with its and the kubelet's CRI calls given `call` each
    /// (a real kubelet gives RunPodSandbox 4 min and retries; this one
    /// does not retry, so a benchmark starting 64 pods on one node's
    /// queue gives it longer).
    pub async fn start_with(
        name: &'static str,
        images: &[(&Path, &str)],
        call: Duration,
    ) -> CtrlLab {
        let t0 = Instant::now();
        let node = CriNode::start().unwrap_or_else(|e| panic!("CRI node: {e}"));
        for (archive, _) in images {
            node.import_image(archive)
                .unwrap_or_else(|e| panic!("importing {}: {e}", archive.display()));
        }
        let cri = node
            .client()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .with_timeout(call);
        // Where the tests run (the lab) the source tree is not: the CRDs the
        // server admits against are the controller's own, as generated.
        let server = testkit::api_server_with(schema::generated()).await;
        let client = server.client();
        testkit::register_node(&client, NODE).await;
        let dir = node
            .node()
            .dir()
            .unwrap_or_else(|e| panic!("{e}"))
            .to_path_buf();
        let refs: Vec<&str> = std::iter::once(IMAGE_REF)
            .chain(images.iter().map(|(_, r)| *r))
            .collect();
        let kubelet = Kubelet::start(
            server.client_as("kubelet"),
            NODE,
            cri.clone(),
            &refs,
            &dir.join("kubelet-pods"),
        );
        let metrics = Arc::new(Metrics::new());
        let ctx = Context::new(
            server.client_as(CONTROLLER),
            NODE.into(),
            Arc::new(ContainerdLocator::new(
                dir.join("containerd/state/io.containerd.runtime.v2.task")
                    .join(CRI_NAMESPACE),
            )),
            Arc::new(TtrpcShim { timeout: CALL }),
            Arc::new(TtrpcNode {
                address: format!("unix://{}", dir.join("node.sock").display()),
                timeout: CALL,
            }),
            metrics.clone(),
        )
        // Often enough for the drop counters in /metrics to show within a
        // wait, seldom enough that nine pods' looks leave the lab's one
        // emulated CPU to the guests.
        .with_network_refresh(Duration::from_secs(5))
        .with_retry(Duration::from_secs(1))
        .with_backoff(Duration::from_millis(500), Duration::from_secs(10));
        let controller = tokio::spawn(twig_controller::run(Arc::new(ctx)));
        let lab = CtrlLab {
            node,
            cri,
            client,
            metrics,
            t0,
            name,
            controller,
            kubelet,
            _server: server,
        };
        lab.step("node, API server, kubelet and controller up");
        lab
    }

    /// How many sandboxes the kubelet stopped as orphans (none of Twig's
    /// making may be one: a real kubelet stops them).
    pub fn orphans_stopped(&self) -> u64 {
        self.kubelet.orphans_stopped()
    }

    /// Prints a progress line with the time since the start, past the test
    /// harness's capture: a binary the lab kills as hung has shown how far
    /// it got.
    pub fn step(&self, what: &str) {
        let line = format!(
            "{}: {:>7.2} s  {what} (the test process has used {:.1} s of CPU)\n",
            self.name,
            self.t0.elapsed().as_secs_f64(),
            cpu_seconds()
        );
        // Progress only: a closed stderr loses nothing the test checks.
        let _ = std::io::stderr().write_all(line.as_bytes());
    }

    /// The node's daemons' logs, for failure messages.
    pub fn logs(&self) -> String {
        self.node.node().logs()
    }

    /// [`until`] for the teardown's waits: a timeout shows the last 300
    /// lines of containerd's log (every shim's calls are in it) and where
    /// containerd's CRI goroutines wait.
    async fn until_logged<T, F, Fut>(&self, what: &str, within: Duration, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        // The stacks are taken while the wait is long but the kubelet's CRI
        // calls (CALL) are still waiting in containerd.
        let early = STACKS_AFTER.min(within);
        if let Some(v) = poll(early, &mut check).await {
            return v;
        }
        let stacks = self.node.node().containerd_stacks("cri", 400);
        match poll(within - early, check).await {
            Some(v) => v,
            None => panic!(
                "timed out after {within:?} waiting for {what}\n{}\nafter {early:?}: {stacks}",
                self.node.node().logs_of(300, 40),
            ),
        }
    }

    /// The object `name` once `done` holds, failing with its last state.
    pub async fn wait_for<K>(&self, name: &str, what: &str, done: impl Fn(&K) -> bool) -> K
    where
        K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
            + Clone
            + k8s_openapi::serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        self.wait_state(name, what, |got: Option<&K>| got.is_some_and(&done))
            .await
            .unwrap_or_else(|| panic!("{name} is gone"))
    }

    /// Waits until the object `name` is gone, failing with its last state.
    pub async fn wait_gone<K>(&self, name: &str)
    where
        K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
            + Clone
            + k8s_openapi::serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        self.wait_state(name, "gone", |got: Option<&K>| got.is_none())
            .await;
    }

    /// The object `name` (`None`: there is none) once `done` holds for it,
    /// polled until [`READY`], failing with its last state.
    async fn wait_state<K>(
        &self,
        name: &str,
        what: &str,
        done: impl Fn(Option<&K>) -> bool,
    ) -> Option<K>
    where
        K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
            + Clone
            + k8s_openapi::serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let api: Api<K> = Api::namespaced(self.client.clone(), NS);
        let deadline = Instant::now() + READY;
        loop {
            let got = api.get_opt(name).await.unwrap_or_else(|e| panic!("{e}"));
            if done(got.as_ref()) {
                return got;
            }
            assert!(
                Instant::now() < deadline,
                "{name} not {what} within {READY:?}: {got:#?}\n{}",
                self.logs()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// The pod `name` once the kubelet reports it running (with a pod IP
    /// unless it is on the node's network), and the CRI id of its container
    /// `container`.
    pub async fn running(&self, name: &str, container: &str) -> (Pod, String) {
        let pod: Pod = self
            .wait_for(name, "run by the kubelet", |p: &Pod| {
                p.status.as_ref().is_some_and(|s| s.phase.is_some())
            })
            .await;
        let status = pod.status.clone().unwrap_or_default();
        assert_eq!(
            status.phase.as_deref(),
            Some("Running"),
            "pod {name}: {status:#?}\n{}",
            self.logs()
        );
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network) == Some(true);
        assert!(
            host_network || status.pod_ip.is_some(),
            "pod {name} has no IP: {status:#?}"
        );
        let id = container_id(&pod, container)
            .unwrap_or_else(|| panic!("pod {name} has no container id: {status:#?}"));
        (pod, id)
    }

    /// `argv` in container `id`: (exit code, stdout trimmed).
    pub async fn exec(&self, id: &str, argv: &[&str]) -> (i32, String) {
        let out = self
            .cri
            .exec_sync(id, argv, EXEC)
            .await
            .unwrap_or_else(|e| panic!("{}", self.node.cri_error(&format!("exec {argv:?}"), e)));
        (
            out.exit_code,
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        )
    }

    /// `sh -c script` in container `id`: (exit code, stdout trimmed).
    pub async fn sh(&self, id: &str, script: &str) -> (i32, String) {
        self.exec(id, &["sh", "-c", script]).await
    }

    /// Takes a full Snapshot `name` of pod `pod` and waits until it is done,
    /// which must be Ready.
    pub async fn snapshot(&self, name: &str, pod: &str) -> SnapshotStatus {
        testkit::create(
            &self.client,
            &Snapshot::new(
                name,
                SnapshotSpec {
                    pod_name: pod.into(),
                    pod_uid: None,
                    mode: SnapshotMode::Full,
                    deletion_policy: DeletionPolicy::Delete,
                    ttl_seconds_after_ready: None,
                    failure_deadline_seconds: None,
                    export: false,
                },
            ),
        )
        .await;
        let snap: Snapshot = self
            .wait_for(name, "done", |s: &Snapshot| {
                s.status
                    .as_ref()
                    .is_some_and(|s| matches!(s.phase, Phase::Ready | Phase::Failed))
            })
            .await;
        let status = snap.status.clone().unwrap_or_default();
        assert_eq!(status.phase, Phase::Ready, "{status:#?}\n{}", self.logs());
        status
    }

    /// Deletes the Snapshots `names` one after the other, each gone (its
    /// finalizer let go) before the next: a child before its parent.
    pub async fn delete_snapshots(&self, names: &[&str]) {
        let snapshots: Api<Snapshot> = Api::namespaced(self.client.clone(), NS);
        for name in names {
            snapshots
                .delete(name, &DeleteParams::default())
                .await
                .unwrap_or_else(|e| panic!("deleting Snapshot {name}: {e}"));
            self.until_logged(
                &format!("Snapshot {name}'s finalizer to let go"),
                READY,
                || async { matches!(snapshots.get_opt(name).await, Ok(None)).then_some(()) },
            )
            .await;
        }
    }

    /// Waits until no pod is left in the API server, no sandbox in CRI, and
    /// nothing of the pods' VMMs `vmms` on the node.
    pub async fn nothing_left(&self, vmms: &[u32]) {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), NS);
        self.until_logged("the pods to be gone", READY, || async {
            let left = pods.list(&ListParams::default()).await.ok()?.items;
            left.is_empty().then_some(())
        })
        .await;
        self.until_logged(
            "the sandboxes and everything of them to go",
            READY,
            || async {
                let sandboxes = self.cri.list_pod_sandboxes().await.ok()?;
                let left = self.node.leftovers(vmms);
                (sandboxes.is_empty() && left.is_empty()).then_some(())
            },
        )
        .await;
    }

    /// The CRI sandbox of the pod with UID `uid`.
    pub async fn sandbox(&self, uid: &str) -> Option<String> {
        let sandboxes = self
            .cri
            .list_pod_sandboxes()
            .await
            .unwrap_or_else(|e| panic!("{}", self.node.cri_error("ListPodSandbox", e)));
        sandbox_of(&sandboxes, uid)
    }
}

/// CPU time this process has used (user and system), in seconds.
fn cpu_seconds() -> f64 {
    nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .map(|u| {
            let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
            t(u.user_time()) + t(u.system_time())
        })
        .unwrap_or(f64::NAN)
}

impl Drop for CtrlLab {
    fn drop(&mut self) {
        self.controller.abort();
    }
}
