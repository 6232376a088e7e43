//! The sandbox API end to end: the unmodified `e2b` and `cubesandbox` SDKs
//! (`tests/sandbox_api/flow.py`, run by their venv's interpreter chrooted
//! into the tree `tests/lab/run.sh` carries as `TWIG_E2E_SDK`) against
//! twig-api (in this process, on the node's loopback), over real Twig pods:
//! the controller and the test kubelet on the real node ([`CtrlLab`]), a
//! SandboxTemplate built by a build Pod, and the envd of twig-agent in
//! each guest. A stand-in scheduler binds twig-api's pods to the node.
//!
//! What the flow checks, each step printed as it passes: create from the
//! template; `commands.run` (exit code, stdout and stderr, streamed
//! output, stdin, a background process killed); files written, read,
//! listed; `pause()` then `connect()` with a running process's memory
//! intact (a shell's counter goes on from its own count); envd's port
//! through the proxy refused without the token; `fork()` diverging from its
//! source; `kill()`; with the CubeSandbox SDK `create_snapshot()`,
//! `rollback()` restoring a file and a process's memory, and `clone(n)`
//! whose clones share the state up to the clone point and diverge after.
//! Here: every sandbox pod asked for envd with its token's digest, and
//! nothing of the sandboxes is left after the kills. For the record (api's
//! BENCHMARKS.md; printed as `BENCH {...}`, never asserted): each
//! operation's time through the SDK, and, with `TWIG_E2E_OBJECTS_BENCH`
//! set in the lab (`TWIG_LAB_ENV=TWIG_E2E_OBJECTS_BENCH=1`), the same
//! operations through the Kubernetes objects on a pod of the same shape.
//! Built with `--features lab`, run in the nested lab
//! (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test sandbox_api`).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use twig_api::auth::{Tenants, TokenKey};
use twig_api::{App, Server, Settings};
use twig_controller::crd::{
    CloneSource, CloneSpec, Phase, PodClone, Rollback, RollbackSpec, SandboxTemplate,
    SandboxTemplateSpec, Snapshot, SnapshotMode, SnapshotSpec, CLONE_LABEL,
};
use twig_controller_testkit::{self as testkit, NS};
use twig_e2e::ctrllab::{until, CtrlLab, NODE, READY};
use twig_e2e::{BASE_MEM_MIB, IMAGE_REF};

/// The tenant's API key.
const KEY: &str = "lab-key";
/// The sandboxes' domain (CubeSandbox's SDK names hosts under it).
const DOMAIN: &str = "sandboxes.lab";
/// Clones of the CubeSandbox SDK's `clone(n)`: 8 in the benchmark's run
/// (with [`OBJECTS_BENCH`], as api's BENCHMARKS.md records), 4 in CI's,
/// where each clone is a restore on one emulated CPU (~30 s) and four
/// share and diverge as eight do.
fn clones() -> usize {
    if std::env::var_os(OBJECTS_BENCH).is_some() {
        8
    } else {
        4
    }
}
/// Set (to anything) in the lab's environment: the objects' side of the
/// benchmark runs too (`TWIG_LAB_ENV=TWIG_E2E_OBJECTS_BENCH=1`).
const OBJECTS_BENCH: &str = "TWIG_E2E_OBJECTS_BENCH";
/// How long the flow may run (every step is a guest under emulation).
const FLOW: Duration = Duration::from_secs(2400);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unmodified_sdks_drive_twig_pods_through_twig_api() {
    let sdk = SdkTree::unpack();
    let lab = CtrlLab::start("sandbox-api", &[]).await;
    let client = &lab.client;

    // The template every sandbox starts from: a long sleep, built once.
    let template = SandboxTemplate::new(
        "base",
        SandboxTemplateSpec {
            image: IMAGE_REF.into(),
            vcpus: 1,
            memory_mib: u32::try_from(BASE_MEM_MIB).unwrap_or(u32::MAX),
            command: Some(vec!["sleep".into(), "1000000".into()]),
            warmup: None,
            egress_policy: None,
        },
    );
    testkit::create(client, &template).await;
    lab.wait_for("base", "Ready on the node", |t: &SandboxTemplate| {
        t.status.as_ref().is_some_and(|s| s.ready_nodes == 1)
    })
    .await;
    lab.step("SandboxTemplate base Ready");

    let annotations = stand_in_scheduler(client.clone());
    let mut tenants = Tenants::default();
    tenants.insert(KEY, NS);
    let tokens = TokenKey::new(&[7; 32]).unwrap_or_else(|e| panic!("{e}"));
    let app = App::new(
        client.clone(),
        Settings {
            tenants,
            tokens: tokens.clone(),
            domain: Some(DOMAIN.into()),
            envd_port: twig_proto::contract::ENVD_PORT,
            default_timeout: 3600,
            max_timeout: 7200,
            start_timeout: READY,
            snapshot_timeout: READY,
        },
    );
    let control = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let proxy = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let api_url = format!("http://{}", control.local_addr().expect("addr"));
    let proxy_port = proxy.local_addr().expect("addr").port();
    tokio::spawn(app.clone().serve(control, Server::Control));
    tokio::spawn(app.clone().serve(proxy, Server::Proxy));
    lab.step(&format!("twig-api at {api_url}, its proxy on {proxy_port}"));

    let proxy_url = format!("http://127.0.0.1:{proxy_port}");
    let port = proxy_port.to_string();
    let n_clones = clones().to_string();
    let env = [
        ("E2B_API_URL", api_url.as_str()),
        ("E2B_SANDBOX_URL", proxy_url.as_str()),
        ("E2B_API_KEY", KEY),
        ("E2B_HTTP_VERSION", "1.1"),
        ("CUBE_API_URL", api_url.as_str()),
        ("CUBE_API_KEY", KEY),
        ("CUBE_PROXY_NODE_IP", "127.0.0.1"),
        ("CUBE_PROXY_PORT_HTTP", port.as_str()),
        ("CUBE_SANDBOX_DOMAIN", DOMAIN),
        ("TEMPLATE", "base"),
        ("CLONES", n_clones.as_str()),
    ];
    let report = {
        let lab = &lab;
        let step = move |line: &str| lab.step(&format!("sdk: {line}"));
        tokio::task::block_in_place(|| sdk.run_flow(&env, &step))
    };
    let report = report.unwrap_or_else(|e| panic!("{e}\n{}", lab.logs()));
    lab.step("the SDKs' flow passed");

    // Every sandbox pod asked for envd, requiring its sandbox's token from
    // the first request (forks and clones keep their source's).
    let seen = annotations.lock().expect("lock").clone();
    let id = report["id"].as_str().expect("id");
    let pod = seen
        .get(id)
        .unwrap_or_else(|| panic!("no pod {id}: {seen:?}"));
    assert_eq!(pod.get("twig.dev/envd").map(String::as_str), Some("true"));
    let token = tokens.token(twig_api::auth::TokenKind::Envd, NS, id);
    assert_eq!(
        pod.get("twig.dev/envd-token-sha256"),
        Some(&twig_api::auth::sha256_hex(&token))
    );
    assert_eq!(
        report["clones"].as_array().map(Vec::len),
        Some(clones()),
        "{report}"
    );

    // With TWIG_E2E_OBJECTS_BENCH set, the same operations through the
    // Kubernetes objects, on the same pod shape, for the record (the API's
    // overhead is the difference; api's BENCHMARKS.md), never asserted: five
    // minutes of the lab that CI's run does without.
    let objects = match std::env::var_os(OBJECTS_BENCH) {
        Some(_) => objects_bench(&lab, &template, &tokens).await,
        None => Value::Null,
    };
    lab.step(&format!(
        "BENCH {}",
        json!({"sdk": report["bench"], "objects": objects})
    ));

    // Killed: no sandbox pod is left.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    until("the sandboxes' pods to go", READY, || {
        let pods = pods.clone();
        async move {
            let lp = ListParams::default().labels(twig_api::objects::SANDBOX_LABEL);
            pods.list(&lp).await.ok()?.items.is_empty().then_some(())
        }
    })
    .await;
    lab.step("every sandbox's pod is gone");
}

/// Through the objects, seconds: a pod from the template to its first
/// exec's output; an exec of `true` (p50 of 5); an incremental Snapshot; a
/// Rollback (no safety snapshot); a Clone of [`clones()`] until each answers.
async fn objects_bench(lab: &CtrlLab, template: &SandboxTemplate, tokens: &TokenKey) -> Value {
    let client = &lab.client;
    let secs = |t: Instant| t.elapsed().as_secs_f64();
    let token = tokens.token(twig_api::auth::TokenKind::Envd, NS, "objects");
    let pod = twig_api::objects::template_pod(
        "objects",
        template,
        &Default::default(),
        &Default::default(),
        None,
        twig_api::auth::sha256_hex(&token),
    );
    let t = Instant::now();
    testkit::create(client, &pod).await;
    let (_, id) = lab.running("objects", twig_api::objects::CONTAINER).await;
    assert_eq!(lab.exec(&id, &["echo", "ready"]).await, (0, "ready".into()));
    let create = secs(t);
    let mut rounds = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        assert_eq!(lab.exec(&id, &["true"]).await.0, 0);
        rounds.push(secs(t));
    }
    rounds.sort_by(f64::total_cmp);
    let t = Instant::now();
    let mut snap = Snapshot::new(
        "objects-snap",
        SnapshotSpec {
            pod_name: "objects".into(),
            pod_uid: None,
            mode: SnapshotMode::Incremental,
            deletion_policy: Default::default(),
            ttl_seconds_after_ready: None,
            failure_deadline_seconds: None,
            export: false,
        },
    );
    snap.metadata.namespace = Some(NS.into());
    testkit::create(client, &snap).await;
    let done = |p: Option<&Phase>| matches!(p, Some(Phase::Ready | Phase::Failed));
    let snap: Snapshot = lab
        .wait_for("objects-snap", "done", |s: &Snapshot| {
            done(s.status.as_ref().map(|s| &s.phase))
        })
        .await;
    assert_eq!(snap.status.map(|s| s.phase), Some(Phase::Ready));
    let snapshot = secs(t);
    let t = Instant::now();
    let rollback = Rollback::new(
        "objects-back",
        RollbackSpec {
            pod_name: "objects".into(),
            snapshot_name: "objects-snap".into(),
            pod_uid: None,
            safety_snapshot: false,
            failure_deadline_seconds: None,
        },
    );
    testkit::create(client, &rollback).await;
    let back: Rollback = lab
        .wait_for("objects-back", "done", |r: &Rollback| {
            done(r.status.as_ref().map(|s| &s.phase))
        })
        .await;
    assert_eq!(back.status.map(|s| s.phase), Some(Phase::Ready));
    let rolled_back = secs(t);
    let t = Instant::now();
    let clone = PodClone::new(
        "objects-clone",
        CloneSpec {
            source: CloneSource {
                snapshot_name: Some("objects-snap".into()),
                pod_name: None,
            },
            replicas: i32::try_from(clones()).unwrap_or(i32::MAX),
            name_prefix: None,
            labels: None,
            failure_deadline_seconds: None,
        },
    );
    testkit::create(client, &clone).await;
    let clone: PodClone = lab
        .wait_for("objects-clone", "done", |c: &PodClone| {
            done(c.status.as_ref().map(|s| &s.phase))
        })
        .await;
    assert_eq!(clone.status.map(|s| s.phase), Some(Phase::Ready));
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let forks = pods
        .list(&ListParams::default().labels(&format!("{CLONE_LABEL}=objects-clone")))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .items;
    assert_eq!(forks.len(), clones());
    for fork in &forks {
        let (_, id) = lab
            .running(&fork.name_any(), twig_api::objects::CONTAINER)
            .await;
        assert_eq!(lab.exec(&id, &["true"]).await.0, 0);
    }
    let cloned = secs(t);
    let dp = DeleteParams::default();
    let clones: Api<PodClone> = Api::namespaced(client.clone(), NS);
    let _ = clones.delete("objects-clone", &dp).await;
    let _ = pods.delete("objects", &dp).await;
    lab.delete_snapshots(&["objects-snap"]).await;
    json!({
        "create_to_first_output": create,
        "run_true_p50": rounds[rounds.len() / 2],
        "snapshot": snapshot,
        "rollback": rolled_back,
        "clone_all_answering": cloned,
    })
}

/// The pods' annotations as the stand-in scheduler saw them, by name.
type Seen = std::sync::Arc<
    std::sync::Mutex<
        std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>,
    >,
>;

/// Binds every unbound pod of the namespace to the node (twig-api leaves
/// placement to the scheduler) and records its annotations.
fn stand_in_scheduler(client: Client) -> Seen {
    let pods: Api<Pod> = Api::namespaced(client, NS);
    let seen = Seen::default();
    let record = seen.clone();
    tokio::spawn(async move {
        let mut events = watcher(pods.clone(), watcher::Config::default()).boxed();
        while let Some(event) = events.next().await {
            let Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) = event else {
                continue;
            };
            let name = pod.name_any();
            record
                .lock()
                .expect("lock")
                .insert(name.clone(), pod.annotations().clone());
            let bound = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_some();
            if !bound && pod.metadata.deletion_timestamp.is_none() {
                let bind = json!({"spec": {"nodeName": NODE}});
                let _ = pods
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&bind))
                    .await;
            }
        }
    });
    seen
}

/// The SDKs' tree (`TWIG_E2E_SDK`, a tar.gz), unpacked into a temporary
/// directory the flow is chrooted into.
struct SdkTree {
    dir: tempfile::TempDir,
    python: PathBuf,
}

impl SdkTree {
    fn unpack() -> SdkTree {
        let archive = std::env::var("TWIG_E2E_SDK").expect(
            "TWIG_E2E_SDK names the SDK tree (tests/lab/run.sh carries it): run in the lab",
        );
        let python = std::env::var("TWIG_E2E_SDK_PYTHON").expect("TWIG_E2E_SDK_PYTHON");
        let dir = tempfile::tempdir().expect("tempdir");
        let status = Command::new("tar")
            .arg("-C")
            .arg(dir.path())
            .args(["-xzf", &archive])
            .status()
            .expect("tar");
        assert!(status.success(), "unpacking {archive}: {status}");
        for (name, minor) in [("null", 3), ("zero", 5), ("urandom", 9)] {
            let path = dir.path().join("dev").join(name);
            nix::sys::stat::mknod(
                &path,
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(1, minor),
            )
            .unwrap_or_else(|e| panic!("mknod {}: {e}", path.display()));
        }
        // The lab carries test binaries, not sources: the script is
        // compiled in.
        std::fs::write(
            dir.path().join("flow.py"),
            include_str!("sandbox_api/flow.py"),
        )
        .expect("writing flow.py");
        SdkTree {
            dir,
            python: PathBuf::from(python),
        }
    }

    /// Runs the flow with `env`, each of its lines to `step`; its report
    /// (the last line's JSON), or everything it said.
    fn run_flow(&self, env: &[(&str, &str)], step: &dyn Fn(&str)) -> Result<Value, String> {
        let home = std::fs::read_to_string(self.dir.path().join("etc/twig-python-home"))
            .map_err(|e| format!("the SDK tree's python home: {e}"))?;
        let mut child = Command::new("timeout")
            .arg(FLOW.as_secs().to_string())
            .arg("chroot")
            .arg(self.dir.path())
            .arg(&self.python)
            .arg("/flow.py")
            .env_clear()
            .env("PYTHONPATH", "/sdk")
            .env("PYTHONHOME", home.trim())
            .env("PYTHONUNBUFFERED", "1")
            .env("PATH", "/usr/bin:/bin")
            .env("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the flow: {e}"))?;
        let stderr = child.stderr.take().expect("stderr");
        let errors = std::thread::spawn(move || {
            let mut text = String::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                text.push_str(&line);
                text.push('\n');
            }
            text
        });
        let mut last = String::new();
        let mut said = String::new();
        for line in BufReader::new(child.stdout.take().expect("stdout"))
            .lines()
            .map_while(Result::ok)
        {
            step(&line);
            said.push_str(&line);
            said.push('\n');
            last = line;
        }
        let status = child
            .wait()
            .map_err(|e| format!("waiting for the flow: {e}"))?;
        let errors = errors.join().unwrap_or_default();
        if !status.success() {
            return Err(format!("the flow failed ({status}):\n{said}\n{errors}"));
        }
        serde_json::from_str(&last).map_err(|e| format!("its report {last:?}: {e}\n{errors}"))
    }
}
