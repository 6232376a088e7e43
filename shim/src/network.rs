//! A pod's network for its VM. Under CRI the sandbox's OCI spec names the
//! network namespace CNI set up (`linux.namespaces[type=network].path`,
//! holding the pod's veth `eth0` with the pod's IP and a default route).
//! After every restore of the pod's VM the shim, on a thread of its own
//! inside that namespace, reads `eth0`'s IPv4 address and prefix and the
//! default gateway and creates the VM's tap there; joins tap and veth
//! through the [`Joiner`] seam (twig-net's eBPF path, [`Bpf`], with the
//! pod's egress policy, pinned under `<bpffs_root>/<sandbox id>`); sends the
//! tap to the VMM (`attach_net`); and has the agent give the guest's `eth0`
//! the veth's MAC, the pod's IP and the gateway (`Reidentify`). A sandbox
//! without a network namespace (`ctr run`) gets a VM without network.
//!
//! The pinned directory is recorded in the sandbox's state directory
//! ([`RECORD_FILE`]) before anything is attached, so a shim that dies
//! leaves a name for `delete` to tear the path down with ([`teardown`]).

use std::fs::File;
use std::io::BufRead;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use serde_json::Value;
use twig_agent::proto::agent::ReidentifyRequest;
use twig_net::{EgressPolicy, Loader, NodeContext, PodNetConfig, PodNetwork};

use crate::error::{Error, Result};
use crate::spec;

/// CNI's interface in the pod's namespace: the pod's veth.
pub const VETH: &str = "eth0";
/// The guest's network interface (its only virtio-net device).
pub const GUEST_INTERFACE: &str = "eth0";
/// The VM's tap, created in the pod's namespace (one VM per namespace).
pub const TAP: &str = "twig0";
/// The file in the sandbox's state directory naming its pinned bpffs
/// directory while a path may be attached.
pub const RECORD_FILE: &str = "network";

/// What the sandbox's spec asks for: the pod's network namespace and the
/// egress policy its frames are held to.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The pod's network namespace (a file such as `/var/run/netns/cni-…`).
    pub netns: PathBuf,
    /// The pod's egress policy (its `twig.dev/egress-policy` annotation, or
    /// the built-in default).
    pub policy: EgressPolicy,
}

/// The network the sandbox's `spec` asks for: `None` when it names no
/// network namespace (the VM gets no network). A malformed egress-policy
/// annotation is an error, never a fall-back to the default.
pub fn plan(spec: &Value) -> Result<Option<Plan>> {
    let netns = spec
        .pointer("/linux/namespaces")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .find(|ns| ns.get("type").and_then(Value::as_str) == Some("network"))
        .and_then(|ns| ns.get("path").and_then(Value::as_str))
        .filter(|p| !p.is_empty());
    let Some(netns) = netns else {
        return Ok(None);
    };
    let policy = twig_net::effective_policy(
        None,
        spec::annotation(spec, twig_net::EGRESS_POLICY_ANNOTATION),
    )
    .map_err(|e| Error::InvalidArgument(format!("the pod's egress policy: {e}")))?;
    Ok(Some(Plan {
        netns: PathBuf::from(netns),
        policy,
    }))
}

/// The seam between the shim and the pod's data path: joins the VM's tap
/// and the pod's veth in the pod's namespace, and takes them apart.
pub trait Joiner: Send + Sync {
    /// Joins `config.tap` and `config.veth` in `config.netns` under
    /// `policy`, pinned in `dir`; returns the veth's MAC (the guest's).
    /// On an error nothing stays attached or pinned.
    fn join(&self, dir: &Path, config: &PodNetConfig, policy: &EgressPolicy) -> Result<[u8; 6]>;
}

/// The [`Joiner`]: twig-net's eBPF programs, attached by its [`Loader`].
pub struct Bpf {
    loader: Loader,
    node: NodeContext,
}

impl Bpf {
    /// A joiner on this kernel, the node's addresses denied to pods and
    /// `cluster_dns` allowed for DNS. Fails when the kernel cannot run
    /// twig-net: the sandbox is then refused, never run unfiltered.
    pub fn new(cluster_dns: &[Ipv4Addr]) -> Result<Bpf> {
        let node = NodeContext {
            node_addrs: node_addresses()?,
            cluster_dns: cluster_dns.to_vec(),
        };
        Bpf::with_loader(Loader::new(), node)
    }

    /// The decision [`Bpf::new`] makes on the loader it got.
    fn with_loader(
        loader: std::result::Result<Loader, twig_net::Error>,
        node: NodeContext,
    ) -> Result<Bpf> {
        let loader = loader.map_err(|source| Error::Network {
            what: "the pod has a network namespace, but its egress policy cannot be enforced \
                   on this node (the pod is refused rather than run unfiltered)"
                .into(),
            source,
        })?;
        Ok(Bpf { loader, node })
    }
}

impl Joiner for Bpf {
    fn join(&self, dir: &Path, config: &PodNetConfig, policy: &EgressPolicy) -> Result<[u8; 6]> {
        if let Some(root) = dir.parent() {
            twig_net::ensure_bpffs(root).map_err(|source| Error::Network {
                what: format!("preparing the bpffs at {}", root.display()),
                source,
            })?;
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let (_, mac) = self
            .loader
            .attach(dir, config, policy, &self.node)
            .map_err(|source| Error::Network {
                what: format!(
                    "joining tap {} and veth {} in {}",
                    config.tap,
                    config.veth,
                    config.netns.display()
                ),
                source,
            })?;
        Ok(mac)
    }
}

/// The host's own IPv4 addresses (loopback aside), denied to pods unless
/// their policy allows them.
fn node_addresses() -> Result<Vec<Ipv4Addr>> {
    let addrs = nix::ifaddrs::getifaddrs()
        .map_err(|e| Error::io("listing the node's addresses", e.into()))?;
    let mut out: Vec<Ipv4Addr> = addrs
        .filter_map(|a| a.address?.as_sockaddr_in().map(|s| s.ip()))
        .filter(|ip| !ip.is_loopback())
        .collect();
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Tears down the path pinned in `dir` (programs detached, pins removed)
/// and removes `dir`. Nothing pinned there (never attached, or torn down
/// already) is no error.
pub fn teardown(dir: &Path) -> Result<()> {
    match PodNetwork::open(dir) {
        Ok(path) => path.detach().map_err(|source| Error::Network {
            what: format!("detaching the pod network pinned at {}", dir.display()),
            source,
        })?,
        // Never attached, torn down already, or an attach cut short (a
        // killed shim): remove what pins are left.
        Err(twig_net::Error::NotAttached { .. }) => remove_leftover_pins(dir)?,
        Err(source) => {
            return Err(Error::Network {
                what: format!("opening the pod network pinned at {}", dir.display()),
                source,
            })
        }
    }
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::io(format!("removing {}", dir.display()), e))
        }
        _ => Ok(()),
    }
}

/// Removes the files left in `dir` (pins of an attach that never
/// completed), if it exists.
fn remove_leftover_pins(dir: &Path) -> Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(format!("listing {}", dir.display()), e)),
    };
    for entry in entries {
        let path = entry
            .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?
            .path();
        tracing::warn!(pin = %path.display(), "removing a pin left by an incomplete attach");
        std::fs::remove_file(&path)
            .map_err(|e| Error::io(format!("removing {}", path.display()), e))?;
    }
    Ok(())
}

/// Tears down the path a sandbox's state directory records, if any, and
/// the record; for `delete` after the shim died.
pub fn teardown_recorded(state_dir: &Path) -> Result<()> {
    let record = state_dir.join(RECORD_FILE);
    let dir = match std::fs::read_to_string(&record) {
        Ok(d) => PathBuf::from(d.trim()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(format!("reading {}", record.display()), e)),
    };
    teardown(&dir)?;
    remove_record(&record)
}

fn remove_record(record: &Path) -> Result<()> {
    match std::fs::remove_file(record) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::io(format!("removing {}", record.display()), e))
        }
        _ => Ok(()),
    }
}

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
