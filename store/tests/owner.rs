//! Every snapshot records the Kubernetes namespace that owns it, set by
//! the publisher and never by the writer, and only a pod of that namespace
//! may restore it (issue 24, item 1).

use std::fs;

use twig_store::{Artefact, Error, Kind, Manifest, NodeStore};

fn store() -> (tempfile::TempDir, NodeStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = NodeStore::open(dir.path(), true).unwrap();
    (dir, store)
}

#[test]
fn a_snapshot_restores_only_into_its_owners_namespace() {
    let (_dir, store) = store();
    let mut staging = store.stage("pod-a-snap").unwrap();
    staging.put_bytes(Artefact::State, b"state").unwrap();
    staging.set_owner("team-a").unwrap();
    let s = staging.publish().unwrap();
    assert_eq!(s.owner.as_deref(), Some("team-a"));
    assert_eq!(
        store.get("pod-a-snap").unwrap().owner.as_deref(),
        Some("team-a")
    );

    s.check_owner(Some("team-a")).unwrap();
    for other in [Some("team-b"), None] {
        let e = s.check_owner(other).unwrap_err();
        assert!(matches!(e, Error::PermissionDenied(_)), "{other:?}: {e}");
        assert!(e.to_string().contains("team-a"), "{e}");
    }
}

#[test]
fn the_writers_manifest_cannot_choose_the_owner() {
    let (_dir, store) = store();
    let mut staging = store.stage("s").unwrap();
    staging.put_bytes(Artefact::State, b"state").unwrap();
    // A (compromised) writer claims another tenant's namespace.
    let mut m = Manifest::of_staging(staging.dir(), "s", None, Kind::Full).unwrap();
    m.owner = Some("victim".into());
    m.write(staging.dir()).unwrap();
    staging.set_owner("attacker").unwrap();
    let s = staging.publish().unwrap();
    assert_eq!(s.owner.as_deref(), Some("attacker"));
    assert!(s.check_owner(Some("victim")).is_err());

    // And with no owner set, the writer's claim is dropped, not kept.
    let staging = store.stage("t").unwrap();
    fs::write(staging.path(Artefact::State), b"state").unwrap();
    let mut m = Manifest::of_staging(staging.dir(), "t", None, Kind::Full).unwrap();
    m.owner = Some("victim".into());
    m.write(staging.dir()).unwrap();
    let t = staging.publish().unwrap();
    assert_eq!(t.owner, None);
    assert!(t.check_owner(Some("victim")).is_err());
    t.check_owner(None).unwrap();
}

#[test]
fn the_writers_manifest_cannot_set_labels() {
    let (_dir, store) = store();
    let mut staging = store.stage("s").unwrap();
    staging.put_bytes(Artefact::State, b"state").unwrap();
    // A (compromised) writer claims to be the pulled copy of an artifact
    // and the template of some spec.
    let mut m = Manifest::of_staging(staging.dir(), "s", None, Kind::Full).unwrap();
    m.labels
        .insert("twig.dev/oci-manifest".into(), "sha256:forged".into());
    m.labels.insert("kept".into(), "by the writer".into());
    m.write(staging.dir()).unwrap();
    staging.set_label("kept", "by the publisher");
    let s = staging.publish().unwrap();
    assert_eq!(s.labels.len(), 1, "{:?}", s.labels);
    assert_eq!(s.labels["kept"], "by the publisher");
    let again = store.get("s").unwrap();
    assert_eq!(again.labels, s.labels);

    // With no label set, the writer's are all dropped.
    let staging = store.stage("t").unwrap();
    fs::write(staging.path(Artefact::State), b"state").unwrap();
    let mut m = Manifest::of_staging(staging.dir(), "t", None, Kind::Full).unwrap();
    m.labels
        .insert("twig.dev/oci-manifest".into(), "sha256:forged".into());
    m.write(staging.dir()).unwrap();
    assert!(staging.publish().unwrap().labels.is_empty());
}

#[test]
fn an_owner_is_a_namespace_name() {
    let (_dir, store) = store();
    let mut staging = store.stage("s").unwrap();
    for bad in ["", "Team", "a/b", "../x", &"x".repeat(64)] {
        let e = staging.set_owner(bad).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{bad:?}: {e}");
    }
}

#[test]
fn a_manifest_written_before_owners_were_recorded_reads_as_unowned() {
    let (_dir, store) = store();
    let staging = store.stage("old").unwrap();
    fs::write(staging.path(Artefact::State), b"state").unwrap();
    staging.publish().unwrap();
    let path = store.snapshot_dir("old").join("manifest.json");
    let text = fs::read_to_string(&path).unwrap();
    assert!(
        !text.contains("owner"),
        "an unowned manifest names no owner"
    );
    let s = store.get("old").unwrap();
    assert_eq!(s.owner, None);
    let e = s.check_owner(Some("default")).unwrap_err();
    assert!(e.to_string().contains("records no owning namespace"), "{e}");
}
