//! Filesystem primitives of every Twig store and of twig-vmm: reflink
//! (FICLONE) and its copy fallbacks, durable writes, no-replace renames,
//! `flock` and block accounting through FIEMAP. One implementation, shared.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// `FICLONE` = `_IOW(0x94, 9, int)`.
const FICLONE: libc::c_ulong = 0x4004_9409;
/// `FS_IOC_FIEMAP` = `_IOWR('f', 11, struct fiemap)`.
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
const FIEMAP_FLAG_SYNC: u32 = 0x1;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
const FIEMAP_EXTENT_SHARED: u32 = 0x2000;
const FIEMAP_BATCH: usize = 256;

/// How a store makes a child file from a parent file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CloneMode {
    /// FICLONE: a metadata operation; blocks stay shared until written.
    Reflink,
    /// A full (sparse-aware) copy: only behind an explicit `--allow-copy`.
    Copy,
}

/// Makes the open, writable `dst` share all of `src`'s extents (FICLONE).
pub fn ficlone(src: &File, dst: &File) -> io::Result<()> {
    // SAFETY: FICLONE takes the source descriptor as its integer argument;
    // both descriptors are open for the duration of the call.
    let rc = unsafe { libc::ioctl(dst.as_raw_fd(), FICLONE as _, src.as_raw_fd()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reflinks `src` to a new file `dst` (which must not exist).
pub fn reflink(src: &Path, dst: &Path) -> io::Result<()> {
    let from = File::open(src)?;
    let to = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    if let Err(err) = ficlone(&from, &to) {
        drop(to);
        let _ = fs::remove_file(dst);
        return Err(err);
    }
    Ok(())
}

/// Makes the open, writable, empty `dst` a copy of all of `src`: a reflink
/// where the filesystem shares extents, otherwise a copy of the data ranges
/// (`copy_file_range`, or reads and writes where the kernel cannot), keeping
/// holes. Returns which it did; the first fallback is logged once.
pub fn copy_file(src: &File, dst: &File) -> io::Result<CloneMode> {
    let e = match ficlone(src, dst) {
        Ok(()) => return Ok(CloneMode::Reflink),
        Err(e) => e,
    };
    if !matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EXDEV | libc::EINVAL | libc::ENOTTY | libc::ENOSYS)
    ) {
        return Err(e);
    }
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!("this filesystem cannot reflink ({e}); disk images are copied in full");
    });
    dst.set_len(0)?;
    copy_data_ranges(src, dst, true)?;
    Ok(CloneMode::Copy)
}

/// Copies `src` to a new file `dst`, keeping holes: only the data ranges
/// (SEEK_DATA/SEEK_HOLE) are read and written. Plain reads and writes, not
/// `copy_file_range`, which XFS and btrfs would turn into a reflink: this is
/// the real copy the fallback (and the benchmark's baseline) needs.
pub fn sparse_copy(src: &Path, dst: &Path) -> io::Result<()> {
    let from = File::open(src)?;
    let to = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    let result = copy_data_ranges(&from, &to, false);
    if result.is_err() {
        drop(to);
        let _ = fs::remove_file(dst);
    }
    result
}

/// Copies the data ranges of `from` into `to` at the same offsets and gives
/// `to` the length of `from`. With `in_kernel`, through `copy_file_range`
/// (falling back to reads and writes where the kernel refuses it).
fn copy_data_ranges(from: &File, to: &File, in_kernel: bool) -> io::Result<()> {
    let len = from.metadata()?.len();
    to.set_len(len)?;
    let ifd = from.as_raw_fd();
    let mut buf = vec![0u8; 1 << 20];
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: plain lseek on an open descriptor.
        let data = unsafe { libc::lseek(ifd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole remains
            }
            return Err(err);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(ifd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut off = data as u64;
        if in_kernel && copy_range_in_kernel(from, to, &mut off, hole as u64)? {
            pos = hole;
            continue;
        }
        while off < hole as u64 {
            let n = ((hole as u64 - off) as usize).min(buf.len());
            from.read_exact_at(&mut buf[..n], off)?;
            to.write_all_at(&buf[..n], off)?;
            off += n as u64;
        }
        pos = hole;
    }
    Ok(())
}

/// Copies `[*off, end)` of `from` to the same offsets of `to` with
/// `copy_file_range`, advancing `*off`. Returns `false` (the rest left to
/// the caller) where the kernel cannot copy between these files.
fn copy_range_in_kernel(from: &File, to: &File, off: &mut u64, end: u64) -> io::Result<bool> {
    while *off < end {
        let mut off_in = *off as libc::loff_t;
        let mut off_out = *off as libc::loff_t;
        let n = ((end - *off).min(1 << 30)) as usize;
        // SAFETY: both descriptors are open; the offsets are ours and the
        // kernel only reads and updates them.
        let r = unsafe {
            libc::copy_file_range(
                from.as_raw_fd(),
                &mut off_in,
                to.as_raw_fd(),
                &mut off_out,
                n,
                0,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EXDEV | libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS) => {
                    return Ok(false)
                }
                Some(libc::EINTR) => continue,
                _ => return Err(e),
            }
        }
        if r == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the source ended early",
            ));
        }
        *off += r as u64;
    }
    Ok(true)
}

/// Makes `dst` from `src` with the given mode.
pub fn clone_file(mode: CloneMode, src: &Path, dst: &Path) -> io::Result<()> {
    match mode {
        CloneMode::Reflink => reflink(src, dst),
        CloneMode::Copy => sparse_copy(src, dst),
    }
}

/// How the files of a reflink probe start: `<prefix><pid>-<n>-src|dst`.
pub const PROBE_PREFIX: &str = ".reflink-probe-";

/// Whether `name` is a file of a reflink probe of a process that still
/// runs (a store's cleanup leaves those alone).
pub fn live_probe(name: &str) -> bool {
    let Some(pid) = name
        .strip_prefix(PROBE_PREFIX)
        .and_then(|rest| rest.split('-').next())
        .and_then(|pid| pid.parse::<i32>().ok())
    else {
        return false;
    };
    process_lives(pid)
}

/// Whether process `pid` exists (in this pid namespace).
pub fn process_lives(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks that the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0
            || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// Checks that `dir` supports FICLONE by cloning a small probe file there.
/// Returns the OS error when it does not. The probe's files are named for
/// this process and call: shims of pods starting together open the store
/// at once, and shared names made one's probe remove another's files
/// (FICLONE then failed with ENOENT, read as "no reflinks").
pub fn probe_reflink(dir: &Path) -> io::Result<()> {
    static PROBES: AtomicU64 = AtomicU64::new(0);
    let tag = format!(
        "{}-{}",
        std::process::id(),
        PROBES.fetch_add(1, Ordering::Relaxed)
    );
    let a = dir.join(format!("{PROBE_PREFIX}{tag}-src"));
    let b = dir.join(format!("{PROBE_PREFIX}{tag}-dst"));
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create_new(true).open(&a)?;
        f.write_all(&[0x5a; 4096])?;
        f.sync_all()?;
        reflink(&a, &b)
    })();
    let _ = fs::remove_file(&a);
    let _ = fs::remove_file(&b);
    result
}

/// Writes `bytes` to `path` (created or truncated) and fsyncs it.
pub fn write_durable(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// fsyncs a file or directory by path.
pub fn sync_path(path: &Path) -> io::Result<()> {
    File::open(path)?.sync_all()
}

/// Renames `from` to `to`, failing with `AlreadyExists` instead of replacing.
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let from_c = CString::new(from.as_os_str().as_bytes())?;
    let to_c = CString::new(to.as_os_str().as_bytes())?;
    // SAFETY: both are NUL-terminated paths that live across the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from_c.as_ptr(),
            libc::AT_FDCWD,
            to_c.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Takes an exclusive `flock` on an open file or directory, waiting for it.
pub fn flock(file: &File) -> io::Result<()> {
    loop {
        // SAFETY: flock on an open descriptor.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Takes a non-blocking exclusive `flock` on an open file or directory.
/// Returns `Ok(false)` when another descriptor holds it.
pub fn try_flock(file: &File) -> io::Result<bool> {
    // SAFETY: flock on an open descriptor.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(err)
    }
}

/// One physically allocated range of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Where the range starts on the device, in bytes.
    pub physical: u64,
    /// Its length in bytes.
    pub length: u64,
    /// The filesystem reports the range as shared with another file.
    pub shared: bool,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct FiemapExtent {
    fe_logical: u64,
    fe_physical: u64,
    fe_length: u64,
    fe_reserved64: [u64; 2],
    fe_flags: u32,
    fe_reserved: [u32; 3],
}

#[repr(C)]
struct Fiemap {
    fm_start: u64,
    fm_length: u64,
    fm_flags: u32,
    fm_mapped_extents: u32,
    fm_extent_count: u32,
    fm_reserved: u32,
    fm_extents: [FiemapExtent; FIEMAP_BATCH],
}

/// The allocated extents of a file (FIEMAP, after syncing delayed allocation).
pub fn extents(path: &Path) -> io::Result<Vec<Extent>> {
    let file = File::open(path)?;
    let zero = FiemapExtent {
        fe_logical: 0,
        fe_physical: 0,
        fe_length: 0,
        fe_reserved64: [0; 2],
        fe_flags: 0,
        fe_reserved: [0; 3],
    };
    let mut map = Box::new(Fiemap {
        fm_start: 0,
        fm_length: u64::MAX,
        fm_flags: FIEMAP_FLAG_SYNC,
        fm_mapped_extents: 0,
        fm_extent_count: FIEMAP_BATCH as u32,
        fm_reserved: 0,
        fm_extents: [zero; FIEMAP_BATCH],
    });
    let mut out = Vec::new();
    loop {
        map.fm_mapped_extents = 0;
        map.fm_length = u64::MAX - map.fm_start;
        // SAFETY: `map` is a properly sized, writable fiemap with room for
        // `fm_extent_count` extents.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP as _, &mut *map) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let n = map.fm_mapped_extents as usize;
        if n == 0 {
            break;
        }
        let mut last = false;
        for e in &map.fm_extents[..n.min(FIEMAP_BATCH)] {
            out.push(Extent {
                physical: e.fe_physical,
                length: e.fe_length,
                shared: e.fe_flags & FIEMAP_EXTENT_SHARED != 0,
            });
            last |= e.fe_flags & FIEMAP_EXTENT_LAST != 0;
        }
        if last {
            break;
        }
        let tail = &map.fm_extents[n - 1];
        map.fm_start = tail.fe_logical + tail.fe_length;
    }
    Ok(out)
}

/// Space accounting of a set of files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    /// Sum of the files' apparent sizes.
    pub logical_bytes: u64,
    /// Sum of each file's allocated bytes, counting shared blocks once per file.
    pub allocated_bytes: u64,
    /// Bytes the filesystem reports as shared with some other file.
    pub shared_bytes: u64,
    /// Distinct physical bytes: what the set really occupies on disk.
    pub unique_bytes: u64,
    /// Number of files counted.
    pub files: u64,
}

/// Accounts `files` together: physical ranges shared between them count once
/// in `unique_bytes`. On a filesystem without FIEMAP (tmpfs), a file's
/// allocated blocks count as its own: nothing is known to be shared there.
pub fn usage_of<'a>(files: impl IntoIterator<Item = &'a Path>) -> io::Result<Usage> {
    let mut usage = Usage::default();
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for path in files {
        let meta = fs::metadata(path)?;
        usage.logical_bytes += meta.len();
        usage.files += 1;
        let extents = match extents(path) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                let allocated = meta.blocks() * 512;
                usage.allocated_bytes += allocated;
                usage.unique_bytes += allocated;
                continue;
            }
            r => r?,
        };
        for e in extents {
            usage.allocated_bytes += e.length;
            if e.shared {
                usage.shared_bytes += e.length;
            }
            ranges.push((e.physical, e.physical + e.length));
        }
    }
    ranges.sort_unstable();
    let mut end = 0u64;
    for (s, e) in ranges {
        let s = s.max(end);
        if e > s {
            usage.unique_bytes += e - s;
            end = e;
        }
    }
    Ok(usage)
}

/// Removes a file or directory tree; a missing path is not an error.
pub fn remove_all(path: &Path) -> io::Result<()> {
    let removed = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) => Err(e),
    };
    match removed {
        // Gone already, or by someone else meanwhile: what was asked.
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// The POSIX access ACL of a file, as the kernel stores it.
const ACL_XATTR: &[u8] = b"system.posix_acl_access\0";
const ACL_VERSION: u32 = 2;
const ACL_USER_OBJ: u16 = 0x01;
const ACL_USER: u16 = 0x02;
const ACL_GROUP_OBJ: u16 = 0x04;
const ACL_GROUP: u16 = 0x08;
const ACL_MASK: u16 = 0x10;
const ACL_OTHER: u16 = 0x20;
/// Read and search (a directory's `r-x`).
pub const ACL_READ_SEARCH: u16 = 0o5;

/// Serialises this process's read-modify-write of ACLs.
static ACL_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One entry of an access ACL: tag, permission bits, id (users and groups).
type AclEntry = (u16, u16, u32);

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::ErrorKind::InvalidInput.into())
}

/// The access ACL of `path`: its extended ACL, or the three entries its
/// mode makes.
fn read_acl(path: &Path) -> io::Result<Vec<AclEntry>> {
    let p = c_path(path)?;
    let mut buf = vec![0u8; 4 + 8 * 64];
    loop {
        // SAFETY: `p` and the xattr name are NUL-terminated; `buf` is
        // writable for its length.
        let n = unsafe {
            libc::getxattr(
                p.as_ptr(),
                ACL_XATTR.as_ptr().cast(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n >= 0 {
            return parse_acl(&buf[..n as usize]);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENODATA) => {
                let mode = fs::symlink_metadata(path)?.mode() as u16;
                return Ok(vec![
                    (ACL_USER_OBJ, (mode >> 6) & 7, u32::MAX),
                    (ACL_GROUP_OBJ, (mode >> 3) & 7, u32::MAX),
                    (ACL_OTHER, mode & 7, u32::MAX),
                ]);
            }
            Some(libc::ERANGE) if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            _ => return Err(e),
        }
    }
}

fn parse_acl(b: &[u8]) -> io::Result<Vec<AclEntry>> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "malformed POSIX ACL");
    let (version, rest) = b.split_first_chunk::<4>().ok_or_else(bad)?;
    if u32::from_le_bytes(*version) != ACL_VERSION || rest.len() % 8 != 0 {
        return Err(bad());
    }
    Ok(rest
        .chunks_exact(8)
        .map(|e| {
            (
                u16::from_le_bytes([e[0], e[1]]),
                u16::from_le_bytes([e[2], e[3]]),
                u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
            )
        })
        .collect())
}

/// Writes `entries` (sorted here, the mask recomputed: the union of the
/// group class) as the access ACL of `path`; without named users or
/// groups it is the mode alone.
fn write_acl(path: &Path, mut entries: Vec<AclEntry>) -> io::Result<()> {
    entries.retain(|e| e.0 != ACL_MASK);
    let named = entries
        .iter()
        .filter(|e| e.0 == ACL_USER || e.0 == ACL_GROUP)
        .count();
    if named > 0 {
        let mask = entries
            .iter()
            .filter(|e| matches!(e.0, ACL_USER | ACL_GROUP_OBJ | ACL_GROUP))
            .fold(0, |m, e| m | e.1);
        entries.push((ACL_MASK, mask, u32::MAX));
    }
    entries.sort_by_key(|e| (e.0, e.2));
    let mut b = ACL_VERSION.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        b.extend_from_slice(&tag.to_le_bytes());
        b.extend_from_slice(&perm.to_le_bytes());
        b.extend_from_slice(&id.to_le_bytes());
    }
    let p = c_path(path)?;
    // SAFETY: `p` and the name are NUL-terminated; `b` is readable for its
    // length. The kernel keeps only the mode for a minimal ACL.
    let r = unsafe {
        libc::setxattr(
            p.as_ptr(),
            ACL_XATTR.as_ptr().cast(),
            b.as_ptr().cast(),
            b.len(),
            0,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Grants user `uid` the permission bits `perm` on `path` by a named-user
/// ACL entry (kept with the others `path` has).
pub fn acl_grant(path: &Path, uid: u32, perm: u16) -> io::Result<()> {
    let _lock = ACL_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let mut entries = read_acl(path)?;
    if entries.contains(&(ACL_USER, perm, uid)) {
        return Ok(());
    }
    entries.retain(|e| !(e.0 == ACL_USER && e.2 == uid));
    entries.push((ACL_USER, perm, uid));
    write_acl(path, entries)
}

/// Removes the named-user ACL entries of `path` whose user `which`
/// selects; whether there were any.
pub fn acl_revoke(path: &Path, which: impl Fn(u32) -> bool) -> io::Result<bool> {
    let _lock = ACL_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let mut entries = read_acl(path)?;
    let before = entries.len();
    entries.retain(|e| !(e.0 == ACL_USER && which(e.2)));
    if entries.len() == before {
        return Ok(false);
    }
    write_acl(path, entries)?;
    Ok(true)
}

/// The users `path`'s access ACL names.
pub fn acl_users(path: &Path) -> io::Result<Vec<u32>> {
    Ok(read_acl(path)?
        .into_iter()
        .filter(|e| e.0 == ACL_USER)
        .map(|e| e.2)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_on_a_filesystem_without_fiemap_counts_allocated_blocks() {
        // /dev/shm is a tmpfs, which has no FIEMAP.
        let dir = tempfile::tempdir_in("/dev/shm").expect("a tmpfs directory");
        let path = dir.path().join("f");
        fs::write(&path, vec![1u8; 64 << 10]).expect("write");
        assert!(extents(&path).is_err(), "tmpfs answered FIEMAP");
        let u = usage_of([path.as_path()]).expect("usage on tmpfs");
        assert_eq!((u.files, u.logical_bytes), (1, 64 << 10));
        assert_eq!(u.allocated_bytes, u.unique_bytes);
        assert!(u.allocated_bytes >= 64 << 10, "{u:?}");
        assert_eq!(u.shared_bytes, 0);
    }
    use std::process::Command;

    fn sparse(path: &Path) -> File {
        let f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        f.write_all_at(&[1u8; 4096], 0).unwrap();
        f.write_all_at(&[2u8; 4096], 32 << 20).unwrap();
        f.set_len(64 << 20).unwrap();
        f
    }

    /// Copies `src` (made by `sparse`) and checks the copy, which may
    /// allocate at most `max_alloc` bytes.
    fn check_copy(src: &File, dst_path: &Path, max_alloc: u64) -> File {
        let dst = OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(dst_path)
            .unwrap();
        copy_file(src, &dst).unwrap();
        assert_eq!(dst.metadata().unwrap().len(), 64 << 20);
        let mut b = vec![0u8; 8192];
        dst.read_exact_at(&mut b, 0).unwrap();
        assert!(b[..4096].iter().all(|x| *x == 1) && b[4096..].iter().all(|x| *x == 0));
        dst.read_exact_at(&mut b, 32 << 20).unwrap();
        assert!(b[..4096].iter().all(|x| *x == 2));
        assert!(
            dst.metadata().unwrap().blocks() * 512 <= max_alloc,
            "holes kept"
        );
        dst
    }

    #[test]
    fn copy_file_copies_contents_and_keeps_holes() {
        let d = tempfile::tempdir().unwrap();
        let src = sparse(&d.path().join("src"));
        check_copy(&src, &d.path().join("dst"), 4 << 20);
        // The plain read/write copy keeps holes too.
        sparse_copy(&d.path().join("src"), &d.path().join("dst2")).unwrap();
        let m = fs::metadata(d.path().join("dst2")).unwrap();
        assert_eq!(m.len(), 64 << 20);
        assert!(m.blocks() * 512 <= 4 << 20, "holes kept");
    }

    /// An XFS file system on a loop device, unmounted on drop.
    struct Xfs(tempfile::TempDir);

    impl Drop for Xfs {
        fn drop(&mut self) {
            let _ = Command::new("umount")
                .arg(self.0.path().join("mnt"))
                .status();
        }
    }

    /// A fresh reflink-capable XFS (needs root and xfsprogs).
    fn xfs() -> (Xfs, std::path::PathBuf) {
        let fs = Xfs(tempfile::tempdir().unwrap());
        let img = fs.0.path().join("xfs.img");
        File::create(&img).unwrap().set_len(512 << 20).unwrap();
        let mkfs = Command::new("mkfs.xfs")
            .args(["-q", "-m", "reflink=1"])
            .arg(&img)
            .status()
            .expect("mkfs.xfs (xfsprogs) is needed");
        assert!(mkfs.success());
        let mnt = fs.0.path().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let ok = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(ok.success(), "loop-mounting XFS (needs root)");
        (fs, mnt)
    }

    #[test]
    fn probes_made_at_once_all_find_reflinks() {
        let (_fs, mnt) = xfs();
        let probes: Vec<_> = (0..16)
            .map(|_| {
                let dir = mnt.clone();
                std::thread::spawn(move || (0..20).map(|_| probe_reflink(&dir)).collect::<Vec<_>>())
            })
            .collect();
        for p in probes {
            for r in p.join().unwrap() {
                r.unwrap();
            }
        }
        let left: Vec<_> = fs::read_dir(&mnt)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "probe files left: {left:?}");
    }

    #[test]
    fn copy_file_reflinks_where_the_filesystem_can() {
        let (_fs, mnt) = xfs();
        let src = sparse(&mnt.join("src"));
        let before = free_bytes(&mnt);
        let big = vec![3u8; 8 << 20];
        src.write_all_at(&big, 8 << 20).unwrap();
        src.sync_all().unwrap();
        let used_by_src = before - free_bytes(&mnt);
        let dst = check_copy(&src, &mnt.join("dst"), 12 << 20);
        dst.sync_all().unwrap();
        let mut b = vec![0u8; 8 << 20];
        dst.read_exact_at(&mut b, 8 << 20).unwrap();
        assert!(b == big);
        let used_by_copy = before - used_by_src - free_bytes(&mnt);
        assert!(
            used_by_copy < 1 << 20,
            "a reflink shares the 8 MiB of data ({used_by_copy} bytes used)"
        );
    }

    fn free_bytes(p: &Path) -> u64 {
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: statvfs is plain old data; all zeroes is a valid value.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a NUL-terminated path and `s` outlives the call,
        // which only fills it.
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
        s.f_bfree * s.f_frsize
    }
}
