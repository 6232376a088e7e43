//! The VM snapshot node store (twig-store), on a loop-mounted XFS, btrfs
//! (and a refusal on ext4): the filesystems a node runs it on.

mod common;

use common::LoopFs;
use std::fs;
use std::io::Write;
use twig_store::{Artefact, CloneMode, Error, Kind, Manifest, NodeStore};

fn write_pattern(path: &std::path::Path, mib: usize, byte: u8) {
    let mut f = fs::File::create(path).unwrap();
    for _ in 0..mib {
        f.write_all(&vec![byte; 1 << 20]).unwrap();
    }
    f.sync_all().unwrap();
}

#[test]
fn stage_publish_clone_account_delete() {
    let xfs = LoopFs::xfs(320);
    let store = NodeStore::open(&xfs.path().join("vm"), false).expect("open");
    assert_eq!(store.clone_mode(), CloneMode::Reflink);

    // Artefacts: memory written in place, disk reflinked in from a pod's disk.
    let pod_disk = xfs.path().join("pod-disk.img");
    write_pattern(&pod_disk, 16, 0xd1);
    let mut staging = store.stage("tpl-1").expect("stage");
    write_pattern(&staging.path(Artefact::Memory), 8, 0x3e);
    staging.put_bytes(Artefact::State, b"vcpu state").unwrap();
    staging.put_file(Artefact::Disk(0), &pod_disk).unwrap();
    staging.set_label("twig.dev/pod", "default/agent-0");
    assert!(
        matches!(store.get("tpl-1"), Err(Error::NotFound(_))),
        "a staged snapshot must not be visible"
    );
    assert!(store.list().unwrap().is_empty());
    assert!(staging.dir().ends_with("tpl-1"), "named by the id");
    let snap = staging.publish().expect("publish");
    assert_eq!(snap.dir(), store.snapshot_dir("tpl-1"));
    assert_eq!(snap.kind, Kind::Full);
    assert_eq!(snap.artefacts[&Artefact::Memory], 8 << 20);
    assert_eq!(snap.artefacts[&Artefact::State], 10);
    assert_eq!(snap.artefacts[&Artefact::Disk(0)], 16 << 20);
    assert_eq!(snap.labels["twig.dev/pod"], "default/agent-0");
    assert_eq!(store.get("tpl-1").unwrap(), snap);
    // Labels change after publication, atomically; nothing else does.
    store
        .set_label("tpl-1", "twig.dev/egress-policy", Some("{}"))
        .unwrap();
    store.set_label("tpl-1", "twig.dev/pod", None).unwrap();
    let relabelled = store.get("tpl-1").unwrap();
    assert_eq!(relabelled.labels["twig.dev/egress-policy"], "{}");
    assert!(!relabelled.labels.contains_key("twig.dev/pod"));
    assert_eq!(relabelled.artefacts, snap.artefacts);
    assert!(!snap.dir().join("manifest.json.new").exists());
    assert!(matches!(
        store.set_label("absent", "k", Some("v")),
        Err(Error::NotFound(_))
    ));
    store
        .set_label("tpl-1", "twig.dev/pod", Some("default/agent-0"))
        .unwrap();
    let snap = store.get("tpl-1").unwrap();
    assert_eq!(
        fs::read(snap.path(Artefact::State).unwrap()).unwrap(),
        b"vcpu state"
    );

    // The same name cannot be published twice.
    let mut again = store.stage("tpl-1-b").unwrap();
    again.put_bytes(Artefact::State, b"x").unwrap();
    drop(again);
    assert!(matches!(store.stage("tpl-1"), Err(Error::AlreadyExists(_))));
    assert!(matches!(
        store.stage("../evil"),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(store.stage(""), Err(Error::InvalidArgument(_))));

    // A child on top of it, and reflinked disks for restored pods.
    let mut child = store.stage("tpl-1.snap-1").unwrap();
    child.set_parent("tpl-1").unwrap();
    child.put_bytes(Artefact::Memory, &[1u8; 4096]).unwrap();
    let child = child.publish().unwrap();
    assert_eq!(child.parent.as_deref(), Some("tpl-1"));
    assert_eq!(child.kind, Kind::Incremental, "a parent and no set_kind");
    assert_eq!(
        store
            .list()
            .unwrap()
            .iter()
            .map(|s| s.id.as_str())
            .collect::<Vec<_>>(),
        ["tpl-1", "tpl-1.snap-1"]
    );
    for i in 0..10 {
        let dest = xfs.path().join(format!("pod-{i}.img"));
        store
            .reflink_out("tpl-1", Artefact::Disk(0), &dest)
            .unwrap();
        assert_eq!(fs::metadata(&dest).unwrap().len(), 16 << 20);
    }
    assert!(matches!(
        store.reflink_out("tpl-1.snap-1", Artefact::Disk(0), &xfs.path().join("x")),
        Err(Error::NotFound(_))
    ));
    let pods: Vec<_> = (0..10)
        .map(|i| xfs.path().join(format!("pod-{i}.img")))
        .collect();
    let pods_usage = twig_store::fsops::usage_of(pods.iter().map(|p| p.as_path())).unwrap();
    assert_eq!(pods_usage.allocated_bytes, 160 << 20);
    assert!(
        pods_usage.unique_bytes <= 16 << 20,
        "ten reflinked disks occupy {} distinct bytes",
        pods_usage.unique_bytes
    );

    let usage = store.usage().unwrap();
    assert_eq!(usage.files, 4);
    assert_eq!(usage.logical_bytes, (8 << 20) + 10 + (16 << 20) + 4096);
    assert!(usage.shared_bytes >= 16 << 20, "{usage:?}");
    let one = store.usage_of("tpl-1").unwrap();
    assert_eq!(one.files, 3);

    // Deleting a parent is refused while its child exists.
    assert!(matches!(
        store.delete("tpl-1"),
        Err(Error::FailedPrecondition(_))
    ));
    store.delete("tpl-1.snap-1").unwrap();
    store.delete("tpl-1").unwrap();
    assert!(matches!(store.delete("tpl-1"), Err(Error::NotFound(_))));
    assert!(store.list().unwrap().is_empty());
    // The pods' disks are independent of the deleted snapshot.
    assert_eq!(fs::read(&pods[3]).unwrap(), vec![0xd1; 16 << 20]);
}

#[test]
fn crash_leftovers_are_cleaned_but_live_staging_is_not() {
    let xfs = LoopFs::xfs(320);
    let root = xfs.path().join("vm");
    let store = NodeStore::open(&root, false).unwrap();
    // What a writer killed mid-staging leaves behind: an unlocked directory.
    let dead = root.join("tmp/crashed.123.0.staging");
    fs::create_dir(&dead).unwrap();
    fs::write(dead.join("memory"), b"half").unwrap();
    // A writer still at work in another handle (as another process would).
    let other = NodeStore::open(&root, false).unwrap();
    assert!(!dead.exists(), "open() removes crash leftovers");
    let mut live = other.stage("live").unwrap();
    live.put_bytes(Artefact::State, b"s").unwrap();
    assert_eq!(store.cleanup().unwrap(), 0, "a locked staging dir is kept");
    let published = live.publish().unwrap();
    assert_eq!(store.get("live").unwrap(), published);
    // A file beside the snapshots (a template builder's lock) is no snapshot.
    fs::write(root.join("snapshots/live.lock"), b"").unwrap();
    assert_eq!(store.list().unwrap(), std::slice::from_ref(&published));
    fs::remove_file(root.join("snapshots/live.lock")).unwrap();
    // A staging dropped without publishing vanishes.
    let mut dropped = store.stage("dropped").unwrap();
    dropped.put_bytes(Artefact::State, b"s").unwrap();
    let path = dropped.path(Artefact::State);
    drop(dropped);
    assert!(!path.exists());
    assert!(matches!(store.get("dropped"), Err(Error::NotFound(_))));
    assert_eq!(fs::read_dir(root.join("tmp")).unwrap().count(), 0);
    // Publishing nothing is refused.
    assert!(matches!(
        store.stage("empty").unwrap().publish(),
        Err(Error::InvalidArgument(_))
    ));
}

/// What a writer in another process (twig-vmm) leaves in its staging
/// directory decides what is published: its manifest gives the parent and
/// kind and must list what the directory holds; anything outside the layout
/// is refused and nothing is visible.
#[test]
fn a_writers_manifest_is_checked_and_foreign_files_are_refused() {
    let xfs = LoopFs::xfs(320);
    let store = NodeStore::open(&xfs.path().join("vm"), false).unwrap();
    let mut base = store.stage("base").unwrap();
    base.put_bytes(Artefact::State, b"s").unwrap();
    base.publish().unwrap();

    // A manifest naming another id, a parent the store lacks, or listing
    // other files than the directory holds, is refused.
    type Doctor = fn(&mut Manifest);
    let cases: [(Doctor, &str); 3] = [
        (|m| m.id = "other".into(), "names snapshot"),
        (|m| m.parent = Some("gone".into()), "gone"),
        (
            |m| {
                m.artefacts.insert("disk7".into(), 1);
            },
            "but the directory holds",
        ),
    ];
    for (doctor, why) in cases {
        let mut c = store.stage("c").unwrap();
        c.put_bytes(Artefact::Memory, &[1u8; 4096]).unwrap();
        let mut m = Manifest::of_staging(c.dir(), "c", Some("base"), Kind::Incremental).unwrap();
        doctor(&mut m);
        m.write(c.dir()).unwrap();
        let e = c.publish().unwrap_err().to_string();
        assert!(e.contains(why), "{why}: {e}");
        assert!(matches!(store.get("c"), Err(Error::NotFound(_))));
    }
    let c = store.stage("c").unwrap();
    assert!(Manifest::of_staging(c.dir(), "c", None, Kind::Incremental)
        .unwrap_err()
        .to_string()
        .contains("needs a parent"));
    drop(c);
    // A file outside the layout (or a misspelt disk) is refused.
    for name in ["disk.img", "disk01", "notes"] {
        let mut c = store.stage("c").unwrap();
        c.put_bytes(Artefact::State, b"s").unwrap();
        fs::write(c.dir().join(name), b"x").unwrap();
        let e = c.publish().unwrap_err().to_string();
        assert!(e.contains("is not an artefact"), "{name}: {e}");
    }
    // The staging and the writer's manifest must agree.
    let mut c = store.stage("c").unwrap();
    c.put_bytes(Artefact::State, b"s").unwrap();
    c.set_kind(Kind::Full);
    Manifest::of_staging(c.dir(), "c", Some("base"), Kind::Incremental)
        .unwrap()
        .write(c.dir())
        .unwrap();
    assert!(c
        .publish()
        .unwrap_err()
        .to_string()
        .contains("another kind"));
    // A good one: parent and kind recorded, labels added; the parent is
    // then pinned.
    let mut c = store.stage("c").unwrap();
    c.put_bytes(Artefact::Memory, &[1u8; 4096]).unwrap();
    c.put_bytes(Artefact::Disk(3), &[2u8; 512]).unwrap();
    Manifest::of_staging(c.dir(), "c", Some("base"), Kind::Incremental)
        .unwrap()
        .write(c.dir())
        .unwrap();
    c.set_label("twig.dev/pod", "ns/p");
    let c = c.publish().unwrap();
    assert_eq!(
        (c.parent.as_deref(), c.kind),
        (Some("base"), Kind::Incremental)
    );
    assert_eq!(c.labels["twig.dev/pod"], "ns/p");
    assert_eq!(
        c.artefacts.keys().copied().collect::<Vec<_>>(),
        [Artefact::Memory, Artefact::Disk(3)]
    );
    assert!(matches!(
        store.delete("base"),
        Err(Error::FailedPrecondition(_))
    ));
    assert_eq!(fs::read_dir(xfs.path().join("vm/tmp")).unwrap().count(), 0);
}

#[test]
fn refuses_ext4_without_allow_copy() {
    let ext4 = LoopFs::ext4(64);
    let root = ext4.path().join("vm");
    match NodeStore::open(&root, false) {
        Err(e @ Error::NoReflink { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("reflink") && msg.contains("--allow-copy"),
                "{msg}"
            );
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("ext4 must be refused"),
    }
    let store = NodeStore::open(&root, true).unwrap();
    assert_eq!(store.clone_mode(), CloneMode::Copy);
    let mut s = store.stage("a").unwrap();
    s.put_bytes(Artefact::Disk(0), &[9u8; 8192]).unwrap();
    s.publish().unwrap();
    let dest = ext4.path().join("copy.img");
    store.reflink_out("a", Artefact::Disk(0), &dest).unwrap();
    assert_eq!(fs::read(&dest).unwrap(), vec![9u8; 8192]);
}

/// Both stores work on btrfs, the other reflink filesystem the issue names.
#[test]
fn both_stores_reflink_on_btrfs() {
    let btrfs = LoopFs::btrfs(320);
    let vm = NodeStore::open(&btrfs.path().join("vm"), false).expect("node store on btrfs");
    assert_eq!(vm.clone_mode(), CloneMode::Reflink);

    let store = twig_snapshotter::SnapshotStore::open(
        &btrfs.path().join("snapshots"),
        &twig_snapshotter::StoreOptions {
            image_size: 32 << 20,
            allow_copy: false,
        },
    )
    .expect("snapshot store on btrfs");
    assert_eq!(store.clone_mode(), CloneMode::Reflink);
    store.prepare("a", None, Default::default()).unwrap();
    store.commit("c", "a", Default::default()).unwrap();
    for i in 0..10 {
        store
            .prepare(&format!("child-{i}"), Some("c"), Default::default())
            .unwrap();
    }
    let usage = store.disk_usage().unwrap();
    assert_eq!(usage.files, 11);
    assert!(
        usage.unique_bytes * 5 < usage.allocated_bytes,
        "children must share the parent's blocks: {usage:?}"
    );
    let image = store.image_path("child-3").unwrap();
    assert_eq!(fs::metadata(&image).unwrap().len(), 32 << 20);
}

/// Shims of pods starting together open the store at once: each open
/// probes reflinks in `tmp/` and sweeps `tmp/` of abandoned entries, and
/// neither may take the other's probe files away (the lab's eight forks
/// failed with "does not support reflinks (ENOENT)", then "removing
/// .reflink-probe-…").
#[test]
fn stores_opened_at_once_all_reflink() {
    let xfs = LoopFs::xfs(320);
    let root = xfs.path().join("vm");
    NodeStore::open(&root, false).expect("open");
    let openers: Vec<_> = (0..16)
        .map(|_| {
            let root = root.clone();
            std::thread::spawn(move || {
                (0..10)
                    .map(|_| NodeStore::open(&root, false).map(|s| s.clone_mode()))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for opener in openers {
        for opened in opener.join().expect("an opener") {
            assert_eq!(opened.expect("open"), CloneMode::Reflink);
        }
    }
    let left: Vec<_> = fs::read_dir(root.join("tmp"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left in tmp: {left:?}");
}
