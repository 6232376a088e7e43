//! twig-net: frames per second and one-way latency from a pod's tap to the
//! outside of its veth, through the eBPF redirect (policy of 1 and 10,000
//! rules) against a Linux bridge and `tc mirred` (Kata's way), and the set-up
//! time of a pod's network path. Runs on the host in network namespaces
//! (root). The `ip`/`tc` commands build the comparison set-ups only.

use crate::stats::{Context, Error, Report};
use serde_json::json;
use std::fs::File;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use twig_net::{EgressPolicy, EgressRule, NodeContext, PodNetConfig, PodNetwork};

/// Options of `twig-bench net`.
#[derive(clap::Args)]
pub struct Args {
    /// Frames sent per throughput measurement.
    #[arg(long, default_value_t = 50_000)]
    frames: usize,
    /// Frames timed one by one per latency measurement.
    #[arg(long, default_value_t = 2_000)]
    latency_samples: usize,
    /// Attach/detach cycles timed for the set-up time.
    #[arg(long, default_value_t = 50)]
    setup_runs: usize,
}

const POD_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
const PEER_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const POD_MAC: [u8; 6] = [2, 0, 0, 0, 0, 2];
const PEER_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const WINDOW: usize = 64;
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
        frame.extend_from_slice(&[0x08, 0x00, 0x45, 0, 0, 32, 0, 1, 0x40, 0, 64, 17, 0, 0]);
        frame.extend_from_slice(&POD_IP.octets());
        frame.extend_from_slice(&PEER_IP.octets());
        frame.extend_from_slice(&[0x9c, 0x40, 0x27, 0x0f, 0, 12, 0, 0]);
        frame.extend_from_slice(&seq.to_be_bytes());
        self.tap
            .write_all(&frame)
            .context(|| "writing to the tap".into())
    }

    /// Waits for frames until `count` bench frames arrived or `deadline`; returns how many did.
    fn receive(&self, count: usize, deadline: Instant) -> usize {
        let mut buf = [0u8; 2048];
        let mut got = 0;
        while got < count && Instant::now() < deadline {
            // SAFETY: `buf` is writable for its length.
            let n = unsafe {
                libc::recv(
                    self.capture.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                )
            };
            if n >= 42 && buf[12..14] == [0x08, 0x00] && buf[36..38] == [0x27, 0x0f] {
                got += 1;
            }
        }
        got
    }

    /// Frames per second with `WINDOW` frames in flight, and lost frames.
    fn throughput(&mut self, frames: usize) -> Result<(f64, usize), Error> {
        let start = Instant::now();
        let mut lost = 0;
        for batch in 0..frames / WINDOW {
            for i in 0..WINDOW {
                self.send((batch * WINDOW + i) as u32)?;
            }
            lost += WINDOW - self.receive(WINDOW, Instant::now() + Duration::from_secs(1));
        }
        let sent = frames / WINDOW * WINDOW;
        Ok(((sent - lost) as f64 / start.elapsed().as_secs_f64(), lost))
    }

    /// One-way latency tap → peer, one frame in flight.
    fn latency(&mut self, samples: usize) -> Result<Vec<Duration>, Error> {
        let mut out = Vec::with_capacity(samples);
        for seq in 0..samples {
            let start = Instant::now();
            self.send(seq as u32)?;
            if self.receive(1, start + Duration::from_secs(1)) == 1 {
                out.push(start.elapsed());
            }
        }
        if out.is_empty() {
            return Err("no frame got through".into());
        }
        Ok(out)
    }
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
    // Warm up (bridge learning, caches).
    bed.throughput(WINDOW * 4)?;
    let (pps, lost) = bed.throughput(args.frames)?;
    report.value(&format!("{name}_pps"), json!(pps.round()));
    report.insert(&format!("{name}_lost"), json!(lost));
    let latency = bed.latency(args.latency_samples)?;
    report.timing(&format!("{name}_latency_ms"), &latency);
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
    twig_net::check_support()?;
    let mut bed = Bed::new()?;
    let mut report = Report::default();
    let node = NodeContext::default();
    let dir = bed.bpffs.path().join("pod");

    let mut attach = Vec::new();
    let mut detach = Vec::new();
    for _ in 0..args.setup_runs {
        let start = Instant::now();
        let (pod, _) = PodNetwork::attach(&dir, &config(&bed), &EgressPolicy::default(), &node)?;
        attach.push(start.elapsed());
        let start = Instant::now();
        pod.detach()?;
        detach.push(start.elapsed());
    }
    report.timing("setup_attach_ms", &attach);
    report.timing("setup_detach_ms", &detach);

    let (mut pod, _) = PodNetwork::attach(&dir, &config(&bed), &rules(1), &node)?;
    measure(&mut bed, args, &mut report, "ebpf_1_rule")?;
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

    for (from, to) in [("tap0", "eth0"), ("eth0", "tap0")] {
        sh("tc", &["-n", &p, "qdisc", "add", "dev", from, "ingress"])?;
        sh(
            "tc",
            &[
                "-n", &p, "filter", "add", "dev", from, "parent", "ffff:", "protocol", "all",
                "matchall", "action", "mirred", "egress", "redirect", "dev", to,
            ],
        )?;
    }
    measure(&mut bed, args, &mut report, "tc_mirred")?;
    Ok(report.into_value())
}
