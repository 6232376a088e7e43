//! The chart's registry values (`registry.*`: where Snapshots are exported)
//! rendered with the real Helm: the controller's arguments, the node
//! installer's registry section and credentials Secret, and the admission
//! policies that let a node's controller leave an exported Snapshot's
//! Clone pods to the scheduler, and nobody else set
//! `twig.dev/restore-artifact`.

use twig_controller_testkit as support;

use std::collections::BTreeMap;
use std::process::Command;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};
use twig_controller::crd::{CloneSource, CloneSpec, PodClone};
use twig_controller::reconcile::clone::{clone_pod, Restore};

use support::admission::{self, Request, Verdict};
use support::kube_tools::{helm, run};

const NAMESPACE: &str = "twig-system";
const REGISTRY: &str = "registry.example:5000";

/// `helm template` of the chart with `values` (JSON) over values.yaml: its
/// output, or Helm's error.
fn render(values: &Value) -> Result<String, String> {
    let file = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("values file");
    std::fs::write(file.path(), values.to_string()).expect("write values");
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/twig");
    let out = run(Command::new(helm())
        .args(["template", "twig"])
        .arg(chart)
        .args(["--namespace", NAMESPACE, "--values"])
        .arg(file.path()));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    if out.status.success() {
        Ok(text(&out.stdout))
    } else {
        Err(text(&out.stderr))
    }
}

fn documents(values: &Value) -> Vec<Value> {
    let yaml = render(values).unwrap_or_else(|e| panic!("helm template: {e}"));
    yaml.split("\n---")
        .filter(|doc| {
            doc.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .map(|doc| serde_saphyr::from_str(doc).unwrap_or_else(|e| panic!("{e}\n{doc}")))
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn with_registry() -> Value {
    json!({"registry": {
        "host": REGISTRY,
        "prefix": "snapshots/twig",
        "plainHttp": true,
        "credentialsSecret": "registry-push",
        "lazyFillKiBPerSecond": 4096,
    }})
}

fn controller_args(docs: &[Value]) -> Vec<String> {
    let ds: DaemonSet = serde_json::from_value(find(docs, "DaemonSet", "twig-controller").clone())
        .expect("DaemonSet");
    let pod = ds.spec.template.spec.expect("pod spec");
    pod.containers[0].args.clone().expect("args")
}

fn installer(docs: &[Value]) -> (Vec<String>, k8s_openapi::api::core::v1::PodSpec) {
    let ds: DaemonSet = serde_json::from_value(find(docs, "DaemonSet", "twig-node-setup").clone())
        .expect("DaemonSet");
    let pod = ds.spec.template.spec.expect("pod spec");
    let command = pod.init_containers.as_ref().expect("init containers")[0]
        .command
        .clone()
        .expect("command");
    (command, pod)
}

#[test]
fn registry_values_reach_the_controller_and_the_node_installer() {
    let docs = documents(&with_registry());
    let args = controller_args(&docs);
    assert!(args.contains(&format!("--registry={REGISTRY}")), "{args:?}");
    assert!(
        args.contains(&"--registry-prefix=snapshots/twig".to_string()),
        "{args:?}"
    );
    // The controller binary accepts them.
    let ok = Command::new(env!("CARGO_BIN_EXE_twig-controller"))
        .args(&args)
        .arg("--help")
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run twig-controller");
    assert!(ok.success(), "twig-controller rejects {args:?}");

    // The installer writes node.json's registry section and copies the
    // Secret's config.json, mounted read-only.
    let (command, pod) = installer(&docs);
    let tail: Vec<&str> = command.iter().map(String::as_str).collect();
    let registry_args = [
        "--registry-prefix",
        "snapshots/twig",
        "--registry-plain-http",
        REGISTRY,
        "--registry-credentials",
        "/run/twig-registry/config.json",
        "--registry-lazy-fill-kib",
        "4096",
    ];
    assert!(
        tail.windows(registry_args.len())
            .any(|w| w == registry_args),
        "{command:?}"
    );
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "registry-credentials")
        .expect("the credentials volume");
    let secret = volume.secret.as_ref().expect("a Secret volume");
    assert_eq!(secret.secret_name.as_deref(), Some("registry-push"));
    assert_eq!(secret.default_mode, Some(0o400));
    let items = secret.items.clone().expect("items");
    assert_eq!(
        (items[0].key.as_str(), items[0].path.as_str()),
        (".dockerconfigjson", "config.json")
    );
    let mount = pod.init_containers.as_ref().expect("init")[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "registry-credentials")
        .cloned()
        .expect("mounted");
    assert_eq!(
        (mount.mount_path.as_str(), mount.read_only),
        ("/run/twig-registry", Some(true))
    );

    // Without a registry: no export, nothing for the nodes.
    let docs = documents(&json!({}));
    let args = controller_args(&docs);
    assert!(
        !args.iter().any(|a| a.starts_with("--registry=")),
        "{args:?}"
    );
    let (command, pod) = installer(&docs);
    assert!(
        !command.iter().any(|a| a.starts_with("--registry")),
        "{command:?}"
    );
    assert!(!pod
        .volumes
        .iter()
        .flatten()
        .any(|v| v.name == "registry-credentials"));
}

#[test]
fn helm_refuses_bad_registry_values() {
    for (values, says) in [
        (
            json!({"registry": {"host": "https://registry.example"}}),
            "registry.host",
        ),
        (
            json!({"registry": {"host": REGISTRY, "prefix": "Twig/"}}),
            "registry.prefix",
        ),
        (
            json!({"registry": {"plainHttp": "yes"}}),
            "registry.plainHttp",
        ),
        (
            json!({"registry": {"credentialsSecret": "push"}}),
            "registry.credentialsSecret is set without registry.host",
        ),
        (json!({"registry": {"hots": REGISTRY}}), "hots"),
    ] {
        let err = render(&values).expect_err(&values.to_string());
        assert!(err.contains(says), "{values}: {err}");
    }
}

/// A pod of namespace `team-b` written by `username` (with `extra`):
/// the verdicts of the chart's restore-from policy and node restriction.
fn verdicts(
    docs: &[Value],
    username: &str,
    extra: &BTreeMap<String, Vec<String>>,
    object: &Value,
    old: Option<&Value>,
) -> (Verdict, Verdict) {
    let verdict = |name: &str| {
        let policy = find(docs, "ValidatingAdmissionPolicy", name);
        let binding = find(docs, "ValidatingAdmissionPolicyBinding", name);
        let req = Request::write(("", "v1", "pods"), username, extra, Some(object), old);
        admission::evaluate(policy, binding, &req).expect("the chart's policy evaluates")
    };
    (
        verdict("twig-restore-from"),
        verdict("twig-node-restriction"),
    )
}

fn controller() -> String {
    format!("system:serviceaccount:{NAMESPACE}:twig-controller")
}

fn token_on(node: &str) -> BTreeMap<String, Vec<String>> {
    BTreeMap::from([(
        "authentication.kubernetes.io/node-name".to_string(),
        vec![node.to_string()],
    )])
}

/// Clone pod 0 of Clone `fork` (team-b), as the controller makes it: of an
/// exported snapshot when `artifact` is given, else bound to `node-a`.
fn clone_pod_of(artifact: Option<&str>) -> Value {
    let mut clone = PodClone::new(
        "fork",
        CloneSpec {
            source: CloneSource {
                snapshot_name: Some("redis-snap".into()),
                pod_name: None,
            },
            replicas: 1,
            name_prefix: None,
            labels: None,
            failure_deadline_seconds: None,
        },
    );
    clone.metadata.namespace = Some("team-b".into());
    clone.metadata.uid = Some("4d1b3c2a-0000-4000-8000-000000000001".into());
    let source: Pod = serde_json::from_value(json!({
        "metadata": {"name": "redis", "namespace": "team-b"},
        "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "redis"}]},
    }))
    .expect("source");
    let restore = Restore {
        snapshot_id: "uid-of-a-snapshot",
        snapshot_name: "redis-snap",
        node: "node-a",
        artifact,
    };
    serde_json::to_value(clone_pod(&clone, &source, &restore, 0).expect("clone pod")).expect("json")
}

fn denied(verdict: Verdict) -> String {
    match verdict {
        Verdict::Denied { message, reason } => {
            assert_eq!(reason, "Forbidden", "{message}");
            message
        }
        Verdict::Allowed => panic!("allowed"),
    }
}

#[test]
fn only_an_exported_snapshots_clone_pods_are_left_to_the_scheduler() {
    let docs = documents(&json!({"registry": {"host": REGISTRY}}));
    let controller = controller();
    let node_a = token_on("node-a");
    let artifact = format!(
        "{REGISTRY}/twig/team-b/redis-snap@sha256:{}",
        "ab".repeat(32)
    );
    let unbound = clone_pod_of(Some(&artifact));
    assert!(unbound["spec"].get("nodeName").is_none(), "{unbound}");
    assert_eq!(
        verdicts(&docs, &controller, &node_a, &unbound, None),
        (Verdict::Allowed, Verdict::Allowed)
    );
    // Bound clone pods of the node go through as before.
    let bound = clone_pod_of(None);
    assert_eq!(
        verdicts(&docs, &controller, &node_a, &bound, None),
        (Verdict::Allowed, Verdict::Allowed)
    );

    // Unbound, it must name its own namespace's repository in the chart's
    // registry, and mount no host path.
    let other_ns = artifact.replace("/team-b/", "/team-a/");
    let other_registry = artifact.replace(REGISTRY, "evil.example");
    for wrong in [other_ns, other_registry] {
        let mut pod = unbound.clone();
        pod["metadata"]["annotations"]["twig.dev/restore-artifact"] = json!(wrong);
        let message = denied(verdicts(&docs, &controller, &node_a, &pod, None).1);
        assert!(message.contains("unbound: only a Clone pod"), "{message}");
    }
    let mut host_path = unbound.clone();
    host_path["spec"]["volumes"] = json!([{"name": "d", "hostPath": {"path": "/etc"}}]);
    denied(verdicts(&docs, &controller, &node_a, &host_path, None).1);
    let mut no_artifact = unbound.clone();
    no_artifact["metadata"]["annotations"]
        .as_object_mut()
        .expect("annotations")
        .remove("twig.dev/restore-artifact");
    denied(verdicts(&docs, &controller, &node_a, &no_artifact, None).1);
    // A token without a node creates nothing, unbound or not.
    denied(verdicts(&docs, &controller, &BTreeMap::new(), &unbound, None).1);

    // Without a registry in the chart, no pod is left unbound.
    let docs = documents(&json!({}));
    denied(verdicts(&docs, &controller, &node_a, &unbound, None).1);
}

#[test]
fn only_the_controller_may_set_restore_artifact() {
    let docs = documents(&json!({"registry": {"host": REGISTRY}}));
    let artifact = format!(
        "{REGISTRY}/twig/team-b/redis-snap@sha256:{}",
        "ab".repeat(32)
    );
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team-b",
                     "annotations": {"twig.dev/restore-artifact": artifact}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    });
    let none = BTreeMap::new();
    for user in ["alice", "system:serviceaccount:team-b:default"] {
        let message = denied(verdicts(&docs, user, &none, &pod, None).0);
        assert!(
            message.contains("only the Twig controller may set twig.dev/restore-artifact"),
            "{message}"
        );
        assert!(message.contains(user), "{message}");
    }
    // An update that leaves it as it was is anyone's; changing it is not.
    let old = pod.clone();
    pod["metadata"]["labels"] = json!({"tier": "cache"});
    assert_eq!(
        verdicts(&docs, "alice", &none, &pod, Some(&old)).0,
        Verdict::Allowed
    );
    pod["metadata"]["annotations"]["twig.dev/restore-artifact"] = json!(format!("{artifact}0"));
    denied(verdicts(&docs, "alice", &none, &pod, Some(&old)).0);
    assert_eq!(
        verdicts(&docs, &controller(), &none, &pod, Some(&old)).0,
        Verdict::Allowed
    );
}
