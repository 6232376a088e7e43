//! Who reads a published snapshot (needs root: the writer is another
//! user, as a jailed VMM is): a publish makes the staging directory root's
//! and private, its files root's and not writable by the writer, and
//! grants its writer (and only it) read by an ACL entry; `grant_chain`
//! grants a snapshot and every parent to a user, `revoke_grants` takes
//! a user's grants back by its ledger, `revoke_reads` by a walk, `seal_published` closes snapshots published open.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use twig_store::fsops::acl_users;
use twig_store::grants::{grant_chain, revoke_grants, revoke_reads};
use twig_store::nodestore::seal_published;
use twig_store::{Artefact, NodeStore};

const WRITER: u32 = 64_000;
const OTHER: u32 = 64_001;

/// What user `uid` (its own group) can open of `paths`.
fn opens_as(uid: u32, paths: &[PathBuf]) -> Vec<i32> {
    twig_store::testkit::opens_as(None, uid, uid, paths)
}

/// A store in a directory every user may enter (the test's users reach
/// the store only through their grants).
fn store() -> (tempfile::TempDir, NodeStore) {
    let dir = tempfile::tempdir().unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let store = NodeStore::open(dir.path(), true).unwrap();
    (dir, store)
}

/// Publishes `id` (on `parent`) as written by `writer`: the staging
/// directory and its files the writer's, as twig-vmm's client leaves them.
fn publish_as(store: &NodeStore, id: &str, parent: Option<&str>, writer: u32) {
    let mut staging = store.stage(id).unwrap();
    if let Some(p) = parent {
        staging.set_parent(p).unwrap();
    }
    staging.put_bytes(Artefact::State, b"state").unwrap();
    staging.put_bytes(Artefact::Memory, b"memory").unwrap();
    for f in ["state", "memory"] {
        std::os::unix::fs::chown(staging.dir().join(f), Some(writer), Some(writer)).unwrap();
    }
    std::os::unix::fs::chown(staging.dir(), Some(writer), Some(writer)).unwrap();
    staging.publish().unwrap();
}

fn files(dir: &Path) -> Vec<PathBuf> {
    vec![dir.join("state"), dir.join("memory")]
}

#[test]
fn a_published_snapshot_is_roots_and_read_by_its_writer_alone() {
    let (_d, store) = store();
    publish_as(&store, "s", None, WRITER);
    let dir = store.snapshot_dir("s");
    let m = fs::metadata(&dir).unwrap();
    assert_eq!((m.uid(), m.gid(), m.mode() & 0o707), (0, 0, 0o700));
    for f in files(&dir) {
        let m = fs::metadata(&f).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o644), "{}", f.display());
    }
    assert_eq!(acl_users(&dir).unwrap(), [WRITER]);
    assert_eq!(opens_as(WRITER, &files(&dir)), [0, 0]);
    assert_eq!(opens_as(OTHER, &files(&dir)), [libc::EACCES; 2]);
    // `snapshots/` is entered by id, never listed.
    seal_published(store.root()).unwrap();
    assert_eq!(
        opens_as(WRITER, &[store.root().join("snapshots")]),
        [libc::EACCES]
    );
    assert_eq!(opens_as(WRITER, &files(&dir)), [0, 0]);
}

#[test]
fn a_chain_is_granted_whole_and_revoked_per_user() {
    let (_d, store) = store();
    publish_as(&store, "base", None, 0);
    publish_as(&store, "top", Some("base"), WRITER);
    let (base, top) = (store.snapshot_dir("base"), store.snapshot_dir("top"));
    assert_eq!(opens_as(OTHER, &files(&base)), [libc::EACCES; 2]);

    grant_chain(store.root(), "top", OTHER).unwrap();
    let all: Vec<PathBuf> = files(&top).into_iter().chain(files(&base)).collect();
    assert_eq!(opens_as(OTHER, &all), [0; 4]);
    // The writer was granted only what it wrote.
    assert_eq!(opens_as(WRITER, &all), [0, 0, libc::EACCES, libc::EACCES]);

    assert_eq!(revoke_grants(store.root(), OTHER).unwrap(), 2);
    assert_eq!(opens_as(OTHER, &all), [libc::EACCES; 4]);
    assert_eq!(opens_as(WRITER, &files(&top)), [0, 0]);
    // The ledger is emptied: nothing more to take back.
    assert_eq!(revoke_grants(store.root(), OTHER).unwrap(), 0);
    assert_eq!(revoke_grants(store.root(), WRITER).unwrap(), 1);
    assert_eq!(opens_as(WRITER, &files(&top)), [libc::EACCES; 2]);
    // No grant left: the directory's mode alone again.
    assert!(acl_users(&top).unwrap().is_empty());
    assert_eq!(fs::metadata(&top).unwrap().mode() & 0o777, 0o700);

    let e = grant_chain(store.root(), "absent", OTHER).unwrap_err();
    assert!(matches!(e, twig_store::Error::NotFound(_)), "{e}");
}

#[test]
fn a_snapshot_published_open_is_sealed() {
    let (_d, store) = store();
    publish_as(&store, "old", None, WRITER);
    let dir = store.snapshot_dir("old");
    // As a store published before snapshots were sealed left it.
    revoke_reads(store.root(), |_| true).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&dir, Some(WRITER), Some(WRITER)).unwrap();
    assert_eq!(opens_as(OTHER, &files(&dir)), [0, 0]);
    assert_eq!(seal_published(store.root()).unwrap(), 1);
    assert_eq!(opens_as(OTHER, &files(&dir)), [libc::EACCES; 2]);
    let m = fs::metadata(&dir).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o700));
    assert_eq!(seal_published(store.root()).unwrap(), 0);
}

/// A writer's symbolic link is never followed: refused at publish, and
/// left as it is (with the host file it names) when a snapshot published
/// open is sealed.
#[test]
fn sealing_follows_no_link_of_the_writer() {
    let (d, store) = store();
    let host = d.path().join("host-file");
    fs::write(&host, b"secret").unwrap();
    fs::set_permissions(&host, fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&host, Some(OTHER), Some(OTHER)).unwrap();
    let mut staging = store.stage("s").unwrap();
    staging.put_bytes(Artefact::State, b"state").unwrap();
    std::os::unix::fs::symlink(&host, staging.dir().join("memory")).unwrap();
    std::os::unix::fs::chown(staging.dir(), Some(WRITER), Some(WRITER)).unwrap();
    let e = staging.publish().unwrap_err();
    assert!(matches!(e, twig_store::Error::InvalidArgument(_)), "{e}");

    publish_as(&store, "old", None, WRITER);
    let dir = store.snapshot_dir("old");
    fs::remove_file(dir.join("memory")).unwrap();
    std::os::unix::fs::symlink(&host, dir.join("memory")).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(seal_published(store.root()).unwrap(), 1);
    let m = fs::metadata(&host).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o777), (OTHER, 0o600));
}

#[test]
fn a_staged_snapshot_is_read_not_changed_by_its_reader() {
    let (_d, store) = store();
    let mut staging = store.stage("pulled").unwrap();
    staging.put_bytes(Artefact::State, b"state").unwrap();
    staging.put_bytes(Artefact::Memory, b"memory").unwrap();
    staging.set_owner("team-a").unwrap();
    staging.describe().unwrap();
    let dir = staging.dir().to_path_buf();
    assert_eq!(opens_as(OTHER, &files(&dir)), [libc::EACCES; 2]);

    store.grant_staged(&dir, OTHER).unwrap();
    assert_eq!(opens_as(OTHER, &files(&dir)), [0, 0]);
    assert_eq!(opens_as(WRITER, &files(&dir)), [libc::EACCES; 2]);
    // Read and search only: the directory stays root's, so the reader
    // cannot unlink or replace what will be published.
    let m = fs::metadata(&dir).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o707), (0, 0o700));
    assert_eq!(acl_users(&dir).unwrap(), [OTHER]);
    // Not a staging of this store: refused.
    let e = store
        .grant_staged(&store.snapshot_dir("pulled"), OTHER)
        .unwrap_err();
    assert!(matches!(e, twig_store::Error::InvalidArgument(_)), "{e}");

    staging.publish().unwrap();
    let published = store.snapshot_dir("pulled");
    assert_eq!(opens_as(OTHER, &files(&published)), [0, 0]);
    assert_eq!(revoke_grants(store.root(), OTHER).unwrap(), 1);
    assert_eq!(opens_as(OTHER, &files(&published)), [libc::EACCES; 2]);
}
