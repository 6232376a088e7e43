//! App templates (`EnsureTemplate`): a SandboxTemplate built on this node.
//!
//! The daemon builds a template the way kubelet would run it: a pod of the
//! twig runtime handler through containerd's CRI, in the node's network
//! namespace (no CNI address is taken) and annotated `twig.dev/network:
//! none` (the shim refuses `hostNetwork` without it; the build's VM has no
//! network), whose one container runs the
//! template's image (pulled if not present, as kubelet's `IfNotPresent`;
//! its `command` when given). Once the warm-up command
//! exited 0 inside that container, and the container still runs, the pod's
//! shim takes a full snapshot of it into the node store under the
//! template's id ([`twig_store::layout::template_id`]) with the build's
//! inputs as a label, and the pod is removed. A pod annotated
//! `twig.dev/template: <name>` is then restored from that snapshot, and its
//! first container adopts the template's running process.
//!
//! Builds run in the background; `EnsureTemplate` answers at once (not
//! ready, and why) and the controller asks again. A failed build is
//! reported until the next attempt, `retry_s` later. A build pod left by a
//! daemon that died mid-build is removed when the next build of the same
//! template starts.
//!
//! Why the daemon builds through CRI rather than the controller through a
//! Pod object: the warm-up needs an exec in the container, which the daemon
//! gets from CRI's ExecSync and a controller only through kubelet's
//! streaming API, and a Pod would have to be scheduled, admitted and
//! cleaned up in the cluster for a node-local cache. The price: image
//! pulls use containerd's own credentials (no imagePullSecrets), and the
//! build pod is invisible to Kubernetes. The daemon reaches the build pod's
//! shim only through the `Twig` service the controller uses.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use twig_cri::api;
use twig_cri::CriClient;
use twig_proto::twig::{EnsureTemplateRequest, SnapshotRequest};
use twig_proto::twig_ttrpc::TwigClient;

use crate::config::TemplateBuildConfig;
use crate::error::{Error, Result};
use crate::template::{tail, Templates};
use twig_proto::contract::labels::TEMPLATE_EGRESS_POLICY as TEMPLATE_POLICY_LABEL;

/// The label of an app template's snapshot holding the digest of what it
/// was built from (image, command, warm-up); twig-proto's contract.
pub use twig_proto::contract::labels::TEMPLATE_SPEC as SPEC_LABEL;

/// The label naming the SandboxTemplate (`namespace/name`); twig-proto's
/// contract.
pub use twig_proto::contract::labels::TEMPLATE as TEMPLATE_LABEL;

/// The name of the build pod's one container.
const CONTAINER: &str = "template";

/// The node-store id of template `key` (`namespace/name`).
pub fn template_id(key: &str) -> Result<String> {
    let (namespace, name) = key.split_once('/').ok_or_else(|| {
        Error::InvalidArgument(format!("template name {key:?} is not namespace/name"))
    })?;
    twig_store::layout::template_id(namespace, name).map_err(|e| match e {
        twig_store::Error::InvalidArgument(m) => Error::InvalidArgument(m),
        other => other.into(),
    })
}

/// What one `EnsureTemplate` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// `namespace/name` of the SandboxTemplate.
    pub key: String,
    /// Its node-store id.
    pub id: String,
    /// The image.
    pub image: String,
    /// The container's command (empty: the image's).
    pub command: Vec<String>,
    /// Run inside the container before the snapshot (empty: nothing).
    pub warmup: Vec<String>,
    /// Digest of the three above ([`SPEC_LABEL`]).
    pub digest: String,
    /// The template's egress policy (JSON as asked; checked), for its pods
    /// without their own: not an input of the build.
    pub egress_policy: Option<String>,
}

impl Spec {
    /// The build `req` asks for; `req.name` is `namespace/name`.
    pub fn from_request(req: &EnsureTemplateRequest) -> Result<Spec> {
        let id = template_id(&req.name)?;
        let egress_policy = match req.egress_policy.as_str() {
            "" => None,
            json => {
                twig_net::parse_policy(json, "egress_policy")
                    .map_err(|e| Error::InvalidArgument(format!("template {}: {e}", req.name)))?;
                Some(json.to_string())
            }
        };
        if req.image.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "template {}: empty image",
                req.name
            )));
        }
        let mut h = Sha256::new();
        // The build's own version: v2 snapshots record their owning
        // namespace, and a template built before restores into no pod, so
        // it is built again.
        h.update(b"twig-template-v2\0");
        for part in [&[req.image.clone()][..], &req.command, &req.warmup] {
            for s in part {
                h.update(s.as_bytes());
                h.update(b"\0");
            }
            h.update(b"\x01");
        }
        let digest = h
            .finalize()
            .iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(Spec {
            key: req.name.clone(),
            id,
            image: req.image.clone(),
            command: req.command.clone(),
            warmup: req.warmup.clone(),
            digest,
            egress_policy,
        })
    }

    /// The build pod's name (a Kubernetes name: the key's `/` is a `-`).
    fn pod_name(&self) -> String {
        format!("twig-template-{}", self.key.replace('/', "-"))
    }
}

/// The build pod's sandbox id once CRI made it, until it is removed.
type PodSlot = Arc<Mutex<Option<String>>>;

enum Build {
    Running {
        digest: String,
        since: Instant,
        /// Tells this build from a later one of the same template.
        seq: u64,
        task: tokio::task::JoinHandle<()>,
        /// Its pod's name (a RunPodSandbox in flight has no id yet).
        pod_name: String,
        pod: PodSlot,
    },
    Failed {
        digest: String,
        at: Instant,
        message: String,
    },
}

/// The node's template builds.
pub struct Builder {
    config: TemplateBuildConfig,
    templates: Arc<Templates>,
    builds: Mutex<HashMap<String, Build>>,
    seq: std::sync::atomic::AtomicU64,
}

/// Where a template's build stands, when it is not in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// A build runs (started now, or earlier).
    Building(String),
    /// The last build failed; the next starts later.
    Failed(String),
}

impl Builder {
    /// Builds with `config` into the store of `templates`.
    pub fn new(config: TemplateBuildConfig, templates: Arc<Templates>) -> Arc<Builder> {
        Arc::new(Builder {
            config,
            templates,
            builds: Mutex::new(HashMap::new()),
            seq: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn builds(&self) -> MutexGuard<'_, HashMap<String, Build>> {
        self.builds.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes sure `spec` is being built: starts a build unless one of the
    /// same inputs runs, or failed less than `retry_s` ago.
    pub fn ensure(self: &Arc<Self>, spec: &Spec) -> Progress {
        let mut builds = self.builds();
        match builds.get(&spec.id) {
            Some(Build::Running { digest, since, .. }) if *digest == spec.digest => {
                return Progress::Building(format!(
                    "building from {} on this node for {} s",
                    spec.image,
                    since.elapsed().as_secs()
                ));
            }
            Some(Build::Failed {
                digest,
                at,
                message,
            }) if *digest == spec.digest
                && at.elapsed() < Duration::from_secs(self.config.retry_s) =>
            {
                let next = Duration::from_secs(self.config.retry_s).saturating_sub(at.elapsed());
                return Progress::Failed(format!(
                    "{message} (next attempt in {} s)",
                    next.as_secs()
                ));
            }
            Some(Build::Running { task, .. }) => task.abort(),
            _ => {}
        }
        let (me, s) = (self.clone(), spec.clone());
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pod: PodSlot = Arc::new(Mutex::new(None));
        let slot = pod.clone();
        let task = tokio::spawn(async move {
            let timeout = Duration::from_secs(me.config.build_timeout_s);
            let started = Instant::now();
            tracing::info!(
                template = s.key,
                id = s.id,
                image = s.image,
                "building an app template"
            );
            let result = match tokio::time::timeout(timeout, me.build(&s, &slot)).await {
                Ok(r) => r,
                Err(_) => Err(Error::Timeout(format!(
                    "the build did not finish within templates.build_timeout_s ({} s)",
                    timeout.as_secs()
                ))),
            };
            let mut builds = me.builds();
            // Cancelled, or replaced by a build of other inputs, meanwhile.
            if !matches!(builds.get(&s.id), Some(Build::Running { seq: n, .. }) if *n == seq) {
                return;
            }
            match result {
                Ok(()) => {
                    tracing::info!(template = s.key, elapsed = ?started.elapsed(), "app template built");
                    builds.remove(&s.id);
                }
                Err(e) => {
                    let message =
                        format!("building template {} from {} failed: {e}", s.key, s.image);
                    tracing::warn!("{message}");
                    builds.insert(
                        s.id.clone(),
                        Build::Failed {
                            digest: s.digest.clone(),
                            at: Instant::now(),
                            message,
                        },
                    );
                }
            }
        });
        builds.insert(
            spec.id.clone(),
            Build::Running {
                digest: spec.digest.clone(),
                since: Instant::now(),
                seq,
                task,
                pod_name: spec.pod_name(),
                pod,
            },
        );
        Progress::Building(format!("building from {} on this node", spec.image))
    }

    /// Whether a build of template `id` runs (it may have published the
    /// template and be removing its pod).
    pub fn running(&self, id: &str) -> bool {
        matches!(self.builds().get(id), Some(Build::Running { .. }))
    }

    /// Stops the build of template `id`, if one runs — its work is
    /// dropped, then its pod (and so its VM) stopped and removed through
    /// CRI — and forgets a failed one. A pod that cannot be removed (CRI
    /// not answering) is an error; the next build of the template removes
    /// it (by name).
    pub async fn cancel(&self, id: &str) -> Result<()> {
        let removed = self.builds().remove(id);
        let Some(Build::Running {
            task,
            pod_name,
            pod,
            ..
        }) = removed
        else {
            return Ok(());
        };
        task.abort();
        // Its future dropped: no CRI call of it is made after this.
        let _ = task.await;
        let sandbox = pod.lock().unwrap_or_else(|p| p.into_inner()).take();
        tracing::info!(id, pod = pod_name, sandbox, "stopping a template build");
        self.stop_build_pod(sandbox.as_deref(), &pod_name).await
    }

    /// Stops and removes a cancelled build's pod `sandbox`, and any pod of
    /// its name (a RunPodSandbox in flight when it was cancelled).
    async fn stop_build_pod(&self, sandbox: Option<&str>, pod_name: &str) -> Result<()> {
        let cri = match CriClient::connect(&self.config.cri_socket).await {
            Ok(c) => c.with_timeout(Duration::from_secs(self.config.build_timeout_s)),
            // No pod was made, and none can be now.
            Err(e) if sandbox.is_none() => {
                tracing::info!(pod = pod_name, "no CRI to look for a build pod in: {e}");
                return Ok(());
            }
            Err(e) => {
                return Err(Error::FailedPrecondition(format!(
                    "stopping build pod {pod_name} ({}): reaching containerd's CRI at {}: {e}",
                    sandbox.unwrap_or_default(),
                    self.config.cri_socket.display()
                )))
            }
        };
        if let Some(sb) = sandbox {
            remove_pod(&cri, sb).await?;
        }
        remove_pods_named(&cri, pod_name).await
    }

    /// Stops every build (the daemon stops).
    pub fn stop(&self) {
        for (_, b) in self.builds().drain() {
            if let Build::Running { task, .. } = b {
                task.abort();
            }
        }
    }
}

fn cri_error(what: &str) -> impl FnOnce(twig_cri::Error) -> Error + '_ {
    move |e| Error::FailedPrecondition(format!("{what}: {e}"))
}

impl Builder {
    /// Builds `spec` unless the store holds it already (a build that
    /// finished since its caller looked).
    async fn build(&self, spec: &Spec, pod: &PodSlot) -> Result<()> {
        let templates = self.templates.clone();
        let (id, digest) = (spec.id.clone(), spec.digest.clone());
        let built = tokio::task::spawn_blocking(move || {
            templates
                .store()
                .get(&id)
                .ok()
                .and_then(|s| s.labels.get(SPEC_LABEL).cloned())
        })
        .await
        .map_err(|e| Error::Internal(format!("a blocking task failed: {e}")))?;
        if built.as_deref() == Some(digest.as_str()) {
            return Ok(());
        }
        build(&self.config, spec, pod).await
    }
}

/// Builds `spec` through CRI; the build pod is removed whatever happens
/// (its id is in `pod` while it exists, for a cancellation to remove it).
async fn build(config: &TemplateBuildConfig, spec: &Spec, pod: &PodSlot) -> Result<()> {
    let cri = CriClient::connect(&config.cri_socket)
        .await
        .map_err(cri_error(&format!(
            "reaching containerd's CRI at {} (templates.cri_socket)",
            config.cri_socket.display()
        )))?
        .with_timeout(Duration::from_secs(config.build_timeout_s));
    remove_leftovers(&cri, spec).await?;
    // Pulled if not present, as kubelet's `IfNotPresent` does.
    let present = cri
        .image_present(&spec.image)
        .await
        .map_err(cri_error(&format!("looking up image {}", spec.image)))?;
    if !present {
        cri.pull_image(&spec.image)
            .await
            .map_err(cri_error(&format!("pulling {}", spec.image)))?;
    }
    let logs = config.log_dir.join(&spec.id);
    std::fs::create_dir_all(&logs)
        .map_err(|e| Error::io(format!("creating {}", logs.display()), e))?;
    let pod_cfg = pod_config(spec, &logs);
    let sandbox = cri
        .run_pod_sandbox(&pod_cfg, &config.runtime_handler)
        .await
        .map_err(cri_error(&format!(
            "starting the build pod (runtime handler {:?})",
            config.runtime_handler
        )))?;
    *slot_of(pod) = Some(sandbox.clone());
    let result = build_in(config, &cri, spec, &sandbox, &pod_cfg, &logs).await;
    let removed = remove_pod(&cri, &sandbox).await;
    if removed.is_ok() {
        *slot_of(pod) = None;
    }
    result?;
    removed?;
    let _ = std::fs::remove_dir_all(&logs);
    Ok(())
}

/// The build pod: in the template's Kubernetes namespace, named after the
/// template, on the node's network namespace (CRI sets up no pod network)
/// and asking the twig runtime for a VM without network (a build is
/// offline; a pod restored from the template joins its own network).
fn pod_config(spec: &Spec, logs: &Path) -> api::PodSandboxConfig {
    let mut pod = twig_cri::pod_sandbox_config(&spec.pod_name(), &spec.id, logs);
    if let Some(meta) = pod.metadata.as_mut() {
        meta.namespace = spec
            .key
            .split_once('/')
            .map_or("default", |(ns, _)| ns)
            .to_string();
    }
    pod.hostname = String::new();
    twig_cri::on_node_network(&mut pod);
    pod.annotations.insert(
        twig_proto::contract::NETWORK_ANNOTATION.into(),
        twig_proto::contract::NETWORK_NONE.into(),
    );
    pod
}

async fn build_in(
    config: &TemplateBuildConfig,
    cri: &CriClient,
    spec: &Spec,
    sandbox: &str,
    pod: &api::PodSandboxConfig,
    logs: &Path,
) -> Result<()> {
    let command: Vec<&str> = spec.command.iter().map(String::as_str).collect();
    let container = twig_cri::container_config(CONTAINER, &spec.image, &command, "template.log");
    let id = cri
        .create_container(sandbox, &container, pod)
        .await
        .map_err(cri_error("creating the template's container"))?;
    cri.start_container(&id)
        .await
        .map_err(cri_error("starting the template's container"))?;
    if !spec.warmup.is_empty() {
        let argv: Vec<&str> = spec.warmup.iter().map(String::as_str).collect();
        let out = cri
            .exec_sync(&id, &argv, Duration::from_secs(config.build_timeout_s))
            .await
            .map_err(cri_error("running the warm-up command"))?;
        if out.exit_code != 0 {
            return Err(Error::FailedPrecondition(format!(
                "the warm-up command {:?} exited with {}: {}{}",
                spec.warmup,
                out.exit_code,
                tail(&String::from_utf8_lossy(&out.stdout)),
                tail(&String::from_utf8_lossy(&out.stderr)),
            )));
        }
    }
    let status = cri
        .container_status(&id)
        .await
        .map_err(cri_error("reading the template's container status"))?;
    if status.state != api::ContainerState::ContainerRunning as i32 {
        return Err(Error::FailedPrecondition(format!(
            "the template's container exited (code {}) before it was snapshotted: a template's \
             command must keep running; its log: {}",
            status.exit_code,
            tail(&std::fs::read_to_string(logs.join("template.log")).unwrap_or_default())
        )));
    }
    snapshot(config, spec, sandbox).await
}

/// The build pod's shim snapshots it into the node store.
async fn snapshot(config: &TemplateBuildConfig, spec: &Spec, sandbox: &str) -> Result<()> {
    let address_file = config.task_dir.join(sandbox).join("address");
    let address = std::fs::read_to_string(&address_file).map_err(|e| {
        Error::io(
            format!(
                "reading the build pod's shim address {} (templates.task_dir)",
                address_file.display()
            ),
            e,
        )
    })?;
    let address = address.trim();
    let client = ttrpc::asynchronous::Client::connect(address)
        .await
        .map_err(|e| {
            Error::Internal(format!(
                "connecting to the build pod's shim at {address}: {e}"
            ))
        })?;
    let req = SnapshotRequest {
        sandbox_id: sandbox.to_string(),
        snapshot_id: spec.id.clone(),
        full: true,
        labels: [
            (SPEC_LABEL, Some(&spec.digest)),
            (TEMPLATE_LABEL, Some(&spec.key)),
            (TEMPLATE_POLICY_LABEL, spec.egress_policy.as_ref()),
        ]
        .into_iter()
        .filter_map(|(k, v)| Some((k.to_string(), v?.clone())))
        .collect(),
        ..Default::default()
    };
    let timeout = Duration::from_secs(config.build_timeout_s);
    let ctx = ttrpc::context::with_timeout(i64::try_from(timeout.as_nanos()).unwrap_or(i64::MAX));
    TwigClient::new(client)
        .snapshot(ctx, &req)
        .await
        .map_err(|e| Error::FailedPrecondition(format!("snapshotting the build pod: {e}")))?;
    Ok(())
}

fn slot_of(pod: &PodSlot) -> MutexGuard<'_, Option<String>> {
    pod.lock().unwrap_or_else(|p| p.into_inner())
}

/// Removes build pods of `spec` a previous daemon left (it died or was
/// stopped mid-build).
async fn remove_leftovers(cri: &CriClient, spec: &Spec) -> Result<()> {
    remove_pods_named(cri, &spec.pod_name()).await
}

/// Removes every pod sandbox named `name`.
async fn remove_pods_named(cri: &CriClient, name: &str) -> Result<()> {
    let pods = cri
        .list_pod_sandboxes()
        .await
        .map_err(cri_error("listing pod sandboxes"))?;
    for p in pods {
        if p.metadata.as_ref().is_some_and(|m| m.name == name) {
            tracing::info!(
                pod = name,
                sandbox = p.id,
                "removing a build pod left by an earlier build"
            );
            remove_pod(cri, &p.id).await?;
        }
    }
    Ok(())
}

async fn remove_pod(cri: &CriClient, sandbox: &str) -> Result<()> {
    cri.stop_pod_sandbox(sandbox)
        .await
        .map_err(cri_error(&format!("stopping build pod {sandbox}")))?;
    cri.remove_pod_sandbox(sandbox)
        .await
        .map_err(cri_error(&format!("removing build pod {sandbox}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(image: &str, command: &[&str], warmup: &[&str]) -> EnsureTemplateRequest {
        EnsureTemplateRequest {
            name: "agents/py".into(),
            image: image.into(),
            command: command.iter().map(|s| s.to_string()).collect(),
            warmup: warmup.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_spec_names_its_template_and_its_digest_follows_every_input() {
        let a = Spec::from_request(&req("py:3", &["python"], &["true"])).unwrap();
        assert_eq!(a.id, "template.agents.py");
        assert_eq!(a.pod_name(), "twig-template-agents-py");
        assert_eq!(
            a.digest,
            Spec::from_request(&req("py:3", &["python"], &["true"]))
                .unwrap()
                .digest
        );
        for other in [
            req("py:4", &["python"], &["true"]),
            req("py:3", &["python", "-u"], &["true"]),
            req("py:3", &["python"], &[]),
            // Moving an argument from the command to the warm-up is another spec.
            req("py:3", &[], &["python", "true"]),
        ] {
            assert_ne!(
                Spec::from_request(&other).unwrap().digest,
                a.digest,
                "{other:?}"
            );
        }
        for bad in [
            EnsureTemplateRequest {
                name: "py".into(),
                ..req("py:3", &[], &[])
            },
            EnsureTemplateRequest {
                name: "Agents/py".into(),
                ..req("py:3", &[], &[])
            },
            req("", &[], &[]),
        ] {
            let e = Spec::from_request(&bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
        }
    }

    /// Issue 24, item 6: a template deleted mid-build stops its build:
    /// the build's work is dropped and its pod (its VM) is stopped through
    /// CRI — here CRI does not answer, so the cancellation says the pod
    /// could not be stopped, naming it, rather than leaving it silently.
    #[tokio::test]
    async fn cancelling_a_running_build_stops_its_work_and_its_pod() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = crate::config::Config {
            store: dir.path().join("store"),
            allow_copy: true,
            run_dir: dir.path().join("run"),
            ..Default::default()
        };
        config.templates.cri_socket = dir.path().join("no-containerd.sock");
        let templates = Arc::new(Templates::open(&config).unwrap());
        let builder = Builder::new(config.templates.clone(), templates);
        let spec = Spec::from_request(&req("py:3", &[], &[])).unwrap();
        let (dropped_tx, dropped) = tokio::sync::oneshot::channel::<()>();
        let work = tokio::spawn(async move {
            let _dropped_when_aborted = dropped_tx;
            std::future::pending::<()>().await
        });
        let pod: PodSlot = Arc::new(Mutex::new(Some("sandbox-1".into())));
        builder.builds().insert(
            spec.id.clone(),
            Build::Running {
                digest: spec.digest.clone(),
                since: Instant::now(),
                seq: 0,
                task: work,
                pod_name: spec.pod_name(),
                pod,
            },
        );
        assert!(builder.running(&spec.id));
        let e = builder.cancel(&spec.id).await.unwrap_err();
        assert!(
            e.to_string()
                .contains("stopping build pod twig-template-agents-py (sandbox-1)"),
            "{e}"
        );
        assert!(dropped.await.is_err(), "the build's work was dropped");
        assert!(!builder.running(&spec.id));
        // Nothing runs: nothing to stop.
        builder.cancel(&spec.id).await.expect("no build");
    }

    #[test]
    fn the_build_pod_runs_in_the_node_network_and_the_template_namespace() {
        let spec = Spec::from_request(&req("py:3", &[], &[])).unwrap();
        let pod = pod_config(&spec, Path::new("/logs"));
        let meta = pod.metadata.unwrap();
        assert_eq!(
            (meta.name.as_str(), meta.namespace.as_str()),
            ("twig-template-agents-py", "agents")
        );
        let ns = pod
            .linux
            .and_then(|l| l.security_context)
            .and_then(|s| s.namespace_options)
            .unwrap();
        assert_eq!(ns.network, api::NamespaceMode::Node as i32);
        assert_eq!(
            pod.annotations
                .get(twig_proto::contract::NETWORK_ANNOTATION)
                .map(String::as_str),
            Some(twig_proto::contract::NETWORK_NONE),
            "the twig runtime refuses hostNetwork without it"
        );
    }
}
