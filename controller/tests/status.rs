//! Status written with server-side apply: the test API server's SSA
//! semantics, many nodes writing one SandboxTemplate's `status.nodes`, the
//! conditions of Snapshot, Clone and Rollback, and the memory bounds.

use twig_controller_testkit as support;

use std::sync::Arc;

use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::{json, Value};
use twig_controller::crd::{
    CloneSource, CloneSpec, DeletionPolicy, Phase, PodClone, Rollback, RollbackSpec,
    SandboxTemplate, SandboxTemplateSpec, Snapshot, SnapshotMode, SnapshotSpec,
};

use support::apiserver::TestApiServer;
use support::fake::{Call, FakeNode};
use support::{
    api_server, create, eventually, expect_reasons, mark_ready, running_pod, start_controller,
    wait_for, NS,
};

fn template(name: &str, memory_mib: u32) -> SandboxTemplate {
    SandboxTemplate::new(
        name,
        SandboxTemplateSpec {
            image: "python:3.12".into(),
            vcpus: 1,
            memory_mib,
            command: None,
            warmup: None,
            egress_policy: None,
        },
    )
}

fn entry_names(t: &SandboxTemplate) -> Vec<String> {
    let mut names: Vec<String> = t
        .status
        .iter()
        .flat_map(|s| s.nodes.iter().map(|n| n.node_name.clone()))
        .collect();
    names.sort();
    names
}

fn node_status(node: &str, ready: bool, ready_nodes: i32) -> Value {
    json!({
        "apiVersion": "twig.dev/v1alpha1", "kind": "SandboxTemplate",
        "metadata": {"name": "t"},
        "status": {"nodes": [{"nodeName": node, "ready": ready}], "readyNodes": ready_nodes},
    })
}

fn managed_by<'a>(t: &'a SandboxTemplate, manager: &str) -> Option<&'a Value> {
    t.metadata
        .managed_fields
        .iter()
        .flatten()
        .find(|m| m.manager.as_deref() == Some(manager))
        .and_then(|m| m.fields_v1.as_ref())
        .map(|f| &f.0)
}

/// The test API server's server-side apply behaves as kube-apiserver's.
#[tokio::test]
async fn test_api_server_applies_like_kube_apiserver() {
    let server = api_server().await;
    let client = server.client();
    let api: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    create(&client, &template("t", 256)).await;
    let apply = |manager: &str| PatchParams::apply(manager);

    // Two managers apply their own entries of a map list: both survive.
    api.patch_status(
        "t",
        &apply("node-a"),
        &Patch::Apply(node_status("a", true, 1)),
    )
    .await
    .expect("apply a");
    let both = api
        .patch_status(
            "t",
            &apply("node-b"),
            &Patch::Apply(node_status("b", false, 1)),
        )
        .await
        .expect("apply b (same readyNodes: shared, no conflict)");
    assert_eq!(entry_names(&both), ["a", "b"]);
    let a_fields = managed_by(&both, "node-a").expect("node-a's managedFields");
    assert_eq!(
        a_fields["f:status"]["f:nodes"]["k:{\"nodeName\":\"a\"}"],
        json!({".": {}, "f:nodeName": {}, "f:ready": {}})
    );
    let entry = both
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .find(|m| m.manager.as_deref() == Some("node-a"))
        .expect("entry");
    assert_eq!(
        (entry.operation.as_deref(), entry.subresource.as_deref()),
        (Some("Apply"), Some("status"))
    );

    // Changing a field another manager owns is a conflict, unless forced.
    let err = api
        .patch_status(
            "t",
            &apply("node-b"),
            &Patch::Apply(node_status("b", true, 2)),
        )
        .await
        .expect_err("conflict");
    let kube::Error::Api(resp) = err else {
        panic!("not an API error: {err}")
    };
    assert_eq!((resp.code, resp.reason.as_str()), (409, "Conflict"));
    assert!(
        resp.message
            .contains("conflict with \"node-a\": .status.readyNodes"),
        "{}",
        resp.message
    );
    let forced = api
        .patch_status(
            "t",
            &apply("node-b").force(),
            &Patch::Apply(node_status("b", true, 2)),
        )
        .await
        .expect("forced");
    assert_eq!(forced.status.as_ref().map(|s| s.ready_nodes), Some(2));
    let a_fields = managed_by(&forced, "node-a").expect("node-a still owns its entry");
    assert!(
        a_fields["f:status"].get("f:readyNodes").is_none(),
        "force took readyNodes over: {a_fields}"
    );

    // Someone else (an Update) sets a message on b's entry.
    let mut edited = forced.clone();
    if let Some(s) = edited.status.as_mut() {
        s.nodes
            .iter_mut()
            .find(|n| n.node_name == "b")
            .expect("b")
            .message = Some("looked at by hand".into());
    }
    let edited = api
        .replace_status("t", &PostParams::default(), &edited)
        .await
        .expect("update");

    // node-a stops applying its entry: only its entry goes.
    let without_a = json!({
        "apiVersion": "twig.dev/v1alpha1", "kind": "SandboxTemplate",
        "metadata": {"name": "t"}, "status": {"readyNodes": 2},
    });
    let after = api
        .patch_status("t", &apply("node-a"), &Patch::Apply(without_a))
        .await
        .expect("apply without a");
    assert_eq!(entry_names(&after), ["b"]);
    // node-b re-applies its entry without the message: the message is not node-b's to remove.
    let after = api
        .patch_status(
            "t",
            &apply("node-b").force(),
            &Patch::Apply(node_status("b", true, 1)),
        )
        .await
        .expect("apply b again");
    let b = &after.status.as_ref().expect("status").nodes[0];
    assert_eq!(b.message.as_deref(), Some("looked at by hand"));
    assert_ne!(after.resource_version(), edited.resource_version());

    // An apply that changes nothing does not write.
    let same = api
        .patch_status(
            "t",
            &apply("node-b").force(),
            &Patch::Apply(node_status("b", true, 1)),
        )
        .await
        .expect("no-op apply");
    assert_eq!(same.resource_version(), after.resource_version());

    // The apply is pinned to a resourceVersion when it names one.
    let mut stale = node_status("b", false, 1);
    stale["metadata"]["resourceVersion"] = json!(edited.resource_version());
    let err = api
        .patch_status("t", &apply("node-b").force(), &Patch::Apply(stale))
        .await
        .expect_err("stale");
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 409),
        "{err}"
    );

    // JSON Patch: a test of null passes on a missing field, fails on a present one.
    let add: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers", "value": null},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]},
    ]))
    .expect("patch");
    let patched = api
        .patch(
            "t",
            &PatchParams::default(),
            &Patch::Json::<()>(add.clone()),
        )
        .await
        .expect("json patch");
    assert_eq!(patched.finalizers(), ["x/y"]);
    let err = api
        .patch("t", &PatchParams::default(), &Patch::Json::<()>(add))
        .await
        .expect_err("test fails");
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 422),
        "{err}"
    );
}

#[tokio::test]
async fn many_nodes_apply_their_template_entries_without_losing_any() {
    let server = api_server().await;
    let client = server.client();
    let nodes: Vec<String> = (0..6).map(|i| format!("node-{i}")).collect();
    let fakes: Vec<Arc<FakeNode>> = nodes.iter().map(|_| Arc::default()).collect();
    let _controllers: Vec<_> = nodes
        .iter()
        .zip(&fakes)
        .map(|(n, f)| start_controller(&server, n, f))
        .collect();
    create(&client, &template("shared", 512)).await;
    let done = wait_for(
        &client,
        "shared",
        "ready on every node",
        |t: &SandboxTemplate| {
            t.status
                .as_ref()
                .is_some_and(|s| s.ready_nodes == 6 && s.nodes.len() == 6)
        },
    )
    .await;
    assert_eq!(entry_names(&done), nodes);
    for node in &nodes {
        let fields = managed_by(&done, &format!("twig-controller/{node}"))
            .unwrap_or_else(|| panic!("no managedFields of {node}"));
        let key = format!("k:{{\"nodeName\":\"{node}\"}}");
        assert!(
            fields["f:status"]["f:nodes"].get(&key).is_some(),
            "{node} does not own its entry: {fields}"
        );
        let others = fields["f:status"]["f:nodes"]
            .as_object()
            .map_or(0, |o| o.len());
        assert_eq!(others, 1, "{node} owns other nodes' entries: {fields}");
    }
}

fn condition<'a>(
    conditions: &'a [k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    type_: &str,
) -> (&'a str, &'a str) {
    let c = conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {conditions:?}"));
    (c.status.as_str(), c.reason.as_str())
}

#[tokio::test]
async fn snapshot_clone_and_rollback_report_ready_progressing_and_failure() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    running_pod(&client, "bob", "node-a").await;
    create(
        &client,
        &Snapshot::new(
            "base",
            SnapshotSpec {
                pod_uid: None,
                export: false,
                failure_deadline_seconds: None,
                pod_name: "redis".into(),
                mode: SnapshotMode::Incremental,
                deletion_policy: DeletionPolicy::Delete,
                ttl_seconds_after_ready: None,
            },
        ),
    )
    .await;
    let snap = wait_for(&client, "base", "Ready", |s: &Snapshot| {
        s.status.as_ref().is_some_and(|st| st.phase == Phase::Ready)
    })
    .await;
    let conds = snap.status.expect("status").conditions;
    assert_eq!(condition(&conds, "Ready"), ("True", "SnapshotTaken"));
    assert_eq!(condition(&conds, "Progressing").0, "False");
    assert_eq!(condition(&conds, "Failure").0, "False");

    // A Clone in progress, then Ready.
    let clone = PodClone::new(
        "fork",
        CloneSpec {
            failure_deadline_seconds: None,
            source: CloneSource {
                snapshot_name: Some("base".into()),
                pod_name: None,
            },
            replicas: 2,
            name_prefix: None,
            labels: None,
        },
    );
    create(&client, &clone).await;
    let progressing = wait_for(&client, "fork", "InProgress", |c: &PodClone| {
        c.status
            .as_ref()
            .is_some_and(|s| s.phase == Phase::InProgress)
    })
    .await;
    let conds = progressing.status.expect("status").conditions;
    assert_eq!(condition(&conds, "Progressing"), ("True", "PodsNotReady"));
    assert_eq!(condition(&conds, "Ready").0, "False");
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), NS);
    for name in ["fork-0", "fork-1"] {
        let pod = eventually(name, || {
            let pods = pods.clone();
            async move { pods.get_opt(name).await.ok().flatten() }
        })
        .await;
        mark_ready(&client, &pod).await;
    }
    let ready = wait_for(&client, "fork", "Ready", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| s.phase == Phase::Ready)
    })
    .await;
    let conds = ready.status.expect("status").conditions;
    assert_eq!(condition(&conds, "Ready"), ("True", "AllPodsReady"));
    assert_eq!(condition(&conds, "Progressing").0, "False");
    assert_eq!(condition(&conds, "Failure").0, "False");

    // A Rollback that succeeds, and one that fails.
    let rollback = |name: &str, pod: &str| {
        Rollback::new(
            name,
            RollbackSpec {
                pod_uid: None,
                safety_snapshot: true,
                failure_deadline_seconds: None,
                pod_name: pod.into(),
                snapshot_name: "base".into(),
            },
        )
    };
    create(&client, &rollback("undo", "redis")).await;
    create(&client, &rollback("wrong", "bob")).await;
    let done = wait_for(&client, "undo", "Ready", |r: &Rollback| {
        r.status.as_ref().is_some_and(|s| s.phase == Phase::Ready)
    })
    .await;
    let conds = done.status.expect("status").conditions;
    assert_eq!(condition(&conds, "Ready"), ("True", "RolledBack"));
    assert_eq!(condition(&conds, "Progressing").0, "False");
    let failed = wait_for(&client, "wrong", "Failed", |r: &Rollback| {
        r.status.as_ref().is_some_and(|s| s.phase == Phase::Failed)
    })
    .await;
    let conds = failed.status.expect("status").conditions;
    assert_eq!(condition(&conds, "Failure"), ("True", "NotInLineage"));
    assert_eq!(condition(&conds, "Ready").0, "False");
    assert_eq!(condition(&conds, "Progressing").0, "False");
}

#[tokio::test]
async fn memory_twig_vmm_does_not_accept_is_refused() {
    // The schema refuses it at admission…
    let server = api_server().await;
    let client = server.client();
    let api: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    for (mib, expected) in [
        (8, "should be greater than or equal to 16"),
        (4096, "should be less than or equal to 3072"),
        (255, "should be a multiple of 2"),
    ] {
        let err = api
            .create(&PostParams::default(), &template(&format!("m{mib}"), mib))
            .await
            .expect_err("refused");
        assert!(err.to_string().contains(expected), "{mib}: {err}");
    }

    // …and the controller refuses what got past an older schema, with a clear message.
    let server = TestApiServer::start(None).await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    create(&client, &template("huge", 4096)).await;
    let refused = wait_for(&client, "huge", "refused", |t: &SandboxTemplate| {
        t.status.as_ref().is_some_and(|s| !s.nodes.is_empty())
    })
    .await;
    let entry = &refused.status.expect("status").nodes[0];
    assert!(!entry.ready);
    assert_eq!(
        entry.message.as_deref(),
        Some("spec.memoryMiB 4096 is not accepted by twig-vmm: guest RAM is a multiple of 2 MiB from 16 to 3072 MiB")
    );
    expect_reasons(&client, "huge", &["Invalid"]).await;
    assert!(!fake
        .calls()
        .iter()
        .any(|c| matches!(c, Call::EnsureTemplate(_))));
}
