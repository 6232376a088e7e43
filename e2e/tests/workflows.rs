//! An agent's workflow on Redis, through Twig's Kubernetes objects, against
//! the real node ([`CtrlLab`]: containerd's CRI plugin, the twig shim,
//! twig-node, the controller reconciling in the testkit's API server, the
//! test kubelet running the pods). Redis 7 from Debian's packages
//! (`e2e/build-image.sh` with `TWIG_IMAGE_DEBS`, built by tests/lab/run.sh
//! into `TWIG_E2E_REDIS_IMAGE`), with an append-only file in `/data` on the
//! pod's rootfs, so its state is in guest memory and on disk. The pods are
//! on the node's network (`hostNetwork`); Redis listens on loopback.
//!
//! Scenario: a Redis pod, keys written → a Snapshot becomes Ready → the
//! agent's destructive step: `FLUSHALL` and `rm -rf /data` → a Rollback
//! becomes Ready: the same pod (UID, sandbox) holds every key again and its
//! data directory is back → the rewind undone with a Rollback to the
//! safety snapshot the first one took → everything deleted (the safety
//! snapshot before its parent), nothing left on the node.
//!
//! Not here: forks of the Redis pod. A Clone of 8 of it now starts in the
//! lab (two boots of three) but has not passed end to end; the phase is in
//! git history (commit 920c9ac; tests/lab/README.md). The controller test
//! clones its counter pod twice, and the controller's host tests fan a
//! Clone out to 256.
//! Built with `--features lab`, run in the nested lab
//! (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test workflows`).

use std::path::PathBuf;
use std::time::Instant;

use k8s_openapi::api::core::v1::{Container, Pod};
use kube::api::{DeleteParams, ListParams};
use kube::{Api, ResourceExt};
use twig_controller::crd::{
    DeletionPolicy, Phase, Rollback, RollbackSpec, RollbackStatus, Snapshot, SnapshotMode,
    SnapshotSpec,
};
use twig_controller_testkit::{self as testkit, NS};
use twig_e2e::ctrllab::{twig_pod, until, CtrlLab, READY};

/// The Redis image's reference, as tests/lab/run.sh builds it.
const REDIS_REF: &str = "docker.io/library/twig-e2e-redis:v1";
/// Keys the agent writes before its snapshot.
const KEYS: usize = 20;
const CLI: &str = "/usr/bin/redis-cli";
/// Redis on the pod's loopback, its append-only file in `/data` (the
/// rootfs), fsynced at every write: what it acknowledged is on disk.
const SERVER: &str = "mkdir -p /data && exec /usr/bin/redis-server --bind 127.0.0.1 \
     --protected-mode no --dir /data --appendonly yes --appendfsync always --save ''";

/// The Redis pod, on the node's network: no eBPF path to load (eBPF
/// verification beside nested guests provokes the lab's wedges,
/// tests/lab/README.md); the pod network is covered by tests/controller.rs
/// and tests/cri.rs.
fn redis_pod(name: &str) -> Pod {
    let mut pod = twig_pod(
        name,
        Container {
            name: "redis".into(),
            image: Some(REDIS_REF.into()),
            command: Some(vec!["/bin/sh".into(), "-c".into()]),
            args: Some(vec![SERVER.into()]),
            ..Default::default()
        },
    );
    if let Some(spec) = pod.spec.as_mut() {
        spec.host_network = Some(true);
    }
    pod
}

/// `redis-cli args…` in container `id`: its output, which must exit 0.
async fn cli(lab: &CtrlLab, id: &str, args: &[&str]) -> String {
    let argv: Vec<&str> = std::iter::once(CLI).chain(args.iter().copied()).collect();
    let (code, out) = lab.exec(id, &argv).await;
    assert_eq!(code, 0, "redis-cli {args:?} in {id}: {out}");
    out
}

/// Waits until Redis in container `id` answers.
async fn answering(lab: &CtrlLab, id: &str) {
    until(&format!("Redis in {id} to answer"), READY, || async {
        let (code, out) = lab.exec(id, &[CLI, "ping"]).await;
        (code == 0 && out == "PONG").then_some(())
    })
    .await;
}

/// The number of keys in container `id`'s Redis.
async fn dbsize(lab: &CtrlLab, id: &str) -> usize {
    let out = cli(lab, id, &["dbsize"]).await;
    out.parse()
        .unwrap_or_else(|e| panic!("DBSIZE of {id} said {out:?}: {e}"))
}

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
    let image = PathBuf::from(std::env::var_os("TWIG_E2E_REDIS_IMAGE").unwrap_or_else(|| {
        panic!(
            "TWIG_E2E_REDIS_IMAGE is not set: run this test through tests/lab/run.sh, which \
             builds the Redis image with e2e/build-image.sh"
        )
    }));
    let lab = CtrlLab::start("workflows", &[(&image, REDIS_REF)]).await;
    let client = &lab.client;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // The agent's pod: Redis with keys, a file in its data directory.
    let source = testkit::create(client, &redis_pod("agent")).await;
    let uid = source.uid().unwrap_or_default();
    let (_, ctr) = lab.running("agent", "redis").await;
    let sandbox = lab.sandbox(&uid).await;
    assert!(sandbox.is_some(), "no CRI sandbox for pod UID {uid}");
    answering(&lab, &ctr).await;
    let (code, out) = lab
        .sh(
            &ctr,
            &format!(
                "for i in $(seq 1 {KEYS}); do {CLI} set key$i value$i >/dev/null || exit 1; done; \
                 echo notes > /data/notes && sync"
            ),
        )
        .await;
    assert_eq!(code, 0, "writing the keys: {out}");
    assert_eq!(dbsize(&lab, &ctr).await, KEYS);
    lab.step(&format!("pod agent runs Redis with {KEYS} keys"));

    // Snapshot.
    testkit::create(
        client,
        &Snapshot::new(
            "before-cleanup",
            SnapshotSpec {
                pod_name: "agent".into(),
                pod_uid: None,
                mode: SnapshotMode::Full,
                deletion_policy: DeletionPolicy::Delete,
                ttl_seconds_after_ready: None,
                failure_deadline_seconds: None,
            },
        ),
    )
    .await;
    let snap: Snapshot = lab
        .wait_for("before-cleanup", "done", |s: &Snapshot| {
            s.status
                .as_ref()
                .is_some_and(|s| matches!(s.phase, Phase::Ready | Phase::Failed))
        })
        .await;
    let status = snap.status.clone().unwrap_or_default();
    assert_eq!(status.phase, Phase::Ready, "{status:#?}\n{}", lab.logs());
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
    until("the pods to be gone", READY, || async {
        let left = pods.list(&ListParams::default()).await.ok()?.items;
        left.is_empty().then_some(())
    })
    .await;
    // The safety snapshot builds on before-cleanup, which is kept until
    // its child is gone: deleted in that order.
    let snapshots: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    for name in ["rewind-safety", "before-cleanup"] {
        snapshots
            .delete(name, &dp)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        until("the Snapshot's finalizer to let go", READY, || async {
            matches!(snapshots.get_opt(name).await, Ok(None)).then_some(())
        })
        .await;
    }
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
    lab.step("all deleted, nothing left");
}
