//! Renders charts/twig without Helm and checks the manifests strictly.
//!
//! The chart keeps to a small subset of Helm's template language (value
//! substitution, `quote`, `toYaml | nindent N`, `if`/`end`, `{{-`/`-}}`
//! trimming); this renderer implements exactly that subset and fails on
//! anything else, so the chart cannot drift beyond what is checked here.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde_json::{json, Value};

fn chart_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/twig")
}

fn lookup<'a>(ctx: &'a Value, path: &str) -> &'a Value {
    let mut v = ctx;
    for part in path.trim_start_matches('.').split('.') {
        v = v
            .get(part)
            .unwrap_or_else(|| panic!("template refers to missing value {path}"));
    }
    v
}

fn scalar(v: &Value, what: &str) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("{what} renders a non-scalar {other}; use toYaml"),
    }
}

fn truthy(v: &Value) -> bool {
    !matches!(v, Value::Null | Value::Bool(false))
        && *v != json!(0)
        && *v != json!("")
        && *v != json!([])
        && *v != json!({})
}

fn to_yaml(v: &Value) -> String {
    serde_saphyr::to_string(v)
        .expect("toYaml")
        .trim_end_matches('\n')
        .to_string()
}

/// Evaluates one action; `None` for control actions.
fn eval(action: &str, ctx: &Value, used: &mut BTreeSet<String>) -> String {
    let stages: Vec<&str> = action.split('|').map(str::trim).collect();
    let mut value = match stages[0].split_whitespace().collect::<Vec<_>>().as_slice() {
        [path] if path.starts_with('.') => {
            used.insert(path.to_string());
            scalar(lookup(ctx, path), path)
        }
        ["toYaml", path] if path.starts_with('.') => {
            used.insert(path.to_string());
            to_yaml(lookup(ctx, path))
        }
        _ => panic!("unsupported template action {{{{ {action} }}}}"),
    };
    for stage in &stages[1..] {
        value = match stage.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["quote"] => serde_json::to_string(&value).expect("quote"),
            ["nindent", n] => {
                let pad = " ".repeat(n.parse().expect("nindent width"));
                format!(
                    "\n{}",
                    value
                        .lines()
                        .map(|l| format!("{pad}{l}"))
                        .collect::<Vec<_>>()
                        .join("\n")
                )
            }
            _ => panic!("unsupported template function in {{{{ {action} }}}}"),
        };
    }
    value
}

/// Renders one template file.
fn render(template: &str, ctx: &Value, used: &mut BTreeSet<String>) -> String {
    let mut out = String::new();
    let mut conditions: Vec<bool> = Vec::new();
    let mut rest = template;
    let mut trim_next = false;
    while let Some(start) = rest.find("{{") {
        let (text, after) = rest.split_at(start);
        let end = after.find("}}").expect("unclosed action");
        let raw = &after[2..end];
        let (trim_before, raw) = raw.strip_prefix('-').map_or((false, raw), |r| (true, r));
        let (trim_after, raw) = raw.strip_suffix('-').map_or((false, raw), |r| (true, r));
        let text = if trim_next { text.trim_start() } else { text };
        if conditions.iter().all(|c| *c) {
            out.push_str(text);
        }
        if trim_before {
            let kept = out.trim_end().len();
            out.truncate(kept);
        }
        let action = raw.trim();
        match action.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["if", path] => {
                used.insert(path.to_string());
                conditions.push(truthy(lookup(ctx, path)));
            }
            ["end"] => {
                conditions.pop().expect("end without if");
            }
            _ => {
                if conditions.iter().all(|c| *c) {
                    out.push_str(&eval(action, ctx, used));
                }
            }
        }
        trim_next = trim_after;
        rest = &after[end + 2..];
    }
    assert!(conditions.is_empty(), "if without end");
    let tail = if trim_next { rest.trim_start() } else { rest };
    out.push_str(tail);
    out
}

fn merge(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// Renders every template with values.yaml plus `overrides`; returns the documents.
fn render_chart(overrides: Value, used: &mut BTreeSet<String>) -> Vec<Value> {
    let dir = chart_dir();
    let chart: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(dir.join("Chart.yaml")).expect("Chart.yaml"),
    )
    .expect("parse Chart.yaml");
    let mut values: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(dir.join("values.yaml")).expect("values.yaml"),
    )
    .expect("parse values.yaml");
    merge(&mut values, &overrides);
    let ctx = json!({
        "Values": values,
        "Release": {"Name": "twig", "Namespace": "twig-system"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
    });
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join("templates"))
        .expect("templates")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    let mut docs = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("template");
        let rendered = render(&text, &ctx, used);
        for doc in rendered.split("\n---") {
            let meaningful = doc
                .lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
            if meaningful {
                let value: Value = serde_saphyr::from_str(doc).unwrap_or_else(|e| {
                    panic!("{} renders invalid YAML: {e}\n{doc}", file.display())
                });
                docs.push(value);
            }
        }
    }
    docs
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

fn leaf_paths(v: &Value, prefix: &str, out: &mut Vec<String>) {
    match v.as_object() {
        Some(map) if !map.is_empty() => {
            for (k, child) in map {
                leaf_paths(child, &format!("{prefix}.{k}"), out);
            }
        }
        _ => out.push(prefix.to_string()),
    }
}

#[test]
fn chart_renders_to_valid_manifests() {
    let mut used = BTreeSet::new();
    let docs = render_chart(json!({}), &mut used);
    let kinds: BTreeSet<String> = docs
        .iter()
        .map(|d| {
            format!(
                "{}/{}",
                d["kind"].as_str().unwrap_or_default(),
                d["metadata"]["name"].as_str().unwrap_or_default()
            )
        })
        .collect();
    let expected: BTreeSet<String> = [
        "ServiceAccount/twig-controller",
        "ClusterRole/twig-controller",
        "ClusterRoleBinding/twig-controller",
        "RuntimeClass/twig",
        "DaemonSet/twig-controller",
        "ConfigMap/twig-containerd-config",
        "DaemonSet/twig-node-setup",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(kinds, expected);

    let sa: ServiceAccount = strict(find(&docs, "ServiceAccount", "twig-controller"));
    let binding: ClusterRoleBinding = strict(find(&docs, "ClusterRoleBinding", "twig-controller"));
    strict::<ClusterRole>(find(&docs, "ClusterRole", "twig-controller"));
    let subject = &binding.subjects.as_ref().expect("subjects")[0];
    assert_eq!(
        (
            subject.kind.as_str(),
            Some(&subject.name),
            subject.namespace.as_deref()
        ),
        (
            "ServiceAccount",
            sa.metadata.name.as_ref(),
            Some("twig-system")
        )
    );
    assert_eq!(binding.role_ref.name, "twig-controller");

    let rc: RuntimeClass = strict(find(&docs, "RuntimeClass", "twig"));
    assert_eq!(rc.handler, "twig");

    let ds: DaemonSet = strict(find(&docs, "DaemonSet", "twig-controller"));
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
    assert_eq!(pod.service_account_name, sa.metadata.name);
    let container = &pod.containers[0];
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
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_twig-controller"))
        .args(&args)
        .arg("--help")
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run twig-controller");
    assert!(
        status.success(),
        "twig-controller rejects the chart's arguments {args:?}"
    );

    let cm: ConfigMap = strict(find(&docs, "ConfigMap", "twig-containerd-config"));
    let toml = cm
        .data
        .as_ref()
        .and_then(|d| d.get("twig.toml"))
        .expect("twig.toml");
    for needle in [
        "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.twig]",
        "runtime_type = \"io.containerd.twig.v2\"",
        "pod_annotations = [\"twig.dev/*\"]",
        "[proxy_plugins.twig]",
        "address = \"/run/twig/snapshotter.sock\"",
    ] {
        assert!(
            toml.contains(needle),
            "containerd config lacks {needle}:\n{toml}"
        );
    }
    strict::<DaemonSet>(find(&docs, "DaemonSet", "twig-node-setup"));

    // Every documented value is used by some template.
    let values: Value = serde_saphyr::from_str(
        &std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values"),
    )
    .expect("parse");
    let mut leaves = Vec::new();
    leaf_paths(&values, ".Values", &mut leaves);
    for leaf in leaves {
        let covered = used
            .iter()
            .any(|u| leaf == *u || leaf.starts_with(&format!("{u}.")));
        assert!(covered, "value {leaf} is not used by any template");
    }
}

#[test]
fn node_setup_can_be_turned_off() {
    let docs = render_chart(
        json!({"nodeSetup": {"enabled": false}, "tolerations": [{"operator": "Exists"}]}),
        &mut BTreeSet::new(),
    );
    assert!(docs
        .iter()
        .all(|d| d["metadata"]["name"] != "twig-node-setup" && d["kind"] != "ConfigMap"));
    let ds: DaemonSet = strict(find(&docs, "DaemonSet", "twig-controller"));
    let tolerations = ds
        .spec
        .template
        .spec
        .and_then(|p| p.tolerations)
        .expect("tolerations");
    assert_eq!(tolerations[0].operator.as_deref(), Some("Exists"));
}

#[test]
fn cluster_role_grants_exactly_what_the_controller_calls() {
    let docs = render_chart(json!({}), &mut BTreeSet::new());
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
    let mut names = Vec::new();
    for (file, yaml) in twig_controller::crd::crd_files().expect("CRDs") {
        let path: &Path = &chart_crds.join(&file);
        let on_disk = std::fs::read_to_string(path).unwrap_or_default();
        assert!(on_disk == yaml, "charts/twig/crds/{file} is stale; regenerate with `cargo run -p twig-controller -- crds --out charts/twig/crds`");
        names.push(file);
    }
    assert_eq!(
        std::fs::read_dir(&chart_crds).expect("dir").count(),
        names.len()
    );
}
