//! The spec the guest's agent gets: the host's view of the bundle's OCI
//! spec removed or translated into the VM's.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::resources::volumes::{guest_mounts, Plan};

/// The spec the agent gets: the host's view removed. Network namespaces go
/// (the containers share the VM's network, which is the pod's), namespace
/// paths name the pod's first container's namespaces inside the guest
/// (`/proc/<guest pid>/ns/…`, when `sandbox_init` is known) instead of host
/// paths, bind mounts of host paths become binds of guest volumes (or are
/// refused: [`guest_mounts`], whose plan of the volumes to make comes back
/// with the spec; `container` is the container's name in its pod, which
/// names them), and hooks go (they would run on the host under runc;
/// nothing runs them in the guest). A container without a UTS namespace of
/// its own — a pod on the node's network (`hostNetwork`, which runs only
/// with `twig.dev/network: none`), whose containers CRI gives the node's —
/// shares the VM's, whose hostname is the VM's: the
/// spec's `hostname` (the node's, under CRI) goes.
pub fn guest_spec(
    mut spec: Value,
    sandbox_init: Option<u32>,
    container: &str,
) -> Result<(Value, Plan)> {
    let own_uts = spec
        .pointer("/linux/namespaces")
        .and_then(Value::as_array)
        .is_some_and(|ns| {
            ns.iter()
                .any(|n| n.get("type") == Some(&Value::from("uts")))
        });
    if let Some(obj) = spec.as_object_mut() {
        if obj.remove("hooks").is_some() {
            tracing::warn!("OCI hooks are not run by the twig runtime; dropped");
        }
        if !own_uts {
            if let Some(h) = obj.remove("hostname") {
                tracing::debug!(%h, "no UTS namespace of its own: the container keeps the VM's hostname");
            }
        }
    }
    let plan = guest_mounts(&mut spec, container)?;
    let Some(namespaces) = spec
        .pointer_mut("/linux/namespaces")
        .and_then(Value::as_array_mut)
    else {
        return Ok((spec, plan));
    };
    let mut kept = Vec::with_capacity(namespaces.len());
    for ns in namespaces.drain(..) {
        let kind = ns
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("OCI spec: a namespace without a type: {ns}"))
            })?
            .to_string();
        if kind == "network" {
            continue;
        }
        let has_path = ns
            .get("path")
            .and_then(Value::as_str)
            .is_some_and(|p| !p.is_empty());
        if !has_path {
            kept.push(ns);
            continue;
        }
        let file = match kind.as_str() {
            "pid" => "pid",
            "ipc" => "ipc",
            "uts" => "uts",
            "mount" => "mnt",
            "cgroup" => "cgroup",
            other => {
                return Err(Error::InvalidArgument(format!(
                    "OCI spec: joining a {other} namespace by path is not supported in a twig VM"
                )))
            }
        };
        kept.push(match sandbox_init {
            Some(pid) => {
                serde_json::json!({"type": kind, "path": format!("/proc/{pid}/ns/{file}")})
            }
            None => serde_json::json!({"type": kind}),
        });
    }
    *namespaces = kept;
    Ok((spec, plan))
}

/// Whether OCI spec `spec` joins a pid namespace by path (CRI's POD or
/// TARGET namespace mode) rather than making its own.
pub fn joins_pid_namespace(spec: &Value) -> bool {
    spec.pointer("/linux/namespaces")
        .and_then(Value::as_array)
        .is_some_and(|ns| {
            ns.iter().any(|n| {
                n.get("type") == Some(&Value::from("pid"))
                    && n.get("path")
                        .and_then(Value::as_str)
                        .is_some_and(|p| !p.is_empty())
            })
        })
}

/// Makes guest spec `spec` join the pid namespace of guest process `pid`
/// (the target of `kubectl debug --target`) instead of the pod's.
pub fn join_pid_namespace_of(spec: &mut Value, pid: u32) {
    let namespaces = spec
        .pointer_mut("/linux/namespaces")
        .and_then(Value::as_array_mut);
    for ns in namespaces.into_iter().flatten() {
        if ns.get("type") == Some(&Value::from("pid")) {
            *ns = serde_json::json!({"type": "pid", "path": format!("/proc/{pid}/ns/pid")});
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::spec::root_read_only;

    #[test]
    fn guest_spec_drops_the_hosts_view() {
        let spec = json!({
            "process": {"args": ["sh"]},
            "root": {"path": "rootfs", "readonly": true},
            "hooks": {"prestart": [{"path": "/bin/true"}]},
            "linux": {"namespaces": [
                {"type": "pid"},
                {"type": "ipc", "path": "/proc/4242/ns/ipc"},
                {"type": "uts", "path": "/proc/4242/ns/uts"},
                {"type": "mount"},
                {"type": "network", "path": "/var/run/netns/cni-1"}
            ]}
        });
        assert!(root_read_only(&spec));
        let g = guest_spec(spec.clone(), Some(7), "c").unwrap().0;
        assert!(g.get("hooks").is_none());
        assert_eq!(g["process"]["args"][0], "sh");
        assert_eq!(
            g["linux"]["namespaces"],
            json!([{"type": "pid"}, {"type": "ipc", "path": "/proc/7/ns/ipc"},
                   {"type": "uts", "path": "/proc/7/ns/uts"}, {"type": "mount"}])
        );
        let g = guest_spec(spec, None, "c").unwrap().0;
        assert_eq!(
            g["linux"]["namespaces"],
            json!([{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}])
        );
        let bad = json!({"linux": {"namespaces": [{"type": "user", "path": "/proc/1/ns/user"}]}});
        assert!(matches!(
            guest_spec(bad, Some(1), "c"),
            Err(Error::InvalidArgument(_))
        ));
        // A pod on the node's network: no UTS namespace, the node's
        // hostname; it keeps the VM's.
        let host = json!({"hostname": "node-1", "linux": {"namespaces": [{"type": "pid"}]}});
        assert!(guest_spec(host, None, "c")
            .unwrap()
            .0
            .get("hostname")
            .is_none());
        let own = json!({"hostname": "pod", "linux": {"namespaces": [{"type": "uts"}]}});
        assert_eq!(guest_spec(own, None, "c").unwrap().0["hostname"], "pod");
        let untyped = json!({"linux": {"namespaces": [{"path": "/x"}]}});
        assert!(guest_spec(untyped, None, "c").is_err());
    }
}
