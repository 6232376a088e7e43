//! twig-proto's error contract on the controller's side: every code the
//! shim answers keeps its meaning through the ttrpc client, and a Snapshot
//! or Rollback the shim failed says which, with a reason of its own
//! (`RollbackRefused`: the pod runs on, on its old state; `PodLost`: its VM
//! is gone); `UNAVAILABLE` and `DEADLINE_EXCEEDED` are retried. And the
//! rollback rule shared with the shim: a clone never rolls back to the
//! snapshot it was restored from.

use twig_controller_testkit as support;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Client;
use twig_controller::crd::{Phase, Rollback, RollbackSpec, Snapshot, RESTORE_FROM_ANNOTATION};
use twig_controller::shim::{ErrorCode, Sandbox, ShimError, TtrpcShim, TwigShim};
use twig_proto::{twig as pb, twig_ttrpc as rpc};

use support::fake::FakeNode;
use support::{api_server, running_pod, running_pod_with, snapshot, snapshot_in, start_controller};

/// A shim whose Rollback answers the code numbered by the snapshot id.
struct Answering;

#[async_trait]
impl rpc::Twig for Answering {
    async fn rollback(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        req: pb::RollbackRequest,
    ) -> ttrpc::Result<pb::RollbackResponse> {
        let number: i32 = req.snapshot_id.parse().unwrap_or_default();
        match ErrorCode::from_number(number) {
            Some(code) => Err(code.status(format!("answered {code:?}"))),
            None => Ok(pb::RollbackResponse::default()),
        }
    }
}

#[tokio::test]
async fn every_code_of_the_contract_keeps_its_meaning_through_the_client() {
    let dir = tempfile::tempdir().expect("tempdir");
    let address = format!("unix://{}", dir.path().join("shim.sock").display());
    let mut server = ttrpc::r#async::Server::new()
        .bind(&address)
        .expect("bind ttrpc")
        .register_service(rpc::create_twig(Arc::new(Answering)));
    server.start().await.expect("start ttrpc");
    let shim = TtrpcShim {
        timeout: Duration::from_secs(10),
    };
    let sandbox = Sandbox {
        id: "sb-1".into(),
        address: address.clone(),
    };
    for code in ErrorCode::ALL {
        let err = shim
            .rollback(&sandbox, &code.number().to_string(), "op")
            .await
            .expect_err("every code is an error");
        let message = format!("answered {code:?}");
        let kept = match (code, &err) {
            (ErrorCode::InvalidArgument, ShimError::Invalid(m))
            | (ErrorCode::NotFound, ShimError::NotFound(m))
            | (ErrorCode::AlreadyExists, ShimError::AlreadyExists(m))
            | (ErrorCode::PermissionDenied, ShimError::Forbidden(m))
            | (ErrorCode::ResourceExhausted, ShimError::NoSpace(m))
            | (ErrorCode::FailedPrecondition, ShimError::Refused(m))
            | (ErrorCode::Aborted, ShimError::Aborted(m))
            | (ErrorCode::Unimplemented, ShimError::Unimplemented(m))
            | (ErrorCode::DataLoss, ShimError::Lost(m))
            | (ErrorCode::Internal, ShimError::Call { message: m, .. })
            | (
                ErrorCode::Unavailable | ErrorCode::DeadlineExceeded,
                ShimError::Unavailable { message: m, .. },
            ) => *m == message,
            _ => false,
        };
        assert!(kept, "{code:?} came through as {err:?}");
    }
    // A code outside the contract reads as INTERNAL.
    let err = shim
        .rollback(&sandbox, "11", "op")
        .await
        .expect_err("OUT_OF_RANGE");
    assert!(matches!(err, ShimError::Call { .. }), "{err:?}");
    shim.rollback(&sandbox, "0", "op").await.expect("OK");
    server.shutdown().await.expect("shutdown");
}

fn rollback(name: &str, pod: &str, snap: &str) -> Rollback {
    Rollback::new(
        name,
        RollbackSpec {
            pod_name: pod.to_string(),
            snapshot_name: snap.to_string(),
            pod_uid: None,
            safety_snapshot: false,
            failure_deadline_seconds: None,
        },
    )
}

async fn rollback_in(client: &Client, name: &str, phase: Phase) -> Rollback {
    support::wait_for(client, name, &format!("{phase}"), |r: &Rollback| {
        r.status.as_ref().is_some_and(|st| st.phase == phase)
    })
    .await
}

/// The reason and message of the True `Failure` condition.
fn failure(conditions: &[Condition]) -> (String, String) {
    conditions
        .iter()
        .find(|c| c.type_ == "Failure" && c.status == "True")
        .map(|c| (c.reason.clone(), c.message.clone()))
        .unwrap_or_default()
}

/// Each code that fails an operation, with the reason the object gets.
const FAILING: [(ErrorCode, &str, &str); 10] = [
    (ErrorCode::Aborted, "RollbackRefused", "SnapshotRefused"),
    (ErrorCode::DataLoss, "PodLost", "PodLost"),
    (ErrorCode::PermissionDenied, "Forbidden", "Forbidden"),
    (
        ErrorCode::ResourceExhausted,
        "NodeStoreFull",
        "NodeStoreFull",
    ),
    (
        ErrorCode::FailedPrecondition,
        "PreconditionFailed",
        "PreconditionFailed",
    ),
    (
        ErrorCode::InvalidArgument,
        "InvalidRequest",
        "InvalidRequest",
    ),
    (ErrorCode::NotFound, "NotFound", "NotFound"),
    (ErrorCode::AlreadyExists, "AlreadyExists", "AlreadyExists"),
    (ErrorCode::Unimplemented, "Unimplemented", "Unimplemented"),
    (ErrorCode::Internal, "ShimError", "ShimError"),
];

#[tokio::test]
async fn each_code_failing_a_rollback_has_its_own_reason() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "agent", "node-a").await;
    support::create(&client, &snapshot("base", "agent")).await;
    snapshot_in(&client, "base", Phase::Ready).await;

    for (i, (code, reason, _)) in FAILING.into_iter().enumerate() {
        fake.answer_rollbacks(&[code]);
        let name = format!("rb-{i}");
        support::create(&client, &rollback(&name, "agent", "base")).await;
        let failed = rollback_in(&client, &name, Phase::Failed).await;
        let status = failed.status.expect("status");
        let (got, message) = failure(&status.conditions);
        assert_eq!(got, reason, "{code:?}: {message}");
        let error = status.error.expect("status.error");
        assert!(
            error.message.starts_with(&format!("{reason}: ")),
            "{}",
            error.message
        );
        match code {
            ErrorCode::Aborted => assert!(
                message.contains("the pod runs on, on its state before the rollback"),
                "{message}"
            ),
            ErrorCode::DataLoss => assert!(
                message.contains("every container of the pod exited"),
                "{message}"
            ),
            _ => {}
        }
    }
    let reasons: std::collections::BTreeSet<_> = FAILING.iter().map(|(_, r, _)| r).collect();
    assert_eq!(reasons.len(), FAILING.len(), "one reason per code");
}

#[tokio::test]
async fn each_code_failing_a_snapshot_has_its_own_reason() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "agent", "node-a").await;

    for (i, (code, _, reason)) in FAILING.into_iter().enumerate() {
        fake.answer_snapshots(&[code]);
        let name = format!("snap-{i}");
        support::create(&client, &snapshot(&name, "agent")).await;
        let failed: Snapshot = snapshot_in(&client, &name, Phase::Failed).await;
        let status = failed.status.expect("status");
        let (got, message) = failure(&status.conditions);
        assert_eq!(got, reason, "{code:?}: {message}");
        assert!(!status.ready_to_use);
    }
}

#[tokio::test]
async fn a_busy_or_late_shim_is_asked_again() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "agent", "node-a").await;
    fake.answer_snapshots(&[ErrorCode::Unavailable, ErrorCode::DeadlineExceeded]);
    support::create(&client, &snapshot("base", "agent")).await;
    snapshot_in(&client, "base", Phase::Ready).await;
    assert_eq!(fake.snapshot_calls(), 3);

    fake.answer_rollbacks(&[ErrorCode::DeadlineExceeded, ErrorCode::Unavailable]);
    support::create(&client, &rollback("later", "agent", "base")).await;
    rollback_in(&client, "later", Phase::Ready).await;
    assert_eq!(fake.rollback_calls(), 3);
}

#[tokio::test]
async fn a_clone_never_rolls_back_to_the_snapshot_it_was_restored_from() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "source", "node-a").await;
    support::create(&client, &snapshot("origin", "source")).await;
    let origin = snapshot_in(&client, "origin", Phase::Ready).await;
    let id = origin.status.and_then(|s| s.snapshot_id).expect("id");
    running_pod_with(
        &client,
        "fork-0",
        "node-a",
        true,
        &[(RESTORE_FROM_ANNOTATION, id)],
    )
    .await;

    // The shim would refuse it (a snapshot of another sandbox): the
    // controller refuses it first, saying why.
    support::create(&client, &rollback("reset", "fork-0", "origin")).await;
    let failed = rollback_in(&client, "reset", Phase::Failed).await;
    let (reason, message) = failure(&failed.status.map(|s| s.conditions).unwrap_or_default());
    assert_eq!(reason, "NotInLineage", "{message}");
    assert!(
        message.contains("a clone never rolls back to the snapshot it was restored from"),
        "{message}"
    );
    assert_eq!(fake.rollback_calls(), 0);

    // Its own snapshot is its lineage.
    support::create(&client, &snapshot("own", "fork-0")).await;
    snapshot_in(&client, "own", Phase::Ready).await;
    support::create(&client, &rollback("rewind", "fork-0", "own")).await;
    let done = rollback_in(&client, "rewind", Phase::Ready).await;
    assert!(done.status.and_then(|s| s.pod_uid).is_some());
    assert_eq!(fake.rollback_calls(), 1);
}
