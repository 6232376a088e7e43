//! `kubectl twig tree`: the snapshot lineage, grouped by pod.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde::Serialize;
use twig_controller::crd::{Snapshot, RESTORE_FROM_ANNOTATION};

use crate::cli::Output;
use crate::error::Error;
use crate::output::{age, emit, print, size, table};

/// The lineage of a namespace's snapshots: what `-o json|yaml` prints.
#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct Lineage {
    /// The namespace.
    pub namespace: String,
    /// One entry per pod that has snapshots, by name.
    pub pods: Vec<PodLineage>,
}

/// One pod and its snapshots.
#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct PodLineage {
    /// The pod's name (`spec.podName` of its snapshots).
    pub name: String,
    /// The pod's phase; `NotFound` when it is gone.
    pub phase: String,
    /// When the pod was created (absent when it is gone).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<Time>,
    /// The Snapshot the pod was restored from (its `twig.dev/restore-from`), when listed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restored_from: Option<String>,
    /// Its snapshots without a parent among them, each with its descendants.
    pub snapshots: Vec<SnapshotNode>,
}

/// One snapshot and the snapshots taken on top of it.
#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotNode {
    /// The Snapshot's name.
    pub name: String,
    /// `status.phase`.
    pub phase: String,
    /// `status.snapshotID`, its node-store ID.
    #[serde(rename = "snapshotID", skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// `status.parent`, the parent's node-store ID.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// `status.sizeBytes`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// When the Snapshot was created.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<Time>,
    /// Snapshots of the same pod whose parent this is, oldest first.
    pub children: Vec<SnapshotNode>,
}

/// `kubectl twig tree [POD]`.
pub async fn tree(
    client: Client,
    namespace: &str,
    pod: Option<String>,
    output: Option<Output>,
) -> Result<(), Error> {
    let snapshots = Api::<Snapshot>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await?
        .items;
    let pod_api = Api::<Pod>::namespaced(client, namespace);
    let pods: HashMap<String, Pod> = pod_api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|p| (p.name_any(), p))
        .collect();
    let mut lineage = lineage(namespace, &snapshots, &pods);
    if let Some(pod) = &pod {
        lineage.pods.retain(|p| &p.name == pod);
        if lineage.pods.is_empty() {
            // An unknown pod is the server's NotFound, as kubectl prints it.
            pod_api.get(pod).await?;
        }
    }
    if output.is_none() && lineage.pods.is_empty() {
        match &pod {
            Some(pod) => eprintln!("No snapshots of pod {pod} in {namespace} namespace."),
            None => eprintln!("No snapshots found in {namespace} namespace."),
        }
        return Ok(());
    }
    match output {
        None => print(&table(&rows(&lineage))),
        Some(Output::Name) => {
            let mut names = String::new();
            for pod in &lineage.pods {
                walk(&pod.snapshots, &mut |s| {
                    names.push_str(&format!("snapshot.twig.dev/{}\n", s.name));
                });
            }
            print(&names)
        }
        Some(format) => emit(Some(format), "", &lineage, ""),
    }
}

fn walk(nodes: &[SnapshotNode], visit: &mut impl FnMut(&SnapshotNode)) {
    for node in nodes {
        visit(node);
        walk(&node.children, visit);
    }
}

/// The namespace's snapshots grouped by pod and nested by parent: a snapshot
/// is under its parent when the parent is a snapshot of the same pod, at its
/// pod's top level otherwise (no parent, a parent of another pod, or one no
/// longer listed).
pub fn lineage(namespace: &str, snapshots: &[Snapshot], pods: &HashMap<String, Pod>) -> Lineage {
    let by_id: HashMap<&str, &Snapshot> =
        snapshots.iter().filter_map(|s| Some((id(s)?, s))).collect();
    let mut groups: BTreeMap<&str, Vec<&Snapshot>> = BTreeMap::new();
    for snapshot in snapshots {
        groups
            .entry(snapshot.spec.pod_name.as_str())
            .or_default()
            .push(snapshot);
    }
    let pods = groups
        .into_iter()
        .map(|(name, members)| {
            let pod = pods.get(name);
            PodLineage {
                name: name.to_string(),
                phase: match pod {
                    Some(p) => p
                        .status
                        .as_ref()
                        .and_then(|s| s.phase.clone())
                        .unwrap_or_else(|| "Unknown".into()),
                    None => "NotFound".into(),
                },
                creation_timestamp: pod.and_then(|p| p.metadata.creation_timestamp.clone()),
                restored_from: pod
                    .and_then(|p| p.annotations().get(RESTORE_FROM_ANNOTATION))
                    .and_then(|id| by_id.get(id.as_str()))
                    .map(|s| s.name_any()),
                snapshots: nest(&members),
            }
        })
        .collect();
    Lineage {
        namespace: namespace.to_string(),
        pods,
    }
}

/// One pod's snapshots as trees.
fn nest(members: &[&Snapshot]) -> Vec<SnapshotNode> {
    let ids: HashSet<&str> = members.iter().filter_map(|s| id(s)).collect();
    let mut children: HashMap<&str, Vec<&Snapshot>> = HashMap::new();
    let mut roots = Vec::new();
    for snapshot in members {
        match parent(snapshot).filter(|p| ids.contains(p) && Some(*p) != id(snapshot)) {
            Some(p) => children.entry(p).or_default().push(snapshot),
            None => roots.push(*snapshot),
        }
    }
    sort(&mut roots);
    let mut placed = HashSet::new();
    let mut trees: Vec<SnapshotNode> = roots
        .iter()
        .filter_map(|root| node(root, &children, &mut placed))
        .collect();
    // Parent links that loop leave snapshots no root reaches: each such one
    // is placed at the top as well.
    let mut rest: Vec<&Snapshot> = members.to_vec();
    sort(&mut rest);
    for snapshot in rest {
        if let Some(tree) = node(snapshot, &children, &mut placed) {
            trees.push(tree);
        }
    }
    trees
}

fn node<'a>(
    snapshot: &'a Snapshot,
    children: &HashMap<&str, Vec<&'a Snapshot>>,
    placed: &mut HashSet<String>,
) -> Option<SnapshotNode> {
    if !placed.insert(snapshot.name_any()) {
        return None;
    }
    let status = snapshot.status.clone().unwrap_or_default();
    let mut kids = id(snapshot)
        .and_then(|i| children.get(i))
        .cloned()
        .unwrap_or_default();
    sort(&mut kids);
    Some(SnapshotNode {
        name: snapshot.name_any(),
        phase: status.phase.to_string(),
        snapshot_id: status.snapshot_id,
        parent: status.parent,
        size_bytes: status.size_bytes,
        creation_timestamp: snapshot.metadata.creation_timestamp.clone(),
        children: kids
            .iter()
            .filter_map(|kid| node(kid, children, placed))
            .collect(),
    })
}

/// The table: a row per pod, then its snapshots drawn as `kubectl tree` draws.
fn rows(lineage: &Lineage) -> Vec<Vec<String>> {
    let mut rows = vec![["NAME", "PHASE", "SIZE", "AGE"].map(String::from).to_vec()];
    for pod in &lineage.pods {
        let mut label = format!("Pod/{}", pod.name);
        if let Some(from) = &pod.restored_from {
            label.push_str(&format!(" (from Snapshot/{from})"));
        }
        let pod_age = match &pod.creation_timestamp {
            Some(time) => age(Some(time)),
            None => String::new(),
        };
        rows.push(vec![label, pod.phase.clone(), String::new(), pod_age]);
        draw(&pod.snapshots, "", &mut rows);
    }
    rows
}

fn draw(nodes: &[SnapshotNode], indent: &str, rows: &mut Vec<Vec<String>>) {
    for (i, node) in nodes.iter().enumerate() {
        let last = i + 1 == nodes.len();
        rows.push(vec![
            format!(
                "{indent}{}Snapshot/{}",
                if last { "└─" } else { "├─" },
                node.name
            ),
            node.phase.clone(),
            size(node.size_bytes),
            age(node.creation_timestamp.as_ref()),
        ]);
        let indent = format!("{indent}{}", if last { "  " } else { "│ " });
        draw(&node.children, &indent, rows);
    }
}

fn id(snapshot: &Snapshot) -> Option<&str> {
    snapshot.status.as_ref()?.snapshot_id.as_deref()
}

fn parent(snapshot: &Snapshot) -> Option<&str> {
    snapshot.status.as_ref()?.parent.as_deref()
}

/// Oldest first, then by name.
fn sort(snapshots: &mut [&Snapshot]) {
    snapshots.sort_by(|a, b| {
        (&a.metadata.creation_timestamp, a.name_any())
            .cmp(&(&b.metadata.creation_timestamp, b.name_any()))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn snapshot(name: &str, pod: &str, id: &str, parent: Option<&str>) -> Snapshot {
        serde_json::from_value(json!({
            "apiVersion": "twig.dev/v1alpha1", "kind": "Snapshot",
            "metadata": {"name": name},
            "spec": {"podName": pod},
            "status": {"phase": "Ready", "snapshotID": id, "parent": parent},
        }))
        .expect("snapshot")
    }

    fn names(nodes: &[SnapshotNode]) -> Vec<String> {
        nodes
            .iter()
            .map(|n| {
                let kids = names(&n.children);
                if kids.is_empty() {
                    n.name.clone()
                } else {
                    format!("{}[{}]", n.name, kids.join(","))
                }
            })
            .collect()
    }

    #[test]
    fn nests_by_parent_within_a_pod() {
        let snapshots = vec![
            snapshot("c", "p", "3", Some("2")),
            snapshot("a", "p", "1", None),
            snapshot("b", "p", "2", Some("1")),
            snapshot("d", "p", "4", Some("1")),
            // Another pod's snapshot on top of p's: at the top of its own pod.
            snapshot("x", "q", "9", Some("2")),
            // A parent no longer listed, and a self-parent.
            snapshot("o", "p", "5", Some("gone")),
            snapshot("s", "p", "6", Some("6")),
        ];
        let lineage = lineage("ns", &snapshots, &HashMap::new());
        let trees: Vec<(String, Vec<String>)> = lineage
            .pods
            .iter()
            .map(|p| (p.name.clone(), names(&p.snapshots)))
            .collect();
        assert_eq!(
            trees,
            [
                (
                    "p".to_string(),
                    vec!["a[b[c],d]".to_string(), "o".into(), "s".into()]
                ),
                ("q".to_string(), vec!["x".to_string()]),
            ]
        );
        assert!(lineage.pods.iter().all(|p| p.phase == "NotFound"));
    }

    #[test]
    fn a_loop_of_parents_is_still_shown() {
        let snapshots = vec![
            snapshot("a", "p", "1", Some("2")),
            snapshot("b", "p", "2", Some("1")),
        ];
        let lineage = lineage("ns", &snapshots, &HashMap::new());
        assert_eq!(names(&lineage.pods[0].snapshots), ["a[b]"]);
    }
}
