//! The confined `twig-vmm serve`: seccomp filters per thread and the jail
//! (mount namespace rooted in a per-VM directory, an unprivileged user with
//! no capabilities, a new network and PID namespace, a cgroup), driven
//! through `api::Client` like the shim drives it. Needs root and /dev/kvm.

mod common;

use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Instant;

use common::*;
use twig_store::NodeStore;
use twig_vmm::api::{Client, ClientError, Reply, Request};
use twig_vmm::{ErrorKind, Kind, RunState};

const BIN: &str = env!("CARGO_BIN_EXE_twig-vmm");
const UID: u32 = 4242;
const GID: u32 = 4343;

struct Vmm {
    child: Child,
    api: Client,
}

impl Vmm {
    /// Starts `twig-vmm serve` with `args`; its API socket is `sock` (a
    /// host path) and it is told `inner` (the path it sees).
    fn start(sock: &Path, inner: &Path, args: &[&str]) -> Vmm {
        let child = Command::new(BIN)
            .arg("serve")
            .arg("--api-sock")
            .arg(inner)
            .args(args)
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn twig-vmm");
        let api = Client::connect(sock, T).expect("connect to twig-vmm");
        Vmm { child, api }
    }

    /// The VMM's own process: with --new-pid-ns, the child of the one
    /// started.
    fn vmm_pid(&self, pid_ns: bool) -> u32 {
        let pid = self.child.id();
        if !pid_ns {
            return pid;
        }
        let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .expect("read children");
        let kids: Vec<u32> = children
            .split_whitespace()
            .map(|c| c.parse().unwrap())
            .collect();
        assert_eq!(kids.len(), 1, "one VMM child: {children:?}");
        kids[0]
    }

    fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + T;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
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

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in {status}"))
        .trim()
        .to_string()
}

/// A directory owned by the jail's user (tempdirs are 0700 root).
fn owned_dir(path: &Path) {
    std::fs::create_dir_all(path).unwrap();
    std::os::unix::fs::chown(path, Some(UID), Some(GID)).unwrap();
}

fn world_readable(path: &Path) {
    let mut p = std::fs::metadata(path).unwrap().permissions();
    p.set_mode(p.mode() | 0o755);
    std::fs::set_permissions(path, p).unwrap();
}

fn jail_args<'a>(jail: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "--jail", jail, "--uid", "4242", "--gid", "4343", "--serial", "/serial",
    ];
    v.extend_from_slice(extra);
    v
}

/// Snapshots `id` the shim's way: the node store stages it, the VMM writes
/// into the staging directory (owned by the jail's user, seen by the VMM
/// under `inner`, the store's path inside its jail), the store publishes.
/// Returns the reply and the published directory as the VMM sees it.
fn snapshot(
    api: &mut Client,
    store: &NodeStore,
    inner: &Path,
    id: &str,
    kind: Kind,
) -> Result<(twig_vmm::SnapshotInfo, PathBuf), ClientError> {
    let staging = store.stage(id).expect("stage");
    std::os::unix::fs::chown(staging.dir(), Some(UID), Some(GID)).unwrap();
    let jailed = |p: &Path| inner.join(p.strip_prefix(store.root()).unwrap());
    let info = api.snapshot(&jailed(staging.dir()), kind, T)?;
    let published = staging.publish().expect("publish");
    Ok((info, jailed(published.dir())))
}

/// Removes the test's cgroup when dropped (after the VMMs declared after
/// it are killed), even when the test fails.
struct CgroupGuard(String);

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        remove_cgroup(&self.0);
    }
}

fn remove_cgroup(name: &str) {
    for h in twig_vmm::jail::cgroup::hierarchies().unwrap() {
        let group = h.mount.join(name);
        for dir in group.ancestors().take_while(|a| *a != h.mount) {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

#[test]
fn a_jailed_vmm_boots_snapshots_rolls_back_and_restores() {
    require_kvm();
    let d = tmp();
    world_readable(d.path());
    let (ja, jb, store) = (
        d.path().join("a"),
        d.path().join("b"),
        d.path().join("store"),
    );
    for j in [&ja, &jb, &store] {
        owned_dir(j);
    }
    // The kernel is put into the jail by the caller, as the shim would.
    twig_vmm::testguest::write_to(&ja).unwrap();
    let kernel_name = std::fs::read_dir(&ja)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name();
    let kernel = Path::new("/").join(&kernel_name);
    let bind = format!("{}:/store", store.display());
    let cgroup = format!("twig-jail-test/vm-{}", std::process::id());
    let _cleanup = CgroupGuard(cgroup.clone());
    let ja_s = ja.to_str().unwrap();
    let mut a = Vmm::start(
        &ja.join("api.sock"),
        Path::new("/api.sock"),
        &jail_args(
            ja_s,
            &[
                "--jail-bind",
                &bind,
                "--new-pid-ns",
                "--cgroup",
                &cgroup,
                "--cgroup-set",
                "pids.max=64",
            ],
        ),
    );
    let pid = a.vmm_pid(true);
    // Who it runs as.
    assert_eq!(status_field(pid, "Uid"), "4242\t4242\t4242\t4242");
    assert_eq!(status_field(pid, "Gid"), "4343\t4343\t4343\t4343");
    assert_eq!(status_field(pid, "Groups"), "");
    for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, caps), "0000000000000000", "{caps}");
    }
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    assert_eq!(status_field(pid, "Seccomp"), "2");
    // It is PID 1 of its own PID namespace, in a network namespace of its
    // own, and sees only its jail.
    assert_eq!(
        status_field(pid, "NSpid").split_whitespace().last(),
        Some("1")
    );
    let ns = |p: &str, n: &str| std::fs::read_link(format!("/proc/{p}/ns/{n}")).unwrap();
    assert_ne!(ns(&pid.to_string(), "net"), ns("self", "net"));
    assert_ne!(ns(&pid.to_string(), "mnt"), ns("self", "mnt"));
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    assert!(root.join("dev/kvm").exists());
    assert!(root.join("store").is_dir());
    assert!(root.join(&kernel_name).exists());
    assert!(
        !root.join("etc").exists(),
        "the host's /etc is not in the jail"
    );
    assert!(!root.join("dev/net/tun").exists(), "no tap, no tun");
    // Its /proc shows its PID namespace: itself only.
    let pids_seen: Vec<String> = std::fs::read_dir(root.join("proc"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.parse::<u32>().is_ok())
        .collect();
    assert_eq!(pids_seen, vec!["1".to_string()]);
    // Its cgroup, with the setting, on the v1 hierarchies here.
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(
        cg.lines()
            .any(|l| l.contains(":pids:") && l.ends_with(&cgroup)),
        "{cg}"
    );
    let pids = twig_vmm::jail::cgroup::hierarchies()
        .unwrap()
        .into_iter()
        .find(|h| h.controllers.iter().any(|c| c == "pids"))
        .expect("a pids hierarchy");
    assert_eq!(
        std::fs::read_to_string(pids.mount.join(&cgroup).join("pids.max"))
            .unwrap()
            .trim(),
        "64"
    );

    let state = a
        .api
        .boot(&kernel, None, "console=ttyS0", MIB, 1, T)
        .expect("boot");
    assert_eq!(state, RunState::Running);
    let node = NodeStore::open(&store, true).expect("open the node store");
    let jailed_store = Path::new("/store");
    let (full, s1) = snapshot(&mut a.api, &node, jailed_store, "s1", Kind::Full).unwrap();
    let (incr, s2) = snapshot(&mut a.api, &node, jailed_store, "s2", Kind::Incremental).unwrap();
    assert_eq!(incr.parent.as_deref(), Some(full.id.as_str()));
    assert_eq!(s1, Path::new("/store/snapshots/s1"));
    assert!(
        store.join("snapshots/s1/state").exists(),
        "written through the bind"
    );
    // Its hot list (the pages its guest used) came from the page tables,
    // read in the jail through the pagemap opened before it.
    let meta = twig_vmm::snapshot::read_state(&store.join("snapshots/s1"))
        .unwrap()
        .meta;
    let counter = twig_vmm::testguest::COUNTER / 4096;
    assert!(
        meta.hot
            .iter()
            .any(|(f, n)| counter >= *f && counter < f + n),
        "the guest's counter page is not in the hot list {:?}",
        meta.hot
    );
    let r = a.api.rollback(&s1, T).unwrap();
    assert_eq!(r.id, full.id);
    // Paths outside the jail do not exist for it.
    let outside = store.join("snapshots/s1");
    let (kind, e) = match a.api.rollback(&outside, T) {
        Err(ClientError::Vmm { kind, message }) => (kind, message),
        other => panic!("rollback outside the jail: {other:?}"),
    };
    assert_eq!(kind, ErrorKind::NotFound, "{e}");
    assert!(e.contains(outside.to_str().unwrap()), "{e}");
    assert_eq!(a.api.stats(T).unwrap().state, RunState::Running);

    // A second jailed VMM (its own jail, the same store) restores.
    let jb_s = jb.to_str().unwrap();
    let mut b = Vmm::start(
        &jb.join("api.sock"),
        Path::new("/api.sock"),
        &jail_args(
            jb_s,
            &["--jail-bind", &format!("{}:/store:ro", store.display())],
        ),
    );
    let (kind, e) = match b.api.restore(&outside, T) {
        Err(ClientError::Vmm { kind, message }) => (kind, message),
        other => panic!("restore outside the jail: {other:?}"),
    };
    assert_eq!(kind, ErrorKind::NotFound, "{e}");
    assert_eq!(b.api.restore(&s2, T).unwrap(), incr.id);
    assert_eq!(b.api.stats(T).unwrap().state, RunState::Running);
    let (kind, e) = match snapshot(&mut b.api, &node, jailed_store, "s3", Kind::Full) {
        Err(ClientError::Vmm { kind, message }) => (kind, message),
        other => panic!("snapshot into a read-only bind: {other:?}"),
    };
    assert_eq!(kind, ErrorKind::Refused, "{e}");
    assert!(node.get("s3").is_err(), "nothing published");

    b.api.shutdown(T).unwrap();
    assert!(b.wait().success());
    a.api.shutdown(T).unwrap();
    assert!(
        a.wait().success(),
        "the PID namespace's parent exits like the VMM"
    );
    assert!(!d.path().join("a/api.sock").exists());
}

#[test]
fn a_forbidden_syscall_kills_the_vmm_with_sigsys() {
    require_kvm();
    let d = tmp();
    let kernel = twig_vmm::testguest::write_to(d.path()).unwrap();
    let sock = d.path().join("api.sock");
    let serial = d.path().join("serial");
    let serial_s = serial.to_str().unwrap();

    // Control: without the filters the same call is harmless.
    let mut off = Vmm::start(&sock, &sock, &["--serial", serial_s, "--seccomp", "off"]);
    match off.api.call(&Request::TestTrigger {}, T) {
        Ok(Reply::Triggered { result }) => assert!(result >= 0, "personality: {result}"),
        other => panic!("trigger without filters: {other:?}"),
    }
    off.api.shutdown(T).unwrap();
    assert!(off.wait().success());

    // Unjailed, filters on (the default): a running VM, a snapshot, then
    // the call; the process dies of SIGSYS and the snapshot stays valid.
    let mut on = Vmm::start(&sock, &sock, &["--serial", serial_s]);
    on.api
        .boot(&kernel, None, "console=ttyS0", MIB, 1, T)
        .unwrap();
    let node = NodeStore::open(&d.path().join("store"), true).expect("open the node store");
    let (_, s1) = snapshot(&mut on.api, &node, node.root(), "s1", Kind::Full).unwrap();
    let r = on.api.call(&Request::TestTrigger {}, T);
    assert!(
        matches!(
            r,
            Err(ClientError::Io { .. } | ClientError::Protocol { .. })
        ),
        "no answer from a killed VMM: {r:?}"
    );
    let status = on.wait();
    assert_eq!(status.signal(), Some(libc::SIGSYS), "{status}");
    twig_vmm::snapshot::verify(&s1).expect("the snapshot taken before is intact");

    // Jailed in a PID namespace: the process the caller started ends the
    // same way.
    let j = d.path().join("jail");
    owned_dir(&j);
    world_readable(d.path());
    let mut jailed = Vmm::start(
        &j.join("api.sock"),
        Path::new("/api.sock"),
        &jail_args(j.to_str().unwrap(), &["--new-pid-ns"]),
    );
    assert!(jailed.api.call(&Request::TestTrigger {}, T).is_err());
    let status = jailed.wait();
    assert_eq!(status.signal(), Some(libc::SIGSYS), "{status}");
}

#[test]
fn a_jailed_vmm_takes_a_tap_from_another_network_namespace() {
    require_kvm();
    let d = tmp();
    world_readable(d.path());
    let j = d.path().join("jail");
    owned_dir(&j);
    twig_vmm::testguest::write_to(&j).unwrap();
    let kernel_name = std::fs::read_dir(&j)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name();
    let mut a = Vmm::start(
        &j.join("api.sock"),
        Path::new("/api.sock"),
        &jail_args(j.to_str().unwrap(), &["--new-pid-ns", "--net"]),
    );
    a.api
        .boot(
            &Path::new("/").join(&kernel_name),
            None,
            "console=ttyS0",
            MIB,
            1,
            T,
        )
        .unwrap();
    // The VMM has no capabilities and its own network namespace: the tap
    // is created here, in the caller's, and sent.
    let tap = format!("twj{}", std::process::id() % 100_000);
    let file = open_tap(&tap);
    assert_eq!(a.api.attach_net(file.as_fd(), T).expect("attach_net"), tap);
    drop(file);
    let stats = a.api.stats(T).expect("stats, the VMM survived its filters");
    assert_eq!(stats.net.and_then(|n| n.tap).as_deref(), Some(tap.as_str()));
    assert!(link_exists(&tap), "the tap stays in the caller's namespace");
    a.api.shutdown(T).unwrap();
    assert!(a.wait().success());
    assert!(
        !link_exists(&tap),
        "closing the VMM's descriptor removed the tap"
    );
}

#[test]
fn bad_jail_configurations_are_refused_clearly() {
    let d = tmp();
    let j = d.path().to_str().unwrap();
    let _cleanup = CgroupGuard("twig-jail-test-bad/x".into());
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["serve", "--api-sock", "/api.sock"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = run(&["--jail", j, "--uid", "0", "--gid", "0"]);
    assert!(e.contains("must not be 0"), "{e}");
    let e = run(&["--jail", j, "--uid", "1", "--gid", "1", "--tap", "tap0"]);
    assert!(e.contains("needs --netns"), "{e}");
    let e = run(&["--jail", "/nonexistent/jail", "--uid", "1", "--gid", "1"]);
    assert!(e.contains("/nonexistent/jail"), "{e}");
    let e = run(&["--jail", j, "--uid", "1"]);
    assert!(e.contains("--gid"), "{e}");
    let e = run(&[
        "--jail",
        j,
        "--uid",
        "1",
        "--gid",
        "1",
        "--jail-bind",
        "relative",
    ]);
    assert!(e.contains("absolute"), "{e}");
    let e = run(&[
        "--jail",
        j,
        "--uid",
        "1",
        "--gid",
        "1",
        "--cgroup",
        "twig-jail-test-bad/x",
        "--cgroup-set",
        "nosuch.file=1",
    ]);
    assert!(e.contains("nosuch.file"), "{e}");
}

/// An XFS filesystem (reflinks) on a loop device, unmounted when dropped.
struct Xfs(tempfile::TempDir);

impl Xfs {
    fn mount() -> Xfs {
        let dir = tmp();
        let img = dir.path().join("xfs.img");
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(512 << 20))
            .unwrap();
        let mkfs = Command::new("mkfs.xfs")
            .args(["-q", "-m", "reflink=1"])
            .arg(&img)
            .status()
            .expect("mkfs.xfs (xfsprogs) is needed");
        assert!(mkfs.success(), "mkfs.xfs");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let ok = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt)
            .status()
            .expect("mount");
        assert!(ok.success(), "loop-mounting XFS (needs root)");
        world_readable(dir.path());
        Xfs(dir)
    }

    fn path(&self) -> PathBuf {
        self.0.path().join("mnt")
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.path()).status();
    }
}

/// A node store at `root` laid out for jailed VMMs as twig-node lays it
/// out: its `tmp` writable by the VMMs' group (sticky), where a rollback
/// backs up disks sent as descriptors.
fn jail_store(root: &Path, allow_copy: bool) -> NodeStore {
    let store = NodeStore::open(root, allow_copy).expect("open the node store");
    let tmp = root.join("tmp");
    std::os::unix::fs::chown(&tmp, None, Some(GID)).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1775)).unwrap();
    store
}

/// A jailed VMM cannot open the caller's files: `Client::attach_disk` opens
/// the image and sends its descriptor with the request. The VMM serves the
/// file it was sent (a snapshot copies exactly its bytes), while the same
/// file named by path alone does not exist for it, and a request that
/// announces a descriptor it did not send is refused. A rollback puts the
/// snapshot's bytes into the sent read-write image through the descriptor
/// (reflinks: the store, bound as twig-node binds it, on the image's XFS);
/// with a store on another filesystem it is refused, naming both, and the
/// VM runs on with its disk unchanged.
#[test]
fn a_jailed_vmm_attaches_disks_sent_as_descriptors_and_rolls_them_back() {
    require_kvm();
    let xfs = Xfs::mount();
    let d = tmp();
    world_readable(d.path());
    let ja = d.path().join("a");
    owned_dir(&ja);
    twig_vmm::testguest::write_to(&ja).unwrap();
    let kernel = Path::new("/").join(
        std::fs::read_dir(&ja)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .file_name(),
    );
    // Images outside the jail, the host's root's only (mode 0600), on the
    // store's filesystem.
    let image = |name: &str, byte: u8| {
        let p = xfs.path().join(name);
        std::fs::write(&p, vec![byte; 1 << 20]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p
    };
    let (rw, ro) = (image("rootfs.img", 0xa5), image("base.img", 0x5a));
    // Two stores bound at their host paths, snapshots read-only and tmp
    // read-write: one on the images' XFS, one elsewhere (/tmp).
    let (store, other) = (xfs.path().join("store"), d.path().join("other"));
    let node = jail_store(&store, false);
    let elsewhere = jail_store(&other, true);
    let mut binds = Vec::new();
    for s in [&store, &other] {
        binds.push(format!("{}:ro", s.join("snapshots").display()));
        binds.push(s.join("tmp").display().to_string());
    }
    let mut extra = vec!["--disk-slots", "3"];
    for b in &binds {
        extra.extend(["--jail-bind", b.as_str()]);
    }
    let mut a = Vmm::start(
        &ja.join("api.sock"),
        Path::new("/api.sock"),
        &jail_args(ja.to_str().unwrap(), &extra),
    );
    a.api
        .boot(&kernel, None, "console=ttyS0", MIB, 1, T)
        .expect("boot");
    a.api
        .attach_disk(0, &rw, false, T)
        .expect("attach read-write");
    a.api
        .attach_disk(1, &ro, true, T)
        .expect("attach read-only");

    // By path alone, the file is not there for the jailed VMM.
    let by_path = Request::AttachDisk {
        slot: 2,
        path: rw.clone(),
        read_only: false,
        fd: false,
    };
    match a.api.call(&by_path, T) {
        Err(ClientError::Vmm { kind, message }) => {
            assert_eq!(kind, ErrorKind::InvalidRequest, "{message}");
            assert!(message.contains("rootfs.img"), "{message}");
        }
        other => panic!("attach by a path outside the jail: {other:?}"),
    }
    // A descriptor announced but not sent.
    let no_fd = Request::AttachDisk {
        slot: 2,
        path: rw.clone(),
        read_only: false,
        fd: true,
    };
    match a.api.call(&no_fd, T) {
        Err(ClientError::Vmm { kind, message }) => {
            assert_eq!(kind, ErrorKind::InvalidRequest, "{message}");
            assert!(message.contains("file descriptor"), "{message}");
        }
        other => panic!("attach without the announced descriptor: {other:?}"),
    }

    // The snapshot holds the read-write slot's bytes, read through the
    // descriptor.
    let (_, s1) = snapshot(&mut a.api, &node, &store, "s1", Kind::Full).expect("snapshot");
    let at_s1 = std::fs::read(&rw).unwrap();
    assert_eq!(
        std::fs::read(s1.join("disk0")).expect("the slot's copy"),
        at_s1
    );

    // The image changes (bytes and size) after the snapshot; the rollback
    // puts the snapshot's back through the descriptor.
    let f = std::fs::OpenOptions::new().write(true).open(&rw).unwrap();
    f.write_all_at(b"after the snapshot", 4096).unwrap();
    f.set_len(2 << 20).unwrap();
    a.api.rollback(&s1, T).expect("rollback with a sent disk");
    assert!(
        std::fs::read(&rw).unwrap() == at_s1,
        "the image holds the snapshot's bytes"
    );
    let stats = a.api.stats(T).unwrap();
    assert_eq!(stats.state, RunState::Running);
    assert_eq!(stats.guest_exit, None);
    assert_eq!(std::fs::read(&ro).unwrap(), vec![0x5a; 1 << 20]);
    let left: Vec<_> = std::fs::read_dir(store.join("tmp")).unwrap().collect();
    assert!(left.is_empty(), "the backup is gone: {left:?}");

    // A snapshot store on another filesystem cannot reflink into the
    // image: refused, naming both, the image and the VM unchanged.
    let (_, e1) = snapshot(&mut a.api, &elsewhere, &other, "e1", Kind::Full)
        .expect("snapshot into the other store");
    f.write_all_at(b"after e1", 0).unwrap();
    let before = std::fs::read(&rw).unwrap();
    match a.api.rollback(&e1, T) {
        Err(ClientError::Vmm { kind, message }) => {
            assert_eq!(kind, ErrorKind::Refused, "{message}");
            assert!(
                message.contains("rootfs.img") && message.contains("on device"),
                "{message}"
            );
        }
        other => panic!("rollback from another filesystem: {other:?}"),
    }
    assert!(
        std::fs::read(&rw).unwrap() == before,
        "the image is unchanged"
    );
    assert_eq!(a.api.stats(T).unwrap().state, RunState::Running);
    // And a rollback to s1 still works.
    a.api.rollback(&s1, T).expect("rollback to s1 again");
    assert!(std::fs::read(&rw).unwrap() == at_s1);

    a.api.detach_disk(0, T).expect("detach");
    a.api.attach_disk(0, &rw, false, T).expect("attach again");
    a.api.shutdown(T).unwrap();
    assert!(a.wait().success());
    drop(f);
}
