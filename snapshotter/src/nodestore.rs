//! The node store for VM snapshots (memory, state, disk), shared by the shim
//! (which writes and restores snapshots) and the controller (which lists,
//! accounts and deletes them). Several processes may use one store at once:
//! every change is a rename on the filesystem, and staging directories are
//! `flock`ed by their writer so that `cleanup` never takes one in use.
//!
//! ```text
//! <root>/snapshots/<name>/manifest.json   published, immutable
//! <root>/snapshots/<name>/{memory,state,disk.img}
//! <root>/tmp/                              staging and deletion area
//! ```

use crate::error::{ctx, Error, Result};
use crate::fsops::{self, CloneMode, Usage};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

const MANIFEST: &str = "manifest.json";

/// One artefact of a VM snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Artefact {
    /// Guest memory image (mapped `MAP_PRIVATE` on restore).
    Memory,
    /// vCPU, irqchip, clock and device state.
    State,
    /// The writable disk (an ext4 image), reflinked per restored pod.
    Disk,
}

impl Artefact {
    pub const ALL: [Artefact; 3] = [Artefact::Memory, Artefact::State, Artefact::Disk];

    /// File name inside a snapshot directory.
    pub fn file_name(self) -> &'static str {
        match self {
            Artefact::Memory => "memory",
            Artefact::State => "state",
            Artefact::Disk => "disk.img",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Manifest {
    name: String,
    parent: Option<String>,
    created: SystemTime,
    labels: BTreeMap<String, String>,
    /// Present artefacts and their sizes in bytes.
    artefacts: BTreeMap<Artefact, u64>,
}

/// A published VM snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmSnapshot {
    pub name: String,
    /// The snapshot this one was taken on top of (for incremental memory).
    pub parent: Option<String>,
    pub created: SystemTime,
    pub labels: BTreeMap<String, String>,
    /// Present artefacts with their sizes in bytes.
    pub artefacts: BTreeMap<Artefact, u64>,
    dir: PathBuf,
}

impl VmSnapshot {
    /// Path of an artefact (read-only by convention: published snapshots are
    /// immutable; reflink it out with [`NodeStore::reflink_out`] to write).
    pub fn path(&self, a: Artefact) -> Option<PathBuf> {
        self.artefacts
            .contains_key(&a)
            .then(|| self.dir.join(a.file_name()))
    }
}

/// The store. Cheap to open; holds no in-memory index.
pub struct NodeStore {
    root: PathBuf,
    mode: CloneMode,
    seq: AtomicU64,
}

/// Checks a snapshot name: 1–128 of `[A-Za-z0-9._-]`, not starting with `.`.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "invalid VM snapshot name {name:?}: use 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
        )))
    }
}

impl NodeStore {
    /// Opens (creating if needed) the store at `root`. Refuses a filesystem
    /// without reflink unless `allow_copy`. Removes abandoned staging.
    pub fn open(root: &Path, allow_copy: bool) -> Result<NodeStore> {
        for dir in [root.join("snapshots"), root.join("tmp")] {
            fs::create_dir_all(&dir).map_err(ctx(format!("creating {}", dir.display())))?;
        }
        let mode = match fsops::probe_reflink(&root.join("tmp")) {
            Ok(()) => CloneMode::Reflink,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                return Err(Error::io(
                    format!("probing reflink in {}", root.display()),
                    e,
                ))
            }
            Err(source) if !allow_copy => {
                return Err(Error::NoReflink {
                    root: root.to_path_buf(),
                    source,
                })
            }
            Err(_) => CloneMode::Copy,
        };
        let store = NodeStore {
            root: root.to_path_buf(),
            mode,
            seq: AtomicU64::new(0),
        };
        store.cleanup()?;
        Ok(store)
    }

    /// Whether artefacts are reflinked or copied.
    pub fn clone_mode(&self) -> CloneMode {
        self.mode
    }

    fn published(&self, name: &str) -> PathBuf {
        self.root.join("snapshots").join(name)
    }

    fn tmp_name(&self, name: &str, what: &str) -> PathBuf {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        self.root
            .join("tmp")
            .join(format!("{name}.{}.{seq}.{what}", std::process::id()))
    }

    /// Starts a new snapshot `name`, staged privately until
    /// [`Staging::publish`]. Dropping the staging discards it.
    pub fn stage(&self, name: &str) -> Result<Staging<'_>> {
        validate_name(name)?;
        if self.published(name).exists() {
            return Err(Error::AlreadyExists(format!("VM snapshot {name:?}")));
        }
        let dir = self.tmp_name(name, "staging");
        fs::create_dir(&dir).map_err(ctx(format!("creating {}", dir.display())))?;
        let lock = File::open(&dir).map_err(ctx(format!("opening {}", dir.display())))?;
        if !fsops::try_flock(&lock).map_err(ctx(format!("locking {}", dir.display())))? {
            return Err(Error::FailedPrecondition(format!(
                "staging directory {} is locked by someone else",
                dir.display()
            )));
        }
        Ok(Staging {
            store: self,
            name: name.to_string(),
            dir,
            _lock: lock,
            parent: None,
            labels: BTreeMap::new(),
            published: false,
        })
    }

    /// A published snapshot.
    pub fn get(&self, name: &str) -> Result<VmSnapshot> {
        validate_name(name)?;
        let dir = self.published(name);
        let path = dir.join(MANIFEST);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotFound(format!("VM snapshot {name:?}")))
            }
            Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
        };
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        Ok(VmSnapshot {
            name: m.name,
            parent: m.parent,
            created: m.created,
            labels: m.labels,
            artefacts: m.artefacts,
            dir,
        })
    }

    /// Every published snapshot, by name.
    pub fn list(&self) -> Result<Vec<VmSnapshot>> {
        let dir = self.root.join("snapshots");
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).map_err(ctx(format!("reading {}", dir.display())))? {
            let entry = entry.map_err(ctx(format!("reading {}", dir.display())))?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if validate_name(&name).is_err() {
                continue;
            }
            match self.get(&name) {
                Ok(s) => out.push(s),
                // Deleted between read_dir and get.
                Err(Error::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Deletes a published snapshot. Refused while another snapshot names it
    /// as parent.
    pub fn delete(&self, name: &str) -> Result<()> {
        self.get(name)?;
        if let Some(child) = self
            .list()?
            .into_iter()
            .find(|s| s.parent.as_deref() == Some(name))
        {
            return Err(Error::FailedPrecondition(format!(
                "cannot delete VM snapshot {name:?}: {:?} is its child",
                child.name
            )));
        }
        let dir = self.published(name);
        let lock = File::open(&dir).map_err(ctx(format!("opening {}", dir.display())))?;
        if !fsops::try_flock(&lock).map_err(ctx(format!("locking {}", dir.display())))? {
            return Err(Error::FailedPrecondition(format!(
                "VM snapshot {name:?} is being deleted by someone else"
            )));
        }
        let doomed = self.tmp_name(name, "deleted");
        match fs::rename(&dir, &doomed) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotFound(format!("VM snapshot {name:?}")))
            }
            Err(e) => {
                return Err(Error::io(
                    format!("moving {} to {}", dir.display(), doomed.display()),
                    e,
                ))
            }
        }
        let snapshots = self.root.join("snapshots");
        fsops::sync_path(&snapshots).map_err(ctx(format!("syncing {}", snapshots.display())))?;
        fsops::remove_all(&doomed).map_err(ctx(format!("removing {}", doomed.display())))
    }

    /// Reflinks (or, in copy mode, copies) a published artefact to `dest`,
    /// which must not exist: e.g. the writable disk of a pod restored from
    /// the snapshot.
    pub fn reflink_out(&self, name: &str, a: Artefact, dest: &Path) -> Result<()> {
        let snap = self.get(name)?;
        let src = snap
            .path(a)
            .ok_or_else(|| Error::NotFound(format!("{} of VM snapshot {name:?}", a.file_name())))?;
        fsops::clone_file(self.mode, &src, dest).map_err(ctx(format!(
            "cloning {} to {}",
            src.display(),
            dest.display()
        )))?;
        fsops::sync_path(dest).map_err(ctx(format!("syncing {}", dest.display())))
    }

    /// Space of one snapshot's artefacts.
    pub fn usage_of(&self, name: &str) -> Result<Usage> {
        let snap = self.get(name)?;
        let files: Vec<PathBuf> = Artefact::ALL.iter().filter_map(|a| snap.path(*a)).collect();
        fsops::usage_of(files.iter().map(PathBuf::as_path))
            .map_err(ctx(format!("accounting VM snapshot {name:?}")))
    }

    /// Space of the whole store; blocks shared between snapshots count once
    /// in `unique_bytes`.
    pub fn usage(&self) -> Result<Usage> {
        let files: Vec<PathBuf> = self
            .list()?
            .iter()
            .flat_map(|s| Artefact::ALL.iter().filter_map(|a| s.path(*a)))
            .collect();
        fsops::usage_of(files.iter().map(PathBuf::as_path))
            .map_err(ctx(format!("accounting {}", self.root.display())))
    }

    /// Removes staging and deletion leftovers nobody holds a lock on (e.g.
    /// after a crash). Returns how many entries were removed.
    pub fn cleanup(&self) -> Result<usize> {
        let tmp = self.root.join("tmp");
        let mut removed = 0;
        for entry in fs::read_dir(&tmp).map_err(ctx(format!("reading {}", tmp.display())))? {
            let entry = entry.map_err(ctx(format!("reading {}", tmp.display())))?;
            let path = entry.path();
            let held = match File::open(&path) {
                Ok(f) => {
                    !fsops::try_flock(&f).map_err(ctx(format!("locking {}", path.display())))?
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
            };
            if held {
                continue;
            }
            fsops::remove_all(&path).map_err(ctx(format!("removing {}", path.display())))?;
            removed += 1;
        }
        Ok(removed)
    }
}

/// A snapshot being written. Put artefacts, then [`Staging::publish`].
pub struct Staging<'a> {
    store: &'a NodeStore,
    name: String,
    dir: PathBuf,
    _lock: File,
    parent: Option<String>,
    labels: BTreeMap<String, String>,
    published: bool,
}

impl Staging<'_> {
    /// Where to write an artefact directly (e.g. the VMM dumps memory here).
    pub fn path(&self, a: Artefact) -> PathBuf {
        self.dir.join(a.file_name())
    }

    /// Reflinks (or copies) `src` in as artefact `a`.
    pub fn put_file(&mut self, a: Artefact, src: &Path) -> Result<()> {
        let dest = self.path(a);
        fsops::remove_all(&dest).map_err(ctx(format!("replacing {}", dest.display())))?;
        fsops::clone_file(self.store.mode, src, &dest).map_err(ctx(format!(
            "cloning {} to {}",
            src.display(),
            dest.display()
        )))
    }

    /// Writes artefact `a` from bytes.
    pub fn put_bytes(&mut self, a: Artefact, bytes: &[u8]) -> Result<()> {
        let dest = self.path(a);
        fsops::write_durable(&dest, bytes).map_err(ctx(format!("writing {}", dest.display())))
    }

    /// Records the snapshot this one is taken on top of (must be published).
    pub fn set_parent(&mut self, parent: &str) -> Result<()> {
        self.store.get(parent)?;
        self.parent = Some(parent.to_string());
        Ok(())
    }

    /// Sets a free-form label.
    pub fn set_label(&mut self, key: &str, value: &str) {
        self.labels.insert(key.to_string(), value.to_string());
    }

    /// fsyncs every artefact and the manifest, then atomically renames the
    /// staging directory into place. Fails with `AlreadyExists` if the name
    /// was published meanwhile; nothing is visible before this returns Ok.
    pub fn publish(mut self) -> Result<VmSnapshot> {
        let mut artefacts = BTreeMap::new();
        for a in Artefact::ALL {
            let p = self.path(a);
            match fs::metadata(&p) {
                Ok(m) => {
                    fsops::sync_path(&p).map_err(ctx(format!("syncing {}", p.display())))?;
                    artefacts.insert(a, m.len());
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(format!("inspecting {}", p.display()), e)),
            }
        }
        if artefacts.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "VM snapshot {:?} has no artefacts to publish",
                self.name
            )));
        }
        let manifest = Manifest {
            name: self.name.clone(),
            parent: self.parent.clone(),
            created: SystemTime::now(),
            labels: self.labels.clone(),
            artefacts,
        };
        let bytes = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Io {
            context: "encoding a VM snapshot manifest".into(),
            source: std::io::Error::other(e),
        })?;
        let mpath = self.dir.join(MANIFEST);
        fsops::write_durable(&mpath, &bytes)
            .map_err(ctx(format!("writing {}", mpath.display())))?;
        fsops::sync_path(&self.dir).map_err(ctx(format!("syncing {}", self.dir.display())))?;
        let dest = self.store.published(&self.name);
        fsops::rename_noreplace(&self.dir, &dest).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                Error::AlreadyExists(format!("VM snapshot {:?}", self.name))
            } else {
                Error::io(
                    format!("publishing {} as {}", self.dir.display(), dest.display()),
                    e,
                )
            }
        })?;
        self.published = true;
        let snapshots = self.store.root.join("snapshots");
        fsops::sync_path(&snapshots).map_err(ctx(format!("syncing {}", snapshots.display())))?;
        tracing::debug!(name = %self.name, "VM snapshot published");
        self.store.get(&self.name)
    }
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        if !self.published {
            if let Err(e) = fsops::remove_all(&self.dir) {
                tracing::warn!(path = %self.dir.display(), error = %e, "leaving staging for cleanup");
            }
        }
    }
}
