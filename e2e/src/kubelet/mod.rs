//! A test kubelet: what kubelet does for a pod, so that Twig's pods can be
//! run and checked against a real containerd with the controller testkit's
//! API server standing in for kube-apiserver. Each part follows kubelet's
//! own source (named in the module's docs):
//!
//! - It watches the Pods bound to its node (`spec.nodeName`, a field
//!   selector, as kubelet lists them), and the ConfigMaps and Secrets, and
//!   runs one worker per live pod ([`pod`]).
//! - Volumes ([`volumes`], [`atomic`]) are laid out under the kubelet's root
//!   directory ([`KubeletConfig::root`]) as kubelet lays them out, the
//!   default ServiceAccount token volume injected into every pod that does
//!   not opt out (as the ServiceAccount admission plugin does), configuration
//!   volumes rewritten atomically when their objects change and the token
//!   re-minted every [`KubeletConfig::token_rotation`]. The token is shaped
//!   like TokenRequest's but minted here and signed by nobody, and `ca.crt`
//!   is the namespace's `kube-root-ca.crt` ConfigMap's, or
//!   [`KubeletConfig::root_ca`] when the test created none.
//! - `RunPodSandbox` gets the pod's UID, name, namespace, labels and
//!   **annotations** (containerd's CRI plugin passes `twig.dev/*` on to the
//!   shim), the runtime handler named by `runtimeClassName`, the node's
//!   network for `hostNetwork: true`, the hostname, and the DNS config of
//!   the pod's `dnsPolicy` ([`dns`]); each container gets kubelet's
//!   managed `/etc/hosts` and its termination message file.
//! - Init containers, sidecars, restarts with crash-loop back-off
//!   ([`lifecycle`]); startup, readiness and liveness probes and `preStop`
//!   hooks ([`probes`]); container exits, termination messages and the
//!   pod's phase and conditions in its status ([`status`]).
//! - When the pod is deleted (or starts terminating) its containers get
//!   their `preStop` hooks and `StopContainer` within the pod's
//!   `terminationGracePeriodSeconds`, then the sandbox is stopped and
//!   removed and the pod's directory with its mounts goes.
//! - Housekeeping (`kubelet_pods.go` `HandlePodCleanups`, every
//!   [`HOUSEKEEPING`] once the pod list is synced): every READY sandbox in
//!   CRI whose `metadata.uid` is not a pod of this node is stopped as an
//!   orphan, whatever its labels, name or namespace — so a sandbox made
//!   through CRI by anyone but this kubelet (a template build the node ran
//!   itself) dies here as under a real kubelet. Counted in
//!   [`Kubelet::orphans_stopped`] (kubelet's
//!   `kubelet_orphaned_runtime_pods_total`).
//!
//! What it does not do: pull images (a container must name one of the
//! images it is given, already on the node; a pod naming another fails at
//! once, naming it), `env` beyond plain values (`valueFrom`, `envFrom` and
//! `$(VAR)` expansion are refused), `postStart` hooks, resources,
//! security contexts, persistent volumes and raw block devices, ephemeral
//! containers, readiness gates, or the final delete of a terminating pod
//! (the test API server deletes a pod without finalizers at once).

mod atomic;
mod dns;
mod lifecycle;
mod pod;
mod probes;
mod status;
mod volumes;

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use twig_cri::{api, CriClient};

pub use atomic::{AtomicWriter, FileProjection, Payload};
pub use lifecycle::{BACKOFF_BASE, BACKOFF_MAX};
pub use volumes::{ROOT_CA_CONFIG_MAP, TOKEN_MOUNT_PATH, TOKEN_VOLUME_PREFIX};

/// How often the kubelet stops orphaned sandboxes (kubelet's housekeeping
/// period).
pub const HOUSEKEEPING: Duration = Duration::from_secs(2);

/// The container runtime's prefix of `containerStatuses[].containerID`.
pub const CONTAINER_ID_PREFIX: &str = "containerd://";

/// The placeholder CA of [`KubeletConfig::root_ca`].
const PLACEHOLDER_CA: &str = "-----BEGIN CERTIFICATE-----\n\
    dHdpZyB0ZXN0IGt1YmVsZXQ6IG5vIGNsdXN0ZXIgQ0E=\n\
    -----END CERTIFICATE-----\n";

/// A random number from the kernel (the time's nanoseconds if that fails).
pub(crate) fn random_u32() -> u32 {
    let mut buf = [0u8; 4];
    match std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf)) {
        Ok(()) => u32::from_ne_bytes(buf),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default(),
    }
}

/// How the test kubelet runs, as kubelet's flags and configuration set it.
#[derive(Debug, Clone)]
pub struct KubeletConfig {
    /// The images on the node; a container naming another fails.
    pub images: Vec<String>,
    /// Where container logs go, one directory per pod
    /// (`<namespace>_<name>_<uid>`, as kubelet names them under
    /// `/var/log/pods`).
    pub logs: PathBuf,
    /// kubelet's `--root-dir` (its `/var/lib/kubelet`): `pods/<uid>/…`.
    pub root: PathBuf,
    /// `--cluster-dns`.
    pub cluster_dns: Vec<String>,
    /// `--cluster-domain`.
    pub cluster_domain: String,
    /// `--resolv-conf`: the node's resolv.conf (`None`: kubelet's `""`).
    pub resolv_conf: Option<PathBuf>,
    /// The node's hosts file, for pods on the node's network.
    pub node_hosts: PathBuf,
    /// The first crash-loop back-off (kubelet: 10 s).
    pub backoff_base: Duration,
    /// The longest crash-loop back-off (kubelet: 300 s).
    pub backoff_max: Duration,
    /// How often the ServiceAccount token is re-minted (kubelet renews at
    /// 80 % of the token's life: ~48 min for the admission plugin's 3607 s).
    pub token_rotation: Duration,
    /// `ca.crt` of the token volume when the namespace has no
    /// `kube-root-ca.crt` ConfigMap.
    pub root_ca: String,
    /// How often container states are read from CRI (kubelet's PLEG
    /// relists every second).
    pub sync_period: Duration,
    /// The ServiceAccount admission plugin's token volume is injected into
    /// pods that do not opt out (as in every cluster; off only to run pods
    /// on a runtime that cannot mount volumes yet).
    pub service_account_token: bool,
    /// Memory-backed volumes (Secret, projected, downward API, emptyDir of
    /// `medium: Memory`) and `subPath`s are mounted, as kubelet mounts
    /// them, when this is set and the kubelet runs as root.
    pub mount: bool,
}

impl KubeletConfig {
    /// kubelet's defaults, with `images` on the node, container logs under
    /// `logs` and the root directory `kubelet` beside it.
    pub fn new(images: &[&str], logs: &Path) -> KubeletConfig {
        KubeletConfig {
            images: images.iter().map(|i| i.to_string()).collect(),
            logs: logs.to_path_buf(),
            root: logs.parent().unwrap_or(logs).join("kubelet"),
            cluster_dns: vec!["10.96.0.10".into()],
            cluster_domain: "cluster.local".into(),
            resolv_conf: Some("/etc/resolv.conf".into()),
            node_hosts: "/etc/hosts".into(),
            backoff_base: BACKOFF_BASE,
            backoff_max: BACKOFF_MAX,
            token_rotation: Duration::from_secs(48 * 60),
            root_ca: PLACEHOLDER_CA.into(),
            sync_period: Duration::from_secs(1),
            service_account_token: true,
            mount: true,
        }
    }
}

/// What every pod's worker shares.
struct Shared {
    client: Client,
    cri: CriClient,
    config: KubeletConfig,
    dns: dns::NodeDns,
    config_maps: Store<ConfigMap>,
    secrets: Store<Secret>,
    /// Bumped on every ConfigMap or Secret event.
    objects: watch::Receiver<u64>,
    /// Sandboxes stopped as orphans.
    orphans: AtomicU64,
}

/// A running test kubelet; it stops watching when dropped, and its pods'
/// workers with it (the sandboxes stay: [`crate::cri::CriNode`] removes
/// what is left when it is dropped).
pub struct Kubelet {
    tasks: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl Kubelet {
    /// Starts the kubelet of node `node` on `client`'s API server, running
    /// pods through `cri` whose containers each name one of `images` (on
    /// the node already: in the lab [`crate::IMAGE_REF`] and what a test
    /// imported), with their container logs under `logs`, and kubelet's
    /// defaults otherwise ([`KubeletConfig::new`]).
    pub fn start(
        client: Client,
        node: &str,
        cri: CriClient,
        images: &[&str],
        logs: &Path,
    ) -> Kubelet {
        Kubelet::start_with(client, node, cri, KubeletConfig::new(images, logs))
    }

    /// Starts the kubelet with `config`.
    pub fn start_with(
        client: Client,
        node: &str,
        cri: CriClient,
        config: KubeletConfig,
    ) -> Kubelet {
        let (bump, objects) = watch::channel(0u64);
        let bump = Arc::new(bump);
        let (config_maps, cm_task) = reflect::<ConfigMap>(&client, bump.clone());
        let (secrets, secret_task) = reflect::<Secret>(&client, bump);
        let host = config.resolv_conf.as_ref().map(|p| {
            std::fs::read_to_string(p)
                .map(|t| dns::parse_resolv_conf(&t))
                .unwrap_or_default()
        });
        let shared = Arc::new(Shared {
            client,
            cri,
            dns: dns::NodeDns {
                cluster_dns: config.cluster_dns.clone(),
                cluster_domain: config.cluster_domain.clone(),
                host,
            },
            config,
            config_maps,
            secrets,
            objects,
            orphans: AtomicU64::new(0),
        });
        let node = node.to_string();
        Kubelet {
            tasks: vec![
                cm_task,
                secret_task,
                tokio::spawn(watch_pods(shared.clone(), node)),
            ],
            shared,
        }
    }

    /// How many sandboxes housekeeping stopped as orphans (kubelet's
    /// `kubelet_orphaned_runtime_pods_total`).
    pub fn orphans_stopped(&self) -> u64 {
        self.shared.orphans.load(Ordering::Relaxed)
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A store of every `K`, kept by a task that bumps `bump` on each event.
fn reflect<K>(client: &Client, bump: Arc<watch::Sender<u64>>) -> (Store<K>, JoinHandle<()>)
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let events = reflector::reflector(
        writer,
        watcher(Api::<K>::all(client.clone()), watcher::Config::default()),
    )
    .default_backoff();
    let task = tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(_) => bump.send_modify(|n| *n += 1),
                Err(e) => tracing::warn!("kubelet: watching {}: {e}", K::plural(&())),
            }
        }
    });
    (store, task)
}

/// Watches the node's pods and keeps one worker per live pod, sending it
/// each new version; dropping its sender (the pod is gone or terminating)
/// makes it stop the pod.
async fn watch_pods(shared: Arc<Shared>, node: String) {
    let pods: Api<Pod> = Api::all(shared.client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let (store, writer) = reflector::store();
    let events = reflector::reflector(writer, watcher(pods, config)).default_backoff();
    let mut events = std::pin::pin!(events);
    let mut running: HashMap<String, watch::Sender<Arc<Pod>>> = HashMap::new();
    // Pods whose worker has not finished (a deleted pod's is stopping it).
    let mut workers = Workers::default();
    let mut housekeeping = tokio::time::interval(HOUSEKEEPING);
    let mut synced = false;
    loop {
        tokio::select! {
            event = events.next() => {
                let Some(event) = event else { break };
                if let Err(e) = event {
                    tracing::warn!("kubelet {node}: watching pods: {e}");
                    continue;
                }
                synced = true;
                sync(&shared, &store, &mut running, &mut workers);
                workers.reap();
            }
            _ = housekeeping.tick(), if synced => {
                workers.reap();
                stop_orphans(&shared, &store, &workers, &node).await;
            }
        }
    }
}

/// The pods' workers, with the UIDs of those not finished.
#[derive(Default)]
struct Workers {
    set: JoinSet<String>,
    alive: std::collections::HashSet<String>,
}

impl Workers {
    fn spawn(&mut self, shared: Arc<Shared>, uid: String, rx: watch::Receiver<Arc<Pod>>) {
        self.alive.insert(uid.clone());
        self.set.spawn(async move {
            pod::run(shared, rx).await;
            uid
        });
    }

    /// Forgets the workers that finished.
    fn reap(&mut self) {
        while let Some(done) = self.set.try_join_next() {
            if let Ok(uid) = done {
                self.alive.remove(&uid);
            }
        }
    }
}

/// Stops every READY sandbox whose pod UID is neither a pod of the node
/// nor one a worker still handles (`HandlePodCleanups`' orphaned runtime
/// pods: kubelet sends them `SyncPodKill`).
async fn stop_orphans(shared: &Shared, store: &Store<Pod>, workers: &Workers, node: &str) {
    let sandboxes = match shared.cri.list_pod_sandboxes().await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("kubelet {node}: housekeeping: listing sandboxes: {e}");
            return;
        }
    };
    let known: std::collections::HashSet<String> = store
        .state()
        .iter()
        .filter_map(|p| p.metadata.uid.clone())
        .chain(workers.alive.iter().cloned())
        .collect();
    for sandbox in sandboxes {
        if sandbox.state != api::PodSandboxState::SandboxReady as i32 {
            continue;
        }
        let Some(meta) = sandbox.metadata.as_ref() else {
            continue;
        };
        if known.contains(&meta.uid) {
            continue;
        }
        tracing::warn!(
            "kubelet {node}: stopping orphaned sandbox {} ({}/{}, uid {:?}): not a pod of this node",
            sandbox.id,
            meta.namespace,
            meta.name,
            meta.uid
        );
        shared.orphans.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = shared.cri.stop_pod_sandbox(&sandbox.id).await {
            tracing::warn!(
                "kubelet {node}: stopping orphaned sandbox {}: {e}",
                sandbox.id
            );
        }
    }
}

/// Starts a worker for each new live pod, updates the others, and lets go
/// of the pods that are gone.
fn sync(
    shared: &Arc<Shared>,
    store: &Store<Pod>,
    running: &mut HashMap<String, watch::Sender<Arc<Pod>>>,
    workers: &mut Workers,
) {
    let live: HashMap<String, Arc<Pod>> = store
        .state()
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| Some((p.metadata.uid.clone()?, p)))
        .collect();
    running.retain(|uid, _| live.contains_key(uid));
    for (uid, pod) in live {
        match running.get(&uid) {
            Some(tx) => {
                tx.send_if_modified(|old| {
                    let changed = old.metadata.resource_version != pod.metadata.resource_version;
                    *old = pod.clone();
                    changed
                });
            }
            None => {
                let (tx, rx) = watch::channel(pod);
                running.insert(uid.clone(), tx);
                workers.spawn(shared.clone(), uid, rx);
            }
        }
    }
}

/// The CRI container id of the pod's container `name`, from its status.
pub fn container_id(pod: &Pod, name: &str) -> Option<String> {
    let status = pod.status.as_ref()?;
    status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
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
