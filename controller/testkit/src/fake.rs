//! A fake node behind the controller's traits: it "runs" every pod it is
//! asked about, records each call, and can hold snapshots in flight. A
//! sandbox has a network path (a policy in force and counters) once the
//! test gives it one, or from the start after [`FakeNode::with_network_paths`].
//!
//! Sizes: a full snapshot holds [`FULL_MEMORY_BYTES`] of memory, an
//! incremental one [`PAGE_BYTES`]; each holds [`DISK_BYTES`] of disk and
//! restores to [`RESTORE_BYTES`]. The store's usage is the sum of what its
//! snapshots hold, on a filesystem of [`STORE_CAPACITY_BYTES`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use tokio::sync::watch;
use twig_controller::crd::{SandboxTemplateSpec, SnapshotMode};
use twig_controller::sandbox::{LocateError, SandboxLocator};
use twig_controller::shim::{
    BuildIn, ErrorCode, Exported, NetworkCounter, NetworkStats, NodeService, Sandbox, SandboxStats,
    ShimError, SnapshotInfo, StoreUsage, TemplateState, TwigShim, PULLED_FROM,
};
use twig_net::EgressPolicy;

/// One call the fake received, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    /// `Twig.Snapshot` of a sandbox.
    Snapshot {
        /// The sandbox (pod sandbox id).
        sandbox: String,
        /// The node-store id asked for.
        snapshot_id: String,
    },
    /// `Twig.Rollback` of a sandbox.
    Rollback {
        /// The sandbox (pod sandbox id).
        sandbox: String,
        /// The snapshot to go back to.
        snapshot_id: String,
        /// The operation's id (the Rollback's UID).
        operation_id: String,
    },
    /// `Twig.Stats` of the sandbox.
    Stats(String),
    /// `Twig.SetEgressPolicy` of a sandbox.
    SetEgressPolicy {
        /// The sandbox (pod sandbox id).
        sandbox: String,
        /// The policy sent (`None`: the built-in default).
        policy: Option<EgressPolicy>,
    },
    /// `Node.DeleteSnapshot` of the id.
    DeleteSnapshot(String),
    /// `Node.EnsureTemplate` of the template.
    EnsureTemplate(String),
    /// `Node.DeleteTemplate` of the template.
    DeleteTemplate(String),
    /// `Node.ExportSnapshot`.
    ExportSnapshot {
        /// The node-store id pushed.
        snapshot_id: String,
        /// Where to (`registry/repository:tag`).
        reference: String,
        /// The namespace asking.
        namespace: String,
    },
}

/// Memory a full snapshot of the fake holds (its guest's RAM, all written).
pub const FULL_MEMORY_BYTES: u64 = 128 << 20;
/// Memory an incremental snapshot of the fake holds: one page.
pub const PAGE_BYTES: u64 = 4096;
/// Disk bytes every snapshot of the fake holds.
pub const DISK_BYTES: u64 = 3 << 20;
/// What every snapshot of the fake restores to: 128 MiB of RAM and a 1 GiB disk.
pub const RESTORE_BYTES: u64 = (128 << 20) + (1 << 30);
/// Size of the fake node store's filesystem.
pub const STORE_CAPACITY_BYTES: u64 = 100 << 30;

#[derive(Default)]
struct SandboxState {
    snapshots: Vec<SnapshotInfo>,
    last_rollback: Option<String>,
    network: Option<NetworkState>,
}

#[derive(Clone, Default)]
struct NetworkState {
    policy: EgressPolicy,
    counters: Vec<NetworkCounter>,
}

#[derive(Default)]
struct State {
    sandboxes: BTreeMap<String, SandboxState>,
    killed: BTreeSet<String>,
    calls: Vec<Call>,
    /// The node store: each snapshot's id and its parent's.
    store: BTreeMap<String, Option<String>>,
    hold: bool,
    in_flight: BTreeMap<String, usize>,
    max_in_flight: usize,
    /// DeleteSnapshot calls still to fail as if the node service were down.
    failing_deletes: usize,
    /// When each DeleteSnapshot call arrived.
    delete_times: Vec<std::time::Instant>,
    /// Every sandbox has a network path (the built-in default policy at first).
    network_paths: bool,
    /// SetEgressPolicy calls still to fail.
    failing_sets: usize,
    /// Snapshot calls still to refuse (after they were recorded).
    failing_snapshots: usize,
    /// Codes the next Snapshot calls answer (after they were recorded), in order.
    snapshot_codes: Vec<ErrorCode>,
    /// Codes the next Rollback calls answer (after they were recorded), in order.
    rollback_codes: Vec<ErrorCode>,
    /// The shim answers Snapshot without sizes (as one that predates them).
    shim_without_sizes: bool,
    /// GetStoreUsage calls still to fail as if the node service were down
    /// (GetStoreUsage is periodic, so it is not in the call log).
    failing_store_usage: usize,
    /// Templates the node store holds (ensured and not deleted).
    templates: BTreeSet<String>,
    /// The build Pod UIDs each template was built in, in order.
    build_pods: BTreeMap<String, Vec<String>>,
    /// EnsureTemplate calls with a build Pod still to fail the build.
    failing_builds: usize,
    /// Build Pods a build failed in (spent: a build there fails again).
    spent_pods: BTreeSet<String>,
    /// Codes the next ExportSnapshot calls answer (after they were recorded), in order.
    export_codes: Vec<ErrorCode>,
    /// Templates pulled instead of built: (key, artifact).
    pulled_templates: Vec<(String, String)>,
}

/// The fake node: sandboxes, node store and call log behind the controller's traits.
pub struct FakeNode {
    state: Mutex<State>,
    wake: watch::Sender<u64>,
}

impl Default for FakeNode {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            wake: watch::channel(0).0,
        }
    }
}

struct InFlight<'a> {
    node: &'a FakeNode,
    sandbox: String,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(n) = self.node.lock().in_flight.get_mut(&self.sandbox) {
            *n -= 1;
        }
    }
}

impl FakeNode {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The UIDs of the build Pods template `key` (`namespace/name`) was
    /// built in (or failed in), in order.
    pub fn build_pods(&self, key: &str) -> Vec<String> {
        self.lock().build_pods.get(key).cloned().unwrap_or_default()
    }

    /// Makes the next `n` builds given a build Pod fail (the Pod is spent).
    pub fn fail_builds(&self, n: usize) {
        self.lock().failing_builds = n;
    }

    /// Every call received so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// How many Snapshot calls arrived.
    pub fn snapshot_calls(&self) -> usize {
        self.calls()
            .iter()
            .filter(|c| matches!(c, Call::Snapshot { .. }))
            .count()
    }

    /// The ExportSnapshot calls, in order: (snapshot id, reference, namespace).
    pub fn export_calls(&self) -> Vec<(String, String, String)> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::ExportSnapshot {
                    snapshot_id,
                    reference,
                    namespace,
                } => Some((snapshot_id, reference, namespace)),
                _ => None,
            })
            .collect()
    }

    /// The templates EnsureTemplate pulled from another node's export
    /// instead of building: (key, artifact).
    pub fn pulled_templates(&self) -> Vec<(String, String)> {
        self.lock().pulled_templates.clone()
    }

    /// The next ExportSnapshot calls answer `codes`, one each, as twig-node
    /// does (`UNAVAILABLE`: the registry could not be reached, …).
    pub fn answer_exports(&self, codes: &[ErrorCode]) {
        self.lock().export_codes = codes.to_vec();
    }

    /// How many Rollback calls arrived.
    pub fn rollback_calls(&self) -> usize {
        self.calls()
            .iter()
            .filter(|c| matches!(c, Call::Rollback { .. }))
            .count()
    }

    /// Whether the node store still holds this snapshot.
    pub fn stored(&self, id: &str) -> bool {
        self.lock().store.contains_key(id)
    }

    /// Calls in flight now, on all sandboxes.
    pub fn in_flight(&self) -> usize {
        self.lock().in_flight.values().sum()
    }

    /// The node store loses a snapshot (e.g. the node's disk was wiped).
    pub fn lose(&self, id: &str) {
        self.lock().store.remove(id);
    }

    /// The next `n` DeleteSnapshot calls fail as if the node service were down.
    pub fn fail_deletes(&self, n: usize) {
        self.lock().failing_deletes = n;
    }

    /// When each DeleteSnapshot call arrived, in order.
    pub fn delete_times(&self) -> Vec<std::time::Instant> {
        self.lock().delete_times.clone()
    }

    /// Most operations that ran at once on one sandbox.
    pub fn max_in_flight(&self) -> usize {
        self.lock().max_in_flight
    }

    /// Snapshots wait (after they were recorded) until released.
    pub fn hold_snapshots(&self, hold: bool) {
        self.lock().hold = hold;
        self.wake.send_modify(|n| *n += 1);
    }

    /// The pod's sandbox goes away, failing calls in flight.
    pub fn kill_sandbox(&self, pod_uid: &str) {
        self.lock().killed.insert(format!("sb-{pod_uid}"));
        self.wake.send_modify(|n| *n += 1);
    }

    /// Every sandbox gets a network path, with the built-in default policy
    /// in force and zero counters until the test changes them.
    #[must_use]
    pub fn with_network_paths(self) -> Self {
        self.lock().network_paths = true;
        self
    }

    /// The pod's sandbox has a network path with `policy` in force (as if
    /// its shim had started it with that policy).
    pub fn set_policy_in_force(&self, pod_uid: &str, policy: EgressPolicy) {
        let mut st = self.lock();
        let sb = st.sandboxes.entry(format!("sb-{pod_uid}")).or_default();
        sb.network.get_or_insert_with(NetworkState::default).policy = policy;
    }

    /// The policy in force on the pod's network path, if it has one.
    pub fn policy_in_force(&self, pod_uid: &str) -> Option<EgressPolicy> {
        let st = self.lock();
        let sb = st.sandboxes.get(&format!("sb-{pod_uid}"))?;
        sb.network.as_ref().map(|n| n.policy.clone())
    }

    /// The pod's network path reports these counters from now on.
    pub fn set_counters(&self, pod_uid: &str, counters: Vec<NetworkCounter>) {
        let mut st = self.lock();
        let sb = st.sandboxes.entry(format!("sb-{pod_uid}")).or_default();
        sb.network
            .get_or_insert_with(NetworkState::default)
            .counters = counters;
    }

    /// The next `n` Snapshot calls are refused by the shim (after they were
    /// recorded); nothing is stored for them.
    pub fn fail_snapshots(&self, n: usize) {
        self.lock().failing_snapshots = n;
    }

    /// The next Snapshot calls answer `codes`, one each, as the shim does
    /// (twig-proto's `ErrorCode`); nothing is stored for them.
    pub fn answer_snapshots(&self, codes: &[ErrorCode]) {
        self.lock().snapshot_codes = codes.to_vec();
    }

    /// The next Rollback calls answer `codes`, one each, as the shim does;
    /// the pod's state is not changed by them.
    pub fn answer_rollbacks(&self, codes: &[ErrorCode]) {
        self.lock().rollback_codes = codes.to_vec();
    }

    /// The shim answers Snapshot without sizes from now on (as a shim that
    /// predates them); the node store still knows them.
    pub fn shim_without_sizes(&self) {
        self.lock().shim_without_sizes = true;
    }

    /// The next `n` GetStoreUsage calls fail as if the node service were down.
    pub fn fail_store_usage(&self, n: usize) {
        self.lock().failing_store_usage = n;
    }

    /// The next `n` SetEgressPolicy calls fail (after they were recorded).
    pub fn fail_set_policy(&self, n: usize) {
        self.lock().failing_sets = n;
    }

    /// The SetEgressPolicy calls on the pod's sandbox, in order.
    pub fn set_policy_calls(&self, pod_uid: &str) -> Vec<Option<EgressPolicy>> {
        let id = format!("sb-{pod_uid}");
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::SetEgressPolicy { sandbox, policy } if sandbox == id => Some(policy),
                _ => None,
            })
            .collect()
    }

    fn enter(&self, sandbox: &str) -> InFlight<'_> {
        let mut st = self.lock();
        let n = st.in_flight.entry(sandbox.to_string()).or_default();
        *n += 1;
        let n = *n;
        st.max_in_flight = st.max_in_flight.max(n);
        InFlight {
            node: self,
            sandbox: sandbox.to_string(),
        }
    }

    fn gone(&self, sandbox: &str) -> Option<ShimError> {
        self.lock()
            .killed
            .contains(sandbox)
            .then(|| ShimError::NotFound(format!("sandbox {sandbox} is gone")))
    }
}

#[async_trait]
impl SandboxLocator for FakeNode {
    async fn locate(&self, pod: &Pod) -> Result<Sandbox, LocateError> {
        let uid = pod.metadata.uid.clone().ok_or(LocateError::NoUid)?;
        let id = format!("sb-{uid}");
        if self.lock().killed.contains(&id) {
            return Err(LocateError::NotFound(uid));
        }
        Ok(Sandbox {
            id,
            address: "unix:///fake/shim.sock".to_string(),
        })
    }
}

#[async_trait]
impl TwigShim for FakeNode {
    async fn snapshot(
        &self,
        sandbox: &Sandbox,
        snapshot_id: &str,
        mode: SnapshotMode,
    ) -> Result<SnapshotInfo, ShimError> {
        if let Some(e) = self.gone(&sandbox.id) {
            return Err(e);
        }
        let _in_flight = self.enter(&sandbox.id);
        let info = {
            let mut st = self.lock();
            st.calls.push(Call::Snapshot {
                sandbox: sandbox.id.clone(),
                snapshot_id: snapshot_id.to_string(),
            });
            if st.failing_snapshots > 0 {
                st.failing_snapshots -= 1;
                return Err(ShimError::Refused(format!(
                    "snapshot {snapshot_id}: the guest did not pause"
                )));
            }
            if !st.snapshot_codes.is_empty() {
                let code = st.snapshot_codes.remove(0);
                return Err(answer(code, "Snapshot", snapshot_id));
            }
            let sb = st.sandboxes.entry(sandbox.id.clone()).or_default();
            let parent = match mode {
                SnapshotMode::Full => None,
                SnapshotMode::Incremental => sb.snapshots.last().map(|s| s.snapshot_id.clone()),
            };
            let memory_bytes = if parent.is_some() {
                PAGE_BYTES
            } else {
                FULL_MEMORY_BYTES
            };
            let info = SnapshotInfo {
                snapshot_id: snapshot_id.to_string(),
                written_bytes: memory_bytes,
                parent_id: parent,
                size_bytes: 128 << 20,
                memory_bytes,
                disk_bytes: DISK_BYTES,
                restore_bytes: RESTORE_BYTES,
            };
            // The shim finishes a snapshot even if its caller goes away.
            sb.snapshots.push(info.clone());
            st.store
                .insert(snapshot_id.to_string(), info.parent_id.clone());
            if st.shim_without_sizes {
                SnapshotInfo {
                    memory_bytes: 0,
                    disk_bytes: 0,
                    restore_bytes: 0,
                    ..info
                }
            } else {
                info
            }
        };
        let mut wake = self.wake.subscribe();
        loop {
            if let Some(e) = self.gone(&sandbox.id) {
                self.lock().store.remove(snapshot_id);
                return Err(e);
            }
            if !self.lock().hold {
                return Ok(info);
            }
            if wake.changed().await.is_err() {
                return Ok(info);
            }
        }
    }

    async fn rollback(
        &self,
        sandbox: &Sandbox,
        snapshot_id: &str,
        operation_id: &str,
    ) -> Result<(), ShimError> {
        if let Some(e) = self.gone(&sandbox.id) {
            return Err(e);
        }
        let _in_flight = self.enter(&sandbox.id);
        let mut st = self.lock();
        st.calls.push(Call::Rollback {
            sandbox: sandbox.id.clone(),
            snapshot_id: snapshot_id.to_string(),
            operation_id: operation_id.to_string(),
        });
        if !st.store.contains_key(snapshot_id) {
            return Err(ShimError::Refused(format!(
                "snapshot {snapshot_id} is not on this node"
            )));
        }
        if !st.rollback_codes.is_empty() {
            let code = st.rollback_codes.remove(0);
            return Err(answer(code, "Rollback", snapshot_id));
        }
        st.sandboxes
            .entry(sandbox.id.clone())
            .or_default()
            .last_rollback = Some(operation_id.to_string());
        Ok(())
    }

    async fn stats(&self, sandbox: &Sandbox) -> Result<SandboxStats, ShimError> {
        if let Some(e) = self.gone(&sandbox.id) {
            return Err(e);
        }
        let mut st = self.lock();
        st.calls.push(Call::Stats(sandbox.id.clone()));
        let network_paths = st.network_paths;
        let sb = st.sandboxes.entry(sandbox.id.clone()).or_default();
        if network_paths && sb.network.is_none() {
            sb.network = Some(NetworkState::default());
        }
        Ok(SandboxStats {
            snapshots: sb.snapshots.clone(),
            last_rollback_operation_id: sb.last_rollback.clone(),
            network: sb.network.as_ref().map(|n| NetworkStats {
                egress_policy: Some(n.policy.clone()),
                counters: n.counters.clone(),
            }),
        })
    }

    async fn set_egress_policy(
        &self,
        sandbox: &Sandbox,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), ShimError> {
        if let Some(e) = self.gone(&sandbox.id) {
            return Err(e);
        }
        let mut st = self.lock();
        st.calls.push(Call::SetEgressPolicy {
            sandbox: sandbox.id.clone(),
            policy: policy.cloned(),
        });
        if st.failing_sets > 0 {
            st.failing_sets -= 1;
            return Err(ShimError::Call {
                call: "SetEgressPolicy",
                message: "the policy maps could not be written".to_string(),
            });
        }
        let network = st
            .sandboxes
            .get_mut(&sandbox.id)
            .and_then(|sb| sb.network.as_mut())
            .ok_or_else(|| {
                ShimError::Refused(format!("sandbox {} has no network path", sandbox.id))
            })?;
        network.policy = policy.cloned().unwrap_or_default();
        Ok(())
    }
}

#[async_trait]
impl NodeService for FakeNode {
    async fn delete_snapshot(&self, snapshot_id: &str) -> Result<(), ShimError> {
        let mut st = self.lock();
        st.calls.push(Call::DeleteSnapshot(snapshot_id.to_string()));
        st.delete_times.push(std::time::Instant::now());
        if st.failing_deletes > 0 {
            st.failing_deletes -= 1;
            return Err(ShimError::Unavailable {
                address: "unix:///run/twig/node.sock".to_string(),
                message: "connection refused".to_string(),
            });
        }
        // As the node store does: a parent stays while a child's
        // incremental data in the store needs it.
        if let Some(child) = st
            .store
            .iter()
            .find(|(_, parent)| parent.as_deref() == Some(snapshot_id))
            .map(|(id, _)| id.clone())
        {
            return Err(ShimError::Refused(format!(
                "cannot delete VM snapshot {snapshot_id:?}: {child:?} is its child"
            )));
        }
        st.store.remove(snapshot_id);
        Ok(())
    }

    async fn get_snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotInfo>, ShimError> {
        let st = self.lock();
        if !st.store.contains_key(snapshot_id) {
            return Ok(None);
        }
        Ok(st
            .sandboxes
            .values()
            .flat_map(|sb| &sb.snapshots)
            .find(|s| s.snapshot_id == snapshot_id)
            .cloned())
    }

    async fn store_usage(&self) -> Result<StoreUsage, ShimError> {
        let mut st = self.lock();
        if st.failing_store_usage > 0 {
            st.failing_store_usage -= 1;
            return Err(ShimError::Unavailable {
                address: "unix:///run/twig/node.sock".to_string(),
                message: "connection refused".to_string(),
            });
        }
        let stored: Vec<&SnapshotInfo> = st
            .sandboxes
            .values()
            .flat_map(|sb| &sb.snapshots)
            .filter(|s| st.store.contains_key(&s.snapshot_id))
            .collect();
        let allocated_bytes = stored.iter().map(|s| s.memory_bytes + s.disk_bytes).sum();
        Ok(StoreUsage {
            allocated_bytes,
            capacity_bytes: STORE_CAPACITY_BYTES,
            free_bytes: STORE_CAPACITY_BYTES - allocated_bytes,
            snapshots: stored.len() as u64,
            templates: st.templates.len() as u64,
        })
    }

    async fn ensure_template(
        &self,
        key: &str,
        _spec: &SandboxTemplateSpec,
        build_in: BuildIn<'_>,
        artifact: Option<&str>,
    ) -> Result<TemplateState, ShimError> {
        let mut st = self.lock();
        st.calls.push(Call::EnsureTemplate(key.to_string()));
        // As twig-node does with another node's export: pulled, not built.
        if let Some(a) = artifact.filter(|_| !st.templates.contains(key)) {
            st.templates.insert(key.to_string());
            st.pulled_templates.push((key.to_string(), a.to_string()));
            return Ok(TemplateState {
                ready: true,
                message: Some(format!("{PULLED_FROM}{a}")),
                needs_build_pod: false,
                failed: false,
            });
        }
        let state = |ready, needs_build_pod, failed| TemplateState {
            ready,
            message: None,
            needs_build_pod,
            failed,
        };
        if st.templates.contains(key) {
            return Ok(state(true, false, false));
        }
        // As the node answers: built in the Pod given (at once, here), or
        // a Pod asked for.
        match build_in {
            BuildIn::NodePod => {}
            BuildIn::BuildPod(None) => return Ok(state(false, true, false)),
            BuildIn::BuildPod(Some(uid)) if st.spent_pods.contains(uid) => {
                return Ok(state(false, false, true));
            }
            BuildIn::BuildPod(Some(uid)) => {
                st.build_pods
                    .entry(key.to_string())
                    .or_default()
                    .push(uid.to_string());
                if st.failing_builds > 0 {
                    st.failing_builds -= 1;
                    st.spent_pods.insert(uid.to_string());
                    return Ok(state(false, false, true));
                }
            }
        }
        st.templates.insert(key.to_string());
        Ok(state(true, false, false))
    }

    async fn delete_template(&self, key: &str) -> Result<(), ShimError> {
        let mut st = self.lock();
        st.calls.push(Call::DeleteTemplate(key.to_string()));
        st.templates.remove(key);
        Ok(())
    }

    async fn export_snapshot(
        &self,
        snapshot_id: &str,
        reference: &str,
        namespace: &str,
    ) -> Result<Exported, ShimError> {
        let mut st = self.lock();
        st.calls.push(Call::ExportSnapshot {
            snapshot_id: snapshot_id.to_string(),
            reference: reference.to_string(),
            namespace: namespace.to_string(),
        });
        if !st.export_codes.is_empty() {
            let code = st.export_codes.remove(0);
            return Err(answer(code, "ExportSnapshot", snapshot_id));
        }
        // A template's id is `template.<namespace>.<name>`.
        let template = snapshot_id
            .strip_prefix("template.")
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(ns, name)| st.templates.contains(&format!("{ns}/{name}")));
        if !st.store.contains_key(snapshot_id) && !template {
            return Err(answer(ErrorCode::NotFound, "ExportSnapshot", snapshot_id));
        }
        let bytes_uploaded = st
            .sandboxes
            .values()
            .flat_map(|sb| &sb.snapshots)
            .find(|s| s.snapshot_id == snapshot_id)
            .map_or(0, |s| s.memory_bytes + s.disk_bytes);
        Ok(Exported {
            digest: export_digest(snapshot_id),
            bytes_uploaded,
            snapshots_pushed: 1,
            snapshots_present: 0,
        })
    }
}

/// The manifest digest the fake gives the export of `snapshot_id`
/// (`sha256:` and 64 hex digits, stable).
pub fn export_digest(snapshot_id: &str) -> String {
    let hex: String = (0..4u64)
        .map(|i| {
            let h = snapshot_id
                .bytes()
                .fold(0xcbf2_9ce4_8422_2325_u64 ^ i, |h, b| {
                    (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
                });
            format!("{h:016x}")
        })
        .collect();
    format!("sha256:{hex}")
}

/// The error the controller's ttrpc client makes of the shim answering
/// `code` to `call` of `snapshot_id`.
fn answer(code: ErrorCode, call: &'static str, snapshot_id: &str) -> ShimError {
    let message = format!("{call} of snapshot {snapshot_id} answered {code:?} by the fake");
    ShimError::from_code(code, call, "unix:///fake/shim.sock", message)
}

/// Shares one fake as all three traits.
pub fn as_traits(
    fake: &Arc<FakeNode>,
) -> (
    Arc<dyn SandboxLocator>,
    Arc<dyn TwigShim>,
    Arc<dyn NodeService>,
) {
    (fake.clone(), fake.clone(), fake.clone())
}
