//! API conventions and lifecycle: `readyToUse`, `error`, the parent's name,
//! failure deadlines of Snapshots and Rollbacks, and a parent Snapshot
//! kept (with its node-side data) while a child builds on it.

use twig_controller_testkit as support;

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use kube::{Api, ResourceExt};
use twig_controller::crd::{DeletionPolicy, Phase, Rollback, RollbackSpec, Snapshot};
use twig_controller::reconcile::snapshot::DELETION_BLOCKED;

use support::fake::{Call, FakeNode};
use support::{api_server, event_reasons, eventually, running_pod, start_controller, wait_for, NS};
use support::{snapshot, snapshot_in};

fn reason_of<'a>(
    conditions: impl IntoIterator<Item = &'a Condition>,
    type_: &str,
) -> Option<String> {
    conditions
        .into_iter()
        .find(|c| c.type_ == type_ && c.status == "True")
        .map(|c| c.reason.clone())
}

/// The `DeletionBlocked` condition of the deleting Snapshot `name`, once
/// it has one.
async fn deletion_blocked(client: &kube::Client, name: &str) -> Condition {
    let held = wait_for(client, name, "its deletion held", |s: &Snapshot| {
        reason_of(
            s.status.iter().flat_map(|st| &st.conditions),
            DELETION_BLOCKED,
        )
        .is_some()
    })
    .await;
    assert!(held.metadata.deletion_timestamp.is_some());
    held.status
        .into_iter()
        .flat_map(|s| s.conditions)
        .find(|c| c.type_ == DELETION_BLOCKED)
        .expect("condition")
}

#[tokio::test]
async fn snapshots_say_ready_to_use_their_parent_and_their_error() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &snapshot("first", "redis")).await;
    let first = snapshot_in(&client, "first", Phase::Ready).await;
    let status = first.status.expect("status");
    assert!(status.ready_to_use);
    assert_eq!(status.parent_snapshot_name, None);
    assert_eq!(status.error, None);

    support::create(&client, &snapshot("second", "redis")).await;
    let second = snapshot_in(&client, "second", Phase::Ready).await;
    assert_eq!(
        second
            .status
            .and_then(|s| s.parent_snapshot_name)
            .as_deref(),
        Some("first")
    );

    support::create(&client, &snapshot("nobody", "missing")).await;
    let failed = snapshot_in(&client, "nobody", Phase::Failed).await;
    let status = failed.status.expect("status");
    assert!(!status.ready_to_use);
    let error = status.error.expect("status.error");
    assert_eq!(error.message, "PodNotFound: pod missing not found");
    assert_eq!(status.message.as_deref(), Some("pod missing not found"));

    // A lost snapshot is no longer ready to use.
    fake.lose(&first.metadata.uid.clone().expect("uid"));
    let lost = snapshot_in(&client, "first", Phase::Lost).await;
    let status = lost.status.expect("status");
    assert!(!status.ready_to_use);
    assert!(status
        .error
        .is_some_and(|e| e.message.starts_with("Lost: ")));
}

#[tokio::test]
async fn snapshots_and_rollbacks_fail_at_their_deadline() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);

    // A pod the scheduler never places.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let unscheduled = Pod {
        metadata: ObjectMeta {
            name: Some("pending".to_string()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            runtime_class_name: Some("twig".to_string()),
            containers: vec![Container {
                name: "app".to_string(),
                image: Some("redis:7".to_string()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    };
    pods.create(&PostParams::default(), &unscheduled)
        .await
        .expect("create pod");
    let mut snap = snapshot("never", "pending");
    snap.spec.failure_deadline_seconds = Some(1);
    support::create(&client, &snap).await;
    let failed = snapshot_in(&client, "never", Phase::Failed).await;
    let status = failed.status.expect("status");
    assert_eq!(
        reason_of(&status.conditions, "Failure").as_deref(),
        Some("DeadlineExceeded")
    );
    assert!(
        status
            .message
            .as_deref()
            .is_some_and(|m| m.contains("waiting for pod pending to be scheduled")),
        "{status:?}"
    );

    // A snapshot whose node keeps failing (the pod's sandbox cannot be found):
    // retried with backoff until the deadline, then failed with the last error.
    let lost = running_pod(&client, "no-sandbox", "node-a").await;
    fake.kill_sandbox(&lost.uid().expect("uid"));
    let mut snap = snapshot("retried", "no-sandbox");
    snap.spec.failure_deadline_seconds = Some(1);
    support::create(&client, &snap).await;
    let failed = snapshot_in(&client, "retried", Phase::Failed).await;
    let status = failed.status.expect("status");
    assert_eq!(
        reason_of(&status.conditions, "Failure").as_deref(),
        Some("DeadlineExceeded")
    );
    let message = status.message.unwrap_or_default();
    assert!(
        message.contains("waiting for a retry (last error: ")
            && message.contains("finding the pod's sandbox"),
        "{message}"
    );

    // A Rollback waiting on a snapshot that does not finish in time.
    running_pod(&client, "redis", "node-a").await;
    fake.hold_snapshots(true);
    support::create(&client, &snapshot("slow", "redis")).await;
    snapshot_in(&client, "slow", Phase::InProgress).await;
    let rb = Rollback::new(
        "late",
        RollbackSpec {
            pod_name: "redis".to_string(),
            snapshot_name: "slow".to_string(),
            pod_uid: None,
            safety_snapshot: true,
            failure_deadline_seconds: Some(1),
        },
    );
    support::create(&client, &rb).await;
    let late = wait_for(&client, "late", "Failed", |r: &Rollback| {
        r.status.as_ref().is_some_and(|s| s.phase == Phase::Failed)
    })
    .await;
    let status = late.status.expect("status");
    assert_eq!(
        reason_of(&status.conditions, "Failure").as_deref(),
        Some("DeadlineExceeded")
    );
    assert!(status
        .error
        .is_some_and(|e| e.message.contains("waiting for snapshot slow to be Ready")));
    fake.hold_snapshots(false);
    snapshot_in(&client, "slow", Phase::Ready).await;
    assert_eq!(fake.rollback_calls(), 0);
    assert!(event_reasons(&client, "late")
        .await
        .contains(&"DeadlineExceeded".to_string()));
}

#[tokio::test]
async fn a_parent_snapshot_is_kept_while_a_child_builds_on_it() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &snapshot("parent", "redis")).await;
    let parent = snapshot_in(&client, "parent", Phase::Ready).await;
    support::create(&client, &snapshot("child", "redis")).await;
    let child = snapshot_in(&client, "child", Phase::Ready).await;
    let (parent_id, child_id) = (parent.uid().expect("uid"), child.uid().expect("uid"));
    assert_eq!(
        child.status.as_ref().and_then(|s| s.parent.clone()),
        Some(parent_id.clone())
    );

    let api: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    api.delete("parent", &DeleteParams::default())
        .await
        .expect("delete parent");
    let condition = deletion_blocked(&client, "parent").await;
    assert_eq!(condition.reason, "ChildSnapshotsExist");
    assert!(condition
        .message
        .contains("snapshots child of namespace default"));
    eventually("a DeletionBlocked Event", || async {
        event_reasons(&client, "parent")
            .await
            .contains(&"DeletionBlocked".to_string())
            .then_some(())
    })
    .await;
    assert!(fake.stored(&parent_id), "the parent's data stays");
    assert!(!fake
        .calls()
        .contains(&Call::DeleteSnapshot(parent_id.clone())));

    // Once the child is gone, the parent goes, in that order.
    api.delete("child", &DeleteParams::default())
        .await
        .expect("delete child");
    support::wait_gone::<Snapshot>(&client, "parent").await;
    let calls = fake.calls();
    let at = |id: &str| {
        calls
            .iter()
            .position(|c| *c == Call::DeleteSnapshot(id.to_string()))
    };
    assert!(
        matches!((at(&child_id), at(&parent_id)), (Some(c), Some(p)) if c < p),
        "{calls:?}"
    );
    assert!(!fake.stored(&parent_id) && !fake.stored(&child_id));
    let reasons = event_reasons(&client, "parent").await;
    assert_eq!(
        reasons
            .iter()
            .filter(|r| r.as_str() == "DeletionBlocked")
            .count(),
        1,
        "said once: {reasons:?}"
    );
}

/// A child deleted with policy Retain leaves its incremental data in the
/// node store, and that data needs its parent's: the node refuses to
/// delete the parent's, and the deleting parent says so (DeletionBlocked,
/// NodeKeepsData) and keeps its finalizer until the retained data goes.
#[tokio::test]
async fn a_parent_is_kept_while_a_retained_childs_data_needs_it() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &snapshot("parent", "redis")).await;
    let parent = snapshot_in(&client, "parent", Phase::Ready).await;
    let mut child = snapshot("child", "redis");
    child.spec.deletion_policy = DeletionPolicy::Retain;
    support::create(&client, &child).await;
    let child = snapshot_in(&client, "child", Phase::Ready).await;
    let (parent_id, child_id) = (parent.uid().expect("uid"), child.uid().expect("uid"));

    let api: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    api.delete("child", &DeleteParams::default())
        .await
        .expect("delete child");
    support::wait_gone::<Snapshot>(&client, "child").await;
    assert!(fake.stored(&child_id), "Retain keeps the child's data");

    api.delete("parent", &DeleteParams::default())
        .await
        .expect("delete parent");
    let condition = deletion_blocked(&client, "parent").await;
    assert_eq!(condition.reason, "NodeKeepsData");
    assert!(
        condition.message.contains(&child_id) && condition.message.contains("is its child"),
        "{}",
        condition.message
    );
    assert!(fake.stored(&parent_id), "the parent's data stays");

    // An operator removes the retained data from the node: the parent goes.
    fake.lose(&child_id);
    support::wait_gone::<Snapshot>(&client, "parent").await;
    assert!(!fake.stored(&parent_id));
    let reasons = event_reasons(&client, "parent").await;
    assert_eq!(
        reasons
            .iter()
            .filter(|r| r.as_str() == "DeletionBlocked")
            .count(),
        1,
        "said once: {reasons:?}"
    );
}
