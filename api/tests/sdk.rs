//! The unmodified `e2b` SDK (from PyPI, by `scripts/sdk-venv.sh`) against
//! twig-api, with the controller reconciling Snapshots and Clones behind a
//! fake node, on the testkit's API server. No kubelet exists here: a
//! stand-in binds each sandbox pod to the node and marks it Running and
//! Ready at 127.0.0.1, where a stand-in envd records the `/init` calls
//! (twig-agent's real envd is tested in `agent/tests/envd.rs` and the lab).
//! Needs python3 with venv and pip, and PyPI: the test fails saying so.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Namespace, Pod, PodCondition, PodStatus};
use kube::api::{ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use twig_api::auth::{Tenants, TokenKey};
use twig_api::{App, Server, Settings};
use twig_controller::crd::{SandboxTemplate, SandboxTemplateSpec, Snapshot};
use twig_controller_testkit::{self as support, fake::FakeNode};

const NODE: &str = "node-a";

/// The SDKs' venv, made (or found in the cache) by the project's script.
fn sdk_python() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/sdk-venv.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .expect("running scripts/sdk-venv.sh");
    assert!(
        out.status.success(),
        "scripts/sdk-venv.sh failed (this test needs python3 with venv and pip, and PyPI): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let venv = String::from_utf8_lossy(&out.stdout).trim().to_string();
    PathBuf::from(venv).join("bin/python")
}

/// A stand-in envd on 127.0.0.1: records each `/init` body and the token
/// it came with.
async fn stand_in_envd() -> (u16, Arc<Mutex<Vec<(Option<String>, Value)>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind envd");
    let port = listener.local_addr().expect("addr").port();
    let inits = Arc::new(Mutex::new(Vec::new()));
    let seen = inits.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let token = req
                            .headers()
                            .get("x-access-token")
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string);
                        let path = req.uri().path().to_string();
                        let body = req.into_body().collect().await?.to_bytes();
                        if path == "/init" {
                            let value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                            seen.lock().expect("lock").push((token, value));
                        }
                        let mut res = hyper::Response::new(Full::new(Bytes::new()));
                        *res.status_mut() = hyper::StatusCode::NO_CONTENT;
                        Ok::<_, hyper::Error>(res)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (port, inits)
}

/// The scheduler and kubelet stand-in: every pod of `ns` is bound to
/// [`NODE`] and set Running and Ready at 127.0.0.1; returns the
/// annotations of the pods it saw.
fn stand_in_kubelet(client: Client, ns: &str) -> Arc<Mutex<PodAnnotations>> {
    let pods: Api<Pod> = Api::namespaced(client, ns);
    let seen = Arc::new(Mutex::new(PodAnnotations::new()));
    let record = seen.clone();
    tokio::spawn(async move {
        let mut events = watcher(pods.clone(), watcher::Config::default()).boxed();
        while let Some(Ok(event)) = events.next().await {
            let (watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) = event else {
                continue;
            };
            let ready = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.as_ref())
                .is_some();
            if ready || pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let name = pod.name_any();
            record
                .lock()
                .expect("lock")
                .insert(name.clone(), pod.annotations().clone());
            if pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_none()
            {
                let bind = json!({"spec": {"nodeName": NODE}});
                let _ = pods
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&bind))
                    .await;
            }
            let Ok(mut pod) = pods.get(&name).await else {
                continue;
            };
            pod.status = Some(PodStatus {
                phase: Some("Running".to_string()),
                pod_ip: Some("127.0.0.1".to_string()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".to_string(),
                    status: "True".to_string(),
                    ..Default::default()
                }]),
                ..Default::default()
            });
            let _ = pods
                .replace_status(&name, &PostParams::default(), &pod)
                .await;
        }
    });
    seen
}

/// The annotations of each pod the stand-in kubelet started, by name.
type PodAnnotations = BTreeMap<String, BTreeMap<String, String>>;

/// Runs `tests/sdk/<script>` with `env`; its JSON report (its last line).
async fn run_flow(python: &Path, script: &str, env: &[(&str, &str)]) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/sdk")
        .join(script);
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(&path)
        .env_remove("E2B_API_KEY")
        .env_remove("E2B_DEBUG")
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(300), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{script} took over 300 s"))
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("{script} printed no JSON report: {stdout}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_e2b_sdk_drives_sandboxes_through_twig_objects() {
    let python = sdk_python();
    let server = support::api_server().await;
    let client = server.client();
    support::register_node(&client, NODE).await;
    let fake = Arc::new(FakeNode::default());
    let _ctrl = support::start_controller(&server, NODE, &fake);
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let team_b = Namespace {
        metadata: ObjectMeta {
            name: Some("team-b".to_string()),
            ..Default::default()
        },
        ..Default::default()
    };
    let _ = namespaces.create(&PostParams::default(), &team_b).await;
    let template = SandboxTemplate::new(
        "base",
        SandboxTemplateSpec {
            image: "busybox:1.36".to_string(),
            vcpus: 1,
            memory_mib: 256,
            command: Some(vec!["sleep".to_string(), "infinity".to_string()]),
            warmup: None,
            egress_policy: None,
        },
    );
    support::create(&client, &template).await;
    let pod_annotations = stand_in_kubelet(client.clone(), support::NS);
    let (envd_port, inits) = stand_in_envd().await;

    let mut tenants = Tenants::default();
    tenants.insert("key-a", support::NS);
    tenants.insert("key-b", "team-b");
    let tokens = TokenKey::new(&[42; 32]).expect("token key");
    let app = App::new(
        client.clone(),
        Settings {
            tenants,
            tokens: tokens.clone(),
            domain: None,
            envd_port,
            default_timeout: 300,
            max_timeout: 3600,
            start_timeout: Duration::from_secs(30),
            snapshot_timeout: Duration::from_secs(30),
        },
    );
    tokio::spawn(app.clone().reap_forever(Duration::from_millis(100)));
    let control = TcpListener::bind("127.0.0.1:0").await.expect("bind api");
    let proxy = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let api_url = format!("http://{}", control.local_addr().expect("addr"));
    let sandbox_url = format!("http://{}", proxy.local_addr().expect("addr"));
    tokio::spawn(app.clone().serve(control, Server::Control));
    tokio::spawn(app.clone().serve(proxy, Server::Proxy));

    let envd = envd_port.to_string();
    let report = run_flow(
        &python,
        "e2b_flow.py",
        &[
            ("E2B_API_URL", api_url.as_str()),
            ("E2B_SANDBOX_URL", sandbox_url.as_str()),
            ("E2B_HTTP_VERSION", "1.1"),
            ("KEY_A", "key-a"),
            ("KEY_B", "key-b"),
            ("ENVD_PORT", envd.as_str()),
        ],
    )
    .await;
    let id = report["id"].as_str().expect("id");

    // The envd token the API gave is the one envd was told, and each
    // clone's envd was told its own token with its source's.
    let given = report["envd_token"].as_str().expect("token");
    assert!(tokens.check(twig_api::auth::TokenKind::Envd, support::NS, id, given));
    // Its pod asked for envd, requiring that token from the first request,
    // and the first /init carried it.
    let annotations = pod_annotations.lock().expect("lock").get(id).cloned();
    let annotations = annotations.expect("the sandbox's pod was seen");
    assert_eq!(
        annotations.get("twig.dev/envd").map(String::as_str),
        Some("true")
    );
    assert_eq!(
        annotations.get("twig.dev/envd-token-sha256"),
        Some(&twig_api::auth::sha256_hex(given))
    );
    let inits = inits.lock().expect("lock").clone();
    let told: Vec<&str> = inits
        .iter()
        .filter_map(|(_, body)| body["accessToken"].as_str())
        .collect();
    assert!(told.contains(&given), "envd never got {given}: {told:?}");
    for (token, body) in &inits {
        if body["accessToken"] == given {
            assert_eq!(token.as_deref(), Some(given), "an /init without the token");
        }
    }
    for fork in report["forks"].as_array().expect("forks") {
        let fork = fork.as_str().expect("fork id");
        let token = tokens.token(twig_api::auth::TokenKind::Envd, support::NS, fork);
        let init = inits
            .iter()
            .find(|(_, body)| body["accessToken"] == token.as_str())
            .expect("a fork's init");
        assert_eq!(
            init.0.as_deref(),
            Some(given),
            "a fork's init carries its source's token"
        );
    }
    // Error bodies as E2B gives them.
    let unknown = report["unknown_template"].as_str().expect("message");
    assert!(
        unknown.contains("404") && unknown.contains("no-such-template"),
        "{unknown}"
    );
    assert!(report["b_get"].as_str().expect("b").contains(id));

    let cube = run_flow(
        &python,
        "cube_flow.py",
        &[
            ("CUBE_API_URL", api_url.as_str()),
            ("CUBE_API_KEY", "key-a"),
            ("CUBE_TEMPLATE_ID", "base"),
        ],
    )
    .await;
    assert_eq!(cube["clones"].as_array().map(Vec::len), Some(3));
    assert!(cube["unknown_template"]
        .as_str()
        .is_some_and(|m| m.contains("no-such-template")));

    // Killed: nothing of the sandbox is left but its user snapshot's deletion.
    let pods: Api<Pod> = Api::namespaced(client.clone(), support::NS);
    let left = |lp: ListParams| {
        let pods = pods.clone();
        async move {
            pods.list(&lp)
                .await
                .map(|l| l.items.len())
                .unwrap_or(usize::MAX)
        }
    };
    support::eventually("the sandboxes' pods to go", || {
        let left = &left;
        async move {
            (left(ListParams::default().labels(twig_api::objects::SANDBOX_LABEL)).await == 0)
                .then_some(())
        }
    })
    .await;
    let snaps: Api<Snapshot> = Api::namespaced(client.clone(), support::NS);
    let pause = format!(
        "{}={id},{}={}",
        twig_api::objects::SANDBOX_LABEL,
        twig_api::objects::ROLE_LABEL,
        twig_api::objects::ROLE_PAUSE
    );
    let paused: BTreeMap<String, Snapshot> = snaps
        .list(&ListParams::default().labels(&pause))
        .await
        .expect("list")
        .items
        .into_iter()
        .filter(|s| s.metadata.deletion_timestamp.is_none())
        .map(|s| (s.name_any(), s))
        .collect();
    assert!(
        paused.is_empty(),
        "pause snapshots left: {:?}",
        paused.keys()
    );
}
