//! The five reconcilers and the loop that runs them.
//!
//! What they share:
//!
//! - A controller handles an object when its pod (Snapshot, Rollback, Clone
//!   of a pod) or its snapshot (Clone of a snapshot) is on its node; every
//!   node handles every SandboxTemplate. Operations on one pod are
//!   serialized by a per-pod lock.
//! - Restarts: a snapshot's node-store id is the Snapshot's UID and a
//!   rollback's operation id the Rollback's, so a controller that finds an
//!   object `InProgress` asks the shim (`Stats`) whether the work was done
//!   and redoes it only if not.
//! - Status is written with server-side apply, field manager
//!   `twig-controller/<node>`, forced. A Snapshot's, Clone's or Rollback's
//!   status is applied whole and pinned to the resourceVersion it was
//!   computed from (a 409 retries the object); a SandboxTemplate's is not
//!   pinned: each node applies only its own `status.nodes` entry and the
//!   `readyNodes` it counts (shared, last writer wins, converging because
//!   every status change makes every node look again). A condition's
//!   lastTransitionTime changes only with its status.
//! - Finalizers go through kube-runtime's helper (JSON patches with a
//!   `test`). A node is gone when its Node object no longer exists; a node
//!   only down still holds its finalizers. Another node reconciling a
//!   deleting object removes a gone node's finalizer (Warning `NodeGone`),
//!   looking again every `orphan_check` while the node exists; data of a
//!   node that comes back after its Node object was deleted is not removed.
//! - A failed reconcile is retried after a per-object exponential backoff
//!   (1 s doubling to 5 min, no jitter, reset by a success); waiting for
//!   something else is no failure and is looked at again after `retry`.
//! - `spec.failureDeadlineSeconds` stops waiting (it does not interrupt a
//!   shim call in flight); a snapshot the shim already took when a restarted
//!   controller looks again is still recorded Ready.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Resource};

use crate::context::{now, Context, Error};
use crate::crd::{
    OperationError, Phase, PodClone, Rollback, SandboxTemplate, Snapshot, CLONE_LABEL,
    SAFETY_FOR_LABEL,
};
use crate::shim::ShimError;

/// Failure reason of a Snapshot, Clone or Rollback not done by its `spec.failureDeadlineSeconds`.
pub const DEADLINE_EXCEEDED: &str = "DeadlineExceeded";
/// Failure reason of an operation whose pod was recreated under the same name.
pub const POD_REPLACED: &str = "PodReplaced";

/// Failure reasons of a Snapshot or Rollback the shim failed, one per code
/// of twig-proto's error contract (`twig_proto::contract::ErrorCode`);
/// `UNAVAILABLE` and `DEADLINE_EXCEEDED` are retried instead.
pub mod shim_reason {
    /// `ABORTED` on a Rollback: refused, the pod runs on, on its state
    /// before the rollback.
    pub const ROLLBACK_REFUSED: &str = "RollbackRefused";
    /// `ABORTED` on a Snapshot: refused, the pod runs on unchanged.
    pub const SNAPSHOT_REFUSED: &str = "SnapshotRefused";
    /// `DATA_LOSS`: the pod's VM is lost, every container of the pod exited.
    pub const POD_LOST: &str = "PodLost";
    /// `PERMISSION_DENIED`: the snapshot belongs to another namespace.
    pub const FORBIDDEN: &str = "Forbidden";
    /// `RESOURCE_EXHAUSTED`: the node store's filesystem is full.
    pub const NODE_STORE_FULL: &str = "NodeStoreFull";
    /// `FAILED_PRECONDITION`: the pod or snapshot is not in a state for it.
    pub const PRECONDITION_FAILED: &str = "PreconditionFailed";
    /// `INVALID_ARGUMENT`: the shim read the request as malformed.
    pub const INVALID_REQUEST: &str = "InvalidRequest";
    /// `NOT_FOUND`: the shim does not know the sandbox or the snapshot.
    pub const NOT_FOUND: &str = "NotFound";
    /// `ALREADY_EXISTS`: the snapshot id is taken by something else.
    pub const ALREADY_EXISTS: &str = "AlreadyExists";
    /// `UNIMPLEMENTED`: the shim does not serve the call (an older shim).
    pub const UNIMPLEMENTED: &str = "Unimplemented";
    /// `INTERNAL` or anything else.
    pub const SHIM_ERROR: &str = "ShimError";
}

/// What the shim's failure of a Snapshot or Rollback means for the object:
/// its failure reason and message. `op` is `snapshot` or `rollback`.
pub(crate) fn shim_failure(op: ShimOp, err: &ShimError) -> (&'static str, String) {
    use shim_reason::*;
    let verb = match op {
        ShimOp::Snapshot => "snapshot",
        ShimOp::Rollback => "rollback",
    };
    match (err, op) {
        (ShimError::Aborted(m), ShimOp::Rollback) => (
            ROLLBACK_REFUSED,
            format!("the shim refused the rollback; the pod runs on, on its state before the rollback: {m}"),
        ),
        (ShimError::Aborted(m), ShimOp::Snapshot) => (
            SNAPSHOT_REFUSED,
            format!("the shim refused the snapshot; the pod runs on unchanged: {m}"),
        ),
        (ShimError::Lost(m), _) => (
            POD_LOST,
            format!("the pod's VM was lost during the {verb}: every container of the pod exited and its memory is gone: {m}"),
        ),
        (ShimError::Forbidden(m), _) => (
            FORBIDDEN,
            format!("the shim refused the {verb}: the snapshot belongs to another namespace: {m}"),
        ),
        (ShimError::NoSpace(m), _) => (
            NODE_STORE_FULL,
            format!("the node store's filesystem is full; nothing was published: {m}"),
        ),
        (ShimError::Refused(m), _) => (
            PRECONDITION_FAILED,
            format!("the shim refused the {verb}; the pod is unchanged: {m}"),
        ),
        (ShimError::Invalid(m), _) => (
            INVALID_REQUEST,
            format!("the shim read the {verb} request as malformed: {m}"),
        ),
        (ShimError::NotFound(m), _) => (NOT_FOUND, format!("the shim failed the {verb}: {m}")),
        (ShimError::AlreadyExists(m), _) => {
            (ALREADY_EXISTS, format!("the shim failed the {verb}: {m}"))
        }
        (ShimError::Unimplemented(m), _) => (
            UNIMPLEMENTED,
            format!("the pod's shim does not do a {verb}: {m}"),
        ),
        (ShimError::Unavailable { .. } | ShimError::Call { .. }, _) => {
            (SHIM_ERROR, format!("the shim failed the {verb}: {err}"))
        }
    }
}

/// The shim operations whose failures [`shim_failure`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ShimOp {
    /// `Twig.Snapshot`.
    Snapshot,
    /// `Twig.Rollback`.
    Rollback,
}

/// Time left before an object's failure deadline (`seconds` after its
/// creation): `None` without a deadline, `Some(ZERO)` once it has passed.
pub(crate) fn deadline_left(created: Option<&Time>, seconds: Option<i64>) -> Option<Duration> {
    let seconds = seconds?;
    let created_ms = created.map_or_else(
        || Timestamp::now().as_millisecond(),
        |t| t.0.as_millisecond(),
    );
    let left_ms = created_ms
        .saturating_add(seconds.saturating_mul(1000))
        .saturating_sub(Timestamp::now().as_millisecond());
    Some(Duration::from_millis(u64::try_from(left_ms).unwrap_or(0)))
}

/// The action of an object waiting on something else: look again after
/// `retry`, or at its deadline when that comes first.
pub(crate) fn wait(retry: Duration, left: Option<Duration>) -> Action {
    Action::requeue(left.map_or(retry, |l| l.min(retry)))
}

/// The message of a failure deadline that has passed.
pub(crate) fn deadline_message(kind: &str, seconds: Option<i64>, waiting_for: &str) -> String {
    format!(
        "the {kind} was not done within its failureDeadlineSeconds ({} s) after creation; it was waiting for {waiting_for}",
        seconds.unwrap_or_default()
    )
}

/// `status.error` of a failure.
pub(crate) fn operation_error(reason: &str, message: &str) -> OperationError {
    OperationError {
        message: format!("{reason}: {message}"),
        time: now(),
    }
}

/// Writes an object's status with server-side apply, as this node's field
/// manager (forcing: a controller owns what it writes). The whole status is
/// applied, so fields this node wrote before and leaves out now are removed.
/// The apply is pinned to the resourceVersion `obj` was read at: a 409
/// means the object changed since, and it is looked at again.
pub(crate) async fn write_status<K>(
    api: &Api<K>,
    obj: &K,
    status: K::Status,
    ctx: &Context,
) -> Result<K, Error>
where
    K: Resource<DynamicType = ()>
        + kube::core::object::HasStatus
        + Clone
        + Debug
        + serde::Serialize
        + serde::de::DeserializeOwned,
    K::Status: serde::Serialize,
{
    let body = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": {
            "name": obj.meta().name,
            "resourceVersion": obj.meta().resource_version,
        },
        "status": status,
    });
    apply_status(api, obj, body, ctx).await
}

/// Server-side applies `body` (a partial object with `apiVersion`, `kind`,
/// `metadata.name` and `status`) to the status subresource of `obj`.
pub(crate) async fn apply_status<K>(
    api: &Api<K>,
    obj: &K,
    body: serde_json::Value,
    ctx: &Context,
) -> Result<K, Error>
where
    K: Resource + Clone + Debug + serde::de::DeserializeOwned,
{
    let name = obj
        .meta()
        .name
        .clone()
        .ok_or(Error::MissingField("metadata.name"))?;
    let params = PatchParams::apply(&ctx.field_manager).force();
    Ok(api
        .patch_status(&name, &params, &Patch::Apply(body))
        .await?)
}

/// The conditions of a Snapshot, Clone or Rollback in `phase`: `Ready`
/// (True once done), `Progressing` (True while Pending or InProgress) and
/// `Failure` (True once Failed or Lost), each with `reason` and `message`
/// when True, followed by the conditions of other types in `old` as they
/// were (a Snapshot's `Exported`, `DeletionBlocked`). A condition keeps its
/// lastTransitionTime while its status does not change.
pub(crate) fn conditions(
    old: &[Condition],
    phase: Phase,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) -> Vec<Condition> {
    let states = [
        ("Ready", phase == Phase::Ready),
        (
            "Progressing",
            matches!(phase, Phase::Pending | Phase::InProgress),
        ),
        ("Failure", matches!(phase, Phase::Failed | Phase::Lost)),
    ];
    let phase_conditions = states.into_iter().map(|(type_, on)| {
        let status = if on { "True" } else { "False" };
        let previous = old.iter().find(|c| c.type_ == type_);
        let last_transition_time = previous
            .filter(|c| c.status == status)
            .map_or_else(now, |c| c.last_transition_time.clone());
        let (reason, message) = if on {
            (reason.to_string(), message.to_string())
        } else {
            (format!("Not{type_}"), format!("the object is {phase}"))
        };
        Condition {
            type_: type_.to_string(),
            status: status.to_string(),
            reason,
            message,
            last_transition_time,
            observed_generation: generation,
        }
    });
    let others = old
        .iter()
        .filter(|c| !PHASE_CONDITIONS.contains(&c.type_.as_str()))
        .cloned();
    phase_conditions.chain(others).collect()
}

/// The condition types [`conditions`] derives from the phase.
const PHASE_CONDITIONS: [&str; 3] = ["Ready", "Progressing", "Failure"];

/// `old` with the condition `type_` set to `status` (`True`, `False`,
/// `Unknown`) for `reason` and `message`; its lastTransitionTime changes
/// only with its status.
pub(crate) fn set_condition(
    old: &[Condition],
    type_: &str,
    status: &str,
    (reason, message): (&str, &str),
    generation: Option<i64>,
) -> Vec<Condition> {
    let previous = old.iter().find(|c| c.type_ == type_);
    let last_transition_time = previous
        .filter(|c| c.status == status)
        .map_or_else(now, |c| c.last_transition_time.clone());
    let condition = Condition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message: message.to_string(),
        last_transition_time,
        observed_generation: generation,
    };
    let mut conditions: Vec<Condition> = old.iter().filter(|c| c.type_ != type_).cloned().collect();
    conditions.push(condition);
    conditions
}

pub mod clone;
pub mod export;
pub mod network;
pub mod rollback;
pub mod snapshot;
mod store_gc;
mod store_usage;
pub mod template;

/// Checks a Kubernetes object name (DNS subdomain) the way the API server would.
pub(crate) fn validate_name(field: &str, name: &str) -> Result<(), String> {
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    let ok_ends = name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if name.is_empty() || name.len() > 253 || !ok_chars || !ok_ends {
        return Err(format!(
            "{field} {name:?} is not a valid object name (lowercase alphanumerics, '-' and '.', at most 253)"
        ));
    }
    Ok(())
}

/// The pod, if it still exists, is not terminating, and (when `uid` is given) is the same pod.
pub(crate) async fn current_pod(
    pods: &Api<Pod>,
    name: &str,
    uid: Option<&str>,
) -> Result<Option<Pod>, Error> {
    let pod = pods.get_opt(name).await?;
    Ok(pod.filter(|p| {
        p.metadata.deletion_timestamp.is_none()
            && (uid.is_none() || p.metadata.uid.as_deref() == uid)
    }))
}

/// Identifies an object in the backoff table: kind, namespace, name.
fn backoff_key<K: Resource<DynamicType = ()>>(obj: &K) -> String {
    format!(
        "{}/{}/{}",
        K::kind(&()),
        obj.meta().namespace.as_deref().unwrap_or_default(),
        obj.meta().name.as_deref().unwrap_or_default()
    )
}

/// Retries a failed object after its next exponential backoff delay.
fn error_policy<K>(obj: Arc<K>, err: &Error, ctx: Arc<Context>) -> Action
where
    K: Resource<DynamicType = ()>,
{
    let key = backoff_key(obj.as_ref());
    let delay = ctx.backoff.failed(&key);
    tracing::warn!(object = %key, error = %err, retry_in = ?delay, "reconcile failed; retrying");
    Action::requeue(delay)
}

/// Runs `reconcile` and resets the object's backoff when it succeeds.
async fn reset_on_success<K, Fut>(
    reconcile: fn(Arc<K>, Arc<Context>) -> Fut,
    obj: Arc<K>,
    ctx: Arc<Context>,
) -> Result<Action, Error>
where
    K: Resource<DynamicType = ()>,
    Fut: std::future::Future<Output = Result<Action, Error>>,
{
    let key = backoff_key(obj.as_ref());
    let result = reconcile(obj, ctx.clone()).await;
    if result.is_ok() {
        ctx.backoff.succeeded(&key);
    }
    result
}

async fn drain<T: Debug, E: std::error::Error>(stream: impl futures::Stream<Item = Result<T, E>>) {
    stream
        .for_each(|result| async move {
            match result {
                Ok(obj) => tracing::debug!(?obj, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile loop"),
            }
        })
        .await;
}

/// Runs the five controllers until the future is dropped.
pub async fn run(ctx: Arc<Context>) {
    let client = ctx.client.clone();
    let snapshots = Controller::new(
        Api::<Snapshot>::all(client.clone()),
        watcher::Config::default(),
    )
    .run(
        |o, c| reset_on_success(snapshot::reconcile, o, c),
        error_policy,
        ctx.clone(),
    );
    let rollbacks = Controller::new(
        Api::<Rollback>::all(client.clone()),
        watcher::Config::default(),
    )
    .watches(
        Api::<Snapshot>::all(client.clone()),
        watcher::Config::default().labels(SAFETY_FOR_LABEL),
        rollback::of_safety_snapshot,
    )
    .run(
        |o, c| reset_on_success(rollback::reconcile, o, c),
        error_policy,
        ctx.clone(),
    );
    let clones = Controller::new(
        Api::<PodClone>::all(client.clone()),
        watcher::Config::default(),
    )
    .owns(
        Api::<Snapshot>::all(client.clone()),
        watcher::Config::default(),
    )
    .owns(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default().labels(CLONE_LABEL),
    )
    .run(
        |o, c| reset_on_success(clone::reconcile, o, c),
        error_policy,
        ctx.clone(),
    );
    let templates = Controller::new(
        Api::<SandboxTemplate>::all(client),
        watcher::Config::default(),
    )
    .run(
        |o, c| reset_on_success(template::reconcile, o, c),
        error_policy,
        ctx.clone(),
    );
    tokio::join!(
        drain(snapshots),
        drain(rollbacks),
        drain(clones),
        drain(templates),
        network::run(ctx.clone()),
        store_usage::run(ctx.clone()),
        store_gc::run(ctx.clone())
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{CloneSource, CloneSpec, SandboxTemplateSpec, SnapshotSpec};

    fn clone(source: CloneSource, replicas: i32, prefix: Option<&str>) -> PodClone {
        PodClone::new(
            "c",
            CloneSpec {
                source,
                replicas,
                name_prefix: prefix.map(String::from),
                labels: None,
                failure_deadline_seconds: None,
            },
        )
    }

    #[test]
    fn names_are_checked_like_the_api_server_does() {
        assert_eq!(validate_name("f", "redis-0.a"), Ok(()));
        for bad in ["", "Redis", "-a", "a-", "a_b", &"a".repeat(254)] {
            let err = validate_name("spec.podName", bad).expect_err(bad);
            assert!(err.starts_with("spec.podName "), "{err}");
        }
    }

    #[test]
    fn clone_specs_need_exactly_one_source_and_sane_replicas() {
        let snap = CloneSource {
            snapshot_name: Some("s".into()),
            pod_name: None,
        };
        assert_eq!(
            clone::validate(&clone(snap.clone(), 8, Some("fork"))),
            Ok(())
        );
        let both = CloneSource {
            snapshot_name: Some("s".into()),
            pod_name: Some("p".into()),
        };
        assert!(clone::validate(&clone(both, 1, None)).is_err_and(|e| e.contains("exactly one")));
        assert!(clone::validate(&clone(CloneSource::default(), 1, None))
            .is_err_and(|e| e.contains("exactly one")));
        assert!(clone::validate(&clone(snap.clone(), 0, None))
            .is_err_and(|e| e.contains("between 1 and 1000")));
        assert_eq!(clone::validate(&clone(snap.clone(), 256, None)), Ok(()));
        assert_eq!(clone::validate(&clone(snap.clone(), 1000, None)), Ok(()));
        assert!(clone::validate(&clone(snap.clone(), 1001, None))
            .is_err_and(|e| e.contains("between 1 and 1000")));
        assert!(
            clone::validate(&clone(snap, 2, Some("a.b"))).is_err_and(|e| e.contains("DNS label"))
        );
    }

    #[test]
    fn snapshot_and_template_specs_are_checked() {
        let mut snap = Snapshot::new(
            "s",
            SnapshotSpec {
                pod_name: "redis".into(),
                pod_uid: None,
                mode: Default::default(),
                deletion_policy: Default::default(),
                ttl_seconds_after_ready: Some(-1),
                failure_deadline_seconds: None,
                export: false,
            },
        );
        assert!(snapshot::validate(&snap).is_err_and(|e| e.contains("ttlSecondsAfterReady")));
        snap.spec.ttl_seconds_after_ready = Some(0);
        assert_eq!(snapshot::validate(&snap), Ok(()));
        snap.spec.failure_deadline_seconds = Some(0);
        assert!(snapshot::validate(&snap).is_err_and(|e| e.contains("failureDeadlineSeconds")));
        snap.spec.failure_deadline_seconds = Some(30);
        assert_eq!(snapshot::validate(&snap), Ok(()));
        let mut template = SandboxTemplate::new(
            "t",
            SandboxTemplateSpec {
                image: "python:3".into(),
                vcpus: 2,
                memory_mib: 32,
                command: None,
                warmup: None,
                egress_policy: None,
            },
        );
        // twig-vmm's bounds: a multiple of 2 MiB from 16 MiB to 3 GiB.
        for bad in [0, 8, 14, 33, 3074, 4096, 262_144] {
            template.spec.memory_mib = bad;
            let err = template::validate(&template).expect_err("out of bounds");
            assert!(
                err.contains(&format!("spec.memoryMiB {bad} is not accepted by twig-vmm"))
                    && err.contains("multiple of 2 MiB from 16 to 3072 MiB"),
                "{err}"
            );
        }
        for good in [16, 32, 512, 3072] {
            template.spec.memory_mib = good;
            assert_eq!(template::validate(&template), Ok(()));
        }
    }
}
