//! The shim's `Twig` service as the controller uses it, with the
//! controller's own code: `ContainerdLocator` finds the pod's shim in
//! containerd's real runtime-v2 state (a `ctr run -d` container carrying
//! CRI's sandbox annotations: the lab has no CRI client yet), and
//! `TtrpcShim` snapshots, rolls back and asks for stats over the shim's
//! socket. The guest's state must come back — a counter in tmpfs, files on
//! the container's rootfs disk — and the container keeps running and
//! answers `ctr task exec`. Failures: a rollback to a snapshot that does not
//! exist, and a snapshot into a full store, leave the pod running and
//! nothing half-written in the store. Built with `--features lab`, run in
//! the nested lab (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab`).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use twig_controller::crd::SnapshotMode;
use twig_controller::sandbox::{ContainerdLocator, SandboxLocator};
use twig_controller::shim::{Sandbox, ShimError, TtrpcShim, TwigShim};
use twig_e2e::crilab::runtime;
use twig_e2e::{fill_up, find_on_path, Node, NodeConfig, Runtime, IMAGE_REF};
use twig_store::NodeStore;

/// Deadline of a shim call (a full snapshot of the lab's 128 MiB guest
/// under TCG takes seconds).
const CALL: Duration = Duration::from_secs(300);
/// Deadline of the guest's progress (the lab is slow).
const PROGRESS: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(100);

/// Counts in tmpfs (`/dev/shm/count`, guest memory) and on the rootfs disk
/// (`/count`), every 50 ms; each file is replaced by a rename, so a reader
/// never sees it half-written.
const COUNTER: &str = "i=0; while :; do i=$((i+1)); echo $i > /dev/shm/count.new; \
     mv /dev/shm/count.new /dev/shm/count; echo $i > /count.new; mv /count.new /count; \
     sleep 0.05; done";

fn node(config: Option<NodeConfig>) -> Node {
    assert!(
        find_on_path(Runtime::Twig.shim()).is_some(),
        "containerd-shim-twig-v2 not found in the workspace build (not on PATH); \
         tests/lab/run.sh carries it into the lab"
    );
    match config {
        Some(c) => Node::start_with(&c),
        None => Node::start(),
    }
    .unwrap_or_else(|e| panic!("the node did not start: {e}"))
}

/// A unique snapshot id: the lab's nodes share one store.
fn snap_id(name: &str) -> String {
    format!("e2e-{}-{name}", std::process::id())
}

/// A CRI-style pod `id` of pod `uid`, made with `ctr run -d` as CRI makes
/// one: its sandbox container (which the shim gives the agent's built-in
/// pause) and one app container, `counter` ([`counter_of`]), running the
/// counter; waits until it has counted.
fn run_counter(node: &Node, id: &str, uid: &str) {
    let uid_note = format!("io.kubernetes.cri.sandbox-uid={uid}");
    run_detached(
        node,
        id,
        &["io.kubernetes.cri.container-type=sandbox", &uid_note],
        "sleep 1000000",
    );
    let sandbox_note = format!("io.kubernetes.cri.sandbox-id={id}");
    run_detached(
        node,
        &counter_of(id),
        &[
            "io.kubernetes.cri.container-type=container",
            &sandbox_note,
            "io.kubernetes.cri.container-name=counter",
        ],
        COUNTER,
    );
    wait_count(node, id, "/dev/shm/count", |n| n >= 3);
}

/// The counter container of pod `id`.
fn counter_of(id: &str) -> String {
    format!("{id}-counter")
}

/// `ctr run -d` of `script` as `id` with the OCI annotations `notes`.
fn run_detached(node: &Node, id: &str, notes: &[&str], script: &str) {
    let mut args = vec![
        "run",
        "-d",
        "--runtime",
        Runtime::Twig.name(),
        "--snapshotter",
        "twig",
    ];
    for n in notes {
        args.extend(["--annotation", n]);
    }
    args.extend([IMAGE_REF, id, "sh", "-c", script]);
    let out = node
        .ctr(args)
        .unwrap_or_else(|e| panic!("ctr run -d: {e}\n{}", node.logs()));
    assert!(
        out.status.success(),
        "ctr run -d of {id} failed: {out}\n{}",
        node.logs()
    );
}

static EXECS: AtomicU32 = AtomicU32::new(0);

/// `ctr task exec` of `argv` in pod `id`'s counter container: (exit
/// code, stdout).
fn exec(node: &Node, id: &str, argv: &[&str]) -> (Option<i32>, String) {
    let exec_id = format!("x{}", EXECS.fetch_add(1, Ordering::SeqCst));
    let counter = counter_of(id);
    let mut args = vec!["task", "exec", "--exec-id", &exec_id, &counter];
    args.extend_from_slice(argv);
    let out = node
        .ctr(args)
        .unwrap_or_else(|e| panic!("ctr task exec: {e}\n{}", node.logs()));
    (out.code(), out.stdout)
}

/// The counter in `file`, read through `ctr task exec`.
fn count(node: &Node, id: &str, file: &str) -> u64 {
    let (code, out) = exec(node, id, &["cat", file]);
    assert_eq!(code, Some(0), "cat {file}: {out}\n{}", node.logs());
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{file} holds {out:?}"))
}

/// Polls the counter in `file` until `ok` holds.
fn wait_count(node: &Node, id: &str, file: &str, ok: impl Fn(u64) -> bool) -> u64 {
    let deadline = Instant::now() + PROGRESS;
    loop {
        let (code, out) = exec(node, id, &["cat", file]);
        if let (Some(0), Ok(n)) = (code, out.trim().parse::<u64>()) {
            if ok(n) {
                return n;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{file} of {id} did not get there within {PROGRESS:?} (last: {out:?})\n{}",
            node.logs()
        );
        std::thread::sleep(POLL);
    }
}

fn task_running(node: &Node, id: &str) -> bool {
    let ls = node.ctr_ok(["task", "ls"]).unwrap_or_default();
    ls.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.first() == Some(&id) && f.get(2) == Some(&"RUNNING")
    })
}

/// Kills pod `id`'s tasks (its counter, then its sandbox) and deletes
/// each once it stopped, so its shim stops the VM.
fn stop(node: &Node, id: &str) {
    for task in [counter_of(id), id.to_string()] {
        node.ctr_ok(["task", "kill", "-s", "KILL", &task])
            .unwrap_or_else(|e| panic!("{e}\n{}", node.logs()));
        let deadline = Instant::now() + PROGRESS;
        while task_running(node, &task) {
            assert!(
                Instant::now() < deadline,
                "{task} did not stop\n{}",
                node.logs()
            );
            std::thread::sleep(POLL);
        }
        node.ctr_ok(["task", "delete", &task])
            .unwrap_or_else(|e| panic!("{e}\n{}", node.logs()));
    }
}

fn pod(uid: &str) -> Pod {
    let mut pod = Pod::default();
    pod.metadata.uid = Some(uid.to_string());
    pod
}

/// Removes the snapshots (children first) from the store, and gives the
/// freed blocks back to what backs the filesystem (`fstrim`: the lab's XFS
/// is a loop file in memory, which keeps deleted blocks otherwise).
fn delete_snapshots(store: &NodeStore, ids: &[&str]) {
    for id in ids {
        if let Err(e) = store.delete(id) {
            eprintln!("deleting snapshot {id}: {e}");
        }
    }
    if find_on_path("fstrim").is_some() {
        let trimmed = std::process::Command::new("fstrim")
            .arg(store.root())
            .status();
        if !trimmed.as_ref().is_ok_and(|s| s.success()) {
            eprintln!("fstrim {} failed: {trimmed:?}", store.root().display());
        }
    }
}

#[test]
fn snapshot_rollback_and_stats_through_the_controllers_client() {
    let node = node(None);
    let id = "svc-rollback";
    let uid = "0b5e2c4a-1111-4c3e-9a43-e2e000000001";
    run_counter(&node, id, uid);
    let rt = runtime();
    let shim = TtrpcShim { timeout: CALL };

    // The controller finds the pod's shim in containerd's state.
    let locator = ContainerdLocator::new(node.task_dir().unwrap());
    let sandbox = rt
        .block_on(locator.locate(&pod(uid)))
        .unwrap_or_else(|e| panic!("locating pod {uid}: {e}\n{}", node.logs()));
    assert_eq!(sandbox.id, id);
    assert_eq!(sandbox.address, node.shim_address(id).unwrap());
    let other = rt.block_on(locator.locate(&pod("no-such-uid")));
    assert!(other.is_err(), "{other:?}");

    let (s1, s2) = (snap_id("s1"), snap_id("s2"));
    let before = count(&node, id, "/dev/shm/count");
    let t = Instant::now();
    let info = rt
        .block_on(shim.snapshot(&sandbox, &s1, SnapshotMode::Full))
        .unwrap_or_else(|e| panic!("snapshot: {e}\n{}", node.logs()));
    let full_ms = t.elapsed().as_secs_f64() * 1e3;
    let after = count(&node, id, "/dev/shm/count");
    assert_eq!(info.snapshot_id, s1);
    assert_eq!(info.parent_id, None);
    assert!(info.size_bytes > 0 && info.written_bytes > 0, "{info:?}");
    // The store holds it, with the pod's containers recorded.
    let store = NodeStore::open(&node.vm_store().unwrap(), false).unwrap();
    let stored = store.get(&s1).expect("the snapshot in the node store");
    assert_eq!(stored.labels["twig.dev/sandbox-id"], id);
    assert!(
        stored.labels["twig.dev/containers"].contains("\"counter\""),
        "{:?}",
        stored.labels
    );
    assert!(
        stored
            .artefacts
            .keys()
            .any(|a| matches!(a, twig_store::Artefact::Disk(_))),
        "the container's rootfs disk is in the snapshot: {:?}",
        stored.artefacts
    );

    // Let the guest move on, and leave marks on its disk and in tmpfs.
    let (code, _) = exec(
        &node,
        id,
        &["sh", "-c", "touch /after; touch /dev/shm/after; sync"],
    );
    assert_eq!(code, Some(0));
    let moved = wait_count(&node, id, "/dev/shm/count", |n| n > after + 40);

    let t = Instant::now();
    rt.block_on(shim.rollback(&sandbox, &s1, "op-1"))
        .unwrap_or_else(|e| panic!("rollback: {e}\n{}", node.logs()));
    let rollback_ms = t.elapsed().as_secs_f64() * 1e3;
    // Back: the counter went back (it had moved 40 past the snapshot), the
    // marks are gone, and the container keeps counting and answers exec.
    let back = count(&node, id, "/dev/shm/count");
    assert!(
        back >= before && back < moved,
        "after the rollback the counter is {back}; snapshot between {before} and {after}, \
         before the rollback {moved}"
    );
    for mark in ["/after", "/dev/shm/after"] {
        let (code, out) = exec(&node, id, &["ls", mark]);
        assert_ne!(code, Some(0), "{mark} survived the rollback: {out}");
    }
    let disk = count(&node, id, "/count");
    assert!(
        disk < moved,
        "the rootfs file says {disk}, before the rollback {moved}"
    );
    wait_count(&node, id, "/dev/shm/count", |n| n > back + 5);
    assert!(task_running(&node, id));

    // Idempotent on the operation id; stats.
    rt.block_on(shim.rollback(&sandbox, &s1, "op-1"))
        .expect("repeated rollback");
    let t = Instant::now();
    let inc = rt
        .block_on(shim.snapshot(&sandbox, &s2, SnapshotMode::Incremental))
        .unwrap_or_else(|e| panic!("incremental snapshot: {e}\n{}", node.logs()));
    let inc_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(inc.parent_id.as_deref(), Some(s1.as_str()));
    let stats = rt.block_on(shim.stats(&sandbox)).expect("stats");
    let ids: Vec<&str> = stats
        .snapshots
        .iter()
        .map(|s| s.snapshot_id.as_str())
        .collect();
    assert_eq!(ids, [s1.as_str(), s2.as_str()]);
    assert_eq!(stats.last_rollback_operation_id.as_deref(), Some("op-1"));

    // A snapshot that does not exist: NOT_FOUND, the pod runs on.
    let e = rt
        .block_on(shim.rollback(&sandbox, "e2e-no-such-snapshot", "op-2"))
        .unwrap_err();
    assert!(matches!(e, ShimError::NotFound(_)), "{e}");
    assert!(e.to_string().contains("e2e-no-such-snapshot"), "{e}");
    let now = count(&node, id, "/dev/shm/count");
    wait_count(&node, id, "/dev/shm/count", |n| n > now);
    assert!(task_running(&node, id));

    eprintln!(
        "twig service through the shim (TCG lab, relative only): full snapshot {full_ms:.0} ms, \
         rollback {rollback_ms:.0} ms, incremental snapshot {inc_ms:.0} ms"
    );
    stop(&node, id);
    delete_snapshots(&store, &[&s2, &s1]);
}

#[test]
fn a_snapshot_into_a_full_store_fails_cleanly_and_the_pod_runs_on() {
    // Its own XFS, so that filling it disturbs no other node.
    let mut config = NodeConfig::from_env().expect("the node's environment");
    config.xfs = None;
    let node = node(Some(config));
    let id = "svc-full";
    let uid = "0b5e2c4a-2222-4c3e-9a43-e2e000000002";
    run_counter(&node, id, uid);
    let rt = runtime();
    let shim = TtrpcShim { timeout: CALL };
    let sandbox = Sandbox {
        id: id.to_string(),
        address: node.shim_address(id).unwrap(),
    };
    let store_dir = node.vm_store().unwrap();
    let filler = fill_up(&store_dir, 4 << 20).expect("filling the store's filesystem");

    let e = rt
        .block_on(shim.snapshot(&sandbox, "full-1", SnapshotMode::Full))
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("No space left") || text.contains("no space left"),
        "not a clear full-disk error: {text}"
    );
    // Nothing half-written: no snapshot, no staging left.
    let store = NodeStore::open(&store_dir, false).unwrap();
    assert!(store.get("full-1").is_err(), "a snapshot was published");
    let staged: Vec<_> = std::fs::read_dir(store_dir.join("tmp"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(staged.is_empty(), "left in the store's tmp/: {staged:?}");
    // The pod runs on.
    std::fs::remove_file(&filler).unwrap();
    let now = count(&node, id, "/dev/shm/count");
    wait_count(&node, id, "/dev/shm/count", |n| n > now);
    assert!(task_running(&node, id));
    // With room again, the same snapshot succeeds.
    let info = rt
        .block_on(shim.snapshot(&sandbox, "full-1", SnapshotMode::Full))
        .unwrap_or_else(|e| panic!("snapshot with room: {e}\n{}", node.logs()));
    assert_eq!(info.snapshot_id, "full-1");
    stop(&node, id);
}
