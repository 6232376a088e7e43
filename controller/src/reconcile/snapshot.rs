//! Snapshot: take a snapshot of a running pod on this node through its shim;
//! remove the node-side data when the object is deleted; expire after its TTL.
//!
//! The finalizer `twig.dev/snapshot-data` is added before the node claims
//! the Snapshot and removed once its data left the node store (policy
//! Delete); a Snapshot no node claimed has no data and is let go by any
//! node. A Ready Snapshot is rechecked every `recheck` (`GetSnapshot`):
//! gone from the store, it becomes `Lost` (an exported one stays Ready
//! from the registry, `availability: Registry`); with `spec.export` it is
//! pushed to the registry ([`super::export`]). Its sizes come from the shim's
//! answer, or, from a shim that predates them (restore size 0), from the
//! node's `GetSnapshot` at the next recheck.
//!
//! A parent outlives its children: a deleting Snapshot keeps its finalizer
//! and data while Snapshots of its namespace that are not Failed or Lost
//! name it in `status.parent` (condition `DeletionBlocked`, reason
//! `ChildSnapshotsExist`), and while the node refuses `DeleteSnapshot`
//! because a child deleted with `deletionPolicy: Retain` (or a running VM)
//! still needs it (`NodeKeepsData`, the node's words; retried with the
//! backoff). Pods restored from a snapshot do not hold it: the node store
//! owns what their mappings need.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{finalizer, Event};
use kube::{Api, ResourceExt};

use super::export;
use super::{
    conditions, deadline_left, deadline_message, operation_error, shim_failure, wait, write_status,
    ShimOp, DEADLINE_EXCEEDED, POD_REPLACED,
};
use crate::context::{is_not_found, millis_since, now, Context, Error};
use crate::crd::{
    bytes_quantity, Availability, DeletionPolicy, Phase, Snapshot, SnapshotMode, SnapshotStatus,
    RUNTIME_CLASS,
};
use crate::reconcile::{current_pod, validate_name};
use crate::shim::{ShimError, SnapshotInfo};

/// Finalizer that keeps a Snapshot until its node-side data is removed.
pub const FINALIZER: &str = "twig.dev/snapshot-data";

/// Checks what the CRD schema checks, for objects written before it was installed.
pub fn validate(snap: &Snapshot) -> Result<(), String> {
    validate_name("spec.podName", &snap.spec.pod_name)?;
    if snap.spec.ttl_seconds_after_ready.is_some_and(|t| t < 0) {
        return Err("spec.ttlSecondsAfterReady must not be negative".to_string());
    }
    if snap.spec.failure_deadline_seconds.is_some_and(|t| t < 1) {
        return Err("spec.failureDeadlineSeconds must be at least 1".to_string());
    }
    Ok(())
}

/// Reconciles one Snapshot. Its finalizer is managed by kube-runtime's
/// helper, on the node that takes the snapshot: added before the node
/// claims the snapshot (writes its name into the status), removed after the
/// node-side data is gone. When that node's Node object no longer exists,
/// any other node removes the finalizer (see [`release_if_node_gone`]).
///
/// An error (retried with backoff) past the Snapshot's failure deadline
/// fails it with `DeadlineExceeded` and the error instead, if it is still
/// Pending or InProgress on this node (or unclaimed).
pub async fn reconcile(snap: Arc<Snapshot>, ctx: Arc<Context>) -> Result<Action, Error> {
    let err = match reconcile_inner(snap.clone(), ctx.clone()).await {
        Ok(action) => return Ok(action),
        Err(err) => err,
    };
    let status = snap.status.clone().unwrap_or_default();
    let ours = status
        .node_name
        .as_deref()
        .is_none_or(|n| n == ctx.node_name);
    let overdue = deadline_left(
        snap.metadata.creation_timestamp.as_ref(),
        snap.spec.failure_deadline_seconds,
    )
    .is_some_and(|l| l.is_zero());
    let open = matches!(status.phase, Phase::Pending | Phase::InProgress);
    if !(ours && overdue && open) || snap.metadata.deletion_timestamp.is_some() {
        return Err(err);
    }
    let api: Api<Snapshot> =
        Api::namespaced(ctx.client.clone(), &snap.namespace().unwrap_or_default());
    let message = deadline_message(
        "snapshot",
        snap.spec.failure_deadline_seconds,
        &format!("a retry (last error: {err})"),
    );
    fail(&api, &snap, Some(status), DEADLINE_EXCEEDED, message, &ctx).await
}

async fn reconcile_inner(snap: Arc<Snapshot>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = snap
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<Snapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let status = snap.status.clone().unwrap_or_default();
    let deleting = snap.metadata.deletion_timestamp.is_some();
    match status.node_name.as_deref() {
        Some(node) if node != ctx.node_name => {
            if deleting && snap.finalizers().iter().any(|f| f == FINALIZER) {
                return release_if_node_gone(&api, snap.clone(), node, &ctx).await;
            }
            return Ok(Action::await_change());
        }
        Some(_) => {
            if deleting && snap.finalizers().iter().any(|f| f == FINALIZER) {
                if let Some(action) = hold_for_children(&api, &snap, &ns, &ctx).await? {
                    return Ok(action);
                }
            }
        }
        None if deleting => {
            // No node claimed it, so no node took (or is taking) it: nothing to remove.
            return Ok(finalizer(&api, FINALIZER, snap, |_| async {
                Ok::<_, Error>(Action::await_change())
            })
            .await?);
        }
        None => {
            if status.phase != Phase::Pending {
                return Ok(Action::await_change());
            }
            if let Err(action) = precheck(&api, &snap, &ns, &ctx).await? {
                return Ok(action);
            }
        }
    }
    let ctx = ctx.clone();
    let inner = api.clone();
    Ok(finalizer(&api, FINALIZER, snap, |event| async move {
        match event {
            Event::Apply(snap) => apply(&inner, snap, &ns, &ctx).await,
            Event::Cleanup(snap) => cleanup(&inner, &snap, &ctx).await,
        }
    })
    .await?)
}

async fn apply(
    api: &Api<Snapshot>,
    snap: Arc<Snapshot>,
    ns: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    let status = snap.status.clone().unwrap_or_default();
    match status.phase {
        Phase::Pending => start(api, &snap, ns, ctx).await,
        Phase::InProgress => take(api, (*snap).clone(), ns, ctx, true).await,
        Phase::Ready => ready(api, &snap, &status, ns, ctx).await,
        Phase::Failed | Phase::Lost => Ok(Action::await_change()),
    }
}

/// Whether this node should take the snapshot: `Ok(pod)` when its pod runs
/// here under Twig; otherwise the Snapshot was failed (with a reason) or is
/// left to another node, and `Err` says when to look again.
async fn precheck(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    ns: &str,
    ctx: &Context,
) -> Result<Result<Pod, Action>, Error> {
    if let Err(message) = validate(snap) {
        return fail(api, snap, None, "Invalid", message, ctx)
            .await
            .map(Err);
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let pod_name = &snap.spec.pod_name;
    let Some(pod) = pods.get_opt(pod_name).await? else {
        let message = format!("pod {pod_name} not found");
        return fail(api, snap, None, "PodNotFound", message, ctx)
            .await
            .map(Err);
    };
    let left = deadline_left(
        snap.metadata.creation_timestamp.as_ref(),
        snap.spec.failure_deadline_seconds,
    );
    let Some(pod_node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
        // Not scheduled yet: look again later, failing it at its deadline.
        if left.is_some_and(|l| l.is_zero()) {
            let message = deadline_message(
                "snapshot",
                snap.spec.failure_deadline_seconds,
                &format!("pod {pod_name} to be scheduled"),
            );
            return fail(api, snap, None, DEADLINE_EXCEEDED, message, ctx)
                .await
                .map(Err);
        }
        return Ok(Err(wait(ctx.retry, left)));
    };
    if pod_node != ctx.node_name {
        return Ok(Err(Action::await_change()));
    }
    if let Some(want) = snap.spec.pod_uid.as_deref() {
        if pod.metadata.uid.as_deref() != Some(want) {
            let message = format!(
                "pod {pod_name} has UID {}, not {want} (spec.podUid): it was recreated under the same name",
                pod.metadata.uid.as_deref().unwrap_or("<none>")
            );
            return fail(api, snap, None, POD_REPLACED, message, ctx)
                .await
                .map(Err);
        }
    }
    let runtime_class = pod
        .spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref());
    if runtime_class != Some(RUNTIME_CLASS) {
        let message = format!("pod {pod_name} does not run under RuntimeClass {RUNTIME_CLASS}");
        return fail(api, snap, None, "NotATwigPod", message, ctx)
            .await
            .map(Err);
    }
    if pod.metadata.deletion_timestamp.is_some() {
        let message = format!("pod {pod_name} is terminating");
        return fail(api, snap, None, "PodTerminating", message, ctx)
            .await
            .map(Err);
    }
    Ok(Ok(pod))
}

async fn start(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    ns: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    let pod = match precheck(api, snap, ns, ctx).await? {
        Ok(pod) => pod,
        Err(action) => return Ok(action),
    };
    let pod_name = &snap.spec.pod_name;
    let message = format!("taking a snapshot of pod {pod_name}");
    let status = SnapshotStatus {
        phase: Phase::InProgress,
        node_name: Some(ctx.node_name.clone()),
        pod_uid: pod.metadata.uid.clone(),
        source_pod: Some(super::clone::source_pod(&pod)?),
        start_time: Some(now()),
        conditions: conditions(
            &[],
            Phase::InProgress,
            "SnapshotInProgress",
            &message,
            snap.metadata.generation,
        ),
        message: Some(message),
        ..Default::default()
    };
    let snap = write_status(api, snap, status, ctx).await?;
    let mode = match snap.spec.mode {
        SnapshotMode::Incremental => "an incremental",
        SnapshotMode::Full => "a full",
    };
    let note = format!(
        "Taking {mode} snapshot of pod {pod_name} on node {}",
        ctx.node_name
    );
    ctx.event(&snap, EventType::Normal, "Started", "Snapshot", note)
        .await;
    take(api, snap, ns, ctx, false).await
}

/// Removes the finalizer of a Snapshot whose node is gone (its Node object
/// no longer exists, so neither does its node store); until then, looks
/// again every `orphan_check`. Any node's controller may do it.
async fn release_if_node_gone(
    api: &Api<Snapshot>,
    snap: Arc<Snapshot>,
    node: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    if ctx.node_exists(node).await? {
        return Ok(Action::requeue(ctx.orphan_check));
    }
    Ok(finalizer(api, FINALIZER, snap, |event| async move {
        if let Event::Cleanup(snap) = event {
            let note = format!(
                "Node {node} is gone (no Node object); its data of this snapshot went with it"
            );
            ctx.event(
                snap.as_ref(),
                EventType::Warning,
                "NodeGone",
                "Delete",
                note,
            )
            .await;
        }
        Ok::<_, Error>(Action::await_change())
    })
    .await?)
}

/// Takes the snapshot, or (when `resumed`) first asks the shim whether a
/// previous controller already took it.
async fn take(
    api: &Api<Snapshot>,
    snap: Snapshot,
    ns: &str,
    ctx: &Context,
    resumed: bool,
) -> Result<Action, Error> {
    let status = snap.status.clone().unwrap_or_default();
    let pod_name = snap.spec.pod_name.clone();
    let _guard = ctx.lock_pod(ns, &pod_name).await;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let Some(pod) = current_pod(&pods, &pod_name, status.pod_uid.as_deref()).await? else {
        let message = format!("pod {pod_name} was deleted before the snapshot completed");
        return fail(api, &snap, Some(status), "PodDeleted", message, ctx).await;
    };
    let id = snap.uid().ok_or(Error::MissingField("metadata.uid"))?;
    let sandbox = ctx.locator.locate(&pod).await?;
    let mut info: Option<SnapshotInfo> = None;
    if resumed {
        info = ctx
            .shim
            .stats(&sandbox)
            .await?
            .snapshots
            .into_iter()
            .find(|s| s.snapshot_id == id);
        if info.is_some() {
            tracing::info!(snapshot = %snap.name_any(), "found the snapshot a previous controller took");
        }
    }
    let left = deadline_left(
        snap.metadata.creation_timestamp.as_ref(),
        snap.spec.failure_deadline_seconds,
    );
    if info.is_none() && left.is_some_and(|l| l.is_zero()) {
        let message = deadline_message(
            "snapshot",
            snap.spec.failure_deadline_seconds,
            "its node to take it",
        );
        return fail(api, &snap, Some(status), DEADLINE_EXCEEDED, message, ctx).await;
    }
    let info = match info {
        Some(info) => info,
        None => match ctx.shim.snapshot(&sandbox, &id, snap.spec.mode).await {
            Ok(info) => info,
            Err(err) => return shim_failed(api, &snap, status, &pods, err, ctx).await,
        },
    };
    let duration_ms = millis_since(status.start_time.as_ref());
    let parent_snapshot_name = match info.parent_id.as_deref() {
        Some(parent) => snapshot_named_by_id(api, parent).await?,
        None => None,
    };
    let ready = SnapshotStatus {
        phase: Phase::Ready,
        ready_to_use: true,
        snapshot_id: Some(info.snapshot_id.clone()),
        parent: info.parent_id.clone(),
        parent_snapshot_name,
        size_bytes: Some(info.size_bytes),
        written_bytes: Some(info.written_bytes),
        duration_ms: Some(duration_ms),
        ready_time: Some(now()),
        availability: Some(export::availability(&status)),
        conditions: conditions(
            &status.conditions,
            Phase::Ready,
            "SnapshotTaken",
            "snapshot is ready",
            snap.metadata.generation,
        ),
        message: None,
        error: None,
        ..status
    };
    let snap = write_status(api, &snap, with_sizes(ready, &info), ctx).await?;
    ctx.metrics
        .observe("snapshot", true, duration_ms as f64 / 1000.0);
    let note = format!(
        "Snapshot {} of pod {pod_name} ready: {} bytes written in {duration_ms} ms",
        info.snapshot_id, info.written_bytes
    );
    ctx.event(&snap, EventType::Normal, "Ready", "Snapshot", note)
        .await;
    Ok(match snap.spec.ttl_seconds_after_ready {
        Some(ttl) => {
            Action::requeue(Duration::from_secs(ttl.max(0).unsigned_abs()).min(ctx.recheck))
        }
        None => Action::requeue(ctx.recheck),
    })
}

/// A Ready snapshot: expire it after its TTL, mark it Lost when its data
/// left the node (unless it was exported: then it is in the registry
/// only), export it when its spec asks.
async fn ready(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    status: &SnapshotStatus,
    ns: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    if let Some(action) = expire(api, snap, status, ctx).await? {
        return Ok(action);
    }
    let id = status
        .snapshot_id
        .clone()
        .ok_or(Error::MissingField("status.snapshotID"))?;
    let stored = ctx.node.get_snapshot(&id).await?;
    if stored.is_none() && status.artifact.is_some() {
        return registry_only(api, snap, status, &id, ctx).await;
    }
    let Some(stored) = stored else {
        let message = format!("snapshot {id} is no longer on node {}", ctx.node_name);
        let lost = SnapshotStatus {
            phase: Phase::Lost,
            ready_to_use: false,
            availability: None,
            error: Some(operation_error("Lost", &message)),
            conditions: conditions(
                &status.conditions,
                Phase::Lost,
                "Lost",
                &message,
                snap.metadata.generation,
            ),
            message: Some(message.clone()),
            ..status.clone()
        };
        let snap = write_status(api, snap, lost, ctx).await?;
        ctx.event(&snap, EventType::Warning, "Lost", "Snapshot", message)
            .await;
        return Ok(Action::await_change());
    };
    // The node's sizes when the status lacks them (a snapshot taken through
    // a shim that predates them) or says otherwise: the node's files decide.
    let mut sized = with_sizes(status.clone(), &stored);
    sized.availability = Some(export::availability(status));
    let snap = if sized == *status {
        snap.clone()
    } else {
        write_status(api, snap, sized, ctx).await?
    };
    export::export(api, snap, ns, ctx).await?;
    Ok(Action::requeue(ctx.recheck))
}

/// An exported snapshot whose node copy is gone stays Ready: Clones pull
/// it from the registry (`availability: Registry`); said once, in the
/// message and a Warning Event.
async fn registry_only(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    status: &SnapshotStatus,
    id: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    if status.availability == Some(Availability::Registry) {
        return Ok(Action::requeue(ctx.recheck));
    }
    let message = format!(
        "snapshot {id} is no longer on node {}; it is still in the registry, so Clones of it run (on any node) but a Rollback to it cannot",
        ctx.node_name
    );
    let registry_only = SnapshotStatus {
        availability: Some(Availability::Registry),
        message: Some(message.clone()),
        ..status.clone()
    };
    let snap = write_status(api, snap, registry_only, ctx).await?;
    ctx.event(
        &snap,
        EventType::Warning,
        "NodeCopyLost",
        "Snapshot",
        message,
    )
    .await;
    Ok(Action::requeue(ctx.recheck))
}

/// `status` with the memory, disk and restore sizes of `info`; unchanged
/// when `info` has none (a shim or node that predates them answers 0 for
/// the restore size, which no snapshot has: it holds the guest's RAM).
fn with_sizes(status: SnapshotStatus, info: &SnapshotInfo) -> SnapshotStatus {
    if info.restore_bytes == 0 {
        return status;
    }
    SnapshotStatus {
        memory_bytes: Some(info.memory_bytes),
        disk_bytes: Some(info.disk_bytes),
        restore_size: Some(bytes_quantity(info.restore_bytes)),
        ..status
    }
}

async fn shim_failed(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    status: SnapshotStatus,
    pods: &Api<Pod>,
    err: ShimError,
    ctx: &Context,
) -> Result<Action, Error> {
    let pod_name = &snap.spec.pod_name;
    if current_pod(pods, pod_name, status.pod_uid.as_deref())
        .await?
        .is_none()
    {
        let message = format!("pod {pod_name} was deleted during the snapshot ({err})");
        return fail(api, snap, Some(status), "PodDeleted", message, ctx).await;
    }
    if let ShimError::Unavailable { .. } = err {
        return Err(err.into());
    }
    let (reason, message) = shim_failure(ShimOp::Snapshot, &err);
    fail(api, snap, Some(status), reason, message, ctx).await
}

/// Deletes the Snapshot once its TTL has passed (`Some`), or says when to look again.
async fn expire(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    status: &SnapshotStatus,
    ctx: &Context,
) -> Result<Option<Action>, Error> {
    let (Some(ttl), Some(ready)) = (
        snap.spec.ttl_seconds_after_ready,
        status.ready_time.as_ref(),
    ) else {
        return Ok(None);
    };
    let deadline_ms = ready
        .0
        .as_millisecond()
        .saturating_add(ttl.saturating_mul(1000));
    let left_ms = deadline_ms - Timestamp::now().as_millisecond();
    if left_ms > 0 {
        let left = Duration::from_millis(left_ms.unsigned_abs());
        return Ok((left < ctx.recheck).then(|| Action::requeue(left)));
    }
    let note = format!("Deleting snapshot: {ttl} s after it became Ready");
    ctx.event(snap, EventType::Normal, "Expired", "Delete", note)
        .await;
    match api.delete(&snap.name_any(), &DeleteParams::default()).await {
        Ok(_) => Ok(Some(Action::await_change())),
        Err(e) if is_not_found(&e) => Ok(Some(Action::await_change())),
        Err(e) => Err(e.into()),
    }
}

/// Removes this node's data of a deleted Snapshot (policy Delete); the
/// finalizer helper then removes the finalizer. When the node refuses —
/// the store keeps the data for a child's incremental data (a child
/// Snapshot deleted with policy Retain leaves its data, which needs this
/// one) or a running VM restored from it — the Snapshot says why in a
/// `DeletionBlocked` condition (reason `NodeKeepsData`) and a Warning
/// Event, keeps its finalizer, and is tried again with the backoff.
async fn cleanup(api: &Api<Snapshot>, snap: &Snapshot, ctx: &Context) -> Result<Action, Error> {
    let status = snap.status.clone().unwrap_or_default();
    let on_this_node = status.node_name.as_deref() == Some(ctx.node_name.as_str());
    if on_this_node && snap.spec.deletion_policy == DeletionPolicy::Delete {
        // An interrupted snapshot may exist under the object's UID without a status saying so.
        let id = status
            .snapshot_id
            .clone()
            .or_else(|| snap.uid())
            .ok_or(Error::MissingField("metadata.uid"))?;
        let _guard = ctx
            .lock_pod(&snap.namespace().unwrap_or_default(), &snap.spec.pod_name)
            .await;
        let started = std::time::Instant::now();
        let result = ctx.node.delete_snapshot(&id).await;
        ctx.metrics.observe(
            "delete_snapshot",
            result.is_ok(),
            started.elapsed().as_secs_f64(),
        );
        if let Err(ShimError::Refused(why)) = &result {
            let message = format!(
                "node {} keeps the data of snapshot {id}: {why}; remove what holds it first",
                ctx.node_name
            );
            block_deletion(api, snap, "NodeKeepsData", message, ctx).await?;
        }
        result?;
        let note = format!("Removed snapshot {id} from node {}", ctx.node_name);
        ctx.event(snap, EventType::Normal, "DataDeleted", "Delete", note)
            .await;
    } else if on_this_node {
        // Policy Retain: the data stays, and the node's garbage collector
        // must not take it for an orphan once the object is gone.
        let id = status
            .snapshot_id
            .clone()
            .or_else(|| snap.uid())
            .ok_or(Error::MissingField("metadata.uid"))?;
        match ctx.node.retain_snapshot(&id).await {
            // A node daemon that predates the collector keeps everything
            // (ttrpc answers NOT_FOUND for a method it does not serve).
            Ok(()) | Err(ShimError::Unimplemented(_) | ShimError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Action::await_change())
}

async fn fail(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    status: Option<SnapshotStatus>,
    reason: &str,
    message: String,
    ctx: &Context,
) -> Result<Action, Error> {
    let status = status.unwrap_or_default();
    let duration_ms = millis_since(status.start_time.as_ref());
    let failed = SnapshotStatus {
        phase: Phase::Failed,
        ready_to_use: false,
        error: Some(operation_error(reason, &message)),
        conditions: conditions(
            &status.conditions,
            Phase::Failed,
            reason,
            &message,
            snap.metadata.generation,
        ),
        message: Some(message.clone()),
        ..status
    };
    let snap = write_status(api, snap, failed, ctx).await?;
    ctx.metrics
        .observe("snapshot", false, duration_ms as f64 / 1000.0);
    ctx.event(&snap, EventType::Warning, "Failed", "Snapshot", message)
        .await;
    Ok(Action::await_change())
}

/// The name of the Snapshot (in `api`'s namespace) whose node-store ID is `id`.
async fn snapshot_named_by_id(api: &Api<Snapshot>, id: &str) -> Result<Option<String>, Error> {
    let all = api.list(&ListParams::default()).await?;
    Ok(all
        .items
        .into_iter()
        .find(|s| s.status.as_ref().and_then(|st| st.snapshot_id.as_deref()) == Some(id))
        .map(|s| s.name_any()))
}

/// Condition type on a deleting Snapshot whose data is kept for its children.
pub const DELETION_BLOCKED: &str = "DeletionBlocked";

/// Keeps a deleting Snapshot (policy Delete) and its node-side data while
/// Snapshots of the same namespace that are not Failed name it as their
/// `status.parent`: their incremental data needs it. Says why in a
/// `DeletionBlocked` condition and a Warning Event (once), and looks again
/// after `retry`. `None` when nothing depends on it.
async fn hold_for_children(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    ns: &str,
    ctx: &Context,
) -> Result<Option<Action>, Error> {
    if snap.spec.deletion_policy != DeletionPolicy::Delete {
        return Ok(None);
    }
    let status = snap.status.clone().unwrap_or_default();
    let Some(id) = status.snapshot_id.clone() else {
        return Ok(None);
    };
    let mut children: Vec<String> = api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|s| {
            s.status.as_ref().is_some_and(|st| {
                st.parent.as_deref() == Some(id.as_str())
                    && matches!(st.phase, Phase::Ready | Phase::InProgress | Phase::Pending)
            })
        })
        .map(|s| s.name_any())
        .collect();
    if children.is_empty() {
        return Ok(None);
    }
    children.sort();
    let message = format!(
        "the node-side data of snapshot {id} is kept while snapshots {} of namespace {ns} build on it; delete them first",
        children.join(", ")
    );
    block_deletion(api, snap, "ChildSnapshotsExist", message, ctx).await?;
    Ok(Some(Action::requeue(ctx.retry)))
}

/// Records on a deleting Snapshot why its deletion waits: a
/// `DeletionBlocked` condition and a Warning Event, once per message.
async fn block_deletion(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    reason: &str,
    message: String,
    ctx: &Context,
) -> Result<(), Error> {
    let status = snap.status.clone().unwrap_or_default();
    let already = status
        .conditions
        .iter()
        .any(|c| c.type_ == DELETION_BLOCKED && c.status == "True" && c.message == message);
    if already {
        return Ok(());
    }
    let mut conds: Vec<Condition> = status
        .conditions
        .iter()
        .filter(|c| c.type_ != DELETION_BLOCKED)
        .cloned()
        .collect();
    conds.push(Condition {
        type_: DELETION_BLOCKED.to_string(),
        status: "True".to_string(),
        reason: reason.to_string(),
        message: message.clone(),
        last_transition_time: now(),
        observed_generation: snap.metadata.generation,
    });
    let held = SnapshotStatus {
        conditions: conds,
        ..status
    };
    let snap = write_status(api, snap, held, ctx).await?;
    ctx.event(
        &snap,
        EventType::Warning,
        "DeletionBlocked",
        "Delete",
        message,
    )
    .await;
    Ok(())
}
