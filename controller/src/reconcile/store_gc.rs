//! The node store's garbage collector, driven from here because only the
//! controller sees the objects that refer to the store's snapshots: every
//! `gc_every` it lists every Snapshot and SandboxTemplate of the cluster
//! and sends the node daemon the ids they name (`CollectGarbage`); the
//! daemon deletes the published snapshots nothing refers to that are older
//! than `gc_grace` and are none of its own roots (base templates, retained
//! snapshots, snapshots of running VMs, builds, parents of kept ones). What
//! it reclaimed is counted in `twig_node_store_gc_reclaimed_bytes_total`
//! and `twig_node_store_gc_deleted_snapshots_total`. A failed list sends
//! nothing (an incomplete set would make referenced data look orphaned).

use std::collections::BTreeSet;
use std::sync::Arc;

use kube::api::{Api, ListParams};
use kube::ResourceExt;
use tokio::time::MissedTickBehavior;

use crate::context::Context;
use crate::crd::{SandboxTemplate, Snapshot};
use crate::shim::ShimError;

/// The node-store ids the cluster's objects name: each Snapshot's UID (the
/// id its node takes it under, so a snapshot still being taken counts) and
/// `status.snapshotID`, and each SandboxTemplate's template id
/// (`template.<namespace>.<name>`, twig-store's `layout::template_id`).
pub fn referenced(snapshots: &[Snapshot], templates: &[SandboxTemplate]) -> Vec<String> {
    let mut ids = BTreeSet::new();
    for s in snapshots {
        if let Some(uid) = s.uid() {
            ids.insert(uid);
        }
        if let Some(id) = s.status.as_ref().and_then(|st| st.snapshot_id.clone()) {
            ids.insert(id);
        }
    }
    for t in templates {
        if let Some(ns) = t.namespace() {
            ids.insert(format!("template.{ns}.{}", t.name_any()));
        }
    }
    ids.into_iter().collect()
}

async fn collect_once(ctx: &Context) -> Result<(), String> {
    let lp = ListParams::default();
    let snapshots = Api::<Snapshot>::all(ctx.client.clone())
        .list(&lp)
        .await
        .map_err(|e| format!("listing Snapshots: {e}"))?;
    let templates = Api::<SandboxTemplate>::all(ctx.client.clone())
        .list(&lp)
        .await
        .map_err(|e| format!("listing SandboxTemplates: {e}"))?;
    let ids = referenced(&snapshots.items, &templates.items);
    match ctx.node.collect_garbage(ids, ctx.gc_grace).await {
        Ok(c) => {
            if !c.deleted.is_empty() {
                tracing::info!(
                    deleted = ?c.deleted,
                    bytes = c.reclaimed_bytes,
                    "the node store's garbage collected"
                );
            }
            ctx.metrics
                .add_store_gc(&ctx.node_name, c.deleted.len() as u64, c.reclaimed_bytes);
            Ok(())
        }
        // A node daemon that predates the collector (ttrpc answers
        // NOT_FOUND for a method it does not serve).
        Err(ShimError::Unimplemented(_) | ShimError::NotFound(_)) => {
            tracing::debug!("the node daemon collects no garbage");
            Ok(())
        }
        Err(e) => Err(format!("CollectGarbage: {e}")),
    }
}

/// Collects the node store's garbage every `gc_every` until the future is
/// dropped (the first time one period after the start, once the caches of
/// a restarted cluster had time to settle).
pub(crate) async fn run(ctx: Arc<Context>) {
    let start = tokio::time::Instant::now() + ctx.gc_every;
    let mut tick = tokio::time::interval_at(start, ctx.gc_every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = collect_once(&ctx).await {
            tracing::warn!("the node store's garbage collection failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{SandboxTemplateSpec, SnapshotSpec, SnapshotStatus};
    use serde_json::json;

    #[test]
    fn the_referenced_ids_are_snapshot_uids_their_ids_and_template_ids() {
        let spec: SnapshotSpec = serde_json::from_value(json!({"podName": "p"})).unwrap();
        let mut a = Snapshot::new("a", spec);
        a.metadata.namespace = Some("team-a".into());
        a.metadata.uid = Some("uid-a".into());
        let mut b = a.clone();
        b.metadata.uid = Some("uid-b".into());
        b.status = Some(SnapshotStatus {
            snapshot_id: Some("id-b".into()),
            ..Default::default()
        });
        let spec: SandboxTemplateSpec =
            serde_json::from_value(json!({"image": "py:3", "vcpus": 1, "memoryMiB": 32})).unwrap();
        let mut t = SandboxTemplate::new("py", spec);
        t.metadata.namespace = Some("agents".into());
        assert_eq!(
            referenced(&[a, b], &[t]),
            ["id-b", "template.agents.py", "uid-a", "uid-b"]
        );
        assert!(referenced(&[], &[]).is_empty());
    }
}
