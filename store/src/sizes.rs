//! Sizes: what one snapshot holds (memory and disks, allocated) and what a
//! restore of it needs (guest RAM and disks, logical), and what the whole
//! store occupies on its filesystem. Allocated bytes are `st_blocks × 512`:
//! a sparse file counts only what is allocated, and a block a reflink
//! shares with another file counts in each file (the filesystem does not
//! say which file owns it; [`crate::NodeStore::usage`] counts shared
//! extents once, at the price of a FIEMAP walk of every file).

use std::collections::HashSet;
use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::error::{ctx, Error, Result};
use crate::layout::Artefact;

/// The sizes of one published snapshot, computed from its files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SnapshotSizes {
    /// Allocated bytes of its `memory` file: all of guest RAM that was ever
    /// written for a full snapshot, its own layer (the pages dirtied since
    /// its parent) for an incremental one. Holes (never-touched pages)
    /// count nothing.
    pub memory_bytes: u64,
    /// Allocated bytes of its `disk<i>` files together (blocks shared by
    /// reflink with a parent or a running pod count here too).
    pub disk_bytes: u64,
    /// What a restore of it maps: the `memory` file's logical size (twig-vmm
    /// sizes every memory file, full or incremental, to the guest's RAM)
    /// plus every `disk<i>`'s logical size (the pod's disks). Like a
    /// VolumeSnapshot's `restoreSize`: the capacity the restored pod gets,
    /// independent of sparseness and of the parent chain.
    pub restore_bytes: u64,
}

/// The sizes of the snapshot in directory `dir` (its `memory` and
/// `disk<i>` files; a missing `memory` counts 0, `state` and the manifest
/// count in neither). Reads nothing but the files' metadata, so the shim
/// can call it on a snapshot it has just published.
pub fn snapshot_sizes(dir: &Path) -> Result<SnapshotSizes> {
    let mut sizes = SnapshotSizes::default();
    let reading = || format!("reading {}", dir.display());
    for entry in fs::read_dir(dir).map_err(ctx(reading()))? {
        let entry = entry.map_err(ctx(reading()))?;
        let name = entry.file_name();
        let Some(artefact) = name.to_str().and_then(Artefact::from_file_name) else {
            continue;
        };
        let path = entry.path();
        let meta = fs::symlink_metadata(&path)
            .map_err(ctx(format!("reading the metadata of {}", path.display())))?;
        if !meta.is_file() {
            continue;
        }
        let allocated = meta.blocks().saturating_mul(512);
        match artefact {
            Artefact::Memory => sizes.memory_bytes = allocated,
            Artefact::Disk(_) => sizes.disk_bytes = sizes.disk_bytes.saturating_add(allocated),
            Artefact::State => continue,
        }
        sizes.restore_bytes = sizes.restore_bytes.saturating_add(meta.len());
    }
    Ok(sizes)
}

/// The node store's footprint and its filesystem's room.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StoreStats {
    /// Allocated bytes of every regular file under the store's root
    /// (published snapshots with their manifests, staging in progress,
    /// deletions not yet done); a file with several hard links counts once,
    /// a block shared by reflink counts in each file that holds it.
    pub allocated_bytes: u64,
    /// Size of the store's filesystem (`statvfs`: blocks × fragment size).
    pub capacity_bytes: u64,
    /// Bytes of it an unprivileged writer can still allocate (`f_bavail`,
    /// what `df` shows as available).
    pub free_bytes: u64,
    /// Published snapshots that are not templates.
    pub snapshots: u64,
    /// Published templates.
    pub templates: u64,
}

/// Allocated bytes of every regular file under `root`, each inode once.
/// Entries that vanish while it walks (a deletion finishing) are skipped.
pub(crate) fn allocated_under(root: &Path) -> Result<u64> {
    let mut seen = HashSet::new();
    let mut total = 0_u64;
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound && dir != root => continue,
            Err(e) => return Err(Error::io(format!("reading {}", dir.display()), e)),
        };
        for entry in entries {
            let entry = entry.map_err(ctx(format!("reading {}", dir.display())))?;
            let meta = match entry.metadata() {
                Ok(m) => m,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => {
                    return Err(Error::io(
                        format!("reading the metadata of {}", entry.path().display()),
                        e,
                    ))
                }
            };
            if meta.is_dir() {
                pending.push(entry.path());
            } else if meta.is_file() && seen.insert((meta.dev(), meta.ino())) {
                total = total.saturating_add(meta.blocks().saturating_mul(512));
            }
        }
    }
    Ok(total)
}

/// Capacity and free bytes of the filesystem holding `path`.
// statvfs's field types differ between targets (u32 on some 32-bit ones).
#[allow(clippy::useless_conversion)]
pub(crate) fn filesystem_room(path: &Path) -> Result<(u64, u64)> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidArgument(format!("{} holds a NUL byte", path.display())))?;
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `s` a writable statvfs, both
    // alive for the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(Error::io(
            format!("statvfs of {}", path.display()),
            io::Error::last_os_error(),
        ));
    }
    let fragment = u64::from(s.f_frsize);
    Ok((
        u64::from(s.f_blocks).saturating_mul(fragment),
        u64::from(s.f_bavail).saturating_mul(fragment),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::unix::fs::FileExt;

    fn allocated(path: &Path) -> u64 {
        fs::metadata(path).unwrap().blocks() * 512
    }

    #[test]
    fn a_sparse_memory_file_counts_what_is_allocated_and_restores_its_length() {
        let d = tempfile::tempdir().unwrap();
        let memory = File::create(d.path().join("memory")).unwrap();
        memory.set_len(64 << 20).unwrap();
        memory.write_all_at(&[7; 8192], 1 << 20).unwrap();
        memory.sync_all().unwrap();
        let disk = File::create(d.path().join("disk0")).unwrap();
        disk.set_len(32 << 20).unwrap();
        disk.write_all_at(&[1; 4096], 0).unwrap();
        disk.sync_all().unwrap();
        fs::write(d.path().join("disk2"), [2; 12288]).unwrap();
        fs::write(d.path().join("state"), [3; 20000]).unwrap();
        fs::write(d.path().join("manifest.json"), b"{}").unwrap();

        let s = snapshot_sizes(d.path()).unwrap();
        let mem = allocated(&d.path().join("memory"));
        assert!(
            (8192..64 << 20).contains(&mem),
            "memory holes counted: {mem}"
        );
        assert_eq!(s.memory_bytes, mem);
        let disks = allocated(&d.path().join("disk0")) + allocated(&d.path().join("disk2"));
        assert!(disks < 32 << 20, "disk holes counted: {disks}");
        assert_eq!(s.disk_bytes, disks);
        assert_eq!(s.restore_bytes, (64 << 20) + (32 << 20) + 12288);
    }

    #[test]
    fn a_snapshot_without_memory_or_disks_holds_nothing_and_a_missing_one_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("state"), [3; 100]).unwrap();
        assert_eq!(snapshot_sizes(d.path()).unwrap(), SnapshotSizes::default());
        let err = snapshot_sizes(&d.path().join("gone")).unwrap_err();
        assert!(err.to_string().contains("gone"), "{err}");
    }

    #[test]
    fn the_store_total_counts_hard_links_once_and_every_level() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("a/b")).unwrap();
        fs::write(d.path().join("a/x"), [1; 10000]).unwrap();
        fs::write(d.path().join("a/b/y"), [1; 5000]).unwrap();
        fs::hard_link(d.path().join("a/x"), d.path().join("x-again")).unwrap();
        let want = allocated(&d.path().join("a/x")) + allocated(&d.path().join("a/b/y"));
        assert!(want >= 15000);
        assert_eq!(allocated_under(d.path()).unwrap(), want);
        assert!(allocated_under(&d.path().join("nope")).is_err());
    }

    #[test]
    fn the_filesystem_room_is_what_statvfs_says() {
        let d = tempfile::tempdir().unwrap();
        let (capacity, free) = filesystem_room(d.path()).unwrap();
        assert!(capacity > 0 && free <= capacity, "{capacity} {free}");
        assert!(filesystem_room(&d.path().join("nope")).is_err());
    }
}
