//! Finding a pod's sandbox (and its shim's socket) through containerd.
//!
//! containerd's runtime v2 keeps one bundle directory per task under its state
//! directory (`/run/containerd/io.containerd.runtime.v2.task/<namespace>/<id>`).
//! The CRI plugin marks the sandbox's bundle in its OCI `config.json` with the
//! annotations `io.kubernetes.cri.container-type: sandbox` and
//! `io.kubernetes.cri.sandbox-uid: <pod UID>`, and containerd writes the shim's
//! ttrpc address to the bundle's `address` file. Reading these is local, needs
//! no gRPC client, and works while containerd itself is restarting.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;

use crate::shim::Sandbox;

const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
const SANDBOX_UID: &str = "io.kubernetes.cri.sandbox-uid";

/// Failure to find a pod's sandbox.
#[derive(Debug, thiserror::Error)]
pub enum LocateError {
    /// The pod object has no `metadata.uid`.
    #[error("pod has no UID")]
    NoUid,
    /// No sandbox of the pod (by UID) runs on this node.
    #[error("no sandbox of pod UID {0} on this node")]
    NotFound(String),
    /// containerd's state directory could not be read.
    #[error("reading containerd state {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Finds the sandbox that runs a pod on this node.
#[async_trait]
pub trait SandboxLocator: Send + Sync {
    /// The sandbox running `pod` on this node.
    async fn locate(&self, pod: &Pod) -> Result<Sandbox, LocateError>;
}

/// [`SandboxLocator`] over containerd's runtime v2 state directory.
///
/// A bundle's `config.json` never changes while the bundle lives, so each is
/// parsed once: the locator remembers every bundle it has read (by name and
/// inode) until the bundle is gone. A look is one directory listing and one
/// `address` read, however many pods the node runs (the network reconciler
/// looks at every pod every `network_refresh`).
#[derive(Debug)]
pub struct ContainerdLocator {
    task_dir: PathBuf,
    bundles: Mutex<HashMap<(OsString, u64), BundleKind>>,
}

/// What a bundle's `config.json` says it runs.
#[derive(Clone, Debug, PartialEq)]
enum BundleKind {
    /// The sandbox of the pod with this UID.
    Sandbox(String),
    /// Anything else (a container, a sandbox without a pod UID).
    Other,
}

#[derive(serde::Deserialize)]
struct OciSpec {
    #[serde(default)]
    annotations: std::collections::BTreeMap<String, String>,
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> LocateError + '_ {
    move |source| LocateError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl ContainerdLocator {
    /// A locator over `task_dir`: `<state>/io.containerd.runtime.v2.task/<containerd
    /// namespace>`, normally `/run/containerd/io.containerd.runtime.v2.task/k8s.io`.
    pub fn new(task_dir: impl Into<PathBuf>) -> Self {
        ContainerdLocator {
            task_dir: task_dir.into(),
            bundles: Mutex::new(HashMap::new()),
        }
    }

    /// How many bundles it remembers: those seen by its last look that it
    /// could read.
    pub fn known_bundles(&self) -> usize {
        self.remembered().len()
    }

    fn remembered(&self) -> std::sync::MutexGuard<'_, HashMap<(OsString, u64), BundleKind>> {
        self.bundles.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What the bundle at `dir` runs, from its `config.json`; `None` while it
/// cannot be read or parsed (bundles come and go while we scan, and a
/// half-written one is not ours yet).
async fn bundle_kind(dir: &Path) -> Option<BundleKind> {
    let bytes = tokio::fs::read(dir.join("config.json")).await.ok()?;
    let spec = serde_json::from_slice::<OciSpec>(&bytes).ok()?;
    let is_sandbox = spec.annotations.get(CONTAINER_TYPE).map(String::as_str) == Some("sandbox");
    Some(match spec.annotations.get(SANDBOX_UID) {
        Some(uid) if is_sandbox => BundleKind::Sandbox(uid.clone()),
        _ => BundleKind::Other,
    })
}

#[async_trait]
impl SandboxLocator for ContainerdLocator {
    async fn locate(&self, pod: &Pod) -> Result<Sandbox, LocateError> {
        let uid = pod.metadata.uid.as_deref().ok_or(LocateError::NoUid)?;
        let mut entries = tokio::fs::read_dir(&self.task_dir)
            .await
            .map_err(io_error(&self.task_dir))?;
        let mut present = Vec::new();
        let mut found = None;
        while let Some(entry) = entries
            .next_entry()
            .await
            .map_err(io_error(&self.task_dir))?
        {
            let key = (entry.file_name(), entry.ino());
            let known = self.remembered().get(&key).cloned();
            let kind = match known {
                Some(kind) => Some(kind),
                None => {
                    let kind = bundle_kind(&entry.path()).await;
                    if let Some(kind) = &kind {
                        self.remembered().insert(key.clone(), kind.clone());
                    }
                    kind
                }
            };
            present.push(key);
            if found.is_none() && kind == Some(BundleKind::Sandbox(uid.to_string())) {
                found = Some(entry);
            }
        }
        // The listing is complete: forget the bundles that are gone.
        let present: HashSet<_> = present.into_iter().collect();
        self.remembered().retain(|key, _| present.contains(key));
        let entry = found.ok_or_else(|| LocateError::NotFound(uid.to_string()))?;
        let address_file = entry.path().join("address");
        let address = tokio::fs::read_to_string(&address_file)
            .await
            .map_err(io_error(&address_file))?;
        Ok(Sandbox {
            id: entry.file_name().to_string_lossy().into_owned(),
            address: address.trim().to_string(),
        })
    }
}
