//! Snapshot: take a snapshot of a running pod on this node through its shim;
//! remove the node-side data when the object is deleted; expire after its TTL.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::api::DeleteParams;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};

use super::write_status;
use crate::context::{
    add_finalizer, is_not_found, millis_since, now, remove_finalizer, Context, Error,
};
use crate::crd::{DeletionPolicy, Phase, Snapshot, SnapshotMode, SnapshotStatus, RUNTIME_CLASS};
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
    Ok(())
}

/// Reconciles one Snapshot.
pub async fn reconcile(snap: Arc<Snapshot>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = snap
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<Snapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let status = snap.status.clone().unwrap_or_default();
    if status
        .node_name
        .as_ref()
        .is_some_and(|n| *n != ctx.node_name)
    {
        return Ok(Action::await_change());
    }
    if snap.metadata.deletion_timestamp.is_some() {
        return finalize(&api, &snap, &status, &ctx).await;
    }
    match status.phase {
        Phase::Pending => start(&api, &snap, &ns, &ctx).await,
        Phase::InProgress => take(&api, (*snap).clone(), &ns, &ctx, true).await,
        Phase::Ready => ready(&api, &snap, &status, &ctx).await,
        Phase::Failed | Phase::Lost => Ok(Action::await_change()),
    }
}

async fn start(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    ns: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    if let Err(message) = validate(snap) {
        return fail(api, snap, None, "Invalid", message, ctx).await;
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let pod_name = &snap.spec.pod_name;
    let Some(pod) = pods.get_opt(pod_name).await? else {
        return fail(
            api,
            snap,
            None,
            "PodNotFound",
            format!("pod {pod_name} not found"),
            ctx,
        )
        .await;
    };
    let Some(pod_node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
        // Not scheduled yet: look again later.
        return Ok(Action::requeue(ctx.retry));
    };
    if pod_node != ctx.node_name {
        return Ok(Action::await_change());
    }
    let runtime_class = pod
        .spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref());
    if runtime_class != Some(RUNTIME_CLASS) {
        let message = format!("pod {pod_name} does not run under RuntimeClass {RUNTIME_CLASS}");
        return fail(api, snap, None, "NotATwigPod", message, ctx).await;
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return fail(
            api,
            snap,
            None,
            "PodTerminating",
            format!("pod {pod_name} is terminating"),
            ctx,
        )
        .await;
    }
    let snap = add_finalizer(api, snap, FINALIZER).await?;
    let status = SnapshotStatus {
        phase: Phase::InProgress,
        node_name: Some(ctx.node_name.clone()),
        pod_uid: pod.metadata.uid.clone(),
        start_time: Some(now()),
        message: Some(format!("taking a snapshot of pod {pod_name}")),
        conditions: vec![ready_condition(
            &snap,
            "False",
            "InProgress",
            "snapshot in progress",
        )],
        ..Default::default()
    };
    let snap = write_status(api, &snap, status).await?;
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
    let info = match info {
        Some(info) => info,
        None => match ctx.shim.snapshot(&sandbox, &id, snap.spec.mode).await {
            Ok(info) => info,
            Err(err) => return shim_failed(api, &snap, status, &pods, err, ctx).await,
        },
    };
    let duration_ms = millis_since(status.start_time.as_ref());
    let ready = SnapshotStatus {
        phase: Phase::Ready,
        snapshot_id: Some(info.snapshot_id.clone()),
        parent: info.parent_id.clone(),
        size_bytes: Some(info.size_bytes),
        written_bytes: Some(info.written_bytes),
        duration_ms: Some(duration_ms),
        ready_time: Some(now()),
        conditions: vec![ready_condition(
            &snap,
            "True",
            "SnapshotTaken",
            "snapshot is ready",
        )],
        message: None,
        ..status
    };
    let snap = write_status(api, &snap, ready).await?;
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

/// A Ready snapshot: expire it after its TTL, mark it Lost when its data left the node.
async fn ready(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    status: &SnapshotStatus,
    ctx: &Context,
) -> Result<Action, Error> {
    if let Some(action) = expire(api, snap, status, ctx).await? {
        return Ok(action);
    }
    let id = status
        .snapshot_id
        .clone()
        .ok_or(Error::MissingField("status.snapshotID"))?;
    if !ctx.node.has_snapshot(&id).await? {
        let message = format!("snapshot {id} is no longer on node {}", ctx.node_name);
        let lost = SnapshotStatus {
            phase: Phase::Lost,
            conditions: vec![ready_condition(snap, "False", "Lost", &message)],
            message: Some(message.clone()),
            ..status.clone()
        };
        let snap = write_status(api, snap, lost).await?;
        ctx.event(&snap, EventType::Warning, "Lost", "Snapshot", message)
            .await;
        return Ok(Action::await_change());
    }
    Ok(Action::requeue(ctx.recheck))
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
    fail(
        api,
        snap,
        Some(status),
        "ShimError",
        format!("the shim failed the snapshot: {err}"),
        ctx,
    )
    .await
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

async fn finalize(
    api: &Api<Snapshot>,
    snap: &Snapshot,
    status: &SnapshotStatus,
    ctx: &Context,
) -> Result<Action, Error> {
    if !snap.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
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
        result?;
        let note = format!("Removed snapshot {id} from node {}", ctx.node_name);
        ctx.event(snap, EventType::Normal, "DataDeleted", "Delete", note)
            .await;
    }
    remove_finalizer(api, snap, FINALIZER).await?;
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
        conditions: vec![ready_condition(snap, "False", reason, &message)],
        message: Some(message.clone()),
        ..status
    };
    let snap = write_status(api, snap, failed).await?;
    ctx.metrics
        .observe("snapshot", false, duration_ms as f64 / 1000.0);
    ctx.event(&snap, EventType::Warning, "Failed", "Snapshot", message)
        .await;
    Ok(Action::await_change())
}

fn ready_condition(snap: &Snapshot, status: &str, reason: &str, message: &str) -> Condition {
    Condition {
        type_: "Ready".to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message: message.to_string(),
        last_transition_time: now(),
        observed_generation: snap.metadata.generation,
    }
}
