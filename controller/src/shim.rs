//! The node-local services the controller acts through: the shim's `twig`
//! ttrpc service (one per pod sandbox) and the node service (one per node),
//! both defined in twig-proto's `twig.proto`. Reconcilers see them only
//! through the [`TwigShim`] and [`NodeService`] traits, so tests can put fakes
//! behind them.

use std::time::Duration;

use async_trait::async_trait;

use twig_net::EgressPolicy;
/// twig-proto's error contract of the `Twig` and `Node` services.
pub use twig_proto::contract::ErrorCode;

use crate::crd::{SandboxTemplateSpec, SnapshotMode};

use twig_proto::{twig as pb, twig_ttrpc as rpc};

/// A pod sandbox on this node and the address of the shim that runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sandbox {
    /// containerd's sandbox ID.
    pub id: String,
    /// ttrpc address of the sandbox's shim, e.g. `unix:///run/containerd/s/…`.
    pub address: String,
}

/// A snapshot as the shim reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// The node-store id of the snapshot.
    pub snapshot_id: String,
    /// Its parent's id, for an incremental snapshot.
    pub parent_id: Option<String>,
    /// Bytes the snapshot holds (memory, state and disks).
    pub size_bytes: u64,
    /// Bytes written to take it.
    pub written_bytes: u64,
    /// Allocated bytes of its guest memory (an incremental snapshot's own
    /// layer); 0 from a shim or node that predates the field.
    pub memory_bytes: u64,
    /// Allocated bytes of its disks; 0 from a shim or node that predates the field.
    pub disk_bytes: u64,
    /// What a restore of it maps: guest RAM plus the disks' logical sizes;
    /// 0 from a shim or node that predates the field.
    pub restore_bytes: u64,
}

/// The node store's footprint and room, as the node daemon reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreUsage {
    /// Allocated bytes of every file under the store's root.
    pub allocated_bytes: u64,
    /// Size of the store's filesystem.
    pub capacity_bytes: u64,
    /// Bytes still available on that filesystem.
    pub free_bytes: u64,
    /// Published snapshots that are not templates.
    pub snapshots: u64,
    /// Published templates.
    pub templates: u64,
}

/// What the shim knows about a sandbox.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SandboxStats {
    /// The snapshots taken of the sandbox.
    pub snapshots: Vec<SnapshotInfo>,
    /// The operation id of the last rollback done, so a restarted
    /// controller knows whether its rollback happened.
    pub last_rollback_operation_id: Option<String>,
    /// The pod's network path; `None` for a pod without one.
    pub network: Option<NetworkStats>,
}

/// A pod's network path as the shim reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetworkStats {
    /// The egress policy in force; `None` when the shim's JSON could not be
    /// read as twig-net's `EgressPolicy` (then it is unknown, and differs
    /// from any policy the controller wants).
    pub egress_policy: Option<EgressPolicy>,
    /// One counter per reason, in the shim's order.
    pub counters: Vec<NetworkCounter>,
}

/// Packets and bytes of one counter of a pod's network path.
///
/// The reason stays the shim's label (twig-net's `Reason::label`: `egress`,
/// `deny_rule`, `spoofed_ip`, …) rather than a parsed `Reason`, so a reason
/// added to the data path is exported without a controller release.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetworkCounter {
    /// Why frames were counted here.
    pub reason: String,
    /// Whether they were dropped.
    pub dropped: bool,
    /// Frames.
    pub packets: u64,
    /// Bytes of those frames.
    pub bytes: u64,
}

/// Where a template is built when the node lacks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuildIn<'a> {
    /// A pod the node daemon runs itself through CRI: only for a node no
    /// kubelet manages (kubelet stops sandboxes it did not make).
    NodePod,
    /// The build Pod of this UID, which kubelet runs (`None`: there is none
    /// yet; the node says when one is needed). What the controller uses.
    BuildPod(Option<&'a str>),
}

/// How twig-node's EnsureTemplate answer starts when it pulled the
/// template instead of building it (followed by the artifact).
pub const PULLED_FROM: &str = "pulled from ";

/// A template's state on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateState {
    /// Whether the template can be restored from on this node.
    pub ready: bool,
    /// Why not, or what is happening.
    pub message: Option<String>,
    /// A build should start: the controller makes a build Pod.
    pub needs_build_pod: bool,
    /// The last build failed; a build Pod it ran in is spent.
    pub failed: bool,
}

/// Failure of a call to a node-local service: one variant per meaning of
/// twig-proto's error contract ([`ErrorCode`]), so each becomes its own
/// condition reason.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    /// The service could not be reached (socket missing, connection
    /// refused), or answered `UNAVAILABLE` or `DEADLINE_EXCEEDED`: nothing
    /// is known to be done; the call is retried (Snapshot and Rollback are
    /// idempotent on their ids).
    #[error("cannot reach {address}: {message}")]
    Unavailable {
        /// The service's address.
        address: String,
        /// Why it could not be reached.
        message: String,
    },
    /// `NOT_FOUND`: the service does not know the sandbox, snapshot or method.
    #[error("not found: {0}")]
    NotFound(String),
    /// `FAILED_PRECONDITION`: the pod or snapshot is not in a state for the
    /// call (e.g. a rollback target taken with other containers).
    #[error("refused: {0}")]
    Refused(String),
    /// `INVALID_ARGUMENT`: the request is malformed.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// `ALREADY_EXISTS`: the id is taken by something else.
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// `PERMISSION_DENIED`: the snapshot belongs to another namespace.
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// `RESOURCE_EXHAUSTED`: the node store's filesystem is full.
    #[error("node store full: {0}")]
    NoSpace(String),
    /// `ABORTED`: refused with nothing changed; the pod runs on, on its
    /// state from before the call.
    #[error("aborted: {0}")]
    Aborted(String),
    /// `DATA_LOSS`: the pod's VM is lost; every task of the pod exited.
    #[error("pod lost: {0}")]
    Lost(String),
    /// `UNIMPLEMENTED`: the service does not serve the method.
    #[error("unimplemented: {0}")]
    Unimplemented(String),
    /// `INTERNAL` (or any code outside the contract), or a transport failure.
    #[error("{call} failed: {message}")]
    Call {
        /// The method called.
        call: &'static str,
        /// What the service or transport said.
        message: String,
    },
}

impl ShimError {
    /// The error for an answer of `code` with `message` from the service
    /// at `address`, method `call`.
    pub fn from_code(
        code: ErrorCode,
        call: &'static str,
        address: &str,
        message: String,
    ) -> ShimError {
        match code {
            ErrorCode::Unavailable | ErrorCode::DeadlineExceeded => ShimError::Unavailable {
                address: address.to_string(),
                message,
            },
            ErrorCode::NotFound => ShimError::NotFound(message),
            ErrorCode::FailedPrecondition => ShimError::Refused(message),
            ErrorCode::InvalidArgument => ShimError::Invalid(message),
            ErrorCode::AlreadyExists => ShimError::AlreadyExists(message),
            ErrorCode::PermissionDenied => ShimError::Forbidden(message),
            ErrorCode::ResourceExhausted => ShimError::NoSpace(message),
            ErrorCode::Aborted => ShimError::Aborted(message),
            ErrorCode::DataLoss => ShimError::Lost(message),
            ErrorCode::Unimplemented => ShimError::Unimplemented(message),
            ErrorCode::Internal => ShimError::Call { call, message },
        }
    }
}

/// The shim's `twig.v1.Twig` service.
#[async_trait]
pub trait TwigShim: Send + Sync {
    /// Snapshots the sandbox under `snapshot_id` (idempotent on the ID).
    async fn snapshot(
        &self,
        sandbox: &Sandbox,
        snapshot_id: &str,
        mode: SnapshotMode,
    ) -> Result<SnapshotInfo, ShimError>;
    /// Rolls the sandbox back to `snapshot_id` (idempotent on `operation_id`).
    async fn rollback(
        &self,
        sandbox: &Sandbox,
        snapshot_id: &str,
        operation_id: &str,
    ) -> Result<(), ShimError>;
    /// Lists the sandbox's snapshots, its last rollback and its network path.
    async fn stats(&self, sandbox: &Sandbox) -> Result<SandboxStats, ShimError>;
    /// Replaces the egress policy on the running pod's network path
    /// (`None`: the built-in default). [`ShimError::Refused`] for a pod
    /// without a network path or a policy the shim refuses.
    async fn set_egress_policy(
        &self,
        sandbox: &Sandbox,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), ShimError>;
}

/// The node's `twig.v1.Node` service (node store and templates).
#[async_trait]
pub trait NodeService: Send + Sync {
    /// Removes a snapshot's data; succeeds when it is already gone.
    async fn delete_snapshot(&self, snapshot_id: &str) -> Result<(), ShimError>;
    /// The snapshot with its sizes, if the node store still holds it.
    async fn get_snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotInfo>, ShimError>;
    /// Finds the template `key` (`namespace/name`) on this node, or builds
    /// it as `build_in` says.
    /// `artifact`: where another node's build was exported; a node lacking
    /// the template pulls it from there instead of building it when it was
    /// built from the same inputs (the answer's message then starts with
    /// [`PULLED_FROM`] and the artifact).
    async fn ensure_template(
        &self,
        key: &str,
        spec: &SandboxTemplateSpec,
        build_in: BuildIn<'_>,
        artifact: Option<&str>,
    ) -> Result<TemplateState, ShimError>;
    /// Removes the template `key` from this node; succeeds when it is already gone.
    async fn delete_template(&self, key: &str) -> Result<(), ShimError>;
    /// The node store's footprint, its filesystem's room and its counts.
    async fn store_usage(&self) -> Result<StoreUsage, ShimError>;
    /// Deletes the node store's snapshots nothing refers to: not in
    /// `referenced` (every id the cluster's objects name, complete), not
    /// published within `grace`, and none of the node's own roots (see
    /// twig-node's README, *Garbage collection*).
    async fn collect_garbage(
        &self,
        referenced: Vec<String>,
        grace: Duration,
    ) -> Result<Collected, ShimError> {
        let _ = (referenced, grace);
        Err(ShimError::Unimplemented("CollectGarbage".to_string()))
    }
    /// Marks a snapshot whose object was deleted with `deletionPolicy:
    /// Retain`, so the garbage collector keeps it; succeeds when it is gone.
    async fn retain_snapshot(&self, snapshot_id: &str) -> Result<(), ShimError> {
        let _ = snapshot_id;
        Err(ShimError::Unimplemented("RetainSnapshot".to_string()))
    }
    /// Pushes snapshot `snapshot_id` of `namespace` (and the parents the
    /// registry lacks) to `reference` (`registry/<prefix>/<namespace>/<name>:<tag>`).
    /// `Unavailable`: the registry could not be reached (retry);
    /// `Forbidden`: the registry or the node refused.
    async fn export_snapshot(
        &self,
        snapshot_id: &str,
        reference: &str,
        namespace: &str,
    ) -> Result<Exported, ShimError> {
        let _ = (snapshot_id, reference, namespace);
        Err(ShimError::Unimplemented("ExportSnapshot".to_string()))
    }
}

/// What one export pushed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exported {
    /// The snapshot's manifest digest (`sha256:…`).
    pub digest: String,
    /// Bytes uploaded (what the registry already had is not).
    pub bytes_uploaded: u64,
    /// Snapshots of the chain pushed.
    pub snapshots_pushed: u32,
    /// Snapshots of the chain the registry already had.
    pub snapshots_present: u32,
}

/// Shortest deadline of an export: a push of a large snapshot takes longer
/// than the other calls (a retry after a deadline skips what was uploaded).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(1800);

/// What one garbage collection of the node store deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Collected {
    /// The snapshots deleted, children before parents.
    pub deleted: Vec<String>,
    /// Allocated bytes of their files.
    pub reclaimed_bytes: u64,
}

fn map_error(call: &'static str, address: &str, err: ttrpc::Error) -> ShimError {
    match err {
        ttrpc::Error::RpcStatus(status) => {
            let code = ErrorCode::of_status(&status).unwrap_or(ErrorCode::Internal);
            ShimError::from_code(code, call, address, status.message)
        }
        ttrpc::Error::Socket(message) => ShimError::Unavailable {
            address: address.to_string(),
            message,
        },
        other => ShimError::Call {
            call,
            message: other.to_string(),
        },
    }
}

fn timeout_nanos(timeout: Duration) -> i64 {
    i64::try_from(timeout.as_nanos()).unwrap_or(i64::MAX)
}

async fn connect(address: &str) -> Result<ttrpc::asynchronous::Client, ShimError> {
    ttrpc::asynchronous::Client::connect(address)
        .await
        .map_err(|e| ShimError::Unavailable {
            address: address.to_string(),
            message: e.to_string(),
        })
}

/// `policy` as the JSON the services take; `None` (the built-in default) is empty.
fn policy_json(call: &'static str, policy: Option<&EgressPolicy>) -> Result<String, ShimError> {
    policy.map_or(Ok(String::new()), |p| {
        serde_json::to_string(p).map_err(|e| ShimError::Call {
            call,
            message: format!("encoding the egress policy: {e}"),
        })
    })
}

fn network_stats(sandbox: &Sandbox, network: &pb::PodNetworkStats) -> NetworkStats {
    let egress_policy = match serde_json::from_str::<EgressPolicy>(&network.egress_policy) {
        Ok(policy) => Some(policy),
        Err(e) => {
            tracing::warn!(sandbox = %sandbox.id, error = %e, "the shim's egress policy in force is unreadable");
            None
        }
    };
    NetworkStats {
        egress_policy,
        counters: network
            .counters
            .iter()
            .map(|c| NetworkCounter {
                reason: c.reason.clone(),
                dropped: c.dropped,
                packets: c.packets,
                bytes: c.bytes,
            })
            .collect(),
    }
}

fn snapshot_info(info: &pb::SnapshotInfo) -> SnapshotInfo {
    SnapshotInfo {
        snapshot_id: info.snapshot_id.clone(),
        parent_id: (!info.parent_id.is_empty()).then(|| info.parent_id.clone()),
        size_bytes: info.size_bytes,
        written_bytes: info.written_bytes,
        memory_bytes: info.memory_bytes,
        disk_bytes: info.disk_bytes,
        restore_bytes: info.restore_bytes,
    }
}

/// [`TwigShim`] over ttrpc on the shim's Unix socket.
#[derive(Clone, Debug)]
pub struct TtrpcShim {
    /// Deadline of one call; snapshots of large guests take seconds.
    pub timeout: Duration,
}

#[async_trait]
impl TwigShim for TtrpcShim {
    async fn snapshot(
        &self,
        sandbox: &Sandbox,
        snapshot_id: &str,
        mode: SnapshotMode,
    ) -> Result<SnapshotInfo, ShimError> {
        let client = rpc::TwigClient::new(connect(&sandbox.address).await?);
        let req = pb::SnapshotRequest {
            sandbox_id: sandbox.id.clone(),
            snapshot_id: snapshot_id.to_string(),
            full: mode == SnapshotMode::Full,
            ..Default::default()
        };
        let resp = client
            .snapshot(
                ttrpc::context::with_timeout(timeout_nanos(self.timeout)),
                &req,
            )
            .await
            .map_err(|e| map_error("Snapshot", &sandbox.address, e))?;
        resp.snapshot
            .as_ref()
            .map(snapshot_info)
            .ok_or(ShimError::Call {
                call: "Snapshot",
                message: "response carries no snapshot".to_string(),
            })
    }

    async fn rollback(
        &self,
        sandbox: &Sandbox,
        snapshot_id: &str,
        operation_id: &str,
    ) -> Result<(), ShimError> {
        let client = rpc::TwigClient::new(connect(&sandbox.address).await?);
        let req = pb::RollbackRequest {
            sandbox_id: sandbox.id.clone(),
            snapshot_id: snapshot_id.to_string(),
            operation_id: operation_id.to_string(),
            ..Default::default()
        };
        client
            .rollback(
                ttrpc::context::with_timeout(timeout_nanos(self.timeout)),
                &req,
            )
            .await
            .map_err(|e| map_error("Rollback", &sandbox.address, e))?;
        Ok(())
    }

    async fn stats(&self, sandbox: &Sandbox) -> Result<SandboxStats, ShimError> {
        let client = rpc::TwigClient::new(connect(&sandbox.address).await?);
        let req = pb::StatsRequest {
            sandbox_id: sandbox.id.clone(),
            ..Default::default()
        };
        let resp = client
            .stats(
                ttrpc::context::with_timeout(timeout_nanos(self.timeout)),
                &req,
            )
            .await
            .map_err(|e| map_error("Stats", &sandbox.address, e))?;
        Ok(SandboxStats {
            snapshots: resp.snapshots.iter().map(snapshot_info).collect(),
            last_rollback_operation_id: (!resp.last_rollback_operation_id.is_empty())
                .then(|| resp.last_rollback_operation_id.clone()),
            network: resp.network.as_ref().map(|n| network_stats(sandbox, n)),
        })
    }

    async fn set_egress_policy(
        &self,
        sandbox: &Sandbox,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), ShimError> {
        let req = pb::SetEgressPolicyRequest {
            sandbox_id: sandbox.id.clone(),
            egress_policy: policy_json("SetEgressPolicy", policy)?,
            ..Default::default()
        };
        let client = rpc::TwigClient::new(connect(&sandbox.address).await?);
        client
            .set_egress_policy(
                ttrpc::context::with_timeout(timeout_nanos(self.timeout)),
                &req,
            )
            .await
            .map_err(|e| map_error("SetEgressPolicy", &sandbox.address, e))?;
        Ok(())
    }
}

/// [`NodeService`] over ttrpc on the node daemon's Unix socket.
#[derive(Clone, Debug)]
pub struct TtrpcNode {
    /// ttrpc address, e.g. `unix:///run/twig/node.sock`.
    pub address: String,
    /// Deadline of one call; building a template boots a VM.
    pub timeout: Duration,
}

impl TtrpcNode {
    async fn client(&self) -> Result<rpc::NodeClient, ShimError> {
        Ok(rpc::NodeClient::new(connect(&self.address).await?))
    }

    fn ctx(&self) -> ttrpc::context::Context {
        ttrpc::context::with_timeout(timeout_nanos(self.timeout))
    }
}

#[async_trait]
impl NodeService for TtrpcNode {
    async fn delete_snapshot(&self, snapshot_id: &str) -> Result<(), ShimError> {
        let req = pb::DeleteSnapshotRequest {
            snapshot_id: snapshot_id.to_string(),
            ..Default::default()
        };
        self.client()
            .await?
            .delete_snapshot(self.ctx(), &req)
            .await
            .map_err(|e| map_error("DeleteSnapshot", &self.address, e))?;
        Ok(())
    }

    async fn get_snapshot(&self, snapshot_id: &str) -> Result<Option<SnapshotInfo>, ShimError> {
        let req = pb::GetSnapshotRequest {
            snapshot_id: snapshot_id.to_string(),
            ..Default::default()
        };
        let resp = self
            .client()
            .await?
            .get_snapshot(self.ctx(), &req)
            .await
            .map_err(|e| map_error("GetSnapshot", &self.address, e))?;
        if !resp.found {
            return Ok(None);
        }
        let info = resp.snapshot.as_ref().ok_or(ShimError::Call {
            call: "GetSnapshot",
            message: "a found snapshot without its info".to_string(),
        })?;
        Ok(Some(snapshot_info(info)))
    }

    async fn ensure_template(
        &self,
        key: &str,
        spec: &SandboxTemplateSpec,
        build_in: BuildIn<'_>,
        artifact: Option<&str>,
    ) -> Result<TemplateState, ShimError> {
        let req = pb::EnsureTemplateRequest {
            artifact: artifact.unwrap_or_default().to_string(),
            name: key.to_string(),
            image: spec.image.clone(),
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            command: spec.command.clone().unwrap_or_default(),
            warmup: spec.warmup.clone().unwrap_or_default(),
            egress_policy: policy_json("EnsureTemplate", spec.egress_policy.as_ref())?,
            build_pod: match build_in {
                BuildIn::NodePod => None,
                BuildIn::BuildPod(uid) => Some(pb::BuildPod {
                    uid: uid.unwrap_or_default().to_string(),
                    ..Default::default()
                }),
            }
            .into(),
            ..Default::default()
        };
        let resp = self
            .client()
            .await?
            .ensure_template(self.ctx(), &req)
            .await
            .map_err(|e| map_error("EnsureTemplate", &self.address, e))?;
        Ok(TemplateState {
            ready: resp.ready,
            message: (!resp.message.is_empty()).then(|| resp.message.clone()),
            needs_build_pod: resp.needs_build_pod,
            failed: resp.failed,
        })
    }

    async fn delete_template(&self, key: &str) -> Result<(), ShimError> {
        let req = pb::DeleteTemplateRequest {
            name: key.to_string(),
            ..Default::default()
        };
        self.client()
            .await?
            .delete_template(self.ctx(), &req)
            .await
            .map_err(|e| map_error("DeleteTemplate", &self.address, e))?;
        Ok(())
    }

    async fn store_usage(&self) -> Result<StoreUsage, ShimError> {
        let resp = self
            .client()
            .await?
            .get_store_usage(self.ctx(), &pb::GetStoreUsageRequest::default())
            .await
            .map_err(|e| map_error("GetStoreUsage", &self.address, e))?;
        Ok(StoreUsage {
            allocated_bytes: resp.allocated_bytes,
            capacity_bytes: resp.capacity_bytes,
            free_bytes: resp.free_bytes,
            snapshots: resp.snapshots,
            templates: resp.templates,
        })
    }

    async fn collect_garbage(
        &self,
        referenced: Vec<String>,
        grace: Duration,
    ) -> Result<Collected, ShimError> {
        let req = pb::CollectGarbageRequest {
            referenced,
            grace_seconds: grace.as_secs(),
            ..Default::default()
        };
        let resp = self
            .client()
            .await?
            .collect_garbage(self.ctx(), &req)
            .await
            .map_err(|e| map_error("CollectGarbage", &self.address, e))?;
        Ok(Collected {
            deleted: resp.deleted,
            reclaimed_bytes: resp.reclaimed_bytes,
        })
    }

    async fn retain_snapshot(&self, snapshot_id: &str) -> Result<(), ShimError> {
        let req = pb::RetainSnapshotRequest {
            snapshot_id: snapshot_id.to_string(),
            ..Default::default()
        };
        self.client()
            .await?
            .retain_snapshot(self.ctx(), &req)
            .await
            .map_err(|e| map_error("RetainSnapshot", &self.address, e))?;
        Ok(())
    }

    async fn export_snapshot(
        &self,
        snapshot_id: &str,
        reference: &str,
        namespace: &str,
    ) -> Result<Exported, ShimError> {
        let req = pb::ExportSnapshotRequest {
            snapshot_id: snapshot_id.to_string(),
            reference: reference.to_string(),
            namespace: namespace.to_string(),
            ..Default::default()
        };
        let ctx = ttrpc::context::with_timeout(timeout_nanos(self.timeout.max(EXPORT_TIMEOUT)));
        let resp = self
            .client()
            .await?
            .export_snapshot(ctx, &req)
            .await
            .map_err(|e| map_error("ExportSnapshot", &self.address, e))?;
        if resp.digest.is_empty() {
            return Err(ShimError::Call {
                call: "ExportSnapshot",
                message: "an export answered without a digest".to_string(),
            });
        }
        Ok(Exported {
            digest: resp.digest,
            bytes_uploaded: resp.bytes_uploaded,
            snapshots_pushed: resp.snapshots_pushed,
            snapshots_present: resp.snapshots_present,
        })
    }
}
