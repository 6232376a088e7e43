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

use containerd_shim_protos::ttrpc;
use serde_json::Value;
use std::sync::{Mutex, PoisonError};
use twig_agent::proto::agent::ReidentifyRequest;

use twig_net::{AttachMode, Counters, EgressPolicy, Loader, NodeContext, PodNetConfig, PodNetwork};

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
    /// Replaces the policy of the path `join` pinned in `dir`, while the
    /// pod runs; a policy that does not compile changes nothing.
    fn set_policy(&self, dir: &Path, policy: &EgressPolicy) -> Result<()>;
    /// The counters of the path pinned in `dir`.
    fn counters(&self, dir: &Path) -> Result<Counters>;
}

/// Moves a prepared twig-net set to the pod's directory (`dir`, not yet
/// existing); `false` when none was moved.
type TakeSet = Box<dyn Fn(&Path) -> bool + Send + Sync>;

/// The [`Joiner`]: twig-net's eBPF programs. It first asks the node daemon
/// for a prepared set (`AcquireNetSet`: maps created, programs verified and
/// pinned, moved into the pod's directory) and attaches it from its pins;
/// only when the daemon has none (or does not answer) does it load a set
/// itself, with a [`Loader`] made on that first need (making one parses the
/// kernel's BTF and probes the kernel: ~10 ms kept off the common path).
pub struct Bpf {
    node: NodeContext,
    take: TakeSet,
    loader: Mutex<Option<Loader>>,
}

impl Bpf {
    /// A joiner that takes prepared sets from the node daemon on
    /// `node_socket`, the node's addresses denied to pods and `cluster_dns`
    /// allowed for DNS. A node whose kernel cannot run twig-net has no
    /// prepared sets, and the loader this joiner then makes refuses the
    /// pod: never run unfiltered.
    pub fn new(cluster_dns: &[Ipv4Addr], node_socket: &Path) -> Result<Bpf> {
        let node_socket = node_socket.to_path_buf();
        Ok(Bpf::with_take(
            NodeContext {
                node_addrs: node_addresses()?,
                cluster_dns: cluster_dns.to_vec(),
            },
            Box::new(move |dir| take_from_node(&node_socket, dir)),
        ))
    }

    fn with_take(node: NodeContext, take: TakeSet) -> Bpf {
        Bpf {
            node,
            take,
            loader: Mutex::new(None),
        }
    }

    /// Attaches with this process's own loader (made on first use).
    fn attach_own(
        &self,
        dir: &Path,
        config: &PodNetConfig,
        policy: &EgressPolicy,
    ) -> Result<[u8; 6]> {
        let mut loader = self.loader.lock().unwrap_or_else(PoisonError::into_inner);
        let loader = match &mut *loader {
            Some(l) => l,
            empty => empty.insert(checked_loader(Loader::new())?),
        };
        let (_, mac) = loader
            .attach(dir, config, policy, &self.node)
            .map_err(|source| joining(config, source))?;
        Ok(mac)
    }
}

/// The error of a failed join.
fn joining(config: &PodNetConfig, source: twig_net::Error) -> Error {
    Error::Network {
        what: format!(
            "joining tap {} and veth {} in {}",
            config.tap,
            config.veth,
            config.netns.display()
        ),
        source,
    }
}

/// The decision on the loader a joiner got: a kernel that cannot run
/// twig-net refuses the pod.
fn checked_loader(loader: std::result::Result<Loader, twig_net::Error>) -> Result<Loader> {
    loader.map_err(|source| Error::Network {
        what: "the pod has a network namespace, but its egress policy cannot be enforced \
               on this node (the pod is refused rather than run unfiltered)"
            .into(),
        source,
    })
}

/// How long the shim waits for the node daemon's `AcquireNetSet`.
const ACQUIRE_NET_SET_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// `AcquireNetSet` on the node daemon: whether it moved a prepared set to
/// `dir`. Any failure is logged and means "no": the shim loads its own.
fn take_from_node(node_socket: &Path, dir: &Path) -> bool {
    let request = twig_proto::node::AcquireNetSetRequest {
        dir: dir.to_string_lossy().into_owned(),
        sandbox_id: dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        ..Default::default()
    };
    let answer = ttrpc::Client::connect(&format!("unix://{}", node_socket.display()))
        .map_err(|e| e.to_string())
        .and_then(|client| {
            twig_proto::node_ttrpc::PoolClient::new(client)
                .acquire_net_set(
                    ttrpc::context::with_timeout(
                        i64::try_from(ACQUIRE_NET_SET_TIMEOUT.as_nanos()).unwrap_or(i64::MAX),
                    ),
                    &request,
                )
                .map_err(|e| e.to_string())
        });
    match answer {
        Ok(a) => a.taken,
        Err(e) => {
            tracing::warn!(socket = %node_socket.display(), dir = %dir.display(), "no prepared twig-net set from the node daemon, loading one: {e}");
            false
        }
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
        let prepared = dir.symlink_metadata().is_err() && (self.take)(dir);
        let mac = if prepared {
            let mode = AttachMode::from_env().map_err(|source| Error::Network {
                what: "choosing how to attach the pod's network".into(),
                source,
            })?;
            let mode = mode.unwrap_or(AttachMode::Netlink);
            let (_, mac) = Loader::attach_prepared(dir, config, policy, &self.node, mode)
                .map_err(|source| joining(config, source))?;
            mac
        } else {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
            self.attach_own(dir, config, policy)?
        };
        tracing::info!(dir = %dir.display(), prepared, "twig-net set attached");
        Ok(mac)
    }

    fn set_policy(&self, dir: &Path, policy: &EgressPolicy) -> Result<()> {
        PodNetwork::open(dir)
            .and_then(|mut path| path.update_policy(policy, &self.node))
            .map_err(|source| Error::Network {
                what: format!("replacing the egress policy pinned in {}", dir.display()),
                source,
            })
    }

    fn counters(&self, dir: &Path) -> Result<Counters> {
        PodNetwork::open(dir)
            .and_then(|path| path.counters())
            .map_err(|source| Error::Network {
                what: format!("reading the counters pinned in {}", dir.display()),
                source,
            })
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::sync::Mutex;

    fn ip(args: &[&str]) -> bool {
        Command::new("ip")
            .args(args)
            .output()
            .expect("run ip (iproute2)")
            .status
            .success()
    }

    /// A pod network namespace as CNI's bridge plugin leaves it: `eth0`
    /// (one end of a veth) with `10.231.<n>.2/24` and a default route via
    /// `.1`. Removed on drop.
    struct PodNs {
        name: String,
        host: String,
    }

    impl PodNs {
        fn new(n: u8) -> PodNs {
            let name = format!("twigshim{}-{n}", std::process::id());
            let host = format!("tsh{}h{n}", std::process::id() % 100_000);
            let ns = PodNs { name, host };
            let (name, host) = (ns.name.as_str(), ns.host.as_str());
            let addr = format!("10.231.{n}.2/24");
            let gw = format!("10.231.{n}.1");
            for args in [
                vec!["netns", "add", name],
                vec![
                    "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", name,
                ],
                vec!["-n", name, "addr", "add", &addr, "dev", "eth0"],
                vec!["-n", name, "link", "set", "eth0", "up"],
                vec!["-n", name, "link", "set", "lo", "up"],
                vec!["link", "set", host, "up"],
                vec!["-n", name, "route", "add", "default", "via", &gw],
            ] {
                assert!(ip(&args), "ip {args:?} (the test needs root)");
            }
            ns
        }

        fn path(&self) -> PathBuf {
            PathBuf::from("/var/run/netns").join(&self.name)
        }

        fn has_link(&self, link: &str) -> bool {
            ip(&["-n", &self.name, "link", "show", link])
        }
    }

    impl Drop for PodNs {
        fn drop(&mut self) {
            let _ = ip(&["netns", "del", &self.name]);
            let _ = ip(&["link", "del", &self.host]);
        }
    }

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

    fn plan_for(ns: &PodNs) -> Plan {
        Plan {
            netns: ns.path(),
            policy: EgressPolicy::default(),
        }
    }

    #[test]
    fn the_spec_names_the_network_namespace_and_the_policy() {
        let none =
            serde_json::json!({"linux": {"namespaces": [{"type": "pid"}, {"type": "network"}]}});
        assert_eq!(
            plan(&none).unwrap(),
            None,
            "a new namespace, not CNI's: no network"
        );
        assert_eq!(plan(&serde_json::json!({})).unwrap(), None);
        let cri = serde_json::json!({
            "linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/cni-1"}]},
            "annotations": {"twig.dev/egress-policy": "{\"allow\":[{\"cidr\":\"10.88.0.0/16\"}]}"}
        });
        let p = plan(&cri).unwrap().unwrap();
        assert_eq!(p.netns, PathBuf::from("/var/run/netns/cni-1"));
        assert_eq!(p.policy.allow.len(), 1);
        let bad = serde_json::json!({
            "linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/cni-1"}]},
            "annotations": {"twig.dev/egress-policy": "{\"allow\":[{\"cidr\":\"nonsense\"}]}"}
        });
        let e = plan(&bad).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_))
                && e.to_string().contains("twig.dev/egress-policy"),
            "{e}"
        );
    }

    #[test]
    fn without_bpf_the_pod_is_refused_never_run_unfiltered() {
        let e = checked_loader(Err(twig_net::Error::Unsupported("BPF disabled".into())))
            .err()
            .unwrap();
        assert_eq!(
            e.code(),
            containerd_shim_protos::ttrpc::Code::FAILED_PRECONDITION
        );
        let msg = e.to_string();
        assert!(
            msg.contains("refused rather than run unfiltered") && msg.contains("BPF disabled"),
            "{msg}"
        );
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

    /// A private bpffs on a temporary directory, unmounted on drop.
    struct Bpffs(tempfile::TempDir);

    impl Drop for Bpffs {
        fn drop(&mut self) {
            let _ = nix::mount::umount2(self.0.path(), nix::mount::MntFlags::MNT_DETACH);
        }
    }

    #[test]
    fn twig_net_joins_the_tap_and_the_veth_and_teardown_removes_every_pin() {
        let ns = PodNs::new(3);
        let bpffs = Bpffs(tempfile::tempdir().unwrap());
        let state = tempfile::tempdir().unwrap();
        let record = state.path().join(RECORD_FILE);
        let dir = bpffs.0.path().join("sb3");
        // No node daemon answers there: the joiner loads its own set.
        let joiner = Bpf::new(&[], &state.path().join("no-node.sock")).unwrap();
        let mut vmm_tap = None;
        let net = PodNet::attach(
            &plan_for(&ns),
            &dir,
            &record,
            &joiner,
            |tap| {
                vmm_tap = Some(tap.try_clone_to_owned().unwrap());
                Ok(())
            },
            |_| Ok(()),
        )
        .unwrap();
        let filters = |dev: &str| {
            let out = Command::new("tc")
                .args(["-n", &ns.name, "filter", "show", "dev", dev, "ingress"])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        assert!(filters(TAP).contains("bpf"), "tap: {}", filters(TAP));
        assert!(filters(VETH).contains("bpf"), "veth: {}", filters(VETH));
        assert!(dir.join("config").exists(), "pinned");
        // The shim died: `delete` finds the path through the record; the
        // VMM (holding the tap) is killed first.
        drop(net);
        drop(vmm_tap);
        teardown_recorded(state.path()).unwrap();
        assert!(!dir.exists(), "no pinned directory left");
        assert!(!record.exists());
        assert!(!filters(VETH).contains("bpf"), "the veth carries nothing");
        assert!(!ns.has_link(TAP));
        // Again: nothing to do, no error.
        teardown_recorded(state.path()).unwrap();
        teardown(&dir).unwrap();
    }

    /// A set the node daemon prepared is moved into the pod's directory and
    /// attached from its pins (no loader in the shim); a shim that dies
    /// after the move but before the attach leaves pins `teardown` removes.
    #[test]
    fn a_prepared_set_from_the_node_is_attached_and_one_never_attached_is_torn_down() {
        let ns = PodNs::new(4);
        let bpffs = Bpffs(tempfile::tempdir().unwrap());
        let state = tempfile::tempdir().unwrap();
        let record = state.path().join(RECORD_FILE);
        twig_net::ensure_bpffs(bpffs.0.path()).unwrap();
        let pool = bpffs.0.path().join("pool");
        std::fs::create_dir(&pool).unwrap();
        let preparer = Loader::new().expect("twig-net runs here (root, BPF)");
        for set in ["s1", "s2"] {
            preparer.prepare(&pool.join(set)).unwrap();
        }
        let staged = Mutex::new(vec![pool.join("s1"), pool.join("s2")]);
        let joiner = Bpf::with_take(
            NodeContext::default(),
            Box::new(move |dir| {
                let set = staged.lock().unwrap().pop();
                set.is_some_and(|set| std::fs::rename(set, dir).is_ok())
            }),
        );
        let dir = bpffs.0.path().join("sb4");
        let mut vmm_tap = None;
        let net = PodNet::attach(
            &plan_for(&ns),
            &dir,
            &record,
            &joiner,
            |tap| {
                vmm_tap = Some(tap.try_clone_to_owned().unwrap());
                Ok(())
            },
            |_| Ok(()),
        )
        .unwrap();
        assert!(
            joiner.loader.lock().unwrap().is_none(),
            "no loader was needed"
        );
        assert!(!pool.join("s2").exists(), "the prepared set was used");
        assert!(dir.join("prog_tap").exists() && !dir.join("ready_tap").exists());
        let out = Command::new("tc")
            .args(["-n", &ns.name, "filter", "show", "dev", VETH, "ingress"])
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).contains("bpf"));
        drop(vmm_tap);
        net.detach().unwrap();
        assert!(!dir.exists() && !record.exists());

        // Moved to a pod's directory, never attached (the shim died).
        let orphan = bpffs.0.path().join("sb5");
        std::fs::rename(pool.join("s1"), &orphan).unwrap();
        teardown(&orphan).unwrap();
        assert!(!orphan.exists(), "the unattached set's pins are removed");
    }
}
