//! The `Twig` service over ttrpc (the generated `TwigClient`, as the
//! controller calls it) next to the Task service, against a real twig-agent
//! on the host. The VM is a stand-in ([`FakeVm`]: a [`HostSandbox`] whose
//! snapshots write small artefacts into the real node store, on a loop XFS,
//! and whose rollbacks succeed, are refused or lose the VM on request), so
//! this checks what the service owns: the queue, idempotency, the store's
//! staging and publication, the pod's labels, error codes, and what the
//! Task service reports after a lost VM. Real VMs are checked in the lab
//! (`e2e/tests/twig_service.rs`). Needs root (loop devices, mounts).

use std::io::{Read, Seek, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use containerd_shim::asynchronous::ExitSignal;
use containerd_shim_protos::api;
use containerd_shim_protos::shim_async::TaskClient;
use containerd_shim_protos::ttrpc::context::Context;
use containerd_shim_protos::ttrpc::r#async::{transport::Listener, Client, Server};
use containerd_shim_protos::ttrpc::Code;
use containerd_shim_protos::types::task::Status;
use serde_json::json;
use tokio::sync::mpsc;
use twig_agent::client::AgentClient;
use twig_agent::proto::agent::BlockVolume;
use twig_net::{Counters, EgressPolicy, Reason};
use twig_proto::twig as pb;
use twig_proto::twig_ttrpc::TwigClient;
use twig_shim::labels::{SnapshotContainer, CONTAINERS_LABEL, SANDBOX_LABEL};
use twig_shim::pod::Event;
use twig_shim::restore::SnapshotSource;
use twig_shim::sandbox::{
    Attachment, Fixed, HostSandbox, NetworkStats, Restored, Sandbox, VmRollback, VmSnapshot,
    SANDBOX_ADOPTION,
};
use twig_shim::server::task_services;
use twig_shim::service::TaskService;
use twig_shim::twig_service::TwigService;
use twig_shim::{Error, Result};
use twig_store::{Artefact, Kind, Manifest, NodeStore};
use twig_vmm::api::ClientError;
use twig_vmm::ErrorKind;

mod common;
use common::{bundle, code, ctx, twig_mount, Agent, T};

const SANDBOX: &str = "pod-1";
/// The Kubernetes namespace of the fixture's pod (CRI's annotation).
const NAMESPACE: &str = "team-a";

/// What the next rollback of the [`FakeVm`] does.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Outcome {
    Ok,
    Refused,
    Lost,
}

/// A host agent in place of the VM's, and a VMM's snapshot and rollback
/// reduced to what the service sees.
struct FakeVm {
    host: HostSandbox,
    /// The node store (on a loop XFS).
    store: std::path::PathBuf,
    baseline: Mutex<Option<String>>,
    /// When set, the next snapshot waits for a message on it.
    hold: Mutex<Option<std_mpsc::Receiver<()>>>,
    /// When set, the next disk detach waits for a message on it.
    detach_hold: Mutex<Option<std_mpsc::Receiver<()>>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    snapshots: AtomicUsize,
    rollbacks: AtomicUsize,
    next_rollback: Mutex<Outcome>,
    restored: Mutex<Vec<Restored>>,
    /// The network path's policy; `None`: the pod has no path.
    policy: Mutex<Option<EgressPolicy>>,
}

impl FakeVm {
    fn enter(&self) {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(n, Ordering::SeqCst);
    }

    fn leave(&self) {
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn vmm_error(kind: ErrorKind, message: &str) -> Error {
    Error::Vmm {
        what: "the fake VM".into(),
        source: ClientError::Vmm {
            kind,
            message: message.into(),
        },
    }
}

impl Sandbox for FakeVm {
    fn agent(&self) -> AgentClient {
        self.host.agent()
    }

    fn agent_epoch(&self) -> u64 {
        self.host.agent_epoch()
    }

    fn attach_disk(&self, image: &Path, read_only: bool) -> Result<Attachment> {
        self.host.attach_disk(image, read_only)
    }

    fn create_container(
        &self,
        id: &str,
        image: &Path,
        read_only: bool,
        block_volumes: Vec<BlockVolume>,
        spec_json: &[u8],
    ) -> Result<Attachment> {
        let a = self
            .host
            .create_container(id, image, read_only, block_volumes, spec_json)?;
        // A VM's rootfs sits on a disk slot.
        Ok(Attachment { slot: Some(0), ..a })
    }

    fn detach(&self, attachment: &Attachment) -> Result<()> {
        if let Some(rx) = self.detach_hold.lock().unwrap().take() {
            rx.recv_timeout(T)
                .expect("the test releases the held detach");
        }
        // Like a VMM's slot, a loop device detaches once: again, it fails.
        self.host.detach(attachment)
    }

    fn pause(&self) -> Result<()> {
        self.host.pause()
    }

    fn resume(&self) -> Result<()> {
        self.host.resume()
    }

    fn shutdown(&self) -> Result<()> {
        self.host.shutdown()
    }

    fn snapshot(&self, staging: &Path, full: bool) -> Result<VmSnapshot> {
        self.enter();
        self.snapshots.fetch_add(1, Ordering::SeqCst);
        if let Some(rx) = self.hold.lock().unwrap().take() {
            rx.recv_timeout(T)
                .expect("the test releases the held snapshot");
        }
        let id = staging.file_name().unwrap().to_string_lossy().into_owned();
        let parent = if full {
            None
        } else {
            self.baseline.lock().unwrap().clone()
        };
        let write = || -> std::io::Result<()> {
            std::fs::write(staging.join("state"), b"vcpu and device state")?;
            // Guest RAM of 1 MiB, 3 pages of it written; a sparse disk.
            let memory = std::fs::File::create(staging.join("memory"))?;
            memory.set_len(1 << 20)?;
            memory.write_all_at(&[7u8; 3 * 4096], 64 << 10)?;
            let disk = std::fs::File::create(staging.join("disk0"))?;
            disk.set_len(4 << 20)?;
            disk.write_all_at(&[1u8; 8192], 0)?;
            memory.sync_all()?;
            disk.sync_all()?;
            Ok(())
        };
        let r = write()
            .map_err(|e| Error::io("writing the fake snapshot", e))
            .and_then(|()| {
                let kind = if full { Kind::Full } else { Kind::Incremental };
                Manifest::of_staging(staging, &id, parent.as_deref(), kind)
                    .and_then(|m| m.write(staging))
                    .map_err(|e| Error::Internal(e.to_string()))
            });
        self.leave();
        r?;
        *self.baseline.lock().unwrap() = Some(id);
        Ok(VmSnapshot {
            parent,
            pages_written: 3,
        })
    }

    fn rollback(&self, dir: &Path) -> Result<VmRollback> {
        self.enter();
        self.rollbacks.fetch_add(1, Ordering::SeqCst);
        let outcome = *self.next_rollback.lock().unwrap();
        self.leave();
        match outcome {
            Outcome::Ok => {
                *self.baseline.lock().unwrap() =
                    Some(dir.file_name().unwrap().to_string_lossy().into_owned());
                Ok(VmRollback {
                    pages_restored: 3,
                    remapped: false,
                })
            }
            Outcome::Refused => Err(vmm_error(
                ErrorKind::Refused,
                "rollback failed and was undone; the VM runs on its previous state",
            )),
            Outcome::Lost => Err(vmm_error(ErrorKind::Lost, "the VM is lost")),
        }
    }

    fn snapshot_store(&self) -> Result<std::path::PathBuf> {
        Ok(self.store.clone())
    }

    fn restored_for(&self, name: &str) -> Option<Restored> {
        let restored = self.restored.lock().unwrap();
        restored.iter().find(|r| r.name == name).cloned()
    }

    fn take_restored(&self, name: &str) -> Option<Restored> {
        let mut restored = self.restored.lock().unwrap();
        let i = restored.iter().position(|r| r.name == name)?;
        Some(restored.remove(i))
    }

    fn network_stats(&self) -> Result<Option<NetworkStats>> {
        Ok(self
            .policy
            .lock()
            .unwrap()
            .clone()
            .map(|policy| NetworkStats {
                policy,
                counters: Counters::default(),
            }))
    }

    fn set_egress_policy(&self, policy: &EgressPolicy) -> Result<()> {
        match &mut *self.policy.lock().unwrap() {
            Some(p) => {
                *p = policy.clone();
                Ok(())
            }
            None => Err(Error::FailedPrecondition("no path".into())),
        }
    }
}

/// Runs a command, panicking with its output when it fails.
fn sh(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A loop-mounted XFS with reflinks (a node store's filesystem), unmounted
/// on drop.
struct LoopXfs {
    dir: tempfile::TempDir,
    loopdev: String,
}

impl LoopXfs {
    fn new(size_mib: u64) -> LoopXfs {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("xfs.img");
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(size_mib << 20))
            .unwrap();
        sh(Command::new("mkfs.xfs")
            .args(["-q", "-m", "reflink=1"])
            .arg(&img));
        let loopdev = sh(Command::new("losetup").args(["--find", "--show"]).arg(&img))
            .trim()
            .to_string();
        let fs = LoopXfs { dir, loopdev };
        std::fs::create_dir(fs.path()).unwrap();
        sh(Command::new("mount").arg(&fs.loopdev).arg(fs.path()));
        fs
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("mnt")
    }
}

impl Drop for LoopXfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.path()).status();
        let _ = Command::new("losetup").args(["-d", &self.loopdev]).status();
    }
}

struct Fixture {
    task: TaskClient,
    twig: TwigClient,
    vm: Arc<FakeVm>,
    events: mpsc::UnboundedReceiver<Event>,
    dir: tempfile::TempDir,
    store: LoopXfs,
    _server: Server,
    _agent: Agent,
}

async fn fixture(queue_deadline: Duration) -> Fixture {
    let agent = Agent::start();
    let host = tokio::task::spawn_blocking({
        let s = agent.socket.clone();
        move || HostSandbox::connect(&s, T)
    })
    .await
    .unwrap()
    .expect("connecting to the host agent");
    let store = tokio::task::spawn_blocking(|| LoopXfs::new(320))
        .await
        .unwrap();
    let vm = Arc::new(FakeVm {
        host,
        store: store.path(),
        baseline: Mutex::new(None),
        hold: Mutex::new(None),
        detach_hold: Mutex::new(None),
        in_flight: AtomicUsize::new(0),
        max_in_flight: AtomicUsize::new(0),
        snapshots: AtomicUsize::new(0),
        rollbacks: AtomicUsize::new(0),
        next_rollback: Mutex::new(Outcome::Ok),
        restored: Mutex::new(Vec::new()),
        policy: Mutex::new(None),
    });
    let (tx, events) = mpsc::unbounded_channel();
    let exit = Arc::new(ExitSignal::default());
    let task = TaskService::new(Arc::new(Fixed(vm.clone())), tx, exit, T);
    let twig = TwigService::new(task.pod().clone(), SANDBOX.into(), queue_deadline);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("shim.sock");
    let listener =
        Listener::try_from(std::os::unix::net::UnixListener::bind(&sock).unwrap()).unwrap();
    let mut server = Server::new()
        .add_listener(listener)
        .register_service(task_services(task))
        .register_service(twig.services());
    server.start().await.unwrap();
    let address = format!("unix://{}", sock.display());
    Fixture {
        task: TaskClient::new(Client::connect(&address).await.unwrap()),
        twig: TwigClient::new(Client::connect(&address).await.unwrap()),
        vm,
        events,
        dir,
        store,
        _server: server,
        _agent: agent,
    }
}

impl Fixture {
    /// A second shim's Task service on the same VM (as a shim whose VM was
    /// restored from a snapshot of this pod sees it).
    async fn second_shim(&self) -> (TaskClient, Server) {
        let (tx, _events) = mpsc::unbounded_channel();
        let exit = Arc::new(ExitSignal::default());
        let task = TaskService::new(Arc::new(Fixed(self.vm.clone())), tx, exit, T);
        let sock = self.dir.path().join("shim2.sock");
        let listener =
            Listener::try_from(std::os::unix::net::UnixListener::bind(&sock).unwrap()).unwrap();
        let mut server = Server::new()
            .add_listener(listener)
            .register_service(task_services(task));
        server.start().await.unwrap();
        let client = Client::connect(&format!("unix://{}", sock.display()))
            .await
            .unwrap();
        (TaskClient::new(client), server)
    }

    /// Creates and starts container `id` (a shell that sleeps), named
    /// `name` by CRI's annotation, in pod namespace [`NAMESPACE`].
    async fn run(&self, id: &str, name: &str) {
        let (b, img) = bundle(
            self.dir.path(),
            id,
            &["sleep", "1000"],
            json!({"annotations": {"io.kubernetes.cri.container-name": name,
                                   "io.kubernetes.cri.sandbox-namespace": NAMESPACE}}),
        );
        let create = api::CreateTaskRequest {
            id: id.into(),
            bundle: b.display().to_string(),
            rootfs: vec![twig_mount(&img)],
            ..Default::default()
        };
        self.task.create(ctx(), &create).await.expect("create");
        let start = api::StartRequest {
            id: id.into(),
            ..Default::default()
        };
        self.task.start(ctx(), &start).await.expect("start");
    }

    async fn state(&self, id: &str) -> api::StateResponse {
        let req = api::StateRequest {
            id: id.into(),
            ..Default::default()
        };
        self.task.state(ctx(), &req).await.expect("state")
    }

    async fn snapshot(
        &self,
        c: Context,
        id: &str,
        full: bool,
    ) -> ttrpc_result::R<pb::SnapshotInfo> {
        snapshot(self.twig.clone(), c, id, full).await
    }

    async fn rollback(&self, id: &str, op: &str) -> ttrpc_result::R<()> {
        let req = pb::RollbackRequest {
            sandbox_id: SANDBOX.into(),
            snapshot_id: id.into(),
            operation_id: op.into(),
            ..Default::default()
        };
        self.twig.rollback(ctx(), &req).await.map(|_| ())
    }

    async fn stats(&self) -> pb::StatsResponse {
        let req = pb::StatsRequest {
            sandbox_id: SANDBOX.into(),
            ..Default::default()
        };
        self.twig.stats(ctx(), &req).await.expect("stats")
    }

    fn store(&self) -> NodeStore {
        NodeStore::open(&self.store.path(), false).expect("the node store")
    }

    /// The store's staging area holds nothing.
    fn nothing_staged(&self) {
        let tmp = self.store.path().join("tmp");
        let left: Vec<_> = std::fs::read_dir(&tmp)
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "left in {}: {left:?}", tmp.display());
    }
}

/// Snapshot `id` of the pod through `twig`.
async fn snapshot(
    twig: TwigClient,
    c: Context,
    id: &str,
    full: bool,
) -> ttrpc_result::R<pb::SnapshotInfo> {
    let req = pb::SnapshotRequest {
        sandbox_id: SANDBOX.into(),
        snapshot_id: id.into(),
        full,
        ..Default::default()
    };
    twig.snapshot(c, &req)
        .await
        .map(|r| r.snapshot.into_option().expect("a snapshot in the reply"))
}

mod ttrpc_result {
    /// A call's result as the generated client returns it.
    pub type R<T> = std::result::Result<T, containerd_shim_protos::ttrpc::Error>;
}

/// A context without a deadline: the service's own queue deadline applies.
fn no_deadline() -> Context {
    Context::default()
}

/// Polls `cond` every 5 ms until it holds or `T` passes.
async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + T;
    while !cond() {
        assert!(Instant::now() < deadline, "{what}: not within {T:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn snapshots_go_into_the_store_with_the_pods_containers_and_are_idempotent() {
    let f = fixture(T).await;
    // No VM yet: a clear refusal.
    let e = f.snapshot(ctx(), "s0", true).await.unwrap_err();
    assert_eq!(code(e), Code::FAILED_PRECONDITION);
    f.run("c1", "app").await;

    let s1 = f.snapshot(ctx(), "s1", true).await.expect("full snapshot");
    assert_eq!(s1.snapshot_id, "s1");
    assert_eq!(s1.parent_id, "");
    assert!(s1.size_bytes >= 3 * 4096, "{s1:?}");
    assert!(s1.written_bytes >= 3 * 4096, "{s1:?}");
    // Sizes from the published files: allocated memory and disk, and
    // what a restore maps (RAM and the disk's length).
    let dir = f.store().snapshot_dir("s1");
    let blocks = |name: &str| std::fs::metadata(dir.join(name)).unwrap().blocks() * 512;
    assert_eq!(s1.memory_bytes, blocks("memory"), "{s1:?}");
    assert!((3 * 4096..1 << 20).contains(&s1.memory_bytes), "{s1:?}");
    assert_eq!(s1.disk_bytes, blocks("disk0"), "{s1:?}");
    assert!((8192..4 << 20).contains(&s1.disk_bytes), "{s1:?}");
    assert_eq!(s1.restore_bytes, (1 << 20) + (4 << 20), "{s1:?}");
    let s2 = f.snapshot(ctx(), "s2", false).await.expect("incremental");
    assert_eq!(s2.parent_id, "s1");

    // What the store holds: the pod's sandbox and containers as labels.
    let stored = f.store().get("s2").expect("s2 published");
    assert_eq!(stored.parent.as_deref(), Some("s1"));
    assert_eq!(
        stored.labels.get(SANDBOX_LABEL).map(String::as_str),
        Some(SANDBOX)
    );
    let containers: Vec<SnapshotContainer> =
        serde_json::from_str(&stored.labels[CONTAINERS_LABEL]).unwrap();
    assert_eq!(
        containers,
        [SnapshotContainer {
            mounts_of: None,
            id: "c1".into(),
            guest_id: None,
            pid: None,
            name: Some("app".into()),
            slot: Some(0),
            running: true,
        }]
    );

    // The same id again: the same snapshot, the VM not asked again.
    let before = f.vm.snapshots.load(Ordering::SeqCst);
    let again = f.snapshot(ctx(), "s2", false).await.expect("repeat");
    assert_eq!(again, s2);
    assert_eq!(f.vm.snapshots.load(Ordering::SeqCst), before);

    // Bad requests: another sandbox, an empty or invalid id, an id the
    // store holds from elsewhere.
    let other = pb::SnapshotRequest {
        sandbox_id: "pod-2".into(),
        snapshot_id: "x".into(),
        ..Default::default()
    };
    assert_eq!(
        code(f.twig.snapshot(ctx(), &other).await.unwrap_err()),
        Code::NOT_FOUND
    );
    assert_eq!(
        code(f.snapshot(ctx(), "", true).await.unwrap_err()),
        Code::INVALID_ARGUMENT
    );
    assert_eq!(
        code(f.snapshot(ctx(), "../up", true).await.unwrap_err()),
        Code::INVALID_ARGUMENT
    );
    let store = f.store();
    let mut foreign = store.stage("foreign").unwrap();
    foreign
        .put_bytes(twig_store::Artefact::State, b"s")
        .unwrap();
    foreign.publish().unwrap();
    assert_eq!(
        code(f.snapshot(ctx(), "foreign", true).await.unwrap_err()),
        Code::ALREADY_EXISTS
    );
    f.nothing_staged();

    // Stats: the pod's snapshots; one deleted from the store drops out.
    let stats = f.stats().await;
    let ids: Vec<&str> = stats
        .snapshots
        .iter()
        .map(|s| s.snapshot_id.as_str())
        .collect();
    assert_eq!(ids, ["s1", "s2"]);
    assert_eq!(stats.last_rollback_operation_id, "");
    f.store().delete("s2").unwrap();
    let ids: Vec<String> = f
        .stats()
        .await
        .snapshots
        .into_iter()
        .map(|s| s.snapshot_id)
        .collect();
    assert_eq!(ids, ["s1"]);
    assert_eq!(f.state("c1").await.status.enum_value(), Ok(Status::RUNNING));

    // The caller's labels are recorded; the shim's own keys are not theirs.
    let labelled = |id: &str, key: &str| pb::SnapshotRequest {
        sandbox_id: SANDBOX.into(),
        snapshot_id: id.into(),
        full: true,
        labels: [(key.to_string(), "v".to_string())].into(),
        ..Default::default()
    };
    f.twig
        .snapshot(ctx(), &labelled("s3", "twig.dev/template-spec"))
        .await
        .expect("a snapshot with a caller's label");
    let stored = f.store().get("s3").expect("s3 published");
    assert_eq!(
        stored
            .labels
            .get("twig.dev/template-spec")
            .map(String::as_str),
        Some("v")
    );
    assert_eq!(
        stored.labels.get(SANDBOX_LABEL).map(String::as_str),
        Some(SANDBOX)
    );
    for key in [SANDBOX_LABEL, CONTAINERS_LABEL] {
        let e = f
            .twig
            .snapshot(ctx(), &labelled("s4", key))
            .await
            .unwrap_err();
        assert_eq!(code(e), Code::INVALID_ARGUMENT, "{key}");
    }
    assert!(
        f.store().get("s4").is_err(),
        "a refused snapshot was published"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn operations_on_a_pod_wait_their_turn_up_to_a_deadline() {
    let f = fixture(Duration::from_secs(1)).await;
    f.run("c1", "app").await;
    let (release, held) = std_mpsc::channel();
    *f.vm.hold.lock().unwrap() = Some(held);

    let first = tokio::spawn(snapshot(f.twig.clone(), ctx(), "a", true));
    until("the first snapshot reaches the VM", || {
        f.vm.snapshots.load(Ordering::SeqCst) == 1
    })
    .await;
    // A second one with a long deadline queues behind it.
    let second = tokio::spawn(snapshot(f.twig.clone(), ctx(), "b", false));
    // A rollback without a deadline waits the service's 1 s, then gives up.
    let started = Instant::now();
    let req = pb::RollbackRequest {
        sandbox_id: SANDBOX.into(),
        snapshot_id: "a".into(),
        operation_id: "op-1".into(),
        ..Default::default()
    };
    let e = f.twig.rollback(no_deadline(), &req).await.unwrap_err();
    let msg = format!("{e:?}");
    assert_eq!(code(e), Code::DEADLINE_EXCEEDED, "{msg}");
    assert!(started.elapsed() >= Duration::from_millis(900));
    assert!(!second.is_finished(), "the second snapshot did not wait");
    assert_eq!(f.vm.rollbacks.load(Ordering::SeqCst), 0);

    release.send(()).unwrap();
    let a = first.await.unwrap().expect("first snapshot");
    let b = second.await.unwrap().expect("queued snapshot");
    assert_eq!(b.parent_id, a.snapshot_id);
    assert_eq!(f.vm.max_in_flight.load(Ordering::SeqCst), 1);
    // And a no-deadline call that finds the pod idle runs at once.
    f.snapshot(no_deadline(), "c", false)
        .await
        .expect("idle pod");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rollback_refusals_keep_the_pod_and_a_lost_vm_ends_its_tasks() {
    let mut f = fixture(T).await;
    f.run("c1", "app").await;
    f.snapshot(ctx(), "s1", true).await.expect("snapshot");

    // Done, and idempotent on the operation id.
    f.rollback("s1", "op-1").await.expect("rollback");
    f.rollback("s1", "op-1").await.expect("repeat");
    assert_eq!(f.vm.rollbacks.load(Ordering::SeqCst), 1);
    assert_eq!(f.stats().await.last_rollback_operation_id, "op-1");

    // No such snapshot: NOT_FOUND, the VM not touched, the pod runs.
    let e = f.rollback("nope", "op-2").await.unwrap_err();
    assert_eq!(code(e), Code::NOT_FOUND);
    // A snapshot of another sandbox: refused.
    let store = f.store();
    let mut foreign = store.stage("foreign").unwrap();
    foreign
        .put_bytes(twig_store::Artefact::State, b"s")
        .unwrap();
    foreign.set_label(SANDBOX_LABEL, "pod-2");
    foreign.publish().unwrap();
    let e = f.rollback("foreign", "op-2").await.unwrap_err();
    assert_eq!(code(e), Code::FAILED_PRECONDITION);
    assert_eq!(f.vm.rollbacks.load(Ordering::SeqCst), 1);
    // The VMM refuses: ABORTED, still running, the operation not recorded.
    *f.vm.next_rollback.lock().unwrap() = Outcome::Refused;
    let e = f.rollback("s1", "op-3").await.unwrap_err();
    assert_eq!(code(e), Code::ABORTED);
    assert_eq!(f.state("c1").await.status.enum_value(), Ok(Status::RUNNING));
    assert_eq!(f.stats().await.last_rollback_operation_id, "op-1");
    while f.events.try_recv().is_ok() {}

    // A second container since the snapshot: the rollback is refused.
    f.run("c2", "sidecar").await;
    let e = f.rollback("s1", "op-4").await.unwrap_err();
    let msg = format!("{e:?}");
    assert!(msg.contains("changed since snapshot s1"), "{msg}");
    assert_eq!(code(e), Code::FAILED_PRECONDITION);
    f.snapshot(ctx(), "s2", true)
        .await
        .expect("snapshot of both");

    // The VM is lost: DATA_LOSS, and every task is reported exited.
    *f.vm.next_rollback.lock().unwrap() = Outcome::Lost;
    let e = f.rollback("s2", "op-5").await.unwrap_err();
    assert_eq!(code(e), Code::DATA_LOSS);
    for id in ["c1", "c2"] {
        let st = f.state(id).await;
        assert_eq!(st.status.enum_value(), Ok(Status::STOPPED), "{id}");
        assert_eq!(st.exit_status, 255, "{id}");
        let wait = api::WaitRequest {
            id: id.into(),
            ..Default::default()
        };
        assert_eq!(f.task.wait(ctx(), &wait).await.unwrap().exit_status, 255);
    }
    let mut exits = Vec::new();
    while let Ok(ev) = f.events.try_recv() {
        if ev.topic == containerd_shim_protos::topics::TASK_EXIT_EVENT_TOPIC {
            exits.push(ev.topic);
        }
    }
    assert_eq!(exits.len(), 2, "one TaskExit per container");
    f.nothing_staged();
}

/// ttrpc drops a call whose caller's deadline passed, and containerd gives
/// its handling of a TaskExit (a Delete) 10 s. A Delete that outlives its
/// caller still finishes: the retry finds the container gone, instead of
/// failing for ever on a disk that was detached already (CRI's
/// StopPodSandbox then never returned).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delete_whose_caller_gave_up_still_finishes() {
    let f = fixture(T).await;
    f.run("c1", "app").await;
    let kill = api::KillRequest {
        id: "c1".into(),
        signal: 9,
        ..Default::default()
    };
    f.task.kill(ctx(), &kill).await.expect("kill");
    let wait = api::WaitRequest {
        id: "c1".into(),
        ..Default::default()
    };
    assert_eq!(
        f.task.wait(ctx(), &wait).await.expect("wait").exit_status,
        137
    );

    let (release, held) = std_mpsc::channel();
    *f.vm.detach_hold.lock().unwrap() = Some(held);
    let delete = api::DeleteRequest {
        id: "c1".into(),
        ..Default::default()
    };
    let impatient = Context {
        timeout_nano: 300_000_000,
        ..Default::default()
    };
    let e = f.task.delete(impatient, &delete).await.unwrap_err();
    // The client or the server ends it at the deadline.
    let text = format!("{e:?}").to_lowercase();
    assert!(
        text.contains("deadline") || text.contains("timeout"),
        "{e:?}"
    );
    release.send(()).expect("the delete waits on its detach");

    // The first Delete finishes on its own: the container is gone, and a
    // retry says so (containerd takes NOT_FOUND as deleted).
    let state = api::StateRequest {
        id: "c1".into(),
        ..Default::default()
    };
    let deadline = Instant::now() + T;
    loop {
        match f.task.state(ctx(), &state).await {
            Err(e) if code(e.clone()) == Code::NOT_FOUND => break,
            other => assert!(
                Instant::now() < deadline,
                "c1 still known after its delete: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let e = f.task.delete(ctx(), &delete).await.unwrap_err();
    assert_eq!(code(e), Code::NOT_FOUND, "the retry of the delete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_is_its_namespaces_and_restores_into_no_other() {
    let f = fixture(T).await;
    f.run("c1", "app").await;
    f.snapshot(ctx(), "owned", true).await.expect("snapshot");
    let snap = f.store().get("owned").unwrap();
    assert_eq!(snap.owner.as_deref(), Some(NAMESPACE));
    // A clone's sandbox spec names its pod's namespace (CRI's annotation)
    // and the snapshot (twig.dev/restore-from).
    let rootfs = f.dir.path().join("clone-rootfs.img");
    std::fs::write(&rootfs, b"").unwrap();
    let sandbox = |ns: Option<&str>| {
        let mut annotations = json!({"twig.dev/restore-from": "owned"});
        if let Some(ns) = ns {
            annotations["io.kubernetes.cri.sandbox-namespace"] = json!(ns);
        }
        json!({"hostname": "clone", "annotations": annotations})
    };
    for other in [Some("team-b"), None] {
        let oci = sandbox(other);
        let e = SnapshotSource::open(snap.dir(), "owned", &oci, "clone", &rootfs)
            .err()
            .unwrap_or_else(|| panic!("{other:?} restored {NAMESPACE}'s snapshot"));
        assert_eq!(e.code(), Code::PERMISSION_DENIED, "{e}");
        assert!(e.to_string().contains(NAMESPACE), "{e}");
    }
    SnapshotSource::open(
        snap.dir(),
        "owned",
        &sandbox(Some(NAMESPACE)),
        "clone",
        &rootfs,
    )
    .expect("its own namespace restores it");
    f.nothing_staged();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restored_container_is_adopted_by_its_name() {
    let f = fixture(T).await;
    f.run("c1", "app").await;
    // The VM holds a running container "app" (guest id c1) from a snapshot.
    f.vm.restored.lock().unwrap().push(Restored {
        mounts_of: None,
        guest_id: "c1".into(),
        name: "app".into(),
        slot: Some(0),
        pid: None,
    });
    let (task, _server) = f.second_shim().await;
    // The new pod's sandbox container adopts the snapshotted one (the
    // running c1 stands in for it here): no second sandbox process.
    f.vm.restored.lock().unwrap().push(Restored {
        mounts_of: None,
        guest_id: "c1".into(),
        name: SANDBOX_ADOPTION.into(),
        slot: Some(0),
        pid: Some(1),
    });
    let (sb, sb_img) = bundle(
        f.dir.path(),
        "clone-sb",
        &["sleep", "1000"],
        json!({"annotations": {"io.kubernetes.cri.container-type": "sandbox"}}),
    );
    let create = api::CreateTaskRequest {
        id: "clone-sb".into(),
        bundle: sb.display().to_string(),
        rootfs: vec![twig_mount(&sb_img)],
        ..Default::default()
    };
    task.create(ctx(), &create)
        .await
        .expect("create the sandbox (adopt)");
    assert_eq!(
        f.vm.restored.lock().unwrap().len(),
        1,
        "the sandbox was adopted; the app waits"
    );
    // A raw block volume cannot be added to the running container: refused,
    // and the container stays there to be adopted.
    let img = f.dir.path().join("volume.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let dev = twig_agent::testkit::LoopDevice::new(&img).unwrap();
    let (b, rootfs) = bundle(
        f.dir.path(),
        "clone-blk",
        &["sleep", "1000"],
        json!({"annotations": {"io.kubernetes.cri.container-name": "app"},
               "linux": {"devices": [block_device(&dev.0, "/dev/xvdb")]}}),
    );
    let create = api::CreateTaskRequest {
        id: "clone-blk".into(),
        bundle: b.display().to_string(),
        rootfs: vec![twig_mount(&rootfs)],
        ..Default::default()
    };
    let e = task.create(ctx(), &create).await.unwrap_err();
    assert!(format!("{e:?}").contains("raw block volume"), "{e:?}");
    assert_eq!(code(e), Code::FAILED_PRECONDITION);
    assert_eq!(f.vm.restored.lock().unwrap().len(), 1, "still adoptable");
    let (b, img) = bundle(
        f.dir.path(),
        "clone-1",
        &["sleep", "1000"],
        json!({"annotations": {"io.kubernetes.cri.container-name": "app"}}),
    );
    let create = api::CreateTaskRequest {
        id: "clone-1".into(),
        bundle: b.display().to_string(),
        rootfs: vec![twig_mount(&img)],
        ..Default::default()
    };
    task.create(ctx(), &create).await.expect("create (adopt)");
    assert!(f.vm.restored.lock().unwrap().is_empty(), "adopted once");
    let start = api::StartRequest {
        id: "clone-1".into(),
        ..Default::default()
    };
    task.start(ctx(), &start)
        .await
        .expect("start (adopted: runs already)");
    let state = api::StateRequest {
        id: "clone-1".into(),
        ..Default::default()
    };
    let st = task.state(ctx(), &state).await.unwrap();
    assert_eq!(st.status.enum_value(), Ok(Status::RUNNING));
    // Signals reach the guest's process: the one container c1 started.
    let kill = api::KillRequest {
        id: "clone-1".into(),
        signal: 9,
        ..Default::default()
    };
    task.kill(ctx(), &kill).await.expect("kill");
    let wait = api::WaitRequest {
        id: "clone-1".into(),
        ..Default::default()
    };
    assert_eq!(task.wait(ctx(), &wait).await.unwrap().exit_status, 137);
    let wait = api::WaitRequest {
        id: "c1".into(),
        ..Default::default()
    };
    assert_eq!(f.task.wait(ctx(), &wait).await.unwrap().exit_status, 137);
    // A second container of that name is not adopted again: created anew.
    let (b2, img2) = bundle(
        f.dir.path(),
        "clone-2",
        &["sleep", "1000"],
        json!({"annotations": {"io.kubernetes.cri.container-name": "app"}}),
    );
    let create = api::CreateTaskRequest {
        id: "clone-2".into(),
        bundle: b2.display().to_string(),
        rootfs: vec![twig_mount(&img2)],
        ..Default::default()
    };
    task.create(ctx(), &create).await.expect("create (new)");
    task.start(
        ctx(),
        &api::StartRequest {
            id: "clone-2".into(),
            ..Default::default()
        },
    )
    .await
    .expect("start (new)");
    let kill = api::KillRequest {
        id: "clone-2".into(),
        signal: 9,
        ..Default::default()
    };
    task.kill(ctx(), &kill).await.expect("kill the new one");
}

/// A published snapshot `id` of `store` with `state` and `memory`, the
/// disks `disks` and the labels `labels`.
fn publish(store: &NodeStore, id: &str, disks: &[(usize, &[u8])], labels: &[(&str, &str)]) {
    let mut s = store.stage(id).unwrap();
    s.put_bytes(Artefact::State, b"state").unwrap();
    s.put_bytes(Artefact::Memory, b"memory").unwrap();
    for (i, bytes) in disks {
        s.put_bytes(Artefact::Disk(*i), bytes).unwrap();
    }
    for (k, v) in labels {
        s.set_label(k, v);
    }
    s.publish().unwrap();
}

#[test]
fn restore_from_reads_the_pod_snapshot_and_reflinks_its_disks_into_anonymous_files() {
    let xfs = LoopXfs::new(320);
    let store = NodeStore::open(&xfs.path().join("vm"), false).unwrap();
    publish(&store, "tpl", &[], &[]);
    let tpl = store.snapshot_dir("tpl");
    let containers = serde_json::to_string(&[
        SnapshotContainer {
            mounts_of: None,
            id: "src".into(),
            guest_id: None,
            pid: Some(7),
            name: None,
            slot: Some(2),
            running: true,
        },
        SnapshotContainer {
            mounts_of: None,
            id: "c1-clone".into(),
            // Adopted in an earlier clone: the guest knows it as c1.
            guest_id: Some("c1".into()),
            pid: None,
            name: Some("counter".into()),
            slot: Some(1),
            running: true,
        },
        SnapshotContainer {
            mounts_of: None,
            id: "c2".into(),
            guest_id: None,
            pid: None,
            name: Some("done".into()),
            slot: Some(0),
            running: false,
        },
    ])
    .unwrap();
    let disk1 = vec![0x5au8; 64 * 1024];
    let disk0 = vec![0x11u8; 4096];
    publish(
        &store,
        "pod-snap",
        &[(0, &disk0), (1, &disk1)],
        &[(SANDBOX_LABEL, "src"), (CONTAINERS_LABEL, &containers)],
    );
    // The new pod's sandbox rootfs: it stands in for the snapshotted
    // sandbox container's read-only one (slot 2, not copied).
    let pause = xfs.path().join("pause.img");
    std::fs::write(&pause, [0x33u8; 8192]).unwrap();
    let tmp = xfs.path().join("vm/tmp");
    let before: Vec<_> = std::fs::read_dir(&tmp).unwrap().collect();

    let oci = json!({"hostname": "clone-1"});
    let src =
        SnapshotSource::open(&tpl, "pod-snap", &oci, "sb", &pause).expect("open the snapshot");
    assert_eq!(src.id, "pod-snap");
    assert_eq!(src.dir, store.snapshot_dir("pod-snap"));
    assert_eq!(src.hostname, "clone-1");
    assert_eq!(
        src.restored,
        vec![
            Restored {
                mounts_of: None,
                guest_id: "src".into(),
                name: SANDBOX_ADOPTION.into(),
                slot: Some(2),
                pid: Some(7),
            },
            Restored {
                mounts_of: None,
                guest_id: "c1".into(),
                name: "counter".into(),
                slot: Some(1),
                pid: None,
            }
        ],
        "running containers with a CRI name are adopted by name, under the guest's id for \
         them; the sandbox container by the new sandbox"
    );
    assert_eq!(src.slot_numbers().collect::<Vec<_>>(), vec![2, 1, 0]);
    let (_, name, stand_in) = &src.slots[0];
    assert_eq!(name, &pause);
    let mut bytes = Vec::new();
    stand_in
        .try_clone()
        .unwrap()
        .read_to_end(&mut bytes)
        .unwrap();
    assert_eq!(bytes, [0x33u8; 8192], "the new sandbox's rootfs, read-only");
    assert!(stand_in.try_clone().unwrap().write_all(b"x").is_err());
    for (slot, _, file) in &src.slots[1..] {
        let mut bytes = Vec::new();
        let mut f = file.try_clone().unwrap();
        f.rewind().unwrap();
        f.read_to_end(&mut bytes).unwrap();
        assert_eq!(
            bytes,
            if *slot == 1 {
                disk1.clone()
            } else {
                disk0.clone()
            }
        );
        f.write_all_at(b"the clone writes", 0).unwrap();
    }
    assert_eq!(
        std::fs::read(store.snapshot_dir("pod-snap").join("disk1")).unwrap(),
        disk1,
        "the snapshot's disk is not the pod's"
    );
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        before.len(),
        "the pod's copies have no names: nothing is left behind"
    );
    // Without a hostname in the spec, the sandbox id.
    let src2 = SnapshotSource::open(&tpl, "pod-snap", &json!({}), "sb-2", &pause).unwrap();
    assert_eq!(src2.hostname, "sb-2");

    // Refusals name what is wrong.
    let e = SnapshotSource::open(&tpl, "nope", &oci, "sb", &pause).unwrap_err();
    assert_eq!(e.code(), Code::NOT_FOUND, "{e}");
    assert!(e.to_string().contains("snapshot nope"), "{e}");
    publish(&store, "not-a-pod", &[], &[]);
    let e = SnapshotSource::open(&tpl, "not-a-pod", &oci, "sb", &pause).unwrap_err();
    assert!(e.to_string().contains("not a pod snapshot"), "{e}");
    publish(
        &store,
        "no-disk",
        &[],
        &[(
            CONTAINERS_LABEL,
            r#"[{"id":"c1","name":"a","slot":0,"running":true}]"#,
        )],
    );
    let e = SnapshotSource::open(&tpl, "no-disk", &oci, "sb", &pause).unwrap_err();
    assert!(
        e.to_string().contains("no copy of disk slot 0") && e.to_string().contains("read-only"),
        "{e}"
    );
    let damaged = store.snapshot_dir("pod-snap").join("disk1");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&damaged)
        .unwrap()
        .set_len(512)
        .unwrap();
    let e = SnapshotSource::open(&tpl, "pod-snap", &oci, "sb", &pause).unwrap_err();
    assert!(e.to_string().contains("damaged"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_egress_policy_changes_while_the_pod_runs_and_stats_show_its_path() {
    let f = fixture(T).await;
    f.run("c1", "app").await;
    let set = |policy: &str| pb::SetEgressPolicyRequest {
        sandbox_id: SANDBOX.into(),
        egress_policy: policy.into(),
        ..Default::default()
    };
    let policy_in_force = |s: pb::StatsResponse| {
        s.network
            .into_option()
            .map(|n| serde_json::from_str::<EgressPolicy>(&n.egress_policy).unwrap())
    };
    // A pod without a network path: none in Stats, and no policy to set.
    assert_eq!(policy_in_force(f.stats().await), None);
    let e = f.twig.set_egress_policy(ctx(), &set("")).await.unwrap_err();
    assert_eq!(code(e), Code::FAILED_PRECONDITION);

    *f.vm.policy.lock().unwrap() = Some(EgressPolicy::default());
    let stats = f.stats().await;
    let network = stats.network.clone().into_option().expect("a network path");
    let reasons: Vec<&str> = network.counters.iter().map(|c| c.reason.as_str()).collect();
    let all: Vec<&str> = Reason::ALL.iter().map(|r| r.label()).collect();
    assert_eq!(reasons, all);
    assert!(network
        .counters
        .iter()
        .zip(Reason::ALL)
        .all(|(c, r)| c.dropped == r.is_drop()));
    assert_eq!(policy_in_force(stats), Some(EgressPolicy::default()));

    let allow = r#"{"allow":[{"cidr":"10.0.0.0/8","protocol":"tcp","ports":[{"port":443}]}]}"#;
    f.twig
        .set_egress_policy(ctx(), &set(allow))
        .await
        .expect("SetEgressPolicy");
    let expected: EgressPolicy = serde_json::from_str(allow).unwrap();
    assert_eq!(policy_in_force(f.stats().await), Some(expected.clone()));
    // Malformed: refused, naming the problem; the policy in force stays.
    for bad in [
        r#"{"allow":[{"cidr":"10.0.0.0/33"}]}"#,
        "{",
        r#"{"open":true}"#,
    ] {
        let e = f
            .twig
            .set_egress_policy(ctx(), &set(bad))
            .await
            .unwrap_err();
        let msg = format!("{e:?}");
        assert_eq!(code(e), Code::INVALID_ARGUMENT, "{bad}");
        assert!(msg.contains("egress_policy"), "{msg}");
    }
    assert_eq!(policy_in_force(f.stats().await), Some(expected));
    // Empty: the built-in default again. Another sandbox: not found.
    f.twig.set_egress_policy(ctx(), &set("")).await.unwrap();
    assert_eq!(
        policy_in_force(f.stats().await),
        Some(EgressPolicy::default())
    );
    let other = pb::SetEgressPolicyRequest {
        sandbox_id: "pod-2".into(),
        ..Default::default()
    };
    let e = f.twig.set_egress_policy(ctx(), &other).await.unwrap_err();
    assert_eq!(code(e), Code::NOT_FOUND);
}

/// Issue 24, item 6: deleting a pod's latest snapshot (its Snapshot
/// object deleted) must not make every later incremental snapshot of the
/// pod fail: the VM's baseline is gone from the store, so the next one is
/// taken full and the chain starts again from it — also when the baseline
/// goes while the snapshot is being taken, and after a rollback to a
/// snapshot deleted since.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_the_pods_latest_snapshot_then_snapshotting_again_succeeds() {
    let f = fixture(T).await;
    f.run("c1", "app").await;
    f.snapshot(ctx(), "s1", true).await.expect("full");
    let s2 = f.snapshot(ctx(), "s2", false).await.expect("incremental");
    assert_eq!(s2.parent_id, "s1");

    // The latest snapshot deleted: the next one is full, and incremental
    // ones follow it again.
    f.store().delete("s2").unwrap();
    let s3 = f
        .snapshot(ctx(), "s3", false)
        .await
        .expect("a snapshot after the latest one was deleted");
    assert_eq!(s3.parent_id, "", "{s3:?}");
    assert_eq!(f.store().get("s3").unwrap().kind, Kind::Full);
    let s4 = f.snapshot(ctx(), "s4", false).await.expect("incremental");
    assert_eq!(s4.parent_id, "s3");

    // Rolled back to s1, which is then deleted: the VM's baseline is gone.
    f.rollback("s1", "op-1").await.expect("rollback");
    f.store().delete("s1").unwrap();
    let s5 = f
        .snapshot(ctx(), "s5", false)
        .await
        .expect("after a rollback");
    assert_eq!(s5.parent_id, "");

    // The baseline deleted while the VM takes the snapshot: the store
    // refuses to publish an incremental one with no parent, and a full one
    // is taken in its place.
    let (release, held) = std_mpsc::channel();
    *f.vm.hold.lock().unwrap() = Some(held);
    let before = f.vm.snapshots.load(Ordering::SeqCst);
    let racing = tokio::spawn(snapshot(f.twig.clone(), ctx(), "s6", false));
    until("the snapshot reaches the VM", || {
        f.vm.snapshots.load(Ordering::SeqCst) == before + 1
    })
    .await;
    f.store().delete("s5").unwrap();
    release.send(()).unwrap();
    let s6 = racing
        .await
        .unwrap()
        .expect("the snapshot whose parent went");
    assert_eq!(s6.parent_id, "", "{s6:?}");
    assert_eq!(f.vm.snapshots.load(Ordering::SeqCst), before + 2);
    let s7 = f.snapshot(ctx(), "s7", false).await.expect("incremental");
    assert_eq!(s7.parent_id, "s6");
    f.nothing_staged();
    assert_eq!(f.state("c1").await.status.enum_value(), Ok(Status::RUNNING));
}

/// Issue 24, item 6: a snapshot's container list is taken under the lock
/// CRI's Create and Delete of the pod's containers hold: a snapshot asked
/// while a Delete is removing a container waits for it, and its labels do
/// not list a container the VM no longer has.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_lists_the_containers_its_vm_holds_while_cri_deletes_one() {
    let f = fixture(T).await;
    f.run("c1", "app").await;
    f.run("c2", "side").await;
    let kill = api::KillRequest {
        id: "c2".into(),
        signal: 9,
        ..Default::default()
    };
    f.task.kill(ctx(), &kill).await.expect("kill");
    let wait = api::WaitRequest {
        id: "c2".into(),
        ..Default::default()
    };
    f.task.wait(ctx(), &wait).await.expect("wait");

    // c2's Delete stops at its disk's detach: the VM has removed it.
    let (release, held) = std_mpsc::channel();
    *f.vm.detach_hold.lock().unwrap() = Some(held);
    let delete = api::DeleteRequest {
        id: "c2".into(),
        ..Default::default()
    };
    let deleting = {
        let task = f.task.clone();
        tokio::spawn(async move { task.delete(ctx(), &delete).await })
    };
    // The fake's detach holds the mutex while it waits.
    until("the delete reaches the detach", || {
        match f.vm.detach_hold.try_lock() {
            Err(std::sync::TryLockError::WouldBlock) => true,
            Ok(hold) => hold.is_none(),
            Err(_) => false,
        }
    })
    .await;
    let snapshotting = tokio::spawn(snapshot(f.twig.clone(), ctx(), "s1", true));
    // The snapshot does not reach the VM while the Delete changes the pod
    // (without the lock it would at once; with it, never: this bound only
    // gives the faulty case its time to show).
    let reached = tokio::time::timeout(
        Duration::from_millis(500),
        until("the snapshot reaches the VM", || {
            f.vm.snapshots.load(Ordering::SeqCst) == 1
        }),
    )
    .await;
    assert!(
        reached.is_err(),
        "the snapshot ran during a container's Delete"
    );
    release.send(()).expect("the delete waits on its detach");
    deleting.await.unwrap().expect("delete");
    snapshotting.await.unwrap().expect("snapshot");
    let stored = f.store().get("s1").expect("s1 published");
    let containers: Vec<SnapshotContainer> =
        serde_json::from_str(&stored.labels[CONTAINERS_LABEL]).unwrap();
    let ids: Vec<&str> = containers.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["c1"], "{containers:?}");
}

/// The OCI `linux.devices` entry CRI gives for host block device `host`
/// as `path`.
fn block_device(host: &Path, path: &str) -> serde_json::Value {
    let rdev = std::fs::metadata(host).unwrap().rdev();
    json!({"path": path, "type": "b", "major": libc::major(rdev), "minor": libc::minor(rdev),
           "fileMode": 0o660, "uid": 0, "gid": 0})
}

/// A raw block volume (CRI's `linux.devices` entry for a `volumeDevices`
/// claim): the shim attaches the host device, the container writes it,
/// Snapshot and Rollback are refused naming the container, and deleting
/// the container frees the device.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_raw_block_volume_reaches_the_container_and_refuses_snapshots() {
    let f = fixture(T).await;
    f.run("c1", "app").await;
    f.snapshot(ctx(), "s1", true).await.expect("snapshot");

    let img = f.dir.path().join("volume.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    let dev = twig_agent::testkit::LoopDevice::new(&img).unwrap();
    let rdev = std::fs::metadata(&dev.0).unwrap().rdev();
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    let (b, rootfs) = bundle(
        f.dir.path(),
        "c2",
        &[
            "sh",
            "-c",
            "echo volume-data | dd of=/dev/xvdb conv=notrunc,fsync && exec sleep 1000",
        ],
        json!({"annotations": {"io.kubernetes.cri.container-name": "db",
                               "io.kubernetes.cri.sandbox-namespace": NAMESPACE},
               "linux": {"devices": [block_device(&dev.0, "/dev/xvdb")],
                         "resources": {"devices": [
                             {"allow": false, "access": "rwm"},
                             {"allow": true, "type": "b", "major": major, "minor": minor,
                              "access": "mrw"}]}}}),
    );
    let create = api::CreateTaskRequest {
        id: "c2".into(),
        bundle: b.display().to_string(),
        rootfs: vec![twig_mount(&rootfs)],
        ..Default::default()
    };
    f.task
        .create(ctx(), &create)
        .await
        .expect("create with a block volume");
    let start = api::StartRequest {
        id: "c2".into(),
        ..Default::default()
    };
    f.task.start(ctx(), &start).await.expect("start");
    until("the container wrote its volume", || {
        std::fs::read(&img).is_ok_and(|d| d.starts_with(b"volume-data\n"))
    })
    .await;

    for e in [
        f.snapshot(ctx(), "s2", true).await.map(drop).unwrap_err(),
        f.rollback("s1", "op-1").await.unwrap_err(),
    ] {
        let msg = format!("{e:?}");
        assert!(
            msg.contains("raw block volume") && msg.contains("c2"),
            "{msg}"
        );
        assert_eq!(code(e), Code::FAILED_PRECONDITION);
    }
    assert_eq!(f.vm.rollbacks.load(Ordering::SeqCst), 0, "the VM untouched");

    // Deleting the container frees the device (no loop device over it is
    // left by the host sandbox).
    let kill = api::KillRequest {
        id: "c2".into(),
        signal: 9,
        ..Default::default()
    };
    f.task.kill(ctx(), &kill).await.expect("kill");
    let wait = api::WaitRequest {
        id: "c2".into(),
        ..Default::default()
    };
    f.task.wait(ctx(), &wait).await.expect("wait");
    let delete = api::DeleteRequest {
        id: "c2".into(),
        ..Default::default()
    };
    f.task.delete(ctx(), &delete).await.expect("delete");
    let over = sh(Command::new("losetup").arg("-j").arg(&dev.0));
    assert!(over.trim().is_empty(), "left attached: {over}");
    f.snapshot(ctx(), "s3", true)
        .await
        .expect("a snapshot once the volume is gone");
}
