//! virtio-blk on a raw image file: reads, writes, flushes (`fdatasync`) and
//! the device id, served one request at a time by the disk's own I/O
//! thread ([`worker`]): the vCPU that notifies the queue only wakes it, so
//! a guest's slow disk I/O never keeps a vCPU from parking, and a pause
//! stops the worker between requests. A request moves at most
//! SEG_MAX × SIZE_MAX (254 MiB) in CHUNK-sized pieces; the pause waits a
//! bounded time for the one in hand (see [`worker`] for why it is never cut
//! short). A read-only disk is opened `O_RDONLY` and offers
//! `VIRTIO_BLK_F_RO`. Every request is validated (descriptor layout, length,
//! sector range); a bad request or a failed host I/O (a full host disk
//! included) answers `VIRTIO_BLK_S_IOERR`, never a VMM failure.
//!
//! The image file is shared with the VM (and the worker) through
//! [`DiskFile`], which snapshots copy and restores replace (see
//! `vm/persist.rs`) while the worker is paused.
//!
//! A **disk slot** is a virtio-blk device that starts empty: capacity 0,
//! every read, write and flush answered `VIRTIO_BLK_S_IOERR` without
//! touching any file, GET_ID an id of zeros. A file attached while the VM
//! runs (`vm/disks.rs`) is served from the next request on, and the
//! configuration generation changes so the transport raises the
//! configuration-change interrupt: Linux's virtio_blk then re-reads the
//! capacity. Feature bits are negotiated once, at the driver's probe, so a
//! slot never offers `VIRTIO_BLK_F_RO`: a read-only attachment is enforced
//! here (writes answer `VIRTIO_BLK_S_IOERR`) and by mounting read-only in
//! the guest.

mod image;
mod inplace;
mod worker;

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::Queue;
#[cfg(test)]
use virtio_queue::QueueT;
use vm_memory::{Address, Bytes, GuestAddress};

#[cfg(test)]
pub(crate) use image::BLKGETSIZE64;
pub use image::{DiskFile, Replacement, ID_LEN, SECTOR};
pub use inplace::scratch_dir;
pub use worker::DiskWorker;

use super::VirtioDevice;
use crate::memory::GuestMem;
use crate::ratelimit::warn_limited;

const QUEUE_SIZE: u16 = 256;
/// Data segments per request the driver may use (the queue less header and
/// status).
const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// Largest data segment.
const SIZE_MAX: u32 = 1 << 20;
/// Bytes moved between the image and guest memory at a time.
const CHUNK: usize = 128 * 1024;
const HEADER_LEN: u64 = 16;

/// The block device, as the transport holds it.
pub struct Blk {
    disk: Arc<DiskFile>,
    serving: Serving,
}

/// Where requests are served.
enum Serving {
    /// On the notifying thread (a device driven directly, in unit tests).
    #[cfg(test)]
    Inline(Server),
    /// On the disk's I/O worker, which the notify only wakes.
    Worker(Arc<worker::Control>),
}

impl Blk {
    /// A block device serving `disk` on the thread that notifies it.
    #[cfg(test)]
    pub fn new(disk: Arc<DiskFile>) -> Blk {
        Blk {
            serving: Serving::Inline(Server::new(disk.clone())),
            disk,
        }
    }

    /// A block device serving `disk` on an I/O worker, started by
    /// [`DiskWorker::spawn`] once the device has its transport.
    pub fn with_worker(disk: Arc<DiskFile>) -> (Blk, Arc<worker::Control>) {
        let control = Arc::new(worker::Control::default());
        let blk = Blk {
            serving: Serving::Worker(control.clone()),
            disk,
        };
        (blk, control)
    }
}

/// Serves requests on one disk: the request parser and the I/O.
pub(crate) struct Server {
    disk: Arc<DiskFile>,
    buf: Vec<u8>,
}

impl Server {
    pub(crate) fn new(disk: Arc<DiskFile>) -> Server {
        Server {
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

impl Server {
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
        let guard = self.disk.lock();
        if r.kind == VIRTIO_BLK_T_GET_ID {
            let id = guard.backing.as_ref().map_or([0u8; ID_LEN], |b| b.id);
            let mut written = 0;
            for &(addr, n) in &r.data_in {
                let k = n.min(ID_LEN - written);
                if k == 0 {
                    break;
                }
                mem.write_slice(&id[written..written + k], addr)
                    .map_err(|e| Failure::Bad(format!("guest buffer: {e}")))?;
                written += k;
            }
            return Ok(written as u32);
        }
        if !matches!(
            r.kind,
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT | VIRTIO_BLK_T_FLUSH
        ) {
            return Err(Failure::Unsupported);
        }
        let Some(backing) = guard.backing.as_ref() else {
            return Err(Failure::Bad("the disk slot is empty".into()));
        };
        match r.kind {
            VIRTIO_BLK_T_IN => {
                if r.out_len != 0 {
                    return Err(Failure::Bad("a read with data to write".into()));
                }
                let mut off = range(r.in_len, backing.size)?;
                for &(addr, n) in &r.data_in {
                    let mut done = 0;
                    while done < n {
                        let k = (n - done).min(CHUNK);
                        let buf = &mut self.buf[..k];
                        backing
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
                if backing.read_only {
                    return Err(Failure::Bad("write to a read-only disk".into()));
                }
                let mut off = range(r.out_len, backing.size)?;
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
                        crate::vm::failpoint::stall("blk-write");
                        backing
                            .file
                            .write_all_at(buf, off)
                            .map_err(|e| Failure::Host(format!("write at {off}: {e}")))?;
                        done += k;
                        off += k as u64;
                    }
                }
                Ok(0)
            }
            _ => {
                if !backing.read_only {
                    backing
                        .file
                        .sync_data()
                        .map_err(|e| Failure::Host(format!("fdatasync: {e}")))?;
                }
                Ok(0)
            }
        }
    }

    /// The attached image's path, for messages.
    fn name(&self) -> String {
        self.disk
            .path()
            .map_or_else(|| "(empty slot)".into(), |p| p.display().to_string())
    }

    /// Handles one descriptor chain; returns the used length (0 if there is
    /// not even a status byte to write).
    pub(crate) fn request(&mut self, descs: &[Descriptor], mem: &GuestMem) -> u32 {
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
                tracing::debug!(disk = %self.name(), "virtio-blk: bad request: {why}");
                (VIRTIO_BLK_S_IOERR, 0)
            }
            Err(Failure::Host(why)) => {
                warn_limited!(disk = %self.name(), "virtio-blk: I/O error: {why}");
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
        // A slot's feature bits are fixed before anything is attached.
        if !self.disk.is_slot() && self.disk.read_only() {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }

    fn config_generation(&self) -> u32 {
        self.disk.generation()
    }

    fn describe(&self) -> String {
        match (self.disk.is_slot(), self.disk.path()) {
            (true, None) => "empty slot".into(),
            (slot, Some(p)) => format!(
                "{}{} ({} bytes{})",
                if slot { "slot: " } else { "" },
                p.display(),
                self.disk.size(),
                if self.disk.read_only() {
                    ", read-only"
                } else {
                    ""
                }
            ),
            (false, None) => String::new(),
        }
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

    // Only a device served inline (in unit tests) looks at the queues here.
    #[cfg_attr(not(test), allow(unused_variables))]
    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMem) -> bool {
        match &mut self.serving {
            Serving::Worker(control) => {
                control.kick();
                false
            }
            #[cfg(test)]
            Serving::Inline(server) => server.serve_queue(index, queues, mem),
        }
    }
}

#[cfg(test)]
impl Server {
    /// Serves every available request of queue `index` on this thread.
    fn serve_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let Some(queue) = queues.get_mut(index) else {
            return false;
        };
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let descs: Vec<Descriptor> = chain.collect();
            let len = self.request(&descs, mem);
            if let Err(e) = queue.add_used(mem, head, len) {
                warn_limited!("virtio-blk: {e}");
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
    use std::fs::File;
    use std::path::{Path, PathBuf};
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
        assert!(
            e.contains("neither a regular file nor a block device"),
            "{e}"
        );
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

    use virtio_bindings::virtio_mmio::{
        VIRTIO_MMIO_CONFIG_GENERATION, VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INTERRUPT_STATUS,
        VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_STATUS,
    };

    fn capacity(d: &mut Driver) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&d.config(8));
        u64::from_le_bytes(b)
    }

    fn slot_driver() -> (Driver, Arc<DiskFile>) {
        let disk = Arc::new(DiskFile::slot());
        (Driver::new(Box::new(Blk::new(disk.clone()))), disk)
    }

    /// Asserts that the driver was told of a configuration change (and
    /// acknowledges it, as Linux's interrupt handler does).
    fn config_interrupt(d: &mut Driver) {
        assert_eq!(d.irq.read().unwrap(), 1, "interrupt raised");
        let status = d.reg(VIRTIO_MMIO_INTERRUPT_STATUS);
        assert_ne!(status & VIRTIO_MMIO_INT_CONFIG, 0, "configuration change");
        d.set(VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INT_CONFIG);
        let status = d.reg(VIRTIO_MMIO_INTERRUPT_STATUS);
        assert_eq!(status & VIRTIO_MMIO_INT_CONFIG, 0, "acknowledged");
    }

    #[test]
    fn an_empty_slot_has_capacity_0_and_fails_every_request_without_a_file() {
        let (mut d, disk) = slot_driver();
        assert!(disk.is_slot() && !disk.attached());
        assert_eq!(capacity(&mut d), 0);
        assert_eq!(d.device_features() & (1 << VIRTIO_BLK_F_RO), 0, "no RO");
        assert_eq!(request(&mut d, VIRTIO_BLK_T_IN, 0, &[], 512).0, IOERR);
        assert_eq!(request(&mut d, VIRTIO_BLK_T_OUT, 0, &[1; 512], 0).0, IOERR);
        assert_eq!(request(&mut d, VIRTIO_BLK_T_FLUSH, 0, &[], 0).0, IOERR);
        let (st, len, data) = request(&mut d, VIRTIO_BLK_T_GET_ID, 0, &[], 20);
        assert_eq!((st, len), (OK, 21));
        assert_eq!(d.read(data, 20), vec![0; 20], "a stable empty id");
        assert_eq!(request(&mut d, 99, 0, &[], 0).0, VIRTIO_BLK_S_UNSUPP as u8);
        assert!(disk.detach().unwrap_err().to_string().contains("empty"));
        assert!(disk.try_clone_file().is_err());
        disk.sync().unwrap();
        assert!(!disk.meta().has_copy());
    }

    #[test]
    fn attach_and_detach_announce_the_capacity_and_switch_the_file_served() {
        let dir = tempfile::tempdir().unwrap();
        let p = image(dir.path(), "ctr-rootfs.img");
        let (mut d, disk) = slot_driver();
        let gen0 = d.reg(VIRTIO_MMIO_CONFIG_GENERATION);
        d.t.announce_config();
        assert!(d.irq.read().is_err(), "nothing changed: no interrupt");

        disk.attach(&p, false).unwrap();
        d.t.announce_config();
        config_interrupt(&mut d);
        let gen1 = d.reg(VIRTIO_MMIO_CONFIG_GENERATION);
        assert_ne!(gen1, gen0, "generation bumped");
        assert_eq!(capacity(&mut d), SECTORS);
        let (st, _, data) = request(&mut d, VIRTIO_BLK_T_IN, 9, &[], 512);
        assert_eq!(st, OK);
        assert_eq!(d.read(data, 512), vec![9; 512], "the file's bytes");
        let _ = d.irq.read();
        assert_eq!(request(&mut d, VIRTIO_BLK_T_OUT, 3, &[0xcd; 512], 0).0, OK);
        assert_eq!(std::fs::read(&p).unwrap()[3 * 512..4 * 512], [0xcd; 512]);
        assert_eq!(request(&mut d, VIRTIO_BLK_T_FLUSH, 0, &[], 0).0, OK);
        let (_, _, data) = request(&mut d, VIRTIO_BLK_T_GET_ID, 0, &[], 20);
        assert_eq!(&d.read(data, 20), b"ctr-rootfs.img\0\0\0\0\0\0");
        let _ = d.irq.read();

        let other = image(dir.path(), "other.img");
        let e = disk.attach(&other, false).unwrap_err().to_string();
        assert!(e.contains("busy") && e.contains("ctr-rootfs.img"), "{e}");

        assert_eq!(disk.detach().unwrap(), p);
        d.t.announce_config();
        config_interrupt(&mut d);
        assert_ne!(
            d.reg(VIRTIO_MMIO_CONFIG_GENERATION),
            gen1,
            "generation bumped again"
        );
        assert_eq!(capacity(&mut d), 0);
        let before = std::fs::read(&p).unwrap();
        assert_eq!(request(&mut d, VIRTIO_BLK_T_IN, 0, &[], 512).0, IOERR);
        assert_eq!(request(&mut d, VIRTIO_BLK_T_OUT, 0, &[7; 512], 0).0, IOERR);
        assert_eq!(std::fs::read(&p).unwrap(), before, "detached: untouched");
    }

    #[test]
    fn a_read_only_attachment_refuses_writes_though_rw_was_negotiated() {
        let dir = tempfile::tempdir().unwrap();
        let p = image(dir.path(), "base.img");
        let before = std::fs::read(&p).unwrap();
        let (mut d, disk) = slot_driver();
        disk.attach(&p, true).unwrap();
        d.t.announce_config();
        config_interrupt(&mut d);
        assert_eq!(d.device_features() & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(request(&mut d, VIRTIO_BLK_T_OUT, 0, &[9; 512], 0).0, IOERR);
        assert_eq!(request(&mut d, VIRTIO_BLK_T_IN, 5, &[], 512).0, OK);
        assert_eq!(std::fs::read(&p).unwrap(), before);
        assert!(disk.read_only() && !disk.meta().has_copy());
    }

    #[test]
    fn bad_attachments_are_refused_and_leave_the_slot_empty() {
        let dir = tempfile::tempdir().unwrap();
        let (mut d, disk) = slot_driver();
        let odd = dir.path().join("odd.img");
        std::fs::write(&odd, [0u8; 1000]).unwrap();
        let e = disk.attach(&odd, false).unwrap_err().to_string();
        assert!(e.contains("not a multiple of 512"), "{e}");
        let e = disk
            .attach(&dir.path().join("missing.img"), true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.img"), "{e}");
        assert!(disk.attach(dir.path(), true).is_err(), "a directory");
        assert!(!disk.attached());
        d.t.announce_config();
        assert!(d.irq.read().is_err(), "no interrupt");
        assert_eq!(capacity(&mut d), 0);

        let p = image(dir.path(), "fixed.img");
        let fixed = DiskFile::open(&p, false).unwrap();
        assert!(fixed.attach(&p, false).is_err());
        assert!(fixed.detach().is_err());
    }

    #[test]
    fn a_host_block_device_is_served_with_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let p = image(dir.path(), "volume.img");
        let dev = twig_agent::testkit::LoopDevice::new(&p)
            .expect("a loop device (this test needs root and losetup)");
        let (mut d, disk) = slot_driver();
        disk.attach(&dev.0, false).unwrap();
        assert!(disk.is_block_device());
        d.t.announce_config();
        config_interrupt(&mut d);
        assert_eq!(
            capacity(&mut d),
            SECTORS,
            "the device's size (BLKGETSIZE64)"
        );
        let (st, _, data) = request(&mut d, VIRTIO_BLK_T_IN, 9, &[], 512);
        assert_eq!(st, OK);
        assert_eq!(d.read(data, 512), vec![9; 512], "the device's bytes");
        let _ = d.irq.read();
        assert_eq!(request(&mut d, VIRTIO_BLK_T_OUT, 3, &[0xab; 512], 0).0, OK);
        let _ = d.irq.read();
        assert_eq!(request(&mut d, VIRTIO_BLK_T_FLUSH, 0, &[], 0).0, OK);
        let mut f = std::fs::File::open(&dev.0).unwrap();
        let mut sector = [0u8; 512];
        std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(3 * 512)).unwrap();
        std::io::Read::read_exact(&mut f, &mut sector).unwrap();
        assert_eq!(sector, [0xab; 512], "written through to the device");
        assert!(disk.meta().has_copy());
        assert_eq!(disk.detach().unwrap(), dev.0);
        assert!(!disk.is_block_device());
        let e = disk.attach(Path::new("/dev/null"), true).unwrap_err();
        assert!(
            e.to_string()
                .contains("neither a regular file nor a block device"),
            "{e}"
        );
    }

    #[test]
    fn a_driver_that_is_not_live_is_not_interrupted() {
        let dir = tempfile::tempdir().unwrap();
        let p = image(dir.path(), "d.img");
        let (mut d, disk) = slot_driver();
        d.set(VIRTIO_MMIO_STATUS, 0);
        disk.attach(&p, false).unwrap();
        d.t.announce_config();
        assert!(d.irq.read().is_err());
        assert_eq!(d.reg(VIRTIO_MMIO_INTERRUPT_STATUS), 0);
        assert_eq!(capacity(&mut d), SECTORS, "read at probe");
    }

    #[test]
    fn slot_replacements_create_attach_and_empty() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("snap-disk");
        std::fs::write(&src, vec![0x42u8; 4096]).unwrap();
        let target = dir.path().join("clone.img");
        let disk = DiskFile::slot();

        // A copy into a file that does not exist yet; dropped after the
        // swap, nothing is left.
        let mut r = Replacement::copy(&target, &src, 4096).unwrap();
        r.swap_in().unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), vec![0x42; 4096]);
        drop(r);
        assert!(!target.exists());
        let mut r = Replacement::copy(&target, &src, 4096).unwrap();
        r.swap_in().unwrap();
        r.finish(&disk);
        assert_eq!(
            (disk.path(), disk.size(), disk.read_only()),
            (Some(target.clone()), 4096, false)
        );
        let g = disk.generation();
        Replacement::empty().finish(&disk);
        assert!(!disk.attached() && disk.generation() != g);

        let e = Replacement::attach_read_only(&src, 8192)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("4096 bytes") && e.contains("same image"), "{e}");
        let r = Replacement::attach_read_only(&src, 4096).unwrap();
        r.finish(&disk);
        assert!(disk.read_only() && disk.size() == 4096);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "no temporary files left: {names:?}");
    }
}
