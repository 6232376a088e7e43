//! virtio-mmio (version 2) transport and Twig's virtio devices.
//!
//! Devices sit at `MMIO_BASE + i * MMIO_SIZE` with interrupt line
//! `IRQ_BASE + i`; the guest finds them on its command line
//! (`virtio_mmio.device=4K@<base>:<irq>`, which the VMM appends). Interrupts
//! go through KVM irqfds. Transport and queue state is part of every
//! snapshot, so after restore and rollback the queues carry on where they
//! were. Queue processing uses the virtio-queue crate.
//!
//! Devices: entropy ([`rng`]), block ([`blk`]), network ([`net`]), vsock
//! ([`vsock`]) and a balloon that only takes free page reports
//! ([`balloon`]). Devices fed from the host side (net, vsock) expose a
//! descriptor that the VM's device thread polls (see `devices.rs`).

pub mod balloon;
pub mod blk;
pub mod net;
pub mod rng;
#[cfg(test)]
pub(crate) mod testing;
pub mod vsock;

use std::os::fd::RawFd;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FAILED, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_ids::{
    VIRTIO_ID_BALLOON, VIRTIO_ID_BLOCK, VIRTIO_ID_NET, VIRTIO_ID_RNG, VIRTIO_ID_VSOCK,
};
use virtio_bindings::virtio_mmio::{
    VIRTIO_MMIO_CONFIG, VIRTIO_MMIO_CONFIG_GENERATION, VIRTIO_MMIO_DEVICE_FEATURES,
    VIRTIO_MMIO_DEVICE_FEATURES_SEL, VIRTIO_MMIO_DEVICE_ID, VIRTIO_MMIO_DRIVER_FEATURES,
    VIRTIO_MMIO_DRIVER_FEATURES_SEL, VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INTERRUPT_STATUS,
    VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING, VIRTIO_MMIO_MAGIC_VALUE,
    VIRTIO_MMIO_QUEUE_AVAIL_HIGH, VIRTIO_MMIO_QUEUE_AVAIL_LOW, VIRTIO_MMIO_QUEUE_DESC_HIGH,
    VIRTIO_MMIO_QUEUE_DESC_LOW, VIRTIO_MMIO_QUEUE_NOTIFY, VIRTIO_MMIO_QUEUE_NUM,
    VIRTIO_MMIO_QUEUE_NUM_MAX, VIRTIO_MMIO_QUEUE_READY, VIRTIO_MMIO_QUEUE_SEL,
    VIRTIO_MMIO_QUEUE_USED_HIGH, VIRTIO_MMIO_QUEUE_USED_LOW, VIRTIO_MMIO_STATUS,
    VIRTIO_MMIO_VENDOR_ID, VIRTIO_MMIO_VERSION,
};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use crate::error::{Error, Result};
use crate::memory::GuestMem;

/// First device's MMIO base.
pub const MMIO_BASE: u64 = 0xd000_0000;
/// Each device's MMIO window.
pub const MMIO_SIZE: u64 = 0x1000;
/// First device's interrupt line.
pub const IRQ_BASE: u32 = 5;
/// Last interrupt line a device may use: the legacy PIC's last, so that
/// snapshots of guests booted without an MP table (which drive the PIC
/// only; KVM routes GSIs 16-23 to the IOAPIC only) restore with the same
/// lines.
pub const IRQ_LAST: u32 = 15;
/// Most virtio devices a VM can have.
pub const MAX_DEVICES: usize = (IRQ_LAST - IRQ_BASE + 1) as usize;

/// The magic value register's contents, "virt".
const MAGIC: u32 = 0x7472_6976;
/// The vendor id register's contents, "twig".
const VENDOR: u32 = 0x6769_7774;
/// The virtio-mmio version implemented (the modern, non-legacy layout).
const MMIO_VERSION: u32 = 2;

/// A short name for virtio device id `t`, for messages.
pub fn device_name(t: u32) -> String {
    match t {
        VIRTIO_ID_NET => "net".into(),
        VIRTIO_ID_BLOCK => "block".into(),
        VIRTIO_ID_RNG => "rng".into(),
        VIRTIO_ID_VSOCK => "vsock".into(),
        VIRTIO_ID_BALLOON => "balloon".into(),
        _ => format!("device type {t}"),
    }
}

/// A virtio device behind the MMIO transport.
pub trait VirtioDevice: Send {
    /// The virtio device id.
    fn device_type(&self) -> u32;
    /// Feature bits the device offers (VIRTIO_F_VERSION_1 is added).
    fn features(&self) -> u64;
    /// Largest size of each queue.
    fn queue_max_sizes(&self) -> &[u16];
    /// Reads the device configuration space.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Serves the buffers the driver made available on queue `index`
    /// (`queues` holds all of the device's queues, so a device may answer on
    /// another queue); returns whether any buffer was used.
    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMem) -> bool;
    /// One descriptor the VM's device thread polls for readability
    /// (level-triggered), for devices fed from the host side (vsock, net).
    /// The device must keep it unreadable while it cannot make progress (for
    /// instance while the guest has posted no receive buffers) and make it
    /// readable again when it can, or the device thread would spin.
    fn host_fd(&self) -> Option<RawFd> {
        None
    }
    /// Called by the device thread when [`VirtioDevice::host_fd`] is
    /// readable, never while the VM is paused; returns whether any buffer
    /// was used.
    fn process_host(&mut self, _queues: &mut [Queue], _mem: &GuestMem) -> bool {
        false
    }
    /// Called after the device's state was restored from a snapshot or
    /// rolled back, with the driver live: host-side state that a snapshot
    /// cannot hold (connections) is dropped and the guest told so. Returns
    /// whether any buffer was used.
    fn after_restore(&mut self, _queues: &mut [Queue], _mem: &GuestMem) -> bool {
        false
    }
    /// The configuration generation: a device whose configuration space
    /// changes while the driver runs (a disk slot's capacity) changes it,
    /// and the transport raises the configuration-change interrupt.
    fn config_generation(&self) -> u32 {
        0
    }
    /// The driver reset the device.
    fn reset(&mut self) {}
    /// The device's own state, for diagnostics.
    fn describe(&self) -> String {
        String::new()
    }
}

/// The MMIO transport of one device.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    queues: Vec<Queue>,
    queue_sel: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    status: u32,
    interrupt_status: u32,
    irq: EventFd,
    mem: GuestMem,
    host_wake: Option<EventFd>,
    /// The device's configuration generation the driver was last told of.
    announced_generation: u32,
    /// Bumped by every reset and state load, so that a request taken
    /// before is not completed into queues set up anew.
    epoch: u64,
}

/// A request taken off a queue by [`MmioTransport::pop_request`], to be
/// served without the transport's lock and handed back to
/// [`MmioTransport::complete`].
pub struct Popped {
    epoch: u64,
    head: u16,
    /// The request's descriptors, in chain order.
    pub descs: Vec<virtio_queue::desc::split::Descriptor>,
}

fn u32_of(data: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    let n = data.len().min(4);
    b[..n].copy_from_slice(&data[..n]);
    u32::from_le_bytes(b)
}

fn set_half(value: u64, half: u32, v: u32) -> u64 {
    match half {
        0 => (value & !0xffff_ffff) | u64::from(v),
        _ => (value & 0xffff_ffff) | (u64::from(v) << 32),
    }
}

impl MmioTransport {
    /// A transport for `device`, raising `irq` when it uses buffers.
    pub fn new(
        device: Box<dyn VirtioDevice>,
        irq: EventFd,
        mem: GuestMem,
    ) -> Result<MmioTransport> {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max).map_err(|e| Error::Config(format!("virtqueue: {e}"))))
            .collect::<Result<Vec<_>>>()?;
        let announced_generation = device.config_generation();
        Ok(MmioTransport {
            device,
            queues,
            queue_sel: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            status: 0,
            interrupt_status: 0,
            irq,
            mem,
            host_wake: None,
            announced_generation,
            epoch: 0,
        })
    }

    /// The virtio device id of the device behind this transport.
    pub fn device_type(&self) -> u32 {
        self.device.device_type()
    }

    /// Sets the eventfd written when the driver brings the device up, so
    /// that the device thread looks at its host descriptor again.
    pub fn set_host_wake(&mut self, wake: EventFd) {
        self.host_wake = Some(wake);
    }

    fn features(&self) -> u64 {
        self.device.features() | 1 << VIRTIO_F_VERSION_1
    }

    fn queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    fn reset(&mut self) {
        self.queues.iter_mut().for_each(|q| q.reset());
        self.device.reset();
        self.queue_sel = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.status = 0;
        self.interrupt_status = 0;
        self.epoch += 1;
    }

    /// A register read at `offset` in the device's window.
    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        let config = u64::from(VIRTIO_MMIO_CONFIG);
        if offset >= config {
            self.device.read_config(offset - config, data);
            return;
        }
        let Ok(offset) = u32::try_from(offset) else {
            return;
        };
        let v: u32 = match offset {
            VIRTIO_MMIO_MAGIC_VALUE => MAGIC,
            VIRTIO_MMIO_VERSION => MMIO_VERSION,
            VIRTIO_MMIO_DEVICE_ID => self.device.device_type(),
            VIRTIO_MMIO_VENDOR_ID => VENDOR,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => self.features() as u32,
                1 => (self.features() >> 32) as u32,
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => self.queue().map_or(0, |q| u32::from(q.max_size())),
            VIRTIO_MMIO_QUEUE_READY => self.queue().map_or(0, |q| u32::from(q.ready())),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt_status,
            VIRTIO_MMIO_STATUS => self.status,
            VIRTIO_MMIO_CONFIG_GENERATION => self.device.config_generation(),
            _ => 0,
        };
        let bytes = v.to_le_bytes();
        let n = data.len().min(4);
        data[..n].copy_from_slice(&bytes[..n]);
    }

    /// A register write at `offset` in the device's window.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let Ok(offset) = u32::try_from(offset) else {
            return;
        };
        let v = u32_of(data);
        match offset {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = v,
            VIRTIO_MMIO_DRIVER_FEATURES => {
                let offered = self.features();
                let half = self.driver_features_sel;
                if half < 2 {
                    self.driver_features = set_half(self.driver_features, half, v) & offered;
                }
            }
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = v,
            VIRTIO_MMIO_QUEUE_NUM => self.with_queue(|q| q.set_size(v as u16)),
            VIRTIO_MMIO_QUEUE_READY => self.with_queue(|q| q.set_ready(v == 1)),
            VIRTIO_MMIO_QUEUE_NOTIFY => self.notify(v as usize),
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt_status &= !v,
            VIRTIO_MMIO_STATUS => {
                if v == 0 {
                    self.reset();
                } else {
                    let was_live = self.live();
                    self.status = v;
                    if self.live() && !was_live {
                        self.wake_host();
                    }
                }
            }
            VIRTIO_MMIO_QUEUE_DESC_LOW => {
                self.with_queue(|q| q.set_desc_table_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_DESC_HIGH => {
                self.with_queue(|q| q.set_desc_table_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_LOW => {
                self.with_queue(|q| q.set_avail_ring_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH => {
                self.with_queue(|q| q.set_avail_ring_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_USED_LOW => {
                self.with_queue(|q| q.set_used_ring_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_USED_HIGH => {
                self.with_queue(|q| q.set_used_ring_address(None, Some(v)))
            }
            _ => {}
        }
    }

    /// Applies `f` to the selected queue, if there is one.
    fn with_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if let Some(q) = self.queue() {
            f(q);
        }
    }

    fn live(&self) -> bool {
        self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 && self.status & VIRTIO_CONFIG_S_FAILED == 0
    }

    fn notify(&mut self, index: usize) {
        if !self.live() {
            return;
        }
        let Some(q) = self.queues.get(index) else {
            return;
        };
        if !q.ready() || !q.is_valid(&self.mem) {
            return;
        }
        let used = self
            .device
            .process_queue(index, &mut self.queues, &self.mem);
        self.signal(used);
    }

    /// Takes the next request the driver made available on queue `index`,
    /// for a device served off the vCPU thread (`blk`). None if the driver
    /// is not up, the queue is not usable or holds nothing.
    pub fn pop_request(&mut self, index: usize) -> Option<Popped> {
        if !self.live() {
            return None;
        }
        let q = self.queues.get_mut(index)?;
        if !q.ready() || !q.is_valid(&self.mem) {
            return None;
        }
        let chain = q.pop_descriptor_chain(&self.mem)?;
        Some(Popped {
            epoch: self.epoch,
            head: chain.head_index(),
            descs: chain.collect(),
        })
    }

    /// Puts a request taken by [`MmioTransport::pop_request`] in the used
    /// ring with `len` bytes written, and interrupts the driver if it
    /// wants to hear of it. Dropped if the device was reset or its state
    /// loaded since the request was taken.
    pub fn complete(&mut self, index: usize, p: &Popped, len: u32) {
        if p.epoch != self.epoch || !self.live() {
            return;
        }
        let Some(q) = self.queues.get_mut(index) else {
            return;
        };
        if !q.ready() || !q.is_valid(&self.mem) {
            return;
        }
        if let Err(e) = q.add_used(&self.mem, p.head, len) {
            crate::ratelimit::warn_limited!("virtio: completing a request: {e}");
            return;
        }
        self.signal(true);
    }

    /// Raises the used-buffer interrupt if buffers were used and a live queue
    /// wants to hear of it.
    fn signal(&mut self, used: bool) {
        let wanted = self.queues.iter_mut().any(|q| {
            q.ready() && q.is_valid(&self.mem) && q.needs_notification(&self.mem).unwrap_or(true)
        });
        if used && wanted {
            self.interrupt_status |= VIRTIO_MMIO_INT_VRING;
            if let Err(e) = self.irq.write(1) {
                tracing::warn!("virtio interrupt: {e}");
            }
        }
    }

    fn wake_host(&self) {
        if let Some(w) = &self.host_wake {
            if let Err(e) = w.write(1) {
                tracing::warn!("waking the device thread: {e}");
            }
        }
    }

    /// The descriptor the device thread polls for this device, if any.
    pub fn host_fd(&self) -> Option<RawFd> {
        self.device.host_fd()
    }

    /// Lets the device move host-side input into the guest's queues. Returns
    /// false, doing nothing, if the driver has not brought the device up: the
    /// caller should stop polling its descriptor until woken through
    /// [`MmioTransport::set_host_wake`].
    pub fn process_host(&mut self) -> bool {
        if !self.live() {
            return false;
        }
        let used = self.device.process_host(&mut self.queues, &self.mem);
        self.signal(used);
        true
    }

    /// Raises the configuration-change interrupt if the device's
    /// configuration changed since the driver was last told (and the driver
    /// is live: a driver that is not reads the configuration when it probes).
    pub fn announce_config(&mut self) {
        let generation = self.device.config_generation();
        if generation == self.announced_generation {
            return;
        }
        self.announced_generation = generation;
        if self.live() {
            self.interrupt_status |= VIRTIO_MMIO_INT_CONFIG;
            if let Err(e) = self.irq.write(1) {
                tracing::warn!("virtio interrupt: {e}");
            }
        }
    }

    /// Tells the device its state was restored or rolled back (and the
    /// driver of a configuration that changed meanwhile).
    pub fn after_restore(&mut self) {
        self.announce_config();
        if !self.live() {
            return;
        }
        let used = self.device.after_restore(&mut self.queues, &self.mem);
        self.signal(used);
    }

    /// Raises the interrupt again if the driver has not acknowledged it.
    pub fn retrigger_pending(&self) {
        if self.interrupt_status != 0 {
            if let Err(e) = self.irq.write(1) {
                tracing::warn!("virtio interrupt: {e}");
            }
        }
    }

    /// Transport, queue and device state, for diagnostics: the status and
    /// interrupt registers, and for each queue the device's indices next to
    /// the indices the driver published in guest memory.
    pub fn describe(&self) -> String {
        let mut out = format!(
            "{} status {:#x} interrupt {:#x}",
            device_name(self.device.device_type()),
            self.status,
            self.interrupt_status
        );
        for (i, q) in self.queues.iter().enumerate() {
            let s = q.state();
            let idx = |ring: u64| {
                self.mem
                    .read_obj::<u16>(vm_memory::GuestAddress(ring + 2))
                    .map_or_else(|_| "?".to_string(), |v| v.to_string())
            };
            out.push_str(&format!(
                "; q{i} ready {} size {} next avail {} next used {} driver avail {} used {}",
                s.ready,
                s.size,
                s.next_avail,
                s.next_used,
                idx(s.avail_ring),
                idx(s.used_ring)
            ));
        }
        let dev = self.device.describe();
        if !dev.is_empty() {
            out.push_str("; ");
            out.push_str(&dev);
        }
        out
    }

    /// Transport and queue state for a snapshot.
    pub fn save(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for v in [
            self.queue_sel,
            self.device_features_sel,
            self.driver_features_sel,
            self.status,
            self.interrupt_status,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.driver_features.to_le_bytes());
        out.extend_from_slice(&(self.queues.len() as u32).to_le_bytes());
        for q in &self.queues {
            let s = q.state();
            for v in [s.max_size, s.next_avail, s.next_used, s.size] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.push(u8::from(s.event_idx_enabled));
            out.push(u8::from(s.ready));
            for v in [s.desc_table, s.avail_ring, s.used_ring] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    /// Parses state saved by [`MmioTransport::save`] for this transport,
    /// validating every queue, without applying it.
    pub fn parse(&self, b: &[u8]) -> Result<TransportState> {
        let bad = |what: &str| Error::Config(format!("virtio device state: {what}"));
        let mut r = b;
        let mut take = |n: usize| -> Result<&[u8]> {
            if r.len() < n {
                return Err(bad("truncated"));
            }
            let (h, t) = r.split_at(n);
            r = t;
            Ok(h)
        };
        let mut regs = [0u32; 5];
        for v in regs.iter_mut() {
            *v = u32_of(take(4)?);
        }
        let mut f = [0u8; 8];
        f.copy_from_slice(take(8)?);
        let driver_features = u64::from_le_bytes(f);
        let count = u32_of(take(4)?) as usize;
        if count != self.queues.len() {
            return Err(bad("queue count differs"));
        }
        let mut queues = Vec::with_capacity(count);
        for _ in 0..count {
            let h = take(8)?;
            let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
            let flags = take(2)?;
            let mut addrs = [0u64; 3];
            for a in addrs.iter_mut() {
                let mut x = [0u8; 8];
                x.copy_from_slice(take(8)?);
                *a = u64::from_le_bytes(x);
            }
            let state = QueueState {
                max_size: u16_at(0),
                next_avail: u16_at(2),
                next_used: u16_at(4),
                size: u16_at(6),
                event_idx_enabled: flags[0] != 0,
                ready: flags[1] != 0,
                desc_table: addrs[0],
                avail_ring: addrs[1],
                used_ring: addrs[2],
            };
            queues.push(Queue::try_from(state).map_err(|e| bad(&e.to_string()))?);
        }
        if !r.is_empty() {
            return Err(bad("trailing bytes"));
        }
        Ok(TransportState {
            regs,
            driver_features,
            queues,
        })
    }

    /// Applies parsed state; cannot fail.
    pub fn apply(&mut self, s: TransportState) {
        [
            self.queue_sel,
            self.device_features_sel,
            self.driver_features_sel,
            self.status,
            self.interrupt_status,
        ] = s.regs;
        self.driver_features = s.driver_features;
        self.queues = s.queues;
        self.epoch += 1;
    }
}

/// A transport's state, parsed and validated.
pub struct TransportState {
    regs: [u32; 5],
    driver_features: u64,
    queues: Vec<Queue>,
}

#[cfg(test)]
mod tests {
    use super::testing::Driver;
    use super::*;

    #[test]
    fn a_driver_reads_entropy_through_the_transport_and_state_round_trips() {
        let mut d = Driver::new(Box::new(rng::Rng));
        assert_eq!(d.reg(VIRTIO_MMIO_MAGIC_VALUE), MAGIC);
        assert_eq!(d.reg(VIRTIO_MMIO_VERSION), 2);
        assert_eq!(d.reg(VIRTIO_MMIO_DEVICE_ID), VIRTIO_ID_RNG);
        assert_eq!(d.reg(VIRTIO_MMIO_VENDOR_ID), VENDOR);
        d.set(VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        assert_eq!(
            d.reg(VIRTIO_MMIO_DEVICE_FEATURES),
            1 << (VIRTIO_F_VERSION_1 - 32),
            "VIRTIO_F_VERSION_1 offered"
        );
        d.set(VIRTIO_MMIO_QUEUE_SEL, 0);
        assert_eq!(d.reg(VIRTIO_MMIO_QUEUE_NUM_MAX), 256);
        assert_eq!(d.reg(VIRTIO_MMIO_QUEUE_READY), 1);
        assert_ne!(d.reg(VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_DRIVER_OK, 0);
        d.ram.take_vmm_dirty();

        // One device-writable 32-byte buffer.
        let buf = d.alloc(32);
        let head = d.post(0, &[(buf, 32, true)]);
        d.notify(0);
        assert_eq!(d.used(0), Some((u32::from(head), 32)));
        assert!(
            d.read(buf, 32).iter().any(|b| *b != 0),
            "random bytes written"
        );
        assert_eq!(d.irq.read().unwrap(), 1, "interrupt raised");
        assert_eq!(d.reg(VIRTIO_MMIO_INTERRUPT_STATUS), VIRTIO_MMIO_INT_VRING);
        d.set(VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INT_VRING);
        assert_eq!(d.reg(VIRTIO_MMIO_INTERRUPT_STATUS), 0);

        // What the device wrote counts as dirty for snapshots and rollback.
        let dirty = crate::memory::PageSet::from_words(d.ram.take_vmm_dirty(), d.ram.pages());
        let used_page = d.queue(0).used_ring() / 4096;
        assert!(
            dirty.contains((buf / 4096) as usize) && dirty.contains(used_page as usize),
            "{:?}",
            dirty.runs()
        );

        // The state carries over to another transport, and bad state is refused.
        let saved = d.t.save();
        let irq = d.irq.try_clone().unwrap();
        let mut u = MmioTransport::new(Box::new(rng::Rng), irq, d.mem.clone()).unwrap();
        let parsed = u.parse(&saved).unwrap();
        u.apply(parsed);
        assert_eq!(u.save(), saved);
        assert!(u.parse(&saved[..saved.len() - 1]).is_err());
        let mut extra = saved.clone();
        extra.push(0);
        assert!(u.parse(&extra).is_err());
    }
}
