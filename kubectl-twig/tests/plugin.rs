//! `kubectl twig …` run by the real kubectl v1.30 (plugin discovery on PATH)
//! against the test API server. Each test asserts on the objects stored,
//! stdout, stderr and the exit code; for `--wait` and `wait` the test plays
//! the controller and writes the status the plugin waits for.

mod common;

use twig_controller_testkit as support;

use std::path::Path;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{json, Value};
use twig_controller::crd::{PodClone, Rollback, Snapshot, SnapshotMode};

use common::Plugin;
use support::apiserver::TestApiServer;
use support::{eventually, NS};

fn condition(type_: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({"type": type_, "status": status, "reason": reason, "message": message,
           "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1})
}

/// A status as the controller writes it when the object is done.
fn ready(extra: Value) -> Value {
    let mut status = json!({
        "phase": "Ready",
        "conditions": [
            condition("Ready", "True", "Done", ""),
            condition("Progressing", "False", "NotProgressing", ""),
            condition("Failure", "False", "NotFailure", ""),
        ],
    });
    if let (Some(status), Value::Object(extra)) = (status.as_object_mut(), extra) {
        status.extend(extra);
    }
    json!({ "status": status })
}

fn failed(reason: &str, message: &str) -> Value {
    json!({"status": {
        "phase": "Failed",
        "message": message,
        "conditions": [
            condition("Ready", "False", "NotReady", ""),
            condition("Progressing", "False", "NotProgressing", ""),
            condition("Failure", "True", reason, message),
        ],
    }})
}

async fn set_status<K>(client: &Client, name: &str, status: Value)
where
    K: kube::Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned,
{
    Api::<K>::namespaced(client.clone(), NS)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(status))
        .await
        .expect("write status");
}

async fn names<K>(client: &Client) -> Vec<String>
where
    K: kube::Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned,
{
    Api::<K>::namespaced(client.clone(), NS)
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
        .into_iter()
        .filter_map(|o| o.meta().name.clone())
        .collect()
}

/// Waits until the plugin has its watch open (it then sees every later change).
async fn watching(server: &TestApiServer) {
    eventually("the plugin's watch", || async {
        (server.open_watches() >= 1).then_some(())
    })
    .await;
}

/// Every watch the plugin opened ends with it.
async fn no_watch_left(server: &TestApiServer) {
    eventually("the plugin's watches to end", || async {
        (server.open_watches() == 0).then_some(())
    })
    .await;
}

async fn snapshot_named(client: &Client, name: &str) -> Snapshot {
    Api::<Snapshot>::namespaced(client.clone(), NS)
        .get(name)
        .await
        .unwrap_or_else(|e| panic!("snapshot {name}: {e}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn kubectl_finds_the_plugin_and_its_help() {
    let server = support::api_server().await;
    let plugin = Plugin::new(&server);
    let help = plugin.ok(&["--help"]).await;
    for command in ["snapshot", "fork", "rewind", "tree", "wait", "net"] {
        assert!(help.contains(command), "{command} missing from:\n{help}");
        let own = plugin.ok(&[command, "--help"]).await;
        assert!(own.contains("Usage: kubectl twig"), "{own}");
        assert!(own.contains("--namespace"), "{own}");
    }
    let listed = support::kube_tools::succeed(plugin.kubectl_command().args(["plugin", "list"]));
    let expected = plugin.path.path().join("kubectl-twig");
    assert!(
        listed.lines().any(|l| Path::new(l.trim()) == expected),
        "kubectl plugin list:\n{listed}"
    );
    let run = plugin.run(&["frobnicate"]).await;
    run.assert_error("unrecognized subcommand 'frobnicate'");
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_creates_a_snapshot_of_the_pod() {
    let server = support::api_server().await;
    let client = server.client();
    let plugin = Plugin::new(&server);
    support::running_pod(&client, "redis", "node-a").await;

    let out = plugin.ok(&["snapshot", "redis"]).await;
    let generated = names::<Snapshot>(&client).await;
    let [name] = generated.as_slice() else {
        panic!("one Snapshot expected: {generated:?}");
    };
    assert!(
        name.starts_with("redis-") && name.len() > "redis-".len(),
        "{name}"
    );
    assert_eq!(out, format!("snapshot.twig.dev/{name} created\n"));
    let snapshot = snapshot_named(&client, name).await;
    assert_eq!(snapshot.spec.pod_name, "redis");
    assert_eq!(snapshot.spec.mode, SnapshotMode::Incremental);
    assert_eq!(snapshot.spec.ttl_seconds_after_ready, None);
    // The UID of the pod the plugin checked is pinned.
    let pod = Api::<Pod>::namespaced(client.clone(), NS)
        .get("redis")
        .await
        .expect("pod");
    assert!(pod.metadata.uid.is_some());
    assert_eq!(snapshot.spec.pod_uid, pod.metadata.uid);

    let out = plugin
        .ok(&[
            "snapshot", "redis", "--name", "seeded", "--mode", "full", "--ttl", "600", "-o", "name",
        ])
        .await;
    assert_eq!(out, "snapshot.twig.dev/seeded\n");
    let snapshot = snapshot_named(&client, "seeded").await;
    assert_eq!(snapshot.spec.mode, SnapshotMode::Full);
    assert_eq!(snapshot.spec.ttl_seconds_after_ready, Some(600));

    let out = plugin
        .ok(&["snapshot", "redis", "--name", "as-json", "-o", "json"])
        .await;
    let obj: Value = serde_json::from_str(&out).expect("-o json is JSON");
    assert_eq!(obj["kind"], "Snapshot");
    assert_eq!(obj["metadata"]["name"], "as-json");
    assert_eq!(obj["spec"]["podName"], "redis");
    let out = plugin
        .ok(&["snapshot", "redis", "--name", "as-yaml", "-o", "yaml"])
        .await;
    let obj: Value = serde_saphyr::from_str(&out).expect("-o yaml is YAML");
    assert_eq!(obj["apiVersion"], "twig.dev/v1alpha1");
    assert_eq!(obj["metadata"]["name"], "as-yaml");
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_refuses_bad_input_and_creates_nothing() {
    let server = support::api_server().await;
    let client = server.client();
    let plugin = Plugin::new(&server);
    support::running_pod(&client, "redis", "node-a").await;

    let run = plugin.run(&["snapshot", "nosuch"]).await;
    run.assert_not_found("pods", "nosuch");
    let run = plugin
        .run(&["snapshot", "redis", "--mode", "partial"])
        .await;
    run.assert_error("invalid value 'partial' for '--mode <MODE>'");
    let run = plugin.run(&["snapshot", "redis", "--ttl=-5"]).await;
    run.assert_error("--ttl");
    let run = plugin.run(&["snapshot", "redis", "--wait=soon"]).await;
    run.assert_error("invalid duration \"soon\"");
    assert_eq!(names::<Snapshot>(&client).await, Vec::<String>::new());

    // A pod of another runtime: the controller would fail the Snapshot; the plugin says so first.
    let pods = Api::<Pod>::namespaced(client.clone(), NS);
    let runc: Pod = serde_json::from_value(json!({
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "a", "image": "a"}]},
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &runc)
        .await
        .expect("pod");
    let run = plugin.run(&["snapshot", "plain"]).await;
    run.assert_error("error: pod plain is not a Twig pod: its runtimeClassName is unset, not twig");
    let run = plugin.run(&["fork", "plain", "--replicas", "2"]).await;
    run.assert_error("pod plain is not a Twig pod");
    let run = plugin.run(&["rewind", "plain", "--to", "x"]).await;
    run.assert_error("pod plain is not a Twig pod");
    assert_eq!(names::<Snapshot>(&client).await, Vec::<String>::new());
    assert_eq!(names::<PodClone>(&client).await, Vec::<String>::new());
    assert_eq!(names::<Rollback>(&client).await, Vec::<String>::new());

    // A name the server refuses: its error, as kubectl prints it.
    plugin.ok(&["snapshot", "redis", "--name", "taken"]).await;
    let run = plugin.run(&["snapshot", "redis", "--name", "taken"]).await;
    run.assert_error("Error from server (AlreadyExists): ");
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_wait_returns_when_ready_and_fails_with_the_message() {
    let server = support::api_server().await;
    let client = server.client();
    let plugin = Plugin::new(&server);
    support::running_pod(&client, "redis", "node-a").await;

    let waiting = plugin.start(&["snapshot", "redis", "--name", "good", "--wait=30s"]);
    watching(&server).await;
    set_status::<Snapshot>(&client, "good", ready(json!({"sizeBytes": 4096}))).await;
    let run = waiting.await_output().await;
    assert!(run.success(), "{run:?}");
    assert_eq!(
        run.stdout,
        "snapshot.twig.dev/good created\nsnapshot.twig.dev/good ready\n"
    );

    // Failed while waiting: exit 1 with the controller's message, at once.
    let waiting = plugin.start(&["snapshot", "redis", "--name", "bad", "--wait"]);
    eventually("the second watch", || async {
        (server.open_watches() >= 1 && names::<Snapshot>(&client).await.len() == 2).then_some(())
    })
    .await;
    set_status::<Snapshot>(
        &client,
        "bad",
        failed("PodTerminating", "pod redis is terminating"),
    )
    .await;
    let run = waiting.await_output().await;
    run.assert_error("error: snapshot.twig.dev/bad failed: pod redis is terminating");
    assert_eq!(run.stdout, "snapshot.twig.dev/bad created\n");

    // Nobody makes it Ready: kubectl wait's timeout error; the Snapshot stays.
    let run = plugin
        .run(&[
            "snapshot",
            "redis",
            "--name",
            "slow",
            "--wait=1s",
            "-o",
            "name",
        ])
        .await;
    run.assert_error("error: timed out waiting for the condition on snapshots/slow");
    assert_eq!(run.stdout, "snapshot.twig.dev/slow\n");
    snapshot_named(&client, "slow").await;
    no_watch_left(&server).await;

    // -o json after --wait: the Ready object.
    let waiting = plugin.start(&[
        "snapshot", "redis", "--name", "json", "--wait", "-o", "json",
    ]);
    eventually("the json snapshot's watch", || async {
        (server.open_watches() >= 1 && names::<Snapshot>(&client).await.len() == 4).then_some(())
    })
    .await;
    set_status::<Snapshot>(&client, "json", ready(json!({}))).await;
    let run = waiting.await_output().await;
    assert!(run.success(), "{run:?}");
    let obj: Value = serde_json::from_str(&run.stdout).expect("JSON");
    assert_eq!(obj["status"]["phase"], "Ready");
}

#[tokio::test(flavor = "multi_thread")]
async fn fork_creates_a_clone_and_prints_its_pods_when_ready() {
    let server = support::api_server().await;
    let client = server.client();
    let plugin = Plugin::new(&server);
    support::running_pod(&client, "redis", "node-a").await;

    let out = plugin.ok(&["fork", "redis", "--replicas", "8"]).await;
    let clones = names::<PodClone>(&client).await;
    let [name] = clones.as_slice() else {
        panic!("one Clone expected: {clones:?}");
    };
    assert!(name.starts_with("redis-fork-"), "{name}");
    assert_eq!(out, format!("clone.twig.dev/{name} created\n"));
    let clones_api = Api::<PodClone>::namespaced(client.clone(), NS);
    let clone = clones_api.get(name).await.expect("clone");
    assert_eq!(clone.spec.replicas, 8);
    assert_eq!(clone.spec.source.pod_name.as_deref(), Some("redis"));
    assert_eq!(clone.spec.source.snapshot_name, None);

    // From a snapshot, waiting: the test plays the controller and starts the pods.
    plugin.ok(&["snapshot", "redis", "--name", "seeded"]).await;
    let waiting = plugin.start(&[
        "fork",
        "--from-snapshot",
        "seeded",
        "--replicas",
        "2",
        "--name",
        "trial",
        "--wait",
    ]);
    watching(&server).await;
    let clone = clones_api.get("trial").await.expect("clone");
    assert_eq!(clone.spec.source.snapshot_name.as_deref(), Some("seeded"));
    assert_eq!(clone.spec.replicas, 2);
    for pod in ["trial-0", "trial-1"] {
        support::running_pod(&client, pod, "node-a").await;
    }
    set_status::<PodClone>(
        &client,
        "trial",
        ready(
            json!({"pods": ["trial-0", "trial-1"], "readyReplicas": 2, "snapshotName": "seeded"}),
        ),
    )
    .await;
    let run = waiting.await_output().await;
    assert!(run.success(), "{run:?}");
    let lines: Vec<Vec<&str>> = run
        .stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        lines,
        [
            vec!["clone.twig.dev/trial", "created"],
            vec!["clone.twig.dev/trial", "ready"],
            vec!["NAME", "READY", "STATUS", "NODE", "IP"],
            vec!["trial-0", "0/0", "Running", "node-a", "<none>"],
            vec!["trial-1", "0/0", "Running", "node-a", "<none>"],
        ],
        "{}",
        run.stdout
    );

    // -o name with --wait: the Clone, then its pods.
    let waiting = plugin.start(&[
        "fork",
        "redis",
        "--replicas",
        "1",
        "--name",
        "one",
        "--wait",
        "-o",
        "name",
    ]);
    eventually("the Clone one", || async {
        (server.open_watches() >= 1 && clones_api.get_opt("one").await.ok().flatten().is_some())
            .then_some(())
    })
    .await;
    set_status::<PodClone>(
        &client,
        "one",
        ready(json!({"pods": ["one-0"], "readyReplicas": 1})),
    )
    .await;
    let run = waiting.await_output().await;
    assert!(run.success(), "{run:?}");
    assert_eq!(run.stdout, "clone.twig.dev/one\npod/one-0\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn fork_refuses_bad_input_and_creates_nothing() {
    let server = support::api_server().await;
    let client = server.client();
    let plugin = Plugin::new(&server);
    support::running_pod(&client, "redis", "node-a").await;

    let run = plugin.run(&["fork", "redis", "--replicas", "0"]).await;
    run.assert_error("0 replicas; a fork needs at least 1");
    let run = plugin.run(&["fork", "redis", "--replicas=-3"]).await;
    run.assert_error("--replicas");
    let run = plugin.run(&["fork", "redis"]).await;
    run.assert_error("--replicas <N>");
    let run = plugin.run(&["fork", "--replicas", "2"]).await;
    run.assert_error("<POD>");
    let run = plugin
        .run(&[
            "fork",
            "redis",
            "--from-snapshot",
            "seeded",
            "--replicas",
            "2",
        ])
        .await;
    run.assert_error("cannot be used with");
    let run = plugin.run(&["fork", "nosuch", "--replicas", "2"]).await;
    run.assert_not_found("pods", "nosuch");
    let run = plugin
        .run(&["fork", "--from-snapshot", "nosuch", "--replicas", "2"])
        .await;
    run.assert_not_found("snapshots.twig.dev", "nosuch");
    // More replicas than the CRD allows: the server's schema refuses it.
    let run = plugin.run(&["fork", "redis", "--replicas", "100000"]).await;
    run.assert_error("Error from server (Invalid)");
    assert_eq!(names::<PodClone>(&client).await, Vec::<String>::new());

    // A Clone that fails while waited on.
    let waiting = plugin.start(&[
        "fork",
        "redis",
        "--replicas",
        "2",
        "--name",
        "doomed",
        "--wait=30s",
    ]);
    watching(&server).await;
    set_status::<PodClone>(
        &client,
        "doomed",
        failed("SourcePodNotFound", "pod redis is gone"),
    )
    .await;
    let run = waiting.await_output().await;
    run.assert_error("error: clone.twig.dev/doomed failed: pod redis is gone");
}

#[tokio::test(flavor = "multi_thread")]
async fn rewind_creates_a_rollback() {
    let server = support::api_server().await;
    let client = server.client();
    let plugin = Plugin::new(&server);
    let pod = support::running_pod(&client, "redis", "node-a").await;
    plugin.ok(&["snapshot", "redis", "--name", "seeded"]).await;

    let out = plugin.ok(&["rewind", "redis", "--to", "seeded"]).await;
    let rollbacks = names::<Rollback>(&client).await;
    let [name] = rollbacks.as_slice() else {
        panic!("one Rollback expected: {rollbacks:?}");
    };
    assert!(name.starts_with("redis-rewind-"), "{name}");
    assert_eq!(out, format!("rollback.twig.dev/{name} created\n"));
    let api = Api::<Rollback>::namespaced(client.clone(), NS);
    let rollback = api.get(name).await.expect("rollback");
    assert_eq!(rollback.spec.pod_name, "redis");
    assert_eq!(rollback.spec.snapshot_name, "seeded");
    assert_eq!(rollback.spec.pod_uid, pod.metadata.uid);
    assert!(
        rollback.spec.safety_snapshot,
        "a safety snapshot by default"
    );
    plugin
        .ok(&[
            "rewind",
            "redis",
            "--to",
            "seeded",
            "--name",
            "unsafe",
            "--no-safety-snapshot",
        ])
        .await;
    let rollback = api.get("unsafe").await.expect("rollback");
    assert!(!rollback.spec.safety_snapshot);

    let waiting = plugin.start(&[
        "rewind", "redis", "--to", "seeded", "--name", "back", "--wait",
    ]);
    watching(&server).await;
    set_status::<Rollback>(
        &client,
        "back",
        ready(json!({"durationMs": 12, "safetySnapshotName": "redis-safety"})),
    )
    .await;
    let run = waiting.await_output().await;
    assert!(run.success(), "{run:?}");
    assert_eq!(
        run.stdout,
        "rollback.twig.dev/back created\nrollback.twig.dev/back ready\n\
         safety snapshot: snapshot.twig.dev/redis-safety (undo: kubectl twig rewind redis --to redis-safety)\n"
    );

    // A failed rewind: the controller's error, at once.
    let waiting = plugin.start(&[
        "rewind", "redis", "--to", "seeded", "--name", "nope", "--wait",
    ]);
    eventually("the Rollback nope's watch", || async {
        (server.open_watches() >= 1 && api.get_opt("nope").await.ok().flatten().is_some())
            .then_some(())
    })
    .await;
    set_status::<Rollback>(
        &client,
        "nope",
        json!({"status": {"phase": "Failed", "error": {
            "message": "NotInLineage: seeded is not in pod redis's lineage",
            "time": "2026-01-01T00:00:00Z"}}}),
    )
    .await;
    let run = waiting.await_output().await;
    run.assert_error(
        "error: rollback.twig.dev/nope failed: NotInLineage: seeded is not in pod redis's lineage",
    );

    let run = plugin.run(&["rewind", "redis", "--to", "nosuch"]).await;
    run.assert_not_found("snapshots.twig.dev", "nosuch");
    let run = plugin.run(&["rewind", "nosuch", "--to", "seeded"]).await;
    run.assert_not_found("pods", "nosuch");
    let run = plugin.run(&["rewind", "redis"]).await;
    run.assert_error("--to <SNAPSHOT>");
    assert_eq!(names::<Rollback>(&client).await.len(), 4);
}

/// A table's cells, cut where the header's columns start (the first keeps its indent).
fn columns(table: &str) -> Vec<Vec<String>> {
    let mut lines = table.lines();
    let header: Vec<char> = lines.next().expect("header").chars().collect();
    let starts: Vec<usize> = (0..header.len())
        .filter(|&i| header[i] != ' ' && (i == 0 || header[i - 1] == ' '))
        .collect();
    std::iter::once(header.iter().collect::<String>())
        .chain(lines.map(str::to_string))
        .map(|line| {
            let chars: Vec<char> = line.chars().collect();
            starts
                .iter()
                .enumerate()
                .map(|(i, &start)| {
                    let end = starts
                        .get(i + 1)
                        .copied()
                        .unwrap_or(chars.len())
                        .min(chars.len());
                    let cell: String = chars[start.min(end)..end].iter().collect();
                    if i == 0 {
                        cell.trim_end().to_string()
                    } else {
                        cell.trim().to_string()
                    }
                })
                .collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn tree_shows_the_lineage_by_pod() {
    let server = support::api_server().await;
    let client = server.client();
    let plugin = Plugin::new(&server);
    support::running_pod(&client, "redis", "node-a").await;
    // redis: base ← incr1 ← incr2, and base ← other; a clone pod of incr1 with its own snapshot.
    for (name, id, parent, size) in [
        ("base", "id-base", None, 512u64 << 20),
        ("incr1", "id-1", Some("id-base"), 3 << 20),
        ("incr2", "id-2", Some("id-1"), 1536),
        ("other", "id-o", Some("id-base"), 2 << 20),
    ] {
        plugin.ok(&["snapshot", "redis", "--name", name]).await;
        set_status::<Snapshot>(
            &client,
            name,
            ready(json!({"snapshotID": id, "parent": parent, "sizeBytes": size})),
        )
        .await;
    }
    let pods = Api::<Pod>::namespaced(client.clone(), NS);
    support::running_pod(&client, "fork-0", "node-a").await;
    pods.patch(
        "fork-0",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"twig.dev/restore-from": "id-1"}}})),
    )
    .await
    .expect("annotate");
    plugin
        .ok(&["snapshot", "fork-0", "--name", "fork-snap"])
        .await;
    set_status::<Snapshot>(
        &client,
        "fork-snap",
        ready(json!({"snapshotID": "id-f", "parent": "id-1", "sizeBytes": 4096})),
    )
    .await;
    // A snapshot still in progress, of a pod since deleted.
    support::running_pod(&client, "gone", "node-a").await;
    plugin.ok(&["snapshot", "gone", "--name", "orphan"]).await;
    pods.delete("gone", &DeleteParams::default())
        .await
        .expect("delete pod");

    let out = plugin.ok(&["tree"]).await;
    let rows = columns(&out);
    // Every cell but the last (the age).
    let shown: Vec<&[String]> = rows.iter().map(|r| &r[..3]).collect();
    let expected = [
        ["NAME", "PHASE", "SIZE"],
        ["Pod/fork-0 (from Snapshot/incr1)", "Running", ""],
        ["└─Snapshot/fork-snap", "Ready", "4Ki"],
        ["Pod/gone", "NotFound", ""],
        ["└─Snapshot/orphan", "Pending", "-"],
        ["Pod/redis", "Running", ""],
        ["└─Snapshot/base", "Ready", "512Mi"],
        ["  ├─Snapshot/incr1", "Ready", "3Mi"],
        ["  │ └─Snapshot/incr2", "Ready", "1.5Ki"],
        ["  └─Snapshot/other", "Ready", "2Mi"],
    ];
    assert_eq!(shown, expected, "\n{out}");
    for (i, row) in rows.iter().enumerate().skip(1) {
        let age = &row[3];
        // The deleted pod has no age; everything else was made seconds ago.
        let expected = if i == 3 {
            age.is_empty()
        } else {
            age.ends_with('s')
        };
        assert!(expected, "age {age:?} in row {i}:\n{out}");
    }

    // -o name: the snapshots in tree order; -o json: the nested lineage.
    let out = plugin.ok(&["tree", "redis", "-o", "name"]).await;
    assert_eq!(
        out,
        "snapshot.twig.dev/base\nsnapshot.twig.dev/incr1\nsnapshot.twig.dev/incr2\nsnapshot.twig.dev/other\n"
    );
    let out = plugin.ok(&["tree", "-o", "json"]).await;
    let lineage: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(lineage["namespace"], NS);
    let redis = &lineage["pods"][2];
    assert_eq!(redis["name"], "redis");
    assert_eq!(redis["phase"], "Running");
    let base = &redis["snapshots"][0];
    assert_eq!(
        (&base["name"], &base["snapshotID"], &base["sizeBytes"]),
        (&json!("base"), &json!("id-base"), &json!(512u64 << 20))
    );
    let incr1 = &base["children"][0];
    assert_eq!(
        (&incr1["name"], &incr1["parent"]),
        (&json!("incr1"), &json!("id-base"))
    );
    assert_eq!(incr1["children"][0]["name"], "incr2");
    assert_eq!(base["children"][1]["name"], "other");
    assert_eq!(lineage["pods"][0]["restoredFrom"], "incr1");
    assert_eq!(lineage["pods"][1]["phase"], "NotFound");
    let out = plugin.ok(&["tree", "gone", "-o", "yaml"]).await;
    let gone: Value = serde_saphyr::from_str(&out).expect("YAML");
    assert_eq!(gone["pods"][0]["snapshots"][0]["name"], "orphan");

    let out = plugin.ok(&["tree", "fork-0"]).await;
    assert_eq!(out.lines().count(), 3, "{out}");
    assert!(
        out.contains("Snapshot/fork-snap") && !out.contains("Snapshot/base"),
        "{out}"
    );

    let run = plugin.run(&["tree", "nosuch"]).await;
    run.assert_not_found("pods", "nosuch");
    let run = plugin.run(&["tree", "redis", "-n", "empty"]).await;
    run.assert_not_found("pods", "redis");
}

#[tokio::test(flavor = "multi_thread")]
async fn wait_watches_like_kubectl_wait() {
    let server = support::api_server().await;
    let client = server.client();
    let plugin = Plugin::new(&server);
    support::running_pod(&client, "redis", "node-a").await;
    plugin.ok(&["snapshot", "redis", "--name", "s"]).await;

    // Not Ready: kubectl wait's timeout error and exit code.
    let run = plugin.run(&["wait", "snapshot/s", "--timeout=1s"]).await;
    run.assert_error("error: timed out waiting for the condition on snapshots/s");
    let run = plugin.run(&["wait", "snapshot/s", "--timeout=0"]).await;
    run.assert_error("error: timed out waiting for the condition on snapshots/s");
    let real = support::kube_tools::run(&mut plugin.kubectl.command(&[
        "wait",
        "--for=condition=Ready",
        "snapshot/s",
        "--timeout=1s",
    ]));
    assert_eq!(
        real.status.code(),
        run.code,
        "exit code unlike kubectl wait's"
    );

    let waiting = plugin.start(&["wait", "tsnap/s", "--for=condition=Ready", "--timeout=30s"]);
    watching(&server).await;
    set_status::<Snapshot>(&client, "s", ready(json!({}))).await;
    let run = waiting.await_output().await;
    assert!(run.success(), "{run:?}");
    assert_eq!(run.stdout, "snapshot.twig.dev/s condition met\n");
    // Already met: at once, with any condition status spelled as kubectl allows.
    let out = plugin
        .ok(&[
            "wait",
            "snapshots.twig.dev/s",
            "--for=condition=failure=false",
            "-o",
            "name",
        ])
        .await;
    assert_eq!(out, "snapshot.twig.dev/s\n");

    // Waiting for Ready on a Failed object ends at once with its message.
    plugin.ok(&["snapshot", "redis", "--name", "f"]).await;
    set_status::<Snapshot>(
        &client,
        "f",
        failed("ShimError", "shim: no space left on device"),
    )
    .await;
    let run = plugin.run(&["wait", "snapshot/f", "--timeout=30s"]).await;
    run.assert_error("error: snapshot.twig.dev/f failed: shim: no space left on device");
    // Another condition of a Failed object is waited on as asked.
    let out = plugin
        .ok(&["wait", "snapshot/f", "--for=condition=Failure"])
        .await;
    assert_eq!(out, "snapshot.twig.dev/f condition met\n");

    // --for=delete returns once the object is gone.
    let waiting = plugin.start(&["wait", "snapshot/s", "--for=delete"]);
    watching(&server).await;
    Api::<Snapshot>::namespaced(client.clone(), NS)
        .delete("s", &DeleteParams::default())
        .await
        .expect("delete");
    let run = waiting.await_output().await;
    assert!(run.success(), "{run:?}");
    assert_eq!(run.stdout, "snapshot.twig.dev/s condition met\n");

    let run = plugin.run(&["wait", "snapshot/nosuch"]).await;
    run.assert_not_found("snapshots.twig.dev", "nosuch");
    // As kubectl wait: waiting for the deletion of what is not there succeeds, silently.
    let run = plugin
        .run(&["wait", "snapshot/nosuch", "--for=delete"])
        .await;
    assert!(run.success() && run.stdout.is_empty(), "{run:?}");
    let run = plugin.run(&["wait", "pod/redis"]).await;
    run.assert_error("doesn't have a Twig resource type \"pod\"");
    let run = plugin.run(&["wait", "snapshot"]).await;
    run.assert_error("KIND/NAME");
    let run = plugin
        .run(&["wait", "snapshot/f", "--for=jsonpath={.x}"])
        .await;
    run.assert_error("unrecognized condition");
    let run = plugin
        .run(&["wait", "snapshot/f", "--timeout=forever"])
        .await;
    run.assert_error("invalid duration");
    no_watch_left(&server).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn namespace_and_context_come_from_the_flags_and_kubeconfig() {
    let server = support::api_server().await;
    let client = server.client();
    let plugin = Plugin::new(&server);
    let pods: Api<Pod> = Api::namespaced(client.clone(), "team-a");
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some("agent".into()),
            ..ObjectMeta::default()
        },
        spec: serde_json::from_value(
            json!({"runtimeClassName": "twig", "containers": [{"name": "a", "image": "a"}]}),
        )
        .expect("spec"),
        status: None,
    };
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("pod");

    // The kubeconfig's namespace is `default`, where there is no such pod.
    let run = plugin.run(&["snapshot", "agent"]).await;
    run.assert_not_found("pods", "agent");
    for flag in [&["-n", "team-a"][..], &["--namespace=team-a"][..]] {
        let mut args = vec!["snapshot", "agent", "-o", "name"];
        args.extend_from_slice(flag);
        plugin.ok(&args).await;
    }
    let in_team = Api::<Snapshot>::namespaced(client.clone(), "team-a")
        .list(&ListParams::default())
        .await
        .expect("list");
    assert_eq!(in_team.items.len(), 2);

    // A second context whose namespace is team-a, chosen with --context.
    let kubeconfig = std::fs::read_to_string(plugin.kubectl.kubeconfig()).expect("kubeconfig");
    let kubeconfig = kubeconfig.replace(
        "contexts: [",
        "contexts: [{name: team, context: {cluster: test, user: test, namespace: team-a}}, ",
    );
    let other = tempfile::NamedTempFile::new().expect("kubeconfig");
    std::fs::write(other.path(), kubeconfig).expect("write");
    let path = other.path().display().to_string();
    plugin
        .ok(&[
            "snapshot",
            "agent",
            "--kubeconfig",
            &path,
            "--context",
            "team",
        ])
        .await;
    let run = plugin
        .run(&[
            "snapshot",
            "agent",
            "--kubeconfig",
            &path,
            "--context",
            "nosuch",
        ])
        .await;
    run.assert_error("nosuch");
    let run = plugin
        .run(&["snapshot", "agent", "--kubeconfig", "/nonexistent/config"])
        .await;
    run.assert_error("/nonexistent/config");
    // A server that does not answer: which one, and why.
    let dead = tempfile::NamedTempFile::new().expect("kubeconfig");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    std::fs::write(
        dead.path(),
        std::fs::read_to_string(plugin.kubectl.kubeconfig())
            .expect("kubeconfig")
            .replace(&server.addr.to_string(), &format!("127.0.0.1:{port}")),
    )
    .expect("write");
    let dead_path = dead.path().display().to_string();
    let run = plugin.run(&["tree", "--kubeconfig", &dead_path]).await;
    run.assert_error(&format!(
        "error: talking to the server http://127.0.0.1:{port}/: "
    ));
    run.assert_error("Connection refused");
    assert!(Path::new(&path).exists());
}
