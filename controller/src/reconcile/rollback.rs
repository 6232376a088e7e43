//! Rollback: rewind a running pod on this node in place to a snapshot of its lineage.
//!
//! A snapshot is in a pod's lineage when it was taken of that pod (same
//! UID): a clone never rolls back to the snapshot it was restored from
//! (`NotInLineage`, before the shim is called). Unless
//! `spec.safetySnapshot: false`, a Rollback first creates a Snapshot
//! `<rollback>-safety` (shortened with a hash when too long), labelled
//! `twig.dev/safety-for: <rollback>` and annotated `twig.dev/safety-for-uid`,
//! waits (watching) until it is Ready and only then calls the shim. The
//! safety Snapshot is not owned by the Rollback, so deleting the Rollback
//! keeps it as a way back. The safety snapshot and the rollback are two
//! operations under the pod's lock, not one. A Rollback acts once:
//! Ready/Failed Rollbacks are never acted on again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};

use super::{
    conditions, deadline_left, deadline_message, operation_error, shim_failure, wait, write_status,
    ShimOp, DEADLINE_EXCEEDED, POD_REPLACED,
};
use crate::context::{bounded_name, millis_since, now, Context, Error};
use crate::crd::{
    DeletionPolicy, Phase, Rollback, RollbackStatus, Snapshot, SnapshotMode, SnapshotSpec,
    RESTORE_FROM_ANNOTATION, SAFETY_FOR_LABEL, SAFETY_FOR_UID_ANNOTATION,
};
use crate::reconcile::{current_pod, validate_name};
use crate::shim::ShimError;

/// Checks what the CRD schema checks, for objects written before it was installed.
pub fn validate(rollback: &Rollback) -> Result<(), String> {
    validate_name("spec.podName", &rollback.spec.pod_name)?;
    validate_name("spec.snapshotName", &rollback.spec.snapshot_name)?;
    if rollback
        .spec
        .failure_deadline_seconds
        .is_some_and(|t| t < 1)
    {
        return Err("spec.failureDeadlineSeconds must be at least 1".to_string());
    }
    Ok(())
}

/// Reconciles one Rollback. A Ready or Failed Rollback is never acted on
/// again, so applying the same manifest twice rolls back once. An error
/// (retried with backoff) past the Rollback's failure deadline fails it
/// with `DeadlineExceeded` and the error instead.
pub async fn reconcile(rb: Arc<Rollback>, ctx: Arc<Context>) -> Result<Action, Error> {
    let err = match reconcile_inner(rb.clone(), ctx.clone()).await {
        Ok(action) => return Ok(action),
        Err(err) => err,
    };
    let open = rb
        .status
        .as_ref()
        .is_none_or(|s| matches!(s.phase, Phase::Pending | Phase::InProgress));
    if !open || !left(&rb).is_some_and(|l| l.is_zero()) || rb.metadata.deletion_timestamp.is_some()
    {
        return Err(err);
    }
    let api: Api<Rollback> =
        Api::namespaced(ctx.client.clone(), &rb.namespace().unwrap_or_default());
    deadline_passed(&api, &rb, &format!("a retry (last error: {err})"), &ctx).await
}

async fn reconcile_inner(rb: Arc<Rollback>, ctx: Arc<Context>) -> Result<Action, Error> {
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

/// The Rollback a safety Snapshot was taken for (its `twig.dev/safety-for` label).
pub fn of_safety_snapshot(snap: Snapshot) -> Option<ObjectRef<Rollback>> {
    let name = snap.labels().get(SAFETY_FOR_LABEL)?;
    let ns = snap.namespace()?;
    Some(ObjectRef::new(name).within(&ns))
}

/// Name of the safety Snapshot a Rollback takes: `<rollback>-safety`
/// (shortened with a hash when too long for an object name).
pub fn safety_snapshot_name(rb: &Rollback) -> String {
    bounded_name(&rb.name_any(), "-safety", 253)
}

fn left(rb: &Rollback) -> Option<Duration> {
    deadline_left(
        rb.metadata.creation_timestamp.as_ref(),
        rb.spec.failure_deadline_seconds,
    )
}

async fn deadline_passed(
    api: &Api<Rollback>,
    rb: &Rollback,
    waiting_for: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    let message = deadline_message("rollback", rb.spec.failure_deadline_seconds, waiting_for);
    fail(api, rb, DEADLINE_EXCEEDED, message, ctx).await
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
    if let Some(want) = rb.spec.pod_uid.as_deref() {
        if pod.metadata.uid.as_deref() != Some(want) {
            let message = format!(
                "pod {pod_name} has UID {}, not {want} (spec.podUid): it was recreated under the same name",
                pod.metadata.uid.as_deref().unwrap_or("<none>")
            );
            return fail(api, rb, POD_REPLACED, message, ctx).await;
        }
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
        Phase::Pending | Phase::InProgress => {
            if left(rb).is_some_and(|l| l.is_zero()) {
                let waiting_for = format!("snapshot {snap_name} to be Ready");
                return deadline_passed(api, rb, &waiting_for, ctx).await;
            }
            return Ok(wait(ctx.retry, left(rb)));
        }
        Phase::Failed | Phase::Lost => {
            let message = format!("snapshot {snap_name} is {}", snap_status.phase);
            return fail(api, rb, "SnapshotNotReady", message, ctx).await;
        }
    }
    if let Err(message) = in_lineage(&pod, &snap) {
        return fail(api, rb, "NotInLineage", message, ctx).await;
    }
    if left(rb).is_some_and(|l| l.is_zero()) {
        return deadline_passed(api, rb, "its node to start it", ctx).await;
    }
    let safety = rb.spec.safety_snapshot.then(|| safety_snapshot_name(rb));
    let message = match &safety {
        Some(safety) => format!(
            "taking safety snapshot {safety} of pod {pod_name}, then rolling it back to snapshot {snap_name}"
        ),
        None => format!("rolling pod {pod_name} back to snapshot {snap_name}"),
    };
    let status = RollbackStatus {
        phase: Phase::InProgress,
        node_name: Some(ctx.node_name.clone()),
        pod_uid: pod.metadata.uid.clone(),
        safety_snapshot_name: safety,
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
    proceed(api, &rb, &pod, &snap, ctx, false).await
}

async fn resume(
    api: &Api<Rollback>,
    rb: &Rollback,
    ns: &str,
    ctx: &Context,
) -> Result<Action, Error> {
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let pod_name = &rb.spec.pod_name;
    let pinned = rb.status.as_ref().and_then(|s| s.pod_uid.clone());
    let Some(pod) = current_pod(&pods, pod_name, pinned.as_deref()).await? else {
        if let (Some(other), Some(pinned)) = (current_pod(&pods, pod_name, None).await?, &pinned) {
            let message = format!(
                "pod {pod_name} was recreated during the rollback (UID {}, not {pinned}); the new pod is left alone",
                other.metadata.uid.as_deref().unwrap_or("<none>")
            );
            return fail(api, rb, POD_REPLACED, message, ctx).await;
        }
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
    proceed(api, rb, &pod, &snap, ctx, true).await
}

/// Where a Rollback's safety snapshot stands.
enum Safety {
    /// Ready: the rollback may go on.
    Ready,
    /// Being taken: look again.
    Waiting,
    /// Will not be taken: the rollback fails with this reason and message.
    Failed(&'static str, String),
}

/// Makes sure the Rollback's safety Snapshot exists (creating it the first
/// time: not owned by the Rollback, so it outlives it) and says where it stands.
async fn ensure_safety_snapshot(rb: &Rollback, name: &str, ctx: &Context) -> Result<Safety, Error> {
    let ns = rb.namespace().unwrap_or_default();
    let snapshots: Api<Snapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let rb_uid = rb.uid().ok_or(Error::MissingField("metadata.uid"))?;
    let Some(snap) = snapshots.get_opt(name).await? else {
        let pod_uid = rb.status.as_ref().and_then(|s| s.pod_uid.clone());
        let snap = Snapshot {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                namespace: Some(ns.clone()),
                labels: Some(BTreeMap::from([(
                    SAFETY_FOR_LABEL.to_string(),
                    rb.name_any(),
                )])),
                annotations: Some(BTreeMap::from([(
                    SAFETY_FOR_UID_ANNOTATION.to_string(),
                    rb_uid,
                )])),
                ..Default::default()
            },
            spec: SnapshotSpec {
                pod_name: rb.spec.pod_name.clone(),
                pod_uid,
                mode: SnapshotMode::Incremental,
                deletion_policy: DeletionPolicy::Delete,
                ttl_seconds_after_ready: None,
                failure_deadline_seconds: None,
                export: false,
            },
            status: None,
        };
        match snapshots.create(&PostParams::default(), &snap).await {
            Ok(_) => {
                let note = format!(
                    "Taking safety snapshot {name} of pod {} before rolling it back",
                    rb.spec.pod_name
                );
                ctx.event(
                    rb,
                    EventType::Normal,
                    "SafetySnapshotRequested",
                    "Rollback",
                    note,
                )
                .await;
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(Safety::Waiting);
    };
    if snap.annotations().get(SAFETY_FOR_UID_ANNOTATION) != rb.uid().as_ref() {
        return Ok(Safety::Failed(
            "NameTaken",
            format!("snapshot {name} already exists and was not taken for this Rollback"),
        ));
    }
    let status = snap.status.unwrap_or_default();
    Ok(match status.phase {
        Phase::Ready => Safety::Ready,
        Phase::Pending | Phase::InProgress => Safety::Waiting,
        Phase::Failed | Phase::Lost => Safety::Failed(
            "SafetySnapshotFailed",
            format!(
                "safety snapshot {name} is {}, so the pod was not rolled back: {}",
                status.phase,
                status.message.unwrap_or_default()
            ),
        ),
    })
}

/// Takes the safety snapshot (when asked for), then rolls the pod back;
/// when `resumed`, first asks the shim whether a previous controller
/// already rolled it back.
async fn proceed(
    api: &Api<Rollback>,
    rb: &Rollback,
    pod: &Pod,
    snap: &Snapshot,
    ctx: &Context,
    resumed: bool,
) -> Result<Action, Error> {
    let op_id = rb.uid().ok_or(Error::MissingField("metadata.uid"))?;
    if resumed {
        let sandbox = ctx.locator.locate(pod).await?;
        let last = ctx.shim.stats(&sandbox).await?.last_rollback_operation_id;
        if last.as_deref() == Some(op_id.as_str()) {
            tracing::info!(rollback = %rb.name_any(), "found the rollback a previous controller did");
            return finish(api, rb, ctx).await;
        }
    }
    let safety = rb
        .status
        .as_ref()
        .and_then(|s| s.safety_snapshot_name.clone());
    if let Some(name) = safety {
        match ensure_safety_snapshot(rb, &name, ctx).await? {
            Safety::Ready => {}
            Safety::Waiting => {
                if left(rb).is_some_and(|l| l.is_zero()) {
                    let waiting_for = format!("safety snapshot {name} to be Ready");
                    return deadline_passed(api, rb, &waiting_for, ctx).await;
                }
                return Ok(wait(ctx.retry, left(rb)));
            }
            Safety::Failed(reason, message) => return fail(api, rb, reason, message, ctx).await,
        }
    }
    if left(rb).is_some_and(|l| l.is_zero()) {
        return deadline_passed(api, rb, "the shim to roll the pod back", ctx).await;
    }
    roll_back(api, rb, pod, snap, ctx).await
}

/// Is `snap` a rollback target of `pod`? `Err` carries why not.
///
/// The rule, the shim's too: a pod rolls back only to a snapshot taken of
/// itself (same pod UID; the shim also checks the same sandbox and the same
/// containers, and refuses otherwise with `FAILED_PRECONDITION`). The
/// snapshot a clone was restored from (`twig.dev/restore-from`) and its
/// ancestors were taken of another pod: a clone's VM is restored from
/// them once, at its start, and never rolled back to them. To rewind a
/// clone to where it started, snapshot it once it is Ready and roll back
/// to that, or make a new clone.
fn in_lineage(pod: &Pod, snap: &Snapshot) -> Result<(), String> {
    let status = snap.status.clone().unwrap_or_default();
    if status.pod_uid.is_some() && status.pod_uid == pod.metadata.uid {
        return Ok(());
    }
    let origin = status
        .snapshot_id
        .as_ref()
        .is_some_and(|id| pod.annotations().get(RESTORE_FROM_ANNOTATION) == Some(id));
    let clone_note = if origin {
        format!(
            "; pod {} was restored from it, and a clone never rolls back to the snapshot it was \
             restored from: snapshot the clone and roll back to that",
            pod.name_any()
        )
    } else {
        String::new()
    };
    Err(format!(
        "snapshot {} is not in the lineage of pod {}: it was taken of pod {}, and a pod rolls \
         back only to snapshots taken of itself{clone_note}",
        snap.name_any(),
        pod.name_any(),
        snap.spec.pod_name
    ))
}

async fn roll_back(
    api: &Api<Rollback>,
    rb: &Rollback,
    pod: &Pod,
    snap: &Snapshot,
    ctx: &Context,
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
    if let Err(err) = ctx.shim.rollback(&sandbox, &snapshot_id, &op_id).await {
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
        let (reason, mut message) = shim_failure(ShimOp::Rollback, &err);
        if let Some(safety) = rb
            .status
            .as_ref()
            .and_then(|s| s.safety_snapshot_name.as_deref())
        {
            message.push_str(&format!(
                "; safety snapshot {safety} holds the pod's state before the rollback"
            ));
        }
        return fail(api, rb, reason, message, ctx).await;
    }
    finish(api, rb, ctx).await
}

/// Marks the Rollback Ready.
async fn finish(api: &Api<Rollback>, rb: &Rollback, ctx: &Context) -> Result<Action, Error> {
    let pod_name = &rb.spec.pod_name;
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
        error: None,
        ..status
    };
    let rb = write_status(api, rb, ready, ctx).await?;
    ctx.metrics
        .observe("rollback", true, duration_ms as f64 / 1000.0);
    let undo = rb
        .status
        .as_ref()
        .and_then(|s| s.safety_snapshot_name.as_deref())
        .map(|s| format!("; safety snapshot {s} holds the state before"))
        .unwrap_or_default();
    let note = format!(
        "Pod {pod_name} rolled back to snapshot {} in {duration_ms} ms{undo}",
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
        error: Some(operation_error(reason, &message)),
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
