//! Export: a Ready Snapshot with `spec.export` is pushed by its node to the
//! cluster's OCI registry (twig-node's `ExportSnapshot`, through twig-oci),
//! so that Clones of it run on any node.
//!
//! The repository is `<registry>/<prefix>/<namespace>/<name>` (the only
//! ones twig-node lets the namespace write), the tag the Snapshot's UID; the
//! artifact is recorded by digest in `status.artifact`, and
//! `status.availability` says where the snapshot can be restored from. The
//! condition `Exported` tells how it went: `Unknown`/`Exporting` during the
//! first push, `True`/`Exported`, or `False` with `RegistryUnavailable`
//! (retried with the backoff), `PermissionDenied`, `ExportFailed` or
//! `NoRegistry` (tried again at each recheck). A failed export never fails
//! the Snapshot: it stays Ready on its node. The artifact outlives the
//! Snapshot: its lifecycle is the registry's (retention policies); nodes
//! keep no credentials the controller could use to delete it.

use kube::runtime::events::EventType;
use kube::{Api, ResourceExt};

use super::{set_condition, write_status};
use crate::context::{Context, Error};
use crate::crd::{Availability, Snapshot, SnapshotArtifact, SnapshotStatus};
use crate::shim::ShimError;

/// Condition type of a Snapshot's export.
pub const EXPORTED: &str = "Exported";

/// Reasons of the `Exported` condition.
pub mod reason {
    /// True: the snapshot is in the registry (`status.artifact`).
    pub const EXPORTED: &str = "Exported";
    /// Unknown: the first push is under way.
    pub const EXPORTING: &str = "Exporting";
    /// False: the registry (or the node daemon) could not be reached;
    /// retried with the backoff.
    pub const REGISTRY_UNAVAILABLE: &str = "RegistryUnavailable";
    /// False: the registry refused the node's credentials, or the node the
    /// repository (not the namespace's).
    pub const PERMISSION_DENIED: &str = "PermissionDenied";
    /// False: any other failure, in the node's words.
    pub const EXPORT_FAILED: &str = "ExportFailed";
    /// False: `spec.export` without a registry (`--registry`, the chart's
    /// `registry.host`).
    pub const NO_REGISTRY: &str = "NoRegistry";
}

/// Exports a Ready snapshot of this node when its spec asks and it has no
/// artifact yet. Returns the Snapshot as last written; an `Err` is a
/// failure to retry with the backoff (the condition already says it).
pub(crate) async fn export(
    api: &Api<Snapshot>,
    snap: Snapshot,
    ns: &str,
    ctx: &Context,
) -> Result<Snapshot, Error> {
    let wanted =
        |s: &Snapshot| s.spec.export && s.status.as_ref().is_none_or(|st| st.artifact.is_none());
    if !wanted(&snap) {
        return Ok(snap);
    }
    // The cache may lag behind this controller's own last write (a push
    // done, a failure recorded): decide on the object as it is now.
    let snap = api.get(&snap.name_any()).await?;
    if !wanted(&snap) {
        return Ok(snap);
    }
    let status = snap.status.clone().unwrap_or_default();
    let Some(registry) = ctx.registry.clone() else {
        let message = "spec.export is set but the controller has no registry to export to (its --registry; the chart's registry.host)";
        return set_exported(api, snap, "False", reason::NO_REGISTRY, message, ctx).await;
    };
    let id = status
        .snapshot_id
        .clone()
        .ok_or(Error::MissingField("status.snapshotID"))?;
    let uid = snap.uid().ok_or(Error::MissingField("metadata.uid"))?;
    let repository = registry.repository(ns, &snap.name_any());
    let reference = format!("{repository}:{uid}");
    let mut snap = snap;
    if !status.conditions.iter().any(|c| c.type_ == EXPORTED) {
        let message = format!("pushing snapshot {id} to {reference}");
        snap = set_exported(api, snap, "Unknown", reason::EXPORTING, &message, ctx).await?;
        let note = format!("Pushing snapshot {id} to {reference}");
        ctx.event(&snap, EventType::Normal, "Exporting", "Export", note)
            .await;
    }
    let started = std::time::Instant::now();
    let result = ctx.node.export_snapshot(&id, &reference, ns).await;
    ctx.metrics
        .observe("export", result.is_ok(), started.elapsed().as_secs_f64());
    let pushed = match result {
        Ok(pushed) => pushed,
        Err(err) => return failed(api, snap, &reference, err, ctx).await,
    };
    let artifact = SnapshotArtifact {
        reference: format!("{repository}@{}", pushed.digest),
        digest: pushed.digest.clone(),
        bytes_uploaded: pushed.bytes_uploaded,
    };
    let message = format!(
        "in the registry as {}: {} bytes uploaded, {} snapshots pushed, {} already there",
        artifact.reference,
        pushed.bytes_uploaded,
        pushed.snapshots_pushed,
        pushed.snapshots_present
    );
    let status = snap.status.clone().unwrap_or_default();
    let exported = SnapshotStatus {
        availability: Some(Availability::NodeAndRegistry),
        artifact: Some(artifact),
        conditions: set_condition(
            &status.conditions,
            EXPORTED,
            "True",
            (reason::EXPORTED, &message),
            snap.metadata.generation,
        ),
        ..status
    };
    let snap = write_status(api, &snap, exported, ctx).await?;
    let note = format!("Exported to the registry: {message}");
    ctx.event(&snap, EventType::Normal, "Exported", "Export", note)
        .await;
    Ok(snap)
}

/// Records a failed export: `Unavailable` is returned to be retried with
/// the backoff, anything else is tried again at the next recheck.
async fn failed(
    api: &Api<Snapshot>,
    snap: Snapshot,
    reference: &str,
    err: ShimError,
    ctx: &Context,
) -> Result<Snapshot, Error> {
    let (why, message) = match &err {
        ShimError::Unavailable { .. } => (
            reason::REGISTRY_UNAVAILABLE,
            format!("the push to {reference} could not reach the registry (or the node daemon); retrying: {err}"),
        ),
        ShimError::Forbidden(m) => (
            reason::PERMISSION_DENIED,
            format!("the push to {reference} was refused (the node's registry credentials, or a repository outside the namespace's): {m}"),
        ),
        _ => (
            reason::EXPORT_FAILED,
            format!("the push to {reference} failed: {err}"),
        ),
    };
    let already = snap.status.as_ref().is_some_and(|st| {
        st.conditions
            .iter()
            .any(|c| c.type_ == EXPORTED && c.reason == why && c.message == message)
    });
    let snap = if already {
        snap
    } else {
        let snap = set_exported(api, snap, "False", why, &message, ctx).await?;
        ctx.event(&snap, EventType::Warning, why, "Export", message)
            .await;
        snap
    };
    match err {
        ShimError::Unavailable { .. } => Err(err.into()),
        _ => Ok(snap),
    }
}

/// Writes the `Exported` condition (unless it already says that), with
/// `status.availability` set.
async fn set_exported(
    api: &Api<Snapshot>,
    snap: Snapshot,
    status_: &str,
    why: &str,
    message: &str,
    ctx: &Context,
) -> Result<Snapshot, Error> {
    let status = snap.status.clone().unwrap_or_default();
    let unchanged = status.conditions.iter().any(|c| {
        c.type_ == EXPORTED && c.status == status_ && c.reason == why && c.message == message
    });
    if unchanged {
        return Ok(snap);
    }
    let new = SnapshotStatus {
        availability: Some(availability(&status)),
        conditions: set_condition(
            &status.conditions,
            EXPORTED,
            status_,
            (why, message),
            snap.metadata.generation,
        ),
        ..status
    };
    write_status(api, &snap, new, ctx).await
}

/// Where a Ready snapshot can be restored from, by its artifact (a snapshot
/// whose node copy is gone says `Registry` already).
pub(crate) fn availability(status: &SnapshotStatus) -> Availability {
    match (status.availability, status.artifact.is_some()) {
        (Some(Availability::Registry), true) => Availability::Registry,
        (_, true) => Availability::NodeAndRegistry,
        (_, false) => Availability::Node,
    }
}
