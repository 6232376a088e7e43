//! The `twig-vmm` binary: its API on a Unix socket, driven by
//! `twig_vmm::api::Client` the way the shim will, with the process started
//! and stopped by PID. Hand-written JSON appears only where a test sends
//! malformed lines on purpose.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use twig_store::NodeStore;
use twig_vmm::api::{
    ApiError, Client, ClientError, Hello, Reply, Request, Response, PROTOCOL_VERSION,
};
use twig_vmm::{ErrorKind, Kind, RunState, SnapshotInfo};

const BIN: &str = env!("CARGO_BIN_EXE_twig-vmm");

struct Vmm {
    child: Child,
    sock: PathBuf,
    api: Client,
}

impl Vmm {
    fn start(dir: &Path, name: &str, extra: &[&str]) -> Vmm {
        let sock = dir.join(format!("{name}.sock"));
        let child = Command::new(BIN)
            .args(["serve", "--api-sock"])
            .arg(&sock)
            .arg("--serial")
            .arg(dir.join(format!("{name}.serial")))
            .args(extra)
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn twig-vmm");
        let api = Client::connect(&sock, T).expect("connect to twig-vmm");
        Vmm { child, sock, api }
    }

    /// Another client of the same VMM.
    fn client(&self) -> Client {
        Client::connect(&self.sock, T).expect("connect to twig-vmm")
    }

    /// A raw connection, for malformed requests.
    fn raw(&self) -> BufReader<UnixStream> {
        let s = UnixStream::connect(&self.sock).expect("connect");
        s.set_read_timeout(Some(T)).unwrap();
        BufReader::new(s)
    }

    fn shutdown(mut self) {
        self.api.shutdown(T).expect("shutdown");
        let deadline = Instant::now() + T;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "twig-vmm exited with {status}");
                assert!(!self.sock.exists(), "the socket is removed");
                return;
            }
            assert!(Instant::now() < deadline, "twig-vmm did not exit");
            std::thread::yield_now();
        }
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The VMM's error kind and message, or a panic naming what came instead.
fn vmm_err<T: std::fmt::Debug>(r: Result<T, ClientError>) -> (ErrorKind, String) {
    match r {
        Err(ClientError::Vmm { kind, message }) => (kind, message),
        other => panic!("expected an error from the VMM, got {other:?}"),
    }
}

/// Sends one raw line and parses the answer.
fn raw_call(conn: &mut BufReader<UnixStream>, line: &str) -> Response {
    writeln!(conn.get_mut(), "{line}").unwrap();
    let mut answer = String::new();
    conn.read_line(&mut answer).unwrap();
    serde_json::from_str(&answer).unwrap_or_else(|e| panic!("bad response {answer:?}: {e}"))
}

fn raw_err(conn: &mut BufReader<UnixStream>, line: &str) -> ApiError {
    match raw_call(conn, line) {
        Response::Error(e) => e,
        Response::Ok(r) => panic!("{line} answered {r:?}"),
    }
}

/// A node store in the test's directory (copies allowed: /tmp cannot
/// reflink).
fn node_store(d: &Path) -> NodeStore {
    NodeStore::open(&d.join("store"), true).expect("open the node store")
}

/// The shim's way to snapshot: the store stages `id`, the VMM writes into
/// the staging directory, the store publishes once the VMM answered.
/// Returns the reply and the published directory.
fn snapshot(
    api: &mut Client,
    store: &NodeStore,
    id: &str,
    kind: Kind,
) -> Result<(SnapshotInfo, PathBuf), ClientError> {
    let staging = store.stage(id).expect("stage");
    let info = api.snapshot(staging.dir(), kind, T)?;
    let published = staging.publish().expect("publish");
    Ok((info, published.dir().to_path_buf()))
}

fn wait_file(path: &Path, pat: &str) {
    let deadline = Instant::now() + T;
    loop {
        let s = std::fs::read_to_string(path).unwrap_or_default();
        if s.contains(pat) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} never showed {pat:?}: {s:?}",
            path.display()
        );
        std::thread::yield_now();
    }
}

fn boot(vmm: &mut Vmm, kernel: &Path, vcpus: usize) {
    let state = vmm
        .api
        .boot(kernel, None, "console=ttyS0", MIB, vcpus, T)
        .expect("boot");
    assert_eq!(state, RunState::Running);
}

#[test]
fn boot_snapshot_rollback_restore_over_the_api() {
    require_kvm();
    let d = tmp();
    let kernel: PathBuf = twig_vmm::testguest::write_to(d.path()).unwrap();
    let mut a = Vmm::start(d.path(), "a", &[]);
    let hello = a.api.hello(T).unwrap();
    assert_eq!(hello.protocol, PROTOCOL_VERSION);
    let (kind, e) = vmm_err(a.api.stats(T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("no VM yet"), "{e}");
    boot(&mut a, &kernel, 2);
    wait_file(&d.path().join("a.serial"), "B");
    let (kind, e) = vmm_err(a.api.boot(&kernel, None, "", MIB, 1, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("already has a VM"), "{e}");
    let store = node_store(d.path());
    let (full, s1) = snapshot(&mut a.api, &store, "s1", Kind::Full).unwrap();
    assert_eq!(full.kind, Kind::Full);
    assert_eq!(full.id, "s1");
    let (incr, _) = snapshot(&mut a.api, &store, "s2", Kind::Incremental).unwrap();
    assert_eq!(incr.parent.as_deref(), Some(full.id.as_str()));
    let s2 = store.get("s2").unwrap();
    assert_eq!(s2.parent.as_deref(), Some("s1"));
    assert_eq!(s2.kind, twig_store::Kind::Incremental);
    let r = a.api.rollback(&s1, T).unwrap();
    assert_eq!(r.id, full.id);
    assert!(!r.remapped);
    assert_eq!(a.api.pause(T).unwrap(), RunState::Paused);
    let st = a.api.stats(T).unwrap();
    assert_eq!(st.state, RunState::Paused);
    assert_eq!(st.vcpus, 2);
    assert_eq!(a.api.resume(T).unwrap(), RunState::Running);

    // A second process, with a VM prepared ahead of time, restores s1.
    let mut b = Vmm::start(
        d.path(),
        "b",
        &[
            "--prepare-mem-mib",
            &MIB.to_string(),
            "--prepare-vcpus",
            "2",
        ],
    );
    assert_eq!(b.api.restore(&s1, T).unwrap(), full.id);
    let st = b.api.stats(T).unwrap();
    assert_eq!(st.state, RunState::Running);
    assert_eq!(st.baseline.as_deref(), Some(full.id.as_str()));
    b.shutdown();
    a.shutdown();

    let out = Command::new(BIN).arg("verify").arg(&s1).output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"kind\": \"full\""));
}

#[test]
fn disks_and_devices_from_the_command_line_follow_snapshots() {
    require_kvm();
    let d = tmp();
    let kernel: PathBuf = twig_vmm::testguest::write_to(d.path()).unwrap();
    let rw = d.path().join("rw.img");
    std::fs::write(&rw, vec![0x5a; 1 << 20]).unwrap();
    let ro = d.path().join("ro.img");
    std::fs::write(&ro, vec![0x11; 64 * 1024]).unwrap();
    let ro_arg = format!("{}:ro", ro.display());
    let mut a = Vmm::start(
        d.path(),
        "a",
        &["--disk", rw.to_str().unwrap(), "--disk", &ro_arg],
    );
    boot(&mut a, &kernel, 1);
    wait_file(&d.path().join("a.serial"), "B");
    let store = node_store(d.path());
    let (_, s1) = snapshot(&mut a.api, &store, "s1", Kind::Full).unwrap();
    assert!(std::fs::read(s1.join("disk0")).unwrap() == std::fs::read(&rw).unwrap());
    assert!(!s1.join("disk1").exists());
    a.shutdown();

    // Restored in another process with its own disk file.
    let rw2 = d.path().join("rw2.img");
    std::fs::write(&rw2, vec![0u8; 512]).unwrap();
    let mut b = Vmm::start(
        d.path(),
        "b",
        &["--disk", rw2.to_str().unwrap(), "--disk", &ro_arg],
    );
    b.api.restore(&s1, T).unwrap();
    assert!(std::fs::read(&rw2).unwrap() == std::fs::read(&rw).unwrap());
    b.shutdown();

    // Without the disks, the snapshot does not fit.
    let mut c = Vmm::start(d.path(), "c", &[]);
    let (kind, e) = vmm_err(c.api.restore(&s1, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("virtio devices differ"), "{e}");
    c.shutdown();
    // A missing image is named when the VM is made.
    let mut m = Vmm::start(d.path(), "m", &["--disk", "/nonexistent/disk.img"]);
    let (_, e) = vmm_err(m.api.boot(&kernel, None, "", MIB, 1, T));
    assert!(e.contains("/nonexistent/disk.img"), "{e}");
    m.shutdown();

    for bad in [
        vec!["--tap", "t0", "--mac", "aa:bb"],
        vec!["--tap", "t0", "--mac", "01:00:00:00:00:01"],
        vec!["--mac", "02:00:00:00:00:01"],
        vec!["--vsock-cid", "5"],
        vec!["--max-connections", "0"],
    ] {
        let out = Command::new(BIN)
            .args(["serve", "--api-sock", "/nonexistent/x.sock"])
            .args(&bad)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad:?}");
        assert!(!out.stderr.is_empty(), "{bad:?}");
    }
}

#[test]
fn disk_slots_are_filled_and_emptied_over_the_api() {
    require_kvm();
    let d = tmp();
    let kernel: PathBuf = twig_vmm::testguest::write_to(d.path()).unwrap();
    let rootfs = d.path().join("rootfs.img");
    std::fs::write(&rootfs, vec![0x77; 256 * 1024]).unwrap();
    let mut a = Vmm::start(d.path(), "a", &["--disk-slots", "2"]);
    boot(&mut a, &kernel, 1);
    a.api.attach_disk(0, &rootfs, false, T).expect("attach");
    let (kind, e) = vmm_err(a.api.attach_disk(0, &rootfs, false, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("disk slot 0"), "{e}");
    let (kind, e) = vmm_err(a.api.attach_disk(5, &rootfs, false, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("disk slot 5"), "{e}");
    let odd = d.path().join("odd.img");
    std::fs::write(&odd, [0u8; 100]).unwrap();
    let (kind, _) = vmm_err(a.api.attach_disk(1, &odd, false, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    let store = node_store(d.path());
    let (_, s1) = snapshot(&mut a.api, &store, "s1", Kind::Full).unwrap();
    assert!(std::fs::read(s1.join("disk0")).unwrap() == std::fs::read(&rootfs).unwrap());
    a.api.detach_disk(0, T).expect("detach");
    let (kind, _) = vmm_err(a.api.detach_disk(0, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    a.shutdown();

    // A clone names the file its attached slot goes to.
    let mine = d.path().join("clone-rootfs.img");
    let slot_file = format!("0={}", mine.display());
    let mut b = Vmm::start(
        d.path(),
        "b",
        &["--disk-slots", "2", "--slot-file", &slot_file],
    );
    b.api.restore(&s1, T).expect("restore with the slot's file");
    assert!(std::fs::read(&mine).unwrap() == std::fs::read(&rootfs).unwrap());
    b.shutdown();
    // Without one, or with other slots, the restore is refused.
    let mut c = Vmm::start(d.path(), "c", &["--disk-slots", "2"]);
    let (kind, e) = vmm_err(c.api.restore(&s1, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("slot 0"), "{e}");
    c.shutdown();
    let mut f = Vmm::start(
        d.path(),
        "f",
        &["--disk-slots", "1", "--slot-file", &slot_file],
    );
    let (kind, _) = vmm_err(f.api.restore(&s1, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    f.shutdown();
}

#[test]
fn a_tap_sent_as_a_descriptor_backs_the_net_device() {
    require_kvm();
    let d = tmp();
    let kernel: PathBuf = twig_vmm::testguest::write_to(d.path()).unwrap();
    let tap = format!("twa{}", std::process::id() % 100_000);
    let net = |api: &mut Client| api.stats(T).expect("stats").net.expect("a net device");
    let mut a = Vmm::start(d.path(), "a", &["--net"]);
    boot(&mut a, &kernel, 1);
    assert_eq!(net(&mut a.api).tap, None, "detached until attach_net");
    // A request without a descriptor, and one that is no tap.
    let e = raw_err(&mut a.raw(), r#"{"op":"attach_net"}"#);
    assert_eq!(e.kind, ErrorKind::InvalidRequest);
    assert!(e.message.contains("descriptor"), "{}", e.message);
    let null = std::fs::File::open("/dev/null").unwrap();
    let (kind, e) = vmm_err(a.api.attach_net(null.as_fd(), T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("not a tap"), "{e}");
    assert_eq!(net(&mut a.api).tap, None);

    let file = open_tap(&tap);
    assert_eq!(a.api.attach_net(file.as_fd(), T).expect("attach_net"), tap);
    // The VMM holds the tap now: the interface outlives our descriptor.
    drop(file);
    assert!(link_exists(&tap));
    assert_eq!(net(&mut a.api).tap.as_deref(), Some(tap.as_str()));
    let other = open_tap(&format!("{tap}b"));
    let (kind, e) = vmm_err(a.api.attach_net(other.as_fd(), T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("already"), "{e}");
    drop(other);

    // Snapshots hold the device, not the tap; rollback keeps the tap.
    let store = node_store(d.path());
    let (_, s1) = snapshot(&mut a.api, &store, "s1", Kind::Full).unwrap();
    a.api.rollback(&s1, T).expect("rollback");
    assert_eq!(net(&mut a.api).tap.as_deref(), Some(tap.as_str()));
    a.shutdown();
    let deadline = Instant::now() + T;
    while link_exists(&tap) {
        assert!(Instant::now() < deadline, "the tap outlived its VMM");
        std::thread::yield_now();
    }

    // A restored VM's device is detached until its own tap comes.
    let mut b = Vmm::start(d.path(), "b", &["--net"]);
    b.api.restore(&s1, T).expect("restore");
    assert_eq!(net(&mut b.api).tap, None);
    let file = open_tap(&tap);
    assert_eq!(b.api.attach_net(file.as_fd(), T).expect("attach_net"), tap);
    b.shutdown();

    // A VMM without a net device refuses, and cannot restore the snapshot.
    let mut c = Vmm::start(d.path(), "c", &[]);
    boot(&mut c, &kernel, 1);
    assert!(c.api.stats(T).expect("stats").net.is_none());
    let (kind, e) = vmm_err(c.api.attach_net(file.as_fd(), T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("no network device"), "{e}");
    c.shutdown();
    let mut f = Vmm::start(d.path(), "f", &[]);
    let (kind, e) = vmm_err(f.api.restore(&s1, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("net"), "{e}");
    f.shutdown();
}

#[test]
fn a_vmm_with_the_balloon_snapshots_and_restores_only_into_its_kind() {
    require_kvm();
    let d = tmp();
    let kernel: PathBuf = twig_vmm::testguest::write_to(d.path()).unwrap();
    let mut a = Vmm::start(d.path(), "a", &["--balloon"]);
    boot(&mut a, &kernel, 1);
    let store = node_store(d.path());
    let (_, s1) = snapshot(&mut a.api, &store, "s1", Kind::Full).unwrap();
    a.api.rollback(&s1, T).expect("rollback");
    a.shutdown();

    let mut b = Vmm::start(d.path(), "b", &["--balloon"]);
    b.api
        .restore(&s1, T)
        .expect("restore into a VMM with the balloon");
    b.shutdown();
    let mut c = Vmm::start(d.path(), "c", &[]);
    let (kind, e) = vmm_err(c.api.restore(&s1, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("balloon"), "{e}");
    c.shutdown();
}

#[test]
fn bad_requests_get_invalid_request_errors() {
    require_kvm();
    let d = tmp();
    let a = Vmm::start(d.path(), "a", &[]);
    let mut raw = a.raw();
    for (line, says) in [
        ("not json", "bad request"),
        (r#"{"op":"fly"}"#, "unknown variant"),
        (r#"{"op":"restore"}"#, "missing field `dir`"),
        (r#"{"op":"pause","extra":1}"#, "unknown field"),
        (
            r#"{"op":"boot","kernel":"/etc/hostname","mem_mib":64}"#,
            "neither an ELF vmlinux",
        ),
        (
            r#"{"op":"boot","kernel":"/etc/hostname","mem_mib":5}"#,
            "multiple of 2 MiB",
        ),
        (
            r#"{"op":"attach_disk","slot":0,"path":"/d.img"}"#,
            "no VM yet",
        ),
    ] {
        let e = raw_err(&mut raw, line);
        assert_eq!(e.kind, ErrorKind::InvalidRequest, "{line}: {e:?}");
        assert!(e.message.contains(says), "{line}: {e:?}");
    }
    // Not UTF-8.
    raw.get_mut().write_all(b"\xff\xfe\n").unwrap();
    let mut line = String::new();
    raw.read_line(&mut line).unwrap();
    let e: Response = serde_json::from_str(&line).unwrap();
    assert!(
        matches!(&e, Response::Error(e) if e.kind == ErrorKind::InvalidRequest),
        "{line}"
    );
    // An oversized request gets an error and the connection is closed.
    let long = format!("{{\"op\":\"stats\",\"x\":\"{}\"}}\n", "a".repeat(70_000));
    let _ = raw.get_mut().write_all(long.as_bytes());
    let e = {
        let mut line = String::new();
        raw.read_line(&mut line).unwrap();
        serde_json::from_str::<Response>(&line).unwrap()
    };
    assert!(
        matches!(&e, Response::Error(e) if e.kind == ErrorKind::InvalidRequest && e.message.contains("longer than")),
        "{e:?}"
    );
    let mut rest = String::new();
    assert_eq!(raw.read_line(&mut rest).unwrap(), 0, "closed after: {rest}");
    a.shutdown();

    let out = Command::new(BIN)
        .arg("verify")
        .arg(d.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot open the state file"));
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("serve") && help.contains("guest_stopped"),
        "{help}"
    );
}

/// A test guest whose first instruction is `ud2` (with no IDT: a triple
/// fault): it stops as soon as it runs.
fn crashing_kernel(dir: &Path) -> PathBuf {
    let mut image = twig_vmm::testguest::BZIMAGE.to_vec();
    // The 64-bit entry: 0x200 into the payload, after 4 setup sectors and
    // the boot sector.
    image[5 * 512 + 0x200..5 * 512 + 0x202].copy_from_slice(&[0x0f, 0x0b]);
    twig_vmm::testguest::write_image(dir, "crash.bzImage", &image).unwrap()
}

#[test]
fn each_error_kind_says_what_the_caller_can_do() {
    require_kvm();
    let d = tmp();
    let kernel = twig_vmm::testguest::write_to(d.path()).unwrap();
    let mut a = Vmm::start(d.path(), "a", &[]);
    let missing = d.path().join("missing");

    // not_found: the snapshot does not exist; nothing changed.
    let (kind, e) = vmm_err(a.api.restore(&missing, T));
    assert_eq!(kind, ErrorKind::NotFound, "{e}");
    assert!(e.contains("does not exist"), "{e}");
    boot(&mut a, &kernel, 1);
    wait_file(&d.path().join("a.serial"), "B");
    let (kind, e) = vmm_err(a.api.rollback(&missing, T));
    assert_eq!(kind, ErrorKind::NotFound, "{e}");

    // refused: a rollback to a corrupted snapshot, and a snapshot that
    // cannot be written, leave the VM running on its previous state.
    let store = node_store(d.path());
    let (full, s1) = snapshot(&mut a.api, &store, "s1", Kind::Full).unwrap();
    let bad = d.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::write(bad.join("state"), b"not a snapshot").unwrap();
    std::fs::copy(s1.join("memory"), bad.join("memory")).unwrap();
    let (kind, e) = vmm_err(a.api.rollback(&bad, T));
    assert_eq!(kind, ErrorKind::Refused, "{e}");
    assert!(e.contains("keeps running on its previous state"), "{e}");
    let staging = store.stage("s").unwrap();
    std::fs::create_dir(staging.dir().join("state")).unwrap();
    let (kind, e) = vmm_err(a.api.snapshot(staging.dir(), Kind::Full, T));
    assert_eq!(kind, ErrorKind::Refused, "{e}");
    drop(staging);
    let st = a.api.stats(T).unwrap();
    assert_eq!(st.state, RunState::Running);
    assert_eq!(st.baseline.as_deref(), Some(full.id.as_str()));
    assert_eq!(a.api.rollback(&s1, T).unwrap().id, full.id);

    // invalid_request: a disk without disk slots.
    let (kind, e) = vmm_err(a.api.attach_disk(0, &d.path().join("d.img"), false, T));
    assert_eq!(kind, ErrorKind::InvalidRequest, "{e}");
    assert!(e.contains("0 disk slots"), "{e}");
    a.shutdown();

    // guest_stopped: the guest crashed; resuming it makes no sense, but its
    // stats still answer.
    let mut c = Vmm::start(d.path(), "c", &[]);
    let crash = crashing_kernel(d.path());
    c.api.boot(&crash, None, "", MIB, 1, T).unwrap();
    let deadline = Instant::now() + T;
    while c.api.stats(T).unwrap().state != RunState::Stopped {
        assert!(Instant::now() < deadline, "the guest never stopped");
        std::thread::yield_now();
    }
    let (kind, e) = vmm_err(c.api.resume(T));
    assert_eq!(kind, ErrorKind::GuestStopped, "{e}");
    let staging = store.stage("s3").unwrap();
    let (kind, e) = vmm_err(c.api.snapshot(staging.dir(), Kind::Full, T));
    assert_eq!(kind, ErrorKind::GuestStopped, "{e}");
    c.shutdown();

    // busy: covered with the connection limit below; internal: a VMM
    // without a usable /dev/kvm (missing_or_forbidden_kvm_is_reported).
}

#[test]
fn idle_slow_and_vanishing_clients_block_no_one() {
    require_kvm();
    let d = tmp();
    let kernel = twig_vmm::testguest::write_to(d.path()).unwrap();
    let mut a = Vmm::start(
        d.path(),
        "a",
        &["--max-connections", "5", "--idle-timeout-s", "2"],
    );
    boot(&mut a, &kernel, 1);
    // One client connects and says nothing, another sends half a line.
    let idle = a.raw();
    let mut half = a.raw();
    half.get_mut().write_all(br#"{"op":"st"#).unwrap();
    // A third one's stats answer promptly (connect, hello, stats).
    let t = Instant::now();
    let mut b = a.client();
    assert_eq!(b.stats(T).unwrap().state, RunState::Running);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());

    // A client that disconnects mid-request: the operation completes, the
    // server lives on.
    let store = node_store(d.path());
    let staging = store.stage("s1").unwrap();
    {
        let mut gone = a.raw();
        let req = Request::Snapshot {
            dir: staging.dir().to_path_buf(),
            kind: Kind::Full,
        };
        writeln!(gone.get_mut(), "{}", serde_json::to_string(&req).unwrap()).unwrap();
    }
    drop(half);
    // Nobody hears the answer: the writer's manifest, complete, says every
    // artefact is written.
    let draft = staging.dir().join(twig_store::layout::MANIFEST);
    let deadline = Instant::now() + T;
    while std::fs::read(&draft)
        .ok()
        .and_then(|b| serde_json::from_slice::<twig_store::Manifest>(&b).ok())
        .is_none()
    {
        assert!(Instant::now() < deadline, "the snapshot never completed");
        std::thread::yield_now();
    }
    let s1 = staging.publish().unwrap();
    twig_vmm::snapshot::verify(s1.dir()).unwrap();
    assert_eq!(b.stats(T).unwrap().state, RunState::Running);

    // Over the limit: a's client, idle and b hold 3 of 5 slots (once the
    // connections just closed are gone); a 4th and 5th are served, a 6th
    // is told the server is busy.
    let deadline = Instant::now() + T;
    let mut more = Vec::new();
    while more.len() < 2 {
        match Client::connect(&a.sock, T) {
            Ok(c) => more.push(c),
            Err(e) if e.kind() == Some(ErrorKind::Busy) && Instant::now() < deadline => {
                std::thread::yield_now()
            }
            Err(e) => panic!("connection {}: {e}", more.len() + 4),
        }
    }
    let (kind, e) = match Client::connect(&a.sock, T) {
        Err(ClientError::Vmm { kind, message }) => (kind, message),
        other => panic!("a 6th connection: {:?}", other.map(|_| ())),
    };
    assert_eq!(kind, ErrorKind::Busy, "{e}");
    assert!(e.contains("5 API connections"), "{e}");
    drop(more);

    // Idle connections are closed after --idle-timeout-s; a client whose
    // connection was closed connects again by itself on its next call.
    // (The slots of the connections just dropped free up when their server
    // threads notice.)
    let deadline = Instant::now() + T;
    let mut c = loop {
        match Client::connect(&a.sock, T) {
            Ok(c) => break c,
            Err(e) if e.kind() == Some(ErrorKind::Busy) && Instant::now() < deadline => {
                std::thread::yield_now()
            }
            Err(e) => panic!("a client after the others left: {e}"),
        }
    };
    // A raw connection the server accepted (one opened while the slots of
    // the connections just dropped are still taken is answered "busy"),
    // idle from its first answer on.
    let deadline = Instant::now() + T;
    let mut later = loop {
        let mut r = a.raw();
        let mut answer = String::new();
        // A busy server may close before the request is written.
        let accepted = writeln!(r.get_mut(), r#"{{"op":"stats"}}"#).is_ok()
            && r.read_line(&mut answer).is_ok_and(|n| n > 0)
            && !answer.contains(r#""busy""#);
        if accepted {
            break r;
        }
        assert!(Instant::now() < deadline, "never accepted: {answer}");
        std::thread::yield_now();
    };
    let t = Instant::now();
    let mut line = String::new();
    let mut idle = idle;
    assert_eq!(idle.read_line(&mut line).unwrap(), 0, "{line}");
    assert_eq!(later.read_line(&mut line).unwrap(), 0, "{line}");
    assert!(t.elapsed() >= Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(c.stats(T).unwrap().state, RunState::Running);
    assert_eq!(b.stats(T).unwrap().state, RunState::Running);
    a.shutdown();
}

/// A fake VMM: accepts one connection, answers `hello` with `protocol`
/// unless it is None, then reads requests and never answers.
fn fake_vmm(sock: &Path, protocol: Option<u32>) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        let Ok((conn, _)) = listener.accept() else {
            return;
        };
        let mut r = BufReader::new(conn);
        let mut line = String::new();
        if let Some(protocol) = protocol {
            let _ = r.read_line(&mut line);
            let hello = Response::Ok(Reply::Hello(Hello {
                protocol,
                version: "fake".into(),
            }));
            let _ = writeln!(r.get_mut(), "{}", hello.to_line());
        }
        // Hold the connection open, answering nothing, until the client
        // gives up and closes it.
        while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {}
    })
}

#[test]
fn client_deadlines_and_version_checks() {
    let d = tmp();
    let short = Duration::from_millis(300);

    // Never answers hello: connect times out within its deadline.
    let sock = d.path().join("mute.sock");
    let fake = fake_vmm(&sock, None);
    let t = Instant::now();
    match Client::connect(&sock, short) {
        Err(ClientError::Timeout { op, after, .. }) => {
            assert_eq!(op, "hello");
            assert_eq!(after, short);
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert!(t.elapsed() < short * 3, "{:?}", t.elapsed());
    fake.join().unwrap();

    // Answers hello, then nothing: each call has its own deadline.
    let sock = d.path().join("slow.sock");
    let fake = fake_vmm(&sock, Some(PROTOCOL_VERSION));
    let mut c = Client::connect(&sock, T).unwrap();
    let t = Instant::now();
    match c.stats(short) {
        Err(ClientError::Timeout { op, .. }) => assert_eq!(op, "stats"),
        other => panic!("{other:?}"),
    }
    assert!(
        t.elapsed() >= short && t.elapsed() < short * 3,
        "{:?}",
        t.elapsed()
    );
    drop(c);
    fake.join().unwrap();

    // Speaks another protocol: refused at connect.
    let sock = d.path().join("old.sock");
    let fake = fake_vmm(&sock, Some(PROTOCOL_VERSION + 1));
    match Client::connect(&sock, T) {
        Err(ClientError::Version { vmm, client, .. }) => {
            assert_eq!((vmm, client), (PROTOCOL_VERSION + 1, PROTOCOL_VERSION));
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    fake.join().unwrap();

    // Nobody there: an I/O error once the connect deadline passes.
    let t = Instant::now();
    let r = Client::connect(&d.path().join("nobody.sock"), short);
    assert!(
        matches!(r, Err(ClientError::Io { .. })),
        "{:?}",
        r.map(|_| ())
    );
    assert!(t.elapsed() >= short && t.elapsed() < short * 3);
}

/// The race an idle timeout makes: the VMM closes a connection the client
/// has just sent a request on, without reading it (the client's read is
/// reset). The client sends it again on a new connection, once — the VMM
/// never saw it, so it cannot run twice.
#[test]
fn a_request_the_vmm_closed_unread_is_sent_again_once() {
    let d = tmp();
    let sock = d.path().join("closing.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let hello = Response::Ok(Reply::Hello(Hello {
        protocol: PROTOCOL_VERSION,
        version: "fake".into(),
    }))
    .to_line();
    let fake = std::thread::spawn(move || {
        let mut answered = 0;
        // What each connection does with the request after hello.
        for answer in [false, true, false, false] {
            let (c, _) = listener.accept().unwrap();
            let mut r = BufReader::new(c);
            let mut line = String::new();
            // The connect's hello.
            r.read_line(&mut line).unwrap();
            writeln!(r.get_mut(), "{hello}").unwrap();
            // Wait for the next request without reading it, then close or
            // answer it.
            let mut byte = [0u8; 1];
            let fd = std::os::fd::AsRawFd::as_raw_fd(r.get_ref());
            // SAFETY: recv writes at most one byte into `byte`.
            let n = unsafe { libc::recv(fd, byte.as_mut_ptr().cast(), 1, libc::MSG_PEEK) };
            assert_eq!(n, 1);
            if !answer {
                continue;
            }
            line.clear();
            r.read_line(&mut line).unwrap();
            writeln!(r.get_mut(), "{hello}").unwrap();
            answered += 1;
        }
        answered
    });
    let mut c = Client::connect(&sock, T).unwrap();
    // Reset once: sent again, answered.
    assert_eq!(c.hello(T).unwrap().version, "fake");
    // Reset on the new connection too: reported, not sent a third time.
    let mut c = Client::connect(&sock, T).unwrap();
    match c.hello(T) {
        Err(ClientError::Io { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::ConnectionReset)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fake.join().unwrap(), 1);
}

#[test]
fn missing_or_forbidden_kvm_is_reported() {
    require_kvm();
    let d = tmp();
    let kernel = twig_vmm::testguest::write_to(d.path()).unwrap();
    let run = |name: &str, argv: &dyn Fn(&str) -> Vec<String>| -> (ErrorKind, String) {
        let sock = d.path().join(format!("{name}.sock"));
        let serve = format!(
            "{BIN} serve --api-sock {} --serial /dev/null",
            sock.display()
        );
        let args = argv(&serve);
        let mut child = Command::new(&args[0]).args(&args[1..]).spawn().unwrap();
        let mut api = Client::connect(&sock, T).unwrap();
        let r = vmm_err(api.boot(&kernel, None, "", MIB, 1, T));
        let _ = child.kill();
        let _ = child.wait();
        r
    };
    // /dev/kvm replaced by /dev/null in a private mount namespace.
    let (kind, e) = run("nokvm", &|serve| {
        let script = format!("mount --bind /dev/null /dev/kvm && exec {serve}");
        ["unshare", "-m", "sh", "-c", &script]
            .map(String::from)
            .to_vec()
    });
    assert_eq!(kind, ErrorKind::Internal);
    assert!(e.contains("not a usable KVM device"), "{e}");
    // An unprivileged user.
    std::fs::set_permissions(
        d.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let (kind, e) = run("nobody", &|serve| {
        let mut v: Vec<String> = [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ]
        .map(String::from)
        .to_vec();
        v.extend(serve.split(' ').map(String::from));
        v
    });
    assert_eq!(kind, ErrorKind::Internal);
    assert!(
        e.contains("cannot open /dev/kvm") && e.contains("ermission"),
        "{e}"
    );
}

#[test]
fn a_vmm_killed_mid_snapshot_leaves_no_valid_looking_snapshot() {
    require_kvm();
    let d = tmp();
    let kernel = twig_vmm::testguest::write_to(d.path()).unwrap();
    let root = d.path().join("store");
    let store = node_store(d.path());
    let mut a = Vmm::start(d.path(), "a", &[]);
    a.api.boot(&kernel, None, "", 2048, 1, T).unwrap();
    let staging = store.stage("big").unwrap();
    let mut conn = a.raw();
    let req = Request::Snapshot {
        dir: staging.dir().to_path_buf(),
        kind: Kind::Full,
    };
    writeln!(conn.get_mut(), "{}", serde_json::to_string(&req).unwrap()).unwrap();
    // Kill the VMM as soon as the snapshot is being written.
    let deadline = Instant::now() + T;
    while !staging.dir().join("memory").exists() {
        assert!(Instant::now() < deadline, "the snapshot never started");
        std::thread::yield_now();
    }
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    // The client sees the VMM gone, not a hang.
    let r = a.api.stats(T);
    assert!(
        matches!(
            r,
            Err(ClientError::Io { .. }) | Err(ClientError::Protocol { .. })
        ),
        "{r:?}"
    );
    // The VMM publishes nothing itself: the store does, once the writer
    // answers, and this one never did. The staging goes with its holder.
    assert!(store.list().unwrap().is_empty(), "nothing published");
    drop(staging);
    assert!(matches!(
        store.get("big"),
        Err(twig_store::Error::NotFound(_))
    ));
    assert_eq!(std::fs::read_dir(root.join("tmp")).unwrap().count(), 0);
    let e = twig_vmm::snapshot::verify(&store.snapshot_dir("big"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot open the state file"), "{e}");
    // The store still takes a snapshot under that id.
    let mut b = Vmm::start(d.path(), "b", &[]);
    boot(&mut b, &kernel, 1);
    let (_, big) = snapshot(&mut b.api, &store, "big", Kind::Full).unwrap();
    twig_vmm::snapshot::verify(&big).unwrap();
    b.shutdown();
}

#[test]
fn template_refuses_without_vsock_and_fails_when_the_guest_never_listens() {
    require_kvm();
    let d = tempfile::tempdir().unwrap();
    let kernel = twig_vmm::testguest::write_to(d.path()).unwrap();
    let out = |args: &[&str]| {
        Command::new(BIN)
            .arg("template")
            .args(args)
            .env("TWIG_LOG", "error")
            .output()
            .unwrap()
    };
    let tpl = d.path().join("store/snapshots/tpl");
    let kernel = kernel.to_str().unwrap();
    let tpl_s = tpl.to_str().unwrap();

    // A template lands in a node store: <store>/snapshots/<id>.
    let o = out(&[d.path().join("tpl").to_str().unwrap(), "--kernel", kernel]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not a snapshot directory of a store"), "{err}");

    let o = out(&[tpl_s, "--kernel", kernel, "--mem-mib", "64"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("needs --vsock-uds"), "{err}");

    // The test guest never accepts vsock connections: not ready in time.
    let uds = d.path().join("tpl.vsock");
    let t = Instant::now();
    let o = out(&[
        tpl_s,
        "--kernel",
        kernel,
        "--mem-mib",
        "64",
        "--serial",
        "/dev/null",
        "--vsock-uds",
        uds.to_str().unwrap(),
        "--timeout-s",
        "1",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not ready within"), "{err}");
    assert!(t.elapsed() < std::time::Duration::from_secs(30));
    assert!(!tpl.exists(), "nothing is written");
    assert_eq!(
        std::fs::read_dir(d.path().join("store/tmp"))
            .unwrap()
            .count(),
        0,
        "nor staged"
    );
}

#[test]
fn a_restore_takes_its_slot_images_as_descriptors() {
    require_kvm();
    let d = tmp();
    let kernel: PathBuf = twig_vmm::testguest::write_to(d.path()).unwrap();
    let rootfs = d.path().join("rootfs.img");
    std::fs::write(&rootfs, vec![0x77; 256 * 1024]).unwrap();
    let mut a = Vmm::start(d.path(), "a", &["--disk-slots", "2"]);
    boot(&mut a, &kernel, 1);
    a.api.attach_disk(0, &rootfs, false, T).expect("attach");
    let store = node_store(d.path());
    let (_, s1) = snapshot(&mut a.api, &store, "s1", Kind::Full).unwrap();
    a.shutdown();

    // The caller's copy of the slot's disk: distinct bytes, so the restored
    // VM's next snapshot shows which file the slot serves. Its name is one
    // the VMM cannot open: only the descriptor reaches it.
    let mine = d.path().join("mine.img");
    std::fs::write(&mine, vec![0x42; 256 * 1024]).unwrap();
    let open_rw = |p: &Path| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(p)
            .unwrap()
    };
    let name = Path::new("/nonexistent/pod/slot0.img");
    let mut b = Vmm::start(d.path(), "b", &["--disk-slots", "2"]);

    // Refusals change nothing: the same VMM restores afterwards.
    let (kind, e) = vmm_err(b.api.restore(&s1, T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(
        e.contains("disk slot 0") && e.contains("send an image"),
        "{e}"
    );
    let extra = open_rw(&mine);
    let (kind, e) = vmm_err(b.api.restore_with(
        &s1,
        &[(0, name, &open_rw(&mine)), (1, name, &extra)],
        T,
    ));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(
        e.contains("slot 1") && e.contains("empty in the snapshot"),
        "{e}"
    );
    let (kind, e) = vmm_err(b.api.restore_with(&s1, &[(5, name, &extra)], T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("slot 5") && e.contains("2 disk slots"), "{e}");
    let read_only = std::fs::File::open(&mine).unwrap();
    let (kind, e) = vmm_err(b.api.restore_with(&s1, &[(0, name, &read_only)], T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("open read-only"), "{e}");
    let short = d.path().join("short.img");
    std::fs::write(&short, vec![0x42; 128 * 1024]).unwrap();
    let (kind, e) = vmm_err(b.api.restore_with(&s1, &[(0, name, &open_rw(&short))], T));
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert!(e.contains("131072 bytes") && e.contains("262144"), "{e}");
    // A request announcing an image whose descriptor never came.
    let err = raw_err(
        &mut b.raw(),
        &format!(
            r#"{{"op":"restore","dir":"{}","slots":[{{"slot":0,"path":"/x.img"}}]}}"#,
            s1.display()
        ),
    );
    assert_eq!(err.kind, ErrorKind::InvalidRequest);
    assert!(err.message.contains("file descriptors"), "{}", err.message);
    assert_eq!(std::fs::read(&mine).unwrap(), vec![0x42; 256 * 1024]);

    let id = b
        .api
        .restore_with(&s1, &[(0, name, &open_rw(&mine))], T)
        .expect("restore with the slot's image sent");
    assert_eq!(id, "s1");
    let (_, s2) = snapshot(&mut b.api, &store, "s2", Kind::Full).unwrap();
    assert_eq!(
        std::fs::read(s2.join("disk0")).unwrap(),
        vec![0x42; 256 * 1024],
        "the slot serves the sent image as it is"
    );
    assert_eq!(
        std::fs::read(&rootfs).unwrap(),
        vec![0x77; 256 * 1024],
        "the source's image is untouched"
    );
    b.shutdown();
}
