//! Restore-from: a pod whose sandbox spec carries the annotation
//! `twig.dev/restore-from: <snapshot id>` (CRI passes pod annotations to
//! the runtime when the runtime handler lists them in `pod_annotations`)
//! gets its VM restored from that pod snapshot of the node store instead of
//! a template. The snapshot's labels (written by the `Twig` service) say
//! which containers ran in it and on which disk slots; each attached
//! slot's disk (the snapshot's `disk<slot>`) is reflinked into an
//! anonymous file of the pod (`O_TMPFILE` in the store's `tmp`, on the
//! snapshots' filesystem) whose descriptor the VMM gets with the restore,
//! so a jailed VMM serves it and nothing is left behind when the VMM or the
//! slot lets go of it. The Task service then *adopts* the running
//! container of the same CRI name instead of creating a new one, and the
//! clone takes its own identity (hostname, RNG reseed, clock step) through
//! the agent before any container of the new pod runs.
//!
//! [`restore_source`] reads what the sandbox's spec asks to restore
//! (`twig.dev/restore-from`, else an app template's `twig.dev/template`);
//! [`SnapshotSource::open`] finds that snapshot in the node store and makes
//! the pod's disk copies; [`identity`] is a restored VM's own identity.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;
use twig_agent::proto::agent::ReidentifyRequest;
use twig_store::layout::{Artefact, TEMPLATE_POLICY_LABEL, TMP_DIR};
use twig_store::NodeStore;

use crate::error::{Error, Result};
use crate::labels::{SnapshotContainer, CONTAINERS_LABEL, SANDBOX_LABEL};
use crate::sandbox::{Restored, SANDBOX_ADOPTION, TEMPLATE_ADOPTION};
use crate::spec;
use twig_proto::contract::TEMPLATE_BUILD_CONTAINER;

pub use twig_proto::contract::{
    CRI_SANDBOX_NAMESPACE_ANNOTATION as SANDBOX_NAMESPACE_ANNOTATION, RESTORE_ARTIFACT_ANNOTATION,
    RESTORE_FROM_ANNOTATION, TEMPLATE_ANNOTATION,
};

/// Bytes of host entropy mixed into a clone's RNG.
const ENTROPY_BYTES: usize = 64;

/// A pod snapshot of the node store a sandbox's VM is restored from,
/// instead of the node's base template.
pub struct RestoreFrom<'a> {
    /// The snapshot's id.
    pub id: String,
    /// The SandboxTemplate (`namespace/name`) when the snapshot is an app
    /// template: its app container is adopted by the pod's first container.
    pub app_template: Option<String>,
    /// Where the snapshot was exported (`twig.dev/restore-artifact`) and
    /// the pod's namespace: a node that lacks it pulls it from there.
    pub artifact: Option<(String, String)>,
    /// The sandbox's OCI spec.
    pub oci: &'a serde_json::Value,
    /// The new sandbox container's rootfs image.
    pub rootfs: &'a Path,
}

/// What the sandbox's spec asks to restore instead of the base template:
/// `twig.dev/restore-from`, else `twig.dev/template` (of the pod's
/// namespace).
pub fn restore_source<'a>(
    oci: &'a serde_json::Value,
    rootfs: &'a Path,
) -> Result<Option<RestoreFrom<'a>>> {
    if let Some(id) = spec::annotation(oci, RESTORE_FROM_ANNOTATION) {
        let artifact = match spec::annotation(oci, RESTORE_ARTIFACT_ANNOTATION) {
            None => None,
            Some(reference) => {
                let namespace =
                    spec::annotation(oci, SANDBOX_NAMESPACE_ANNOTATION).ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "{RESTORE_ARTIFACT_ANNOTATION}: a snapshot is pulled for the pod's \
                             namespace, and this sandbox has none \
                             ({SANDBOX_NAMESPACE_ANNOTATION})"
                        ))
                    })?;
                Some((reference.to_string(), namespace.to_string()))
            }
        };
        return Ok(Some(RestoreFrom {
            id: id.to_string(),
            app_template: None,
            artifact,
            oci,
            rootfs,
        }));
    }
    let Some(name) = spec::annotation(oci, TEMPLATE_ANNOTATION) else {
        return Ok(None);
    };
    let namespace = spec::annotation(oci, SANDBOX_NAMESPACE_ANNOTATION).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{TEMPLATE_ANNOTATION}: {name:?} names a SandboxTemplate of the pod's namespace, and \
             this sandbox has none ({SANDBOX_NAMESPACE_ANNOTATION}): templates are for pods made \
             through CRI"
        ))
    })?;
    let id = twig_store::layout::template_id(namespace, name)
        .map_err(|e| Error::InvalidArgument(format!("{TEMPLATE_ANNOTATION}: {e}")))?;
    Ok(Some(RestoreFrom {
        id,
        app_template: Some(format!("{namespace}/{name}")),
        artifact: None,
        oci,
        rootfs,
    }))
}

/// Why a pod of SandboxTemplate `name` (node store id `id`) cannot start
/// when its template is not in the node store.
pub fn not_built(name: &str, id: &str) -> String {
    format!(
        "{TEMPLATE_ANNOTATION}: SandboxTemplate {name} is not built on this node (node store id \
         {id}): its status says whether the node's build is ready"
    )
}

/// A pod snapshot to restore, with what the restored VM needs.
#[derive(Debug)]
pub struct SnapshotSource {
    /// The snapshot's id.
    pub id: String,
    /// Its directory in the node store (what the VMM restores).
    pub dir: PathBuf,
    /// The pod's own copy of each attached slot's disk: (slot, a name for
    /// logs, the open image).
    pub slots: Vec<(usize, PathBuf, File)>,
    /// The running containers to adopt.
    pub restored: Vec<Restored>,
    /// The clone's hostname.
    pub hostname: String,
    /// An app template's egress policy (its snapshot's label; JSON), for
    /// its pods without their own.
    pub egress_policy: Option<String>,
}

impl SnapshotSource {
    /// Finds snapshot `id` in the node store holding `template_dir` (the
    /// template the node daemon handed over with the VM: pods and their
    /// snapshots share the store) and makes the pod's copies of its slot
    /// disks. `oci` is the sandbox's spec (its `hostname` becomes the
    /// clone's; without one, `sandbox_id`); `sandbox_rootfs` the new
    /// sandbox container's rootfs image, which stands in for the
    /// snapshotted sandbox container's read-only one (the same sandbox
    /// image; read-only disks are not copied into snapshots).
    pub fn open(
        template_dir: &Path,
        id: &str,
        oci: &Value,
        sandbox_id: &str,
        sandbox_rootfs: &Path,
    ) -> Result<Self> {
        Self::open_in(template_dir, false, id, oci, sandbox_id, sandbox_rootfs)
    }

    /// [`SnapshotSource::open`] of snapshot `id`, pulled and not yet
    /// published (its memory arrives while the VM runs: a lazy restore),
    /// from its staging directory `staged`, as the node described it.
    pub fn open_staged(
        staged: &Path,
        id: &str,
        oci: &Value,
        sandbox_id: &str,
        sandbox_rootfs: &Path,
    ) -> Result<Self> {
        Self::open_in(staged, true, id, oci, sandbox_id, sandbox_rootfs)
    }

    fn open_in(
        template_dir: &Path,
        staged: bool,
        id: &str,
        oci: &Value,
        sandbox_id: &str,
        sandbox_rootfs: &Path,
    ) -> Result<Self> {
        let in_store = if staged {
            twig_store::layout::staging_target(template_dir)
                .and_then(|(_, published)| twig_store::layout::locate(&published))
        } else {
            twig_store::layout::locate(template_dir)
        };
        let (root, _) = in_store.map_err(|e| {
            Error::FailedPrecondition(format!(
                "{RESTORE_FROM_ANNOTATION}: the node's template is not in a node store: {e}"
            ))
        })?;
        let store = NodeStore::open(&root, false).map_err(|source| Error::Store {
            what: format!("{RESTORE_FROM_ANNOTATION}: opening the node store"),
            source,
        })?;
        let snap = if staged {
            store.staged(template_dir).and_then(|s| {
                if s.id == id {
                    Ok(s)
                } else {
                    Err(twig_store::Error::InvalidArgument(format!(
                        "{} stages snapshot {}, not {id}",
                        template_dir.display(),
                        s.id
                    )))
                }
            })
        } else {
            store.get(id)
        };
        let snap = snap.map_err(|e| match e {
            twig_store::Error::NotFound(_) => Error::NotFound(format!(
                "{RESTORE_FROM_ANNOTATION}: snapshot {id} is not in the node store {}",
                root.display()
            )),
            source => Error::Store {
                what: format!("{RESTORE_FROM_ANNOTATION}: reading snapshot {id}"),
                source,
            },
        })?;
        // One tenant's memory, processes and disks never reach another's
        // pod: only a pod of the namespace that took it restores it.
        snap.check_owner(spec::annotation(oci, SANDBOX_NAMESPACE_ANNOTATION))
            .map_err(|source| Error::Store {
                what: format!("{RESTORE_FROM_ANNOTATION}: snapshot {id}"),
                source,
            })?;
        let containers: Vec<SnapshotContainer> = snap
            .labels
            .get(CONTAINERS_LABEL)
            .map(|l| serde_json::from_str(l))
            .transpose()
            .map_err(|e| {
                Error::FailedPrecondition(format!(
                    "{RESTORE_FROM_ANNOTATION}: snapshot {id}: unreadable {CONTAINERS_LABEL}: {e}"
                ))
            })?
            .ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "{RESTORE_FROM_ANNOTATION}: snapshot {id} is not a pod snapshot (no \
                     {CONTAINERS_LABEL} label)"
                ))
            })?;
        let tmp = root.join(TMP_DIR);
        let snapshotted_sandbox = snap.labels.get(SANDBOX_LABEL);
        let mut slots = Vec::new();
        for c in &containers {
            let Some(slot) = c.slot else { continue };
            // A VM restored from a template has no fixed disks: slot s is
            // disk s.
            let (name, file) = match snap.artefacts.get(&Artefact::Disk(slot)) {
                Some(size) => {
                    let disk = snap.dir().join(Artefact::Disk(slot).file_name());
                    let name = format!("{}/pod-{sandbox_id}/slot{slot}", tmp.display());
                    (PathBuf::from(name), pod_copy(&disk, &tmp, *size)?)
                }
                // A read-only rootfs: only the sandbox container's has a
                // stand-in (twig-vmm checks its size).
                None if snapshotted_sandbox == Some(&c.id) => {
                    let file = File::open(sandbox_rootfs).map_err(|e| {
                        Error::io(format!("opening {}", sandbox_rootfs.display()), e)
                    })?;
                    (sandbox_rootfs.to_path_buf(), file)
                }
                None => {
                    return Err(Error::FailedPrecondition(format!(
                        "{RESTORE_FROM_ANNOTATION}: snapshot {id} has no copy of disk slot \
                         {slot} (container {}): a read-only rootfs is not in a snapshot, and \
                         only the sandbox container's has a stand-in",
                        c.id
                    )))
                }
            };
            slots.push((slot, name, file));
        }
        // Running containers wait for the new pod's container of the same
        // name; the snapshotted sandbox container for the new sandbox's.
        let restored = containers
            .iter()
            .filter(|c| c.running)
            .filter_map(|c| {
                let name = match &c.name {
                    Some(name) => name.clone(),
                    None if snapshotted_sandbox == Some(&c.id) => SANDBOX_ADOPTION.to_string(),
                    None => return None,
                };
                Some(Restored {
                    guest_id: c.guest_id.clone().unwrap_or_else(|| c.id.clone()),
                    name,
                    slot: c.slot,
                    pid: c.pid,
                    mounts_of: c.mounts_of.clone(),
                })
            })
            .collect();
        let hostname = oci
            .get("hostname")
            .and_then(Value::as_str)
            .filter(|h| !h.is_empty())
            .map(str::to_string)
            .unwrap_or_else(|| sandbox_id.chars().take(63).collect());
        Ok(SnapshotSource {
            id: id.to_string(),
            dir: snap.dir().to_path_buf(),
            slots,
            restored,
            hostname,
            egress_policy: snap.labels.get(TEMPLATE_POLICY_LABEL).cloned(),
        })
    }

    /// This snapshot as an app template's: its one running app container
    /// (the node daemon's build pod has exactly one) is adopted by the
    /// first container of the new pod, whatever its name. A snapshot with
    /// another number of running app containers is no app template.
    pub fn app_template(mut self) -> Result<Self> {
        let mut apps = self
            .restored
            .iter_mut()
            .filter(|r| r.name != SANDBOX_ADOPTION);
        match (apps.next(), apps.next()) {
            (Some(app), None) => {
                // Its processes' mounts bind the guest volumes its build
                // container named (twig-proto's contract).
                app.mounts_of
                    .get_or_insert_with(|| TEMPLATE_BUILD_CONTAINER.to_string());
                app.name = TEMPLATE_ADOPTION.to_string();
            }
            _ => {
                return Err(Error::FailedPrecondition(format!(
                    "snapshot {} is no app template: it holds {} running app containers, a \
                     template one",
                    self.id,
                    self.restored
                        .iter()
                        .filter(|r| r.name != SANDBOX_ADOPTION)
                        .count()
                )))
            }
        }
        Ok(self)
    }

    /// The slots whose disks the VMM gets, for marking them used.
    pub fn slot_numbers(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots.iter().map(|(s, _, _)| *s)
    }
}

/// A reflink of the snapshot's disk `disk` (`size` bytes) into a new
/// anonymous file in `tmp` (the store's, so on the snapshots' filesystem,
/// which a later rollback of the clone needs too): the pod's own copy, gone
/// once the last descriptor of it closes.
fn pod_copy(disk: &Path, tmp: &Path, size: u64) -> Result<File> {
    let src = File::open(disk).map_err(|e| Error::io(format!("opening {}", disk.display()), e))?;
    let len = src
        .metadata()
        .map_err(|e| Error::io(format!("reading {}", disk.display()), e))?
        .len();
    if len != size {
        return Err(Error::FailedPrecondition(format!(
            "{RESTORE_FROM_ANNOTATION}: {} is {len} bytes, its snapshot's manifest says {size}: \
             the snapshot is damaged",
            disk.display()
        )));
    }
    let dst = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .mode(0o600)
        .open(tmp)
        .map_err(|e| {
            Error::io(
                format!(
                    "creating the pod's copy of {} in {}",
                    disk.display(),
                    tmp.display()
                ),
                e,
            )
        })?;
    twig_store::fsops::ficlone(&src, &dst).map_err(|e| {
        Error::io(
            format!(
                "reflinking {} into the pod's copy (FICLONE)",
                disk.display()
            ),
            e,
        )
    })?;
    Ok(dst)
}

/// The clone's own identity: its hostname, fresh host entropy for the
/// guest's RNG, and the host's wall clock. The network part (IP, MAC) is
/// the pod network's.
pub fn identity(hostname: &str) -> Result<ReidentifyRequest> {
    let mut entropy = vec![0u8; ENTROPY_BYTES];
    File::open("/dev/urandom")
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

    fn source(names: &[&str]) -> SnapshotSource {
        SnapshotSource {
            id: "template.default.t".into(),
            dir: PathBuf::new(),
            slots: Vec::new(),
            restored: names
                .iter()
                .map(|n| Restored {
                    guest_id: format!("g-{n}"),
                    name: n.to_string(),
                    slot: Some(0),
                    pid: None,
                    mounts_of: None,
                })
                .collect(),
            hostname: "h".into(),
            egress_policy: None,
        }
    }

    #[test]
    fn an_app_template_hands_its_one_app_container_to_the_pods_first() {
        let t = source(&[SANDBOX_ADOPTION, "template"])
            .app_template()
            .unwrap();
        let names: Vec<&str> = t.restored.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, [SANDBOX_ADOPTION, TEMPLATE_ADOPTION]);
        // Its processes' mounts bind the volumes its build container
        // named; a pod snapshot's container keeps what it recorded.
        let mounts: Vec<Option<&str>> = t.restored.iter().map(|r| r.mounts_of.as_deref()).collect();
        assert_eq!(mounts, [None, Some(TEMPLATE_BUILD_CONTAINER)]);
        let mut recorded = source(&[SANDBOX_ADOPTION, "app"]);
        recorded.restored[1].mounts_of = Some("template".into());
        let kept = recorded.app_template().unwrap();
        assert_eq!(kept.restored[1].mounts_of.as_deref(), Some("template"));
        for bad in [&[SANDBOX_ADOPTION][..], &[SANDBOX_ADOPTION, "a", "b"]] {
            let e = source(bad).app_template().unwrap_err();
            assert!(
                matches!(e, Error::FailedPrecondition(_))
                    && e.to_string().contains("no app template"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn a_restore_artifact_is_pulled_for_the_pods_namespace() {
        let rootfs = Path::new("/r");
        let spec = |pairs: &[(&str, &str)]| {
            let a: serde_json::Map<String, Value> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), Value::from(*v)))
                .collect();
            serde_json::json!({ "annotations": a })
        };
        let artifact = "r.io/twig/team-a/s@sha256:ab";
        let with = spec(&[
            (RESTORE_FROM_ANNOTATION, "snap-1"),
            (RESTORE_ARTIFACT_ANNOTATION, artifact),
            (SANDBOX_NAMESPACE_ANNOTATION, "team-a"),
        ]);
        let r = restore_source(&with, rootfs).unwrap().unwrap();
        assert_eq!(r.id, "snap-1");
        assert_eq!(r.artifact, Some((artifact.into(), "team-a".into())));
        let plain = spec(&[(RESTORE_FROM_ANNOTATION, "snap-1")]);
        assert_eq!(
            restore_source(&plain, rootfs).unwrap().unwrap().artifact,
            None
        );
        let no_namespace = spec(&[
            (RESTORE_FROM_ANNOTATION, "snap-1"),
            (RESTORE_ARTIFACT_ANNOTATION, artifact),
        ]);
        let e = restore_source(&no_namespace, rootfs).err().unwrap();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
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
