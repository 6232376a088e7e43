//! `kubectl twig tree`: the snapshot lineage, grouped by pod.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use twig_controller::crd::{Snapshot, RESTORE_FROM_ANNOTATION};

use crate::error::Error;
use crate::output::{age, print, size, table};

/// `kubectl twig tree [POD]`.
pub async fn tree(client: Client, namespace: &str, pod: Option<String>) -> Result<(), Error> {
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
    let forest = Forest::new(&snapshots);
    let mut groups: BTreeMap<&str, Vec<&Snapshot>> = BTreeMap::new();
    for snapshot in &snapshots {
        groups
            .entry(snapshot.spec.pod_name.as_str())
            .or_default()
            .push(snapshot);
    }
    if let Some(pod) = &pod {
        groups.retain(|name, _| name == pod);
        if groups.is_empty() {
            // An unknown pod is the server's NotFound, as kubectl prints it.
            pod_api.get(pod).await?;
            eprintln!("No snapshots of pod {pod} in {namespace} namespace.");
            return Ok(());
        }
    }
    if groups.is_empty() {
        eprintln!("No snapshots found in {namespace} namespace.");
        return Ok(());
    }
    let mut rows = vec![["NAME", "PHASE", "SIZE", "AGE"].map(String::from).to_vec()];
    for (pod_name, members) in groups {
        let pod = pods.get(pod_name);
        let mut label = format!("Pod/{pod_name}");
        if let Some(from) = pod
            .and_then(|p| p.annotations().get(RESTORE_FROM_ANNOTATION))
            .and_then(|id| forest.by_id.get(id.as_str()))
        {
            label.push_str(&format!(" (from Snapshot/{})", from.name_any()));
        }
        rows.push(vec![
            label,
            match pod {
                Some(p) => p
                    .status
                    .as_ref()
                    .and_then(|s| s.phase.clone())
                    .unwrap_or_else(|| "Unknown".into()),
                None => "NotFound".into(),
            },
            String::new(),
            pod.map(|p| age(p.metadata.creation_timestamp.as_ref()))
                .unwrap_or_default(),
        ]);
        forest.render(&members, &mut rows);
    }
    print(&table(&rows))
}

/// Snapshots by node-store ID, for following `status.parent`.
struct Forest<'a> {
    by_id: HashMap<&'a str, &'a Snapshot>,
}

impl<'a> Forest<'a> {
    fn new(snapshots: &'a [Snapshot]) -> Self {
        let by_id = snapshots
            .iter()
            .filter_map(|s| Some((s.status.as_ref()?.snapshot_id.as_deref()?, s)))
            .collect();
        Self { by_id }
    }

    /// Rows for one pod's snapshots: each under its parent when the parent is
    /// one of them, at the top otherwise (no parent, a parent of another pod,
    /// or one no longer listed).
    fn render(&self, members: &[&'a Snapshot], rows: &mut Vec<Vec<String>>) {
        let ids: HashSet<&str> = members.iter().filter_map(|s| id(s)).collect();
        let mut children: HashMap<&str, Vec<&Snapshot>> = HashMap::new();
        let mut roots = Vec::new();
        for snapshot in members {
            match parent(snapshot).filter(|p| ids.contains(p) && Some(*p) != id(snapshot)) {
                Some(p) => children.entry(p).or_default().push(snapshot),
                None => roots.push(*snapshot),
            }
        }
        let mut shown = HashSet::new();
        let mut pending: Vec<&Snapshot> = members.to_vec();
        sort(&mut roots);
        // Parent links that loop leave some snapshots unreachable from a
        // root: each such one is shown at the top as well.
        loop {
            for (i, root) in roots.iter().enumerate() {
                self.row(root, "", i + 1 == roots.len(), &children, &mut shown, rows);
            }
            pending.retain(|s| !shown.contains(&s.name_any()));
            let Some(first) = pending.first() else { break };
            roots = vec![*first];
        }
    }

    fn row(
        &self,
        snapshot: &Snapshot,
        indent: &str,
        last: bool,
        children: &HashMap<&str, Vec<&Snapshot>>,
        shown: &mut HashSet<String>,
        rows: &mut Vec<Vec<String>>,
    ) {
        if !shown.insert(snapshot.name_any()) {
            return;
        }
        let status = snapshot.status.clone().unwrap_or_default();
        rows.push(vec![
            format!(
                "{indent}{}Snapshot/{}",
                if last { "└─" } else { "├─" },
                snapshot.name_any()
            ),
            status.phase.to_string(),
            size(status.size_bytes),
            age(snapshot.metadata.creation_timestamp.as_ref()),
        ]);
        let mut kids = id(snapshot)
            .and_then(|i| children.get(i))
            .cloned()
            .unwrap_or_default();
        sort(&mut kids);
        let indent = format!("{indent}{}", if last { "  " } else { "│ " });
        for (i, kid) in kids.iter().enumerate() {
            self.row(kid, &indent, i + 1 == kids.len(), children, shown, rows);
        }
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
