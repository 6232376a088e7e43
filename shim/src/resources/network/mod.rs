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
//! without a network namespace (`ctr run`), or a pod annotated
//! `twig.dev/network: none` (twig-proto's `contract::NETWORK_ANNOTATION`,
//! whatever CRI set up), gets a VM without network. A pod on the node's
//! network (`hostNetwork: true`) without that annotation is refused before
//! a VM is taken (`spec::check_host_namespaces`).
//!
//! The pinned directory is recorded in the sandbox's state directory
//! ([`RECORD_FILE`]) before anything is attached, so a shim that dies
//! leaves a name for `delete` to tear the path down with ([`teardown`]).

mod bpf;
mod pod_net;
#[cfg(test)]
mod testing;

use std::path::{Path, PathBuf};

use serde_json::Value;
use twig_net::{Counters, EgressPolicy, PodNetConfig, PodNetwork};

use crate::error::{Error, Result};
use crate::spec;

pub use bpf::Bpf;
pub use pod_net::{PodAddress, PodNet};

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
/// network namespace or asks for none (`twig.dev/network: none`): the VM
/// gets no network. A malformed egress-policy
/// annotation is an error, never a fall-back to the default.
pub fn plan(spec: &Value, bound: &EgressPolicy) -> Result<Option<Plan>> {
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
    if spec::network_none(spec)? {
        return Ok(None);
    }
    let own = spec::annotation(spec, twig_net::EGRESS_POLICY_ANNOTATION)
        .map(|text| {
            twig_net::parse_policy(
                text,
                &format!(
                    "metadata.annotations[{}]",
                    twig_net::EGRESS_POLICY_ANNOTATION
                ),
            )
        })
        .transpose()
        .map_err(|e| Error::InvalidArgument(format!("the pod's egress policy: {e}")))?;
    let policy = match own {
        None => EgressPolicy::default(),
        // An app template's pod: bounded by its template's at the restore.
        Some(own) if spec::annotation(spec, crate::restore::TEMPLATE_ANNOTATION).is_some() => own,
        Some(own) => bounded(&own, bound, "the node's egress_bound (shim.json)")?,
    };
    Ok(Some(Plan {
        netns: PathBuf::from(netns),
        policy,
    }))
}

/// The pod's own policy (its annotation) narrowed to what `bound` (its
/// template's, or the cluster's default, at `bound_path`) lets through
/// (`twig_net::bounded_policy`): a pod author narrows, never widens; what
/// was clipped is logged.
pub fn bounded(own: &EgressPolicy, bound: &EgressPolicy, bound_path: &str) -> Result<EgressPolicy> {
    let b = twig_net::bounded_policy(own, bound, bound_path)
        .map_err(|e| Error::InvalidArgument(format!("the pod's egress policy: {e}")))?;
    if !b.clipped.is_empty() {
        tracing::warn!(clipped = ?b.clipped, bound = bound_path, "the pod's egress policy reaches past its bound; clipped");
    }
    Ok(b.policy)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_names_the_network_namespace_and_the_policy() {
        let none =
            serde_json::json!({"linux": {"namespaces": [{"type": "pid"}, {"type": "network"}]}});
        assert_eq!(
            plan(&none, &EgressPolicy::default()).unwrap(),
            None,
            "a new namespace, not CNI's: no network"
        );
        assert_eq!(
            plan(&serde_json::json!({}), &EgressPolicy::default()).unwrap(),
            None
        );
        let cri = serde_json::json!({
            "linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/cni-1"}]},
            "annotations": {"twig.dev/egress-policy": "{\"allow\":[{\"cidr\":\"10.88.0.0/16\"}]}"}
        });
        let p = plan(&cri, &EgressPolicy::default()).unwrap().unwrap();
        assert_eq!(p.netns, PathBuf::from("/var/run/netns/cni-1"));
        // A private range the cluster's default denies: clipped, never
        // opened by the pod's own annotation.
        assert!(p.policy.allow.is_empty(), "{:?}", p.policy);
        let narrow = serde_json::json!({
            "linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/cni-1"}]},
            "annotations": {"twig.dev/egress-policy":
                "{\"defaultAction\":\"deny\",\"allow\":[{\"cidr\":\"8.8.8.0/24\"}]}"}
        });
        let p = plan(&narrow, &EgressPolicy::default()).unwrap().unwrap();
        assert_eq!(
            p.policy.allow.len(),
            1,
            "a narrower policy is the pod's: {:?}",
            p.policy
        );
        // A node whose admin allows the private range lets the pod ask.
        let admin: EgressPolicy =
            serde_json::from_str(r#"{"allow":[{"cidr":"10.0.0.0/8"}]}"#).unwrap();
        let p = plan(&cri, &admin).unwrap().unwrap();
        assert_eq!(p.policy.allow.len(), 1, "{:?}", p.policy);
        let bad = serde_json::json!({
            "linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/cni-1"}]},
            "annotations": {"twig.dev/egress-policy": "{\"allow\":[{\"cidr\":\"nonsense\"}]}"}
        });
        let e = plan(&bad, &EgressPolicy::default()).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_))
                && e.to_string().contains("twig.dev/egress-policy"),
            "{e}"
        );
        let offline = serde_json::json!({
            "linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/cni-1"}]},
            "annotations": {"twig.dev/network": "none"}
        });
        assert_eq!(
            plan(&offline, &EgressPolicy::default()).unwrap(),
            None,
            "asked for no network: CNI's namespace is not joined"
        );
    }

    #[test]
    fn a_pods_udp_reply_ports_are_narrowed_to_its_bound() {
        let serving = serde_json::json!({
            "linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/cni-1"}]},
            "annotations": {"twig.dev/egress-policy":
                "{\"udpReplyPorts\":[{\"port\":53},{\"port\":5000,\"endPort\":5010}]}"}
        });
        // The cluster's default opens no UDP port to replies: the pod's
        // ports are clipped, not refused.
        let p = plan(&serving, &EgressPolicy::default()).unwrap().unwrap();
        assert!(p.policy.udp_reply_ports.is_empty(), "{:?}", p.policy);
        // A node admin opening 53 lets the pod have 53, and only 53.
        let admin: EgressPolicy =
            serde_json::from_str(r#"{"udpReplyPorts":[{"port":53}]}"#).unwrap();
        let p = plan(&serving, &admin).unwrap().unwrap();
        assert_eq!(
            p.policy.udp_reply_ports,
            [twig_net::PortRange {
                port: 53,
                end_port: None
            }]
        );
        // A template's ports bound a pod of that template the same way.
        let template: EgressPolicy =
            serde_json::from_str(r#"{"udpReplyPorts":[{"port":5000,"endPort":5004}]}"#).unwrap();
        let own = twig_net::parse_policy(
            r#"{"udpReplyPorts":[{"port":5000,"endPort":5010}]}"#,
            "annotation",
        )
        .unwrap();
        let bounded = bounded(&own, &template, "SandboxTemplate t's spec.egressPolicy").unwrap();
        assert_eq!(
            bounded.udp_reply_ports,
            [twig_net::PortRange {
                port: 5000,
                end_port: Some(5004)
            }]
        );
        let bad = serde_json::json!({
            "linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/cni-1"}]},
            "annotations": {"twig.dev/egress-policy": "{\"udpReplyPorts\":[{\"port\":0}]}"}
        });
        let e = plan(&bad, &admin).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(_))
                && e.to_string()
                    .contains("metadata.annotations[twig.dev/egress-policy].udpReplyPorts[0].port"),
            "{e}"
        );
    }
}
