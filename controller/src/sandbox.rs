//! Finding a pod's sandbox (and its shim's socket) through containerd.
//!
//! containerd's runtime v2 keeps one bundle directory per task under its state
//! directory (`/run/containerd/io.containerd.runtime.v2.task/<namespace>/<id>`).
//! The CRI plugin marks the sandbox's bundle in its OCI `config.json` with the
//! annotations `io.kubernetes.cri.container-type: sandbox` and
//! `io.kubernetes.cri.sandbox-uid: <pod UID>`, and containerd writes the shim's
//! ttrpc address to the bundle's `address` file. Reading these is local, needs
//! no gRPC client, and works while containerd itself is restarting.

use std::path::{Path, PathBuf};

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
#[derive(Clone, Debug)]
pub struct ContainerdLocator {
    /// `<state>/io.containerd.runtime.v2.task/<containerd namespace>`, normally
    /// `/run/containerd/io.containerd.runtime.v2.task/k8s.io`.
    pub task_dir: PathBuf,
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

#[async_trait]
impl SandboxLocator for ContainerdLocator {
    async fn locate(&self, pod: &Pod) -> Result<Sandbox, LocateError> {
        let uid = pod.metadata.uid.as_deref().ok_or(LocateError::NoUid)?;
        let mut entries = tokio::fs::read_dir(&self.task_dir)
            .await
            .map_err(io_error(&self.task_dir))?;
        while let Some(entry) = entries
            .next_entry()
            .await
            .map_err(io_error(&self.task_dir))?
        {
            let bundle = entry.path();
            let config = bundle.join("config.json");
            // Bundles come and go while we scan; a half-written one is not ours.
            let Ok(bytes) = tokio::fs::read(&config).await else {
                continue;
            };
            let Ok(spec) = serde_json::from_slice::<OciSpec>(&bytes) else {
                continue;
            };
            let is_sandbox =
                spec.annotations.get(CONTAINER_TYPE).map(String::as_str) == Some("sandbox");
            if !is_sandbox || spec.annotations.get(SANDBOX_UID).map(String::as_str) != Some(uid) {
                continue;
            }
            let address_file = bundle.join("address");
            let address = tokio::fs::read_to_string(&address_file)
                .await
                .map_err(io_error(&address_file))?;
            return Ok(Sandbox {
                id: entry.file_name().to_string_lossy().into_owned(),
                address: address.trim().to_string(),
            });
        }
        Err(LocateError::NotFound(uid.to_string()))
    }
}
