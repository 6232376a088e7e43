//! Snapshots exported to an OCI registry (`spec.export`) and Clones that
//! span nodes: the export through the fake node's `ExportSnapshot`, its
//! condition and artifact, its failures; Clone pods of an exported
//! Snapshot left to the scheduler (under the chart's admission policies),
//! of a node-local one bound to its node; a SandboxTemplate built on one
//! node and pulled, not built, by the next.

use twig_controller_testkit as support;

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{HostPathVolumeSource, Pod, Volume};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use twig_controller::context::Registry;
use twig_controller::crd::{
    Availability, ClonePlacement, CloneSource, CloneSpec, Phase, PodClone, SandboxTemplate,
    SandboxTemplateSpec, Snapshot, RESTORE_ARTIFACT_ANNOTATION, RESTORE_FROM_ANNOTATION,
};
use twig_controller::shim::ErrorCode;

use support::fake::{export_digest, FakeNode};
use support::{
    api_server, clone_pods, event_reasons, eventually, running_pod, running_pod_with, snapshot,
    snapshot_in, start_controller, start_controller_with, wait_for, Controller, NS,
};

const REGISTRY: &str = "registry.example:5000";

fn registry() -> Registry {
    Registry::new(REGISTRY, "twig").expect("registry")
}

/// A controller of `node` that exports to [`REGISTRY`].
fn exporting_controller(
    server: &support::apiserver::TestApiServer,
    node: &str,
    fake: &Arc<FakeNode>,
) -> Controller {
    start_controller_with(server, node, fake, |c| c.with_registry(registry()))
}

/// Snapshot `name` of `pod` with `spec.export`.
fn exported(name: &str, pod: &str) -> Snapshot {
    let mut snap = snapshot(name, pod);
    snap.spec.export = true;
    snap
}

/// The `Exported` condition's (status, reason) once `ok` holds for it.
async fn exported_condition(
    client: &Client,
    name: &str,
    ok: impl Fn(&str, &str) -> bool,
) -> Snapshot {
    wait_for(client, name, "its Exported condition", |s: &Snapshot| {
        s.status.as_ref().is_some_and(|st| {
            st.conditions
                .iter()
                .any(|c| c.type_ == "Exported" && ok(&c.status, &c.reason))
        })
    })
    .await
}

/// Waits until the Events about `name` include `reasons`.
async fn saw_reasons(client: &Client, name: &str, reasons: &[&str]) {
    eventually(&format!("Events {reasons:?} about {name}"), || async {
        let seen = event_reasons(client, name).await;
        reasons
            .iter()
            .all(|r| seen.iter().any(|s| s == r))
            .then_some(())
    })
    .await;
}

fn condition<'a>(
    snap: &'a Snapshot,
    type_: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    snap.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .unwrap_or_else(|| panic!("no {type_} condition: {snap:?}"))
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exported_snapshot_names_its_artifact_and_says_so() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = exporting_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &exported("s1", "redis")).await;

    let snap = exported_condition(&client, "s1", |s, _| s == "True").await;
    let uid = snap.uid().expect("uid");
    let status = snap.status.clone().expect("status");
    assert_eq!(status.phase, Phase::Ready);
    let id = status.snapshot_id.clone().expect("snapshotID");
    assert_eq!(
        fake.export_calls(),
        [(
            id.clone(),
            format!("{REGISTRY}/twig/{NS}/s1:{uid}"),
            NS.to_string()
        )]
    );
    let artifact = status.artifact.clone().expect("artifact");
    assert_eq!(artifact.digest, export_digest(&id));
    assert_eq!(
        artifact.reference,
        format!("{REGISTRY}/twig/{NS}/s1@{}", artifact.digest)
    );
    assert!(artifact.bytes_uploaded > 0, "{artifact:?}");
    assert_eq!(status.availability, Some(Availability::NodeAndRegistry));
    let exported = condition(&snap, "Exported");
    assert_eq!(exported.reason, "Exported");
    assert!(
        exported.message.contains(&artifact.reference),
        "{exported:?}"
    );
    // The phase's conditions stand beside it.
    assert_eq!(condition(&snap, "Ready").status, "True");
    saw_reasons(&client, "s1", &["Exporting", "Exported"]).await;

    // Rechecks do not push again.
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    assert_eq!(fake.export_calls().len(), 1);

    // A node-local Snapshot says so and is not pushed.
    support::create(&client, &snapshot("local", "redis")).await;
    let local = snapshot_in(&client, "local", Phase::Ready).await;
    let local_status = local.status.expect("status");
    assert_eq!(local_status.availability, Some(Availability::Node));
    assert!(local_status.artifact.is_none());
    assert!(!local_status
        .conditions
        .iter()
        .any(|c| c.type_ == "Exported"));

    // Export may be turned on later, not off.
    let api: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    api.patch(
        "local",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"export": true}})),
    )
    .await
    .expect("turn export on");
    exported_condition(&client, "local", |s, _| s == "True").await;
    let off = api
        .patch(
            "local",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"export": false}})),
        )
        .await
        .expect_err("export cannot be turned off");
    assert!(off.to_string().contains("turned on, not off"), "{off}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_registry_is_retried_and_the_snapshot_stays_ready() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    // Unreachable until the test has seen it said: with the test's short
    // backoff two failures passed between two of its polls under load
    // (the CI of 2026-11-29), and it waited for a condition already gone.
    fake.answer_exports(&[ErrorCode::Unavailable; 1000]);
    let _ctrl = exporting_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &exported("s1", "redis")).await;

    let failed = exported_condition(&client, "s1", |s, r| {
        s == "False" && r == "RegistryUnavailable"
    })
    .await;
    let status = failed.status.clone().expect("status");
    assert_eq!(status.phase, Phase::Ready, "still usable on its node");
    assert!(status.ready_to_use);
    assert_eq!(status.availability, Some(Availability::Node));
    assert!(status.artifact.is_none());
    assert!(
        condition(&failed, "Exported").message.contains("retrying"),
        "{failed:?}"
    );

    // Retried with the backoff until the registry answers.
    fake.answer_exports(&[]);
    let done = exported_condition(&client, "s1", |s, _| s == "True").await;
    assert!(fake.export_calls().len() >= 2, "{:?}", fake.export_calls());
    assert!(done.status.expect("status").artifact.is_some());
    saw_reasons(&client, "s1", &["RegistryUnavailable", "Exported"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_export_and_no_registry_leave_the_snapshot_on_its_node() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    fake.answer_exports(&[ErrorCode::PermissionDenied, ErrorCode::DataLoss]);
    let _ctrl = exporting_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &exported("denied", "redis")).await;
    // Each failure is said (a Warning with its reason), the Snapshot stays
    // Ready, and the export is tried again (at the next look) until it works.
    let done = exported_condition(&client, "denied", |s, _| s == "True").await;
    saw_reasons(
        &client,
        "denied",
        &["PermissionDenied", "ExportFailed", "Exported"],
    )
    .await;
    assert_eq!(done.status.expect("status").phase, Phase::Ready);
    let warnings: Vec<_> = support::events_about(&client, "denied")
        .await
        .into_iter()
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .filter_map(|e| e.note)
        .collect();
    assert!(
        warnings.iter().any(|w| w.contains("was refused"))
            && warnings.iter().any(|w| w.contains("failed:")),
        "{warnings:?}"
    );
    assert_eq!(fake.export_calls().len(), 3);

    // A controller without a registry.
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &exported("nowhere", "redis")).await;
    let nowhere =
        exported_condition(&client, "nowhere", |s, r| s == "False" && r == "NoRegistry").await;
    let status = nowhere.status.clone().expect("status");
    assert_eq!(status.phase, Phase::Ready);
    assert_eq!(status.availability, Some(Availability::Node));
    assert!(
        condition(&nowhere, "Exported")
            .message
            .contains("--registry"),
        "{nowhere:?}"
    );
    assert!(fake.export_calls().is_empty());

    // Its Clone does not wait for an export that will not come: its pods
    // are bound to the snapshot's node.
    support::create(&client, &fork("local-fork", "nowhere", 1)).await;
    let pods = clone_pods(&client, "local-fork", 1).await;
    let spec = pods[0].spec.clone().expect("spec");
    assert_eq!(spec.node_name.as_deref(), Some("node-a"));
    assert!(!pods[0]
        .annotations()
        .contains_key(RESTORE_ARTIFACT_ANNOTATION));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_an_exported_snapshot_are_left_to_the_scheduler() {
    let server = api_server().await;
    support::enforce_chart_policies_with(&server, &[&format!("registry.host={REGISTRY}")]);
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = exporting_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &exported("shared", "redis")).await;
    support::create(&client, &snapshot("local", "redis")).await;
    // A Clone made while the export is under way waits for it.
    support::create(&client, &fork("wide", "shared", 3)).await;
    let snap = exported_condition(&client, "shared", |s, _| s == "True").await;
    let status = snap.status.expect("status");
    let artifact = status.artifact.expect("artifact").reference;
    let id = status.snapshot_id.expect("snapshotID");

    let pods = clone_pods(&client, "wide", 3).await;
    for pod in &pods {
        let spec = pod.spec.clone().expect("spec");
        assert_eq!(
            spec.node_name,
            None,
            "{} is left to the scheduler",
            pod.name_any()
        );
        assert_eq!(spec.runtime_class_name.as_deref(), Some("twig"));
        let annotations = pod.annotations();
        assert_eq!(annotations.get(RESTORE_FROM_ANNOTATION), Some(&id));
        assert_eq!(
            annotations.get(RESTORE_ARTIFACT_ANNOTATION),
            Some(&artifact)
        );
    }
    let clone = wait_for(&client, "wide", "its placement", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| {
            s.placement == Some(ClonePlacement::Scheduler) && s.replicas.len() == 3
        })
    })
    .await;
    let status = clone.status.expect("status");
    assert_eq!(
        status.node_name.as_deref(),
        Some("node-a"),
        "made by the snapshot's node"
    );
    assert!(status.replicas.iter().all(|r| r.node_name.is_none()));

    // The scheduler binds one to another node: its entry says where.
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut bound = pod_api.get("wide-0").await.expect("wide-0");
    if let Some(spec) = bound.spec.as_mut() {
        spec.node_name = Some("node-b".into());
    }
    pod_api
        .replace("wide-0", &Default::default(), &bound)
        .await
        .expect("bind wide-0");
    wait_for(&client, "wide", "wide-0 on node-b", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| {
            s.replicas
                .iter()
                .any(|r| r.name == "wide-0" && r.node_name.as_deref() == Some("node-b"))
        })
    })
    .await;

    // A node-local snapshot's clones are bound to its node, as before.
    support::create(&client, &fork("near", "local", 2)).await;
    for pod in clone_pods(&client, "near", 2).await {
        assert_eq!(
            pod.spec.clone().expect("spec").node_name.as_deref(),
            Some("node-a")
        );
        assert!(!pod.annotations().contains_key(RESTORE_ARTIFACT_ANNOTATION));
    }
    let near = wait_for(&client, "near", "its placement", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| s.placement.is_some())
    })
    .await;
    assert_eq!(
        near.status.expect("status").placement,
        Some(ClonePlacement::SnapshotNode)
    );

    // Exports and unbound clones need nothing the chart's role does not grant.
    let granted: BTreeSet<(String, String, String)> = support::rbac::CONTROLLER_RULES
        .iter()
        .flat_map(|(g, r, verbs)| {
            verbs
                .iter()
                .map(move |v| (g.to_string(), r.to_string(), v.to_string()))
        })
        .collect();
    let beyond: Vec<_> = server
        .accesses(support::CONTROLLER)
        .into_iter()
        .map(|a| (a.group, a.resource, a.verb))
        .filter(|a| !granted.contains(a))
        .collect();
    assert!(
        beyond.is_empty(),
        "beyond the controller's role: {beyond:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_paths_keep_clones_on_the_node_and_a_lost_node_copy_leaves_the_registry() {
    let server = api_server().await;
    support::enforce_chart_policies_with(&server, &[&format!("registry.host={REGISTRY}")]);
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = exporting_controller(&server, "node-a", &fake);
    let pod = running_pod_with(&client, "cache", "node-a", true, &[]).await;
    // The source mounts a host path: its clones stay where those files are.
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), NS);
    let mut with_host_path = pod.clone();
    if let Some(spec) = with_host_path.spec.as_mut() {
        spec.volumes = Some(vec![Volume {
            name: "data".into(),
            host_path: Some(HostPathVolumeSource {
                path: "/srv/data".into(),
                type_: None,
            }),
            ..Default::default()
        }]);
    }
    pod_api
        .replace("cache", &Default::default(), &with_host_path)
        .await
        .expect("a host path");
    support::create(&client, &exported("cache-snap", "cache")).await;
    let snap = exported_condition(&client, "cache-snap", |s, _| s == "True").await;
    support::create(&client, &fork("cache-fork", "cache-snap", 1)).await;
    let pods = clone_pods(&client, "cache-fork", 1).await;
    assert_eq!(
        pods[0].spec.clone().expect("spec").node_name.as_deref(),
        Some("node-a")
    );
    assert!(!pods[0]
        .annotations()
        .contains_key(RESTORE_ARTIFACT_ANNOTATION));

    // The node loses its copy: the Snapshot stays Ready, from the registry.
    let id = snap.status.and_then(|s| s.snapshot_id).expect("snapshotID");
    fake.lose(&id);
    let gone = wait_for(
        &client,
        "cache-snap",
        "availability Registry",
        |s: &Snapshot| {
            s.status
                .as_ref()
                .is_some_and(|st| st.availability == Some(Availability::Registry))
        },
    )
    .await;
    let status = gone.status.expect("status");
    assert_eq!(status.phase, Phase::Ready);
    assert!(status
        .message
        .unwrap_or_default()
        .contains("still in the registry"));
    saw_reasons(&client, "cache-snap", &["NodeCopyLost"]).await;
}

/// An exported snapshot outlives its node: once the node is gone, a Clone
/// of it is adopted by one other node's controller, which makes its pods,
/// left to the scheduler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_of_an_exported_snapshot_whose_node_is_gone_is_adopted_by_one_node() {
    let server = api_server().await;
    support::enforce_chart_policies_with(&server, &[&format!("registry.host={REGISTRY}")]);
    let client = server.client();
    for node in ["node-a", "node-b", "node-c"] {
        support::register_node(&client, node).await;
    }
    let fake = Arc::new(FakeNode::default());
    let ctrl_a = exporting_controller(&server, "node-a", &fake);
    running_pod(&client, "agent", "node-a").await;
    support::create(&client, &exported("kept", "agent")).await;
    let snap = exported_condition(&client, "kept", |s, _| s == "True").await;
    let artifact = snap
        .status
        .and_then(|s| s.artifact)
        .expect("artifact")
        .reference;
    // node-a's machine is gone, and its Node object with it.
    drop(ctrl_a);
    support::delete_node(&client, "node-a").await;
    let (fake_b, fake_c) = (Arc::new(FakeNode::default()), Arc::new(FakeNode::default()));
    let _b = exporting_controller(&server, "node-b", &fake_b);
    let _c = exporting_controller(&server, "node-c", &fake_c);
    support::create(&client, &fork("orphan", "kept", 2)).await;

    for pod in clone_pods(&client, "orphan", 2).await {
        assert_eq!(pod.spec.clone().expect("spec").node_name, None);
        assert_eq!(
            pod.annotations().get(RESTORE_ARTIFACT_ANNOTATION),
            Some(&artifact)
        );
    }
    let clone = wait_for(&client, "orphan", "its adopter", |c: &PodClone| {
        c.status
            .as_ref()
            .is_some_and(|s| s.adopted_by.is_some() && s.replicas.len() == 2)
    })
    .await;
    let status = clone.status.expect("status");
    let adopter = status.adopted_by.expect("adoptedBy");
    assert!(
        ["node-b", "node-c"].contains(&adopter.as_str()),
        "{adopter}"
    );
    assert_eq!(status.node_name.as_deref(), Some("node-a"));
    assert_eq!(status.placement, Some(ClonePlacement::Scheduler));
    saw_reasons(&client, "orphan", &["Adopted", "PodsCreated"]).await;
    let reasons = event_reasons(&client, "orphan").await;
    for once in ["Adopted", "PodsCreated"] {
        assert_eq!(
            reasons.iter().filter(|r| *r == once).count(),
            1,
            "one node adopts and makes the pods: {reasons:?}"
        );
    }
}

/// A SandboxTemplate is built once: the node that built it exports it, and
/// a node that joins later pulls that build instead of building its own
/// (twig-node keeps it only when its inputs are the same).
#[tokio::test]
async fn a_template_built_on_one_node_is_pulled_by_the_next_not_built() {
    let server = api_server().await;
    let client = server.client();
    let (fake_a, fake_b) = (Arc::new(FakeNode::default()), Arc::new(FakeNode::default()));
    let _a = exporting_controller(&server, "node-a", &fake_a);
    let template = SandboxTemplate::new(
        "py",
        SandboxTemplateSpec {
            image: "reg.example/py:3".into(),
            vcpus: 1,
            memory_mib: 128,
            command: None,
            warmup: None,
            egress_policy: None,
        },
    );
    support::create(&client, &template).await;
    let api: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    let entry = |t: &SandboxTemplate, node: &str| {
        t.status
            .as_ref()
            .and_then(|s| s.nodes.iter().find(|n| n.node_name == node).cloned())
    };
    let on_a = eventually("the template ready and exported on node-a", || {
        let api = api.clone();
        async move {
            let t = api.get("py").await.ok()?;
            entry(&t, "node-a").filter(|e| e.ready && e.artifact.is_some())
        }
    })
    .await;
    let id = format!("template.{NS}.py");
    let artifact = format!("{REGISTRY}/twig/{NS}/template-py@{}", export_digest(&id));
    assert_eq!(on_a.artifact.as_deref(), Some(artifact.as_str()));
    let exports = fake_a.export_calls();
    assert_eq!(exports.len(), 1, "{exports:?}");
    assert_eq!(exports[0].0, id);
    assert!(exports[0]
        .1
        .starts_with(&format!("{REGISTRY}/twig/{NS}/template-py:g")));
    assert_eq!(fake_a.build_pods(&format!("{NS}/py")).len(), 1);

    let _b = exporting_controller(&server, "node-b", &fake_b);
    let on_b = eventually("the template ready on node-b", || {
        let api = api.clone();
        async move {
            let t = api.get("py").await.ok()?;
            entry(&t, "node-b").filter(|e| e.ready)
        }
    })
    .await;
    assert_eq!(
        fake_b.pulled_templates(),
        [(format!("{NS}/py"), artifact.clone())],
        "node-b pulled node-a's build"
    );
    assert!(
        fake_b.build_pods(&format!("{NS}/py")).is_empty(),
        "and built none"
    );
    assert!(fake_b.export_calls().is_empty(), "nor pushed it again");
    assert_eq!(on_b.artifact.as_deref(), Some(artifact.as_str()));
}
