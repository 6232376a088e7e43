//! Running work inside a pod's network namespace, and the interface look-ups
//! done there (one socket, one `ioctl` each: no netlink dump).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::sched::{setns, CloneFlags};

use crate::Error;

/// Runs `work` in the network namespace open as `file`, on the calling
/// thread, and moves the thread back to its own namespace afterwards (also
/// when `work` fails or panics). No thread is spawned: on a busy node every
/// hand-off to another thread waits for a CPU.
pub(crate) fn in_netns<T, F>(file: &File, netns: &Path, work: F) -> Result<T, Error>
where
    F: FnOnce() -> Result<T, Error>,
{
    let own = Path::new("/proc/thread-self/ns/net");
    let home = File::open(own).map_err(|source| Error::Netns {
        path: own.to_owned(),
        source,
    })?;
    setns(file, CloneFlags::CLONE_NEWNET).map_err(|e| Error::Netns {
        path: netns.to_owned(),
        source: e.into(),
    })?;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
    if let Err(e) = setns(&home, CloneFlags::CLONE_NEWNET) {
        // A thread of the node's daemon left in a pod's namespace would do
        // its later work there: stop rather than go on.
        tracing::error!(error = %e, "cannot return to the thread's own network namespace");
        std::process::abort();
    }
    result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Opens the namespace file `netns`.
pub(crate) fn open_netns(netns: &Path) -> Result<File, Error> {
    File::open(netns).map_err(|source| Error::Netns {
        path: netns.to_owned(),
        source,
    })
}

/// The identity of an open namespace file: (`st_dev`, `st_ino`), the same for
/// every file naming the same namespace.
pub(crate) fn netns_id(file: &File, netns: &Path) -> Result<(u64, u64), Error> {
    let meta = file.metadata().map_err(|source| Error::Netns {
        path: netns.to_owned(),
        source,
    })?;
    Ok((meta.dev(), meta.ino()))
}

/// `struct ifreq`: the name, then a 24-byte union.
#[repr(C)]
struct IfReq {
    name: [u8; 16],
    data: [u8; 24],
}

/// `ARPHRD_ETHER`, the hardware type of an Ethernet address.
const ARPHRD_ETHER: u16 = 1;

/// A datagram socket in the current thread's namespace, for interface
/// `ioctl`s.
pub(crate) struct IfSocket {
    fd: OwnedFd,
}

impl IfSocket {
    /// Opens the socket (in the namespace of the calling thread).
    pub fn new() -> Result<Self, Error> {
        // SAFETY: socket(2) with constant arguments; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(Error::Bpf {
                what: "opening a socket for interface look-ups".into(),
                source: Box::new(std::io::Error::last_os_error()),
            });
        }
        // SAFETY: `fd` was just returned by socket(2) and nobody else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Self { fd })
    }

    fn request(name: &str) -> Option<IfReq> {
        let bytes = name.as_bytes();
        if bytes.is_empty() || bytes.len() >= 16 || bytes.contains(&0) {
            return None;
        }
        let mut req = IfReq {
            name: [0; 16],
            data: [0; 24],
        };
        req.name[..bytes.len()].copy_from_slice(bytes);
        Some(req)
    }

    fn ioctl(&self, request: libc::c_ulong, req: &mut IfReq) -> std::io::Result<()> {
        // SAFETY: the three requests used here (SIOCGIFINDEX, SIOCGIFHWADDR,
        // SIOCGIFNAME) read and write one `struct ifreq`, which `IfReq`
        // matches in size (40 bytes) and layout; `req` outlives the call.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), request, req as *mut IfReq) };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// The index of interface `name`.
    pub fn ifindex(&self, name: &str, netns: &Path) -> Result<u32, Error> {
        let missing = || Error::NoInterface {
            name: name.to_owned(),
            netns: netns.to_owned(),
        };
        let mut req = Self::request(name).ok_or_else(missing)?;
        self.ioctl(libc::SIOCGIFINDEX, &mut req)
            .map_err(|_| missing())?;
        let index = i32::from_ne_bytes([req.data[0], req.data[1], req.data[2], req.data[3]]);
        u32::try_from(index).map_err(|_| missing())
    }

    /// The Ethernet address of interface `name`.
    pub fn mac(&self, name: &str, netns: &Path) -> Result<[u8; 6], Error> {
        let mut req = Self::request(name).ok_or_else(|| Error::NoInterface {
            name: name.to_owned(),
            netns: netns.to_owned(),
        })?;
        self.ioctl(libc::SIOCGIFHWADDR, &mut req)
            .map_err(|e| Error::Bpf {
                what: format!("reading the hardware address of {name:?}"),
                source: Box::new(e),
            })?;
        // `struct sockaddr`: the family, then the address bytes.
        let family = u16::from_ne_bytes([req.data[0], req.data[1]]);
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&req.data[2..8]);
        if family != ARPHRD_ETHER || mac == [0; 6] {
            return Err(Error::NoMac(name.to_owned()));
        }
        Ok(mac)
    }

    /// The name of the interface with index `ifindex`, if there is one.
    pub fn name(&self, ifindex: u32) -> Option<String> {
        let mut req = IfReq {
            name: [0; 16],
            data: [0; 24],
        };
        req.data[..4].copy_from_slice(&i32::try_from(ifindex).ok()?.to_ne_bytes());
        self.ioctl(libc::SIOCGIFNAME, &mut req).ok()?;
        let len = req.name.iter().position(|&b| b == 0).unwrap_or(16);
        String::from_utf8(req.name[..len].to_vec()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_found_by_name_and_index_and_has_no_ethernet_address() {
        let netns = Path::new("/proc/self/ns/net");
        let socket = IfSocket::new().expect("socket");
        let index = socket.ifindex("lo", netns).expect("lo");
        assert_eq!(socket.name(index).as_deref(), Some("lo"));
        assert!(matches!(socket.mac("lo", netns), Err(Error::NoMac(_))));
        for bad in ["", "a-name-longer-than-15", "nul\0name", "no-such-if"] {
            assert!(
                matches!(socket.ifindex(bad, netns), Err(Error::NoInterface { .. })),
                "{bad:?}"
            );
        }
    }
}
