//! The image files behind virtio-blk devices: [`DiskFile`] (a fixed disk's
//! image, or a disk slot that a file is attached to and detached from while
//! the VM runs) and [`Replacement`] (how restore and rollback put a
//! snapshot's copy of a disk in place, or change what a slot holds).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::snapshot::{self, DiskMeta};

use super::inplace::InPlace;

/// Sector size of the virtio-blk protocol.
pub const SECTOR: u64 = 512;
/// Length of a virtio-blk device id.
pub const ID_LEN: usize = 20;

/// An open image file: what a fixed disk always has and a slot has while
/// a file is attached.
pub(super) struct Backing {
    pub(super) path: PathBuf,
    pub(super) read_only: bool,
    pub(super) id: [u8; ID_LEN],
    pub(super) file: File,
    pub(super) size: u64,
    /// Whether the image came as a descriptor (the VMM may not be able to
    /// reach its directory).
    pub(super) sent: bool,
    /// Whether it is a host block device (a pod's raw block volume) rather
    /// than an image file: a snapshot cannot copy it.
    pub(super) block_device: bool,
}

// `BLKGETSIZE64` (`_IOR(0x12, 114, u64)`): a block device's size; the
// jail's seccomp filter allows it.
vmm_sys_util::ioctl_ior_nr!(BLKGETSIZE64, 0x12, 114, u64);

/// The size in bytes of the block device open as `file`.
fn block_device_size(file: &File) -> std::io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 to the pointer, which points to
    // `size`; `file` is an open descriptor.
    let r = unsafe { vmm_sys_util::ioctl::ioctl_with_mut_ref(file, BLKGETSIZE64(), &mut size) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

impl Backing {
    /// Opens the raw image at `path`; its size must be a multiple of 512.
    fn open(path: &Path, read_only: bool) -> Result<Backing> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|e| Error::io(format!("opening disk image {}", path.display()), e))?;
        Backing::of(path, read_only, file)
    }

    /// Checks that `file` (open at `path`) is a regular file or a block
    /// device whose size is a multiple of 512.
    fn of(path: &Path, read_only: bool, file: File) -> Result<Backing> {
        let meta = file
            .metadata()
            .map_err(|e| Error::io(format!("reading disk image {}", path.display()), e))?;
        let block_device = meta.file_type().is_block_device();
        let size = if block_device {
            block_device_size(&file).map_err(|e| {
                Error::io(
                    format!("reading the size of block device {}", path.display()),
                    e,
                )
            })?
        } else if meta.is_file() {
            meta.len()
        } else {
            return Err(Error::Config(format!(
                "disk image {} is neither a regular file nor a block device",
                path.display()
            )));
        };
        if size % SECTOR != 0 {
            return Err(Error::Config(format!(
                "disk image {} is {size} bytes, not a multiple of {SECTOR}",
                path.display()
            )));
        }
        Ok(Backing {
            path: path.to_path_buf(),
            read_only,
            id: id_of(path),
            file,
            size,
            sent: false,
            block_device,
        })
    }
}

impl Backing {
    /// An image the caller opened and sent (`file`, named `path`); a
    /// read-write one must be open for writing.
    fn sent(path: &Path, read_only: bool, file: File) -> Result<Backing> {
        if !read_only {
            // SAFETY: F_GETFL on a descriptor `file` owns; no memory is
            // passed.
            let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
            if flags < 0 {
                return Err(Error::io(
                    format!("reading the flags of disk image {}", path.display()),
                    std::io::Error::last_os_error(),
                ));
            }
            if flags & libc::O_ACCMODE == libc::O_RDONLY {
                return Err(Error::Config(format!(
                    "disk image {} was sent open read-only for a read-write attachment",
                    path.display()
                )));
            }
        }
        let mut backing = Backing::of(path, read_only, file)?;
        backing.sent = true;
        Ok(backing)
    }
}

pub(super) struct Inner {
    /// The image served; `None` for an empty slot.
    pub(super) backing: Option<Backing>,
    /// Bumped whenever what the guest reads from the configuration space
    /// (the capacity) may have changed.
    pub(super) generation: u32,
}

impl Inner {
    fn set(&mut self, backing: Option<Backing>) {
        let before = self.backing.as_ref().map(|b| b.size);
        let after = backing.as_ref().map(|b| b.size);
        self.backing = backing;
        if before != after {
            self.generation = self.generation.wrapping_add(1);
        }
    }

    /// The attached image now has `size` bytes.
    fn resize(&mut self, size: u64) {
        if let Some(b) = &mut self.backing {
            if b.size != size {
                b.size = size;
                self.generation = self.generation.wrapping_add(1);
            }
        }
    }
}

/// A disk's image, shared between its virtio-blk device and the VM (which
/// copies it into snapshots and replaces it on restore): either a fixed
/// disk, opened when the VM is created and served for its whole life, or a
/// disk slot, empty (capacity 0, every request an I/O error) until a file
/// is attached to it.
pub struct DiskFile {
    slot: bool,
    inner: Mutex<Inner>,
}

impl DiskFile {
    /// Opens the raw image at `path` (read-only or read-write) as a fixed
    /// disk; its size must be a multiple of 512 bytes.
    pub fn open(path: &Path, read_only: bool) -> Result<DiskFile> {
        Ok(DiskFile {
            slot: false,
            inner: Mutex::new(Inner {
                backing: Some(Backing::open(path, read_only)?),
                generation: 0,
            }),
        })
    }

    /// An empty disk slot.
    pub fn slot() -> DiskFile {
        DiskFile {
            slot: true,
            inner: Mutex::new(Inner {
                backing: None,
                generation: 0,
            }),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether this is a disk slot (files come and go) rather than a fixed
    /// disk.
    pub fn is_slot(&self) -> bool {
        self.slot
    }

    /// Whether an image is attached (always, for a fixed disk).
    pub fn attached(&self) -> bool {
        self.lock().backing.is_some()
    }

    /// The image's path, if one is attached.
    pub fn path(&self) -> Option<PathBuf> {
        self.lock().backing.as_ref().map(|b| b.path.clone())
    }

    /// Whether the guest may only read the attached image (false for an
    /// empty slot).
    pub fn read_only(&self) -> bool {
        self.lock().backing.as_ref().is_some_and(|b| b.read_only)
    }

    /// The attached image's size in bytes (0 for an empty slot).
    pub fn size(&self) -> u64 {
        self.lock().backing.as_ref().map_or(0, |b| b.size)
    }

    /// What a snapshot records of this disk.
    pub fn meta(&self) -> DiskMeta {
        let g = self.lock();
        DiskMeta {
            read_only: g.backing.as_ref().is_some_and(|b| b.read_only),
            size: g.backing.as_ref().map_or(0, |b| b.size),
            slot: self.slot,
            attached: g.backing.is_some(),
        }
    }

    /// The configuration generation: changes whenever the capacity may have.
    pub fn generation(&self) -> u32 {
        self.lock().generation
    }

    /// Attaches the image at `path` to this empty slot; the device serves
    /// it from the next request on.
    pub fn attach(&self, path: &Path, read_only: bool) -> Result<()> {
        if !self.slot {
            return Err(Error::Config("a fixed disk cannot be attached to".into()));
        }
        self.attach_backing(Backing::open(path, read_only)?)
    }

    /// Attaches `file`, an image the caller opened (a jailed VMM cannot
    /// open it by path: it came over the API socket), to this empty slot;
    /// `path` names it (in logs and the device id). A read-write attachment
    /// needs a file open for writing.
    pub fn attach_file(&self, path: &Path, file: File, read_only: bool) -> Result<()> {
        if !self.slot {
            return Err(Error::Config("a fixed disk cannot be attached to".into()));
        }
        self.attach_backing(Backing::sent(path, read_only, file)?)
    }

    fn attach_backing(&self, backing: Backing) -> Result<()> {
        let mut g = self.lock();
        if let Some(b) = &g.backing {
            return Err(Error::Config(format!(
                "busy: {} is attached",
                b.path.display()
            )));
        }
        g.set(Some(backing));
        Ok(())
    }

    /// Empties this slot; returns the path of the image that was attached.
    /// Requests served from now on fail; the file is closed and left as is.
    pub fn detach(&self) -> Result<PathBuf> {
        if !self.slot {
            return Err(Error::Config("a fixed disk cannot be detached".into()));
        }
        let mut g = self.lock();
        let Some(b) = &g.backing else {
            return Err(Error::Config("empty: nothing is attached".into()));
        };
        let path = b.path.clone();
        g.set(None);
        Ok(path)
    }

    fn attached_path(&self) -> Result<PathBuf> {
        self.path()
            .ok_or_else(|| Error::Config("the disk slot is empty".into()))
    }

    /// A second descriptor for the attached image (for copying it).
    pub fn try_clone_file(&self) -> Result<File> {
        let g = self.lock();
        let b = g
            .backing
            .as_ref()
            .ok_or_else(|| Error::Config("the disk slot is empty".into()))?;
        b.file
            .try_clone()
            .map_err(|e| Error::io(format!("duplicating disk image {}", b.path.display()), e))
    }

    /// Makes what the guest wrote durable (`fdatasync`); nothing to do for
    /// an empty slot.
    pub fn sync(&self) -> Result<()> {
        let g = self.lock();
        match &g.backing {
            Some(b) => b
                .file
                .sync_data()
                .map_err(|e| Error::io(format!("fdatasync of disk image {}", b.path.display()), e)),
            None => Ok(()),
        }
    }

    /// Whether a host block device rather than an image file is attached.
    pub fn is_block_device(&self) -> bool {
        self.lock().backing.as_ref().is_some_and(|b| b.block_device)
    }

    /// Whether the attached image came as a descriptor rather than by path.
    pub fn sent(&self) -> bool {
        self.lock().backing.as_ref().is_some_and(|b| b.sent)
    }

    /// Copies `src` (a snapshot's copy of this disk, which must be `size`
    /// bytes) into a new file next to the attached image, ready to take its
    /// place. Nothing visible changes until [`Replacement::swap_in`].
    pub fn prepare_replacement(&self, src: &Path, size: u64) -> Result<Replacement> {
        let path = self.attached_path()?;
        Replacement::copy(&path, src, size)
    }

    /// Prepares putting `src` (a snapshot's copy of this disk, which must
    /// be `size` bytes) into the attached image through its descriptor,
    /// for an image the VMM may not reach by path: the current contents are
    /// reflinked into an anonymous backup in `scratch` (on the image's
    /// filesystem). Nothing visible changes until [`Replacement::swap_in`].
    pub fn prepare_in_place(&self, src: &Path, size: u64, scratch: &Path) -> Result<Replacement> {
        let path = self.attached_path()?;
        let target = self.try_clone_file()?;
        Ok(Replacement {
            action: Action::InPlace(InPlace::prepare(target, &path, src, size, scratch)?),
        })
    }
}

fn sibling(path: &Path, what: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.twig-{what}-{}", snapshot::new_id()))
}

/// A change to what a disk serves, prepared so that it cannot fail half-way:
/// a snapshot's copy of the disk about to replace the image at a path (or
/// to be created there), an image about to be attached as it is, or a slot
/// about to be emptied. Dropped before [`Replacement::finish`], it puts the
/// old file back (if swapped in) and removes the new one.
pub struct Replacement {
    action: Action,
}

enum Action {
    /// A copy of a snapshot's disk that takes the place of `path`.
    Copy(CopyIn),
    /// A snapshot's disk reflinked into the attached image's descriptor.
    InPlace(InPlace),
    /// An image attached as it is (a read-only slot on restore, or an
    /// image sent for a slot's restore).
    Attach(Backing),
    /// The slot is emptied.
    Empty,
}

struct CopyIn {
    path: PathBuf,
    /// The new image before the swap; after it, the old one (if there
    /// was a file at `path`).
    holder: Option<PathBuf>,
    file: Option<File>,
    size: u64,
    swapped: bool,
}

fn rename_exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: both are valid NUL-terminated paths that outlive the call.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Replacement {
    /// Copies `src` (a snapshot's disk copy, which must be `size` bytes)
    /// into a new file next to `path`, ready to take its place (there may
    /// be no file at `path` yet).
    pub fn copy(path: &Path, src: &Path, size: u64) -> Result<Replacement> {
        let from =
            File::open(src).map_err(|e| Error::io(format!("opening {}", src.display()), e))?;
        let from = Backing::of(src, true, from)?;
        if from.size != size {
            return Err(Error::snapshot(
                src,
                format!(
                    "disk copy is {} bytes, the snapshot recorded {size}",
                    from.size
                ),
            ));
        }
        let tmp = sibling(path, "new");
        let file = OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(&tmp)
            .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
        let r = Replacement {
            action: Action::Copy(CopyIn {
                path: path.to_path_buf(),
                holder: Some(tmp.clone()),
                file: Some(file),
                size,
                swapped: false,
            }),
        };
        if let Action::Copy(CopyIn { file: Some(f), .. }) = &r.action {
            twig_store::fsops::copy_file(&from.file, f)
                .map(drop)
                .map_err(|e| {
                    Error::io(format!("copying {} to {}", src.display(), tmp.display()), e)
                })?;
        }
        if let Ok(m) = std::fs::metadata(path) {
            if let Err(e) = std::fs::set_permissions(&tmp, m.permissions()) {
                tracing::warn!("copying permissions to {}: {e}", tmp.display());
            }
        }
        Ok(r)
    }

    /// Opens the image at `path` read-only, to be attached as it is; it must
    /// be `size` bytes (read-only disks are not copied into snapshots, so
    /// the same image must be attached).
    pub fn attach_read_only(path: &Path, size: u64) -> Result<Replacement> {
        let b = Backing::open(path, true)?;
        if b.size != size {
            return Err(Error::Config(format!(
                "read-only image {} is {} bytes, the snapshot's was {size} bytes; read-only disks are not copied into snapshots, so the same image must be attached",
                path.display(),
                b.size
            )));
        }
        Ok(Replacement {
            action: Action::Attach(b),
        })
    }

    /// Takes `file`, an image the caller opened and sent for a slot's
    /// restore (named `path`, in logs and the device id), to be attached as
    /// it is: its contents are the caller's to provide (the snapshot's copy
    /// of the slot's disk, reflinked by the caller). It must be `size`
    /// bytes, the size the snapshot recorded, and open for writing unless
    /// `read_only`.
    pub fn attach_sent(path: &Path, file: File, read_only: bool, size: u64) -> Result<Replacement> {
        let b = Backing::sent(path, read_only, file)?;
        if b.size != size {
            return Err(Error::Config(format!(
                "the image sent as {} is {} bytes, the snapshot's disk was {size} bytes",
                path.display(),
                b.size
            )));
        }
        Ok(Replacement {
            action: Action::Attach(b),
        })
    }

    /// Empties a slot.
    pub fn empty() -> Replacement {
        Replacement {
            action: Action::Empty,
        }
    }

    /// Puts a new image at its path (atomically where the filesystem can
    /// exchange names); the old one is kept aside until
    /// [`Replacement::finish`]. Nothing to do for the other changes.
    pub fn swap_in(&mut self) -> Result<()> {
        match &mut self.action {
            Action::Copy(c) => c.swap_in(),
            Action::InPlace(p) => p.apply(),
            Action::Attach(_) | Action::Empty => Ok(()),
        }
    }

    /// Undoes [`Replacement::swap_in`]: the old image (or contents) back
    /// where it was. Dropping an unfinished replacement does the same, but
    /// only logs a failure.
    pub fn undo(&mut self) -> Result<()> {
        match &mut self.action {
            Action::Copy(c) => c.undo(),
            Action::InPlace(p) => p.undo(),
            Action::Attach(_) | Action::Empty => Ok(()),
        }
    }

    /// Makes `disk` serve what was prepared and deletes an old image that
    /// was replaced.
    pub fn finish(mut self, disk: &DiskFile) {
        let mut g = disk.lock();
        match std::mem::replace(&mut self.action, Action::Empty) {
            Action::Copy(mut c) => {
                let (read_only, id) = g
                    .backing
                    .as_ref()
                    .filter(|b| b.path == c.path)
                    .map_or((false, None), |b| (b.read_only, Some(b.id)));
                if let Some(file) = c.file.take() {
                    let backing = Backing {
                        id: id.unwrap_or_else(|| id_of(&c.path)),
                        path: c.path.clone(),
                        read_only,
                        file,
                        size: c.size,
                        sent: false,
                        block_device: false,
                    };
                    g.set(Some(backing));
                }
                c.swapped = false;
                if let Some(old) = c.holder.take() {
                    if let Err(e) = std::fs::remove_file(&old) {
                        tracing::warn!("removing the old disk image {}: {e}", old.display());
                    }
                }
            }
            Action::InPlace(p) => {
                g.resize(p.new_size());
                p.commit();
            }
            Action::Attach(b) => g.set(Some(b)),
            Action::Empty => g.set(None),
        }
    }
}

fn id_of(path: &Path) -> [u8; ID_LEN] {
    let mut id = [0u8; ID_LEN];
    if let Some(name) = path.file_name() {
        let b = name.as_encoded_bytes();
        let n = b.len().min(ID_LEN);
        id[..n].copy_from_slice(&b[..n]);
    }
    id
}

impl CopyIn {
    fn swap_in(&mut self) -> Result<()> {
        let err = |e| Error::io(format!("replacing disk image {}", self.path.display()), e);
        let Some(new) = self.holder.clone() else {
            return Ok(());
        };
        match rename_exchange(&new, &self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && new.exists() => {
                // Nothing at the path yet (a slot's file on restore).
                std::fs::rename(&new, &self.path).map_err(err)?;
                self.holder = None;
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
                let old = sibling(&self.path, "old");
                std::fs::rename(&self.path, &old).map_err(err)?;
                if let Err(e) = std::fs::rename(&new, &self.path) {
                    if let Err(back) = std::fs::rename(&old, &self.path) {
                        tracing::error!(
                            "disk image {} is left at {}: {back}",
                            self.path.display(),
                            old.display()
                        );
                    }
                    return Err(err(e));
                }
                self.holder = Some(old);
            }
            Err(e) => return Err(err(e)),
        }
        self.swapped = true;
        Ok(())
    }
}

impl CopyIn {
    /// Puts the old image back at the path (or removes the new one if
    /// there was none), if swapped in.
    fn undo(&mut self) -> Result<()> {
        if self.file.is_none() || !self.swapped {
            return Ok(());
        }
        match &self.holder {
            Some(old) => std::fs::rename(old, &self.path).map_err(|e| {
                Error::io(
                    format!(
                        "putting disk image {} back from {}",
                        self.path.display(),
                        old.display()
                    ),
                    e,
                )
            })?,
            None => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    tracing::warn!("removing {}: {e}", self.path.display());
                }
            }
        }
        self.holder = None;
        self.swapped = false;
        Ok(())
    }
}

impl Drop for CopyIn {
    fn drop(&mut self) {
        if self.file.is_none() {
            return;
        }
        if self.swapped {
            if let Err(e) = self.undo() {
                tracing::error!("{e}");
            }
        } else if let Some(new) = &self.holder {
            let _ = std::fs::remove_file(new);
        }
    }
}
