//! Fault injection into rollback: for every step, a failure is injected
//! into the rollback of a running test guest that has dirtied pages and
//! changed its read-write disk since the snapshot; afterwards guest RAM,
//! vCPU state, irqchip/PIT, device state and the disk are compared with
//! the state the VM must be on (its old one, or exactly the snapshot after a
//! roll-forward), the VM must run, and a rollback must then succeed.
//! Each round first changes memory, disk and device state, so that every
//! part differs between the VM and the snapshot.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use zerocopy::IntoBytes;

use crate::devices::Capture;
use crate::error::Error;
use crate::snapshot::Kind;
use crate::testguest::{self, Command};
use crate::vm::failpoint;
use crate::vm::{DeviceConfig, DiskConfig, RunState, Shape, Vm};

const T: Duration = Duration::from_secs(20);
const MIB: usize = 32;
const PAGES: usize = MIB * 256;

/// A paused VM's state, as a rollback must keep it or reach it (everything
/// but the clock, the MSRs and PIT load times, which move on).
struct Seen {
    ram: Vec<u8>,
    vcpu: Vec<(&'static str, Vec<u8>)>,
    chips: Vec<u8>,
    pit: Vec<u8>,
    devices: Vec<u8>,
    disk: Vec<u8>,
    /// kvmclock, ns: not compared, but it must never go back.
    clock: u64,
}

fn seen(vm: &Vm, disk: &Path) -> Seen {
    assert_eq!(vm.state, RunState::Paused, "seen() needs a paused VM");
    let v = vm.save_vcpus().expect("saving vCPU state");
    let v = &v[0];
    let (chips, mut pit, clock) = vm.save_vm_state().expect("saving VM state");
    // When a channel was (re)loaded: KVM stamps it with the time of
    // KVM_SET_PIT2.
    for c in pit.channels.iter_mut() {
        c.count_load_time = 0;
    }
    // RFLAGS.RF (bit 16) says whether the instruction at RIP was
    // interrupted (an exit or a signal's kick landing mid-instruction, as
    // happens under load): timing, not state a rollback keeps or reaches.
    let mut regs = v.regs;
    regs.rflags &= !(1 << 16);
    // XSTATE_BV's x87, SSE and AVX bits (the XSAVE header at byte 512) say
    // which of them the CPU tracked as in use, which a context switch of
    // the vCPU thread can set with the registers still at their initial
    // values; the registers themselves are compared.
    let mut xsave = v.xsave.clone();
    if let Some(header) = xsave.get_mut(512 / 4) {
        *header &= !0b111;
    }
    Seen {
        ram: vm.read_guest_ram().expect("reading guest RAM"),
        vcpu: vec![
            ("mp_state", v.mp_state.as_bytes().to_vec()),
            ("regs", regs.as_bytes().to_vec()),
            ("sregs", v.sregs.as_bytes().to_vec()),
            ("xsave", xsave.as_bytes().to_vec()),
            ("xcrs", v.xcrs.as_bytes().to_vec()),
            ("debugregs", v.debugregs.as_bytes().to_vec()),
            ("lapic", v.lapic.as_bytes().to_vec()),
            ("events", v.events.as_bytes().to_vec()),
        ],
        chips: chips.as_bytes().to_vec(),
        pit: pit.as_bytes().to_vec(),
        devices: vm.devices.save(),
        disk: std::fs::read(disk).expect("reading the disk image"),
        clock: clock.clock,
    }
}

/// Pauses `vm` (running) with its vCPU where the guest waits for a command
/// ([`testguest::PARKED_RIP`]), not elsewhere in its idle loop: after a
/// resume the vCPU runs a few instructions before it parks again, and two
/// looks at a VM stopped at different ones differ in their registers.
fn pause_parked(vm: &mut Vm) {
    let deadline = Instant::now() + T;
    loop {
        vm.pause().expect("pause");
        let rip = vm.save_vcpus().expect("saving vCPU state")[0].regs.rip;
        if rip == testguest::PARKED_RIP {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the guest did not park within {T:?} (rip {rip:#x})"
        );
        vm.resume().expect("resume");
    }
}

/// The 64-bit words at which two saved states differ, as `index: want → got`
/// (for `regs`: rax, rbx, rcx, rdx, rsi, rdi, rsp, rbp, r8–r15, rip, rflags).
fn words_differing(a: &[u8], b: &[u8]) -> String {
    let word = |c: &[u8]| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        u64::from_le_bytes(w)
    };
    a.chunks(8)
        .zip(b.chunks(8))
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, (x, y))| format!("{i}: {:#x} → {:#x}", word(x), word(y)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn first_page_differing(a: &[u8], b: &[u8]) -> Option<usize> {
    a.chunks(4096).zip(b.chunks(4096)).position(|(x, y)| x != y)
}

fn assert_same(what: &str, want: &Seen, got: &Seen) {
    assert!(
        want.ram == got.ram,
        "{what}: guest RAM differs, first at page {:?}",
        first_page_differing(&want.ram, &got.ram)
    );
    for ((name, a), (_, b)) in want.vcpu.iter().zip(&got.vcpu) {
        assert!(
            a == b,
            "{what}: vCPU {name} differs: {}",
            words_differing(a, b)
        );
    }
    assert!(want.chips == got.chips, "{what}: irqchip state differs");
    assert!(want.pit == got.pit, "{what}: PIT state differs");
    assert!(want.devices == got.devices, "{what}: device state differs");
    assert!(want.disk == got.disk, "{what}: disk contents differ");
}

fn dirty(vm: &mut Vm, first: u64, pages: u64, value: u64) {
    testguest::run(
        vm,
        Command::Dirty,
        [testguest::SCRATCH + first * 4096, pages, value],
        T,
    )
    .expect("dirty command");
}

/// Changes device state as a guest driver would: the UART's scratch
/// register and the entropy device's feature-select register.
fn poke_devices(vm: &Vm, v: u8) {
    vm.devices.pio_write(0x3f8 + 7, &[v]);
    vm.devices.mmio_write(
        crate::virtio::MMIO_BASE + 0x014,
        &u32::from(v).to_le_bytes(),
    );
}

fn write_disk(path: &Path, off: u64, data: &[u8]) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("opening the disk image");
    f.write_all_at(data, off).expect("writing the disk image");
}

struct Fixture {
    dir: tempfile::TempDir,
    vm: Vm,
    serial: Capture,
    disk: PathBuf,
    /// The target: an incremental snapshot on top of a full one.
    s2: PathBuf,
    /// A full snapshot of another lineage.
    s3: PathBuf,
    /// The VM as it was when `s2` was taken.
    at_s2: Seen,
    round: u64,
}

fn fixture() -> Fixture {
    if let Err(e) = crate::vm::open_kvm() {
        panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("rw.img");
    std::fs::write(&disk, vec![0xa1; 1 << 20]).expect("writing the disk image");
    let serial = Capture::new();
    let devices = DeviceConfig {
        disks: vec![DiskConfig {
            path: disk.clone(),
            read_only: false,
        }],
        ..Default::default()
    };
    let mut vm =
        Vm::create_with(Shape::new(MIB, 1), serial.writer(), &devices).expect("creating a VM");
    let kernel = testguest::write_to(dir.path()).expect("writing the test guest");
    vm.boot(&kernel, "console=ttyS0").expect("boot");
    serial.wait_for(b"B", 0, T).expect("boot marker");
    testguest::wait_booted(&vm, T).expect("guest magic");

    dirty(&mut vm, 0, 8, 100);
    let store = twig_store::NodeStore::open(&dir.path().join("store"), true).expect("node store");
    vm.snapshot_into(&store, "s1", Kind::Full)
        .expect("full snapshot");
    dirty(&mut vm, 0, 4, 200);
    write_disk(&disk, 4096, b"s2-time");
    poke_devices(&vm, 0x55);
    pause_parked(&mut vm);
    vm.snapshot_into(&store, "s2", Kind::Incremental)
        .expect("incremental snapshot");
    let s2 = store.snapshot_dir("s2");
    let at_s2 = seen(&vm, &disk);
    vm.resume().expect("resume");
    dirty(&mut vm, 0, 2, 900);
    vm.snapshot_into(&store, "s3", Kind::Full)
        .expect("second full snapshot");
    let s3 = store.snapshot_dir("s3");
    Fixture {
        dir,
        vm,
        serial,
        disk,
        s2,
        s3,
        at_s2,
        round: 0,
    }
}

impl Fixture {
    /// Has the guest print a byte: it runs.
    fn runs(&mut self, what: &str) {
        let byte = b'a' + (self.round % 26) as u8;
        let from = self.serial.bytes().len();
        testguest::run(&mut self.vm, Command::Print, [u64::from(byte), 0, 0], T)
            .unwrap_or_else(|e| panic!("{what}: the guest does not run: {e}"));
        self.serial
            .wait_for(&[byte], from, T)
            .unwrap_or_else(|e| panic!("{what}: the guest does not print: {e}"));
    }

    /// Checks the VM runs exactly on `s2`.
    fn on_s2(&mut self, what: &str) {
        assert_eq!(self.vm.state(), RunState::Running, "{what}");
        pause_parked(&mut self.vm);
        assert_same(what, &self.at_s2, &seen(&self.vm, &self.disk));
        self.vm.resume().expect("resume");
        self.runs(what);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// The rollback fails and the VM is on its old state.
    Refused,
    /// A memory step fails and the VM is on the snapshot (rolled forward).
    RolledForward,
    /// The rollback succeeds but every page counts as dirty.
    AllDirty,
    /// The VM is lost: stopped, its disk put back.
    Lost,
}

/// One round: the guest changes memory and disk since its baseline (on
/// `s3`'s lineage when `other_lineage`), `armed` failpoints fail a rollback
/// to `s2`, the outcome is checked, then a rollback to `s2` succeeds.
fn round(fx: &mut Fixture, armed: &[&'static str], other_lineage: bool, expect: Expect) {
    fx.round += 1;
    let what = format!(
        "{armed:?}{}",
        if other_lineage {
            " from another lineage"
        } else {
            ""
        }
    );
    if other_lineage {
        let info = fx.vm.rollback(&fx.s3).expect("rollback to s3");
        assert!(info.remapped, "{what}: s3 is another lineage");
    }
    dirty(&mut fx.vm, 2, 8, 1000 * fx.round);
    write_disk(&fx.disk, 0, format!("live-{}", fx.round).as_bytes());
    poke_devices(&fx.vm, fx.round as u8);
    // A refused rollback is checked on a paused VM: one that ran between
    // two looks may have been stopped at another instruction of its idle
    // loop (a resume lets the vCPU run until it parks again).
    pause_parked(&mut fx.vm);
    let before = seen(&fx.vm, &fx.disk);
    if expect != Expect::Refused {
        fx.vm.resume().expect("resume");
    }

    for name in armed {
        failpoint::arm(name);
    }
    let result = fx.vm.rollback(&fx.s2);
    failpoint::disarm_all();

    match expect {
        Expect::Refused => {
            let e = result.err().unwrap_or_else(|| panic!("{what}: succeeded"));
            assert!(matches!(e, Error::Rollback(_)), "{what}: {e}");
            assert!(e.to_string().contains("failpoint rollback."), "{what}: {e}");
            assert_eq!(fx.vm.state(), RunState::Paused, "{what}: it stays paused");
            let after = seen(&fx.vm, &fx.disk);
            assert_same(&what, &before, &after);
            assert!(
                after.clock >= before.clock,
                "{what}: the clock went back from {} to {} ns",
                before.clock,
                after.clock
            );
            fx.vm.resume().expect("resume");
            // Refused on a running VM, the rollback leaves it running.
            for name in armed {
                failpoint::arm(name);
            }
            let again = fx.vm.rollback(&fx.s2);
            failpoint::disarm_all();
            assert!(
                matches!(again, Err(Error::Rollback(_))),
                "{what}: {again:?}"
            );
            assert_eq!(fx.vm.state(), RunState::Running, "{what}: it runs on");
            fx.runs(&what);
        }
        Expect::RolledForward => {
            let info = result.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(info.remapped, "{what}: all of RAM is rebuilt");
            fx.on_s2(&what);
        }
        Expect::AllDirty => {
            let info = result.unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(!info.remapped, "{what}");
            let stats = fx.vm.stats().expect("stats");
            assert_eq!(stats.dirty_pages, PAGES, "{what}: every page dirty");
            fx.on_s2(&what);
        }
        Expect::Lost => {
            let e = result.err().unwrap_or_else(|| panic!("{what}: succeeded"));
            assert!(matches!(e, Error::VmLost(_)), "{what}: {e}");
            assert_eq!(fx.vm.state(), RunState::Stopped, "{what}");
            assert!(fx.vm.resume().is_err(), "{what}: a lost VM does not resume");
            assert!(
                std::fs::read(&fx.disk).expect("reading the disk") == before.disk,
                "{what}: the old disk is put back"
            );
            let ram = fx.vm.read_guest_ram().expect("reading guest RAM");
            assert!(ram.iter().all(|b| *b == 0), "{what}: RAM is zeroed");
        }
    }

    // Whatever happened, a rollback now succeeds and lands on s2.
    fx.vm
        .rollback(&fx.s2)
        .unwrap_or_else(|e| panic!("{what}: the next rollback: {e}"));
    fx.on_s2(&format!("{what}, then a rollback"));
}

#[test]
fn every_failure_leaves_the_vm_on_its_old_state_or_on_the_snapshot() {
    let mut fx = fixture();
    // First a plain rollback, so that the baseline is s2.
    fx.vm.rollback(&fx.s2).expect("rollback to s2");
    fx.on_s2("the first rollback");
    for fp in [
        "rollback.plan",
        "rollback.stage",
        "rollback.parse_devices",
        "rollback.prepare_disks",
        "rollback.backup",
        "rollback.vcpus",
        "rollback.vm_state",
        "rollback.devices",
        "rollback.disks",
    ] {
        round(&mut fx, &[fp], false, Expect::Refused);
    }
    for fp in ["rollback.discard", "rollback.write_pages"] {
        round(&mut fx, &[fp], false, Expect::RolledForward);
    }
    round(&mut fx, &["rollback.dirty_log"], false, Expect::AllDirty);
    for fp in ["rollback.stage", "rollback.vcpus", "rollback.disks"] {
        round(&mut fx, &[fp], true, Expect::Refused);
    }
    round(&mut fx, &["rollback.remap"], true, Expect::RolledForward);
    assert!(
        leftovers(fx.dir.path()).is_empty(),
        "{:?}",
        leftovers(fx.dir.path())
    );
}

#[test]
fn a_rollback_that_can_neither_undo_nor_finish_loses_the_vm_which_a_rollback_revives() {
    let mut fx = fixture();
    round(
        &mut fx,
        &["rollback.vcpus", "rollback.undo"],
        false,
        Expect::Lost,
    );
    round(
        &mut fx,
        &["rollback.discard", "rollback.roll_forward"],
        false,
        Expect::Lost,
    );
    round(
        &mut fx,
        &["rollback.remap", "rollback.roll_forward"],
        true,
        Expect::Lost,
    );
    assert!(
        leftovers(fx.dir.path()).is_empty(),
        "{:?}",
        leftovers(fx.dir.path())
    );
}

/// Hidden files (temporary disk copies, kept-aside images) left behind.
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("reading the test directory")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

/// An XFS filesystem (reflinks) on a loop device, unmounted when dropped.
struct Xfs {
    dir: tempfile::TempDir,
}

impl Xfs {
    fn mount() -> Xfs {
        use std::process::Command;
        let dir = tempfile::tempdir().expect("tempdir");
        let img = dir.path().join("xfs.img");
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(512 << 20))
            .expect("creating the XFS image");
        let mkfs = Command::new("mkfs.xfs")
            .args(["-q", "-m", "reflink=1"])
            .arg(&img)
            .status()
            .expect("mkfs.xfs (xfsprogs) is needed");
        assert!(mkfs.success(), "mkfs.xfs");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).expect("mount point");
        let ok = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt)
            .status()
            .expect("mount");
        assert!(ok.success(), "loop-mounting XFS (needs root)");
        Xfs { dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.path())
            .status();
    }
}

/// A read-write disk sent as a descriptor (named by a path the VMM cannot
/// reach, as in a jail) is rolled back through its descriptor: reflinks
/// from the store on the image's filesystem. A failure at every new step
/// (the backup, the resize, the reflink, the steps after it, a failed
/// undo) leaves the image's old bytes and size; the backup never outlives
/// the rollback; a store on another filesystem is refused, naming both.
#[test]
fn a_disk_sent_as_a_descriptor_rolls_back_through_it_all_or_nothing() {
    let xfs = Xfs::mount();
    let image = xfs.path().join("rootfs.img");
    std::fs::write(&image, vec![0xa5; 1 << 20]).expect("writing the image");
    let store_root = xfs.path().join("store");
    let store = twig_store::NodeStore::open(&store_root, false).expect("node store on XFS");
    if let Err(e) = crate::vm::open_kvm() {
        panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let serial = Capture::new();
    let devices = DeviceConfig {
        disk_slots: 1,
        ..Default::default()
    };
    let mut vm =
        Vm::create_with(Shape::new(MIB, 1), serial.writer(), &devices).expect("creating a VM");
    let kernel = testguest::write_to(dir.path()).expect("writing the test guest");
    vm.boot(&kernel, "console=ttyS0").expect("boot");
    testguest::wait_booted(&vm, T).expect("guest magic");
    let sent = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&image)
        .expect("opening the image");
    vm.attach_disk_file(0, Path::new("/unreachable/rootfs.img"), sent, false)
        .expect("attaching the descriptor");

    dirty(&mut vm, 0, 8, 100);
    pause_parked(&mut vm);
    vm.snapshot_into(&store, "s1", Kind::Full)
        .expect("snapshot");
    let s1 = store.snapshot_dir("s1");
    let at_s1 = seen(&vm, &image);
    vm.resume().expect("resume");

    let runs = |vm: &mut Vm, round: u64, what: &str| {
        let byte = b'a' + (round % 26) as u8;
        let from = serial.bytes().len();
        testguest::run(vm, Command::Print, [u64::from(byte), 0, 0], T)
            .unwrap_or_else(|e| panic!("{what}: the guest does not run: {e}"));
        serial
            .wait_for(&[byte], from, T)
            .unwrap_or_else(|e| panic!("{what}: the guest does not print: {e}"));
    };
    let on_s1 = |vm: &mut Vm, what: &str| {
        pause_parked(vm);
        assert_same(what, &at_s1, &seen(vm, &image));
        vm.resume().expect("resume");
        assert_eq!(vm.disk_slots()[0].size, 1 << 20, "{what}: capacity");
    };
    let tmp_is_empty = |what: &str| {
        let left: Vec<_> = std::fs::read_dir(store_root.join("tmp"))
            .expect("reading the store's tmp")
            .collect();
        assert!(left.is_empty(), "{what}: left in tmp: {left:?}");
    };

    vm.rollback(&s1).expect("the first rollback");
    on_s1(&mut vm, "the first rollback");
    runs(&mut vm, 0, "the first rollback");

    let rounds: &[(&[&'static str], Expect)] = &[
        (&["rollback.prepare_disks"], Expect::Refused),
        (&["rollback.disk_backup"], Expect::Refused),
        (&["rollback.disk_resize"], Expect::Refused),
        (&["rollback.disk_clone"], Expect::Refused),
        (&["rollback.disks"], Expect::Refused),
        (&["rollback.disk_clone", "rollback.disk_undo"], Expect::Lost),
    ];
    for (round, (armed, expect)) in (1u64..).zip(rounds) {
        let what = format!("{armed:?}");
        // Memory, the disk's bytes and its size all differ from s1.
        dirty(&mut vm, 2, 8, 1000 * round);
        write_disk(&image, 0, format!("live-{round}").as_bytes());
        std::fs::OpenOptions::new()
            .write(true)
            .open(&image)
            .and_then(|f| f.set_len((1 << 20) + 4096 * round))
            .expect("growing the image");
        // Refused, the rollback is checked on a VM paused throughout (see
        // `round`).
        pause_parked(&mut vm);
        let before = seen(&vm, &image);
        if *expect != Expect::Refused {
            vm.resume().expect("resume");
        }
        for name in *armed {
            failpoint::arm(name);
        }
        let result = vm.rollback(&s1);
        failpoint::disarm_all();
        let e = result.err().unwrap_or_else(|| panic!("{what}: succeeded"));
        assert!(e.to_string().contains("failpoint rollback."), "{what}: {e}");
        match expect {
            Expect::Refused => {
                assert!(matches!(e, Error::Rollback(_)), "{what}: {e}");
                assert_eq!(vm.state(), RunState::Paused, "{what}: it stays paused");
                assert_same(&what, &before, &seen(&vm, &image));
                vm.resume().expect("resume");
                runs(&mut vm, round, &what);
            }
            _ => {
                assert!(matches!(e, Error::VmLost(_)), "{what}: {e}");
                assert_eq!(vm.state(), RunState::Stopped, "{what}");
                assert_ne!(
                    std::fs::read(&image).expect("reading the image"),
                    before.disk,
                    "{what}: the undo failed, so the image holds the snapshot's bytes"
                );
            }
        }
        tmp_is_empty(&what);
        vm.rollback(&s1)
            .unwrap_or_else(|e| panic!("{what}: the next rollback: {e}"));
        on_s1(&mut vm, &format!("{what}, then a rollback"));
        runs(&mut vm, round, &format!("{what}, then a rollback"));
        tmp_is_empty(&format!("{what}, then a rollback"));
    }

    // A store on another filesystem: no reflink can reach the image.
    let elsewhere =
        twig_store::NodeStore::open(&dir.path().join("store"), true).expect("node store");
    vm.snapshot_into(&elsewhere, "e1", Kind::Full)
        .expect("snapshot into the other store");
    write_disk(&image, 0, b"after-e1");
    pause_parked(&mut vm);
    let before = seen(&vm, &image);
    let e = vm
        .rollback(&elsewhere.snapshot_dir("e1"))
        .expect_err("a rollback from another filesystem is refused");
    assert!(matches!(e, Error::Rollback(_)), "{e}");
    let message = e.to_string();
    assert!(
        message.contains("rootfs.img")
            && message.contains("on device")
            && message.contains(" but "),
        "the message names both filesystems: {message}"
    );
    assert_eq!(
        vm.state(),
        RunState::Paused,
        "a refused rollback leaves it paused"
    );
    assert_same("another filesystem", &before, &seen(&vm, &image));
    vm.resume().expect("resume");
    runs(&mut vm, 99, "another filesystem");
    drop(vm);
}
