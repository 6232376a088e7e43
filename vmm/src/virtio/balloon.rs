//! virtio-balloon with free page reporting only: guest memory the guest
//! kernel frees goes back to the host.
//!
//! The device offers `VIRTIO_BALLOON_F_REPORTING` and nothing else. Its
//! target (`num_pages`) stays 0, so a driver never inflates; the inflate and
//! deflate queues exist because the specification requires them, and buffers
//! posted on them are returned untouched. With only that feature negotiated
//! the driver finds the reporting queue at index 2 (Linux numbers the queues
//! it uses consecutively).
//!
//! Each buffer on the reporting queue names a free range of guest physical
//! memory (its address and length). A range that lies inside guest RAM and
//! is page-aligned is dropped from the host mapping with
//! `madvise(MADV_DONTNEED)`: for the private copy-on-write mapping of a
//! snapshot's memory file (every restored pod) the pod's own copy goes and
//! the page reads the snapshot's bytes again; for anonymous memory it reads
//! zeros. Either is fine for a page the guest freed. The range is then marked
//! in guest memory's dirty bitmap, as if the VMM had written it, so that an
//! incremental snapshot saves it and a rollback puts the target's bytes back
//! (a page dropped after a snapshot must not read the template's bytes after
//! a rollback to that snapshot). Anything else (outside RAM, not page
//! aligned, empty) is refused with a warning and left alone; every buffer is
//! returned to the driver, which waits for it.
//!
//! The device has no state of its own beyond the transport's (queues and
//! negotiated features), which every snapshot holds.

use virtio_bindings::virtio_ids::VIRTIO_ID_BALLOON;
use virtio_queue::{Queue, QueueT};
use vm_memory::bitmap::Bitmap;
use vm_memory::{Address, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::VirtioDevice;
use crate::memory::{GuestMem, PAGE_SIZE};

/// `VIRTIO_BALLOON_F_REPORTING`: the free page reporting queue.
pub const VIRTIO_BALLOON_F_REPORTING: u32 = 5;

/// Queue indices with only `VIRTIO_BALLOON_F_REPORTING` negotiated.
const INFLATE: usize = 0;
const DEFLATE: usize = 1;
const REPORTING: usize = 2;

/// Queue sizes. Linux refuses a reporting queue shorter than its
/// `PAGE_REPORTING_CAPACITY` (32 ranges per report).
const QUEUE_SIZES: &[u16] = &[256, 256, 64];

/// Why a reported range was refused.
#[derive(Debug, thiserror::Error)]
pub enum RangeError {
    /// Empty, or address or length not a multiple of the page size.
    #[error("range {addr:#x}+{len:#x} is empty or not page-aligned")]
    Unaligned {
        /// The guest physical address.
        addr: u64,
        /// The length in bytes.
        len: u32,
    },
    /// Not wholly inside guest RAM.
    #[error("range {addr:#x}+{len:#x} is not inside guest RAM")]
    OutsideRam {
        /// The guest physical address.
        addr: u64,
        /// The length in bytes.
        len: u32,
    },
    /// `madvise` failed (the range was checked: this is the host's doing).
    #[error("madvise(MADV_DONTNEED) on {addr:#x}+{len:#x}: {source}")]
    Madvise {
        /// The guest physical address.
        addr: u64,
        /// The length in bytes.
        len: u32,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// What the device did, for diagnostics.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    /// Ranges dropped from the host mapping.
    ranges: u64,
    /// Bytes dropped from the host mapping.
    bytes: u64,
    /// Ranges refused.
    refused: u64,
}

/// The balloon device.
#[derive(Default)]
pub struct Balloon {
    counters: Counters,
}

impl Balloon {
    /// A balloon device offering free page reporting.
    pub fn new() -> Balloon {
        Balloon::default()
    }
}

/// Drops the pages of the reported range `addr`+`len` from the host mapping
/// behind `mem` and marks them dirty.
pub fn discard_range(mem: &GuestMem, addr: u64, len: u32) -> Result<(), RangeError> {
    let page = PAGE_SIZE as u64;
    if len == 0 || addr % page != 0 || u64::from(len) % page != 0 {
        return Err(RangeError::Unaligned { addr, len });
    }
    let outside = || RangeError::OutsideRam { addr, len };
    let (region, offset) = mem
        .to_region_addr(GuestAddress(addr))
        .ok_or_else(outside)?;
    match offset.raw_value().checked_add(u64::from(len)) {
        Some(end) if end <= region.len() => {}
        _ => return Err(outside()),
    }
    let host = region.get_host_address(offset).map_err(|_| outside())?;
    // SAFETY: `host..host + len` lies inside the region's mapping (checked
    // above against the region's length), which guest RAM owns for the VM's
    // life. MADV_DONTNEED changes only what backs the range, never the
    // mapping, and no Rust reference into guest RAM exists (all access copies
    // through volatile accessors or syscalls).
    let r = unsafe { libc::madvise(host.cast(), len as usize, libc::MADV_DONTNEED) };
    if r != 0 {
        return Err(RangeError::Madvise {
            addr,
            len,
            source: std::io::Error::last_os_error(),
        });
    }
    // Marked after the drop: a snapshot that sees the mark sees the page
    // already dropped.
    region
        .bitmap()
        .mark_dirty(offset.raw_value() as usize, len as usize);
    Ok(())
}

impl Balloon {
    fn report(&mut self, queue: &mut Queue, mem: &GuestMem) -> bool {
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            for desc in chain {
                match discard_range(mem, desc.addr().raw_value(), desc.len()) {
                    Ok(()) => {
                        self.counters.ranges += 1;
                        self.counters.bytes += u64::from(desc.len());
                    }
                    Err(e) => {
                        self.counters.refused += 1;
                        tracing::warn!("virtio-balloon: reported {e}; left alone");
                    }
                }
            }
            if let Err(e) = queue.add_used(mem, head, 0) {
                tracing::warn!("virtio-balloon: {e}");
                break;
            }
            used = true;
        }
        used
    }

    /// Returns buffers of a queue the device does not act on.
    fn ignore(queue: &mut Queue, mem: &GuestMem) -> bool {
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            if let Err(e) = queue.add_used(mem, chain.head_index(), 0) {
                tracing::warn!("virtio-balloon: {e}");
                break;
            }
            used = true;
        }
        used
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BALLOON
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_BALLOON_F_REPORTING
    }

    fn queue_max_sizes(&self) -> &[u16] {
        QUEUE_SIZES
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        // struct virtio_balloon_config: num_pages (the target), actual,
        // free_page_hint_cmd_id and poison_val all read as 0; the driver's
        // writes of `actual` (always 0 here) are not kept.
        data.iter_mut().for_each(|b| *b = 0);
    }

    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let Some(queue) = queues.get_mut(index) else {
            return false;
        };
        match index {
            REPORTING => self.report(queue, mem),
            INFLATE | DEFLATE => {
                tracing::debug!("virtio-balloon: buffers on queue {index} with a target of 0");
                Balloon::ignore(queue, mem)
            }
            _ => false,
        }
    }

    fn describe(&self) -> String {
        let c = self.counters;
        format!(
            "reported {} ranges, {} bytes dropped, {} refused",
            c.ranges, c.bytes, c.refused
        )
    }
}
