//! Restore-from: a pod whose first container's OCI spec carries the
//! annotation `twig.dev/restore-from: <snapshot id>` (CRI passes pod
//! annotations to the sandbox's spec when the runtime handler lists them in
//! `pod_annotations`) gets a VM restored from that node-store snapshot
//! instead of the base template. The snapshot's labels (written by the
//! `Twig` service) say which containers ran in it: the VMM gets a file for
//! each of their disk slots (the snapshot's copy of the rootfs), and the
//! Task service *adopts* the running container of the same CRI name
//! instead of creating a new one. The clone then takes its own identity
//! (hostname, RNG reseed, clock step) through the agent.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;
use twig_agent::proto::agent::ReidentifyRequest;
use twig_store::NodeStore;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::sandbox::Restored;
use crate::spec;
use crate::twig_service::{SnapshotContainer, TwigService, CONTAINERS_LABEL};

/// The annotation naming the pod snapshot to restore from.
pub const RESTORE_FROM_ANNOTATION: &str = "twig.dev/restore-from";

/// Bytes of host entropy mixed into a clone's RNG.
const ENTROPY_BYTES: usize = 64;

/// What a sandbox's VM is restored from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The base template (`template.dir`).
    Template,
    /// A pod snapshot of the node store.
    Snapshot(SnapshotSource),
}

/// A pod snapshot to restore, with what the restored VM needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotSource {
    /// The snapshot's id.
    pub id: String,
    /// Its directory in the node store.
    pub dir: PathBuf,
    /// Where the VM's own copies of the snapshot's slot disks go (removed
    /// with the VM).
    pub files_dir: PathBuf,
    /// Each attached slot of the snapshot and the file that gets its disk.
    pub slot_files: Vec<(usize, PathBuf)>,
    /// The running containers to adopt.
    pub restored: Vec<Restored>,
    /// The clone's hostname.
    pub hostname: String,
}

impl Source {
    /// The source the first container's spec `oci` asks for; the VM's
    /// files go in a directory named like its state directory `state_dir`.
    pub fn for_spec(
        config: &Config,
        state_dir: &Path,
        sandbox_id: &str,
        oci: &Value,
    ) -> Result<Source> {
        let Some(id) = spec::annotation(oci, RESTORE_FROM_ANNOTATION) else {
            return Ok(Source::Template);
        };
        let root = TwigService::store_of_template(&config.template.dir)
            .map_err(Error::FailedPrecondition)?;
        let store = NodeStore::open(&root, false).map_err(|source| Error::Store {
            what: "opening the node store".into(),
            source,
        })?;
        let snap = store.get(id).map_err(|e| match e {
            twig_store::Error::NotFound(_) => Error::NotFound(format!(
                "{RESTORE_FROM_ANNOTATION}: snapshot {id} is not in the node store {}",
                root.display()
            )),
            source => Error::Store {
                what: format!("reading snapshot {id}"),
                source,
            },
        })?;
        let containers: Vec<SnapshotContainer> = snap
            .labels
            .get(CONTAINERS_LABEL)
            .map(|l| serde_json::from_str(l))
            .transpose()
            .map_err(|e| {
                Error::FailedPrecondition(format!(
                    "snapshot {id}: unreadable {CONTAINERS_LABEL}: {e}"
                ))
            })?
            .unwrap_or_default();
        let name = state_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| sandbox_id.to_string());
        let files_dir = root.parent().unwrap_or(&root).join("pods").join(name);
        let slot_files = containers
            .iter()
            .filter_map(|c| c.slot)
            .map(|s| (s, files_dir.join(format!("slot{s}.img"))))
            .collect();
        let restored = containers
            .iter()
            .filter(|c| c.running)
            .filter_map(|c| {
                Some(Restored {
                    guest_id: c.id.clone(),
                    name: c.name.clone()?,
                    slot: c.slot?,
                })
            })
            .collect();
        let hostname = oci
            .get("hostname")
            .and_then(Value::as_str)
            .filter(|h| !h.is_empty())
            .map(str::to_string)
            .unwrap_or_else(|| sandbox_id.chars().take(63).collect());
        Ok(Source::Snapshot(SnapshotSource {
            id: id.to_string(),
            dir: snap.dir().to_path_buf(),
            files_dir,
            slot_files,
            restored,
            hostname,
        }))
    }
}

/// The clone's own identity: its hostname, fresh host entropy for the
/// guest's RNG, and the host's wall clock. The network part (IP, MAC)
/// waits for the pod's network.
pub fn identity(hostname: &str) -> Result<ReidentifyRequest> {
    let mut entropy = vec![0u8; ENTROPY_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut entropy))
        .map_err(|e| Error::io("reading /dev/urandom", e))?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|e| Error::Internal(format!("the host clock is before 1970: {e}")))?;
    Ok(ReidentifyRequest {
        hostname: hostname.to_string(),
        entropy,
        realtime_ns: u64::try_from(now.as_nanos()).unwrap_or(u64::MAX),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_the_annotation_the_template_is_the_source() {
        let oci = serde_json::json!({"annotations": {}});
        let s = Source::for_spec(&Config::default(), Path::new("/run/x"), "pod", &oci);
        assert_eq!(s.unwrap(), Source::Template);
    }

    #[test]
    fn identities_carry_fresh_entropy_and_the_clock() {
        let a = identity("clone-1").unwrap();
        let b = identity("clone-1").unwrap();
        assert_eq!(a.hostname, "clone-1");
        assert_eq!(a.entropy.len(), ENTROPY_BYTES);
        assert_ne!(a.entropy, b.entropy);
        assert!(a.realtime_ns > 1_700_000_000_000_000_000);
    }
}
