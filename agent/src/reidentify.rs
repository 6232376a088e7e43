//! A new identity after a restore or clone: entropy and a reseeded CRNG,
//! hostname, MAC, IPv4 address, default route, wall clock.

use std::os::fd::AsRawFd;

use twig_agent::proto::agent::ReidentifyRequest;

use crate::error::{AgentError, Result};
use crate::netdev;

/// RNDADDENTROPY = _IOW('R', 0x03, int[2])
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// RNDRESEEDCRNG = _IO('R', 0x07)
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
/// The most entropy one request may carry.
pub const MAX_ENTROPY_BYTES: usize = 4096;

/// Checks every field before anything is changed.
pub fn validate(req: &ReidentifyRequest) -> Result<()> {
    let bad = |m: String| AgentError::InvalidArgument(m);
    if !req.hostname.is_empty()
        && (req.hostname.len() > 64
            || !req
                .hostname
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'))
    {
        return Err(bad(format!(
            "hostname {:?}: use at most 64 of [A-Za-z0-9.-]",
            req.hostname
        )));
    }
    let wants_net =
        !req.mac.is_empty() || !req.ipv4_cidr.is_empty() || !req.ipv4_gateway.is_empty();
    if wants_net && req.interface.is_empty() {
        return Err(bad(
            "mac, ipv4_cidr or ipv4_gateway given without interface".to_string(),
        ));
    }
    if !req.mac.is_empty() {
        netdev::parse_mac(&req.mac).map_err(bad)?;
    }
    if !req.ipv4_cidr.is_empty() {
        netdev::parse_cidr(&req.ipv4_cidr).map_err(bad)?;
    }
    if !req.ipv4_gateway.is_empty() {
        req.ipv4_gateway
            .parse::<std::net::Ipv4Addr>()
            .map_err(|e| bad(format!("gateway {:?}: {e}", req.ipv4_gateway)))?;
    }
    if req.entropy.len() > MAX_ENTROPY_BYTES {
        return Err(bad(format!(
            "entropy: {} bytes, at most {MAX_ENTROPY_BYTES}",
            req.entropy.len()
        )));
    }
    if req.realtime_ns > i64::MAX as u64 {
        return Err(bad(format!("realtime_ns {} out of range", req.realtime_ns)));
    }
    if let Some(envd) = req.envd.as_ref() {
        if !envd.token_sha256.is_empty() && envd.token_sha256.len() != 32 {
            return Err(bad(format!(
                "envd.token_sha256: {} bytes, a SHA-256 has 32",
                envd.token_sha256.len()
            )));
        }
    }
    Ok(())
}

/// Applies the request; returns the wall clock before it was stepped.
pub fn apply(req: &ReidentifyRequest) -> Result<u64> {
    validate(req)?;
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME)
        .map_err(|e| AgentError::sys("reading CLOCK_REALTIME", e))?;
    let previous = u64::try_from(now.tv_sec()).unwrap_or_default() * 1_000_000_000
        + u64::try_from(now.tv_nsec()).unwrap_or_default();
    if !req.entropy.is_empty() {
        add_entropy(&req.entropy)?;
    }
    if !req.hostname.is_empty() {
        nix::unistd::sethostname(&req.hostname)
            .map_err(|e| AgentError::sys(format!("setting hostname {:?}", req.hostname), e))?;
    }
    if !req.interface.is_empty() {
        configure_interface(req)?;
    }
    if req.realtime_ns != 0 {
        let ts = nix::sys::time::TimeSpec::new(
            (req.realtime_ns / 1_000_000_000) as libc::time_t,
            (req.realtime_ns % 1_000_000_000) as libc::c_long,
        );
        nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, ts)
            .map_err(|e| AgentError::sys("setting CLOCK_REALTIME", e))?;
    }
    tracing::info!(hostname = %req.hostname, interface = %req.interface, ip = %req.ipv4_cidr, "reidentified");
    Ok(previous)
}

/// Sets `hostname` in the UTS namespace of the running process `pid` (a
/// restored pod's container with its own UTS namespace keeps the hostname
/// of the pod it was snapshotted in otherwise), from a short-lived thread
/// that joins the namespace, so the agent's own threads stay where they are.
pub fn set_hostname_of(pid: i32, hostname: &str) -> Result<()> {
    let path = format!("/proc/{pid}/ns/uts");
    let ns =
        std::fs::File::open(&path).map_err(|e| AgentError::sys(format!("opening {path}"), e))?;
    let name = hostname.to_string();
    std::thread::Builder::new()
        .name("set-hostname".into())
        .spawn(move || -> Result<()> {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWUTS)
                .map_err(|e| AgentError::sys(format!("joining {path}"), e))?;
            nix::unistd::sethostname(&name)
                .map_err(|e| AgentError::sys(format!("setting hostname {name:?} in {path}"), e))
        })
        .map_err(|e| AgentError::sys("starting a thread to set a container's hostname", e))?
        .join()
        .map_err(|_| AgentError::Internal("the thread setting a hostname panicked".into()))?
}

fn configure_interface(req: &ReidentifyRequest) -> Result<()> {
    let ifname = req.interface.as_str();
    let net = |what: &str, e: std::io::Error| AgentError::sys(format!("{ifname}: {what}"), e);
    if !req.mac.is_empty() {
        let mac = netdev::parse_mac(&req.mac).map_err(AgentError::InvalidArgument)?;
        netdev::set_down(ifname).map_err(|e| net("taking the link down", e))?;
        netdev::set_mac(ifname, mac).map_err(|e| net(&format!("setting MAC {}", req.mac), e))?;
    }
    netdev::set_up(ifname).map_err(|e| net("bringing the link up", e))?;
    if !req.ipv4_cidr.is_empty() {
        let (addr, prefix) =
            netdev::parse_cidr(&req.ipv4_cidr).map_err(AgentError::InvalidArgument)?;
        netdev::set_ipv4(ifname, addr, prefix)
            .map_err(|e| net(&format!("setting address {}", req.ipv4_cidr), e))?;
    }
    if !req.ipv4_gateway.is_empty() {
        let gw = req
            .ipv4_gateway
            .parse()
            .map_err(|e| AgentError::InvalidArgument(format!("gateway: {e}")))?;
        netdev::set_default_route(ifname, gw)
            .map_err(|e| net(&format!("default route via {gw}"), e))?;
    }
    Ok(())
}

/// Mixes `entropy` into the kernel's pool, crediting it, then forces the
/// CRNG to reseed so that clones of one snapshot diverge at once.
fn add_entropy(entropy: &[u8]) -> Result<()> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| AgentError::sys("opening /dev/urandom", e))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info: Vec<u8> = Vec::with_capacity(8 + entropy.len());
    let bits = i32::try_from(entropy.len() * 8).unwrap_or(i32::MAX);
    let size = i32::try_from(entropy.len()).unwrap_or(i32::MAX);
    info.extend_from_slice(&bits.to_ne_bytes());
    info.extend_from_slice(&size.to_ne_bytes());
    info.extend_from_slice(entropy);
    info.resize(info.len().next_multiple_of(4), 0);
    // SAFETY: the buffer holds a complete rand_pool_info.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } < 0 {
        return Err(AgentError::sys(
            "RNDADDENTROPY",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG as _) } < 0 {
        return Err(AgentError::sys(
            "RNDRESEEDCRNG",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> ReidentifyRequest {
        ReidentifyRequest::default()
    }

    #[test]
    fn a_process_in_its_own_uts_namespace_gets_the_new_hostname() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test needs root (setns, sethostname)"
        );
        let ours = nix::unistd::gethostname().unwrap();
        let mut child = std::process::Command::new("unshare")
            .args(["--uts", "sleep", "1000"])
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let own_ns = std::fs::read_link("/proc/self/ns/uts").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::fs::read_link(format!("/proc/{pid}/ns/uts")).ok() == Some(own_ns.clone())
            || !std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.starts_with(b"sleep"))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "unshare did not start"
            );
            std::thread::yield_now();
        }
        set_hostname_of(pid, "clone-7").unwrap();
        let out = std::process::Command::new("nsenter")
            .args(["-t", &pid.to_string(), "-u", "hostname"])
            .output()
            .unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "clone-7");
        assert_eq!(
            nix::unistd::gethostname().unwrap(),
            ours,
            "ours is untouched"
        );
        let e = set_hostname_of(pid, "clone-8").unwrap_err();
        assert!(
            e.to_string().contains(&format!("/proc/{pid}/ns/uts")),
            "{e}"
        );
    }

    #[test]
    fn validation() {
        validate(&req()).unwrap();
        let mut r = req();
        r.hostname = "pod-7.example".into();
        r.interface = "eth0".into();
        r.mac = "02:00:00:00:00:07".into();
        r.ipv4_cidr = "10.0.0.7/24".into();
        r.ipv4_gateway = "10.0.0.1".into();
        r.entropy = vec![1; 64];
        validate(&r).unwrap();

        type Mutation = fn(&mut ReidentifyRequest);
        let cases: Vec<(Mutation, &str)> = vec![
            (|r| r.hostname = "bad host".into(), "hostname"),
            (|r| r.interface.clear(), "without interface"),
            (|r| r.mac = "zz".into(), "MAC"),
            (|r| r.ipv4_cidr = "10.0.0.7".into(), "prefix"),
            (|r| r.ipv4_gateway = "10.0.0".into(), "gateway"),
            (|r| r.entropy = vec![0; 5000], "entropy"),
            (|r| r.realtime_ns = u64::MAX, "realtime_ns"),
            (
                |r| r.envd.mut_or_insert_default().token_sha256 = vec![1; 31],
                "token_sha256",
            ),
        ];
        for (mutate, want) in cases {
            let mut bad = r.clone();
            mutate(&mut bad);
            let e = validate(&bad).unwrap_err().to_string();
            assert!(e.contains(want), "{e} lacks {want}");
        }
    }
}
