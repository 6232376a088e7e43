//! Egress policy in the API: a SandboxTemplate's `spec.egressPolicy` refused
//! by the CRD schema where the schema can say it (enums, port bounds) and by
//! the reconciler where it cannot (CIDR syntax, port ranges upside down),
//! always naming the field; the example's policies are valid; clone pods
//! carry their source's `twig.dev/egress-policy` annotation.

use twig_controller_testkit as support;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use kube::api::{ApiResource, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Resource};
use serde_json::{json, Value};
use twig_controller::crd::{
    CloneSource, CloneSpec, Phase, PodClone, SandboxTemplate, SandboxTemplateSpec, Snapshot,
    SnapshotSpec, EGRESS_POLICY_ANNOTATION, NETWORK_ANNOTATION, RESTORE_FROM_ANNOTATION,
    TEMPLATE_ANNOTATION,
};
use twig_controller::reconcile::clone::{clone_pod, Restore};
use twig_controller::reconcile::template;
use twig_net::{effective_policy, Action, EgressPolicy};
use twig_proto::contract::{ENVD_ANNOTATION, ENVD_TOKEN_SHA256_ANNOTATION};

use support::fake::{Call, FakeNode};
use support::{
    api_server, create, events_about, eventually, expect_reasons, running_pod, start_controller,
    wait_for, NS,
};

fn template_json(name: &str, policy: Value) -> Value {
    json!({
        "apiVersion": "twig.dev/v1alpha1",
        "kind": "SandboxTemplate",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"image": "python:3.12", "vcpus": 1, "memoryMiB": 64, "egressPolicy": policy},
    })
}

fn node_entry(t: &SandboxTemplate) -> Option<(bool, String)> {
    let entry = t.status.as_ref()?.nodes.first()?;
    Some((entry.ready, entry.message.clone().unwrap_or_default()))
}

#[tokio::test]
async fn the_schema_refuses_what_it_can_say_naming_the_field() {
    let server = api_server().await;
    let api: Api<DynamicObject> = Api::namespaced_with(
        server.client(),
        NS,
        &ApiResource::erase::<SandboxTemplate>(&()),
    );
    for (name, policy, expected) in [
        (
            "action",
            json!({"defaultAction": "block"}),
            vec!["spec.egressPolicy.defaultAction: Unsupported value: \"block\""],
        ),
        (
            "protocol",
            json!({"allow": [{"cidr": "1.2.3.0/24", "protocol": "sctp"}]}),
            vec!["spec.egressPolicy.allow[0].protocol: Unsupported value: \"sctp\""],
        ),
        (
            "ports",
            json!({"deny": [{"cidr": "1.2.3.0/24", "ports": [{"port": 0}, {"port": 80, "endPort": 70000}]}]}),
            vec![
                "spec.egressPolicy.deny[0].ports[0].port: Invalid value: 0",
                "should be greater than or equal to 1",
                "spec.egressPolicy.deny[0].ports[1].endPort: Invalid value: 70000",
                "should be less than or equal to 65535",
            ],
        ),
        (
            "nocidr",
            json!({"allow": [{"protocol": "tcp"}]}),
            vec!["spec.egressPolicy.allow[0].cidr: Required value"],
        ),
    ] {
        let obj: DynamicObject =
            serde_json::from_value(template_json(name, policy)).expect("object");
        let err = api
            .create(&PostParams::default(), &obj)
            .await
            .expect_err("refused at admission")
            .to_string();
        for expected in expected {
            assert!(
                err.contains(expected),
                "{name}: {expected:?} missing from {err}"
            );
        }
    }
    // A valid policy is admitted, and reads back as the same policy.
    let policy = json!({"defaultAction": "deny", "allow": [{"cidr": "0.0.0.0/0", "protocol": "tcp", "ports": [{"port": 443}]}]});
    let obj: DynamicObject =
        serde_json::from_value(template_json("ok", policy.clone())).expect("object");
    api.create(&PostParams::default(), &obj)
        .await
        .expect("admitted");
    let typed: Api<SandboxTemplate> = Api::namespaced(server.client(), NS);
    let stored = typed.get("ok").await.expect("stored");
    let expected: EgressPolicy = serde_json::from_value(policy).expect("policy");
    assert_eq!(stored.spec.egress_policy, Some(expected));
}

#[tokio::test]
async fn the_reconciler_refuses_what_the_schema_cannot_say_and_recovers_once_fixed() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    // Past the schema: CIDR syntax, host bits, IPv6, a range upside down,
    // ports on ICMP.
    let policy = json!({
        "allow": [{"cidr": "10.0.0.1/8"}, {"cidr": "fd00::/8"}],
        "deny": [
            {"cidr": "not-a-cidr"},
            {"cidr": "1.2.3.0/24", "ports": [{"port": 9, "endPort": 8}]},
            {"cidr": "1.2.3.0/24", "protocol": "icmp", "ports": [{"port": 1}]},
        ],
    });
    let bad: SandboxTemplate = serde_json::from_value(template_json("bad", policy)).expect("typed");
    create(&client, &bad).await;
    let refused = wait_for(&client, "bad", "refused", |t: &SandboxTemplate| {
        node_entry(t).is_some()
    })
    .await;
    let (ready, message) = node_entry(&refused).expect("entry");
    assert!(!ready, "an invalid policy must not make the template ready");
    for expected in [
        "spec.egressPolicy.allow[0].cidr: \"10.0.0.1/8\" has host bits set (did you mean 10.0.0.0/8?)",
        "spec.egressPolicy.allow[1].cidr: \"fd00::/8\" is an IPv6 network",
        "spec.egressPolicy.deny[0].cidr: \"not-a-cidr\" is not an IPv4 CIDR",
        "spec.egressPolicy.deny[1].ports[0].endPort: 8 is below port 9",
        "spec.egressPolicy.deny[2].ports: ICMP has no ports",
    ] {
        assert!(message.contains(expected), "{expected:?} missing from {message}");
    }
    expect_reasons(&client, "bad", &["Invalid"]).await;
    let events = events_about(&client, "bad").await;
    let note = events[0].note.clone().unwrap_or_default();
    assert!(
        note.contains("spec.egressPolicy.deny[1].ports[0].endPort: 8 is below port 9"),
        "{note}"
    );
    assert!(
        !fake
            .calls()
            .iter()
            .any(|c| matches!(c, Call::EnsureTemplate(_))),
        "an invalid template must not be built"
    );

    // Fixed in place: built and ready, nothing left of the complaint.
    let api: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    let fix = json!({"spec": {"egressPolicy": {"allow": [{"cidr": "10.0.0.0/8"}], "deny": [{"cidr": "1.2.3.0/24", "ports": [{"port": 8, "endPort": 9}]}]}}});
    api.patch("bad", &PatchParams::default(), &Patch::Merge(&fix))
        .await
        .expect("patched");
    let ready = wait_for(&client, "bad", "ready", |t: &SandboxTemplate| {
        node_entry(t).is_some_and(|(ready, _)| ready)
    })
    .await;
    assert_eq!(node_entry(&ready), Some((true, String::new())));
    assert!(fake
        .calls()
        .iter()
        .any(|c| *c == Call::EnsureTemplate(format!("{NS}/bad"))));
}

#[test]
fn template_validation_names_the_policy_field_of_a_whole_policy_problem() {
    let allow = (0..40_000u32)
        .map(|i| twig_net::EgressRule::cidr(&std::net::Ipv4Addr::from(0x0b00_0000 + i).to_string()))
        .collect();
    let t = SandboxTemplate::new(
        "big",
        SandboxTemplateSpec {
            image: "python:3.12".into(),
            vcpus: 1,
            memory_mib: 64,
            command: None,
            warmup: None,
            egress_policy: Some(EgressPolicy {
                allow,
                ..Default::default()
            }),
        },
    );
    let err = template::validate(&t).expect_err("too big");
    assert!(
        err.starts_with("invalid egress policy: spec.egressPolicy: the policy expands to"),
        "{err}"
    );
}

/// The example's template passes the reconciler's checks, and its pods'
/// effective policies are the template's and the annotation's.
#[test]
fn the_examples_policies_are_valid_and_the_annotation_replaces_the_templates() {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/template/egress.yaml");
    let text = std::fs::read_to_string(&path).expect("example");
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("yaml");
    let tpl: SandboxTemplate = serde_json::from_value(docs[0].clone()).expect("template");
    assert_eq!(template::validate(&tpl), Ok(()));
    let policy = tpl.spec.egress_policy.as_ref().expect("a policy");
    assert_eq!(policy.default_action, Action::Deny);
    let pods: Vec<Pod> = docs[1..]
        .iter()
        .map(|d| serde_json::from_value(d.clone()).expect("pod"))
        .collect();
    let annotation = |pod: &Pod| {
        pod.metadata
            .annotations
            .as_ref()?
            .get(EGRESS_POLICY_ANNOTATION)
            .cloned()
    };
    assert_eq!(
        effective_policy(Some(policy), annotation(&pods[0]).as_deref()).as_ref(),
        Ok(policy)
    );
    let own = effective_policy(Some(policy), annotation(&pods[1]).as_deref()).expect("valid");
    assert_eq!(own.allow.len(), 1);
    assert!(own.deny.is_empty(), "rules are not merged: {own:?}");
}

fn source_pod(annotations: Option<BTreeMap<String, String>>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some("agent".into()),
            namespace: Some(NS.into()),
            annotations,
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "main".into(),
                image: Some("python:3.12".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    }
}

fn a_clone() -> PodClone {
    let mut clone = PodClone::new(
        "fork",
        CloneSpec {
            failure_deadline_seconds: None,
            source: CloneSource {
                snapshot_name: Some("snap".into()),
                pod_name: None,
            },
            replicas: 2,
            name_prefix: None,
            labels: None,
        },
    );
    clone.meta_mut().namespace = Some(NS.into());
    clone.meta_mut().uid = Some("clone-uid".into());
    clone
}

#[test]
fn a_clone_pod_carries_its_sources_egress_policy_annotation() {
    let policy = r#"{"defaultAction":"deny","allow":[{"cidr":"203.0.113.0/24"}]}"#;
    let source = source_pod(Some(BTreeMap::from([
        (EGRESS_POLICY_ANNOTATION.to_string(), policy.to_string()),
        (NETWORK_ANNOTATION.to_string(), "none".to_string()),
        (ENVD_ANNOTATION.to_string(), "true".to_string()),
        (ENVD_TOKEN_SHA256_ANNOTATION.to_string(), "ab".repeat(32)),
        ("team".to_string(), "not copied".to_string()),
    ])));
    let restore = Restore {
        snapshot_id: "snap-id",
        snapshot_name: "snap",
        node: "node-a",
        artifact: None,
    };
    let pod = clone_pod(&a_clone(), &source, &restore, 1).expect("pod");
    let annotations = pod.metadata.annotations.expect("annotations");
    assert_eq!(
        annotations
            .get(EGRESS_POLICY_ANNOTATION)
            .map(String::as_str),
        Some(policy)
    );
    assert_eq!(
        annotations.get(RESTORE_FROM_ANNOTATION).map(String::as_str),
        Some("snap-id")
    );
    assert_eq!(
        annotations.get(NETWORK_ANNOTATION).map(String::as_str),
        Some("none"),
        "a source without network has clones without it"
    );
    // The source's sandbox API runs in the memory its clones restore:
    // they keep it, and the token it requires.
    assert_eq!(
        annotations.get(ENVD_ANNOTATION).map(String::as_str),
        Some("true")
    );
    assert_eq!(
        annotations.get(ENVD_TOKEN_SHA256_ANNOTATION),
        Some(&"ab".repeat(32))
    );
    assert!(!annotations.contains_key("team"), "{annotations:?}");

    // No annotation on the source: none on the clone.
    let pod = clone_pod(&a_clone(), &source_pod(None), &restore, 0).expect("pod");
    let annotations = pod.metadata.annotations.expect("annotations");
    assert!(!annotations.contains_key(EGRESS_POLICY_ANNOTATION));
}

/// A running pod named by `name`, restored from `template`, and a Ready
/// Snapshot of it.
async fn snapshotted_pod_of_template(client: &kube::Client, name: &str, template: &str) {
    running_pod(client, name, "node-a").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let patch = json!({"metadata": {"annotations": {TEMPLATE_ANNOTATION: template}}});
    pods.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("annotate");
    let snap = Snapshot::new(
        &format!("{name}-snap"),
        SnapshotSpec {
            pod_uid: None,
            export: false,
            failure_deadline_seconds: None,
            pod_name: name.into(),
            mode: Default::default(),
            deletion_policy: Default::default(),
            ttl_seconds_after_ready: None,
        },
    );
    create(client, &snap).await;
    wait_for(client, &format!("{name}-snap"), "Ready", |s: &Snapshot| {
        s.status.as_ref().is_some_and(|s| s.phase == Phase::Ready)
    })
    .await;
}

fn clone_of_snapshot(name: &str, snapshot: &str) -> PodClone {
    PodClone::new(
        name,
        CloneSpec {
            failure_deadline_seconds: None,
            source: CloneSource {
                snapshot_name: Some(snapshot.into()),
                pod_name: None,
            },
            replicas: 2,
            name_prefix: None,
            labels: None,
        },
    )
}

#[tokio::test]
async fn clones_of_a_pod_restored_from_a_template_keep_the_templates_policy() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    let policy = json!({"defaultAction": "deny", "allow": [{"cidr": "0.0.0.0/0", "protocol": "tcp", "ports": [{"port": 443}]}]});
    let tpl: SandboxTemplate =
        serde_json::from_value(template_json("locked", policy.clone())).expect("typed");
    create(&client, &tpl).await;
    snapshotted_pod_of_template(&client, "agent", "locked").await;

    // The template's policy goes with the clone pods, and the template
    // they name bounds it (restore-from wins over it for the restore).
    create(&client, &clone_of_snapshot("fork", "agent-snap")).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let clones = eventually("2 clone pods", || {
        let pods = pods.clone();
        async move {
            let l = pods
                .list(&kube::api::ListParams::default().labels("twig.dev/clone=fork"))
                .await
                .ok()?;
            (l.items.len() == 2).then_some(l.items)
        }
    })
    .await;
    let expected: EgressPolicy = serde_json::from_value(policy).expect("policy");
    for pod in &clones {
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        let text = annotations
            .get(EGRESS_POLICY_ANNOTATION)
            .expect("the template's policy, as the annotation");
        assert_eq!(effective_policy(None, Some(text)), Ok(expected.clone()));
        assert_eq!(
            annotations.get(TEMPLATE_ANNOTATION).map(String::as_str),
            Some("locked")
        );
    }

    // A source whose template is gone: its policy is unknown, so no clone
    // is made (none may run looser than its source).
    snapshotted_pod_of_template(&client, "orphan", "deleted-template").await;
    create(&client, &clone_of_snapshot("orphan-fork", "orphan-snap")).await;
    let failed = wait_for(&client, "orphan-fork", "Failed", |c: &PodClone| {
        c.status.as_ref().is_some_and(|s| s.phase == Phase::Failed)
    })
    .await;
    let message = failed.status.and_then(|s| s.message).unwrap_or_default();
    assert!(
        message.starts_with(
            "TemplateNotFound: SandboxTemplate deleted-template of source pod orphan is gone"
        ),
        "{message}"
    );
    let listed = pods
        .list(&kube::api::ListParams::default().labels("twig.dev/clone=orphan-fork"))
        .await
        .expect("list");
    assert!(listed.items.is_empty(), "no clone pods: {:?}", listed.items);
}
