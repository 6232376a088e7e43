//! A pod snapshotted on one node runs on another (issue 26): two nodes in
//! the lab, each its own containerd, twig-snapshotter, twig-node and node
//! store, and the harness's registry (`docker-registry`). On node A a pod
//! made through CRI runs a counter (in tmpfs, on its rootfs disk); the Twig
//! service snapshots it and A's twig-node exports it; on node B, whose
//! store has never seen it, the test plays kubelet for a Clone's pod
//! (RunPodSandbox annotated `twig.dev/restore-from` with A's snapshot id and
//! `twig.dev/restore-artifact` with the artifact): B's twig-node pulls it,
//! restoring it lazily (the VM runs from the staged state while its memory
//! is faulted in from the registry, then completed), the adopted counter
//! goes on from A's value, memory and disk, and it answers before its
//! memory is complete (B's background download paced to take over a
//! minute). Then:
//! another namespace's clone is refused, and with the registry stopped a
//! clone of a snapshot B lacks fails RunPodSandbox cleanly.
//! Built with `--features lab`, run in the nested lab
//! (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test cross_node`).

use std::time::{Duration, Instant};

use twig_controller::crd::SnapshotMode;
use twig_controller::shim::{TtrpcShim, TwigShim};
use twig_cri::api::PodSandboxConfig;
use twig_cri::container_config;
use twig_cri::harness::Registry;
use twig_e2e::crilab::{runtime, CriLab, COUNTER};
use twig_e2e::IMAGE_REF;
use twig_proto::contract::{RESTORE_ARTIFACT_ANNOTATION, RESTORE_FROM_ANNOTATION};
use twig_proto::twig::{ExportSnapshotRequest, GetSnapshotRequest};
use twig_proto::twig_ttrpc::NodeClient;

/// Deadline of a shim or node call (a full snapshot of the lab's 128 MiB
/// guest under TCG takes seconds, its export more).
const CALL: Duration = Duration::from_secs(300);
/// Node B's lazy-restore download pace: the pod's memory (about 28 MiB
/// written) takes over a minute, so the clone answers first.
const FILL_KIB_PER_S: u64 = 384;
/// The longest that download may take (128 MiB at that pace).
const FILL: Duration = Duration::from_secs(128 * 1024 / FILL_KIB_PER_S);
const HANDLER: &str = "twig";
/// The namespace `twig_cri::pod_sandbox_config` gives pods.
const NS: &str = "default";

fn step(t0: Instant, what: &str) {
    eprintln!("cross-node: {:>7.2} s  {what}", t0.elapsed().as_secs_f64());
}

async fn node_client(lab: &CriLab) -> NodeClient {
    let socket = lab.dir().join("node.sock");
    NodeClient::new(
        ttrpc::r#async::Client::connect(&format!("unix://{}", socket.display()))
            .await
            .unwrap_or_else(|e| panic!("connecting to twig-node at {}: {e}", socket.display())),
    )
}

fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_timeout(CALL.as_nanos() as i64)
}

/// A pod named `name` on `lab`, restored from `snapshot` pulled from
/// `artifact`.
fn clone_pod(lab: &CriLab, name: &str, snapshot: &str, artifact: &str) -> PodSandboxConfig {
    let mut pod = lab.node.pod_config(name).unwrap_or_else(|e| panic!("{e}"));
    pod.annotations
        .insert(RESTORE_FROM_ANNOTATION.into(), snapshot.into());
    pod.annotations
        .insert(RESTORE_ARTIFACT_ANNOTATION.into(), artifact.into());
    pod
}

fn counter() -> twig_cri::api::ContainerConfig {
    container_config(
        "counter",
        IMAGE_REF,
        &["/bin/sh", "-c", COUNTER],
        "counter.log",
    )
}

#[test]
fn a_pod_snapshotted_on_one_node_is_cloned_onto_another_and_counts_on() {
    runtime().block_on(scenario());
}

async fn scenario() {
    let t0 = Instant::now();
    let work = tempfile::tempdir().unwrap();
    let registry = Registry::start(work.path()).unwrap_or_else(|e| panic!("docker-registry: {e}"));
    let host = registry.host();
    let a = CriLab::start_configured(|c| c.registry = Some(host.clone())).await;
    let b = CriLab::start_configured(|c| {
        c.registry = Some(host.clone());
        c.own_store = true;
        c.lazy_fill_kib_per_s = FILL_KIB_PER_S;
    })
    .await;
    step(t0, "two nodes and a registry up");

    let src_pod = a
        .node
        .pod_config("counter-src")
        .unwrap_or_else(|e| panic!("{e}"));
    let (_, src) = a.run_pod(&src_pod, HANDLER, &counter()).await;
    a.wait_count(&src, "/dev/shm/count", |n| n >= 3).await;
    let sandbox = a.sandbox_of(&src_pod).await;
    let snap = format!("e2e-{}-cross", std::process::id());
    let before = a.wait_count(&src, "/dev/shm/count", |_| true).await;
    TtrpcShim { timeout: CALL }
        .snapshot(&sandbox, &snap, SnapshotMode::Full)
        .await
        .unwrap_or_else(|e| panic!("snapshot: {e}\n{}", a.logs()));
    step(t0, "snapshot on A");

    let reference = format!("{host}/twig/{NS}/counter:v1");
    let exported = node_client(&a)
        .await
        .export_snapshot(
            ctx(),
            &ExportSnapshotRequest {
                snapshot_id: snap.clone(),
                reference: reference.clone(),
                namespace: NS.into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_or_else(|e| panic!("ExportSnapshot: {e}\n{}", a.logs()));
    let artifact = format!("{host}/twig/{NS}/counter@{}", exported.digest);
    eprintln!(
        "cross-node: exported {} bytes ({} snapshots) as {artifact}",
        exported.bytes_uploaded, exported.snapshots_pushed
    );
    let b_node = node_client(&b).await;
    let on_b = |id: &str| {
        let req = GetSnapshotRequest {
            snapshot_id: id.into(),
            ..Default::default()
        };
        let node = b_node.clone();
        async move {
            node.get_snapshot(ctx(), &req)
                .await
                .unwrap_or_else(|e| panic!("GetSnapshot: {e}"))
                .found
        }
    };
    assert!(!on_b(&snap).await, "B's store is its own");
    step(t0, "exported");

    // B plays the Clone's pod: it lacks the snapshot and pulls it.
    let pod = clone_pod(&b, "counter-clone", &snap, &artifact);
    let (clone_pod_id, clone) = b.run_pod(&pod, HANDLER, &counter()).await;
    step(t0, "the clone runs on B");
    let first = b.wait_count(&clone, "/dev/shm/count", |_| true).await;
    // It answered before its memory was all here: B's background download
    // is paced to take minutes, and its pages came by range meanwhile.
    let node_log = || b.node.node().logs_of(0, 100_000);
    assert!(
        !node_log().contains("lazy restore complete"),
        "the clone answered only once its memory was complete:\n{}",
        b.logs()
    );
    assert!(
        first >= before,
        "the clone on B counts from {first}; A's snapshot was taken at {before} or later"
    );
    let disk = b.wait_count(&clone, "/count", |_| true).await;
    assert!(
        disk + 1 >= before,
        "the clone's disk says {disk}, A's was past {before}"
    );
    b.wait_count(&clone, "/dev/shm/count", |n| n > first + 5)
        .await;
    let (_, hostname) = b.exec(&clone, &["hostname"]).await;
    assert_eq!(hostname, "counter-clone");
    assert!(
        !on_b(&snap).await,
        "B keeps the pulled snapshot under its own id"
    );
    step(t0, "the clone counts on with A's memory and disk");

    // B restored it lazily: the VM ran from the staged state while its
    // memory came from the registry, then the node completed it.
    assert!(
        node_log().contains("handed over a VMM restoring lazily"),
        "B did not restore lazily:\n{}",
        b.logs()
    );
    let deadline = Instant::now() + CALL + FILL;
    while !node_log().contains("lazy restore complete") {
        assert!(
            !node_log().contains("lazy restore failed") && Instant::now() < deadline,
            "the lazy restore did not complete:\n{}",
            b.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    b.wait_count(&clone, "/dev/shm/count", |n| n > first + 8)
        .await;
    step(t0, "B's lazy restore completed, the clone counts on");

    // Another namespace's pod may not pull it.
    let mut other = clone_pod(&b, "other-ns", &snap, &artifact);
    if let Some(m) = other.metadata.as_mut() {
        m.namespace = "team-b".into();
    }
    let refused = b
        .cri
        .run_pod_sandbox(&other, HANDLER)
        .await
        .expect_err("a pod of another namespace restored the snapshot");
    assert!(refused.to_string().contains("team-b"), "{refused}");

    // The registry gone: a clone of a snapshot B lacks fails cleanly.
    drop(registry);
    let gone = clone_pod(
        &b,
        "registry-gone",
        "e2e-never-pushed",
        &format!("{host}/twig/{NS}/counter:v2"),
    );
    let e = b
        .cri
        .run_pod_sandbox(&gone, HANDLER)
        .await
        .expect_err("a clone whose registry is gone started");
    assert!(e.to_string().contains("unreachable"), "{e}");
    step(t0, "refusals");

    b.remove_pod(&clone_pod_id).await;
    let vmms = b.node.pod_vmms();
    assert!(vmms.is_empty(), "B's pod VMMs left: {vmms:?}");
}
