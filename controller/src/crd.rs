//! The `twig.dev/v1alpha1` custom resources. The CRD YAML under `crds/` is
//! generated from these types (`twig-controller crds --out crds`).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use serde::{Deserialize, Serialize};
use twig_net::EgressPolicy;

/// API group of every Twig resource.
pub const GROUP: &str = "twig.dev";
/// Pod annotation holding the pod's own egress policy (JSON
/// `twig_net::EgressPolicy`); it narrows its template's `spec.egressPolicy`
/// (twig-proto's contract).
pub use twig_proto::contract::EGRESS_POLICY_ANNOTATION;
/// Pod annotation, besides `twig.dev/restore-from`, naming the OCI artifact
/// of an exported snapshot (`registry/repository@sha256:…`): a node whose
/// store lacks the snapshot pulls it from there (twig-proto's contract).
pub use twig_proto::contract::RESTORE_ARTIFACT_ANNOTATION;
/// Pod annotations turning the sandbox API (envd) on and naming the access
/// token it requires (twig-proto's contract): a Clone's pods keep their
/// source's.
pub use twig_proto::contract::{ENVD_ANNOTATION, ENVD_ON, ENVD_TOKEN_SHA256_ANNOTATION};
/// Pod annotation asking for a VM without network (twig-proto's contract):
/// a Clone's pods keep their source's.
pub use twig_proto::contract::{NETWORK_ANNOTATION, NETWORK_NONE};
/// Pod annotations naming the snapshot (its node-store ID) a pod is
/// restored from, and the SandboxTemplate a pod starts from: twig-proto's
/// contract, shared with the shim.
pub use twig_proto::contract::{RESTORE_FROM_ANNOTATION, TEMPLATE_ANNOTATION};
/// Label on every pod a Clone creates, valued with the Clone's name.
pub const CLONE_LABEL: &str = "twig.dev/clone";
/// The RuntimeClass (and containerd handler) of Twig pods.
pub const RUNTIME_CLASS: &str = "twig";
/// Label on the safety Snapshot a Rollback takes, valued with the Rollback's name.
pub const SAFETY_FOR_LABEL: &str = "twig.dev/safety-for";
/// Annotation on the safety Snapshot a Rollback takes, valued with the Rollback's UID.
pub const SAFETY_FOR_UID_ANNOTATION: &str = "twig.dev/safety-for-uid";
/// Most pods one Clone may create (`spec.replicas`); the CRD schema says the same.
pub const MAX_REPLICAS: i32 = 1000;

/// What went wrong with a Snapshot, Clone or Rollback, and when (as in
/// VolumeSnapshot's `status.error`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OperationError {
    /// What failed, with the reason first (`PodNotFound: pod redis not found`).
    pub message: String,
    /// When the failure was recorded.
    pub time: Time,
}

/// Lifecycle phase shared by Snapshot, Clone and Rollback.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum Phase {
    /// Accepted, no work started.
    #[default]
    Pending,
    /// The node is working on it.
    InProgress,
    /// Done.
    Ready,
    /// Will not complete; `message` says why.
    Failed,
    /// (Snapshot) its node-side data is gone.
    Lost,
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// How much of the guest a snapshot writes.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum SnapshotMode {
    /// Only the pages dirtied since the pod's previous snapshot; the disk is reflinked.
    #[default]
    Incremental,
    /// All of guest memory.
    Full,
}

/// What happens to the node-side data when the Snapshot object is deleted.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum DeletionPolicy {
    /// Remove the snapshot's data from the node store.
    #[default]
    Delete,
    /// Keep the data on the node.
    Retain,
}

/// Which pod to snapshot, how, and what happens to the data afterwards.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "twig.dev",
    version = "v1alpha1",
    kind = "Snapshot",
    doc = "A point-in-time copy of a running Twig pod (memory, processes and disk), held on its node.",
    namespaced,
    status = "SnapshotStatus",
    shortname = "tsnap",
    category = "twig",
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".spec.podName"}"#,
    printcolumn = r#"{"name":"Ready","type":"boolean","jsonPath":".status.readyToUse"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".status.nodeName"}"#,
    printcolumn = r#"{"name":"Size","type":"integer","jsonPath":".status.sizeBytes"}"#,
    printcolumn = r#"{"name":"Parent","type":"string","jsonPath":".status.parentSnapshotName"}"#,
    printcolumn = r#"{"name":"Written","type":"integer","jsonPath":".status.writtenBytes","priority":1}"#,
    printcolumn = r#"{"name":"Availability","type":"string","jsonPath":".status.availability","priority":1}"#,
    printcolumn(
        name = "Duration(ms)",
        type_ = "integer",
        json_path = ".status.durationMs"
    ),
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("self.podName == oldSelf.podName && self.mode == oldSelf.mode && has(self.podUid) == has(oldSelf.podUid) && (!has(self.podUid) || self.podUid == oldSelf.podUid)").message("podName, podUid and mode are immutable"))]
#[x_kube(validation = Rule::new("!has(oldSelf.export) || !oldSelf.export || (has(self.export) && self.export)").message("export may be turned on, not off: the artifact stays in the registry"))]
#[serde(rename_all = "camelCase")]
pub struct SnapshotSpec {
    /// The running Twig pod to snapshot, in the Snapshot's namespace.
    #[schemars(length(min = 1, max = 253))]
    pub pod_name: String,
    /// The UID the pod must have; a pod recreated under the same name is
    /// refused (`PodReplaced`). Without it, the controller pins the UID it
    /// first sees in `status.podUid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub pod_uid: Option<String>,
    /// Incremental (default) writes only pages dirtied since the pod's last snapshot.
    #[serde(default)]
    pub mode: SnapshotMode,
    /// Delete (default) removes the node-side data with the object; Retain keeps it.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
    /// Delete the Snapshot this many seconds after it became Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_ready: Option<i64>,
    /// Fail the Snapshot (`DeadlineExceeded`) if it is not Ready this many
    /// seconds after its creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub failure_deadline_seconds: Option<i64>,
    /// Push the snapshot (and the parents the registry lacks) to the
    /// cluster's OCI registry once Ready, as
    /// `<registry>/<prefix>/<namespace>/<name>:<uid>` (condition `Exported`,
    /// `status.artifact`), so that Clones of it run on any node. May be
    /// turned on later, not off. Default false: the snapshot stays on its node.
    #[serde(default)]
    pub export: bool,
}

/// Where a Ready snapshot can be restored from.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum Availability {
    /// Only its node's store: Clones run on that node, and the snapshot is
    /// lost with it.
    Node,
    /// Its node's store and the registry (`status.artifact`): Clones run on
    /// any node, each pulling what it lacks.
    NodeAndRegistry,
    /// Only the registry: its node's copy is gone. Clones still run on any
    /// node; a Rollback to it needs the node's copy and fails.
    Registry,
}

/// The OCI artifact a Snapshot was exported as.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotArtifact {
    /// `<registry>/<prefix>/<namespace>/<name>@<digest>`: what a Clone's
    /// pods pull (their `twig.dev/restore-artifact`).
    pub reference: String,
    /// The artifact's manifest digest (`sha256:…`).
    pub digest: String,
    /// Bytes the export uploaded (blobs the registry already had are not
    /// uploaded again: a snapshot incremental on an exported one uploads
    /// only its own pages and disk extents).
    pub bytes_uploaded: u64,
}

/// Observed state of a Snapshot.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: Phase,
    /// True while the snapshot is Ready: pods can be rolled back to it and cloned from it.
    #[serde(default)]
    pub ready_to_use: bool,
    /// Node whose store holds the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// UID of the pod the snapshot was taken of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// ID of the snapshot in the node store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "snapshotID")]
    pub snapshot_id: Option<String>,
    /// Node-store ID of the snapshot this one is incremental on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Name of the Snapshot object (same namespace) whose node-store ID is
    /// `parent`, when one exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_snapshot_name: Option<String>,
    /// Size of the snapshot in the node store, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// Bytes written by this snapshot (less than the size when incremental).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_bytes: Option<u64>,
    /// Bytes of guest memory the snapshot holds on disk (its memory file's
    /// allocated blocks: all of RAM ever written for a full snapshot, the
    /// pages changed since its parent for an incremental one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    /// Bytes of container disks the snapshot holds on disk (allocated
    /// blocks; blocks shared by reflink with its parent count too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// What a pod restored from the snapshot gets, like a VolumeSnapshot's
    /// `restoreSize`: its guest RAM plus its disks' full sizes, as a
    /// quantity of bytes (e.g. `1280Mi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_size: Option<Quantity>,
    /// Time from start to Ready, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// When the node started the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When the snapshot became Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_time: Option<Time>,
    /// `Ready`, `Progressing` and `Failure`, each with a reason; `Exported`
    /// with `spec.export` (True once in the registry; False with
    /// `RegistryUnavailable`, retried, `PermissionDenied`, `ExportFailed`
    /// or `NoRegistry`, while the snapshot stays Ready on its node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Why the snapshot is in its phase (failures, loss).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The failure, with its time (set when Failed or Lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<OperationError>,
    /// Where the Ready snapshot can be restored from: `Node` (only its
    /// node's store), `NodeAndRegistry` (exported), `Registry` (exported,
    /// its node's copy gone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub availability: Option<Availability>,
    /// The OCI artifact the snapshot was exported as (`spec.export`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<SnapshotArtifact>,
    /// The pod as it was when the snapshot was taken: what a Clone of the
    /// snapshot copies, so that clones outlive their source pod (a sandbox
    /// paused by deleting its pod is resumed from it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_pod: Option<SourcePod>,
}

/// What a snapshot keeps of its source pod for the pods cloned from it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SourcePod {
    /// The pod's spec (a `PodSpec`).
    #[schemars(schema_with = "any_object")]
    pub spec: serde_json::Value,
    /// The pod's Twig annotations a clone keeps: its egress policy,
    /// network and SandboxTemplate.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// An object of any fields, kept as given (`x-kubernetes-preserve-unknown-fields`).
fn any_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true
    })
}

/// `bytes` as an exact Kubernetes quantity: with the largest binary suffix
/// (`Ki` … `Ei`) that divides it, else a plain integer (`0`, `1000`,
/// `268435456` is `256Mi`).
pub fn bytes_quantity(bytes: u64) -> Quantity {
    const SUFFIXES: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let mut value = bytes;
    let mut suffix = "";
    for s in SUFFIXES {
        if value == 0 || value % 1024 != 0 {
            break;
        }
        value /= 1024;
        suffix = s;
    }
    Quantity(format!("{value}{suffix}"))
}

/// Where a Clone's pods come from: exactly one of the two fields.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[x_kube(validation = Rule::new("has(self.snapshotName) != has(self.podName)").message("set exactly one of source.snapshotName and source.podName"))]
#[serde(rename_all = "camelCase")]
pub struct CloneSource {
    /// A Ready Snapshot in the Clone's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub snapshot_name: Option<String>,
    /// A running Twig pod; the Clone first takes a Snapshot of it that it owns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub pod_name: Option<String>,
}

/// Where the clones come from, how many, and how they are named and labelled.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "twig.dev",
    version = "v1alpha1",
    kind = "Clone",
    doc = "N running copies of a pod, restored from one snapshot: on the snapshot's node, or on any node when the snapshot was exported.",
    root = "PodClone",
    namespaced,
    status = "CloneStatus",
    shortname = "tclone",
    category = "twig",
    printcolumn = r#"{"name":"Snapshot","type":"string","jsonPath":".status.snapshotName"}"#,
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.readyReplicas"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".status.nodeName","priority":1}"#,
    printcolumn(
        name = "Duration(ms)",
        type_ = "integer",
        json_path = ".status.durationMs"
    ),
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("self.source == oldSelf.source && self.replicas == oldSelf.replicas").message("source and replicas are immutable; create another Clone"))]
#[serde(rename_all = "camelCase")]
pub struct CloneSpec {
    /// Where the pods come from.
    pub source: CloneSource,
    /// Number of pods, 1 to 1000 ([`MAX_REPLICAS`]).
    #[schemars(range(min = 1, max = 1000))]
    pub replicas: i32,
    /// Pods are named `<namePrefix>-<index>`; defaults to the Clone's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 58),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name_prefix: Option<String>,
    /// Extra labels on every clone pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Fail the Clone (`DeadlineExceeded`) if its pods are not all Ready this
    /// many seconds after its creation; the pods made so far are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub failure_deadline_seconds: Option<i64>,
}

/// Observed state of a Clone.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CloneStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: Phase,
    /// The Snapshot the pods are restored from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_name: Option<String>,
    /// The snapshot's node, whose controller makes the pods: they run there,
    /// or, when the snapshot was exported (`placement: Scheduler`), where the
    /// scheduler puts them (`replicas[].nodeName`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// The node whose controller makes the pods instead, when the
    /// snapshot's node is gone and the snapshot was exported: the first
    /// live node's controller to record itself here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopted_by: Option<String>,
    /// How the pods are placed, decided with the first ones: `SnapshotNode`
    /// (bound to the snapshot's node) or `Scheduler` (any node; each pulls
    /// the exported snapshot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<ClonePlacement>,
    /// Names of the clone pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
    /// One entry per clone pod, keyed by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub replicas: Vec<ReplicaStatus>,
    /// Number of clone pods that are Ready.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Time from the Clone's creation until all pods were Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// `Ready`, `Progressing` and `Failure`, each with a reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Why the Clone is in its phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The failure, with its time (set when Failed or Lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<OperationError>,
}

/// Where a Clone's pods run.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum ClonePlacement {
    /// Bound to the snapshot's node (a snapshot only there, or a source pod
    /// with hostPath volumes, which name that node's files).
    SnapshotNode,
    /// Placed by the scheduler, within the source pod's constraints; a node
    /// lacking the snapshot pulls it from `status.artifact` of the Snapshot.
    Scheduler,
}

/// The state of one clone pod.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    /// The pod's name.
    pub name: String,
    /// The node the pod was bound to, once it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// The pod's phase (`Pending`, `Running`, …; `Pending` before it exists).
    pub phase: String,
    /// Whether the pod's `Ready` condition is True.
    pub ready: bool,
    /// Why the pod is not Ready, when its status says (the pod's message or
    /// a container's waiting reason).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Which pod to roll back, and to which snapshot.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "twig.dev",
    version = "v1alpha1",
    kind = "Rollback",
    doc = "Rewinds a running Twig pod in place to a snapshot of its lineage.",
    namespaced,
    status = "RollbackStatus",
    shortname = "trb",
    category = "twig",
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".spec.podName"}"#,
    printcolumn = r#"{"name":"Snapshot","type":"string","jsonPath":".spec.snapshotName"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".status.nodeName","priority":1}"#,
    printcolumn = r#"{"name":"Safety","type":"string","jsonPath":".status.safetySnapshotName"}"#,
    printcolumn(
        name = "Duration(ms)",
        type_ = "integer",
        json_path = ".status.durationMs"
    ),
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("a Rollback's spec is immutable; create a new Rollback"))]
#[serde(rename_all = "camelCase")]
pub struct RollbackSpec {
    /// The running Twig pod to roll back, in the Rollback's namespace.
    #[schemars(length(min = 1, max = 253))]
    pub pod_name: String,
    /// A Ready Snapshot from the pod's lineage.
    #[schemars(length(min = 1, max = 253))]
    pub snapshot_name: String,
    /// The UID the pod must have; a pod recreated under the same name is
    /// refused (`PodReplaced`). Without it, the controller pins the UID it
    /// first sees in `status.podUid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub pod_uid: Option<String>,
    /// Take a Snapshot of the pod before rolling it back (default true), so
    /// the rollback can itself be undone; named in `status.safetySnapshotName`.
    #[serde(default = "default_true")]
    pub safety_snapshot: bool,
    /// Fail the Rollback (`DeadlineExceeded`) if it is not done this many
    /// seconds after its creation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub failure_deadline_seconds: Option<i64>,
}

fn default_true() -> bool {
    true
}

/// Observed state of a Rollback.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollbackStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: Phase,
    /// The node that rolls the pod back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// UID of the pod being rolled back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The Snapshot of the pod taken just before the rollback (not owned by
    /// the Rollback: it outlives it, so the rollback can be undone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safety_snapshot_name: Option<String>,
    /// When the node started the rollback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// Time from start to done, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// When the rollback finished (Ready or Failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// `Ready`, `Progressing` and `Failure`, each with a reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Why the Rollback is in its phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The failure, with its time (set when Failed or Lost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<OperationError>,
}

/// What the template VM runs and how big it is.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "twig.dev",
    version = "v1alpha1",
    kind = "SandboxTemplate",
    doc = "A paused, pre-booted VM that new Twig pods are restored from instead of booted.",
    namespaced,
    status = "SandboxTemplateStatus",
    shortname = "ttpl",
    category = "twig",
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.image"}"#,
    printcolumn = r#"{"name":"vCPUs","type":"integer","jsonPath":".spec.vcpus"}"#,
    printcolumn(name = "Memory(MiB)", type_ = "integer", json_path = ".spec.memoryMiB"),
    printcolumn = r#"{"name":"Ready nodes","type":"integer","jsonPath":".status.readyNodes"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SandboxTemplateSpec {
    /// Container image the template runs.
    #[schemars(length(min = 1))]
    pub image: String,
    /// Number of vCPUs, 1 to 64.
    #[schemars(range(min = 1, max = 64))]
    pub vcpus: u32,
    /// Guest RAM in MiB: what twig-vmm accepts, a multiple of 2 from 16 to 3072 (3 GiB).
    #[serde(rename = "memoryMiB")]
    #[schemars(range(min = 16, max = 3072), extend("multipleOf" = 2))]
    pub memory_mib: u32,
    /// Overrides the image's entrypoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// Run in the template VM before it is saved (e.g. to load the app and warm caches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<Vec<String>>,
    /// Egress policy of the pods restored from this template (a pod's
    /// `twig.dev/egress-policy` annotation narrows it for that pod, never
    /// widens it: what reaches past it is clipped, its `udpReplyPorts`
    /// included); the built-in default (public destinations allowed,
    /// private ones and the metadata range denied, no UDP reply ports)
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_policy: Option<EgressPolicy>,
}

/// Observed state of a SandboxTemplate: one entry per node that built it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxTemplateStatus {
    /// One entry per node, keyed by node name; each node writes only its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["nodeName"]))]
    pub nodes: Vec<TemplateNodeStatus>,
    /// Number of nodes holding the template ready.
    #[serde(default)]
    pub ready_nodes: i32,
}

/// The template's state on one node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateNodeStatus {
    /// The node.
    pub node_name: String,
    /// Whether the template is built and ready to restore from on this node.
    pub ready: bool,
    /// Why it is not ready (building, or the error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// This node's build in the registry
    /// (`<registry>/<prefix>/<namespace>/template-<name>@sha256:…`): exported
    /// once ready when this node built it, or the artifact it pulled it
    /// from. Nodes without the template pull it from here instead of
    /// building it, when they would build it from the same inputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<String>,
}

/// Every CRD, in a stable order.
pub fn all_crds(
) -> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    vec![
        Snapshot::crd(),
        PodClone::crd(),
        Rollback::crd(),
        SandboxTemplate::crd(),
    ]
}

/// One CRD rendered as the YAML checked in under `crds/`, with its file name.
pub fn crd_files() -> Result<Vec<(String, String)>, serde_saphyr::SerializeError> {
    all_crds()
        .into_iter()
        .map(|crd| {
            let file = format!("{}.yaml", crd.metadata.name.as_deref().unwrap_or_default());
            let body = serde_saphyr::to_string(&crd)?;
            Ok((
                file,
                format!("# Generated by `twig-controller crds --out crds`; do not edit.\n{body}"),
            ))
        })
        .collect()
}
