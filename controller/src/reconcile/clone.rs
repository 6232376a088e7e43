//! Clone: N pods restored from one snapshot, copies of the source pod's spec,
//! owned by the Clone, made by the controller of the snapshot's node.
//!
//! Where they run: a snapshot only in its node's store restores only there,
//! so its clones are bound to that node (`spec.nodeName`). An exported
//! snapshot (`status.artifact`) restores anywhere: its clones carry
//! `twig.dev/restore-artifact` besides `twig.dev/restore-from` and are left
//! to the scheduler, within the source pod's own constraints (node
//! selector, affinity, tolerations; the RuntimeClass adds Twig's nodes),
//! and a node lacking the snapshot pulls it (twig-node's AcquireVm). A
//! source pod with hostPath volumes is cloned on its node all the same:
//! its host paths name that node's files. A Clone of a Snapshot whose
//! export is under way waits for it (`spec.export` and no `Exported`
//! verdict yet); a failed export clones on the snapshot's node.
//!
//! An exported snapshot outlives its node: when the snapshot's Node object
//! is gone (looked at every `orphan_check` while pods are missing), the
//! controllers of the other nodes race to record themselves in
//! `status.adoptedBy` (a status write pinned to the resourceVersion read:
//! one wins, the others see it) and the winner makes the pods, each left
//! to the scheduler. A source pod with host paths cannot be cloned
//! elsewhere: such a Clone fails (`SnapshotNodeGone`).

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, ObjectMeta, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, Resource, ResourceExt};

use super::{
    conditions, deadline_left, deadline_message, operation_error, wait, write_status,
    DEADLINE_EXCEEDED,
};
use crate::context::{is_not_found, millis_since, Context, Error};
use crate::crd::{
    ClonePlacement, CloneStatus, DeletionPolicy, Phase, PodClone, ReplicaStatus, SandboxTemplate,
    Snapshot, SnapshotMode, SnapshotSpec, SnapshotStatus, SourcePod, CLONE_LABEL,
    EGRESS_POLICY_ANNOTATION, ENVD_ANNOTATION, ENVD_TOKEN_SHA256_ANNOTATION, MAX_REPLICAS,
    NETWORK_ANNOTATION, RESTORE_ARTIFACT_ANNOTATION, RESTORE_FROM_ANNOTATION, RUNTIME_CLASS,
    TEMPLATE_ANNOTATION,
};
use crate::reconcile::export::EXPORTED;
use crate::reconcile::validate_name;

/// Annotation on clone pods naming the Snapshot object they came from (for people; the shim reads `twig.dev/restore-from`).
pub const SOURCE_SNAPSHOT_ANNOTATION: &str = "twig.dev/source-snapshot";

/// Checks what the CRD schema and its CEL rules check.
pub fn validate(clone: &PodClone) -> Result<(), String> {
    let source = &clone.spec.source;
    match (&source.snapshot_name, &source.pod_name) {
        (Some(name), None) => validate_name("spec.source.snapshotName", name)?,
        (None, Some(name)) => validate_name("spec.source.podName", name)?,
        _ => {
            return Err(
                "set exactly one of spec.source.snapshotName and spec.source.podName".to_string(),
            )
        }
    }
    if !(1..=MAX_REPLICAS).contains(&clone.spec.replicas) {
        return Err(format!(
            "spec.replicas must be between 1 and {MAX_REPLICAS}, not {}",
            clone.spec.replicas
        ));
    }
    if clone.spec.failure_deadline_seconds.is_some_and(|t| t < 1) {
        return Err("spec.failureDeadlineSeconds must be at least 1".to_string());
    }
    if let Some(prefix) = &clone.spec.name_prefix {
        if prefix.len() > 58 || prefix.contains('.') {
            return Err(format!(
                "spec.namePrefix {prefix:?} must be a DNS label of at most 58 characters"
            ));
        }
        validate_name("spec.namePrefix", prefix)?;
    }
    Ok(())
}

/// Name of the Snapshot a Clone of a pod takes (and owns).
pub fn source_snapshot_name(clone: &PodClone) -> String {
    format!("{}-source", clone.name_any())
}

/// Name of the clone pod with this index.
pub fn pod_name(clone: &PodClone, index: i32) -> String {
    let prefix = clone
        .spec
        .name_prefix
        .clone()
        .unwrap_or_else(|| clone.name_any());
    format!("{prefix}-{index}")
}

/// Reconciles one Clone.
pub async fn reconcile(clone: Arc<PodClone>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = clone
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<PodClone> = Api::namespaced(ctx.client.clone(), &ns);
    let status = clone.status.clone().unwrap_or_default();
    // Deleting a Clone deletes its pods and snapshot through their ownerReferences.
    if clone.metadata.deletion_timestamp.is_some()
        || matches!(status.phase, Phase::Failed | Phase::Lost)
    {
        return Ok(Action::await_change());
    }
    if let Err(message) = validate(&clone) {
        return fail(&api, &clone, "Invalid", message, &ctx).await;
    }
    let left = deadline_left(
        clone.metadata.creation_timestamp.as_ref(),
        clone.spec.failure_deadline_seconds,
    );
    let snapshots: Api<Snapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let snap_name = match (
        &clone.spec.source.snapshot_name,
        &clone.spec.source.pod_name,
    ) {
        (Some(name), _) => name.clone(),
        (None, Some(pod)) => {
            match ensure_source_snapshot(&api, &clone, pod, &snapshots, &pods, &ctx).await? {
                Ok(name) => name,
                Err(action) => return Ok(action),
            }
        }
        (None, None) => return Err(Error::MissingField("spec.source")),
    };
    let Some(snap) = snapshots.get_opt(&snap_name).await? else {
        return fail(
            &api,
            &clone,
            "SnapshotNotFound",
            format!("snapshot {snap_name} not found"),
            &ctx,
        )
        .await;
    };
    let snap_status = snap.status.clone().unwrap_or_default();
    match snap_status.phase {
        Phase::Ready => {}
        Phase::Pending | Phase::InProgress => {
            if left.is_some_and(|l| l.is_zero()) {
                let waiting_for = format!("snapshot {snap_name} to be Ready");
                let message =
                    deadline_message("clone", clone.spec.failure_deadline_seconds, &waiting_for);
                return fail(&api, &clone, DEADLINE_EXCEEDED, message, &ctx).await;
            }
            return Ok(wait(ctx.retry, left));
        }
        Phase::Failed | Phase::Lost => {
            let detail = snap_status.message.unwrap_or_default();
            let message = format!("snapshot {snap_name} is {}: {detail}", snap_status.phase);
            return fail(&api, &clone, "SnapshotFailed", message, &ctx).await;
        }
    }
    let (Some(node), Some(snapshot_id)) = (
        snap_status.node_name.clone(),
        snap_status.snapshot_id.clone(),
    ) else {
        return Err(Error::MissingField("snapshot status.nodeName/snapshotID"));
    };
    if node != ctx.node_name {
        match adoption(&api, &clone, &status, &snap_status, &node, &ctx).await? {
            Adoption::Ours => {}
            Adoption::Wait(action) => return Ok(action),
        }
    }
    if snap.spec.export && export_pending(&snap_status) {
        if left.is_some_and(|l| l.is_zero()) {
            let waiting_for = format!("snapshot {snap_name} to be exported");
            let message =
                deadline_message("clone", clone.spec.failure_deadline_seconds, &waiting_for);
            return fail(&api, &clone, DEADLINE_EXCEEDED, message, &ctx).await;
        }
        return Ok(wait(ctx.retry, left));
    }
    let source_name = &snap.spec.pod_name;
    let source = match &snap_status.source_pod {
        Some(kept) => match kept_pod(source_name, kept) {
            Ok(pod) => pod,
            Err(e) => {
                let message = format!("snapshot {snap_name} keeps an unreadable pod spec: {e}");
                return fail(&api, &clone, "SourcePodInvalid", message, &ctx).await;
            }
        },
        // Snapshots from before `status.sourcePod`: the live pod's spec.
        None => match pods.get_opt(source_name).await? {
            Some(pod) => pod,
            None => {
                let message = format!(
                    "source pod {source_name} of snapshot {snap_name} is gone; clones copy its spec"
                );
                return fail(&api, &clone, "SourcePodNotFound", message, &ctx).await;
            }
        },
    };
    let policy = match source_policy(&source, &ns, &ctx).await? {
        Ok(policy) => policy,
        Err(message) => return fail(&api, &clone, "TemplateNotFound", message, &ctx).await,
    };
    let selector = format!("{CLONE_LABEL}={}", clone.name_any());
    let mut existing: BTreeMap<String, Pod> = pods
        .list(&ListParams::default().labels(&selector))
        .await?
        .items
        .into_iter()
        .filter(|p| owned_by(p, clone.as_ref()))
        .map(|p| (p.name_any(), p))
        .collect();
    let missing = (0..clone.spec.replicas).any(|i| !existing.contains_key(&pod_name(&clone, i)));
    if missing && !still_wanted(&api, &clone).await? {
        return Ok(Action::await_change());
    }
    // Decided once, with the first pods: pods made again later are placed
    // as their siblings were.
    let artifact = snap_status
        .artifact
        .as_ref()
        .filter(|_| !has_host_path(&source))
        .filter(|_| status.placement != Some(ClonePlacement::SnapshotNode))
        .map(|a| a.reference.as_str());
    let placement = if artifact.is_some() {
        ClonePlacement::Scheduler
    } else {
        ClonePlacement::SnapshotNode
    };
    if placement == ClonePlacement::SnapshotNode && node != ctx.node_name {
        let message = format!(
            "the node {node} of snapshot {snap_name} is gone and its source pod mounts host \
             paths of that node: it cannot be cloned elsewhere"
        );
        return fail(&api, &clone, "SnapshotNodeGone", message, &ctx).await;
    }
    let restore = Restore {
        snapshot_id: &snapshot_id,
        snapshot_name: &snap_name,
        node: &node,
        artifact,
    };
    let mut created = 0;
    let mut names = Vec::new();
    for index in 0..clone.spec.replicas {
        let name = pod_name(&clone, index);
        names.push(name.clone());
        if existing.contains_key(&name) {
            continue;
        }
        let mut pod = clone_pod(&clone, &source, &restore, index)?;
        if let (Some(policy), Some(annotations)) = (&policy, pod.metadata.annotations.as_mut()) {
            annotations
                .entry(EGRESS_POLICY_ANNOTATION.to_string())
                .or_insert_with(|| policy.clone());
        }
        match pods.create(&PostParams::default(), &pod).await {
            Ok(made) => {
                created += 1;
                existing.insert(name, made);
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let found = pods.get(&name).await?;
                if !owned_by(&found, &clone) {
                    let message =
                        format!("pod {name} already exists and does not belong to this Clone");
                    return fail(&api, &clone, "NameTaken", message, &ctx).await;
                }
                existing.insert(name, found);
            }
            Err(e) => return Err(e.into()),
        }
    }
    if created > 0 {
        let note = match artifact {
            Some(a) => format!("Created {created} pods from snapshot {snap_name} (exported as {a}), placed by the scheduler"),
            None => format!("Created {created} pods from snapshot {snap_name} on node {node}"),
        };
        ctx.event(
            clone.as_ref(),
            EventType::Normal,
            "PodsCreated",
            "Clone",
            note,
        )
        .await;
    }
    let replicas: Vec<ReplicaStatus> = names
        .iter()
        .map(|name| replica_status(name, existing.get(name)))
        .collect();
    let ready = replicas.iter().filter(|r| r.ready).count();
    let ready = i32::try_from(ready).unwrap_or(i32::MAX);
    let all_ready = ready == clone.spec.replicas;
    if !all_ready && left.is_some_and(|l| l.is_zero()) {
        let waiting_for = format!("its pods to be Ready ({ready}/{} are)", clone.spec.replicas);
        let message = deadline_message("clone", clone.spec.failure_deadline_seconds, &waiting_for);
        return fail(&api, &clone, DEADLINE_EXCEEDED, message, &ctx).await;
    }
    let duration_ms = all_ready.then(|| millis_since(clone.metadata.creation_timestamp.as_ref()));
    let phase = if all_ready {
        Phase::Ready
    } else {
        Phase::InProgress
    };
    let message = (!all_ready).then(|| format!("{ready}/{} pods ready", clone.spec.replicas));
    let (reason, condition_message) = match &message {
        Some(m) => ("PodsNotReady", m.clone()),
        None => ("AllPodsReady", format!("all {ready} pods are Ready")),
    };
    let new = CloneStatus {
        phase,
        snapshot_name: Some(snap_name.clone()),
        node_name: Some(node.clone()),
        adopted_by: status.adopted_by.clone(),
        placement: Some(placement),
        pods: names,
        replicas,
        ready_replicas: ready,
        duration_ms: status.duration_ms.or(duration_ms),
        conditions: conditions(
            &status.conditions,
            phase,
            reason,
            &condition_message,
            clone.metadata.generation,
        ),
        message,
        error: None,
    };
    if !same_status(&new, &status) {
        let clone = write_status(&api, &clone, new, &ctx).await?;
        if all_ready && status.phase != Phase::Ready {
            let ms = duration_ms.unwrap_or_default();
            ctx.metrics.observe("clone", true, ms as f64 / 1000.0);
            let note =
                format!("All {ready} clones of snapshot {snap_name} are Ready after {ms} ms");
            ctx.event(&clone, EventType::Normal, "Ready", "Clone", note)
                .await;
        } else if !all_ready && status.phase == Phase::Ready {
            let note = format!("{ready}/{} clone pods are Ready", clone.spec.replicas);
            ctx.event(&clone, EventType::Warning, "PodsNotReady", "Clone", note)
                .await;
        }
    }
    Ok(match (all_ready, left) {
        (false, Some(left)) => Action::requeue(left),
        _ => Action::await_change(),
    })
}

/// The status of the clone pod `name` (`None`: not created yet).
fn replica_status(name: &str, pod: Option<&Pod>) -> ReplicaStatus {
    let status = pod.and_then(|p| p.status.as_ref());
    let ready = pod.is_some_and(pod_ready);
    let waiting = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .find_map(|c| {
            let waiting = c.state.as_ref()?.waiting.as_ref()?;
            let reason = waiting.reason.clone().unwrap_or_default();
            Some(match &waiting.message {
                Some(m) => format!("container {}: {reason}: {m}", c.name),
                None => format!("container {}: {reason}", c.name),
            })
        });
    ReplicaStatus {
        name: name.to_string(),
        node_name: pod.and_then(|p| p.spec.as_ref()?.node_name.clone()),
        phase: status
            .and_then(|s| s.phase.clone())
            .unwrap_or_else(|| "Pending".to_string()),
        ready,
        message: if ready {
            None
        } else {
            status
                .and_then(|s| s.message.clone())
                .or_else(|| unschedulable(status))
                .or(waiting)
        },
    }
}

/// Why the scheduler has not placed the pod (its `PodScheduled` condition
/// False), e.g. no node with room for an unbound clone.
fn unschedulable(status: Option<&k8s_openapi::api::core::v1::PodStatus>) -> Option<String> {
    let scheduled = status?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")?;
    Some(format!(
        "not scheduled: {}: {}",
        scheduled.reason.as_deref().unwrap_or("Unschedulable"),
        scheduled.message.as_deref().unwrap_or_default()
    ))
}

/// Makes sure the Clone's own Snapshot of `pod` exists; `Ok(name)` once it is Ready.
async fn ensure_source_snapshot(
    api: &Api<PodClone>,
    clone: &PodClone,
    pod_name: &str,
    snapshots: &Api<Snapshot>,
    pods: &Api<Pod>,
    ctx: &Context,
) -> Result<Result<String, Action>, Error> {
    let name = source_snapshot_name(clone);
    if let Some(snap) = snapshots.get_opt(&name).await? {
        if !owned_by(&snap, clone) {
            let message =
                format!("snapshot {name} already exists and does not belong to this Clone");
            return fail(api, clone, "NameTaken", message, ctx).await.map(Err);
        }
        return Ok(Ok(name));
    }
    // Only the node running the pod takes its snapshot.
    let Some(pod) = pods
        .get_opt(pod_name)
        .await?
        .filter(|p| p.metadata.deletion_timestamp.is_none())
    else {
        return fail(
            api,
            clone,
            "PodNotFound",
            format!("pod {pod_name} not found"),
            ctx,
        )
        .await
        .map(Err);
    };
    if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(ctx.node_name.as_str()) {
        return Ok(Err(Action::await_change()));
    }
    let owner = clone
        .controller_owner_ref(&())
        .ok_or(Error::MissingField("metadata.uid"))?;
    let snap = Snapshot {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: clone.namespace(),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        spec: SnapshotSpec {
            pod_name: pod_name.to_string(),
            // Pinned: a pod recreated under the name before the snapshot is refused.
            pod_uid: pod.metadata.uid.clone(),
            mode: SnapshotMode::Incremental,
            deletion_policy: DeletionPolicy::Delete,
            ttl_seconds_after_ready: None,
            // The Clone's deadline bounds its snapshot too.
            failure_deadline_seconds: clone.spec.failure_deadline_seconds,
            export: false,
        },
        status: None,
    };
    match snapshots.create(&PostParams::default(), &snap).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => return Ok(Err(Action::requeue(ctx.retry))),
        Err(e) => return Err(e.into()),
    }
    let message = format!("taking snapshot {name} of pod {pod_name}");
    let status = CloneStatus {
        phase: Phase::InProgress,
        snapshot_name: Some(name.clone()),
        conditions: conditions(
            &[],
            Phase::InProgress,
            "SnapshotInProgress",
            &message,
            clone.metadata.generation,
        ),
        message: Some(message),
        ..Default::default()
    };
    let clone = write_status(api, clone, status, ctx).await?;
    let note = format!("Taking snapshot {name} of pod {pod_name} to clone it");
    ctx.event(
        &clone,
        EventType::Normal,
        "SnapshotRequested",
        "Clone",
        note,
    )
    .await;
    Ok(Err(Action::await_change()))
}

/// Equal but for the conditions' transition times (which a rewrite would not change anyway).
fn same_status(a: &CloneStatus, b: &CloneStatus) -> bool {
    let strip = |s: &CloneStatus| {
        let mut s = s.clone();
        for c in &mut s.conditions {
            c.last_transition_time = Time(Timestamp::UNIX_EPOCH);
        }
        s
    };
    strip(a) == strip(b)
}

/// Whether `clone` still exists as this object (same UID, not being
/// deleted), read from the API server rather than the cache: a reconcile
/// of a cached copy that raced the Clone's deletion (its pods already
/// collected) must not create them again. The garbage collector would
/// delete them at once, but a kubelet that saw them would start each
/// sandbox and tear it down again.
async fn still_wanted(api: &Api<PodClone>, clone: &PodClone) -> Result<bool, Error> {
    Ok(api.get_opt(&clone.name_any()).await?.is_some_and(|c| {
        c.metadata.uid == clone.metadata.uid && c.metadata.deletion_timestamp.is_none()
    }))
}

fn owned_by<K: Resource>(obj: &K, clone: &PodClone) -> bool {
    let uid = clone.meta().uid.as_deref();
    obj.meta()
        .owner_references
        .iter()
        .flatten()
        .any(|o| Some(o.uid.as_str()) == uid && o.controller == Some(true))
}

/// The egress policy a source pod restored from a SandboxTemplate runs with
/// when it has no `twig.dev/egress-policy` of its own: its template's
/// `spec.egressPolicy` as JSON, for the clones' annotation (clone pods do not
/// name the template, so the shim could not find that policy). `Ok(None)`
/// when the source has its own annotation (`clone_pod` copies it), no
/// template, or a template without a policy (the built-in default holds for
/// both). `Ok(Err)` when the template is gone: the clones' policy cannot be
/// known, and a clone must not run with a looser one than its source.
async fn source_policy(
    source: &Pod,
    ns: &str,
    ctx: &Context,
) -> Result<Result<Option<String>, String>, Error> {
    let annotations = source.annotations();
    if annotations.contains_key(EGRESS_POLICY_ANNOTATION) {
        return Ok(Ok(None));
    }
    let Some(name) = annotations.get(TEMPLATE_ANNOTATION) else {
        return Ok(Ok(None));
    };
    // `list` by name: the controller's role lists and watches templates.
    let templates: Api<SandboxTemplate> = Api::namespaced(ctx.client.clone(), ns);
    let found = templates
        .list(&ListParams::default().fields(&format!("metadata.name={name}")))
        .await?
        .items
        .into_iter()
        .find(|t| t.name_any() == *name);
    let Some(template) = found else {
        return Ok(Err(format!(
            "SandboxTemplate {name} of source pod {} is gone, so the egress policy its clones must keep is unknown; set the {EGRESS_POLICY_ANNOTATION} annotation on the source pod and create the Clone again",
            source.name_any()
        )));
    };
    match &template.spec.egress_policy {
        None => Ok(Ok(None)),
        Some(policy) => Ok(Ok(Some(
            serde_json::to_string(policy).map_err(kube::Error::SerdeError)?,
        ))),
    }
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The pod annotations a clone keeps from its source: without network
/// (`twig.dev/network: none`) the clones are without it too, the source's
/// egress policy bounds theirs, and its SandboxTemplate bounds their policy
/// as it bounds the source's (`twig.dev/restore-from` wins over it for the
/// restore); a source with the sandbox API (`twig.dev/envd`) runs it in
/// guest memory, and its clones keep it, with the token it requires.
const KEPT_ANNOTATIONS: [&str; 5] = [
    EGRESS_POLICY_ANNOTATION,
    NETWORK_ANNOTATION,
    TEMPLATE_ANNOTATION,
    ENVD_ANNOTATION,
    ENVD_TOKEN_SHA256_ANNOTATION,
];

/// What a Snapshot keeps of `pod` (its `status.sourcePod`).
pub fn source_pod(pod: &Pod) -> Result<SourcePod, Error> {
    let spec = serde_json::to_value(pod.spec.clone().unwrap_or_default())?;
    let annotations = KEPT_ANNOTATIONS
        .iter()
        .filter_map(|key| {
            pod.annotations()
                .get(*key)
                .map(|value| (key.to_string(), value.clone()))
        })
        .collect();
    Ok(SourcePod { spec, annotations })
}

/// The source pod `name` a Snapshot kept, as a pod to copy.
fn kept_pod(name: &str, kept: &SourcePod) -> Result<Pod, serde_json::Error> {
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            annotations: Some(kept.annotations.clone()),
            ..Default::default()
        },
        spec: Some(serde_json::from_value(kept.spec.clone())?),
        status: None,
    })
}

/// What a Clone's pods are restored from.
#[derive(Clone, Copy, Debug)]
pub struct Restore<'a> {
    /// The snapshot's node-store id (`twig.dev/restore-from`).
    pub snapshot_id: &'a str,
    /// The Snapshot object's name.
    pub snapshot_name: &'a str,
    /// The snapshot's node.
    pub node: &'a str,
    /// The exported snapshot's artifact (`twig.dev/restore-artifact`): the
    /// pods are left to the scheduler; `None`: bound to `node`.
    pub artifact: Option<&'a str>,
}

/// Whether the snapshot's export has not given its verdict yet (no
/// `Exported` condition, or `Unknown`) and no artifact is recorded.
fn export_pending(status: &SnapshotStatus) -> bool {
    status.artifact.is_none()
        && status
            .conditions
            .iter()
            .find(|c| c.type_ == EXPORTED)
            .is_none_or(|c| c.status == "Unknown")
}

/// Whether the pod mounts host paths (which name its node's files).
fn has_host_path(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .is_some_and(|vs| vs.iter().any(|v| v.host_path.is_some()))
}

/// The pod spec of clone `index`: the source's spec under the twig
/// RuntimeClass, restored from the snapshot — bound to the snapshot's node,
/// or, with an artifact, unbound and carrying `twig.dev/restore-artifact`
/// — with the source's egress policy annotation (`twig.dev/egress-policy`)
/// and its `twig.dev/template` (the policy's bound) when it has them: a
/// clone gets its source's policy.
pub fn clone_pod(
    clone: &PodClone,
    source: &Pod,
    restore: &Restore<'_>,
    index: i32,
) -> Result<Pod, Error> {
    let mut spec = source.spec.clone().unwrap_or_default();
    spec.node_name = match restore.artifact {
        Some(_) => None,
        None => Some(restore.node.to_string()),
    };
    spec.runtime_class_name = Some(RUNTIME_CLASS.to_string());
    // Each clone gets its own identity: hostname defaults to the pod name.
    spec.hostname = None;
    spec.ephemeral_containers = None;
    let mut labels: BTreeMap<String, String> = clone.spec.labels.clone().unwrap_or_default();
    labels.insert(CLONE_LABEL.to_string(), clone.name_any());
    let mut annotations = BTreeMap::from([
        (
            RESTORE_FROM_ANNOTATION.to_string(),
            restore.snapshot_id.to_string(),
        ),
        (
            SOURCE_SNAPSHOT_ANNOTATION.to_string(),
            restore.snapshot_name.to_string(),
        ),
    ]);
    if let Some(artifact) = restore.artifact {
        annotations.insert(
            RESTORE_ARTIFACT_ANNOTATION.to_string(),
            artifact.to_string(),
        );
    }
    for key in KEPT_ANNOTATIONS {
        if let Some(value) = source.annotations().get(key) {
            annotations.insert(key.to_string(), value.clone());
        }
    }
    let owner = clone
        .controller_owner_ref(&())
        .ok_or(Error::MissingField("metadata.uid"))?;
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(pod_name(clone, index)),
            namespace: clone.namespace(),
            labels: Some(labels),
            annotations: Some(annotations),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    })
}

/// Whether this node's controller makes the pods of a Clone whose
/// snapshot is on another node.
enum Adoption {
    /// It does: the snapshot's node is gone and this node won the Clone.
    Ours,
    /// It does not (now): look again as `Action` says.
    Wait(Action),
}

/// Decides [`Adoption`] for `clone` of a snapshot (`snap`) on `node`, not
/// this one: only an exported snapshot whose node is gone is adopted, by
/// the first live node to record itself in `status.adoptedBy`.
async fn adoption(
    api: &Api<PodClone>,
    clone: &PodClone,
    status: &CloneStatus,
    snap: &SnapshotStatus,
    node: &str,
    ctx: &Context,
) -> Result<Adoption, Error> {
    let exported =
        snap.artifact.is_some() && status.placement != Some(ClonePlacement::SnapshotNode);
    if !exported || status.phase == Phase::Ready {
        return Ok(Adoption::Wait(Action::await_change()));
    }
    if let Some(adopter) = &status.adopted_by {
        if *adopter == ctx.node_name {
            return Ok(Adoption::Ours);
        }
        if ctx.node_exists(adopter).await? {
            return Ok(Adoption::Wait(Action::requeue(ctx.orphan_check)));
        }
    } else if ctx.node_exists(node).await? {
        return Ok(Adoption::Wait(Action::requeue(ctx.orphan_check)));
    }
    // Pinned to the resourceVersion read: a 409 (another node won) retries
    // the Clone, which then finds the winner.
    let claimed = CloneStatus {
        adopted_by: Some(ctx.node_name.clone()),
        ..status.clone()
    };
    let gone = status.adopted_by.as_deref().unwrap_or(node);
    let clone = write_status(api, clone, claimed, ctx).await?;
    ctx.event(
        &clone,
        EventType::Normal,
        "Adopted",
        "Clone",
        format!(
            "node {gone} is gone; node {} makes this Clone's pods from the exported snapshot",
            ctx.node_name
        ),
    )
    .await;
    Ok(Adoption::Ours)
}

async fn fail(
    api: &Api<PodClone>,
    clone: &PodClone,
    reason: &str,
    message: String,
    ctx: &Context,
) -> Result<Action, Error> {
    let old = clone.status.clone().unwrap_or_default();
    let status = CloneStatus {
        phase: Phase::Failed,
        message: Some(format!("{reason}: {message}")),
        error: Some(operation_error(reason, &message)),
        conditions: conditions(
            &old.conditions,
            Phase::Failed,
            reason,
            &message,
            clone.metadata.generation,
        ),
        ..old
    };
    let clone = match write_status(api, clone, status, ctx).await {
        Ok(c) => c,
        Err(Error::Kube(e)) if is_not_found(&e) => return Ok(Action::await_change()),
        Err(e) => return Err(e),
    };
    ctx.metrics.observe(
        "clone",
        false,
        millis_since(clone.metadata.creation_timestamp.as_ref()) as f64 / 1000.0,
    );
    ctx.event(&clone, EventType::Warning, reason, "Clone", message)
        .await;
    Ok(Action::await_change())
}
