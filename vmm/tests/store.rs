//! twig-vmm and the node store together (twig-store): snapshots made by a VM
//! are staged, published, listed, restored, reflinked out and deleted
//! through the store, and a store moved elsewhere still restores its chains.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::*;
use twig_store::{Artefact, Error as StoreError, NodeStore};
use twig_vmm::{DeviceConfig, DiskConfig, Kind, Shape, Vm};

const DISK: usize = 256 * 1024;

fn disk(path: PathBuf, byte: u8) -> PathBuf {
    std::fs::write(&path, vec![byte; DISK]).unwrap();
    path
}

fn with_disk(path: &Path) -> DeviceConfig {
    DeviceConfig {
        disks: vec![DiskConfig {
            path: path.to_path_buf(),
            read_only: false,
        }],
        ..Default::default()
    }
}

fn restore(dir: &Path, devices: &DeviceConfig) -> Vm {
    let mut vm = Vm::create_with(Shape::new(MIB, 1), Box::new(std::io::sink()), devices).unwrap();
    vm.restore(dir).unwrap();
    vm.pause().unwrap();
    vm
}

#[test]
fn a_vmm_snapshot_is_stored_listed_restored_and_deleted_through_the_node_store() {
    let d = tmp();
    let rw = disk(d.path().join("rw.img"), 0x5a);
    let mut g = boot_with(d.path(), MIB, 1, &with_disk(&rw));
    let store = NodeStore::open(&d.path().join("store"), true).unwrap();

    dirty(&mut g.vm, 0, 8, 10);
    let base = g.vm.snapshot_into(&store, "base", Kind::Full).unwrap();
    assert_eq!((base.id.as_str(), base.parent.as_deref()), ("base", None));
    std::fs::write(&rw, vec![0x77; DISK]).unwrap();
    dirty(&mut g.vm, 4, 8, 20);
    let child =
        g.vm.snapshot_into(&store, "child", Kind::Incremental)
            .unwrap();
    assert_eq!(child.parent.as_deref(), Some("base"));

    // Listed with the layout's artefacts, their sizes as on disk.
    let list = store.list().unwrap();
    let ids: Vec<_> = list.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["base", "child"]);
    let (b, c) = (&list[0], &list[1]);
    assert_eq!(
        (b.kind, b.parent.as_deref()),
        (twig_store::Kind::Full, None)
    );
    assert_eq!(
        (c.kind, c.parent.as_deref()),
        (twig_store::Kind::Incremental, Some("base"))
    );
    for s in &list {
        let sizes: BTreeMap<Artefact, u64> = [Artefact::Memory, Artefact::State, Artefact::Disk(0)]
            .into_iter()
            .map(|a| {
                (
                    a,
                    std::fs::metadata(s.dir().join(a.file_name()))
                        .unwrap()
                        .len(),
                )
            })
            .collect();
        assert_eq!(s.artefacts, sizes, "{}", s.id);
        assert_eq!(s.dir(), store.snapshot_dir(&s.id));
        twig_vmm::snapshot::verify(s.dir()).unwrap();
    }
    assert_eq!(b.artefacts[&Artefact::Memory], (MIB << 20) as u64);
    assert_eq!(store.usage_of("child").unwrap().files, 3);

    // Restored from the store: the chain's memory and the child's disk.
    let rw2 = disk(d.path().join("rw2.img"), 0);
    let r = restore(c.dir(), &with_disk(&rw2));
    assert_eq!((word(&r, 0), word(&r, 4), word(&r, 11)), (10, 20, 27));
    assert!(std::fs::read(&rw2).unwrap() == vec![0x77; DISK]);
    // A pod's own disk reflinked (here copied) out of the base.
    let pod = d.path().join("pod.img");
    store.reflink_out("base", Artefact::Disk(0), &pod).unwrap();
    assert!(std::fs::read(&pod).unwrap() == vec![0x5a; DISK]);

    // A parent with a child cannot go; then both go, in order.
    match store.delete("base") {
        Err(StoreError::FailedPrecondition(m)) => assert!(m.contains("child"), "{m}"),
        other => panic!("deleting a parent with a child: {other:?}"),
    }
    restore(c.dir(), &with_disk(&rw2));
    store.delete("child").unwrap();
    store.delete("base").unwrap();
    assert!(store.list().unwrap().is_empty());
    assert!(matches!(store.get("base"), Err(StoreError::NotFound(_))));
    let mut vm = Vm::create_with(
        Shape::new(MIB, 1),
        Box::new(std::io::sink()),
        &with_disk(&rw2),
    )
    .unwrap();
    let e = vm
        .restore(&store.snapshot_dir("base"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot open the state file"), "{e}");
    // The restored VM's disk and the pod's disk are their own.
    assert!(std::fs::read(&pod).unwrap() == vec![0x5a; DISK]);

    // The VM's baseline was deleted: an incremental on it cannot publish,
    // and the store says why.
    let e =
        g.vm.snapshot_into(&store, "orphan", Kind::Incremental)
            .unwrap_err()
            .to_string();
    assert!(e.contains("\"child\" not found"), "{e}");
    assert!(store.list().unwrap().is_empty());
    // A full snapshot needs no parent and starts a new baseline.
    g.vm.snapshot_into(&store, "again", Kind::Full).unwrap();
    assert_eq!(store.list().unwrap().len(), 1);
}

#[test]
fn a_moved_store_still_restores_its_chains() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    let old = d.path().join("node-a");
    {
        let store = NodeStore::open(&old, true).unwrap();
        dirty(&mut g.vm, 0, 4, 100);
        g.vm.snapshot_into(&store, "s0", Kind::Full).unwrap();
        dirty(&mut g.vm, 2, 4, 200);
        g.vm.snapshot_into(&store, "s1", Kind::Incremental).unwrap();
        dirty(&mut g.vm, 5, 2, 300);
        g.vm.snapshot_into(&store, "s2", Kind::Incremental).unwrap();
    }
    g.vm.pause().unwrap();
    let want = g.vm.read_guest_ram().unwrap();

    // Moved one level deeper, under another name.
    let new = d.path().join("elsewhere/node-b");
    std::fs::create_dir(d.path().join("elsewhere")).unwrap();
    std::fs::rename(&old, &new).unwrap();
    assert!(!old.exists());
    let store = NodeStore::open(&new, true).unwrap();
    let ids: Vec<_> = store.list().unwrap().into_iter().map(|s| s.id).collect();
    assert_eq!(ids, ["s0", "s1", "s2"]);
    let tip = store.get("s2").unwrap();
    assert!(tip.dir().starts_with(&new));
    let meta = twig_vmm::snapshot::verify(tip.dir()).unwrap();
    assert_eq!(meta.parent.map(|p| p.id).as_deref(), Some("s1"));

    let r = restore(tip.dir(), &DeviceConfig::default());
    assert!(r.read_guest_ram().unwrap() == want, "the whole chain");
    assert_eq!((word(&r, 0), word(&r, 3), word(&r, 6)), (100, 201, 301));
    let mid = restore(&store.snapshot_dir("s1"), &DeviceConfig::default());
    assert_eq!((word(&mid, 3), word(&mid, 6)), (201, 0));

    // Clones and a rollback of a running VM read the moved chain too.
    let clones = Vm::clone_from(
        tip.dir(),
        2,
        |_| Box::new(std::io::sink()),
        |_| DeviceConfig::default(),
    )
    .unwrap();
    assert_eq!(clones.len(), 2);
    let mut other = boot(d.path(), MIB, 1);
    dirty(&mut other.vm, 0, 8, 9);
    other.vm.rollback(&store.snapshot_dir("s1")).unwrap();
    other.vm.pause().unwrap();
    assert_eq!(
        (word(&other.vm, 0), word(&other.vm, 3), word(&other.vm, 7)),
        (100, 201, 0)
    );
}
