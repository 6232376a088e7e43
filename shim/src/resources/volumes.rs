//! Volumes: what kubelet and CRI bind-mount into a container from the
//! host, as the pod's VM gets it. The guest cannot see host files, so
//! (as Kata Containers does without a shared filesystem):
//! - kubelet's configuration volumes (ConfigMap, Secret, projected — the
//!   ServiceAccount token —, downward API) and CRI's pod files
//!   (`/etc/resolv.conf`, `/etc/hosts`, `/etc/hostname`) are **mirrored**:
//!   the host tree is copied into a guest volume (twig-agent's
//!   `SyncVolume`, on the agent's tmpfs: never on a disk a snapshot
//!   carries) before the container is created, and configuration volumes
//!   are kept current while the pod runs ([`crate::resources::watch`]:
//!   kubelet's `..data` swap stays atomic in the guest) and after every
//!   rollback, so the pod sees its own current content (a clone its own
//!   token);
//! - the termination-message file is a guest file of the container's own,
//!   copied back to the host path when the container exits (at most
//!   [`TERMINATION_MESSAGE_BYTES`], as kubelet reads it);
//! - an emptyDir is a guest volume shared by the pod's containers, in the
//!   VM, so snapshot, rollback and clone carry it with the pod: on the
//!   pod's disk ([`PodDisk`]: the sandbox container's rootfs image from
//!   twig-snapshotter, attached to a disk slot when a container first needs
//!   it), or a tmpfs of its own of the volume's `sizeLimit` for `medium:
//!   Memory`. A `subPath` of an emptyDir is the same directory of it in the guest
//!   (found by inode on the host, made in the guest by `PrepareVolume`'s
//!   `subdirs`);
//! - a host directory — a hostPath, a filesystem PersistentVolume, a
//!   subPath of either — is **shared**: served over 9P2000.L by a jailed
//!   server and mounted by the agent ([`crate::resources::share`]); reads
//!   and writes reach the host at once;
//! - anything else (a hostPath that is a file or a socket, a subPath that
//!   is no directory of its emptyDir on the host) is refused, naming the
//!   mount.
//!
//! A mirrored volume's guest name comes from the container's name and the
//! mount's destination, not from host paths: a clone (another pod UID,
//! another random ServiceAccount volume name) and a restarted container
//! refresh the very guest directories its running processes bind.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use std::time::Duration;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use twig_agent::client::AgentClient;
use twig_agent::proto::agent::{volume_entry, PrepareVolumeRequest, VolumeEntry};
use twig_proto::GUEST_VOLUMES_DIR;

use crate::error::{Error, Result};
use crate::resources::share::{self, Identity, Share};
use crate::sandbox::Sandbox;
use crate::share_server::ServeArgs;

/// The file name a mirrored single file (or a termination message) has in
/// its guest volume.
pub const FILE: &str = "file";

/// How much of a termination message kubelet reads (its
/// `MaxContainerTerminationMessageLength`), and so the shim copies back.
pub const TERMINATION_MESSAGE_BYTES: u32 = 4096;

/// The most a mirrored volume may hold (entries' contents, paths and link
/// targets): under ttrpc's 4 MiB message. ConfigMaps and Secrets hold at
/// most 1 MiB each.
pub const MIRROR_MAX_BYTES: usize = 3 << 20;

/// The most entries a mirrored volume may hold.
const MIRROR_MAX_ENTRIES: usize = 10_000;

/// The pod files CRI writes per sandbox and binds into every container.
const CRI_POD_FILES: [&str; 3] = ["/etc/hosts", "/etc/resolv.conf", "/etc/hostname"];

/// kubelet's volume plugins whose content it writes (atomically) and keeps
/// current: mirrored with live updates.
const CONFIG_PLUGINS: [&str; 4] = ["configmap", "secret", "projected", "downward-api"];

/// A guest volume a container's mounts need before it is created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Volume {
    /// A host directory or file copied into the guest.
    Mirror(Mirror),
    /// The container's termination-message file: empty in the guest at
    /// create, copied back to `host` when the container exits.
    Termination {
        /// The guest volume.
        name: String,
        /// kubelet's file for it.
        host: PathBuf,
    },
    /// An emptyDir, shared by the pod's containers.
    EmptyDir {
        /// The guest volume (`empty-dir~<volume name>`).
        name: String,
        /// A tmpfs of its own of this size (`medium: Memory`); 0: a
        /// directory on the pod's disk.
        tmpfs_bytes: u64,
        /// Its directories a container mounts by `subPath`, made in the
        /// guest as kubelet makes them on the host.
        subdirs: Vec<String>,
    },
    /// A host directory shared with the guest.
    Shared(Share),
}

impl Volume {
    /// Its guest volume's name.
    pub fn name(&self) -> &str {
        match self {
            Volume::Mirror(m) => &m.name,
            Volume::Shared(s) => &s.name,
            Volume::Termination { name, .. } | Volume::EmptyDir { name, .. } => name,
        }
    }

    /// Whether it lives on the pod's disk (an emptyDir not in memory).
    pub fn on_pod_disk(&self) -> bool {
        matches!(self, Volume::EmptyDir { tmpfs_bytes: 0, .. })
    }

    /// Whether it belongs to one container (removed with it), rather than
    /// to the pod (an emptyDir outlives a container's restart).
    pub fn per_container(&self) -> bool {
        !matches!(self, Volume::EmptyDir { .. })
    }
}

/// The pod's disk as the guest sees it: where disk-backed volumes live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodDisk {
    /// Its guest block device (`/dev/vdb`).
    pub device: String,
    /// Its size, when it was attached a moment ago (the agent waits until
    /// the guest sees it); 0 when it was attached before.
    pub bytes: u64,
}

/// A host directory or file mirrored into a guest volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mirror {
    /// The guest volume.
    pub name: String,
    /// The host directory or file.
    pub host: PathBuf,
    /// A single file (its guest copy is `<volume>/`[`FILE`]).
    pub file: bool,
    /// kubelet keeps it current (a configuration volume): the guest copy
    /// follows.
    pub live: bool,
}

/// What a container's mounts need: the spec's mounts rewritten for the
/// guest, and the guest volumes to prepare first.
#[derive(Debug, Default)]
pub struct Plan {
    /// The volumes, in mount order.
    pub volumes: Vec<Volume>,
}

/// Whether an OCI mount is a bind mount (its source a path).
fn is_bind(m: &Value) -> bool {
    m.get("type").and_then(Value::as_str) == Some("bind")
        || m.get("options")
            .and_then(Value::as_array)
            .is_some_and(|o| o.iter().any(|o| o == "bind" || o == "rbind"))
}

/// The guest volume name of `container`'s mount on `destination`.
fn mirror_name(container: &str, destination: &str) -> String {
    volume_name("m", container, destination)
}

/// The guest volume name, `<prefix>-<digest>`, of `container`'s mount on
/// `destination`.
fn volume_name(prefix: &str, container: &str, destination: &str) -> String {
    let digest = Sha256::digest(format!("{container}\0{destination}").as_bytes());
    let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{hex}")
}

/// Whether an OCI mount asks for read-only.
fn is_read_only(m: &Value) -> bool {
    m.get("options")
        .and_then(Value::as_array)
        .is_some_and(|o| o.iter().any(|o| o == "ro"))
}

/// `…/volumes/kubernetes.io~<plugin>/<name>` of kubelet's pod directory:
/// (plugin, name).
fn kubelet_volume(source: &Path) -> Option<(&str, &str)> {
    let mut parts = source.components().rev();
    let name = parts.next()?.as_os_str().to_str()?;
    let plugin = parts
        .next()?
        .as_os_str()
        .to_str()?
        .strip_prefix("kubernetes.io~")?;
    (parts.next()?.as_os_str() == "volumes").then_some((plugin, name))
}

/// `<kubelet root>/pods/<uid>/volume-subpaths/<volume>/<container>/<index>`:
/// (the pod's directory, the volume's name).
fn kubelet_subpath(source: &Path) -> Option<(PathBuf, &str)> {
    let parts: Vec<Component<'_>> = source.components().collect();
    let n = parts.len();
    if n < 6 || parts[n - 4].as_os_str() != "volume-subpaths" {
        return None;
    }
    let pod: PathBuf = parts[..n - 4].iter().collect();
    Some((pod, parts[n - 3].as_os_str().to_str()?))
}

/// `<kubelet root>/pods/<uid>/containers/<name>/<id>`: kubelet's
/// termination-message file of a container.
fn is_termination_file(source: &Path) -> bool {
    let parts: Vec<Component<'_>> = source.components().collect();
    let n = parts.len();
    n >= 5 && parts[n - 3].as_os_str() == "containers" && parts[n - 5].as_os_str() == "pods"
}

/// The size of the tmpfs kubelet mounted for a `medium: Memory` emptyDir at
/// `dir`; `None` when it is no tmpfs (a disk-backed emptyDir).
fn tmpfs_size(dir: &Path) -> Result<Option<u64>> {
    let st = nix::sys::statfs::statfs(dir).map_err(|e| {
        Error::InvalidArgument(format!(
            "emptyDir {}: cannot look at it on the host: {e}",
            dir.display()
        ))
    })?;
    if st.filesystem_type() != nix::sys::statfs::TMPFS_MAGIC {
        return Ok(None);
    }
    let bytes = st.blocks().saturating_mul(st.block_size().unsigned_abs());
    Ok(Some(bytes))
}

/// Rewrites the spec's mounts for the guest (see the module doc) and says
/// which guest volumes they need; `container` is the container's name in
/// its pod (CRI's), which names its mirrored volumes. `/dev/shm` (CRI binds
/// the pod's shared memory there) becomes a tmpfs of the container's own (a
/// bind of another container's `/dev/shm` through `/proc/<pid>/root` fails
/// with EINVAL; System V shared memory is still the pod's, through its IPC
/// namespace).
pub fn guest_mounts(spec: &mut Value, container: &str) -> Result<Plan> {
    let mut plan = Plan::default();
    let identity = Identity::of(spec)?;
    let Some(mounts) = spec.get_mut("mounts").and_then(Value::as_array_mut) else {
        return Ok(plan);
    };
    for m in mounts.iter_mut() {
        if !is_bind(m) {
            continue;
        }
        let dest = m
            .get("destination")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if dest == "/dev/shm" {
            *m = json!({
                "destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            });
            continue;
        }
        let source = PathBuf::from(m.get("source").and_then(Value::as_str).unwrap_or_default());
        let mount = Mount {
            source: &source,
            dest: &dest,
            container,
            read_only: is_read_only(m),
            identity: &identity,
        };
        let (volume, sub) = classify(&mount)?;
        let guest = match (&volume, &sub) {
            (Volume::Mirror(Mirror { file: true, .. }) | Volume::Termination { .. }, _) => {
                format!("{GUEST_VOLUMES_DIR}/{}/{FILE}", volume.name())
            }
            (_, Some(sub)) => format!("{GUEST_VOLUMES_DIR}/{}/{sub}", volume.name()),
            (_, None) => format!("{GUEST_VOLUMES_DIR}/{}", volume.name()),
        };
        m["source"] = json!(guest);
        m["type"] = json!("bind");
        let v = match plan.volumes.iter().position(|v| v.name() == volume.name()) {
            Some(i) => &mut plan.volumes[i],
            None => {
                plan.volumes.push(volume);
                plan.volumes
                    .last_mut()
                    .ok_or_else(|| Error::Internal("no volume".into()))?
            }
        };
        if let (Volume::EmptyDir { subdirs, .. }, Some(sub)) = (v, sub) {
            if !subdirs.contains(&sub) {
                subdirs.push(sub);
            }
        }
    }
    Ok(plan)
}

/// The directory of emptyDir `dir` (on the host) that `subpath` (kubelet's
/// bind mount of it) is: the same inode, found at most 8 levels down.
fn subpath_of(dir: &Path, subpath: &Path) -> Option<String> {
    let want = std::fs::metadata(subpath).ok()?;
    let mut todo = vec![(PathBuf::new(), 0)];
    let mut seen = 0usize;
    while let Some((rel, depth)) = todo.pop() {
        for entry in std::fs::read_dir(dir.join(&rel)).ok()?.flatten() {
            seen += 1;
            if seen > MIRROR_MAX_ENTRIES {
                return None;
            }
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_dir() {
                continue;
            }
            let path = rel.join(entry.file_name());
            if (meta.dev(), meta.ino()) == (want.dev(), want.ino()) {
                return path.to_str().map(str::to_string);
            }
            if depth < 8 {
                todo.push((path, depth + 1));
            }
        }
    }
    None
}

/// A bind mount of a container's spec, as [`classify`] sees it.
struct Mount<'a> {
    source: &'a Path,
    dest: &'a str,
    container: &'a str,
    read_only: bool,
    identity: &'a Identity,
}

/// What the bind mount is in the guest, and the directory of it bound (a
/// subPath of an emptyDir).
fn classify(mount: &Mount<'_>) -> Result<(Volume, Option<String>)> {
    let Mount {
        source,
        dest,
        container,
        ..
    } = *mount;
    let refuse = |why: String| {
        Err(Error::InvalidArgument(format!(
            "the mount on {dest} (the host's {}): {why}",
            source.display()
        )))
    };
    let mirror = |live: bool| -> Result<(Volume, Option<String>)> {
        let meta = std::fs::metadata(source).map_err(|e| {
            Error::InvalidArgument(format!(
                "the mount on {dest}: its host source {}: {e}",
                source.display()
            ))
        })?;
        let mirror = Mirror {
            name: mirror_name(container, dest),
            host: source.to_path_buf(),
            file: !meta.is_dir(),
            live: live && meta.is_dir(),
        };
        Ok((Volume::Mirror(mirror), None))
    };
    if let Some((plugin, name)) = kubelet_volume(source) {
        if CONFIG_PLUGINS.contains(&plugin) {
            return mirror(true);
        }
        if plugin == "empty-dir" {
            return Ok((empty_dir(name, source)?, None));
        }
        return shared(mount);
    }
    if let Some((pod, volume)) = kubelet_subpath(source) {
        let host_dir = pod.join("volumes/kubernetes.io~empty-dir").join(volume);
        if host_dir.exists() {
            // The emptyDir lives in the VM: the same directory of it there.
            let Some(sub) = subpath_of(&host_dir, source) else {
                return refuse(format!(
                    "a subPath of emptyDir {volume:?} that is no directory of it on the host"
                ));
            };
            return Ok((empty_dir(volume, &host_dir)?, Some(sub)));
        }
        // A subPath of a configuration volume is not updated under runc
        // either; one of a host filesystem is shared.
        let config = CONFIG_PLUGINS.iter().any(|p| {
            pod.join("volumes")
                .join(format!("kubernetes.io~{p}"))
                .join(volume)
                .exists()
        });
        return if config { mirror(false) } else { shared(mount) };
    }
    if is_termination_file(source) {
        let volume = Volume::Termination {
            name: mirror_name(container, dest),
            host: source.to_path_buf(),
        };
        return Ok((volume, None));
    }
    if CRI_POD_FILES.contains(&dest) || source.ends_with("etc-hosts") {
        return mirror(false);
    }
    shared(mount)
}

/// A host directory shared with the guest; anything else is refused.
fn shared(mount: &Mount<'_>) -> Result<(Volume, Option<String>)> {
    let (source, dest) = (mount.source, mount.dest);
    let meta = std::fs::metadata(source).map_err(|e| {
        Error::InvalidArgument(format!(
            "the mount on {dest}: its host source {}: {e}",
            source.display()
        ))
    })?;
    if !meta.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "the mount on {dest} (the host's {}): only a directory of the host (hostPath, \
             filesystem volume) is shared with the VM, not a file, socket or device",
            source.display()
        )));
    }
    let id = mount.identity;
    let share = Share {
        name: volume_name("s", mount.container, dest),
        serve: ServeArgs {
            dir: source.to_path_buf(),
            uid: id.uid,
            gid: id.gid,
            groups: id.groups.clone(),
            caps: id.caps,
            read_only: mount.read_only,
        },
    };
    Ok((Volume::Shared(share), None))
}

/// emptyDir `name`, kubelet's directory `dir` on the host.
fn empty_dir(name: &str, dir: &Path) -> Result<Volume> {
    Ok(Volume::EmptyDir {
        name: format!("empty-dir~{name}"),
        tmpfs_bytes: tmpfs_size(dir)?.unwrap_or(0),
        subdirs: Vec::new(),
    })
}

/// The request that makes `volume` in the guest (before its content).
pub fn prepare_request(volume: &Volume, disk: Option<&PodDisk>) -> Result<PrepareVolumeRequest> {
    let disk = match (volume.on_pod_disk(), disk) {
        (true, Some(d)) => d.clone(),
        (true, None) => {
            return Err(Error::Internal(format!(
                "volume {} lives on the pod's disk, which is not attached",
                volume.name()
            )))
        }
        (false, _) => PodDisk {
            device: String::new(),
            bytes: 0,
        },
    };
    let (mode, uid, gid, tmpfs_bytes) = match volume {
        Volume::Mirror(m) if !m.file => {
            let meta = std::fs::metadata(&m.host)
                .map_err(|e| mirror_error(m.host.as_path(), "reading", &e))?;
            (
                meta.permissions().mode() & 0o7777,
                meta.uid(),
                meta.gid(),
                0,
            )
        }
        Volume::Mirror(_) | Volume::Termination { .. } => (0o755, 0, 0, 0),
        Volume::Shared(s) => {
            return Err(Error::Internal(format!(
                "volume {} is a file share, mounted by its own request",
                s.name
            )))
        }
        // kubelet makes an emptyDir world-writable.
        Volume::EmptyDir { tmpfs_bytes, .. } => (0o777, 0, 0, *tmpfs_bytes),
    };
    let subdirs = match volume {
        Volume::EmptyDir { subdirs, .. } => subdirs.clone(),
        _ => Vec::new(),
    };
    Ok(PrepareVolumeRequest {
        name: volume.name().to_string(),
        tmpfs_bytes,
        mode,
        uid,
        gid,
        subdirs,
        device: disk.device,
        device_bytes: disk.bytes,
        ..Default::default()
    })
}

fn mirror_error(path: &Path, what: &str, e: &std::io::Error) -> Error {
    Error::FailedPrecondition(format!(
        "{what} {} to mirror it into the VM: {e}",
        path.display()
    ))
}

/// The content `volume` gets in the guest now: a mirror's host tree, an
/// empty termination file; `None` for an emptyDir (its content is the
/// VM's).
pub fn content(volume: &Volume) -> Result<Option<Vec<VolumeEntry>>> {
    match volume {
        Volume::Mirror(m) if m.file => {
            let meta =
                std::fs::metadata(&m.host).map_err(|e| mirror_error(&m.host, "reading", &e))?;
            let data = read_bounded(&m.host, meta.len())?;
            Ok(Some(vec![file_entry(FILE, data, &meta)]))
        }
        Volume::Mirror(m) => read_tree(&m.host).map(Some),
        Volume::Termination { host, .. } => {
            let meta = std::fs::metadata(host).map_err(|e| mirror_error(host, "reading", &e))?;
            Ok(Some(vec![file_entry(FILE, Vec::new(), &meta)]))
        }
        Volume::EmptyDir { .. } | Volume::Shared(_) => Ok(None),
    }
}

fn file_entry(path: &str, data: Vec<u8>, meta: &std::fs::Metadata) -> VolumeEntry {
    VolumeEntry {
        path: path.to_string(),
        mode: meta.permissions().mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        kind: Some(volume_entry::Kind::File(data)),
        ..Default::default()
    }
}

fn read_bounded(path: &Path, len: u64) -> Result<Vec<u8>> {
    if len > MIRROR_MAX_BYTES as u64 {
        return Err(Error::FailedPrecondition(format!(
            "{} holds {len} bytes: the twig runtime mirrors at most {MIRROR_MAX_BYTES} bytes \
             of a volume into the VM",
            path.display()
        )));
    }
    std::fs::read(path).map_err(|e| mirror_error(path, "reading", &e))
}

/// Every entry under `root` (not following symlinks), paths relative to it.
pub fn read_tree(root: &Path) -> Result<Vec<VolumeEntry>> {
    let mut entries = Vec::new();
    let mut total = 0usize;
    let mut dirs = vec![PathBuf::new()];
    while let Some(rel) = dirs.pop() {
        let dir = root.join(&rel);
        let list = std::fs::read_dir(&dir).map_err(|e| mirror_error(&dir, "listing", &e))?;
        for item in list {
            let item = item.map_err(|e| mirror_error(&dir, "listing", &e))?;
            let path = rel.join(item.file_name());
            let full = root.join(&path);
            let meta =
                std::fs::symlink_metadata(&full).map_err(|e| mirror_error(&full, "reading", &e))?;
            let name = path.to_str().ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "{}: a name that is not UTF-8 cannot be mirrored into the VM",
                    full.display()
                ))
            })?;
            let mut entry = VolumeEntry {
                path: name.to_string(),
                mode: meta.permissions().mode() & 0o7777,
                uid: meta.uid(),
                gid: meta.gid(),
                ..Default::default()
            };
            total += name.len();
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&full)
                    .map_err(|e| mirror_error(&full, "reading the link", &e))?;
                let target = target
                    .to_str()
                    .ok_or_else(|| {
                        Error::FailedPrecondition(format!(
                            "{}: a link target that is not UTF-8 cannot be mirrored into the VM",
                            full.display()
                        ))
                    })?
                    .to_string();
                total += target.len();
                entry.kind = Some(volume_entry::Kind::Symlink(target));
            } else if meta.is_dir() {
                entry.kind = Some(volume_entry::Kind::Dir(true));
                dirs.push(path.clone());
            } else if meta.is_file() {
                let data = read_bounded(&full, meta.len())?;
                total += data.len();
                entry.kind = Some(volume_entry::Kind::File(data));
            } else {
                continue;
            }
            entries.push(entry);
            if total > MIRROR_MAX_BYTES || entries.len() > MIRROR_MAX_ENTRIES {
                return Err(Error::FailedPrecondition(format!(
                    "{}: more than {MIRROR_MAX_BYTES} bytes or {MIRROR_MAX_ENTRIES} entries; the \
                     twig runtime mirrors no more of a volume into the VM",
                    root.display()
                )));
            }
        }
    }
    Ok(entries)
}

/// Makes `volumes` in the guest and gives each its content now (before
/// the container that mounts them is created, or adopted in a clone: the
/// clone's own content replaces its source's): one `PrepareVolumes` call
/// for all but the shared directories (more when their content passes
/// [`BATCH_BYTES`]), which each get their server, returned.
pub fn prepare(
    sandbox: &dyn Sandbox,
    volumes: &[Volume],
    disk: Option<&PodDisk>,
    timeout: Duration,
) -> Result<Vec<share::Server>> {
    let agent = sandbox.agent();
    let mut batch = Vec::new();
    let mut bytes = 0;
    for v in volumes.iter().filter(|v| !matches!(v, Volume::Shared(_))) {
        let mut req = prepare_request(v, disk)?;
        if let Some(entries) = content(v)? {
            req.has_content = true;
            req.entries = entries;
        }
        let size = containerd_shim_protos::protobuf::Message::compute_size(&req);
        if bytes + size > BATCH_BYTES && !batch.is_empty() {
            prepare_batch(&agent, std::mem::take(&mut batch), timeout)?;
            bytes = 0;
        }
        batch.push(req);
        bytes += size;
    }
    if !batch.is_empty() {
        prepare_batch(&agent, batch, timeout)?;
    }
    volumes
        .iter()
        .filter_map(|v| match v {
            Volume::Shared(s) => Some(share::attach(sandbox, s, timeout)),
            _ => None,
        })
        .collect()
}

/// The most one `PrepareVolumes` call carries, encoded: under ttrpc's 4
/// MiB message (one mirrored volume holds at most [`MIRROR_MAX_BYTES`]).
const BATCH_BYTES: u64 = 3 << 20 | 512 << 10;

/// One `PrepareVolumes` call; an agent from before it (a VM restored from
/// an older template) gets a `PrepareVolume` and `SyncVolume` per volume.
fn prepare_batch(
    agent: &AgentClient,
    batch: Vec<PrepareVolumeRequest>,
    timeout: Duration,
) -> Result<()> {
    let names = || {
        batch
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match agent.prepare_volumes(batch.clone(), timeout) {
        Err(e) if is_unknown_method(&e) => {}
        r => return r.map_err(|e| Error::agent(format!("making guest volumes {}", names()), e)),
    }
    for mut req in batch {
        let entries = req.has_content.then(|| std::mem::take(&mut req.entries));
        req.has_content = false;
        agent
            .prepare_volume(&req, timeout)
            .map_err(|e| Error::agent(format!("making guest volume {}", req.name), e))?;
        if let Some(entries) = entries {
            agent
                .sync_volume(&req.name, entries, timeout)
                .map_err(|e| Error::agent(format!("filling guest volume {}", req.name), e))?;
        }
    }
    Ok(())
}

/// Whether the agent does not know the method called (ttrpc's synchronous
/// server answers `INVALID_ARGUMENT` "<method> does not exist").
fn is_unknown_method(e: &twig_agent::client::Error) -> bool {
    e.status_code() == Some("INVALID_ARGUMENT") && e.to_string().contains("does not exist")
}

/// Gives a mirrored volume its host content again (kubelet changed it, or
/// a rollback took the guest's copy back in time).
pub fn resync(agent: &AgentClient, mirror: &Mirror, timeout: Duration) -> Result<()> {
    let volume = Volume::Mirror(mirror.clone());
    let entries = content(&volume)?.unwrap_or_default();
    agent
        .sync_volume(&mirror.name, entries, timeout)
        .map_err(|e| Error::agent(format!("updating guest volume {}", mirror.name), e))
}

/// Copies a termination message back to kubelet's file once the container
/// exited: at most [`TERMINATION_MESSAGE_BYTES`] (what kubelet reads).
pub fn copy_back(agent: &AgentClient, volume: &Volume, timeout: Duration) -> Result<()> {
    let Volume::Termination { name, host } = volume else {
        return Ok(());
    };
    let read = agent
        .read_volume_file(name, FILE, TERMINATION_MESSAGE_BYTES, timeout)
        .map_err(|e| Error::agent(format!("reading the termination message of {name}"), e))?;
    std::fs::write(host, &read.data).map_err(|e| {
        Error::Internal(format!(
            "writing the termination message to {}: {e}",
            host.display()
        ))
    })
}

/// Removes a container's own guest volumes (it was deleted); an emptyDir
/// stays with the pod.
pub fn remove(agent: &AgentClient, volumes: &[Volume], timeout: Duration) -> Result<()> {
    for v in volumes.iter().filter(|v| v.per_container()) {
        agent
            .remove_volume(v.name(), timeout)
            .map_err(|e| Error::agent(format!("removing guest volume {}", v.name()), e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn bind(dest: &str, source: &Path, ro: bool) -> Value {
        let mut options = vec!["rbind", "rprivate"];
        options.push(if ro { "ro" } else { "rw" });
        json!({"destination": dest, "type": "bind", "source": source, "options": options})
    }

    /// A kubelet pod directory with a ConfigMap (atomic-writer layout), an
    /// emptyDir, a termination file and etc-hosts; and CRI's resolv.conf.
    fn kubelet_pod(root: &Path) -> PathBuf {
        let pod = root.join("pods/uid-1");
        let cm = pod.join("volumes/kubernetes.io~configmap/cfg");
        std::fs::create_dir_all(cm.join("..2026_11_28_01")).unwrap();
        std::fs::write(cm.join("..2026_11_28_01/key"), "v1").unwrap();
        symlink("..2026_11_28_01", cm.join("..data")).unwrap();
        symlink("..data/key", cm.join("key")).unwrap();
        std::fs::create_dir_all(pod.join("volumes/kubernetes.io~empty-dir/scratch")).unwrap();
        std::fs::create_dir_all(pod.join("containers/app")).unwrap();
        std::fs::write(pod.join("containers/app/0a1b2c"), "").unwrap();
        std::fs::write(pod.join("etc-hosts"), "127.0.0.1 localhost\n").unwrap();
        std::fs::write(root.join("resolv.conf"), "nameserver 10.96.0.10\n").unwrap();
        pod
    }

    #[test]
    fn kubelets_mounts_become_guest_volumes() {
        let tmp = tempfile::tempdir().unwrap();
        let pod = kubelet_pod(tmp.path());
        let proc_mount = json!({"destination": "/proc", "type": "proc", "source": "proc"});
        let mut spec = json!({"mounts": [
            proc_mount,
            bind("/etc/config", &pod.join("volumes/kubernetes.io~configmap/cfg"), true),
            bind("/scratch", &pod.join("volumes/kubernetes.io~empty-dir/scratch"), false),
            bind("/dev/termination-log", &pod.join("containers/app/0a1b2c"), false),
            bind("/etc/hosts", &pod.join("etc-hosts"), false),
            bind("/etc/resolv.conf", &tmp.path().join("resolv.conf"), true),
            bind("/dev/shm", Path::new("/run/containerd/sandboxes/p/shm"), false),
        ]});
        let plan = guest_mounts(&mut spec, "app").unwrap();
        let mounts = spec["mounts"].as_array().unwrap();
        assert_eq!(mounts[0], proc_mount);
        let names: Vec<&str> = plan.volumes.iter().map(Volume::name).collect();
        assert_eq!(names.len(), 5, "{names:?}");
        // The ConfigMap: mirrored, live, its guest directory bound read-only.
        let Volume::Mirror(cm) = &plan.volumes[0] else {
            panic!("{:?}", plan.volumes[0])
        };
        assert!(cm.live && !cm.file);
        assert_eq!(
            mounts[1]["source"],
            json!(format!("{GUEST_VOLUMES_DIR}/{}", cm.name))
        );
        assert!(mounts[1]["options"]
            .as_array()
            .unwrap()
            .contains(&json!("ro")));
        assert_eq!(
            plan.volumes[1],
            Volume::EmptyDir {
                name: "empty-dir~scratch".into(),
                tmpfs_bytes: 0,
                subdirs: Vec::new(),
            }
        );
        assert!(matches!(plan.volumes[2], Volume::Termination { .. }));
        assert_eq!(
            mounts[3]["source"],
            json!(format!(
                "{GUEST_VOLUMES_DIR}/{}/{FILE}",
                plan.volumes[2].name()
            ))
        );
        for (i, v) in [(4, &plan.volumes[3]), (5, &plan.volumes[4])] {
            let Volume::Mirror(m) = v else {
                panic!("{v:?}")
            };
            assert!(m.file && !m.live, "{m:?}");
            assert_eq!(
                mounts[i]["source"],
                json!(format!("{GUEST_VOLUMES_DIR}/{}/{FILE}", m.name))
            );
        }
        assert_eq!(mounts[6]["type"], "tmpfs");
    }

    #[test]
    fn a_clones_mounts_name_the_same_guest_volumes() {
        // Another pod UID and another random token volume name: the same
        // container and destination, so the same guest directory.
        let tmp = tempfile::tempdir().unwrap();
        let mut names = Vec::new();
        for (uid, vol) in [
            ("uid-a", "kube-api-access-abcde"),
            ("uid-b", "kube-api-access-vwxyz"),
        ] {
            let dir = tmp
                .path()
                .join(format!("pods/{uid}/volumes/kubernetes.io~projected/{vol}"));
            std::fs::create_dir_all(&dir).unwrap();
            let mut spec = json!({"mounts": [
                bind("/var/run/secrets/kubernetes.io/serviceaccount", &dir, true)]});
            names.push(
                guest_mounts(&mut spec, "app").unwrap().volumes[0]
                    .name()
                    .to_string(),
            );
        }
        assert_eq!(names[0], names[1]);
        let mut other = json!({"mounts": [bind(
            "/var/run/secrets/kubernetes.io/serviceaccount",
            &tmp.path().join("pods/uid-a/volumes/kubernetes.io~projected/kube-api-access-abcde"),
            true
        )]});
        let sidecar = guest_mounts(&mut other, "sidecar").unwrap();
        assert_ne!(
            sidecar.volumes[0].name(),
            names[0],
            "each container its own copy"
        );
    }

    #[test]
    fn host_directories_are_shared_as_the_containers_user_and_the_rest_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let pod = tmp.path().join("pods/uid-1");
        let csi = pod.join("volumes/kubernetes.io~csi/pvc-1/mount");
        let nfs = pod.join("volumes/kubernetes.io~nfs/shared");
        let host = tmp.path().join("srv/data");
        let pv_sub = pod.join("volume-subpaths/pvc-1/app/0");
        let cm_sub = pod.join("volume-subpaths/config/app/1");
        std::fs::create_dir_all(pod.join("volumes/kubernetes.io~configmap/config")).unwrap();
        for d in [&csi, &nfs, &host, &pv_sub, &cm_sub] {
            std::fs::create_dir_all(d).unwrap();
        }
        let user = json!({"uid": 1000, "gid": 1000, "additionalGids": [4000]});
        let mut spec = json!({
            "process": {"user": user, "capabilities": {"effective": ["CAP_CHOWN", "CAP_SYS_ADMIN"]}},
            "mounts": [bind("/data", &host, true), bind("/nfs", &nfs, false),
                       bind("/pv", &csi, false), bind("/pv-sub", &pv_sub, false),
                       bind("/cm-sub", &cm_sub, false)]});
        let plan = guest_mounts(&mut spec, "app").unwrap();
        let shares: Vec<&Share> = plan
            .volumes
            .iter()
            .filter_map(|v| match v {
                Volume::Shared(s) => Some(s),
                _ => None,
            })
            .collect();
        let dirs: Vec<&Path> = shares.iter().map(|s| s.serve.dir.as_path()).collect();
        assert_eq!(dirs, [host.as_path(), &nfs, &csi, &pv_sub]);
        let first = &shares[0].serve;
        assert!(first.read_only && !shares[1].serve.read_only);
        assert_eq!(
            (first.uid, first.gid, first.groups.as_slice()),
            (1000, 1000, &[4000][..])
        );
        assert_eq!(first.caps, 1, "CAP_CHOWN only: the file capabilities");
        assert!(
            matches!(plan.volumes[4], Volume::Mirror(_)),
            "a ConfigMap's subPath"
        );
        let mounts = spec["mounts"].as_array().unwrap();
        assert_eq!(
            mounts[0]["source"],
            json!(format!("{GUEST_VOLUMES_DIR}/{}", shares[0].name))
        );
        assert!(shares[0].name.starts_with("s-"));

        let file = tmp.path().join("srv/file");
        std::fs::write(&file, "x").unwrap();
        let sub = pod.join("volume-subpaths/scratch/app/0");
        std::fs::create_dir_all(pod.join("volumes/kubernetes.io~empty-dir/scratch")).unwrap();
        std::fs::create_dir_all(&sub).unwrap();
        for (dest, source, says) in [
            ("/file", file.as_path(), "not a file"),
            ("/gone", Path::new("/nonexistent/twig"), "No such file"),
            ("/sub", sub.as_path(), "no directory of it"),
        ] {
            let mut spec = json!({"mounts": [bind(dest, source, false)]});
            let e = guest_mounts(&mut spec, "app").unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            let text = e.to_string();
            assert!(text.contains(dest) && text.contains(says), "{text}");
        }
    }

    #[test]
    fn a_subpath_of_an_emptydir_is_the_same_directory_of_it_in_the_guest() {
        let tmp = tempfile::tempdir().unwrap();
        let pod = tmp.path().join("pods/uid-1");
        let scratch = pod.join("volumes/kubernetes.io~empty-dir/scratch");
        std::fs::create_dir_all(scratch.join("seed/deep")).unwrap();
        // kubelet's bind of the subPath; a symlink stands in for it here
        // (the same inode through the link).
        let sub = pod.join("volume-subpaths/scratch/app/1");
        std::fs::create_dir_all(sub.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(scratch.join("seed/deep"), &sub).unwrap();
        let mut spec = json!({"mounts": [
            bind("/scratch", &scratch, false),
            bind("/seed", &sub, false),
        ]});
        let plan = guest_mounts(&mut spec, "app").unwrap();
        assert_eq!(
            plan.volumes,
            [Volume::EmptyDir {
                name: "empty-dir~scratch".into(),
                tmpfs_bytes: 0,
                subdirs: vec!["seed/deep".into()],
            }]
        );
        assert_eq!(
            spec["mounts"][1]["source"],
            json!(format!("{GUEST_VOLUMES_DIR}/empty-dir~scratch/seed/deep"))
        );
        let disk = PodDisk {
            device: "/dev/vdb".into(),
            bytes: 4 << 30,
        };
        let req = prepare_request(&plan.volumes[0], Some(&disk)).unwrap();
        assert_eq!(
            (req.device.as_str(), req.device_bytes, req.tmpfs_bytes),
            ("/dev/vdb", 4 << 30, 0),
            "a disk-backed emptyDir lives on the pod's disk"
        );
        let e = prepare_request(&plan.volumes[0], None).unwrap_err();
        assert!(e.to_string().contains("pod's disk"), "{e}");
        assert_eq!(req.subdirs, ["seed/deep"]);
    }

    #[test]
    fn a_mirrored_tree_keeps_kubelets_layout() {
        let tmp = tempfile::tempdir().unwrap();
        let pod = kubelet_pod(tmp.path());
        let cm = pod.join("volumes/kubernetes.io~configmap/cfg");
        let mut entries = read_tree(&cm).unwrap();
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        let shape: Vec<(String, Option<volume_entry::Kind>)> =
            entries.into_iter().map(|e| (e.path, e.kind)).collect();
        assert_eq!(
            shape,
            [
                ("..2026_11_28_01", volume_entry::Kind::Dir(true)),
                (
                    "..2026_11_28_01/key",
                    volume_entry::Kind::File(b"v1".to_vec())
                ),
                (
                    "..data",
                    volume_entry::Kind::Symlink("..2026_11_28_01".into())
                ),
                ("key", volume_entry::Kind::Symlink("..data/key".into())),
            ]
            .map(|(p, k)| (p.to_string(), Some(k)))
        );
        let big = tmp.path().join("big");
        std::fs::create_dir(&big).unwrap();
        std::fs::write(big.join("f"), vec![0u8; MIRROR_MAX_BYTES + 1]).unwrap();
        let e = read_tree(&big).unwrap_err();
        assert!(e.to_string().contains("mirrors at most"), "{e}");
    }
}
