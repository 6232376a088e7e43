//! A full snapshot's memory file, written in rounds while the guest runs
//! (pre-copy; the rounds themselves are `vm/precopy.rs`).
//!
//! [`MemoryWriter`] copies pages of guest RAM into the memory file at their
//! own offsets, as often as they change, and keeps one CRC32 per page, so
//! the file's checksum (`Meta::memory_crc`, the CRC32 of all pages in
//! order) is folded from the page CRCs at the end instead of read back
//! (see [`crc_of_pages`]). Pages are read through a private copy, never
//! from guest RAM twice: what is checksummed is what is written.
//!
//! A booted VM's RAM is a shared memfd: its pages are read with `pread`
//! from the memfd, and the first pass skips the memfd's holes (pages the
//! guest never touched), which stay holes in the memory file. Reading them
//! through the mapping would allocate them. Other RAM (a private mapping
//! of a snapshot's memory file) is read through the mapping, which maps
//! the file's page cache and makes no private copies.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::memory::{Backing, GuestRam, PageSet, PAGE_SIZE};
use crate::snapshot::PageCopy;

/// Pages read and written at a time (256 KiB).
const CHUNK_PAGES: usize = 64;

/// The CRC32 of a page of zeros.
fn zero_page_crc() -> u32 {
    static CRC: OnceLock<u32> = OnceLock::new();
    *CRC.get_or_init(|| crc32fast::hash(&[0u8; PAGE_SIZE]))
}

/// The linear map that appends a page of zero bytes to a CRC32 register:
/// column `i` is the image of bit `i`.
fn page_shift() -> &'static [u32; 32] {
    static SHIFT: OnceLock<[u32; 32]> = OnceLock::new();
    SHIFT.get_or_init(|| {
        let mut cols = [0u32; 32];
        for (i, col) in cols.iter_mut().enumerate() {
            let mut c = 1u32 << i;
            for _ in 0..PAGE_SIZE * 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0xedb8_8320
                } else {
                    c >> 1
                };
            }
            *col = c;
        }
        cols
    })
}

fn apply(m: &[u32; 32], mut v: u32) -> u32 {
    let mut out = 0;
    let mut i = 0;
    while v != 0 {
        if v & 1 != 0 {
            out ^= m[i];
        }
        v >>= 1;
        i += 1;
    }
    out
}

/// The CRC32 of the concatenation of pages whose own CRC32s are `crcs`, in
/// order: `crc(A ‖ B) = shift_B(crc(A)) ^ crc(B)`, with the shift over one
/// page a fixed 32×32 bit matrix.
pub fn crc_of_pages(crcs: &[u32]) -> u32 {
    let m = page_shift();
    crcs.iter().fold(0, |acc, &c| apply(m, acc) ^ c)
}

/// A full snapshot's memory file being written, with each page's CRC32.
pub struct MemoryWriter {
    file: File,
    crcs: Vec<u32>,
    buf: Vec<u8>,
}

impl MemoryWriter {
    /// Takes the (new, empty) memory file and sizes it to RAM: every page
    /// reads zeros until written.
    pub fn new(file: File, ram: &GuestRam) -> Result<MemoryWriter> {
        file.set_len(ram.size() as u64)
            .map_err(|e| Error::io("sizing the snapshot memory file", e))?;
        Ok(MemoryWriter {
            file,
            crcs: vec![zero_page_crc(); ram.pages()],
            buf: vec![0u8; CHUNK_PAGES * PAGE_SIZE],
        })
    }

    /// Copies all of RAM (a memfd's holes excepted: they read zeros
    /// already); returns the pages copied.
    pub fn copy_all(&mut self, ram: &GuestRam) -> Result<usize> {
        let runs = match ram.backing() {
            Backing::Memfd(fd) => data_runs(fd, ram.pages())?,
            _ => vec![(0, ram.pages())],
        };
        self.copy_runs(ram, &runs)
    }

    /// Copies the pages of `set`; returns how many.
    pub fn copy_set(&mut self, ram: &GuestRam, set: &PageSet) -> Result<usize> {
        self.copy_runs(ram, &set.runs())
    }

    fn copy_runs(&mut self, ram: &GuestRam, runs: &[(usize, usize)]) -> Result<usize> {
        let memfd = match ram.backing() {
            Backing::Memfd(fd) => Some(fd.clone()),
            _ => None,
        };
        let mut copied = 0;
        for &(start, n) in runs {
            let mut done = 0;
            while done < n {
                let k = CHUNK_PAGES.min(n - done);
                let page = start + done;
                let (off, len) = ram.check(page, k)?;
                let buf = &mut self.buf[..len];
                match &memfd {
                    Some(fd) => fd
                        .read_exact_at(buf, off as u64)
                        .map_err(|e| Error::io("reading guest RAM from its memfd", e))?,
                    None => ram.read_pages(page, k, buf)?,
                }
                self.put(page, off, len)?;
                done += k;
            }
            copied += n;
        }
        Ok(copied)
    }

    /// Writes the first `len` bytes of the buffer at RAM offset `off`
    /// (page `page` on) and records their pages' CRCs.
    fn put(&mut self, page: usize, off: usize, len: usize) -> Result<()> {
        let bytes = &self.buf[..len];
        for (i, p) in bytes.chunks_exact(PAGE_SIZE).enumerate() {
            self.crcs[page + i] = crc32fast::hash(p);
        }
        self.file
            .write_all_at(bytes, off as u64)
            .map_err(|e| Error::io("writing guest memory to the snapshot", e))
    }

    /// Writes pages copied out while the guest was paused over what the
    /// rounds wrote; returns the file's CRC32.
    pub fn finish(&mut self, copy: &PageCopy) -> Result<u32> {
        for (page, bytes) in copy.pages() {
            self.crcs[page] = crc32fast::hash(bytes);
            self.file
                .write_all_at(bytes, (page * PAGE_SIZE) as u64)
                .map_err(|e| Error::io("writing guest memory to the snapshot", e))?;
        }
        Ok(self.crc())
    }

    /// The CRC32 of the file as written so far.
    pub fn crc(&self) -> u32 {
        crc_of_pages(&self.crcs)
    }

    /// Writes back what is written so far and waits for it, so that the
    /// final fsync has little to do and no writeback of this file competes
    /// with the guest's vCPUs for the host's CPUs during the pause.
    pub fn write_back(&self) -> Result<()> {
        // SAFETY: sync_file_range on an open fd, over the whole file.
        let r = unsafe {
            libc::sync_file_range(
                self.file.as_raw_fd(),
                0,
                0,
                libc::SYNC_FILE_RANGE_WAIT_BEFORE
                    | libc::SYNC_FILE_RANGE_WRITE
                    | libc::SYNC_FILE_RANGE_WAIT_AFTER,
            )
        };
        if r != 0 {
            return Err(Error::io(
                "writing the snapshot memory back",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// The runs of pages of `fd` that hold data (`SEEK_DATA`/`SEEK_HOLE`), in
/// whole pages, within `pages`.
fn data_runs(fd: &File, pages: usize) -> Result<Vec<(usize, usize)>> {
    let size = (pages * PAGE_SIZE) as libc::off_t;
    let seek = |from: libc::off_t, whence: libc::c_int| -> Result<Option<libc::off_t>> {
        // SAFETY: lseek on an open fd; it changes only the file offset.
        let r = unsafe { libc::lseek(fd.as_raw_fd(), from, whence) };
        if r >= 0 {
            return Ok(Some(r));
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(Error::io("finding the data in guest RAM's memfd", e)),
        }
    };
    let mut runs = Vec::new();
    let mut at = 0;
    while at < size {
        let Some(data) = seek(at, libc::SEEK_DATA)? else {
            break;
        };
        let end = seek(data, libc::SEEK_HOLE)?.unwrap_or(size).min(size);
        let first = data as usize / PAGE_SIZE;
        let last = (end as usize).div_ceil(PAGE_SIZE);
        if last > first {
            runs.push((first, last - first));
        }
        at = end.max(data + 1);
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_crcs_fold_into_the_crc_of_the_whole() {
        let pages = 37;
        let mut bytes = vec![0u8; pages * PAGE_SIZE];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7 + i / 4096) as u8;
        }
        bytes[5 * PAGE_SIZE..7 * PAGE_SIZE].fill(0);
        let crcs: Vec<u32> = bytes.chunks(PAGE_SIZE).map(crc32fast::hash).collect();
        assert_eq!(crc_of_pages(&crcs), crc32fast::hash(&bytes));
        assert_eq!(crcs[5], zero_page_crc());
        assert_eq!(crc_of_pages(&[]), crc32fast::hash(&[]));
    }

    #[test]
    fn a_memfd_s_holes_are_skipped() {
        let mut ram = GuestRam::reserve(64 * PAGE_SIZE).unwrap();
        ram.back_with_memfd().unwrap();
        ram.write_pages(3, &[1u8; 2 * PAGE_SIZE]).unwrap();
        ram.write_pages(40, &[2u8; PAGE_SIZE]).unwrap();
        let Backing::Memfd(fd) = ram.backing().clone() else {
            panic!("a memfd backing");
        };
        let runs = data_runs(&fd, ram.pages()).unwrap();
        let held: usize = runs.iter().map(|r| r.1).sum();
        assert!(runs.iter().any(|&(s, n)| s <= 3 && s + n >= 5), "{runs:?}");
        assert!(runs.iter().any(|&(s, n)| s <= 40 && s + n > 40), "{runs:?}");
        assert!(held < 64, "holes skipped: {runs:?}");
    }
}
