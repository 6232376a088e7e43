//! Lazy restore through userfaultfd (`twig_vmm::uffd`): the `twig-vmm`
//! binary (seccomp filters on, as by default) restores a snapshot whose
//! memory a page server in the test serves on demand, from the snapshot
//! chain's memory files composed. Needs root, /dev/kvm and
//! /dev/userfaultfd; fails, never skips, without them.

mod common;

use std::fs::{File, OpenOptions};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use twig_vmm::api::{Client, ClientError};
use twig_vmm::snapshot::{read_exact_at, Image};
use twig_vmm::testguest::{self, Command as Cmd};
use twig_vmm::uffd::PageServer;
use twig_vmm::{ErrorKind, Kind, RunState, Shape, Vm};

const BIN: &str = env!("CARGO_BIN_EXE_twig-vmm");
const PAGE: usize = 4096;

fn require_userfaultfd() -> File {
    require_kvm();
    OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
        .unwrap_or_else(|e| {
            panic!("this test needs /dev/userfaultfd (Linux >= 6.1) opened as root: {e}")
        })
}

struct Vmm {
    child: Child,
    api: Client,
}

impl Vmm {
    /// `twig-vmm serve` (seccomp on); its stderr goes to `<name>.log`.
    fn start(dir: &Path, name: &str) -> Vmm {
        let sock = dir.join(format!("{name}.sock"));
        let serial = dir.join(format!("{name}.serial"));
        let args = [
            "--api-sock",
            sock.to_str().unwrap(),
            "--serial",
            serial.to_str().unwrap(),
        ];
        Vmm::spawn(&sock, &args, &dir.join(format!("{name}.log")))
    }

    /// `twig-vmm serve ARGS`, whose API socket is `sock` here.
    fn spawn(sock: &Path, args: &[&str], log: &Path) -> Vmm {
        let log = File::create(log).unwrap();
        let child = Command::new(BIN)
            .arg("serve")
            .args(args)
            .env("TWIG_LOG", "info")
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn twig-vmm");
        let api = Client::connect(sock, T).expect("connect to twig-vmm");
        Vmm { child, api }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Page `p` as a normal restore of `image` would have it: from the newest
/// layer holding it, else the root's memory file.
fn composed(image: &Arc<Image>, p: u64, buf: &mut [u8]) {
    let src = image
        .layer_for(p as usize)
        .unwrap_or_else(|| image.chain()[0].clone());
    read_exact_at(&src.memory, buf, p * PAGE as u64).expect("read a snapshot page");
}

enum Ctl {
    /// Serve every page, then say complete.
    Finish,
    /// Close the socket (and the userfaultfd) mid-run.
    Vanish,
}

/// A page server on a thread: answers faults from `image`'s composed
/// memory until told what to do; counts the pages it filled.
struct Handler {
    served: Arc<AtomicU64>,
    faults: Arc<AtomicU64>,
    /// The pages faults asked for, in order.
    faulted: Arc<Mutex<Vec<u64>>>,
    ctl: Sender<Ctl>,
    thread: JoinHandle<Result<u64, String>>,
}

impl Handler {
    fn start(conn: UnixStream, image: Arc<Image>) -> Handler {
        let served = Arc::new(AtomicU64::new(0));
        let faults = Arc::new(AtomicU64::new(0));
        let faulted = Arc::new(Mutex::new(Vec::new()));
        let (ctl, rx) = channel();
        let (s, f, fp) = (served.clone(), faults.clone(), faulted.clone());
        let thread = std::thread::spawn(move || serve(conn, &image, &s, &f, &fp, &rx));
        Handler {
            served,
            faults,
            faulted,
            ctl,
            thread,
        }
    }

    fn wait_faults(&self, at_least: u64) {
        let deadline = Instant::now() + T;
        while self.faults.load(Ordering::SeqCst) < at_least {
            assert!(Instant::now() < deadline, "no page faults came");
            std::thread::yield_now();
        }
    }

    /// Waits until a fault asked for `page`.
    fn wait_fault_on(&self, page: u64) {
        let deadline = Instant::now() + T;
        while !self.faulted.lock().unwrap().contains(&page) {
            assert!(Instant::now() < deadline, "no fault on page {page} came");
            std::thread::yield_now();
        }
    }
}

fn serve(
    conn: UnixStream,
    image: &Arc<Image>,
    served: &AtomicU64,
    faults: &AtomicU64,
    faulted: &Mutex<Vec<u64>>,
    ctl: &Receiver<Ctl>,
) -> Result<u64, String> {
    let ps = PageServer::accept(conn, T).map_err(|e| e.to_string())?;
    let layout = ps.layout().clone();
    assert_eq!(layout.mem_size, image.state.meta.mem_size);
    let mut page = vec![0u8; PAGE];
    loop {
        match ctl.try_recv() {
            Ok(Ctl::Vanish) => return Ok(served.load(Ordering::SeqCst)),
            Ok(Ctl::Finish) => break,
            Err(_) => {}
        }
        if let Some(p) = ps
            .next_fault(Some(Duration::from_millis(5)))
            .map_err(|e| e.to_string())?
        {
            faults.fetch_add(1, Ordering::SeqCst);
            faulted.lock().unwrap().push(p);
            composed(image, p, &mut page);
            let n = ps.copy(p, &page).map_err(|e| e.to_string())?;
            served.fetch_add(n, Ordering::SeqCst);
        }
    }
    const CHUNK: u64 = 256;
    let mut buf = vec![0u8; CHUNK as usize * PAGE];
    let mut first = 0;
    while first < layout.pages() {
        let n = CHUNK.min(layout.pages() - first);
        for i in 0..n {
            composed(
                image,
                first + i,
                &mut buf[i as usize * PAGE..(i as usize + 1) * PAGE],
            );
        }
        let filled = ps
            .copy(first, &buf[..n as usize * PAGE])
            .map_err(|e| e.to_string())?;
        served.fetch_add(filled, Ordering::SeqCst);
        first += n;
    }
    ps.complete().map_err(|e| e.to_string())?;
    Ok(served.load(Ordering::SeqCst))
}

fn word_in(image: &Arc<Image>, gpa: u64) -> u64 {
    let mut page = vec![0u8; PAGE];
    composed(image, gpa / PAGE as u64, &mut page);
    let off = (gpa % PAGE as u64) as usize;
    u64::from_le_bytes(page[off..off + 8].try_into().unwrap())
}

/// Boots the test guest, dirties scratch pages, snapshots `s1` (full),
/// dirties more and starts it spinning, snapshots `s2` (incremental).
fn make_chain(d: &Path) -> (PathBuf, PathBuf) {
    let mut g = boot(d, MIB, 1);
    dirty(&mut g.vm, 0, 64, 1000);
    let s1 = snap(d, "s1");
    take(&mut g.vm, &s1, Kind::Full).expect("full snapshot");
    dirty(&mut g.vm, 10, 20, 5000);
    testguest::post(&mut g.vm, Cmd::Spin, [0; 3]).expect("spin");
    testguest::poll(T, "spinning", || {
        Ok(g.vm.read_u64(testguest::COUNTER)? > 1000)
    })
    .expect("the guest spins");
    let s2 = snap(d, "s2");
    take(&mut g.vm, &s2, Kind::Incremental).expect("incremental snapshot");
    (s1, s2)
}

fn expected_word(p: u64) -> u64 {
    if (10..30).contains(&p) {
        5000 + p - 10
    } else {
        1000 + p
    }
}

/// A snapshot through the API into the store of `d`, published.
fn api_snapshot(api: &mut Client, d: &Path, id: &str, kind: Kind) -> Result<PathBuf, ClientError> {
    let (store, _) = store_of(&snap(d, "s1"));
    let staging = store.stage(id).expect("stage");
    api.snapshot(staging.dir(), kind, T)?;
    Ok(staging.publish().expect("publish").dir().to_path_buf())
}

#[test]
fn a_lazily_restored_guest_runs_before_its_memory_is_complete_and_ends_exact() {
    let dev = require_userfaultfd();
    let d = tmp();
    let (_s1, s2) = make_chain(d.path());
    let image = Image::open(&s2).expect("open s2");
    let pages = image.state.meta.mem_size / PAGE as u64;
    let counter_s2 = word_in(&image, testguest::COUNTER);

    // A normal restore, for comparison.
    let start = Instant::now();
    let mut normal = Vmm::start(d.path(), "normal");
    normal.api.restore(&s2, T).expect("normal restore");
    let normal_ms = start.elapsed().as_secs_f64() * 1e3;
    drop(normal);

    let start = Instant::now();
    let mut vmm = Vmm::start(d.path(), "lazy");
    let (mine, theirs) = UnixStream::pair().unwrap();
    let handler = Handler::start(theirs, image.clone());
    let id = vmm
        .api
        .restore_lazy(&s2, &[], &dev, &mine, T)
        .expect("lazy restore");
    let lazy_ms = start.elapsed().as_secs_f64() * 1e3;
    drop(mine);
    assert_eq!(id, "s2");
    let at_restore = handler.served.load(Ordering::SeqCst);
    eprintln!(
        "spawn -> restored: lazy {lazy_ms:.1} ms ({at_restore} of {pages} pages served), normal {normal_ms:.1} ms"
    );
    assert!(
        at_restore < pages / 4,
        "restored with {at_restore} of {pages} pages"
    );
    // The guest runs on what it faulted in: it wrote its counter's page.
    // (Not "a fault after the restore answered": under load the spinning
    // guest faulted its few pages in before the answer reached the test.)
    handler.wait_fault_on(testguest::COUNTER / PAGE as u64);
    assert_eq!(vmm.api.stats(T).unwrap().state, RunState::Running);
    assert!(handler.served.load(Ordering::SeqCst) < pages);

    // Before complete: no rollback (the VM runs on), an incremental
    // snapshot (its parent s2 is in the store) and a full one are fine.
    match vmm.api.rollback(&s2, T) {
        Err(ClientError::Vmm { kind, message }) => {
            assert_eq!(kind, ErrorKind::Refused, "{message}");
            assert!(message.contains("page server"), "{message}");
        }
        other => panic!("a rollback before complete answered {other:?}"),
    }
    assert_eq!(vmm.api.stats(T).unwrap().state, RunState::Running);
    let s3 = api_snapshot(&mut vmm.api, d.path(), "s3", Kind::Incremental).expect("incremental");
    vmm.api.pause(T).unwrap();
    let f1 = api_snapshot(&mut vmm.api, d.path(), "f1", Kind::Full).expect("full, paused");
    vmm.api.resume(T).unwrap();

    handler.ctl.send(Ctl::Finish).unwrap();
    let total = handler.thread.join().unwrap().expect("the page server");
    assert_eq!(total, pages, "every page filled exactly once");
    let log = d.path().join("lazy.log");
    let deadline = Instant::now() + T;
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("lazy restore complete")
    {
        assert!(Instant::now() < deadline, "the VMM never unregistered RAM");
        std::thread::yield_now();
    }
    // After complete the guest keeps running; a snapshot is exact; a
    // rollback works.
    assert_eq!(vmm.api.stats(T).unwrap().state, RunState::Running);
    let s4 = api_snapshot(&mut vmm.api, d.path(), "s4", Kind::Full).expect("full snapshot");
    let r = vmm.api.rollback(&s3, T).expect("rollback after complete");
    assert_eq!(r.id, "s3");
    let s5 = api_snapshot(&mut vmm.api, d.path(), "s5", Kind::Incremental).expect("incremental");
    drop(vmm);

    // Every snapshot holds s2's memory but for the spinning counter's
    // page, which moved on.
    let counter_page = testguest::COUNTER / PAGE as u64;
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    for dir in [&s3, &f1, &s4, &s5] {
        let img = Image::open(dir).expect("open");
        let mut differ = Vec::new();
        for p in 0..pages {
            composed(&image, p, &mut a);
            composed(&img, p, &mut b);
            if a != b {
                differ.push(p);
            }
        }
        assert!(
            differ.iter().all(|p| *p == counter_page),
            "{}: pages {differ:?} differ from s2",
            dir.display()
        );
        let c = word_in(&img, testguest::COUNTER);
        assert!(c > counter_s2, "the guest ran: counter {c} > {counter_s2}");
    }

    // The page server filled every page, yet s4's hot list is s2's (and
    // what the guest dirtied since): not all of memory.
    let hot_of = |dir: &Path| Image::open(dir).unwrap().state.meta.hot.clone();
    let (h2, h4) = (hot_of(&s2), hot_of(&s4));
    let covers = |hot: &[(u64, u64)], p: u64| hot.iter().any(|(f, n)| p >= *f && p < f + n);
    assert!(covers(&h2, counter_page), "s2's hot list {h2:?}");
    assert!(covers(&h4, counter_page), "s4's hot list {h4:?}");
    assert!(
        !covers(&h4, pages - 1),
        "s4's hot list is all of memory: {h4:?}"
    );
    for p in 0..pages {
        assert!(
            !covers(&h2, p) || covers(&h4, p),
            "page {p} left s4's hot list"
        );
    }

    // s4 restores normally and the guest spins on.
    let serial = twig_vmm::Capture::new();
    let mut vm =
        Vm::create_with(Shape::new(MIB, 1), serial.writer(), &Default::default()).expect("create");
    vm.restore(&s4).expect("restore s4");
    for p in 0..64 {
        assert_eq!(word(&vm, p), expected_word(p), "page {p}");
    }
    let c4 = word_in(&Image::open(&s4).unwrap(), testguest::COUNTER);
    testguest::poll(T, "the restored guest spins on", || {
        Ok(vm.read_u64(testguest::COUNTER)? > c4)
    })
    .expect("spinning");
}

#[test]
fn a_page_server_that_vanishes_ends_the_vmm_with_a_reason() {
    let dev = require_userfaultfd();
    let d = tmp();
    let (s1, _) = make_chain(d.path());
    let image = Image::open(&s1).expect("open s1");
    let mut vmm = Vmm::start(d.path(), "v");
    let (mine, theirs) = UnixStream::pair().unwrap();
    let handler = Handler::start(theirs, image);
    vmm.api
        .restore_lazy(&s1, &[], &dev, &mine, T)
        .expect("lazy restore");
    drop(mine);
    handler.wait_faults(1);
    handler.ctl.send(Ctl::Vanish).unwrap();
    handler.thread.join().unwrap().expect("the page server");
    let deadline = Instant::now() + T;
    let status = loop {
        if let Some(s) = vmm.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the VMM still runs without its page server"
        );
        std::thread::yield_now();
    };
    assert!(!status.success(), "exited with {status}");
    let log = std::fs::read_to_string(d.path().join("v.log")).unwrap();
    assert!(
        log.contains("page server of the lazy restore went away"),
        "{log}"
    );
}

#[test]
fn lazy_restores_without_their_descriptors_are_refused_and_the_vmm_still_restores() {
    let dev = require_userfaultfd();
    let d = tmp();
    let (s1, s2) = make_chain(d.path());
    let mut vmm = Vmm::start(d.path(), "b");
    // No descriptors at all.
    let req = twig_vmm::api::Request::Restore {
        dir: s2.clone(),
        slots: Vec::new(),
        lazy: true,
    };
    match vmm.api.call(&req, T) {
        Err(ClientError::Vmm { kind, message }) => {
            assert_eq!(kind, ErrorKind::InvalidRequest);
            assert!(message.contains("file descriptors"), "{message}");
        }
        other => panic!("answered {other:?}"),
    }
    // A file that is not /dev/userfaultfd.
    let (mine, _theirs) = UnixStream::pair().unwrap();
    let not_dev = tempfile::tempfile().unwrap();
    match vmm.api.restore_lazy(&s2, &[], &not_dev, &mine, T) {
        Err(ClientError::Vmm { kind, message }) => {
            assert_eq!(kind, ErrorKind::InvalidRequest);
            assert!(message.contains("userfaultfd"), "{message}");
        }
        other => panic!("answered {other:?}"),
    }
    // A page server that is not a socket.
    match vmm.api.restore_lazy(&s2, &[], &dev, &not_dev_socket(), T) {
        Err(ClientError::Vmm { kind, message }) => {
            assert_eq!(kind, ErrorKind::InvalidRequest);
            assert!(message.contains("socket"), "{message}");
        }
        other => panic!("answered {other:?}"),
    }
    // A snapshot that does not exist.
    match vmm
        .api
        .restore_lazy(&snap(d.path(), "nope"), &[], &dev, &mine, T)
    {
        Err(ClientError::Vmm { kind, .. }) => assert_eq!(kind, ErrorKind::NotFound),
        other => panic!("answered {other:?}"),
    }
    // Still restorable, normally.
    assert_eq!(vmm.api.restore(&s1, T).unwrap(), "s1");
    assert_eq!(vmm.api.stats(T).unwrap().state, RunState::Running);
}

#[test]
fn a_jailed_vmm_restores_lazily() {
    let dev = require_userfaultfd();
    let d = tmp();
    let (_s1, s2) = make_chain(d.path());
    let image = Image::open(&s2).expect("open s2");
    let pages = image.state.meta.mem_size / PAGE as u64;
    // The jail's user (4242) reads the store; the tempdir is 0700 root.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let store = d.path().join("store");
    chown_tree(&store);
    let jail = d.path().join("jail");
    std::fs::create_dir(&jail).unwrap();
    std::os::unix::fs::chown(&jail, Some(4242), Some(4343)).unwrap();
    let bind = format!("{}:/store:ro", store.display());
    let args = [
        "--api-sock",
        "/api.sock",
        "--jail",
        jail.to_str().unwrap(),
        "--uid",
        "4242",
        "--gid",
        "4343",
        "--serial",
        "/serial",
        "--jail-bind",
        &bind,
    ];
    let log = d.path().join("jailed.log");
    let mut vmm = Vmm::spawn(&jail.join("api.sock"), &args, &log);
    let (mine, theirs) = UnixStream::pair().unwrap();
    let handler = Handler::start(theirs, image);
    let id = vmm
        .api
        .restore_lazy(Path::new("/store/snapshots/s2"), &[], &dev, &mine, T)
        .unwrap_or_else(|e| {
            panic!(
                "jailed lazy restore: {e}; log: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
    drop(mine);
    assert_eq!(id, "s2");
    handler.wait_faults(1);
    handler.ctl.send(Ctl::Finish).unwrap();
    assert_eq!(handler.thread.join().unwrap().expect("page server"), pages);
    assert_eq!(vmm.api.stats(T).unwrap().state, RunState::Running);
    vmm.api.shutdown(T).unwrap();
}

fn chown_tree(path: &Path) {
    std::os::unix::fs::chown(path, Some(4242), Some(4343)).unwrap();
    if path.is_dir() {
        for e in std::fs::read_dir(path).unwrap() {
            chown_tree(&e.unwrap().path());
        }
    }
}

/// A datagram socket: not a page server's stream.
fn not_dev_socket() -> UnixStream {
    use std::os::fd::OwnedFd;
    let (a, _b) = std::os::unix::net::UnixDatagram::pair().unwrap();
    // A UnixStream around a datagram socket, only to send it.
    UnixStream::from(OwnedFd::from(a))
}
