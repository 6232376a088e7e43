//! "Try 8 things from here": forks of an agent's Redis pod through Twig's
//! Kubernetes objects, against the real node ([`CtrlLab`]), on the Redis
//! pod of [`twig_e2e::redis`].
//!
//! Scenario: a Redis pod, keys written → a Snapshot becomes Ready → the
//! source pod goes on (a key of its own) → a Clone of the Snapshot with
//! [`FORKS`] replicas becomes Ready: every fork is a running pod of its own
//! (UID, sandbox, hostname) that holds the snapshot's keys and files and not
//! the source's later key, writes a key of its own, and sees none of the
//! other forks' → the source sees no fork's key → everything deleted,
//! nothing left on the node.
//!
//! A test binary of its own: forks start eight guests at once, which is
//! when the lab's outer VM wedges most (tests/lab/README.md), and run.sh
//! boots it again only for the binaries that have not passed.
//! Built with `--features lab`, run in the nested lab
//! (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test forks`).

use std::collections::BTreeSet;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams};
use kube::{Api, ResourceExt};
use twig_controller::crd::{CloneSource, CloneSpec, Phase, PodClone, CLONE_LABEL};
use twig_controller_testkit::{self as testkit, NS};
use twig_e2e::ctrllab::CtrlLab;
use twig_e2e::redis::{self, answering, cli, dbsize, CLI};

/// Keys the agent writes before its snapshot.
const KEYS: usize = 20;
/// Forks of the snapshot ("try 8 things from here").
const FORKS: i32 = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_forks_of_a_redis_pod_hold_its_keys_and_see_none_of_each_others() {
    let image = redis::image();
    let lab = CtrlLab::start("forks", &[(&image, redis::REDIS_REF)]).await;
    let client = &lab.client;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    let source = testkit::create(client, &redis::pod("agent")).await;
    let (_, ctr) = lab.running("agent", redis::CONTAINER).await;
    answering(&lab, &ctr).await;
    redis::write_keys(&lab, &ctr, KEYS).await;
    lab.step(&format!("pod agent runs Redis with {KEYS} keys"));
    lab.snapshot("here", "agent").await;
    lab.step("Snapshot here Ready");
    // The source goes on after the snapshot: the forks must not see this.
    cli(&lab, &ctr, &["set", "later", "source"]).await;

    let t = Instant::now();
    testkit::create(
        client,
        &PodClone::new(
            "try",
            CloneSpec {
                source: CloneSource {
                    snapshot_name: Some("here".into()),
                    pod_name: None,
                },
                replicas: FORKS,
                name_prefix: None,
                labels: None,
                failure_deadline_seconds: None,
            },
        ),
    )
    .await;
    let clone: PodClone = lab
        .wait_for("try", "done", |c: &PodClone| {
            c.status
                .as_ref()
                .is_some_and(|s| matches!(s.phase, Phase::Ready | Phase::Failed))
        })
        .await;
    let took = t.elapsed();
    let status = clone.status.clone().unwrap_or_default();
    assert_eq!(status.phase, Phase::Ready, "{status:#?}\n{}", lab.logs());
    assert_eq!(status.ready_replicas, FORKS, "{status:#?}");
    lab.step(&format!("Clone try of {FORKS} Ready in {took:?}"));

    let forks = pods
        .list(&ListParams::default().labels(&format!("{CLONE_LABEL}=try")))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .items;
    assert_eq!(forks.len(), FORKS as usize, "fork pods: {forks:#?}");
    let mut uids = BTreeSet::from([source.uid().unwrap_or_default()]);
    let mut sandboxes = BTreeSet::new();
    let mut ids = Vec::new();
    for pod in &forks {
        let name = pod.name_any();
        let uid = pod.uid().unwrap_or_default();
        assert!(uids.insert(uid.clone()), "fork {name} has another's UID");
        let (_, id) = lab.running(&name, redis::CONTAINER).await;
        let sandbox = lab.sandbox(&uid).await;
        assert!(
            sandbox.is_some() && sandboxes.insert(sandbox.clone()),
            "fork {name}'s sandbox {sandbox:?}"
        );
        // No wait for Redis to answer: a fork resumes the snapshot's running
        // Redis, which answers its first command. One exec for all of it:
        // each is seconds under the lab's TCG, more with nine guests.
        let (code, out) = lab
            .sh(
                &id,
                &format!(
                    "{CLI} dbsize && {CLI} get key3 && cat /data/notes && hostname && \
                     {CLI} set own:{name} {name}"
                ),
            )
            .await;
        assert_eq!(
            (code, out.as_str()),
            (0, format!("{KEYS}\nvalue3\nnotes\n{name}\nOK").as_str()),
            "fork {name}: its keys (not the source's later one), its files, its hostname, \
             its own key written"
        );
        ids.push((name, id));
    }
    for (name, id) in &ids {
        let (code, out) = lab
            .sh(id, &format!("{CLI} keys 'own:*' && {CLI} dbsize"))
            .await;
        assert_eq!(
            (code, out.as_str()),
            (0, format!("own:{name}\n{}", KEYS + 1).as_str()),
            "fork {name} sees another fork's key"
        );
    }
    assert_eq!(
        cli(&lab, &ctr, &["keys", "own:*"]).await,
        "",
        "the source pod saw a fork's write"
    );
    assert_eq!(dbsize(&lab, &ctr).await, KEYS + 1, "the source's keys");
    lab.step(&format!(
        "{FORKS} forks hold the keys, each wrote its own and sees no other's"
    ));

    let vmms = lab.node.pod_vmms();
    assert_eq!(vmms.len(), 1 + FORKS as usize, "pod VMMs {vmms:?}");
    let dp = DeleteParams::default();
    let clones: Api<PodClone> = Api::namespaced(client.clone(), NS);
    clones
        .delete("try", &dp)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // The forks go with their Clone (owner references, garbage collection).
    pods.delete("agent", &dp)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    lab.delete_snapshots(&["here"]).await;
    lab.nothing_left(&vmms).await;
    lab.step("all deleted, nothing left");
}
