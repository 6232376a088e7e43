//! Network interface configuration through the classic ioctls (no netlink,
//! no libc resolver): link up/down, MAC, IPv4 address, default route.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        return Err(format!("MAC {s:?} is not six colon-separated bytes"));
    }
    let mut mac = [0u8; 6];
    for (i, p) in parts.iter().enumerate() {
        if p.len() != 2 {
            return Err(format!("MAC {s:?}: {p:?} is not two hex digits"));
        }
        mac[i] = u8::from_str_radix(p, 16)
            .map_err(|_| format!("MAC {s:?}: {p:?} is not two hex digits"))?;
    }
    if mac[0] & 1 == 1 {
        return Err(format!("MAC {s:?} is a multicast address"));
    }
    Ok(mac)
}

/// Parses `10.0.0.2/24`.
pub fn parse_cidr(s: &str) -> Result<(Ipv4Addr, u8), String> {
    let (addr, prefix) = s
        .split_once('/')
        .ok_or_else(|| format!("IPv4 address {s:?} has no /prefix"))?;
    let addr: Ipv4Addr = addr
        .parse()
        .map_err(|e| format!("IPv4 address {addr:?}: {e}"))?;
    let prefix: u8 = prefix
        .parse()
        .ok()
        .filter(|p| *p <= 32)
        .ok_or_else(|| format!("prefix {prefix:?} is not 0-32"))?;
    Ok((addr, prefix))
}

/// The netmask of a prefix length.
pub fn netmask(prefix: u8) -> Ipv4Addr {
    if prefix == 0 {
        Ipv4Addr::UNSPECIFIED
    } else {
        Ipv4Addr::from(u32::MAX << (32 - u32::from(prefix)))
    }
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ifreq(name: &str) -> io::Result<libc::ifreq> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['/', '\0', ' ']) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("invalid interface name {name:?}"),
        ));
    }
    // SAFETY: ifreq is plain old data; all-zero is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

fn ioctl(sock: &OwnedFd, request: libc::c_ulong, arg: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: the callers pass a pointer to the struct the request expects.
    if unsafe { libc::ioctl(sock.as_raw_fd(), request as _, arg) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size (16 bytes).
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn set_flags(name: &str, up: bool) -> io::Result<()> {
    let sock = socket()?;
    let mut req = ifreq(name)?;
    ioctl(&sock, libc::SIOCGIFFLAGS, (&raw mut req).cast())?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    let flags = if up {
        flags | libc::IFF_UP as libc::c_short
    } else {
        flags & !(libc::IFF_UP as libc::c_short)
    };
    req.ifr_ifru.ifru_flags = flags;
    ioctl(&sock, libc::SIOCSIFFLAGS, (&raw mut req).cast())
}

/// Brings an interface up.
pub fn set_up(name: &str) -> io::Result<()> {
    set_flags(name, true)
}

/// Takes an interface down.
pub fn set_down(name: &str) -> io::Result<()> {
    set_flags(name, false)
}

/// Sets an Ethernet interface's MAC (the interface must be down).
pub fn set_mac(name: &str, mac: [u8; 6]) -> io::Result<()> {
    let sock = socket()?;
    let mut req = ifreq(name)?;
    // SAFETY: sockaddr is plain old data.
    let mut sa: libc::sockaddr = unsafe { std::mem::zeroed() };
    sa.sa_family = libc::ARPHRD_ETHER;
    for (dst, src) in sa.sa_data.iter_mut().zip(mac) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_hwaddr = sa;
    ioctl(&sock, libc::SIOCSIFHWADDR, (&raw mut req).cast())
}

/// Sets an interface's IPv4 address and netmask.
pub fn set_ipv4(name: &str, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
    let sock = socket()?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_addr = sockaddr_in(addr);
    ioctl(&sock, libc::SIOCSIFADDR, (&raw mut req).cast())?;
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_netmask = sockaddr_in(netmask(prefix));
    ioctl(&sock, libc::SIOCSIFNETMASK, (&raw mut req).cast())
}

fn default_route(gateway: Option<Ipv4Addr>, dev: &mut [u8]) -> libc::rtentry {
    // SAFETY: rtentry is plain old data; all-zero is valid.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr_in(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr_in(Ipv4Addr::UNSPECIFIED);
    rt.rt_flags = libc::RTF_UP;
    if let Some(gw) = gateway {
        rt.rt_gateway = sockaddr_in(gw);
        rt.rt_flags |= libc::RTF_GATEWAY;
    }
    rt.rt_dev = dev.as_mut_ptr().cast();
    rt
}

/// Replaces the default route with one through `gateway` on `name`.
pub fn set_default_route(name: &str, gateway: Ipv4Addr) -> io::Result<()> {
    let sock = socket()?;
    // Remove the old default routes (any device); ESRCH once none is left.
    for _ in 0..16 {
        let mut rt = default_route(None, &mut []);
        rt.rt_dev = std::ptr::null_mut();
        match ioctl(&sock, libc::SIOCDELRT, (&raw mut rt).cast()) {
            Ok(()) => continue,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => break,
            Err(e) => return Err(e),
        }
    }
    let mut dev: Vec<u8> = name.bytes().chain([0]).collect();
    let mut rt = default_route(Some(gateway), &mut dev);
    ioctl(&sock, libc::SIOCADDRT, (&raw mut rt).cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs() {
        assert_eq!(
            parse_mac("02:aB:00:11:22:ff").unwrap(),
            [2, 0xab, 0, 0x11, 0x22, 0xff]
        );
        for bad in [
            "",
            "02:ab:00:11:22",
            "02:ab:00:11:22:ff:00",
            "zz:ab:00:11:22:ff",
            "03:00:00:00:00:00",
            "2:ab:00:11:22:ff",
        ] {
            assert!(parse_mac(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn cidrs() {
        assert_eq!(
            parse_cidr("10.0.0.2/24").unwrap(),
            (Ipv4Addr::new(10, 0, 0, 2), 24)
        );
        assert_eq!(netmask(24), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(netmask(0), Ipv4Addr::UNSPECIFIED);
        assert_eq!(netmask(32), Ipv4Addr::BROADCAST);
        for bad in ["10.0.0.2", "10.0.0.2/33", "10.0.0/24", "x/1", "10.0.0.2/-1"] {
            assert!(parse_cidr(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_interface_names_are_rejected() {
        assert!(ifreq("").is_err());
        assert!(ifreq("a/b").is_err());
        assert!(ifreq(&"x".repeat(16)).is_err());
        assert!(ifreq("eth0").is_ok());
    }
}
