//! Disks in snapshots: a read-write disk's image is copied into every
//! snapshot and put back by rollback, restore and clone; read-only disks
//! must match; a rollback whose disk copy fails changes nothing.

mod common;

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use common::*;
use twig_vmm::{DeviceConfig, DiskConfig, Kind, RunState, Shape, Vm};

const DISK: usize = 1 << 20;

fn image(path: PathBuf, byte: u8, len: usize) -> PathBuf {
    std::fs::write(&path, vec![byte; len]).unwrap();
    path
}

/// Writes into a disk file in place, as the guest would.
fn write_at(path: &Path, off: u64, data: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, off).unwrap();
}

fn disks(rw: &Path, ro: &Path) -> DeviceConfig {
    DeviceConfig {
        disks: vec![
            DiskConfig {
                path: rw.to_path_buf(),
                read_only: false,
            },
            DiskConfig {
                path: ro.to_path_buf(),
                read_only: true,
            },
        ],
        ..Default::default()
    }
}

/// Hidden files (temporary copies, kept-aside images) left in `dir`.
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

/// Whether this process still holds `path`'s replaced (deleted) image open.
fn holds_deleted(path: &Path) -> bool {
    let deleted = format!("{} (deleted)", path.display());
    std::fs::read_dir("/proc/self/fd").unwrap().any(|e| {
        std::fs::read_link(e.unwrap().path()).is_ok_and(|l| l.to_string_lossy() == deleted)
    })
}

#[test]
fn snapshots_carry_read_write_disks_through_rollback_restore_and_clone() {
    let d = tmp();
    let rw = image(d.path().join("rw.img"), 0xa1, DISK);
    write_at(&rw, 4096, b"snapshot-time");
    let ro = image(d.path().join("ro.img"), 0x0f, 64 * 1024);
    let mut g = boot_with(d.path(), MIB, 1, &disks(&rw, &ro));
    dirty(&mut g.vm, 0, 4, 100);
    let s = snap(d.path(), "s");
    take(&mut g.vm, &s, Kind::Full).unwrap();
    let want = std::fs::read(&rw).unwrap();
    assert!(std::fs::read(s.join("disk0")).unwrap() == want, "disk0");
    assert!(!s.join("disk1").exists(), "read-only disks are not copied");
    twig_vmm::snapshot::verify(&s).unwrap();

    // The guest changes its disk and memory, then rolls back.
    write_at(&rw, 4096, b"after-the-snap");
    dirty(&mut g.vm, 0, 4, 200);
    g.vm.rollback(&s).unwrap();
    assert!(std::fs::read(&rw).unwrap() == want, "rolled-back disk");
    assert_eq!(word(&g.vm, 0), 100);
    assert_eq!(g.vm.state(), RunState::Running);
    print(&mut g.vm, &g.serial, b'r');
    assert!(leftovers(d.path()).is_empty(), "{:?}", leftovers(d.path()));
    assert!(!holds_deleted(&rw), "the device serves the new image");
    // Again, from the rolled-back state.
    write_at(&rw, 0, b"second-change");
    g.vm.rollback(&s).unwrap();
    assert!(std::fs::read(&rw).unwrap() == want);

    // A new VM with its own disk file gets the snapshot's disk.
    let rw2 = image(d.path().join("rw2.img"), 0, 512);
    let mut r = Vm::create_with(
        Shape::new(MIB, 1),
        Box::new(std::io::sink()),
        &disks(&rw2, &ro),
    )
    .unwrap();
    r.restore(&s).unwrap();
    assert!(std::fs::read(&rw2).unwrap() == want, "restored disk");
    assert_eq!(word(&r, 0), 100);
    assert!(!holds_deleted(&rw2));
    write_at(&rw2, 0, b"restored-vm");
    assert!(
        std::fs::read(s.join("disk0")).unwrap() == want,
        "the snapshot's copy is its own"
    );

    // Three clones, three separate files.
    let paths: Vec<PathBuf> = (0..3)
        .map(|i| image(d.path().join(format!("c{i}.img")), 0, 512))
        .collect();
    let clones = Vm::clone_from(
        &s,
        3,
        |_| Box::new(std::io::sink()),
        |i| disks(&paths[i], &ro),
    )
    .unwrap();
    assert_eq!(clones.len(), 3);
    for p in &paths {
        assert!(std::fs::read(p).unwrap() == want, "{}", p.display());
    }
    write_at(&paths[0], 0, b"clone-0");
    assert!(std::fs::read(&paths[1]).unwrap() == want);
    let inodes: Vec<u64> = paths
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().ino())
        .collect();
    assert!(inodes[0] != inodes[1] && inodes[1] != inodes[2] && inodes[0] != inodes[2]);
    assert!(
        std::fs::read(&rw).unwrap() == want,
        "the source's disk untouched"
    );
}

#[test]
fn restoring_into_a_vm_with_other_devices_is_refused() {
    let d = tmp();
    let rw = image(d.path().join("rw.img"), 1, DISK);
    let ro = image(d.path().join("ro.img"), 2, 64 * 1024);
    let mut g = boot_with(d.path(), MIB, 1, &disks(&rw, &ro));
    let s = snap(d.path(), "s");
    take(&mut g.vm, &s, Kind::Full).unwrap();
    let restore = |devices: &DeviceConfig| {
        let mut vm =
            Vm::create_with(Shape::new(MIB, 1), Box::new(std::io::sink()), devices).unwrap();
        vm.restore(&s).unwrap_err().to_string()
    };
    let e = restore(&DeviceConfig::default());
    assert!(
        e.contains("virtio devices differ")
            && e.contains("the snapshot has rng, block, block; this VM has rng"),
        "{e}"
    );
    let rw2 = image(d.path().join("rw2.img"), 3, 512);
    let mut swapped = disks(&rw2, &ro);
    swapped.disks[0].read_only = true;
    swapped.disks[1].read_only = false;
    let e = restore(&swapped);
    assert!(
        e.contains("disk 0 is read-write in the snapshot but read-only in this VM"),
        "{e}"
    );
    let ro_big = image(d.path().join("ro-big.img"), 2, 128 * 1024);
    let e = restore(&disks(&rw2, &ro_big));
    assert!(
        e.contains("read-only disk 1") && e.contains("the same image must be attached"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(&rw2).unwrap(),
        vec![3; 512],
        "refused: untouched"
    );
}

#[test]
fn a_rollback_whose_disk_copy_fails_leaves_the_vm_and_its_disk_as_they_were() {
    let d = tmp();
    let rw = image(d.path().join("rw.img"), 7, DISK);
    let ro = image(d.path().join("ro.img"), 8, 64 * 1024);
    let mut g = boot_with(d.path(), MIB, 1, &disks(&rw, &ro));
    dirty(&mut g.vm, 0, 4, 100);
    let s1 = snap(d.path(), "s1");
    take(&mut g.vm, &s1, Kind::Full).unwrap();
    let s2 = snap(d.path(), "s2");
    take(&mut g.vm, &s2, Kind::Incremental).unwrap();
    write_at(&rw, 0, b"live-state");
    dirty(&mut g.vm, 0, 4, 300);
    let live = std::fs::read(&rw).unwrap();

    // s1's disk copy is gone: refused before the VM is touched.
    std::fs::remove_file(s1.join("disk0")).unwrap();
    let e = g.vm.rollback(&s1).unwrap_err().to_string();
    assert!(e.contains("rollback refused") && e.contains("disk0"), "{e}");
    // s2 (the VM's baseline, already open) has a truncated copy: found
    // while copying, with the VM paused.
    std::fs::OpenOptions::new()
        .write(true)
        .open(s2.join("disk0"))
        .unwrap()
        .set_len(512)
        .unwrap();
    let e = g.vm.rollback(&s2).unwrap_err().to_string();
    assert!(
        e.contains("rollback refused") && e.contains("512 bytes"),
        "{e}"
    );

    assert_eq!(g.vm.state(), RunState::Running);
    assert_eq!(word(&g.vm, 0), 300, "memory as it was");
    assert!(std::fs::read(&rw).unwrap() == live, "disk as it was");
    assert!(leftovers(d.path()).is_empty(), "{:?}", leftovers(d.path()));
    print(&mut g.vm, &g.serial, b'!');
    let e = twig_vmm::snapshot::verify(&s2).unwrap_err().to_string();
    assert!(e.contains("disk0"), "{e}");
}
