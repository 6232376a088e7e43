//! A test kubelet: the part of a kubelet the Twig controller relies on, so
//! the controller can run against a real node in the lab with the
//! controller testkit's API server standing in for kube-apiserver.
//!
//! It watches the Pods bound to its node (`spec.nodeName`, a field
//! selector, as kubelet lists them) and, for each new one, runs it through
//! CRI: `RunPodSandbox` with the pod's UID, name, namespace, labels and
//! **annotations** (containerd's CRI plugin passes `twig.dev/*` on to the
//! shim) and the runtime handler named by `runtimeClassName`, then
//! `CreateContainer` + `StartContainer` of each container with the pod
//! spec's `command` and `args` (a pod with `hostNetwork: true` gets the
//! node's network namespace, as kubelet asks CRI for it, and no pod IP in
//! its status). It then writes the pod's status as kubelet
//! does: `phase: Running`, `podIP`, `containerStatuses` (`ready`,
//! `containerID: containerd://…`) and the conditions `Initialized`,
//! `ContainersReady`, `Ready` and `PodScheduled` True. A pod it cannot run
//! gets `phase: Failed` with the error in `status.message`. When the pod
//! is deleted (or starts terminating), it stops and removes the sandbox.
//!
//! What it does not do: pull images (a container must name one of the
//! images it is given, already on the node: the lab's [`crate::IMAGE_REF`]
//! and those a test imported; a pod naming another fails), init containers, probes,
//! volumes, restarts, graceful deletion (the test API server deletes a pod
//! without a finalizer at once), or reporting containers that exit.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStatus, Pod, PodCondition, PodIP, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use twig_cri::{api, CriClient};

/// The container runtime's prefix of `containerStatuses[].containerID`.
pub const CONTAINER_ID_PREFIX: &str = "containerd://";

/// Why a pod could not be run.
#[derive(Debug, thiserror::Error)]
enum PodError {
    #[error("{call}: {source}")]
    Cri {
        call: &'static str,
        source: twig_cri::Error,
    },
    #[error("{0}")]
    Unsupported(String),
    #[error("creating the log directory {path}: {source}")]
    Logs {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn cri(call: &'static str) -> impl FnOnce(twig_cri::Error) -> PodError {
    move |source| PodError::Cri { call, source }
}

/// What every pod's task shares.
struct Shared {
    client: Client,
    cri: CriClient,
    logs: PathBuf,
    images: Vec<String>,
}

/// A running test kubelet; it stops watching when dropped, and its pods'
/// tasks with it (the sandboxes stay: [`crate::cri::CriNode`] removes
/// what is left when it is dropped).
pub struct Kubelet {
    task: JoinHandle<()>,
}

impl Kubelet {
    /// Starts the kubelet of node `node` on `client`'s API server, running
    /// pods through `cri` whose containers each name one of `images` (on
    /// the node already: in the lab [`crate::IMAGE_REF`] and what a test
    /// imported), with their container logs under `logs` (one directory per
    /// pod, `<namespace>_<name>_<uid>`, as kubelet names them).
    pub fn start(
        client: Client,
        node: &str,
        cri: CriClient,
        images: &[&str],
        logs: &Path,
    ) -> Kubelet {
        let shared = Arc::new(Shared {
            client,
            cri,
            logs: logs.to_path_buf(),
            images: images.iter().map(|i| i.to_string()).collect(),
        });
        let node = node.to_string();
        Kubelet {
            task: tokio::spawn(watch(shared, node)),
        }
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Watches the node's pods and keeps one task per live pod.
async fn watch(shared: Arc<Shared>, node: String) {
    let pods: Api<Pod> = Api::all(shared.client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let (store, writer) = reflector::store();
    let events = reflector::reflector(writer, watcher(pods, config)).default_backoff();
    let mut events = std::pin::pin!(events);
    // A pod's task runs it, then waits on its receiver: dropping the
    // sender (the pod is gone or terminating) makes it remove the sandbox.
    let mut running: HashMap<String, oneshot::Sender<()>> = HashMap::new();
    let mut tasks = JoinSet::new();
    while let Some(event) = events.next().await {
        if let Err(e) = event {
            eprintln!("kubelet {node}: watching pods: {e}");
            continue;
        }
        sync(&shared, &store, &mut running, &mut tasks);
        while tasks.try_join_next().is_some() {}
    }
}

/// Starts a task for each new live pod and lets go of the pods that are gone.
fn sync(
    shared: &Arc<Shared>,
    store: &Store<Pod>,
    running: &mut HashMap<String, oneshot::Sender<()>>,
    tasks: &mut JoinSet<()>,
) {
    let live: HashMap<String, Arc<Pod>> = store
        .state()
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| Some((p.metadata.uid.clone()?, p)))
        .collect();
    running.retain(|uid, _| live.contains_key(uid));
    for (uid, pod) in live {
        if running.contains_key(&uid) {
            continue;
        }
        let (gone_tx, gone_rx) = oneshot::channel();
        running.insert(uid, gone_tx);
        tasks.spawn(pod_lifecycle(shared.clone(), pod, gone_rx));
    }
}

/// Runs the pod, reports its status, and once it is gone removes its sandbox.
async fn pod_lifecycle(shared: Arc<Shared>, pod: Arc<Pod>, gone: oneshot::Receiver<()>) {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let mut sandbox = None;
    let status = match run_pod(&shared, &pod, &mut sandbox).await {
        Ok(status) => status,
        Err(e) => {
            eprintln!("kubelet: pod {namespace}/{name} failed: {e}");
            PodStatus {
                phase: Some("Failed".into()),
                reason: Some("TestKubelet".into()),
                message: Some(e.to_string()),
                ..Default::default()
            }
        }
    };
    let pods: Api<Pod> = Api::namespaced(shared.client.clone(), &namespace);
    let patch = Patch::Merge(json!({ "status": status }));
    if let Err(e) = pods
        .patch_status(&name, &PatchParams::default(), &patch)
        .await
    {
        eprintln!("kubelet: writing the status of pod {namespace}/{name}: {e}");
    }
    // Only ever dropped, never sent: the pod is gone.
    let _ = gone.await;
    if let Some(id) = sandbox {
        if let Err(e) = shared.cri.stop_pod_sandbox(&id).await {
            eprintln!("kubelet: StopPodSandbox {id} of pod {namespace}/{name}: {e}");
        }
        if let Err(e) = shared.cri.remove_pod_sandbox(&id).await {
            eprintln!("kubelet: RemovePodSandbox {id} of pod {namespace}/{name}: {e}");
        }
    }
}

/// The pod through CRI; `sandbox` holds its sandbox's id once there is one.
async fn run_pod(
    shared: &Shared,
    pod: &Pod,
    sandbox: &mut Option<String>,
) -> Result<PodStatus, PodError> {
    let meta = &pod.metadata;
    let name = meta.name.clone().unwrap_or_default();
    let namespace = meta.namespace.clone().unwrap_or_default();
    let uid = meta.uid.clone().unwrap_or_default();
    let spec = pod
        .spec
        .as_ref()
        .ok_or_else(|| PodError::Unsupported("the pod has no spec".into()))?;
    let images = &shared.images;
    if let Some(c) = spec
        .containers
        .iter()
        .find(|c| !images.iter().any(|i| c.image.as_ref() == Some(i)))
    {
        return Err(PodError::Unsupported(format!(
            "container {}: image {:?} is not on the node (the test kubelet pulls none; it runs \
             {images:?})",
            c.name, c.image
        )));
    }
    let logs = shared.logs.join(format!("{namespace}_{name}_{uid}"));
    std::fs::create_dir_all(&logs).map_err(|source| PodError::Logs {
        path: logs.clone(),
        source,
    })?;
    let mut config = twig_cri::pod_sandbox_config(&name, &uid, &logs);
    if let Some(m) = config.metadata.as_mut() {
        m.namespace = namespace;
    }
    config.hostname = spec.hostname.clone().unwrap_or(name);
    let host_network = spec.host_network == Some(true);
    if host_network {
        twig_cri::on_node_network(&mut config);
    }
    config.labels = meta
        .labels
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    config.annotations = meta
        .annotations
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    // No runtimeClassName: CRI's default runtime, as kubelet asks for it.
    let handler = spec.runtime_class_name.clone().unwrap_or_default();
    let started_at = Some(Time(Timestamp::now()));
    let id = shared
        .cri
        .run_pod_sandbox(&config, &handler)
        .await
        .map_err(cri("RunPodSandbox"))?;
    *sandbox = Some(id.clone());
    let mut statuses = Vec::new();
    for c in &spec.containers {
        let image = c.image.clone().unwrap_or_default();
        let mut container =
            twig_cri::container_config(&c.name, &image, &[], &format!("{}.log", c.name));
        container.command = c.command.clone().unwrap_or_default();
        container.args = c.args.clone().unwrap_or_default();
        let cid = shared
            .cri
            .create_container(&id, &container, &config)
            .await
            .map_err(cri("CreateContainer"))?;
        shared
            .cri
            .start_container(&cid)
            .await
            .map_err(cri("StartContainer"))?;
        statuses.push(ContainerStatus {
            name: c.name.clone(),
            image,
            container_id: Some(format!("{CONTAINER_ID_PREFIX}{cid}")),
            ready: true,
            started: Some(true),
            state: Some(ContainerState {
                running: Some(ContainerStateRunning {
                    started_at: Some(Time(Timestamp::now())),
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    // A pod on the node's network has the node's address, which this
    // kubelet does not know: it reports none.
    let ip = if host_network {
        None
    } else {
        Some(
            shared
                .cri
                .pod_ip(&id)
                .await
                .map_err(cri("PodSandboxStatus"))?
                .to_string(),
        )
    };
    let conditions = ["PodScheduled", "Initialized", "ContainersReady", "Ready"]
        .into_iter()
        .map(|type_| PodCondition {
            type_: type_.into(),
            status: "True".into(),
            last_transition_time: Some(Time(Timestamp::now())),
            ..Default::default()
        })
        .collect();
    Ok(PodStatus {
        phase: Some("Running".into()),
        pod_ips: ip.clone().map(|ip| vec![PodIP { ip }]),
        pod_ip: ip,
        start_time: started_at,
        container_statuses: Some(statuses),
        conditions: Some(conditions),
        ..Default::default()
    })
}

/// The CRI container id of the pod's container `name`, from its status.
pub fn container_id(pod: &Pod, name: &str) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == name)?
        .container_id
        .as_deref()?
        .strip_prefix(CONTAINER_ID_PREFIX)
        .map(String::from)
}

/// The id of the CRI pod sandbox of the pod with UID `uid` among `sandboxes`.
pub fn sandbox_of(sandboxes: &[api::PodSandbox], uid: &str) -> Option<String> {
    sandboxes
        .iter()
        .find(|s| s.metadata.as_ref().is_some_and(|m| m.uid == uid))
        .map(|s| s.id.clone())
}
