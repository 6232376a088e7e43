//! The four reconcilers and the loop that runs them.

use std::fmt::Debug;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use kube::{Api, Resource};

use crate::context::{Context, Error};
use crate::crd::{PodClone, Rollback, SandboxTemplate, Snapshot, CLONE_LABEL};

/// Replaces an object's status through the status subresource (409 when the
/// object changed since it was read).
pub(crate) async fn write_status<K>(api: &Api<K>, obj: &K, status: K::Status) -> Result<K, Error>
where
    K: Resource
        + kube::core::object::HasStatus
        + Clone
        + Debug
        + serde::Serialize
        + serde::de::DeserializeOwned,
{
    let mut new = obj.clone();
    *new.status_mut() = Some(status);
    Ok(api
        .replace_status(
            &kube::ResourceExt::name_any(obj),
            &kube::api::PostParams::default(),
            &new,
        )
        .await?)
}

pub mod clone;
pub mod rollback;
pub mod snapshot;
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

fn error_policy<K>(obj: Arc<K>, err: &Error, ctx: Arc<Context>) -> Action
where
    K: Resource<DynamicType = ()>,
{
    tracing::warn!(kind = %K::kind(&()), name = ?obj.meta().name, error = %err, "reconcile failed; retrying");
    Action::requeue(ctx.retry)
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

/// Runs the four controllers until the future is dropped.
pub async fn run(ctx: Arc<Context>) {
    let client = ctx.client.clone();
    let snapshots = Controller::new(
        Api::<Snapshot>::all(client.clone()),
        watcher::Config::default(),
    )
    .run(snapshot::reconcile, error_policy, ctx.clone());
    let rollbacks = Controller::new(
        Api::<Rollback>::all(client.clone()),
        watcher::Config::default(),
    )
    .run(rollback::reconcile, error_policy, ctx.clone());
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
    .run(clone::reconcile, error_policy, ctx.clone());
    let templates = Controller::new(
        Api::<SandboxTemplate>::all(client),
        watcher::Config::default(),
    )
    .run(template::reconcile, error_policy, ctx.clone());
    tokio::join!(
        drain(snapshots),
        drain(rollbacks),
        drain(clones),
        drain(templates)
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
            .is_err_and(|e| e.contains("between 1 and 100")));
        assert!(clone::validate(&clone(snap.clone(), 101, None))
            .is_err_and(|e| e.contains("between 1 and 100")));
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
                mode: Default::default(),
                deletion_policy: Default::default(),
                ttl_seconds_after_ready: Some(-1),
            },
        );
        assert!(snapshot::validate(&snap).is_err_and(|e| e.contains("ttlSecondsAfterReady")));
        snap.spec.ttl_seconds_after_ready = Some(0);
        assert_eq!(snapshot::validate(&snap), Ok(()));
        let mut template = SandboxTemplate::new(
            "t",
            SandboxTemplateSpec {
                image: "python:3".into(),
                vcpus: 2,
                memory_mib: 32,
                command: None,
                warmup: None,
            },
        );
        assert!(template::validate(&template).is_err_and(|e| e.contains("memoryMiB")));
        template.spec.memory_mib = 512;
        assert_eq!(template::validate(&template), Ok(()));
    }
}
