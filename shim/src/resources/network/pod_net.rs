//! The pod's network set up for its freshly restored VM: in the pod's
//! namespace (on a thread of its own) the pod's address is read and the
//! VM's tap created; tap and veth are joined; the VMM gets the tap and the
//! guest its identity. [`PodNet`] undoes it.

use std::fs::File;
use std::io::BufRead;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use twig_agent::proto::agent::ReidentifyRequest;
use twig_net::PodNetConfig;

use super::{remove_record, teardown, Joiner, Plan, GUEST_INTERFACE, TAP, VETH};
use crate::error::{Error, Result};

/// The pod's address as CNI configured it in its namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodAddress {
    /// The veth's IPv4 address: the pod's IP.
    pub ip: Ipv4Addr,
    /// Its prefix length.
    pub prefix: u8,
    /// The default route's gateway, if there is one.
    pub gateway: Option<Ipv4Addr>,
}

/// A pod's network attached to its VM: what tears it down, and the
/// identity the guest is given again after a rollback.
pub struct PodNet {
    dir: PathBuf,
    record: PathBuf,
    identity: ReidentifyRequest,
}

impl std::fmt::Debug for PodNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodNet")
            .field("dir", &self.dir)
            .field("ip", &self.identity.ipv4_cidr)
            .field("mac", &self.identity.mac)
            .finish()
    }
}

impl PodNet {
    /// Sets the pod's network up for its freshly restored VM: in the pod's
    /// namespace reads the pod's address and creates the tap, joins tap and
    /// veth with `joiner` (pinned in `dir`, recorded in `record` first),
    /// gives the VMM the tap (`send_tap`) and the guest its identity
    /// (`reidentify`). On an error everything done is undone (the path
    /// detached, the record removed; the tap goes with the last descriptor).
    pub fn attach(
        plan: &Plan,
        dir: &Path,
        record: &Path,
        joiner: &dyn Joiner,
        send_tap: impl FnOnce(BorrowedFd<'_>) -> Result<()>,
        reidentify: impl FnOnce(&ReidentifyRequest) -> Result<()>,
    ) -> Result<PodNet> {
        let (tap, address) = in_pod_namespace(&plan.netns)?;
        std::fs::write(record, dir.as_os_str().as_encoded_bytes())
            .map_err(|e| Error::io(format!("writing {}", record.display()), e))?;
        let net = PodNet {
            dir: dir.to_path_buf(),
            record: record.to_path_buf(),
            identity: ReidentifyRequest::default(),
        };
        let config = PodNetConfig {
            netns: plan.netns.clone(),
            veth: VETH.into(),
            tap: TAP.into(),
            pod_ip: address.ip,
        };
        let mac = match joiner.join(dir, &config, &plan.policy) {
            Ok(mac) => mac,
            Err(e) => {
                net.undo();
                return Err(e);
            }
        };
        let net = PodNet {
            identity: identity(&address, mac),
            ..net
        };
        if let Err(e) = send_tap(tap.as_fd()).and_then(|()| reidentify(&net.identity)) {
            net.undo();
            return Err(e);
        }
        tracing::info!(
            netns = %plan.netns.display(),
            ip = %net.identity.ipv4_cidr,
            gateway = %net.identity.ipv4_gateway,
            mac = %net.identity.mac,
            "the pod's network is attached to its VM"
        );
        Ok(net)
    }

    /// The guest's network identity (sent again after a rollback, which
    /// may bring back a guest state configured for another pod).
    pub fn identity(&self) -> &ReidentifyRequest {
        &self.identity
    }

    fn undo(&self) {
        if let Err(e) = teardown(&self.dir).and_then(|()| remove_record(&self.record)) {
            tracing::warn!(dir = %self.dir.display(), "undoing a failed network set-up: {e}");
        }
    }

    /// Tears the path down (after the VM stopped: its tap is gone) and
    /// removes the record.
    pub fn detach(self) -> Result<()> {
        teardown(&self.dir)?;
        remove_record(&self.record)
    }
}

/// The agent's request that gives the guest's interface the pod's identity.
fn identity(address: &PodAddress, mac: [u8; 6]) -> ReidentifyRequest {
    ReidentifyRequest {
        interface: GUEST_INTERFACE.into(),
        mac: mac
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":"),
        ipv4_cidr: format!("{}/{}", address.ip, address.prefix),
        ipv4_gateway: address.gateway.map(|g| g.to_string()).unwrap_or_default(),
        ..Default::default()
    }
}

/// On a thread of its own that joins the pod's namespace (and ends there):
/// the pod's address, and a new tap (up) in that namespace.
fn in_pod_namespace(netns: &Path) -> Result<(File, PodAddress)> {
    let ns = File::open(netns).map_err(|e| {
        Error::io(
            format!("opening the pod's network namespace {}", netns.display()),
            e,
        )
    })?;
    let what = format!("in the pod's network namespace {}", netns.display());
    std::thread::scope(|s| {
        s.spawn(|| -> Result<(File, PodAddress)> {
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| Error::io(format!("entering {}", netns.display()), e.into()))?;
            let address = read_address(VETH)?;
            let tap = create_tap(TAP)?;
            Ok((tap, address))
        })
        .join()
        .map_err(|_| Error::Internal(format!("the thread working {what} panicked")))?
    })
    .map_err(|e| match e {
        Error::Io { what: w, source } => Error::Io {
            what: format!("{w} ({what})"),
            source,
        },
        other => other,
    })
}

/// `ifreq` for the interface ioctls used here.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    data: [u8; 24],
}

impl IfReq {
    fn new(name: &str) -> Result<IfReq> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            return Err(Error::InvalidArgument(format!("interface name {name:?}")));
        }
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            data: [0; 24],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        Ok(req)
    }

    /// The IPv4 address of a `struct sockaddr_in` in the data.
    fn ipv4(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.data[4], self.data[5], self.data[6], self.data[7])
    }

    fn flags(&self) -> libc::c_short {
        libc::c_short::from_ne_bytes([self.data[0], self.data[1]])
    }

    fn set_flags(&mut self, flags: libc::c_short) {
        self.data[..2].copy_from_slice(&flags.to_ne_bytes());
    }
}

/// An `AF_INET` datagram socket for interface ioctls in this thread's
/// namespace.
fn inet_socket() -> Result<OwnedFd> {
    nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| Error::io("creating a socket for interface ioctls", e.into()))
}

/// `ioctl(fd, request, req)`.
fn ifreq_ioctl(
    fd: BorrowedFd<'_>,
    request: libc::c_ulong,
    req: &mut IfReq,
    what: &str,
) -> Result<()> {
    // SAFETY: the interface ioctls used here read and write a `struct
    // ifreq`, which IfReq lays out (name, then a 24-byte union).
    if unsafe { libc::ioctl(fd.as_raw_fd(), request, std::ptr::from_mut(req)) } < 0 {
        return Err(Error::io(what.to_string(), std::io::Error::last_os_error()));
    }
    Ok(())
}

/// `interface`'s IPv4 address and prefix, and the default gateway, in
/// this thread's namespace.
fn read_address(interface: &str) -> Result<PodAddress> {
    let sock = inet_socket()?;
    let mut req = IfReq::new(interface)?;
    ifreq_ioctl(
        sock.as_fd(),
        libc::SIOCGIFADDR,
        &mut req,
        &format!("reading {interface}'s IPv4 address"),
    )?;
    let ip = req.ipv4();
    let mut req = IfReq::new(interface)?;
    ifreq_ioctl(
        sock.as_fd(),
        libc::SIOCGIFNETMASK,
        &mut req,
        &format!("reading {interface}'s netmask"),
    )?;
    let prefix = u32::from(req.ipv4()).count_ones() as u8;
    let routes = File::open("/proc/thread-self/net/route")
        .map_err(|e| Error::io("opening /proc/thread-self/net/route", e))?;
    let lines = std::io::BufReader::new(routes)
        .lines()
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| Error::io("reading /proc/thread-self/net/route", e))?;
    Ok(PodAddress {
        ip,
        prefix,
        gateway: default_gateway(&lines),
    })
}

/// The gateway of the default route in `/proc/net/route`'s lines (hex
/// fields, the address in the host's byte order).
fn default_gateway(lines: &[String]) -> Option<Ipv4Addr> {
    lines.iter().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (dest, gw, mask) = (f.get(1)?, f.get(2)?, f.get(7)?);
        if *dest != "00000000" || *mask != "00000000" {
            return None;
        }
        let gw = u32::from_str_radix(gw, 16).ok()?;
        (gw != 0).then(|| Ipv4Addr::from(gw.to_ne_bytes()))
    })
}

/// Creates the tap `name` in this thread's namespace (`IFF_TAP|IFF_NO_PI|
/// IFF_VNET_HDR`, as the VMM needs it) and sets it up; it lives as long as
/// a descriptor of it is open.
fn create_tap(name: &str) -> Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(|e| Error::io("opening /dev/net/tun", e))?;
    let mut req = IfReq::new(name)?;
    req.set_flags((libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short);
    ifreq_ioctl(
        file.as_fd(),
        libc::TUNSETIFF,
        &mut req,
        &format!("creating tap {name}"),
    )?;
    let sock = inet_socket()?;
    let mut req = IfReq::new(name)?;
    ifreq_ioctl(
        sock.as_fd(),
        libc::SIOCGIFFLAGS,
        &mut req,
        &format!("reading {name}'s flags"),
    )?;
    let flags = req.flags() | libc::IFF_UP as libc::c_short;
    req.set_flags(flags);
    ifreq_ioctl(
        sock.as_fd(),
        libc::SIOCSIFFLAGS,
        &mut req,
        &format!("setting {name} up"),
    )?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use twig_net::{Counters, EgressPolicy};

    use super::*;
    use crate::resources::network::testing::{ip, plan_for, PodNs};
    use crate::resources::network::RECORD_FILE;

    /// A joiner that records what it was asked and answers `mac` or fails,
    /// pinning a file in `dir` as twig-net would.
    struct FakeJoiner {
        fail: bool,
        calls: Mutex<Vec<(PathBuf, String, String, Ipv4Addr)>>,
    }

    impl FakeJoiner {
        fn new(fail: bool) -> FakeJoiner {
            FakeJoiner {
                fail,
                calls: Mutex::new(Vec::new()),
            }
        }
    }

    impl Joiner for FakeJoiner {
        fn join(&self, dir: &Path, c: &PodNetConfig, _: &EgressPolicy) -> Result<[u8; 6]> {
            self.calls.lock().unwrap().push((
                c.netns.clone(),
                c.veth.clone(),
                c.tap.clone(),
                c.pod_ip,
            ));
            if self.fail {
                return Err(Error::Network {
                    what: "joining".into(),
                    source: twig_net::Error::Unsupported("no BPF here".into()),
                });
            }
            std::fs::create_dir_all(dir).unwrap();
            std::fs::write(dir.join("config"), "pinned").unwrap();
            Ok([0x0a, 0x58, 0x0a, 0xe7, 0x00, 0x02])
        }

        fn set_policy(&self, _: &Path, _: &EgressPolicy) -> Result<()> {
            unreachable!("the set-up tests change no policy")
        }

        fn counters(&self, _: &Path) -> Result<Counters> {
            unreachable!("the set-up tests read no counters")
        }
    }

    /// TUNGETIFF: the interface name behind a tap descriptor.
    fn tap_of(fd: BorrowedFd<'_>) -> String {
        let mut req = IfReq::new("x").unwrap();
        ifreq_ioctl(fd, libc::TUNGETIFF, &mut req, "TUNGETIFF").unwrap();
        let flags = req.flags();
        assert_eq!(
            libc::c_int::from(flags) & (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR),
            libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR
        );
        let len = req.name.iter().position(|b| *b == 0).unwrap();
        String::from_utf8_lossy(&req.name[..len]).into_owned()
    }

    #[test]
    fn the_default_gateway_comes_from_the_route_table() {
        let lines: Vec<String> = [
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT",
            "eth0\t00E7340A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0",
            "eth0\t00000000\t01E7340A\t0003\t0\t0\t0\t00000000\t0\t0\t0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(default_gateway(&lines), Some(Ipv4Addr::new(10, 52, 231, 1)));
        assert_eq!(default_gateway(&lines[..2]), None);
    }

    #[test]
    fn the_vm_gets_a_tap_in_the_pods_namespace_and_the_pods_identity() {
        let ns = PodNs::new(1);
        let state = tempfile::tempdir().unwrap();
        let record = state.path().join(RECORD_FILE);
        let dir = state.path().join("bpf").join("sb1");
        let joiner = FakeJoiner::new(false);
        let mut sent = None;
        let mut told = None;
        let net = PodNet::attach(
            &plan_for(&ns),
            &dir,
            &record,
            &joiner,
            |tap| {
                assert!(ns.has_link(TAP), "the tap is in the pod's namespace");
                assert!(
                    !Path::new("/sys/class/net").join(TAP).exists(),
                    "not in ours"
                );
                assert_eq!(
                    std::fs::read_to_string(&record).unwrap(),
                    dir.to_str().unwrap(),
                    "recorded before the VMM has the tap"
                );
                sent = Some((tap_of(tap), tap.try_clone_to_owned().unwrap()));
                Ok(())
            },
            |req| {
                told = Some(req.clone());
                Ok(())
            },
        )
        .unwrap();
        let calls = joiner.calls.lock().unwrap().clone();
        assert_eq!(
            calls,
            vec![(
                ns.path(),
                VETH.to_string(),
                TAP.to_string(),
                Ipv4Addr::new(10, 231, 1, 2)
            )]
        );
        let (name, fd) = sent.expect("the tap went to the VMM");
        assert_eq!(name, TAP);
        let told = told.expect("the guest was told");
        assert_eq!(told.interface, "eth0");
        assert_eq!(told.mac, "0a:58:0a:e7:00:02", "the veth's MAC");
        assert_eq!(told.ipv4_cidr, "10.231.1.2/24");
        assert_eq!(told.ipv4_gateway, "10.231.1.1");
        assert_eq!(net.identity(), &told);
        // The VMM's descriptor is the tap's last: closing it removes it.
        assert!(ns.has_link(TAP));
        drop(fd);
        assert!(!ns.has_link(TAP), "the tap goes with the VMM's descriptor");
        net.detach().unwrap();
        assert!(!dir.exists() && !record.exists(), "nothing left");
    }

    #[test]
    fn a_failed_set_up_leaves_nothing_and_sends_nothing() {
        let ns = PodNs::new(2);
        let state = tempfile::tempdir().unwrap();
        let record = state.path().join(RECORD_FILE);
        let dir = state.path().join("sb2");
        // The join fails: the VMM never gets a tap, the guest is not told.
        let e = PodNet::attach(
            &plan_for(&ns),
            &dir,
            &record,
            &FakeJoiner::new(true),
            |_| panic!("no tap is sent after a failed join"),
            |_| panic!("no identity after a failed join"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("no BPF here"), "{e}");
        assert!(!ns.has_link(TAP) && !record.exists() && !dir.exists());
        // The VMM refuses the tap, or the agent the identity: the joined
        // path is taken apart again.
        for failing_send in [true, false] {
            let e = PodNet::attach(
                &plan_for(&ns),
                &dir,
                &record,
                &FakeJoiner::new(false),
                |_| match failing_send {
                    true => Err(Error::Internal("the VMM said no".into())),
                    false => Ok(()),
                },
                |_| Err(Error::Internal("the agent said no".into())),
            )
            .unwrap_err();
            assert!(e.to_string().contains("said no"), "{e}");
            assert!(!ns.has_link(TAP), "tap gone");
            assert!(!record.exists() && !dir.exists(), "path and record gone");
        }
        // No namespace at that path: a clear error.
        let e = PodNet::attach(
            &Plan {
                netns: PathBuf::from("/var/run/netns/twig-no-such-ns"),
                policy: EgressPolicy::default(),
            },
            &dir,
            &record,
            &FakeJoiner::new(false),
            |_| Ok(()),
            |_| Ok(()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("twig-no-such-ns"), "{e}");
        // A namespace without CNI's eth0.
        assert!(ip(&["-n", &ns.name, "link", "del", "eth0"]));
        let e = PodNet::attach(
            &plan_for(&ns),
            &dir,
            &record,
            &FakeJoiner::new(false),
            |_| Ok(()),
            |_| Ok(()),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("eth0") && e.to_string().contains(&ns.name),
            "{e}"
        );
        assert!(!ns.has_link(TAP) && !record.exists());
    }
}
