//! A fake virtio driver for the device tests: split virtqueues laid out in
//! guest memory the way a guest driver lays them out (descriptor table,
//! available ring, used ring), with which a test posts descriptor chains and
//! reads back used entries and what the device wrote.
//!
//! [`FakeQueue`] is the driver's side of one queue; a test can hand its
//! [`FakeQueue::queue`] straight to a device. [`Driver`] brings a device up
//! through the MMIO transport's registers, as Linux does, and owns one
//! `FakeQueue` per device queue.

use std::collections::HashMap;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FEATURES_OK,
};
use virtio_bindings::virtio_mmio::{
    VIRTIO_MMIO_CONFIG, VIRTIO_MMIO_DEVICE_FEATURES, VIRTIO_MMIO_DEVICE_FEATURES_SEL,
    VIRTIO_MMIO_DRIVER_FEATURES, VIRTIO_MMIO_DRIVER_FEATURES_SEL, VIRTIO_MMIO_QUEUE_AVAIL_LOW,
    VIRTIO_MMIO_QUEUE_DESC_LOW, VIRTIO_MMIO_QUEUE_NOTIFY, VIRTIO_MMIO_QUEUE_NUM,
    VIRTIO_MMIO_QUEUE_READY, VIRTIO_MMIO_QUEUE_SEL, VIRTIO_MMIO_QUEUE_USED_LOW, VIRTIO_MMIO_STATUS,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{MmioTransport, VirtioDevice};
use crate::memory::{GuestMem, GuestRam};

/// A buffer of a descriptor chain: guest address, length, and whether the
/// device writes it.
pub type Buf = (u64, u32, bool);

/// Bytes before a queue's data slots: descriptor table, available ring and
/// used ring, a page each (enough for 256 entries).
const RINGS: u64 = 0x3000;

/// The driver's side of one split virtqueue in guest memory.
pub struct FakeQueue {
    size: u16,
    desc: u64,
    /// Descriptor `i` owns the slot at `slots + i * slot_len`.
    slots: u64,
    slot_len: u64,
    free: Vec<u16>,
    /// Posted chains by head: their descriptor indices and buffers.
    chains: HashMap<u16, (Vec<u16>, Vec<Buf>)>,
    avail_idx: u16,
    used_idx: u16,
}

impl FakeQueue {
    /// Guest memory a queue of `size` entries with `slot_len`-byte data
    /// slots takes.
    pub fn footprint(size: u16, slot_len: u64) -> u64 {
        RINGS + u64::from(size) * slot_len
    }

    /// A queue of `size` entries at `base`: its rings, then one data slot of
    /// `slot_len` bytes per descriptor (for [`FakeQueue::post_bytes`]).
    pub fn new(base: u64, size: u16, slot_len: u64) -> FakeQueue {
        FakeQueue {
            size,
            desc: base,
            slots: base + RINGS,
            slot_len,
            free: (0..size).rev().collect(),
            chains: HashMap::new(),
            avail_idx: 0,
            used_idx: 0,
        }
    }

    /// The available ring's guest address.
    pub fn avail_ring(&self) -> u64 {
        self.desc + 0x1000
    }

    /// The used ring's guest address.
    pub fn used_ring(&self) -> u64 {
        self.desc + 0x2000
    }

    /// The device's side of this queue, set up and ready, for tests that
    /// drive a device without the transport.
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).expect("a valid queue size");
        q.set_size(self.size);
        q.try_set_desc_table_address(GuestAddress(self.desc))
            .expect("an aligned descriptor table");
        q.try_set_avail_ring_address(GuestAddress(self.avail_ring()))
            .expect("an aligned available ring");
        q.try_set_used_ring_address(GuestAddress(self.used_ring()))
            .expect("an aligned used ring");
        q.set_ready(true);
        q
    }

    /// Chains posted and not used yet.
    pub fn in_flight(&self) -> u16 {
        self.avail_idx.wrapping_sub(self.used_idx)
    }

    /// Makes the chain `bufs` available (without notifying); returns its
    /// head.
    pub fn post(&mut self, mem: &GuestMem, bufs: &[Buf]) -> u16 {
        let idx: Vec<u16> = bufs
            .iter()
            .map(|_| self.free.pop().expect("a free descriptor"))
            .collect();
        self.publish(mem, &idx, bufs.to_vec())
    }

    /// Makes a chain of (length, device-writable, contents) available, each
    /// descriptor in its own data slot; returns its head.
    pub fn post_bytes(&mut self, mem: &GuestMem, descs: &[(u32, bool, &[u8])]) -> u16 {
        let idx: Vec<u16> = descs
            .iter()
            .map(|_| self.free.pop().expect("a free descriptor"))
            .collect();
        let mut bufs = Vec::with_capacity(descs.len());
        for (&i, &(len, write, data)) in idx.iter().zip(descs) {
            assert!(u64::from(len) <= self.slot_len, "{len} bytes exceed a slot");
            let addr = self.slots + u64::from(i) * self.slot_len;
            mem.write_slice(data, GuestAddress(addr))
                .expect("slot in guest memory");
            bufs.push((addr, len, write));
        }
        self.publish(mem, &idx, bufs)
    }

    fn publish(&mut self, mem: &GuestMem, idx: &[u16], bufs: Vec<Buf>) -> u16 {
        for (k, (&i, &(addr, len, write))) in idx.iter().zip(&bufs).enumerate() {
            let mut flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
            let next = idx.get(k + 1).copied().unwrap_or(0);
            if k + 1 < idx.len() {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            // struct virtq_desc: addr, len, flags, next.
            let d = GuestAddress(self.desc + u64::from(i) * 16);
            let at = |off: u64| d.unchecked_add(off);
            mem.write_obj(addr, d).expect("ring in memory");
            mem.write_obj(len, at(8)).expect("ring in memory");
            mem.write_obj(flags, at(12)).expect("ring in memory");
            mem.write_obj(next, at(14)).expect("ring in memory");
        }
        let head = idx[0];
        let slot = self.avail_ring() + 4 + 2 * u64::from(self.avail_idx % self.size);
        mem.write_obj(head, GuestAddress(slot))
            .expect("ring in memory");
        self.avail_idx = self.avail_idx.wrapping_add(1);
        mem.write_obj(self.avail_idx, GuestAddress(self.avail_ring() + 2))
            .expect("ring in memory");
        self.chains.insert(head, (idx.to_vec(), bufs));
        head
    }

    fn pop_used(&mut self, mem: &GuestMem) -> Option<(u32, u32, Vec<Buf>)> {
        let idx: u16 = mem
            .read_obj(GuestAddress(self.used_ring() + 2))
            .expect("ring in memory");
        if idx == self.used_idx {
            return None;
        }
        let e = self.used_ring() + 4 + 8 * u64::from(self.used_idx % self.size);
        let head: u32 = mem.read_obj(GuestAddress(e)).expect("ring in memory");
        let len: u32 = mem.read_obj(GuestAddress(e + 4)).expect("ring in memory");
        self.used_idx = self.used_idx.wrapping_add(1);
        let id = u16::try_from(head).expect("a descriptor index");
        let (idx, chain) = self
            .chains
            .remove(&id)
            .expect("the device used a posted chain");
        self.free.extend(idx);
        Some((head, len, chain))
    }

    /// The next used element: (head, length).
    pub fn used(&mut self, mem: &GuestMem) -> Option<(u32, u32)> {
        self.pop_used(mem).map(|(head, len, _)| (head, len))
    }

    /// Every chain used since the last call: its length and the bytes the
    /// device wrote, gathered across the chain's writable buffers.
    pub fn take_used(&mut self, mem: &GuestMem) -> Vec<(u32, Vec<u8>)> {
        let mut out = Vec::new();
        while let Some((_, len, chain)) = self.pop_used(mem) {
            let mut data = Vec::new();
            let mut left = len as usize;
            for (addr, dlen, _) in chain.into_iter().filter(|b| b.2) {
                let n = left.min(dlen as usize);
                let mut b = vec![0u8; n];
                mem.read_slice(&mut b, GuestAddress(addr))
                    .expect("used buffer in guest memory");
                data.extend_from_slice(&b);
                left -= n;
            }
            out.push((len, data));
        }
        out
    }
}

const DRIVER_RAM: usize = 16 << 20;
const DRIVER_QUEUE_SIZE: u16 = 16;
const DRIVER_SLOT: u64 = 0x1000;
const DRIVER_QUEUES: u64 = 0x1_0000;
/// Where [`Driver::alloc`] hands out buffers.
const DRIVER_DATA: u64 = 0x10_0000;

/// A driver that brought up every queue of its device through the MMIO
/// transport.
pub struct Driver {
    /// The transport, for register access.
    pub t: MmioTransport,
    /// Guest memory.
    pub mem: GuestMem,
    /// The device's interrupt.
    pub irq: EventFd,
    /// The memory behind `mem` (its dirty log included).
    pub ram: GuestRam,
    queues: Vec<FakeQueue>,
    next_data: u64,
}

impl Driver {
    /// Negotiates every offered feature and sets up all queues.
    pub fn new(device: Box<dyn VirtioDevice>) -> Driver {
        let ram = GuestRam::reserve(DRIVER_RAM).expect("guest memory");
        let mem = ram.memory().clone();
        let irq = EventFd::new(EFD_NONBLOCK).expect("an eventfd");
        let t = MmioTransport::new(device, irq.try_clone().expect("an eventfd"), mem.clone())
            .expect("a transport");
        let mut d = Driver {
            t,
            mem,
            irq,
            ram,
            queues: Vec::new(),
            next_data: DRIVER_DATA,
        };
        let mut status = VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER;
        d.set(VIRTIO_MMIO_STATUS, status);
        for half in 0..2 {
            d.set(VIRTIO_MMIO_DEVICE_FEATURES_SEL, half);
            let f = d.reg(VIRTIO_MMIO_DEVICE_FEATURES);
            d.set(VIRTIO_MMIO_DRIVER_FEATURES_SEL, half);
            d.set(VIRTIO_MMIO_DRIVER_FEATURES, f);
        }
        status |= VIRTIO_CONFIG_S_FEATURES_OK;
        d.set(VIRTIO_MMIO_STATUS, status);
        let stride = FakeQueue::footprint(DRIVER_QUEUE_SIZE, DRIVER_SLOT);
        for q in 0..d.t.queues.len() as u32 {
            let fq = FakeQueue::new(
                DRIVER_QUEUES + u64::from(q) * stride,
                DRIVER_QUEUE_SIZE,
                DRIVER_SLOT,
            );
            assert!(fq.slots + stride <= DRIVER_DATA, "queues overlap the data");
            d.set(VIRTIO_MMIO_QUEUE_SEL, q);
            d.set(VIRTIO_MMIO_QUEUE_NUM, u32::from(DRIVER_QUEUE_SIZE));
            d.set(VIRTIO_MMIO_QUEUE_DESC_LOW, fq.desc as u32);
            d.set(VIRTIO_MMIO_QUEUE_AVAIL_LOW, fq.avail_ring() as u32);
            d.set(VIRTIO_MMIO_QUEUE_USED_LOW, fq.used_ring() as u32);
            d.set(VIRTIO_MMIO_QUEUE_READY, 1);
            d.queues.push(fq);
        }
        d.set(VIRTIO_MMIO_STATUS, status | VIRTIO_CONFIG_S_DRIVER_OK);
        d
    }

    /// Writes transport register `off`.
    pub fn set(&mut self, off: u32, v: u32) {
        self.t.write(u64::from(off), &v.to_le_bytes());
    }

    /// Reads transport register `off`.
    pub fn reg(&mut self, off: u32) -> u32 {
        let mut b = [0u8; 4];
        self.t.read(u64::from(off), &mut b);
        u32::from_le_bytes(b)
    }

    /// The device's feature bits, both halves.
    pub fn device_features(&mut self) -> u64 {
        let mut f = 0;
        for half in 0..2 {
            self.set(VIRTIO_MMIO_DEVICE_FEATURES_SEL, half);
            f |= u64::from(self.reg(VIRTIO_MMIO_DEVICE_FEATURES)) << (32 * half);
        }
        f
    }

    /// The first `len` bytes of the device's configuration space.
    pub fn config(&mut self, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.t.read(u64::from(VIRTIO_MMIO_CONFIG), &mut b);
        b
    }

    /// The driver's side of queue `q`.
    pub fn queue(&self, q: usize) -> &FakeQueue {
        &self.queues[q]
    }

    /// A fresh buffer of `len` bytes in guest memory.
    pub fn alloc(&mut self, len: u32) -> u64 {
        let a = self.next_data;
        self.next_data += u64::from(len).div_ceil(64) * 64;
        assert!(self.next_data <= DRIVER_RAM as u64, "out of test memory");
        a
    }

    /// Writes guest memory.
    pub fn write(&self, addr: u64, data: &[u8]) {
        self.mem
            .write_slice(data, GuestAddress(addr))
            .expect("in guest memory");
    }

    /// Reads guest memory.
    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.mem
            .read_slice(&mut b, GuestAddress(addr))
            .expect("in guest memory");
        b
    }

    /// Makes the chain `bufs` available on queue `q` (without notifying);
    /// returns its head.
    pub fn post(&mut self, q: usize, bufs: &[Buf]) -> u16 {
        self.queues[q].post(&self.mem, bufs)
    }

    /// Notifies queue `q`.
    pub fn notify(&mut self, q: usize) {
        self.set(VIRTIO_MMIO_QUEUE_NOTIFY, q as u32);
    }

    /// The next used element of queue `q`: (head, length).
    pub fn used(&mut self, q: usize) -> Option<(u32, u32)> {
        self.queues[q].used(&self.mem)
    }
}
