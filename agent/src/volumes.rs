//! Guest volumes: directories under the volumes root
//! (`twig_proto::GUEST_VOLUMES_DIR`) that the host mirrors kubelet's files
//! into (ServiceAccount tokens, ConfigMaps, Secrets, downwardAPI,
//! resolv.conf, hosts), emptyDirs, and per-container termination-message
//! files; containers bind-mount them.
//!
//! The root is a tmpfs of the agent's (mode 0700), mounted on first use. A
//! volume is a directory on it, a tmpfs of its own with a size, or a
//! directory on the pod's disk (an ext4 block device the host attached,
//! mounted once at `pod-disk` beside the root: a disk-backed emptyDir,
//! which snapshots, rollbacks and clones carry with the pod) bound onto
//! it. Inside a
//! volume every operation works on descriptors: parents are opened with
//! `openat2` beneath the volume without following symlinks, so a symlink
//! planted in a volume never makes the agent write or read outside it.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::PathBuf;
use std::sync::Mutex;

use nix::errno::Errno;
use nix::fcntl::{openat, openat2, renameat, OFlag, OpenHow, ResolveFlag, AT_FDCWD};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{fstat, fstatat, mkdirat, FileStat, Mode, SFlag};
use nix::unistd::{fchown, fchownat, symlinkat, unlinkat, Gid, Uid, UnlinkatFlags};
use nix::NixPath;
use twig_agent::proto::agent::{
    volume_entry, PrepareVolumeRequest, ReadVolumeFileRequest, ReadVolumeFileResponse,
    SyncVolumeRequest, VolumeEntry,
};

use crate::error::{AgentError, Result};
use crate::reaper::lock;

/// The longest volume name.
pub const MAX_NAME_LEN: usize = 200;
/// The longest entry path or symlink target, in bytes (PATH_MAX).
pub const MAX_PATH_LEN: usize = 4096;
/// The most entries one SyncVolume takes.
pub const MAX_ENTRIES: usize = 65_536;
/// The most bytes (contents, paths, targets) one SyncVolume takes; ttrpc's
/// own message limit (4 MiB in ttrpc 0.10) comes first.
pub const MAX_SYNC_BYTES: usize = 16 << 20;
/// The most ReadVolumeFile returns.
pub const MAX_READ_BYTES: u32 = 64 << 10;
/// Names starting with this are the agent's (its temporary files); kubelet
/// keeps keys starting with `..` for itself too.
const RESERVED_PREFIX: &str = "..twig";
/// Where a file or symlink is made before it is renamed into place.
const TMP_NAME: &str = "..twig-tmp";
/// The pod's disk's mount point, beside the volumes root.
const POD_DISK_DIR: &str = "pod-disk";
/// The directory of the pod's disk holding its volumes.
const DISK_VOLUMES: &str = "twig-volumes";

/// The guest's volumes.
pub struct Volumes {
    root: PathBuf,
    /// Serializes changes; true once the root tmpfs is mounted.
    mounted: Mutex<bool>,
}

fn invalid(msg: String) -> AgentError {
    AgentError::InvalidArgument(msg)
}

/// Checks a volume name: 1-200 characters of [A-Za-z0-9._~-], not `.` or `..`.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "invalid volume name {name:?}: use 1-{MAX_NAME_LEN} characters of [A-Za-z0-9._~-], not \".\" or \"..\""
        )))
    }
}

/// Checks a path inside a volume: relative, at most 4096 bytes, no NUL,
/// components non-empty, at most 255 bytes, not `.` or `..`.
pub fn validate_path(path: &str) -> Result<()> {
    let bad = |why: &str| Err(invalid(format!("invalid volume path {path:?}: {why}")));
    if path.is_empty() {
        return bad("empty");
    }
    if path.len() > MAX_PATH_LEN {
        return bad("longer than 4096 bytes");
    }
    if path.contains('\0') {
        return bad("contains NUL");
    }
    if path.starts_with('/') {
        return bad("absolute");
    }
    for c in path.split('/') {
        match c {
            "" => return bad("empty component"),
            "." | ".." => return bad("\".\" or \"..\" component"),
            c if c.len() > 255 => return bad("component longer than 255 bytes"),
            _ => {}
        }
    }
    Ok(())
}

fn validate_mode(what: &str, mode: u32) -> Result<()> {
    if mode > 0o7777 {
        return Err(invalid(format!("{what}: mode {mode:#o} is over 0o7777")));
    }
    Ok(())
}

fn errno(e: std::io::Error) -> Errno {
    Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

/// Where `path` is: its parent (empty: the volume) and its name.
fn split(path: &str) -> (&str, &str) {
    path.rsplit_once('/').unwrap_or(("", path))
}

/// Checks a symlink target of the entry at `path`: relative, `..` only as
/// leading components and no more of them than `path` has parents, no `.`
/// or empty components. Such a target resolves inside the volume whatever
/// the other entries are: its `..` steps climb real directories (parents
/// are listed directories) and the rest only descends.
fn validate_target(path: &str, target: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(invalid(format!(
            "invalid symlink {path:?} -> {target:?}: {why}"
        )))
    };
    if target.is_empty() {
        return bad("empty target");
    }
    if target.len() > MAX_PATH_LEN {
        return bad("target longer than 4096 bytes");
    }
    if target.contains('\0') {
        return bad("target contains NUL");
    }
    if target.starts_with('/') {
        return bad("absolute target");
    }
    let depth = path.split('/').count() - 1;
    let mut ups = 0;
    let mut descended = false;
    for c in target.split('/') {
        match c {
            "" | "." => return bad("empty or \".\" component in the target"),
            ".." if descended => return bad("\"..\" after a name in the target"),
            ".." => ups += 1,
            _ => descended = true,
        }
    }
    if ups > depth {
        return bad("target leaves the volume");
    }
    Ok(())
}

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    File(Vec<u8>),
    Symlink(String),
    Dir,
}

/// A validated entry of SyncVolume.
#[derive(Debug, Clone)]
struct Entry {
    path: String,
    mode: u32,
    uid: u32,
    gid: u32,
    kind: Kind,
}

/// Validates SyncVolume's entries: each on its own, no path twice, every
/// parent a listed directory, within the limits.
fn validate_entries(entries: Vec<VolumeEntry>) -> Result<Vec<Entry>> {
    if entries.len() > MAX_ENTRIES {
        return Err(invalid(format!(
            "{} entries, over {MAX_ENTRIES}",
            entries.len()
        )));
    }
    let mut total = 0usize;
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        validate_path(&e.path)?;
        validate_mode(&e.path, e.mode)?;
        if e.path.split('/').any(|c| c.starts_with(RESERVED_PREFIX)) {
            return Err(invalid(format!(
                "invalid volume path {:?}: names starting with {RESERVED_PREFIX:?} are the agent's",
                e.path
            )));
        }
        let kind = match e.kind {
            Some(volume_entry::Kind::File(data)) => Kind::File(data),
            Some(volume_entry::Kind::Symlink(target)) => {
                validate_target(&e.path, &target)?;
                Kind::Symlink(target)
            }
            Some(volume_entry::Kind::Dir(true)) => Kind::Dir,
            _ => {
                return Err(invalid(format!(
                    "entry {:?}: not a file, a symlink or a directory",
                    e.path
                )))
            }
        };
        total += e.path.len()
            + match &kind {
                Kind::File(d) => d.len(),
                Kind::Symlink(t) => t.len(),
                Kind::Dir => 0,
            };
        if total > MAX_SYNC_BYTES {
            return Err(invalid(format!(
                "the entries hold more than {MAX_SYNC_BYTES} bytes"
            )));
        }
        out.push(Entry {
            path: e.path,
            mode: e.mode,
            uid: e.uid,
            gid: e.gid,
            kind,
        });
    }
    let kinds: HashMap<&str, &Kind> = out.iter().map(|e| (e.path.as_str(), &e.kind)).collect();
    if kinds.len() != out.len() {
        let mut seen = HashSet::new();
        let dup = out.iter().find(|e| !seen.insert(e.path.as_str()));
        return Err(invalid(format!(
            "entry {:?} is listed twice",
            dup.map(|e| e.path.as_str()).unwrap_or_default()
        )));
    }
    for e in &out {
        let (parent, _) = split(&e.path);
        if !parent.is_empty() && kinds.get(parent) != Some(&&Kind::Dir) {
            return Err(invalid(format!(
                "entry {:?}: its parent {parent:?} is not a listed directory",
                e.path
            )));
        }
    }
    Ok(out)
}

/// Opens directory `rel` of the volume (empty: the volume itself) without
/// following any symlink and without leaving it.
fn open_dir(vol: BorrowedFd<'_>, rel: &str) -> nix::Result<OwnedFd> {
    let rel = if rel.is_empty() { "." } else { rel };
    openat2(
        vol,
        rel,
        OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
            .resolve(
                ResolveFlag::RESOLVE_BENEATH
                    | ResolveFlag::RESOLVE_NO_SYMLINKS
                    | ResolveFlag::RESOLVE_NO_XDEV,
            ),
    )
}

/// `mkdir -p` of `sub` inside the volume `vol` (a subPath): each missing
/// directory made with `mode` (the volume's, as kubelet makes a subPath's),
/// every step opened beneath the volume without following a symlink. What
/// a container made there already stays, a file included (a subPath may
/// name a file one container wrote for another), unless it is a symlink.
fn make_subdir(vol: BorrowedFd<'_>, sub: &str, mode: u32) -> Result<()> {
    validate_path(sub)?;
    let parts: Vec<&str> = sub.split('/').collect();
    let mut done = String::new();
    for (i, part) in parts.iter().copied().enumerate() {
        let dir = open_dir(vol, &done).map_err(sys("opening", sub))?;
        match mkdirat(dir.as_fd(), part, Mode::from_bits_retain(mode)) {
            Ok(()) => {
                let made = openat(
                    dir.as_fd(),
                    part,
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(sys("opening", sub))?;
                // Past the umask.
                nix::sys::stat::fchmod(made.as_fd(), Mode::from_bits_retain(mode))
                    .map_err(sys("setting the mode of", sub))?;
            }
            Err(Errno::EEXIST) if i + 1 == parts.len() => {
                let st = stat_at(dir.as_fd(), part).map_err(sys("inspecting", sub))?;
                if st.is_some_and(|st| is(&st, SFlag::S_IFLNK)) {
                    return Err(invalid(format!(
                        "subPath {sub:?} is a symlink in the volume"
                    )));
                }
            }
            Err(Errno::EEXIST) => {}
            Err(e) => return Err(sys("creating", sub)(e)),
        }
        if !done.is_empty() {
            done.push('/');
        }
        done.push_str(part);
    }
    Ok(())
}

fn stat_at(dir: BorrowedFd<'_>, name: &(impl NixPath + ?Sized)) -> nix::Result<Option<FileStat>> {
    match fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

fn is(st: &FileStat, kind: SFlag) -> bool {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == kind
}

/// Permission bits, uid and gid as the entry wants them.
fn same_attrs(st: &FileStat, e: &Entry) -> bool {
    st.st_uid == e.uid
        && st.st_gid == e.gid
        && (is(st, SFlag::S_IFLNK) || st.st_mode & 0o7777 == e.mode)
}

/// Whether the regular file `name` in `dir` holds `data`.
fn same_contents(dir: BorrowedFd<'_>, name: &str, data: &[u8]) -> nix::Result<bool> {
    let fd = openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let mut have = Vec::with_capacity(data.len());
    File::from(fd)
        .take(data.len() as u64 + 1)
        .read_to_end(&mut have)
        .map_err(errno)?;
    Ok(have == data)
}

/// One step of a sync.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    /// Make directory `entries[i]` (replacing what else is there).
    Mkdir(usize),
    /// Write file `entries[i]` under a temporary name, rename it over.
    Write(usize),
    /// Write file `entries[i]` in place (truncated, its inode kept): the
    /// one file of a single-file volume, which containers bind-mount as a
    /// file (CRI's `/etc/hosts`, `/etc/resolv.conf`), where a rename would
    /// leave every existing bind on the old content — a process adopted
    /// from a template or a clone's source must see the new pod's.
    Rewrite(usize),
    /// Make symlink `entries[i]` under a temporary name, rename it over.
    Link(usize),
    /// Set the mode and owner of `entries[i]`, which is as listed otherwise.
    Attrs(usize),
    /// Remove `name` in directory `parent` and everything under it.
    Remove {
        /// A listed directory, or empty: the volume.
        parent: String,
        /// Any name (not listed).
        name: OsString,
    },
}

fn sys<'a>(what: &str, path: &'a str) -> impl FnOnce(Errno) -> AgentError + 'a {
    let what = what.to_string();
    move |e| AgentError::sys(format!("{what} {path:?}"), e)
}

/// What makes the tree under `vol` equal to `entries`, in order:
/// directories and changed files (parents first), then symlinks (those
/// whose target goes through another listed symlink, as kubelet's
/// `key -> ..data/key` through `..data`, after the others), then removal
/// of everything not listed (deepest first). Unchanged entries get no
/// step, so a file a container has bind-mounted keeps its inode.
fn plan(vol: BorrowedFd<'_>, entries: &[Entry]) -> Result<Vec<Op>> {
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by(|&a, &b| entries[a].path.split('/').cmp(entries[b].path.split('/')));
    let kinds: HashMap<&str, &Kind> = entries.iter().map(|e| (e.path.as_str(), &e.kind)).collect();
    let mut ops = Vec::new();
    let mut links = Vec::new();
    for &i in &order {
        let e = &entries[i];
        let (parent, name) = split(&e.path);
        let existing = match open_dir(vol, parent) {
            Ok(dir) => stat_at(dir.as_fd(), name)
                .map_err(sys("inspecting", &e.path))?
                .map(|st| (dir, st)),
            Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP | Errno::EXDEV) => None,
            Err(err) => return Err(sys("opening the parent of", &e.path)(err)),
        };
        let op = match (&e.kind, existing) {
            (Kind::Dir, Some((_, st))) if is(&st, SFlag::S_IFDIR) => {
                (!same_attrs(&st, e)).then_some(Op::Attrs(i))
            }
            (Kind::Dir, _) => Some(Op::Mkdir(i)),
            (Kind::File(data), Some((dir, st)))
                if is(&st, SFlag::S_IFREG)
                    && st.st_size == data.len() as i64
                    && same_contents(dir.as_fd(), name, data)
                        .map_err(sys("reading", &e.path))? =>
            {
                (!same_attrs(&st, e)).then_some(Op::Attrs(i))
            }
            (Kind::File(_), Some((_, st))) if entries.len() == 1 && is(&st, SFlag::S_IFREG) => {
                Some(Op::Rewrite(i))
            }
            (Kind::File(_), _) => Some(Op::Write(i)),
            (Kind::Symlink(target), Some((dir, st)))
                if is(&st, SFlag::S_IFLNK)
                    && nix::fcntl::readlinkat(dir.as_fd(), name)
                        .map_err(sys("reading", &e.path))?
                        == target.as_str() =>
            {
                if !same_attrs(&st, e) {
                    links.push((0, Op::Attrs(i)));
                }
                None
            }
            (Kind::Symlink(target), _) => {
                let through = through_link(&e.path, target, &kinds);
                links.push((usize::from(through), Op::Link(i)));
                None
            }
        };
        ops.extend(op);
    }
    links.sort_by_key(|(rank, _)| *rank);
    ops.extend(links.into_iter().map(|(_, op)| op));
    let mut removals = unlisted(vol, &kinds)?;
    removals.sort_by(|a, b| {
        let depth = |p: &str| p.split('/').filter(|c| !c.is_empty()).count();
        depth(&b.0).cmp(&depth(&a.0)).then_with(|| a.cmp(b))
    });
    ops.extend(
        removals
            .into_iter()
            .map(|(parent, name)| Op::Remove { parent, name }),
    );
    Ok(ops)
}

/// Whether the target of symlink `path` goes through another listed
/// symlink (resolved lexically; targets are checked to be `../`* names).
fn through_link(path: &str, target: &str, kinds: &HashMap<&str, &Kind>) -> bool {
    let mut at: Vec<&str> = split(path).0.split('/').filter(|c| !c.is_empty()).collect();
    for c in target.split('/') {
        if c == ".." {
            at.pop();
        } else {
            at.push(c);
            if matches!(kinds.get(at.join("/").as_str()), Some(Kind::Symlink(_))) {
                return true;
            }
        }
    }
    false
}

/// The topmost paths under `vol` that are not listed, as (parent, name)
/// (not descending into them), and none under a listed path that is not a
/// directory there.
fn unlisted(vol: BorrowedFd<'_>, kinds: &HashMap<&str, &Kind>) -> Result<Vec<(String, OsString)>> {
    let mut out = Vec::new();
    let mut todo = vec![String::new()];
    while let Some(rel) = todo.pop() {
        let dir = match open_dir(vol, &rel) {
            Ok(d) => d,
            Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP | Errno::EXDEV) => continue,
            Err(e) => return Err(sys("opening", &rel)(e)),
        };
        for name in list(dir.as_fd()).map_err(sys("listing", &rel))? {
            // A name that is not UTF-8 is never listed.
            let Some(utf8) = name.to_str() else {
                out.push((rel.clone(), name));
                continue;
            };
            let path = if rel.is_empty() {
                utf8.to_string()
            } else {
                format!("{rel}/{utf8}")
            };
            match kinds.get(path.as_str()) {
                None => out.push((rel.clone(), name)),
                Some(Kind::Dir) => {
                    let st = stat_at(dir.as_fd(), utf8).map_err(sys("inspecting", &path))?;
                    if st.is_some_and(|st| is(&st, SFlag::S_IFDIR)) {
                        todo.push(path);
                    }
                }
                Some(_) => {}
            }
        }
    }
    Ok(out)
}

/// The names in `dir` but `.` and `..`, read through `/proc/self/fd`.
fn list(dir: BorrowedFd<'_>) -> nix::Result<Vec<OsString>> {
    let path = format!("/proc/self/fd/{}", dir.as_raw_fd());
    let mut names = Vec::new();
    for entry in std::fs::read_dir(path).map_err(errno)? {
        names.push(entry.map_err(errno)?.file_name());
    }
    Ok(names)
}

/// Removes `name` in `dir` and, for a directory, everything under it,
/// never following a symlink. Missing is fine.
fn remove_tree(dir: BorrowedFd<'_>, name: &(impl AsRef<OsStr> + ?Sized)) -> nix::Result<()> {
    let name = name.as_ref();
    let Some(st) = stat_at(dir, name)? else {
        return Ok(());
    };
    if is(&st, SFlag::S_IFDIR) {
        let sub = openat(
            dir,
            name,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        for child in list(sub.as_fd())? {
            remove_tree(sub.as_fd(), &child)?;
        }
        match unlinkat(dir, name, UnlinkatFlags::RemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(e),
        }
    } else {
        match unlinkat(dir, name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

fn owner(e: &Entry) -> (Option<Uid>, Option<Gid>) {
    (Some(Uid::from_raw(e.uid)), Some(Gid::from_raw(e.gid)))
}

/// Owner first, then the mode (chown clears set-id bits).
fn set_attrs_fd(fd: BorrowedFd<'_>, e: &Entry) -> nix::Result<()> {
    let (uid, gid) = owner(e);
    fchown(fd, uid, gid)?;
    nix::sys::stat::fchmod(fd, Mode::from_bits_retain(e.mode))
}

/// Renames the temporary `TMP_NAME` in `dir` over `name`; a directory in
/// the way (an entry that changed kind) is removed first.
fn rename_over(dir: BorrowedFd<'_>, name: &str) -> nix::Result<()> {
    match renameat(dir, TMP_NAME, dir, name) {
        Err(Errno::EISDIR | Errno::ENOTEMPTY | Errno::EEXIST) => {
            remove_tree(dir, name)?;
            renameat(dir, TMP_NAME, dir, name)
        }
        r => r,
    }
}

/// Carries out one step of [`plan`].
fn apply(vol: BorrowedFd<'_>, entries: &[Entry], op: &Op) -> Result<()> {
    let path = match op {
        Op::Mkdir(i) | Op::Write(i) | Op::Rewrite(i) | Op::Link(i) | Op::Attrs(i) => {
            entries[*i].path.as_str()
        }
        Op::Remove { parent, name } => {
            let shown = format!("{parent}/{}", name.to_string_lossy());
            return match open_dir(vol, parent) {
                Ok(dir) => remove_tree(dir.as_fd(), name).map_err(sys("removing", &shown)),
                // Gone with its parent (an entry that changed kind).
                Err(Errno::ENOENT | Errno::ENOTDIR) => Ok(()),
                Err(e) => Err(sys("opening the parent of", &shown)(e)),
            };
        }
    };
    let (parent, name) = split(path);
    let dir = open_dir(vol, parent).map_err(sys("opening the parent of", path))?;
    let dir = dir.as_fd();
    match op {
        Op::Mkdir(i) => {
            let e = &entries[*i];
            remove_tree(dir, name).map_err(sys("replacing", path))?;
            mkdirat(dir, name, Mode::from_bits_retain(0o700)).map_err(sys("creating", path))?;
            let fd = openat(
                dir,
                name,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(sys("opening", path))?;
            set_attrs_fd(fd.as_fd(), e).map_err(sys("setting the mode of", path))
        }
        Op::Write(i) => {
            let e = &entries[*i];
            let Kind::File(data) = &e.kind else {
                return Ok(());
            };
            remove_tree(dir, TMP_NAME).map_err(sys("clearing the temporary file of", path))?;
            let written = write_tmp(dir, data, e).and_then(|()| rename_over(dir, name));
            if written.is_err() {
                let _ = unlinkat(dir, TMP_NAME, UnlinkatFlags::NoRemoveDir);
            }
            written.map_err(sys("writing", path))
        }
        Op::Rewrite(i) => {
            let e = &entries[*i];
            let Kind::File(data) = &e.kind else {
                return Ok(());
            };
            let fd = openat(
                dir,
                name,
                OFlag::O_WRONLY | OFlag::O_TRUNC | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(sys("opening", path))?;
            set_attrs_fd(fd.as_fd(), e).map_err(sys("setting the mode of", path))?;
            File::from(fd)
                .write_all(data)
                .map_err(|err| sys("writing", path)(errno(err)))
        }
        Op::Link(i) => {
            let e = &entries[*i];
            let Kind::Symlink(target) = &e.kind else {
                return Ok(());
            };
            remove_tree(dir, TMP_NAME).map_err(sys("clearing the temporary link of", path))?;
            let (uid, gid) = owner(e);
            let linked = symlinkat(target.as_str(), dir, TMP_NAME)
                .and_then(|()| {
                    fchownat(
                        dir,
                        TMP_NAME,
                        uid,
                        gid,
                        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                    )
                })
                .and_then(|()| rename_over(dir, name));
            if linked.is_err() {
                let _ = unlinkat(dir, TMP_NAME, UnlinkatFlags::NoRemoveDir);
            }
            linked.map_err(sys("linking", path))
        }
        Op::Attrs(i) => {
            let e = &entries[*i];
            if let Kind::Symlink(_) = e.kind {
                let (uid, gid) = owner(e);
                return fchownat(
                    dir,
                    name,
                    uid,
                    gid,
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(sys("setting the owner of", path));
            }
            let fd = openat(
                dir,
                name,
                OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(sys("opening", path))?;
            set_attrs_fd(fd.as_fd(), e).map_err(sys("setting the mode of", path))
        }
        Op::Remove { .. } => Ok(()),
    }
}

fn write_tmp(dir: BorrowedFd<'_>, data: &[u8], e: &Entry) -> nix::Result<()> {
    let fd = openat(
        dir,
        TMP_NAME,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_retain(0o600),
    )?;
    set_attrs_fd(fd.as_fd(), e)?;
    File::from(fd).write_all(data).map_err(errno)
}

/// Makes the tree under `vol` (a volume's directory) equal to `entries`
/// (see [`plan`]).
fn sync_tree(vol: BorrowedFd<'_>, entries: &[Entry]) -> Result<()> {
    for op in plan(vol, entries)? {
        apply(vol, entries, &op)?;
    }
    Ok(())
}

/// Opens `path` in `vol` for reading: symlinks are followed only while
/// they stay in the volume; only a regular file is read.
fn read_beneath(vol: BorrowedFd<'_>, path: &str, max: u32) -> Result<ReadVolumeFileResponse> {
    let fd = openat2(
        vol,
        path,
        OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)
            .resolve(
                ResolveFlag::RESOLVE_BENEATH
                    | ResolveFlag::RESOLVE_NO_MAGICLINKS
                    | ResolveFlag::RESOLVE_NO_XDEV,
            ),
    )
    .map_err(|e| match e {
        Errno::ENOENT | Errno::ENOTDIR => AgentError::NotFound(format!("no file {path:?}: {e}")),
        Errno::EXDEV | Errno::ELOOP => {
            AgentError::InvalidArgument(format!("{path:?} leads out of the volume: {e}"))
        }
        e => AgentError::sys(format!("opening {path:?}"), e),
    })?;
    let st = fstat(fd.as_fd()).map_err(|e| AgentError::sys(format!("inspecting {path:?}"), e))?;
    if !is(&st, SFlag::S_IFREG) {
        return Err(invalid(format!("{path:?} is not a regular file")));
    }
    let max = match max {
        0 => MAX_READ_BYTES,
        n => n.min(MAX_READ_BYTES),
    } as usize;
    let mut data = Vec::new();
    File::from(fd)
        .take(max as u64 + 1)
        .read_to_end(&mut data)
        .map_err(|e| AgentError::sys(format!("reading {path:?}"), e))?;
    let truncated = data.len() > max;
    data.truncate(max);
    Ok(ReadVolumeFileResponse {
        data,
        truncated,
        ..Default::default()
    })
}

fn is_mount_point(path: &std::path::Path, parent_dev: u64) -> std::io::Result<bool> {
    Ok(std::fs::symlink_metadata(path)?.dev() != parent_dev)
}

impl Volumes {
    /// The volumes under `root` (`twig_proto::GUEST_VOLUMES_DIR` in a VM).
    pub fn new(root: PathBuf) -> Self {
        Volumes {
            root,
            mounted: Mutex::new(false),
        }
    }

    /// Mounts the root tmpfs (mode 0700) unless it is (a restored VM's
    /// agent remembers; a new one checks).
    fn mount_root(&self, mounted: &mut bool) -> Result<()> {
        if *mounted {
            return Ok(());
        }
        let root = &self.root;
        let shown = root.display();
        std::fs::create_dir_all(root)
            .map_err(|e| AgentError::sys(format!("creating {shown}"), e))?;
        let parent = root.parent().unwrap_or(root);
        let parent_dev = std::fs::metadata(parent)
            .map_err(|e| AgentError::sys(format!("inspecting {}", parent.display()), e))?
            .dev();
        let already = is_mount_point(root, parent_dev)
            .map_err(|e| AgentError::sys(format!("inspecting {shown}"), e))?;
        if !already {
            mount(
                Some("tmpfs"),
                root,
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some("mode=0700"),
            )
            .map_err(|e| AgentError::sys(format!("mounting a tmpfs on {shown}"), e))?;
            tracing::info!(root = %shown, "volumes tmpfs mounted");
        }
        *mounted = true;
        Ok(())
    }

    fn root_dev(&self) -> Result<u64> {
        std::fs::metadata(&self.root)
            .map(|m| m.dev())
            .map_err(|e| AgentError::sys(format!("inspecting {}", self.root.display()), e))
    }

    /// Where the pod's disk is mounted: beside the volumes root.
    fn disk_dir(&self) -> PathBuf {
        self.root.parent().unwrap_or(&self.root).join(POD_DISK_DIR)
    }

    /// Mounts the pod's disk `device` (ext4) unless it is mounted, and makes
    /// its volumes directory: the device number its files have.
    fn mount_disk(&self, device: &str) -> Result<u64> {
        let want = std::fs::metadata(device)
            .map_err(|e| AgentError::InvalidArgument(format!("the pod's disk {device}: {e}")))?;
        if !want.file_type().is_block_device() {
            return Err(AgentError::InvalidArgument(format!(
                "the pod's disk {device} is not a block device"
            )));
        }
        let want = want.rdev();
        let dir = self.disk_dir();
        let shown = dir.display();
        std::fs::create_dir_all(&dir)
            .map_err(|e| AgentError::sys(format!("creating {shown}"), e))?;
        let parent = dir.parent().unwrap_or(&dir);
        let parent_dev = std::fs::metadata(parent)
            .map_err(|e| AgentError::sys(format!("inspecting {}", parent.display()), e))?
            .dev();
        let mounted = is_mount_point(&dir, parent_dev)
            .map_err(|e| AgentError::sys(format!("inspecting {shown}"), e))?;
        if !mounted {
            mount(
                Some(device),
                &dir,
                Some("ext4"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                None::<&str>,
            )
            .map_err(|e| {
                AgentError::sys(format!("mounting the pod's disk {device} on {shown}"), e)
            })?;
            tracing::info!(device, dir = %shown, "the pod's disk mounted");
        }
        let have = std::fs::metadata(&dir)
            .map_err(|e| AgentError::sys(format!("inspecting {shown}"), e))?
            .dev();
        if have != want {
            return Err(AgentError::FailedPrecondition(format!(
                "{shown} holds another disk than {device}: a pod has one disk for its volumes"
            )));
        }
        match std::fs::create_dir(dir.join(DISK_VOLUMES)) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(AgentError::sys(
                    format!("creating {shown}/{DISK_VOLUMES}"),
                    e,
                ))
            }
            _ => {}
        }
        Ok(want)
    }

    /// PrepareVolume: creates volume `name` unless it exists — a directory,
    /// a tmpfs of `tmpfs_bytes`, or a directory on the pod's disk `device`
    /// bound onto it —, resizes its tmpfs, sets its mode and owner.
    pub fn prepare(&self, req: &PrepareVolumeRequest) -> Result<()> {
        let name = req.name.as_str();
        validate_name(name)?;
        if !req.share.is_empty() {
            return self.prepare_share(req);
        }
        validate_mode(name, req.mode)?;
        let on_disk = !req.device.is_empty();
        if on_disk && req.tmpfs_bytes > 0 {
            return Err(AgentError::InvalidArgument(format!(
                "volume {name}: a tmpfs of its own or a directory on the pod's disk, not both"
            )));
        }
        let mut mounted = lock(&self.mounted);
        self.mount_root(&mut mounted)?;
        let disk_dev = on_disk.then(|| self.mount_disk(&req.device)).transpose()?;
        let dir = self.root.join(name);
        let shown = dir.display();
        let root_dev = self.root_dev()?;
        let size = format!("size={}", req.tmpfs_bytes);
        match std::fs::symlink_metadata(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&dir)
                    .map_err(|e| AgentError::sys(format!("creating {shown}"), e))?;
                let made = if req.tmpfs_bytes > 0 {
                    let data = format!("{size},mode=0700");
                    mount(
                        Some("tmpfs"),
                        &dir,
                        Some("tmpfs"),
                        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                        Some(data.as_str()),
                    )
                    .map_err(|e| AgentError::sys(format!("mounting a tmpfs on {shown}"), e))
                } else if on_disk {
                    self.bind_from_disk(name, &dir)
                } else {
                    Ok(())
                };
                if let Err(e) = made {
                    let _ = std::fs::remove_dir(&dir);
                    return Err(e);
                }
                tracing::info!(
                    name,
                    tmpfs_bytes = req.tmpfs_bytes,
                    on_disk,
                    "volume created"
                );
            }
            Err(e) => return Err(AgentError::sys(format!("inspecting {shown}"), e)),
            Ok(m) if !m.is_dir() => {
                return Err(AgentError::Internal(format!("{shown} is not a directory")))
            }
            Ok(m) => {
                let is = if m.dev() == root_dev {
                    "a directory"
                } else if Some(m.dev()) == disk_dev {
                    "on the pod's disk"
                } else {
                    "a tmpfs of its own"
                };
                let want = if on_disk {
                    "on the pod's disk"
                } else if req.tmpfs_bytes > 0 {
                    "a tmpfs of its own"
                } else {
                    "a directory"
                };
                if is != want {
                    return Err(AgentError::FailedPrecondition(format!(
                        "volume {name} is {is}, not {want}"
                    )));
                }
                if req.tmpfs_bytes > 0 {
                    mount(
                        None::<&str>,
                        &dir,
                        None::<&str>,
                        MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                        Some(size.as_str()),
                    )
                    .map_err(|e| {
                        AgentError::FailedPrecondition(format!(
                            "resizing the tmpfs of volume {name} to {} bytes: {e} \
                             (does it hold more?)",
                            req.tmpfs_bytes
                        ))
                    })?;
                }
            }
        }
        let fd = openat(
            AT_FDCWD,
            &dir,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| AgentError::sys(format!("opening {shown}"), e))?;
        fchown(
            fd.as_fd(),
            Some(Uid::from_raw(req.uid)),
            Some(Gid::from_raw(req.gid)),
        )
        .and_then(|()| nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_retain(req.mode)))
        .map_err(|e| AgentError::sys(format!("setting the mode of {shown}"), e))?;
        for sub in &req.subdirs {
            make_subdir(fd.as_fd(), sub, req.mode)?;
        }
        Ok(())
    }

    /// PrepareVolume of a file share: mounts the 9p filesystem served on
    /// share `req.share`'s connection on a new volume `req.name`.
    fn prepare_share(&self, req: &PrepareVolumeRequest) -> Result<()> {
        let name = req.name.as_str();
        if !twig_agent::proto::file_share::valid_id(&req.share) {
            return Err(invalid(format!(
                "volume {name}: share id {:?} is malformed",
                req.share
            )));
        }
        if req.tmpfs_bytes > 0 || !req.device.is_empty() {
            return Err(invalid(format!(
                "volume {name}: a file share is neither a tmpfs nor on the pod's disk"
            )));
        }
        let mut mounted = lock(&self.mounted);
        self.mount_root(&mut mounted)?;
        let dir = self.root.join(name);
        let shown = dir.display();
        match std::fs::create_dir(&dir) {
            // A restarted container's (the same name): the exited one's
            // mount is detached (its bind, if any, keeps it) and the new
            // share mounted in its place.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let root_dev = self.root_dev()?;
                let mounted = is_mount_point(&dir, root_dev)
                    .map_err(|e| AgentError::sys(format!("inspecting {shown}"), e))?;
                if mounted {
                    umount2(&dir, MntFlags::MNT_DETACH)
                        .map_err(|e| AgentError::sys(format!("unmounting {shown}"), e))?;
                }
            }
            Err(e) => return Err(AgentError::sys(format!("creating {shown}"), e)),
            Ok(()) => {}
        }
        let mounted = crate::shares::take(&req.share, crate::shares::ARRIVAL)
            .and_then(|stream| crate::shares::mount(stream, &dir, req.read_only));
        if let Err(e) = mounted {
            let _ = std::fs::remove_dir(&dir);
            return Err(e);
        }
        tracing::info!(name, read_only = req.read_only, "file share mounted");
        Ok(())
    }

    /// Binds volume `name`'s directory on the pod's disk (made if missing:
    /// a restored pod's is there already) onto `dir`.
    fn bind_from_disk(&self, name: &str, dir: &std::path::Path) -> Result<()> {
        let src = self.disk_dir().join(DISK_VOLUMES).join(name);
        match std::fs::create_dir(&src) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(AgentError::sys(format!("creating {}", src.display()), e))
            }
            _ => {}
        }
        mount(
            Some(&src),
            dir,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(|e| {
            AgentError::sys(
                format!("binding {} onto {}", src.display(), dir.display()),
                e,
            )
        })
    }

    fn open(&self, name: &str) -> Result<OwnedFd> {
        let dir = self.root.join(name);
        openat(
            AT_FDCWD,
            &dir,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::ENOENT => AgentError::NotFound(format!("no volume {name}")),
            e => AgentError::sys(format!("opening {}", dir.display()), e),
        })
    }

    /// SyncVolume: makes volume `name`'s tree equal to the entries.
    pub fn sync(&self, req: SyncVolumeRequest) -> Result<()> {
        validate_name(&req.name)?;
        let entries = validate_entries(req.entries)?;
        let _serialized = lock(&self.mounted);
        let vol = self.open(&req.name)?;
        sync_tree(vol.as_fd(), &entries)?;
        tracing::debug!(name = req.name, entries = entries.len(), "volume synced");
        Ok(())
    }

    /// ReadVolumeFile: the start of a regular file of volume `name`.
    pub fn read_file(&self, req: &ReadVolumeFileRequest) -> Result<ReadVolumeFileResponse> {
        validate_name(&req.name)?;
        validate_path(&req.path)?;
        let vol = self.open(&req.name)?;
        read_beneath(vol.as_fd(), &req.path, req.max_bytes)
    }

    /// RemoveVolume: unmounts (a tmpfs of its own) and deletes volume
    /// `name`; missing is fine.
    pub fn remove(&self, name: &str) -> Result<()> {
        validate_name(name)?;
        let _serialized = lock(&self.mounted);
        let dir = self.root.join(name);
        let shown = dir.display();
        let root_dev = match std::fs::metadata(&self.root) {
            Ok(m) => m.dev(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                return Err(AgentError::sys(
                    format!("inspecting {}", self.root.display()),
                    e,
                ))
            }
        };
        match is_mount_point(&dir, root_dev) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(AgentError::sys(format!("inspecting {shown}"), e)),
            // Detached: a container's bind mount of it lives on until the
            // container goes.
            Ok(true) => umount2(&dir, MntFlags::MNT_DETACH)
                .map_err(|e| AgentError::sys(format!("unmounting {shown}"), e))?,
            Ok(false) => {}
        }
        std::fs::remove_dir_all(&dir)
            .map_err(|e| AgentError::sys(format!("removing {shown}"), e))?;
        tracing::info!(name, "volume removed");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, data: &str) -> VolumeEntry {
        let mut e = VolumeEntry {
            path: path.to_string(),
            mode: 0o644,
            ..Default::default()
        };
        e.set_file(data.as_bytes().to_vec());
        e
    }

    fn dir(path: &str) -> VolumeEntry {
        let mut e = VolumeEntry {
            path: path.to_string(),
            mode: 0o755,
            ..Default::default()
        };
        e.set_dir(true);
        e
    }

    fn link(path: &str, target: &str) -> VolumeEntry {
        let mut e = VolumeEntry {
            path: path.to_string(),
            ..Default::default()
        };
        e.set_symlink(target.to_string());
        e
    }

    fn open_root(d: &tempfile::TempDir) -> OwnedFd {
        openat(
            AT_FDCWD,
            d.path(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    fn sync(vol: &OwnedFd, entries: Vec<VolumeEntry>) -> Result<()> {
        sync_tree(vol.as_fd(), &validate_entries(entries)?)
    }

    /// The tree under `root`: `path` → contents, `-> target` or `/`.
    fn tree(root: &std::path::Path) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut todo = vec![root.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                let m = std::fs::symlink_metadata(&p).unwrap();
                let what = if m.is_symlink() {
                    format!("-> {}", std::fs::read_link(&p).unwrap().display())
                } else if m.is_dir() {
                    todo.push(p);
                    "/".to_string()
                } else {
                    std::fs::read_to_string(&p).unwrap()
                };
                out.push((rel, what));
            }
        }
        out.sort();
        out
    }

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    /// kubelet's AtomicWriter layout of `keys` in timestamped dir `ts`.
    fn kubelet(ts: &str, keys: &[(&str, &str)]) -> Vec<VolumeEntry> {
        let mut v = vec![dir(ts), link("..data", ts)];
        for (k, data) in keys {
            v.push(file(&format!("{ts}/{k}"), data));
            v.push(link(k, &format!("..data/{k}")));
        }
        v
    }

    fn code(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Ok(v) => format!("ok {v:?}"),
            Err(AgentError::InvalidArgument(m)) => format!("invalid: {m}"),
            Err(AgentError::NotFound(m)) => format!("not found: {m}"),
            Err(e) => format!("other: {e}"),
        }
    }

    #[test]
    fn a_subpath_is_made_beneath_the_volume_and_never_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let vol = File::open(tmp.path()).unwrap();
        make_subdir(vol.as_fd(), "seed/deep", 0o777).unwrap();
        let mode = std::fs::metadata(tmp.path().join("seed/deep"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o777, "the volume's mode, past the umask");
        make_subdir(vol.as_fd(), "seed/deep", 0o777).unwrap();
        // A file one container wrote for another's subPath stays.
        std::fs::write(tmp.path().join("seed/file"), "x").unwrap();
        make_subdir(vol.as_fd(), "seed/file", 0o777).unwrap();
        assert_eq!(std::fs::read(tmp.path().join("seed/file")).unwrap(), b"x");
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), tmp.path().join("out")).unwrap();
        assert!(make_subdir(vol.as_fd(), "out/x", 0o777).is_err());
        assert!(
            make_subdir(vol.as_fd(), "out", 0o777).is_err(),
            "a link as the subPath"
        );
        assert!(!outside.path().join("x").exists(), "made through a link");
        assert!(code(make_subdir(vol.as_fd(), "../x", 0o777)).starts_with("invalid"));
    }

    #[test]
    fn names_paths_modes_and_targets_are_checked() {
        for ok in ["a", "kube-api-access-x7k2p", "term.c1_~x", &"n".repeat(200)] {
            validate_name(ok).unwrap();
        }
        for bad in ["", ".", "..", "a/b", "a b", "ä", &"n".repeat(201), "a\0"] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
        for ok in [
            "a",
            "..data",
            "..2026_11_28_10_00_00.1/key",
            "a/b/c",
            ".hidden",
        ] {
            validate_path(ok).unwrap();
        }
        let long = "a/".repeat(2048) + "a";
        let long_name = "n".repeat(256);
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "a/./b",
            "./a",
            "a//b",
            "a/",
            "a\0b",
            &long,
            &long_name,
        ] {
            assert!(validate_path(bad).is_err(), "{bad:?}");
        }
        for (path, target) in [
            ("key", "..data/key"),
            ("..data", "..2026_11_28"),
            ("a/b", "../c"),
            ("a/b/c", "../../d/e"),
            ("a/b", ".."),
        ] {
            validate_target(path, target).unwrap();
        }
        for (path, target) in [
            ("key", "/etc/passwd"),
            ("key", "../x"),
            ("a/b", "../../x"),
            ("key", "a/../../x"),
            ("key", "a/../b"),
            ("key", "./a"),
            ("key", "a//b"),
            ("key", ""),
            ("key", "a\0b"),
        ] {
            assert!(validate_target(path, target).is_err(), "{path} -> {target}");
        }
        let mut e = file("a", "x");
        e.mode = 0o10000;
        let e = code(validate_entries(vec![e]));
        assert!(e.contains("over 0o7777"), "{e}");
    }

    #[test]
    fn entries_need_listed_parents_no_duplicates_and_stay_within_limits() {
        let e = code(validate_entries(vec![file("a/b", "x")]));
        assert!(e.contains("not a listed directory"), "{e}");
        let e = code(validate_entries(vec![file("a", "x"), file("a/b", "y")]));
        assert!(e.contains("not a listed directory"), "{e}");
        let e = code(validate_entries(vec![file("a", "x"), file("a", "y")]));
        assert!(e.contains("listed twice"), "{e}");
        let e = code(validate_entries(vec![file("..twig-tmp", "x")]));
        assert!(e.contains("the agent's"), "{e}");
        let e = code(validate_entries(vec![VolumeEntry {
            path: "a".into(),
            ..Default::default()
        }]));
        assert!(e.contains("not a file, a symlink or a directory"), "{e}");
        let mut d = dir("d");
        d.set_dir(false);
        assert!(validate_entries(vec![d]).is_err());
        let big = "x".repeat(MAX_SYNC_BYTES / 2);
        let e = code(validate_entries(vec![file("a", &big), file("b", &big)]));
        assert!(e.contains("more than"), "{e}");
        let many = (0..=MAX_ENTRIES).map(|i| dir(&i.to_string())).collect();
        let e = code(validate_entries(many));
        assert!(e.contains("entries, over"), "{e}");
        validate_entries(vec![dir("a"), file("a/b", "x"), link("c", "a/b")]).unwrap();
    }

    #[test]
    fn a_sync_makes_the_tree_equal_to_the_entries() {
        let d = tempfile::tempdir().unwrap();
        let vol = open_root(&d);
        std::fs::write(d.path().join("stale"), "old").unwrap();
        std::fs::create_dir_all(d.path().join("olddir/sub")).unwrap();
        std::fs::write(d.path().join("olddir/sub/f"), "x").unwrap();
        std::fs::create_dir(d.path().join("was-dir")).unwrap();
        std::fs::write(d.path().join("was-dir/f"), "x").unwrap();
        std::fs::write(d.path().join("was-file"), "x").unwrap();
        let mut secret = file("s/secret", "pw");
        secret.mode = 0o600;
        secret.gid = 1234;
        sync(
            &vol,
            vec![
                dir("s"),
                secret,
                file("was-dir", "now a file"),
                dir("was-file"),
                link("l", "s/secret"),
                file("empty", ""),
            ],
        )
        .unwrap();
        assert_eq!(
            tree(d.path()),
            pairs(&[
                ("empty", ""),
                ("l", "-> s/secret"),
                ("s", "/"),
                ("s/secret", "pw"),
                ("was-dir", "now a file"),
                ("was-file", "/"),
            ])
        );
        let m = std::fs::metadata(d.path().join("s/secret")).unwrap();
        assert_eq!((m.mode() & 0o7777, m.uid(), m.gid()), (0o600, 0, 1234));
        assert_eq!(
            std::fs::metadata(d.path().join("s")).unwrap().mode() & 0o7777,
            0o755
        );
        // The same entries again: nothing to do.
        let entries = validate_entries(vec![
            dir("s"),
            {
                let mut s = file("s/secret", "pw");
                s.mode = 0o600;
                s.gid = 1234;
                s
            },
            file("was-dir", "now a file"),
            dir("was-file"),
            link("l", "s/secret"),
            file("empty", ""),
        ])
        .unwrap();
        assert_eq!(plan(vol.as_fd(), &entries).unwrap(), vec![]);
        // A new mode alone is set in place (same inode).
        let ino = std::fs::metadata(d.path().join("s/secret")).unwrap().ino();
        let mut s = file("s/secret", "pw");
        s.mode = 0o640;
        sync(&vol, vec![dir("s"), s]).unwrap();
        let m = std::fs::metadata(d.path().join("s/secret")).unwrap();
        assert_eq!((m.ino(), m.mode() & 0o7777, m.gid()), (ino, 0o640, 0));
        assert_eq!(tree(d.path()), pairs(&[("s", "/"), ("s/secret", "pw")]));
        // Empty: everything goes, names that are not UTF-8 too.
        use std::os::unix::ffi::OsStrExt;
        std::fs::write(d.path().join(OsStr::from_bytes(b"s/\xff")), "x").unwrap();
        sync(&vol, vec![]).unwrap();
        assert_eq!(tree(d.path()), vec![]);
        // The one file of a single-file volume (CRI's /etc/hosts, bound as
        // a file) changes in place: a bind of it sees the new content.
        sync(&vol, vec![file("file", "old hosts")]).unwrap();
        let ino = std::fs::metadata(d.path().join("file")).unwrap().ino();
        let entries = validate_entries(vec![file("file", "the pod's own hosts")]).unwrap();
        assert_eq!(plan(vol.as_fd(), &entries).unwrap(), vec![Op::Rewrite(0)]);
        sync(&vol, vec![file("file", "the pod's own hosts")]).unwrap();
        let m = std::fs::metadata(d.path().join("file")).unwrap();
        assert_eq!(m.ino(), ino);
        assert_eq!(tree(d.path()), pairs(&[("file", "the pod's own hosts")]));
    }

    #[test]
    fn a_kubelet_data_swap_stays_atomic_for_readers() {
        let d = tempfile::tempdir().unwrap();
        let vol = open_root(&d);
        let old_ts = "..2026_11_28_10_00_00.111";
        let new_ts = "..2026_11_28_10_05_00.222";
        sync(&vol, kubelet(old_ts, &[("a", "a1"), ("gone", "g1")])).unwrap();
        assert_eq!(
            tree(d.path()),
            pairs(&[
                ("..2026_11_28_10_00_00.111", "/"),
                ("..2026_11_28_10_00_00.111/a", "a1"),
                ("..2026_11_28_10_00_00.111/gone", "g1"),
                ("..data", "-> ..2026_11_28_10_00_00.111"),
                ("a", "-> ..data/a"),
                ("gone", "-> ..data/gone"),
            ])
        );
        let a_ino = std::fs::symlink_metadata(d.path().join("a")).unwrap().ino();

        // An update: key a changes, gone goes, new comes; a key whose name
        // sorts before "..data" too.
        let entries =
            validate_entries(kubelet(new_ts, &[("a", "a2"), ("new", "n2"), ("-x", "x2")])).unwrap();
        let ops = plan(vol.as_fd(), &entries).unwrap();
        let show: Vec<String> = ops
            .iter()
            .map(|op| match op {
                Op::Mkdir(i) => format!("mkdir {}", entries[*i].path),
                Op::Write(i) => format!("write {}", entries[*i].path),
                Op::Rewrite(i) => format!("rewrite {}", entries[*i].path),
                Op::Link(i) => format!("link {}", entries[*i].path),
                Op::Attrs(i) => format!("attrs {}", entries[*i].path),
                Op::Remove { parent, name } => {
                    format!("remove {parent}/{}", name.to_string_lossy())
                }
            })
            .collect();
        assert_eq!(
            show,
            [
                format!("mkdir {new_ts}"),
                format!("write {new_ts}/-x"),
                format!("write {new_ts}/a"),
                format!("write {new_ts}/new"),
                "link ..data".to_string(),
                "link -x".to_string(),
                "link new".to_string(),
                format!("remove /{old_ts}"),
                "remove /gone".to_string(),
            ]
        );
        // Step by step: the old tree stays whole until ..data moves, the
        // new one is whole from then on; a is never missing or partial.
        let read = |k: &str| std::fs::read_to_string(d.path().join(k)).ok();
        let mut want = [("a", Some("a1")), ("gone", Some("g1"))];
        for op in &ops {
            for (k, v) in want {
                assert_eq!(read(k).as_deref(), v, "{k} before {op:?}");
            }
            apply(vol.as_fd(), &entries, op).unwrap();
            if matches!(op, Op::Link(i) if entries[*i].path == "..data") {
                want = [("a", Some("a2")), ("gone", None)];
            }
            for (k, v) in want {
                assert_eq!(read(k).as_deref(), v, "{k} after {op:?}");
            }
        }
        assert_eq!(
            tree(d.path()),
            pairs(&[
                ("-x", "-> ..data/-x"),
                ("..2026_11_28_10_05_00.222", "/"),
                ("..2026_11_28_10_05_00.222/-x", "x2"),
                ("..2026_11_28_10_05_00.222/a", "a2"),
                ("..2026_11_28_10_05_00.222/new", "n2"),
                ("..data", "-> ..2026_11_28_10_05_00.222"),
                ("a", "-> ..data/a"),
                ("new", "-> ..data/new"),
            ])
        );
        // The unchanged user-visible symlink was not replaced.
        assert_eq!(
            std::fs::symlink_metadata(d.path().join("a")).unwrap().ino(),
            a_ino
        );
    }

    #[test]
    fn concurrent_readers_never_see_a_missing_or_partial_file() {
        let d = tempfile::tempdir().unwrap();
        let vol = open_root(&d);
        let content = |n: usize| format!("{n:04}").repeat(4096);
        sync(&vol, kubelet("..ts0", &[("k", &content(0))])).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut reads = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // As with kubelet, a reader that resolved ..data just
                    // before the old directory went finds nothing there.
                    let Ok(got) = std::fs::read_to_string(d.path().join("k")) else {
                        continue;
                    };
                    assert_eq!(got.len(), 4 * 4096);
                    assert_eq!(got, got[..4].repeat(4096));
                    reads += 1;
                }
                reads
            });
            for n in 1..200 {
                sync(&vol, kubelet(&format!("..ts{n}"), &[("k", &content(n))])).unwrap();
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            assert!(reader.join().unwrap() > 0);
        });
        assert_eq!(tree(d.path()).len(), 4);
    }

    #[test]
    fn a_sync_never_writes_through_a_planted_symlink() {
        let outside = tempfile::tempdir().unwrap();
        let d = tempfile::tempdir().unwrap();
        let vol = open_root(&d);
        std::os::unix::fs::symlink(outside.path(), d.path().join("sub")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("f"), d.path().join("f")).unwrap();
        sync(&vol, vec![dir("sub"), file("sub/x", "in"), file("f", "in")]).unwrap();
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
        assert_eq!(
            tree(d.path()),
            pairs(&[("f", "in"), ("sub", "/"), ("sub/x", "in")])
        );
    }

    #[test]
    fn reads_stay_in_the_volume() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "host").unwrap();
        let d = tempfile::tempdir().unwrap();
        let vol = open_root(&d);
        sync(
            &vol,
            kubelet("..ts", &[("msg", "bye"), ("big", &"x".repeat(100_000))]),
        )
        .unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), d.path().join("abs")).unwrap();
        std::fs::create_dir(d.path().join("d")).unwrap();
        std::os::unix::fs::symlink("../../x", d.path().join("d/up")).unwrap();
        let r = read_beneath(vol.as_fd(), "msg", 100).unwrap();
        assert_eq!((r.data.as_slice(), r.truncated), (&b"bye"[..], false));
        let r = read_beneath(vol.as_fd(), "msg", 2).unwrap();
        assert_eq!((r.data.as_slice(), r.truncated), (&b"by"[..], true));
        let r = read_beneath(vol.as_fd(), "big", 0).unwrap();
        assert_eq!((r.data.len(), r.truncated), (MAX_READ_BYTES as usize, true));
        assert!(code(read_beneath(vol.as_fd(), "abs", 0)).starts_with("invalid"));
        assert!(code(read_beneath(vol.as_fd(), "d/up", 0)).starts_with("invalid"));
        assert!(code(read_beneath(vol.as_fd(), "d", 0)).contains("not a regular file"));
        assert!(code(read_beneath(vol.as_fd(), "missing", 0)).starts_with("not found"));
        assert!(code(read_beneath(vol.as_fd(), "msg/x", 0)).starts_with("not found"));
    }
}
