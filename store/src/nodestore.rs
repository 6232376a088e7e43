//! The node store for VM snapshots, shared by the node daemon (which hands
//! out staging directories, publishes, accounts and deletes), twig-vmm
//! (which writes into a staging directory and reads published snapshots)
//! and the shim. Several processes may use one store at once: every change
//! is a rename on the filesystem, publication and deletion are serialised
//! by a `flock` on `snapshots/`, and staging leases are `flock`ed by their
//! holder so that `cleanup` never takes one in use. The layout is
//! [`crate::layout`]'s.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use crate::error::{ctx, Error, Result};
use crate::fsops::{self, CloneMode, Usage};
use crate::grants::{self, published_dirs};
use crate::layout::{
    artefacts_in, validate_id, Artefact, Kind, Manifest, LEASE_SUFFIX, MANIFEST, SNAPSHOTS_DIR,
    STAGED, TMP_DIR,
};
use crate::sizes::{self, SnapshotSizes, StoreStats};

/// A published VM snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmSnapshot {
    /// Its id, the name of its directory.
    pub id: String,
    /// The snapshot this one was taken on top of (for incremental memory).
    pub parent: Option<String>,
    /// Full or incremental.
    pub kind: Kind,
    /// When it was published.
    pub created: SystemTime,
    /// Free-form labels.
    pub labels: BTreeMap<String, String>,
    /// The Kubernetes namespace that owns it ([`Manifest::owner`]).
    pub owner: Option<String>,
    /// Present artefacts with their sizes in bytes.
    pub artefacts: BTreeMap<Artefact, u64>,
    dir: PathBuf,
}

impl VmSnapshot {
    /// Its directory (what twig-vmm restores from).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of an artefact (read-only by convention: published snapshots are
    /// immutable; reflink it out with [`NodeStore::reflink_out`] to write).
    pub fn path(&self, a: Artefact) -> Option<PathBuf> {
        self.artefacts
            .contains_key(&a)
            .then(|| self.dir.join(a.file_name()))
    }

    /// Refuses a restore of this snapshot into a pod of `namespace` (`None`:
    /// a sandbox made outside Kubernetes) unless it is the snapshot's
    /// owner: one tenant's snapshot, memory and disks included, never
    /// reaches another tenant's pod. A snapshot that records no owner
    /// restores only outside Kubernetes.
    pub fn check_owner(&self, namespace: Option<&str>) -> Result<()> {
        if self.owner.as_deref() == namespace {
            return Ok(());
        }
        let owner = match &self.owner {
            Some(o) => format!("is owned by namespace {o:?}"),
            None => "records no owning namespace (taken outside Kubernetes)".to_string(),
        };
        let pod = match namespace {
            Some(ns) => format!("a pod of namespace {ns:?}"),
            None => "a sandbox outside Kubernetes".to_string(),
        };
        Err(Error::PermissionDenied(format!(
            "VM snapshot {:?} {owner}: {pod} may not restore it",
            self.id
        )))
    }
}

/// The store. Cheap to open; holds no in-memory index.
pub struct NodeStore {
    root: PathBuf,
    mode: CloneMode,
    seq: AtomicU64,
}

impl NodeStore {
    /// Opens (creating if needed) the store at `root`. Refuses a filesystem
    /// without reflink unless `allow_copy`. Removes abandoned staging.
    pub fn open(root: &Path, allow_copy: bool) -> Result<NodeStore> {
        let root =
            std::path::absolute(root).map_err(ctx(format!("resolving {}", root.display())))?;
        for dir in [root.join(SNAPSHOTS_DIR), root.join(TMP_DIR)] {
            fs::create_dir_all(&dir).map_err(ctx(format!("creating {}", dir.display())))?;
        }
        let mode = match fsops::probe_reflink(&root.join(TMP_DIR)) {
            Ok(()) => CloneMode::Reflink,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                return Err(Error::io(
                    format!("probing reflink in {}", root.display()),
                    e,
                ))
            }
            Err(source) if !allow_copy => return Err(Error::NoReflink { root, source }),
            Err(_) => CloneMode::Copy,
        };
        let store = NodeStore {
            root,
            mode,
            seq: AtomicU64::new(0),
        };
        store.cleanup()?;
        Ok(store)
    }

    /// The store's root directory (absolute).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether artefacts are reflinked or copied.
    pub fn clone_mode(&self) -> CloneMode {
        self.mode
    }

    /// The directory snapshot `id` is (or would be) published as.
    pub fn snapshot_dir(&self, id: &str) -> PathBuf {
        self.root.join(SNAPSHOTS_DIR).join(id)
    }

    fn tmp_name(&self, id: &str, what: &str) -> PathBuf {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        self.root
            .join(TMP_DIR)
            .join(format!("{id}.{}.{seq}.{what}", std::process::id()))
    }

    /// Serialises publication and deletion across processes (a blocking
    /// `flock` on `snapshots/`, released when the file is dropped).
    fn exclusive(&self) -> Result<File> {
        let dir = self.root.join(SNAPSHOTS_DIR);
        let f = File::open(&dir).map_err(ctx(format!("opening {}", dir.display())))?;
        fsops::flock(&f).map_err(ctx(format!("locking {}", dir.display())))?;
        Ok(f)
    }

    /// Starts snapshot `id`, staged privately until [`Staging::publish`]:
    /// a directory named `id` inside a lease this handle `flock`s. Hand
    /// [`Staging::dir`] to the writer (twig-vmm). Dropping the staging
    /// discards it.
    pub fn stage(&self, id: &str) -> Result<Staging<'_>> {
        validate_id(id)?;
        if self.snapshot_dir(id).exists() {
            return Err(Error::AlreadyExists(format!("VM snapshot {id:?}")));
        }
        let (lease, lock) = self.lease(id)?;
        let staging = Staging {
            store: self,
            id: id.to_string(),
            dir: lease.join(id),
            lease,
            _lock: lock,
            parent: None,
            kind: None,
            labels: BTreeMap::new(),
            owner: None,
            published: false,
        };
        // Its writer's alone until published (a jailed VMM gets it chowned,
        // and other VMMs, each its own user, cannot look in).
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&staging.dir)
            .map_err(ctx(format!("creating {}", staging.dir.display())))?;
        Ok(staging)
    }

    /// A new staging lease for `id`, locked before any cleanup may take
    /// it: made and locked under a name cleanups leave alone while this
    /// process lives (`<id>.<pid>.<n>.new`), then renamed to its lease name
    /// (the lock is on the directory, not its name). Made and locked under
    /// its lease name, another process's cleanup could find it in between,
    /// unlocked, and remove it under its writer.
    fn lease(&self, id: &str) -> Result<(PathBuf, File)> {
        let new = self.tmp_name(id, NEW_LEASE);
        fs::create_dir(&new).map_err(ctx(format!("creating {}", new.display())))?;
        let lock = File::open(&new).map_err(ctx(format!("opening {}", new.display())))?;
        let locked = fsops::try_flock(&lock).map_err(ctx(format!("locking {}", new.display())))?;
        let lease = self.tmp_name(id, LEASE_SUFFIX.trim_start_matches('.'));
        if !locked {
            let _ = fs::remove_dir(&new);
            return Err(Error::FailedPrecondition(format!(
                "staging directory {} is locked by someone else",
                new.display()
            )));
        }
        fs::rename(&new, &lease).map_err(ctx(format!(
            "renaming {} to {}",
            new.display(),
            lease.display()
        )))?;
        Ok((lease, lock))
    }

    /// A published snapshot.
    pub fn get(&self, id: &str) -> Result<VmSnapshot> {
        validate_id(id)?;
        let dir = self.snapshot_dir(id);
        read_snapshot(&dir.join(MANIFEST), id, dir)
    }

    /// A snapshot staged in `dir` (`<store>/tmp/<lease>/<id>` of this
    /// store) and not yet published, as its publisher described it
    /// ([`Staging::describe`]): a VM restored while its memory arrives
    /// reads its state, disks and labels from there. `NotFound` if nothing
    /// was described there (or it was published or dropped meanwhile).
    pub fn staged(&self, dir: &Path) -> Result<VmSnapshot> {
        let (id, _) = crate::layout::staging_target(dir)?;
        let tmp = self.root.join(TMP_DIR);
        if dir.parent().and_then(Path::parent) != Some(tmp.as_path()) {
            return Err(Error::InvalidArgument(format!(
                "{} is not a staging directory of the store {}",
                dir.display(),
                self.root.display()
            )));
        }
        read_snapshot(&dir.join(STAGED), &id, dir.to_path_buf())
    }

    /// Lets user `uid` (a jailed VMM's) read the described staging `dir`
    /// ([`NodeStore::staged`]), written by this store's publisher (its
    /// files made root's `0644`, as published ones are), without owning it:
    /// it cannot alter what will be published. Taken back with the user's
    /// other grants.
    pub fn grant_staged(&self, dir: &Path, uid: u32) -> Result<()> {
        let s = self.staged(dir)?;
        if let Some(writer) = seal(s.dir())? {
            return Err(Error::InvalidArgument(format!(
                "{} was written by user {writer}, not by this store's publisher",
                dir.display()
            )));
        }
        grants::grant_reader(&self.root, s.dir(), &s.id, uid)
    }

    /// Every published snapshot, by id.
    pub fn list(&self) -> Result<Vec<VmSnapshot>> {
        let dir = self.root.join(SNAPSHOTS_DIR);
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).map_err(ctx(format!("reading {}", dir.display())))? {
            let entry = entry.map_err(ctx(format!("reading {}", dir.display())))?;
            let Some(id) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            // Not a snapshot: e.g. a lock file a template builder keeps
            // next to the snapshot it builds.
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if validate_id(&id).is_err() {
                continue;
            }
            match self.get(&id) {
                Ok(s) => out.push(s),
                // Deleted between read_dir and get.
                Err(Error::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// Deletes a published snapshot. Refused while another snapshot names it
    /// as parent.
    pub fn delete(&self, id: &str) -> Result<()> {
        let guard = self.exclusive()?;
        self.get(id)?;
        if let Some(child) = self
            .list()?
            .into_iter()
            .find(|s| s.parent.as_deref() == Some(id))
        {
            return Err(Error::FailedPrecondition(format!(
                "cannot delete VM snapshot {id:?}: {:?} is its child",
                child.id
            )));
        }
        let dir = self.snapshot_dir(id);
        let doomed = self.tmp_name(id, "deleted");
        fs::rename(&dir, &doomed).map_err(ctx(format!(
            "moving {} to {}",
            dir.display(),
            doomed.display()
        )))?;
        let snapshots = self.root.join(SNAPSHOTS_DIR);
        fsops::sync_path(&snapshots).map_err(ctx(format!("syncing {}", snapshots.display())))?;
        drop(guard);
        fsops::remove_all(&doomed).map_err(ctx(format!("removing {}", doomed.display())))
    }

    /// Sets (`Some`) or removes (`None`) label `key` of published snapshot
    /// `id`: the one thing of a published snapshot that changes (e.g. the
    /// egress policy of an app template's pods). The manifest is replaced
    /// atomically (a new file renamed over it), so a reader sees the old
    /// labels or the new ones, never a torn manifest.
    pub fn set_label(&self, id: &str, key: &str, value: Option<&str>) -> Result<()> {
        let _guard = self.exclusive()?;
        let snap = self.get(id)?;
        let path = snap.dir.join(MANIFEST);
        let bytes = fs::read(&path).map_err(ctx(format!("reading {}", path.display())))?;
        let mut m: Manifest = serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        match value {
            Some(v) => m.labels.insert(key.to_string(), v.to_string()),
            None => m.labels.remove(key),
        };
        let new = snap.dir.join(format!("{MANIFEST}.new"));
        fsops::write_durable(&new, &m.to_bytes()?)
            .map_err(ctx(format!("writing {}", new.display())))?;
        fs::rename(&new, &path).map_err(ctx(format!(
            "renaming {} to {}",
            new.display(),
            path.display()
        )))?;
        fsops::sync_path(&snap.dir).map_err(ctx(format!("syncing {}", snap.dir.display())))
    }

    /// Reflinks (or, in copy mode, copies) a published artefact to `dest`,
    /// which must not exist: e.g. the writable disk of a pod restored from
    /// the snapshot.
    pub fn reflink_out(&self, id: &str, a: Artefact, dest: &Path) -> Result<()> {
        let snap = self.get(id)?;
        let src = snap
            .path(a)
            .ok_or_else(|| Error::NotFound(format!("{a} of VM snapshot {id:?}")))?;
        fsops::clone_file(self.mode, &src, dest).map_err(ctx(format!(
            "cloning {} to {}",
            src.display(),
            dest.display()
        )))?;
        fsops::sync_path(dest).map_err(ctx(format!("syncing {}", dest.display())))
    }

    /// Space of one snapshot's artefacts.
    pub fn usage_of(&self, id: &str) -> Result<Usage> {
        let files = artefact_paths(&self.get(id)?);
        fsops::usage_of(files.iter().map(PathBuf::as_path))
            .map_err(ctx(format!("accounting VM snapshot {id:?}")))
    }

    /// Allocated bytes (`st_blocks`) of every file of published snapshot
    /// `id`, its manifest included: what deleting it gives back (a block
    /// it shares by reflink with another file counts here too).
    pub fn allocated_of(&self, id: &str) -> Result<u64> {
        let snap = self.get(id)?;
        sizes::allocated_under(snap.dir())
    }

    /// Space of the whole store; blocks shared between snapshots count once
    /// in `unique_bytes`.
    pub fn usage(&self) -> Result<Usage> {
        let files: Vec<PathBuf> = self.list()?.iter().flat_map(artefact_paths).collect();
        fsops::usage_of(files.iter().map(PathBuf::as_path))
            .map_err(ctx(format!("accounting {}", self.root.display())))
    }

    /// Memory, disk and restore sizes of published snapshot `id`
    /// ([`crate::sizes::snapshot_sizes`] of its directory).
    pub fn sizes_of(&self, id: &str) -> Result<SnapshotSizes> {
        let snap = self.get(id)?;
        sizes::snapshot_sizes(snap.dir())
    }

    /// The store's allocated bytes (every file under its root, `st_blocks`),
    /// its filesystem's capacity and free bytes, and how many published
    /// snapshots are templates (`is_template`: the store does not know which
    /// ids its users give templates) and how many are not.
    pub fn stats(&self, is_template: impl Fn(&VmSnapshot) -> bool) -> Result<StoreStats> {
        let listed = self.list()?;
        let templates = listed.iter().filter(|s| is_template(s)).count() as u64;
        let (capacity_bytes, free_bytes) = sizes::filesystem_room(&self.root)?;
        Ok(StoreStats {
            allocated_bytes: sizes::allocated_under(&self.root)?,
            capacity_bytes,
            free_bytes,
            snapshots: listed.len() as u64 - templates,
            templates,
        })
    }

    /// Removes staging and deletion leftovers nobody holds a lock on (e.g.
    /// after a crash). Returns how many entries were removed.
    pub fn cleanup(&self) -> Result<usize> {
        let tmp = self.root.join(TMP_DIR);
        let mut removed = 0;
        for entry in fs::read_dir(&tmp).map_err(ctx(format!("reading {}", tmp.display())))? {
            let entry = entry.map_err(ctx(format!("reading {}", tmp.display())))?;
            let path = entry.path();
            // Another process's reflink probe, in flight (opening a store),
            // or a lease it is making (NodeStore::lease).
            let name = entry.file_name().to_string_lossy().into_owned();
            if fsops::live_probe(&name) || new_lease_of_a_live_process(&name) {
                continue;
            }
            // A lease is locked before it has its name (NodeStore::lease):
            // unlocked, it is abandoned. Held until removed, so no one else
            // takes it meanwhile.
            let lock = match File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
            };
            if !fsops::try_flock(&lock).map_err(ctx(format!("locking {}", path.display())))? {
                continue;
            }
            fsops::remove_all(&path).map_err(ctx(format!("removing {}", path.display())))?;
            drop(lock);
            removed += 1;
        }
        Ok(removed)
    }
}

/// How the name of a lease being made ends (`<id>.<pid>.<n>.new`).
const NEW_LEASE: &str = "new";

/// Whether `name` is a lease being made by a process that still runs.
fn new_lease_of_a_live_process(name: &str) -> bool {
    let pid = name
        .strip_suffix(NEW_LEASE)
        .and_then(|rest| rest.strip_suffix('.'))
        .and_then(|rest| rest.rsplit('.').nth(1))
        .and_then(|pid| pid.parse::<i32>().ok());
    pid.is_some_and(fsops::process_lives)
}

/// fsyncs `dir` on a thread of its own, logging a failure.
fn sync_in_background(dir: PathBuf) {
    let spawned = std::thread::Builder::new()
        .name("twig-dirsync".into())
        .spawn(move || {
            if let Err(e) = fsops::sync_path(&dir) {
                tracing::warn!(path = %dir.display(), error = %e, "fsync of a published name");
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the directory fsync thread");
    }
}

/// Makes a staging directory this process's user's before it is
/// published: the directory `0700` (its readers are granted it by ACL),
/// its regular files `0644` (what guards them is the directory) — neither
/// writable by its writer any more. Symbolic links are not followed (a
/// writer's link to a host file is left as it is; the manifest check
/// refuses it). The writer's user, if another one (a jailed VMM).
fn seal(dir: &Path) -> Result<Option<u32>> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let meta = fs::symlink_metadata(dir).map_err(ctx(format!("looking at {}", dir.display())))?;
    // SAFETY: geteuid/getegid cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let writer = (meta.uid() != uid).then_some(meta.uid());
    if writer.is_some() {
        std::os::unix::fs::lchown(dir, Some(uid), Some(gid))
            .map_err(ctx(format!("taking {} from its writer", dir.display())))?;
    }
    // A directory this process wrote keeps the read grants it gave
    // (`grant_staged`): chmod would mask its ACL entries out. One a
    // writer had loses whatever entries the writer made.
    if writer.is_some() || meta.mode() & 0o707 != 0o700 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(ctx(format!("closing {} to other users", dir.display())))?;
    }
    for entry in fs::read_dir(dir).map_err(ctx(format!("listing {}", dir.display())))? {
        let path = entry
            .map_err(ctx(format!("listing {}", dir.display())))?
            .path();
        let file = match File::options()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => continue,
            Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
        };
        let m = file
            .metadata()
            .map_err(ctx(format!("looking at {}", path.display())))?;
        if !m.is_file() {
            continue;
        }
        if m.uid() != uid || m.gid() != gid {
            std::os::unix::fs::fchown(&file, Some(uid), Some(gid))
                .map_err(ctx(format!("taking {} from its writer", path.display())))?;
        }
        file.set_permissions(fs::Permissions::from_mode(0o644))
            .map_err(ctx(format!("chmod of {}", path.display())))?;
    }
    Ok(writer)
}

/// Closes the published snapshots of the store at `root` to other users:
/// `snapshots/` `0711` (entered by id, never listed), and every snapshot
/// still open to all (published before snapshots were sealed) sealed as a
/// publish seals it. Returns how many were sealed.
pub fn seal_published(root: &Path) -> Result<usize> {
    use std::os::unix::fs::MetadataExt;
    let snapshots = root.join(SNAPSHOTS_DIR);
    fs::set_permissions(&snapshots, fs::Permissions::from_mode(0o711))
        .map_err(ctx(format!("chmod of {}", snapshots.display())))?;
    let mut sealed = 0;
    for dir in published_dirs(root)? {
        match fs::symlink_metadata(&dir) {
            Ok(m) if m.mode() & 0o007 != 0 => {
                seal(&dir)?;
                sealed += 1;
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("looking at {}", dir.display()), e)),
        }
    }
    Ok(sealed)
}

fn artefact_paths(s: &VmSnapshot) -> Vec<PathBuf> {
    s.artefacts.keys().filter_map(|a| s.path(*a)).collect()
}

/// A snapshot being written. Put artefacts (or let a writer fill
/// [`Staging::dir`]), then [`Staging::publish`].
pub struct Staging<'a> {
    store: &'a NodeStore,
    id: String,
    lease: PathBuf,
    dir: PathBuf,
    _lock: File,
    parent: Option<String>,
    kind: Option<Kind>,
    labels: BTreeMap<String, String>,
    owner: Option<String>,
    published: bool,
}

impl Staging<'_> {
    /// The id it will be published as.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The staging directory, named by the id: what a writer (twig-vmm's
    /// `Vm::snapshot`) is handed to write the artefacts into.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where to write an artefact directly.
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
    /// A writer's manifest says the same, or publishing is refused.
    pub fn set_parent(&mut self, parent: &str) -> Result<()> {
        self.store.get(parent)?;
        self.parent = Some(parent.to_string());
        Ok(())
    }

    /// Records full or incremental (otherwise: the writer's manifest says,
    /// or incremental with a parent and full without).
    pub fn set_kind(&mut self, kind: Kind) {
        self.kind = Some(kind);
    }

    /// Sets a free-form label. Only labels set here are published: those
    /// in a writer's manifest are dropped.
    pub fn set_label(&mut self, key: &str, value: &str) {
        self.labels.insert(key.to_string(), value.to_string());
    }

    /// Records the Kubernetes namespace that owns the snapshot
    /// ([`Manifest::owner`]); whatever a writer's manifest says of its
    /// owner is replaced by this (the writer is not trusted with it).
    pub fn set_owner(&mut self, namespace: &str) -> Result<()> {
        crate::layout::validate_owner(namespace)?;
        self.owner = Some(namespace.to_string());
        Ok(())
    }

    /// Describes what this staging will publish — its artefacts now, with
    /// the parent, kind, labels and owner set so far — for
    /// [`NodeStore::staged`], before it is complete: a VM restored while
    /// its memory arrives is restored from here. Published, the
    /// description is dropped.
    pub fn describe(&self) -> Result<()> {
        let kind = self.kind.unwrap_or(match self.parent {
            Some(_) => Kind::Incremental,
            None => Kind::Full,
        });
        let mut m = Manifest::of_staging(&self.dir, &self.id, self.parent.as_deref(), kind)?;
        m.labels.clone_from(&self.labels);
        m.owner.clone_from(&self.owner);
        let path = self.dir.join(STAGED);
        fsops::write_durable(&path, &m.to_bytes()?)
            .map_err(ctx(format!("writing {}", path.display())))
    }

    /// The writer's manifest, if it left one, checked against the
    /// directory and what was set here.
    fn writers_manifest(&self) -> Result<Option<Manifest>> {
        let path = self.dir.join(MANIFEST);
        let m: Manifest = match fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| {
                Error::InvalidArgument(format!(
                    "the writer's manifest {} is malformed: {e}",
                    path.display()
                ))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
        };
        let bad = |what: &str| {
            Error::InvalidArgument(format!(
                "VM snapshot {:?}: the writer's manifest {what}",
                self.id
            ))
        };
        if m.id != self.id {
            return Err(bad(&format!("names snapshot {:?}", m.id)));
        }
        if self.parent.is_some() && self.parent != m.parent {
            return Err(bad("names another parent than was set"));
        }
        if self.kind.is_some_and(|k| k != m.kind) {
            return Err(bad("gives another kind than was set"));
        }
        if (m.kind == Kind::Incremental) != m.parent.is_some() {
            return Err(bad(
                "is inconsistent: an incremental snapshot needs a parent, a full one has none",
            ));
        }
        let found = artefacts_in(&self.dir, &self.id)?;
        if found != m.artefacts {
            return Err(bad(&format!(
                "lists {:?} but the directory holds {found:?}",
                m.artefacts
            )));
        }
        Ok(Some(m))
    }

    /// The manifest to publish, durable in the staging directory: the
    /// writer's (rewritten only to add labels) or, without one, made here
    /// after syncing every artefact.
    fn final_manifest(&self) -> Result<Manifest> {
        if let Some(mut m) = self.writers_manifest()? {
            // Labels and owner are the publisher's: a writer (a jailed
            // VMM) could otherwise claim a label the node trusts, such as
            // the registry digest a pulled copy is found by.
            if m.labels != self.labels || m.owner != self.owner {
                m.labels.clone_from(&self.labels);
                m.owner.clone_from(&self.owner);
                let path = self.dir.join(MANIFEST);
                // In place: the directory entry is already durable.
                fsops::write_durable(&path, &m.to_bytes()?)
                    .map_err(ctx(format!("writing {}", path.display())))?;
            }
            return Ok(m);
        }
        let mut m = Manifest::of_staging(
            &self.dir,
            &self.id,
            self.parent.as_deref(),
            self.kind.unwrap_or(match self.parent {
                Some(_) => Kind::Incremental,
                None => Kind::Full,
            }),
        )?;
        for name in m.artefacts.keys() {
            let p = self.dir.join(name);
            fsops::sync_path(&p).map_err(ctx(format!("syncing {}", p.display())))?;
        }
        m.labels = self.labels.clone();
        m.owner.clone_from(&self.owner);
        m.write(&self.dir)?;
        Ok(m)
    }

    /// Makes the snapshot durable in its staging directory (see
    /// [`Manifest`]: what a writer's manifest vouches for is not synced
    /// again), then atomically renames the directory into place. Fails with
    /// `AlreadyExists` if the id was published meanwhile, `NotFound` if the
    /// parent is gone, `InvalidArgument` if the directory or the writer's
    /// manifest break the layout; nothing is visible before this returns
    /// Ok. The new name itself is made durable by a background fsync of
    /// `snapshots/` (a rename is atomic: a power cut in the next moments can
    /// lose the name but never expose a partial snapshot).
    pub fn publish(mut self) -> Result<VmSnapshot> {
        let staged = self.dir.join(STAGED);
        match fs::remove_file(&staged) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::io(format!("removing {}", staged.display()), e))
            }
            _ => {}
        }
        let manifest = self.final_manifest()?;
        let guard = self.store.exclusive()?;
        if let Some(p) = &manifest.parent {
            // Under the lock: a parent cannot be deleted until its child is in.
            self.store.get(p)?;
        }
        let dest = self.store.snapshot_dir(&self.id);
        // Published, it is this process's user's; its writer (a jailed
        // VMM) keeps reading it, other VMMs only once granted.
        let writer = seal(&self.dir)?;
        if let Some(uid) = writer {
            grants::grant_writer(&self.store.root, &self.dir, &self.id, uid)?;
        }
        fsops::rename_noreplace(&self.dir, &dest).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                Error::AlreadyExists(format!("VM snapshot {:?}", self.id))
            } else {
                Error::io(
                    format!("publishing {} as {}", self.dir.display(), dest.display()),
                    e,
                )
            }
        })?;
        self.published = true;
        drop(guard);
        sync_in_background(self.store.root.join(SNAPSHOTS_DIR));
        if let Err(e) = fs::remove_dir(&self.lease) {
            tracing::warn!(path = %self.lease.display(), error = %e, "leaving an empty lease for cleanup");
        }
        tracing::debug!(id = %self.id, "VM snapshot published");
        self.store.get(&self.id)
    }
}

/// The snapshot `id` in `dir` as the manifest at `path` describes it.
fn read_snapshot(path: &Path, id: &str, dir: PathBuf) -> Result<VmSnapshot> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::NotFound(format!("VM snapshot {id:?}")))
        }
        Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
    };
    let corrupt = |detail: String| Error::Corrupt {
        path: path.to_path_buf(),
        detail,
    };
    let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
    if m.id != id {
        return Err(corrupt(format!("it names snapshot {:?}", m.id)));
    }
    let mut artefacts = BTreeMap::new();
    for (name, size) in m.artefacts {
        let a = Artefact::from_file_name(&name)
            .ok_or_else(|| corrupt(format!("unknown artefact {name:?}")))?;
        artefacts.insert(a, size);
    }
    Ok(VmSnapshot {
        id: m.id,
        parent: m.parent,
        kind: m.kind,
        created: m.created,
        labels: m.labels,
        owner: m.owner,
        artefacts,
        dir,
    })
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        if !self.published {
            if let Err(e) = fsops::remove_all(&self.lease) {
                tracing::warn!(path = %self.lease.display(), error = %e, "leaving staging for cleanup");
            }
        }
    }
}
