//! Snapshot sizes in status (`memoryBytes`, `diskBytes`, `restoreSize`),
//! from the shim's answer or, for a shim that predates them, from the
//! node's GetSnapshot; and the node store's usage as `twig_node_store_*`
//! gauges, refreshed from GetStoreUsage and dropped while it fails.

use twig_controller_testkit as support;

use std::sync::Arc;

use kube::api::DynamicObject;
use kube::discovery::ApiResource;
use kube::{Api, Client};
use twig_controller::crd::{
    bytes_quantity, DeletionPolicy, Phase, Snapshot, SnapshotMode, SnapshotSpec,
};

use support::fake::{
    FakeNode, DISK_BYTES, FULL_MEMORY_BYTES, PAGE_BYTES, RESTORE_BYTES, STORE_CAPACITY_BYTES,
};
use support::{api_server, eventually, running_pod, start_controller, Controller, NS};

fn snapshot(name: &str, mode: SnapshotMode) -> Snapshot {
    Snapshot::new(
        name,
        SnapshotSpec {
            pod_uid: None,
            export: false,
            failure_deadline_seconds: None,
            pod_name: "redis".to_string(),
            mode,
            deletion_policy: DeletionPolicy::Delete,
            ttl_seconds_after_ready: None,
        },
    )
}

async fn ready(client: &Client, name: &str) -> Snapshot {
    let api: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    eventually(&format!("snapshot {name} Ready"), || {
        let api = api.clone();
        async move {
            let s = api.get(name).await.ok()?;
            (s.status.as_ref()?.phase == Phase::Ready).then_some(s)
        }
    })
    .await
}

/// The status as stored (JSON), as kubectl would print it.
async fn raw_status(client: &Client, name: &str) -> serde_json::Value {
    let ar = ApiResource::erase::<Snapshot>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &ar);
    api.get(name).await.expect("get").data["status"].clone()
}

/// The value of the sample `name{node="…"}` in the metrics text, if any.
fn sample(ctrl: &Controller, name: &str, node: &str) -> Option<u64> {
    let text = ctrl.metrics.encode().expect("metrics encode");
    let prefix = format!("{name}{{node=\"{node}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.parse().expect("an integer gauge"))
}

#[test]
fn restore_sizes_are_exact_quantities() {
    for (bytes, text) in [
        (0, "0"),
        (1000, "1000"),
        (4096, "4Ki"),
        (268_435_456, "256Mi"),
        (RESTORE_BYTES, "1152Mi"),
        (3 << 30, "3Gi"),
        ((1 << 30) + 1, "1073741825"),
    ] {
        assert_eq!(bytes_quantity(bytes).0, text, "{bytes}");
    }
}

#[tokio::test]
async fn snapshot_status_carries_memory_disk_and_restore_sizes() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;

    support::create(&client, &snapshot("full", SnapshotMode::Full)).await;
    let full = ready(&client, "full").await.status.expect("status");
    assert_eq!(full.memory_bytes, Some(FULL_MEMORY_BYTES));
    assert_eq!(full.disk_bytes, Some(DISK_BYTES));
    assert_eq!(
        full.restore_size.as_ref().map(|q| q.0.as_str()),
        Some("1152Mi")
    );

    support::create(&client, &snapshot("layer", SnapshotMode::Incremental)).await;
    let layer = ready(&client, "layer").await.status.expect("status");
    assert!(layer.parent.is_some(), "{layer:?}");
    assert_eq!(layer.memory_bytes, Some(PAGE_BYTES), "its own layer only");
    assert_eq!(layer.disk_bytes, Some(DISK_BYTES));
    assert_eq!(
        layer.restore_size, full.restore_size,
        "a restore maps all of RAM"
    );

    let raw = raw_status(&client, "layer").await;
    assert_eq!(raw["memoryBytes"], serde_json::json!(PAGE_BYTES));
    assert_eq!(raw["diskBytes"], serde_json::json!(DISK_BYTES));
    assert_eq!(raw["restoreSize"], serde_json::json!("1152Mi"));
}

#[tokio::test]
async fn sizes_a_shim_does_not_report_come_from_the_node_store() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    fake.shim_without_sizes();
    let _ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;

    support::create(&client, &snapshot("old-shim", SnapshotMode::Full)).await;
    ready(&client, "old-shim").await;
    let api: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    let status = eventually("the node's sizes in status", || {
        let api = api.clone();
        async move {
            let s = api.get("old-shim").await.ok()?.status?;
            s.restore_size.is_some().then_some(s)
        }
    })
    .await;
    assert_eq!(status.phase, Phase::Ready);
    assert_eq!(status.memory_bytes, Some(FULL_MEMORY_BYTES));
    assert_eq!(status.disk_bytes, Some(DISK_BYTES));
    assert_eq!(status.restore_size, Some(bytes_quantity(RESTORE_BYTES)));
}

#[tokio::test]
async fn node_store_usage_is_exported_per_node_and_dropped_while_unknown() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let ctrl = start_controller(&server, "node-a", &fake);
    let metric = |name: &str| sample(&ctrl, name, "node-a");

    let empty = eventually("the store gauges", || async {
        metric("twig_node_store_capacity_bytes").map(|c| {
            (
                c,
                metric("twig_node_store_bytes"),
                metric("twig_node_store_snapshots"),
            )
        })
    })
    .await;
    assert_eq!(empty, (STORE_CAPACITY_BYTES, Some(0), Some(0)));
    let text = ctrl.metrics.encode().unwrap();
    for family in [
        "twig_node_store_bytes",
        "twig_node_store_capacity_bytes",
        "twig_node_store_free_bytes",
        "twig_node_store_snapshots",
        "twig_node_store_templates",
    ] {
        assert!(text.contains(&format!("# TYPE {family} gauge")), "{text}");
    }

    running_pod(&client, "redis", "node-a").await;
    support::create(&client, &snapshot("full", SnapshotMode::Full)).await;
    ready(&client, "full").await;
    support::create(&client, &snapshot("layer", SnapshotMode::Incremental)).await;
    ready(&client, "layer").await;
    let held = FULL_MEMORY_BYTES + PAGE_BYTES + 2 * DISK_BYTES;
    eventually("two snapshots counted", || async {
        (metric("twig_node_store_snapshots") == Some(2)).then_some(())
    })
    .await;
    assert_eq!(metric("twig_node_store_bytes"), Some(held));
    assert_eq!(
        metric("twig_node_store_free_bytes"),
        Some(STORE_CAPACITY_BYTES - held)
    );
    assert_eq!(metric("twig_node_store_templates"), Some(0));

    // The node daemon stops answering: no stale numbers; then it is back.
    fake.fail_store_usage(usize::MAX);
    eventually("the series dropped", || async {
        metric("twig_node_store_bytes").is_none().then_some(())
    })
    .await;
    assert_eq!(metric("twig_node_store_free_bytes"), None);
    fake.fail_store_usage(0);
    eventually("the series back", || async {
        (metric("twig_node_store_bytes") == Some(held)).then_some(())
    })
    .await;
}
