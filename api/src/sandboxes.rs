//! The sandbox operations, each on one tenant's namespace: what every API
//! call does to Twig's Kubernetes objects (see [`crate::objects`] for how
//! a sandbox is kept in them).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::{Duration, SystemTime};

use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;
use twig_controller::crd::{
    Phase, PodClone, Rollback, RollbackSpec, SandboxTemplate, Snapshot, CLONE_LABEL,
};

use crate::auth::{sha256_hex, TokenKind};
use crate::error::ApiError;
use crate::model::{
    ForkError, ForkResult, NewSandbox, Sandbox, SandboxDetail, SnapshotInfo, ENVD_VERSION,
};
use crate::objects::{
    self, check_id, SandboxMeta, CPUS_ANNOTATION, END_ANNOTATION, MEMORY_ANNOTATION,
    ON_TIMEOUT_ANNOTATION, PUBLIC_TRAFFIC_ANNOTATION, ROLE_FORK, ROLE_LABEL, ROLE_PAUSE,
    ROLE_SNAPSHOT, SANDBOX_LABEL, SNAPSHOT_NAMES_ANNOTATION, SNAPSHOT_OF_LABEL, STARTED_ANNOTATION,
    TEMPLATE_ID_ANNOTATION,
};
use crate::App;

/// Most forks one call makes.
pub const MAX_FORKS: i64 = 64;

/// Where a sandbox is now.
pub enum State {
    /// Its pod.
    Running(Box<Pod>),
    /// Its pause Snapshot.
    Paused(Box<Snapshot>),
}

/// A sandbox found in a namespace.
pub struct Found {
    /// Its ID.
    pub id: String,
    /// Its state.
    pub state: State,
}

impl Found {
    fn meta(&self) -> &ObjectMeta {
        match &self.state {
            State::Running(pod) => &pod.metadata,
            State::Paused(snap) => &snap.metadata,
        }
    }

    fn state_name(&self) -> &'static str {
        match self.state {
            State::Running(_) => "running",
            State::Paused(_) => "paused",
        }
    }

    fn pod(&self) -> Result<&Pod, ApiError> {
        match &self.state {
            State::Running(pod) => Ok(pod),
            State::Paused(_) => Err(ApiError::conflict(format!(
                "sandbox '{}' is paused; connect to it first",
                self.id
            ))),
        }
    }
}

/// RFC 3339 of `t`, to the second, in UTC.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let ts = k8s_openapi::jiff::Timestamp::from_second(i64::try_from(secs).unwrap_or(i64::MAX))
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// The time an RFC 3339 annotation holds.
pub fn parse_time(text: &str) -> Option<SystemTime> {
    let ts: k8s_openapi::jiff::Timestamp = text.parse().ok()?;
    let secs = u64::try_from(ts.as_second()).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
}

/// A Twig object with a lifecycle phase.
trait Phased {
    fn phase(&self) -> Option<Phase>;
}

impl Phased for PodClone {
    fn phase(&self) -> Option<Phase> {
        self.status.as_ref().map(|s| s.phase)
    }
}

impl Phased for Snapshot {
    fn phase(&self) -> Option<Phase> {
        self.status.as_ref().map(|s| s.phase)
    }
}

impl Phased for Rollback {
    fn phase(&self) -> Option<Phase> {
        self.status.as_ref().map(|s| s.phase)
    }
}

/// Whether `obj` is gone or its phase is final (Ready, Failed or Lost).
fn settled<K: Phased>(obj: Option<&K>) -> bool {
    obj.is_none_or(|o| {
        o.phase()
            .is_some_and(|p| matches!(p, Phase::Ready | Phase::Failed | Phase::Lost))
    })
}

fn not_deleting<K: Resource>(obj: &K) -> bool {
    obj.meta().deletion_timestamp.is_none()
}

fn pod_ready(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    status.and_then(|s| s.pod_ip.as_ref()).is_some()
        && status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn pod_ended(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Failed" || p == "Succeeded")
}

/// Why a pod is not running: its containers' waiting or terminated reasons.
fn pod_trouble(pod: &Pod) -> String {
    let status = pod.status.as_ref();
    let mut parts: Vec<String> = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let state = c.state.as_ref()?;
            if let Some(w) = &state.waiting {
                return Some(format!(
                    "{}: {} {}",
                    c.name,
                    w.reason.clone().unwrap_or_default(),
                    w.message.clone().unwrap_or_default()
                ));
            }
            state.terminated.as_ref().map(|t| {
                format!(
                    "{}: exited {} {}",
                    c.name,
                    t.exit_code,
                    t.reason.clone().unwrap_or_default()
                )
            })
        })
        .collect();
    if let Some(phase) = status.and_then(|s| s.phase.as_ref()) {
        parts.insert(0, format!("pod {phase}"));
    }
    if parts.is_empty() {
        "not scheduled or started yet".to_string()
    } else {
        parts.join("; ")
    }
}

impl App {
    fn api<K>(&self, ns: &str) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), ns)
    }

    /// Waits until `cond` holds for object `name` (or it is gone, when
    /// `cond` accepts `None`), at most `limit`.
    async fn wait<K>(
        &self,
        ns: &str,
        name: &str,
        limit: Duration,
        cond: impl Fn(Option<&K>) -> bool,
    ) -> Result<Option<Option<K>>, ApiError>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + Debug
            + Send
            + DeserializeOwned
            + 'static,
        <K as Resource>::DynamicType: Default,
    {
        match tokio::time::timeout(limit, await_condition(self.api::<K>(ns), name, cond)).await {
            Ok(Ok(obj)) => Ok(Some(obj)),
            Ok(Err(e)) => Err(ApiError::internal(format!("watching {name}: {e}"))),
            Err(_) => Ok(None),
        }
    }

    /// The sandbox `id` of namespace `ns`.
    pub async fn find(&self, ns: &str, id: &str) -> Result<Found, ApiError> {
        check_id("sandbox", id)?;
        let selector = format!("{SANDBOX_LABEL}={id}");
        let pods = self
            .api::<Pod>(ns)
            .list(&ListParams::default().labels(&selector))
            .await?;
        if let Some(pod) = pods.items.into_iter().find(not_deleting) {
            return Ok(Found {
                id: id.to_string(),
                state: State::Running(Box::new(pod)),
            });
        }
        let paused = format!("{selector},{ROLE_LABEL}={ROLE_PAUSE}");
        let snaps = self
            .api::<Snapshot>(ns)
            .list(&ListParams::default().labels(&paused))
            .await?;
        snaps
            .items
            .into_iter()
            .filter(|s| {
                not_deleting(s) && s.status.as_ref().is_some_and(|st| st.phase == Phase::Ready)
            })
            .max_by_key(|s| s.metadata.creation_timestamp.clone())
            .map(|snap| Found {
                id: id.to_string(),
                state: State::Paused(Box::new(snap)),
            })
            .ok_or_else(|| ApiError::not_found(format!("sandbox '{id}' not found")))
    }

    /// The timeout `asked` (seconds) as an end time; the default when absent.
    fn end_time(&self, asked: Option<i64>) -> Result<SystemTime, ApiError> {
        let secs = asked.unwrap_or(self.default_timeout);
        if secs < 1 || secs > self.max_timeout {
            return Err(ApiError::bad_request(format!(
                "timeout must be between 1 and {} seconds, not {secs}",
                self.max_timeout
            )));
        }
        Ok(SystemTime::now() + Duration::from_secs(secs.unsigned_abs()))
    }

    /// The answer for a running sandbox.
    fn sandbox(&self, ns: &str, id: &str, meta: &SandboxMeta) -> Sandbox {
        let template = meta
            .annotations
            .get(TEMPLATE_ID_ANNOTATION)
            .cloned()
            .unwrap_or_default();
        let private = meta
            .annotations
            .get(PUBLIC_TRAFFIC_ANNOTATION)
            .is_some_and(|v| v == "false");
        Sandbox {
            alias: Some(template.clone()),
            template_id: template,
            sandbox_id: id.to_string(),
            client_id: "twig".to_string(),
            envd_version: ENVD_VERSION.to_string(),
            domain: self.domain.clone(),
            envd_access_token: Some(self.tokens.token(TokenKind::Envd, ns, id)),
            traffic_access_token: private.then(|| self.tokens.token(TokenKind::Traffic, ns, id)),
            state: "running".to_string(),
        }
    }

    /// `GET /sandboxes/{id}`.
    pub fn detail(&self, ns: &str, found: &Found) -> SandboxDetail {
        let meta = SandboxMeta::of(found.meta());
        let get = |key: &str| meta.annotations.get(key).cloned();
        let number = |key: &str| get(key).and_then(|v| v.parse().ok()).unwrap_or_default();
        let template = get(TEMPLATE_ID_ANNOTATION).unwrap_or_default();
        let running = matches!(found.state, State::Running(_));
        SandboxDetail {
            alias: Some(template.clone()),
            template_id: template,
            sandbox_id: found.id.clone(),
            client_id: "twig".to_string(),
            cpu_count: number(CPUS_ANNOTATION),
            memory_mb: number(MEMORY_ANNOTATION),
            disk_size_mb: 0,
            started_at: get(STARTED_ANNOTATION).unwrap_or_default(),
            end_at: get(END_ANNOTATION).unwrap_or_default(),
            envd_version: ENVD_VERSION.to_string(),
            state: found.state_name().to_string(),
            metadata: objects::metadata_of(&meta.labels),
            domain: self.domain.clone(),
            envd_access_token: running.then(|| self.tokens.token(TokenKind::Envd, ns, &found.id)),
        }
    }

    /// `POST /v2/sandboxes`, `POST /sandboxes`: a sandbox from a
    /// SandboxTemplate, or from a snapshot (its ID as the template ID).
    pub async fn create(&self, ns: &str, req: NewSandbox) -> Result<Sandbox, ApiError> {
        let template_id = req.template_id.clone();
        if !crate::auth::is_dns_label(&template_id) {
            return Err(ApiError::not_found(format!(
                "template '{template_id}' not found"
            )));
        }
        let id = objects::new_id('i')?;
        let mut labels = objects::metadata_labels(&req.metadata.clone().unwrap_or_default())?;
        labels.insert(SANDBOX_LABEL.to_string(), id.clone());
        let end = self.end_time(req.timeout)?;
        let mut annotations = BTreeMap::from([
            (TEMPLATE_ID_ANNOTATION.to_string(), template_id.clone()),
            (STARTED_ANNOTATION.to_string(), rfc3339(SystemTime::now())),
            (END_ANNOTATION.to_string(), rfc3339(end)),
        ]);
        let pause_at_end = req.auto_pause == Some(true)
            || req
                .lifecycle
                .as_ref()
                .and_then(|l| l.on_timeout.as_deref())
                .is_some_and(|t| t == "pause");
        if pause_at_end {
            annotations.insert(ON_TIMEOUT_ANNOTATION.to_string(), "pause".to_string());
        }
        let network = req.network.unwrap_or_default();
        if network.allow_public_traffic == Some(false) {
            annotations.insert(PUBLIC_TRAFFIC_ANNOTATION.to_string(), "false".to_string());
        }
        let policy = egress_policy(
            req.allow_internet_access,
            network.allow_out.unwrap_or_default(),
            network.deny_out.unwrap_or_default(),
        )?;
        let env = req.env_vars.unwrap_or_default();

        let snapshots = self.api::<Snapshot>(ns);
        if let Some(snap) = snapshots.get_opt(&template_id).await? {
            if snap.labels().get(ROLE_LABEL).map(String::as_str) != Some(ROLE_SNAPSHOT) {
                return Err(ApiError::not_found(format!(
                    "template '{template_id}' not found"
                )));
            }
            for key in [CPUS_ANNOTATION, MEMORY_ANNOTATION] {
                if let Some(v) = snap.annotations().get(key) {
                    annotations.insert(key.to_string(), v.clone());
                }
            }
            let meta = SandboxMeta {
                labels,
                annotations,
            };
            let source = snap.labels().get(SNAPSHOT_OF_LABEL).cloned();
            let pod = self.start_clone(ns, &id, &template_id, &meta).await?;
            self.init_envd(ns, &pod, &id, source.as_deref(), &env)
                .await?;
            return Ok(self.sandbox(ns, &id, &meta));
        }
        let Some(template) = self
            .api::<SandboxTemplate>(ns)
            .get_opt(&template_id)
            .await?
        else {
            return Err(ApiError::not_found(format!(
                "template '{template_id}' not found"
            )));
        };
        annotations.insert(CPUS_ANNOTATION.to_string(), template.spec.vcpus.to_string());
        annotations.insert(
            MEMORY_ANNOTATION.to_string(),
            template.spec.memory_mib.to_string(),
        );
        let meta = SandboxMeta {
            labels,
            annotations,
        };
        let token = self.tokens.token(TokenKind::Envd, ns, &id);
        let pod = objects::template_pod(&id, &template, &meta, &env, policy, sha256_hex(&token));
        self.api::<Pod>(ns)
            .create(&PostParams::default(), &pod)
            .await?;
        let pod = self.ready_pod(ns, &id, None).await?;
        // envd requires the sandbox's token from the start.
        self.init_envd(ns, &pod, &id, Some(&id), &env).await?;
        Ok(self.sandbox(ns, &id, &meta))
    }

    /// Makes sandbox `id`'s pod by a Clone of Snapshot `snapshot`, and
    /// waits for it to be Ready.
    async fn start_clone(
        &self,
        ns: &str,
        name: &str,
        snapshot: &str,
        meta: &SandboxMeta,
    ) -> Result<Pod, ApiError> {
        let clone = objects::clone(name, snapshot, meta, self.start_timeout);
        self.api::<PodClone>(ns)
            .create(&PostParams::default(), &clone)
            .await?;
        let pod_name = objects::clone_pod_name(name);
        // The Clone makes the pod, and is Ready when the pod is.
        let waited = self
            .wait::<PodClone>(ns, name, self.start_timeout, settled)
            .await?;
        let failed = match waited {
            Some(Some(c)) => {
                let status = c.status.unwrap_or_default();
                (status.phase != Phase::Ready)
                    .then(|| status.message.unwrap_or_else(|| status.phase.to_string()))
            }
            Some(None) => Some("its Clone was deleted".to_string()),
            None => Some(format!(
                "not Ready within {} s",
                self.start_timeout.as_secs()
            )),
        };
        if let Some(why) = failed {
            let pod = self.api::<Pod>(ns).get_opt(&pod_name).await?;
            let trouble = pod.as_ref().map(pod_trouble).unwrap_or_default();
            self.remove(ns, &pod_name, Some(name)).await;
            return Err(ApiError::internal(format!(
                "the sandbox did not start: {why} {trouble}"
            )));
        }
        let pod = self.ready_pod(ns, &pod_name, Some(name)).await?;
        // A Clone's pod has the Clone's labels; the sandbox's annotations
        // (its times and size) are written on it here.
        let patch = json!({"metadata": {"annotations": meta.annotations}});
        self.api::<Pod>(ns)
            .patch(&pod_name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(ApiError::from)
            .map(|_| pod)
    }

    /// Waits for pod `name` to be Ready with an IP; on failure removes it
    /// (with its Clone `clone`, if any) and says why it did not start.
    async fn ready_pod(&self, ns: &str, name: &str, clone: Option<&str>) -> Result<Pod, ApiError> {
        let done = |pod: Option<&Pod>| pod.is_none_or(|p| pod_ready(p) || pod_ended(p));
        let waited = self.wait::<Pod>(ns, name, self.start_timeout, done).await?;
        let trouble = match waited {
            Some(Some(pod)) if pod_ready(&pod) => return Ok(pod),
            Some(Some(pod)) => pod_trouble(&pod),
            Some(None) => "its pod was deleted".to_string(),
            None => {
                let now = self.api::<Pod>(ns).get_opt(name).await?;
                let why = now.as_ref().map(pod_trouble).unwrap_or_default();
                format!("not Ready within {} s: {why}", self.start_timeout.as_secs())
            }
        };
        self.remove(ns, name, clone).await;
        Err(ApiError::internal(format!(
            "the sandbox did not start: {trouble}"
        )))
    }

    /// Deletes pod `name` and the Clone that made it, ignoring what is gone.
    async fn remove(&self, ns: &str, pod: &str, clone: Option<&str>) {
        if let Some(clone) = clone {
            let _ = self
                .api::<PodClone>(ns)
                .delete(clone, &DeleteParams::background())
                .await;
        }
        let _ = self
            .api::<Pod>(ns)
            .delete(pod, &DeleteParams::default())
            .await;
    }

    /// Tells the sandbox's envd its access token, environment and the time
    /// (E2B's `POST /init`): after every start from a template or snapshot,
    /// whose envd requires the token of sandbox `source` (the new sandbox's
    /// own, named by its pod, or the snapshotted sandbox's, in its memory).
    async fn init_envd(
        &self,
        ns: &str,
        pod: &Pod,
        id: &str,
        source: Option<&str>,
        env: &BTreeMap<String, String>,
    ) -> Result<(), ApiError> {
        let Some(ip) = pod.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
            return Err(ApiError::internal("the sandbox's pod has no IP"));
        };
        let body = json!({
            "accessToken": self.tokens.token(TokenKind::Envd, ns, id),
            "envVars": env,
            "timestamp": rfc3339(SystemTime::now()),
        });
        let old = source.map(|s| self.tokens.token(TokenKind::Envd, ns, s));
        crate::envd::init(&self.http, &ip, self.envd_port, old.as_deref(), &body)
            .await
            .map_err(|e| ApiError::internal(format!("the sandbox's envd: {e}")))
    }

    /// `POST /sandboxes/{id}/pause`: a full Snapshot of the pod, then the pod
    /// (its VM) released. Earlier pause Snapshots of the sandbox go.
    pub async fn pause(&self, ns: &str, id: &str) -> Result<(), ApiError> {
        let found = self.find(ns, id).await?;
        let pod = match &found.state {
            State::Running(pod) => pod,
            State::Paused(_) => {
                return Err(ApiError::conflict(format!(
                    "sandbox '{id}' is already paused"
                )))
            }
        };
        let meta = SandboxMeta::of(&pod.metadata);
        let name = format!("{id}-p{}", objects::generation());
        self.take_snapshot(
            ns,
            &name,
            &pod.name_any(),
            ROLE_PAUSE,
            id,
            &meta,
            BTreeMap::new(),
        )
        .await?;
        let earlier = self.pause_snapshots(ns, id).await?;
        let pod_name = pod.name_any();
        self.remove(ns, &pod_name, clone_of(pod).as_deref()).await;
        let gone = self
            .wait::<Pod>(ns, &pod_name, self.start_timeout, |p| p.is_none())
            .await?;
        if gone.is_none() {
            return Err(ApiError::internal(format!(
                "sandbox '{id}' was snapshotted but its pod {pod_name} is still there after {} s",
                self.start_timeout.as_secs()
            )));
        }
        for old in earlier.into_iter().filter(|n| *n != name) {
            let _ = self
                .api::<Snapshot>(ns)
                .delete(&old, &DeleteParams::default())
                .await;
        }
        Ok(())
    }

    async fn pause_snapshots(&self, ns: &str, id: &str) -> Result<Vec<String>, ApiError> {
        let selector = format!("{SANDBOX_LABEL}={id},{ROLE_LABEL}={ROLE_PAUSE}");
        Ok(self
            .api::<Snapshot>(ns)
            .list(&ListParams::default().labels(&selector))
            .await?
            .items
            .iter()
            .map(|s| s.name_any())
            .collect())
    }

    /// Creates Snapshot `name` and waits for it to be Ready; a failed one is
    /// deleted and its reason returned.
    #[allow(clippy::too_many_arguments)]
    async fn take_snapshot(
        &self,
        ns: &str,
        name: &str,
        pod: &str,
        role: &str,
        id: &str,
        meta: &SandboxMeta,
        extra: BTreeMap<String, String>,
    ) -> Result<Snapshot, ApiError> {
        let snap = objects::snapshot(name, pod, role, id, meta, extra, self.snapshot_timeout);
        let api = self.api::<Snapshot>(ns);
        api.create(&PostParams::default(), &snap).await?;
        let waited = self
            .wait::<Snapshot>(ns, name, self.snapshot_timeout, settled)
            .await?;
        let why = match waited {
            Some(Some(s)) => {
                let status = s.status.clone().unwrap_or_default();
                if status.phase == Phase::Ready {
                    return Ok(s);
                }
                status.message.unwrap_or_else(|| status.phase.to_string())
            }
            Some(None) => "it was deleted".to_string(),
            None => format!("not Ready within {} s", self.snapshot_timeout.as_secs()),
        };
        let _ = api.delete(name, &DeleteParams::default()).await;
        Err(ApiError::internal(format!(
            "snapshot of sandbox '{id}' failed: {why}"
        )))
    }

    /// `POST /v2/sandboxes/{id}/connect`, `/connect`, `/resume`: a running
    /// sandbox gets the new timeout (`false`: it was running); a paused one
    /// is restored from its pause Snapshot (`true`).
    pub async fn connect(
        &self,
        ns: &str,
        id: &str,
        timeout: Option<i64>,
    ) -> Result<(Sandbox, bool), ApiError> {
        let found = self.find(ns, id).await?;
        let end = self.end_time(timeout)?;
        match &found.state {
            State::Running(pod) => {
                // Connecting never shortens a running sandbox's life.
                let later = pod
                    .annotations()
                    .get(END_ANNOTATION)
                    .and_then(|t| parse_time(t))
                    .is_none_or(|current| current < end);
                if later {
                    self.set_end(ns, &found, Some(end)).await?;
                }
                let meta = SandboxMeta::of(&pod.metadata);
                Ok((self.sandbox(ns, id, &meta), false))
            }
            State::Paused(snap) => {
                let mut meta = SandboxMeta::of(&snap.metadata);
                meta.annotations
                    .insert(END_ANNOTATION.to_string(), rfc3339(end));
                let name = format!("{id}-r{}", objects::generation());
                let pod = self.start_clone(ns, &name, &snap.name_any(), &meta).await?;
                self.init_envd(ns, &pod, id, Some(id), &BTreeMap::new())
                    .await?;
                Ok((self.sandbox(ns, id, &meta), true))
            }
        }
    }

    /// `POST /sandboxes/{id}/fork`: `count` new sandboxes from one Snapshot
    /// of this one, each its own Clone; the Snapshot goes with the last.
    pub async fn fork(
        &self,
        ns: &str,
        id: &str,
        count: Option<i64>,
        timeout: Option<i64>,
    ) -> Result<Vec<ForkResult>, ApiError> {
        let count = count.unwrap_or(1);
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(ApiError::bad_request(format!(
                "count must be between 1 and {MAX_FORKS}, not {count}"
            )));
        }
        let end = self.end_time(timeout)?;
        let found = self.find(ns, id).await?;
        let pod = found.pod()?;
        let meta = SandboxMeta::of(&pod.metadata);
        let snap_name = format!("{id}-f{}", objects::generation());
        let snap = self
            .take_snapshot(
                ns,
                &snap_name,
                &pod.name_any(),
                ROLE_FORK,
                id,
                &meta,
                BTreeMap::new(),
            )
            .await?;
        let mut ids = Vec::new();
        for _ in 0..count {
            ids.push(objects::new_id('i')?);
        }
        let snap_name = &snap_name;
        let starts = ids.iter().map(|new| {
            let mut fork = meta.with_id(new);
            fork.annotations
                .insert(STARTED_ANNOTATION.to_string(), rfc3339(SystemTime::now()));
            fork.annotations
                .insert(END_ANNOTATION.to_string(), rfc3339(end));
            async move {
                let pod = self.start_clone(ns, new, snap_name, &fork).await?;
                self.init_envd(ns, &pod, new, Some(id), &BTreeMap::new())
                    .await?;
                Ok::<_, ApiError>(self.sandbox(ns, new, &fork))
            }
        });
        let results = join_all(starts).await;
        self.own_by_clones(ns, &snap, &ids).await;
        Ok(results
            .into_iter()
            .map(|r| match r {
                Ok(sandbox) => ForkResult {
                    sandbox: Some(sandbox),
                    error: None,
                },
                Err(e) => ForkResult {
                    sandbox: None,
                    error: Some(ForkError {
                        code: e.status,
                        message: e.message,
                    }),
                },
            })
            .collect())
    }

    /// Makes the Clones `names` owners of `snap`, so that it is garbage
    /// collected with the last of them (it is deleted now when none exists).
    async fn own_by_clones(&self, ns: &str, snap: &Snapshot, names: &[String]) {
        let clones = self.api::<PodClone>(ns);
        let mut owners: Vec<OwnerReference> = Vec::new();
        for name in names {
            if let Ok(Some(clone)) = clones.get_opt(name).await {
                if let Some(mut owner) = clone.controller_owner_ref(&()) {
                    owner.controller = Some(false);
                    owner.block_owner_deletion = Some(false);
                    owners.push(owner);
                }
            }
        }
        let api = self.api::<Snapshot>(ns);
        let name = snap.name_any();
        if owners.is_empty() {
            let _ = api.delete(&name, &DeleteParams::default()).await;
            return;
        }
        let patch = json!({"metadata": {"ownerReferences": owners}});
        if let Err(e) = api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            tracing::warn!(snapshot = %name, "could not make the forks own their snapshot: {e}");
        }
    }

    /// `POST /sandboxes/{id}/snapshots`: a Snapshot whose ID is a template ID.
    pub async fn snapshot(
        &self,
        ns: &str,
        id: &str,
        name: Option<String>,
    ) -> Result<SnapshotInfo, ApiError> {
        let found = self.find(ns, id).await?;
        let pod = found.pod()?;
        let meta = SandboxMeta::of(&pod.metadata);
        let names: Vec<String> = name.into_iter().collect();
        let mut extra = BTreeMap::from([(
            SNAPSHOT_NAMES_ANNOTATION.to_string(),
            serde_json::to_string(&names).unwrap_or_default(),
        )]);
        for key in [TEMPLATE_ID_ANNOTATION, CPUS_ANNOTATION, MEMORY_ANNOTATION] {
            if let Some(v) = meta.annotations.get(key) {
                extra.insert(key.to_string(), v.clone());
            }
        }
        let snap_id = objects::new_id('s')?;
        self.take_snapshot(
            ns,
            &snap_id,
            &pod.name_any(),
            ROLE_SNAPSHOT,
            id,
            &meta,
            extra,
        )
        .await?;
        Ok(SnapshotInfo {
            snapshot_id: snap_id,
            names,
        })
    }

    /// `GET /snapshots`: the Ready user snapshots, of one sandbox if asked.
    pub async fn snapshots(
        &self,
        ns: &str,
        of: Option<&str>,
    ) -> Result<Vec<SnapshotInfo>, ApiError> {
        let mut selector = format!("{ROLE_LABEL}={ROLE_SNAPSHOT}");
        if let Some(id) = of {
            check_id("sandbox", id)?;
            selector.push_str(&format!(",{SNAPSHOT_OF_LABEL}={id}"));
        }
        let mut snaps = self
            .api::<Snapshot>(ns)
            .list(&ListParams::default().labels(&selector))
            .await?
            .items;
        snaps.sort_by_key(|s| s.metadata.creation_timestamp.clone());
        Ok(snaps
            .into_iter()
            .filter(|s| {
                not_deleting(s) && s.status.as_ref().is_some_and(|st| st.phase == Phase::Ready)
            })
            .map(|s| SnapshotInfo {
                names: s
                    .annotations()
                    .get(SNAPSHOT_NAMES_ANNOTATION)
                    .and_then(|n| serde_json::from_str(n).ok())
                    .unwrap_or_default(),
                snapshot_id: s.name_any(),
            })
            .collect())
    }

    /// `DELETE /templates/{id}`: deletes a user snapshot.
    pub async fn delete_snapshot(&self, ns: &str, snap_id: &str) -> Result<(), ApiError> {
        check_id("snapshot", snap_id)?;
        let api = self.api::<Snapshot>(ns);
        let missing = || ApiError::not_found(format!("snapshot '{snap_id}' not found"));
        let snap = api.get_opt(snap_id).await?.ok_or_else(missing)?;
        if !not_deleting(&snap)
            || snap.labels().get(ROLE_LABEL).map(String::as_str) != Some(ROLE_SNAPSHOT)
        {
            return Err(missing());
        }
        api.delete(snap_id, &DeleteParams::default()).await?;
        Ok(())
    }

    /// `POST /sandboxes/{id}/rollback`: the sandbox's pod rolled back in
    /// place to one of its snapshots (a Rollback object, removed when done).
    pub async fn rollback(&self, ns: &str, id: &str, snap_id: &str) -> Result<(), ApiError> {
        check_id("snapshot", snap_id)?;
        let found = self.find(ns, id).await?;
        let pod = found.pod()?;
        let snap = self
            .api::<Snapshot>(ns)
            .get_opt(snap_id)
            .await?
            .filter(|s| {
                s.labels().get(ROLE_LABEL).map(String::as_str) == Some(ROLE_SNAPSHOT)
                    && s.labels().get(SNAPSHOT_OF_LABEL).map(String::as_str) == Some(id)
            })
            .ok_or_else(|| {
                ApiError::not_found(format!("snapshot '{snap_id}' of sandbox '{id}' not found"))
            })?;
        let name = format!("{id}-b{}", objects::generation());
        // The Rollback's deadline and this wait alike.
        let timeout = self.snapshot_timeout.saturating_mul(2);
        let mut rollback = Rollback::new(
            &name,
            RollbackSpec {
                pod_name: pod.name_any(),
                snapshot_name: snap.name_any(),
                pod_uid: pod.uid(),
                safety_snapshot: false,
                failure_deadline_seconds: Some(objects::deadline_seconds(timeout)),
            },
        );
        rollback.metadata.labels = Some(BTreeMap::from([(
            SANDBOX_LABEL.to_string(),
            id.to_string(),
        )]));
        let api = self.api::<Rollback>(ns);
        api.create(&PostParams::default(), &rollback).await?;
        let waited = self.wait::<Rollback>(ns, &name, timeout, settled).await?;
        let _ = api.delete(&name, &DeleteParams::default()).await;
        match waited {
            Some(Some(r)) => {
                let status = r.status.unwrap_or_default();
                if status.phase == Phase::Ready {
                    Ok(())
                } else {
                    Err(ApiError::internal(format!(
                        "rollback of sandbox '{id}' failed: {}",
                        status.message.unwrap_or_else(|| status.phase.to_string())
                    )))
                }
            }
            Some(None) => Err(ApiError::internal("the Rollback was deleted")),
            None => Err(ApiError::internal(format!(
                "rollback of sandbox '{id}' not done within {} s",
                timeout.as_secs()
            ))),
        }
    }

    /// `DELETE /sandboxes/{id}`: its pod, Clones and pause Snapshots.
    pub async fn kill(&self, ns: &str, id: &str) -> Result<(), ApiError> {
        let found = self.find(ns, id).await?;
        let selector = format!("{SANDBOX_LABEL}={id}");
        let lp = ListParams::default().labels(&selector);
        let clones = self.api::<PodClone>(ns);
        for clone in clones.list(&lp).await?.items {
            let _ = clones
                .delete(&clone.name_any(), &DeleteParams::background())
                .await;
        }
        let pods = self.api::<Pod>(ns);
        for pod in pods.list(&lp).await?.items {
            let _ = pods.delete(&pod.name_any(), &DeleteParams::default()).await;
        }
        let paused = format!("{selector},{ROLE_LABEL}={ROLE_PAUSE}");
        let snaps = self.api::<Snapshot>(ns);
        for snap in snaps
            .list(&ListParams::default().labels(&paused))
            .await?
            .items
        {
            let _ = snaps
                .delete(&snap.name_any(), &DeleteParams::default())
                .await;
        }
        tracing::info!(namespace = ns, sandbox = %found.id, "killed");
        Ok(())
    }

    /// `POST /sandboxes/{id}/timeout`: `secs` from now (CubeSandbox: 0 is
    /// now, a negative value never).
    pub async fn set_timeout(&self, ns: &str, id: &str, secs: i64) -> Result<(), ApiError> {
        let found = self.find(ns, id).await?;
        let end = match secs {
            s if s < 0 => None,
            0 => Some(SystemTime::now()),
            s => Some(self.end_time(Some(s))?),
        };
        self.set_end(ns, &found, end).await
    }

    async fn set_end(
        &self,
        ns: &str,
        found: &Found,
        end: Option<SystemTime>,
    ) -> Result<(), ApiError> {
        let patch = json!({"metadata": {"annotations": {END_ANNOTATION: end.map(rfc3339)}}});
        let params = PatchParams::default();
        match &found.state {
            State::Running(pod) => {
                self.api::<Pod>(ns)
                    .patch(&pod.name_any(), &params, &Patch::Merge(&patch))
                    .await?;
            }
            State::Paused(snap) => {
                self.api::<Snapshot>(ns)
                    .patch(&snap.name_any(), &params, &Patch::Merge(&patch))
                    .await?;
            }
        }
        Ok(())
    }

    /// `GET /v2/sandboxes`, `GET /sandboxes`: the namespace's sandboxes in
    /// `states`, with all of `metadata`, ordered by ID.
    pub async fn list(
        &self,
        ns: &str,
        states: &[String],
        metadata: &BTreeMap<String, String>,
    ) -> Result<Vec<SandboxDetail>, ApiError> {
        let mut selector = vec![SANDBOX_LABEL.to_string()];
        for (k, v) in objects::metadata_labels(metadata)? {
            selector.push(format!("{k}={v}"));
        }
        let lp = ListParams::default().labels(&selector.join(","));
        let wants = |s: &str| states.is_empty() || states.iter().any(|w| w == s);
        let mut found: BTreeMap<String, Found> = BTreeMap::new();
        for pod in self.api::<Pod>(ns).list(&lp).await?.items {
            if let Some(id) = pod.labels().get(SANDBOX_LABEL).cloned() {
                if not_deleting(&pod) {
                    found.insert(
                        id.clone(),
                        Found {
                            id,
                            state: State::Running(Box::new(pod)),
                        },
                    );
                }
            }
        }
        let paused = format!("{},{ROLE_LABEL}={ROLE_PAUSE}", selector.join(","));
        for snap in self
            .api::<Snapshot>(ns)
            .list(&ListParams::default().labels(&paused))
            .await?
            .items
        {
            let ready = snap
                .status
                .as_ref()
                .is_some_and(|st| st.phase == Phase::Ready);
            if let (Some(id), true) = (snap.labels().get(SANDBOX_LABEL).cloned(), ready) {
                found.entry(id.clone()).or_insert(Found {
                    id,
                    state: State::Paused(Box::new(snap)),
                });
            }
        }
        Ok(found
            .values()
            .filter(|f| wants(f.state_name()))
            .map(|f| self.detail(ns, f))
            .collect())
    }

    /// Kills or pauses (as each asked) the sandboxes of `ns` whose timeout
    /// has passed.
    pub async fn reap(&self, ns: &str) -> Result<(), ApiError> {
        let now = SystemTime::now();
        let lp = ListParams::default().labels(SANDBOX_LABEL);
        for pod in self.api::<Pod>(ns).list(&lp).await?.items {
            let expired = pod
                .annotations()
                .get(END_ANNOTATION)
                .and_then(|t| parse_time(t))
                .is_some_and(|end| end <= now);
            let Some(id) = pod.labels().get(SANDBOX_LABEL).cloned() else {
                continue;
            };
            if !expired || !not_deleting(&pod) {
                continue;
            }
            let pause = pod
                .annotations()
                .get(ON_TIMEOUT_ANNOTATION)
                .is_some_and(|v| v == "pause");
            let done = if pause {
                self.pause(ns, &id).await
            } else {
                self.kill(ns, &id).await
            };
            match done {
                Ok(()) => tracing::info!(namespace = ns, sandbox = %id, pause, "timed out"),
                Err(e) => {
                    tracing::warn!(namespace = ns, sandbox = %id, "ending at its timeout: {e}")
                }
            }
        }
        Ok(())
    }
}

/// The Clone that made `pod`, if one did.
fn clone_of(pod: &Pod) -> Option<String> {
    pod.labels().get(CLONE_LABEL).cloned()
}

/// The egress policy (twig-net's JSON) a create asks for, if it narrows the
/// template's: no internet, and the `allowOut`/`denyOut` networks.
fn egress_policy(
    internet: Option<bool>,
    allow: Vec<String>,
    deny: Vec<String>,
) -> Result<Option<String>, ApiError> {
    if internet != Some(false) && allow.is_empty() && deny.is_empty() {
        return Ok(None);
    }
    let rules = |cidrs: Vec<String>| -> Vec<serde_json::Value> {
        cidrs.into_iter().map(|c| json!({"cidr": c})).collect()
    };
    let policy = json!({
        "defaultAction": if internet == Some(false) { "deny" } else { "allow" },
        "allow": rules(allow),
        "deny": rules(deny),
    });
    let text = policy.to_string();
    twig_net::parse_policy(&text, "network")
        .and_then(|p| p.validate().map(|()| p))
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(Some(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_round_trip() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let text = rfc3339(t);
        assert_eq!(text, "2027-01-15T08:00:00Z");
        assert_eq!(parse_time(&text), Some(t));
        assert_eq!(parse_time("yesterday"), None);
    }

    #[test]
    fn egress_follows_internet_access_and_bad_networks_are_refused() {
        assert_eq!(egress_policy(None, vec![], vec![]).expect("none"), None);
        let off = egress_policy(Some(false), vec!["10.0.0.0/8".into()], vec![])
            .expect("policy")
            .expect("some");
        assert!(off.contains("\"defaultAction\":\"deny\""), "{off}");
        assert!(off.contains("10.0.0.0/8"), "{off}");
        let bad = egress_policy(None, vec![], vec!["nowhere".into()]).unwrap_err();
        assert_eq!(bad.status, 400);
    }
}
