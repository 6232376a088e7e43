//! A Rollback that can be undone: the safety Snapshot it takes first (on
//! by default), in the order of the shim's calls, named in its status,
//! outliving the Rollback and usable to rewind the rewind; the opt-out; a
//! failed safety snapshot stopping the rollback; a recreated pod refused.

use twig_controller_testkit as support;

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::api::DeleteParams;
use kube::{Api, Client, ResourceExt};
use twig_controller::crd::{Phase, Rollback, RollbackSpec, Snapshot, SAFETY_FOR_LABEL};

use support::fake::{Call, FakeNode};
use support::{api_server, expect_reasons, running_pod, start_controller, wait_for, NS};
use support::{snapshot, snapshot_in};

fn rollback(name: &str, pod: &str, snap: &str, safety: bool) -> Rollback {
    Rollback::new(
        name,
        RollbackSpec {
            pod_name: pod.to_string(),
            snapshot_name: snap.to_string(),
            pod_uid: None,
            safety_snapshot: safety,
            failure_deadline_seconds: None,
        },
    )
}

async fn rollback_in(client: &Client, name: &str, phase: Phase) -> Rollback {
    wait_for(client, name, &format!("{phase}"), |r: &Rollback| {
        r.status.as_ref().is_some_and(|st| st.phase == phase)
    })
    .await
}

fn failure_reason(rb: &Rollback) -> String {
    rb.status
        .iter()
        .flat_map(|s| &s.conditions)
        .find(|c| c.type_ == "Failure" && c.status == "True")
        .map(|c| c.reason.clone())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_rollback_first_takes_a_safety_snapshot_that_outlives_it_and_can_be_rolled_back_to() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    let pod = running_pod(&client, "agent", "node-a").await;
    let base = support::create(&client, &snapshot("base", "agent")).await;
    snapshot_in(&client, "base", Phase::Ready).await;

    let rb = support::create(&client, &rollback("rewind", "agent", "base", true)).await;
    let done = rollback_in(&client, "rewind", Phase::Ready).await;
    let status = done.status.expect("status");
    assert_eq!(
        status.safety_snapshot_name.as_deref(),
        Some("rewind-safety")
    );
    assert_eq!(status.pod_uid, pod.uid());
    assert_eq!(status.node_name.as_deref(), Some("node-a"));

    let safety = snapshot_in(&client, "rewind-safety", Phase::Ready).await;
    assert_eq!(safety.spec.pod_name, "agent");
    assert_eq!(safety.spec.pod_uid, pod.uid(), "the pod's UID is pinned");
    assert_eq!(
        safety.labels().get(SAFETY_FOR_LABEL).map(String::as_str),
        Some("rewind")
    );
    assert!(
        safety.owner_references().is_empty(),
        "not garbage-collected with the Rollback"
    );

    // The shim saw the safety snapshot before the rollback, to the base snapshot.
    let sandbox = format!("sb-{}", pod.uid().expect("uid"));
    let calls = fake.calls();
    let snapshot_at = calls.iter().position(|c| {
        *c == Call::Snapshot {
            sandbox: sandbox.clone(),
            snapshot_id: safety.uid().expect("uid"),
        }
    });
    let rollback_at = calls.iter().position(|c| {
        *c == Call::Rollback {
            sandbox: sandbox.clone(),
            snapshot_id: base.uid().expect("uid"),
            operation_id: rb.uid().expect("uid"),
        }
    });
    assert!(
        matches!((snapshot_at, rollback_at), (Some(s), Some(r)) if s < r),
        "{calls:?}"
    );
    expect_reasons(
        &client,
        "rewind",
        &["Started", "SafetySnapshotRequested", "RolledBack"],
    )
    .await;

    // The Rollback goes; its safety snapshot stays, and rewinds the rewind.
    let rollbacks: Api<Rollback> = Api::namespaced(client.clone(), NS);
    rollbacks
        .delete("rewind", &DeleteParams::default())
        .await
        .expect("delete rollback");
    support::wait_gone::<Rollback>(&client, "rewind").await;
    let kept = snapshot_in(&client, "rewind-safety", Phase::Ready).await;
    assert!(kept.metadata.deletion_timestamp.is_none());
    let undo = support::create(&client, &rollback("undo", "agent", "rewind-safety", false)).await;
    rollback_in(&client, "undo", Phase::Ready).await;
    assert!(fake.calls().contains(&Call::Rollback {
        sandbox,
        snapshot_id: kept.uid().expect("uid"),
        operation_id: undo.uid().expect("uid"),
    }));
}

#[tokio::test]
async fn safety_snapshot_false_rolls_back_without_one() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "agent", "node-a").await;
    support::create(&client, &snapshot("base", "agent")).await;
    snapshot_in(&client, "base", Phase::Ready).await;

    support::create(&client, &rollback("quick", "agent", "base", false)).await;
    let done = rollback_in(&client, "quick", Phase::Ready).await;
    assert_eq!(done.status.and_then(|s| s.safety_snapshot_name), None);
    assert_eq!(fake.snapshot_calls(), 1, "only the base snapshot");
    let snapshots: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    assert!(snapshots
        .get_opt("quick-safety")
        .await
        .expect("get")
        .is_none());
    expect_reasons(&client, "quick", &["Started", "RolledBack"]).await;
}

#[tokio::test]
async fn a_failed_safety_snapshot_leaves_the_pod_alone() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "agent", "node-a").await;
    support::create(&client, &snapshot("base", "agent")).await;
    snapshot_in(&client, "base", Phase::Ready).await;

    fake.fail_snapshots(1);
    support::create(&client, &rollback("risky", "agent", "base", true)).await;
    let failed = rollback_in(&client, "risky", Phase::Failed).await;
    assert_eq!(failure_reason(&failed), "SafetySnapshotFailed");
    let status = failed.status.clone().expect("status");
    let error = status.error.expect("status.error");
    assert!(
        error
            .message
            .starts_with("SafetySnapshotFailed: safety snapshot risky-safety is Failed")
            && error.message.contains("the guest did not pause"),
        "{}",
        error.message
    );
    assert_eq!(status.message.as_deref(), Some(error.message.as_str()));
    assert_eq!(
        fake.rollback_calls(),
        0,
        "no rollback without its safety net"
    );
    snapshot_in(&client, "risky-safety", Phase::Failed).await;
}

#[tokio::test]
async fn a_pod_recreated_under_the_same_name_is_refused() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    let old = running_pod(&client, "agent", "node-a").await;
    support::create(&client, &snapshot("base", "agent")).await;
    snapshot_in(&client, "base", Phase::Ready).await;

    // The pod is deleted and a new one made under its name.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.delete("agent", &DeleteParams::default())
        .await
        .expect("delete pod");
    support::wait_gone::<Pod>(&client, "agent").await;
    let new = running_pod(&client, "agent", "node-a").await;
    assert_ne!(old.uid(), new.uid());

    // Objects that name the old pod's UID do not touch the new pod.
    let mut rb = rollback("to-old", "agent", "base", true);
    rb.spec.pod_uid = old.uid();
    support::create(&client, &rb).await;
    let failed = rollback_in(&client, "to-old", Phase::Failed).await;
    assert_eq!(failure_reason(&failed), "PodReplaced");
    let message = failed.status.and_then(|s| s.message).unwrap_or_default();
    assert!(
        message.contains("recreated under the same name")
            && message.contains(&new.uid().unwrap_or_default()),
        "{message}"
    );
    let mut snap = snapshot("of-old", "agent");
    snap.spec.pod_uid = old.uid();
    support::create(&client, &snap).await;
    let refused = snapshot_in(&client, "of-old", Phase::Failed).await;
    let reason = refused
        .status
        .iter()
        .flat_map(|s| &s.conditions)
        .find(|c| c.type_ == "Failure")
        .map(|c| c.reason.clone());
    assert_eq!(reason.as_deref(), Some("PodReplaced"));
    assert_eq!(fake.rollback_calls(), 0);
    assert_eq!(fake.snapshot_calls(), 1, "only the base snapshot");

    // The old pod's snapshot is not in the new pod's lineage either.
    support::create(&client, &rollback("plain", "agent", "base", false)).await;
    let failed = rollback_in(&client, "plain", Phase::Failed).await;
    assert_eq!(failure_reason(&failed), "NotInLineage");
}
