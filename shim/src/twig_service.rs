//! The `Twig` service of twig-proto's `twig.proto` (`twig.v1.Twig`): the
//! controller's snapshot, rollback and stats of the running pod, served on
//! the shim's own ttrpc socket next to the Task service (the address
//! containerd writes in the bundle's `address` file).
//!
//! - **Snapshot** goes into the node store the base template lives in
//!   (`<store>/snapshots/<template id>`): [`twig_store::NodeStore::stage`]
//!   → the VM's snapshot into the staging directory (memory, vCPU and
//!   device state, and a `disk<i>` per read-write disk: every container's
//!   rootfs on its slot) → publish. The snapshot's labels record the pod:
//!   [`SANDBOX_LABEL`] and [`CONTAINERS_LABEL`] (each container's id, CRI
//!   name, disk slot and whether it ran), what a restore needs to adopt its
//!   processes. A failure publishes nothing (the staging is dropped).
//! - **Rollback** is in place and all or nothing (twig-vmm's rollback):
//!   `refused` = the pod still runs on its previous state; `lost` = the VM
//!   is gone, and every process of the pod is reported exited.
//! - **Stats**: the snapshots this shim took that the store still holds,
//!   and the last rollback's operation id.
//!
//! One operation at a time per pod: Snapshot and Rollback wait in a FIFO
//! queue (tokio's fair mutex) up to the call's deadline, then fail with
//! `DEADLINE_EXCEEDED`; Stats does not wait behind them.

use std::collections::HashMap;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use containerd_shim_protos::ttrpc;
use containerd_shim_protos::ttrpc::r#async::{Service, TtrpcContext};
use twig_net::{EgressPolicy, Reason};
use twig_proto::contract::ErrorCode;
use twig_proto::twig as pb;
use twig_proto::twig_ttrpc::{create_twig, Twig};
use twig_store::{Artefact, NodeStore, SnapshotSizes};

use crate::error::{Error, Result};
use crate::labels::{SnapshotContainer, CONTAINERS_LABEL, SANDBOX_LABEL};
use crate::pod::{to_completion, ContainerView, Pod};
use crate::restore::SANDBOX_NAMESPACE_ANNOTATION;
use crate::sandbox::NetworkStats;
use crate::spec::{self, CONTAINER_NAME_ANNOTATION};

/// How long a call without a deadline waits behind other operations.
pub const DEFAULT_QUEUE_DEADLINE: Duration = Duration::from_secs(300);

/// What the service remembers between calls.
struct Record {
    /// Snapshots taken by this shim, oldest first.
    snapshots: Vec<pb::SnapshotInfo>,
    /// The operation id of the last rollback done.
    last_rollback: String,
    /// False after a snapshot the VM took but the store did not publish:
    /// the VM tracks changes against it, so the next snapshot asked to be
    /// incremental is a full one (until a full snapshot or a rollback).
    baseline_published: bool,
    /// The published snapshot the VM tracks changes against, when this
    /// shim knows it (its last snapshot, or its last rollback's target;
    /// `None`: the snapshot the VM was restored from, which the node
    /// daemon leases). Deleted from the store since, an incremental
    /// snapshot would have no parent: a full one is taken instead.
    baseline: Option<String>,
}

/// The `twig.v1.Twig` service of one shim.
#[derive(Clone)]
pub struct TwigService {
    inner: Arc<Inner>,
}

struct Inner {
    pod: Pod,
    sandbox_id: String,
    queue: tokio::sync::Mutex<()>,
    record: Mutex<Record>,
    queue_deadline: Duration,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("blocking task: {e}")))
}

fn store_error(what: impl Into<String>) -> impl FnOnce(twig_store::Error) -> Error {
    let what = what.into();
    move |source| Error::Store { what, source }
}

impl TwigService {
    /// The service for `pod`, group `sandbox_id`, keeping snapshots in the
    /// node store of the pod's template
    /// ([`crate::sandbox::Sandbox::snapshot_store`]). Calls without a
    /// deadline wait at most `queue_deadline` behind other operations.
    pub fn new(pod: Pod, sandbox_id: String, queue_deadline: Duration) -> TwigService {
        TwigService {
            inner: Arc::new(Inner {
                pod,
                sandbox_id,
                queue: tokio::sync::Mutex::new(()),
                record: Mutex::new(Record {
                    snapshots: Vec::new(),
                    last_rollback: String::new(),
                    baseline_published: true,
                    baseline: None,
                }),
                queue_deadline,
            }),
        }
    }

    /// The service's ttrpc registration.
    pub fn services(self) -> HashMap<String, Service> {
        create_twig(Arc::new(self))
    }

    fn record(&self) -> MutexGuard<'_, Record> {
        self.inner.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_sandbox(&self, sandbox_id: &str) -> Result<()> {
        if !sandbox_id.is_empty() && sandbox_id != self.inner.sandbox_id {
            return Err(Error::NotFound(format!(
                "this shim runs sandbox {}, not {sandbox_id}",
                self.inner.sandbox_id
            )));
        }
        Ok(())
    }

    /// Waits for the pod's earlier operations, at most `deadline`.
    async fn queue(&self, deadline: Duration) -> Result<tokio::sync::MutexGuard<'_, ()>> {
        let started = Instant::now();
        tokio::time::timeout(deadline, self.inner.queue.lock())
            .await
            .map_err(|_| {
                Error::Deadline(format!(
                    "sandbox {}: waited {:?} behind another snapshot or rollback",
                    self.inner.sandbox_id,
                    started.elapsed()
                ))
            })
    }

    fn deadline(&self, ctx: &TtrpcContext) -> Duration {
        u64::try_from(ctx.timeout_nano)
            .ok()
            .filter(|n| *n > 0)
            .map(Duration::from_nanos)
            .unwrap_or(self.inner.queue_deadline)
    }

    /// The pod's Kubernetes namespace (CRI's annotation on its containers'
    /// specs), which owns its snapshots; `None` outside Kubernetes.
    fn namespace(&self) -> Result<Option<String>> {
        for c in self.inner.pod.container_views() {
            let oci = spec::read_spec(&c.bundle)?;
            if let Some(ns) = spec::annotation(&oci, SANDBOX_NAMESPACE_ANNOTATION) {
                return Ok(Some(ns.to_string()));
            }
        }
        Ok(None)
    }

    /// Refuses to `what` (snapshot or roll back) a pod with a raw block
    /// volume: the volume lives on the host, outside what a snapshot
    /// carries, so neither could keep the guest's view of it true.
    /// Refuses to `what` a pod whose volumes live outside its VM: a raw
    /// block volume or a shared host directory cannot be rewound.
    fn refuse_host_volumes(&self, what: &str) -> Result<()> {
        for c in self.inner.pod.container_views() {
            let volume = if c.block_volumes > 0 {
                "a raw block volume (volumeDevices)"
            } else if c.shares > 0 {
                "a host directory (hostPath or filesystem volume)"
            } else {
                continue;
            };
            return Err(Error::FailedPrecondition(format!(
                "cannot {what} pod sandbox {}: container {} has {volume}, which lives \
                 outside the VM and is not rewound",
                self.inner.sandbox_id, c.id
            )));
        }
        Ok(())
    }

    fn containers(&self) -> Result<Vec<SnapshotContainer>> {
        let sandbox_pid = self.inner.pod.sandbox_pid();
        let sandbox_id = &self.inner.sandbox_id;
        self.inner
            .pod
            .container_views()
            .into_iter()
            .map(|c: ContainerView| {
                let oci = spec::read_spec(&c.bundle)?;
                Ok(SnapshotContainer {
                    name: spec::annotation(&oci, CONTAINER_NAME_ANNOTATION).map(str::to_string),
                    pid: sandbox_pid.filter(|_| &c.id == sandbox_id),
                    guest_id: Some(c.guest_id).filter(|g| *g != c.id),
                    mounts_of: c.mounts_of,
                    id: c.id,
                    slot: c.slot,
                    running: c.running,
                })
            })
            .collect()
    }

    async fn do_snapshot(
        &self,
        req: pb::SnapshotRequest,
        deadline: Duration,
    ) -> Result<pb::SnapshotInfo> {
        self.check_sandbox(&req.sandbox_id)?;
        if req.snapshot_id.is_empty() {
            return Err(Error::InvalidArgument("snapshot: empty snapshot id".into()));
        }
        if let Some(key) = [SANDBOX_LABEL, CONTAINERS_LABEL]
            .into_iter()
            .find(|k| req.labels.contains_key(*k))
        {
            return Err(Error::InvalidArgument(format!(
                "snapshot {}: label {key} is the shim's own",
                req.snapshot_id
            )));
        }
        let _turn = self.queue(deadline).await?;
        if let Some(s) = self
            .record()
            .snapshots
            .iter()
            .find(|s| s.snapshot_id == req.snapshot_id)
        {
            return Ok(s.clone());
        }
        let sandbox = self.inner.pod.current_sandbox().await.ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "sandbox {} has no VM yet (no container was created)",
                self.inner.sandbox_id
            ))
        })?;
        let root = sandbox.snapshot_store()?;
        // No container is created or deleted from the list to the VM's
        // snapshot: the labels say what the snapshot holds.
        let _frozen = self.inner.pod.freeze_containers().await;
        self.refuse_host_volumes("snapshot")?;
        let containers = serde_json::to_string(&self.containers()?)
            .map_err(|e| Error::Internal(format!("encoding the pod's containers: {e}")))?;
        let owner = self.namespace()?;
        let sandbox_id = self.inner.sandbox_id.clone();
        // What the VM tracks changes against: `None` when it is a
        // snapshot the store did not publish (an incremental one would
        // have no parent).
        let baseline = {
            let r = self.record();
            r.baseline_published.then(|| r.baseline.clone())
        };
        let (id, full, labels) = (req.snapshot_id.clone(), req.full, req.labels);
        let started = Instant::now();
        let (result, baseline_lost) = blocking(move || {
            let store = match NodeStore::open(&root, false) {
                Ok(s) => s,
                Err(e) => return (Err(store_error("opening the node store")(e)), false),
            };
            let take = |full: bool| {
                take_snapshot(
                    &store,
                    sandbox.as_ref(),
                    &id,
                    full,
                    &labels,
                    &sandbox_id,
                    &containers,
                    owner.as_deref(),
                )
            };
            // The VM's baseline deleted since (a Snapshot object deleted,
            // or what it was rolled back to): an incremental snapshot
            // would name a parent the store no longer holds, and so would
            // every one after it. Rebase on a full one.
            let gone = |b: &str| matches!(store.get(b), Err(twig_store::Error::NotFound(_)));
            let asked_full = full;
            let full = match &baseline {
                None => true,
                Some(b) => full || b.as_deref().is_some_and(gone),
            };
            if full && !asked_full {
                tracing::info!(
                    id,
                    ?baseline,
                    "the VM's baseline left the store: a full snapshot"
                );
            }
            match take(full) {
                // Deleted between the look and the publication (or a
                // baseline this shim did not know): the VM now tracks
                // changes against the unpublished snapshot, which a full
                // one replaces.
                (
                    Err(Error::Store {
                        source: twig_store::Error::NotFound(m),
                        ..
                    }),
                    true,
                ) if !full => {
                    tracing::info!(
                        id,
                        "the incremental snapshot's parent left the store ({m}): a full snapshot"
                    );
                    take(true)
                }
                other => other,
            }
        })
        .await?;
        let mut record = self.record();
        match result {
            Ok(info) => {
                tracing::info!(
                    id = info.snapshot_id,
                    parent = info.parent_id,
                    full,
                    elapsed = ?started.elapsed(),
                    "pod snapshot published"
                );
                record.baseline_published = true;
                record.baseline = Some(info.snapshot_id.clone());
                record.snapshots.push(info.clone());
                Ok(info)
            }
            Err(e) => {
                if baseline_lost {
                    record.baseline_published = false;
                }
                tracing::warn!(id = req.snapshot_id, "pod snapshot failed: {e}");
                Err(e)
            }
        }
    }

    async fn do_rollback(&self, req: pb::RollbackRequest, deadline: Duration) -> Result<()> {
        self.check_sandbox(&req.sandbox_id)?;
        if req.snapshot_id.is_empty() {
            return Err(Error::InvalidArgument("rollback: empty snapshot id".into()));
        }
        let _turn = self.queue(deadline).await?;
        if !req.operation_id.is_empty() && self.record().last_rollback == req.operation_id {
            return Ok(());
        }
        let sandbox = self.inner.pod.current_sandbox().await.ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "sandbox {} has no VM yet (no container was created)",
                self.inner.sandbox_id
            ))
        })?;
        let root = sandbox.snapshot_store()?;
        // The pod's containers stay what the check compares until the VM
        // is back (see `do_snapshot`).
        let _frozen = self.inner.pod.freeze_containers().await;
        self.refuse_host_volumes("roll back")?;
        let now = self.containers()?;
        let sandbox_id = self.inner.sandbox_id.clone();
        let id = req.snapshot_id.clone();
        let started = Instant::now();
        let result = blocking(move || {
            let store =
                NodeStore::open(&root, false).map_err(store_error("opening the node store"))?;
            let snap = store.get(&id).map_err(|e| match e {
                twig_store::Error::NotFound(_) => Error::NotFound(format!(
                    "snapshot {id} is not in the node store {}",
                    root.display()
                )),
                other => store_error(format!("reading snapshot {id}"))(other),
            })?;
            check_rollback_target(&id, &snap.labels, &sandbox_id, &now)?;
            sandbox.rollback(snap.dir())
        })
        .await?;
        match result {
            Ok(info) => {
                tracing::info!(
                    id = req.snapshot_id,
                    operation = req.operation_id,
                    pages = info.pages_restored,
                    remapped = info.remapped,
                    elapsed = ?started.elapsed(),
                    "pod rolled back"
                );
                {
                    let mut record = self.record();
                    record.last_rollback = req.operation_id;
                    // The VM now tracks changes against a published snapshot.
                    record.baseline_published = true;
                    record.baseline = Some(req.snapshot_id.clone());
                }
                // The snapshot's copies of the pod's configuration and
                // Secrets are the pod's of then; it keeps its current ones.
                self.inner.pod.resync_volumes().await;
                Ok(())
            }
            Err(e) if e.is_vm_lost() => {
                self.inner.pod.vm_lost(&e.to_string());
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    async fn do_stats(&self, req: pb::StatsRequest) -> Result<pb::StatsResponse> {
        self.check_sandbox(&req.sandbox_id)?;
        let snapshots = self.record().snapshots.clone();
        let last = self.record().last_rollback.clone();
        // Snapshots deleted from the store since (the controller deletes
        // them through the node service) are not the pod's any more.
        let sandbox = self.inner.pod.current_sandbox().await;
        let root = sandbox.as_ref().and_then(|sb| sb.snapshot_store().ok());
        let network = match sandbox {
            Some(sb) => blocking(move || sb.network_stats()).await??,
            None => None,
        }
        .map(network_stats)
        .transpose()?;
        // The controller asks every pod for its stats every
        // `network_refresh`: a pod that took no snapshot (most clones) opens
        // no store (an open probes reflinks and sweeps `tmp/`).
        let snapshots = blocking(move || {
            if snapshots.is_empty() {
                return snapshots;
            }
            let Some(store) = root.and_then(|r| NodeStore::open(&r, false).ok()) else {
                return snapshots;
            };
            snapshots
                .into_iter()
                .filter(|s| {
                    !matches!(
                        store.get(&s.snapshot_id),
                        Err(twig_store::Error::NotFound(_))
                    )
                })
                .collect()
        })
        .await?;
        Ok(pb::StatsResponse {
            snapshots,
            last_rollback_operation_id: last,
            network: network.into(),
            ..Default::default()
        })
    }

    async fn do_set_egress_policy(&self, req: pb::SetEgressPolicyRequest) -> Result<()> {
        self.check_sandbox(&req.sandbox_id)?;
        let policy = match req.egress_policy.as_str() {
            "" => EgressPolicy::default(),
            json => twig_net::parse_policy(json, "egress_policy")
                .map_err(|e| Error::InvalidArgument(e.to_string()))?,
        };
        let sandbox = self.inner.pod.current_sandbox().await.ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "sandbox {} has no VM yet (no container was created)",
                self.inner.sandbox_id
            ))
        })?;
        blocking(move || sandbox.set_egress_policy(&policy)).await?
    }
}

/// Takes snapshot `id` of `sandbox` into `store` and publishes it; the
/// flag says whether the VM took the snapshot but the store did not
/// publish it (the VM's baseline is then an unpublished snapshot).
#[allow(clippy::too_many_arguments)]
fn take_snapshot(
    store: &NodeStore,
    sandbox: &dyn crate::sandbox::Sandbox,
    id: &str,
    full: bool,
    labels: &HashMap<String, String>,
    sandbox_id: &str,
    containers: &str,
    owner: Option<&str>,
) -> (Result<pb::SnapshotInfo>, bool) {
    let mut staging = match store.stage(id) {
        Ok(s) => s,
        Err(e) => return (Err(store_error(format!("staging snapshot {id}"))(e)), false),
    };
    for (key, value) in labels {
        staging.set_label(key, value);
    }
    staging.set_label(SANDBOX_LABEL, sandbox_id);
    staging.set_label(CONTAINERS_LABEL, containers);
    // Only a pod of this namespace may restore it (a Clone's pods).
    if let Some(ns) = owner {
        if let Err(e) = staging.set_owner(ns) {
            return (
                Err(store_error(format!("snapshot {id}: its owner"))(e)),
                false,
            );
        }
    }
    let vm = match sandbox.snapshot(staging.dir(), full) {
        Ok(vm) => vm,
        Err(e) => return (Err(e), false),
    };
    let published = match staging.publish() {
        Ok(p) => p,
        Err(e) => {
            return (
                Err(store_error(format!("publishing snapshot {id}"))(e)),
                true,
            )
        }
    };
    let size = store
        .usage_of(id)
        .map(|u| u.allocated_bytes)
        .unwrap_or_else(|e| {
            tracing::warn!(id, "accounting the snapshot: {e}");
            0
        });
    let state = published
        .artefacts
        .get(&Artefact::State)
        .copied()
        .unwrap_or_default();
    let sizes = twig_store::snapshot_sizes(published.dir()).unwrap_or_else(|e| {
        tracing::warn!(id, "sizing the snapshot: {e}");
        SnapshotSizes::default()
    });
    let info = pb::SnapshotInfo {
        snapshot_id: id.to_string(),
        parent_id: vm.parent.unwrap_or_default(),
        size_bytes: size,
        written_bytes: vm.pages_written.saturating_mul(4096).saturating_add(state),
        memory_bytes: sizes.memory_bytes,
        disk_bytes: sizes.disk_bytes,
        restore_bytes: sizes.restore_bytes,
        ..Default::default()
    };
    (Ok(info), false)
}

/// The `Twig` service's view of a pod's network path.
fn network_stats(n: NetworkStats) -> Result<pb::PodNetworkStats> {
    Ok(pb::PodNetworkStats {
        egress_policy: serde_json::to_string(&n.policy)
            .map_err(|e| Error::Internal(format!("encoding the egress policy: {e}")))?,
        counters: Reason::ALL
            .iter()
            .map(|r| {
                let c = n.counters.get(*r);
                pb::NetworkCounter {
                    reason: r.label().to_string(),
                    dropped: r.is_drop(),
                    packets: c.packets,
                    bytes: c.bytes,
                    ..Default::default()
                }
            })
            .collect(),
        ..Default::default()
    })
}

/// A rollback target must be a snapshot of this sandbox taken with the
/// containers it has now, on the same disk slots and in the same state:
/// containerd cannot see a container come back or go away, and a rollback
/// puts back every slot's disk.
pub fn check_rollback_target(
    id: &str,
    labels: &std::collections::BTreeMap<String, String>,
    sandbox_id: &str,
    now: &[SnapshotContainer],
) -> Result<()> {
    let of = labels.get(SANDBOX_LABEL).map(String::as_str).unwrap_or("");
    if of != sandbox_id {
        return Err(Error::FailedPrecondition(format!(
            "snapshot {id} was taken of sandbox {:?}, not of this one ({sandbox_id})",
            of
        )));
    }
    let then: Vec<SnapshotContainer> = labels
        .get(CONTAINERS_LABEL)
        .map(|l| serde_json::from_str(l))
        .transpose()
        .map_err(|e| {
            Error::FailedPrecondition(format!("snapshot {id}: unreadable {CONTAINERS_LABEL}: {e}"))
        })?
        .unwrap_or_default();
    let key = |c: &SnapshotContainer| (c.id.clone(), c.slot, c.running);
    let (a, b): (Vec<_>, Vec<_>) = (
        then.iter().map(key).collect(),
        now.iter().map(key).collect(),
    );
    if a != b {
        let show = |v: &[(String, Option<usize>, bool)]| {
            v.iter()
                .map(|(id, slot, run)| {
                    let slot = slot.map(|s| s.to_string()).unwrap_or_else(|| "-".into());
                    let state = if *run { "running" } else { "not running" };
                    format!("{id} (slot {slot}, {state})")
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(Error::FailedPrecondition(format!(
            "the pod's containers changed since snapshot {id} (then: [{}]; now: [{}]); \
             a rollback cannot bring containers back or take them away",
            show(&a),
            show(&b)
        )));
    }
    Ok(())
}

/// The status the controller acts on: twig-vmm's `refused` is `ABORTED`
/// (the pod still runs on its previous state; try again), `lost` is
/// `DATA_LOSS` (the VM is gone), a full store or disk is
/// `RESOURCE_EXHAUSTED`; everything else as containerd's errdefs
/// ([`Error::code`]).
pub fn status(e: &Error) -> ErrorCode {
    use twig_vmm::ErrorKind;
    if no_space(e) {
        return ErrorCode::ResourceExhausted;
    }
    match e.vmm_kind() {
        Some(ErrorKind::Refused) => ErrorCode::Aborted,
        Some(ErrorKind::Lost) => ErrorCode::DataLoss,
        Some(ErrorKind::GuestStopped) => ErrorCode::FailedPrecondition,
        Some(ErrorKind::GuestNotAnswering) => ErrorCode::Unavailable,
        _ => ErrorCode::from_number(e.code() as i32).unwrap_or(ErrorCode::Internal),
    }
}

/// Whether the store's filesystem filled up. twig-vmm's API has no kind for
/// it (its write fails as `internal` with the OS error in the message), so
/// the message's ENOSPC text is what tells.
fn no_space(e: &Error) -> bool {
    match e {
        Error::Store {
            source: twig_store::Error::NoSpace { .. },
            ..
        } => true,
        Error::Vmm { source, .. } => {
            let m = source.to_string();
            m.contains("No space left on device") || m.contains("os error 28")
        }
        _ => false,
    }
}

fn to_ttrpc(e: Error) -> ttrpc::Error {
    status(&e).status(e.to_string())
}

#[async_trait]
impl Twig for TwigService {
    async fn snapshot(
        &self,
        ctx: &TtrpcContext,
        req: pb::SnapshotRequest,
    ) -> ttrpc::Result<pb::SnapshotResponse> {
        let deadline = self.deadline(ctx);
        let info = to_completion(self, |s| async move { s.do_snapshot(req, deadline).await })
            .await
            .map_err(to_ttrpc)?;
        Ok(pb::SnapshotResponse {
            snapshot: Some(info).into(),
            ..Default::default()
        })
    }

    async fn rollback(
        &self,
        ctx: &TtrpcContext,
        req: pb::RollbackRequest,
    ) -> ttrpc::Result<pb::RollbackResponse> {
        let deadline = self.deadline(ctx);
        to_completion(self, |s| async move { s.do_rollback(req, deadline).await })
            .await
            .map_err(to_ttrpc)?;
        Ok(pb::RollbackResponse::default())
    }

    async fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: pb::StatsRequest,
    ) -> ttrpc::Result<pb::StatsResponse> {
        self.do_stats(req).await.map_err(to_ttrpc)
    }

    async fn set_egress_policy(
        &self,
        _ctx: &TtrpcContext,
        req: pb::SetEgressPolicyRequest,
    ) -> ttrpc::Result<pb::SetEgressPolicyResponse> {
        self.do_set_egress_policy(req).await.map_err(to_ttrpc)?;
        Ok(pb::SetEgressPolicyResponse::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn c(id: &str, slot: usize, running: bool) -> SnapshotContainer {
        SnapshotContainer {
            id: id.into(),
            guest_id: None,
            pid: None,
            name: Some(format!("{id}-name")),
            slot: Some(slot),
            running,
            mounts_of: None,
        }
    }

    fn labels(sandbox: &str, cs: &[SnapshotContainer]) -> BTreeMap<String, String> {
        BTreeMap::from([
            (SANDBOX_LABEL.to_string(), sandbox.to_string()),
            (
                CONTAINERS_LABEL.to_string(),
                serde_json::to_string(cs).unwrap_or_default(),
            ),
        ])
    }

    #[test]
    fn rollback_targets_must_match_the_pod() {
        let now = [c("a", 0, true), c("b", 1, true)];
        assert!(check_rollback_target("s", &labels("pod", &now), "pod", &now).is_ok());
        let e = check_rollback_target("s", &labels("other", &now), "pod", &now).unwrap_err();
        assert_eq!(status(&e), ErrorCode::FailedPrecondition);
        assert!(e.to_string().contains("other"), "{e}");
        // A container added, one exited, one on another slot.
        for then in [
            vec![c("a", 0, true)],
            vec![c("a", 0, true), c("b", 1, false)],
            vec![c("a", 0, true), c("b", 2, true)],
        ] {
            let e = check_rollback_target("s", &labels("pod", &then), "pod", &now).unwrap_err();
            assert_eq!(status(&e), ErrorCode::FailedPrecondition);
            assert!(e.to_string().contains("changed since snapshot s"), "{e}");
        }
        let mut bad = labels("pod", &now);
        bad.insert(CONTAINERS_LABEL.into(), "{".into());
        let e = check_rollback_target("s", &bad, "pod", &now).unwrap_err();
        assert!(e.to_string().contains("unreadable"), "{e}");
    }

    #[test]
    fn errors_map_to_codes_the_controller_acts_on() {
        use twig_vmm::api::ClientError;
        use twig_vmm::ErrorKind;
        let vmm = |kind, message: &str| Error::Vmm {
            what: "x".into(),
            source: ClientError::Vmm {
                kind,
                message: message.into(),
            },
        };
        let cases = [
            (vmm(ErrorKind::Refused, "undone"), ttrpc::Code::ABORTED),
            (vmm(ErrorKind::Lost, "gone"), ttrpc::Code::DATA_LOSS),
            (vmm(ErrorKind::NotFound, "no"), ttrpc::Code::NOT_FOUND),
            (
                vmm(
                    ErrorKind::Internal,
                    "writing memory: No space left on device (os error 28)",
                ),
                ttrpc::Code::RESOURCE_EXHAUSTED,
            ),
            (vmm(ErrorKind::Internal, "kvm"), ttrpc::Code::INTERNAL),
            (
                Error::Store {
                    what: "publishing".into(),
                    source: twig_store::Error::NoSpace {
                        context: "c".into(),
                    },
                },
                ttrpc::Code::RESOURCE_EXHAUSTED,
            ),
            (
                Error::Store {
                    what: "staging".into(),
                    source: twig_store::Error::AlreadyExists("s".into()),
                },
                ttrpc::Code::ALREADY_EXISTS,
            ),
            (
                Error::Deadline("queue".into()),
                ttrpc::Code::DEADLINE_EXCEEDED,
            ),
        ];
        for (e, code) in cases {
            let msg = e.to_string();
            match to_ttrpc(e) {
                ttrpc::Error::RpcStatus(s) => {
                    assert_eq!(s.code(), code, "{msg}");
                    assert_eq!(s.message(), msg);
                }
                other => panic!("not a status: {other:?}"),
            }
        }
    }
}
