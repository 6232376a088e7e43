//! Host test bed: a pod namespace with a veth and a tap (opened by the test,
//! standing in for the guest), and an outside namespace on the veth's peer
//! where frames are captured with an `AF_PACKET` socket. Needs root.

#![allow(dead_code)] // each test file uses a different part

use std::fs::File;
use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sched::{setns, CloneFlags};

pub const POD_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
pub const PEER_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
pub const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
pub const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const DEADLINE: Duration = Duration::from_secs(5);
const VNET_HDR_LEN: usize = 10;

/// Runs `ip` (iproute2) and asserts it succeeds.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("run ip (iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `tc` in the namespace file `netns` and returns its output lines.
pub fn tc(netns: &Path, args: &[&str]) -> Vec<String> {
    let out = in_ns(netns, || {
        Command::new("tc")
            .args(args)
            .output()
            .expect("run tc (iproute2)")
    });
    assert!(
        out.status.success(),
        "tc {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The lines of `tc filter show` for the ingress of `dev` (empty without a clsact qdisc).
pub fn tc_filters(netns: &Path, dev: &str) -> Vec<String> {
    let qdiscs = tc(netns, &["qdisc", "show", "dev", dev]);
    if !qdiscs.iter().any(|l| l.contains("clsact")) {
        return Vec::new();
    }
    tc(netns, &["filter", "show", "dev", dev, "ingress"])
}

/// Runs `work` on a thread inside the namespace file `netns`.
pub fn in_ns<T: Send>(netns: &Path, work: impl FnOnce() -> T + Send) -> T {
    let file = File::open(netns).expect("open netns");
    std::thread::scope(|s| {
        s.spawn(move || {
            setns(&file, CloneFlags::CLONE_NEWNET).expect("setns");
            work()
        })
        .join()
        .expect("netns thread")
    })
}

/// A private bpffs instance mounted on a temporary directory.
pub struct Bpffs {
    pub dir: tempfile::TempDir,
}

impl Bpffs {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("twig-net-bpffs")
            .tempdir()
            .expect("tempdir");
        twig_net::ensure_bpffs(dir.path()).expect("mount bpffs (needs root)");
        Bpffs { dir }
    }

    pub fn pod_dir(&self, pod: &str) -> PathBuf {
        self.dir.path().join(pod)
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.dir.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}

/// The two namespaces, the veth pair and the tap.
pub struct Bed {
    pub pod_ns: String,
    pub out_ns: String,
    pub tap: File,
    pub capture: OwnedFd,
    pub bpffs: Bpffs,
}

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: i16,
    pad: [u8; 22],
}

fn open_tap(name: &str) -> File {
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .expect("open /dev/net/tun");
    let mut req = IfReq {
        name: [0; 16],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16,
        pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq`, which `IfReq`
    // matches in size (40 bytes) and layout for the name and flags fields;
    // `req` outlives the call and `tun` is an open tun device.
    let rc = unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req as *mut IfReq) };
    assert_eq!(rc, 0, "TUNSETIFF: {}", std::io::Error::last_os_error());
    set_nonblocking(tun.as_raw_fd());
    tun
}

fn set_nonblocking(fd: i32) {
    // SAFETY: fcntl on a file descriptor the caller owns, with integer arguments only.
    let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK) };
    assert_eq!(rc, 0, "O_NONBLOCK: {}", std::io::Error::last_os_error());
}

fn packet_socket(ifname: &str) -> OwnedFd {
    let protocol = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(protocol)) };
    assert!(
        fd >= 0,
        "AF_PACKET socket: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let index = nix::net::if_::if_nametoindex(ifname).expect("peer ifindex");
    // SAFETY: `sockaddr_ll` is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = protocol;
    addr.sll_ifindex = index as i32;
    // SAFETY: `addr` is a valid `sockaddr_ll` and the length passed is its size.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &addr as *const libc::sockaddr_ll as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    assert_eq!(rc, 0, "bind AF_PACKET: {}", std::io::Error::last_os_error());
    set_nonblocking(fd.as_raw_fd());
    fd
}

impl Bed {
    /// Creates the namespaces; `tag` makes the names unique per test.
    pub fn new(tag: &str) -> Self {
        let pod_ns = format!("twn-{tag}-{}-p", std::process::id());
        let out_ns = format!("twn-{tag}-{}-o", std::process::id());
        ip(&["netns", "add", &pod_ns]);
        ip(&["netns", "add", &out_ns]);
        ip(&[
            "link", "add", "eth0", "netns", &pod_ns, "type", "veth", "peer", "name", "peer0",
            "netns", &out_ns,
        ]);
        let mac = |m: [u8; 6]| {
            m.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        };
        ip(&[
            "-n",
            &pod_ns,
            "link",
            "set",
            "eth0",
            "address",
            &mac(POD_MAC),
        ]);
        ip(&[
            "-n",
            &out_ns,
            "link",
            "set",
            "peer0",
            "address",
            &mac(PEER_MAC),
        ]);
        ip(&[
            "-n",
            &pod_ns,
            "addr",
            "add",
            &format!("{POD_IP}/24"),
            "dev",
            "eth0",
        ]);
        ip(&[
            "-n",
            &out_ns,
            "addr",
            "add",
            &format!("{PEER_IP}/24"),
            "dev",
            "peer0",
        ]);
        for (ns, dev) in [
            (&pod_ns, "eth0"),
            (&out_ns, "peer0"),
            (&pod_ns, "lo"),
            (&out_ns, "lo"),
        ] {
            ip(&["-n", ns, "link", "set", dev, "up"]);
        }
        let pod_path = Self::ns_path(&pod_ns);
        let tap = in_ns(&pod_path, || open_tap("tap0"));
        ip(&["-n", &pod_ns, "link", "set", "tap0", "up"]);
        let capture = in_ns(&Self::ns_path(&out_ns), || packet_socket("peer0"));
        Bed {
            pod_ns,
            out_ns,
            tap,
            capture,
            bpffs: Bpffs::new(),
        }
    }

    pub fn ns_path(name: &str) -> PathBuf {
        Path::new("/run/netns").join(name)
    }

    pub fn pod_netns(&self) -> PathBuf {
        Self::ns_path(&self.pod_ns)
    }

    /// Deletes the pod namespace's name (the namespace goes with its last user).
    pub fn delete_pod_netns(&self) {
        ip(&["netns", "del", &self.pod_ns]);
    }

    pub fn out_netns(&self) -> PathBuf {
        Self::ns_path(&self.out_ns)
    }

    pub fn config(&self) -> twig_net::PodNetConfig {
        twig_net::PodNetConfig {
            netns: self.pod_netns(),
            veth: "eth0".into(),
            tap: "tap0".into(),
            pod_ip: POD_IP,
        }
    }

    /// Writes one frame as the guest would (with an empty virtio-net header).
    pub fn guest_send(&mut self, frame: &[u8]) {
        let mut buf = vec![0u8; VNET_HDR_LEN];
        buf.extend_from_slice(frame);
        self.tap.write_all(&buf).expect("write to tap");
    }

    /// Reads frames from the tap until one satisfies `want`; panics at the deadline.
    pub fn guest_recv_until(&mut self, want: impl Fn(&[u8]) -> bool) -> Vec<u8> {
        let deadline = Instant::now() + DEADLINE;
        let mut buf = vec![0u8; 65_536];
        loop {
            match self.tap.read(&mut buf) {
                Ok(n) if n >= VNET_HDR_LEN && want(&buf[VNET_HDR_LEN..n]) => {
                    return buf[VNET_HDR_LEN..n].to_vec()
                }
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(
                        Instant::now() < deadline,
                        "no matching frame reached the guest in time"
                    );
                    wait_readable(self.tap.as_raw_fd(), deadline);
                }
                Err(e) => panic!("read tap: {e}"),
            }
        }
    }

    /// Sends a raw frame out of the peer (towards the pod).
    pub fn outside_send(&self, frame: &[u8]) {
        // SAFETY: `frame` is a valid buffer of `frame.len()` bytes; the socket is bound to peer0.
        let n = unsafe {
            libc::send(
                self.capture.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
            )
        };
        assert_eq!(
            n,
            frame.len() as isize,
            "send on peer0: {}",
            std::io::Error::last_os_error()
        );
    }

    /// Reads frames arriving at the peer until one contains `marker`;
    /// returns every frame received before it. Panics at the deadline.
    pub fn outside_recv_until(&self, marker: &[u8]) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        let mut buf = vec![0u8; 65_536];
        loop {
            // SAFETY: `buf` is a valid writable buffer of `buf.len()` bytes.
            let n = unsafe {
                libc::recv(
                    self.capture.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "recv peer0: {e}");
                assert!(
                    Instant::now() < deadline,
                    "marker {marker:?} never reached the outside"
                );
                wait_readable(self.capture.as_raw_fd(), deadline);
                continue;
            }
            let frame = buf[..n as usize].to_vec();
            if contains(&frame, marker) {
                return seen;
            }
            seen.push(frame);
        }
    }
}

fn wait_readable(fd: i32, deadline: Instant) {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .as_millis()
        .max(1) as i32;
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid `pollfd`, count 1.
    unsafe { libc::poll(&mut pfd, 1, left) };
}

impl Drop for Bed {
    fn drop(&mut self) {
        for ns in [&self.pod_ns, &self.out_ns] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// An Ethernet frame.
pub fn ether(dst: [u8; 6], src: [u8; 6], ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + payload.len());
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An IPv4 packet (header checksum filled in).
pub fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, frag_off: u16, payload: &[u8]) -> Vec<u8> {
    let total = (20 + payload.len()) as u16;
    let mut h = vec![0x45, 0];
    h.extend_from_slice(&total.to_be_bytes());
    h.extend_from_slice(&[0, 1]);
    h.extend_from_slice(&frag_off.to_be_bytes());
    h.extend_from_slice(&[64, proto, 0, 0]);
    h.extend_from_slice(&src.octets());
    h.extend_from_slice(&dst.octets());
    let mut sum: u32 = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    h.extend_from_slice(payload);
    h
}

/// A UDP (proto 17) or TCP-like (proto 6, ports only) transport header plus payload.
pub fn l4(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut u = Vec::new();
    u.extend_from_slice(&sport.to_be_bytes());
    u.extend_from_slice(&dport.to_be_bytes());
    u.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(payload);
    u
}

/// A frame from the guest: UDP from the pod to `dst:dport`.
pub fn guest_udp(dst: Ipv4Addr, dport: u16, payload: &[u8]) -> Vec<u8> {
    ether(
        PEER_MAC,
        POD_MAC,
        0x0800,
        &ipv4(POD_IP, dst, 17, 0, &l4(40000, dport, payload)),
    )
}

/// An ARP request: `sha`/`spa` asking for `tpa`.
pub fn arp_request(sha: [u8; 6], spa: Ipv4Addr, tpa: Ipv4Addr) -> Vec<u8> {
    let mut a = vec![0, 1, 0x08, 0x00, 6, 4, 0, 1];
    a.extend_from_slice(&sha);
    a.extend_from_slice(&spa.octets());
    a.extend_from_slice(&[0; 6]);
    a.extend_from_slice(&tpa.octets());
    ether([0xff; 6], POD_MAC, 0x0806, &a)
}

/// Polls the counter of `reason` until it reaches `want` (or the deadline).
pub fn wait_count(pod: &twig_net::PodNetwork, reason: twig_net::Reason, want: u64) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let got = pod.counters().expect("counters").get(reason).packets;
        if got == want {
            return;
        }
        assert!(got < want, "{reason:?}: counted {got}, expected {want}");
        assert!(
            Instant::now() < deadline,
            "{reason:?}: counted {got}, expected {want}"
        );
        std::thread::yield_now();
    }
}

/// Sends `bad` as the guest, then an allowed marker; asserts the marker gets
/// out, `bad` does not, and exactly one more frame is counted under `reason`.
pub fn assert_dropped(
    bed: &mut Bed,
    pod: &twig_net::PodNetwork,
    name: &str,
    bad: &[u8],
    reason: twig_net::Reason,
) {
    let before = pod.counters().expect("counters").get(reason).packets;
    bed.guest_send(bad);
    wait_count(pod, reason, before + 1);
    let marker = format!("marker after {name}");
    bed.guest_send(&guest_udp(PEER_IP, 9999, marker.as_bytes()));
    let leaked = bed.outside_recv_until(marker.as_bytes());
    assert!(
        !leaked.iter().any(|f| contains(f, name.as_bytes())),
        "{name} leaked out of the pod"
    );
}

/// Sends `good` as the guest and waits for it at the peer.
pub fn assert_passes(bed: &mut Bed, good: &[u8], marker: &str) {
    bed.guest_send(good);
    bed.outside_recv_until(marker.as_bytes());
}
