//! The real kubectl (v1.30) against the test API server: apply of every
//! example manifest (client-side and server-side), `get` with the CRDs'
//! printer columns, `wait` on a condition and on a JSONPath, `delete` held
//! by a finalizer, and server-side field validation refusing bad input.
//! The test plays the controller: it writes the status kubectl waits for.

use twig_controller_testkit as support;

use std::path::PathBuf;
use std::process::Output;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::{json, Value};
use twig_controller::crd::{PodClone, Rollback, SandboxTemplate, Snapshot};

use support::kube_tools::Kubectl;
use support::{eventually, NS};

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn example(path: &str) -> String {
    examples().join(path).display().to_string()
}

/// Every document of every example manifest.
fn example_documents() -> Vec<Value> {
    let mut docs = Vec::new();
    let mut dirs = vec![examples()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("examples dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                let text = std::fs::read_to_string(&path).expect("read example");
                for doc in text.split("\n---") {
                    let value: Value = serde_saphyr::from_str(doc)
                        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                    if !value.is_null() {
                        docs.push(value);
                    }
                }
            }
        }
    }
    docs
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The stored object named by an example document, fetched with kube.
async fn stored(client: &Client, doc: &Value) -> Value {
    let name = doc["metadata"]["name"].as_str().expect("name");
    let kind = doc["kind"].as_str().expect("kind");
    macro_rules! fetch {
        ($t:ty) => {
            serde_json::to_value(
                Api::<$t>::namespaced(client.clone(), NS)
                    .get(name)
                    .await
                    .unwrap_or_else(|e| panic!("{kind} {name} not stored: {e}")),
            )
            .expect("json")
        };
    }
    match kind {
        "Pod" => fetch!(Pod),
        "Snapshot" => fetch!(Snapshot),
        "Clone" => fetch!(PodClone),
        "Rollback" => fetch!(Rollback),
        "SandboxTemplate" => fetch!(SandboxTemplate),
        other => panic!("an example of kind {other} this test does not know"),
    }
}

/// `sent` is contained in `stored` (the server adds metadata and defaults).
fn contains(stored: &Value, sent: &Value) -> bool {
    match (stored, sent) {
        (Value::Object(s), Value::Object(w)) => w
            .iter()
            .all(|(k, v)| s.get(k).is_some_and(|sv| contains(sv, v))),
        (Value::Array(s), Value::Array(w)) => {
            s.len() == w.len() && s.iter().zip(w).all(|(a, b)| contains(a, b))
        }
        (s, w) => s == w,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_applies_every_example() {
    let server = support::api_server().await;
    let client = server.client();
    let kubectl = Kubectl::new(server.addr);
    let dir = examples().display().to_string();
    let docs = example_documents();
    assert!(docs.len() >= 8, "the examples: {docs:?}");

    let out = kubectl.ok(&["apply", "-R", "-f", &dir]).await;
    for doc in &docs {
        let line = format!(
            "{}/{} created",
            kind_resource(doc),
            doc["metadata"]["name"].as_str().expect("name")
        );
        assert!(out.contains(&line), "no `{line}` in:\n{out}");
        let obj = stored(&client, doc).await;
        assert!(
            contains(&obj, doc),
            "stored object differs from the example:\n{obj:#}\nsent:\n{doc:#}"
        );
        // Client-side apply records what it applied, for its next three-way merge.
        assert!(
            obj["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
                .is_string(),
            "no last-applied-configuration on {obj}"
        );
    }
    // Applying again changes nothing.
    let again = kubectl.ok(&["apply", "-R", "-f", &dir]).await;
    assert_eq!(
        again.lines().filter(|l| l.ends_with(" unchanged")).count(),
        docs.len(),
        "{again}"
    );
    // An edited manifest is merged into the stored object.
    let edited = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("manifest");
    let manifest = std::fs::read_to_string(example("redis-fork/snapshot.yaml"))
        .expect("read")
        .replace("deletionPolicy: Delete", "deletionPolicy: Retain");
    std::fs::write(edited.path(), manifest).expect("write");
    let out = kubectl
        .ok(&["apply", "-f", &edited.path().display().to_string()])
        .await;
    assert!(
        out.contains("snapshot.twig.dev/redis-seeded configured"),
        "{out}"
    );
    let snapshot = Api::<Snapshot>::namespaced(client.clone(), NS)
        .get("redis-seeded")
        .await
        .expect("get");
    assert_eq!(
        serde_json::to_value(&snapshot).expect("json")["spec"]["deletionPolicy"],
        "Retain"
    );
}

/// `<kind>.<group>` as kubectl names a resource in its output (`pod` for the core group).
fn kind_resource(doc: &Value) -> String {
    let kind = doc["kind"].as_str().expect("kind").to_lowercase();
    match doc["apiVersion"]
        .as_str()
        .expect("apiVersion")
        .split_once('/')
    {
        Some((group, _)) => format!("{kind}.{group}"),
        None => kind,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_server_side_applies_every_example() {
    let server = support::api_server().await;
    let client = server.client();
    let kubectl = Kubectl::new(server.addr);
    let dir = examples().display().to_string();
    let out = kubectl
        .ok(&["apply", "--server-side", "-R", "-f", &dir])
        .await;
    let docs = example_documents();
    for doc in &docs {
        assert!(contains(&stored(&client, doc).await, doc), "{doc}");
    }
    assert_eq!(
        out.lines()
            .filter(|l| l.ends_with(" serverside-applied"))
            .count(),
        docs.len(),
        "{out}"
    );
    let snapshot = stored(&client, &docs[0]).await;
    let managers: Vec<&str> = snapshot["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["manager"].as_str())
        .collect();
    assert_eq!(managers, ["kubectl"], "field manager of {snapshot}");
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_get_prints_the_printer_columns() {
    let server = support::api_server().await;
    let client = server.client();
    let kubectl = Kubectl::new(server.addr);
    kubectl
        .ok(&["apply", "-f", &example("redis-fork/snapshot.yaml")])
        .await;
    let before = kubectl.ok(&["get", "snapshots"]).await;
    let header: Vec<&str> = before
        .lines()
        .next()
        .expect("header")
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME",
            "POD",
            "READY",
            "PHASE",
            "NODE",
            "SIZE",
            "PARENT",
            "DURATION(MS)",
            "AGE"
        ],
        "{before}"
    );
    Api::<Snapshot>::namespaced(client.clone(), NS)
        .patch_status(
            "redis-seeded",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "phase": "Ready", "readyToUse": true, "nodeName": "node-a",
                "sizeBytes": 134217728, "parentSnapshotName": "redis-base",
                "writtenBytes": 4096, "durationMs": 41, "availability": "NodeAndRegistry",
            }})),
        )
        .await
        .expect("status");
    let out = kubectl.ok(&["get", "snapshots"]).await;
    let row: Vec<&str> = out
        .lines()
        .nth(1)
        .expect("row")
        .split_whitespace()
        .collect();
    assert_eq!(
        &row[..8],
        [
            "redis-seeded",
            "redis",
            "true",
            "Ready",
            "node-a",
            "134217728",
            "redis-base",
            "41"
        ],
        "{out}"
    );
    assert!(row[8].ends_with('s'), "age {}: {out}", row[8]);
    // Priority-1 columns appear with -o wide.
    let wide = kubectl
        .ok(&["get", "snapshot", "redis-seeded", "-o", "wide"])
        .await;
    let header: Vec<&str> = wide
        .lines()
        .next()
        .expect("header")
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME",
            "POD",
            "READY",
            "PHASE",
            "NODE",
            "SIZE",
            "PARENT",
            "WRITTEN",
            "AVAILABILITY",
            "DURATION(MS)",
            "AGE"
        ],
        "{wide}"
    );
    assert!(
        wide.contains("node-a") && wide.contains("4096") && wide.contains("NodeAndRegistry"),
        "{wide}"
    );
    // Short name and category from discovery.
    assert!(kubectl.ok(&["get", "tsnap"]).await.contains("redis-seeded"));
    let all = kubectl.ok(&["get", "twig"]).await;
    assert!(all.contains("snapshot.twig.dev/redis-seeded"), "{all}");
    // A JSONPath output reads the stored object.
    let phase = kubectl
        .ok(&[
            "get",
            "snapshot",
            "redis-seeded",
            "-o",
            "jsonpath={.status.phase}",
        ])
        .await;
    assert_eq!(phase, "Ready");
    // An unknown name is the server's NotFound.
    let out = kubectl.run(&["get", "snapshot", "nope"]).await;
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(
        stderr.contains("NotFound") && stderr.contains("\"nope\" not found"),
        "{stderr}"
    );
}

fn ready_status() -> Value {
    let condition = |type_: &str, status: &str, reason: &str| {
        json!({"type": type_, "status": status, "reason": reason, "message": "",
               "lastTransitionTime": "2025-01-01T00:00:00Z", "observedGeneration": 1})
    };
    json!({"status": {
        "phase": "Ready",
        "conditions": [
            condition("Ready", "True", "SnapshotTaken"),
            condition("Progressing", "False", "NotProgressing"),
            condition("Failure", "False", "NotFailure"),
        ],
    }})
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_wait_returns_when_the_snapshot_is_ready() {
    let server = support::api_server().await;
    let client = server.client();
    let kubectl = Kubectl::new(server.addr);
    kubectl
        .ok(&["apply", "-f", &example("redis-fork/snapshot.yaml")])
        .await;
    // Not Ready yet: the wait times out with kubectl's error.
    let out = kubectl
        .run(&[
            "wait",
            "--for=condition=Ready",
            "snapshot/redis-seeded",
            "--timeout=1s",
        ])
        .await;
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "waited for a condition nobody set");
    assert!(stderr.contains("timed out waiting"), "{stderr}");

    let mut condition = kubectl.command(&[
        "wait",
        "--for=condition=Ready",
        "snapshot/redis-seeded",
        "--timeout=60s",
    ]);
    let mut jsonpath = kubectl.command(&[
        "wait",
        "--for=jsonpath={.status.phase}=Ready",
        "snapshot/redis-seeded",
        "--timeout=60s",
    ]);
    let condition = tokio::task::spawn_blocking(move || condition.output());
    let jsonpath = tokio::task::spawn_blocking(move || jsonpath.output());
    // Both wait on a watch, so the condition arrives as a watch event.
    eventually("both kubectl waits watching", || async {
        (server.open_watches() == 2).then_some(())
    })
    .await;
    // The controller's part.
    Api::<Snapshot>::namespaced(client.clone(), NS)
        .patch_status(
            "redis-seeded",
            &PatchParams::default(),
            &Patch::Merge(ready_status()),
        )
        .await
        .expect("status");
    for waited in [condition, jsonpath] {
        let out = waited.await.expect("task").expect("kubectl wait");
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        assert_eq!(
            stdout.trim(),
            "snapshot.twig.dev/redis-seeded condition met"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_delete_waits_for_the_finalizer() {
    let server = support::api_server().await;
    let client = server.client();
    let kubectl = Kubectl::new(server.addr);
    kubectl
        .ok(&["apply", "-f", &example("redis-fork/snapshot.yaml")])
        .await;
    let snapshots = Api::<Snapshot>::namespaced(client.clone(), NS);
    snapshots
        .patch(
            "redis-seeded",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["twig.dev/snapshot-data"]}})),
        )
        .await
        .expect("finalizer");
    let mut delete = kubectl.command(&["delete", "snapshot", "redis-seeded", "--timeout=60s"]);
    let delete = tokio::task::spawn_blocking(move || delete.output());
    // Marked for deletion, held by the finalizer while the node's data goes.
    eventually("deletionTimestamp set", || {
        let snapshots = snapshots.clone();
        async move {
            snapshots
                .get("redis-seeded")
                .await
                .ok()
                .filter(|s| s.metadata.deletion_timestamp.is_some())
        }
    })
    .await;
    eventually("kubectl delete watching", || async {
        (server.open_watches() == 1).then_some(())
    })
    .await;
    assert!(
        !delete.is_finished(),
        "kubectl delete returned before the object was gone"
    );
    snapshots
        .patch(
            "redis-seeded",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("release the finalizer");
    let out = delete.await.expect("task").expect("kubectl delete");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout.trim(), "snapshot.twig.dev \"redis-seeded\" deleted");
    assert!(snapshots
        .get_opt("redis-seeded")
        .await
        .expect("get")
        .is_none());
    // Deleting what is gone is the server's NotFound.
    let out = kubectl.run(&["delete", "snapshot", "redis-seeded"]).await;
    assert!(!out.status.success());
    assert!(text(&out).1.contains("NotFound"), "{}", text(&out).1);
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_apply_refuses_bad_manifests() {
    let server = support::api_server().await;
    let client = server.client();
    let kubectl = Kubectl::new(server.addr);
    let write = |yaml: &str| {
        let file = tempfile::Builder::new()
            .suffix(".yaml")
            .tempfile()
            .expect("manifest");
        std::fs::write(file.path(), yaml).expect("write");
        file
    };
    let cases = [
        (
            "apiVersion: twig.dev/v1alpha1\nkind: Snapshot\nmetadata: {name: typo}\nspec: {podNmae: redis}\n",
            "unknown field \"spec.podNmae\"",
        ),
        (
            "apiVersion: twig.dev/v1alpha1\nkind: Snapshot\nmetadata: {name: typo, labelz: {a: b}}\nspec: {podName: redis}\n",
            "unknown field \"metadata.labelz\"",
        ),
        (
            "apiVersion: v1\nkind: Pod\nmetadata: {name: typo}\nspec: {containers: [{name: c, image: i, imagePullPolicey: Always}]}\n",
            "unknown field \"spec.containers[0].imagePullPolicey\"",
        ),
        (
            "apiVersion: twig.dev/v1alpha1\nkind: Snapshot\nmetadata: {name: typo}\nspec: {podName: redis, mode: Sideways}\n",
            "Unsupported value",
        ),
    ];
    for (manifest, error) in cases {
        let file = write(manifest);
        for extra in [&[][..], &["--server-side"][..]] {
            let mut args = vec!["apply", "-f"];
            let path = file.path().display().to_string();
            args.push(&path);
            args.extend(extra);
            let out = kubectl.run(&args).await;
            let (_, stderr) = text(&out);
            assert!(!out.status.success(), "{manifest} applied");
            assert!(stderr.contains(error), "{manifest}: {stderr}");
        }
    }
    // Nothing was stored.
    assert!(Api::<Snapshot>::namespaced(client.clone(), NS)
        .get_opt("typo")
        .await
        .expect("get")
        .is_none());
    assert!(Api::<Pod>::namespaced(client, NS)
        .get_opt("typo")
        .await
        .expect("get")
        .is_none());
    // Warn instead of Strict: stored, and kubectl shows the server's warning.
    let file = write(
        "apiVersion: twig.dev/v1alpha1\nkind: Snapshot\nmetadata: {name: warned}\nspec: {podName: redis, podNmae: redis}\n",
    );
    let out = kubectl
        .run(&[
            "create",
            "--validate=warn",
            "-f",
            &file.path().display().to_string(),
        ])
        .await;
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("Warning: unknown field \"spec.podNmae\""),
        "{stderr}"
    );
}
