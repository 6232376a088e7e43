//! An agent's workflow on Redis, through Twig's Kubernetes objects, against
//! the real node ([`CtrlLab`]: containerd's CRI plugin, the twig shim,
//! twig-node, the controller reconciling in the testkit's API server, the
//! test kubelet running the pods), on the Redis pod of [`twig_e2e::redis`]:
//! its state is in guest memory and on its rootfs.
//!
//! Scenario: a Redis pod, keys written → a Snapshot becomes Ready → the
//! agent's destructive step: `FLUSHALL` and `rm -rf /data` → a Rollback
//! becomes Ready: the same pod (UID, sandbox) holds every key again and its
//! data directory is back → the rewind undone with a Rollback to the
//! safety snapshot the first one took → everything deleted (the safety
//! snapshot before its parent), nothing left on the node.
//!
//! Forks of the Redis pod are tests/forks.rs.
//! Built with `--features lab`, run in the nested lab
//! (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test workflows`).

use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kube::api::DeleteParams;
use kube::{Api, ResourceExt};
use twig_controller::crd::{Phase, Rollback, RollbackSpec, RollbackStatus};
use twig_controller_testkit::{self as testkit, NS};
use twig_e2e::ctrllab::CtrlLab;
use twig_e2e::redis::{self, answering, cli, dbsize};

/// Keys the agent writes before its snapshot.
const KEYS: usize = 20;

/// The Rollback `name` once done, which must be Ready.
async fn done(lab: &CtrlLab, name: &str) -> RollbackStatus {
    let rollback: Rollback = lab
        .wait_for(name, "done", |r: &Rollback| {
            r.status
                .as_ref()
                .is_some_and(|s| matches!(s.phase, Phase::Ready | Phase::Failed))
        })
        .await;
    let status = rollback.status.clone().unwrap_or_default();
    assert_eq!(status.phase, Phase::Ready, "{status:#?}\n{}", lab.logs());
    status
}

/// Rolls pod `agent` back to `snapshot` with the Rollback `name`, taking no
/// safety snapshot, and waits until it is done.
async fn rollback_to(lab: &CtrlLab, name: &str, snapshot: &str) {
    testkit::create(
        &lab.client,
        &Rollback::new(
            name,
            RollbackSpec {
                pod_name: "agent".into(),
                snapshot_name: snapshot.into(),
                pod_uid: None,
                safety_snapshot: false,
                failure_deadline_seconds: None,
            },
        ),
    )
    .await;
    done(lab, name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_snapshots_rewinds_and_undoes_the_rewind_of_a_redis_pod() {
    let image = redis::image();
    let lab = CtrlLab::start("workflows", &[(&image, redis::REDIS_REF)]).await;
    let client = &lab.client;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // The agent's pod: Redis with keys, a file in its data directory.
    let source = testkit::create(client, &redis::pod("agent")).await;
    let uid = source.uid().unwrap_or_default();
    let (_, ctr) = lab.running("agent", redis::CONTAINER).await;
    let sandbox = lab.sandbox(&uid).await;
    assert!(sandbox.is_some(), "no CRI sandbox for pod UID {uid}");
    answering(&lab, &ctr).await;
    redis::write_keys(&lab, &ctr, KEYS).await;
    lab.step(&format!("pod agent runs Redis with {KEYS} keys"));

    // Snapshot.
    lab.snapshot("before-cleanup", "agent").await;
    lab.step("Snapshot before-cleanup Ready");

    // The agent's mistake: the data and its files gone.
    cli(&lab, &ctr, &["flushall"]).await;
    let (code, _) = lab
        .sh(&ctr, "rm -rf /data/notes /data/appendonlydir && sync")
        .await;
    assert_eq!(code, 0);
    assert_eq!(dbsize(&lab, &ctr).await, 0);
    assert_ne!(lab.sh(&ctr, "test -e /data/notes").await.0, 0);
    lab.step("FLUSHALL and rm -rf in /data done");

    // Rewind.
    let t = Instant::now();
    testkit::create(
        client,
        &Rollback::new(
            "rewind",
            RollbackSpec {
                pod_name: "agent".into(),
                snapshot_name: "before-cleanup".into(),
                pod_uid: None,
                // The default: a safety snapshot of the pod first.
                safety_snapshot: true,
                failure_deadline_seconds: None,
            },
        ),
    )
    .await;
    let status = done(&lab, "rewind").await;
    answering(&lab, &ctr).await;
    let took = t.elapsed();
    assert_eq!(dbsize(&lab, &ctr).await, KEYS, "keys after the rewind");
    assert_eq!(cli(&lab, &ctr, &["get", "key7"]).await, "value7");
    assert_eq!(
        lab.sh(&ctr, "cat /data/notes").await,
        (0, "notes".to_string())
    );
    let (code, aof) = lab.sh(&ctr, "ls /data/appendonlydir").await;
    assert!(
        code == 0 && !aof.is_empty(),
        "the append-only files: {aof:?}"
    );
    // Redis keeps appending to the rewound file.
    cli(&lab, &ctr, &["set", "after", "rewind"]).await;
    assert_eq!(dbsize(&lab, &ctr).await, KEYS + 1);
    assert_eq!(
        lab.sandbox(&uid).await,
        sandbox,
        "the rewind changed the sandbox"
    );
    let current = pods.get("agent").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(current.uid().as_deref(), Some(uid.as_str()), "another pod");
    lab.step(&format!(
        "rewound in {took:?}: the same pod holds its {KEYS} keys and its files"
    ));

    // The rewind can be undone: its safety snapshot holds the state it
    // replaced (no keys, no files).
    let safety = status
        .safety_snapshot_name
        .clone()
        .unwrap_or_else(|| panic!("the Rollback names no safety snapshot: {status:#?}"));
    assert_eq!(safety, "rewind-safety");
    rollback_to(&lab, "undo", &safety).await;
    answering(&lab, &ctr).await;
    assert_eq!(dbsize(&lab, &ctr).await, 0, "keys after undoing the rewind");
    assert_ne!(lab.sh(&ctr, "test -e /data/notes").await.0, 0);
    assert_eq!(
        lab.sandbox(&uid).await,
        sandbox,
        "the undo changed the sandbox"
    );
    lab.step("the rewind undone from its safety snapshot");

    // Delete everything; nothing is left.
    let vmms = lab.node.pod_vmms();
    assert_eq!(vmms.len(), 1, "pod VMMs {vmms:?}");
    let dp = DeleteParams::default();
    let rollbacks: Api<Rollback> = Api::namespaced(client.clone(), NS);
    for name in ["rewind", "undo"] {
        rollbacks
            .delete(name, &dp)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    pods.delete("agent", &dp)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The safety snapshot builds on before-cleanup, which is kept until
    // its child is gone: deleted in that order.
    lab.delete_snapshots(&["rewind-safety", "before-cleanup"])
        .await;
    lab.nothing_left(&vmms).await;
    lab.step("all deleted, nothing left");
}
