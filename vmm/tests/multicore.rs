//! Multi-core correctness of snapshot, restore, rollback and clone (issue
//! 12): a ring-3 guest checks and rewrites a self-describing pattern over
//! its memory without pause (the churn command) while the VMM snapshots,
//! rolls back and clones it from other threads, and a device thread fills
//! the guest's network receive buffers with frames pumped into its tap.
//! A faithful snapshot, restore, rollback or clone resumes the guest at an
//! instruction boundary with registers and memory consistent, so the guest
//! never sees a page that does not hold its pattern; a stale translation, a
//! lost dirty page or a page remapped under a running vCPU shows up as one.
//!
//! Each experiment runs twice: with the vCPU threads on one CPU and the
//! VMM's threads (this test's thread, the device thread, the frame pump) on
//! another, and as the control with all of them on one CPU while a spinner
//! keeps the other CPU busy. The tests run one at a time (they pin threads)
//! and need two CPUs; they print what they did and where the threads ran.

mod common;

use std::collections::HashSet;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::*;
use twig_vmm::testguest::{self, ChurnStatus, Command};
use twig_vmm::{DeviceConfig, Kind, NetConfig, RunState, Vm};

/// Guest RAM of every VM here.
const MEM_MIB: usize = 32;
/// Pages the guest churns (2 MiB from `testguest::SCRATCH`).
const PAGES: u64 = 512;
/// Receive buffers the guest keeps posted.
const RX_QUEUE: u16 = 64;
/// Deadline of the rollback experiment: a guest that has not made the
/// progress `ROLLBACKS` rollbacks need by then has stalled. (A deadline,
/// not a speed target: a loaded machine takes longer, and that is fine.)
const ROLLBACK_TIME: Duration = Duration::from_secs(180);
/// Rollbacks the rollback experiment makes.
const ROLLBACKS: usize = 12;
/// Rounds of concurrent clones in the clone experiment.
const CLONE_ROUNDS: usize = 6;
/// Clones per round.
const CLONES: usize = 4;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where the threads run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// vCPU threads on one CPU, the VMM's threads on the other.
    Apart,
    /// Everything on one CPU; a spinner keeps the other one busy.
    Together,
}

fn tid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

/// Pins thread `tid` (0: the calling thread) to `cpu`.
fn pin(tid: i32, cpu: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes inside it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (it came from sched_getaffinity).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: passes a valid cpu_set_t of the size given.
    let r = unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set) };
    assert_eq!(
        r,
        0,
        "pinning thread {tid} to CPU {cpu}: {}",
        std::io::Error::last_os_error()
    );
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: passes a valid cpu_set_t of the size given.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    assert_eq!(
        r,
        0,
        "sched_getaffinity: {}",
        std::io::Error::last_os_error()
    );
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: reads a bit of a valid cpu_set_t, index below CPU_SETSIZE.
        .filter(|c| unsafe { libc::CPU_ISSET(*c, &set) })
        .collect()
}

/// Two CPUs to put threads on; fails loudly on a one-CPU machine, where
/// the experiment cannot tell anything apart.
fn two_cpus() -> (usize, usize) {
    let cpus = allowed_cpus();
    assert!(
        cpus.len() >= 2,
        "the multi-core experiment needs two CPUs; this process may use {cpus:?} \
         (in the lab: TWIG_LAB_SMP=2)"
    );
    (cpus[0], cpus[1])
}

/// This process's threads named `name`.
fn threads_named(name: &str) -> HashSet<i32> {
    let mut out = HashSet::new();
    for e in std::fs::read_dir("/proc/self/task").expect("listing /proc/self/task") {
        let e = e.expect("reading /proc/self/task");
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim_end() == name {
            if let Some(t) = e.file_name().to_str().and_then(|s| s.parse().ok()) {
                out.insert(t);
            }
        }
    }
    out
}

/// The CPU thread `tid` last ran on (field 39 of its stat).
fn last_cpu(tid: i32) -> Option<usize> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(36)?.parse().ok()
}

/// The VM threads started by `f`: (vCPU threads, device threads).
fn new_threads<R>(f: impl FnOnce() -> R) -> (R, Vec<i32>, Vec<i32>) {
    let (v0, d0) = (threads_named("twig-vcpu0"), threads_named("twig-devices"));
    let r = f();
    let vcpus = threads_named("twig-vcpu0")
        .difference(&v0)
        .copied()
        .collect();
    let devs = threads_named("twig-devices")
        .difference(&d0)
        .copied()
        .collect();
    (r, vcpus, devs)
}

/// A thread that keeps a CPU busy until dropped.
struct Spinner {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Spinner {
    fn on(cpu: usize) -> Spinner {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            pin(0, cpu);
            let mut x = 0u64;
            while !s.load(Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        });
        Spinner {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn tap_name(i: usize) -> String {
    format!("twmc{}x{i}", std::process::id() % 100_000)
}

fn link_up(tap: &str) {
    let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{tap}/disable_ipv6"), "1");
    let ok = std::process::Command::new("ip")
        .args(["link", "set", tap, "up"])
        .status()
        .expect("running ip");
    assert!(ok.success(), "ip link set {tap} up");
}

/// A raw packet socket on a tap, sending frames to the tap's reader (the
/// VM's device thread) from its own thread until dropped.
struct Pump {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn packet_socket(tap: &str) -> OwnedFd {
    let name = std::ffi::CString::new(tap).expect("tap name");
    // SAFETY: a valid NUL-terminated name.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert_ne!(ifindex, 0, "no interface {tap}");
    let proto = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain socket creation.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            i32::from(proto),
        )
    };
    assert!(
        fd >= 0,
        "AF_PACKET socket: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: fd is a new socket we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_ll is plain data.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = proto;
    addr.sll_ifindex = ifindex as i32;
    // SAFETY: addr is a sockaddr_ll of the size given.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            std::ptr::addr_of!(addr).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    assert_eq!(
        r,
        0,
        "binding to {tap}: {}",
        std::io::Error::last_os_error()
    );
    fd
}

impl Pump {
    fn start(tap: &str, cpu: usize) -> Pump {
        let fd = packet_socket(tap);
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (s, n) = (stop.clone(), sent.clone());
        let thread = std::thread::spawn(move || {
            pin(0, cpu);
            let mut frame = vec![0xffu8; 6];
            frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x99, 0x88, 0xb5]);
            frame.resize(60, 0);
            while !s.load(Ordering::Relaxed) {
                // A burst, then a pause to pace the pump: the device thread
                // gets a steady stream without the pump owning its CPU.
                for _ in 0..16 {
                    // SAFETY: sends from a valid buffer.
                    let r = unsafe {
                        libc::send(fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0)
                    };
                    if r > 0 {
                        n.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        });
        Pump {
            stop,
            sent,
            thread: Some(thread),
        }
    }
}

impl Drop for Pump {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Snapshots live in tmpfs: the root filesystem here is small and shared.
fn shm_tmp() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("twig-multicore")
        .tempdir_in("/dev/shm")
        .expect("tempdir in /dev/shm")
}

fn status(vm: &Vm) -> ChurnStatus {
    ChurnStatus::read(vm).expect("reading the churn counters")
}

/// Asserts, on a paused VM, that the guest saw no bad page and that every
/// page holds what the guest's registers say.
fn assert_consistent(vm: &Vm, what: &str) -> ChurnStatus {
    assert_eq!(vm.state(), RunState::Paused, "{what}");
    let st = status(vm);
    assert_eq!(st.bad, 0, "{what}: the guest found bad pages: {st:?}");
    let bad = testguest::churn_check(vm, testguest::SCRATCH, PAGES).expect("checking pages");
    assert!(
        bad.is_empty(),
        "{what}: {} pages differ from the guest's registers, first {:?} ({st:?})",
        bad.len(),
        bad.first()
    );
    st
}

/// Waits until the running guest has checked `pages` more pages than `from`.
fn wait_progress(vm: &Vm, from: u64, pages: u64, what: &str) -> u64 {
    let mut now = 0;
    testguest::poll(T, what, || {
        now = vm.read_u64(testguest::CHURN_VERIFIED)?;
        Ok(now >= from + pages)
    })
    .unwrap_or_else(|e| panic!("{e} (checked {now} pages, from {from})"));
    now
}

/// Starts the churn command and waits until the guest has written its
/// pages and runs the loop.
fn start_churn(vm: &mut Vm, net_area: u64) {
    let want = testguest::post(vm, Command::Churn, [testguest::SCRATCH, PAGES, net_area])
        .expect("posting churn");
    testguest::poll(T, "churn to start", || {
        Ok(vm.read_u64(testguest::DONE)? >= want)
    })
    .expect("churn start");
    wait_progress(vm, 0, 2 * PAGES, "the first churn passes");
}

struct Snap {
    dir: PathBuf,
    tag: u64,
    at: ChurnStatus,
}

/// How often thread `tid` blocked (its voluntary context switches).
fn blocked(tid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
        .trim()
        .parse()
        .ok()
}

/// Where each kind of thread last ran, for the report.
fn placement(vcpus: &[i32], devs: &[i32]) -> String {
    let cpu = |t: &i32| last_cpu(*t).map_or("?".into(), |c| c.to_string());
    format!(
        "vCPU threads on CPU {:?} (blocked {:?} times), device threads on CPU {:?}, \
         test thread on CPU {}",
        vcpus.iter().map(cpu).collect::<Vec<_>>(),
        vcpus.iter().map(|t| blocked(*t)).collect::<Vec<_>>(),
        devs.iter().map(cpu).collect::<Vec<_>>(),
        cpu(&tid())
    )
}

fn rollback_experiment(layout: Layout) {
    let _serial = one_at_a_time();
    require_kvm();
    let (a, b) = two_cpus();
    // Threads inherit their creator's affinity: the VM's start on CPU a.
    pin(0, a);
    let d = shm_tmp();
    let tap = tap_name(0);
    let devices = DeviceConfig {
        net: Some(NetConfig {
            tap: Some(tap.clone()),
            mac: [0x02, 0, 0, 0, 0x3c, 1],
        }),
        ..Default::default()
    };
    let (mut g, vcpus, devs) = new_threads(|| boot_with(d.path(), MEM_MIB, 1, &devices));
    assert_eq!(
        (vcpus.len(), devs.len()),
        (1, 1),
        "one vCPU and one device thread"
    );
    link_up(&tap);
    // rng is virtio device 0, net device 1.
    let net_mmio = testguest::virtio_mmio_addr(1);
    testguest::prepare_net_rx(&g.vm, testguest::NET_QUEUE_AREA, net_mmio, RX_QUEUE)
        .expect("queue area");
    start_churn(&mut g.vm, testguest::NET_QUEUE_AREA);
    let vmm_cpu = match layout {
        Layout::Apart => b,
        Layout::Together => a,
    };
    pin(devs[0], vmm_cpu);
    pin(0, vmm_cpu);
    let _spinner = (layout == Layout::Together).then(|| Spinner::on(b));
    let pump = Pump::start(&tap, vmm_cpu);

    let start = Instant::now();
    let mut snaps: Vec<Snap> = Vec::new();
    let (mut full, mut incremental, mut rollbacks) = (0, 0, 0);
    // Pages checked and frames received, summed over the timeline's
    // segments (a rollback rewinds the guest's own counters).
    let (mut checked, mut frames) = (0u64, 0u64);
    let mut seg = status(&g.vm);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut i = 0u64;
    // The fastest the guest has been seen to check pages, per second.
    let mut rate = 0.0f64;
    while rollbacks < ROLLBACKS && start.elapsed() < ROLLBACK_TIME {
        i += 1;
        let (now, t) = (status(&g.vm).verified, Instant::now());
        let then = wait_progress(&g.vm, now, 2 * PAGES, "churn between operations");
        rate = rate.max((then - now) as f64 / t.elapsed().as_secs_f64());
        g.vm.pause().expect("pause");
        let st = assert_consistent(&g.vm, &format!("before operation {i}"));
        let kind = if snaps.len() % 4 == 0 {
            Kind::Full
        } else {
            Kind::Incremental
        };
        let tag = 0x7467_0000_0000 + i;
        g.vm.write_u64(testguest::HOST_TAG, tag).expect("tag");
        let dir = snap(d.path(), &format!("s{i}"));
        take(&mut g.vm, &dir, kind).expect("snapshot");
        match kind {
            Kind::Full => full += 1,
            Kind::Incremental => incremental += 1,
        }
        snaps.push(Snap { dir, tag, at: st });
        g.vm.write_u64(testguest::HOST_TAG, !tag).expect("tag");
        g.vm.resume().expect("resume");
        if i % 2 == 1 {
            continue;
        }
        // Roll back to any snapshot of the tree, once the guest is well past
        // it (eight passes, and what it checks in 100 ms at its best), so
        // that a guest rewound and one that went on cannot be mixed up.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let target = &snaps[(seed % snaps.len() as u64) as usize];
        let margin = (8 * PAGES).max((rate / 10.0) as u64);
        wait_progress(&g.vm, target.at.verified, margin, "churn before rollback");
        g.vm.pause().expect("pause");
        let pre = assert_consistent(&g.vm, &format!("before rollback {rollbacks}"));
        checked += pre.verified - seg.verified;
        frames += pre.rx - seg.rx;
        g.vm.rollback(&target.dir).expect("rollback");
        rollbacks += 1;
        g.vm.pause().expect("pause");
        let what = format!("after rollback {rollbacks} to {}", target.dir.display());
        let post = assert_consistent(&g.vm, &what);
        assert_eq!(
            g.vm.read_u64(testguest::HOST_TAG).unwrap(),
            target.tag,
            "{what}: memory is the snapshot's"
        );
        assert!(
            post.verified >= target.at.verified && post.verified < pre.verified,
            "{what}: the guest's count went back to the snapshot's {} and on from there \
             (before the rollback {}, after {})",
            target.at.verified,
            pre.verified,
            post.verified
        );
        assert!(post.gen >= target.at.gen && post.gen <= pre.gen, "{what}");
        seg = post;
        g.vm.resume().expect("resume");
    }
    let now = status(&g.vm).verified;
    wait_progress(&g.vm, now, 4 * PAGES, "churn after the last rollback");
    g.vm.pause().expect("pause");
    let end = assert_consistent(&g.vm, "at the end");
    checked += end.verified - seg.verified;
    frames += end.rx - seg.rx;
    let sent = pump.sent.load(Ordering::Relaxed);
    drop(pump);
    let exits = g.vm.stats().expect("stats").exits;
    eprintln!(
        "multicore rollback {layout:?}: {rollbacks} rollbacks, {full} full + {incremental} \
         incremental snapshots, {checked} pages checked, 0 bad, {frames} frames received \
         by the guest of {sent} pumped, {exits} vCPU exits to the VMM, in {:.1} s; {}",
        start.elapsed().as_secs_f64(),
        placement(&vcpus, &devs)
    );
    assert_eq!(
        rollbacks, ROLLBACKS,
        "the guest stalled: {rollbacks} rollbacks by the {ROLLBACK_TIME:?} deadline"
    );
    assert!(frames > 0, "the device thread delivered no frame");
}

fn clone_experiment(layout: Layout) {
    let _serial = one_at_a_time();
    require_kvm();
    let (a, b) = two_cpus();
    pin(0, a);
    let d = shm_tmp();
    let mut g = boot(d.path(), MEM_MIB, 1);
    start_churn(&mut g.vm, 0);
    let vmm_cpu = match layout {
        Layout::Apart => b,
        Layout::Together => a,
    };
    let _spinner = (layout == Layout::Together).then(|| Spinner::on(b));
    let start = Instant::now();
    let (mut restores, mut checked) = (0usize, 0u64);
    let mut report = String::new();
    for round in 0..CLONE_ROUNDS {
        pin(0, a);
        let now = status(&g.vm).verified;
        wait_progress(&g.vm, now, 2 * PAGES, "the source's churn");
        g.vm.pause().expect("pause");
        let at = assert_consistent(&g.vm, &format!("source, round {round}"));
        let tag = 0x636c_0000_0000 + round as u64;
        g.vm.write_u64(testguest::HOST_TAG, tag).expect("tag");
        let s = snap(d.path(), &format!("s{round}"));
        take(&mut g.vm, &s, Kind::Full).expect("snapshot");
        // Restored concurrently, from threads on CPU a: so are their vCPUs.
        let (clones, vcpus, _) = new_threads(|| {
            Vm::clone_from(
                &s,
                CLONES,
                |_| Box::new(std::io::sink()),
                |_| DeviceConfig::default(),
            )
            .expect("clones")
        });
        assert_eq!(vcpus.len(), CLONES);
        pin(0, vmm_cpu);
        g.vm.resume().expect("resume the source");
        let mut clones = clones;
        for (k, c) in clones.iter().enumerate() {
            wait_progress(c, at.verified, 8 * PAGES, &format!("clone {k}'s churn"));
        }
        for (k, c) in clones.iter_mut().enumerate() {
            c.pause().expect("pause clone");
            let what = format!("clone {k} of round {round}");
            let st = assert_consistent(c, &what);
            assert_eq!(c.read_u64(testguest::HOST_TAG).unwrap(), tag, "{what}");
            assert!(st.verified >= at.verified + 8 * PAGES, "{what}");
            checked += st.verified - at.verified;
            restores += 1;
        }
        report = placement(&vcpus, &[]);
        drop(clones);
    }
    g.vm.pause().expect("pause");
    let end = assert_consistent(&g.vm, "the source at the end");
    checked += end.verified;
    eprintln!(
        "multicore clones {layout:?}: {restores} VMs restored in {CLONE_ROUNDS} rounds of \
         {CLONES} concurrent clones, {checked} pages checked, 0 bad, in {:.1} s; {report}",
        start.elapsed().as_secs_f64()
    );
}

#[test]
fn rollbacks_with_vcpu_and_vmm_threads_on_different_cpus() {
    rollback_experiment(Layout::Apart);
}

#[test]
fn rollbacks_with_vcpu_and_vmm_threads_on_one_cpu() {
    rollback_experiment(Layout::Together);
}

#[test]
fn concurrent_clones_with_vcpu_and_vmm_threads_on_different_cpus() {
    clone_experiment(Layout::Apart);
}

#[test]
fn concurrent_clones_with_vcpu_and_vmm_threads_on_one_cpu() {
    clone_experiment(Layout::Together);
}

#[test]
fn churn_reports_a_page_changed_under_it() {
    // The detector itself: a page the host changes behind the guest's back
    // is found by the guest and by the host's check.
    let _serial = one_at_a_time();
    let d = tmp();
    let mut g = boot(d.path(), MEM_MIB, 1);
    start_churn(&mut g.vm, 0);
    g.vm.pause().expect("pause");
    let regs = g.vm.vcpu_regs(0).expect("registers");
    let victim = (regs.r11 + PAGES / 2) % PAGES;
    let gpa = testguest::SCRATCH + victim * 4096 + 8 * 77;
    let was = g.vm.read_u64(gpa).expect("read");
    g.vm.write_u64(gpa, !was).expect("write");
    let found = testguest::churn_check(&g.vm, testguest::SCRATCH, PAGES).expect("check");
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (found[0].page, found[0].word, found[0].seen),
        (victim, 77, !was)
    );
    g.vm.resume().expect("resume");
    testguest::poll(T, "the guest to find the changed page", || {
        Ok(g.vm.read_u64(testguest::CHURN_BAD)? > 0)
    })
    .expect("guest detection");
    g.vm.pause().expect("pause");
    let st = status(&g.vm);
    assert_eq!(
        (st.bad, st.bad_page, st.bad_word, st.bad_seen),
        (1, victim, 77, !was),
        "{st:?}"
    );
    // It rewrote the page and goes on without further complaint.
    g.vm.resume().expect("resume");
    wait_progress(&g.vm, st.verified, 4 * PAGES, "churn after the bad page");
    g.vm.pause().expect("pause");
    assert_eq!(status(&g.vm).bad, 1);
    assert!(testguest::churn_check(&g.vm, testguest::SCRATCH, PAGES)
        .expect("check")
        .is_empty());
}
