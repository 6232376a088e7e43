//! virtio-net on a host tap device.
//!
//! The tap is opened with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR` and a 12-byte
//! vnet header, non-blocking. The device offers only `VIRTIO_NET_F_MAC` (no
//! offloads), so the 12-byte `virtio_net_hdr` passes through between guest
//! and tap with no flags set. Transmit runs on the vCPU thread that notified
//! the queue; receive runs on the VM's device thread, which polls
//! [`Net::host_fd`]: an inner epoll that holds the tap only while the guest
//! has posted receive buffers, so the thread never spins on frames it has
//! nowhere to put.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::Ordering;

use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::Bytes;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::VirtioDevice;
use crate::error::{Error, Result};
use crate::memory::GuestMem;

const RX: usize = 0;
const TX: usize = 1;
const QUEUE_SIZE: u16 = 256;
/// The virtio-net header with VIRTIO_F_VERSION_1 (`num_buffers` included).
pub const HDR_LEN: usize = 12;
/// Largest header plus frame moved at once.
const MAX_PACKET: usize = HDR_LEN + 65_550;
/// Frames moved from the tap per call, so the device thread lets go of the
/// transport (and the vCPU's queue notifications get it) between batches
/// under a steady stream; the tap stays readable and the device thread's
/// level-triggered epoll calls again.
const RX_BATCH: usize = 32;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// The network device.
pub struct Net {
    tap: File,
    name: String,
    config: [u8; 6],
    epoll: Epoll,
    armed: bool,
    rx: Vec<u8>,
    tx: Vec<u8>,
}

impl Net {
    /// Attaches to the tap device `tap` (created if missing, as the kernel
    /// does for TUNSETIFF) and gives the guest the address `mac`.
    pub fn new(tap: &str, mac: [u8; 6]) -> Result<Net> {
        let fail = |what: &str, e: std::io::Error| Error::io(format!("tap {tap}: {what}"), e);
        if tap.is_empty() || tap.len() >= libc::IFNAMSIZ || tap.contains('\0') {
            return Err(Error::Config(format!(
                "tap name {tap:?} must be 1 to {} bytes",
                libc::IFNAMSIZ - 1
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|e| fail("cannot open /dev/net/tun", e))?;
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short,
            _pad: [0; 22],
        };
        req.name[..tap.len()].copy_from_slice(tap.as_bytes());
        // SAFETY: TUNSETIFF reads and writes an ifreq, which IfReq lays out.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
            return Err(fail("TUNSETIFF failed", std::io::Error::last_os_error()));
        }
        let hdr = HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr) } < 0 {
            return Err(fail(
                "TUNSETVNETHDRSZ failed",
                std::io::Error::last_os_error(),
            ));
        }
        let epoll = Epoll::new().map_err(|e| fail("creating an epoll", e))?;
        Ok(Net {
            tap: file,
            name: tap.to_string(),
            config: mac,
            epoll,
            armed: false,
            rx: vec![0; MAX_PACKET],
            tx: Vec::with_capacity(MAX_PACKET),
        })
    }

    fn set_armed(&mut self, on: bool) {
        if self.armed == on {
            return;
        }
        let (op, events) = if on {
            (ControlOperation::Add, EventSet::IN)
        } else {
            (ControlOperation::Delete, EventSet::empty())
        };
        let fd = self.tap.as_raw_fd();
        match self.epoll.ctl(op, fd, EpollEvent::new(events, fd as u64)) {
            Ok(()) => self.armed = on,
            Err(e) => tracing::warn!(tap = %self.name, "virtio-net: epoll: {e}"),
        }
    }

    fn transmit(&mut self, queue: &mut Queue, mem: &GuestMem) -> bool {
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            self.tx.clear();
            let mut ok = true;
            for d in chain {
                if d.is_write_only() {
                    continue;
                }
                let n = d.len() as usize;
                let start = self.tx.len();
                if start + n > MAX_PACKET {
                    ok = false;
                    break;
                }
                self.tx.resize(start + n, 0);
                if mem.read_slice(&mut self.tx[start..], d.addr()).is_err() {
                    ok = false;
                    break;
                }
            }
            if ok && self.tx.len() > HDR_LEN {
                if let Err(e) = self.tap.write(&self.tx) {
                    tracing::debug!(tap = %self.name, "virtio-net: frame dropped: {e}");
                }
            } else {
                tracing::debug!(tap = %self.name, "virtio-net: malformed transmit buffer dropped");
            }
            if let Err(e) = queue.add_used(mem, head, 0) {
                tracing::warn!("virtio-net: {e}");
                break;
            }
            used = true;
        }
        used
    }

    fn receive(&mut self, queue: &mut Queue, mem: &GuestMem) -> bool {
        let mut used = false;
        for _ in 0..RX_BATCH {
            let posted = queue
                .avail_idx(mem, Ordering::Acquire)
                .is_ok_and(|i| i.0 != queue.next_avail());
            if !posted {
                self.set_armed(false);
                break;
            }
            let n = match self.tap.read(&mut self.rx) {
                Ok(n) if n > HDR_LEN => n,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!(tap = %self.name, "virtio-net: reading the tap: {e}");
                    break;
                }
            };
            // num_buffers: always one buffer without VIRTIO_NET_F_MRG_RXBUF.
            self.rx[10..12].copy_from_slice(&1u16.to_le_bytes());
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                self.set_armed(false);
                break;
            };
            let head = chain.head_index();
            let mut done = 0;
            for d in chain {
                if done == n {
                    break;
                }
                if !d.is_write_only() {
                    continue;
                }
                let k = (d.len() as usize).min(n - done);
                if mem.write_slice(&self.rx[done..done + k], d.addr()).is_err() {
                    break;
                }
                done += k;
            }
            if done < n {
                // Too small or bad buffer: drop the frame, keep the buffer.
                tracing::debug!(tap = %self.name, "virtio-net: {n}-byte frame dropped, receive buffer too small");
                queue.go_to_previous_position();
                break;
            }
            if let Err(e) = queue.add_used(mem, head, n as u32) {
                tracing::warn!("virtio-net: {e}");
                break;
            }
            used = true;
        }
        used
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn features(&self) -> u64 {
        1 << VIRTIO_NET_F_MAC
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| self.config.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMem) -> bool {
        match index {
            RX => {
                // Buffers posted: let the device thread fill them.
                self.set_armed(true);
                false
            }
            TX => queues.get_mut(TX).is_some_and(|q| self.transmit(q, mem)),
            _ => false,
        }
    }

    fn host_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn process_host(&mut self, queues: &mut [Queue], mem: &GuestMem) -> bool {
        match queues.get_mut(RX) {
            Some(q) if q.ready() => self.receive(q, mem),
            _ => {
                self.set_armed(false);
                false
            }
        }
    }

    fn after_restore(&mut self, _queues: &mut [Queue], _mem: &GuestMem) -> bool {
        // The restored receive queue may hold buffers: look.
        self.set_armed(true);
        false
    }

    fn reset(&mut self) {
        self.set_armed(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::Driver;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::sync::atomic::AtomicUsize;
    use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;

    const MAC: [u8; 6] = [0x02, 0x74, 0x77, 0x69, 0x67, 0x01];
    const ETHERTYPE: [u8; 2] = [0x88, 0xb5];

    fn tap_name() -> String {
        static N: AtomicUsize = AtomicUsize::new(0);
        format!(
            "twt{}x{}",
            std::process::id() % 100_000,
            N.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn up(tap: &str) {
        // No IPv6 chatter from the host on the test tap.
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{tap}/disable_ipv6"), "1");
        let ok = std::process::Command::new("ip")
            .args(["link", "set", tap, "up"])
            .status()
            .unwrap();
        assert!(ok.success(), "ip link set {tap} up");
    }

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0xff; 6];
        f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x99]);
        f.extend_from_slice(&ETHERTYPE);
        f.extend_from_slice(payload);
        f.resize(60, 0);
        f
    }

    /// A raw packet socket on the tap: what it sends the tap's reader gets,
    /// and it sees what is written into the tap.
    struct Packet(OwnedFd);

    impl Packet {
        fn on(tap: &str) -> Packet {
            let name = std::ffi::CString::new(tap).unwrap();
            // SAFETY: a valid NUL-terminated name.
            let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
            assert_ne!(ifindex, 0, "no interface {tap}");
            let proto = (libc::ETH_P_ALL as u16).to_be();
            // SAFETY: plain socket creation.
            let fd = unsafe {
                libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                    i32::from(proto),
                )
            };
            assert!(fd >= 0, "{}", std::io::Error::last_os_error());
            // SAFETY: fd is a new socket we own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: sockaddr_ll is plain data.
            let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            addr.sll_family = libc::AF_PACKET as u16;
            addr.sll_protocol = proto;
            addr.sll_ifindex = ifindex as i32;
            // SAFETY: addr is a sockaddr_ll of the size given.
            let r = unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    std::ptr::addr_of!(addr).cast(),
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
            Packet(fd)
        }

        fn send(&self, f: &[u8]) {
            // SAFETY: sends from a valid buffer.
            let n = unsafe { libc::send(self.0.as_raw_fd(), f.as_ptr().cast(), f.len(), 0) };
            assert_eq!(n, f.len() as isize, "{}", std::io::Error::last_os_error());
        }

        /// Waits up to 10 s for a frame with `payload`.
        fn expect(&self, payload: &[u8]) {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let mut buf = [0u8; 2048];
            while std::time::Instant::now() < deadline {
                if !readable(self.0.as_raw_fd(), 100) {
                    continue;
                }
                // SAFETY: receives into a valid buffer.
                let n = unsafe {
                    libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
                };
                if n > 14 && buf[12..14] == ETHERTYPE && buf[14..n as usize].starts_with(payload) {
                    return;
                }
            }
            panic!("no frame {payload:?} on the tap");
        }
    }

    fn readable(fd: RawFd, timeout_ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, timeout_ms) == 1 }
    }

    #[test]
    fn offers_its_mac_and_refuses_bad_taps() {
        let tap = tap_name();
        let mut d = Driver::new(Box::new(Net::new(&tap, MAC).unwrap()));
        assert_eq!(d.config(6), MAC);
        assert_eq!(
            d.device_features(),
            1 << VIRTIO_NET_F_MAC | 1 << VIRTIO_F_VERSION_1,
            "MAC only"
        );
        let e = Net::new("a-name-far-too-long", MAC)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("a-name-far-too-long"), "{e}");
        let e = Net::new("lo", MAC).err().unwrap().to_string();
        assert!(e.contains("tap lo") && e.contains("TUNSETIFF"), "{e}");
    }

    #[test]
    fn frames_go_out_through_the_tap() {
        let tap = tap_name();
        let mut d = Driver::new(Box::new(Net::new(&tap, MAC).unwrap()));
        up(&tap);
        let pkt = Packet::on(&tap);
        let f = frame(b"twig-tx");
        let buf = d.alloc((HDR_LEN + f.len()) as u32);
        d.write(buf, &[0; HDR_LEN]);
        d.write(buf + HDR_LEN as u64, &f);
        let head = d.post(TX, &[(buf, (HDR_LEN + f.len()) as u32, false)]);
        d.notify(TX);
        assert_eq!(d.used(TX), Some((u32::from(head), 0)));
        pkt.expect(b"twig-tx");
        // A header-only buffer is dropped, and the queue carries on.
        d.post(TX, &[(buf, HDR_LEN as u32, false)]);
        d.notify(TX);
        assert!(d.used(TX).is_some());
    }

    #[test]
    fn frames_come_in_only_while_the_guest_has_buffers() {
        let tap = tap_name();
        let mut d = Driver::new(Box::new(Net::new(&tap, MAC).unwrap()));
        up(&tap);
        let pkt = Packet::on(&tap);
        let host = d.t.host_fd().unwrap();
        pkt.send(&frame(b"twig-rx-1"));
        assert!(
            !readable(host, 300),
            "no receive buffers: the device thread has nothing to do"
        );
        let mut seen = false;
        for _ in 0..8 {
            let buf = d.alloc(2048);
            let head = d.post(RX, &[(buf, 2048, true)]);
            d.notify(RX);
            assert!(readable(host, 10_000), "buffers posted: frames move");
            assert!(d.t.process_host());
            let (id, len) = d.used(RX).expect("a frame received");
            assert_eq!(id, u32::from(head));
            let got = d.read(buf, len as usize);
            assert_eq!(&got[..10], &[0; 10], "no offloads");
            assert_eq!(&got[10..12], &[1, 0], "num_buffers");
            if got[HDR_LEN..] == frame(b"twig-rx-1")[..] {
                seen = true;
                break;
            }
        }
        assert!(seen, "the injected frame reached the guest");
        assert_eq!(d.irq.read().unwrap(), 1, "interrupt raised");
        // Frames waiting on the tap, but every buffer used: quiet again.
        pkt.send(&frame(b"twig-rx-2"));
        assert!(!readable(host, 300));
        let buf = d.alloc(2048);
        d.post(RX, &[(buf, 2048, true)]);
        d.notify(RX);
        assert!(readable(host, 10_000));
        assert!(d.t.process_host());
        assert!(d.used(RX).is_some());
        assert!(!readable(host, 0));
    }
}
