//! Restore-from through CRI, as a Clone's pods get it: a pod made through
//! containerd's CRI plugin runs a counter (in tmpfs, on its rootfs disk and
//! on stdout); the Twig service snapshots it (the controller's own client
//! and locator); then the test plays kubelet for a clone: RunPodSandbox
//! annotated `twig.dev/restore-from: <snapshot>` (the CRI runtime handler
//! passes `twig.dev/*` pod annotations), CreateContainer + StartContainer
//! of the same name adopt the snapshot's running counter, which goes on
//! from the snapshot's value under the clone's own hostname, on its own
//! copy of the disk, with its output in the clone's CRI log, while the
//! source runs on; a second clone of the snapshot reads other random bytes. Failures: an unknown snapshot id and a corrupt snapshot
//! fail RunPodSandbox with a clear error and leave no VMM, shim or mount.
//! Built with `--features lab`, run in the nested lab
//! (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test restore_from`).

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use twig_controller::crd::SnapshotMode;
use twig_controller::sandbox::{ContainerdLocator, SandboxLocator};
use twig_controller::shim::{TtrpcShim, TwigShim};
use twig_cri::api::PodSandboxConfig;
use twig_cri::{container_config, logs};
use twig_e2e::cri::{CriNode, CRI_NAMESPACE};
use twig_e2e::crilab::{runtime, CriLab, COUNTER, PROGRESS};
use twig_e2e::IMAGE_REF;
use twig_proto::node::StatusRequest;
use twig_proto::node_ttrpc::PoolClient;
use twig_store::{Artefact, NodeStore};

/// Deadline of a shim call (a full snapshot of the lab's 128 MiB guest
/// under TCG takes seconds).
const CALL: Duration = Duration::from_secs(300);
const POLL: Duration = Duration::from_millis(100);
const HANDLER: &str = "twig";
const ANNOTATION: &str = "twig.dev/restore-from";

/// Says how far the scenario got (seen with `--nocapture` in the lab's
/// console when a step hangs).
fn step(t0: Instant, what: &str) {
    eprintln!(
        "restore-from: {:>7.2} s  {what}",
        t0.elapsed().as_secs_f64()
    );
}

/// A unique snapshot id: the lab's nodes share one store.
fn snap_id(name: &str) -> String {
    format!("e2e-{}-{name}", std::process::id())
}

struct Harness(CriLab);

impl std::ops::Deref for Harness {
    type Target = CriLab;
    fn deref(&self) -> &CriLab {
        &self.0
    }
}

impl Harness {
    async fn start() -> Harness {
        Harness(CriLab::start().await)
    }

    /// A pod named `name`, annotated `restore-from` when given.
    fn pod(&self, name: &str, restore_from: Option<&str>) -> PodSandboxConfig {
        let mut pod = self.node.pod_config(name).unwrap_or_else(|e| panic!("{e}"));
        if let Some(id) = restore_from {
            pod.annotations.insert(ANNOTATION.into(), id.into());
        }
        pod
    }

    /// RunPodSandbox, then CreateContainer + StartContainer of the counter.
    async fn run_counter(&self, pod: &PodSandboxConfig) -> (String, String) {
        let pod_id = self
            .cri
            .run_pod_sandbox(pod, HANDLER)
            .await
            .unwrap_or_else(|e| self.fail("RunPodSandbox", e));
        let config = container_config(
            "counter",
            IMAGE_REF,
            &["/bin/sh", "-c", COUNTER],
            "counter.log",
        );
        let id = self
            .cri
            .create_container(&pod_id, &config, pod)
            .await
            .unwrap_or_else(|e| self.fail("CreateContainer counter", e));
        self.cri
            .start_container(&id)
            .await
            .unwrap_or_else(|e| self.fail("StartContainer counter", e));
        (pod_id, id)
    }

    /// The VMMs twig-node handed over and that have not exited.
    fn handed_vmms(&self) -> Vec<u32> {
        let socket = self.dir().join("node.sock");
        let client = ttrpc::Client::connect(&format!("unix://{}", socket.display()))
            .unwrap_or_else(|e| panic!("connecting to twig-node at {}: {e}", socket.display()));
        PoolClient::new(client)
            .status(
                ttrpc::context::with_timeout(10_000_000_000),
                &StatusRequest::default(),
            )
            .unwrap_or_else(|e| panic!("Pool.Status: {e}"))
            .handed_pids
    }

    /// Waits until no VMM is handed over and nothing of a pod is left.
    async fn wait_nothing_left(&self, vmms: &[u32]) {
        let deadline = Instant::now() + PROGRESS;
        loop {
            let handed = self.handed_vmms();
            let left = self.node.leftovers(vmms);
            if handed.is_empty() && left.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "left behind: handed-over VMMs {handed:?}, {left:?}\n{}",
                self.node.node().logs()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// RunPodSandbox of a pod restored from `snapshot`, which must fail;
    /// returns the error's text.
    async fn refused(&self, name: &str, snapshot: &str) -> String {
        let pod = self.pod(name, Some(snapshot));
        match self.cri.run_pod_sandbox(&pod, HANDLER).await {
            Ok(id) => panic!("RunPodSandbox restored from {snapshot} made pod {id}"),
            Err(e) => e.to_string(),
        }
    }
}

fn pod_of(config: &PodSandboxConfig) -> Pod {
    let mut pod = Pod::default();
    pod.metadata.uid = config.metadata.as_ref().map(|m| m.uid.clone());
    pod
}

#[test]
fn a_cri_pod_is_cloned_from_its_snapshot_and_adopts_its_running_container() {
    runtime().block_on(clone_scenario());
}

async fn clone_scenario() {
    let t0 = Instant::now();
    let h = Harness::start().await;
    step(t0, "node up");
    let src_pod = h.pod("counter-src", None);
    let (src_pod_id, src) = h.run_counter(&src_pod).await;
    h.wait_count(&src, "/dev/shm/count", |n| n >= 3).await;
    step(t0, "source counts");

    // Snapshot the source through the Twig service, as the controller does.
    let locator = ContainerdLocator::new(
        h.dir()
            .join("containerd/state/io.containerd.runtime.v2.task")
            .join(CRI_NAMESPACE),
    );
    let sandbox = locator
        .locate(&pod_of(&src_pod))
        .await
        .unwrap_or_else(|e| panic!("locating the source pod: {e}\n{}", h.node.node().logs()));
    assert_eq!(sandbox.id, src_pod_id);
    let shim = TtrpcShim { timeout: CALL };
    let snap = snap_id("clone-src");
    let before = h.wait_count(&src, "/dev/shm/count", |_| true).await;
    shim.snapshot(&sandbox, &snap, SnapshotMode::Full)
        .await
        .unwrap_or_else(|e| panic!("snapshot: {e}\n{}", h.node.node().logs()));
    let after = h.wait_count(&src, "/dev/shm/count", |_| true).await;
    step(t0, "snapshot");

    // The clone, as kubelet makes a Clone's pod.
    let clone_pod = h.pod("counter-clone", Some(&snap));
    let (clone_pod_id, clone) = h.run_counter(&clone_pod).await;
    step(t0, "clone created and started");
    // The counter goes on from the snapshot's value, not from 0.
    let first = h.wait_count(&clone, "/dev/shm/count", |_| true).await;
    assert!(
        first >= before,
        "the clone counts from {first}; the snapshot was taken between {before} and {after}"
    );
    let disk = h.wait_count(&clone, "/count", |_| true).await;
    assert!(
        disk >= before.saturating_sub(1),
        "the clone's disk says {disk}"
    );
    h.wait_count(&clone, "/dev/shm/count", |n| n > first + 5)
        .await;
    // Its output goes to the clone's CRI log from the adoption on, and
    // carries on the snapshot's count (what the source's shim had not read
    // yet at the snapshot comes first: at most a few lines before it).
    let log = CriNode::container_log(&clone_pod, "counter.log");
    let lines = logs::wait_for(&log, PROGRESS, |l| l.len() >= 3)
        .await
        .unwrap_or_else(|e| panic!("the clone's log: {e}\n{}", h.node.node().logs()));
    let counted: Vec<u64> = lines
        .iter()
        .filter_map(|l| l.text.strip_prefix("count ")?.parse().ok())
        .collect();
    let lowest = counted.iter().min().copied().unwrap_or_default();
    assert!(
        lowest + 20 >= before && lowest > 1,
        "the clone's log counts from {lowest}, the snapshot was past {before}: {lines:?}"
    );
    step(t0, "the clone counts on");

    // Its own identity, and its own disk.
    let (_, src_host) = h.exec(&src, &["hostname"]).await;
    let (_, clone_host) = h.exec(&clone, &["hostname"]).await;
    assert_eq!(src_host, "counter-src");
    assert_eq!(clone_host, "counter-clone");
    let (code, _) = h
        .exec(&clone, &["sh", "-c", "echo clone > /clone-mark && sync"])
        .await;
    assert_eq!(code, 0);
    let (code, _) = h
        .exec(&src, &["sh", "-c", "echo source > /src-mark && sync"])
        .await;
    assert_eq!(code, 0);
    let (code, _) = h.exec(&src, &["test", "-e", "/clone-mark"]).await;
    assert_ne!(code, 0, "the clone's file shows in the source");
    let (code, _) = h.exec(&clone, &["test", "-e", "/src-mark"]).await;
    assert_ne!(code, 0, "the source's file shows in the clone");
    // The source runs on.
    h.wait_count(&src, "/dev/shm/count", |n| n > after + 5)
        .await;
    step(t0, "identity and isolation");

    // A container created new in the clone joins the pod's namespaces —
    // the snapshotted sandbox's, which the clone's sandbox adopted — so,
    // in the pod's shared pid namespace (CRI's default here), it sees the
    // adopted counter.
    let probe = container_config("probe", IMAGE_REF, &["sleep", "3600"], "probe.log");
    let probe = h
        .cri
        .create_container(&clone_pod_id, &probe, &clone_pod)
        .await
        .unwrap_or_else(|e| h.fail("CreateContainer probe", e));
    h.cri
        .start_container(&probe)
        .await
        .unwrap_or_else(|e| h.fail("StartContainer probe", e));
    // `[c]` keeps the probe's own command line from matching.
    let (_, seen) = h
        .exec(
            &probe,
            &[
                "sh",
                "-c",
                "grep -l 'shm/[c]ount.new' /proc/[0-9]*/cmdline 2>/dev/null; true",
            ],
        )
        .await;
    assert!(
        seen.lines().any(|l| l.starts_with("/proc/")),
        "a new container in the clone does not see the adopted counter: {seen:?}"
    );
    step(t0, "a new container joins the clone's pod namespaces");

    // A second clone of the same snapshot: its own name, and RNG output of
    // its own (the guest's CRNG was reseeded with fresh host entropy).
    let second_pod = h.pod("counter-clone-2", Some(&snap));
    let t = Instant::now();
    let (second_pod_id, second) = h.run_counter(&second_pod).await;
    eprintln!(
        "restore-from: a clone's RunPodSandbox + CreateContainer + StartContainer took {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let (_, second_host) = h.exec(&second, &["hostname"]).await;
    assert_eq!(second_host, "counter-clone-2");
    let random = "head -c 16 /dev/urandom | od -An -tx1";
    let (_, a) = h.exec(&clone, &["sh", "-c", random]).await;
    let (_, b) = h.exec(&second, &["sh", "-c", random]).await;
    assert!(a.len() > 30 && b.len() > 30, "{a:?} {b:?}");
    assert_ne!(
        a, b,
        "two clones of one snapshot read the same random bytes"
    );
    step(t0, "a second clone, its own RNG");

    let vmms = h.node.pod_vmms();
    assert_eq!(vmms.len(), 3, "pod VMMs {vmms:?}");
    for pod in [&second_pod_id, &clone_pod_id, &src_pod_id] {
        h.remove_pod(pod).await;
    }
    h.wait_nothing_left(&vmms).await;
    step(t0, "all removed, nothing left");
    let store = NodeStore::open(&h.node.node().vm_store().unwrap(), false).unwrap();
    if let Err(e) = store.delete(&snap) {
        eprintln!("deleting snapshot {snap}: {e}");
    }
}

#[test]
fn restoring_an_unknown_or_corrupt_snapshot_fails_and_leaves_nothing() {
    runtime().block_on(failure_scenario());
}

async fn failure_scenario() {
    let t0 = Instant::now();
    let h = Harness::start().await;
    let missing = snap_id("no-such-snapshot");
    let e = h.refused("unknown", &missing).await;
    assert!(e.contains(&missing) && e.contains(ANNOTATION), "{e}");
    h.wait_nothing_left(&[]).await;
    step(t0, "unknown snapshot refused");

    // A pod snapshot, copied under another id with its memory cut short.
    let pod = h.pod("to-corrupt", None);
    let (pod_id, ctr) = h.run_counter(&pod).await;
    h.wait_count(&ctr, "/dev/shm/count", |n| n >= 3).await;
    let locator = ContainerdLocator::new(
        h.dir()
            .join("containerd/state/io.containerd.runtime.v2.task")
            .join(CRI_NAMESPACE),
    );
    let sandbox = locator
        .locate(&pod_of(&pod))
        .await
        .unwrap_or_else(|e| panic!("locating the pod: {e}"));
    let (good, bad) = (snap_id("good"), snap_id("corrupt"));
    TtrpcShim { timeout: CALL }
        .snapshot(&sandbox, &good, SnapshotMode::Full)
        .await
        .unwrap_or_else(|e| panic!("snapshot: {e}\n{}", h.node.node().logs()));
    let vmms = h.node.pod_vmms();
    h.remove_pod(&pod_id).await;
    h.wait_nothing_left(&vmms).await;
    let store = NodeStore::open(&h.node.node().vm_store().unwrap(), false).unwrap();
    let original = store.get(&good).unwrap();
    let mut copy = store.stage(&bad).unwrap();
    for a in original.artefacts.keys() {
        copy.put_file(*a, &original.dir().join(a.file_name()))
            .unwrap();
    }
    for (k, v) in &original.labels {
        copy.set_label(k, v);
    }
    if let Some(owner) = &original.owner {
        copy.set_owner(owner).unwrap();
    }
    let corrupt = copy.publish().unwrap();
    // As readable to the jailed VMMs as the original (the store makes
    // its own copies private).
    for name in std::iter::once(None).chain(original.artefacts.keys().map(Some)) {
        let at =
            |dir: &std::path::Path| name.map_or(dir.to_path_buf(), |a| dir.join(a.file_name()));
        let mode = std::fs::metadata(at(original.dir())).unwrap().permissions();
        std::fs::set_permissions(at(corrupt.dir()), mode).unwrap();
    }
    let memory = corrupt.dir().join(Artefact::Memory.file_name());
    let len = std::fs::metadata(&memory).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&memory)
        .and_then(|f| f.set_len(len / 2))
        .unwrap();
    let e = h.refused("corrupt", &bad).await;
    assert!(
        e.contains(&bad) && e.contains("memory file"),
        "not a clear error: {e}"
    );
    h.wait_nothing_left(&[]).await;
    step(t0, "corrupt snapshot refused");
    for id in [&bad, &good] {
        if let Err(e) = store.delete(id) {
            eprintln!("deleting snapshot {id}: {e}");
        }
    }
}
