//! The `Node` service on a real node store: GetSnapshot (with its sizes),
//! GetStoreUsage, DeleteSnapshot, EnsureTemplate and DeleteTemplate; deletion refused while a VM restored
//! from the snapshot runs or a child names it; a corrupt template refused
//! before anything is handed over; a base template whose build fails
//! leaves nothing in the store; configuration errors.

mod common;

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::process::Command;

use common::*;
use twig_proto::node::AcquireVmRequest;
use twig_proto::twig::{
    CollectGarbageRequest, CollectGarbageResponse, DeleteSnapshotRequest, DeleteTemplateRequest,
    EnsureTemplateRequest, EnsureTemplateResponse, GetSnapshotRequest, GetSnapshotResponse,
    GetStoreUsageRequest, GetStoreUsageResponse, RetainSnapshotRequest,
};
use twig_store::{Artefact, NodeStore};

fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_timeout(T.as_nanos() as i64)
}

impl Node {
    fn get(&self, id: &str) -> Result<GetSnapshotResponse, ttrpc::Error> {
        let req = GetSnapshotRequest {
            snapshot_id: id.into(),
            ..Default::default()
        };
        self.rt.block_on(self.node.get_snapshot(ctx(), &req))
    }

    fn store_usage(&self) -> Result<GetStoreUsageResponse, ttrpc::Error> {
        self.rt.block_on(
            self.node
                .get_store_usage(ctx(), &GetStoreUsageRequest::default()),
        )
    }

    fn delete(&self, id: &str) -> Result<(), ttrpc::Error> {
        let req = DeleteSnapshotRequest {
            snapshot_id: id.into(),
            ..Default::default()
        };
        self.rt
            .block_on(self.node.delete_snapshot(ctx(), &req))
            .map(|_| ())
    }

    fn delete_template(&self, name: &str) -> Result<(), ttrpc::Error> {
        let req = DeleteTemplateRequest {
            name: name.into(),
            ..Default::default()
        };
        self.rt
            .block_on(self.node.delete_template(ctx(), &req))
            .map(|_| ())
    }

    fn ensure(&self, name: &str, memory_mib: u32) -> Result<EnsureTemplateResponse, ttrpc::Error> {
        let req = EnsureTemplateRequest {
            name: name.into(),
            image: "example.com/app:1".into(),
            memory_mib,
            vcpus: 1,
            ..Default::default()
        };
        self.rt.block_on(self.node.ensure_template(ctx(), &req))
    }
}

#[test]
fn snapshots_and_templates_of_the_node_store() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let node = Node::start(dir.path(), &config(dir.path(), 0));

    let got = node.get("tiny").expect("GetSnapshot");
    assert!(got.found);
    assert_eq!(got.snapshot.snapshot_id, "tiny");
    assert_eq!(got.snapshot.parent_id, "");
    assert!(got.snapshot.size_bytes >= u64::from(MIB) << 20, "{got:?}");
    assert!(!node.get("nothing").expect("GetSnapshot").found);
    let (code, msg) = status(node.get("").unwrap_err());
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{msg}");

    // An app template placed in the store (no build label) is ready.
    make_template(dir.path(), "template.default.tiny");
    assert!(
        node.ensure("default/tiny", MIB)
            .expect("EnsureTemplate")
            .ready
    );
    assert!(
        node.ensure("default/tiny", 0)
            .expect("EnsureTemplate, any size")
            .ready
    );
    let (code, msg) = status(node.ensure("default/tiny", 128).unwrap_err());
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    assert!(
        msg.contains("128 MiB") && msg.contains("asked for"),
        "{msg}"
    );
    let (code, msg) = status(node.ensure("tiny", MIB).unwrap_err());
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("namespace/name"), "{msg}");
    // Its egress policy follows the request, with no rebuild; a malformed
    // one is refused and changes nothing.
    let store = NodeStore::open(&dir.path().join("store"), true).unwrap();
    let policy = |p: &str| EnsureTemplateRequest {
        name: "default/tiny".into(),
        image: "example.com/app:1".into(),
        egress_policy: p.into(),
        ..Default::default()
    };
    let label = || {
        store
            .get("template.default.tiny")
            .unwrap()
            .labels
            .get("twig.dev/egress-policy")
            .cloned()
    };
    let allow = r#"{"allow":[{"cidr":"10.0.0.0/8"}]}"#;
    let r = node
        .rt
        .block_on(node.node.ensure_template(ctx(), &policy(allow)));
    assert!(r.expect("EnsureTemplate with a policy").ready);
    assert_eq!(label().as_deref(), Some(allow));
    let (code, msg) = status(
        node.rt
            .block_on(
                node.node
                    .ensure_template(ctx(), &policy(r#"{"allow":[{"cidr":"x"}]}"#)),
            )
            .unwrap_err(),
    );
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains("egress_policy"), "{msg}");
    assert_eq!(label().as_deref(), Some(allow));
    let r = node
        .rt
        .block_on(node.node.ensure_template(ctx(), &policy("")));
    assert!(r.expect("EnsureTemplate without a policy").ready);
    assert_eq!(label(), None);
    // One that is not there is built through containerd's CRI; without a
    // containerd the build fails, says why, and leaves nothing.
    let first = node.ensure("default/app", MIB).expect("EnsureTemplate");
    assert!(!first.ready);
    assert!(
        first.message.contains("building from example.com/app:1"),
        "{first:?}"
    );
    let mut last = first;
    wait_until("the build's failure is reported", T, || {
        last = node.ensure("default/app", MIB).expect("EnsureTemplate");
        last.message.contains("failed")
    });
    assert!(!last.ready);
    assert!(
        last.message.contains("no-containerd.sock") && last.message.contains("next attempt in"),
        "{last:?}"
    );
    assert!(!node.get("template.default.app").unwrap().found);
    node.delete_template("default/app")
        .expect("DeleteTemplate of a template never built");
    node.delete_template("default/tiny")
        .expect("DeleteTemplate");
    assert!(!node.get("template.default.tiny").unwrap().found);

    // A VM restored from the template holds it.
    let vm = node.acquire("tiny").expect("AcquireVm");
    let (code, msg) = status(node.delete("tiny").unwrap_err());
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    assert!(
        msg.contains("in use") && msg.contains(&vm.pid.to_string()),
        "{msg}"
    );
    assert!(node.get("tiny").unwrap().found, "nothing was deleted");
    sigkill(vm.pid);
    wait_until("the VMM is reaped", T, || gone(vm.pid));
    wait_until("the daemon saw it exit", T, || {
        node.status().handed_pids.is_empty()
    });

    // A clone's VM holds the pod snapshot it is restored from (whose
    // state the daemon reads for the VM's shape).
    make_template(dir.path(), "pod-snap");
    let vm = node
        .acquire_req(AcquireVmRequest {
            template: "tiny".into(),
            sandbox_id: "clone".into(),
            restore_from: "pod-snap".into(),
            ..Default::default()
        })
        .expect("AcquireVm for a clone");
    let (code, msg) = status(node.delete("pod-snap").unwrap_err());
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    assert!(
        msg.contains("in use") && msg.contains(&vm.pid.to_string()),
        "{msg}"
    );
    sigkill(vm.pid);
    wait_until("the clone's VMM is reaped", T, || gone(vm.pid));
    wait_until("the daemon saw it exit", T, || {
        node.status().handed_pids.is_empty()
    });
    node.delete("pod-snap")
        .expect("DeleteSnapshot once the clone is gone");

    // A child names it as parent.
    let mut staging = store.stage("tiny.child").unwrap();
    staging.set_parent("tiny").unwrap();
    staging.set_kind(twig_store::Kind::Incremental);
    staging
        .put_bytes(twig_store::Artefact::Memory, b"")
        .unwrap();
    staging.publish().unwrap();
    let (code, msg) = status(node.delete("tiny").unwrap_err());
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    assert!(msg.contains("tiny.child"), "{msg}");
    assert_eq!(node.get("tiny.child").unwrap().snapshot.parent_id, "tiny");

    node.delete("tiny.child")
        .expect("DeleteSnapshot of the child");
    node.delete("tiny").expect("DeleteSnapshot");
    assert!(!node.get("tiny").unwrap().found);
    assert!(!store.snapshot_dir("tiny").exists());
    node.delete("tiny").expect("deleting what is gone succeeds");
    node.delete_template("default/tiny")
        .expect("so does DeleteTemplate");
}

#[test]
fn a_corrupt_template_is_refused_before_a_vm_is_handed_over() {
    let dir = tempfile::tempdir().unwrap();
    let id = "template.default.tiny";
    make_template(dir.path(), id);
    let state = dir.path().join("store/snapshots").join(id).join("state");
    let mut bytes = std::fs::read(&state).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&state, bytes).unwrap();
    let node = Node::start(dir.path(), &config(dir.path(), 0));
    let (code, msg) = status(node.acquire(id).unwrap_err());
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    assert!(msg.contains(&format!("{id:?} is unusable")), "{msg}");
    let (code, msg) = status(node.ensure("default/tiny", MIB).unwrap_err());
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    assert!(msg.contains("unusable"), "{msg}");
    let vms: Vec<_> = std::fs::read_dir(dir.path().join("run/vms"))
        .unwrap()
        .collect();
    assert!(vms.is_empty(), "no VMM was started: {vms:?}");
}

#[test]
fn a_failed_base_template_build_is_a_clear_error_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), 0);
    // Inputs that exist but boot nothing: twig-vmm's loader refuses them.
    let kernel = dir.path().join("garbage-kernel");
    let initrd = dir.path().join("initrd");
    std::fs::write(&kernel, vec![0x5a; 64 * 1024]).unwrap();
    std::fs::write(&initrd, b"not a cpio").unwrap();
    c["base"]["kernel"] = serde_json::json!(kernel);
    c["base"]["initrd"] = serde_json::json!(initrd);
    let node = Node::start(dir.path(), &c);
    let (code, msg) = status(node.acquire("").unwrap_err());
    assert_eq!(code, ttrpc::Code::INTERNAL, "{msg}");
    assert!(
        msg.contains("building the base template base-") && msg.contains("garbage-kernel"),
        "{msg}"
    );
    let store = NodeStore::open(&dir.path().join("store"), true).unwrap();
    assert!(store.list().unwrap().is_empty(), "nothing was published");
    let tmp: Vec<_> = std::fs::read_dir(dir.path().join("store/tmp"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(tmp.is_empty(), "nothing half-written stays: {tmp:?}");
}

#[test]
fn configuration_errors_stop_the_daemon_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node.json");
    for (text, needle) in [
        (r#"{"pool": {"size": 3}}"#, "unknown field `size`"),
        (r#"{"disk_slots": 0}"#, "disk_slots is 0"),
        ("not json", "node.json"),
    ] {
        std::fs::write(&path, text).unwrap();
        let out = Command::new(BIN)
            .arg("--config")
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}: {err}");
        assert!(err.contains(needle), "{text}: {err}");
    }
    let out = Command::new(BIN)
        .arg("--config")
        .arg(dir.path().join("missing.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.json"));
}

#[test]
fn a_second_daemon_on_a_served_socket_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), 0);
    let _node = Node::start(dir.path(), &c);
    let path = dir.path().join("second.json");
    std::fs::write(&path, c.to_string()).unwrap();
    let out = Command::new(BIN)
        .arg("--config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("served already"), "{err}");
    assert!(Path::new(&dir.path().join("node.sock")).exists());
}

/// Allocated bytes (`st_blocks`) of a file.
fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Allocated bytes of every regular file under `dir`.
fn allocated_under(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                allocated_under(&e.path())
            } else if t.is_file() {
                allocated(&e.path())
            } else {
                0
            }
        })
        .sum()
}

#[test]
fn snapshot_sizes_and_store_usage_match_the_files_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "template.default.tiny");
    let node = Node::start(dir.path(), &config(dir.path(), 0));
    let store = NodeStore::open(&dir.path().join("store"), true).unwrap();
    // A pod snapshot on top of it: a sparse layer of 3 pages, a sparse disk.
    let mut staging = store.stage("pod-snap").unwrap();
    let memory = std::fs::File::create(staging.path(Artefact::Memory)).unwrap();
    memory.set_len(u64::from(MIB) << 20).unwrap();
    for page in [0_u64, 100, 1000] {
        memory.write_all_at(&[0x5a; 4096], page * 4096).unwrap();
    }
    memory.sync_all().unwrap();
    let disk = std::fs::File::create(staging.path(Artefact::Disk(1))).unwrap();
    disk.set_len(32 << 20).unwrap();
    disk.write_all_at(&[1; 65536], 1 << 20).unwrap();
    disk.sync_all().unwrap();
    staging.put_bytes(Artefact::State, &[2; 5000]).unwrap();
    staging.set_parent("template.default.tiny").unwrap();
    staging.publish().unwrap();

    let template = node
        .get("template.default.tiny")
        .expect("GetSnapshot")
        .snapshot;
    let tdir = store.snapshot_dir("template.default.tiny");
    assert_eq!(template.memory_bytes, allocated(&tdir.join("memory")));
    assert!(template.memory_bytes > 0, "{template:?}");
    assert_eq!(template.disk_bytes, 0, "the template VM has no disk");
    assert_eq!(template.restore_bytes, u64::from(MIB) << 20, "{template:?}");

    let snap = node.get("pod-snap").expect("GetSnapshot").snapshot;
    let sdir = store.snapshot_dir("pod-snap");
    assert_eq!(snap.parent_id, "template.default.tiny");
    assert_eq!(snap.memory_bytes, allocated(&sdir.join("memory")));
    assert!(
        (3 * 4096..1 << 20).contains(&snap.memory_bytes),
        "holes are not counted: {snap:?}"
    );
    assert_eq!(snap.disk_bytes, allocated(&sdir.join("disk1")));
    assert!((65536..32 << 20).contains(&snap.disk_bytes), "{snap:?}");
    assert_eq!(snap.restore_bytes, (u64::from(MIB) << 20) + (32 << 20));

    let usage = node.store_usage().expect("GetStoreUsage");
    assert_eq!((usage.snapshots, usage.templates), (1, 1), "{usage:?}");
    assert_eq!(
        usage.allocated_bytes,
        allocated_under(&dir.path().join("store"))
    );
    assert!(usage.allocated_bytes >= snap.memory_bytes + snap.disk_bytes + template.memory_bytes);
    assert!(
        usage.free_bytes > 0 && usage.free_bytes < usage.capacity_bytes,
        "{usage:?}"
    );

    // Deleting the pod snapshot gives its bytes back.
    node.delete("pod-snap").expect("DeleteSnapshot");
    let after = node.store_usage().expect("GetStoreUsage");
    assert_eq!((after.snapshots, after.templates), (0, 1), "{after:?}");
    assert_eq!(
        after.allocated_bytes,
        allocated_under(&dir.path().join("store"))
    );
    assert!(
        after.allocated_bytes + snap.memory_bytes + snap.disk_bytes <= usage.allocated_bytes,
        "{after:?} {usage:?}"
    );
}

impl Node {
    fn collect(&self, referenced: &[&str], grace_s: u64) -> CollectGarbageResponse {
        let req = CollectGarbageRequest {
            referenced: referenced.iter().map(|s| s.to_string()).collect(),
            grace_seconds: grace_s,
            ..Default::default()
        };
        self.rt
            .block_on(self.node.collect_garbage(ctx(), &req))
            .expect("CollectGarbage")
    }

    fn retain(&self, id: &str) {
        let req = RetainSnapshotRequest {
            snapshot_id: id.into(),
            ..Default::default()
        };
        self.rt
            .block_on(self.node.retain_snapshot(ctx(), &req))
            .expect("RetainSnapshot");
    }
}

/// Publishes `id` (on `parent`) with `bytes` of memory.
fn publish_snapshot(store: &NodeStore, id: &str, parent: Option<&str>, bytes: usize) {
    let mut s = store.stage(id).unwrap();
    if let Some(p) = parent {
        s.set_parent(p).unwrap();
    }
    s.put_bytes(Artefact::State, b"state").unwrap();
    s.put_bytes(Artefact::Memory, &vec![7u8; bytes]).unwrap();
    s.publish().unwrap();
}

/// Issue 24, item 6: the node store's garbage collector reclaims a
/// snapshot nothing refers to (e.g. one the shim published after its
/// Snapshot object was deleted or timed out), children before parents,
/// and keeps every root: what the caller's objects name and their
/// parents, base templates, retained snapshots, snapshots a running VM
/// was restored from, and snapshots younger than the grace period.
#[test]
fn the_gc_reclaims_an_orphan_and_keeps_what_is_referred_to() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let node = Node::start(dir.path(), &config(dir.path(), 0));
    let store = NodeStore::open(&dir.path().join("store"), true).unwrap();
    publish_snapshot(&store, "orphan", None, 256 << 10);
    publish_snapshot(&store, "orphan.child", Some("orphan"), 64 << 10);
    publish_snapshot(&store, "pod.parent", None, 4096);
    publish_snapshot(&store, "pod.kept", Some("pod.parent"), 4096);
    publish_snapshot(&store, "base-0123456789abcdef", None, 4096);
    publish_snapshot(&store, "retained", None, 4096);
    node.retain("retained");
    node.retain("not-there");
    let vm = node.acquire("tiny").expect("AcquireVm");
    let orphans = ["orphan", "orphan.child"]
        .map(|id| allocated_under(&store.snapshot_dir(id)))
        .iter()
        .sum::<u64>();
    assert!(orphans >= (320 << 10), "{orphans}");

    // Within the grace period everything stays.
    let c = node.collect(&["pod.kept"], 3600);
    assert!(c.deleted.is_empty(), "{c:?}");
    assert!(store.get("orphan").is_ok());

    let c = node.collect(&["pod.kept"], 0);
    assert_eq!(c.deleted, ["orphan.child", "orphan"], "{c:?}");
    assert_eq!(c.reclaimed_bytes, orphans, "{c:?}");
    let mut left: Vec<String> = store.list().unwrap().into_iter().map(|s| s.id).collect();
    left.sort();
    assert_eq!(
        left,
        [
            "base-0123456789abcdef",
            "pod.kept",
            "pod.parent",
            "retained",
            "tiny"
        ]
    );

    // The VM gone, its template is garbage too; again, nothing more.
    sigkill(vm.pid);
    wait_until("the VMM is reaped", T, || gone(vm.pid));
    wait_until("the daemon saw it exit", T, || {
        node.status().handed_pids.is_empty()
    });
    let c = node.collect(&["pod.kept"], 0);
    assert_eq!(c.deleted, ["tiny"], "{c:?}");
    assert!(node.collect(&["pod.kept"], 0).deleted.is_empty());
}
