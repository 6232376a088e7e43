//! virtio-net on a host tap device.
//!
//! The tap is opened with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR` and a 12-byte
//! vnet header, non-blocking. The device offers only `VIRTIO_NET_F_MAC` (no
//! offloads), so the 12-byte `virtio_net_hdr` carries nothing: the host's
//! header reaches the guest with no flags set, and the guest's is zeroed
//! before its frame reaches the tap (a guest must not ask the host kernel for
//! checksum or segmentation work it never negotiated). Transmit runs on the vCPU thread that notified
//! the queue; receive runs on the VM's device thread, which polls
//! [`Net::host_fd`]: an inner epoll that holds the tap only while the guest
//! has posted receive buffers, so the thread never spins on frames it has
//! nowhere to put.
//!
//! The tap is the device's [`NetBackend`], shared with the VM: it is opened
//! by name when the VM is created, or attached later as a descriptor the
//! caller opened ([`NetBackend::attach`]; how a jailed VMM, which cannot
//! create a tap in a pod's network namespace, gets one). Until then the
//! device is *detached*: frames the guest sends are dropped and counted,
//! nothing is received. Snapshots hold the device, never the tap.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::Bytes;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::VirtioDevice;
use crate::error::{Error, Result};
use crate::memory::GuestMem;
use crate::ratelimit::warn_limited;

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
/// The flags a tap must have been opened with.
const TAP_FLAGS: libc::c_int = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// An open tap and its name.
struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Opens the tap named `tap` (created if missing, as the kernel does for
    /// TUNSETIFF).
    fn open(tap: &str) -> Result<Tap> {
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
            flags: TAP_FLAGS as libc::c_short,
            _pad: [0; 22],
        };
        req.name[..tap.len()].copy_from_slice(tap.as_bytes());
        // SAFETY: TUNSETIFF reads and writes an ifreq, which IfReq lays out.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
            return Err(fail("TUNSETIFF failed", std::io::Error::last_os_error()));
        }
        Tap::configure(file, tap.to_string())
    }

    /// Takes a descriptor the caller opened: it must be a tap attached to an
    /// interface with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`.
    fn adopt(file: File) -> Result<Tap> {
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: 0,
            _pad: [0; 22],
        };
        // SAFETY: TUNGETIFF writes an ifreq, which IfReq lays out; on a
        // descriptor that is not a tun/tap it fails and writes nothing.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNGETIFF, &mut req) } < 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::Net(format!(
                "the descriptor sent is not a tap attached to an interface (TUNGETIFF: {e})"
            )));
        }
        let len = req
            .name
            .iter()
            .position(|b| *b == 0)
            .unwrap_or(req.name.len());
        let name = String::from_utf8_lossy(&req.name[..len]).into_owned();
        let flags = libc::c_int::from(req.flags);
        if flags & TAP_FLAGS != TAP_FLAGS {
            return Err(Error::Net(format!(
                "{name} was opened with flags {flags:#x}; a VM's tap needs IFF_TAP|IFF_NO_PI|IFF_VNET_HDR ({TAP_FLAGS:#x})"
            )));
        }
        let on: libc::c_int = 1;
        // SAFETY: FIONBIO reads an int.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::FIONBIO, &on) } < 0 {
            return Err(Error::io(
                format!("tap {name}: making it non-blocking"),
                std::io::Error::last_os_error(),
            ));
        }
        Tap::configure(file, name)
    }

    /// Sets the vnet header size both sides use.
    fn configure(file: File, name: String) -> Result<Tap> {
        let hdr = HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr) } < 0 {
            return Err(Error::io(
                format!("tap {name}: TUNSETVNETHDRSZ failed"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Tap { file, name })
    }
}

/// The device's link to the host: the tap, if attached, and whether the
/// inner epoll holds it.
#[derive(Default)]
struct Link {
    tap: Option<Tap>,
    armed: bool,
}

/// The host side of a network device, shared by the device and its VM: the
/// tap (attached when the VM is created or later) and the inner epoll the
/// device thread polls.
pub struct NetBackend {
    epoll: Epoll,
    link: Mutex<Link>,
    tx_dropped: AtomicU64,
}

impl NetBackend {
    fn new(tap: Option<Tap>) -> Result<NetBackend> {
        let epoll = Epoll::new().map_err(|e| Error::io("virtio-net: creating an epoll", e))?;
        Ok(NetBackend {
            epoll,
            link: Mutex::new(Link { tap, armed: false }),
            tx_dropped: AtomicU64::new(0),
        })
    }

    fn link(&self) -> MutexGuard<'_, Link> {
        self.link.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Attaches the tap `file` (opened by the caller with
    /// `IFF_TAP|IFF_NO_PI|IFF_VNET_HDR`; its vnet header size is set to 12
    /// and it is made non-blocking) to a detached device and returns the
    /// interface's name. Refused, changing nothing, if the device has a tap
    /// already or `file` is not such a tap.
    pub fn attach(&self, file: File) -> Result<String> {
        let mut link = self.link();
        if let Some(t) = &link.tap {
            return Err(Error::Net(format!(
                "the network device is attached to {} already",
                t.name
            )));
        }
        let tap = Tap::adopt(file)?;
        let name = tap.name.clone();
        link.tap = Some(tap);
        // Look at the receive queue: the device thread disarms again if the
        // guest has posted no buffers.
        self.set_armed(&mut link, true);
        tracing::info!(tap = %name, "virtio-net: tap attached");
        Ok(name)
    }

    /// The name of the attached tap, if any.
    pub fn tap_name(&self) -> Option<String> {
        self.link().tap.as_ref().map(|t| t.name.clone())
    }

    /// Frames the guest sent while the device had no tap.
    pub fn tx_dropped(&self) -> u64 {
        self.tx_dropped.load(Ordering::Relaxed)
    }

    fn set_armed(&self, link: &mut Link, on: bool) {
        if link.armed == on {
            return;
        }
        let Some(tap) = &link.tap else {
            return;
        };
        let (op, events) = if on {
            (ControlOperation::Add, EventSet::IN)
        } else {
            (ControlOperation::Delete, EventSet::empty())
        };
        let fd = tap.file.as_raw_fd();
        match self.epoll.ctl(op, fd, EpollEvent::new(events, fd as u64)) {
            Ok(()) => link.armed = on,
            Err(e) => tracing::warn!(tap = %tap.name, "virtio-net: epoll: {e}"),
        }
    }
}

/// The network device.
pub struct Net {
    backend: Arc<NetBackend>,
    config: [u8; 6],
    rx: Vec<u8>,
    tx: Vec<u8>,
}

impl Net {
    /// A device with the address `mac` on the tap named `tap` (created if
    /// missing, as the kernel does for TUNSETIFF), or detached with `None`.
    pub fn new(tap: Option<&str>, mac: [u8; 6]) -> Result<Net> {
        let tap = tap.map(Tap::open).transpose()?;
        Ok(Net {
            backend: Arc::new(NetBackend::new(tap)?),
            config: mac,
            rx: vec![0; MAX_PACKET],
            tx: Vec::with_capacity(MAX_PACKET),
        })
    }

    /// The device's host side, through which a tap is attached later.
    pub fn backend(&self) -> Arc<NetBackend> {
        self.backend.clone()
    }

    fn set_armed(&self, on: bool) {
        self.backend.set_armed(&mut self.backend.link(), on);
    }

    fn transmit(&mut self, queue: &mut Queue, mem: &GuestMem) -> bool {
        let mut link = self.backend.link();
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
            match link.tap.as_mut() {
                Some(tap) if ok && self.tx.len() > HDR_LEN => {
                    // No offload was negotiated: whatever the guest put in
                    // the header means nothing, and the tap would act on it.
                    self.tx[..HDR_LEN].fill(0);
                    if let Err(e) = tap.file.write(&self.tx) {
                        tracing::debug!(tap = %tap.name, "virtio-net: frame dropped: {e}");
                    }
                }
                Some(tap) => {
                    tracing::debug!(tap = %tap.name, "virtio-net: malformed transmit buffer dropped");
                }
                None => {
                    self.backend.tx_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            if let Err(e) = queue.add_used(mem, head, 0) {
                warn_limited!("virtio-net: {e}");
                break;
            }
            used = true;
        }
        used
    }

    fn receive(&mut self, queue: &mut Queue, mem: &GuestMem) -> bool {
        let mut link = self.backend.link();
        let mut used = false;
        for _ in 0..RX_BATCH {
            let posted = queue
                .avail_idx(mem, Ordering::Acquire)
                .is_ok_and(|i| i.0 != queue.next_avail());
            if !posted {
                self.backend.set_armed(&mut link, false);
                break;
            }
            let Some(tap) = link.tap.as_mut() else {
                break;
            };
            let n = match tap.file.read(&mut self.rx) {
                Ok(n) if n > HDR_LEN => n,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!(tap = %tap.name, "virtio-net: reading the tap: {e}");
                    break;
                }
            };
            // num_buffers: always one buffer without VIRTIO_NET_F_MRG_RXBUF.
            self.rx[10..12].copy_from_slice(&1u16.to_le_bytes());
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                self.backend.set_armed(&mut link, false);
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
                tracing::debug!("virtio-net: {n}-byte frame dropped, receive buffer too small");
                queue.go_to_previous_position();
                break;
            }
            if let Err(e) = queue.add_used(mem, head, n as u32) {
                warn_limited!("virtio-net: {e}");
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
        Some(self.backend.epoll.as_raw_fd())
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
        let mut d = Driver::new(Box::new(Net::new(Some(&tap), MAC).unwrap()));
        assert_eq!(d.config(6), MAC);
        assert_eq!(
            d.device_features(),
            1 << VIRTIO_NET_F_MAC | 1 << VIRTIO_F_VERSION_1,
            "MAC only"
        );
        let e = Net::new(Some("a-name-far-too-long"), MAC)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("a-name-far-too-long"), "{e}");
        let e = Net::new(Some("lo"), MAC).err().unwrap().to_string();
        assert!(e.contains("tap lo") && e.contains("TUNSETIFF"), "{e}");
    }

    #[test]
    fn frames_go_out_through_the_tap() {
        let tap = tap_name();
        let mut d = Driver::new(Box::new(Net::new(Some(&tap), MAC).unwrap()));
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
        let mut d = Driver::new(Box::new(Net::new(Some(&tap), MAC).unwrap()));
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

    /// A tap named `name` opened the way a caller of `attach` opens one,
    /// with `flags`.
    fn open_tap(name: &str, flags: libc::c_int) -> File {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .unwrap();
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: flags as libc::c_short,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF on an ifreq.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        file
    }

    fn send_frame(d: &mut Driver, payload: &[u8]) {
        let f = frame(payload);
        let buf = d.alloc((HDR_LEN + f.len()) as u32);
        d.write(buf, &[0; HDR_LEN]);
        d.write(buf + HDR_LEN as u64, &f);
        let head = d.post(TX, &[(buf, (HDR_LEN + f.len()) as u32, false)]);
        d.notify(TX);
        assert_eq!(d.used(TX), Some((u32::from(head), 0)), "buffer used");
    }

    /// A device whose "tap" is one end of a `SOCK_SEQPACKET` socket pair
    /// (a frame per message, as a tap reads and writes them), and the other
    /// end, which sees exactly the bytes written to the tap.
    fn on_fake_tap() -> (Net, File) {
        let mut fds = [0; 2];
        // SAFETY: socketpair writes two descriptors into fds.
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        // SAFETY: both descriptors are new and ours.
        let (ours, theirs) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        let tap = Tap {
            file: ours,
            name: "fake".into(),
        };
        let net = Net {
            backend: Arc::new(NetBackend::new(Some(tap)).unwrap()),
            config: MAC,
            rx: vec![0; MAX_PACKET],
            tx: Vec::with_capacity(MAX_PACKET),
        };
        (net, theirs)
    }

    #[test]
    fn a_crafted_gso_header_from_the_guest_reaches_the_tap_zeroed() {
        let (net, mut peer) = on_fake_tap();
        let mut d = Driver::new(Box::new(net));
        let f = frame(b"twig-gso");
        // NEEDS_CSUM, GSO_TCPV4 with an ECN bit, header and segment sizes,
        // a checksum start and offset past the frame, num_buffers.
        let hdr: [u8; HDR_LEN] = [1, 0x81, 54, 0, 0x78, 0x05, 0xff, 0xff, 0xff, 0x7f, 7, 0];
        // Header and frame in separate descriptors, as Linux sends them.
        let h = d.alloc(HDR_LEN as u32);
        d.write(h, &hdr);
        let b = d.alloc(f.len() as u32);
        d.write(b, &f);
        let head = d.post(
            TX,
            &[(h, HDR_LEN as u32, false), (b, f.len() as u32, false)],
        );
        d.notify(TX);
        assert_eq!(d.used(TX), Some((u32::from(head), 0)));
        let mut got = vec![0; MAX_PACKET];
        let n = peer.read(&mut got).unwrap();
        assert_eq!(n, HDR_LEN + f.len(), "one frame, whole");
        assert_eq!(got[..HDR_LEN], [0; HDR_LEN], "no offload reaches the tap");
        assert_eq!(got[HDR_LEN..n], f[..], "the frame itself untouched");
    }

    #[test]
    fn a_detached_device_drops_and_counts_until_a_tap_is_attached() {
        let net = Net::new(None, MAC).unwrap();
        let backend = net.backend();
        let mut d = Driver::new(Box::new(net));
        let host = d.t.host_fd().unwrap();
        assert_eq!(d.config(6), MAC);
        assert_eq!(backend.tap_name(), None);
        send_frame(&mut d, b"twig-lost");
        send_frame(&mut d, b"twig-lost");
        assert_eq!(backend.tx_dropped(), 2, "both frames dropped and counted");
        let buf = d.alloc(2048);
        d.post(RX, &[(buf, 2048, true)]);
        d.notify(RX);
        assert!(!readable(host, 200), "nothing to receive without a tap");

        let tap = tap_name();
        let name = backend.attach(open_tap(&tap, TAP_FLAGS)).unwrap();
        assert_eq!(name, tap);
        assert_eq!(backend.tap_name().as_deref(), Some(tap.as_str()));
        up(&tap);
        let pkt = Packet::on(&tap);
        send_frame(&mut d, b"twig-out");
        pkt.expect(b"twig-out");
        assert_eq!(backend.tx_dropped(), 2, "nothing dropped once attached");
        // The buffer posted while detached gets the first frame now.
        let mut seen = false;
        for _ in 0..8 {
            pkt.send(&frame(b"twig-in"));
            assert!(readable(host, 10_000), "the attached tap is polled");
            assert!(d.t.process_host());
            let (_, len) = d.used(RX).expect("a frame received");
            if d.read(buf, len as usize)[HDR_LEN..] == frame(b"twig-in")[..] {
                seen = true;
                break;
            }
            d.post(RX, &[(buf, 2048, true)]);
            d.notify(RX);
        }
        assert!(seen, "the frame reached the guest");

        let again = tap_name();
        let e = backend.attach(open_tap(&again, TAP_FLAGS)).unwrap_err();
        assert!(
            matches!(e, Error::Net(_))
                && e.to_string()
                    .contains(&format!("attached to {tap} already")),
            "{e}"
        );
        assert_eq!(
            backend.tap_name().as_deref(),
            Some(tap.as_str()),
            "unchanged"
        );
    }

    #[test]
    fn attach_refuses_what_is_not_a_tap_the_device_can_use() {
        let backend = Net::new(None, MAC).unwrap().backend();
        let e = backend
            .attach(File::open("/dev/null").unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("not a tap"), "{e}");
        // /dev/net/tun opened but never bound to an interface.
        let unbound = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .unwrap();
        let e = backend.attach(unbound).unwrap_err();
        assert!(e.to_string().contains("not a tap"), "{e}");
        let tun = tap_name();
        let e = backend
            .attach(open_tap(
                &tun,
                libc::IFF_TUN | libc::IFF_NO_PI | libc::IFF_VNET_HDR,
            ))
            .unwrap_err();
        assert!(
            e.to_string().contains("IFF_TAP|IFF_NO_PI|IFF_VNET_HDR"),
            "{e}"
        );
        let plain = tap_name();
        let e = backend
            .attach(open_tap(&plain, libc::IFF_TAP | libc::IFF_NO_PI))
            .unwrap_err();
        assert!(e.to_string().contains(&plain), "{e}");
        assert_eq!(backend.tap_name(), None, "every refusal left it detached");
        // Still attachable after the refusals.
        let tap = tap_name();
        assert_eq!(backend.attach(open_tap(&tap, TAP_FLAGS)).unwrap(), tap);
    }
}
