//! twig-net: frames per second and one-way latency from a pod's tap to the
//! outside of its veth, through the eBPF redirect (policy of 1 and 10,000
//! rules, and replies to a private peer that the policy passes only because
//! the peer started the flow) against a Linux bridge and `tc mirred` (Kata's way), and the set-up
//! time of a pod's network path in each attach mode. Runs on the host in
//! network namespaces (root). The `ip`/`tc` commands build the comparison
//! set-ups only.
//!
//! Every frame carries a sequence number; a window of frames is sent, then
//! received until all of them arrived or none arrived for `IDLE` (those are
//! counted lost), so a lossy path costs at most `IDLE` a window, and each
//! measurement stops at `--budget-secs` whatever happened.

use crate::stats::{Context, Error, Report};
use serde_json::json;
use std::fs::File;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use twig_net::{AttachMode, EgressPolicy, EgressRule, Loader, NodeContext, PodNetConfig};

/// Options of `twig-bench net`.
#[derive(clap::Args)]
pub struct Args {
    /// Frames sent per throughput measurement.
    #[arg(long, default_value_t = 50_000)]
    frames: usize,
    /// Frames timed one by one per latency measurement.
    #[arg(long, default_value_t = 2_000)]
    latency_samples: usize,
    /// Attach/detach cycles timed for the set-up time (per mode).
    #[arg(long, default_value_t = 50)]
    setup_runs: usize,
    /// Upper bound on each throughput or latency measurement, in seconds.
    #[arg(long, default_value_t = 20)]
    budget_secs: u64,
}

const POD_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
const PEER_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const POD_MAC: [u8; 6] = [2, 0, 0, 0, 0, 2];
const PEER_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
/// A private peer (the node): the guest may only answer it.
const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 7);
/// The ports of every bench frame (guest side, peer side).
const POD_PORT: u16 = 40_000;
const PEER_PORT: u16 = 9_999;
const WINDOW: usize = 64;
/// A window's missing frames are declared lost after this long without one.
const IDLE: Duration = Duration::from_millis(5);
const VNET_HDR: [u8; 10] = [0; 10];

fn sh(program: &str, args: &[&str]) -> Result<(), Error> {
    let out = Command::new(program)
        .args(args)
        .output()
        .context(|| format!("running {program}"))?;
    if !out.status.success() {
        return Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(())
}

fn in_ns<T: Send>(ns: &Path, work: impl FnOnce() -> Result<T, Error> + Send) -> Result<T, Error> {
    let file = File::open(ns).context(|| format!("opening {}", ns.display()))?;
    std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: setns(2) on an open namespace file; affects only this thread.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(format!("setns: {}", std::io::Error::last_os_error()));
            }
            work().map_err(|e| e.to_string())
        })
        .join()
        .map_err(|_| "namespace thread panicked".to_string())?
    })
    .map_err(Error::from)
}

fn check(rc: i64, what: &str) -> Result<(), Error> {
    if rc < 0 {
        return Err(format!("{what}: {}", std::io::Error::last_os_error()).into());
    }
    Ok(())
}

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: i16,
    pad: [u8; 22],
}

fn open_tap() -> Result<File, Error> {
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .context(|| "/dev/net/tun".into())?;
    let mut req = IfReq {
        name: [0; 16],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16,
        pad: [0; 22],
    };
    req.name[..4].copy_from_slice(b"tap0");
    check(
        // SAFETY: TUNSETIFF takes a `struct ifreq` (40 bytes, name then
        // flags), which `IfReq` matches; `req` outlives the call.
        unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req as *mut IfReq) }.into(),
        "TUNSETIFF",
    )?;
    Ok(tun)
}

fn packet_socket() -> Result<OwnedFd, Error> {
    let protocol = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: socket(2) with constant arguments; checked below.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK,
            i32::from(protocol),
        )
    };
    check(fd.into(), "AF_PACKET socket")?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `sockaddr_ll` is plain data; all-zero is valid.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = protocol;
    // SAFETY: a NUL-terminated interface name.
    addr.sll_ifindex = unsafe { libc::if_nametoindex(c"peer0".as_ptr()) } as i32;
    let size = std::mem::size_of::<libc::sockaddr_ll>() as u32;
    // SAFETY: `addr` is a valid `sockaddr_ll` of `size` bytes.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_ll).cast(),
            size,
        )
    };
    check(rc.into(), "bind AF_PACKET")?;
    Ok(fd)
}

struct Bed {
    pod: String,
    out: String,
    tap: File,
    capture: OwnedFd,
    bpffs: tempfile::TempDir,
    seq: u32,
    /// The destination of the frames the guest sends.
    dst: Ipv4Addr,
}

impl Drop for Bed {
    fn drop(&mut self) {
        for ns in [&self.pod, &self.out] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = Command::new("umount").arg(self.bpffs.path()).status();
    }
}

impl Bed {
    fn new() -> Result<Bed, Error> {
        let pod = format!("twbench-{}-p", std::process::id());
        let out = format!("twbench-{}-o", std::process::id());
        sh("ip", &["netns", "add", &pod])?;
        sh("ip", &["netns", "add", &out])?;
        let bpffs = tempfile::Builder::new()
            .prefix("twig-bench-bpffs")
            .tempdir()
            .context(|| "tempdir".into())?;
        twig_net::ensure_bpffs(bpffs.path())?;
        sh(
            "ip",
            &[
                "link", "add", "eth0", "netns", &pod, "type", "veth", "peer", "name", "peer0",
                "netns", &out,
            ],
        )?;
        sh(
            "ip",
            &[
                "-n",
                &pod,
                "link",
                "set",
                "eth0",
                "address",
                "02:00:00:00:00:02",
                "up",
            ],
        )?;
        sh(
            "ip",
            &[
                "-n",
                &out,
                "link",
                "set",
                "peer0",
                "address",
                "02:00:00:00:00:01",
                "up",
            ],
        )?;
        let pod_ns = Path::new("/run/netns").join(&pod);
        let tap = in_ns(&pod_ns, open_tap)?;
        sh("ip", &["-n", &pod, "link", "set", "tap0", "up"])?;
        let capture = in_ns(&Path::new("/run/netns").join(&out), packet_socket)?;
        Ok(Bed {
            pod,
            out,
            tap,
            capture,
            bpffs,
            seq: 0,
            dst: PEER_IP,
        })
    }

    fn pod_ns(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.pod)
    }

    fn send(&mut self, seq: u32) -> Result<(), Error> {
        let mut frame = Vec::with_capacity(80);
        frame.extend_from_slice(&VNET_HDR);
        frame.extend_from_slice(&PEER_MAC);
        frame.extend_from_slice(&POD_MAC);
        frame.extend_from_slice(&[0x08, 0x00]);
        frame.extend_from_slice(&ipv4_header(POD_IP, self.dst));
        frame.extend_from_slice(&udp_ports(POD_PORT, PEER_PORT));
        frame.extend_from_slice(&seq.to_be_bytes());
        self.tap
            .write_all(&frame)
            .context(|| "writing to the tap".into())
    }

    /// Sends a frame from `src` towards the guest (out of the peer), which
    /// starts a flow the guest may answer.
    fn start_flow(&self, src: Ipv4Addr) -> Result<(), Error> {
        let mut frame = Vec::with_capacity(64);
        frame.extend_from_slice(&POD_MAC);
        frame.extend_from_slice(&PEER_MAC);
        frame.extend_from_slice(&[0x08, 0x00]);
        frame.extend_from_slice(&ipv4_header(src, POD_IP));
        frame.extend_from_slice(&udp_ports(PEER_PORT, POD_PORT));
        frame.extend_from_slice(&[0; 4]);
        // SAFETY: `frame` is a valid buffer of `frame.len()` bytes.
        let n = unsafe {
            libc::send(
                self.capture.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
            )
        };
        check(n as i64, "sending on peer0")
    }

    /// Receives bench frames with a sequence number in `first..first + count`
    /// until all of them arrived or none arrived for `IDLE`; returns how many did.
    fn receive(&self, first: u32, count: usize) -> usize {
        let mut buf = [0u8; 2048];
        let mut seen = vec![false; count];
        let mut got = 0;
        while got < count {
            // SAFETY: `buf` is writable for its length.
            let n = unsafe {
                libc::recv(
                    self.capture.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                )
            };
            if n < 0 {
                let mut pfd = libc::pollfd {
                    fd: self.capture.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid `pollfd`, count 1.
                let ready = unsafe { libc::poll(&mut pfd, 1, IDLE.as_millis() as i32) };
                if ready <= 0 {
                    break;
                }
                continue;
            }
            let n = n as usize;
            if n < 46 || buf[12..14] != [0x08, 0x00] || buf[36..38] != [0x27, 0x0f] {
                continue;
            }
            let seq = u32::from_be_bytes([buf[42], buf[43], buf[44], buf[45]]);
            let Some(i) = seq.checked_sub(first).map(|i| i as usize) else {
                continue;
            };
            if i < count && !seen[i] {
                seen[i] = true;
                got += 1;
            }
        }
        got
    }

    /// Frames per second with `WINDOW` frames in flight, frames sent and lost.
    fn throughput(
        &mut self,
        frames: usize,
        budget: Duration,
    ) -> Result<(f64, usize, usize), Error> {
        let start = Instant::now();
        let (mut sent, mut lost) = (0, 0);
        while sent + WINDOW <= frames && start.elapsed() < budget {
            let first = self.seq;
            for _ in 0..WINDOW {
                self.send_next()?;
            }
            sent += WINDOW;
            lost += WINDOW - self.receive(first, WINDOW);
        }
        Ok((
            (sent - lost) as f64 / start.elapsed().as_secs_f64(),
            sent,
            lost,
        ))
    }

    /// One-way latency tap → peer, one frame in flight; and frames lost.
    fn latency(
        &mut self,
        samples: usize,
        budget: Duration,
    ) -> Result<(Vec<Duration>, usize), Error> {
        let mut out = Vec::with_capacity(samples);
        let mut lost = 0;
        let begin = Instant::now();
        for _ in 0..samples {
            if begin.elapsed() >= budget {
                break;
            }
            let first = self.seq;
            let start = Instant::now();
            self.send_next()?;
            if self.receive(first, 1) == 1 {
                out.push(start.elapsed());
            } else {
                lost += 1;
            }
        }
        if out.is_empty() {
            return Err("no frame got through".into());
        }
        Ok((out, lost))
    }

    fn send_next(&mut self) -> Result<(), Error> {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        self.send(seq)
    }
}

/// The IPv4 header of every bench frame (UDP, 32 bytes in all), with its
/// checksum: a bridge with `br_netfilter` on (`bridge-nf-call-iptables=1`, as
/// Kubernetes nodes run) drops frames whose header checksum is wrong.
fn ipv4_header(src: Ipv4Addr, dst: Ipv4Addr) -> [u8; 20] {
    let mut h = [
        0x45, 0, 0, 32, 0, 1, 0x40, 0, 64, 17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let mut sum: u32 = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    h
}

/// A UDP header of 12 bytes (4 of payload), no checksum.
fn udp_ports(sport: u16, dport: u16) -> [u8; 8] {
    let [s0, s1] = sport.to_be_bytes();
    let [d0, d1] = dport.to_be_bytes();
    [s0, s1, d0, d1, 0, 12, 0, 0]
}

fn config(bed: &Bed) -> PodNetConfig {
    PodNetConfig {
        netns: bed.pod_ns(),
        veth: "eth0".into(),
        tap: "tap0".into(),
        pod_ip: POD_IP,
    }
}

fn rules(n: u32) -> EgressPolicy {
    let deny = (0..n)
        .map(|i| EgressRule::cidr(&Ipv4Addr::from(0x0b00_0000 + i).to_string()))
        .collect();
    EgressPolicy {
        deny,
        ..Default::default()
    }
}

fn measure(bed: &mut Bed, args: &Args, report: &mut Report, name: &str) -> Result<(), Error> {
    let budget = Duration::from_secs(args.budget_secs);
    // Warm up (bridge learning, caches).
    bed.throughput(WINDOW * 4, budget)?;
    let (pps, sent, lost) = bed.throughput(args.frames, budget)?;
    report.value(&format!("{name}_pps"), json!(pps.round()));
    report.value(&format!("{name}_sent_lost"), json!([sent, lost]));
    let (latency, lost) = bed.latency(args.latency_samples, budget)?;
    report.timing(&format!("{name}_latency_ms"), &latency);
    report.insert(&format!("{name}_latency_lost"), json!(lost));
    Ok(())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Set-up and removal times of a pod's path in `mode`: from a preloaded set
/// (the pod's path), with an empty pool, and the off-path load of a set.
fn setup(bed: &Bed, args: &Args, report: &mut Report, mode: AttachMode) -> Result<(), Error> {
    let loader = Loader::with_mode(mode)?;
    let node = NodeContext::default();
    let dir = bed.bpffs.path().join("pod");
    let policy = EgressPolicy::default();
    let (mut load, mut attach, mut cold, mut detach) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.setup_runs {
        let start = Instant::now();
        loader.preload(1)?;
        load.push(start.elapsed());
        let start = Instant::now();
        let (pod, _) = loader.attach(&dir, &config(bed), &policy, &node)?;
        attach.push(start.elapsed());
        let start = Instant::now();
        pod.detach()?;
        detach.push(start.elapsed());
        let start = Instant::now();
        let (pod, _) = loader.attach(&dir, &config(bed), &policy, &node)?;
        cold.push(start.elapsed());
        pod.detach()?;
    }
    report.timing(&format!("setup_{mode}_load_set_ms"), &load);
    report.timing(&format!("setup_{mode}_attach_ms"), &attach);
    report.timing(&format!("setup_{mode}_attach_cold_ms"), &cold);
    report.timing(&format!("setup_{mode}_detach_ms"), &detach);
    Ok(())
}

/// Runs the benchmark.
pub fn run(args: &Args) -> Result<serde_json::Value, Error> {
    if args.frames < WINDOW || args.latency_samples == 0 || args.setup_runs == 0 {
        return Err(format!(
            "--frames must be at least {WINDOW}; --latency-samples and --setup-runs positive"
        )
        .into());
    }
    let mode = twig_net::check_support()?;
    let mut bed = Bed::new()?;
    let mut report = Report::default();
    report.value("load_average_start", json!(load_average()));
    report.value("attach_mode", json!(mode.to_string()));
    let modes = match twig_net::check_support_with(Some(AttachMode::Tcx)) {
        Ok(_) => vec![AttachMode::Tcx, AttachMode::Netlink],
        Err(_) => vec![AttachMode::Netlink],
    };
    for m in modes {
        setup(&bed, args, &mut report, m)?;
    }

    let node = NodeContext::default();
    let loader = Loader::with_mode(mode)?;
    let dir = bed.bpffs.path().join("pod");
    let (mut pod, _) = loader.attach(&dir, &config(&bed), &rules(1), &node)?;
    measure(&mut bed, args, &mut report, "ebpf_1_rule")?;
    // Replies to the node (private): the policy alone would drop them.
    bed.start_flow(NODE_IP)?;
    bed.dst = NODE_IP;
    measure(&mut bed, args, &mut report, "ebpf_reply")?;
    bed.dst = PEER_IP;
    let start = Instant::now();
    pod.update_policy(&rules(10_000), &node)?;
    report.value(
        "policy_update_10000_rules_ms",
        json!(start.elapsed().as_secs_f64() * 1e3),
    );
    measure(&mut bed, args, &mut report, "ebpf_10000_rules")?;
    pod.detach()?;

    let p = bed.pod.clone();
    // A bridge drops frames whose source is one of its ports' own MACs, and
    // the guest uses the veth's MAC: give the veth another one here.
    sh(
        "ip",
        &[
            "-n",
            &p,
            "link",
            "set",
            "eth0",
            "address",
            "02:00:00:00:00:03",
        ],
    )?;
    sh("ip", &["-n", &p, "link", "add", "br0", "type", "bridge"])?;
    for dev in ["eth0", "tap0"] {
        sh("ip", &["-n", &p, "link", "set", dev, "master", "br0"])?;
    }
    sh("ip", &["-n", &p, "link", "set", "br0", "up"])?;
    measure(&mut bed, args, &mut report, "bridge")?;
    sh("ip", &["-n", &p, "link", "del", "br0"])?;

    // A clsact qdisc (it may be there already from the netlink mode) and a
    // u32 match-all filter with a mirred redirect: this kernel config, like
    // many, has neither matchall nor gact, but u32 and mirred.
    for (from, to) in [("tap0", "eth0"), ("eth0", "tap0")] {
        sh("tc", &["-n", &p, "qdisc", "replace", "dev", from, "clsact"])?;
        sh(
            "tc",
            &[
                "-n", &p, "filter", "add", "dev", from, "ingress", "protocol", "all", "u32",
                "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", to,
            ],
        )?;
    }
    measure(&mut bed, args, &mut report, "tc_mirred")?;
    report.value("load_average_end", json!(load_average()));
    Ok(report.into_value())
}
