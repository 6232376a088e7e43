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

fn slot(path: &Path, read_only: bool) -> DiskConfig {
    DiskConfig {
        path: path.to_path_buf(),
        read_only,
    }
}

/// One read-write fixed disk and `slots` disk slots.
fn with_slots(fixed: &Path, slots: usize) -> DeviceConfig {
    DeviceConfig {
        disks: vec![slot(fixed, false)],
        disk_slots: slots,
        ..Default::default()
    }
}

/// `(path, read_only, size)` of every slot.
fn slots_of(vm: &Vm) -> Vec<(Option<PathBuf>, bool, u64)> {
    vm.disk_slots()
        .into_iter()
        .map(|s| (s.path, s.read_only, s.size))
        .collect()
}

#[test]
fn disk_slots_carry_their_files_through_snapshot_rollback_restore_and_clone() {
    let d = tmp();
    let fixed = image(d.path().join("fixed.img"), 0x11, 64 * 1024);
    let ctr = image(d.path().join("ctr.img"), 0xa1, DISK);
    write_at(&ctr, 8192, b"container-rootfs");
    let base = image(d.path().join("base.img"), 0x0b, 128 * 1024);
    let mut g = boot_with(d.path(), MIB, 1, &with_slots(&fixed, 2));
    assert_eq!(slots_of(&g.vm), vec![(None, false, 0), (None, false, 0)]);
    dirty(&mut g.vm, 0, 2, 100);
    let s0 = snap(d.path(), "s0");
    take(&mut g.vm, &s0, Kind::Full).unwrap();
    assert!(!s0.join("disk1").exists() && !s0.join("disk2").exists());

    g.vm.attach_disk(0, &slot(&ctr, false)).unwrap();
    g.vm.attach_disk(1, &slot(&base, true)).unwrap();
    assert_eq!(
        slots_of(&g.vm),
        vec![
            (Some(ctr.clone()), false, DISK as u64),
            (Some(base.clone()), true, 128 * 1024)
        ]
    );
    dirty(&mut g.vm, 0, 2, 200);
    let s1 = snap(d.path(), "s1");
    take(&mut g.vm, &s1, Kind::Incremental).unwrap();
    let at_s1 = std::fs::read(&ctr).unwrap();
    assert!(
        std::fs::read(s1.join("disk1")).unwrap() == at_s1,
        "slot copied"
    );
    assert!(!s1.join("disk2").exists(), "read-only slots are not copied");
    twig_vmm::snapshot::verify(&s1).unwrap();

    // The container writes, then the pod rolls back: the slot's content
    // comes back in the same file.
    write_at(&ctr, 8192, b"written-after-s1");
    dirty(&mut g.vm, 0, 2, 300);
    g.vm.rollback(&s1).unwrap();
    assert!(std::fs::read(&ctr).unwrap() == at_s1, "slot content back");
    assert_eq!(word(&g.vm, 0), 200);
    assert_eq!(slots_of(&g.vm)[0].0.as_deref(), Some(ctr.as_path()));
    assert!(!holds_deleted(&ctr), "the slot serves the new image");
    assert!(leftovers(d.path()).is_empty(), "{:?}", leftovers(d.path()));

    // Clones: each names the file its attached slots go to.
    let paths: Vec<(PathBuf, PathBuf)> = (0..2)
        .map(|i| {
            (
                image(d.path().join(format!("f{i}.img")), 0, 512),
                d.path().join(format!("ctr{i}.img")),
            )
        })
        .collect();
    let clones = Vm::clone_from(
        &s1,
        2,
        |_| Box::new(std::io::sink()),
        |i| DeviceConfig {
            slot_files: [(0, paths[i].1.clone()), (1, base.clone())].into(),
            ..with_slots(&paths[i].0, 2)
        },
    )
    .unwrap();
    for (c, (f, ctr_i)) in clones.iter().zip(&paths) {
        assert!(
            std::fs::read(ctr_i).unwrap() == at_s1,
            "{}",
            ctr_i.display()
        );
        assert_eq!(std::fs::read(f).unwrap(), vec![0x11; 64 * 1024]);
        assert_eq!(
            slots_of(c),
            vec![
                (Some(ctr_i.clone()), false, DISK as u64),
                (Some(base.clone()), true, 128 * 1024)
            ]
        );
        assert_eq!(word(c, 0), 200);
    }
    write_at(&paths[0].1, 0, b"clone-0");
    assert!(std::fs::read(&paths[1].1).unwrap() == at_s1, "own files");
    assert!(std::fs::read(s1.join("disk1")).unwrap() == at_s1);
    drop(clones);

    // Back to before the attach: both slots empty, the files left alone.
    g.vm.rollback(&s0).unwrap();
    assert_eq!(slots_of(&g.vm), vec![(None, false, 0), (None, false, 0)]);
    assert_eq!(word(&g.vm, 0), 100);
    assert!(std::fs::read(&ctr).unwrap() == at_s1);

    // Forward to s1 needs the files attached again: refused until they are.
    let e = g.vm.rollback(&s1).unwrap_err().to_string();
    assert!(
        e.contains("rollback refused")
            && e.contains("disk slot 0 had a read-write image attached")
            && e.contains("attach the file"),
        "{e}"
    );
    assert_eq!(g.vm.state(), RunState::Running);
    assert_eq!(word(&g.vm, 0), 100);
    g.vm.attach_disk(0, &slot(&ctr, false)).unwrap();
    g.vm.attach_disk(1, &slot(&ctr, true)).unwrap();
    let e = g.vm.rollback(&s1).unwrap_err().to_string();
    assert!(
        e.contains("disk slot 1: read-only image") && e.contains("same image"),
        "{e}"
    );
    g.vm.detach_disk(1).unwrap();
    g.vm.attach_disk(1, &slot(&base, true)).unwrap();
    write_at(&ctr, 0, b"scribble");
    g.vm.rollback(&s1).unwrap();
    assert!(std::fs::read(&ctr).unwrap() == at_s1);
    assert_eq!(word(&g.vm, 0), 200);
    print(&mut g.vm, &g.serial, b's');
    assert!(leftovers(d.path()).is_empty(), "{:?}", leftovers(d.path()));
}

#[test]
fn restores_need_the_same_slots_and_a_file_for_each_attached_one() {
    let d = tmp();
    let fixed = image(d.path().join("fixed.img"), 1, 4096);
    let ctr = image(d.path().join("ctr.img"), 2, 8192);
    let mut g = boot_with(d.path(), MIB, 1, &with_slots(&fixed, 2));
    g.vm.attach_disk(1, &slot(&ctr, false)).unwrap();
    let s = snap(d.path(), "s");
    take(&mut g.vm, &s, Kind::Full).unwrap();
    let f2 = image(d.path().join("f2.img"), 3, 512);
    let restore = |devices: &DeviceConfig| {
        let mut vm =
            Vm::create_with(Shape::new(MIB, 1), Box::new(std::io::sink()), devices).unwrap();
        vm.restore(&s).map(|_| vm)
    };
    let e = restore(&with_slots(&f2, 3)).err().unwrap().to_string();
    assert!(
        e.contains("the snapshot has rng, block, block, block; this VM has rng, block, block, block, block"),
        "{e}"
    );
    let e = restore(&DeviceConfig {
        disks: vec![slot(&f2, false), slot(&fixed, true)],
        disk_slots: 1,
        ..Default::default()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("disks differ: the snapshot has 1 disks and 2 disk slots, this VM 2 disks and 1 disk slots"),
        "{e}"
    );
    let e = restore(&with_slots(&f2, 2)).err().unwrap().to_string();
    assert!(
        e.contains("disk slot 1 has a read-write image of 8192 bytes attached")
            && e.contains("slot_files"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(&f2).unwrap(),
        vec![3; 512],
        "refused: untouched"
    );
    let c = d.path().join("c.img");
    let vm = restore(&DeviceConfig {
        slot_files: [(1, c.clone()), (0, d.path().join("unused.img"))].into(),
        ..with_slots(&f2, 2)
    })
    .unwrap();
    assert_eq!(std::fs::read(&c).unwrap(), vec![2; 8192]);
    assert_eq!(
        slots_of(&vm),
        vec![(None, false, 0), (Some(c), false, 8192)]
    );
    assert!(!d.path().join("unused.img").exists());
}

#[test]
fn bad_slot_requests_are_refused_and_change_nothing() {
    let d = tmp();
    let fixed = image(d.path().join("fixed.img"), 1, 4096);
    let ctr = image(d.path().join("ctr.img"), 2, 8192);
    let odd = image(d.path().join("odd.img"), 3, 1000);
    let created = Vm::create_with(
        Shape::new(MIB, 1),
        Box::new(std::io::sink()),
        &with_slots(&fixed, 1),
    );
    let mut created = created.unwrap();
    let e = created.attach_disk(0, &slot(&ctr, false)).unwrap_err();
    assert!(e.to_string().contains("running or paused"), "{e}");

    let mut g = boot_with(d.path(), MIB, 1, &with_slots(&fixed, 1));
    let err = |r: twig_vmm::Result<()>| r.unwrap_err().to_string();
    let e = err(g.vm.attach_disk(1, &slot(&ctr, false)));
    assert!(
        e.contains("disk slot 1: no such slot: this VM has 1 disk slots"),
        "{e}"
    );
    let e = err(g.vm.detach_disk(0));
    assert!(e.contains("disk slot 0: empty"), "{e}");
    let e = err(g
        .vm
        .attach_disk(0, &slot(&d.path().join("missing.img"), false)));
    assert!(
        e.contains("disk slot 0") && e.contains("missing.img"),
        "{e}"
    );
    let e = err(g.vm.attach_disk(0, &slot(&odd, false)));
    assert!(e.contains("not a multiple of 512"), "{e}");
    assert_eq!(slots_of(&g.vm), vec![(None, false, 0)]);
    g.vm.attach_disk(0, &slot(&ctr, false)).unwrap();
    let e = err(g.vm.attach_disk(0, &slot(&fixed, true)));
    assert!(
        e.contains("disk slot 0: busy") && e.contains("ctr.img"),
        "{e}"
    );
    assert_eq!(slots_of(&g.vm)[0].0.as_deref(), Some(ctr.as_path()));
    g.vm.pause().unwrap();
    g.vm.detach_disk(0).unwrap();
    g.vm.resume().unwrap();
    assert_eq!(std::fs::read(&ctr).unwrap(), vec![2; 8192]);

    let create = |c: &DeviceConfig| {
        Vm::create_with(Shape::new(MIB, 1), Box::new(std::io::sink()), c)
            .err()
            .map(|e| e.to_string())
    };
    let e = create(&with_slots(&fixed, 10)).unwrap();
    assert!(e.contains("12 virtio devices; a VM has at most 11"), "{e}");
    let e = create(&DeviceConfig {
        slot_files: [(2, ctr.clone())].into(),
        ..with_slots(&fixed, 2)
    })
    .unwrap();
    assert!(
        e.contains("slot_files names slot 2, but the VM has 2 disk slots"),
        "{e}"
    );
}

#[test]
fn a_host_block_device_in_a_slot_is_served_but_refuses_snapshots_and_rollbacks() {
    let d = tmp();
    let fixed = image(d.path().join("fixed.img"), 1, 4096);
    let volume = image(d.path().join("volume.img"), 5, DISK);
    let dev = twig_agent::testkit::LoopDevice::new(&volume)
        .expect("a loop device (this test needs root and losetup)");
    let mut g = boot_with(d.path(), MIB, 1, &with_slots(&fixed, 1));
    let s0 = snap(d.path(), "s0");
    take(&mut g.vm, &s0, Kind::Full).unwrap();
    g.vm.attach_disk(0, &slot(&dev.0, false)).unwrap();
    assert_eq!(
        slots_of(&g.vm),
        vec![(Some(dev.0.clone()), false, DISK as u64)],
        "sized by BLKGETSIZE64"
    );

    let e = take(&mut g.vm, &snap(d.path(), "s1"), Kind::Full)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("host block device") && e.contains("cannot copy"),
        "{e}"
    );
    let e = g.vm.rollback(&s0).unwrap_err().to_string();
    assert!(
        e.contains("host block device") && e.contains("rollback"),
        "{e}"
    );
    assert_eq!(g.vm.state(), RunState::Running, "the VM runs on");
    assert_eq!(std::fs::read(&volume).unwrap(), vec![5; DISK], "untouched");

    // Detached, the VM snapshots again.
    g.vm.pause().unwrap();
    g.vm.detach_disk(0).unwrap();
    g.vm.resume().unwrap();
    take(&mut g.vm, &snap(d.path(), "s2"), Kind::Full).unwrap();
}
