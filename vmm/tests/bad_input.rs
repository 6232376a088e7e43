//! Bad snapshots and failing operations: refused with their reason, and
//! nothing lost — the VM keeps running on its previous state.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use twig_vmm::snapshot::{self, Image};
use twig_vmm::{testguest, Kind, RunState, Shape, Vm};

/// Boots a guest and takes a full snapshot `s0` and an incremental `s1`.
fn snapshots(d: &Path) -> (Guest, PathBuf, PathBuf) {
    let mut g = boot(d, MIB, 1);
    dirty(&mut g.vm, 0, 4, 11);
    let s0 = snap(d, "s0");
    take(&mut g.vm, &s0, Kind::Full).unwrap();
    dirty(&mut g.vm, 2, 4, 22);
    let s1 = snap(d, "s1");
    take(&mut g.vm, &s1, Kind::Incremental).unwrap();
    (g, s0, s1)
}

fn restore_err(dir: &Path) -> String {
    let mut vm = Vm::create(Shape::new(MIB, 1), Box::new(std::io::sink())).unwrap();
    let err = vm.restore(dir).expect_err("restore must fail").to_string();
    assert_eq!(
        vm.state(),
        RunState::Created,
        "a failed restore leaves the VM unused"
    );
    err
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir(to).unwrap();
    for f in ["state", "memory"] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

fn patch(path: &Path, offset: usize, f: impl FnOnce(&mut u8)) {
    let mut b = std::fs::read(path).unwrap();
    f(&mut b[offset]);
    std::fs::write(path, b).unwrap();
}

#[test]
fn corrupted_truncated_and_wrong_version_state_files_are_refused() {
    let d = tmp();
    let (_g, s0, _) = snapshots(d.path());
    let case = |name: &str, f: &dyn Fn(&Path)| {
        let c = d.path().join(name);
        copy_dir(&s0, &c);
        f(&c.join("state"));
        restore_err(&c)
    };
    let e = case("flip", &|p| patch(p, 100, |b| *b ^= 0x40));
    assert!(e.contains("corrupted (CRC32"), "{e}");
    let e = case("trunc", &|p| {
        let b = std::fs::read(p).unwrap();
        std::fs::write(p, &b[..b.len() / 2]).unwrap();
    });
    assert!(e.contains("truncated"), "{e}");
    let e = case("short", &|p| std::fs::write(p, b"TWIG").unwrap());
    assert!(e.contains("truncated"), "{e}");
    let e = case("version", &|p| patch(p, 8, |b| *b = 9));
    assert!(e.contains("version 9 is not supported"), "{e}");
    // Version 2 named parents by absolute path: a clear refusal, not a
    // misread chain.
    let e = case("v2", &|p| patch(p, 8, |b| *b = 2));
    assert!(
        e.contains("version 2 is not supported")
            && e.contains(&format!("reads version {}", snapshot::VERSION)),
        "{e}"
    );
    assert_eq!(snapshot::VERSION, 3);
    let e = case("magic", &|p| patch(p, 0, |b| *b = b'X'));
    assert!(e.contains("bad magic"), "{e}");
    let e = case("huge", &|p| {
        let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
        f.set_len(snapshot::MAX_STATE_BYTES + 1).unwrap();
    });
    assert!(e.contains("over the"), "{e}");
    let e = case("nostate", &|p| std::fs::remove_file(p).unwrap());
    assert!(e.contains("cannot open the state file"), "{e}");
}

#[test]
fn bad_memory_files_are_refused() {
    let d = tmp();
    let (_g, s0, s1) = snapshots(d.path());
    let t = d.path().join("t");
    copy_dir(&s0, &t);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(t.join("memory"))
        .unwrap();
    f.set_len((MIB << 20) as u64 - 4096).unwrap();
    let e = restore_err(&t);
    assert!(e.contains("truncated or mismatched"), "{e}");

    // A full snapshot's memory is mapped lazily; `verify` reads it all.
    let c = d.path().join("c");
    copy_dir(&s0, &c);
    patch(
        &c.join("memory"),
        twig_vmm::testguest::SCRATCH as usize,
        |b| *b ^= 1,
    );
    let e = snapshot::verify(&c).unwrap_err().to_string();
    assert!(e.contains("memory contents are corrupted"), "{e}");
    snapshot::verify(&s0).unwrap();
    snapshot::verify(&s1).unwrap();

    // An incremental layer's pages are checked whenever the chain is opened.
    let before = std::fs::read(s1.join("memory")).unwrap();
    patch(
        &s1.join("memory"),
        twig_vmm::testguest::SCRATCH as usize + 3 * 4096,
        |b| *b ^= 1,
    );
    let e = restore_err(&s1);
    assert!(e.contains("memory pages are corrupted"), "{e}");
    std::fs::write(s1.join("memory"), before).unwrap();
    Image::open(&s1).unwrap();
}

#[test]
fn broken_chains_and_mismatched_shapes_are_refused() {
    let d = tmp();
    let (_g, s0, s1) = snapshots(d.path());
    let mut vm = Vm::create(Shape::new(MIB * 2, 1), Box::new(std::io::sink())).unwrap();
    let e = vm.restore(&s0).unwrap_err().to_string();
    assert!(e.contains("memory size mismatch"), "{e}");
    let mut vm = Vm::create(Shape::new(MIB, 2), Box::new(std::io::sink())).unwrap();
    let e = vm.restore(&s0).unwrap_err().to_string();
    assert!(e.contains("vCPU count mismatch"), "{e}");

    // A parent replaced by another snapshot.
    let (_g2, other, _) = snapshots(&d.path().join("x").tap_mkdir());
    std::fs::rename(&s0, d.path().join("s0.orig")).unwrap();
    copy_dir(&other, &s0);
    let e = restore_err(&s1);
    assert!(e.contains("expected s0") && e.contains("replaced"), "{e}");
    std::fs::remove_dir_all(&s0).unwrap();
    let e = restore_err(&s1);
    assert!(
        e.contains("s0") && e.contains("cannot open the state file"),
        "{e}"
    );
}

trait TapMkdir {
    fn tap_mkdir(self) -> Self;
}
impl TapMkdir for PathBuf {
    fn tap_mkdir(self) -> Self {
        std::fs::create_dir_all(&self).unwrap();
        self
    }
}

#[test]
fn a_snapshot_from_a_cpu_with_more_features_is_refused() {
    let d = tmp();
    let (_g, s0, _) = snapshots(d.path());
    let mut state = snapshot::read_state(&s0).unwrap();
    // Claim every feature bit of leaf 7: no host has them all.
    for v in &mut state.vcpus {
        for e in v
            .cpuid
            .iter_mut()
            .filter(|e| e.function == 7 && e.index == 0)
        {
            e.ebx = u32::MAX;
        }
    }
    let f = d.path().join("future");
    copy_dir(&s0, &f);
    std::fs::write(f.join("state"), state.encode().unwrap()).unwrap();
    let e = restore_err(&f);
    assert!(
        e.contains("features this host lacks") && e.contains("leaf 0x7.0 ebx"),
        "{e}"
    );
}

#[test]
fn a_snapshot_records_the_pages_its_guest_used_and_a_bad_hot_list_is_refused() {
    let d = tmp();
    let (_g, s0, _) = snapshots(d.path());
    let state = snapshot::read_state(&s0).unwrap();
    let hot = &state.meta.hot;
    let page = |gpa: u64| gpa / 4096;
    let has = |p: u64| hot.iter().any(|(f, n)| p >= *f && p < f + n);
    // What the guest ran on and wrote: its code, its counter, the scratch
    // pages it dirtied; not the far end of RAM it never touched.
    let last = ((MIB as u64) << 20) / 4096 - 1;
    for p in [
        page(testguest::COUNTER),
        page(testguest::SCRATCH),
        page(testguest::SCRATCH) + 3,
    ] {
        assert!(has(p), "page {p} not in the hot list {hot:?}");
    }
    assert!(
        !has(last),
        "the untouched last page in the hot list {hot:?}"
    );
    let case = |name: &str, runs: Vec<(u64, u64)>| {
        let mut state = snapshot::read_state(&s0).unwrap();
        state.meta.hot = runs;
        let c = d.path().join(name);
        copy_dir(&s0, &c);
        std::fs::write(c.join("state"), state.encode().unwrap()).unwrap();
        restore_err(&c)
    };
    let e = case("hot-outside", vec![(last, 2)]);
    assert!(e.contains("hot run") && e.contains("outside"), "{e}");
    let e = case("hot-backwards", vec![(64, 16), (0, 16)]);
    assert!(e.contains("out of order"), "{e}");
    let e = case("hot-many", (0..1025).map(|i| (i * 2, 1)).collect());
    assert!(e.contains("1025 hot runs"), "{e}");
}

#[test]
fn a_short_xsave_area_is_refused() {
    let d = tmp();
    let (_g, s0, _) = snapshots(d.path());
    let mut state = snapshot::read_state(&s0).unwrap();
    // Too short to hold the XSAVE header: KVM would read past its end.
    state.vcpus[0].xsave.truncate(100);
    let short = d.path().join("short");
    copy_dir(&s0, &short);
    std::fs::write(short.join("state"), state.encode().unwrap()).unwrap();
    let e = restore_err(&short);
    assert!(
        e.contains("vCPU 0 XSAVE area is 400 bytes") && e.contains("shorter than the 4096"),
        "{e}"
    );
    // The legacy area alone (a host with fewer state components) is
    // padded to this host's size, never read past, and restores.
    let mut state = snapshot::read_state(&s0).unwrap();
    state.vcpus[0].xsave.truncate(1024);
    let legacy = d.path().join("legacy");
    copy_dir(&s0, &legacy);
    std::fs::write(legacy.join("state"), state.encode().unwrap()).unwrap();
    let serial = twig_vmm::Capture::new();
    let mut vm = Vm::create(Shape::new(MIB, 1), serial.writer()).unwrap();
    vm.restore(&legacy).unwrap();
    vm.resume().unwrap();
    print(&mut vm, &serial, b'x');
}

#[test]
fn failed_rollback_and_snapshot_leave_the_vm_running_on_its_state() {
    let d = tmp();
    let (mut g, s0, _) = snapshots(d.path());
    dirty(&mut g.vm, 0, 2, 99);
    let bad = d.path().join("bad");
    copy_dir(&s0, &bad);
    patch(&bad.join("state"), 200, |b| *b ^= 1);
    let e = g.vm.rollback(&bad).unwrap_err().to_string();
    assert!(
        e.contains("rollback refused") && e.contains("corrupted"),
        "{e}"
    );
    assert_eq!(g.vm.state(), RunState::Running);
    assert_eq!(word(&g.vm, 0), 99, "the VM kept its state");
    print(&mut g.vm, &g.serial, b'k');

    let e =
        g.vm.rollback(&d.path().join("nope"))
            .unwrap_err()
            .to_string();
    assert!(e.contains("rollback refused"), "{e}");
    let other = d.path().join("big").tap_mkdir();
    let mut big = boot(&other, MIB * 2, 1);
    let bs = snap(&other, "bs");
    take(&mut big.vm, &bs, Kind::Full).unwrap();
    let e = g.vm.rollback(&bs).unwrap_err().to_string();
    assert!(e.contains("memory size mismatch"), "{e}");
    assert_eq!(word(&g.vm, 0), 99);

    // Snapshots never overwrite, and a failed one leaves no debris.
    let e = take(&mut g.vm, &s0, Kind::Full).unwrap_err().to_string();
    assert!(e.contains("already exists"), "{e}");
    let e =
        g.vm.snapshot(&d.path().join("no/such/dir"), Kind::Full)
            .unwrap_err()
            .to_string();
    assert!(e.contains("not a staging directory of a store"), "{e}");
    // A write that fails halfway (the state file cannot be created) takes
    // back what it wrote, so the staging cannot be published.
    let (store, _) = store_of(&s0);
    let staging = store.stage("half").unwrap();
    std::fs::create_dir(staging.dir().join("state")).unwrap();
    let e =
        g.vm.snapshot(staging.dir(), Kind::Full)
            .unwrap_err()
            .to_string();
    assert!(e.contains("cannot create state"), "{e}");
    let left: Vec<_> = std::fs::read_dir(staging.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["state"], "no debris besides what was planted");
    assert!(staging.publish().is_err());
    assert!(matches!(
        store.get("half"),
        Err(twig_store::Error::NotFound(_))
    ));
    assert_eq!(g.vm.state(), RunState::Running);
    // Nothing was lost: an incremental snapshot still carries the pages
    // dirtied before the failures.
    let s2 = snap(d.path(), "s2");
    let info = take(&mut g.vm, &s2, Kind::Incremental).unwrap();
    assert!(info.pages_written >= 2, "{info:?}");
    let mut r = Vm::create(Shape::new(MIB, 1), Box::new(std::io::sink())).unwrap();
    r.restore(&s2).unwrap();
    assert_eq!(word(&r, 0), 99);
}

#[test]
fn incremental_needs_a_parent() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    let e = take(&mut g.vm, &snap(d.path(), "i"), Kind::Incremental)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs a parent"), "{e}");
    assert_eq!(g.vm.state(), RunState::Running);
}
