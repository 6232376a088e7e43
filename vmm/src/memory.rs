//! Guest RAM: one host mapping at a fixed address, registered once as KVM
//! memory slot 0, whose backing is swapped underneath KVM instead of
//! re-registering the slot (slot changes cost milliseconds on this machine;
//! KVM drops stale translations through its MMU notifier).
//!
//! Backings: an anonymous placeholder (a VM created ahead of a restore), a
//! shared memfd (a freshly booted VM), or a private copy-on-write mapping of a
//! snapshot's memory file (restored VMs, and every VM after a full snapshot).
//! With a private file mapping, `MADV_DONTNEED` on a range drops the guest's
//! private copies and the range reads the file again: that is how rollback
//! pays only for the pages that changed.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

/// Guest memory as devices and loaders see it. Every write through it marks
/// its page in a bitmap, so pages the VMM writes (device buffers, virtqueue
/// rings) count as dirty just like the guest's own writes.
pub type GuestMem = GuestMemoryMmap<AtomicBitmap>;

use crate::error::{Error, Result};

/// Size of a guest page.
pub const PAGE_SIZE: usize = 4096;

/// A set of guest page numbers, as a bitmap (one bit per 4 KiB page).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageSet {
    words: Vec<u64>,
    pages: usize,
}

impl PageSet {
    /// An empty set over `pages` pages.
    pub fn new(pages: usize) -> PageSet {
        PageSet {
            words: vec![0; pages.div_ceil(64)],
            pages,
        }
    }

    /// A set holding every page.
    pub fn full(pages: usize) -> PageSet {
        let mut s = PageSet::new(pages);
        s.words.iter_mut().for_each(|w| *w = u64::MAX);
        s.trim();
        s
    }

    /// A set from bitmap words, as KVM's dirty log returns them.
    pub fn from_words(mut words: Vec<u64>, pages: usize) -> PageSet {
        words.resize(pages.div_ceil(64), 0);
        let mut s = PageSet { words, pages };
        s.trim();
        s
    }

    fn trim(&mut self) {
        let extra = self.words.len() * 64 - self.pages;
        if extra > 0 {
            if let Some(last) = self.words.last_mut() {
                *last &= u64::MAX >> extra;
            }
        }
    }

    /// The bitmap words.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Adds page `p`.
    pub fn insert(&mut self, p: usize) {
        if p < self.pages {
            self.words[p / 64] |= 1 << (p % 64);
        }
    }

    /// Whether page `p` is in the set.
    pub fn contains(&self, p: usize) -> bool {
        p < self.pages && self.words[p / 64] & (1 << (p % 64)) != 0
    }

    /// Adds every page of `other`.
    pub fn union_with(&mut self, other: &PageSet) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= *b;
        }
    }

    /// Number of pages in the set.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|w| *w == 0)
    }

    /// Iterates the page numbers in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let b = w.trailing_zeros() as usize;
                w &= w - 1;
                Some(i * 64 + b)
            })
        })
    }

    /// Maximal runs of consecutive pages as `(first, count)`.
    pub fn runs(&self) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for p in self.iter() {
            match runs.last_mut() {
                Some((start, n)) if *start + *n == p => *n += 1,
                _ => runs.push((p, 1)),
            }
        }
        runs
    }
}

/// What currently backs guest RAM.
#[derive(Clone)]
pub enum Backing {
    /// Anonymous placeholder: a VM created ahead of a restore.
    Placeholder,
    /// A shared memfd: a freshly booted VM.
    Memfd(Arc<File>),
    /// A private copy-on-write mapping of a snapshot memory file.
    Private(Arc<File>),
}

/// Guest RAM at guest physical address 0.
pub struct GuestRam {
    addr: *mut u8,
    size: usize,
    backing: Backing,
    mem: GuestMem,
}

// SAFETY: the mapping is owned by this struct for its whole life; concurrent
// access goes through vm-memory's volatile accessors or through KVM.
unsafe impl Send for GuestRam {}
// SAFETY: as above.
unsafe impl Sync for GuestRam {}

fn last_os_error(what: impl Into<String>) -> Error {
    Error::io(what, std::io::Error::last_os_error())
}

impl GuestRam {
    /// Reserves `size` bytes of address space backed by an anonymous
    /// placeholder mapping.
    pub fn reserve(size: usize) -> Result<GuestRam> {
        if size == 0 || size % PAGE_SIZE != 0 {
            return Err(Error::Config(format!(
                "guest RAM size {size} is not a positive multiple of {PAGE_SIZE}"
            )));
        }
        // SAFETY: a fresh anonymous mapping; the kernel picks the address.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(last_os_error(format!(
                "reserving {} MiB of guest RAM",
                size >> 20
            )));
        }
        let addr = addr.cast::<u8>();
        let mem = match Self::view(addr, size) {
            Ok(mem) => mem,
            Err(e) => {
                // SAFETY: unmapping the mapping made just above.
                unsafe { libc::munmap(addr.cast(), size) };
                return Err(e);
            }
        };
        Ok(GuestRam {
            addr,
            size,
            backing: Backing::Placeholder,
            mem,
        })
    }

    fn view(addr: *mut u8, size: usize) -> Result<GuestMem> {
        let flags = libc::MAP_PRIVATE | libc::MAP_NORESERVE;
        // SAFETY: `addr..addr+size` is a live mapping owned by the GuestRam
        // that owns this view; vm-memory does not unmap raw regions.
        let region =
            unsafe { MmapRegion::build_raw(addr, size, libc::PROT_READ | libc::PROT_WRITE, flags) }
                .map_err(|e| Error::Config(format!("guest memory view: {e}")))?;
        let region = GuestRegionMmap::new(region, GuestAddress(0))
            .ok_or_else(|| Error::Config("guest memory region overflows".into()))?;
        GuestMemoryMmap::from_regions(vec![region])
            .map_err(|e| Error::Config(format!("guest memory view: {e}")))
    }

    /// Pages written through [`GuestRam::memory`] since the last call, as
    /// bitmap words; resets the bitmap.
    pub fn take_vmm_dirty(&self) -> Vec<u64> {
        self.mem
            .find_region(GuestAddress(0))
            .map(|r| r.bitmap().get_and_reset())
            .unwrap_or_default()
    }

    /// Host address of guest physical address 0.
    pub fn host_addr(&self) -> u64 {
        self.addr as u64
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Number of 4 KiB pages.
    pub fn pages(&self) -> usize {
        self.size / PAGE_SIZE
    }

    /// The current backing.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    /// A vm-memory view, for loaders and device emulation.
    pub fn memory(&self) -> &GuestMem {
        &self.mem
    }

    fn map_fixed(&self, fd: i32, flags: i32, what: &str) -> Result<()> {
        // SAFETY: replaces our own mapping in place with MAP_FIXED; the range
        // is owned by self and stays mapped for its whole life.
        let addr = unsafe {
            libc::mmap(
                self.addr.cast(),
                self.size,
                libc::PROT_READ | libc::PROT_WRITE,
                flags | libc::MAP_FIXED | libc::MAP_NORESERVE,
                fd,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(last_os_error(what));
        }
        Ok(())
    }

    /// Backs RAM with a new, zeroed, shared memfd (a VM about to boot).
    pub fn back_with_memfd(&mut self) -> Result<()> {
        // SAFETY: memfd_create with a static NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"twig-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(last_os_error("memfd_create for guest RAM"));
        }
        // SAFETY: fd was just returned by memfd_create and is owned here.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(self.size as u64)
            .map_err(|e| Error::io("sizing the guest RAM memfd", e))?;
        self.map_fixed(
            file.as_raw_fd(),
            libc::MAP_SHARED,
            "mapping guest RAM memfd",
        )?;
        self.backing = Backing::Memfd(Arc::new(file));
        Ok(())
    }

    /// Maps `file` (exactly RAM-sized) privately over all of guest RAM,
    /// dropping every page the guest had.
    pub fn map_private(&mut self, file: Arc<File>) -> Result<()> {
        self.map_fixed(
            file.as_raw_fd(),
            libc::MAP_PRIVATE,
            "mapping snapshot memory over guest RAM",
        )?;
        self.backing = Backing::Private(file);
        Ok(())
    }

    fn check(&self, page: usize, count: usize) -> Result<(usize, usize)> {
        let off = page
            .checked_mul(PAGE_SIZE)
            .filter(|o| *o <= self.size)
            .ok_or(Error::GuestAddress {
                addr: (page as u64).saturating_mul(PAGE_SIZE as u64),
                len: count * PAGE_SIZE,
            })?;
        let len = count * PAGE_SIZE;
        if len > self.size - off {
            return Err(Error::GuestAddress {
                addr: off as u64,
                len,
            });
        }
        Ok((off, len))
    }

    /// Drops private copies of `count` pages from `page`: with a private file
    /// backing they read the file's contents again.
    pub fn discard(&self, page: usize, count: usize) -> Result<()> {
        let (off, len) = self.check(page, count)?;
        // SAFETY: the range lies inside our mapping (checked above).
        let r = unsafe { libc::madvise(self.addr.add(off).cast(), len, libc::MADV_DONTNEED) };
        if r != 0 {
            return Err(last_os_error("madvise(MADV_DONTNEED) on guest RAM"));
        }
        Ok(())
    }

    /// Copies `data` (whole pages) into guest RAM at `page`.
    pub fn write_pages(&self, page: usize, data: &[u8]) -> Result<()> {
        let (off, len) = self.check(page, data.len() / PAGE_SIZE)?;
        // SAFETY: destination range checked above; source is a live slice that
        // cannot overlap guest RAM (it is owned by the caller).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.addr.add(off), len) };
        Ok(())
    }

    /// Reads `count` pages from `file` at the pages' own offsets into guest
    /// RAM. The VM must be paused.
    pub fn read_pages_from(&self, file: &File, page: usize, count: usize) -> Result<()> {
        let (off, len) = self.check(page, count)?;
        // SAFETY: the range is inside our mapping and no vCPU runs (paused),
        // so nothing else accesses it while the slice lives.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.addr.add(off), len) };
        file.read_exact_at(dst, off as u64)
            .map_err(|e| Error::io("reading snapshot pages into guest RAM", e))
    }

    /// Writes `count` pages of guest RAM from `page` into `file` at the same
    /// offsets. The VM must be paused.
    pub fn write_pages_to(&self, file: &File, page: usize, count: usize) -> Result<()> {
        let src = self.pages_slice(page, count)?;
        file.write_all_at(src, (page * PAGE_SIZE) as u64)
            .map_err(|e| Error::io("writing guest RAM to the snapshot", e))
    }

    /// Guest RAM as a byte slice for checksums and copies. The guest may be
    /// writing concurrently unless it is paused.
    pub fn pages_slice(&self, page: usize, count: usize) -> Result<&[u8]> {
        let (off, len) = self.check(page, count)?;
        // SAFETY: the range is inside our mapping; callers read it while the
        // VM is paused (snapshots) and treat the bytes as plain data.
        Ok(unsafe { std::slice::from_raw_parts(self.addr.add(off), len) })
    }

    /// Guest RAM mapped in this process, from `/proc/self/smaps`:
    /// `(resident, private)` bytes. Resident pages include those shared with
    /// other VMs through the snapshot's page cache; private ones are this
    /// VM's own copies (what it dirtied or was given by a layer).
    pub fn residency(&self) -> Result<(usize, usize)> {
        let smaps = std::fs::read_to_string("/proc/self/smaps")
            .map_err(|e| Error::io("reading /proc/self/smaps", e))?;
        let header = format!("{:x}-", self.addr as usize);
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&header));
        lines.next();
        let (mut rss, mut private) = (0, 0);
        for l in lines {
            let mut parts = l.split_whitespace();
            let (Some(key), Some(kib)) = (parts.next(), parts.next()) else {
                break;
            };
            let Ok(kib) = kib.parse::<usize>() else {
                break; // the next mapping's header
            };
            match key {
                "Rss:" => rss = kib * 1024,
                "Anonymous:" => private = kib * 1024,
                _ => {}
            }
        }
        Ok((rss, private))
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this struct owns.
        unsafe { libc::munmap(self.addr.cast(), self.size) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_set_runs_and_union() {
        let mut a = PageSet::new(200);
        for p in [1, 2, 3, 64, 65, 199] {
            a.insert(p);
        }
        a.insert(500);
        assert_eq!(a.runs(), vec![(1, 3), (64, 2), (199, 1)]);
        assert_eq!(a.count(), 6);
        let mut b = PageSet::new(200);
        b.insert(4);
        a.union_with(&b);
        assert_eq!(a.runs()[0], (1, 4));
        assert_eq!(PageSet::full(130).count(), 130);
        assert!(PageSet::new(10).is_empty());
    }

    #[test]
    fn discard_restores_file_contents() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![7u8; 4 * PAGE_SIZE]).unwrap();
        let mut ram = GuestRam::reserve(4 * PAGE_SIZE).unwrap();
        ram.map_private(Arc::new(f)).unwrap();
        ram.write_pages(1, &[9u8; PAGE_SIZE]).unwrap();
        assert_eq!(ram.pages_slice(1, 1).unwrap()[0], 9);
        ram.discard(1, 1).unwrap();
        assert_eq!(ram.pages_slice(1, 1).unwrap()[0], 7);
        assert!(ram.write_pages(4, &[0u8; PAGE_SIZE]).is_err());
    }
}
