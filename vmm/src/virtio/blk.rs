//! virtio-blk on a raw image file: reads, writes, flushes (`fdatasync`) and
//! the device id, served synchronously on the vCPU thread that notified the
//! queue. A read-only disk is opened `O_RDONLY` and offers
//! `VIRTIO_BLK_F_RO`. Every request is validated (descriptor layout, length,
//! sector range); a bad request or a failed host I/O (a full host disk
//! included) answers `VIRTIO_BLK_S_IOERR`, never a VMM failure.
//!
//! The image file is shared with the VM through [`DiskFile`], which
//! snapshots copy and restores replace (see `vm.rs`).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};

use super::VirtioDevice;
use crate::error::{Error, Result};
use crate::memory::GuestMem;
use crate::snapshot;

/// Sector size of the virtio-blk protocol.
pub const SECTOR: u64 = 512;
const QUEUE_SIZE: u16 = 256;
/// Data segments per request the driver may use (the queue less header and
/// status).
const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Largest data segment.
const SIZE_MAX: u32 = 1 << 20;
/// Bytes moved between the image and guest memory at a time.
const CHUNK: usize = 128 * 1024;
const HEADER_LEN: u64 = 16;
const ID_LEN: usize = 20;

struct Inner {
    file: File,
    size: u64,
}

/// A disk image file, shared between its virtio-blk device and the VM
/// (which copies it into snapshots and replaces it on restore).
pub struct DiskFile {
    path: PathBuf,
    read_only: bool,
    id: [u8; ID_LEN],
    inner: Mutex<Inner>,
}

fn open_image(path: &Path, read_only: bool) -> Result<(File, u64)> {
    let file = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .open(path)
        .map_err(|e| Error::io(format!("opening disk image {}", path.display()), e))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io(format!("reading disk image {}", path.display()), e))?;
    if !meta.is_file() {
        return Err(Error::Config(format!(
            "disk image {} is not a regular file",
            path.display()
        )));
    }
    let size = meta.len();
    if size % SECTOR != 0 {
        return Err(Error::Config(format!(
            "disk image {} is {size} bytes, not a multiple of {SECTOR}",
            path.display()
        )));
    }
    Ok((file, size))
}

impl DiskFile {
    /// Opens the raw image at `path` (read-only or read-write); its size must
    /// be a multiple of 512 bytes.
    pub fn open(path: &Path, read_only: bool) -> Result<DiskFile> {
        let (file, size) = open_image(path, read_only)?;
        let mut id = [0u8; ID_LEN];
        if let Some(name) = path.file_name() {
            let b = name.as_encoded_bytes();
            let n = b.len().min(ID_LEN);
            id[..n].copy_from_slice(&b[..n]);
        }
        Ok(DiskFile {
            path: path.to_path_buf(),
            read_only,
            id,
            inner: Mutex::new(Inner { file, size }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The image's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the guest may only read it.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The image's size in bytes.
    pub fn size(&self) -> u64 {
        self.lock().size
    }

    /// A second descriptor for the open image (for copying it).
    pub fn try_clone_file(&self) -> Result<File> {
        self.lock()
            .file
            .try_clone()
            .map_err(|e| Error::io(format!("duplicating disk image {}", self.path.display()), e))
    }

    /// Makes what the guest wrote durable (`fdatasync`).
    pub fn sync(&self) -> Result<()> {
        self.lock().file.sync_data().map_err(|e| {
            Error::io(
                format!("fdatasync of disk image {}", self.path.display()),
                e,
            )
        })
    }

    /// Copies `src` (a snapshot's copy of this disk, which must be `size`
    /// bytes) into a new file next to this disk's image, ready to take its
    /// place. Nothing visible changes until [`Replacement::swap_in`].
    pub fn prepare_replacement(&self, src: &Path, size: u64) -> Result<Replacement> {
        let (from, actual) = open_image(src, true)?;
        if actual != size {
            return Err(Error::snapshot(
                src,
                format!("disk copy is {actual} bytes, the snapshot recorded {size}"),
            ));
        }
        let tmp = sibling(&self.path, "new");
        let file = OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(&tmp)
            .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
        let r = Replacement {
            path: self.path.clone(),
            holder: tmp,
            file: Some(file),
            size,
            swapped: false,
        };
        let copied = r
            .file
            .as_ref()
            .map_or(Ok(()), |f| twig_store::fsops::copy_file(&from, f).map(drop));
        copied.map_err(|e| {
            Error::io(
                format!("copying {} to {}", src.display(), r.holder.display()),
                e,
            )
        })?;
        if let Ok(m) = std::fs::metadata(&self.path) {
            if let Err(e) = std::fs::set_permissions(&r.holder, m.permissions()) {
                tracing::warn!("copying permissions to {}: {e}", r.holder.display());
            }
        }
        Ok(r)
    }

    /// Serves requests from `file` (`size` bytes) from now on.
    fn install(&self, file: File, size: u64) {
        let mut g = self.lock();
        g.file = file;
        g.size = size;
    }
}

fn sibling(path: &Path, what: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.twig-{what}-{}", snapshot::new_id()))
}

/// A disk image about to replace a VM's disk file. Dropped before
/// [`Replacement::finish`], it puts the old file back (if swapped in) and
/// removes the new one.
pub struct Replacement {
    path: PathBuf,
    /// The new image before the swap, the old one after.
    holder: PathBuf,
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
    // SAFETY: both are valid NUL-terminated paths.
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
    /// Puts the new image at the disk's path (atomically where the
    /// filesystem can exchange names); the old one is kept aside until
    /// [`Replacement::finish`].
    pub fn swap_in(&mut self) -> Result<()> {
        let err = |e| Error::io(format!("replacing disk image {}", self.path.display()), e);
        match rename_exchange(&self.holder, &self.path) {
            Ok(()) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
                let old = sibling(&self.path, "old");
                std::fs::rename(&self.path, &old).map_err(err)?;
                if let Err(e) = std::fs::rename(&self.holder, &self.path) {
                    if let Err(back) = std::fs::rename(&old, &self.path) {
                        tracing::error!(
                            "disk image {} is left at {}: {back}",
                            self.path.display(),
                            old.display()
                        );
                    }
                    return Err(err(e));
                }
                self.holder = old;
            }
            Err(e) => return Err(err(e)),
        }
        self.swapped = true;
        Ok(())
    }

    /// Serves `disk` from the new image and deletes the old one.
    pub fn finish(mut self, disk: &DiskFile) {
        if let Some(f) = self.file.take() {
            disk.install(f, self.size);
        }
        if self.swapped {
            self.swapped = false;
            if let Err(e) = std::fs::remove_file(&self.holder) {
                tracing::warn!("removing the old disk image {}: {e}", self.holder.display());
            }
        }
    }
}

impl Drop for Replacement {
    fn drop(&mut self) {
        if self.file.is_none() {
            return;
        }
        if self.swapped {
            if let Err(e) = std::fs::rename(&self.holder, &self.path) {
                tracing::error!(
                    "cannot put disk image {} back from {}: {e}",
                    self.path.display(),
                    self.holder.display()
                );
            }
        } else {
            let _ = std::fs::remove_file(&self.holder);
        }
    }
}

/// The block device.
pub struct Blk {
    disk: Arc<DiskFile>,
    buf: Vec<u8>,
}

impl Blk {
    /// A block device serving `disk`.
    pub fn new(disk: Arc<DiskFile>) -> Blk {
        Blk {
            disk,
            buf: vec![0u8; CHUNK],
        }
    }
}

/// Byte `[start, start + len)` of the concatenated buffers of `descs`, as
/// guest address pieces.
fn pieces(descs: &[Descriptor], mut start: u64, mut len: u64) -> Vec<(GuestAddress, usize)> {
    let mut out = Vec::new();
    for d in descs {
        if len == 0 {
            break;
        }
        let dl = u64::from(d.len());
        if start >= dl {
            start -= dl;
            continue;
        }
        let n = (dl - start).min(len);
        if let Some(a) = d.addr().checked_add(start) {
            out.push((a, n as usize));
        }
        len -= n;
        start = 0;
    }
    out
}

fn total(descs: &[Descriptor]) -> u64 {
    descs.iter().map(|d| u64::from(d.len())).sum()
}

/// A request's header and buffers.
struct Request<'a> {
    kind: u32,
    sector: u64,
    /// The driver-readable descriptors: header, then data to write.
    out: &'a [Descriptor],
    /// Data bytes after the header.
    out_len: u64,
    /// The device-writable data pieces (the status byte excluded).
    data_in: Vec<(GuestAddress, usize)>,
    in_len: u64,
}

enum Failure {
    /// The request is malformed or out of range: the guest's mistake.
    Bad(String),
    /// The host failed (I/O error, full disk).
    Host(String),
    Unsupported,
}

impl Blk {
    /// Serves one request; returns the status and the bytes written into
    /// the data buffers.
    fn serve(&mut self, r: &Request, mem: &GuestMem) -> std::result::Result<u32, Failure> {
        let sector = r.sector;
        let range = |len: u64, size: u64| -> std::result::Result<u64, Failure> {
            if len % SECTOR != 0 {
                return Err(Failure::Bad(format!(
                    "data length {len} is not a multiple of {SECTOR}"
                )));
            }
            let off = sector
                .checked_mul(SECTOR)
                .filter(|o| o.checked_add(len).is_some_and(|end| end <= size));
            off.ok_or_else(|| {
                Failure::Bad(format!(
                    "sectors {sector}+{} are beyond the disk's {} sectors",
                    len / SECTOR,
                    size / SECTOR
                ))
            })
        };
        match r.kind {
            VIRTIO_BLK_T_IN => {
                if r.out_len != 0 {
                    return Err(Failure::Bad("a read with data to write".into()));
                }
                let inner = self.disk.lock();
                let mut off = range(r.in_len, inner.size)?;
                for &(addr, n) in &r.data_in {
                    let mut done = 0;
                    while done < n {
                        let k = (n - done).min(CHUNK);
                        let buf = &mut self.buf[..k];
                        inner
                            .file
                            .read_exact_at(buf, off)
                            .map_err(|e| Failure::Host(format!("read at {off}: {e}")))?;
                        let at = addr
                            .checked_add(done as u64)
                            .ok_or_else(|| Failure::Bad("buffer address overflows".into()))?;
                        mem.write_slice(buf, at)
                            .map_err(|e| Failure::Bad(format!("guest buffer: {e}")))?;
                        done += k;
                        off += k as u64;
                    }
                }
                Ok(r.in_len as u32)
            }
            VIRTIO_BLK_T_OUT => {
                if self.disk.read_only {
                    return Err(Failure::Bad("write to a read-only disk".into()));
                }
                let inner = self.disk.lock();
                let mut off = range(r.out_len, inner.size)?;
                for (addr, n) in pieces(r.out, HEADER_LEN, r.out_len) {
                    let mut done = 0;
                    while done < n {
                        let k = (n - done).min(CHUNK);
                        let buf = &mut self.buf[..k];
                        let at = addr
                            .checked_add(done as u64)
                            .ok_or_else(|| Failure::Bad("buffer address overflows".into()))?;
                        mem.read_slice(buf, at)
                            .map_err(|e| Failure::Bad(format!("guest buffer: {e}")))?;
                        inner
                            .file
                            .write_all_at(buf, off)
                            .map_err(|e| Failure::Host(format!("write at {off}: {e}")))?;
                        done += k;
                        off += k as u64;
                    }
                }
                Ok(0)
            }
            VIRTIO_BLK_T_FLUSH => {
                if !self.disk.read_only {
                    self.disk
                        .lock()
                        .file
                        .sync_data()
                        .map_err(|e| Failure::Host(format!("fdatasync: {e}")))?;
                }
                Ok(0)
            }
            VIRTIO_BLK_T_GET_ID => {
                let mut written = 0;
                for &(addr, n) in &r.data_in {
                    let k = n.min(ID_LEN - written);
                    if k == 0 {
                        break;
                    }
                    mem.write_slice(&self.disk.id[written..written + k], addr)
                        .map_err(|e| Failure::Bad(format!("guest buffer: {e}")))?;
                    written += k;
                }
                Ok(written as u32)
            }
            _ => Err(Failure::Unsupported),
        }
    }

    /// Handles one descriptor chain; returns the used length (0 if there is
    /// not even a status byte to write).
    fn request(&mut self, descs: &[Descriptor], mem: &GuestMem) -> u32 {
        let split = descs
            .iter()
            .position(|d| d.is_write_only())
            .unwrap_or(descs.len());
        let (out, inb) = descs.split_at(split);
        if inb.iter().any(|d| !d.is_write_only()) || total(inb) == 0 {
            tracing::debug!("virtio-blk: malformed request (descriptor layout)");
            return 0;
        }
        let in_total = total(inb);
        let Some((status_addr, _)) = pieces(inb, in_total - 1, 1).first().copied() else {
            return 0;
        };
        let out_total = total(out);
        let result = if out_total < HEADER_LEN {
            Err(Failure::Bad("no request header".into()))
        } else {
            let mut header = [0u8; HEADER_LEN as usize];
            let mut got = 0;
            let mut read_ok = true;
            for (addr, n) in pieces(out, 0, HEADER_LEN) {
                read_ok &= mem.read_slice(&mut header[got..got + n], addr).is_ok();
                got += n;
            }
            if !read_ok {
                Err(Failure::Bad("request header outside guest memory".into()))
            } else {
                let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
                let mut s = [0u8; 8];
                s.copy_from_slice(&header[8..16]);
                let sector = u64::from_le_bytes(s);
                let req = Request {
                    kind,
                    sector,
                    out,
                    out_len: out_total - HEADER_LEN,
                    data_in: pieces(inb, 0, in_total - 1),
                    in_len: in_total - 1,
                };
                self.serve(&req, mem)
            }
        };
        let (status, written) = match result {
            Ok(n) => (VIRTIO_BLK_S_OK, n),
            Err(Failure::Bad(why)) => {
                tracing::debug!(disk = %self.disk.path.display(), "virtio-blk: bad request: {why}");
                (VIRTIO_BLK_S_IOERR, 0)
            }
            Err(Failure::Host(why)) => {
                tracing::warn!(disk = %self.disk.path.display(), "virtio-blk: I/O error: {why}");
                (VIRTIO_BLK_S_IOERR, 0)
            }
            Err(Failure::Unsupported) => (VIRTIO_BLK_S_UNSUPP, 0),
        };
        if mem.write_slice(&[status as u8], status_addr).is_err() {
            return 0;
        }
        written + 1
    }
}

impl VirtioDevice for Blk {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_SIZE_MAX);
        if self.disk.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut config = [0u8; 24];
        config[..8].copy_from_slice(&(self.disk.size() / SECTOR).to_le_bytes());
        config[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        config[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| config.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let Some(queue) = queues.get_mut(index) else {
            return false;
        };
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let descs: Vec<Descriptor> = chain.collect();
            let len = self.request(&descs, mem);
            if let Err(e) = queue.add_used(mem, head, len) {
                tracing::warn!("virtio-blk: {e}");
                break;
            }
            used = true;
        }
        used
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::Driver;
    use std::process::Command;

    const SECTORS: u64 = 128;

    /// An image whose sector i is filled with byte i.
    fn image(dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        let data: Vec<u8> = (0..SECTORS * SECTOR).map(|i| (i / SECTOR) as u8).collect();
        std::fs::write(&p, data).unwrap();
        p
    }

    fn driver(path: &Path, read_only: bool) -> Driver {
        Driver::new(Box::new(Blk::new(Arc::new(
            DiskFile::open(path, read_only).unwrap(),
        ))))
    }

    /// Sends one request; returns the status, the used length and where the
    /// device-writable data went.
    fn request(d: &mut Driver, kind: u32, sector: u64, out: &[u8], in_len: u32) -> (u8, u32, u64) {
        let hdr = d.alloc(16);
        let mut h = kind.to_le_bytes().to_vec();
        h.extend_from_slice(&[0; 4]);
        h.extend_from_slice(&sector.to_le_bytes());
        d.write(hdr, &h);
        let mut bufs = vec![(hdr, 16, false)];
        if !out.is_empty() {
            let a = d.alloc(out.len() as u32);
            d.write(a, out);
            bufs.push((a, out.len() as u32, false));
        }
        let data_in = d.alloc(in_len.max(1));
        if in_len > 0 {
            bufs.push((data_in, in_len, true));
        }
        let status = d.alloc(1);
        d.write(status, &[0xff]);
        bufs.push((status, 1, true));
        let head = d.post(0, &bufs);
        d.notify(0);
        let (id, len) = d.used(0).expect("request used");
        assert_eq!(id, u32::from(head));
        (d.read(status, 1)[0], len, data_in)
    }

    const OK: u8 = VIRTIO_BLK_S_OK as u8;
    const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;

    #[test]
    fn reads_writes_flushes_and_names_the_disk() {
        let dir = tempfile::tempdir().unwrap();
        let p = image(dir.path(), "rootfs-disk.img");
        let mut d = driver(&p, false);
        assert_eq!(d.config(8), SECTORS.to_le_bytes(), "capacity");
        assert_eq!(d.device_features() & (1 << VIRTIO_BLK_F_RO), 0);

        let (st, len, data) = request(&mut d, VIRTIO_BLK_T_IN, 2, &[], 1024);
        assert_eq!((st, len), (OK, 1025));
        let got = d.read(data, 1024);
        assert!(got[..512].iter().all(|b| *b == 2) && got[512..].iter().all(|b| *b == 3));
        assert_eq!(d.irq.read().unwrap(), 1, "interrupt raised");

        let (st, len, _) = request(&mut d, VIRTIO_BLK_T_OUT, 5, &[0xab; 1024], 0);
        assert_eq!((st, len), (OK, 1));
        let file = std::fs::read(&p).unwrap();
        assert!(file[5 * 512..7 * 512].iter().all(|b| *b == 0xab));
        assert!(file[7 * 512..8 * 512].iter().all(|b| *b == 7));

        let (st, _, _) = request(&mut d, VIRTIO_BLK_T_FLUSH, 0, &[], 0);
        assert_eq!(st, OK);

        let (st, len, data) = request(&mut d, VIRTIO_BLK_T_GET_ID, 0, &[], 20);
        assert_eq!((st, len), (OK, 21));
        assert_eq!(&d.read(data, 20), b"rootfs-disk.img\0\0\0\0\0");

        let (st, _, _) = request(&mut d, 99, 0, &[], 0);
        assert_eq!(st, VIRTIO_BLK_S_UNSUPP as u8);
    }

    #[test]
    fn bad_requests_get_errors_and_never_touch_the_image() {
        let dir = tempfile::tempdir().unwrap();
        let p = image(dir.path(), "d.img");
        let before = std::fs::read(&p).unwrap();
        let mut d = driver(&p, false);
        // Past the end, straddling the end, overflowing.
        assert_eq!(request(&mut d, VIRTIO_BLK_T_IN, SECTORS, &[], 512).0, IOERR);
        assert_eq!(
            request(&mut d, VIRTIO_BLK_T_OUT, SECTORS - 1, &[1; 1024], 0).0,
            IOERR
        );
        assert_eq!(
            request(&mut d, VIRTIO_BLK_T_IN, u64::MAX, &[], 512).0,
            IOERR
        );
        // Not a whole number of sectors.
        assert_eq!(request(&mut d, VIRTIO_BLK_T_OUT, 0, &[1; 100], 0).0, IOERR);
        // A short header.
        let hdr = d.alloc(16);
        let status = d.alloc(1);
        d.post(0, &[(hdr, 8, false), (status, 1, true)]);
        d.notify(0);
        assert_eq!(d.used(0).map(|u| u.1), Some(1));
        assert_eq!(d.read(status, 1)[0], IOERR);
        // No writable status byte at all: returned with nothing written.
        d.post(0, &[(hdr, 16, false)]);
        d.notify(0);
        assert_eq!(d.used(0).map(|u| u.1), Some(0));
        // A readable descriptor after a writable one.
        d.post(0, &[(hdr, 16, false), (status, 1, true), (hdr, 16, false)]);
        d.notify(0);
        assert_eq!(d.used(0).map(|u| u.1), Some(0));
        // A buffer outside guest memory.
        d.write(hdr, &[0; 16]);
        d.post(
            0,
            &[(hdr, 16, false), (1 << 40, 512, true), (status, 1, true)],
        );
        d.notify(0);
        assert_eq!(d.used(0).map(|u| u.1), Some(1));
        assert_eq!(d.read(status, 1)[0], IOERR);
        assert_eq!(std::fs::read(&p).unwrap(), before);
        // The device still serves good requests.
        assert_eq!(request(&mut d, VIRTIO_BLK_T_IN, 1, &[], 512).0, OK);
    }

    #[test]
    fn a_read_only_disk_refuses_writes() {
        let dir = tempfile::tempdir().unwrap();
        let p = image(dir.path(), "ro.img");
        let before = std::fs::read(&p).unwrap();
        let mut d = driver(&p, true);
        assert_ne!(
            d.device_features() & (1 << VIRTIO_BLK_F_RO),
            0,
            "RO offered"
        );
        assert_eq!(request(&mut d, VIRTIO_BLK_T_OUT, 0, &[9; 512], 0).0, IOERR);
        assert_eq!(request(&mut d, VIRTIO_BLK_T_FLUSH, 0, &[], 0).0, OK);
        assert_eq!(request(&mut d, VIRTIO_BLK_T_IN, 3, &[], 512).0, OK);
        assert_eq!(std::fs::read(&p).unwrap(), before);
    }

    #[test]
    fn bad_images_are_refused_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("odd.img");
        std::fs::write(&p, [0u8; 1000]).unwrap();
        let e = DiskFile::open(&p, false).err().unwrap().to_string();
        assert!(e.contains("not a multiple of 512"), "{e}");
        let e = DiskFile::open(&dir.path().join("missing.img"), false)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("missing.img"), "{e}");
        let e = DiskFile::open(dir.path(), true).err().unwrap().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn a_replacement_dropped_after_the_swap_puts_the_old_image_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = image(dir.path(), "d.img");
        let old = std::fs::read(&p).unwrap();
        let src = dir.path().join("snap-disk");
        std::fs::write(&src, vec![0xeeu8; 4096]).unwrap();
        let disk = DiskFile::open(&p, false).unwrap();
        let e = disk
            .prepare_replacement(&src, 8192)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("4096 bytes"), "{e}");

        let mut r = disk.prepare_replacement(&src, 4096).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), old, "nothing visible yet");
        r.swap_in().unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), vec![0xee; 4096]);
        drop(r);
        assert_eq!(std::fs::read(&p).unwrap(), old, "put back");
        assert_eq!(disk.size(), SECTORS * SECTOR);

        let mut r = disk.prepare_replacement(&src, 4096).unwrap();
        r.swap_in().unwrap();
        r.finish(&disk);
        assert_eq!(std::fs::read(&p).unwrap(), vec![0xee; 4096]);
        assert_eq!(disk.size(), 4096, "the device serves the new image");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "no temporary files left: {names:?}");
    }

    /// A tmpfs of 1 MiB, unmounted on drop.
    struct SmallFs(tempfile::TempDir);

    impl Drop for SmallFs {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0.path()).status();
        }
    }

    #[test]
    fn a_full_host_disk_gives_the_guest_io_errors() {
        let fs = SmallFs(tempfile::tempdir().unwrap());
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(fs.0.path())
            .status()
            .unwrap();
        assert!(ok.success(), "mounting a 1 MiB tmpfs (needs root)");
        let p = fs.0.path().join("sparse.img");
        File::create(&p).unwrap().set_len(4 << 20).unwrap();
        let mut d = driver(&p, false);
        let chunk = vec![0x5au8; 64 * 1024];
        let mut statuses = Vec::new();
        for i in 0..48u64 {
            statuses.push(request(&mut d, VIRTIO_BLK_T_OUT, i * 128, &chunk, 0).0);
        }
        assert_eq!(statuses[0], OK);
        assert!(statuses.contains(&IOERR), "{statuses:?}");
        // The device carries on: reads still work.
        assert_eq!(request(&mut d, VIRTIO_BLK_T_IN, 0, &[], 512).0, OK);
        assert_eq!(request(&mut d, VIRTIO_BLK_T_FLUSH, 0, &[], 0).0, OK);
    }
}
