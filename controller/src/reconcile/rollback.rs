//! Rollback: rewind a running pod on this node in place to a snapshot of its lineage.

use std::collections::HashMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};

use super::{conditions, write_status};
use crate::context::{millis_since, now, Context, Error};
use crate::crd::{Phase, Rollback, RollbackStatus, Snapshot, RESTORE_FROM_ANNOTATION};
use crate::reconcile::{current_pod, validate_name};
use crate::shim::ShimError;

/// Checks what the CRD schema checks, for objects written before it was installed.
pub fn validate(rollback: &Rollback) -> Result<(), String> {
    validate_name("spec.podName", &rollback.spec.pod_name)?;
    validate_name("spec.snapshotName", &rollback.spec.snapshot_name)
}

/// Reconciles one Rollback. A Ready or Failed Rollback is never acted on
/// again, so applying the same manifest twice rolls back once.
pub async fn reconcile(rb: Arc<Rollback>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = rb
        .namespace()
        .ok_or(Error::MissingField("metadata.namespace"))?;
    let api: Api<Rollback> = Api::namespaced(ctx.client.clone(), &ns);
    let status = rb.status.clone().unwrap_or_default();
    if rb.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    match status.phase {
        Phase::Pending => start(&api, &rb, &ns, &ctx).await,
        Phase::InProgress => resume(&api, &rb, &ns, &ctx).await,
        Phase::Ready | Phase::Failed | Phase::Lost => Ok(Action::await_change()),
    }
}

async fn start(
    api: &Api<Rollback>,
    rb: &Rollback,
    ns: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    if let Err(message) = validate(rb) {
        return fail(api, rb, "Invalid", message, ctx).await;
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let pod_name = &rb.spec.pod_name;
    let snap_name = &rb.spec.snapshot_name;
    let Some(pod) = current_pod(&pods, pod_name, None).await? else {
        return fail(
            api,
            rb,
            "PodNotFound",
            format!("pod {pod_name} not found"),
            ctx,
        )
        .await;
    };
    if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(ctx.node_name.as_str()) {
        return Ok(Action::await_change());
    }
    let snapshots: Api<Snapshot> = Api::namespaced(ctx.client.clone(), ns);
    let Some(snap) = snapshots.get_opt(snap_name).await? else {
        return fail(
            api,
            rb,
            "SnapshotNotFound",
            format!("snapshot {snap_name} not found"),
            ctx,
        )
        .await;
    };
    let snap_status = snap.status.clone().unwrap_or_default();
    match snap_status.phase {
        Phase::Ready => {}
        Phase::Pending | Phase::InProgress => return Ok(Action::requeue(ctx.retry)),
        Phase::Failed | Phase::Lost => {
            let message = format!("snapshot {snap_name} is {}", snap_status.phase);
            return fail(api, rb, "SnapshotNotReady", message, ctx).await;
        }
    }
    if let Err(message) = in_lineage(&pod, &snap, &snapshots).await? {
        return fail(api, rb, "NotInLineage", message, ctx).await;
    }
    let message = format!("rolling pod {pod_name} back to snapshot {snap_name}");
    let status = RollbackStatus {
        phase: Phase::InProgress,
        start_time: Some(now()),
        conditions: conditions(
            &[],
            Phase::InProgress,
            "RollingBack",
            &message,
            rb.metadata.generation,
        ),
        message: Some(message),
        ..Default::default()
    };
    let rb = write_status(api, rb, status, ctx).await?;
    let note = format!(
        "Rolling pod {pod_name} back to snapshot {snap_name} on node {}",
        ctx.node_name
    );
    ctx.event(&rb, EventType::Normal, "Started", "Rollback", note)
        .await;
    roll_back(api, &rb, &pod, &snap, ctx, false).await
}

async fn resume(
    api: &Api<Rollback>,
    rb: &Rollback,
    ns: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let pod_name = &rb.spec.pod_name;
    let Some(pod) = current_pod(&pods, pod_name, None).await? else {
        let message = format!("pod {pod_name} was deleted during the rollback");
        return fail(api, rb, "PodDeleted", message, ctx).await;
    };
    if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(ctx.node_name.as_str()) {
        return Ok(Action::await_change());
    }
    let snapshots: Api<Snapshot> = Api::namespaced(ctx.client.clone(), ns);
    let Some(snap) = snapshots.get_opt(&rb.spec.snapshot_name).await? else {
        let message = format!(
            "snapshot {} was deleted during the rollback",
            rb.spec.snapshot_name
        );
        return fail(api, rb, "SnapshotNotFound", message, ctx).await;
    };
    roll_back(api, rb, &pod, &snap, ctx, true).await
}

/// Is `snap` a snapshot of this pod, or an ancestor of the snapshot the pod
/// was restored from? `Err` carries the reason it is not.
async fn in_lineage(
    pod: &Pod,
    snap: &Snapshot,
    snapshots: &Api<Snapshot>,
) -> Result<Result<(), String>, Error> {
    let status = snap.status.clone().unwrap_or_default();
    if status.pod_uid.is_some() && status.pod_uid == pod.metadata.uid {
        return Ok(Ok(()));
    }
    let Some(target) = status.snapshot_id.as_deref() else {
        return Ok(Err(format!(
            "snapshot {} has no snapshot ID",
            snap.name_any()
        )));
    };
    if let Some(origin) = pod.annotations().get(RESTORE_FROM_ANNOTATION) {
        let all = snapshots.list(&ListParams::default()).await?;
        let parents: HashMap<String, Option<String>> = all
            .items
            .iter()
            .filter_map(|s| {
                let st = s.status.as_ref()?;
                Some((st.snapshot_id.clone()?, st.parent.clone()))
            })
            .collect();
        let mut next = Some(origin.clone());
        // Each step moves to a parent; a cycle cannot be longer than the list.
        for _ in 0..=parents.len() {
            let Some(id) = next else { break };
            if id == target {
                return Ok(Ok(()));
            }
            next = parents.get(&id).cloned().flatten();
        }
    }
    Ok(Err(format!(
        "snapshot {} is not in the lineage of pod {}: it was taken of pod {} and the pod was not restored from it or its ancestors",
        snap.name_any(),
        pod.name_any(),
        snap.spec.pod_name
    )))
}

async fn roll_back(
    api: &Api<Rollback>,
    rb: &Rollback,
    pod: &Pod,
    snap: &Snapshot,
    ctx: &Context,
    resumed: bool,
) -> Result<Action, Error> {
    let ns = rb.namespace().unwrap_or_default();
    let pod_name = &rb.spec.pod_name;
    let op_id = rb.uid().ok_or(Error::MissingField("metadata.uid"))?;
    let snapshot_id = snap
        .status
        .as_ref()
        .and_then(|s| s.snapshot_id.clone())
        .ok_or(Error::MissingField("snapshot status.snapshotID"))?;
    let _guard = ctx.lock_pod(&ns, pod_name).await;
    let sandbox = ctx.locator.locate(pod).await?;
    let done = resumed
        && ctx
            .shim
            .stats(&sandbox)
            .await?
            .last_rollback_operation_id
            .as_deref()
            == Some(op_id.as_str());
    if done {
        tracing::info!(rollback = %rb.name_any(), "found the rollback a previous controller did");
    } else if let Err(err) = ctx.shim.rollback(&sandbox, &snapshot_id, &op_id).await {
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
        if current_pod(&pods, pod_name, pod.metadata.uid.as_deref())
            .await?
            .is_none()
        {
            let message = format!("pod {pod_name} was deleted during the rollback ({err})");
            return fail(api, rb, "PodDeleted", message, ctx).await;
        }
        if let ShimError::Unavailable { .. } = err {
            return Err(err.into());
        }
        return fail(
            api,
            rb,
            "ShimError",
            format!("the shim failed the rollback: {err}"),
            ctx,
        )
        .await;
    }
    let status = rb.status.clone().unwrap_or_default();
    let duration_ms = millis_since(status.start_time.as_ref());
    let ready = RollbackStatus {
        phase: Phase::Ready,
        duration_ms: Some(duration_ms),
        completion_time: Some(now()),
        conditions: conditions(
            &status.conditions,
            Phase::Ready,
            "RolledBack",
            &format!("rolled back to snapshot {}", rb.spec.snapshot_name),
            rb.metadata.generation,
        ),
        message: None,
        ..status
    };
    let rb = write_status(api, rb, ready, ctx).await?;
    ctx.metrics
        .observe("rollback", true, duration_ms as f64 / 1000.0);
    let note = format!(
        "Pod {pod_name} rolled back to snapshot {} in {duration_ms} ms",
        rb.spec.snapshot_name
    );
    ctx.event(&rb, EventType::Normal, "RolledBack", "Rollback", note)
        .await;
    Ok(Action::await_change())
}

async fn fail(
    api: &Api<Rollback>,
    rb: &Rollback,
    reason: &str,
    message: String,
    ctx: &Context,
) -> Result<Action, Error> {
    let status = rb.status.clone().unwrap_or_default();
    let duration_ms = millis_since(status.start_time.as_ref());
    let failed = RollbackStatus {
        phase: Phase::Failed,
        message: Some(format!("{reason}: {message}")),
        completion_time: Some(now()),
        conditions: conditions(
            &status.conditions,
            Phase::Failed,
            reason,
            &message,
            rb.metadata.generation,
        ),
        ..status
    };
    let rb = write_status(api, rb, failed, ctx).await?;
    ctx.metrics
        .observe("rollback", false, duration_ms as f64 / 1000.0);
    ctx.event(&rb, EventType::Warning, reason, "Rollback", message)
        .await;
    Ok(Action::await_change())
}
