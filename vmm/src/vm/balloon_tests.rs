//! Pages the balloon drops count as changed: a rollback puts the target's
//! bytes back, an incremental snapshot saves what the guest sees, a full
//! snapshot taken while the guest runs (pre-copied: RAM keeps mapping the
//! file it mapped) is put back whole, and a snapshot of a VM with a
//! balloon restores only into a VM with one.

use std::time::Duration;

use crate::devices::Capture;
use crate::snapshot::Kind;
use crate::testguest::{self, Command};
use crate::virtio::balloon::discard_range;
use crate::vm::{DeviceConfig, Shape, Vm};

const T: Duration = Duration::from_secs(20);
const MIB: usize = 32;
/// The pages the test dirties and the balloon drops: 2 MiB of the
/// test guest's scratch area.
const PAGES: u64 = 512;

fn with_balloon(balloon: bool) -> DeviceConfig {
    DeviceConfig {
        balloon,
        ..Default::default()
    }
}

fn dirty(vm: &mut Vm, value: u64) {
    testguest::run(vm, Command::Dirty, [testguest::SCRATCH, PAGES, value], T)
        .expect("dirty command");
}

fn scratch(vm: &Vm) -> Vec<u8> {
    let mut b = vec![0u8; (PAGES * 4096) as usize];
    vm.read_guest(testguest::SCRATCH, &mut b)
        .expect("reading the scratch pages");
    b
}

/// Drops the scratch pages as a free page report does, with the VM paused.
fn report(vm: &mut Vm) {
    vm.pause().expect("pause");
    discard_range(vm.ram.memory(), testguest::SCRATCH, (PAGES * 4096) as u32)
        .expect("a range inside guest RAM");
    vm.resume().expect("resume");
}

#[test]
fn pages_dropped_by_the_balloon_are_rolled_back_and_saved() {
    if let Err(e) = crate::vm::open_kvm() {
        panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let serial = Capture::new();
    let mut vm = Vm::create_with(Shape::new(MIB, 1), serial.writer(), &with_balloon(true))
        .expect("creating a VM with a balloon");
    let kernel = testguest::write_to(dir.path()).expect("writing the test guest");
    vm.boot(&kernel, "console=ttyS0").expect("boot");
    testguest::wait_booted(&vm, T).expect("guest magic");
    let store = twig_store::NodeStore::open(&dir.path().join("store"), true).expect("node store");

    dirty(&mut vm, 100);
    let at_s1 = scratch(&vm);
    // Taken paused, as a template is: RAM then maps s1's file.
    vm.pause().expect("pause");
    vm.snapshot_into(&store, "s1", Kind::Full)
        .expect("full snapshot");
    vm.resume().expect("resume");
    dirty(&mut vm, 200);
    let at_s2 = scratch(&vm);
    assert_ne!(at_s1, at_s2);
    vm.snapshot_into(&store, "s2", Kind::Incremental)
        .expect("incremental snapshot");

    // Dropped, the pages read the root snapshot's file again...
    report(&mut vm);
    assert!(
        scratch(&vm) == at_s1,
        "the dropped pages read the root file"
    );
    // ...and a rollback to s2 puts s2's bytes back.
    vm.rollback(&store.snapshot_dir("s2")).expect("rollback");
    assert!(scratch(&vm) == at_s2, "the rollback restored s2's pages");

    // Dropped again, an incremental snapshot holds what the guest sees.
    report(&mut vm);
    vm.snapshot_into(&store, "s3", Kind::Incremental)
        .expect("incremental snapshot");
    let mut clone = Vm::create_with(Shape::new(MIB, 1), serial.writer(), &with_balloon(true))
        .expect("creating a VM with a balloon");
    clone.restore(&store.snapshot_dir("s3")).expect("restore");
    assert!(scratch(&clone) == at_s1, "s3 holds the pages as dropped");
    testguest::run(&mut clone, Command::Print, [u64::from(b'r'), 0, 0], T)
        .expect("the restored guest runs");

    // The balloon is a device like the others: a VM without one refuses.
    let mut plain = Vm::create_with(Shape::new(MIB, 1), serial.writer(), &with_balloon(false))
        .expect("creating a VM without a balloon");
    let e = plain
        .restore(&store.snapshot_dir("s3"))
        .expect_err("a snapshot with a balloon needs a VM with one");
    assert!(e.to_string().contains("balloon"), "{e}");
}

#[test]
fn pages_dropped_after_a_precopied_snapshot_are_put_back_from_it() {
    if let Err(e) = crate::vm::open_kvm() {
        panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let serial = Capture::new();
    let mut vm = Vm::create_with(Shape::new(MIB, 1), serial.writer(), &with_balloon(true))
        .expect("creating a VM with a balloon");
    let kernel = testguest::write_to(dir.path()).expect("writing the test guest");
    vm.boot(&kernel, "console=ttyS0").expect("boot");
    testguest::wait_booted(&vm, T).expect("guest magic");
    let store = twig_store::NodeStore::open(&dir.path().join("store"), true).expect("node store");

    dirty(&mut vm, 100);
    let at_t = scratch(&vm);
    vm.pause().expect("pause");
    vm.snapshot_into(&store, "t", Kind::Full)
        .expect("the template");
    vm.resume().expect("resume");
    dirty(&mut vm, 300);
    let at_p = scratch(&vm);
    // Taken running: pre-copied, and RAM still maps the template's file.
    let info = vm
        .snapshot_into(&store, "p", Kind::Full)
        .expect("pre-copied full snapshot");
    assert!(info.precopy_rounds >= 1, "{info:?}");
    report(&mut vm);
    assert!(
        scratch(&vm) == at_t,
        "the dropped pages read the file RAM maps, the template's"
    );
    let r = vm.rollback(&store.snapshot_dir("p")).expect("rollback");
    assert!(!r.remapped, "{r:?}");
    assert!(r.pages_restored >= PAGES as usize, "{r:?}");
    assert!(
        scratch(&vm) == at_p,
        "the rollback copied p's pages from its file"
    );
    let mut clone = Vm::create_with(Shape::new(MIB, 1), serial.writer(), &with_balloon(true))
        .expect("creating a VM with a balloon");
    clone.restore(&store.snapshot_dir("p")).expect("restore");
    assert!(scratch(&clone) == at_p, "p holds the pages before the drop");
}
