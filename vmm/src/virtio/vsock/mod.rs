//! virtio-vsock with a Unix-socket host side, in the style of
//! Firecracker's: a host client connects to the device's socket and writes
//! `CONNECT <port>\n`; the device opens a connection to that guest port and
//! answers `OK <host port>\n` once the guest accepted it. A guest connecting
//! to host port `P` reaches the Unix socket `<path>_<P>`.
//!
//! The parts:
//! - this file: the device — its three queues (receive, transmit, event),
//!   its configuration space (the guest's CID) and the transport hooks;
//! - [`packet`]: the packet header as a `zerocopy` struct, and the reading
//!   of guest transmit chains;
//! - [`connection`]: one connection's state machine and credit accounting;
//! - [`muxer`]: the host side — the listener, the handshake, the map of
//!   connections and the epoll instance the VM's device thread polls;
//! - [`uds`]: non-blocking Unix-socket helpers and [`host_connect`], the
//!   client side of the handshake.
//!
//! Connections are not part of snapshots: after a restore or rollback every
//! host connection is dropped and the guest is sent a transport-reset event.

mod connection;
mod muxer;
mod packet;
mod uds;

use std::os::fd::RawFd;
use std::path::Path;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
use virtio_queue::{Queue, QueueOwnedT, QueueT, Writer};

use super::VirtioDevice;
use crate::error::{Error, Result};
use crate::memory::GuestMem;
use crate::ratelimit::warn_limited;
use muxer::Muxer;
use packet::{Packet, EVENT_TRANSPORT_RESET, HDR_LEN};

pub use uds::host_connect;

const QUEUE_SIZES: [u16; 3] = [256; 3];
const RX: usize = 0;
const TX: usize = 1;
const EVENT: usize = 2;

/// Time a host client has to send its handshake, and the guest to answer a
/// connection request; also how long a closing connection may linger.
const TIMEOUT: Duration = Duration::from_secs(2);

/// The vsock device.
pub struct Vsock {
    cid: u64,
    muxer: Muxer,
    /// A transport-reset event waits for an event buffer.
    event_pending: bool,
}

impl Vsock {
    /// A vsock device for a guest with context id `guest_cid`, listening for
    /// host clients on the Unix socket `uds_path` (a stale socket there is
    /// replaced; any other file is an error).
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Vsock> {
        Vsock::open(guest_cid, uds_path, TIMEOUT)
    }

    fn open(guest_cid: u64, uds_path: &Path, timeout: Duration) -> Result<Vsock> {
        if !(3..u64::from(u32::MAX)).contains(&guest_cid) {
            return Err(Error::Config(format!(
                "vsock guest CID {guest_cid} is invalid: it must be between 3 and {}",
                u32::MAX - 1
            )));
        }
        Ok(Vsock {
            cid: guest_cid,
            muxer: Muxer::new(guest_cid, uds_path, timeout)?,
            event_pending: false,
        })
    }

    fn process_tx(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let Some(q) = queues.get_mut(TX) else {
            return false;
        };
        if !q.ready() || !q.is_valid(mem) {
            return false;
        }
        let mut used = false;
        while let Some(chain) = q.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            match Packet::read(chain, mem) {
                Ok(p) => self.muxer.guest_packet(&p),
                Err(why) => tracing::debug!("vsock: dropping malformed packet: {why}"),
            }
            if let Err(e) = q.add_used(mem, head, 0) {
                warn_limited!("vsock: tx queue: {e}");
                break;
            }
            used = true;
        }
        used
    }

    /// Writes the next packet for the guest into `w`; returns the length
    /// written, or `None` when there is nothing to send.
    fn fill<B: vm_memory::bitmap::BitmapSlice>(&mut self, w: &mut Writer<'_, B>) -> Option<u32> {
        let room = w.available_bytes();
        if room < HDR_LEN {
            tracing::debug!("vsock: receive buffer of {room} bytes is too small");
            return Some(0);
        }
        let packet = self.muxer.next_packet(room - HDR_LEN)?;
        if let Err(e) = packet.write_to(w) {
            warn_limited!("vsock: writing a packet to the guest: {e}");
        }
        Some(w.bytes_written() as u32)
    }

    fn deliver_rx(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let Some(q) = queues.get_mut(RX) else {
            return false;
        };
        if !q.ready() || !q.is_valid(mem) {
            return false;
        }
        let mut used = false;
        while self.muxer.has_packets() {
            let Some(chain) = q.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let len = match chain.writer(mem) {
                Ok(mut w) => self.fill(&mut w),
                Err(e) => {
                    tracing::debug!("vsock: bad receive buffer: {e}");
                    Some(0)
                }
            };
            let Some(len) = len else {
                q.go_to_previous_position();
                break;
            };
            if let Err(e) = q.add_used(mem, head, len) {
                warn_limited!("vsock: rx queue: {e}");
                break;
            }
            used = true;
        }
        used
    }

    fn deliver_event(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let Some(q) = queues.get_mut(EVENT) else {
            return false;
        };
        if !self.event_pending || !q.ready() || !q.is_valid(mem) {
            return false;
        }
        let mut used = false;
        while self.event_pending {
            let Some(chain) = q.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let len = match chain.writer(mem) {
                Ok(mut w) if w.available_bytes() >= 4 => {
                    match std::io::Write::write_all(&mut w, &EVENT_TRANSPORT_RESET.to_le_bytes()) {
                        Ok(()) => {
                            self.event_pending = false;
                            4
                        }
                        Err(e) => {
                            tracing::debug!("vsock: writing an event: {e}");
                            0
                        }
                    }
                }
                Ok(_) => 0,
                Err(e) => {
                    tracing::debug!("vsock: bad event buffer: {e}");
                    0
                }
            };
            if let Err(e) = q.add_used(mem, head, len) {
                warn_limited!("vsock: event queue: {e}");
                break;
            }
            used = true;
        }
        used
    }

    /// Work common to every entry point: deadlines, packets for the guest,
    /// epoll registrations and the timer.
    fn pump(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        self.muxer.expire(Instant::now());
        let used = self.deliver_rx(queues, mem);
        self.muxer.sync();
        self.muxer.rearm_timer(Instant::now());
        used
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn describe(&self) -> String {
        format!(
            "vsock: event pending {}, {}",
            self.event_pending,
            self.muxer.describe()
        )
    }

    fn features(&self) -> u64 {
        0
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let cid = self.cid.to_le_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| cid.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let used = match index {
            TX => self.process_tx(queues, mem),
            EVENT => self.deliver_event(queues, mem),
            _ => false,
        };
        self.pump(queues, mem) || used
    }

    fn host_fd(&self) -> Option<RawFd> {
        Some(self.muxer.epoll_fd())
    }

    fn process_host(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        self.muxer.process_events();
        self.pump(queues, mem)
    }

    fn after_restore(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        self.muxer.drop_all();
        self.event_pending = true;
        let used = self.deliver_event(queues, mem);
        self.pump(queues, mem) || used
    }

    fn reset(&mut self) {
        self.muxer.drop_all();
        self.event_pending = false;
        self.muxer.rearm_timer(Instant::now());
    }
}

#[cfg(test)]
mod tests;
