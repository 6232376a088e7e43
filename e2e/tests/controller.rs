//! The controller against the real node: twig-controller (`run`, with the
//! real `TtrpcShim`, `ContainerdLocator` on CRI's `k8s.io` task directory
//! and `TtrpcNode` on the node's twig-node socket) reconciles Snapshot,
//! Rollback and Clone objects in the controller testkit's API server
//! (standing in for kube-apiserver, CRDs admitted), while the test kubelet
//! (`twig_e2e::kubelet`) runs the node's pods through containerd's CRI
//! plugin, the twig shim and twig-node.
//!
//! Scenario: a twig pod counts in tmpfs and has a file on its rootfs → a
//! Snapshot becomes Ready → the pod moves on and the test damages its file
//! → a Rollback becomes Ready: the same sandbox counts on from the
//! snapshot's value with its file back → a Clone of the Snapshot with two
//! replicas: the controller creates two pods restored from it, the kubelet
//! runs them, the Clone reports both ready, each counts on from the
//! snapshot under its own hostname → a SandboxTemplate becomes Ready on
//! the node (twig-node builds it through CRI, warm-up included) and a pod
//! naming it counts on from the template's warm state, under the
//! template's egress policy (it reaches the node), which follows the
//! template and then the pod's own annotation while it runs (the
//! controller pushes each to the shim; the drops show in `/metrics` with
//! the pod's name) → everything
//! deleted: the finalizers let the Snapshot and the SandboxTemplate go
//! once twig-node deleted their data, the kubelet removes the sandboxes,
//! and nothing is left on the node.
//! Built with `--features lab`, run in the nested lab
//! (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test controller`).

use std::net::TcpListener;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, ResourceExt};
use twig_controller::crd::{
    CloneSource, CloneSpec, DeletionPolicy, Phase, PodClone, Rollback, RollbackSpec,
    SandboxTemplate, SandboxTemplateSpec, Snapshot, SnapshotMode, SnapshotSpec, CLONE_LABEL,
    RESTORE_FROM_ANNOTATION, TEMPLATE_ANNOTATION,
};
use twig_controller_testkit::{self as testkit, NS};
use twig_e2e::cri::CriNode;
use twig_e2e::crilab::accept_line;
use twig_e2e::ctrllab::{twig_pod, until, CtrlLab, NODE, READY};
use twig_e2e::{BASE_MEM_MIB, IMAGE_REF};
use twig_net::{EgressPolicy, EGRESS_POLICY_ANNOTATION};
use twig_store::NodeStore;

/// Deadline of the guest's progress.
const PROGRESS: Duration = Duration::from_secs(120);
/// The most the counter can count per second (it sleeps 50 ms a round).
const MAX_RATE: u64 = 20;
/// How far the source pod counts on past its snapshot before the rollback:
/// at [`MAX_RATE`], 15 s of counting, more than a rollback and the first
/// read after it take in the lab, so a counter that went back reads less.
const MOVE_ON: u64 = 15 * MAX_RATE;
/// How long the counter may take to count [`MOVE_ON`] further (measured in
/// the lab: 5–6 a second, ~56 s; slower when the host is busy).
const MOVE_ON_WITHIN: Duration = Duration::from_secs(300);

/// Counts in tmpfs (`/dev/shm/count`, guest memory) every 50 ms, each value
/// replaced by a rename, so a reader never sees it half-written.
const COUNTER: &str = "i=0; while :; do i=$((i+1)); echo $i > /dev/shm/count.new; \
     mv /dev/shm/count.new /dev/shm/count; sleep 0.05; done";

/// The tmpfs counter of container `id`, once it satisfies `ok`.
async fn count(lab: &CtrlLab, id: &str, ok: impl Fn(u64) -> bool) -> u64 {
    count_within(lab, id, PROGRESS, ok).await
}

/// [`count`] with its own deadline.
async fn count_within(lab: &CtrlLab, id: &str, within: Duration, ok: impl Fn(u64) -> bool) -> u64 {
    let ok = &ok;
    until(&format!("the counter of {id}"), within, || async move {
        let (code, out) = lab.sh(id, "cat /dev/shm/count").await;
        out.parse().ok().filter(|n| code == 0 && ok(*n))
    })
    .await
}

/// Whether container `id` can open a TCP connection to the node's
/// bridge address (a private address: the default policy drops it).
async fn reaches_node(lab: &CtrlLab, id: &str) -> bool {
    let gateway = lab.node.net().gateway();
    let listener =
        TcpListener::bind((gateway, 0)).unwrap_or_else(|e| panic!("listen on {gateway}: {e}"));
    let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
    let accepted = std::thread::spawn(move || accept_line(&listener, Duration::from_secs(15)));
    let (_, said) = lab
        .sh(
            id,
            &format!("echo from-the-pod | nc -w 5 {gateway} {port} 2>&1; echo rc=$?"),
        )
        .await;
    let got = accepted
        .join()
        .unwrap_or_else(|_| Err("the accept thread panicked".into()));
    let reached = got.as_deref().map(str::trim) == Ok("from-the-pod");
    assert!(
        reached || !said.contains("rc=0"),
        "nc says it connected, the node got nothing: {said:?}, {got:?}"
    );
    reached
}

/// An egress policy that allows the node's pod subnet (the bridge address
/// included).
fn allow_subnet(node: &CriNode) -> EgressPolicy {
    serde_json::from_value(serde_json::json!({"allow": [{"cidr": node.net().subnet()}]}))
        .unwrap_or_else(|e| panic!("an egress policy: {e}"))
}

fn counter_pod(name: &str) -> Pod {
    twig_pod(
        name,
        Container {
            name: "counter".into(),
            image: Some(IMAGE_REF.into()),
            command: Some(vec!["/bin/sh".into(), "-c".into()]),
            args: Some(vec![COUNTER.into()]),
            ..Default::default()
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_snapshots_rolls_back_and_clones_pods_of_a_real_node() {
    let lab = CtrlLab::start("controller", &[]).await;
    scenario(&lab).await;
}

async fn scenario(lab: &CtrlLab) {
    let client = &lab.client;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // A pod through the kubelet: its counter runs, its rootfs has a file.
    let source = testkit::create(client, &counter_pod("counter")).await;
    let uid = source.uid().unwrap_or_default();
    let (_, ctr) = lab.running("counter", "counter").await;
    let sandbox = lab.sandbox(&uid).await;
    assert!(sandbox.is_some(), "no CRI sandbox for pod UID {uid}");
    let (code, _) = lab.sh(&ctr, "echo original > /marker && sync").await;
    assert_eq!(code, 0);
    count(lab, &ctr, |n| n >= 3).await;
    lab.step("pod counter runs");

    // Snapshot.
    let before = count(lab, &ctr, |_| true).await;
    let snap = Snapshot::new(
        "snap",
        SnapshotSpec {
            pod_name: "counter".into(),
            pod_uid: None,
            mode: SnapshotMode::Full,
            deletion_policy: DeletionPolicy::Delete,
            ttl_seconds_after_ready: None,
            failure_deadline_seconds: None,
            export: false,
        },
    );
    testkit::create(client, &snap).await;
    let snap: Snapshot = lab
        .wait_for("snap", "Ready", |s: &Snapshot| {
            s.status
                .as_ref()
                .is_some_and(|s| matches!(s.phase, Phase::Ready | Phase::Failed))
        })
        .await;
    let after = count(lab, &ctr, |_| true).await;
    let status = snap.status.clone().unwrap_or_default();
    assert_eq!(status.phase, Phase::Ready, "{status:#?}\n{}", lab.logs());
    let snapshot_id = status.snapshot_id.clone().unwrap_or_default();
    assert_eq!(Some(snapshot_id.as_str()), snap.metadata.uid.as_deref());
    assert_eq!(status.node_name.as_deref(), Some(NODE));
    assert_eq!(status.pod_uid.as_deref(), Some(uid.as_str()));
    assert!(status.size_bytes.unwrap_or_default() > 0, "{status:#?}");
    let store = NodeStore::open(
        &lab.node.node().vm_store().unwrap_or_else(|e| panic!("{e}")),
        false,
    )
    .unwrap_or_else(|e| panic!("node store: {e}"));
    assert!(
        store.get(&snapshot_id).is_ok(),
        "the store lacks {snapshot_id}"
    );
    lab.step(&format!(
        "snapshot Ready (counter between {before} and {after})"
    ));

    // The pod moves on: its counter, a mark in its memory, its file damaged.
    let moved = count_within(lab, &ctr, MOVE_ON_WITHIN, |n| n > after + MOVE_ON).await;
    let (code, _) = lab
        .sh(
            &ctr,
            "echo damaged > /marker && echo yes > /dev/shm/moved-on && sync",
        )
        .await;
    assert_eq!(code, 0);
    lab.step(&format!("the pod moved on to {moved}, its file damaged"));

    // Rollback.
    let t_rollback = Instant::now();
    let rollback = Rollback::new(
        "back",
        RollbackSpec {
            pod_name: "counter".into(),
            snapshot_name: "snap".into(),
            pod_uid: None,
            // The default: a safety snapshot of the pod first.
            safety_snapshot: true,
            failure_deadline_seconds: None,
        },
    );
    testkit::create(client, &rollback).await;
    let rollback: Rollback = lab
        .wait_for("back", "done", |r: &Rollback| {
            r.status
                .as_ref()
                .is_some_and(|s| matches!(s.phase, Phase::Ready | Phase::Failed))
        })
        .await;
    let status = rollback.status.clone().unwrap_or_default();
    assert_eq!(status.phase, Phase::Ready, "{status:#?}\n{}", lab.logs());
    assert_eq!(status.safety_snapshot_name.as_deref(), Some("back-safety"));
    let back = count(lab, &ctr, |_| true).await;
    let took = t_rollback.elapsed();
    assert!(
        back >= before && back < moved,
        "after the rollback the counter reads {back}: the snapshot was taken between {before} \
         and {after}, the pod had counted to {moved} ({took:?} since the Rollback was made)"
    );
    let (_, mark) = lab.sh(&ctr, "cat /marker").await;
    assert_eq!(mark, "original", "the rootfs file after the rollback");
    let (code, _) = lab.sh(&ctr, "test -e /dev/shm/moved-on").await;
    assert_ne!(
        code, 0,
        "memory written after the snapshot survived the rollback"
    );
    assert_eq!(
        lab.sandbox(&uid).await,
        sandbox,
        "the rollback changed the sandbox"
    );
    let current = pods.get("counter").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(current.uid().as_deref(), Some(uid.as_str()), "another pod");
    count(lab, &ctr, |n| n > back + 5).await;
    lab.step(&format!(
        "rolled back in {took:?}: the counter went back to {back}, the file is back"
    ));

    // Clone the snapshot twice.
    let clone = PodClone::new(
        "fork",
        CloneSpec {
            source: CloneSource {
                snapshot_name: Some("snap".into()),
                pod_name: None,
            },
            replicas: 2,
            name_prefix: None,
            labels: None,
            failure_deadline_seconds: None,
        },
    );
    testkit::create(client, &clone).await;
    let clone: PodClone = lab
        .wait_for("fork", "Ready", |c: &PodClone| {
            c.status
                .as_ref()
                .is_some_and(|s| matches!(s.phase, Phase::Ready | Phase::Failed))
        })
        .await;
    let status = clone.status.clone().unwrap_or_default();
    assert_eq!(status.phase, Phase::Ready, "{status:#?}\n{}", lab.logs());
    assert_eq!(status.ready_replicas, 2, "{status:#?}");
    let clones = pods
        .list(&ListParams::default().labels(&format!("{CLONE_LABEL}=fork")))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .items;
    assert_eq!(clones.len(), 2, "clone pods: {clones:#?}");
    let mut hostnames = Vec::new();
    for pod in &clones {
        let name = pod.name_any();
        assert_eq!(
            pod.annotations().get(RESTORE_FROM_ANNOTATION),
            Some(&snapshot_id),
            "pod {name}"
        );
        assert_eq!(
            pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
            Some(NODE)
        );
        let (_, id) = lab.running(&name, "counter").await;
        let first = count(lab, &id, |_| true).await;
        assert!(
            first >= before,
            "clone {name} counts from {first}; the snapshot was taken between {before} and {after}"
        );
        count(lab, &id, |n| n > first + 5).await;
        let (_, mark) = lab.sh(&id, "cat /marker").await;
        assert_eq!(mark, "original", "clone {name}'s rootfs file");
        let (_, host) = lab.sh(&id, "hostname").await;
        assert_eq!(host, name, "clone {name}'s hostname");
        hostnames.push(host);
    }
    assert_ne!(hostnames[0], hostnames[1]);
    lab.step("the Clone's two pods count on from the snapshot");

    // A SandboxTemplate: the controller makes its build Pod on the node,
    // the kubelet runs it (and would stop a sandbox it did not make, as a
    // real kubelet does), twig-node warms it up and snapshots it, and the
    // controller deletes the Pod; a pod naming the template starts from it,
    // its one container adopting the template's counter with the warm-up's
    // state in memory.
    let template = SandboxTemplate::new(
        "counter-tpl",
        SandboxTemplateSpec {
            image: IMAGE_REF.into(),
            vcpus: 1,
            memory_mib: u32::try_from(BASE_MEM_MIB).unwrap_or(u32::MAX),
            command: Some(vec!["/bin/sh".into(), "-c".into(), COUNTER.into()]),
            warmup: Some(vec![
                "/bin/sh".into(),
                "-c".into(),
                "echo warm > /dev/shm/warm".into(),
            ]),
            // The node's subnet: the template's pods may reach the node.
            egress_policy: Some(allow_subnet(&lab.node)),
        },
    );
    testkit::create(client, &template).await;
    let build_pod = twig_controller::reconcile::template::build_pod_name(&template, NODE);
    lab.wait_for(&build_pod, "made by the controller", |_: &Pod| true)
        .await;
    lab.wait_for("counter-tpl", "Ready on the node", |t: &SandboxTemplate| {
        t.status.as_ref().is_some_and(|s| s.ready_nodes == 1)
    })
    .await;
    lab.wait_gone::<Pod>(&build_pod).await;
    assert_eq!(
        lab.orphans_stopped(),
        0,
        "a sandbox the kubelet did not make"
    );
    lab.step("the SandboxTemplate is Ready, built in a build Pod the kubelet ran");
    let mut from_template = counter_pod("from-tpl");
    from_template.metadata.annotations =
        Some([(TEMPLATE_ANNOTATION.to_string(), "counter-tpl".to_string())].into());
    if let Some(c) = from_template
        .spec
        .as_mut()
        .and_then(|s| s.containers.first_mut())
    {
        // Not run: the template's counter is adopted instead.
        c.command = Some(vec!["sleep".into(), "7777".into()]);
        c.args = None;
    }
    testkit::create(client, &from_template).await;
    let (_, tpl_ctr) = lab.running("from-tpl", "counter").await;
    assert_eq!(
        lab.sh(&tpl_ctr, "cat /dev/shm/warm").await,
        (0, "warm".to_string())
    );
    let n = count(lab, &tpl_ctr, |_| true).await;
    count(lab, &tpl_ctr, |m| m > n + 5).await;
    assert_eq!(
        lab.sh(&tpl_ctr, "hostname").await,
        (0, "from-tpl".to_string())
    );
    // The adopted process sees this pod's kubelet files (its /etc/hosts
    // names it), not those of the build Pod it was started in.
    let (code, hosts) = lab.sh(&tpl_ctr, "cat /etc/hosts").await;
    assert!(code == 0 && hosts.contains("from-tpl"), "{hosts}");
    lab.step("a pod of the template counts on from its warm state");

    // Its egress policy is the template's, and follows it live: the
    // template drops its policy → the controller puts the default on the
    // running pod (the node is a private address) → the pod's own
    // annotation asking for the subnet is clipped (a pod narrows, never
    // widens: a Warning Event says so) → the template allows the subnet
    // again. The drops are in /metrics.
    assert!(reaches_node(lab, &tpl_ctr).await, "the template's policy");
    let templates: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    let set_template_policy = |policy: serde_json::Value| {
        let templates = templates.clone();
        async move {
            templates
                .patch(
                    "counter-tpl",
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"spec": {"egressPolicy": policy}})),
                )
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        }
    };
    set_template_policy(serde_json::Value::Null).await;
    until("the default policy on the running pod", READY, || async {
        (!reaches_node(lab, &tpl_ctr).await).then_some(())
    })
    .await;
    until("the pod's drops in /metrics", READY, || async {
        let text = lab.metrics.encode().ok()?;
        text.lines()
            .find(|l| {
                l.starts_with("twig_pod_network_packets_total{")
                    && l.contains("pod=\"from-tpl\"")
                    && l.contains("reason=\"private\"")
                    && !l.ends_with(" 0")
            })
            .map(|_| ())
    })
    .await;
    let policy = serde_json::to_string(&allow_subnet(&lab.node)).unwrap_or_default();
    pods.patch(
        "from-tpl",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({
            "metadata": {"annotations": {EGRESS_POLICY_ANNOTATION: policy}}
        })),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    until("the clipped annotation's Event", READY, || async {
        testkit::event_reasons(client, "from-tpl")
            .await
            .iter()
            .any(|r| r == "EgressPolicyClipped")
            .then_some(())
    })
    .await;
    assert!(
        !reaches_node(lab, &tpl_ctr).await,
        "the pod's own annotation widened its egress policy past its template's"
    );
    set_template_policy(serde_json::to_value(allow_subnet(&lab.node)).unwrap_or_default()).await;
    until("the template's policy again", READY, || async {
        reaches_node(lab, &tpl_ctr).await.then_some(())
    })
    .await;
    lab.step("its egress policy followed the template live; its own annotation only narrows");

    // Delete everything; nothing is left.
    let vmms = lab.node.pod_vmms();
    assert_eq!(vmms.len(), 4, "pod VMMs {vmms:?}");
    let dp = DeleteParams::default();
    let clones_api: Api<PodClone> = Api::namespaced(client.clone(), NS);
    clones_api
        .delete("fork", &dp)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let rollbacks: Api<Rollback> = Api::namespaced(client.clone(), NS);
    rollbacks
        .delete("back", &dp)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for pod in ["counter", "from-tpl"] {
        pods.delete(pod, &dp)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    until("the pods to be gone", READY, || async {
        let left = pods.list(&ListParams::default()).await.ok()?.items;
        left.is_empty().then_some(())
    })
    .await;
    let snapshots: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    // The Rollback's safety snapshot outlives it, and builds on `snap`:
    // `snap` is kept until it is gone.
    snapshots
        .delete("back-safety", &dp)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    snapshots
        .delete("snap", &dp)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    until("the Snapshot's finalizer to let go", READY, || async {
        matches!(snapshots.get_opt("snap").await, Ok(None)).then_some(())
    })
    .await;
    assert!(
        store.get(&snapshot_id).is_err(),
        "the node store still holds {snapshot_id}"
    );
    templates
        .delete("counter-tpl", &dp)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    until(
        "the SandboxTemplate's finalizer to let go",
        READY,
        || async { matches!(templates.get_opt("counter-tpl").await, Ok(None)).then_some(()) },
    )
    .await;
    let template_id = format!("template.{NS}.counter-tpl");
    assert!(
        store.get(&template_id).is_err(),
        "the node store still holds {template_id}"
    );
    until(
        "the sandboxes and everything of them to go",
        READY,
        || async {
            let sandboxes = lab.cri.list_pod_sandboxes().await.ok()?;
            let left = lab.node.leftovers(&vmms);
            (sandboxes.is_empty() && left.is_empty()).then_some(())
        },
    )
    .await;
    assert!(lab.node.leftovers(&vmms).is_empty());
    lab.step("all deleted, nothing left");
}
