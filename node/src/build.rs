//! App templates (`EnsureTemplate`): a SandboxTemplate built on this node.
//!
//! A template is built in a pod of the twig runtime handler on the node's
//! network namespace (no CNI address is taken), annotated `twig.dev/network:
//! none` (the shim refuses `hostNetwork` without it; the build's VM has no
//! network), whose one container `template` runs the template's image (its
//! `command` when given). Once the warm-up command exited 0 inside that
//! container (CRI ExecSync), and the container still runs, the pod's shim
//! takes a full snapshot of it into the node store under the template's id
//! ([`twig_store::layout::template_id`]) with the build's inputs as a
//! label. A pod annotated `twig.dev/template: <name>` is then restored from
//! that snapshot, and its first container adopts the template's running
//! process.
//!
//! **Where the build pod comes from** ([`RunsIn`], from the request's
//! `build_pod`):
//!
//! - **A build Pod** (what the controller asks for, `pod.rs`): a Pod object
//!   the controller of this node makes once the node answers
//!   `needs_build_pod` — bound to the node, RuntimeClass `twig`, the
//!   namespace's pull secrets as its `imagePullSecrets`, controlled by the
//!   SandboxTemplate, label `twig.dev/template-build`. Kubelet runs and
//!   pulls it like any pod; the daemon finds its sandbox by the Pod's UID,
//!   warms it up and snapshots it, and never stops or removes it: the
//!   controller deletes the Pod once the template is ready, or when a build
//!   failed in it (a warmed-up container is spent; the next attempt, after
//!   `retry_s`, gets a new Pod).
//! - **A pod the daemon runs itself through CRI** (a node no kubelet
//!   manages: the tests of this crate and of twig-e2e's CRI labs, or a
//!   standalone node): RunPodSandbox/CreateContainer/StartContainer, the
//!   image pulled as `pull` below says, the pod removed after the snapshot.
//!   Under a kubelet this cannot work: kubelet stops every sandbox it did
//!   not make, within seconds (see below).
//!
//! Builds run in the background; `EnsureTemplate` answers at once (not
//! ready, and why) and the controller asks again. At most
//! `templates.max_concurrent_builds` builds run at once (each is a VM, a
//! pull and a full snapshot); the others wait in line, first asked first
//! served, answering "queued behind N builds"; the build timeout counts
//! from a build's turn (a build Pod that kubelet has not started counts
//! against it). A failed build is reported until the next attempt,
//! `retry_s` later. A node-run build pod left by a daemon that died
//! mid-build is removed when the next build of the same template starts.
//!
//! **Image pulls**: a build Pod's image is pulled by kubelet with the Pod's
//! pull secrets, as any pod's. A node-run build uses the registry logins
//! `EnsureTemplate` carries; with logins the image is pulled on every
//! build, so the registry authorises the namespace rather than the node's
//! cache answering for it (see `pull`). Logins are kept in memory for the
//! build only: never logged (their `Debug` shows the registry and user),
//! never written to disk.
//!
//! **Why node-run builds die under kubelet** (kubernetes/kubernetes
//! master, `pkg/kubelet/`):
//!
//! - `kuberuntime/kuberuntime_sandbox.go`, `getKubeletSandboxes`: CRI
//!   `ListPodSandbox` with at most a state filter (READY) — no label
//!   filter: every sandbox containerd's CRI lists counts as kubelet's.
//! - `kuberuntime/kuberuntime_manager.go`, `GetPods`: groups the sandboxes
//!   into pods by the sandbox's CRI `metadata.uid`.
//! - `kubelet_pods.go`, `HandlePodCleanups` (every housekeeping tick, 2 s):
//!   every runtime pod whose UID the pod workers do not know is sent
//!   `SyncPodKill` ("Clean up containers for orphaned pod we had not seen
//!   before", `kubelet_orphaned_runtime_pods_total`); its sandboxes are
//!   stopped.
//!
//! No label, annotation, name or namespace avoids it, and borrowing a real
//! pod's UID makes kubelet kill that pod ("Multiple sandboxes are ready for
//! Pod"). So the build must be a Pod kubelet knows. twig-e2e's test kubelet
//! does the same housekeeping, so the lab's controller tests would fail a
//! node-run build.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use twig_cri::api;
use twig_cri::CriClient;
use twig_proto::contract::TEMPLATE_BUILD_CONTAINER as CONTAINER;
use twig_proto::twig::SnapshotRequest;
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

mod pod;
mod spec;

pub use spec::{template_id, Credential, Credentials, RunsIn, Spec};

/// The build pod's sandbox id once CRI made it, until it is removed.
type PodSlot = Arc<Mutex<Option<String>>>;

enum Build {
    Running {
        digest: String,
        /// When it got its turn (`templates.max_concurrent_builds`); none
        /// while it waits in line.
        started: Option<Instant>,
        /// Tells this build from a later one of the same template; builds
        /// wait for their turn in this order.
        seq: u64,
        task: tokio::task::JoinHandle<()>,
        /// Where it runs.
        runs_in: RunsIn,
        /// Its pod's name (a RunPodSandbox in flight has no id yet).
        pod_name: String,
        pod: PodSlot,
    },
    Failed {
        digest: String,
        at: Instant,
        message: String,
        /// Where it ran (a build Pod is spent).
        runs_in: RunsIn,
    },
}

/// The node's template builds.
pub struct Builder {
    config: TemplateBuildConfig,
    templates: Arc<Templates>,
    builds: Mutex<HashMap<String, Build>>,
    seq: std::sync::atomic::AtomicU64,
    /// One permit per build that may run (`templates.max_concurrent_builds`);
    /// tokio's semaphore serves waiters first come, first served.
    turns: Arc<Semaphore>,
    /// The ids of the images this daemon pulled with a namespace's
    /// credentials (an id, so that no other name of the image escapes): a
    /// build without credentials pulls them again (anonymously, which a
    /// private registry refuses) rather than use the cached copy.
    pulled_with_credentials: Mutex<HashSet<String>>,
}

/// Where a template's build stands, when it is not in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// A build runs (started now, or earlier).
    Building(String),
    /// A build waits for its turn: `templates.max_concurrent_builds` run.
    Queued(String),
    /// The last build failed; the next starts later (a build Pod it ran
    /// in is spent).
    Failed(String),
    /// Builds run in build Pods and none is given: the controller makes
    /// one for the build to start in.
    NeedsBuildPod(String),
}

impl Builder {
    /// Builds with `config` into the store of `templates`.
    pub fn new(config: TemplateBuildConfig, templates: Arc<Templates>) -> Arc<Builder> {
        let turns = Arc::new(Semaphore::new(config.max_concurrent_builds.max(1)));
        Arc::new(Builder {
            config,
            templates,
            builds: Mutex::new(HashMap::new()),
            seq: std::sync::atomic::AtomicU64::new(0),
            turns,
            pulled_with_credentials: Mutex::new(HashSet::new()),
        })
    }

    /// What a running build of `image` is doing: building since it got
    /// its turn, or waiting in line behind the builds that run and those
    /// that asked before it.
    fn running_progress(
        &self,
        builds: &HashMap<String, Build>,
        image: &str,
        seq: u64,
        started: Option<Instant>,
    ) -> Progress {
        if let Some(t) = started {
            return Progress::Building(format!(
                "building from {image} on this node for {} s",
                t.elapsed().as_secs()
            ));
        }
        let ahead = builds
            .values()
            .filter(|b| match b {
                Build::Running {
                    started: Some(_), ..
                } => true,
                Build::Running {
                    started: None,
                    seq: n,
                    ..
                } => *n < seq,
                Build::Failed { .. } => false,
            })
            .count();
        Progress::Queued(format!(
            "queued behind {ahead} build{} on this node (templates.max_concurrent_builds is {})",
            if ahead == 1 { "" } else { "s" },
            self.config.max_concurrent_builds
        ))
    }

    fn builds(&self) -> MutexGuard<'_, HashMap<String, Build>> {
        self.builds.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes sure `spec` is being built: starts a build unless one of the
    /// same inputs runs, or failed less than `retry_s` ago.
    ///
    /// Builds in build Pods: a build runs in the Pod `spec` names; one
    /// running in another Pod (the controller replaced it), or asked for
    /// with none (the controller's Pod is gone), is dropped. A failed
    /// build's Pod is spent: asked again with that Pod, or with none,
    /// within `retry_s`, the failure is reported; with none after that,
    /// [`Progress::NeedsBuildPod`].
    pub fn ensure(self: &Arc<Self>, spec: &Spec) -> Progress {
        let mut builds = self.builds();
        // A build runs on in the Pod it runs in; without a Pod (the
        // controller has none: it was deleted) it is dropped. A failure is
        // reported in its Pod, or without one.
        let same_pod = |runs_in: &RunsIn, running: bool| match &spec.runs_in {
            RunsIn::BuildPod(Some(_)) => *runs_in == spec.runs_in,
            RunsIn::BuildPod(None) => !running,
            RunsIn::NodePod => true,
        };
        match builds.get(&spec.id) {
            Some(Build::Running {
                digest,
                started,
                seq,
                runs_in,
                ..
            }) if *digest == spec.digest && same_pod(runs_in, true) => {
                return self.running_progress(&builds, &spec.image, *seq, *started);
            }
            Some(Build::Failed {
                digest,
                at,
                message,
                runs_in,
            }) if *digest == spec.digest
                && same_pod(runs_in, false)
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
        if spec.runs_in == RunsIn::BuildPod(None) {
            builds.remove(&spec.id);
            return Progress::NeedsBuildPod(format!(
                "waiting for the build Pod of template {} from {}",
                spec.key, spec.image
            ));
        }
        let (me, s) = (self.clone(), spec.clone());
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pod: PodSlot = Arc::new(Mutex::new(None));
        let slot = pod.clone();
        // Its turn now if a build may start and none waits; else in line.
        let turn = self.turns.clone().try_acquire_owned().ok();
        let started = turn.as_ref().map(|_| Instant::now());
        let task = tokio::spawn(async move {
            let Some(_turn) = me.wait_for_turn(turn, &s.id, seq).await else {
                return;
            };
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
                            runs_in: s.runs_in.clone(),
                        },
                    );
                }
            }
        });
        builds.insert(
            spec.id.clone(),
            Build::Running {
                digest: spec.digest.clone(),
                started,
                seq,
                task,
                runs_in: spec.runs_in.clone(),
                pod_name: spec.pod_name(),
                pod,
            },
        );
        self.running_progress(&builds, &spec.image, seq, started)
    }

    /// The turn of build `seq` of template `id`: `turn` when it had one at
    /// once, else the next free one (queued builds get theirs in order);
    /// recorded as started. None when the build was cancelled or replaced
    /// meanwhile (its permit goes back).
    async fn wait_for_turn(
        &self,
        turn: Option<OwnedSemaphorePermit>,
        id: &str,
        seq: u64,
    ) -> Option<OwnedSemaphorePermit> {
        let turn = match turn {
            Some(t) => t,
            None => {
                let t = self.turns.clone().acquire_owned().await.ok()?;
                let mut builds = self.builds();
                match builds.get_mut(id) {
                    Some(Build::Running {
                        seq: n, started, ..
                    }) if *n == seq => *started = Some(Instant::now()),
                    _ => return None,
                }
                tracing::info!(id, "a queued template build got its turn");
                t
            }
        };
        Some(turn)
    }

    /// Whether a build of template `id` runs (it may have published the
    /// template and be removing its pod).
    pub fn running(&self, id: &str) -> bool {
        matches!(self.builds().get(id), Some(Build::Running { .. }))
    }

    /// Stops the build of template `id`, if one runs — its work is
    /// dropped, then a pod the node runs (and so its VM) stopped and
    /// removed through CRI; a build Pod is the controller's to delete — and
    /// forgets a failed one. A pod that cannot be removed (CRI not
    /// answering) is an error; the next build of the template removes it
    /// (by name).
    pub async fn cancel(&self, id: &str) -> Result<()> {
        let removed = self.builds().remove(id);
        let Some(Build::Running {
            task,
            runs_in,
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
        if let RunsIn::BuildPod(uid) = runs_in {
            tracing::info!(id, pod_uid = uid, "stopped a template build in a build Pod");
            return Ok(());
        }
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

/// A CRI client of containerd (`templates.cri_socket`) whose calls time out
/// with the build.
async fn connect(config: &TemplateBuildConfig) -> Result<CriClient> {
    Ok(CriClient::connect(&config.cri_socket)
        .await
        .map_err(cri_error(&format!(
            "reaching containerd's CRI at {} (templates.cri_socket)",
            config.cri_socket.display()
        )))?
        .with_timeout(Duration::from_secs(config.build_timeout_s)))
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
        match &spec.runs_in {
            RunsIn::NodePod => build(&self.config, spec, pod, &self.pulled_with_credentials).await,
            RunsIn::BuildPod(Some(uid)) => pod::build(&self.config, spec, uid).await,
            RunsIn::BuildPod(None) => Err(Error::Internal(
                "a build Pod build started without its Pod".into(),
            )),
        }
    }
}

/// The image calls of a build (CRI's image service; a fake in tests).
#[async_trait::async_trait]
trait Images {
    /// The id of the image the runtime holds as `image`, if any
    /// (`ImageStatus`).
    async fn id(&self, image: &str) -> std::result::Result<Option<String>, twig_cri::Error>;
    /// Pulls `image`, with the login `auth` if given (`PullImage`); the
    /// pulled image's id.
    async fn pull(
        &self,
        image: &str,
        auth: Option<api::AuthConfig>,
    ) -> std::result::Result<String, twig_cri::Error>;
}

#[async_trait::async_trait]
impl Images for CriClient {
    async fn id(&self, image: &str) -> std::result::Result<Option<String>, twig_cri::Error> {
        self.image_id(image).await
    }

    async fn pull(
        &self,
        image: &str,
        auth: Option<api::AuthConfig>,
    ) -> std::result::Result<String, twig_cri::Error> {
        match auth {
            Some(auth) => self.pull_image_with_auth(image, auth).await,
            None => self.pull_image(image).await,
        }
    }
}

/// Makes `spec.image` usable by this build, and only as its namespace may.
///
/// With credentials, the image is pulled with them on every build, each
/// login tried in turn until one is accepted (as kubelet does with a pod's
/// pull secrets), even when containerd holds the image already: the
/// registry, not the node's cache, decides whether this namespace may have
/// it — never another tenant's cached private image. Layers already held
/// are not fetched again, so this costs a manifest request. Without
/// credentials, an image is pulled anonymously when containerd does not
/// hold it (kubelet's `IfNotPresent`) or when this daemon pulled the image
/// it holds under that name with some namespace's credentials (by image
/// id, so another name — a digest, `docker.io/library/…` — does not escape
/// it: a private image, whose registry refuses an anonymous pull). Not covered: a private image put in containerd's
/// cache by someone else (kubelet for a pod with pull secrets, an operator)
/// or by an earlier run of this daemon — kubelet has the same gap unless
/// its `KubeletEnsureSecretPulledImages` feature is on.
async fn pull(
    images: &(dyn Images + Sync),
    spec: &Spec,
    pulled_with_credentials: &Mutex<HashSet<String>>,
) -> Result<()> {
    let image = spec.image.as_str();
    if spec.credentials.is_empty() {
        let held = images
            .id(image)
            .await
            .map_err(cri_error(&format!("looking up image {image}")))?;
        if let Some(id) = held {
            let private = pulled_with_credentials
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&id);
            if !private {
                return Ok(());
            }
        }
        images
            .pull(image, None)
            .await
            .map_err(cri_error(&format!("pulling {image}")))?;
        return Ok(());
    }
    let mut last = None;
    for (i, c) in spec.credentials.iter().enumerate() {
        match images.pull(image, Some(c.auth_config())).await {
            Ok(id) => {
                pulled_with_credentials
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id);
                return Ok(());
            }
            Err(e) => {
                // Which login, by index and registry: never its secret.
                tracing::info!(
                    template = spec.key,
                    image,
                    credential = i,
                    server = c.server,
                    "pulling with a pull secret's login failed: {e}"
                );
                last = Some(e);
            }
        }
    }
    let n = spec.credentials.len();
    Err(Error::FailedPrecondition(format!(
        "pulling {image} with the {n} login{} of namespace {}'s pull secrets failed; the last: {}",
        if n == 1 { "" } else { "s" },
        spec.key.split_once('/').map_or("", |(ns, _)| ns),
        last.map(|e| e.to_string()).unwrap_or_default()
    )))
}

/// Builds `spec` through CRI; the build pod is removed whatever happens
/// (its id is in `pod` while it exists, for a cancellation to remove it).
async fn build(
    config: &TemplateBuildConfig,
    spec: &Spec,
    pod: &PodSlot,
    pulled_with_credentials: &Mutex<HashSet<String>>,
) -> Result<()> {
    let cri = connect(config).await?;
    remove_leftovers(&cri, spec).await?;
    pull(&cri, spec, pulled_with_credentials).await?;
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
    let result = build_in(config, &cri, spec, &sandbox, &pod_cfg).await;
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
    warm_up_and_snapshot(config, cri, spec, sandbox, &id).await
}

/// Runs `spec`'s warm-up command in container `id` of pod `sandbox`
/// (ExecSync), checks the container still runs, and has the pod's shim
/// snapshot it as the template.
async fn warm_up_and_snapshot(
    config: &TemplateBuildConfig,
    cri: &CriClient,
    spec: &Spec,
    sandbox: &str,
    id: &str,
) -> Result<()> {
    if !spec.warmup.is_empty() {
        let argv: Vec<&str> = spec.warmup.iter().map(String::as_str).collect();
        let out = cri
            .exec_sync(id, &argv, Duration::from_secs(config.build_timeout_s))
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
        .container_status(id)
        .await
        .map_err(cri_error("reading the template's container status"))?;
    if status.state != api::ContainerState::ContainerRunning as i32 {
        return Err(Error::FailedPrecondition(format!(
            "the template's container exited (code {}) before it was snapshotted: a template's \
             command must keep running; its log: {}",
            status.exit_code,
            tail(&std::fs::read_to_string(&status.log_path).unwrap_or_default())
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
    use twig_proto::twig::EnsureTemplateRequest;

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
        let on_base = |base: &str| a.clone().built_on(base).digest;
        assert_eq!(on_base("base-1"), on_base("base-1"));
        assert_ne!(
            on_base("base-1"),
            on_base("base-2"),
            "a new base: a rebuild"
        );
        assert_ne!(on_base("base-1"), a.digest);
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
                started: Some(Instant::now()),
                seq: 0,
                task: work,
                runs_in: RunsIn::NodePod,
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

    fn builder_in(dir: &Path, max_concurrent_builds: usize) -> Arc<Builder> {
        let mut config = crate::config::Config {
            store: dir.join("store"),
            allow_copy: true,
            run_dir: dir.join("run"),
            ..Default::default()
        };
        config.templates.cri_socket = dir.join("no-containerd.sock");
        config.templates.log_dir = dir.join("logs");
        config.templates.max_concurrent_builds = max_concurrent_builds;
        let templates = Arc::new(Templates::open(&config).unwrap());
        Builder::new(config.templates.clone(), templates)
    }

    fn named(name: &str) -> Spec {
        Spec::from_request(&EnsureTemplateRequest {
            name: format!("agents/{name}"),
            ..req("py:3", &[], &[])
        })
        .unwrap()
    }

    /// Issue 24, item 7: builds beyond `templates.max_concurrent_builds`
    /// wait for a turn, in the order they were asked for, and say so; one
    /// starts when a running build ends. (A build that started here fails
    /// at once — no containerd — so "still queued" means it never started.)
    /// Builds in build Pods: without a Pod the node asks for one; a build
    /// runs in the Pod named, and one in a replaced Pod is dropped for the
    /// new; a failed build's Pod is spent (asked with it, or with none,
    /// the failure is reported; a new Pod starts a new build); cancelling
    /// one touches no CRI (the Pod is the controller's).
    #[tokio::test]
    async fn builds_in_build_pods_run_in_the_pod_named_and_spend_it_on_failure() {
        let dir = tempfile::tempdir().unwrap();
        let builder = builder_in(dir.path(), 1);
        // Builds stay in line: the only turn is held.
        let _held = builder.turns.clone().try_acquire_owned().unwrap();
        let in_pod = |uid: Option<&str>| Spec {
            runs_in: RunsIn::BuildPod(uid.map(String::from)),
            ..named("a")
        };
        let id = in_pod(None).id;
        assert!(matches!(
            builder.ensure(&in_pod(None)),
            Progress::NeedsBuildPod(_)
        ));
        assert!(!builder.running(&id), "no build without its Pod");

        assert!(matches!(
            builder.ensure(&in_pod(Some("u1"))),
            Progress::Queued(_)
        ));
        let runs_in = |b: &Builder| match b.builds().get(&id) {
            Some(Build::Running { runs_in, .. } | Build::Failed { runs_in, .. }) => {
                Some(runs_in.clone())
            }
            None => None,
        };
        assert_eq!(runs_in(&builder), Some(in_pod(Some("u1")).runs_in));
        // Asked with its Pod: the same build.
        assert!(matches!(
            builder.ensure(&in_pod(Some("u1"))),
            Progress::Queued(_)
        ));
        assert_eq!(runs_in(&builder), Some(in_pod(Some("u1")).runs_in));
        // The controller replaced the Pod: the build moves to the new one.
        assert!(matches!(
            builder.ensure(&in_pod(Some("u2"))),
            Progress::Queued(_)
        ));
        assert_eq!(runs_in(&builder), Some(in_pod(Some("u2")).runs_in));

        // It failed in u2: u2 is spent.
        builder.builds().insert(
            id.clone(),
            Build::Failed {
                digest: in_pod(None).digest,
                at: Instant::now(),
                message: "the warm-up command exited with 1".into(),
                runs_in: in_pod(Some("u2")).runs_in,
            },
        );
        for uid in [Some("u2"), None] {
            match builder.ensure(&in_pod(uid)) {
                Progress::Failed(m) => assert!(m.contains("exited with 1"), "{m}"),
                other => panic!("{uid:?}: {other:?}"),
            }
        }
        assert!(matches!(
            builder.ensure(&in_pod(Some("u3"))),
            Progress::Queued(_)
        ));
        assert_eq!(runs_in(&builder), Some(in_pod(Some("u3")).runs_in));
        // Its Pod is gone (the controller asks without one): the build is
        // dropped and a new Pod asked for.
        assert!(matches!(
            builder.ensure(&in_pod(None)),
            Progress::NeedsBuildPod(_)
        ));
        assert!(!builder.running(&id));
        assert!(matches!(
            builder.ensure(&in_pod(Some("u4"))),
            Progress::Queued(_)
        ));
        // No containerd here: a cancel that reached for CRI would fail.
        builder
            .cancel(&id)
            .await
            .expect("a build Pod's build cancels without CRI");
        assert!(!builder.running(&id));
    }

    #[tokio::test]
    async fn builds_beyond_the_limit_wait_in_line_and_say_so() {
        let dir = tempfile::tempdir().unwrap();
        let builder = builder_in(dir.path(), 1);
        // A build holds the only turn.
        let held = builder.turns.clone().try_acquire_owned().unwrap();
        let a = named("a");
        builder.builds().insert(
            a.id.clone(),
            Build::Running {
                digest: a.digest.clone(),
                started: Some(Instant::now()),
                seq: builder
                    .seq
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                task: tokio::spawn(std::future::pending()),
                runs_in: RunsIn::NodePod,
                pod_name: a.pod_name(),
                pod: Arc::new(Mutex::new(None)),
            },
        );
        let (b, c) = (named("b"), named("c"));
        let limit = "on this node (templates.max_concurrent_builds is 1)";
        assert_eq!(
            builder.ensure(&b),
            Progress::Queued(format!("queued behind 1 build {limit}"))
        );
        assert_eq!(
            builder.ensure(&c),
            Progress::Queued(format!("queued behind 2 builds {limit}"))
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            builder.ensure(&b),
            Progress::Queued(format!("queued behind 1 build {limit}")),
            "asking again neither restarts nor starts it"
        );
        assert_eq!(
            builder.ensure(&c),
            Progress::Queued(format!("queued behind 2 builds {limit}"))
        );

        // The running build ends: the first in line runs (and fails, no
        // containerd), then the next.
        builder.builds().remove(&a.id);
        drop(held);
        let deadline = Instant::now() + Duration::from_secs(20);
        for spec in [&b, &c] {
            loop {
                match builder.ensure(spec) {
                    Progress::Failed(m) => {
                        assert!(m.contains("reaching containerd's CRI"), "{m}");
                        break;
                    }
                    other => assert!(Instant::now() < deadline, "{other:?}"),
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        assert_eq!(
            builder.turns.available_permits(),
            1,
            "every turn was given back"
        );
    }

    /// A queued build that is cancelled leaves the line without running.
    #[tokio::test]
    async fn a_cancelled_queued_build_never_runs() {
        let dir = tempfile::tempdir().unwrap();
        let builder = builder_in(dir.path(), 1);
        let held = builder.turns.clone().try_acquire_owned().unwrap();
        let b = named("b");
        assert!(matches!(builder.ensure(&b), Progress::Queued(_)));
        builder.cancel(&b.id).await.expect("nothing to stop");
        drop(held);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!builder.running(&b.id));
        assert_eq!(builder.turns.available_permits(), 1);
        // It left the line: asked again, it starts at once.
        assert!(
            matches!(builder.ensure(&b), Progress::Building(_)),
            "{:?}",
            builder.ensure(&b)
        );
    }

    /// CRI's image service as a build sees it: holds `present` images
    /// (name → id; a pulled image's id is `sha256:<name>` unless it holds
    /// the name); refuses the first `refuse` pulls; records every pull with
    /// the registry, user and password of its login.
    #[derive(Default)]
    struct FakeImages {
        present: HashMap<String, String>,
        refuse: std::sync::atomic::AtomicUsize,
        pulls: Mutex<Vec<Pull>>,
    }

    #[async_trait::async_trait]
    impl Images for FakeImages {
        async fn id(&self, image: &str) -> std::result::Result<Option<String>, twig_cri::Error> {
            Ok(self.present.get(image).cloned())
        }
        async fn pull(
            &self,
            image: &str,
            auth: Option<api::AuthConfig>,
        ) -> std::result::Result<String, twig_cri::Error> {
            self.pulls.lock().unwrap().push((
                image.to_string(),
                auth.map(|a| (a.server_address, a.username, a.password)),
            ));
            let refuse = &self.refuse;
            if refuse.load(std::sync::atomic::Ordering::Relaxed) > 0 {
                refuse.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                // (The fake's stand-in for a registry's 401.)
                return Err(twig_cri::Error::Incomplete {
                    call: "PullImage",
                    what: "a login the registry accepts",
                });
            }
            Ok(self
                .present
                .get(image)
                .cloned()
                .unwrap_or_else(|| format!("sha256:{image}")))
        }
    }

    fn login(server: &str, user: &str) -> twig_proto::twig::RegistryCredential {
        twig_proto::twig::RegistryCredential {
            server: server.into(),
            username: user.into(),
            password: format!("{user}-secret"),
            ..Default::default()
        }
    }

    fn with_logins(image: &str, logins: &[(&str, &str)]) -> Spec {
        Spec::from_request(&EnsureTemplateRequest {
            pull_credentials: logins.iter().map(|(s, u)| login(s, u)).collect(),
            ..req(image, &[], &[])
        })
        .unwrap()
    }

    #[test]
    fn a_spec_keeps_its_logins_out_of_its_digest_and_its_debug() {
        let plain = Spec::from_request(&req("reg.example/py:3", &[], &[])).unwrap();
        let spec = with_logins("reg.example/py:3", &[("reg.example", "alice")]);
        assert_eq!(spec.digest, plain.digest, "a login is not a build input");
        assert_eq!(spec.credentials.len(), 1);
        assert_eq!(spec.credentials[0].password, "alice-secret");
        let shown = format!("{spec:?}");
        assert!(
            shown.contains("alice") && shown.contains("reg.example"),
            "{shown}"
        );
        assert!(!shown.contains("alice-secret"), "{shown}");
        let e = Spec::from_request(&EnsureTemplateRequest {
            pull_credentials: vec![login("", "alice")],
            ..req("py:3", &[], &[])
        })
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("pull_credentials[0] names no registry")
                && !e.to_string().contains("secret"),
            "{e}"
        );
    }

    type Pull = (String, Option<(String, String, String)>);

    fn pulls_of(images: &FakeImages) -> Vec<Pull> {
        std::mem::take(&mut *images.pulls.lock().unwrap())
    }

    fn with(image: &str, login: Option<(&str, &str)>) -> Pull {
        (
            image.to_string(),
            login.map(|(s, u)| (s.to_string(), u.to_string(), format!("{u}-secret"))),
        )
    }

    /// Issue 24, item 7: a build with its namespace's logins pulls with
    /// them even when containerd holds the image (the registry decides,
    /// not the cache), trying each in turn; a build without logins uses a
    /// cached image unless this daemon pulled it with some namespace's
    /// logins, and then pulls it anonymously.
    #[tokio::test]
    async fn a_private_image_is_pulled_with_the_namespaces_own_logins_every_time() {
        let image = "reg.example/team-a/app:1";
        let by_digest = "reg.example/team-a/app@sha256:1111";
        let images = FakeImages {
            present: [
                (image.to_string(), "sha256:app1".to_string()),
                (by_digest.to_string(), "sha256:app1".to_string()),
            ]
            .into(),
            ..Default::default()
        };
        let seen = Mutex::new(HashSet::new());

        // Cached, and logins given: pulled with the first.
        let spec = with_logins(image, &[("reg.example", "alice"), ("reg.example", "bob")]);
        pull(&images, &spec, &seen).await.unwrap();
        assert_eq!(
            pulls_of(&images),
            vec![with(image, Some(("reg.example", "alice")))]
        );

        // The first login refused: the second is tried.
        images.refuse.store(1, std::sync::atomic::Ordering::Relaxed);
        pull(&images, &spec, &seen).await.unwrap();
        assert_eq!(
            pulls_of(&images),
            vec![
                with(image, Some(("reg.example", "alice"))),
                with(image, Some(("reg.example", "bob")))
            ]
        );

        // Every login refused: the build fails, naming no secret.
        images.refuse.store(2, std::sync::atomic::Ordering::Relaxed);
        let m = pull(&images, &spec, &seen).await.unwrap_err().to_string();
        assert!(
            m.contains("with the 2 logins of namespace agents's pull secrets failed"),
            "{m}"
        );
        assert!(!m.contains("-secret"), "{m}");
        assert_eq!(pulls_of(&images).len(), 2);

        // Another namespace without logins: the cached copy this daemon
        // pulled with logins is not handed out; it is pulled anonymously.
        let other = Spec::from_request(&EnsureTemplateRequest {
            name: "team-b/app".into(),
            ..req(image, &[], &[])
        })
        .unwrap();
        pull(&images, &other, &seen).await.unwrap();
        assert_eq!(pulls_of(&images), vec![with(image, None)]);
        // Nor under another name of the same image.
        let renamed = Spec::from_request(&EnsureTemplateRequest {
            name: "team-b/app".into(),
            ..req(by_digest, &[], &[])
        })
        .unwrap();
        pull(&images, &renamed, &seen).await.unwrap();
        assert_eq!(pulls_of(&images), vec![with(by_digest, None)]);
    }

    #[tokio::test]
    async fn without_logins_a_public_image_is_pulled_only_if_absent() {
        let (cached, absent) = ("docker.io/library/python:3", "docker.io/library/ruby:3");
        let images = FakeImages {
            present: [(cached.to_string(), "sha256:py".to_string())].into(),
            ..Default::default()
        };
        let seen = Mutex::new(HashSet::new());
        for image in [cached, absent] {
            let spec = Spec::from_request(&req(image, &[], &[])).unwrap();
            pull(&images, &spec, &seen).await.unwrap();
        }
        assert_eq!(pulls_of(&images), vec![with(absent, None)]);
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
