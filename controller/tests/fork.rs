//! Fork: a Clone of 256 replicas against the test API server and the fake
//! node, with per-replica status; a Clone not Ready by its failure deadline.

use twig_controller_testkit as support;

use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateWaiting, ContainerStatus, Pod, PodStatus,
};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use twig_controller::crd::{
    CloneSource, CloneSpec, Phase, PodClone, Snapshot, EGRESS_POLICY_ANNOTATION,
};

use support::fake::FakeNode;
use support::snapshot;
use support::{
    api_server, clone_pods, expect_reasons, mark_ready, running_pod, start_controller, wait_for, NS,
};

fn fork(name: &str, snapshot: &str, replicas: i32) -> PodClone {
    PodClone::new(
        name,
        CloneSpec {
            source: CloneSource {
                snapshot_name: Some(snapshot.to_string()),
                pod_name: None,
            },
            replicas,
            name_prefix: None,
            labels: None,
            failure_deadline_seconds: None,
        },
    )
}

async fn ready_snapshot(client: &Client, name: &str, pod: &str) {
    support::create(client, &snapshot(name, pod)).await;
    wait_for(client, name, "Ready", |s: &Snapshot| {
        s.status.as_ref().is_some_and(|st| st.phase == Phase::Ready)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_of_256_replicas_reports_each_and_becomes_ready() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    ready_snapshot(&client, "seeded", "redis").await;

    let started = Instant::now();
    support::create(&client, &fork("wide", "seeded", 256)).await;
    let pods = clone_pods(&client, "wide", 256).await;
    let created_in = started.elapsed();

    // Before any is Ready, every replica is listed, not ready.
    let listed = wait_for(&client, "wide", "256 replicas listed", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| s.replicas.len() == 256)
    })
    .await;
    let status = listed.status.expect("status");
    assert!(status.replicas.iter().all(|r| !r.ready), "{status:?}");
    assert_eq!(status.node_name.as_deref(), Some("node-a"));
    assert_eq!(status.phase, Phase::InProgress);

    // One replica's container cannot start: its entry says why.
    let stuck = pods
        .iter()
        .find(|p| p.name_any() == "wide-7")
        .expect("wide-7");
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let waiting = PodStatus {
        phase: Some("Pending".to_string()),
        container_statuses: Some(vec![ContainerStatus {
            name: "redis".to_string(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("CreateContainerError".to_string()),
                    message: Some("restore failed".to_string()),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]),
        ..Default::default()
    };
    pod_api
        .patch_status(
            "wide-7",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": waiting })),
        )
        .await
        .expect("status of wide-7");
    let told = wait_for(&client, "wide", "wide-7's reason", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| {
            s.replicas.iter().any(|r| {
                r.name == "wide-7"
                    && r.message.as_deref()
                        == Some("container redis: CreateContainerError: restore failed")
            })
        })
    })
    .await;
    assert!(told.status.is_some_and(|s| s.ready_replicas == 0));

    // The kubelet makes every pod Ready (wide-7 too, after a retry).
    for pod in pods.iter().filter(|p| p.name_any() != stuck.name_any()) {
        mark_ready(&client, pod).await;
    }
    let current = pod_api.get("wide-7").await.expect("wide-7");
    mark_ready(&client, &current).await;
    let ready = wait_for(&client, "wide", "Ready", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| s.phase == Phase::Ready)
    })
    .await;
    let total = started.elapsed();
    let status = ready.status.expect("status");
    assert_eq!(status.ready_replicas, 256);
    assert_eq!(status.replicas.len(), 256);
    let mut names: Vec<&str> = status.replicas.iter().map(|r| r.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), 256, "one entry per pod");
    assert!(status
        .replicas
        .iter()
        .all(|r| r.ready && r.phase == "Running" && r.message.is_none()));
    assert!(status
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True" && c.reason == "AllPodsReady"));
    // Printed, not asserted (a timing on a loaded 2-core machine): the
    // test's own 257 status writes dominate it.
    eprintln!("256 clones: created in {created_in:?}, Ready in {total:?}");
    expect_reasons(&client, "wide", &["PodsCreated", "Ready"]).await;
}

#[tokio::test]
async fn a_clone_not_ready_by_its_deadline_fails_and_keeps_its_pods() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    ready_snapshot(&client, "seeded", "redis").await;

    // The deadline is shortened only once the controller has seen one pod
    // Ready: a 1-s deadline from creation raced the test's own steps under
    // load (the Clone failed with 0/2 Ready before the first was marked).
    let mut clone = fork("slow", "seeded", 2);
    clone.spec.failure_deadline_seconds = Some(3600);
    support::create(&client, &clone).await;
    let pods = clone_pods(&client, "slow", 2).await;
    mark_ready(&client, &pods[0]).await;
    wait_for(&client, "slow", "one replica Ready", |c: &PodClone| {
        c.status
            .as_ref()
            .is_some_and(|s| s.replicas.iter().filter(|r| r.ready).count() == 1)
    })
    .await;
    let clones: Api<PodClone> = Api::namespaced(client.clone(), NS);
    clones
        .patch(
            "slow",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"failureDeadlineSeconds": 1}})),
        )
        .await
        .expect("shorten the deadline");
    let failed = wait_for(&client, "slow", "Failed", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| s.phase == Phase::Failed)
    })
    .await;
    let status = failed.status.expect("status");
    let failure = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Failure")
        .expect("Failure");
    assert_eq!(
        (failure.status.as_str(), failure.reason.as_str()),
        ("True", "DeadlineExceeded")
    );
    assert!(
        failure.message.contains("failureDeadlineSeconds (1 s)")
            && failure.message.contains("(1/2 are)"),
        "{}",
        failure.message
    );
    let error = status.error.expect("status.error");
    assert!(
        error.message.starts_with("DeadlineExceeded: "),
        "{}",
        error.message
    );
    clone_pods(&client, "slow", 2).await;
    expect_reasons(&client, "slow", &["PodsCreated", "DeadlineExceeded"]).await;
}

#[tokio::test]
async fn a_ready_clone_losing_a_pod_says_so() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    ready_snapshot(&client, "seeded", "redis").await;
    support::create(&client, &fork("pair", "seeded", 2)).await;
    for pod in clone_pods(&client, "pair", 2).await {
        mark_ready(&client, &pod).await;
    }
    wait_for(&client, "pair", "Ready", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| s.phase == Phase::Ready)
    })
    .await;

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.patch_status(
        "pair-1",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})),
    )
    .await
    .expect("pair-1 not ready");
    let degraded = wait_for(&client, "pair", "InProgress", |c: &PodClone| {
        c.status
            .as_ref()
            .is_some_and(|s| s.phase == Phase::InProgress)
    })
    .await;
    let status = degraded.status.expect("status");
    assert_eq!(status.ready_replicas, 1);
    assert!(status
        .replicas
        .iter()
        .any(|r| r.name == "pair-1" && !r.ready));
    expect_reasons(&client, "pair", &["PodsCreated", "Ready", "PodsNotReady"]).await;
}

#[tokio::test]
async fn a_snapshot_outlives_its_pod_and_is_cloned_from_the_spec_it_kept() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    let policy = r#"{"defaultAction":"deny"}"#.to_string();
    support::running_pod_with(
        &client,
        "paused",
        "node-a",
        true,
        &[(EGRESS_POLICY_ANNOTATION, policy.clone())],
    )
    .await;
    ready_snapshot(&client, "parked", "paused").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.delete("paused", &Default::default())
        .await
        .expect("delete the source pod");
    support::wait_gone::<Pod>(&client, "paused").await;

    support::create(&client, &fork("resumed", "parked", 1)).await;
    let made = clone_pods(&client, "resumed", 1).await;
    let spec = made[0].spec.clone().expect("spec");
    assert_eq!(spec.containers[0].image.as_deref(), Some("redis:7"));
    assert_eq!(spec.node_name.as_deref(), Some("node-a"));
    assert_eq!(
        made[0].annotations().get(EGRESS_POLICY_ANNOTATION),
        Some(&policy)
    );
    mark_ready(&client, &made[0]).await;
    wait_for(&client, "resumed", "Ready", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| s.phase == Phase::Ready)
    })
    .await;
}
