//! Test fixtures of the pod network's tests: a pod network namespace as
//! CNI leaves it, and a private bpffs.

use std::path::PathBuf;
use std::process::Command;

use twig_net::EgressPolicy;

use super::Plan;

/// Runs `ip` (iproute2) with `args`; whether it succeeded.
pub fn ip(args: &[&str]) -> bool {
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
pub struct PodNs {
    /// The namespace's name (`ip netns`).
    pub name: String,
    host: String,
}

impl PodNs {
    /// Namespace `n` (its addresses in `10.231.<n>.0/24`).
    pub fn new(n: u8) -> PodNs {
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

    /// The namespace's file.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/var/run/netns").join(&self.name)
    }

    /// Whether `link` exists in the namespace.
    pub fn has_link(&self, link: &str) -> bool {
        ip(&["-n", &self.name, "link", "show", link])
    }
}

impl Drop for PodNs {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
        let _ = ip(&["link", "del", &self.host]);
    }
}

/// The plan of a pod in `ns` under the default policy.
pub fn plan_for(ns: &PodNs) -> Plan {
    Plan {
        netns: ns.path(),
        policy: EgressPolicy::default(),
    }
}

/// A private bpffs on a temporary directory, unmounted on drop.
pub struct Bpffs(pub tempfile::TempDir);

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.0.path(), nix::mount::MntFlags::MNT_DETACH);
    }
}
