//! Failed reconciles are retried after a per-object exponential backoff
//! that resets when the object reconciles.

use twig_controller_testkit as support;

use std::sync::Arc;
use std::time::Duration;

use kube::api::DeleteParams;
use kube::Api;
use twig_controller::context::Backoff;
use twig_controller::crd::{DeletionPolicy, Phase, Snapshot, SnapshotMode, SnapshotSpec};

use support::fake::FakeNode;
use support::{
    api_server, create, eventually, running_pod, start_controller, wait_for, wait_gone, NS,
};

#[test]
fn backoff_grows_per_object_up_to_its_cap_and_resets() {
    let ms = Duration::from_millis;
    let backoff = Backoff::new(ms(100), ms(800));
    let delays: Vec<Duration> = (0..6).map(|_| backoff.failed("Snapshot/ns/a")).collect();
    assert_eq!(
        delays,
        [ms(100), ms(200), ms(400), ms(800), ms(800), ms(800)]
    );
    assert_eq!(backoff.failure_count("Snapshot/ns/a"), 6);
    // Another object has its own.
    assert_eq!(backoff.failed("Snapshot/ns/b"), ms(100));
    backoff.succeeded("Snapshot/ns/a");
    assert_eq!(backoff.failure_count("Snapshot/ns/a"), 0);
    assert_eq!(backoff.failed("Snapshot/ns/a"), ms(100));
    assert_eq!(backoff.failed("Snapshot/ns/b"), ms(200));
    // Many failures never overflow past the cap.
    let long = Backoff::new(Duration::from_secs(1), Duration::from_secs(300));
    let last = (0..200).map(|_| long.failed("k")).last();
    assert_eq!(last, Some(Duration::from_secs(300)));
}

#[tokio::test]
async fn a_failing_cleanup_is_retried_later_and_later_then_forgotten() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let ctrl = start_controller(&server, "node-a", &fake);
    running_pod(&client, "redis", "node-a").await;
    let snap = Snapshot::new(
        "flaky",
        SnapshotSpec {
            pod_uid: None,
            export: false,
            failure_deadline_seconds: None,
            pod_name: "redis".into(),
            mode: SnapshotMode::Incremental,
            deletion_policy: DeletionPolicy::Delete,
            ttl_seconds_after_ready: None,
        },
    );
    create(&client, &snap).await;
    wait_for(&client, "flaky", "Ready", |s: &Snapshot| {
        s.status.as_ref().is_some_and(|st| st.phase == Phase::Ready)
    })
    .await;

    // The node service is down for three calls, then back.
    fake.fail_deletes(3);
    let api: Api<Snapshot> = Api::namespaced(client.clone(), NS);
    api.delete("flaky", &DeleteParams::default())
        .await
        .expect("delete");
    wait_gone::<Snapshot>(&client, "flaky").await;
    let times = fake.delete_times();
    assert_eq!(times.len(), 4, "one call per attempt");
    let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
    // start_controller: backoff from 100 ms, doubling.
    for (gap, least) in gaps.iter().zip([100, 200, 400]) {
        assert!(
            *gap >= Duration::from_millis(least),
            "retried after {gap:?}, before its {least} ms backoff: {gaps:?}"
        );
    }
    assert!(gaps[1] > gaps[0] && gaps[2] > gaps[1], "{gaps:?}");
    // The reconcile that removed the finalizer resets the backoff as it returns.
    eventually("the success to reset the backoff", || async {
        (ctrl.ctx.backoff.failure_count("Snapshot/default/flaky") == 0).then_some(())
    })
    .await;
}
