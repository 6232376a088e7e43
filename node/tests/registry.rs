//! `ExportSnapshot` / `ImportSnapshot`: a snapshot of one node's store
//! pushed to a real registry (`docker-registry`, started and stopped here)
//! and pulled by another node, each namespace to its own repositories and
//! snapshots only; the registry gone is UNAVAILABLE; a node killed mid-pull
//! publishes nothing and, restarted, removes what the pull left and pulls
//! the snapshot whole; a pod restored lazily on a node that lacks the
//! snapshot. Needs /dev/kvm, /dev/userfaultfd and `docker-registry`.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use twig_cri::harness::Registry;
use twig_node::build::{Spec, SPEC_LABEL};
use twig_proto::node::{AcquireVmRequest, AcquireVmResponse};
use twig_proto::twig::{
    EnsureTemplateRequest, EnsureTemplateResponse, ExportSnapshotRequest, ExportSnapshotResponse,
    GetSnapshotRequest, ImportSnapshotRequest, ImportSnapshotResponse,
};
use twig_proto::twig_ttrpc::NodeClient;
use twig_vmm::api::Client;
use twig_vmm::RunState;

impl Node {
    fn export(
        &self,
        id: &str,
        reference: &str,
        ns: &str,
    ) -> Result<ExportSnapshotResponse, ttrpc::Error> {
        let req = ExportSnapshotRequest {
            snapshot_id: id.into(),
            reference: reference.into(),
            namespace: ns.into(),
            ..Default::default()
        };
        self.rt.block_on(self.node.export_snapshot(ctx(), &req))
    }

    fn import(&self, reference: &str, ns: &str) -> Result<ImportSnapshotResponse, ttrpc::Error> {
        let req = ImportSnapshotRequest {
            reference: reference.into(),
            namespace: ns.into(),
            ..Default::default()
        };
        self.rt.block_on(self.node.import_snapshot(ctx(), &req))
    }

    fn ensure(&self, req: &EnsureTemplateRequest) -> EnsureTemplateResponse {
        self.rt
            .block_on(self.node.ensure_template(ctx(), req))
            .expect("EnsureTemplate")
    }

    fn has(&self, id: &str) -> bool {
        let req = GetSnapshotRequest {
            snapshot_id: id.into(),
            ..Default::default()
        };
        self.rt
            .block_on(self.node.get_snapshot(ctx(), &req))
            .expect("GetSnapshot")
            .found
    }
}

fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_timeout(T.as_nanos() as i64)
}

fn node_with_registry(dir: &std::path::Path, host: &str) -> Node {
    std::fs::create_dir_all(dir).unwrap();
    let mut config = config(dir, 0);
    config["registry"] = serde_json::json!({"plain_http": [host]});
    Node::start(dir, &config)
}

/// A registry under `d` and team-a's snapshot `agent-snap` in the store of
/// node A (`<d>/a`): the registry, its host, A's and B's directories.
fn registry_with_snapshot(d: &Path) -> (Registry, String, PathBuf, PathBuf) {
    let registry = Registry::start(&d.join("registry")).expect("docker-registry");
    let host = registry.host();
    let (da, db) = (d.join("a"), d.join("b"));
    std::fs::create_dir_all(&da).unwrap();
    make_snapshot(&da, "agent-snap", MIB, Some("team-a"), &[]);
    (registry, host, da, db)
}

#[test]
fn a_snapshot_exported_by_one_node_is_imported_by_another_within_its_namespace() {
    let d = tempfile::tempdir().unwrap();
    let (registry, host, da, db) = registry_with_snapshot(d.path());
    let a = node_with_registry(&da, &host);
    let b = node_with_registry(&db, &host);
    let ours = format!("{host}/twig/team-a/agent:v1");

    let refused = [
        (
            a.export("agent-snap", &ours, "team-b"),
            "another namespace's repository",
        ),
        (
            a.export(
                "agent-snap",
                &format!("{host}/twig/team-b/agent:v1"),
                "team-b",
            ),
            "another namespace's snapshot",
        ),
        (
            a.export(
                "agent-snap",
                &format!("{host}/elsewhere/agent:v1"),
                "team-a",
            ),
            "outside the prefix",
        ),
        (
            a.export(
                "agent-snap",
                "evil.example:5000/twig/team-a/agent:v1",
                "team-a",
            ),
            "a registry the node does not name",
        ),
        (
            a.import("evil.example:5000/twig/team-a/agent:v1", "team-a")
                .map(|_| ExportSnapshotResponse::default()),
            "a registry the node does not name",
        ),
    ];
    for (r, what) in refused {
        let (code, msg) = status(r.expect_err(what));
        assert_eq!(code, ttrpc::Code::PERMISSION_DENIED, "{what}: {msg}");
    }
    let (code, msg) = status(
        a.export("agent-snap", "no-registry/agent", "team-a")
            .unwrap_err(),
    );
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{msg}");
    // A node without a registry refuses every reference.
    let none = Node::start(&d.path().join("none"), &{
        std::fs::create_dir_all(d.path().join("none")).unwrap();
        config(&d.path().join("none"), 0)
    });
    let (code, msg) = status(none.import(&ours, "team-a").unwrap_err());
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    assert!(msg.contains("no registry"), "{msg}");
    drop(none);

    let pushed = a
        .export("agent-snap", &ours, "team-a")
        .expect("ExportSnapshot");
    assert!(
        pushed.digest.starts_with("sha256:") && pushed.snapshots_pushed == 1,
        "{pushed:?}"
    );
    assert!(pushed.bytes_uploaded > 0);

    let pulled = b.import(&ours, "team-a").expect("ImportSnapshot");
    assert_eq!(
        (pulled.digest.as_str(), pulled.snapshots_pulled),
        (pushed.digest.as_str(), 1)
    );
    assert!(b.has(&pulled.snapshot_id), "{pulled:?}");
    let again = b
        .import(
            &format!("{host}/twig/team-a/agent@{}", pushed.digest),
            "team-a",
        )
        .unwrap();
    assert_eq!(
        (again.snapshot_id.as_str(), again.bytes_downloaded),
        (pulled.snapshot_id.as_str(), 0)
    );
    // Node A finds it is its own snapshot.
    assert_eq!(a.import(&ours, "team-a").unwrap().snapshot_id, "agent-snap");

    // A pod restoring A's snapshot by its id on B (a Clone's pod placed
    // there): B restores what it pulled.
    let artifact = format!("{host}/twig/team-a/agent@{}", pushed.digest);
    let clone_pod = |node: &Node, artifact: &str, ns: &str| {
        node.acquire_req(AcquireVmRequest {
            sandbox_id: "clone-0".into(),
            restore_from: "agent-snap".into(),
            restore_artifact: artifact.into(),
            namespace: ns.into(),
            ..Default::default()
        })
    };
    let vm = clone_pod(&b, &artifact, "team-a").expect("AcquireVm with restore_artifact");
    assert_eq!(vm.restored_id, pulled.snapshot_id);
    assert!(
        vm.template_dir.ends_with(&pulled.snapshot_id),
        "{}",
        vm.template_dir
    );
    sigkill(vm.pid);
    let (code, msg) = status(clone_pod(&b, &artifact, "team-b").unwrap_err());
    assert_eq!(code, ttrpc::Code::PERMISSION_DENIED, "{msg}");
    // On A, which has it under its own id, nothing is pulled.
    let vm = clone_pod(&a, "unused.example/twig/team-a/x@sha256:0", "team-a").expect("local");
    assert_eq!(vm.restored_id, "agent-snap");
    sigkill(vm.pid);

    let (code, msg) = status(
        b.import(&format!("{host}/twig/team-a/missing:v1"), "team-a")
            .unwrap_err(),
    );
    assert_eq!(code, ttrpc::Code::NOT_FOUND, "{msg}");
    let (code, msg) = status(b.import(&ours, "team-b").unwrap_err());
    assert_eq!(code, ttrpc::Code::PERMISSION_DENIED, "{msg}");

    drop(registry);
    let (code, msg) = status(
        b.import(&format!("{host}/twig/team-a/agent:v2"), "team-a")
            .unwrap_err(),
    );
    assert_eq!(code, ttrpc::Code::UNAVAILABLE, "{msg}");
    assert!(msg.contains(&host), "{msg}");
    let c = node_with_registry(&d.path().join("c"), &host);
    let (code, msg) = status(clone_pod(&c, &artifact, "team-a").unwrap_err());
    assert_eq!(code, ttrpc::Code::UNAVAILABLE, "{msg}");
    assert!(!c.has("agent-snap") && !c.has(&pulled.snapshot_id));
}

#[test]
fn a_template_built_on_one_node_serves_another_without_a_build() {
    let d = tempfile::tempdir().unwrap();
    let registry = Registry::start(&d.path().join("registry")).expect("docker-registry");
    let host = registry.host();
    let (da, db) = (d.path().join("a"), d.path().join("b"));
    std::fs::create_dir_all(&da).unwrap();
    let req = EnsureTemplateRequest {
        name: "team-a/agent".into(),
        image: "example.com/agent:1".into(),
        ..Default::default()
    };
    // These nodes have no base template inputs: the spec stands alone.
    let spec = Spec::from_request(&req).unwrap();
    make_snapshot(
        &da,
        &spec.id,
        MIB,
        Some("team-a"),
        &[(SPEC_LABEL, &spec.digest)],
    );
    let a = node_with_registry(&da, &host);
    let b = node_with_registry(&db, &host);
    assert!(a.ensure(&req).ready, "A has it built");
    let pushed = a
        .export(
            &spec.id,
            &format!("{host}/twig/team-a/template-agent:v1"),
            "team-a",
        )
        .expect("ExportSnapshot of the template");
    let artifact = format!("{host}/twig/team-a/template-agent@{}", pushed.digest);

    let pulled = b.ensure(&EnsureTemplateRequest {
        artifact: artifact.clone(),
        ..req.clone()
    });
    assert!(
        pulled.ready && pulled.message.contains("pulled from"),
        "{pulled:?}"
    );
    assert!(b.has(&spec.id));
    // A pod of the template on B restores it.
    let vm = b
        .acquire(&spec.id)
        .expect("AcquireVm of the pulled template");
    sigkill(vm.pid);

    // Other inputs on the next node: not taken, built (and, with no
    // containerd here, the build fails, saying why the pull was not used).
    let c = node_with_registry(&d.path().join("c"), &host);
    let other = c.ensure(&EnsureTemplateRequest {
        image: "example.com/agent:2".into(),
        artifact,
        ..req.clone()
    });
    assert!(!other.ready, "{other:?}");
    assert!(other.message.contains("other inputs"), "{other:?}");
    assert!(!c.has(&spec.id));
}

/// Restores the VM handed over in `vm` as the shim does for a lazy
/// restore: `/dev/userfaultfd` and a connection to the node's page server
/// sent with the request.
fn restore_lazily(vm: &AcquireVmResponse) -> Result<Client, String> {
    let uffd = std::fs::File::options()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
        .expect("this test needs /dev/userfaultfd (Linux 6.1 or later, as root)");
    let server = UnixStream::connect(&vm.lazy_socket).expect("connect to the page server");
    let mut api = Client::connect(Path::new(&vm.api_socket), T).expect("connect to the VMM");
    api.restore_lazy(Path::new(&vm.template_dir), &[], &uffd, &server, T)
        .map_err(|e| e.to_string())?;
    Ok(api)
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
    })
}

#[test]
fn a_clone_restores_lazily_while_its_memory_arrives_and_fails_when_its_source_vanishes() {
    let d = tempfile::tempdir().unwrap();
    let mut registry = Some(Registry::start(&d.path().join("registry")).expect("docker-registry"));
    let host = registry.as_ref().unwrap().host();
    let (da, db, dc) = (d.path().join("a"), d.path().join("b"), d.path().join("c"));
    std::fs::create_dir_all(&da).unwrap();
    make_snapshot(&da, "agent-snap", MIB, Some("team-a"), &[]);
    let a = node_with_registry(&da, &host);
    let pushed = a
        .export(
            "agent-snap",
            &format!("{host}/twig/team-a/agent:v1"),
            "team-a",
        )
        .expect("ExportSnapshot");
    let artifact = format!("{host}/twig/team-a/agent@{}", pushed.digest);
    let lazy_pod = |node: &Node, sandbox: &str| {
        node.acquire_req(AcquireVmRequest {
            sandbox_id: sandbox.into(),
            restore_from: "agent-snap".into(),
            restore_artifact: artifact.clone(),
            namespace: "team-a".into(),
            ..Default::default()
        })
        .expect("AcquireVm")
    };

    // B lacks it: a VMM is handed over with the staged snapshot and a page
    // server before the memory is there.
    let b = node_with_registry(&db, &host);
    let vm = lazy_pod(&b, "lazy-0");
    assert!(!vm.lazy_socket.is_empty(), "{vm:?}");
    assert!(
        vm.template_dir.contains("/store/tmp/") && vm.template_dir.ends_with(&vm.restored_id),
        "restored from its staging: {}",
        vm.template_dir
    );
    assert!(
        !b.has(&vm.restored_id),
        "published before its memory arrived"
    );
    let mut api = restore_lazily(&vm).expect("lazy restore");
    wait_until("the lazily restored guest runs", T, || {
        let s = api.stats(T).expect("stats");
        s.exits > 0 && s.state == RunState::Running
    });
    // The pull completes and is published; the VM runs on.
    wait_until("the pulled snapshot is published", T, || {
        b.has(&vm.restored_id)
    });
    // Every page in, the node tells the VMM, which stops faulting to it.
    wait_until("the node completes the VM's memory", T, || {
        b.log().contains("lazy restore complete")
    });
    assert!(!b.log().contains("lazy restore failed"), "{}", b.log());
    // The pages the guest ran on when it was snapshotted (its hot list)
    // were fetched ahead of its faults.
    wait_until("the hot list is fetched", T, || {
        b.log().contains("hot pages fetched")
    });
    let log = b.log();
    let hot: u64 = log
        .lines()
        .find(|l| l.contains("hot pages fetched"))
        .map(plain)
        .and_then(|l| {
            let v = l.split("pages=").nth(1)?;
            v.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no hot page count in {log}"));
    assert!(hot > 0, "an empty hot list was fetched: {log}");
    let s = api.stats(T).expect("stats after the memory arrived");
    assert_eq!(s.state, RunState::Running);
    let again = b.import(&artifact, "team-a").expect("ImportSnapshot");
    assert_eq!(
        (again.snapshot_id.as_str(), again.bytes_downloaded),
        (vm.restored_id.as_str(), 0),
        "what the lazy pull published is the pull's"
    );
    sigkill(vm.pid);

    // C lacks it too, and the registry goes away before the memory came:
    // the VMM exits (the pod fails), nothing is published.
    let c = node_with_registry(&dc, &host);
    let vm = lazy_pod(&c, "lazy-1");
    drop(registry.take());
    let restored = restore_lazily(&vm);
    let deadline = std::time::Instant::now() + T;
    while alive(vm.pid) {
        if std::time::Instant::now() > deadline {
            let log = std::fs::read_to_string(Path::new(&vm.state_dir).join("vmm.log"));
            panic!(
                "the VMM whose page source vanished still runs (restore: {:?}); its log: {log:?}",
                restored.err()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(
        !c.has(&vm.restored_id),
        "a lazy pull whose registry vanished was published (restore: {:?})",
        restored.err()
    );
}

/// `line` without its terminal colour codes (`ESC [ … m`).
fn plain(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|c| *c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

/// A proxy to `upstream` that holds every blob request after the first (a
/// snapshot's config, read before its staging is made) unanswered: the
/// pull through it stalls in its first layer. `held` is set once it holds.
fn holding_proxy(upstream: String, held: Arc<AtomicBool>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
    let addr = listener.local_addr().expect("proxy address").to_string();
    let blobs = Arc::new(AtomicUsize::new(0));
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let (Ok(client), Ok(server)) = (client, TcpStream::connect(&upstream)) else {
                return;
            };
            let (mut down_from, mut down_to) = (server.try_clone().expect("clone"), client);
            let mut up_from = down_to.try_clone().expect("clone");
            let mut up_to = server;
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut down_from, &mut down_to);
            });
            let (blobs, held) = (blobs.clone(), held.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 16 << 10];
                loop {
                    let n = match up_from.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let text = String::from_utf8_lossy(&buf[..n]);
                    let asked = text
                        .lines()
                        .filter(|l| l.starts_with("GET ") && l.contains("/blobs/"))
                        .count();
                    if asked > 0 && blobs.fetch_add(asked, Ordering::SeqCst) + asked > 1 {
                        held.store(true, Ordering::SeqCst);
                        // Held: the connection stays open, unanswered, for
                        // the rest of the test process.
                        let _keep = (up_from, up_to);
                        loop {
                            std::thread::park();
                        }
                    }
                    if up_to.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Entries in a node store's staging directory.
fn staged(store: &Path) -> usize {
    std::fs::read_dir(store.join("tmp")).map_or(0, |d| d.count())
}

/// Snapshots published in a node store.
fn published(store: &Path) -> usize {
    std::fs::read_dir(store.join("snapshots")).map_or(0, |d| d.count())
}

#[test]
fn a_node_killed_mid_pull_publishes_nothing_and_its_restart_pulls_the_snapshot_whole() {
    let d = tempfile::tempdir().unwrap();
    let (_registry, host, da, db) = registry_with_snapshot(d.path());
    let pushed = node_with_registry(&da, &host)
        .export(
            "agent-snap",
            &format!("{host}/twig/team-a/agent:v1"),
            "team-a",
        )
        .expect("ExportSnapshot");

    let held = Arc::new(AtomicBool::new(false));
    let proxy = holding_proxy(host.clone(), held.clone());
    std::fs::create_dir_all(&db).unwrap();
    let mut config = config(&db, 0);
    config["registry"] = serde_json::json!({"plain_http": [host, proxy]});
    let b = Node::start(&db, &config);
    // The import on a connection of its own: its node dies under it.
    let socket = format!("unix://{}", db.join("node.sock").display());
    let via = format!("{proxy}/twig/team-a/agent@{}", pushed.digest);
    let pulling = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let client = ttrpc::r#async::Client::connect(&socket).await?;
            let req = ImportSnapshotRequest {
                reference: via,
                namespace: "team-a".into(),
                ..Default::default()
            };
            NodeClient::new(client).import_snapshot(ctx(), &req).await
        })
    });
    let store = db.join("store");
    wait_until("B's pull to stall in its first layer", T, || {
        held.load(Ordering::SeqCst) && staged(&store) > 0
    });
    sigkill(b.child.id());
    let died = pulling.join().expect("the import's thread");
    assert!(died.is_err(), "an import whose node died: {died:?}");
    drop(b);
    assert!(staged(&store) > 0, "killed mid-pull, B left its staging");
    assert_eq!(published(&store), 0, "nothing of the pull was published");

    let b = Node::start(&db, &config);
    assert_eq!(staged(&store), 0, "restarted, B removed what the pull left");
    assert_eq!(published(&store), 0);
    let pulled = b
        .import(&format!("{host}/twig/team-a/agent:v1"), "team-a")
        .expect("ImportSnapshot after the restart");
    assert_eq!(
        (pulled.digest.as_str(), pulled.snapshots_pulled),
        (pushed.digest.as_str(), 1)
    );
    assert!(b.has(&pulled.snapshot_id));
    // Whole: a pod restores it.
    let vm = b
        .acquire_req(AcquireVmRequest {
            sandbox_id: "clone-0".into(),
            restore_from: pulled.snapshot_id.clone(),
            namespace: "team-a".into(),
            ..Default::default()
        })
        .expect("AcquireVm of the pulled snapshot");
    assert_eq!(vm.restored_id, pulled.snapshot_id);
    sigkill(vm.pid);
}
