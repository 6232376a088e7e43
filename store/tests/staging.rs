//! Staging beside other processes' cleanups: every `NodeStore::open` sweeps
//! `tmp/`, and shims open the store while others stage. A lease swept
//! between its creation and its lock lost the staging directory under its
//! writer (twig-vmm: "cannot create disk0 in the staging directory").

use std::fs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use twig_store::{Artefact, NodeStore};

/// Rounds of stage → write → publish against a sweeping neighbour.
const ROUNDS: usize = 1000;

#[test]
fn a_neighbour_s_cleanup_never_takes_a_live_staging() {
    let dir = tempfile::tempdir().expect("a temp dir");
    // Two handles stand for two processes: flock is per open file.
    let stager = NodeStore::open(dir.path(), true).expect("open the store");
    let sweeper = NodeStore::open(dir.path(), true).expect("open it again");
    let stop = AtomicBool::new(false);
    thread::scope(|s| {
        // Stops the sweeper however this scope ends (a failed round too).
        let stopper = StopOnDrop(&stop);
        let sweeping = s.spawn(|| {
            let mut sweeps = 0u64;
            while !stop.load(Ordering::Relaxed) {
                sweeper.cleanup().expect("a cleanup beside staging");
                sweeps += 1;
            }
            sweeps
        });
        for i in 0..ROUNDS {
            let id = format!("s{i}");
            let mut staging = stager.stage(&id).expect("stage");
            // The writer creates its files in the directory it was given.
            fs::write(staging.dir().join("state"), b"vcpu state")
                .unwrap_or_else(|e| panic!("round {i}: the staging directory went: {e}"));
            staging
                .put_bytes(Artefact::Memory, b"ram")
                .unwrap_or_else(|e| panic!("round {i}: {e}"));
            staging
                .publish()
                .unwrap_or_else(|e| panic!("round {i}: publishing: {e}"));
        }
        drop(stopper);
        let sweeps = sweeping.join().expect("the sweeper");
        assert!(sweeps > 0, "the sweeper never ran");
    });
    assert_eq!(stager.list().expect("list").len(), ROUNDS);
    let tmp: Vec<_> = fs::read_dir(dir.path().join("tmp"))
        .expect("tmp")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(tmp.is_empty(), "left in tmp/: {tmp:?}");
}

/// A lease being made (`<id>.<pid>.<n>.new`) is its maker's while the
/// maker lives, and a leftover once it died.
#[test]
fn a_cleanup_leaves_leases_being_made_to_live_makers_only() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let store = NodeStore::open(dir.path(), true).expect("open the store");
    let mut child = std::process::Command::new("true")
        .spawn()
        .expect("spawn true");
    let dead = child.id();
    child.wait().expect("wait for true");
    let tmp = dir.path().join("tmp");
    let live = tmp.join(format!("a.b.{}.0.new", std::process::id()));
    let left = tmp.join(format!("a.b.{dead}.0.new"));
    for d in [&live, &left] {
        fs::create_dir(d).expect("a lease being made");
    }
    assert_eq!(store.cleanup().expect("cleanup"), 1);
    assert!(
        live.exists(),
        "a live process's lease in the making was removed"
    );
    assert!(
        !left.exists(),
        "a dead process's lease in the making stayed"
    );
}

struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A staging directory is its writer's alone (a jailed VMM, each its own
/// user, gets it chowned; no other VMM can look in); published, it stays
/// closed to other users (readers are granted it: `tests/grants.rs`).
#[test]
fn staging_and_a_published_snapshot_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let store = NodeStore::open(dir.path(), true).unwrap();
    let mut staging = store.stage("s").unwrap();
    let mode = |p: &std::path::Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(staging.dir()), 0o700);
    staging.put_bytes(Artefact::State, b"state").unwrap();
    let published = staging.publish().unwrap();
    assert_eq!(mode(published.dir()), 0o700);
}

#[test]
fn a_described_staging_reads_as_what_it_will_publish() {
    let dir = tempfile::tempdir().unwrap();
    let store = twig_store::NodeStore::open(dir.path(), true).unwrap();
    let mut staging = store.stage("pulled").unwrap();
    staging
        .put_bytes(twig_store::Artefact::State, b"state")
        .unwrap();
    staging.set_owner("team-a").unwrap();
    staging.set_label("twig.dev/containers", "[]");
    // Nothing described yet.
    let e = store.staged(staging.dir()).unwrap_err();
    assert!(matches!(e, twig_store::Error::NotFound(_)), "{e}");
    staging.describe().unwrap();

    let s = store.staged(staging.dir()).unwrap();
    assert_eq!(s.id, "pulled");
    assert_eq!(s.dir(), staging.dir());
    assert_eq!(s.owner.as_deref(), Some("team-a"));
    assert_eq!(s.labels["twig.dev/containers"], "[]");
    assert_eq!(
        s.artefacts.keys().collect::<Vec<_>>(),
        [&twig_store::Artefact::State]
    );
    // Unpublished: not a snapshot of the store yet.
    assert!(store.get("pulled").is_err());
    // Only this store's stagings.
    let other = tempfile::tempdir().unwrap();
    assert!(store.staged(other.path()).is_err());

    // What arrives later is published; the description is not.
    staging
        .put_bytes(twig_store::Artefact::Memory, b"memory")
        .unwrap();
    let published = staging.publish().unwrap();
    assert_eq!(published.owner.as_deref(), Some("team-a"));
    assert_eq!(published.artefacts.len(), 2);
    assert!(!published.dir().join(twig_store::layout::STAGED).exists());
}
