//! The labels the shim writes on a pod snapshot in the node store and reads
//! back: which sandbox it was taken of and which containers ran in it. The
//! `Twig` service writes them (Snapshot) and checks them (Rollback);
//! restore-from reads them to adopt the snapshot's running containers. A
//! ground-floor module: it depends on nothing else of the shim.

use serde::{Deserialize, Serialize};

/// The snapshot labels naming the sandbox (shim group) it was taken of and
/// listing the pod's containers (JSON array of [`SnapshotContainer`]):
/// twig-proto's contract.
pub use twig_proto::contract::labels::{CONTAINERS as CONTAINERS_LABEL, SANDBOX as SANDBOX_LABEL};

/// A container as a snapshot records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotContainer {
    /// containerd's container id.
    pub id: String,
    /// Its name in the pod (CRI's `io.kubernetes.cri.container-name`);
    /// none outside CRI.
    #[serde(default)]
    pub name: Option<String>,
    /// The VM's disk slot holding its rootfs.
    pub slot: Option<usize>,
    /// Whether its init process ran.
    pub running: bool,
    /// The id the guest's agent knows it by, where it differs from `id` (a
    /// container adopted in a clone keeps its source's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_id: Option<String>,
    /// Its init's pid in the VM: recorded for the pod's sandbox container,
    /// whose namespaces a clone's new containers join.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// The container name its guest volumes are named after, where it
    /// differs from `name`: one that adopted an app template's process
    /// binds the volumes the template's build container named (and a clone
    /// of it adopts it with them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mounts_of: Option<String>,
}
