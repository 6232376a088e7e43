//! Running work inside a pod's network namespace.

use std::fs::File;
use std::path::Path;

use nix::ifaddrs::getifaddrs;
use nix::net::if_::if_nametoindex;
use nix::sched::{setns, CloneFlags};

use crate::Error;

/// Runs `work` on a fresh thread that has joined the network namespace at
/// `netns` (the caller's thread never changes namespace).
pub(crate) fn in_netns<T, F>(netns: &Path, work: F) -> Result<T, Error>
where
    T: Send,
    F: FnOnce() -> Result<T, Error> + Send,
{
    let file = File::open(netns).map_err(|source| Error::Netns {
        path: netns.to_owned(),
        source,
    })?;
    std::thread::scope(|scope| {
        let thread = scope.spawn(move || {
            setns(&file, CloneFlags::CLONE_NEWNET).map_err(|e| Error::Netns {
                path: netns.to_owned(),
                source: e.into(),
            })?;
            work()
        });
        thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// The index of interface `name` in the current thread's namespace.
pub(crate) fn ifindex(name: &str, netns: &Path) -> Result<u32, Error> {
    if_nametoindex(name).map_err(|_| Error::NoInterface {
        name: name.to_owned(),
        netns: netns.to_owned(),
    })
}

/// The Ethernet address of interface `name` in the current thread's namespace.
pub(crate) fn mac_of(name: &str) -> Result<[u8; 6], Error> {
    let addrs = getifaddrs().map_err(|e| Error::Bpf {
        what: "getifaddrs".into(),
        source: Box::new(e),
    })?;
    addrs
        .filter(|ifaddr| ifaddr.interface_name == name)
        .find_map(|ifaddr| {
            ifaddr
                .address
                .and_then(|a| a.as_link_addr().and_then(|l| l.addr()))
        })
        .ok_or_else(|| Error::NoMac(name.to_owned()))
}
