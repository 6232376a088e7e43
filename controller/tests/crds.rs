//! The checked-in CRDs: up to date with the Rust types, structural, and with
//! CEL rules that compile and decide as intended.

use twig_controller_testkit as support;

use std::collections::BTreeSet;

use serde_json::{json, Value};
use support::schema::{crds_dir, load, structural_errors, value_errors};

#[test]
fn checked_in_crds_match_the_rust_types() {
    let dir = crds_dir();
    let generated = twig_controller::crd::crd_files().expect("render CRDs");
    for (file, yaml) in &generated {
        let on_disk = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
        assert!(
            on_disk == *yaml,
            "crds/{file} is stale; regenerate with `cargo run -p twig-controller -- crds --out crds`"
        );
    }
    let expected: BTreeSet<&str> = generated.iter().map(|(f, _)| f.as_str()).collect();
    let present: BTreeSet<String> = std::fs::read_dir(&dir)
        .expect("crds dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    let present: BTreeSet<&str> = present.iter().map(String::as_str).collect();
    assert_eq!(
        present, expected,
        "crds/ holds files no Rust type generates"
    );
}

/// Follows a printer column's `.a.b` JSON path through the schema.
fn schema_at<'a>(schema: &'a Value, json_path: &str) -> Option<&'a Value> {
    let mut node = schema;
    for part in json_path.trim_start_matches('.').split('.') {
        node = node["properties"].get(part)?;
    }
    Some(node)
}

#[test]
fn every_crd_is_namespaced_structural_with_status_and_printer_columns() {
    let crds = load();
    assert_eq!(
        crds.by_plural
            .keys()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        ["clones", "rollbacks", "sandboxtemplates", "snapshots"]
    );
    for (plural, crd) in &crds.by_plural {
        let doc = &crd.doc;
        assert_eq!(doc["apiVersion"], "apiextensions.k8s.io/v1");
        assert_eq!(doc["metadata"]["name"], format!("{plural}.twig.dev"));
        assert_eq!(doc["spec"]["group"], "twig.dev");
        assert_eq!(doc["spec"]["scope"], "Namespaced");
        let versions = doc["spec"]["versions"].as_array().expect("versions");
        assert_eq!(versions.len(), 1);
        let v = &versions[0];
        assert_eq!(
            (
                v["name"].as_str(),
                v["served"].as_bool(),
                v["storage"].as_bool()
            ),
            (Some("v1alpha1"), Some(true), Some(true))
        );
        assert_eq!(
            v["subresources"]["status"],
            json!({}),
            "{plural} has no status subresource"
        );

        let mut errors = Vec::new();
        structural_errors(&crd.schema, plural, &mut errors);
        assert!(
            errors.is_empty(),
            "{plural} is not structural:\n{}",
            errors.join("\n")
        );

        let columns = v["additionalPrinterColumns"]
            .as_array()
            .expect("printer columns");
        let names: Vec<&str> = columns.iter().filter_map(|c| c["name"].as_str()).collect();
        assert!(names.contains(&"Age"), "{plural}: {names:?}");
        for column in columns {
            let path = column["jsonPath"].as_str().expect("jsonPath");
            if path == ".metadata.creationTimestamp" {
                continue;
            }
            let field = schema_at(&crd.schema, path)
                .unwrap_or_else(|| panic!("{plural}: column path {path} is not in the schema"));
            let ty = column["type"].as_str().expect("column type");
            assert_eq!(
                field["type"].as_str(),
                Some(ty),
                "{plural}: column {path} type"
            );
        }
    }
    let columns = |plural: &str| -> Vec<String> {
        crds.by_plural[plural].doc["spec"]["versions"][0]["additionalPrinterColumns"]
            .as_array()
            .expect("columns")
            .iter()
            .filter_map(|c| c["name"].as_str().map(String::from))
            .collect()
    };
    for plural in ["snapshots", "clones", "rollbacks"] {
        let c = columns(plural);
        assert!(
            c.contains(&"Phase".to_string()) && c.contains(&"Duration(ms)".to_string()),
            "{plural}: {c:?}"
        );
    }
    assert!(columns("snapshots").contains(&"Size".to_string()));
}

#[test]
fn the_structural_check_rejects_what_an_api_server_would() {
    let bad = json!({
        "type": "object",
        "properties": {
            "untyped": {"description": "no type"},
            "union": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
            "empty": {"type": "object"},
            "ref": {"$ref": "#/definitions/x", "type": "string"},
            "list": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}},
                     "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["k"]},
            "badDefault": {"type": "integer", "minimum": 1.0, "default": 0}
        }
    });
    let mut errors = Vec::new();
    structural_errors(&bad, "bad", &mut errors);
    let all = errors.join("\n");
    for expected in [
        "bad.untyped: type must not be empty",
        "bad.union: anyOf is not allowed",
        "bad.empty: an object without properties",
        "bad.ref: $ref is not allowed",
        "list map key k must be required or defaulted",
        "bad.badDefault.default: Invalid value: 0",
    ] {
        assert!(all.contains(expected), "missing {expected:?} in:\n{all}");
    }
}

#[test]
fn every_cel_rule_compiles() {
    let crds = load();
    let mut rules = 0;
    for (plural, crd) in &crds.by_plural {
        let compiled = kube_cel::compile_schema(&crd.schema);
        let errors: Vec<String> = compiled
            .compilation_errors()
            .iter()
            .map(|e| format!("{e:?}"))
            .collect();
        assert!(errors.is_empty(), "{plural}: {errors:?}");
        let mut found = Vec::new();
        rules_in(&crd.schema, plural, &mut found);
        for (path, node, rule) in found {
            // Scope (only self/oldSelf and root variables) and cost within the API server's budget.
            let node_compiled = kube_cel::compile_schema(node);
            let warnings = kube_cel::analyze_rule(
                &rule,
                &node_compiled,
                kube_cel::ScopeContext::CrdValidation,
            );
            assert!(warnings.is_empty(), "{path}: {rule}: {warnings:?}");
            rules += 1;
        }
    }
    assert_eq!(
        rules, 5,
        "a CEL rule was added or lost; cover it in cel_rules_decide_as_intended"
    );
}

/// Every `x-kubernetes-validations` rule with the schema node it sits on.
fn rules_in<'a>(schema: &'a Value, path: &str, out: &mut Vec<(String, &'a Value, String)>) {
    for rule in schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        out.push((
            path.to_string(),
            schema,
            rule["rule"].as_str().unwrap_or_default().to_string(),
        ));
    }
    for (k, v) in schema["properties"].as_object().into_iter().flatten() {
        rules_in(v, &format!("{path}.{k}"), out);
    }
    if schema["items"].is_object() {
        rules_in(&schema["items"], &format!("{path}[]"), out);
    }
    if schema["additionalProperties"].is_object() {
        rules_in(&schema["additionalProperties"], &format!("{path}[*]"), out);
    }
}

fn object(kind: &str, spec: Value) -> Value {
    json!({"apiVersion": "twig.dev/v1alpha1", "kind": kind, "metadata": {"name": "x", "namespace": "default"}, "spec": spec})
}

#[test]
fn cel_rules_decide_as_intended() {
    let crds = load();
    let check =
        |plural: &str, obj: Value, old: Option<Value>| crds.validate(plural, &obj, old.as_ref());

    // Clone: exactly one source.
    let one = object(
        "Clone",
        json!({"source": {"snapshotName": "s"}, "replicas": 8}),
    );
    assert_eq!(check("clones", one.clone(), None), Ok(()));
    assert_eq!(
        check(
            "clones",
            object("Clone", json!({"source": {"podName": "p"}, "replicas": 1})),
            None
        ),
        Ok(())
    );
    for source in [json!({}), json!({"snapshotName": "s", "podName": "p"})] {
        let err = check(
            "clones",
            object("Clone", json!({"source": source, "replicas": 2})),
            None,
        )
        .expect_err("refused");
        assert!(
            err.contains("spec.source: set exactly one of source.snapshotName and source.podName"),
            "{err}"
        );
    }
    // Clone: source and replicas cannot change; labels can.
    let relabelled = object(
        "Clone",
        json!({"source": {"snapshotName": "s"}, "replicas": 8, "labels": {"a": "b"}}),
    );
    assert_eq!(check("clones", relabelled, Some(one.clone())), Ok(()));
    for changed in [
        json!({"source": {"snapshotName": "t"}, "replicas": 8}),
        json!({"source": {"snapshotName": "s"}, "replicas": 9}),
    ] {
        let err =
            check("clones", object("Clone", changed), Some(one.clone())).expect_err("changed");
        assert!(err.contains("source and replicas are immutable"), "{err}");
    }

    // Snapshot: podName, podUid and mode are immutable; the TTL is not.
    let snap = object(
        "Snapshot",
        json!({"podName": "redis", "mode": "Incremental"}),
    );
    let ttl = object(
        "Snapshot",
        json!({"podName": "redis", "mode": "Incremental", "ttlSecondsAfterReady": 60}),
    );
    assert_eq!(check("snapshots", ttl, Some(snap.clone())), Ok(()));
    for changed in [
        json!({"podName": "other", "mode": "Incremental"}),
        json!({"podName": "redis", "mode": "Full"}),
        json!({"podName": "redis", "mode": "Incremental", "podUid": "u-1"}),
    ] {
        let err = check("snapshots", object("Snapshot", changed), Some(snap.clone()))
            .expect_err("changed");
        assert!(
            err.contains("podName, podUid and mode are immutable"),
            "{err}"
        );
    }
    let pinned = object(
        "Snapshot",
        json!({"podName": "redis", "mode": "Incremental", "podUid": "u-1"}),
    );
    assert_eq!(
        check("snapshots", pinned.clone(), Some(pinned.clone())),
        Ok(())
    );
    for changed in [
        json!({"podName": "redis", "mode": "Incremental", "podUid": "u-2"}),
        json!({"podName": "redis", "mode": "Incremental"}),
    ] {
        let err = check(
            "snapshots",
            object("Snapshot", changed),
            Some(pinned.clone()),
        )
        .expect_err("podUid changed");
        assert!(
            err.contains("podName, podUid and mode are immutable"),
            "{err}"
        );
    }
    // The default mode counts as set: omitting it is not a change.
    let defaulted = object("Snapshot", json!({"podName": "redis"}));
    assert_eq!(check("snapshots", defaulted, Some(snap.clone())), Ok(()));
    // Snapshot: export may be turned on later, not off.
    let exported = object(
        "Snapshot",
        json!({"podName": "redis", "mode": "Incremental", "export": true}),
    );
    assert_eq!(
        check("snapshots", exported.clone(), Some(snap.clone())),
        Ok(())
    );
    assert_eq!(
        check("snapshots", exported.clone(), Some(exported.clone())),
        Ok(())
    );
    for off in [
        json!({"podName": "redis", "mode": "Incremental", "export": false}),
        json!({"podName": "redis", "mode": "Incremental"}),
    ] {
        let err = check("snapshots", object("Snapshot", off), Some(exported.clone()))
            .expect_err("turned off");
        assert!(err.contains("export may be turned on, not off"), "{err}");
    }

    // Rollback: the whole spec is immutable.
    let rb = object("Rollback", json!({"podName": "p", "snapshotName": "s"}));
    assert_eq!(check("rollbacks", rb.clone(), Some(rb.clone())), Ok(()));
    let err = check(
        "rollbacks",
        object("Rollback", json!({"podName": "p", "snapshotName": "t"})),
        Some(rb),
    )
    .expect_err("changed");
    assert!(err.contains("a Rollback's spec is immutable"), "{err}");
    // Turning the safety snapshot off later is a change too.
    let err = check(
        "rollbacks",
        object(
            "Rollback",
            json!({"podName": "p", "snapshotName": "s", "safetySnapshot": false}),
        ),
        Some(object(
            "Rollback",
            json!({"podName": "p", "snapshotName": "s", "safetySnapshot": true}),
        )),
    )
    .expect_err("safetySnapshot changed");
    assert!(err.contains("a Rollback's spec is immutable"), "{err}");
}

#[test]
fn openapi_validation_refuses_bad_values() {
    let crds = load();
    let check = |plural: &str, obj: Value| crds.validate(plural, &obj, None);
    let cases = [
        (
            "clones",
            object(
                "Clone",
                json!({"source": {"podName": "p"}, "replicas": 1001}),
            ),
            "should be less than or equal to 1000",
        ),
        (
            "clones",
            object(
                "Clone",
                json!({"source": {"podName": "p"}, "replicas": 2, "failureDeadlineSeconds": 0}),
            ),
            "spec.failureDeadlineSeconds: Invalid value: 0: should be greater than or equal to 1",
        ),
        (
            "rollbacks",
            object(
                "Rollback",
                json!({"podName": "p", "snapshotName": "s", "failureDeadlineSeconds": -5}),
            ),
            "should be greater than or equal to 1",
        ),
        (
            "clones",
            object(
                "Clone",
                json!({"source": {"podName": "p"}, "replicas": 2, "namePrefix": "Bad_Prefix"}),
            ),
            "spec.namePrefix: Invalid value",
        ),
        (
            "snapshots",
            object("Snapshot", json!({"podName": ""})),
            "spec.podName: Invalid value",
        ),
        (
            "snapshots",
            object(
                "Snapshot",
                json!({"podName": "p", "deletionPolicy": "Keep"}),
            ),
            "spec.deletionPolicy: Unsupported value",
        ),
        (
            "snapshots",
            object(
                "Snapshot",
                json!({"podName": "p", "ttlSecondsAfterReady": -1}),
            ),
            "spec.ttlSecondsAfterReady",
        ),
        (
            "rollbacks",
            object("Rollback", json!({"podName": "p"})),
            "spec.snapshotName: Required value",
        ),
        (
            "sandboxtemplates",
            object(
                "SandboxTemplate",
                json!({"image": "i", "vcpus": 1, "memoryMiB": 8}),
            ),
            "spec.memoryMiB: Invalid value: 8: should be greater than or equal to 16",
        ),
        (
            "sandboxtemplates",
            object(
                "SandboxTemplate",
                json!({"image": "i", "vcpus": 1, "memoryMiB": 257}),
            ),
            "spec.memoryMiB: Invalid value: 257: should be a multiple of 2",
        ),
        (
            "sandboxtemplates",
            object(
                "SandboxTemplate",
                json!({"image": "i", "vcpus": 1, "memoryMiB": 4096}),
            ),
            "spec.memoryMiB: Invalid value: 4096: should be less than or equal to 3072",
        ),
    ];
    for (plural, obj, expected) in cases {
        let err = check(plural, obj.clone()).expect_err(expected);
        assert!(err.contains(expected), "{obj}: {err}");
    }
    let mut errors = Vec::new();
    let template = object(
        "SandboxTemplate",
        json!({"image": "python:3", "vcpus": 2, "memoryMiB": 512, "warmup": ["python3", "-c", "import numpy"]}),
    );
    value_errors(
        &crds.by_plural["sandboxtemplates"].schema,
        &template,
        "",
        true,
        &mut errors,
    );
    assert!(errors.is_empty(), "{errors:?}");
}

/// Every manifest under examples/ is a valid object: Twig objects pass the
/// CRD schemas and CEL rules, Pods parse as Pods with nothing unknown.
#[test]
fn examples_are_valid_objects() {
    let crds = load();
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut kinds = BTreeSet::new();
    let mut stack = vec![dir];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("examples dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read");
            let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            for doc in docs {
                let kind = doc["kind"].as_str().unwrap_or_default().to_string();
                let plural = crds
                    .by_plural
                    .iter()
                    .find(|(_, c)| c.kind == kind)
                    .map(|(p, _)| p.clone());
                match plural {
                    Some(plural) => {
                        assert_eq!(doc["apiVersion"], "twig.dev/v1alpha1", "{}", path.display());
                        if let Err(e) = crds.validate(&plural, &doc, None) {
                            panic!("{}: {e}", path.display());
                        }
                    }
                    None => {
                        assert_eq!(kind, "Pod", "{}", path.display());
                        let pod: k8s_openapi::api::core::v1::Pod =
                            serde_json::from_value(doc.clone()).expect("pod");
                        assert_eq!(
                            serde_json::to_value(&pod).expect("pod json"),
                            doc,
                            "{}",
                            path.display()
                        );
                        let spec = pod.spec.expect("spec");
                        assert_eq!(
                            spec.runtime_class_name.as_deref(),
                            Some("twig"),
                            "{}",
                            path.display()
                        );
                    }
                }
                kinds.insert(kind);
            }
        }
    }
    let expected: BTreeSet<String> = ["Clone", "Pod", "Rollback", "SandboxTemplate", "Snapshot"]
        .map(String::from)
        .into();
    assert_eq!(kinds, expected);
}
