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
//! negotiated features), which every snapshot holds. It is one more entry in
//! the device list, last in MMIO order: a snapshot restores only into a VM
//! that agrees on the balloon, so templates built without it restore only
//! into VMs without it. Off by default (`DeviceConfig::balloon`,
//! `--balloon`); twig-node turns it on for its templates and pool.

use virtio_bindings::virtio_ids::VIRTIO_ID_BALLOON;
use virtio_queue::{Queue, QueueT};
use vm_memory::bitmap::Bitmap;
use vm_memory::{Address, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::VirtioDevice;
use crate::memory::{GuestMem, PAGE_SIZE};
use crate::ratelimit::warn_limited;

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
    let (region, offset) = mem.to_region_addr(GuestAddress(addr)).ok_or_else(outside)?;
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
                        warn_limited!("virtio-balloon: reported {e}; left alone");
                    }
                }
            }
            if let Err(e) = queue.add_used(mem, head, 0) {
                warn_limited!("virtio-balloon: {e}");
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
                warn_limited!("virtio-balloon: {e}");
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use virtio_bindings::virtio_mmio::{
        VIRTIO_MMIO_DEVICE_ID, VIRTIO_MMIO_INTERRUPT_STATUS, VIRTIO_MMIO_INT_VRING,
        VIRTIO_MMIO_QUEUE_NUM_MAX, VIRTIO_MMIO_QUEUE_SEL,
    };

    use super::*;
    use crate::memory::PageSet;
    use crate::virtio::testing::Driver;
    use crate::virtio::{rng, MmioTransport};

    const MIB: u64 = 1 << 20;
    /// The "template" bytes of the pages the tests report.
    const FILE_BYTE: u8 = 0xa5;
    /// Where the reported pages lie: [8 MiB, 12 MiB) of the driver's 16 MiB.
    const AREA: u64 = 8 * MIB;
    const AREA_LEN: u64 = 4 * MIB;
    /// Private bytes the queues' rings may add (a few pages written by the
    /// driver and the device).
    const RINGS: usize = 64 << 10;

    /// A driver of a balloon whose RAM is a private mapping of a file (as in
    /// a restored VM) holding `FILE_BYTE` in the area and zeros elsewhere,
    /// with the area written by the guest (the pod's own copies).
    fn driver() -> Driver {
        let mut d = Driver::new(Box::new(Balloon::new()));
        let size = d.ram.size();
        let mut content = vec![0u8; size];
        content[AREA as usize..(AREA + AREA_LEN) as usize].fill(FILE_BYTE);
        let mut f = tempfile::tempfile().expect("a temporary file");
        std::io::Write::write_all(&mut f, &content).expect("writing the file");
        // The queues' rings are zero in the file, as the fresh driver left them.
        d.ram.map_private(Arc::new(f)).expect("mapping the file");
        d.write(AREA, &vec![0x11; AREA_LEN as usize]);
        d.ram.take_vmm_dirty();
        d
    }

    fn private_bytes(d: &Driver) -> usize {
        d.ram.residency().expect("reading /proc/self/smaps").1
    }

    fn dirty(d: &Driver) -> PageSet {
        PageSet::from_words(d.ram.take_vmm_dirty(), d.ram.pages())
    }

    fn pages(addr: u64, len: u64) -> std::ops::Range<usize> {
        (addr / 4096) as usize..((addr + len) / 4096) as usize
    }

    #[test]
    fn reported_ranges_leave_the_host_and_count_as_changed() {
        let mut d = driver();
        assert_eq!(d.reg(VIRTIO_MMIO_DEVICE_ID), 5);
        assert_eq!(
            d.device_features() & !(1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1),
            1 << VIRTIO_BALLOON_F_REPORTING,
            "free page reporting and nothing else"
        );
        for (q, size) in [(0, 256), (1, 256), (2, 64), (3, 0)] {
            d.set(VIRTIO_MMIO_QUEUE_SEL, q);
            assert_eq!(d.reg(VIRTIO_MMIO_QUEUE_NUM_MAX), size, "queue {q}");
        }
        assert_eq!(d.config(16), vec![0; 16], "a target of 0 pages");
        let before = private_bytes(&d);
        assert!(before >= AREA_LEN as usize, "{before} private bytes");

        // Two ranges in one report, as Linux sends them (device-writable).
        let (a, b) = (AREA, AREA + AREA_LEN / 2);
        let half = (AREA_LEN / 2) as u32;
        let head = d.post(REPORTING, &[(a, half, true), (b, half, true)]);
        d.notify(REPORTING);
        assert_eq!(d.used(REPORTING), Some((u32::from(head), 0)));
        assert_eq!(d.irq.read().expect("the interrupt"), 1);
        assert_eq!(d.reg(VIRTIO_MMIO_INTERRUPT_STATUS), VIRTIO_MMIO_INT_VRING);

        let after = private_bytes(&d);
        assert!(
            after + AREA_LEN as usize <= before + RINGS,
            "the pod's copies went: {before} private bytes before, {after} after"
        );
        assert!(
            d.read(AREA, AREA_LEN as usize)
                .iter()
                .all(|x| *x == FILE_BYTE),
            "the pages read the file again"
        );
        let changed = dirty(&d);
        assert!(
            pages(AREA, AREA_LEN).all(|p| changed.contains(p)),
            "every dropped page counts as changed"
        );
        assert!(d
            .t
            .describe()
            .contains("reported 2 ranges, 4194304 bytes dropped, 0 refused"));
    }

    #[test]
    fn hostile_ranges_are_refused_and_every_buffer_returned() {
        let mut d = driver();
        let ram = d.ram.size() as u64;
        let bad: [(u64, u32, bool); 7] = [
            (ram - 4096, 8192, true), // runs past the end of RAM
            (ram, 4096, true),        // just past it
            (1 << 40, 4096, true),    // far past it
            (!0xfff, 4096, true),     // the sum overflows
            (AREA + 1, 4096, true),   // unaligned address
            (AREA, 100, true),        // unaligned length
            (AREA, 0, true),          // empty
        ];
        let head = d.post(REPORTING, &bad);
        d.notify(REPORTING);
        assert_eq!(d.used(REPORTING), Some((u32::from(head), 0)), "returned");
        let changed = dirty(&d);
        assert!(
            pages(AREA, AREA_LEN).all(|p| !changed.contains(p)),
            "nothing counts as changed"
        );
        assert!(
            d.read(AREA, AREA_LEN as usize).iter().all(|x| *x == 0x11),
            "nothing dropped"
        );
        assert!(d
            .t
            .describe()
            .contains("reported 0 ranges, 0 bytes dropped, 7 refused"));

        // The device goes on: a good range after bad ones is dropped, and
        // buffers on the inflate and deflate queues come back untouched.
        let head = d.post(REPORTING, &[(AREA, 4096, true)]);
        d.notify(REPORTING);
        assert_eq!(d.used(REPORTING), Some((u32::from(head), 0)));
        assert_eq!(d.read(AREA, 4096), vec![FILE_BYTE; 4096]);
        assert_eq!(d.read(AREA + 4096, 4096), vec![0x11; 4096]);
        for q in [INFLATE, DEFLATE] {
            let pfns = d.alloc(64);
            d.write(pfns, &[0xff; 64]);
            let head = d.post(q, &[(pfns, 64, false)]);
            d.notify(q);
            assert_eq!(d.used(q), Some((u32::from(head), 0)), "queue {q}");
        }
        assert_eq!(d.read(AREA + 4096, 4096), vec![0x11; 4096]);
    }

    /// Log output of the current thread, kept for a test to read.
    #[derive(Clone, Default)]
    struct Log(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Log {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_guest_sending_malformed_reports_gets_a_few_warnings_logged() {
        let mut d = driver();
        let log = Log::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..500 {
                let head = d.post(REPORTING, &[(AREA + 1, 4096, true), (AREA, 0, true)]);
                d.notify(REPORTING);
                assert_eq!(d.used(REPORTING), Some((u32::from(head), 0)));
            }
        });
        assert!(d.t.describe().contains("1000 refused"), "all refused");
        let log = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        let lines = log.lines().filter(|l| l.contains("virtio-balloon")).count();
        assert!(
            lines <= crate::ratelimit::BURST as usize,
            "{lines} warnings for 1000 refusals:\n{log}"
        );
    }

    #[test]
    fn the_reporting_queue_carries_on_after_restore() {
        let mut d = driver();
        let head = d.post(REPORTING, &[(AREA, 4096, true)]);
        d.notify(REPORTING);
        assert_eq!(d.used(REPORTING), Some((u32::from(head), 0)));
        let saved = d.t.save();

        let irq = d.irq.try_clone().expect("an eventfd");
        let mut restored =
            MmioTransport::new(Box::new(Balloon::new()), irq, d.mem.clone()).expect("transport");
        let parsed = restored.parse(&saved).expect("balloon state");
        restored.apply(parsed);
        assert_eq!(restored.save(), saved);
        d.t = restored;
        let head = d.post(REPORTING, &[(AREA + 4096, 4096, true)]);
        d.notify(REPORTING);
        assert_eq!(
            d.used(REPORTING),
            Some((u32::from(head), 0)),
            "after restore"
        );
        assert_eq!(d.read(AREA + 4096, 4096), vec![FILE_BYTE; 4096]);

        // Another device's state (one queue) does not fit a balloon.
        let irq = d.irq.try_clone().expect("an eventfd");
        let r = MmioTransport::new(Box::new(rng::Rng), irq, d.mem.clone()).expect("transport");
        assert!(d.t.parse(&r.save()).is_err(), "an rng's state refused");
        assert!(d.t.parse(&saved[..saved.len() - 1]).is_err(), "truncated");
    }

    #[test]
    fn reports_are_served_under_the_vcpu_seccomp_filter() {
        // The vCPU thread serves the reporting queue: the filter must allow
        // what it does, or the VMM dies of SIGSYS (and this test process
        // with it). Installed on this thread only.
        let mut d = driver();
        let before = private_bytes(&d);
        let d = std::thread::spawn(move || {
            crate::jail::seccomp::install(crate::jail::seccomp::Role::Vcpu)
                .expect("installing the vCPU filter");
            let head = d.post(REPORTING, &[(AREA, AREA_LEN as u32, true)]);
            d.notify(REPORTING);
            assert_eq!(d.used(REPORTING), Some((u32::from(head), 0)));
            d
        })
        .join()
        .expect("the confined thread");
        assert!(private_bytes(&d) + AREA_LEN as usize <= before + RINGS);
        assert_eq!(d.read(AREA, 4096), vec![FILE_BYTE; 4096]);
    }
}
