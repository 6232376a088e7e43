//! The [`Joiner`] of the pod's data path: twig-net's eBPF programs, a set
//! prepared by the node daemon or loaded by the shim itself.

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use containerd_shim_protos::ttrpc;
use twig_net::{AttachMode, Counters, EgressPolicy, Loader, NodeContext, PodNetConfig, PodNetwork};

use super::Joiner;
use crate::error::{Error, Result};

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

#[cfg(test)]
mod tests {
    use std::process::Command;
    use std::sync::Mutex;

    use super::*;
    use crate::resources::network::testing::{plan_for, Bpffs, PodNs};
    use crate::resources::network::{
        teardown, teardown_recorded, Plan, PodNet, RECORD_FILE, TAP, VETH,
    };

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
        // A UDP server's policy: its reply ports go with the prepared set.
        let dns = twig_net::PortRange {
            port: 53,
            end_port: None,
        };
        let serving = EgressPolicy {
            udp_reply_ports: vec![dns],
            ..EgressPolicy::default()
        };
        let plan = Plan {
            policy: serving,
            ..plan_for(&ns)
        };
        let net = PodNet::attach(
            &plan,
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
        let reply_ports = || PodNetwork::open(&dir).unwrap().udp_reply_ports().unwrap();
        assert_eq!(reply_ports(), [dns], "the policy's UDP reply ports");
        joiner.set_policy(&dir, &EgressPolicy::default()).unwrap();
        assert_eq!(reply_ports(), [], "a replaced policy replaces them");
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
