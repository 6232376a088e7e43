//! Port-forward into a pod's VM: every TCP connection to the loopback
//! addresses (127.0.0.1, ::1) of a pod's network namespace, on any port, is
//! accepted by one listening socket the caller holds (`bpf/forward.c`, an
//! `sk_lookup` program linked to the namespace, steering into a `SOCKMAP`).
//!
//! containerd's CRI PortForward enters the pod's namespace and dials
//! `localhost:<port>` there; on Twig the pod's processes run in its VM, so
//! the caller (the shim) accepts here and forwards each connection to that
//! port inside the guest. [`Forwarded`] says which port and family were
//! dialled.

use std::fs::File;
use std::io;
use std::net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use aya::maps::SockMap;
use aya::programs::SkLookup;
use aya::{Ebpf, EbpfLoader};

use crate::error::{Context, Error};
use crate::netns::{in_netns, open_netns};
use crate::FORWARD_OBJECT;

/// The program in `bpf/forward.c`.
const PROGRAM: &str = "loopback_to_shim";
/// Its one-entry `SOCKMAP`: the listening socket.
const LISTENER_MAP: &str = "forward_listener";
/// The listening socket's backlog: connections the kernel completes
/// before the caller accepts them.
const BACKLOG: libc::c_int = 128;

/// The port-forward of one pod's network namespace: the program linked to
/// the namespace and the listening socket it steers into. Dropping it
/// unlinks the program (the kernel's own lookup applies again) and closes
/// the socket; nothing is pinned, so a dead process leaves nothing behind.
pub struct PortForward {
    listener: TcpListener,
    /// Holds the program and its link to the namespace.
    _ebpf: Ebpf,
}

/// One connection accepted by [`PortForward::accept`].
#[derive(Debug)]
pub struct Forwarded {
    /// The connection, in the pod's namespace.
    pub stream: TcpStream,
    /// The port that was dialled.
    pub port: u16,
    /// Whether `::1` (rather than 127.0.0.1) was dialled.
    pub ipv6: bool,
}

impl std::fmt::Debug for PortForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortForward")
            .field("listener", &self.listener)
            .finish_non_exhaustive()
    }
}

impl PortForward {
    /// Creates the listening socket inside the network namespace `netns`
    /// (a file such as `/var/run/netns/cni-…`; the calling thread enters it
    /// and returns), loads the program, puts the socket in its map and
    /// links the program to the namespace. From then on every TCP
    /// connection to 127.0.0.1 or ::1 there, on any port, even one a socket
    /// of the namespace listens on, reaches [`accept`](Self::accept). On an
    /// error nothing stays linked.
    pub fn attach(netns: &Path) -> Result<PortForward, Error> {
        let ns = open_netns(netns)?;
        let listener = in_netns(&ns, netns, || {
            listen().context(|| "creating the port-forward listening socket".into())
        })?;
        let mut ebpf = EbpfLoader::new()
            // No CO-RE relocations: the kernel's BTF is not needed.
            .btf(None)
            .load(FORWARD_OBJECT)
            .context(|| "loading the port-forward eBPF object".into())?;
        let map = ebpf
            .map_mut(LISTENER_MAP)
            .ok_or_else(|| missing(LISTENER_MAP))?;
        let mut map = SockMap::try_from(map).context(|| format!("opening map {LISTENER_MAP}"))?;
        map.set(0, &listener, 0)
            .context(|| "putting the listening socket in the port-forward map".into())?;
        link(&mut ebpf, &ns, netns)?;
        Ok(PortForward {
            listener,
            _ebpf: ebpf,
        })
    }

    /// Waits for the next connection (blocking; no CPU while none comes).
    /// After [`close`](Self::close) it fails.
    pub fn accept(&self) -> io::Result<Forwarded> {
        let (stream, _peer) = self.listener.accept()?;
        let (port, ipv6) = dialled(stream.local_addr()?);
        Ok(Forwarded { stream, port, ipv6 })
    }

    /// Stops the listening socket: an [`accept`](Self::accept) waiting on
    /// another thread returns an error, and so does every later one; until
    /// the value is dropped, connections to the loopback find no listener
    /// (refused). Idempotent.
    pub fn close(&self) {
        // SAFETY: shutdown(2) on a descriptor this value owns.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
    }

    /// The listening socket (its own address is of no use to a client: the
    /// program steers by the dialled address, not this one).
    pub fn listener(&self) -> &TcpListener {
        &self.listener
    }
}

fn missing(name: &str) -> Error {
    Error::Bpf {
        what: format!("the port-forward object has no {name}"),
        source: "not found".into(),
    }
}

/// Loads the program and links it to the namespace open as `ns`.
fn link(ebpf: &mut Ebpf, ns: &File, netns: &Path) -> Result<(), Error> {
    let program: &mut SkLookup = ebpf
        .program_mut(PROGRAM)
        .ok_or_else(|| missing(PROGRAM))?
        .try_into()
        .context(|| format!("program {PROGRAM}"))?;
    program
        .load()
        .context(|| format!("loading program {PROGRAM} (verifier)"))?;
    program
        .attach(ns)
        .context(|| format!("linking {PROGRAM} to network namespace {}", netns.display()))?;
    Ok(())
}

/// The port and family a connection accepted with local address `local`
/// was dialled at (an IPv4 connection arrives on the dual-stack socket as
/// `::ffff:127.0.0.1`).
fn dialled(local: SocketAddr) -> (u16, bool) {
    match local {
        SocketAddr::V4(a) => (a.port(), false),
        SocketAddr::V6(a) => (a.port(), a.ip().to_ipv4_mapped().is_none()),
    }
}

/// A dual-stack IPv6 listening socket in the calling thread's namespace,
/// bound to `[::ffff:127.0.0.1]:0`: the program hands it connections of
/// both families (a socket must not be IPv6-only to take IPv4 ones).
fn listen() -> io::Result<TcpListener> {
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_INET6,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            libc::IPPROTO_TCP,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and nobody else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let off: libc::c_int = 0;
    // SAFETY: setsockopt(2) with an int option the size passed.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_IPV6,
            libc::IPV6_V6ONLY,
            (&off as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // Bound to an IPv4-mapped address: binding `::1` would make the socket
    // IPv6-only (the kernel sets that for any specific IPv6 address), and
    // the wildcard would expose its port on every address.
    bind(&fd, Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0x7f00, 1))?;
    // SAFETY: listen(2) on the socket above.
    if unsafe { libc::listen(fd.as_raw_fd(), BACKLOG) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(TcpListener::from(fd))
}

fn bind(fd: &OwnedFd, ip: Ipv6Addr) -> io::Result<()> {
    let sockaddr = libc::sockaddr_in6 {
        sin6_family: libc::AF_INET6 as libc::sa_family_t,
        sin6_port: 0,
        sin6_flowinfo: 0,
        sin6_addr: libc::in6_addr {
            s6_addr: ip.octets(),
        },
        sin6_scope_id: 0,
    };
    // SAFETY: bind(2) with a `sockaddr_in6` of the size passed.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sockaddr as *const libc::sockaddr_in6).cast(),
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dialled_port_and_family_come_from_the_local_address() {
        let v4: SocketAddr = "[::ffff:127.0.0.1]:8080".parse().expect("address");
        assert_eq!(dialled(v4), (8080, false));
        let v6: SocketAddr = "[::1]:53".parse().expect("address");
        assert_eq!(dialled(v6), (53, true));
        let plain: SocketAddr = "127.0.0.1:1".parse().expect("address");
        assert_eq!(dialled(plain), (1, false));
    }
}
