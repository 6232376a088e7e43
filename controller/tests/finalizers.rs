//! Finalizers: added and removed through kube-runtime's helper, and released
//! by another node once the node they belong to is gone.

use twig_controller_testkit as support;

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kube::api::DeleteParams;
use kube::{Api, ResourceExt};
use twig_controller::crd::{Phase, SandboxTemplate, SandboxTemplateSpec, Snapshot};

use support::fake::{Call, FakeNode};
use support::snapshot;
use support::{
    api_server, create, delete_node, event_reasons, eventually, register_node, running_pod,
    start_controller, wait_for, wait_gone, CONTROLLER, NS,
};

const SNAPSHOT_FINALIZER: &str = "twig.dev/snapshot-data";

fn phase_is(phase: Phase) -> impl Fn(&Snapshot) -> bool {
    move |s| s.status.as_ref().is_some_and(|st| st.phase == phase)
}

fn template(name: &str) -> SandboxTemplate {
    SandboxTemplate::new(
        name,
        SandboxTemplateSpec {
            image: "python:3.12".into(),
            vcpus: 1,
            memory_mib: 256,
            command: None,
            warmup: None,
            egress_policy: None,
        },
    )
}

#[tokio::test]
async fn snapshot_finalizer_is_added_and_removed_through_the_helper() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    running_pod(&client, "elsewhere", "node-b").await;
    create(&client, &snapshot("other-node", "elsewhere")).await;
    let created = create(&client, &snapshot("snap", "redis")).await;
    let ready = wait_for(&client, "snap", "Ready", phase_is(Phase::Ready)).await;
    assert_eq!(ready.finalizers(), [SNAPSHOT_FINALIZER]);

    // The helper adds and removes finalizers with JSON patches, never with a whole-object update.
    let accesses = server.accesses(CONTROLLER);
    let verbs: Vec<&str> = accesses
        .iter()
        .filter(|a| a.resource == "snapshots")
        .map(|a| a.verb.as_str())
        .collect();
    assert!(verbs.contains(&"patch"), "{verbs:?}");
    assert!(!verbs.contains(&"update"), "{verbs:?}");
    // A snapshot this node does not take gets no finalizer from it.
    let other: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    assert!(other
        .get("other-node")
        .await
        .expect("get")
        .finalizers()
        .is_empty());

    other
        .delete("snap", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone::<Snapshot>(&client, "snap").await;
    let id = created.uid().expect("uid");
    assert!(fake.calls().contains(&Call::DeleteSnapshot(id.clone())));
    assert!(!fake.stored(&id));
}

#[tokio::test]
async fn deleting_a_snapshot_whose_node_is_gone_releases_its_finalizer() {
    let server = api_server().await;
    // A node releases another's finalizer within the chart's node restriction.
    support::enforce_chart_policies(&server);
    let client = server.client();
    register_node(&client, "node-a").await;
    register_node(&client, "node-b").await;
    let (fake_a, fake_b) = (Arc::new(FakeNode::default()), Arc::new(FakeNode::default()));
    let _a = start_controller(&server, "node-a", &fake_a);
    let b = start_controller(&server, "node-b", &fake_b);
    running_pod(&client, "on-b", "node-b").await;
    create(&client, &snapshot("snap-b", "on-b")).await;
    wait_for(&client, "snap-b", "Ready", phase_is(Phase::Ready)).await;

    // node-b's controller dies with its node; the Node object is still there.
    drop(b);
    let api: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    api.delete("snap-b", &DeleteParams::default())
        .await
        .expect("delete");
    eventually("node-a to look at node-b's Node object", || async {
        server
            .accesses(CONTROLLER)
            .iter()
            .any(|a| a.resource == "nodes" && a.verb == "get")
            .then_some(())
    })
    .await;
    let held = api.get("snap-b").await.expect("still held");
    assert!(held.metadata.deletion_timestamp.is_some());
    assert_eq!(
        held.finalizers(),
        [SNAPSHOT_FINALIZER],
        "released while its node may come back"
    );

    // The node is removed from the cluster: another node lets the object go.
    delete_node(&client, "node-b").await;
    wait_gone::<Snapshot>(&client, "snap-b").await;
    assert!(event_reasons(&client, "snap-b")
        .await
        .contains(&"NodeGone".to_string()));
    assert!(
        !fake_a
            .calls()
            .iter()
            .any(|c| matches!(c, Call::DeleteSnapshot(_))),
        "node-a touched its own store for node-b's snapshot: {:?}",
        fake_a.calls()
    );
}

#[tokio::test]
async fn each_node_holds_its_own_template_finalizer_and_gone_nodes_are_released() {
    let server = api_server().await;
    // A node releases another's finalizer within the chart's node restriction.
    support::enforce_chart_policies(&server);
    let client = server.client();
    register_node(&client, "node-a").await;
    register_node(&client, "node-b").await;
    let (fake_a, fake_b) = (Arc::new(FakeNode::default()), Arc::new(FakeNode::default()));
    let _a = start_controller(&server, "node-a", &fake_a);
    let b = start_controller(&server, "node-b", &fake_b);
    create(&client, &template("python")).await;
    let ready = wait_for(
        &client,
        "python",
        "ready on both nodes",
        |t: &SandboxTemplate| t.status.as_ref().is_some_and(|s| s.ready_nodes == 2),
    )
    .await;
    let mut finalizers = ready.finalizers().to_vec();
    finalizers.sort();
    assert_eq!(
        finalizers,
        ["twig.dev/template.node-a", "twig.dev/template.node-b"]
    );

    // node-b goes down; deleting the template removes it from node-a at once.
    drop(b);
    let api: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    api.delete("python", &DeleteParams::default())
        .await
        .expect("delete");
    let held = wait_for(
        &client,
        "python",
        "node-a's finalizer and entry gone",
        |t: &SandboxTemplate| t.finalizers() == ["twig.dev/template.node-b"],
    )
    .await;
    let nodes: Vec<String> = held
        .status
        .expect("status")
        .nodes
        .into_iter()
        .map(|n| n.node_name)
        .collect();
    assert_eq!(nodes, ["node-b"]);
    assert!(fake_a
        .calls()
        .contains(&Call::DeleteTemplate("default/python".into())));

    // node-b is removed from the cluster: node-a releases its finalizer.
    let node_api: Api<Node> = Api::all(client.clone());
    assert!(node_api.get_opt("node-b").await.expect("get").is_some());
    delete_node(&client, "node-b").await;
    wait_gone::<SandboxTemplate>(&client, "python").await;
    assert!(!fake_b
        .calls()
        .contains(&Call::DeleteTemplate("default/python".into())));
    assert!(event_reasons(&client, "python")
        .await
        .contains(&"NodeGone".to_string()));
}

#[test]
fn long_node_names_give_valid_finalizers() {
    let long = format!("{}.example.internal", "ip-10-0-0-1".repeat(20));
    let f = twig_controller::context::template_finalizer(&long);
    let (prefix, name) = f.split_once('/').expect("qualified");
    assert_eq!(prefix, "twig.dev");
    assert!(name.len() <= 63, "{name}");
    assert!(name.starts_with("template.ip-10-0-0-1"), "{name}");
    assert!(
        name.ends_with(|c: char| c.is_ascii_alphanumeric()),
        "{name}"
    );
    let other = twig_controller::context::template_finalizer(&format!("{long}x"));
    assert_ne!(f, other, "two long names share a finalizer");
    assert_eq!(
        twig_controller::context::template_finalizer("node-a"),
        "twig.dev/template.node-a"
    );
}
