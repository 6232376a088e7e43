//! The JSON of E2B's API (the `e2b` SDK 2.63's generated client is the
//! reference: field names as its models read them) and CubeSandbox's
//! additions.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The envd version twig-agent's in-sandbox API answers for: the SDKs gate
/// features on it (stdin, default user, octet-stream uploads, metadata).
pub const ENVD_VERSION: &str = "0.6.4";

/// `POST /v2/sandboxes` (E2B) and `POST /sandboxes` (CubeSandbox).
#[derive(Deserialize, Debug, Default)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    /// A SandboxTemplate's name, or a snapshot's ID.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Seconds until the sandbox times out.
    pub timeout: Option<i64>,
    /// The sandbox's metadata (kept as pod labels).
    pub metadata: Option<BTreeMap<String, String>>,
    /// Environment of the sandbox's commands.
    pub env_vars: Option<BTreeMap<String, String>>,
    /// Pause instead of kill at the timeout (E2B).
    pub auto_pause: Option<bool>,
    /// What happens at the timeout (CubeSandbox, newer E2B).
    pub lifecycle: Option<Lifecycle>,
    /// `false`: no outbound traffic but what `network.allowOut` allows.
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    /// Egress and public-traffic settings.
    pub network: Option<NetworkConfig>,
}

/// A sandbox's lifecycle settings.
#[derive(Deserialize, Debug, Default)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    /// `kill` (default) or `pause`.
    pub on_timeout: Option<String>,
}

/// A sandbox's network settings (the parts Twig honours).
#[derive(Deserialize, Debug, Default)]
#[serde(rename_all = "camelCase")]
pub struct NetworkConfig {
    /// `false`: ports other than envd's need the traffic access token.
    pub allow_public_traffic: Option<bool>,
    /// Destinations (CIDRs) allowed although the default denies.
    pub allow_out: Option<Vec<String>>,
    /// Destinations (CIDRs) denied.
    pub deny_out: Option<Vec<String>>,
}

/// `POST /sandboxes/{id}/timeout`.
#[derive(Deserialize, Debug)]
pub struct SetTimeout {
    /// Seconds from now (CubeSandbox: 0 = now, -1 = never).
    pub timeout: i64,
}

/// `POST /v2/sandboxes/{id}/connect`, `/connect`, `/resume`.
#[derive(Deserialize, Debug, Default)]
pub struct Connect {
    /// Seconds from now until the timeout.
    pub timeout: Option<i64>,
}

/// `POST /sandboxes/{id}/fork`.
#[derive(Deserialize, Debug, Default)]
pub struct Fork {
    /// How many forks (default 1).
    pub count: Option<i64>,
    /// Their timeout, in seconds.
    pub timeout: Option<i64>,
}

/// `POST /sandboxes/{id}/snapshots`.
#[derive(Deserialize, Debug, Default)]
pub struct NewSnapshot {
    /// A name for people (listed in `names`).
    pub name: Option<String>,
    /// `false`: the filesystem only (E2B's `mode="filesystem"`).
    pub memory: Option<bool>,
}

/// `POST /sandboxes/{id}/rollback` (CubeSandbox).
#[derive(Deserialize, Debug)]
pub struct RollbackRequest {
    /// The snapshot to roll back to.
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
}

/// A sandbox as create, connect and fork answer it (`Sandbox`).
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    /// Its template (or snapshot) ID.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Its ID.
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Deprecated by E2B; always `twig`.
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// The envd version the SDK may rely on.
    pub envd_version: String,
    /// The template's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// The domain its ports are reached under (`<port>-<id>.<domain>`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// The token envd requires (`X-Access-Token`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    /// The token other ports require when the traffic is not public.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traffic_access_token: Option<String>,
    /// `running` or `paused` (CubeSandbox reads it).
    pub state: String,
}

/// A sandbox as get and list answer it (`SandboxDetail`, `ListedSandbox`).
#[derive(Serialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    /// Its template (or snapshot) ID.
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Its ID.
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Deprecated by E2B; always `twig`.
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// The template's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// vCPUs.
    pub cpu_count: u32,
    /// Memory, in MiB.
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    /// Disk, in MiB (Twig's container disks grow on demand; 0 = unbounded).
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u32,
    /// When it started (RFC 3339).
    pub started_at: String,
    /// When it times out (RFC 3339).
    pub end_at: String,
    /// The envd version.
    pub envd_version: String,
    /// `running` or `paused`.
    pub state: String,
    /// Its metadata.
    pub metadata: BTreeMap<String, String>,
    /// The domain its ports are reached under.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// The token envd requires.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
}

/// One entry of a fork's answer.
#[derive(Serialize, Debug)]
pub struct ForkResult {
    /// The fork, if it started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Sandbox>,
    /// Why it did not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ForkError>,
}

/// A fork that did not start.
#[derive(Serialize, Debug)]
pub struct ForkError {
    /// The status the single call would have had.
    pub code: u16,
    /// What went wrong.
    pub message: String,
}

/// A snapshot (`SnapshotInfo`).
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct SnapshotInfo {
    /// Its ID: a template ID sandboxes can be created from.
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    /// The names it was given.
    pub names: Vec<String>,
}
