//! The one snapshot directory layout, shared by every writer and reader of
//! VM snapshots (twig-vmm, the node store, the shim, the node daemon).
//!
//! ```text
//! <store>/snapshots/<id>/manifest.json   written by the store when it publishes
//! <store>/snapshots/<id>/state           vCPU, irqchip, clock and device state
//! <store>/snapshots/<id>/memory          guest RAM (all of it, or one layer)
//! <store>/snapshots/<id>/disk<i>         read-write disk i (i = the disk's index)
//! <store>/tmp/<lease>/<id>/              a staging directory handed to a writer
//! ```
//!
//! A snapshot's parent is named **by id** and lives at
//! `<store>/snapshots/<parent-id>`: a sibling directory. Nothing records an
//! absolute path, so a store directory can be moved (or mounted elsewhere)
//! without breaking chains.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Name of the directory of published snapshots inside a store.
pub const SNAPSHOTS_DIR: &str = "snapshots";
/// Name of the staging and deletion area inside a store.
pub const TMP_DIR: &str = "tmp";
/// Name of the directory of read-grant ledgers (one per jailed VMM user)
/// inside a store.
pub const GRANTS_DIR: &str = "grants";
/// Name of a snapshot's manifest.
pub const MANIFEST: &str = "manifest.json";
/// What a staging directory will publish, written by its publisher before
/// it is complete (a snapshot a VM is restored from while its memory is
/// still arriving: [`crate::Staging::describe`]); removed when published.
pub const STAGED: &str = "staged.json";
/// How the name of a staging lease in `tmp/` ends.
pub const LEASE_SUFFIX: &str = ".staging";

/// One file of a VM snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Artefact {
    /// Guest memory (mapped `MAP_PRIVATE` on restore): `memory`.
    Memory,
    /// vCPU, irqchip, clock and device state: `state`.
    State,
    /// Read-write disk `i` (its index among all of the VM's disks): `disk<i>`.
    Disk(usize),
}

impl Artefact {
    /// File name inside a snapshot directory.
    pub fn file_name(self) -> String {
        match self {
            Artefact::Memory => "memory".into(),
            Artefact::State => "state".into(),
            Artefact::Disk(i) => format!("disk{i}"),
        }
    }

    /// The artefact a file of a snapshot directory holds; `None` for any
    /// other name (the manifest included).
    pub fn from_file_name(name: &str) -> Option<Artefact> {
        match name {
            "memory" => Some(Artefact::Memory),
            "state" => Some(Artefact::State),
            _ => {
                let digits = name.strip_prefix("disk")?;
                // Canonical decimal only: `disk01` or `disk+1` would alias `disk1`.
                let canonical = !digits.is_empty()
                    && digits.bytes().all(|b| b.is_ascii_digit())
                    && (digits == "0" || !digits.starts_with('0'));
                if !canonical {
                    return None;
                }
                digits.parse().ok().map(Artefact::Disk)
            }
        }
    }
}

impl fmt::Display for Artefact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file_name())
    }
}

/// Full or incremental, as the manifest records it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Self-contained: all of guest RAM.
    #[default]
    Full,
    /// Only what changed since its parent, which must stay.
    Incremental,
}

/// A snapshot's `manifest.json`. A writer in another process (twig-vmm)
/// writes it into its staging directory together with its artefacts
/// ([`Manifest::of_staging`]): a writer that does vouches that, once it
/// reports success, the artefacts and the manifest are durable (fsynced),
/// so the store does not sync them again (a store publishes only after its
/// writer reported success). The entries of the staging directory are made
/// durable by the publishing rename's directory fsync: on the journaling
/// filesystems a store runs on (XFS, btrfs, ext4), metadata commits in
/// order. The store checks the manifest when publishing and adds its
/// labels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The snapshot's id, its directory's name.
    pub id: String,
    /// The id of its parent, a sibling directory.
    pub parent: Option<String>,
    /// Full or incremental.
    pub kind: Kind,
    /// When the store published it.
    pub created: SystemTime,
    /// Free-form labels (e.g. the pod it was taken from).
    pub labels: BTreeMap<String, String>,
    /// The Kubernetes namespace that owns it (the pod's it was taken from):
    /// only a pod of that namespace may restore it. Set by the publisher
    /// ([`crate::Staging::set_owner`]), never by the writer; `None` for
    /// snapshots taken outside Kubernetes (base templates, `ctr`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Every artefact's file name and size in bytes.
    pub artefacts: BTreeMap<String, u64>,
}

impl Manifest {
    /// The manifest of what `staging` holds now: every artefact and its
    /// size, created now, no labels. Refuses anything in it outside the
    /// layout (the manifest itself aside) and a staging without artefacts.
    pub fn of_staging(
        staging: &Path,
        id: &str,
        parent: Option<&str>,
        kind: Kind,
    ) -> Result<Manifest> {
        validate_id(id)?;
        if (kind == Kind::Incremental) != parent.is_some() {
            return Err(Error::InvalidArgument(format!(
                "snapshot {id:?}: an incremental snapshot needs a parent, a full one has none"
            )));
        }
        Ok(Manifest {
            id: id.to_string(),
            parent: parent.map(str::to_string),
            kind,
            created: SystemTime::now(),
            labels: BTreeMap::new(),
            owner: None,
            artefacts: artefacts_in(staging, id)?,
        })
    }

    /// The manifest's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        serde_json::to_vec_pretty(self).map_err(|e| Error::Io {
            context: "encoding a snapshot manifest".into(),
            source: std::io::Error::other(e),
        })
    }

    /// Writes the manifest into `dir` and fsyncs it and the directory.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = dir.join(MANIFEST);
        crate::fsops::write_durable(&path, &self.to_bytes()?)
            .and_then(|()| crate::fsops::sync_path(dir))
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))
    }
}

/// The artefacts in the snapshot directory `dir` of snapshot `id`, by file
/// name, with their sizes. Anything else there (but the manifests) is
/// refused, and so is a directory without artefacts.
pub fn artefacts_in(dir: &Path, id: &str) -> Result<BTreeMap<String, u64>> {
    let ctx = |e| Error::io(format!("reading {}", dir.display()), e);
    let mut artefacts = BTreeMap::new();
    for entry in std::fs::read_dir(dir).map_err(ctx)? {
        let entry = entry.map_err(ctx)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == MANIFEST || name == STAGED {
            continue;
        }
        let meta = entry.metadata().map_err(ctx)?;
        if Artefact::from_file_name(&name).is_none() || !meta.is_file() {
            return Err(Error::InvalidArgument(format!(
                "snapshot {id:?}: {name:?} is not an artefact (memory, state, disk<i> files)"
            )));
        }
        artefacts.insert(name, meta.len());
    }
    if artefacts.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "snapshot {id:?} has no artefacts to publish"
        )));
    }
    Ok(artefacts)
}

/// The node-store id of app template `name` (a SandboxTemplate) of
/// Kubernetes namespace `namespace`: `template.<namespace>.<name>`. A
/// namespace is a DNS label (no dots), so the first dot after the prefix
/// ends it and no two templates share an id.
pub fn template_id(namespace: &str, name: &str) -> Result<String> {
    let bad = |what: &str, value: &str| {
        Error::InvalidArgument(format!(
            "template {namespace}/{name}: {what} {value:?} is not a Kubernetes {}",
            if what == "namespace" {
                "namespace (a DNS label)"
            } else {
                "object name (a DNS subdomain)"
            }
        ))
    };
    let label = is_dns_label;
    if !label(namespace) {
        return Err(bad("namespace", namespace));
    }
    if name.is_empty() || name.len() > 253 || !name.split('.').all(label) {
        return Err(bad("name", name));
    }
    let id = format!("{TEMPLATE_ID_PREFIX}{namespace}.{name}");
    validate_id(&id)?;
    Ok(id)
}

/// The label of an app template's snapshot holding the egress policy (JSON,
/// twig-net's `EgressPolicy`) of the pods restored from it; none: the
/// built-in default. The node daemon keeps it current
/// (`NodeStore::set_label`). twig-proto's contract defines it.
pub use twig_proto::contract::labels::TEMPLATE_EGRESS_POLICY as TEMPLATE_POLICY_LABEL;

/// What every app template's node-store id starts with ([`template_id`]).
pub const TEMPLATE_ID_PREFIX: &str = "template.";

/// Whether `s` is a DNS label as Kubernetes names namespaces: 1–63 of
/// `[a-z0-9-]`.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Checks a snapshot's owning namespace ([`Manifest::owner`]): a Kubernetes
/// namespace name (a DNS label).
pub fn validate_owner(namespace: &str) -> Result<()> {
    if is_dns_label(namespace) {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "owner {namespace:?} is not a Kubernetes namespace (a DNS label)"
        )))
    }
}

/// Checks a snapshot id: 1–128 of `[A-Za-z0-9._-]`, not starting with `.`.
pub fn validate_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "invalid snapshot id {id:?}: use 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
        )))
    }
}

fn name_of(path: &Path) -> Result<String> {
    let id = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| {
            Error::InvalidArgument(format!("{} names no snapshot directory", path.display()))
        })?
        .to_string();
    validate_id(&id)?;
    Ok(id)
}

/// Where a published snapshot directory `<store>/snapshots/<id>` sits:
/// its store's root and its id. Refuses paths of any other shape.
pub fn locate(snapshot_dir: &Path) -> Result<(PathBuf, String)> {
    let id = name_of(snapshot_dir)?;
    let snapshots = snapshot_dir.parent().filter(|p| {
        p.file_name()
            .is_some_and(|n| n == std::ffi::OsStr::new(SNAPSHOTS_DIR))
    });
    let root = snapshots.and_then(Path::parent).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{} is not a snapshot directory of a store (<store>/{SNAPSHOTS_DIR}/<id>)",
            snapshot_dir.display()
        ))
    })?;
    Ok((root.to_path_buf(), id))
}

/// The directory of `parent_id`, the parent of the snapshot in
/// `snapshot_dir`: its sibling, wherever the store has been moved.
pub fn parent_dir(snapshot_dir: &Path, parent_id: &str) -> Result<PathBuf> {
    validate_id(parent_id)?;
    let siblings = snapshot_dir.parent().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{} has no parent directory to hold its parent snapshot",
            snapshot_dir.display()
        ))
    })?;
    Ok(siblings.join(parent_id))
}

/// For a staging directory handed out by a store (`<store>/tmp/<lease>/<id>`),
/// the snapshot's id and the directory it will be published as
/// (`<store>/snapshots/<id>`). Writers record the latter as the snapshot's
/// home before it exists.
pub fn staging_target(staging: &Path) -> Result<(String, PathBuf)> {
    let id = name_of(staging)?;
    let lease = staging.parent().filter(|l| {
        l.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(LEASE_SUFFIX))
    });
    let tmp = lease.and_then(Path::parent).filter(|p| {
        p.file_name()
            .is_some_and(|n| n == std::ffi::OsStr::new(TMP_DIR))
    });
    let root = tmp.and_then(Path::parent).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{} is not a staging directory of a store (<store>/{TMP_DIR}/<lease>/<id>)",
            staging.display()
        ))
    })?;
    let published = root.join(SNAPSHOTS_DIR).join(&id);
    Ok((id, published))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_ids_are_unique_per_namespace_and_refuse_what_kubernetes_refuses() {
        assert_eq!(
            template_id("agents", "py.v2").unwrap(),
            "template.agents.py.v2"
        );
        assert_ne!(
            template_id("a", "b.c").unwrap(),
            template_id("a-b", "c").unwrap()
        );
        for (ns, name) in [
            ("", "x"),
            ("a.b", "x"),
            ("Default", "x"),
            ("ns", ""),
            ("ns", "x/y"),
            ("ns", "a..b"),
            ("ns", &"x".repeat(120)),
        ] {
            let e = template_id(ns, name).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{ns}/{name}: {e}");
        }
    }

    #[test]
    fn artefact_names_round_trip_and_refuse_aliases() {
        for a in [
            Artefact::Memory,
            Artefact::State,
            Artefact::Disk(0),
            Artefact::Disk(10),
        ] {
            assert_eq!(Artefact::from_file_name(&a.file_name()), Some(a));
        }
        for bad in [
            "disk", "disk01", "disk+1", "disk-1", "disk.img", MANIFEST, "x",
        ] {
            assert_eq!(Artefact::from_file_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn paths_follow_the_layout_and_refuse_other_shapes() {
        let (root, id) = locate(Path::new("/s/snapshots/a.1")).unwrap();
        assert_eq!((root.as_path(), id.as_str()), (Path::new("/s"), "a.1"));
        assert!(locate(Path::new("/s/other/a")).is_err());
        assert!(locate(Path::new("/s/snapshots/..")).is_err());
        let (id, dest) = staging_target(Path::new("/s/tmp/a.1.0.staging/a")).unwrap();
        assert_eq!(id, "a");
        assert_eq!(dest, Path::new("/s/snapshots/a"));
        assert!(staging_target(Path::new("/s/a.staging/a")).is_err());
        assert!(
            staging_target(Path::new("/tmp/.tmpX/a")).is_err(),
            "not a lease"
        );
        assert_eq!(
            parent_dir(Path::new("/moved/snapshots/b"), "a").unwrap(),
            Path::new("/moved/snapshots/a")
        );
        assert!(parent_dir(Path::new("/s/snapshots/b"), "../x").is_err());
    }
}
