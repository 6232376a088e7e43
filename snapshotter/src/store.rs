//! The snapshot store behind the containerd snapshotter: every snapshot is a
//! directory holding an ext4 image and a small JSON record.
//!
//! Layout under the root (which must be on a reflink-capable filesystem):
//!
//! ```text
//! lock                 flock: one process owns the store
//! base-<bytes>.img     empty ext4 image every parentless snapshot is cloned from
//! snapshots/<id>/      published snapshots: rootfs.img + info.json
//! tmp/                 staging and removal area, emptied at start and by Cleanup
//! ```
//!
//! A snapshot becomes visible only by the atomic rename of its fully written,
//! fsynced staging directory into `snapshots/`; metadata changes (commit,
//! update) replace `info.json` by rename. A crash at any point therefore
//! leaves either the old or the new state plus leftovers in `tmp/`.

use crate::error::{ctx, Error, Result};
use crate::filter::Filter;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;
use twig_store::fsops::{self, CloneMode};

const IMAGE: &str = "rootfs.img";
const INFO: &str = "info.json";

/// Kind of a snapshot, as containerd defines it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Read-only snapshot of a committed parent.
    View,
    /// Writable snapshot; can be committed.
    Active,
    /// Immutable; can be a parent.
    Committed,
}

impl Kind {
    /// containerd's name of the kind.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::View => "view",
            Kind::Active => "active",
            Kind::Committed => "committed",
        }
    }
}

/// What containerd's `Stat` returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    /// The key (active, view) or name (committed).
    pub name: String,
    /// The committed parent's name.
    pub parent: Option<String>,
    /// Active, view or committed.
    pub kind: Kind,
    /// When it was created (committed: when it was committed).
    pub created: SystemTime,
    /// When it last changed.
    pub updated: SystemTime,
    /// containerd's labels, verbatim.
    pub labels: BTreeMap<String, String>,
}

/// One mount as containerd consumes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The filesystem type (`ext4`).
    pub fstype: String,
    /// The image file.
    pub source: PathBuf,
    /// Mount options (`rw`/`ro`, `loop`).
    pub options: Vec<String>,
}

/// How the twig shim reads a rootfs mount containerd hands it: a mount of
/// type `ext4` with the `loop` option is a twig snapshot, and its `source` is
/// the image file to attach to the VM as virtio-blk (instead of mounting it).
/// Any other mount is not a twig block image.
pub fn block_image(fstype: &str, source: &str, options: &[String]) -> Option<PathBuf> {
    (fstype == "ext4" && options.iter().any(|o| o == "loop") && !source.is_empty())
        .then(|| PathBuf::from(source))
}

/// Disk use of one snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotUsage {
    /// Bytes of the image's blocks not shared with any other file.
    pub size: u64,
    /// Inodes in use in the image's filesystem (from its superblock).
    pub inodes: u64,
}

/// How to open a [`SnapshotStore`].
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Apparent size of every image (sparse); the ext4 filesystem's size.
    pub image_size: u64,
    /// Allow full copies when the filesystem cannot reflink.
    pub allow_copy: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            image_size: 4 << 30,
            allow_copy: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    key: String,
    kind: Kind,
    parent: Option<u64>,
    created: SystemTime,
    updated: SystemTime,
    labels: BTreeMap<String, String>,
}

struct Entry {
    rec: Record,
    /// Being staged: reserved, not yet visible.
    pending: bool,
}

#[derive(Default)]
struct State {
    by_key: HashMap<String, u64>,
    entries: HashMap<u64, Entry>,
    next_id: u64,
    /// Names in `tmp/` that an operation in flight owns.
    staging: HashSet<String>,
}

impl State {
    fn visible(&self, key: &str) -> Option<(u64, &Entry)> {
        let id = *self.by_key.get(key)?;
        let e = self.entries.get(&id)?;
        (!e.pending).then_some((id, e))
    }

    fn info(&self, rec: &Record) -> Info {
        Info {
            name: rec.key.clone(),
            parent: rec
                .parent
                .and_then(|p| self.entries.get(&p))
                .map(|p| p.rec.key.clone()),
            kind: rec.kind,
            created: rec.created,
            updated: rec.updated,
            labels: rec.labels.clone(),
        }
    }
}

/// The containerd-facing snapshot store. All methods are blocking and safe to
/// call from many threads at once.
pub struct SnapshotStore {
    root: PathBuf,
    mode: CloneMode,
    base: PathBuf,
    state: Mutex<State>,
    tmp_seq: AtomicU64,
    _lock: File,
}

impl SnapshotStore {
    /// Opens (creating if needed) a store at `root`: takes its lock, checks
    /// reflink support, removes staging leftovers and loads the snapshots.
    pub fn open(root: &Path, opts: &StoreOptions) -> Result<SnapshotStore> {
        for dir in [root.to_path_buf(), root.join("snapshots"), root.join("tmp")] {
            fs::create_dir_all(&dir).map_err(ctx(format!("creating {}", dir.display())))?;
        }
        let lock = File::open(root).map_err(ctx(format!("opening {}", root.display())))?;
        if !fsops::try_flock(&lock).map_err(ctx(format!("locking {}", root.display())))? {
            return Err(Error::Locked(root.to_path_buf()));
        }
        let tmp = root.join("tmp");
        let mode = match fsops::probe_reflink(&tmp) {
            Ok(()) => CloneMode::Reflink,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                return Err(Error::io(
                    format!("probing reflink in {}", tmp.display()),
                    e,
                ));
            }
            Err(source) if !opts.allow_copy => {
                return Err(Error::NoReflink {
                    root: root.to_path_buf(),
                    source,
                })
            }
            Err(e) => {
                tracing::warn!(root = %root.display(), error = %e,
                    "no reflink support: images are copied in full (--allow-copy)");
                CloneMode::Copy
            }
        };
        let removed = clear_dir(&tmp, &HashSet::new())?;
        if removed > 0 {
            tracing::info!(removed, "removed staging leftovers of an earlier run");
        }
        let state = load(root)?;
        let base = root.join(format!("base-{}.img", opts.image_size));
        if !base.exists() {
            make_base_image(&tmp, &base, opts.image_size)?;
        }
        tracing::info!(root = %root.display(), ?mode, snapshots = state.entries.len(), "store opened");
        Ok(SnapshotStore {
            root: root.to_path_buf(),
            mode,
            base,
            state: Mutex::new(state),
            tmp_seq: AtomicU64::new(0),
            _lock: lock,
        })
    }

    /// Whether children are reflinks or full copies.
    pub fn clone_mode(&self) -> CloneMode {
        self.mode
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the index half-updated
        // in a way the on-disk state disagrees with, so poisoning is ignored.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn dir_of(&self, id: u64) -> PathBuf {
        self.root.join("snapshots").join(id.to_string())
    }

    /// Path of the ext4 image of snapshot `id`.
    fn image_of(&self, id: u64) -> PathBuf {
        self.dir_of(id).join(IMAGE)
    }

    /// Creates an active snapshot `key` on top of committed `parent`.
    pub fn prepare(
        &self,
        key: &str,
        parent: Option<&str>,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>> {
        self.create(key, parent, Kind::Active, labels)
    }

    /// Creates a read-only view `key` of committed `parent`.
    pub fn view(
        &self,
        key: &str,
        parent: Option<&str>,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>> {
        self.create(key, parent, Kind::View, labels)
    }

    fn create(
        &self,
        key: &str,
        parent: Option<&str>,
        kind: Kind,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>> {
        if key.is_empty() {
            return Err(Error::InvalidArgument(
                "snapshot key must not be empty".into(),
            ));
        }
        let now = SystemTime::now();
        let (id, source, rec) = {
            let mut st = self.lock();
            if st.by_key.contains_key(key) {
                return Err(Error::AlreadyExists(format!("snapshot {key:?}")));
            }
            let parent_id = match parent {
                None => None,
                Some(p) => {
                    let (pid, pe) = st
                        .visible(p)
                        .ok_or_else(|| Error::NotFound(format!("parent snapshot {p:?}")))?;
                    if pe.rec.kind != Kind::Committed {
                        return Err(Error::FailedPrecondition(format!(
                            "parent snapshot {p:?} is {}, only committed snapshots can be parents",
                            pe.rec.kind.as_str()
                        )));
                    }
                    Some(pid)
                }
            };
            let id = st.next_id;
            st.next_id += 1;
            let rec = Record {
                key: key.to_string(),
                kind,
                parent: parent_id,
                created: now,
                updated: now,
                labels,
            };
            st.by_key.insert(key.to_string(), id);
            st.entries.insert(
                id,
                Entry {
                    rec: rec.clone(),
                    pending: true,
                },
            );
            st.staging.insert(id.to_string());
            let source = parent_id.map_or_else(|| self.base.clone(), |p| self.image_of(p));
            (id, source, rec)
        };
        let staged = self.root.join("tmp").join(id.to_string());
        let result = self.stage_and_publish(id, &staged, &source, &rec);
        let mut st = self.lock();
        st.staging.remove(&id.to_string());
        match result {
            Ok(()) => {
                if let Some(e) = st.entries.get_mut(&id) {
                    e.pending = false;
                }
                drop(st);
                tracing::debug!(key, id, kind = kind.as_str(), "snapshot created");
                Ok(self.mounts_for(id, kind))
            }
            Err(e) => {
                st.entries.remove(&id);
                st.by_key.remove(key);
                drop(st);
                if let Err(rm) = fsops::remove_all(&staged) {
                    tracing::warn!(path = %staged.display(), error = %rm, "leaving staging dir for Cleanup");
                }
                tracing::warn!(key, error = %e, "creating snapshot failed");
                Err(e)
            }
        }
    }

    fn stage_and_publish(&self, id: u64, staged: &Path, source: &Path, rec: &Record) -> Result<()> {
        fs::create_dir(staged).map_err(ctx(format!("creating {}", staged.display())))?;
        let image = staged.join(IMAGE);
        fsops::clone_file(self.mode, source, &image).map_err(ctx(format!(
            "cloning {} to {}",
            source.display(),
            image.display()
        )))?;
        fsops::sync_path(&image).map_err(ctx(format!("syncing {}", image.display())))?;
        let info = staged.join(INFO);
        fsops::write_durable(&info, &encode(rec)?)
            .map_err(ctx(format!("writing {}", info.display())))?;
        fsops::sync_path(staged).map_err(ctx(format!("syncing {}", staged.display())))?;
        let dest = self.dir_of(id);
        fsops::rename_noreplace(staged, &dest).map_err(ctx(format!(
            "publishing {} as {}",
            staged.display(),
            dest.display()
        )))?;
        let parent = self.root.join("snapshots");
        fsops::sync_path(&parent).map_err(ctx(format!("syncing {}", parent.display())))
    }

    fn mounts_for(&self, id: u64, kind: Kind) -> Vec<Mount> {
        let access = if kind == Kind::View { "ro" } else { "rw" };
        vec![Mount {
            fstype: "ext4".into(),
            source: self.image_of(id),
            options: vec![access.into(), "loop".into()],
        }]
    }

    /// Mounts of an active snapshot or view.
    pub fn mounts(&self, key: &str) -> Result<Vec<Mount>> {
        let st = self.lock();
        let (id, e) = st
            .visible(key)
            .ok_or_else(|| Error::NotFound(format!("snapshot {key:?}")))?;
        if e.rec.kind == Kind::Committed {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {key:?} is committed; only active snapshots and views have mounts"
            )));
        }
        Ok(self.mounts_for(id, e.rec.kind))
    }

    /// Commits active snapshot `key` as `name`; `key` disappears.
    pub fn commit(&self, name: &str, key: &str, labels: BTreeMap<String, String>) -> Result<()> {
        if name.is_empty() {
            return Err(Error::InvalidArgument(
                "commit name must not be empty".into(),
            ));
        }
        let mut st = self.lock();
        let (id, e) = st
            .visible(key)
            .ok_or_else(|| Error::NotFound(format!("snapshot {key:?}")))?;
        if e.rec.kind != Kind::Active {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {key:?} is {}; only active snapshots can be committed",
                e.rec.kind.as_str()
            )));
        }
        if st.by_key.contains_key(name) {
            return Err(Error::AlreadyExists(format!("snapshot {name:?}")));
        }
        let image = self.image_of(id);
        fsops::sync_path(&image).map_err(ctx(format!("syncing {}", image.display())))?;
        let now = SystemTime::now();
        let rec = Record {
            key: name.to_string(),
            kind: Kind::Committed,
            parent: e.rec.parent,
            created: now,
            updated: now,
            labels,
        };
        self.write_record(id, &rec)?;
        st.by_key.remove(key);
        st.by_key.insert(name.to_string(), id);
        if let Some(e) = st.entries.get_mut(&id) {
            e.rec = rec;
        }
        tracing::debug!(key, name, id, "snapshot committed");
        Ok(())
    }

    /// Replaces `snapshots/<id>/info.json` atomically.
    fn write_record(&self, id: u64, rec: &Record) -> Result<()> {
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = self.root.join("tmp").join(format!("{id}.{seq}.info"));
        let dest = self.dir_of(id).join(INFO);
        let result = fsops::write_durable(&tmp, &encode(rec)?)
            .map_err(ctx(format!("writing {}", tmp.display())))
            .and_then(|()| {
                fs::rename(&tmp, &dest).map_err(ctx(format!(
                    "replacing {} with {}",
                    dest.display(),
                    tmp.display()
                )))
            });
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result?;
        let dir = self.dir_of(id);
        fsops::sync_path(&dir).map_err(ctx(format!("syncing {}", dir.display())))
    }

    /// Removes a snapshot without children.
    pub fn remove(&self, key: &str) -> Result<()> {
        let mut st = self.lock();
        let (id, _) = st
            .visible(key)
            .ok_or_else(|| Error::NotFound(format!("snapshot {key:?}")))?;
        if let Some(child) = st.entries.values().find(|c| c.rec.parent == Some(id)) {
            return Err(Error::FailedPrecondition(format!(
                "cannot remove snapshot {key:?}: snapshot {:?} is its child",
                child.rec.key
            )));
        }
        let dir = self.dir_of(id);
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let doomed = self.root.join("tmp").join(format!("{id}.{seq}.removed"));
        fs::rename(&dir, &doomed).map_err(ctx(format!(
            "moving {} to {}",
            dir.display(),
            doomed.display()
        )))?;
        let snapshots = self.root.join("snapshots");
        fsops::sync_path(&snapshots).map_err(ctx(format!("syncing {}", snapshots.display())))?;
        st.entries.remove(&id);
        st.by_key.remove(key);
        if let Err(e) = fsops::remove_all(&doomed) {
            tracing::warn!(path = %doomed.display(), error = %e, "leaving removed snapshot for Cleanup");
        }
        tracing::debug!(key, id, "snapshot removed");
        Ok(())
    }

    /// Information about one snapshot.
    pub fn stat(&self, key: &str) -> Result<Info> {
        let st = self.lock();
        let (_, e) = st
            .visible(key)
            .ok_or_else(|| Error::NotFound(format!("snapshot {key:?}")))?;
        Ok(st.info(&e.rec))
    }

    /// Updates the labels of `info.name`. `paths` as containerd's field mask:
    /// empty or `labels` replaces all labels, `labels.<k>` sets or (when absent
    /// from `info`) deletes one. Nothing else is mutable.
    pub fn update(&self, info: &Info, paths: &[String]) -> Result<Info> {
        for p in paths {
            if p != "labels" && !p.starts_with("labels.") {
                return Err(Error::InvalidArgument(format!(
                    "cannot update field {p:?} of snapshot {:?}: only labels are mutable",
                    info.name
                )));
            }
        }
        let mut st = self.lock();
        let (id, e) = st
            .visible(&info.name)
            .ok_or_else(|| Error::NotFound(format!("snapshot {:?}", info.name)))?;
        let mut rec = e.rec.clone();
        if paths.is_empty() || paths.iter().any(|p| p == "labels") {
            rec.labels = info.labels.clone();
        }
        for p in paths {
            if let Some(k) = p.strip_prefix("labels.") {
                match info.labels.get(k) {
                    Some(v) if !v.is_empty() => {
                        rec.labels.insert(k.to_string(), v.clone());
                    }
                    _ => {
                        rec.labels.remove(k);
                    }
                }
            }
        }
        rec.updated = SystemTime::now();
        self.write_record(id, &rec)?;
        let out = st.info(&rec);
        if let Some(e) = st.entries.get_mut(&id) {
            e.rec = rec;
        }
        Ok(out)
    }

    /// Path of the ext4 image of any snapshot. Committed images must be
    /// treated as read-only; the image of an active snapshot is what the
    /// twig shim hands to a VM as its virtio-blk root disk.
    pub fn image_path(&self, key: &str) -> Result<PathBuf> {
        let st = self.lock();
        let (id, _) = st
            .visible(key)
            .ok_or_else(|| Error::NotFound(format!("snapshot {key:?}")))?;
        Ok(self.image_of(id))
    }

    /// Space of one snapshot: its own (unshared) blocks and used inodes.
    pub fn usage(&self, key: &str) -> Result<SnapshotUsage> {
        let image = {
            let st = self.lock();
            let (id, _) = st
                .visible(key)
                .ok_or_else(|| Error::NotFound(format!("snapshot {key:?}")))?;
            self.image_of(id)
        };
        let size = fsops::extents(&image)
            .map_err(ctx(format!("mapping extents of {}", image.display())))?
            .iter()
            .filter(|e| !e.shared)
            .map(|e| e.length)
            .sum();
        let inodes = ext4_used_inodes(&image)?;
        Ok(SnapshotUsage { size, inodes })
    }

    /// Every visible snapshot that matches any of `filters` (all when empty).
    pub fn list(&self, filters: &[Filter]) -> Vec<Info> {
        let st = self.lock();
        let mut out: Vec<Info> = st
            .entries
            .values()
            .filter(|e| !e.pending)
            .map(|e| st.info(&e.rec))
            .filter(|i| filters.is_empty() || filters.iter().any(|f| f.matches(i)))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Removes leftovers in `tmp/` that no operation in flight owns. Returns
    /// how many entries were removed.
    pub fn cleanup(&self) -> Result<usize> {
        let st = self.lock();
        clear_dir(&self.root.join("tmp"), &st.staging)
    }

    /// Space used by all images of the store together (shared blocks once).
    pub fn disk_usage(&self) -> Result<fsops::Usage> {
        let images: Vec<PathBuf> = {
            let st = self.lock();
            st.entries
                .iter()
                .filter(|(_, e)| !e.pending)
                .map(|(id, _)| self.image_of(*id))
                .collect()
        };
        fsops::usage_of(images.iter().map(PathBuf::as_path)).map_err(ctx(format!(
            "accounting images under {}",
            self.root.display()
        )))
    }
}

fn encode(rec: &Record) -> Result<Vec<u8>> {
    serde_json::to_vec_pretty(rec).map_err(|e| Error::Io {
        context: "encoding snapshot record".into(),
        source: io::Error::other(e),
    })
}

/// Removes every entry of `dir` whose name is not in `keep`.
fn clear_dir(dir: &Path, keep: &HashSet<String>) -> Result<usize> {
    let mut removed = 0;
    for entry in fs::read_dir(dir).map_err(ctx(format!("reading {}", dir.display())))? {
        let entry = entry.map_err(ctx(format!("reading {}", dir.display())))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if keep.contains(&name) {
            continue;
        }
        let path = entry.path();
        fsops::remove_all(&path).map_err(ctx(format!("removing {}", path.display())))?;
        removed += 1;
    }
    Ok(removed)
}

fn load(root: &Path) -> Result<State> {
    let dir = root.join("snapshots");
    let mut st = State::default();
    for entry in fs::read_dir(&dir).map_err(ctx(format!("reading {}", dir.display())))? {
        let entry = entry.map_err(ctx(format!("reading {}", dir.display())))?;
        let path = entry.path();
        let Some(id) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u64>().ok())
        else {
            tracing::warn!(path = %path.display(), "ignoring foreign entry in the snapshot directory");
            continue;
        };
        let info = path.join(INFO);
        let bytes = fs::read(&info).map_err(ctx(format!("reading {}", info.display())))?;
        let rec: Record = serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
            path: info.clone(),
            detail: e.to_string(),
        })?;
        if st.by_key.insert(rec.key.clone(), id).is_some() {
            return Err(Error::Corrupt {
                path: info,
                detail: format!("key {:?} is used by two snapshots", rec.key),
            });
        }
        st.entries.insert(
            id,
            Entry {
                rec,
                pending: false,
            },
        );
        st.next_id = st.next_id.max(id + 1);
    }
    for e in st.entries.values() {
        if let Some(p) = e.rec.parent {
            if !st.entries.contains_key(&p) {
                tracing::warn!(key = %e.rec.key, parent = p, "snapshot's parent is missing");
            }
        }
    }
    Ok(st)
}

/// Makes the empty ext4 image parentless snapshots start from: inode tables
/// initialised now (so no lazy-init thread later writes every child), no
/// lost+found (so an unpacked rootfs holds exactly the image's files).
fn make_base_image(tmp: &Path, dest: &Path, size: u64) -> Result<()> {
    let staged = tmp.join("base.img");
    let _ = fs::remove_file(&staged);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&staged)
        .map_err(ctx(format!("creating {}", staged.display())))?;
    file.set_len(size)
        .map_err(ctx(format!("sizing {}", staged.display())))?;
    drop(file);
    run_tool(
        Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-E",
                "lazy_itable_init=0,lazy_journal_init=1,nodiscard,root_owner=0:0",
                "-L",
                "twig-rootfs",
            ])
            .arg(&staged),
        "making the base ext4 image (mkfs.ext4 from e2fsprogs)",
    )?;
    run_tool(
        Command::new("debugfs")
            .args(["-w", "-R", "rmdir lost+found"])
            .arg(&staged),
        "removing lost+found from the base image (debugfs from e2fsprogs)",
    )?;
    fsops::sync_path(&staged).map_err(ctx(format!("syncing {}", staged.display())))?;
    fs::rename(&staged, dest).map_err(ctx(format!("publishing {}", dest.display())))?;
    let parent = dest.parent().unwrap_or(tmp);
    fsops::sync_path(parent).map_err(ctx(format!("syncing {}", parent.display())))
}

fn run_tool(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd.output().map_err(|e| Error::Tool {
        context: what.to_string(),
        detail: format!("cannot run {:?}: {e}", cmd.get_program()),
    })?;
    if out.status.success() {
        return Ok(());
    }
    Err(Error::Tool {
        context: what.to_string(),
        detail: format!(
            "{:?} exited with {}: {}",
            cmd.get_program(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    })
}

/// Used inodes according to the ext4 superblock (at byte 1024 of the image).
fn ext4_used_inodes(image: &Path) -> Result<u64> {
    let file = File::open(image).map_err(ctx(format!("opening {}", image.display())))?;
    let mut sb = [0u8; 64];
    file.read_exact_at(&mut sb, 1024).map_err(ctx(format!(
        "reading the superblock of {}",
        image.display()
    )))?;
    let le32 = |o: usize| u32::from_le_bytes([sb[o], sb[o + 1], sb[o + 2], sb[o + 3]]);
    let magic = u16::from_le_bytes([sb[56], sb[57]]);
    if magic != 0xEF53 {
        return Err(Error::Corrupt {
            path: image.to_path_buf(),
            detail: "no ext4 superblock".into(),
        });
    }
    Ok(u64::from(le32(0).saturating_sub(le32(16))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_image_recognises_twig_mounts_only() {
        let opts = |o: &[&str]| o.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            block_image("ext4", "/s/snapshots/3/rootfs.img", &opts(&["rw", "loop"])),
            Some(PathBuf::from("/s/snapshots/3/rootfs.img"))
        );
        assert_eq!(block_image("ext4", "/dev/vdb", &opts(&["rw"])), None);
        assert_eq!(block_image("overlay", "overlay", &opts(&["loop"])), None);
        assert_eq!(block_image("ext4", "", &opts(&["loop"])), None);
    }
}
