//! Replacing a disk image's contents through its open descriptor, for
//! images a jailed VMM was sent as descriptors (it cannot reach their
//! directory, so the rename used for images opened by path is out of
//! reach). All reflinks (`FICLONE`), so the cost does not grow with the
//! image's size:
//!
//! - prepare ([`InPlace::prepare`], nothing visible changes): the
//!   snapshot's copy is opened and checked, and the image's current
//!   contents are reflinked into an anonymous backup (`O_TMPFILE`) in a
//!   scratch directory on the image's filesystem (the node store's `tmp`):
//!   it never has a name, so a VMM killed at any point leaves nothing;
//! - apply ([`InPlace::apply`]): the image gets the snapshot copy's size and
//!   then its extents (`FICLONE` onto the attached descriptor);
//! - undo ([`InPlace::undo`], and on drop if not finished): the old size
//!   and the backup's extents put back the same way.
//!
//! The snapshot's copy and the store's `tmp` must be on the image's
//! filesystem; otherwise the rollback is refused naming both (device, type
//! and mount point), never a full copy on the pause path. The store's `tmp`
//! rather than the VMM's own directory because only the store is known to
//! share the images' filesystem (twig-snapshotter's images and the node
//! store live together); twig-node makes it writable for the jail's group.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::vm::failpoint;

/// A prepared in-place replacement of an attached image's contents.
pub(super) struct InPlace {
    /// The attached image (a second descriptor of it).
    target: File,
    /// Its name, for messages.
    name: PathBuf,
    /// The snapshot's copy of the disk.
    src: File,
    src_path: PathBuf,
    /// A reflink of the image's contents before the change.
    backup: File,
    old_size: u64,
    new_size: u64,
    /// Whether the image may have changed (so an undo is owed).
    applied: bool,
}

impl InPlace {
    /// Opens `src` (the snapshot's copy, which must be `size` bytes) and
    /// reflinks the current contents of `target` (the attached image,
    /// named `name`) into an anonymous file in `scratch`.
    pub(super) fn prepare(
        target: File,
        name: &Path,
        src: &Path,
        size: u64,
        scratch: &Path,
    ) -> Result<InPlace> {
        let from =
            File::open(src).map_err(|e| Error::io(format!("opening {}", src.display()), e))?;
        let have = from
            .metadata()
            .map_err(|e| Error::io(format!("reading {}", src.display()), e))?;
        if have.len() != size {
            return Err(Error::snapshot(
                src,
                format!(
                    "disk copy is {} bytes, the snapshot recorded {size}",
                    have.len()
                ),
            ));
        }
        let old = target
            .metadata()
            .map_err(|e| Error::io(format!("reading disk image {}", name.display()), e))?;
        // The change itself is a reflink from the snapshot's copy: refuse
        // before anything is done if it cannot be one.
        if old.dev() != have.dev() {
            return Err(Error::Config(format!(
                "cannot roll back disk image {} in place: {}",
                name.display(),
                two_filesystems((&target, name), (&from, src))
            )));
        }
        let backup = OpenOptions::new()
            .read(true)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE)
            .open(scratch)
            .map_err(|e| {
                Error::io(
                    format!(
                        "creating a backup of disk image {} in {} (O_TMPFILE)",
                        name.display(),
                        scratch.display()
                    ),
                    e,
                )
            })?;
        reflink(&target, &backup).map_err(|e| {
            cross_fs(
                e,
                format!(
                    "backing up disk image {} into {}",
                    name.display(),
                    scratch.display()
                ),
                (&target, name),
                (&backup, scratch),
            )
        })?;
        failpoint::check("rollback.disk_backup")?;
        Ok(InPlace {
            target,
            name: name.to_path_buf(),
            src: from,
            src_path: src.to_path_buf(),
            backup,
            old_size: old.len(),
            new_size: size,
            applied: false,
        })
    }

    /// The image's size once applied.
    pub(super) fn new_size(&self) -> u64 {
        self.new_size
    }

    /// Gives the image the snapshot copy's size and contents.
    pub(super) fn apply(&mut self) -> Result<()> {
        self.applied = true;
        set_len(&self.target, self.new_size)
            .map_err(|e| Error::io(format!("resizing disk image {}", self.name.display()), e))?;
        failpoint::check("rollback.disk_resize")?;
        reflink(&self.src, &self.target).map_err(|e| {
            cross_fs(
                e,
                format!(
                    "reflinking {} onto disk image {}",
                    self.src_path.display(),
                    self.name.display()
                ),
                (&self.src, &self.src_path),
                (&self.target, &self.name),
            )
        })?;
        failpoint::check("rollback.disk_clone")?;
        Ok(())
    }

    /// Puts the old size and contents back (nothing to do if [`apply`]
    /// never ran).
    ///
    /// [`apply`]: InPlace::apply
    pub(super) fn undo(&mut self) -> Result<()> {
        if !self.applied {
            return Ok(());
        }
        failpoint::check("rollback.disk_undo")?;
        let err = |e| {
            Error::io(
                format!(
                    "putting disk image {} back from its backup",
                    self.name.display()
                ),
                e,
            )
        };
        set_len(&self.target, self.old_size).map_err(err)?;
        reflink(&self.backup, &self.target).map_err(err)?;
        self.applied = false;
        Ok(())
    }

    /// Keeps the change: the backup is closed (and so freed).
    pub(super) fn commit(mut self) {
        self.applied = false;
    }
}

impl Drop for InPlace {
    fn drop(&mut self) {
        if let Err(e) = self.undo() {
            tracing::error!("{e}");
        }
    }
}

fn set_len(f: &File, size: u64) -> io::Result<()> {
    if f.metadata()?.len() == size {
        return Ok(());
    }
    f.set_len(size)
}

/// Makes `dst` share all of `src`'s extents. An empty `src` has none (and
/// `dst` was given its size already).
fn reflink(src: &File, dst: &File) -> io::Result<()> {
    if src.metadata()?.len() == 0 {
        return Ok(());
    }
    twig_store::fsops::ficlone(src, dst)
}

/// The error of a failed reflink; when the kernel says the two files
/// cannot share extents, it names their filesystems.
fn cross_fs(e: io::Error, what: String, a: (&File, &Path), b: (&File, &Path)) -> Error {
    match e.raw_os_error() {
        Some(libc::EXDEV | libc::EOPNOTSUPP | libc::EINVAL | libc::ENOTTY) => {
            Error::Config(format!(
                "{what}: {e}: rolling a disk sent as a descriptor back needs reflinks (FICLONE) between its image, the snapshot store and the store's tmp, one filesystem that supports them (XFS with reflink=1, btrfs); {}",
                two_filesystems(a, b)
            ))
        }
        _ => Error::io(what, e),
    }
}

/// Names the filesystems of two files: device, and type and mount point
/// where this process can see them.
fn two_filesystems(a: (&File, &Path), b: (&File, &Path)) -> String {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let describe = |(f, p): (&File, &Path)| {
        let dev = f.metadata().map(|m| m.dev()).unwrap_or(0);
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        let seen = mounts.lines().find_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            let dash = fields.iter().position(|f| *f == "-")?;
            (fields.get(2) == Some(&format!("{major}:{minor}").as_str())).then(|| {
                format!(
                    ", {} mounted at {}",
                    fields.get(dash + 1).unwrap_or(&"?"),
                    fields.get(4).unwrap_or(&"?")
                )
            })
        });
        format!(
            "{} is on device {major}:{minor}{}",
            p.display(),
            seen.unwrap_or_default()
        )
    };
    format!("{} but {}", describe(a), describe(b))
}

/// The scratch directory for backups of the disks a rollback to the
/// snapshot in `snapshot_dir` replaces in place: its store's `tmp`.
pub fn scratch_dir(snapshot_dir: &Path) -> Result<PathBuf> {
    let (root, _) = twig_store::layout::locate(snapshot_dir).map_err(|e| {
        Error::snapshot(
            snapshot_dir,
            format!("{e}: a disk sent as a descriptor is rolled back through the store's tmp"),
        )
    })?;
    Ok(root.join(twig_store::layout::TMP_DIR))
}
