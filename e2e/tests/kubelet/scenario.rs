//! What kubelet does for every pod, checked through the test kubelet on one
//! runtime handler: ConfigMap, Secret, downward API, emptyDir (memory too)
//! and `subPath` volumes laid out as kubelet lays them out and updated live;
//! the default ServiceAccount token, rotated; the cluster DNS resolv.conf
//! and the managed /etc/hosts; an init container filling an emptyDir; a
//! readiness probe gating Ready; a liveness probe restarting; crash-loop
//! restarts; termination messages (the file and the log fallback); the
//! phases Succeeded and Failed; the pod's directory gone after deletion.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, ContainerStatus, Pod, Secret};
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use twig_controller_testkit::{self as testkit, NS};
use twig_cri::CriClient;
use twig_e2e::kubelet::{container_id, KubeletConfig, TOKEN_MOUNT_PATH};

/// The node the pods are bound to.
pub const NODE: &str = "test-node";
/// A deadline for hangs, not a measure of speed: two restarts of a crashing
/// container (kubelet's back-off of 10 s, then 20 s, each start an emulated
/// guest's) reached their count only at 120 s in a loaded lab run.
const WITHIN: Duration = Duration::from_secs(300);
const EXEC: Duration = Duration::from_secs(60);

/// The kubelet's configuration: short back-off and token rotation.
pub fn config(images: &[&str], logs: &Path) -> KubeletConfig {
    let mut config = KubeletConfig::new(images, logs);
    config.backoff_base = Duration::from_secs(1);
    config.backoff_max = Duration::from_secs(4);
    config.token_rotation = Duration::from_secs(3);
    config
}

async fn until<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WITHIN;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// [`until`] for pod `name`, quoting its status when time is up.
async fn until_pod<T, F, Fut>(pods: &Api<Pod>, name: &str, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + WITHIN;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() >= deadline {
            let status = pods.get(name).await.map(|p| p.status);
            panic!("timed out waiting for {what}; {name}'s status: {status:#?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn pod(name: &str, handler: &str, image: &str, spec: serde_json::Value) -> Pod {
    let mut spec = spec;
    spec["nodeName"] = json!(NODE);
    spec["runtimeClassName"] = json!(handler);
    for list in ["containers", "initContainers"] {
        for c in spec[list].as_array_mut().into_iter().flatten() {
            c["image"] = json!(image);
        }
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS, "labels": {"app": name}},
        "spec": spec,
    }))
    .unwrap_or_else(|e| panic!("{e}"))
}

async fn exec(cri: &CriClient, id: &str, script: &str) -> (i32, String) {
    let out = cri
        .exec_sync(id, &["sh", "-c", script], EXEC)
        .await
        .unwrap_or_else(|e| panic!("exec {script}: {e}"));
    (
        out.exit_code,
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

async fn status_of(pods: &Api<Pod>, name: &str, container: &str) -> Option<(Pod, ContainerStatus)> {
    let p = pods.get(name).await.ok()?;
    let status = p.status.as_ref()?;
    let cs = status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .find(|c| c.name == container)?
        .clone();
    Some((p, cs))
}

fn condition(p: &Pod, type_: &str) -> bool {
    p.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| c.type_ == type_ && c.status == "True")
}

/// The scenario on `handler`: pods named after it, so handlers can share
/// one API server and kubelet (rooted at `root`).
pub async fn kubelet_does(
    cri: &CriClient,
    client: &Client,
    root: &Path,
    handler: &str,
    image: &str,
) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let conf = format!("conf-{handler}");
    let creds = format!("creds-{handler}");
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": conf, "namespace": NS}, "data": {"greeting": "hello"}}))
    .unwrap_or_else(|e| panic!("{e}"));
    testkit::create(client, &cm).await;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": creds, "namespace": NS}, "data": {"password": "czNjcmV0"}}))
    .unwrap_or_else(|e| panic!("{e}"));
    testkit::create(client, &secret).await;

    let name = format!("full-{handler}");
    let full = pod(
        &name,
        handler,
        image,
        json!({
            "subdomain": "web",
            "hostAliases": [{"ip": "10.1.2.3", "hostnames": ["foo.remote"]}],
            "volumes": [
                {"name": "conf", "configMap": {"name": conf}},
                {"name": "creds", "secret": {"secretName": creds, "defaultMode": 0o400,
                    "items": [{"key": "password", "path": "pw"}]}},
                {"name": "work", "emptyDir": {}},
                {"name": "mem", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
                {"name": "info", "downwardAPI": {"items": [
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
            ],
            "initContainers": [{"name": "fill", "command": ["sh", "-c",
                "echo from-init > /work/seed && cat /etc/conf/greeting > /work/copied"],
                "volumeMounts": [{"name": "work", "mountPath": "/work"},
                                 {"name": "conf", "mountPath": "/etc/conf"}]}],
            "containers": [{"name": "app", "command": ["sh", "-c", "exec sleep 3600"],
                // A timeout a slow node (the lab: an exec takes seconds
                // there) meets: a timed-out probe fails, as kubelet's does.
                "readinessProbe": {"exec": {"command": ["test", "-f", "/tmp/ready"]},
                    "periodSeconds": 1, "timeoutSeconds": 30},
                "volumeMounts": [
                    {"name": "conf", "mountPath": "/etc/conf"},
                    {"name": "creds", "mountPath": "/etc/creds"},
                    {"name": "work", "mountPath": "/work"},
                    {"name": "work", "mountPath": "/seed", "subPath": "seed"},
                    {"name": "mem", "mountPath": "/mem"},
                    {"name": "info", "mountPath": "/etc/info"},
                ]}],
        }),
    );
    let uid = testkit::create(client, &full)
        .await
        .uid()
        .unwrap_or_default();
    let (p, cs) = until_pod(&pods, &name, "the app container to run", || async {
        let (p, cs) = status_of(&pods, &name, "app").await?;
        cs.state.as_ref()?.running.as_ref()?;
        Some((p, cs))
    })
    .await;
    let status = p.status.clone().unwrap_or_default();
    assert_eq!(status.phase.as_deref(), Some("Running"), "{status:#?}");
    assert!(
        !cs.ready && !condition(&p, "Ready"),
        "not ready before its probe passes: {status:#?}"
    );
    let init = &status.init_container_statuses.clone().unwrap_or_default()[0];
    let done = init
        .state
        .as_ref()
        .and_then(|s| s.terminated.clone())
        .unwrap_or_default();
    assert_eq!(
        (done.exit_code, done.reason.as_deref()),
        (0, Some("Completed")),
        "{init:#?}"
    );
    assert!(condition(&p, "Initialized"), "{status:#?}");
    let id = container_id(&p, "app").unwrap_or_else(|| panic!("{status:#?}"));
    let ip = status.pod_ip.clone().unwrap_or_default();

    // Readiness follows the probe.
    assert_eq!(exec(cri, &id, "touch /tmp/ready").await.0, 0);
    until_pod(&pods, &name, "the pod to be ready", || async {
        let p = pods.get(&name).await.ok()?;
        condition(&p, "Ready").then_some(())
    })
    .await;

    // The volumes, the token, DNS and /etc/hosts inside the container.
    let (code, out) = exec(
        cri,
        &id,
        &format!(
            "cat /etc/conf/greeting /etc/creds/pw /work/copied /seed; cat {TOKEN_MOUNT_PATH}/namespace; \
             echo; ls {TOKEN_MOUNT_PATH}; cat /etc/info/labels; echo; grep -c ' /mem tmpfs ' /proc/mounts; \
             touch /etc/conf/x 2>/dev/null && echo writable || true"
        ),
    )
    .await;
    assert_eq!(
        (code, out.as_str()),
        (
            0,
            format!(
                "hellos3crethellofrom-init\n{NS}\nca.crt\nnamespace\ntoken\napp=\"{name}\"\n1\n"
            )
            .as_str()
        ),
        "inside {name}"
    );
    let (_, resolv) = exec(cri, &id, "cat /etc/resolv.conf").await;
    assert!(
        resolv.contains("nameserver 10.96.0.10")
            && resolv.contains(&format!(
                "search {NS}.svc.cluster.local svc.cluster.local cluster.local"
            ))
            && resolv.contains("options ndots:5"),
        "{resolv}"
    );
    let (_, hosts) = exec(cri, &id, "cat /etc/hosts").await;
    assert!(
        hosts.starts_with("# Kubernetes-managed hosts file.\n")
            && hosts.contains(&format!(
                "{ip}\t{name}.web.{NS}.svc.cluster.local\t{name}\n"
            ))
            && hosts.ends_with("# Entries added by HostAliases.\n10.1.2.3\tfoo.remote\n"),
        "{hosts}"
    );

    // On the node, as kubelet lays it out.
    let pod_dir = root.join("pods").join(&uid);
    let configmap = pod_dir.join("volumes/kubernetes.io~configmap/conf");
    assert!(
        std::fs::read_link(configmap.join("..data")).is_ok(),
        "{}",
        configmap.display()
    );
    assert_eq!(
        std::fs::read_link(configmap.join("greeting")).ok(),
        Some("..data/greeting".into())
    );
    use std::os::unix::fs::PermissionsExt;
    let pw = pod_dir.join("volumes/kubernetes.io~secret/creds/pw");
    assert_eq!(
        std::fs::metadata(&pw)
            .map(|m| m.permissions().mode() & 0o777)
            .ok(),
        Some(0o400)
    );
    assert!(pod_dir.join("etc-hosts").is_file());

    // A ConfigMap update and the token's rotation reach the container.
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    cms.patch(
        &conf,
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"greeting": "updated"}})),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    until("the ConfigMap update in the volume", || async {
        (exec(cri, &id, "cat /etc/conf/greeting").await.1 == "updated").then_some(())
    })
    .await;
    let token = exec(cri, &id, &format!("cat {TOKEN_MOUNT_PATH}/token"))
        .await
        .1;
    assert_eq!(token.split('.').count(), 3, "{token}");
    until("the token to rotate", || async {
        let now = exec(cri, &id, &format!("cat {TOKEN_MOUNT_PATH}/token"))
            .await
            .1;
        (now != token && !now.is_empty()).then_some(())
    })
    .await;

    // Exits, termination messages and phases.
    let run_once = |n: &str, script: &str, extra: serde_json::Value| {
        let mut c = json!({"name": "app", "command": ["sh", "-c", script]});
        if let (Some(c), Some(extra)) = (c.as_object_mut(), extra.as_object()) {
            c.extend(extra.clone());
        }
        pod(
            &format!("{n}-{handler}"),
            handler,
            image,
            json!({"restartPolicy": "Never", "containers": [c]}),
        )
    };
    let cases = [
        (
            run_once("ok", "exit 0", json!({})),
            "Succeeded",
            0,
            "Completed",
            None,
        ),
        (
            run_once("bye", "echo bye > /dev/termination-log; exit 3", json!({})),
            "Failed",
            3,
            "Error",
            Some("bye\n"),
        ),
        (
            run_once(
                "fallback",
                "echo from-logs; exit 2",
                json!({"terminationMessagePolicy": "FallbackToLogsOnError"}),
            ),
            "Failed",
            2,
            "Error",
            Some("from-logs\n"),
        ),
    ];
    for (p, phase, exit, reason, message) in cases {
        let n = p.name_any();
        testkit::create(client, &p).await;
        let (p, cs) = until_pod(&pods, &n, &format!("{n} to finish"), || async {
            let (p, cs) = status_of(&pods, &n, "app").await?;
            let phase = p.status.as_ref()?.phase.clone()?;
            (phase == "Succeeded" || phase == "Failed").then_some((p, cs))
        })
        .await;
        let t = cs.state.and_then(|s| s.terminated).unwrap_or_default();
        assert_eq!(
            p.status.and_then(|s| s.phase).as_deref(),
            Some(phase),
            "{n}"
        );
        assert_eq!(
            (t.exit_code, t.reason.as_deref(), t.message.as_deref()),
            (exit, Some(reason), message),
            "{n}"
        );
        assert!(
            t.started_at.is_some() && t.finished_at.is_some(),
            "{n}: {t:#?}"
        );
    }

    // Restarts: a crash loop, and a liveness probe that fails.
    let crash = pod(
        &format!("crash-{handler}"),
        handler,
        image,
        json!({
        "containers": [{"name": "app", "command": ["sh", "-c", "exit 1"]}]}),
    );
    let sick = pod(
        &format!("sick-{handler}"),
        handler,
        image,
        json!({
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "app", "command": ["sh", "-c", "exec sleep 3600"],
            "livenessProbe": {"exec": {"command": ["test", "-f", "/tmp/never"]},
                              "periodSeconds": 1, "failureThreshold": 1}}]}),
    );
    for p in [crash, sick] {
        let n = p.name_any();
        testkit::create(client, &p).await;
        let cs = until_pod(&pods, &n, &format!("{n} to restart twice"), || async {
            let (_, cs) = status_of(&pods, &n, "app").await?;
            (cs.restart_count >= 2).then_some(cs)
        })
        .await;
        let last = cs.last_state.and_then(|s| s.terminated).unwrap_or_default();
        assert_ne!(last.exit_code, 0, "{n}: {last:#?}");
        pods.delete(&n, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    // Deleting the pod removes its directory with its mounts.
    pods.delete(&name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    until("the pod's directory to go", || async {
        (!pod_dir.exists()).then_some(())
    })
    .await;
}
