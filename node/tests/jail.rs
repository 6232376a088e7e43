//! twig-node's VMMs run jailed (the default configuration) on this host's
//! /dev/kvm: a pooled VMM runs as the configured unprivileged user, with no
//! capabilities, under its seccomp filters, in its own mount, PID and
//! network namespaces and its own cgroup; its root holds `/dev/kvm`, its own
//! directory and the node store's snapshots and staging, and nothing else
//! (a snapshot in another store is `not_found` for it). Restore, snapshots
//! (full and incremental, published by the real node store) and rollback
//! work through the jail with the paths the shim uses; a second jailed VMM
//! handed over for a clone restores the chain. As a VMM's user in its root,
//! a VMM opens the snapshots it restores and wrote and nothing else of the
//! store (another VMM's published snapshots and staging: `EACCES`), and the
//! next VMM of its user id none of its grants. A system call outside the
//! filters (the test-only trigger) kills the VMM, the daemon reaps it and
//! removes its directory and cgroup. With the jail off, VMMs run as before.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use common::*;
use twig_node::config::{DEFAULT_VMM_ID, DEFAULT_VMM_IDS};
use twig_proto::node::AcquireVmRequest;
use twig_store::NodeStore;
use twig_vmm::api::{Client, ErrorKind, Request};
use twig_vmm::{Kind, RunState};

/// Restores `template_dir` into the VMM serving `api_socket`, as the shim
/// does, and waits until the guest runs.
fn restore(api_socket: &str, template_dir: &Path) -> Client {
    let mut api = Client::connect(Path::new(api_socket), T).expect("connect to the handed VMM");
    api.restore(template_dir, T).expect("restore the template");
    wait_until("the restored guest runs", T, || {
        let s = api.stats(T).expect("stats");
        s.exits > 0 && s.state == RunState::Running
    });
    api
}

/// The test's parent cgroup, removed (with what is left in it) on drop.
struct CgroupGuard(String);

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        for h in twig_vmm::jail::cgroup::hierarchies().unwrap() {
            let parent = h.mount.join(&self.0);
            if let Ok(children) = std::fs::read_dir(&parent) {
                for c in children.flatten().filter(|c| c.path().is_dir()) {
                    let _ = std::fs::remove_dir(c.path());
                }
            }
            let _ = std::fs::remove_dir(&parent);
        }
    }
}

/// Kills a handed-over VMM (the test owns it) if the test ends before it
/// stopped it: it would outlive the daemon.
struct Owned(u32);

impl Drop for Owned {
    fn drop(&mut self) {
        if !gone(self.0) {
            // SAFETY: kill(2); no memory involved.
            unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
        }
    }
}

/// A test node's configuration with the jail's defaults (uid/gid
/// [`DEFAULT_VMM_ID`], new PID namespace) in the cgroup `cgroup`.
fn jailed_config(dir: &Path, size: usize, cgroup: &str) -> serde_json::Value {
    let mut c = config(dir, size);
    c["jail"] = serde_json::json!({
        "cgroup": cgroup,
        "cgroup_settings": {"pids.max": "64"},
    });
    c
}

/// The VMM itself: in its PID namespace it is the only child of the
/// process the daemon started (and handed over), which waits for it.
fn vmm_of(pid: u32) -> u32 {
    let mut child = None;
    wait_until("the jailed VMM runs in its PID namespace", T, || {
        child = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .ok()
            .and_then(|c| c.split_whitespace().next().map(str::to_string))
            .and_then(|c| c.parse().ok());
        child.is_some()
    });
    child.unwrap()
}

/// The value of `field` in `/proc/<pid>/status`, whitespace-normalised.
fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The real, effective, saved and filesystem user id of `pid`, which must
/// be one.
fn uid_of(pid: u32) -> u32 {
    let uids = status_field(pid, "Uid");
    let first = uids.split(' ').next().unwrap().to_string();
    assert_eq!(uids, [first.as_str(); 4].join(" "));
    first.parse().unwrap()
}

fn ns(pid: &str, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap()
}

/// `host` as the process `pid` sees it from its root.
fn seen_by(pid: u32, host: &Path) -> PathBuf {
    Path::new(&format!("/proc/{pid}/root")).join(host.strip_prefix("/").unwrap())
}

#[test]
fn pooled_vmms_run_jailed_and_restore_snapshot_and_roll_back_through_the_jail() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    // A snapshot in another store: outside every pooled VMM's jail.
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    make_template(&other, "elsewhere");
    let cgroup = format!("twig-node-test-{}", std::process::id());
    let _cg = CgroupGuard(cgroup.clone());
    let node = Node::start(dir.path(), &jailed_config(dir.path(), 2, &cgroup));
    wait_until("the pool holds 2 VMMs", T, || node.pooled().len() == 2);
    node.check_pooled(&node.pooled());
    let vm = node.acquire("tiny").expect("AcquireVm");
    let _owned = Owned(vm.pid);
    let inner = vmm_of(vm.pid);

    // An unprivileged user of its own (of the range) with no
    // capabilities, under its filters.
    let uid = uid_of(inner);
    assert!(
        (DEFAULT_VMM_ID..DEFAULT_VMM_ID + DEFAULT_VMM_IDS).contains(&uid),
        "{uid}"
    );
    let gid = DEFAULT_VMM_ID.to_string();
    assert_eq!(status_field(inner, "Gid"), [gid.as_str(); 4].join(" "));
    assert_eq!(status_field(inner, "Groups"), "");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(inner, cap), "0000000000000000", "{cap}");
    }
    assert_eq!(status_field(inner, "NoNewPrivs"), "1");
    assert_eq!(status_field(inner, "Seccomp"), "2");
    // PID 1 of its own PID namespace; its own mount and network namespaces.
    assert_eq!(status_field(inner, "NSpid"), format!("{inner} 1"));
    for kind in ["mnt", "net", "pid"] {
        assert_ne!(ns(&inner.to_string(), kind), ns("self", kind), "{kind}");
    }
    // Its own cgroup, with the configured setting.
    let name = Path::new(&vm.state_dir)
        .file_name()
        .unwrap()
        .to_str()
        .unwrap();
    let group = format!("{cgroup}/{name}");
    let cgroups = std::fs::read_to_string(format!("/proc/{inner}/cgroup")).unwrap();
    assert!(
        cgroups
            .lines()
            .any(|l| l.contains(":pids:") && l.ends_with(&group)),
        "{cgroups}"
    );
    let hierarchies = twig_vmm::jail::cgroup::hierarchies().unwrap();
    let pids = hierarchies
        .iter()
        .find(|h| h.controllers.iter().any(|c| c == "pids"))
        .expect("a pids hierarchy");
    assert_eq!(
        std::fs::read_to_string(pids.mount.join(&group).join("pids.max"))
            .unwrap()
            .trim(),
        "64"
    );

    // Its root: /dev/kvm, its directory and the store's snapshots and
    // staging at their host paths; not the host's files, not another store.
    let store_dir = dir.path().join("store");
    let root = PathBuf::from(format!("/proc/{inner}/root"));
    assert!(root.join("dev/kvm").exists());
    assert!(seen_by(inner, Path::new(&vm.api_socket)).exists());
    assert!(seen_by(inner, &store_dir.join("snapshots/tiny/state")).exists());
    assert!(seen_by(inner, &store_dir.join("tmp")).is_dir());
    for absent in [
        root.join("etc"),
        root.join("usr"),
        seen_by(inner, &dir.path().join("node.json")),
        seen_by(inner, &other.join("store/snapshots/elsewhere/state")),
        seen_by(inner, &Path::new(&vm.state_dir).join("vmm.log")),
    ] {
        assert!(!absent.exists(), "{} is in the jail", absent.display());
    }
    let mut api = Client::connect(Path::new(&vm.api_socket), T).unwrap();
    let e = api
        .restore(&other.join("store/snapshots/elsewhere"), T)
        .expect_err("a snapshot outside the jail");
    assert_eq!(e.kind(), Some(ErrorKind::NotFound), "{e}");

    // Restore, snapshots into the real store, rollback: the shim's calls
    // with the host paths.
    let mut api = restore(&vm.api_socket, Path::new(&vm.template_dir));
    let store = NodeStore::open(&store_dir, true).unwrap();
    for (id, kind) in [("s1", Kind::Full), ("s2", Kind::Incremental)] {
        let staging = store.stage(id).unwrap();
        let info = api.snapshot(staging.dir(), kind, T).expect("snapshot");
        assert_eq!(info.kind, kind);
        // Staged, the directory is the VMM's alone: no other VMM (each its
        // own user) can look in.
        let staged = std::fs::metadata(staging.dir()).unwrap();
        assert_eq!((staged.uid(), staged.mode() & 0o777), (uid, 0o700), "{id}");
        let published = staging.publish().expect("publish");
        // Written by the jailed VMM; published, root's and not writable by
        // it, the directory closed to every other user.
        let state = std::fs::metadata(published.dir().join("state")).unwrap();
        assert_eq!((state.uid(), state.mode() & 0o777), (0, 0o644), "{id}");
        let dir = std::fs::metadata(published.dir()).unwrap();
        assert_eq!((dir.uid(), dir.mode() & 0o707), (0, 0o700), "{id}");
    }
    assert_eq!(store.get("s2").unwrap().parent.as_deref(), Some("s1"));
    for id in ["s1", "s2"] {
        api.rollback(&store.snapshot_dir(id), T)
            .unwrap_or_else(|e| panic!("rollback to {id}: {e}"));
        assert_eq!(api.stats(T).unwrap().baseline.as_deref(), Some(id));
    }
    let e = api
        .rollback(&other.join("store/snapshots/elsewhere"), T)
        .expect_err("a rollback to a snapshot outside the jail");
    assert_eq!(e.kind(), Some(ErrorKind::NotFound), "{e}");

    // Another jailed VMM, another user, handed over for a clone of s2,
    // restores the incremental chain.
    let vm2 = node
        .acquire_req(AcquireVmRequest {
            template: "tiny".into(),
            sandbox_id: "clone".into(),
            restore_from: "s2".into(),
            ..Default::default()
        })
        .expect("AcquireVm for a clone");
    let _owned2 = Owned(vm2.pid);
    assert_ne!(uid_of(vmm_of(vm2.pid)), uid, "each VMM its own user");
    let mut api2 = restore(&vm2.api_socket, &store.snapshot_dir("s2"));
    assert_eq!(api2.stats(T).unwrap().baseline.as_deref(), Some("s2"));

    for (vm, api) in [(&vm, &mut api), (&vm2, &mut api2)] {
        api.shutdown(T).expect("shutdown");
        wait_until("the stopped VMM is reaped", T, || gone(vm.pid));
        wait_until("its directory is removed", T, || {
            !Path::new(&vm.state_dir).exists()
        });
    }
    wait_until("its cgroup is removed", T, || {
        hierarchies.iter().all(|h| !h.mount.join(&group).exists())
    });
}

/// An XFS filesystem (reflinks) on a loop device, unmounted when dropped.
struct Xfs(tempfile::TempDir);

impl Xfs {
    fn mount() -> Xfs {
        use std::process::Command;
        let dir = tempfile::tempdir().unwrap();
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
        Xfs(dir)
    }

    fn path(&self) -> PathBuf {
        self.0.path().join("mnt")
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.path())
            .status();
    }
}

/// A container's read-write rootfs in a pooled (jailed) VMM rolls back:
/// the shim's calls (attach by descriptor, snapshot into the node store,
/// rollback by host path) with the store and the image on one XFS, as on
/// a node whose snapshotter shares the store's filesystem. The image is
/// root's (mode 0600), outside the jail; the rollback puts the snapshot's
/// bytes back into it through the descriptor and the VM runs on.
#[test]
fn a_jailed_vmm_rolls_back_a_container_rootfs_sent_as_a_descriptor() {
    use std::os::unix::fs::{FileExt, PermissionsExt};
    let xfs = Xfs::mount();
    let dir = xfs.path();
    make_template(&dir, "tiny");
    let cgroup = format!("twig-node-test-rootfs-{}", std::process::id());
    let _cg = CgroupGuard(cgroup.clone());
    let node = Node::start(&dir, &jailed_config(&dir, 1, &cgroup));
    let vm = node.acquire("tiny").expect("AcquireVm");
    let _owned = Owned(vm.pid);
    let mut api = restore(&vm.api_socket, Path::new(&vm.template_dir));

    let rootfs = dir.join("rootfs.img");
    std::fs::write(&rootfs, vec![0xa5; 1 << 20]).unwrap();
    std::fs::set_permissions(&rootfs, std::fs::Permissions::from_mode(0o600)).unwrap();
    api.attach_disk(0, &rootfs, false, T)
        .expect("attach the rootfs");
    let store = NodeStore::open(&dir.join("store"), true).unwrap();
    let staging = store.stage("s1").unwrap();
    api.snapshot(staging.dir(), Kind::Full, T)
        .expect("snapshot");
    let s1 = staging.publish().expect("publish");
    let at_s1 = std::fs::read(&rootfs).unwrap();

    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&rootfs)
        .unwrap();
    f.write_all_at(b"the agent's mistake", 8192).unwrap();
    api.rollback(s1.dir(), T)
        .expect("rollback with the rootfs attached");
    assert!(
        std::fs::read(&rootfs).unwrap() == at_s1,
        "the rootfs holds the snapshot's bytes"
    );
    let stats = api.stats(T).unwrap();
    assert_eq!(stats.state, RunState::Running);
    assert_eq!(stats.baseline.as_deref(), Some("s1"));
    assert_eq!(
        std::fs::read_dir(dir.join("store/tmp")).unwrap().count(),
        0,
        "no backup left in the store's tmp"
    );
    api.shutdown(T).expect("shutdown");
    wait_until("the stopped VMM is reaped", T, || gone(vm.pid));
    drop(node);
}

#[test]
fn a_filter_violation_kills_a_jailed_vmm_and_the_daemon_reaps_it() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let cgroup = format!("twig-node-trigger-{}", std::process::id());
    let _cg = CgroupGuard(cgroup.clone());
    let node = Node::start(dir.path(), &jailed_config(dir.path(), 1, &cgroup));
    let vm = node.acquire("tiny").expect("AcquireVm");
    let _owned = Owned(vm.pid);
    let inner = vmm_of(vm.pid);
    let mut api = restore(&vm.api_socket, Path::new(&vm.template_dir));
    let e = api
        .call(&Request::TestTrigger {}, T)
        .expect_err("the VMM dies of the forbidden call");
    assert!(
        matches!(e, twig_vmm::api::ClientError::Io { .. })
            || matches!(e, twig_vmm::api::ClientError::Protocol { .. }),
        "{e:?}"
    );
    wait_until("the killed VMM is reaped", T, || {
        gone(vm.pid) && gone(inner)
    });
    wait_until("its directory is removed", T, || {
        !Path::new(&vm.state_dir).exists()
    });
    // The daemon saw it die of SIGSYS (the process it started re-raises
    // its VMM's signal).
    wait_until("the daemon logs the death", T, || {
        node.log()
            .lines()
            .any(|l| l.contains("a handed-over VMM exited") && l.contains("SIGSYS"))
    });
    assert!(node.status().handed_pids.is_empty());
    let name = Path::new(&vm.state_dir).file_name().unwrap().to_owned();
    wait_until("its cgroup is removed", T, || {
        twig_vmm::jail::cgroup::hierarchies()
            .unwrap()
            .iter()
            .all(|h| !h.mount.join(&cgroup).join(&name).exists())
    });
    // The pool goes on serving.
    let next = node.acquire("tiny").expect("AcquireVm after the death");
    let _owned_next = Owned(next.pid);
    restore(&next.api_socket, Path::new(&next.template_dir));
    sigkill(next.pid);
    wait_until("the next VMM is reaped", T, || gone(next.pid));
}

#[test]
fn with_the_jail_off_vmms_run_as_before() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let mut c = config(dir.path(), 1);
    c["jail"] = serde_json::json!({"enabled": false});
    let node = Node::start(dir.path(), &c);
    let vm = node.acquire("tiny").expect("AcquireVm");
    let pid = vm.pid;
    let _owned = Owned(pid);
    assert_eq!(status_field(pid, "Uid"), "0 0 0 0");
    assert_eq!(status_field(pid, "Seccomp"), "2", "filters stay on");
    for kind in ["mnt", "net", "pid"] {
        assert_eq!(ns(&pid.to_string(), kind), ns("self", kind), "{kind}");
    }
    let mut api = restore(&vm.api_socket, Path::new(&vm.template_dir));
    let store = NodeStore::open(&dir.path().join("store"), true).unwrap();
    let staging = store.stage("s1").unwrap();
    api.snapshot(staging.dir(), Kind::Full, T)
        .expect("snapshot");
    staging.publish().expect("publish");
    api.rollback(&store.snapshot_dir("s1"), T)
        .expect("rollback");
    api.shutdown(T).expect("shutdown");
    wait_until("the stopped VMM is reaped", T, || gone(pid));
}

/// With one user id for VMMs, a second VMM cannot start while the first
/// runs (no two VMMs share a user); once the first exited, its id serves
/// the next.
#[test]
fn no_two_vmms_share_a_user_id() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let cgroup = format!("twig-node-ids-{}", std::process::id());
    let _cg = CgroupGuard(cgroup.clone());
    let mut c = jailed_config(dir.path(), 0, &cgroup);
    c["jail"]["ids"] = serde_json::json!(1);
    let node = Node::start(dir.path(), &c);
    let vm = node.acquire("tiny").expect("AcquireVm");
    let _owned = Owned(vm.pid);
    assert_eq!(uid_of(vmm_of(vm.pid)), DEFAULT_VMM_ID);
    let e = node.acquire("tiny").expect_err("no user id left");
    assert!(format!("{e:?}").contains("user ids"), "{e:?}");
    sigkill(vm.pid);
    wait_until("the VMM is reaped", T, || gone(vm.pid));
    let mut next = None;
    wait_until("its user id serves the next VMM", T, || {
        next = node.acquire("tiny").ok();
        next.is_some()
    });
    let next = next.unwrap();
    let _owned_next = Owned(next.pid);
    assert_eq!(uid_of(vmm_of(next.pid)), DEFAULT_VMM_ID);
}

/// What `open(2)` (read-only) of each of `paths` gives the jailed VMM `pid`
/// as it sees them: in its root, as its user and group, with no other
/// groups; 0 where it opened, else the error number.
fn opens_as_vmm(pid: u32, paths: &[PathBuf]) -> Vec<i32> {
    let gid: u32 = status_field(pid, "Gid")
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    twig_store::testkit::opens_as(Some(&root), uid_of(pid), gid, paths)
}

/// A jailed VMM reads the snapshots it restores and those it wrote, and
/// nothing else of the store: not another VMM's published snapshots
/// (memory and state) nor its staging; and once it exited, the next VMM of
/// its user id reads none of what it was granted.
#[test]
fn a_vmm_reads_only_the_snapshots_it_restores_and_wrote() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let cgroup = format!("twig-node-reads-{}", std::process::id());
    let _cg = CgroupGuard(cgroup.clone());
    let mut c = jailed_config(dir.path(), 0, &cgroup);
    c["jail"]["ids"] = serde_json::json!(2);
    let node = Node::start(dir.path(), &c);
    let store_dir = dir.path().join("store");
    let store = NodeStore::open(&store_dir, true).unwrap();
    let snap = |id: &str, f: &str| store.snapshot_dir(id).join(f);

    let a = node.acquire("tiny").expect("AcquireVm");
    let _owned_a = Owned(a.pid);
    let inner_a = vmm_of(a.pid);
    let mut api_a = restore(&a.api_socket, Path::new(&a.template_dir));
    let staging = store.stage("a1").unwrap();
    api_a
        .snapshot(staging.dir(), Kind::Full, T)
        .expect("snapshot");
    staging.publish().expect("publish");

    let b = node.acquire("tiny").expect("AcquireVm");
    let _owned_b = Owned(b.pid);
    let inner_b = vmm_of(b.pid);
    let mut api_b = restore(&b.api_socket, Path::new(&b.template_dir));
    let staging = store.stage("b1").unwrap();
    api_b
        .snapshot(staging.dir(), Kind::Full, T)
        .expect("snapshot");
    staging.publish().expect("publish");
    let b_staged = store.stage("b2").unwrap();
    api_b
        .snapshot(b_staged.dir(), Kind::Full, T)
        .expect("snapshot");

    let readable = [
        snap("tiny", "state"),
        snap("tiny", "memory"),
        snap("a1", "state"),
        snap("a1", "memory"),
    ];
    assert_eq!(opens_as_vmm(inner_a, &readable), [0; 4]);
    let others = [
        snap("b1", "state"),
        snap("b1", "memory"),
        store.snapshot_dir("b1"),
        b_staged.dir().to_path_buf(),
        b_staged.dir().join("state"),
        store_dir.join("snapshots"),
    ];
    assert_eq!(opens_as_vmm(inner_a, &others), [libc::EACCES; 6]);
    // The other way round: B reads its own, not A's.
    assert_eq!(
        opens_as_vmm(
            inner_b,
            &[snap("b1", "memory"), b_staged.dir().join("memory")]
        ),
        [0; 2]
    );
    assert_eq!(
        opens_as_vmm(inner_b, &[snap("a1", "state"), snap("a1", "memory")]),
        [libc::EACCES; 2]
    );
    // Not writable by the VMM that wrote it.
    assert_eq!(
        std::fs::metadata(snap("a1", "memory")).unwrap().uid(),
        0,
        "a published file is root's"
    );

    // A exits; its user id serves the next VMM, which reads its template
    // but nothing A was granted.
    let uid_a = uid_of(inner_a);
    api_a.shutdown(T).expect("shutdown");
    wait_until("A is reaped", T, || gone(a.pid));
    let mut next = None;
    wait_until("A's user id serves the next VMM", T, || {
        next = node.acquire("tiny").ok();
        next.is_some()
    });
    let next = next.unwrap();
    let _owned_next = Owned(next.pid);
    let inner_next = vmm_of(next.pid);
    assert_eq!(uid_of(inner_next), uid_a);
    assert_eq!(opens_as_vmm(inner_next, &[snap("tiny", "state")]), [0]);
    assert_eq!(
        opens_as_vmm(
            inner_next,
            &[
                snap("a1", "state"),
                snap("a1", "memory"),
                store.snapshot_dir("a1")
            ]
        ),
        [libc::EACCES; 3]
    );
    drop(b_staged);
    api_b.shutdown(T).expect("shutdown");
    wait_until("B is reaped", T, || gone(b.pid));
}
