//! Snapshot, restore, clone and rollback of the test guest on /dev/kvm,
//! proven from guest memory, registers and serial output.

mod common;

use common::*;
use twig_vmm::testguest::{self, Command};
use twig_vmm::{Capture, DeviceConfig, Kind, RunState, Shape, Vm};

fn spin_and_pause(vm: &mut Vm) -> u64 {
    testguest::post(vm, Command::Spin, [0; 3]).unwrap();
    testguest::poll(T, "spinning", || {
        Ok(vm.read_u64(testguest::COUNTER)? > 10_000)
    })
    .unwrap();
    vm.pause().unwrap();
    vm.read_u64(testguest::COUNTER).unwrap()
}

#[test]
fn restore_resumes_at_the_exact_instruction_with_identical_memory() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 2);
    dirty(&mut g.vm, 0, 64, 7);
    let counter = spin_and_pause(&mut g.vm);
    let s = snap(d.path(), "s");
    let info = take(&mut g.vm, &s, Kind::Full).unwrap();
    assert_eq!(info.pages_written, MIB * 256);
    let regs = g.vm.vcpu_regs(0).unwrap();
    let ram = g.vm.read_guest_ram().unwrap();

    let serial = Capture::new();
    let mut r = Vm::create(Shape::new(MIB, 2), serial.writer()).unwrap();
    let image = twig_vmm::snapshot::Image::open(&s).unwrap();
    r.restore_image(&image).unwrap();
    assert_eq!(r.state(), RunState::Paused);
    let rregs = r.vcpu_regs(0).unwrap();
    assert_eq!(rregs.rip, regs.rip, "same instruction");
    assert_eq!(format!("{rregs:?}"), format!("{regs:?}"), "same registers");
    assert!(r.read_guest_ram().unwrap() == ram, "same memory");
    assert_eq!(r.read_u64(testguest::COUNTER).unwrap(), counter);

    r.resume().unwrap();
    testguest::poll(T, "the restored counter to continue", || {
        Ok(r.read_u64(testguest::COUNTER)? > counter)
    })
    .unwrap();
    r.write_u64(testguest::MAILBOX, 0).unwrap(); // stop spinning
    print(&mut r, &serial, b'R');
    assert_eq!(word(&r, 63), 7 + 63);
    // The original keeps running from the same point too.
    g.vm.resume().unwrap();
    testguest::poll(T, "the original counter", || {
        Ok(g.vm.read_u64(testguest::COUNTER)? > counter)
    })
    .unwrap();
}

#[test]
fn clones_run_and_diverge_independently() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    dirty(&mut g.vm, 0, 8, 1000);
    let s = snap(d.path(), "s");
    take(&mut g.vm, &s, Kind::Full).unwrap();
    let captures: Vec<Capture> = (0..4).map(|_| Capture::new()).collect();
    let mut clones =
        Vm::clone_from(&s, 4, |i| captures[i].writer(), |_| DeviceConfig::default()).unwrap();
    assert_eq!(clones.len(), 4);
    for (i, c) in clones.iter_mut().enumerate() {
        dirty(c, 0, 4, 5000 * (i as u64 + 1));
        print(c, &captures[i], b'a' + i as u8);
    }
    for (i, c) in clones.iter().enumerate() {
        assert_eq!(word(c, 0), 5000 * (i as u64 + 1));
        assert_eq!(word(c, 3), 5000 * (i as u64 + 1) + 3);
        assert_eq!(word(c, 4), 1004, "untouched pages come from the snapshot");
        assert_eq!(captures[i].bytes(), vec![b'a' + i as u8], "own serial only");
    }
    assert_eq!(word(&g.vm, 0), 1000, "the source does not see clone writes");
    // Every clone maps the snapshot's memory file privately: unmodified
    // pages come from the one page cache.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let memory = s.join("memory");
    let mapped = maps
        .lines()
        .filter(|l| l.ends_with(memory.to_str().unwrap()) && l.contains(" rw-p "))
        .count();
    assert!(
        mapped >= 4,
        "clones map the snapshot memory privately:\n{maps}"
    );
    // A clone owns only the pages it changed.
    let st = clones[0].stats().unwrap();
    assert!(
        st.guest_private_kib >= 16 && st.guest_private_kib < 1024,
        "{st:?}"
    );
    assert!(st.guest_resident_kib >= st.guest_private_kib, "{st:?}");
    // The snapshot itself is unchanged.
    let mem = std::fs::read(s.join("memory")).unwrap();
    let off = testguest::SCRATCH as usize;
    assert_eq!(
        u64::from_le_bytes(mem[off..off + 8].try_into().unwrap()),
        1000
    );
    twig_vmm::snapshot::verify(&s).unwrap();
}

#[test]
fn rollback_discards_exactly_what_changed_repeatedly() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    dirty(&mut g.vm, 0, 10, 1);
    let s = snap(d.path(), "s");
    take(&mut g.vm, &s, Kind::Full).unwrap();
    for round in 0..3u64 {
        dirty(&mut g.vm, 0, 20, 1000 * (round + 2));
        assert_eq!(word(&g.vm, 15), 1000 * (round + 2) + 15);
        let info = g.vm.rollback(&s).unwrap();
        assert!(!info.remapped);
        assert!(
            info.pages_restored >= 20 && info.pages_restored < 40,
            "rollback touched {} pages for 20 dirtied",
            info.pages_restored
        );
        for p in 0..10 {
            assert_eq!(word(&g.vm, p), 1 + p, "round {round} page {p}");
        }
        for p in 10..20 {
            assert_eq!(word(&g.vm, p), 0, "round {round} page {p}");
        }
        assert_eq!(g.vm.state(), RunState::Running);
        print(&mut g.vm, &g.serial, b'0' + round as u8);
    }
}

#[test]
fn incremental_chain_restores_the_same_bytes_as_a_full_snapshot() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    dirty(&mut g.vm, 0, 30, 10);
    take(&mut g.vm, &snap(d.path(), "s0"), Kind::Full).unwrap();
    dirty(&mut g.vm, 20, 30, 20);
    let i1 = take(&mut g.vm, &snap(d.path(), "s1"), Kind::Incremental).unwrap();
    assert!(i1.pages_written >= 30 && i1.pages_written < 40, "{i1:?}");
    dirty(&mut g.vm, 40, 100, 30);
    g.vm.pause().unwrap();
    take(&mut g.vm, &snap(d.path(), "s2"), Kind::Incremental).unwrap();
    take(&mut g.vm, &snap(d.path(), "full"), Kind::Full).unwrap();

    let restore = |name: &str| {
        let mut vm = Vm::create(Shape::new(MIB, 1), Box::new(std::io::sink())).unwrap();
        vm.restore_image(&twig_vmm::snapshot::Image::open(&snap(d.path(), name)).unwrap())
            .unwrap();
        vm
    };
    let a = restore("s2");
    let b = restore("full");
    assert!(
        a.read_guest_ram().unwrap() == b.read_guest_ram().unwrap(),
        "chain == full"
    );
    assert_eq!(
        format!("{:?}", a.vcpu_regs(0).unwrap()),
        format!("{:?}", b.vcpu_regs(0).unwrap())
    );
    assert_eq!(word(&a, 0), 10);
    assert_eq!(word(&a, 25), 25);
    assert_eq!(word(&a, 45), 35);
    let mid = restore("s1");
    assert_eq!(word(&mid, 45), 45, "s1 holds the second write");
    assert_eq!(word(&mid, 60), 0);
}

#[test]
fn rollback_moves_across_the_snapshot_tree() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    dirty(&mut g.vm, 0, 4, 100);
    let s0 = snap(d.path(), "s0");
    take(&mut g.vm, &s0, Kind::Full).unwrap();
    dirty(&mut g.vm, 2, 4, 200);
    let s1 = snap(d.path(), "s1");
    take(&mut g.vm, &s1, Kind::Incremental).unwrap();
    dirty(&mut g.vm, 0, 8, 300);

    g.vm.rollback(&s0).unwrap();
    let words: Vec<u64> = (0..6).map(|p| word(&g.vm, p)).collect();
    assert_eq!(words, vec![100, 101, 102, 103, 0, 0]);

    g.vm.rollback(&s1).unwrap();
    let words: Vec<u64> = (0..8).map(|p| word(&g.vm, p)).collect();
    assert_eq!(words, vec![100, 101, 200, 201, 202, 203, 0, 0]);

    // A branch: from s1, a sibling of s1's future.
    dirty(&mut g.vm, 6, 1, 400);
    let s2 = snap(d.path(), "s2");
    take(&mut g.vm, &s2, Kind::Incremental).unwrap();
    g.vm.rollback(&s0).unwrap();
    assert_eq!(word(&g.vm, 6), 0);
    g.vm.rollback(&s2).unwrap();
    assert_eq!(word(&g.vm, 6), 400);
    assert_eq!(word(&g.vm, 2), 200);
    print(&mut g.vm, &g.serial, b'!');
}

#[test]
fn vms_with_host_fed_devices_snapshot_roll_back_restore_and_stop() {
    let d = tmp();
    let name = |i: u32| format!("tws{}x{i}", std::process::id() % 100_000);
    let devices = |i: u32| DeviceConfig {
        net: Some(twig_vmm::NetConfig {
            tap: Some(name(i)),
            mac: [0x02, 0, 0, 0, 0, i as u8],
        }),
        vsock: Some(twig_vmm::VsockConfig {
            cid: 3,
            uds_path: d.path().join(format!("vsock{i}.sock")),
        }),
        ..Default::default()
    };
    let mut g = boot_with(d.path(), MIB, 1, &devices(0));
    dirty(&mut g.vm, 0, 4, 10);
    let s = snap(d.path(), "s");
    for _ in 0..3 {
        g.vm.pause().unwrap();
        g.vm.resume().unwrap();
    }
    take(&mut g.vm, &s, Kind::Full).unwrap();
    dirty(&mut g.vm, 0, 4, 20);
    g.vm.rollback(&s).unwrap();
    assert_eq!(word(&g.vm, 0), 10);
    print(&mut g.vm, &g.serial, b'n');

    let serial = Capture::new();
    let mut r = Vm::create_with(Shape::new(MIB, 1), serial.writer(), &devices(1)).unwrap();
    r.restore(&s).unwrap();
    assert_eq!(word(&r, 0), 10);
    print(&mut r, &serial, b'm');

    let mut other = Vm::create(Shape::new(MIB, 1), Box::new(std::io::sink())).unwrap();
    let e = other.restore(&s).unwrap_err().to_string();
    assert!(
        e.contains("the snapshot has rng, net, vsock; this VM has rng"),
        "{e}"
    );
    drop(r);
    drop(g);
}

#[test]
fn a_template_is_taken_once_the_guest_is_ready_and_restores_ready() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    // "Ready" is the guest having printed '!', as an agent answering a
    // ping would be for a Linux guest.
    testguest::post(&mut g.vm, Command::Print, [u64::from(b'!'), 0, 0]).unwrap();
    let mut probes = 0;
    let t = snap(d.path(), "template");
    let (store, id) = store_of(&t);
    let staging = store.stage(&id).unwrap();
    let serial = g.serial.clone();
    let info =
        g.vm.template(staging.dir(), std::time::Duration::from_secs(20), || {
            probes += 1;
            serial.bytes().contains(&b'!')
        })
        .unwrap();
    staging.publish().unwrap();
    assert!(probes >= 1);
    assert_eq!(info.kind, Kind::Full);
    assert_eq!(g.vm.state(), RunState::Paused);

    let rserial = Capture::new();
    let mut r = Vm::create(Shape::new(MIB, 1), rserial.writer()).unwrap();
    r.restore(&t).unwrap();
    r.resume().unwrap();
    print(&mut r, &rserial, b'R');
    assert!(
        !rserial.bytes().contains(&b'B'),
        "the restored guest did not boot"
    );

    // A guest that never gets ready: an error at the deadline, nothing written.
    let mut h = boot(d.path(), MIB, 1);
    let never = store.stage("never").unwrap();
    let e =
        h.vm.template(never.dir(), std::time::Duration::from_millis(200), || false)
            .unwrap_err();
    assert!(e.to_string().contains("not ready within"), "{e}");
    assert_eq!(std::fs::read_dir(never.dir()).unwrap().count(), 0);
    assert!(matches!(
        never.publish(),
        Err(twig_store::Error::InvalidArgument(_))
    ));
    assert_eq!(store.list().unwrap().len(), 1, "only the template");
    assert_eq!(h.vm.state(), RunState::Running);
}

/// Churn pages for the tests of snapshots taken while the guest runs.
const CHURN_PAGES: u64 = 512;

/// Restores `dir` into a new VM, left paused.
fn restored(dir: &std::path::Path, mib: usize) -> Vm {
    let mut vm = Vm::create(Shape::new(mib, 1), Box::new(std::io::sink())).unwrap();
    vm.restore_image(&twig_vmm::snapshot::Image::open(dir).unwrap())
        .unwrap();
    vm
}

/// Asserts that the paused, churning `vm` holds one moment of the guest:
/// every churn page as its registers say, no bad page seen by the guest.
/// Returns the pages the guest had checked.
fn assert_one_moment(vm: &Vm, what: &str) -> u64 {
    assert_moment_of(vm, CHURN_PAGES, what)
}

/// [`assert_one_moment`] for a churn over `pages` pages.
fn assert_moment_of(vm: &Vm, pages: u64, what: &str) -> u64 {
    let st = testguest::ChurnStatus::read(vm).unwrap();
    assert_eq!(st.bad, 0, "{what}: the guest saw bad pages: {st:?}");
    let bad = testguest::churn_check(vm, testguest::SCRATCH, pages).unwrap();
    assert!(
        bad.is_empty(),
        "{what}: {} pages differ from the registers, first {:?} ({st:?})",
        bad.len(),
        bad.first()
    );
    st.verified
}

#[test]
fn incremental_snapshots_of_a_running_guest_hold_the_moment_of_their_pause() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    let want = testguest::post(
        &mut g.vm,
        Command::Churn,
        [testguest::SCRATCH, CHURN_PAGES, 0],
    )
    .unwrap();
    testguest::poll(T, "churn to run two passes", || {
        Ok(g.vm.read_u64(testguest::DONE)? >= want
            && g.vm.read_u64(testguest::CHURN_VERIFIED)? >= 2 * CHURN_PAGES)
    })
    .unwrap();
    take(&mut g.vm, &snap(d.path(), "s0"), Kind::Full).unwrap();
    // The guest never stops: it rewrites its pages right after each resume,
    // while the snapshot's pages are written from the copy.
    let mut last = 0;
    for i in 1..=4 {
        let from = g.vm.read_u64(testguest::CHURN_VERIFIED).unwrap();
        testguest::poll(T, "churn between snapshots", || {
            Ok(g.vm.read_u64(testguest::CHURN_VERIFIED)? >= from + CHURN_PAGES)
        })
        .unwrap();
        let s = snap(d.path(), &format!("s{i}"));
        let info = take(&mut g.vm, &s, Kind::Incremental).unwrap();
        assert_eq!(g.vm.state(), RunState::Running);
        assert!(info.pause_ms <= info.duration_ms, "{info:?}");
        let r = restored(&s, MIB);
        let verified = assert_one_moment(&r, &format!("snapshot s{i}"));
        assert!(
            verified > last,
            "s{i} holds the guest's later writes: {verified} pages checked, {last} before"
        );
        last = verified;
    }
    g.vm.pause().unwrap();
    assert_one_moment(&g.vm, "the source");
}

/// A tmpfs of `mib` MiB mounted at `dir` (unmounted on drop).
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, mib: usize) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("running mount");
        assert!(
            out.status.success(),
            "this test needs root to mount a tmpfs: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Fills the filesystem of `path` with it until it is full.
fn fill(path: &std::path::Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0xa5u8; 1 << 20];
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling the filesystem: {e}"),
        }
    }
}

#[test]
fn a_snapshot_whose_write_fails_after_the_resume_is_lost_but_not_its_pages() {
    let d = tmp();
    let fs = d.path().join("fs");
    let _mount = Tmpfs::mount(&fs, MIB + 16);
    let mut g = boot(d.path(), MIB, 1);
    dirty(&mut g.vm, 0, 10, 100);
    let s0 = snap(&fs, "s0");
    take(&mut g.vm, &s0, Kind::Full).unwrap();
    let (store, _) = store_of(&s0);

    // 100 pages dirtied, then the filesystem is full: the write fails once
    // the guest runs again.
    dirty(&mut g.vm, 0, 100, 500);
    let staging = store.stage("s1").unwrap();
    let filler = fs.join("filler");
    fill(&filler);
    let e = g.vm.snapshot(staging.dir(), Kind::Incremental).unwrap_err();
    assert!(
        e.to_string()
            .contains("writing guest memory to the snapshot"),
        "{e}"
    );
    assert_eq!(g.vm.state(), RunState::Running, "the VM runs on");
    assert_eq!(
        std::fs::read_dir(staging.dir()).unwrap().count(),
        0,
        "nothing half-written stays"
    );
    assert!(staging.publish().is_err(), "nothing to publish");
    assert_eq!(store.list().unwrap().len(), 1, "only s0 is published");
    print(&mut g.vm, &g.serial, b'f');
    // A full snapshot fails in its pre-copy, while the guest runs: nothing
    // stays, and the baseline and its dirty pages are kept.
    let full = store.stage("full").unwrap();
    let e = g.vm.snapshot(full.dir(), Kind::Full).unwrap_err();
    assert!(
        e.to_string()
            .contains("writing guest memory to the snapshot"),
        "{e}"
    );
    assert_eq!(g.vm.state(), RunState::Running, "the VM runs on");
    assert_eq!(std::fs::read_dir(full.dir()).unwrap().count(), 0);
    assert_eq!(g.vm.stats().unwrap().baseline.as_deref(), Some("s0"));
    drop(full);

    // Room again: the next incremental snapshot holds the failed one's pages
    // and the ones dirtied since.
    std::fs::remove_file(&filler).unwrap();
    dirty(&mut g.vm, 200, 10, 900);
    let s2 = snap(&fs, "s2");
    let info = take(&mut g.vm, &s2, Kind::Incremental).unwrap();
    assert_eq!(info.parent.as_deref(), Some("s0"));
    assert!(info.pages_written >= 110, "{info:?}");
    let r = restored(&s2, MIB);
    for p in 0..100 {
        assert_eq!(word(&r, p), 500 + p, "page {p} of the failed snapshot");
    }
    for p in 200..210 {
        assert_eq!(word(&r, p), 900 + p - 200, "page {p} dirtied since");
    }
    g.vm.pause().unwrap();
    assert!(
        r.read_guest_ram().unwrap() == g.vm.read_guest_ram().unwrap(),
        "the chain restores the source's memory"
    );
}

#[test]
fn a_dirty_set_over_the_copy_limit_is_written_while_paused_and_restores() {
    const BIG: usize = 128;
    const PAGES: u64 = 20_000;
    let d = tmp();
    let mut g = boot(d.path(), BIG, 1);
    take(&mut g.vm, &snap(d.path(), "s0"), Kind::Full).unwrap();
    dirty(&mut g.vm, 0, PAGES, 7);
    g.vm.pause().unwrap();
    let s1 = snap(d.path(), "s1");
    let info = take(&mut g.vm, &s1, Kind::Incremental).unwrap();
    assert!(info.pages_written as u64 > PAGES, "{info:?}");
    let r = restored(&s1, BIG);
    assert!(
        r.read_guest_ram().unwrap() == g.vm.read_guest_ram().unwrap(),
        "restores the source's memory"
    );
    assert_eq!(word(&r, PAGES - 1), 7 + PAGES - 1);
}

/// Starts the churn command over `pages` pages and waits for two passes.
fn churn(vm: &mut Vm, pages: u64) {
    let want = testguest::post(vm, Command::Churn, [testguest::SCRATCH, pages, 0]).unwrap();
    testguest::poll(T, "churn to run two passes", || {
        Ok(vm.read_u64(testguest::DONE)? >= want
            && vm.read_u64(testguest::CHURN_VERIFIED)? >= 2 * pages)
    })
    .unwrap();
}

/// Lets the running, churning `vm` check `pages` more pages, then asserts
/// that it saw no bad one.
fn churns_on(vm: &mut Vm, pages: u64, what: &str) {
    let from = vm.read_u64(testguest::CHURN_VERIFIED).unwrap();
    testguest::poll(T, what, || {
        Ok(vm.read_u64(testguest::CHURN_VERIFIED)? >= from + pages)
    })
    .unwrap();
    assert_eq!(vm.read_u64(testguest::CHURN_BAD).unwrap(), 0, "{what}");
}

#[test]
fn a_full_snapshot_copied_while_the_guest_writes_holds_the_moment_of_its_pause() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    dirty(&mut g.vm, CHURN_PAGES, 100, 7);
    // 32 MiB more to copy: a first round long enough for the guest's vCPU
    // to be given the CPU during it, on a loaded machine too (with only
    // the 628 pages above, it once finished before the guest ran at all).
    dirty(&mut g.vm, 2 * CHURN_PAGES, 8192, 11);
    churn(&mut g.vm, CHURN_PAGES);
    let mut last = 0;
    for i in 0..3 {
        let s = snap(d.path(), &format!("f{i}"));
        let info = take(&mut g.vm, &s, Kind::Full).unwrap();
        assert_eq!(g.vm.state(), RunState::Running);
        // The guest rewrote its pages while RAM was copied: they were
        // copied again, in rounds, and last while paused.
        assert!(info.precopy_rounds >= 2, "{info:?}");
        assert!(info.pages_precopied >= 1000, "{info:?}");
        assert!(
            info.pages_paused <= 2 * CHURN_PAGES as usize,
            "only what changed since the last round is copied while paused: {info:?}"
        );
        assert!(info.pause_ms <= info.duration_ms, "{info:?}");
        assert_eq!(info.pages_written, MIB * 256, "{info:?}");
        twig_vmm::snapshot::verify(&s).unwrap();
        // Restored, it is one moment of the guest, later than the last,
        // and the guest continues from it exactly.
        let mut r = restored(&s, MIB);
        let verified = assert_one_moment(&r, &format!("snapshot f{i}"));
        assert!(
            verified > last,
            "f{i}: {verified} pages checked, {last} before"
        );
        last = verified;
        for p in 0..100 {
            assert_eq!(word(&r, CHURN_PAGES + p), 7 + p, "f{i} page {p}");
        }
        r.resume().unwrap();
        churns_on(&mut r, 4 * CHURN_PAGES, "the restored guest churns on");
        churns_on(&mut g.vm, CHURN_PAGES, "the source churns on");
    }
    // A chain on the last: an incremental snapshot of the paused source
    // restores its memory exactly, as a full one of the paused source does.
    g.vm.pause().unwrap();
    let inc = snap(d.path(), "i");
    take(&mut g.vm, &inc, Kind::Incremental).unwrap();
    let full = snap(d.path(), "full");
    take(&mut g.vm, &full, Kind::Full).unwrap();
    let (a, b) = (restored(&inc, MIB), restored(&full, MIB));
    let ram = g.vm.read_guest_ram().unwrap();
    assert!(a.read_guest_ram().unwrap() == ram, "f2 + i is the source");
    assert!(
        b.read_guest_ram().unwrap() == ram,
        "the full snapshot is the source"
    );
}

#[test]
fn a_rollback_to_a_precopied_snapshot_is_exact() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    churn(&mut g.vm, CHURN_PAGES);
    let s = snap(d.path(), "s");
    take(&mut g.vm, &s, Kind::Full).unwrap();
    let at = restored(&s, MIB);
    let mut expected = at.read_guest_ram().unwrap();
    for round in 0..3 {
        churns_on(&mut g.vm, 2 * CHURN_PAGES, "churn before the rollback");
        // RAM does not map the snapshot's file: the changed pages are
        // copied from it.
        let info = g.vm.rollback(&s).unwrap();
        assert!(!info.remapped, "round {round}: {info:?}");
        assert!(
            info.pages_restored >= CHURN_PAGES as usize
                && info.pages_restored < 2 * CHURN_PAGES as usize,
            "round {round}: {info:?}"
        );
        g.vm.pause().unwrap();
        assert_one_moment(&g.vm, &format!("round {round}, after the rollback"));
        let now = g.vm.read_guest_ram().unwrap();
        // Only the churn pages and the mailbox moved since the rollback.
        let (lo, hi) = (
            testguest::SCRATCH as usize,
            (testguest::SCRATCH + CHURN_PAGES * 4096) as usize,
        );
        let mailbox = testguest::MAILBOX as usize;
        let differ = (0..now.len() / 4096)
            .filter(|p| now[p * 4096..(p + 1) * 4096] != expected[p * 4096..(p + 1) * 4096])
            .filter(|p| !(lo..hi).contains(&(p * 4096)) && p * 4096 != mailbox)
            .collect::<Vec<_>>();
        assert!(differ.is_empty(), "round {round}: pages {differ:?} differ");
        expected = now;
        g.vm.resume().unwrap();
    }
    churns_on(&mut g.vm, 4 * CHURN_PAGES, "the guest churns on");
}

#[test]
fn a_guest_writing_faster_than_the_copy_is_snapshotted_within_the_bound() {
    // 20,000 churn pages (78 MiB): more than a buffer holds, rewritten as
    // fast as they are copied.
    const BIG: usize = 128;
    const PAGES: u64 = 20_000;
    let d = tmp();
    let mut g = boot(d.path(), BIG, 1);
    churn(&mut g.vm, PAGES);
    let s = snap(d.path(), "s");
    let info = take(&mut g.vm, &s, Kind::Full).unwrap();
    assert!(info.precopy_rounds <= 9, "{info:?}");
    let r = restored(&s, BIG);
    assert_moment_of(&r, PAGES, "the snapshot");
    // More pages changed than a rollback copies: the file is mapped over
    // RAM once, and RAM maps it from then on.
    churns_on(&mut g.vm, 2 * PAGES, "churn before the rollback");
    let first = g.vm.rollback(&s).unwrap();
    assert!(first.remapped, "{first:?}");
    g.vm.pause().unwrap();
    assert_moment_of(&g.vm, PAGES, "after the first rollback");
    g.vm.resume().unwrap();
    churns_on(&mut g.vm, 2 * PAGES, "churn after the first rollback");
    let second = g.vm.rollback(&s).unwrap();
    assert!(!second.remapped, "{second:?}");
    g.vm.pause().unwrap();
    assert_moment_of(&g.vm, PAGES, "after the second rollback");
}
