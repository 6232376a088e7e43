//! `charts/twig` through the real Helm 3 (`helm lint`, `helm template`), with
//! its default values and with changed ones; every rendered manifest is
//! checked strictly against its Kubernetes type, the RBAC against what the
//! controller calls, and the arguments against the controller binary.

use twig_controller_testkit as support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, Service, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde_json::{json, Value};

use support::admission::{self, Request, Verdict};
use support::kube_tools::{helm, run, succeed};

const RELEASE: &str = "twig";
const NAMESPACE: &str = "twig-system";

/// The RuntimeClass's `overhead.podFixed`, as (resource, quantity) pairs.
fn pod_fixed(rc: &RuntimeClass) -> Vec<(String, String)> {
    rc.overhead
        .clone()
        .and_then(|o| o.pod_fixed)
        .expect("overhead.podFixed")
        .into_iter()
        .map(|(k, v)| (k, v.0))
        .collect()
}

fn chart_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/twig")
}

/// A values file holding `values` (JSON is YAML), kept while the test runs.
fn values_file(values: &Value) -> tempfile::NamedTempFile {
    let file = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("values file");
    std::fs::write(file.path(), values.to_string()).expect("write values");
    file
}

/// `helm template` of the chart with `values` over values.yaml.
fn template_args(values: &Value, release: &str, namespace: &str, extra: &[&str]) -> String {
    let file = values_file(values);
    succeed(
        Command::new(helm())
            .args(["template", release])
            .arg(chart_dir())
            .args(["--namespace", namespace, "--values"])
            .arg(file.path())
            .args(extra),
    )
}

fn template(values: &Value) -> String {
    template_args(values, RELEASE, NAMESPACE, &[])
}

/// The documents of a multi-document YAML stream (comments and empty documents dropped).
fn documents(yaml: &str) -> Vec<Value> {
    yaml.split("\n---")
        .filter(|doc| {
            doc.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .map(|doc| {
            serde_saphyr::from_str(doc).unwrap_or_else(|e| panic!("invalid YAML: {e}\n{doc}"))
        })
        .collect()
}

/// Deserializes into the typed Kubernetes object and back: a field the
/// type does not know (a typo, a wrong level) is lost and fails the check.
fn strict<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value) -> T {
    let typed: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{e}: {doc}"));
    let back = serde_json::to_value(&typed).expect("serialize");
    assert_eq!(&back, doc, "manifest has fields its kind does not define");
    typed
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn kinds(docs: &[Value]) -> BTreeSet<String> {
    docs.iter()
        .map(|d| {
            format!(
                "{}/{}",
                d["kind"].as_str().unwrap_or_default(),
                d["metadata"]["name"].as_str().unwrap_or_default()
            )
        })
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// The controller DaemonSet's container, after checking the DaemonSet as a whole.
fn controller_container(docs: &[Value], service_account: &str) -> Container {
    let ds: DaemonSet = strict(find(docs, "DaemonSet", "twig-controller"));
    let spec = ds.spec;
    let selector = spec.selector.match_labels.clone().expect("selector");
    let pod_labels = spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .expect("labels");
    assert!(
        selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
        "selector does not match the pod labels"
    );
    let pod = spec.template.spec.expect("pod spec");
    assert_eq!(pod.service_account_name.as_deref(), Some(service_account));
    let container = pod.containers[0].clone();
    let volumes: BTreeSet<String> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.clone())
        .collect();
    for mount in container.volume_mounts.iter().flatten() {
        assert!(
            volumes.contains(&mount.name),
            "mount of undefined volume {}",
            mount.name
        );
    }
    // The controller binary accepts the rendered arguments.
    let args = container.args.clone().expect("args");
    let status = Command::new(env!("CARGO_BIN_EXE_twig-controller"))
        .args(&args)
        .arg("--help")
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run twig-controller");
    assert!(
        status.success(),
        "twig-controller rejects the chart's arguments {args:?}"
    );
    container
}

#[test]
fn helm_lints_the_chart_with_default_and_changed_values() {
    succeed(
        Command::new(helm())
            .args(["lint", "--strict"])
            .arg(chart_dir()),
    );
    let changed = values_file(&json!({
        "nodeSetup": {"enabled": false},
        "controller": {"image": "registry.example/twig/controller:9.9.9"},
        "image": {"registry": "registry.example:5000/twig", "tag": "9.9.9"},
        "api": {"enabled": true, "domain": "sandbox.example",
                "ingress": {"enabled": true, "tlsSecret": "wildcard-tls"}},
    }));
    succeed(
        Command::new(helm())
            .args(["lint", "--strict"])
            .arg(chart_dir())
            .arg("--values")
            .arg(changed.path()),
    );
}

#[test]
fn chart_renders_to_valid_manifests() {
    let docs = documents(&template(&json!({})));
    assert_eq!(
        kinds(&docs),
        set(&[
            "ServiceAccount/twig-controller",
            "ClusterRole/twig-controller",
            "ClusterRoleBinding/twig-controller",
            "ClusterRole/twig-view",
            "ClusterRole/twig-edit",
            "RuntimeClass/twig",
            "DaemonSet/twig-controller",
            "DaemonSet/twig-node-setup",
            "Service/twig-controller",
            "ValidatingAdmissionPolicy/twig-restore-from",
            "ValidatingAdmissionPolicyBinding/twig-restore-from",
            "ValidatingAdmissionPolicy/twig-node-restriction",
            "ValidatingAdmissionPolicyBinding/twig-node-restriction",
        ])
    );
    let sa: ServiceAccount = strict(find(&docs, "ServiceAccount", "twig-controller"));
    assert_eq!(sa.metadata.namespace.as_deref(), Some(NAMESPACE));
    let binding: ClusterRoleBinding = strict(find(&docs, "ClusterRoleBinding", "twig-controller"));
    strict::<ClusterRole>(find(&docs, "ClusterRole", "twig-controller"));
    let subject = &binding.subjects.as_ref().expect("subjects")[0];
    assert_eq!(
        (
            subject.kind.as_str(),
            Some(&subject.name),
            subject.namespace.as_deref()
        ),
        ("ServiceAccount", sa.metadata.name.as_ref(), Some(NAMESPACE))
    );
    assert_eq!(binding.role_ref.name, "twig-controller");
    metrics_service_selects_the_controller(&docs, 9090);

    let rc: RuntimeClass = strict(find(&docs, "RuntimeClass", "twig"));
    assert_eq!(rc.handler, "twig");
    assert_eq!(
        pod_fixed(&rc),
        [("memory", "32Mi")].map(|(k, v)| (k.to_string(), v.to_string())),
        "the measured per-pod cost"
    );

    let container = controller_container(&docs, "twig-controller");
    let node_name = container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(
        node_name.as_deref(),
        Some("spec.nodeName"),
        "node name from the downward API"
    );
    let security = container
        .security_context
        .as_ref()
        .expect("securityContext");
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(security.privileged, None);
    assert_eq!(
        security.capabilities.as_ref().and_then(|c| c.drop.clone()),
        Some(vec!["ALL".to_string()])
    );
    assert_eq!(security.read_only_root_filesystem, Some(true));
    // It only reads containerd's state and connects to sockets, which needs
    // no writable mount.
    let mounts = container.volume_mounts.as_ref().expect("mounts");
    assert_eq!(mounts.len(), 3);
    for mount in mounts {
        assert_eq!(
            mount.read_only,
            Some(true),
            "{} is writable",
            mount.mount_path
        );
    }

    // The node installer: scripts/install-node.sh from the installer image
    // into the host's /, privileged, with the host's PID 1 to reach systemd.
    let setup: DaemonSet = strict(find(&docs, "DaemonSet", "twig-node-setup"));
    let pod = setup.spec.template.spec.expect("pod spec");
    assert_eq!(pod.host_pid, Some(true));
    let install = &pod.init_containers.as_ref().expect("init containers")[0];
    assert_eq!(
        install.command.as_deref().expect("command"),
        installer(&["twig", "--start"])
    );
    assert_eq!(
        install.security_context.as_ref().and_then(|s| s.privileged),
        Some(true)
    );
    let mount = &install.volume_mounts.as_ref().expect("mounts")[0];
    assert_eq!(mount.mount_path, "/host");
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .expect("the mounted volume");
    assert_eq!(
        volume.host_path.as_ref().map(|h| h.path.as_str()),
        Some("/")
    );
}

/// The installer's command: install-node.sh into the host's `/` from the
/// image's bundle, for handler `rest[0]`, then the rest.
fn installer(rest: &[&str]) -> Vec<String> {
    [
        "/opt/twig/install-node.sh",
        "--from",
        "/opt/twig",
        "--root",
        "/host",
        "--handler",
    ]
    .iter()
    .chain(rest)
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn node_setup_values_reach_the_installer() {
    let docs = documents(&template(&json!({
        "runtimeClass": {"handler": "twig-kvm"},
        "nodeSetup": {"containerdVersion": "1.7", "start": false},
    })));
    let setup: DaemonSet = strict(find(&docs, "DaemonSet", "twig-node-setup"));
    let pod = setup.spec.template.spec.expect("pod spec");
    let install = &pod.init_containers.as_ref().expect("init containers")[0];
    assert_eq!(
        install.command.as_deref().expect("command"),
        installer(&["twig-kvm", "--containerd-version", "1.7"])
    );
}

#[test]
fn changed_values_reach_the_manifests() {
    let values = json!({
        "controller": {
            "image": "registry.example/twig/controller:9.9.9",
            "imagePullPolicy": "Always",
            "metricsPort": 9191,
            "logLevel": "twig_controller=debug",
            "callTimeoutSeconds": 30,
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        },
        "node": {"twigRunDir": "/var/run/twig"},
        // Helm merges maps with the defaults: a null drops the default label.
        "nodeSelector": {"example.com/pool": "sandboxes", "twig.dev/runtime": null},
        "tolerations": [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
        "runtimeClass": {
            "name": "microvm",
            "handler": "twig-kvm",
            "overhead": {"memory": "64Mi", "cpu": "50m"},
        },
        "nodeSetup": {"enabled": false},
    });
    let docs = documents(&template_args(&values, "sandbox", "agents", &[]));
    assert_eq!(
        kinds(&docs),
        set(&[
            "ServiceAccount/twig-controller",
            "ClusterRole/twig-controller",
            "ClusterRoleBinding/twig-controller",
            "ClusterRole/twig-view",
            "ClusterRole/twig-edit",
            "RuntimeClass/microvm",
            "DaemonSet/twig-controller",
            "Service/twig-controller",
            "ValidatingAdmissionPolicy/twig-restore-from",
            "ValidatingAdmissionPolicyBinding/twig-restore-from",
            "ValidatingAdmissionPolicy/twig-node-restriction",
            "ValidatingAdmissionPolicyBinding/twig-node-restriction",
        ]),
        "node setup off: no node-setup DaemonSet"
    );
    let binding: ClusterRoleBinding = strict(find(&docs, "ClusterRoleBinding", "twig-controller"));
    assert_eq!(
        binding.subjects.expect("subjects")[0].namespace.as_deref(),
        Some("agents")
    );
    let rc: RuntimeClass = strict(find(&docs, "RuntimeClass", "microvm"));
    assert_eq!(rc.handler, "twig-kvm");
    assert_eq!(
        rc.scheduling.clone().and_then(|s| s.node_selector),
        Some([("example.com/pool".to_string(), "sandboxes".to_string())].into())
    );
    assert_eq!(
        pod_fixed(&rc),
        [("cpu", "50m"), ("memory", "64Mi")].map(|(k, v)| (k.to_string(), v.to_string()))
    );

    let ds: DaemonSet = strict(find(&docs, "DaemonSet", "twig-controller"));
    assert_eq!(
        ds.metadata.labels.expect("labels")["app.kubernetes.io/instance"],
        "sandbox"
    );
    let pod = ds.spec.template.spec.expect("pod spec");
    let toleration = &pod.tolerations.expect("tolerations")[0];
    assert_eq!(
        (toleration.key.as_deref(), toleration.effect.as_deref()),
        (Some("sandbox"), Some("NoSchedule"))
    );
    let container = controller_container(&docs, "twig-controller");
    assert_eq!(
        container.image.as_deref(),
        Some("registry.example/twig/controller:9.9.9")
    );
    assert_eq!(container.image_pull_policy.as_deref(), Some("Always"));
    let args = container.args.clone().expect("args");
    for arg in [
        "--metrics-addr=0.0.0.0:9191",
        "--node-socket=unix:///var/run/twig/node.sock",
        "--call-timeout-secs=30",
    ] {
        assert!(args.iter().any(|a| a == arg), "{arg} not in {args:?}");
    }
    assert_eq!(
        container.ports.expect("ports")[0].container_port,
        9191,
        "metrics port"
    );
    metrics_service_selects_the_controller(&docs, 9191);
    let resources = serde_json::to_value(container.resources.expect("resources")).expect("json");
    assert_eq!(resources, values["controller"]["resources"]);
    let log = container
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "RUST_LOG")
        .and_then(|e| e.value.clone());
    assert_eq!(log.as_deref(), Some("twig_controller=debug"));
}

/// The headless Service `kubectl twig net` finds each node's controller
/// through: it selects the controller DaemonSet's pods (and only them) and
/// names their metrics port `metrics`, as the plugin's defaults expect.
fn metrics_service_selects_the_controller(docs: &[Value], port: i32) {
    let service: Service = strict(find(docs, "Service", "twig-controller"));
    let ds: DaemonSet = strict(find(docs, "DaemonSet", "twig-controller"));
    let spec = service.spec.expect("service spec");
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"), "headless");
    assert_eq!(
        spec.selector, ds.spec.selector.match_labels,
        "the Service selects the controller's pods"
    );
    let setup_labels = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == "twig-node-setup")
        .map(|d| d["spec"]["template"]["metadata"]["labels"].clone());
    if let (Some(labels), Some(selector)) = (setup_labels, &spec.selector) {
        let selected = selector.iter().all(|(k, v)| labels[k] == v.as_str());
        assert!(!selected, "the Service must not select the node setup pods");
    }
    let ports = spec.ports.expect("ports");
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].name.as_deref(), Some("metrics"));
    assert_eq!(ports[0].port, port);
    let container = controller_container(docs, "twig-controller");
    let named = container.ports.expect("container ports")[0].name.clone();
    assert_eq!(
        ports[0].target_port,
        named.map(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String),
        "targets the container's named metrics port"
    );
}

/// A value of the same type as `v`, the value of key `key`, that differs
/// from it (and that values.schema.json accepts).
fn changed(key: &str, v: &Value) -> Value {
    match v {
        Value::String(s) if s.is_empty() => json!("changed"),
        Value::String(s) => json!(format!("{s}-changed")),
        Value::Number(n) => json!(n.as_i64().expect("integer value") + 1),
        Value::Bool(b) => json!(!b),
        Value::Array(_) if key == "tolerations" => {
            json!([{"key": "changed", "operator": "Exists"}])
        }
        Value::Array(_) => json!(["changed"]),
        Value::Object(_) => json!({"changed": "yes"}),
        Value::Null => json!("changed"),
    }
}

/// `over` merged into `base`, as Helm merges values: maps key by key,
/// anything else replaced.
fn merged(base: &Value, over: &Value) -> Value {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            let mut out = b.clone();
            for (k, v) in o {
                let next = out.get(k).map_or(v.clone(), |old| merged(old, v));
                out.insert(k.clone(), next);
            }
            Value::Object(out)
        }
        _ => over.clone(),
    }
}

/// Values with every optional part of the chart on: twig-api and its
/// Ingress, and the registry snapshots are exported to.
fn all_on() -> Value {
    json!({
        "api": {"enabled": true, "domain": "sandbox.example", "ingress": {"enabled": true}},
        "registry": {"host": "registry.example"},
    })
}

/// Every leaf of `v` (non-empty objects are descended), as a key path.
fn leaf_paths(v: &Value, prefix: &[String], out: &mut Vec<Vec<String>>) {
    match v.as_object() {
        Some(map) if !map.is_empty() => {
            for (k, child) in map {
                let mut path = prefix.to_vec();
                path.push(k.clone());
                leaf_paths(child, &path, out);
            }
        }
        _ => out.push(prefix.to_vec()),
    }
}

#[test]
fn every_value_changes_the_rendered_chart() {
    let values: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values.yaml"),
    )
    .expect("parse values.yaml");
    // With every optional part on, so that the values of twig-api (off by
    // default) are rendered too; each leaf changes from what that base has.
    let base = merged(&values, &all_on());
    let defaults = template(&all_on());
    let mut leaves = Vec::new();
    leaf_paths(&values, &[], &mut leaves);
    assert!(leaves.len() > 10, "values.yaml has its leaves: {leaves:?}");
    for path in leaves {
        let mut current = &base;
        for key in &path {
            current = &current[key.as_str()];
        }
        let mut over = changed(path.last().expect("a key"), current);
        for key in path.iter().rev() {
            over = json!({ key.clone(): over });
        }
        assert_ne!(
            template(&merged(&all_on(), &over)),
            defaults,
            "value {} is not used by any template",
            path.join(".")
        );
    }
}

#[test]
fn chart_refuses_kubernetes_older_than_it_supports() {
    let out = run(Command::new(helm())
        .args(["template", RELEASE])
        .arg(chart_dir())
        .args(["--kube-version", "1.29.9"]));
    assert!(!out.status.success(), "rendered for Kubernetes 1.29");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("kubeVersion"),
        "the error names the kubeVersion requirement: {stderr}"
    );
}

#[test]
fn cluster_role_grants_exactly_what_the_controller_calls() {
    let docs = documents(&template(&json!({})));
    let role: ClusterRole = strict(find(&docs, "ClusterRole", "twig-controller"));
    let mut granted = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    assert_ne!(verb, "*", "wildcard verb");
                    assert_ne!(resource, "*", "wildcard resource");
                    granted.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    let needed: BTreeSet<(String, String, String)> = support::rbac::CONTROLLER_RULES
        .iter()
        .flat_map(|(g, r, verbs)| {
            verbs
                .iter()
                .map(move |v| (g.to_string(), r.to_string(), v.to_string()))
        })
        .collect();
    assert_eq!(granted, needed);
}

#[test]
fn chart_crds_are_the_generated_ones() {
    let chart_crds = chart_dir().join("crds");
    let mut generated = Vec::new();
    for (file, yaml) in twig_controller::crd::crd_files().expect("CRDs") {
        let path: &Path = &chart_crds.join(&file);
        let on_disk = std::fs::read_to_string(path).unwrap_or_default();
        assert!(on_disk == yaml, "charts/twig/crds/{file} is stale; regenerate with `cargo run -p twig-controller -- crds --out charts/twig/crds`");
        generated.push(serde_saphyr::from_str::<Value>(&yaml).expect("generated CRD"));
    }
    assert_eq!(
        std::fs::read_dir(&chart_crds).expect("dir").count(),
        generated.len()
    );
    // Helm installs exactly these (`helm install` applies crds/ before the templates).
    let rendered = documents(&template_args(
        &json!({}),
        RELEASE,
        NAMESPACE,
        &["--include-crds"],
    ));
    let crds: Vec<&Value> = rendered
        .iter()
        .filter(|d| d["kind"] == "CustomResourceDefinition")
        .collect();
    assert_eq!(crds.len(), generated.len());
    for crd in generated {
        assert!(
            crds.contains(&&crd),
            "helm does not install {}",
            crd["metadata"]["name"]
        );
    }
}

/// The verdict of the chart's restore-from policy (rendered from `docs`)
/// on a pod write by `username`: `old` is the stored pod of an UPDATE.
fn restore_from_verdict(
    docs: &[Value],
    username: &str,
    resource: &str,
    object: &Value,
    old: Option<&Value>,
) -> Verdict {
    let policy = find(docs, "ValidatingAdmissionPolicy", "twig-restore-from");
    let binding = find(
        docs,
        "ValidatingAdmissionPolicyBinding",
        "twig-restore-from",
    );
    let extra = BTreeMap::new();
    let req = Request::write(("", "v1", resource), username, &extra, Some(object), old);
    admission::evaluate(policy, binding, &req).expect("the chart's policy evaluates")
}

/// A pod of namespace `team-b`; `Value::Null`: one without annotations.
fn pod_annotated(annotations: Value) -> Value {
    let mut pod = json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "namespace": "team-b"},
           "spec": {"containers": [{"name": "c", "image": "busybox"}]}});
    if !annotations.is_null() {
        pod["metadata"]["annotations"] = annotations;
    }
    pod
}

#[test]
fn only_the_controller_may_set_restore_from_on_a_pod() {
    let docs = documents(&template(&json!({})));
    let policy: ValidatingAdmissionPolicy = strict(find(
        &docs,
        "ValidatingAdmissionPolicy",
        "twig-restore-from",
    ));
    let binding: ValidatingAdmissionPolicyBinding = strict(find(
        &docs,
        "ValidatingAdmissionPolicyBinding",
        "twig-restore-from",
    ));
    assert_eq!(
        policy.spec.and_then(|s| s.failure_policy).as_deref(),
        Some("Fail")
    );
    assert_eq!(binding.spec.validation_actions, vec!["Deny".to_string()]);

    let controller = format!("system:serviceaccount:{NAMESPACE}:twig-controller");
    let clone = pod_annotated(json!({"twig.dev/restore-from": "uid-of-a-snapshot"}));
    let plain = pod_annotated(json!({"team": "b"}));
    let denied = |v: Verdict| match v {
        Verdict::Denied { message, reason } => {
            assert_eq!(reason, "Forbidden");
            message
        }
        Verdict::Allowed => panic!("allowed"),
    };
    // A user naming a snapshot by hand is refused, with who they are.
    let message = denied(restore_from_verdict(&docs, "alice", "pods", &clone, None));
    assert!(
        message.contains("only the Twig controller") && message.contains("alice"),
        "{message}"
    );
    // The controller's Clone pods go through; pods without it are anyone's.
    assert_eq!(
        restore_from_verdict(&docs, &controller, "pods", &clone, None),
        Verdict::Allowed
    );
    assert_eq!(
        restore_from_verdict(&docs, "alice", "pods", &plain, None),
        Verdict::Allowed
    );
    assert_eq!(
        restore_from_verdict(&docs, "alice", "pods", &pod_annotated(Value::Null), None),
        Verdict::Allowed
    );
    // An update that keeps the annotation (a label, a finalizer) is anyone's;
    // one that adds or changes it is the controller's.
    let mut relabelled = clone.clone();
    relabelled["metadata"]["labels"] = json!({"tier": "gold"});
    assert_eq!(
        restore_from_verdict(&docs, "alice", "pods", &relabelled, Some(&clone)),
        Verdict::Allowed
    );
    let retargeted = pod_annotated(json!({"twig.dev/restore-from": "another-tenants"}));
    denied(restore_from_verdict(
        &docs,
        "alice",
        "pods",
        &retargeted,
        Some(&clone),
    ));
    denied(restore_from_verdict(
        &docs,
        "alice",
        "pods",
        &clone,
        Some(&plain),
    ));
    // Not a pod: not this policy's.
    assert_eq!(
        restore_from_verdict(&docs, "alice", "configmaps", &clone, None),
        Verdict::Allowed
    );

    // The controller of a release in another namespace, and users the
    // operator adds, are trusted; the default namespace's controller is not.
    let elsewhere = documents(&template_args(
        &json!({"admission": {"restoreFromUsers": ["system:serviceaccount:ops:cloner"]}}),
        RELEASE,
        "twig-elsewhere",
        &[],
    ));
    for trusted in [
        "system:serviceaccount:twig-elsewhere:twig-controller",
        "system:serviceaccount:ops:cloner",
    ] {
        assert_eq!(
            restore_from_verdict(&elsewhere, trusted, "pods", &clone, None),
            Verdict::Allowed,
            "{trusted}"
        );
    }
    denied(restore_from_verdict(
        &elsewhere,
        &controller,
        "pods",
        &clone,
        None,
    ));
}

/// Every (group, resource, verb) the rendered chart grants the ServiceAccount
/// `namespace/name`, through any (Cluster)RoleBinding of a role it renders.
fn grants_of(docs: &[Value], namespace: &str, name: &str) -> BTreeSet<(String, String, String)> {
    let mut granted = BTreeSet::new();
    for binding in docs
        .iter()
        .filter(|d| d["kind"] == "ClusterRoleBinding" || d["kind"] == "RoleBinding")
    {
        let names_it = binding["subjects"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|s| {
                s["kind"] == "ServiceAccount" && s["name"] == name && s["namespace"] == namespace
            });
        if !names_it {
            continue;
        }
        let role = find(
            docs,
            binding["roleRef"]["kind"].as_str().expect("roleRef.kind"),
            binding["roleRef"]["name"].as_str().expect("roleRef.name"),
        );
        for rule in role["rules"].as_array().into_iter().flatten() {
            for group in rule["apiGroups"].as_array().into_iter().flatten() {
                for resource in rule["resources"].as_array().into_iter().flatten() {
                    for verb in rule["verbs"].as_array().into_iter().flatten() {
                        let text = |v: &Value| v.as_str().expect("a string").to_string();
                        granted.insert((text(group), text(resource), text(verb)));
                    }
                }
            }
        }
    }
    granted
}

/// The ServiceAccount username of the controller of the default release.
fn controller_user() -> String {
    format!("system:serviceaccount:{NAMESPACE}:twig-controller")
}

/// A bound ServiceAccount token's extra info for a pod on `node` (`None`: a
/// token that names no node).
fn token_of(node: Option<&str>) -> BTreeMap<String, Vec<String>> {
    let mut extra = BTreeMap::from([(
        "authentication.kubernetes.io/pod-name".to_string(),
        vec!["twig-controller-x7k2p".to_string()],
    )]);
    if let Some(node) = node {
        extra.insert(
            "authentication.kubernetes.io/node-name".to_string(),
            vec![node.to_string()],
        );
    }
    extra
}

/// The verdict of the chart's node restriction on a write of `resource`
/// (core group for pods, else twig.dev) by `username` with `extra`:
/// `old` alone is a DELETE, `object` alone a CREATE, both an UPDATE.
fn node_restriction_verdict(
    docs: &[Value],
    username: &str,
    extra: &BTreeMap<String, Vec<String>>,
    resource: &str,
    object: Option<&Value>,
    old: Option<&Value>,
) -> Verdict {
    let policy = find(docs, "ValidatingAdmissionPolicy", "twig-node-restriction");
    let binding = find(
        docs,
        "ValidatingAdmissionPolicyBinding",
        "twig-node-restriction",
    );
    let (group, version) = if resource == "pods" {
        ("", "v1")
    } else {
        ("twig.dev", "v1alpha1")
    };
    let req = Request::write((group, version, resource), username, extra, object, old);
    admission::evaluate(policy, binding, &req).expect("the chart's policy evaluates")
}

/// The message of a `Forbidden` denial.
fn forbidden(verdict: Verdict) -> String {
    match verdict {
        Verdict::Denied { message, reason } => {
            assert_eq!(reason, "Forbidden", "{message}");
            message
        }
        Verdict::Allowed => panic!("allowed"),
    }
}

/// Clone pod 0 of Clone `fork` (team-b) of a Snapshot taken on `node`, as
/// the controller makes it.
fn clone_pod_on(node: &str) -> Value {
    use twig_controller::crd::{CloneSource, CloneSpec, PodClone};
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
    let source: k8s_openapi::api::core::v1::Pod =
        serde_json::from_value(pod_annotated(Value::Null)).expect("source pod");
    let restore = twig_controller::reconcile::clone::Restore {
        snapshot_id: "uid-of-a-snapshot",
        snapshot_name: "redis-snap",
        node,
        artifact: None,
    };
    let pod = twig_controller::reconcile::clone::clone_pod(&clone, &source, &restore, 0)
        .expect("clone pod");
    serde_json::to_value(pod).expect("json")
}

/// The test: no role of the chart lets a node's controller create
/// pods cluster-wide. RBAC grants it `create` on pods (it cannot scope by
/// node), so the node restriction policy must bound every such create to
/// a Clone's pod on the node its token was issued on.
#[test]
fn a_node_controller_creates_pods_only_on_its_own_node() {
    let docs = documents(&template(&json!({})));
    let controller = controller_user();
    let grants = grants_of(&docs, NAMESPACE, "twig-controller");
    let pod_create = [("", "pods", "create"), ("", "pods", "*"), ("", "*", "*")]
        .iter()
        .filter(|(g, r, v)| grants.contains(&(g.to_string(), r.to_string(), v.to_string())))
        .count();
    assert_eq!(pod_create, 1, "the clone pods: {grants:?}");

    // The policy is in force for every namespace and refuses on error.
    let policy: ValidatingAdmissionPolicy = strict(find(
        &docs,
        "ValidatingAdmissionPolicy",
        "twig-node-restriction",
    ));
    let binding: ValidatingAdmissionPolicyBinding = strict(find(
        &docs,
        "ValidatingAdmissionPolicyBinding",
        "twig-node-restriction",
    ));
    assert_eq!(
        policy.spec.and_then(|s| s.failure_policy).as_deref(),
        Some("Fail")
    );
    assert_eq!(binding.spec.validation_actions, vec!["Deny".to_string()]);
    assert!(binding.spec.match_resources.is_none(), "every namespace");

    let node_a = token_of(Some("node-a"));
    let verdict = |user: &str, extra: &BTreeMap<String, Vec<String>>, pod: &Value| {
        node_restriction_verdict(&docs, user, extra, "pods", Some(pod), None)
    };
    // Its own node's clone pod, as the controller makes it, goes through
    // (and through the restore-from policy).
    let own = clone_pod_on("node-a");
    assert_eq!(verdict(&controller, &node_a, &own), Verdict::Allowed);
    assert_eq!(
        restore_from_verdict(&docs, &controller, "pods", &own, None),
        Verdict::Allowed
    );
    // Another node's, or one left to the scheduler (without a registry in
    // the chart: chart_registry.rs), is refused by name.
    let message = forbidden(verdict(&controller, &node_a, &clone_pod_on("node-b")));
    assert!(
        message.contains(
            "\"node-a\" may create and delete pods only on its own node, not on \"node-b\""
        ),
        "{message}"
    );
    let mut unbound = own.clone();
    unbound["spec"]
        .as_object_mut()
        .expect("spec")
        .remove("nodeName");
    forbidden(verdict(&controller, &node_a, &unbound));
    // A token that names no node creates no pod.
    forbidden(verdict(&controller, &token_of(None), &own));
    forbidden(verdict(&controller, &BTreeMap::new(), &own));
    // Only a Clone's pod under Twig: not a runc pod, not a pod without the
    // restore, the Clone's label or its controller ownerReference.
    let mut plain = pod_annotated(Value::Null);
    plain["spec"]["nodeName"] = json!("node-a");
    forbidden(verdict(&controller, &node_a, &plain));
    let mut runc = own.clone();
    runc["spec"]["runtimeClassName"] = json!("runc");
    forbidden(verdict(&controller, &node_a, &runc));
    for (field, key) in [
        ("annotations", "twig.dev/restore-from"),
        ("labels", "twig.dev/clone"),
    ] {
        let mut pod = own.clone();
        pod["metadata"][field]
            .as_object_mut()
            .expect("map")
            .remove(key);
        forbidden(verdict(&controller, &node_a, &pod));
    }
    let mut unowned = own.clone();
    unowned["metadata"]["ownerReferences"][0]["controller"] = json!(false);
    forbidden(verdict(&controller, &node_a, &unowned));
    // Users and other ServiceAccounts are not this policy's.
    for user in ["alice", "system:serviceaccount:twig-system:other"] {
        assert_eq!(verdict(user, &node_a, &plain), Verdict::Allowed, "{user}");
    }
}

/// The build Pod of SandboxTemplate `py` (team-b) on `node`, as the
/// controller makes it.
fn build_pod_on(node: &str) -> Value {
    let mut template: twig_controller::crd::SandboxTemplate =
        serde_json::from_value(template_object(&[])).expect("template");
    template.metadata.uid = Some("4d1b3c2a-0000-4000-8000-000000000002".into());
    template.metadata.generation = Some(1);
    let pod = twig_controller::reconcile::template::build_pod(&template, node, &["hub".into()]);
    serde_json::to_value(pod).expect("json")
}

/// Issue 24, item 7: a node's controller makes and deletes a template's
/// build Pod on its own node — kubelet runs it — and no other pod: not on
/// another node, not one that restores a snapshot, mounts volumes or is
/// not controlled by the template its label names; it deletes no other
/// pod.
#[test]
fn a_node_controller_makes_and_deletes_build_pods_only_on_its_own_node() {
    let docs = documents(&template(&json!({})));
    let controller = controller_user();
    let node_a = token_of(Some("node-a"));
    let create = |pod: &Value| {
        node_restriction_verdict(&docs, &controller, &node_a, "pods", Some(pod), None)
    };
    let delete = |pod: &Value| {
        node_restriction_verdict(&docs, &controller, &node_a, "pods", None, Some(pod))
    };
    let own = build_pod_on("node-a");
    assert_eq!(create(&own), Verdict::Allowed);
    assert_eq!(delete(&own), Verdict::Allowed);
    assert_eq!(
        restore_from_verdict(&docs, &controller, "pods", &own, None),
        Verdict::Allowed
    );
    let message = forbidden(create(&build_pod_on("node-b")));
    assert!(message.contains("only on its own node"), "{message}");
    forbidden(delete(&build_pod_on("node-b")));
    let mut restoring = own.clone();
    restoring["metadata"]["annotations"]["twig.dev/restore-from"] = json!("team-a-snapshot");
    forbidden(create(&restoring));
    let mut with_volume = own.clone();
    with_volume["spec"]["volumes"] =
        json!([{"name": "secrets", "secret": {"secretName": "other"}}]);
    forbidden(create(&with_volume));
    let mut other_owner = own.clone();
    other_owner["metadata"]["labels"]["twig.dev/template-build"] = json!("other");
    forbidden(create(&other_owner));
    let mut runc = own.clone();
    runc["spec"]["runtimeClassName"] = json!("runc");
    forbidden(create(&runc));
    // Any other pod of its node, a clone's included, is not its to delete.
    let message = forbidden(delete(&clone_pod_on("node-a")));
    assert!(
        message.contains("deletes only templates' build pods"),
        "{message}"
    );
    let mut plain = pod_annotated(Value::Null);
    plain["spec"]["nodeName"] = json!("node-a");
    forbidden(delete(&plain));
}

/// A SandboxTemplate (namespace team-b) with `finalizers`.
fn template_object(finalizers: &[&str]) -> Value {
    json!({"apiVersion": "twig.dev/v1alpha1", "kind": "SandboxTemplate",
           "metadata": {"name": "py", "namespace": "team-b", "finalizers": finalizers},
           "spec": {"image": "python:3", "vcpus": 1, "memoryMiB": 128}})
}

/// A Snapshot (namespace team-b) taken on `node`.
fn snapshot_object(node: Option<&str>) -> Value {
    let mut snap = json!({"apiVersion": "twig.dev/v1alpha1", "kind": "Snapshot",
           "metadata": {"name": "s", "namespace": "team-b",
                        "finalizers": ["twig.dev/snapshot-data"]},
           "spec": {"podName": "redis", "mode": "Incremental", "deletionPolicy": "Retain"},
           "status": {"phase": "Pending"}});
    if let Some(node) = node {
        snap["status"] = json!({"phase": "Ready", "nodeName": node});
    }
    snap
}

#[test]
fn a_node_controller_changes_only_finalizers_and_deletes_only_its_snapshots() {
    let docs = documents(&template(&json!({})));
    let controller = controller_user();
    let node_a = token_of(Some("node-a"));
    let verdict = |user: &str, resource: &str, object: Option<&Value>, old: Option<&Value>| {
        node_restriction_verdict(&docs, user, &node_a, resource, object, old)
    };
    let update = |resource: &str, object: &Value, old: &Value| {
        verdict(&controller, resource, Some(object), Some(old))
    };

    // Its finalizer on, another node's off: an update of finalizers only.
    let old = template_object(&["twig.dev/template.node-b"]);
    let new = template_object(&["twig.dev/template.node-a"]);
    assert_eq!(update("sandboxtemplates", &new, &old), Verdict::Allowed);
    // The spec, labels, annotations and owners are not the controller's.
    let mut respec = new.clone();
    respec["spec"]["image"] = json!("attacker/python:3");
    let message = forbidden(update("sandboxtemplates", &respec, &old));
    assert!(message.contains("only the finalizers"), "{message}");
    let mut widened = new.clone();
    widened["spec"]["egressPolicy"] = json!({"defaultAction": "allow"});
    forbidden(update("sandboxtemplates", &widened, &old));
    for (field, value) in [
        ("labels", json!({"tier": "gold"})),
        ("annotations", json!({"note": "x"})),
        (
            "ownerReferences",
            json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "gone", "uid": "u"}]),
        ),
    ] {
        let mut changed = new.clone();
        changed["metadata"][field] = value;
        forbidden(update("sandboxtemplates", &changed, &old));
    }
    // The same holds for Snapshots (a mutable spec field: its deletion policy).
    let snap = snapshot_object(Some("node-b"));
    let mut released = snap.clone();
    released["metadata"]["finalizers"] = json!([]);
    assert_eq!(update("snapshots", &released, &snap), Verdict::Allowed);
    let mut deleting = snap.clone();
    deleting["spec"]["deletionPolicy"] = json!("Delete");
    forbidden(update("snapshots", &deleting, &snap));
    // Its status subresource, and users' edits, are not this policy's.
    assert_eq!(
        update("sandboxtemplates/status", &respec, &old),
        Verdict::Allowed
    );
    assert_eq!(
        verdict("alice", "sandboxtemplates", Some(&respec), Some(&old)),
        Verdict::Allowed
    );

    // Deletes: only the Snapshots its own node took (their TTL).
    let delete = |resource: &str, old: &Value| verdict(&controller, resource, None, Some(old));
    assert_eq!(
        delete("snapshots", &snapshot_object(Some("node-a"))),
        Verdict::Allowed
    );
    let message = forbidden(delete("snapshots", &snapshot_object(Some("node-b"))));
    assert!(message.contains("deletes only the Snapshots"), "{message}");
    forbidden(delete("snapshots", &snapshot_object(None)));
    forbidden(delete("sandboxtemplates", &old));
    assert_eq!(
        verdict(
            "alice",
            "snapshots",
            None,
            Some(&snapshot_object(Some("node-b")))
        ),
        Verdict::Allowed
    );
}

/// Users get Twig's objects through Kubernetes' view, edit and admin roles:
/// read for view, write for edit and admin; no status, nothing else.
#[test]
fn users_get_aggregated_view_and_edit_roles() {
    let docs = documents(&template(&json!({})));
    let plurals: BTreeSet<String> = twig_controller::crd::crd_files()
        .expect("CRDs")
        .iter()
        .map(|(_, yaml)| {
            let crd: Value = serde_saphyr::from_str(yaml).expect("CRD");
            crd["spec"]["names"]["plural"]
                .as_str()
                .expect("plural")
                .to_string()
        })
        .collect();
    assert_eq!(plurals.len(), 4);
    let read = ["get", "list", "watch"];
    let write = ["create", "update", "patch", "delete", "deletecollection"];
    for (name, aggregate_to, verbs) in [
        ("twig-view", &["view"][..], read.to_vec()),
        (
            "twig-edit",
            &["edit", "admin"][..],
            read.iter().chain(&write).copied().collect(),
        ),
    ] {
        let role: ClusterRole = strict(find(&docs, "ClusterRole", name));
        let labels = role.metadata.labels.clone().expect("labels");
        for to in aggregate_to {
            let label = format!("rbac.authorization.k8s.io/aggregate-to-{to}");
            assert_eq!(
                labels.get(&label).map(String::as_str),
                Some("true"),
                "{name}: {label}"
            );
        }
        let aggregated: BTreeSet<&str> = labels
            .keys()
            .filter_map(|k| k.strip_prefix("rbac.authorization.k8s.io/aggregate-to-"))
            .collect();
        assert_eq!(aggregated, aggregate_to.iter().copied().collect(), "{name}");
        let mut granted = BTreeSet::new();
        for rule in role.rules.iter().flatten() {
            assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());
            for group in rule.api_groups.iter().flatten() {
                for resource in rule.resources.iter().flatten() {
                    for verb in &rule.verbs {
                        granted.insert((group.clone(), resource.clone(), verb.clone()));
                    }
                }
            }
        }
        let expected: BTreeSet<(String, String, String)> = plurals
            .iter()
            .flat_map(|p| {
                verbs
                    .iter()
                    .map(move |v| ("twig.dev".to_string(), p.clone(), v.to_string()))
            })
            .collect();
        assert_eq!(granted, expected, "{name}");
    }
}

/// The container images of every pod template in `docs` (containers and
/// init containers), sorted and deduplicated.
fn images_of(docs: &[Value]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for doc in docs {
        let pod = &doc["spec"]["template"]["spec"];
        for list in ["containers", "initContainers"] {
            for c in pod[list].as_array().into_iter().flatten() {
                out.insert(c["image"].as_str().expect("image").to_string());
            }
        }
    }
    out
}

/// `scripts/build-images.sh --list` with `args`: the references it builds.
fn build_images_list(args: &[&str]) -> BTreeSet<String> {
    let script = chart_dir().join("../../scripts/build-images.sh");
    succeed(Command::new(script).arg("--list").args(args))
        .lines()
        .map(str::to_string)
        .collect()
}

/// Issue 25, item 5: every image the chart names (all parts on) is one
/// `scripts/build-images.sh` builds, with the same registry, names and
/// tag, by default and with the registry a test or a user pushes to; the
/// tag is the chart's appVersion, which is the workspace's version (the
/// binaries' `--version`), so the chart and its images go together.
#[test]
fn rendered_images_are_the_ones_build_images_sh_builds() {
    let chart: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(chart_dir().join("Chart.yaml")).expect("Chart.yaml"),
    )
    .expect("parse Chart.yaml");
    assert_eq!(
        chart["appVersion"],
        json!(env!("CARGO_PKG_VERSION")),
        "the chart's appVersion (its images' tag) is the workspace's version"
    );
    let built = build_images_list(&[]);
    let expected: BTreeSet<String> = ["twig-controller", "twig-api", "twig-node-installer"]
        .iter()
        .map(|name| format!("ghcr.io/twig-dev/{name}:{}", env!("CARGO_PKG_VERSION")))
        .collect();
    assert_eq!(built, expected);
    assert_eq!(images_of(&documents(&template(&all_on()))), built);

    let registry = "127.0.0.1:5000/twig";
    let pushed = build_images_list(&["--registry", registry]);
    let docs = documents(&template(&merged(
        &all_on(),
        &json!({"image": {"registry": registry}}),
    )));
    assert_eq!(images_of(&docs), pushed);
    assert!(pushed.iter().all(|r| r.starts_with("127.0.0.1:5000/twig/")));

    // A tag of the user's, and a whole reference for one image.
    let docs = documents(&template(&merged(
        &all_on(),
        &json!({"image": {"tag": "9.9.9"}, "api": {"image": "registry.example/api@sha256:0123"}}),
    )));
    assert_eq!(
        images_of(&docs),
        set(&[
            "ghcr.io/twig-dev/twig-controller:9.9.9",
            "ghcr.io/twig-dev/twig-node-installer:9.9.9",
            "registry.example/api@sha256:0123",
        ])
    );
}

/// (API group, resource, verbs) twig-api calls: api/src/sandboxes.rs and
/// proxy.rs (`await_condition` is a list and a watch of the one object).
const API_RULES: &[(&str, &str, &[&str])] = &[
    (
        "",
        "pods",
        &["get", "list", "watch", "create", "patch", "delete"],
    ),
    (
        "twig.dev",
        "snapshots",
        &["get", "list", "watch", "create", "patch", "delete"],
    ),
    (
        "twig.dev",
        "clones",
        &["get", "list", "watch", "create", "delete"],
    ),
    (
        "twig.dev",
        "rollbacks",
        &["list", "watch", "create", "delete"],
    ),
    ("twig.dev", "sandboxtemplates", &["get"]),
];

/// Every (group, resource, verb) `role` grants, refusing wildcards.
fn granted(role: &ClusterRole) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    assert_ne!(verb, "*", "wildcard verb");
                    assert_ne!(resource, "*", "wildcard resource");
                    out.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    out
}

/// Issue 25, items 1 and 5: twig-api's Deployment, Service, ServiceAccount
/// and role render from its values, as their Kubernetes types, off by
/// default; the role grants exactly what twig-api calls, in every
/// namespace or only in the tenants' ones.
#[test]
fn api_deployment_and_rbac_render_with_its_values() {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::networking::v1::Ingress;
    use k8s_openapi::api::rbac::v1::RoleBinding;

    let defaults = documents(&template(&json!({})));
    assert!(
        kinds(&defaults).iter().all(|k| !k.ends_with("/twig-api")),
        "twig-api is off by default: {:?}",
        kinds(&defaults)
    );

    let docs = documents(&template_args(
        &json!({"api": {"enabled": true}}),
        "sandbox",
        "agents",
        &[],
    ));
    let api_kinds: BTreeSet<String> = kinds(&docs)
        .into_iter()
        .filter(|k| k.ends_with("/twig-api"))
        .collect();
    assert_eq!(
        api_kinds,
        set(&[
            "ServiceAccount/twig-api",
            "ClusterRole/twig-api",
            "ClusterRoleBinding/twig-api",
            "Deployment/twig-api",
            "Service/twig-api",
        ])
    );
    let role: ClusterRole = strict(find(&docs, "ClusterRole", "twig-api"));
    let needed: BTreeSet<(String, String, String)> = API_RULES
        .iter()
        .flat_map(|(g, r, verbs)| {
            verbs
                .iter()
                .map(move |v| (g.to_string(), r.to_string(), v.to_string()))
        })
        .collect();
    assert_eq!(granted(&role), needed);
    let binding: ClusterRoleBinding = strict(find(&docs, "ClusterRoleBinding", "twig-api"));
    assert_eq!(binding.role_ref.name, "twig-api");
    let subject = &binding.subjects.expect("subjects")[0];
    assert_eq!(
        (subject.name.as_str(), subject.namespace.as_deref()),
        ("twig-api", Some("agents"))
    );
    strict::<ServiceAccount>(find(&docs, "ServiceAccount", "twig-api"));

    let deployment: Deployment = strict(find(&docs, "Deployment", "twig-api"));
    let spec = deployment.spec;
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.expect("pod spec");
    assert_eq!(pod.service_account_name.as_deref(), Some("twig-api"));
    let pod_security = pod.security_context.expect("pod securityContext");
    assert_eq!(
        (pod_security.run_as_non_root, pod_security.run_as_user),
        (Some(true), Some(65532)),
        "twig-api runs as the image's non-root user"
    );
    let c = &pod.containers[0];
    assert_eq!(
        c.image.as_deref(),
        Some(format!("ghcr.io/twig-dev/twig-api:{}", env!("CARGO_PKG_VERSION")).as_str())
    );
    let security = c.security_context.as_ref().expect("securityContext");
    assert_eq!(security.read_only_root_filesystem, Some(true));
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(
        c.args.clone().expect("args"),
        [
            "--listen=0.0.0.0:3000",
            "--proxy-listen=0.0.0.0:8080",
            "--keys=/etc/twig-api/keys/keys.yaml",
            "--token-secret=/etc/twig-api/token/secret",
            "--default-timeout=300",
            "--max-timeout=86400",
        ]
    );
    // The two files come from the two Secrets, mounted where the args say.
    let secret_of = |volume: &str| {
        let v = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == volume)
            .unwrap_or_else(|| panic!("no volume {volume}"));
        v.secret.as_ref().and_then(|s| s.secret_name.clone())
    };
    let mount_of = |volume: &str| {
        let m = c
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name == volume)
            .unwrap_or_else(|| panic!("no mount of {volume}"));
        assert_eq!(m.read_only, Some(true));
        m.mount_path.clone()
    };
    assert_eq!(secret_of("keys").as_deref(), Some("twig-api-keys"));
    assert_eq!(secret_of("token").as_deref(), Some("twig-api-token"));
    assert_eq!(mount_of("keys"), "/etc/twig-api/keys");
    assert_eq!(mount_of("token"), "/etc/twig-api/token");
    let probe = c.readiness_probe.as_ref().and_then(|p| p.http_get.as_ref());
    assert_eq!(probe.and_then(|h| h.path.as_deref()), Some("/health"));

    // The Service selects the Deployment's pods and names its two ports.
    let service: Service = strict(find(&docs, "Service", "twig-api"));
    let sspec = service.spec.expect("service spec");
    assert_eq!(sspec.selector, spec.selector.match_labels);
    assert_eq!(sspec.type_.as_deref(), Some("ClusterIP"));
    let ports: Vec<(Option<String>, i32)> = sspec
        .ports
        .expect("ports")
        .into_iter()
        .map(|p| (p.name, p.port))
        .collect();
    assert_eq!(
        ports,
        [(Some("api".into()), 3000), (Some("proxy".into()), 8080)]
    );
    let container_ports: Vec<(Option<String>, i32)> = c
        .ports
        .clone()
        .expect("container ports")
        .into_iter()
        .map(|p| (p.name, p.container_port))
        .collect();
    assert_eq!(container_ports, ports);
    // The controller's headless Service does not select twig-api's pods.
    let controller_service: Service = strict(find(&docs, "Service", "twig-controller"));
    let labels = spec
        .template
        .metadata
        .and_then(|m| m.labels)
        .expect("labels");
    let controller_selector = controller_service
        .spec
        .and_then(|s| s.selector)
        .expect("selector");
    assert!(!controller_selector
        .iter()
        .all(|(k, v)| labels.get(k) == Some(v)));

    // Changed values: tenants' namespaces only, domain, ports, Secrets, TLS at an Ingress.
    let values = json!({"api": {
        "enabled": true,
        "replicas": 3,
        "image": "registry.example/twig-api:1.0",
        "keysSecret": {"name": "tenants", "key": "tenants.yaml"},
        "tokenSecret": {"name": "tokens", "key": "hmac"},
        "domain": "sandbox.example.com",
        "namespaces": ["team-a", "team-b"],
        "apiPort": 3300,
        "proxyPort": 8088,
        "defaultTimeoutSeconds": 60,
        "maxTimeoutSeconds": 3600,
        "logLevel": "twig_api=debug",
        "service": {"type": "LoadBalancer"},
        "ingress": {"enabled": true, "className": "nginx", "tlsSecret": "wildcard-tls"},
    }});
    let docs = documents(&template_args(&values, "sandbox", "agents", &[]));
    assert!(
        !kinds(&docs).contains("ClusterRoleBinding/twig-api"),
        "bound only in the tenants' namespaces"
    );
    let bound: BTreeSet<String> = docs
        .iter()
        .filter(|d| d["kind"] == "RoleBinding")
        .map(|d| {
            let rb: RoleBinding = strict(d);
            assert_eq!(rb.role_ref.kind, "ClusterRole");
            assert_eq!(rb.role_ref.name, "twig-api");
            let s = &rb.subjects.expect("subjects")[0];
            assert_eq!(
                (s.name.as_str(), s.namespace.as_deref()),
                ("twig-api", Some("agents"))
            );
            rb.metadata.namespace.expect("namespace")
        })
        .collect();
    assert_eq!(bound, set(&["team-a", "team-b"]));
    let deployment: Deployment = strict(find(&docs, "Deployment", "twig-api"));
    let spec = deployment.spec;
    assert_eq!(spec.replicas, Some(3));
    let pod = spec.template.spec.expect("pod spec");
    let c = &pod.containers[0];
    assert_eq!(c.image.as_deref(), Some("registry.example/twig-api:1.0"));
    assert_eq!(
        c.args.clone().expect("args"),
        [
            "--listen=0.0.0.0:3300",
            "--proxy-listen=0.0.0.0:8088",
            "--keys=/etc/twig-api/keys/tenants.yaml",
            "--token-secret=/etc/twig-api/token/hmac",
            "--domain=sandbox.example.com",
            "--default-timeout=60",
            "--max-timeout=3600",
        ]
    );
    let env = c.env.clone().expect("env");
    assert_eq!(
        (env[0].name.as_str(), env[0].value.as_deref()),
        ("RUST_LOG", Some("twig_api=debug"))
    );
    let secrets: BTreeSet<String> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.secret.as_ref().and_then(|s| s.secret_name.clone()))
        .collect();
    assert_eq!(secrets, set(&["tenants", "tokens"]));
    let service: Service = strict(find(&docs, "Service", "twig-api"));
    let sspec = service.spec.expect("service spec");
    assert_eq!(sspec.type_.as_deref(), Some("LoadBalancer"));
    assert_eq!(
        sspec
            .ports
            .expect("ports")
            .iter()
            .map(|p| p.port)
            .collect::<Vec<_>>(),
        [3300, 8088]
    );
    let ingress: Ingress = strict(find(&docs, "Ingress", "twig-api"));
    let ispec = ingress.spec.expect("ingress spec");
    assert_eq!(ispec.ingress_class_name.as_deref(), Some("nginx"));
    let tls = &ispec.tls.expect("tls")[0];
    assert_eq!(tls.secret_name.as_deref(), Some("wildcard-tls"));
    assert_eq!(
        tls.hosts.clone().expect("hosts"),
        ["api.sandbox.example.com", "*.sandbox.example.com"]
    );
    let routes: Vec<(String, String)> = ispec
        .rules
        .expect("rules")
        .into_iter()
        .map(|r| {
            let path = &r.http.expect("http").paths[0];
            let port = path
                .backend
                .service
                .as_ref()
                .and_then(|s| s.port.as_ref())
                .and_then(|p| p.name.clone())
                .expect("port name");
            (r.host.expect("host"), port)
        })
        .collect();
    assert_eq!(
        routes,
        [
            ("api.sandbox.example.com".to_string(), "api".to_string()),
            ("*.sandbox.example.com".to_string(), "proxy".to_string()),
        ],
        "the API at api.<domain>, sandboxes' ports at <port>-<id>.<domain>"
    );
}

/// `helm template` with `values`: its stderr, asserting it failed.
fn template_error(values: &Value) -> String {
    let file = values_file(values);
    let out = run(Command::new(helm())
        .args(["template", RELEASE])
        .arg(chart_dir())
        .arg("--values")
        .arg(file.path()));
    assert!(
        !out.status.success(),
        "helm rendered bad values {values}:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// values.schema.json: Helm refuses a misspelt twig-api key, an image
/// registry or tag that is no reference's, a port out of range, a tenant
/// namespace that is no namespace name, and an Ingress without the domain
/// it routes; the same values spelt right render.
#[test]
fn helm_refuses_bad_image_and_api_values() {
    for (bad, says) in [
        (json!({"api": {"enabled": true, "replica": 3}}), "replica"),
        (
            json!({"image": {"registry": "Registry.Example/Twig"}}),
            "registry",
        ),
        (json!({"image": {"tag": "-rc1"}}), "tag"),
        (json!({"api": {"apiPort": 70000}}), "apiPort"),
        (json!({"api": {"namespaces": ["Team_A"]}}), "namespaces"),
        (json!({"api": {"keysSecret": {"name": ""}}}), "keysSecret"),
        (
            json!({"api": {"enabled": true, "ingress": {"enabled": true}}}),
            "needs api.domain",
        ),
    ] {
        let stderr = template_error(&bad);
        assert!(stderr.contains(says), "{bad}: {stderr}");
    }
    template(&json!({
        "api": {"enabled": true, "replicas": 3, "apiPort": 65535, "namespaces": ["team-a"],
                "domain": "sandbox.example", "ingress": {"enabled": true}},
        "image": {"registry": "registry.example:5000/twig/", "tag": "rc1"},
    }));
}
