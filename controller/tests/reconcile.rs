//! The reconcilers against the in-repo API server and a fake node.

use twig_controller_testkit as support;

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use twig_controller::crd::{
    CloneSource, CloneSpec, DeletionPolicy, Phase, PodClone, Rollback, RollbackSpec,
    SandboxTemplate, SandboxTemplateSpec, Snapshot, SnapshotMode,
};

use support::fake::{Call, FakeNode};
use support::{
    api_server, events_about, eventually, expect_reasons, mark_ready, running_pod,
    start_controller, NS,
};
use support::{snapshot, snapshot_in};

fn rollback(name: &str, pod: &str, snap: &str) -> Rollback {
    Rollback::new(
        name,
        RollbackSpec {
            pod_uid: None,
            safety_snapshot: true,
            failure_deadline_seconds: None,
            pod_name: pod.to_string(),
            snapshot_name: snap.to_string(),
        },
    )
}

/// Waits until the Snapshot reaches `phase`.
async fn rollback_in(client: &Client, name: &str, phase: Phase) -> Rollback {
    let api: Api<Rollback> = Api::namespaced(client.clone(), NS);
    eventually(&format!("rollback {name} {phase}"), || {
        let api = api.clone();
        async move {
            let r = api.get(name).await.ok()?;
            (r.status.as_ref()?.phase == phase).then_some(r)
        }
    })
    .await
}

#[tokio::test]
async fn snapshot_reaches_ready_with_status_and_events() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    let pod = running_pod(&client, "redis", "node-a").await;
    let created = support::create(&client, &snapshot("snap-1", "redis")).await;

    let snap = snapshot_in(&client, "snap-1", Phase::Ready).await;
    let status = snap.status.clone().expect("status");
    assert_eq!(status.node_name.as_deref(), Some("node-a"));
    assert_eq!(
        status.snapshot_id,
        created.uid(),
        "the node-store ID is the object's UID"
    );
    assert_eq!(status.pod_uid, pod.uid());
    assert_eq!(status.size_bytes, Some(128 << 20));
    assert!(
        status.written_bytes.is_some()
            && status.duration_ms.is_some()
            && status.ready_time.is_some()
    );
    assert_eq!(
        status.parent, None,
        "the pod's first snapshot has no parent"
    );
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .expect("Ready condition");
    assert_eq!(ready.status, "True");
    assert!(snap
        .finalizers()
        .contains(&"twig.dev/snapshot-data".to_string()));
    assert_eq!(fake.snapshot_calls(), 1);

    // The second snapshot of the pod is incremental on the first.
    support::create(&client, &snapshot("snap-2", "redis")).await;
    let second = snapshot_in(&client, "snap-2", Phase::Ready).await;
    assert_eq!(second.status.and_then(|s| s.parent), created.uid());

    expect_reasons(&client, "snap-1", &["Started", "Ready"]).await;
}

#[tokio::test]
async fn invalid_specs_are_refused_with_a_clear_message() {
    let server = api_server().await;
    let client = server.client();
    let clones: Api<PodClone> = Api::namespaced(client.clone(), NS);
    let both = PodClone::new(
        "both",
        CloneSpec {
            failure_deadline_seconds: None,
            source: CloneSource {
                snapshot_name: Some("s".into()),
                pod_name: Some("p".into()),
            },
            replicas: 2,
            name_prefix: None,
            labels: None,
        },
    );
    let err = clones
        .create(&PostParams::default(), &both)
        .await
        .expect_err("two sources");
    let kube::Error::Api(resp) = err else {
        panic!("not an API error: {err}")
    };
    assert_eq!(resp.code, 422);
    assert!(
        resp.message
            .contains("set exactly one of source.snapshotName and source.podName"),
        "{}",
        resp.message
    );

    let mut zero = both.clone();
    zero.metadata.name = Some("zero".into());
    zero.spec.source.pod_name = None;
    zero.spec.replicas = 0;
    let err = clones
        .create(&PostParams::default(), &zero)
        .await
        .expect_err("zero replicas");
    assert!(
        err.to_string().contains("spec.replicas")
            && err.to_string().contains("greater than or equal to 1"),
        "{err}"
    );

    let resource = kube::core::ApiResource::erase::<Snapshot>(&());
    let snaps: Api<kube::core::DynamicObject> = Api::namespaced_with(client.clone(), NS, &resource);
    let bad_mode = json!({"apiVersion": "twig.dev/v1alpha1", "kind": "Snapshot",
        "metadata": {"name": "bad"}, "spec": {"podName": "redis", "mode": "Partial"}});
    let err = snaps
        .create(
            &PostParams::default(),
            &serde_json::from_value(bad_mode).expect("json"),
        )
        .await
        .expect_err("bad mode");
    assert!(
        err.to_string()
            .contains("spec.mode: Unsupported value: \"Partial\""),
        "{err}"
    );

    let templates: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    let tiny = SandboxTemplate::new(
        "tiny",
        SandboxTemplateSpec {
            image: "python:3".into(),
            vcpus: 0,
            memory_mib: 256,
            command: None,
            warmup: None,
            egress_policy: None,
        },
    );
    let err = templates
        .create(&PostParams::default(), &tiny)
        .await
        .expect_err("0 vcpus");
    assert!(err.to_string().contains("spec.vcpus"), "{err}");

    // A Rollback's spec cannot change after creation.
    let rollbacks: Api<Rollback> = Api::namespaced(client.clone(), NS);
    let rb = rollbacks
        .create(&PostParams::default(), &rollback("rb", "redis", "snap-1"))
        .await
        .expect("create rollback");
    let mut changed = rb.clone();
    changed.spec.snapshot_name = "snap-2".into();
    let err = rollbacks
        .replace("rb", &PostParams::default(), &changed)
        .await
        .expect_err("immutable");
    assert!(err.to_string().contains("spec is immutable"), "{err}");
}

#[tokio::test]
async fn objects_of_pods_on_other_nodes_are_left_alone() {
    let server = api_server().await;
    let client = server.client();
    let fake_a = Arc::new(FakeNode::default());
    let fake_b = Arc::new(FakeNode::default());
    let _a = start_controller(&server, "node-a", &fake_a);
    let _b = start_controller(&server, "node-b", &fake_b);
    running_pod(&client, "on-b", "node-b").await;
    support::create(&client, &snapshot("snap-b", "on-b")).await;

    let snap = snapshot_in(&client, "snap-b", Phase::Ready).await;
    assert_eq!(
        snap.status.and_then(|s| s.node_name).as_deref(),
        Some("node-b")
    );
    assert_eq!(fake_b.snapshot_calls(), 1);
    assert!(
        fake_a.calls().is_empty(),
        "node-a acted: {:?}",
        fake_a.calls()
    );
    let events = events_about(&client, "snap-b").await;
    assert!(!events.is_empty());
    for e in events {
        assert_eq!(e.reporting_instance.as_deref(), Some("node-b"), "{e:?}");
    }
}

#[tokio::test]
async fn pod_deleted_mid_snapshot_fails_with_reason() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    let pod = running_pod(&client, "doomed", "node-a").await;
    fake.hold_snapshots(true);
    support::create(&client, &snapshot("snap-doomed", "doomed")).await;
    eventually("snapshot reaches the shim", || async {
        (fake.snapshot_calls() == 1).then_some(())
    })
    .await;

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.delete("doomed", &DeleteParams::default())
        .await
        .expect("delete pod");
    fake.kill_sandbox(&pod.uid().expect("uid"));

    let snap = snapshot_in(&client, "snap-doomed", Phase::Failed).await;
    let message = snap.status.and_then(|s| s.message).unwrap_or_default();
    assert!(
        message.contains("pod doomed was deleted during the snapshot"),
        "{message}"
    );
    expect_reasons(&client, "snap-doomed", &["Started", "Failed"]).await;
}

#[tokio::test]
async fn restarted_controller_resumes_without_repeating_the_snapshot() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    running_pod(&client, "redis", "node-a").await;
    fake.hold_snapshots(true);
    let first = start_controller(&server, "node-a", &fake);
    support::create(&client, &snapshot("snap-r", "redis")).await;
    snapshot_in(&client, "snap-r", Phase::InProgress).await;
    eventually("snapshot reaches the shim", || async {
        (fake.snapshot_calls() == 1).then_some(())
    })
    .await;

    // The controller dies mid-call; the shim finishes the snapshot anyway.
    drop(first);
    eventually("the dead controller's call to end", || async {
        (fake.in_flight() == 0).then_some(())
    })
    .await;
    fake.hold_snapshots(false);
    let _second = start_controller(&server, "node-a", &fake);

    let snap = snapshot_in(&client, "snap-r", Phase::Ready).await;
    assert_eq!(
        fake.snapshot_calls(),
        1,
        "the snapshot was taken twice: {:?}",
        fake.calls()
    );
    assert!(
        fake.calls().iter().any(|c| matches!(c, Call::Stats(_))),
        "the new controller did not ask the shim"
    );
    assert_eq!(snap.status.and_then(|s| s.snapshot_id), snap.metadata.uid);
}

#[tokio::test]
async fn restarted_controller_resumes_without_repeating_the_rollback() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    running_pod(&client, "redis", "node-a").await;
    let first = start_controller(&server, "node-a", &fake);
    support::create(&client, &snapshot("base", "redis")).await;
    snapshot_in(&client, "base", Phase::Ready).await;
    drop(first);

    // A rollback the dead controller had started and the shim had finished.
    let rb = support::create(&client, &rollback("rb", "redis", "base")).await;
    let api: Api<Rollback> = Api::namespaced(client.clone(), NS);
    let mut in_progress = rb.clone();
    in_progress.status = Some(twig_controller::crd::RollbackStatus {
        phase: Phase::InProgress,
        start_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        )),
        ..Default::default()
    });
    api.replace_status("rb", &PostParams::default(), &in_progress)
        .await
        .expect("status");
    let sandbox = twig_controller::shim::Sandbox {
        id: format!("sb-{}", running_uid(&client, "redis").await),
        address: String::new(),
    };
    let base_id = snapshot_in(&client, "base", Phase::Ready)
        .await
        .uid()
        .expect("uid");
    twig_controller::shim::TwigShim::rollback(
        fake.as_ref(),
        &sandbox,
        &base_id,
        &rb.uid().expect("uid"),
    )
    .await
    .expect("fake rollback");

    let _second = start_controller(&server, "node-a", &fake);
    rollback_in(&client, "rb", Phase::Ready).await;
    assert_eq!(
        fake.rollback_calls(),
        1,
        "rolled back twice: {:?}",
        fake.calls()
    );
    assert!(
        fake.calls().iter().any(|c| matches!(c, Call::Stats(_))),
        "the new controller did not ask the shim"
    );
}

async fn running_uid(client: &Client, pod: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.get(pod).await.expect("pod").uid().expect("uid")
}

#[tokio::test]
async fn deleting_a_snapshot_removes_its_node_data_unless_retained() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    let deleted = support::create(&client, &snapshot("to-delete", "redis")).await;
    let mut retain = snapshot("to-keep", "redis");
    retain.spec.deletion_policy = DeletionPolicy::Retain;
    // Full: retained incremental data on top of to-delete's would keep
    // to-delete's in the store (a_parent_is_kept_while_a_retained_childs_data_needs_it).
    retain.spec.mode = SnapshotMode::Full;
    let kept = support::create(&client, &retain).await;
    snapshot_in(&client, "to-delete", Phase::Ready).await;
    snapshot_in(&client, "to-keep", Phase::Ready).await;
    let (deleted_id, kept_id) = (deleted.uid().expect("uid"), kept.uid().expect("uid"));
    assert!(fake.stored(&deleted_id) && fake.stored(&kept_id));

    let api: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    api.delete("to-delete", &DeleteParams::default())
        .await
        .expect("delete");
    api.delete("to-keep", &DeleteParams::default())
        .await
        .expect("delete");
    support::wait_gone::<Snapshot>(&client, "to-delete").await;
    support::wait_gone::<Snapshot>(&client, "to-keep").await;
    assert!(
        !fake.stored(&deleted_id),
        "node data of a deleted snapshot remains"
    );
    assert!(fake.stored(&kept_id), "Retain removed the data");
    assert!(fake.calls().contains(&Call::DeleteSnapshot(deleted_id)));
    assert!(!fake.calls().contains(&Call::DeleteSnapshot(kept_id)));
}

#[tokio::test]
async fn a_snapshot_whose_data_leaves_the_node_is_lost() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    let created = support::create(&client, &snapshot("fragile", "redis")).await;
    snapshot_in(&client, "fragile", Phase::Ready).await;
    fake.lose(&created.uid().expect("uid"));
    let lost = snapshot_in(&client, "fragile", Phase::Lost).await;
    let message = lost.status.and_then(|s| s.message).unwrap_or_default();
    assert!(message.contains("no longer on node node-a"), "{message}");
    expect_reasons(&client, "fragile", &["Started", "Ready", "Lost"]).await;
}

#[tokio::test]
async fn ttl_expiry_deletes_the_snapshot() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    let mut short = snapshot("short-lived", "redis");
    short.spec.ttl_seconds_after_ready = Some(2);
    let created = support::create(&client, &short).await;
    support::wait_gone::<Snapshot>(&client, "short-lived").await;
    assert!(!fake.stored(&created.uid().expect("uid")));
    expect_reasons(
        &client,
        "short-lived",
        &["Started", "Ready", "Expired", "DataDeleted"],
    )
    .await;
    // readyTime has whole seconds, so 2 s after it is at least 1 s after the Ready event.
    let events = events_about(&client, "short-lived").await;
    let at = |reason: &str| {
        events
            .iter()
            .find(|e| e.reason.as_deref() == Some(reason))
            .and_then(|e| e.event_time.as_ref())
            .map(|t| t.0.as_millisecond())
            .expect("event time")
    };
    let waited_ms = at("Expired") - at("Ready");
    assert!(waited_ms >= 1000, "expired {waited_ms} ms after Ready");
}

#[tokio::test]
async fn rollback_reaches_ready_once_even_when_applied_twice() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "sandbox", "node-a").await;
    let snap = support::create(&client, &snapshot("before-rm", "sandbox")).await;
    snapshot_in(&client, "before-rm", Phase::Ready).await;

    let rb = support::create(&client, &rollback("undo", "sandbox", "before-rm")).await;
    let done = rollback_in(&client, "undo", Phase::Ready).await;
    let status = done.status.clone().expect("status");
    assert!(status.duration_ms.is_some() && status.completion_time.is_some());
    let expected = Call::Rollback {
        sandbox: format!("sb-{}", running_uid(&client, "sandbox").await),
        snapshot_id: snap.uid().expect("uid"),
        operation_id: rb.uid().expect("uid"),
    };
    assert!(fake.calls().contains(&expected), "{:?}", fake.calls());

    // `kubectl apply` of the same manifest again: the object does not change.
    let api: Api<Rollback> = Api::namespaced(client.clone(), NS);
    let again = api
        .replace("undo", &PostParams::default(), &done)
        .await
        .expect("re-apply");
    assert_eq!(
        again.metadata.resource_version,
        done.metadata.resource_version
    );
    // A later object proves the controller has looked at everything before it.
    support::create(&client, &rollback("undo-2", "sandbox", "before-rm")).await;
    rollback_in(&client, "undo-2", Phase::Ready).await;
    assert_eq!(fake.rollback_calls(), 2, "{:?}", fake.calls());
    expect_reasons(
        &client,
        "undo",
        &["Started", "SafetySnapshotRequested", "RolledBack"],
    )
    .await;
}

#[tokio::test]
async fn rollback_to_a_snapshot_outside_the_lineage_is_refused() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "alice", "node-a").await;
    running_pod(&client, "bob", "node-a").await;
    support::create(&client, &snapshot("of-alice", "alice")).await;
    snapshot_in(&client, "of-alice", Phase::Ready).await;

    support::create(&client, &rollback("wrong", "bob", "of-alice")).await;
    let failed = rollback_in(&client, "wrong", Phase::Failed).await;
    let message = failed.status.and_then(|s| s.message).unwrap_or_default();
    assert!(
        message.contains("NotInLineage") && message.contains("not in the lineage of pod bob"),
        "{message}"
    );
    assert_eq!(fake.rollback_calls(), 0);
}

#[tokio::test]
async fn operations_on_one_pod_are_serialized() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "busy", "node-a").await;
    running_pod(&client, "other", "node-a").await;
    support::create(&client, &snapshot("base", "busy")).await;
    support::create(&client, &snapshot("other-base", "other")).await;
    snapshot_in(&client, "base", Phase::Ready).await;
    snapshot_in(&client, "other-base", Phase::Ready).await;

    fake.hold_snapshots(true);
    let held = support::create(&client, &snapshot("held", "busy")).await;
    eventually("held snapshot reaches the shim", || async {
        (fake.snapshot_calls() == 3).then_some(())
    })
    .await;
    // Without safety snapshots (tests/rollback_safety.rs has those), which the fake would hold too.
    let mut waits = rollback("waits", "busy", "base");
    waits.spec.safety_snapshot = false;
    let waits = support::create(&client, &waits).await;
    rollback_in(&client, "waits", Phase::InProgress).await;
    // A rollback of another pod is not held up, and proves the queue moved on.
    let mut free = rollback("free", "other", "other-base");
    free.spec.safety_snapshot = false;
    support::create(&client, &free).await;
    rollback_in(&client, "free", Phase::Ready).await;
    assert_eq!(
        fake.rollback_calls(),
        1,
        "the rollback of the busy pod overtook its snapshot"
    );

    fake.hold_snapshots(false);
    snapshot_in(&client, "held", Phase::Ready).await;
    rollback_in(&client, "waits", Phase::Ready).await;
    assert_eq!(fake.max_in_flight(), 1);
    let calls = fake.calls();
    let (held_id, waits_id) = (held.uid().expect("uid"), waits.uid().expect("uid"));
    let snapshot_at = calls
        .iter()
        .position(|c| matches!(c, Call::Snapshot { snapshot_id, .. } if *snapshot_id == held_id))
        .expect("held snapshot call");
    let rollback_at = calls
        .iter()
        .position(|c| matches!(c, Call::Rollback { operation_id, .. } if *operation_id == waits_id))
        .expect("rollback call");
    assert!(snapshot_at < rollback_at, "{calls:?}");
}

fn clone_of(name: &str, source: CloneSource, replicas: i32) -> PodClone {
    PodClone::new(
        name,
        CloneSpec {
            failure_deadline_seconds: None,
            source,
            replicas,
            name_prefix: None,
            labels: Some([("fork".to_string(), name.to_string())].into()),
        },
    )
}

async fn clone_in(client: &Client, name: &str, phase: Phase) -> PodClone {
    let api: Api<PodClone> = Api::namespaced(client.clone(), NS);
    eventually(&format!("clone {name} {phase}"), || {
        let api = api.clone();
        async move {
            let c = api.get(name).await.ok()?;
            (c.status.as_ref()?.phase == phase).then_some(c)
        }
    })
    .await
}

/// Acts as the kubelet: marks every pod of the clone Ready once it exists.
async fn make_clone_pods_ready(client: &Client, clone: &str, replicas: usize) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let selector = format!("twig.dev/clone={clone}");
    let listed = eventually(&format!("{replicas} pods of {clone}"), || {
        let pods = pods.clone();
        let selector = selector.clone();
        async move {
            let l = pods
                .list(&kube::api::ListParams::default().labels(&selector))
                .await
                .ok()?;
            (l.items.len() == replicas).then_some(l.items)
        }
    })
    .await;
    let mut ready = Vec::new();
    for pod in &listed {
        ready.push(mark_ready(client, pod).await);
    }
    ready
}

#[tokio::test]
async fn clone_of_a_snapshot_creates_eight_pinned_owned_pods() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    let snap = support::create(&client, &snapshot("redis-snap", "redis")).await;
    snapshot_in(&client, "redis-snap", Phase::Ready).await;

    let source = CloneSource {
        snapshot_name: Some("redis-snap".into()),
        pod_name: None,
    };
    let clone = support::create(&client, &clone_of("fork", source, 8)).await;
    let pods = make_clone_pods_ready(&client, "fork", 8).await;
    let mut names: Vec<String> = pods.iter().map(|p| p.name_any()).collect();
    names.sort();
    let mut expected: Vec<String> = (0..8).map(|i| format!("fork-{i}")).collect();
    expected.sort();
    assert_eq!(names, expected);
    for pod in &pods {
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(spec.runtime_class_name.as_deref(), Some("twig"));
        assert_eq!(
            spec.containers[0].image.as_deref(),
            Some("redis:7"),
            "a copy of the source's spec"
        );
        assert_eq!(
            pod.annotations().get("twig.dev/restore-from"),
            snap.uid().as_ref()
        );
        assert_eq!(pod.labels().get("fork").map(String::as_str), Some("fork"));
        let owner = &pod.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), Some(owner.uid.clone())),
            ("Clone", clone.uid())
        );
        assert_eq!(owner.controller, Some(true));
    }
    let ready = clone_in(&client, "fork", Phase::Ready).await;
    let status = ready.status.expect("status");
    assert_eq!(status.ready_replicas, 8);
    assert_eq!(status.pods.len(), 8);
    assert!(status.duration_ms.is_some());
    expect_reasons(&client, "fork", &["PodsCreated", "Ready"]).await;

    // Deleting the Clone deletes its pods.
    let api: Api<PodClone> = Api::namespaced(client.clone(), NS);
    api.delete("fork", &DeleteParams::default())
        .await
        .expect("delete clone");
    support::wait_gone::<Pod>(&client, "fork-7").await;
}

/// A reconcile of a cached Clone that its deletion overtook (the object
/// in the cache still without `deletionTimestamp`) creates none of its
/// pods again: they would be collected at once, after a kubelet began to
/// start them. The Clone is held by a finalizer of the test's, so that a
/// pod made for it would stay to be seen.
#[tokio::test]
async fn a_stale_reconcile_of_a_deleted_clone_creates_no_pods() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &snapshot("redis-snap", "redis")).await;
    snapshot_in(&client, "redis-snap", Phase::Ready).await;
    let source = CloneSource {
        snapshot_name: Some("redis-snap".into()),
        pod_name: None,
    };
    support::create(&client, &clone_of("held", source, 2)).await;
    make_clone_pods_ready(&client, "held", 2).await;
    let stale = clone_in(&client, "held", Phase::Ready).await;

    let api: Api<PodClone> = Api::namespaced(client.clone(), NS);
    let hold = Patch::Merge(json!({"metadata": {"finalizers": ["test.twig.dev/hold"]}}));
    api.patch("held", &PatchParams::default(), &hold)
        .await
        .expect("adding the test's finalizer");
    api.delete("held", &DeleteParams::default())
        .await
        .expect("delete clone");
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.delete("held-1", &DeleteParams::default())
        .await
        .expect("delete a clone pod");
    support::wait_gone::<Pod>(&client, "held-1").await;

    let result =
        twig_controller::reconcile::clone::reconcile(Arc::new(stale), ctrl.ctx.clone()).await;
    assert!(
        pods.get_opt("held-1").await.expect("get pod").is_none(),
        "a stale reconcile made a pod for a Clone being deleted (it returned {result:?})"
    );
    result.expect("reconcile of the stale Clone");

    let release = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    api.patch("held", &PatchParams::default(), &release)
        .await
        .expect("removing the test's finalizer");
    support::wait_gone::<Pod>(&client, "held-0").await;
}

#[tokio::test]
async fn clone_of_a_pod_first_takes_a_snapshot_it_owns() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "agent", "node-a").await;
    let source = CloneSource {
        snapshot_name: None,
        pod_name: Some("agent".into()),
    };
    let mut spec = clone_of("explore", source, 3);
    spec.spec.name_prefix = Some("branch".into());
    let clone = support::create(&client, &spec).await;
    let snap = snapshot_in(&client, "explore-source", Phase::Ready).await;
    assert_eq!(snap.owner_references()[0].uid, clone.uid().expect("uid"));
    let pods = make_clone_pods_ready(&client, "explore", 3).await;
    assert!(pods.iter().all(|p| p.name_any().starts_with("branch-")));
    let ready = clone_in(&client, "explore", Phase::Ready).await;
    assert_eq!(
        ready.status.and_then(|s| s.snapshot_name).as_deref(),
        Some("explore-source")
    );
    expect_reasons(
        &client,
        "explore",
        &["SnapshotRequested", "PodsCreated", "Ready"],
    )
    .await;
}

#[tokio::test]
async fn sandbox_template_lists_ready_nodes_and_is_removed_from_each() {
    let server = api_server().await;
    let client = server.client();
    let fake_a = Arc::new(FakeNode::default());
    let fake_b = Arc::new(FakeNode::default());
    let _a = start_controller(&server, "node-a", &fake_a);
    let _b = start_controller(&server, "node-b", &fake_b);
    let template = SandboxTemplate::new(
        "python",
        SandboxTemplateSpec {
            image: "python:3.12".into(),
            vcpus: 1,
            memory_mib: 256,
            command: Some(vec!["python3".into(), "-i".into()]),
            warmup: None,
            egress_policy: None,
        },
    );
    support::create(&client, &template).await;
    let api: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    let ready = eventually("template ready on both nodes", || {
        let api = api.clone();
        async move {
            let t = api.get("python").await.ok()?;
            (t.status.as_ref()?.ready_nodes == 2).then_some(t)
        }
    })
    .await;
    let nodes: Vec<String> = ready
        .status
        .expect("status")
        .nodes
        .into_iter()
        .map(|n| n.node_name)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(nodes, ["node-a", "node-b"]);
    assert!(fake_a
        .calls()
        .contains(&Call::EnsureTemplate("default/python".into())));

    api.delete("python", &DeleteParams::default())
        .await
        .expect("delete");
    support::wait_gone::<SandboxTemplate>(&client, "python").await;
    assert!(fake_a
        .calls()
        .contains(&Call::DeleteTemplate("default/python".into())));
    assert!(fake_b
        .calls()
        .contains(&Call::DeleteTemplate("default/python".into())));
}

/// The namespace's `default` ServiceAccount pulls with `secrets`.
async fn pull_secrets(client: &Client, secrets: &[&str]) {
    let account: ServiceAccount = serde_json::from_value(json!({
        "metadata": {"name": "default"},
        "imagePullSecrets": secrets.iter().map(|s| json!({"name": s})).collect::<Vec<_>>(),
    }))
    .expect("service account");
    support::create(client, &account).await;
}

fn template_of(name: &str, image: &str) -> SandboxTemplate {
    SandboxTemplate::new(
        name,
        SandboxTemplateSpec {
            image: image.into(),
            vcpus: 1,
            memory_mib: 128,
            command: None,
            warmup: None,
            egress_policy: None,
        },
    )
}

/// Issue 24, item 7: a template is built in a build Pod its node's
/// controller makes (kubelet stops sandboxes it did not make), with the
/// namespace's pull secrets; the Pod goes once the template is ready, and
/// a failed build's Pod is spent: the next attempt gets a new one. Every
/// write passes the chart's admission policies.
#[tokio::test]
async fn sandbox_templates_are_built_in_build_pods_of_their_node() {
    let server = api_server().await;
    support::enforce_chart_policies(&server);
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    pull_secrets(&client, &["team-registry", "hub"]).await;
    fake.fail_builds(1);

    support::create(&client, &template_of("app", "reg.example/team/app:1")).await;
    let api: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    eventually("template app ready", || {
        let api = api.clone();
        async move { (api.get("app").await.ok()?.status?.ready_nodes == 1).then_some(()) }
    })
    .await;
    let built_in = fake.build_pods("default/app");
    assert_eq!(
        built_in.len(),
        2,
        "a failed build, then one in a new Pod: {built_in:?}"
    );
    assert_ne!(built_in[0], built_in[1], "the spent Pod was not reused");
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    eventually("the build Pod deleted", || {
        let pods = pods.clone();
        async move {
            let l = pods
                .list(&kube::api::ListParams::default().labels("twig.dev/template-build"))
                .await
                .ok()?;
            l.items.is_empty().then_some(())
        }
    })
    .await;
    // Built: asked again (a controller restart, a requeue), no new Pod.
    let before = fake.build_pods("default/app").len();
    let ensures = || {
        fake.calls()
            .iter()
            .filter(|c| **c == Call::EnsureTemplate("default/app".into()))
            .count()
    };
    let asked = ensures();
    api.patch(
        "app",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"touched": "yes"}}})),
    )
    .await
    .expect("label");
    eventually("the template ensured again", || {
        let more = ensures() > asked;
        async move { more.then_some(()) }
    })
    .await;
    assert_eq!(fake.build_pods("default/app").len(), before);
}

/// The build Pod's spec: what kubelet needs to run the template's build as
/// any pod, and nothing that would end up in the template's memory.
#[test]
fn a_build_pod_is_bound_to_its_node_and_pulls_with_the_namespaces_secrets() {
    let mut template = template_of("py", "reg.example/py:3");
    template.metadata.namespace = Some(NS.into());
    template.metadata.uid = Some("tpl-uid".into());
    template.metadata.generation = Some(3);
    template.spec.command = Some(vec!["python3".into(), "-i".into()]);
    let pod =
        twig_controller::reconcile::template::build_pod(&template, "node-a", &["hub".to_string()]);
    let v = serde_json::to_value(&pod).expect("json");
    assert_eq!(v["metadata"]["name"], "py-build-node-a");
    assert_eq!(v["metadata"]["labels"]["twig.dev/template-build"], "py");
    assert_eq!(v["metadata"]["annotations"]["twig.dev/network"], "none");
    assert_eq!(
        v["metadata"]["annotations"]["twig.dev/template-generation"],
        "3"
    );
    let owner = &v["metadata"]["ownerReferences"][0];
    assert_eq!(
        (&owner["kind"], &owner["name"], &owner["controller"]),
        (&json!("SandboxTemplate"), &json!("py"), &json!(true))
    );
    let spec = &v["spec"];
    assert_eq!(spec["nodeName"], "node-a");
    assert_eq!(spec["runtimeClassName"], "twig");
    assert_eq!(spec["hostNetwork"], true);
    assert_eq!(spec["restartPolicy"], "Never");
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(spec["enableServiceLinks"], false);
    assert_eq!(spec["imagePullSecrets"], json!([{"name": "hub"}]));
    assert_eq!(spec["tolerations"], json!([{"operator": "Exists"}]));
    assert_eq!(
        spec["containers"],
        json!([{"name": "template", "image": "reg.example/py:3", "command": ["python3", "-i"]}])
    );
    assert!(spec.get("volumes").is_none());
    // Why kubelet has not started it reaches the template's status.
    let mut waiting = pod.clone();
    waiting.status = serde_json::from_value(json!({"containerStatuses": [{
        "name": "template", "image": "reg.example/py:3", "imageID": "", "ready": false,
        "restartCount": 0,
        "state": {"waiting": {"reason": "ErrImagePull", "message": "401 Unauthorized"}},
    }]}))
    .expect("status");
    assert_eq!(
        twig_controller::reconcile::template::waiting_reason(&waiting).as_deref(),
        Some("build Pod: ErrImagePull: 401 Unauthorized")
    );
    assert_eq!(
        twig_controller::reconcile::template::waiting_reason(&pod),
        None
    );
    // A long name stays a DNS label.
    let long = template_of(&"t".repeat(60), "x");
    let name = twig_controller::reconcile::template::build_pod_name(&long, "node-a");
    assert!(name.len() <= 63, "{name}");
}

#[tokio::test]
async fn metrics_count_operations_by_result() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let ctrl = start_controller(&server, "node-a", &fake);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let serve = tokio::spawn(twig_controller::metrics::serve(
        listener,
        ctrl.metrics.clone(),
    ));
    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &snapshot("ok", "redis")).await;
    support::create(&client, &snapshot("no-pod", "missing")).await;
    snapshot_in(&client, "ok", Phase::Ready).await;
    snapshot_in(&client, "no-pod", Phase::Failed).await;

    let text = scrape(addr).await;
    assert!(
        text.contains("twig_operations_total{operation=\"snapshot\",result=\"success\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("twig_operations_total{operation=\"snapshot\",result=\"failure\"} 1"),
        "{text}"
    );
    assert!(
        text.contains(
            "twig_operation_duration_seconds_count{operation=\"snapshot\",result=\"success\"} 1"
        ),
        "{text}"
    );
    serve.abort();
}

async fn scrape(addr: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect metrics");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut out = String::new();
    stream.read_to_string(&mut out).await.expect("response");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

#[tokio::test]
async fn controller_calls_only_what_its_rbac_grants() {
    let server = api_server().await;
    // And writes only what the chart's node restriction lets a node write.
    support::enforce_chart_policies(&server);
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;

    let mut short = snapshot("short", "redis");
    short.spec.ttl_seconds_after_ready = Some(0);
    support::create(&client, &short).await;
    support::wait_gone::<Snapshot>(&client, "short").await;

    let source = CloneSource {
        snapshot_name: None,
        pod_name: Some("redis".into()),
    };
    support::create(&client, &clone_of("fork", source, 2)).await;
    make_clone_pods_ready(&client, "fork", 2).await;
    clone_in(&client, "fork", Phase::Ready).await;
    // A clone does not roll back to the snapshot it was restored from
    // (the shim would refuse it); the controller refuses it first.
    support::create(&client, &rollback("reset", "fork-0", "fork-source")).await;
    rollback_in(&client, "reset", Phase::Failed).await;

    // A template is built in a build Pod (made, then deleted), which pulls
    // with the namespace's pull secrets.
    pull_secrets(&client, &["hub"]).await;
    support::create(&client, &template_of("py", "python:3")).await;
    let templates: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    eventually("template ready", || {
        let templates = templates.clone();
        async move { (templates.get("py").await.ok()?.status?.ready_nodes == 1).then_some(()) }
    })
    .await;
    templates
        .delete("py", &DeleteParams::default())
        .await
        .expect("delete");
    support::wait_gone::<SandboxTemplate>(&client, "py").await;

    let used: std::collections::BTreeSet<(String, String, String)> = server
        .accesses(support::CONTROLLER)
        .into_iter()
        .map(|a| (a.group, a.resource, a.verb))
        .collect();
    let granted: std::collections::BTreeSet<(String, String, String)> =
        support::rbac::CONTROLLER_RULES
            .iter()
            .flat_map(|(g, r, verbs)| {
                verbs
                    .iter()
                    .map(move |v| (g.to_string(), r.to_string(), v.to_string()))
            })
            .collect();
    let beyond: Vec<_> = used.difference(&granted).collect();
    assert!(
        beyond.is_empty(),
        "the controller calls what its RBAC does not grant: {beyond:?}"
    );
    let not_requested: std::collections::BTreeSet<(String, String, String)> =
        support::rbac::NOT_REQUESTED
            .iter()
            .map(|(g, r, v)| (g.to_string(), r.to_string(), v.to_string()))
            .collect();
    let unused: Vec<_> = granted
        .difference(&used)
        .filter(|g| !not_requested.contains(*g))
        .collect();
    assert!(
        unused.is_empty(),
        "the RBAC grants what the controller never calls: {unused:?}"
    );
}

/// The test API server itself: the semantics the reconcilers rely on.
#[tokio::test]
async fn test_api_server_has_kubernetes_semantics() {
    use futures::{StreamExt, TryStreamExt};
    use kube::api::WatchEvent;

    let server = api_server().await;
    let client = server.client();
    let api: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    let created = support::create(&client, &snapshot("s", "redis")).await;
    assert_eq!(created.metadata.generation, Some(1));
    assert!(created.uid().is_some() && created.metadata.creation_timestamp.is_some());

    // A watch from a resourceVersion sees every later change, in order.
    let rv = created.resource_version().expect("rv");
    let mut watch = api
        .watch(&kube::api::WatchParams::default(), &rv)
        .await
        .expect("watch")
        .boxed();

    // The main resource ignores status; /status ignores everything else.
    let mut with_status = created.clone();
    with_status.status = Some(twig_controller::crd::SnapshotStatus {
        phase: Phase::Ready,
        ..Default::default()
    });
    with_status.spec.ttl_seconds_after_ready = Some(5);
    let replaced = api
        .replace("s", &PostParams::default(), &with_status)
        .await
        .expect("replace");
    assert_eq!(replaced.status, None);
    assert_eq!(
        replaced.metadata.generation,
        Some(2),
        "a spec change bumps generation"
    );
    let mut status_only = replaced.clone();
    status_only.status = with_status.status.clone();
    status_only.spec.ttl_seconds_after_ready = Some(99);
    let updated = api
        .replace_status("s", &PostParams::default(), &status_only)
        .await
        .expect("status");
    assert_eq!(updated.status.as_ref().map(|s| s.phase), Some(Phase::Ready));
    assert_eq!(updated.spec.ttl_seconds_after_ready, Some(5));
    assert_eq!(updated.metadata.generation, Some(2));

    // A write from a stale copy is a 409.
    let err = api
        .replace("s", &PostParams::default(), &replaced)
        .await
        .expect_err("stale");
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 409 && e.reason == "Conflict"),
        "{err}"
    );
    let err = api
        .create(&PostParams::default(), &snapshot("s", "redis"))
        .await
        .expect_err("exists");
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 409 && e.reason == "AlreadyExists"),
        "{err}"
    );

    // Finalizers hold a deleted object until they are removed.
    let mut held = updated.clone();
    held.metadata.finalizers = Some(vec!["test/hold".into()]);
    let held = api
        .replace("s", &PostParams::default(), &held)
        .await
        .expect("finalizer");
    api.delete("s", &DeleteParams::default())
        .await
        .expect("delete");
    let marked = api.get("s").await.expect("still there");
    assert!(marked.metadata.deletion_timestamp.is_some());
    let mut more = marked.clone();
    more.metadata.finalizers = Some(vec!["test/hold".into(), "test/other".into()]);
    assert!(
        api.replace("s", &PostParams::default(), &more)
            .await
            .is_err(),
        "no new finalizers once deleting"
    );
    let mut released = marked.clone();
    released.metadata.finalizers = None;
    api.replace("s", &PostParams::default(), &released)
        .await
        .expect("release");
    assert!(api.get_opt("s").await.expect("get").is_none());
    assert_ne!(held.resource_version(), marked.resource_version());

    let kinds: Vec<String> = watch
        .by_ref()
        .take(5)
        .map_ok(|e| match e {
            WatchEvent::Added(_) => "ADDED".to_string(),
            WatchEvent::Modified(_) => "MODIFIED".to_string(),
            WatchEvent::Deleted(_) => "DELETED".to_string(),
            other => format!("{other:?}"),
        })
        .try_collect()
        .await
        .expect("watch events");
    assert_eq!(
        kinds,
        ["MODIFIED", "MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]
    );

    // Deleting an owner deletes its dependents.
    let owner = support::create(&client, &snapshot("owner", "redis")).await;
    let mut dependent = snapshot("dependent", "redis");
    dependent.metadata.owner_references =
        kube::Resource::controller_owner_ref(&owner, &()).map(|o| vec![o]);
    support::create(&client, &dependent).await;
    api.delete("owner", &DeleteParams::default())
        .await
        .expect("delete owner");
    assert!(api.get_opt("dependent").await.expect("get").is_none());
}

/// Objects that reached the API server without schema validation (e.g.
/// written before the CRD was updated) are refused by the controller too.
#[tokio::test]
async fn controller_refuses_invalid_objects_the_api_server_let_through() {
    let server = support::apiserver::TestApiServer::start(None).await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    let both = CloneSource {
        snapshot_name: Some("s".into()),
        pod_name: Some("p".into()),
    };
    support::create(&client, &clone_of("ambiguous", both, 3)).await;
    let failed = clone_in(&client, "ambiguous", Phase::Failed).await;
    let message = failed.status.and_then(|s| s.message).unwrap_or_default();
    assert!(
        message.contains("set exactly one of spec.source.snapshotName and spec.source.podName"),
        "{message}"
    );
    expect_reasons(&client, "ambiguous", &["Invalid"]).await;
    let events = events_about(&client, "ambiguous").await;
    assert_eq!(events[0].type_.as_deref(), Some("Warning"));
    assert_eq!(events[0].reason.as_deref(), Some("Invalid"));
    assert!(fake.calls().is_empty());
}
