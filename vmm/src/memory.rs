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
use std::sync::{Arc, OnceLock};

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{
    Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap, MmapRegion,
};

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

    /// The set as at most `max_runs` runs `(first, count)`, coarsened to
    /// windows of 16 pages (64 KiB) and, while there are more runs than
    /// that, of twice as many: every page of the set is in a run, pages
    /// near them may be too. Empty for an empty set or `max_runs` 0.
    pub fn coarse_runs(&self, max_runs: usize) -> Vec<(usize, usize)> {
        if max_runs == 0 {
            return Vec::new();
        }
        let mut window = 16;
        loop {
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for p in self.iter() {
                let first = p - p % window;
                let end = (first + window).min(self.pages);
                match runs.last_mut() {
                    Some((start, n)) if *start + *n >= first => *n = end - *start,
                    _ => runs.push((first, end - first)),
                }
            }
            if runs.len() <= max_runs {
                return runs;
            }
            window *= 2;
        }
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

/// `/proc/self/pagemap`, kept open from before a jail hides `/proc`
/// ([`keep_pagemap`]).
static PAGEMAP: OnceLock<File> = OnceLock::new();

/// Opens this process's `/proc/self/pagemap` for [`GuestRam::touched`],
/// once: a jailed VMM calls it before its root changes (and after it
/// forked into a PID namespace: the descriptor is the process's own).
pub fn keep_pagemap() -> std::io::Result<()> {
    if PAGEMAP.get().is_none() {
        let _ = PAGEMAP.set(File::open("/proc/self/pagemap")?);
    }
    Ok(())
}

/// Bits of a pagemap entry: the page is present, or swapped out.
const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;

/// Guest RAM at guest physical address 0.
pub struct GuestRam {
    addr: *mut u8,
    size: usize,
    backing: Backing,
    mem: GuestMem,
}

// SAFETY: the mapping is owned by this struct for its whole life and no
// reference into it is ever handed out: every access copies through raw
// pointers (memcpy, syscalls), vm-memory's volatile accessors or KVM.
unsafe impl Send for GuestRam {}
// SAFETY: as above.
unsafe impl Sync for GuestRam {}

fn last_os_error(what: impl Into<String>) -> Error {
    Error::io(what, std::io::Error::last_os_error())
}

/// Bytes [`GuestRam::copy_out`] copies at a time: small enough to stay in
/// cache while a chunk is checksummed and written out.
pub const COPY_CHUNK: usize = 256 * 1024;

fn check_range(size: usize, page: usize, count: usize) -> Result<(usize, usize)> {
    let out = || Error::GuestAddress {
        addr: (page as u64).saturating_mul(PAGE_SIZE as u64),
        len: count.saturating_mul(PAGE_SIZE),
    };
    let off = page.checked_mul(PAGE_SIZE).ok_or_else(out)?;
    let len = count.checked_mul(PAGE_SIZE).ok_or_else(out)?;
    match off.checked_add(len) {
        Some(end) if end <= size => Ok((off, len)),
        _ => Err(out()),
    }
}

/// Copies whole pages into the mapping at `base` (`size` bytes).
fn write_into(base: *mut u8, size: usize, page: usize, data: &[u8]) -> Result<()> {
    if data.len() % PAGE_SIZE != 0 {
        return Err(Error::Config(format!(
            "{} bytes are not whole pages",
            data.len()
        )));
    }
    let (off, len) = check_range(size, page, data.len() / PAGE_SIZE)?;
    // SAFETY: the destination range lies inside the mapping at `base`
    // (checked above), which the caller owns; the source is a caller's slice,
    // which cannot overlap it since no reference into the mapping is ever
    // handed out. No Rust reference to the destination is created.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base.add(off), len) };
    Ok(())
}

/// `pread`s `count` pages of `file`, at the pages' own offsets, into the
/// mapping at `base` (`size` bytes).
fn read_into(base: *mut u8, size: usize, file: &File, page: usize, count: usize) -> Result<()> {
    let (off, len) = check_range(size, page, count)?;
    let mut done = 0;
    while done < len {
        // SAFETY: the kernel writes at most `len - done` bytes from
        // `base + off + done`, inside the caller's mapping (checked above);
        // no Rust reference to that memory exists.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                base.add(off + done).cast(),
                len - done,
                (off + done) as libc::off_t,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            0 => {
                return Err(Error::io(
                    "reading snapshot pages into guest RAM",
                    std::io::ErrorKind::UnexpectedEof.into(),
                ))
            }
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::io("reading snapshot pages into guest RAM", e));
                }
            }
        }
    }
    Ok(())
}

/// A snapshot's memory mapped privately at a scratch address, filled in
/// before it replaces guest RAM as a whole ([`GuestRam::install`]).
/// Dropped without being installed, it is unmapped.
pub struct PreparedRam {
    addr: *mut u8,
    size: usize,
    file: Arc<File>,
}

impl PreparedRam {
    /// Copies `data` (whole pages) into the prepared memory at `page`.
    pub fn write_pages(&self, page: usize, data: &[u8]) -> Result<()> {
        write_into(self.addr, self.size, page, data)
    }

    /// Reads `count` pages from `file`, at the pages' own offsets, into the
    /// prepared memory.
    pub fn read_pages_from(&self, file: &File, page: usize, count: usize) -> Result<()> {
        read_into(self.addr, self.size, file, page, count)
    }
}

impl Drop for PreparedRam {
    fn drop(&mut self) {
        if !self.addr.is_null() {
            // SAFETY: unmapping the scratch mapping this struct owns (it was
            // never moved over guest RAM).
            unsafe { libc::munmap(self.addr.cast(), self.size) };
        }
    }
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

    /// Whether RAM is a private mapping of `file` (the same file, not
    /// only the same contents).
    pub fn maps_file(&self, file: &File) -> bool {
        use std::os::unix::fs::MetadataExt;
        let Backing::Private(mine) = &self.backing else {
            return false;
        };
        match (mine.metadata(), file.metadata()) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
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

    /// Backs RAM with zeroed anonymous memory again (a VM whose memory is
    /// lost).
    pub fn clear(&mut self) -> Result<()> {
        self.map_fixed(
            -1,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            "zeroing guest RAM",
        )?;
        self.backing = Backing::Placeholder;
        Ok(())
    }

    /// Checks that `count` pages from `page` lie inside guest RAM; returns
    /// their byte offset and length.
    pub fn check(&self, page: usize, count: usize) -> Result<(usize, usize)> {
        check_range(self.size, page, count)
    }

    /// Drops private copies of `count` pages from `page`: with a private file
    /// backing they read the file's contents again.
    pub fn discard(&self, page: usize, count: usize) -> Result<()> {
        let (off, len) = self.check(page, count)?;
        // SAFETY: the range lies inside our mapping (checked above);
        // MADV_DONTNEED changes only what backs it, never the mapping.
        let r = unsafe { libc::madvise(self.addr.add(off).cast(), len, libc::MADV_DONTNEED) };
        if r != 0 {
            return Err(last_os_error("madvise(MADV_DONTNEED) on guest RAM"));
        }
        Ok(())
    }

    /// Copies `data` (whole pages) into guest RAM at `page`, bypassing the
    /// dirty bitmap (rollback puts the baseline's own bytes back). A running
    /// guest sees the bytes change under it, as with a device's DMA: pause
    /// the VM first for a consistent result.
    pub fn write_pages(&self, page: usize, data: &[u8]) -> Result<()> {
        write_into(self.addr, self.size, page, data)
    }

    /// Reads `count` pages from `file` at the pages' own offsets into guest
    /// RAM. Pause the VM first for a consistent result.
    pub fn read_pages_from(&self, file: &File, page: usize, count: usize) -> Result<()> {
        read_into(self.addr, self.size, file, page, count)
    }

    /// Copies `count` pages of guest RAM from `page` out in chunks of at
    /// most [`COPY_CHUNK`] bytes, calling `f(offset, bytes)` with each
    /// chunk's byte offset in RAM and a private copy of its bytes (the guest
    /// may write RAM concurrently, so no reference to RAM itself is ever
    /// handed out). Pause the VM first for a consistent result.
    pub fn copy_out(
        &self,
        page: usize,
        count: usize,
        mut f: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let (off, len) = self.check(page, count)?;
        let mut buf = vec![0u8; len.min(COPY_CHUNK)];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(COPY_CHUNK);
            let at = (off + done) as u64;
            self.mem
                .read_slice(&mut buf[..n], GuestAddress(at))
                .map_err(|_| Error::GuestAddress { addr: at, len: n })?;
            f(at, &buf[..n])?;
            done += n;
        }
        Ok(())
    }

    /// Copies `count` pages from `page` into `buf` (exactly that long),
    /// in one pass through vm-memory's volatile accessors.
    pub fn read_pages(&self, page: usize, count: usize, buf: &mut [u8]) -> Result<()> {
        let (off, len) = self.check(page, count)?;
        if buf.len() != len {
            return Err(Error::GuestAddress {
                addr: off as u64,
                len: buf.len(),
            });
        }
        self.mem
            .read_slice(buf, GuestAddress(off as u64))
            .map_err(|_| Error::GuestAddress {
                addr: off as u64,
                len,
            })
    }

    /// Maps `file` (exactly RAM-sized) privately at a scratch address, where
    /// [`PreparedRam`] fills in pages before [`GuestRam::install`] moves it
    /// over guest RAM in one step. Guest RAM is not touched.
    pub fn prepare_private(&self, file: Arc<File>) -> Result<PreparedRam> {
        // SAFETY: a new private mapping of `file` at an address the kernel
        // picks; it overlaps nothing we own.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(last_os_error(
                "mapping snapshot memory at a scratch address",
            ));
        }
        Ok(PreparedRam {
            addr: addr.cast(),
            size: self.size,
            file,
        })
    }

    /// Moves a prepared mapping over guest RAM with one
    /// `mremap(MREMAP_MAYMOVE | MREMAP_FIXED)`: guest RAM is either all the
    /// old memory or all the prepared one, never a mix. On failure the
    /// prepared mapping is dropped; the kernel may have unmapped guest RAM
    /// first (the failure modes are a lack of kernel memory), so a caller
    /// must then map all of RAM again before the guest runs.
    pub fn install(&mut self, mut prepared: PreparedRam) -> Result<()> {
        if prepared.size != self.size {
            return Err(Error::Config(format!(
                "a prepared mapping of {} bytes cannot replace {} bytes of guest RAM",
                prepared.size, self.size
            )));
        }
        // SAFETY: moves the scratch mapping, which `prepared` owns, onto the
        // range this struct owns; `MREMAP_FIXED` replaces what was there (KVM
        // drops its translations through the MMU notifier). On failure the
        // scratch mapping stays where it was and `prepared` unmaps it.
        let r = unsafe {
            libc::mremap(
                prepared.addr.cast(),
                prepared.size,
                self.size,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                self.addr.cast::<libc::c_void>(),
            )
        };
        if r == libc::MAP_FAILED {
            return Err(last_os_error(
                "moving prepared memory over guest RAM (mremap)",
            ));
        }
        // Moved: the scratch range is no longer ours to unmap.
        prepared.addr = std::ptr::null_mut();
        self.backing = Backing::Private(prepared.file.clone());
        Ok(())
    }

    /// The pages this process's page tables map (present or swapped out):
    /// those the guest, KVM or the VMM touched since RAM was last mapped
    /// (a boot's memfd, a restore's or full snapshot's file), as
    /// `/proc/self/pagemap` says. A fault on a file mapping maps the
    /// neighbours the page cache holds too (fault-around): the set is
    /// precise to about 64 KiB.
    pub fn touched(&self) -> Result<PageSet> {
        keep_pagemap().map_err(|e| Error::io("opening /proc/self/pagemap", e))?;
        let map = PAGEMAP
            .get()
            .ok_or_else(|| Error::Config("no /proc/self/pagemap".into()))?;
        let pages = self.pages();
        let mut set = PageSet::new(pages);
        let mut buf = vec![0u8; 8 * 8192];
        let first = self.addr as u64 / PAGE_SIZE as u64;
        let mut p = 0;
        while p < pages {
            let n = (pages - p).min(buf.len() / 8);
            let bytes = &mut buf[..n * 8];
            map.read_exact_at(bytes, (first + p as u64) * 8)
                .map_err(|e| Error::io("reading /proc/self/pagemap", e))?;
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let mut word = [0u8; 8];
                word.copy_from_slice(e);
                if u64::from_ne_bytes(word) & (PM_PRESENT | PM_SWAPPED) != 0 {
                    set.insert(p + i);
                }
            }
            p += n;
        }
        Ok(set)
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
    fn coarse_runs_cover_the_set_within_the_limit() {
        let mut s = PageSet::new(1000);
        for p in [3, 17, 40, 200, 999] {
            s.insert(p);
        }
        // 64 KiB windows: 0..16 and 16..32 touch, 32..48, 192..208, the
        // last window ends with the set.
        assert_eq!(s.coarse_runs(10), vec![(0, 48), (192, 16), (992, 8)]);
        let two = s.coarse_runs(2);
        assert!(two.len() <= 2, "{two:?}");
        for p in s.iter() {
            assert!(
                two.iter().any(|(f, n)| p >= *f && p < f + n),
                "{p} in {two:?}"
            );
        }
        assert!(s.coarse_runs(0).is_empty());
        assert!(PageSet::new(64).coarse_runs(4).is_empty());
    }

    #[test]
    fn touched_pages_are_those_written_or_read() {
        let mut ram = GuestRam::reserve(64 * PAGE_SIZE).unwrap();
        ram.back_with_memfd().unwrap();
        assert!(ram.touched().unwrap().is_empty());
        ram.write_pages(5, &[1u8; PAGE_SIZE]).unwrap();
        assert_eq!(byte_at(&ram, 40), 0);
        let t = ram.touched().unwrap();
        assert!(t.contains(5) && t.contains(40), "{:?}", t.runs());
        assert!(!t.contains(20), "{:?}", t.runs());
    }

    fn byte_at(ram: &GuestRam, page: usize) -> u8 {
        let mut b = [0u8; 1];
        ram.memory()
            .read_slice(&mut b, GuestAddress((page * PAGE_SIZE) as u64))
            .unwrap();
        b[0]
    }

    fn file_of(bytes: &[u8]) -> Arc<File> {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        Arc::new(f)
    }

    #[test]
    fn discard_restores_file_contents() {
        let mut ram = GuestRam::reserve(4 * PAGE_SIZE).unwrap();
        ram.map_private(file_of(&[7u8; 4 * PAGE_SIZE])).unwrap();
        ram.write_pages(1, &[9u8; PAGE_SIZE]).unwrap();
        assert_eq!(byte_at(&ram, 1), 9);
        ram.discard(1, 1).unwrap();
        assert_eq!(byte_at(&ram, 1), 7);
        assert!(ram.write_pages(4, &[0u8; PAGE_SIZE]).is_err());
        assert!(ram.write_pages(3, &[0u8; PAGE_SIZE + 1]).is_err());
        assert!(ram.discard(3, 2).is_err());
        assert!(ram.check(usize::MAX / 2, 1).is_err());
        assert!(ram.check(0, usize::MAX).is_err());
        assert_eq!(byte_at(&ram, 3), 7, "refused operations change nothing");
    }

    #[test]
    fn pages_are_read_from_files_and_copied_out_in_chunks() {
        let pages = 2 * COPY_CHUNK / PAGE_SIZE + 3;
        let mut content = vec![0u8; pages * PAGE_SIZE];
        for (i, b) in content.iter_mut().enumerate() {
            *b = (i / PAGE_SIZE) as u8 ^ (i as u8);
        }
        let file = file_of(&content);
        let ram = GuestRam::reserve(pages * PAGE_SIZE).unwrap();
        ram.read_pages_from(&file, 1, pages - 1).unwrap();
        let mut seen = Vec::new();
        let mut offsets = Vec::new();
        ram.copy_out(0, pages, |off, b| {
            assert!(b.len() <= COPY_CHUNK);
            offsets.push(off);
            seen.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(offsets, [0, COPY_CHUNK as u64, 2 * COPY_CHUNK as u64]);
        assert!(seen[..PAGE_SIZE].iter().all(|b| *b == 0), "page 0 not read");
        assert!(seen[PAGE_SIZE..] == content[PAGE_SIZE..]);
        // A short file is an error.
        let short = file_of(&content[..PAGE_SIZE]);
        assert!(ram.read_pages_from(&short, 1, 1).is_err());
        assert!(ram.copy_out(pages, 1, |_, _| Ok(())).is_err());
    }

    #[test]
    fn a_prepared_mapping_replaces_ram_as_a_whole() {
        let mut ram = GuestRam::reserve(4 * PAGE_SIZE).unwrap();
        ram.back_with_memfd().unwrap();
        ram.write_pages(0, &[1u8; 4 * PAGE_SIZE]).unwrap();
        let target = file_of(&[5u8; 4 * PAGE_SIZE]);
        let p = ram.prepare_private(target.clone()).unwrap();
        p.write_pages(2, &[6u8; PAGE_SIZE]).unwrap();
        assert!(p.write_pages(4, &[6u8; PAGE_SIZE]).is_err());
        assert_eq!(byte_at(&ram, 2), 1, "RAM untouched until installed");
        let addr = ram.host_addr();
        ram.install(p).unwrap();
        assert_eq!(ram.host_addr(), addr);
        let bytes: Vec<u8> = (0..4).map(|i| byte_at(&ram, i)).collect();
        assert_eq!(bytes, [5, 5, 6, 5]);
        assert!(matches!(ram.backing(), Backing::Private(_)));
        // Private: the file is unchanged, and discarding shows it again.
        ram.discard(2, 1).unwrap();
        assert_eq!(byte_at(&ram, 2), 5);
        // A mapping of another size is refused and RAM stays.
        let mut small = GuestRam::reserve(2 * PAGE_SIZE).unwrap();
        let other = small
            .prepare_private(file_of(&[8u8; 2 * PAGE_SIZE]))
            .unwrap();
        assert!(ram.install(other).is_err());
        assert_eq!(byte_at(&ram, 0), 5);
        small.map_private(target).unwrap();
    }
}
