//! The bundle's OCI spec, as the shim reads it: the spec itself, its
//! annotations (CRI's among them), which sandbox a container belongs to and
//! whether its rootfs is read-only. A ground-floor module: the resources
//! and the pod read the spec through it.
//!
//! The spec is kept as JSON (`serde_json::Value`) and only the fields the
//! shim must change are touched, so nothing the agent understands is lost
//! in a typed round trip.

use std::path::Path;

use serde_json::Value;

use twig_proto::contract::{self, EnvdPolicy, NETWORK_ANNOTATION, NETWORK_NONE};

use crate::error::{Error, Result};

/// CRI's annotation naming a container's pod sandbox.
pub const SANDBOX_ID_ANNOTATION: &str = "io.kubernetes.cri.sandbox-id";
/// CRI's annotation saying whether a container is the pod's `sandbox` or a
/// `container` in it.
pub const CONTAINER_TYPE_ANNOTATION: &str = "io.kubernetes.cri.container-type";
/// [`CONTAINER_TYPE_ANNOTATION`]'s value on a pod's sandbox container.
pub const CONTAINER_TYPE_SANDBOX: &str = "sandbox";
/// Groups containers into one shim (one VM) outside CRI, like runc's
/// `io.containerd.runc.v2.group`.
pub const GROUP_ANNOTATION: &str = "io.containerd.twig.v2.group";
/// CRI's annotation carrying a container's name in its pod.
pub const CONTAINER_NAME_ANNOTATION: &str = "io.kubernetes.cri.container-name";

/// Reads `<bundle>/config.json`.
pub fn read_spec(bundle: &Path) -> Result<Value> {
    let path = bundle.join("config.json");
    let text = std::fs::read(&path)
        .map_err(|e| Error::io(format!("reading the OCI spec {}", path.display()), e))?;
    serde_json::from_slice(&text)
        .map_err(|e| Error::InvalidArgument(format!("OCI spec {}: {e}", path.display())))
}

/// The spec's annotation `key`, if set.
pub fn annotation<'a>(spec: &'a Value, key: &str) -> Option<&'a str> {
    spec.get("annotations")?.get(key)?.as_str()
}

/// Which shim (and so which VM) a container belongs to, as runc's v2 shim
/// groups: the group annotation, else CRI's sandbox id, else the container
/// itself (outside CRI every container is its own sandbox).
pub fn grouping(id: &str, spec: &Value) -> String {
    [GROUP_ANNOTATION, SANDBOX_ID_ANNOTATION]
        .iter()
        .find_map(|k| annotation(spec, k).filter(|v| !v.is_empty()))
        .unwrap_or(id)
        .to_string()
}

/// Whether the spec's rootfs is read-only (`root.readonly`).
pub fn root_read_only(spec: &Value) -> bool {
    spec.pointer("/root/readonly")
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// Whether the pod asks for a VM without network
/// ([`NETWORK_ANNOTATION`]` = `[`NETWORK_NONE`]); any other value of the
/// annotation is refused, naming it.
pub fn network_none(spec: &Value) -> Result<bool> {
    match annotation(spec, NETWORK_ANNOTATION) {
        None => Ok(false),
        Some(NETWORK_NONE) => Ok(true),
        Some(other) => Err(Error::InvalidArgument(format!(
            "metadata.annotations[{NETWORK_ANNOTATION}]: {other:?} is not a network the twig \
             runtime knows; the one value is {NETWORK_NONE:?} (a VM without network), or leave \
             it out for the pod's network"
        ))),
    }
}

/// The pod's sandbox API as its annotations ask for it
/// ([`contract::envd_policy`]); an invalid value is refused, naming it.
pub fn envd(spec: &Value) -> Result<Option<EnvdPolicy>> {
    contract::envd_policy(|k| annotation(spec, k)).map_err(Error::InvalidArgument)
}

/// Refuses a CRI pod sandbox that asks for one of the node's namespaces
/// (`hostIPC`, `hostPID`, `hostNetwork`: CRI then gives the sandbox no
/// namespace of that kind): the pod runs in its own VM, whose kernel shares
/// none of them with the node, so it would start with something else than
/// it asked for. A pod on the node's network that says it wants no network
/// at all ([`NETWORK_ANNOTATION`]` = `[`NETWORK_NONE`]) gets a VM without
/// one. Other specs (`ctr`) are not a pod's and pass.
pub fn check_host_namespaces(spec: &Value) -> Result<()> {
    if annotation(spec, CONTAINER_TYPE_ANNOTATION) != Some(CONTAINER_TYPE_SANDBOX) {
        return Ok(());
    }
    let has = |kind: &str| {
        spec.pointer("/linux/namespaces")
            .and_then(Value::as_array)
            .is_some_and(|ns| ns.iter().any(|n| n.get("type") == Some(&Value::from(kind))))
    };
    for (kind, field, what) in [
        (
            "ipc",
            "hostIPC",
            "IPC namespace (System V IPC, POSIX message queues)",
        ),
        ("pid", "hostPID", "PID namespace (its processes)"),
    ] {
        if !has(kind) {
            return Err(Error::InvalidArgument(format!(
                "spec.{field}: true is not supported by the twig runtime: the pod runs in its own \
                 microVM, whose kernel cannot share the node's {what}"
            )));
        }
    }
    if !has("network") && !network_none(spec)? {
        return Err(Error::InvalidArgument(format!(
            "spec.hostNetwork: true is not supported by the twig runtime: the pod runs in its own \
             microVM, whose kernel has a network stack of its own and cannot use the node's \
             interfaces; for a pod without any network, set the annotation \
             {NETWORK_ANNOTATION}: {NETWORK_NONE}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn grouping_follows_cri_annotations_like_runc() {
        let bare = json!({"ociVersion": "1.0.2"});
        assert_eq!(grouping("c1", &bare), "c1");
        let sandbox = json!({"annotations": {
            CONTAINER_TYPE_ANNOTATION: "sandbox", SANDBOX_ID_ANNOTATION: "pod1"}});
        assert_eq!(grouping("pod1", &sandbox), "pod1");
        let member = json!({"annotations": {
            CONTAINER_TYPE_ANNOTATION: "container", SANDBOX_ID_ANNOTATION: "pod1"}});
        assert_eq!(grouping("c2", &member), "pod1");
        let grouped =
            json!({"annotations": {GROUP_ANNOTATION: "g", SANDBOX_ID_ANNOTATION: "pod1"}});
        assert_eq!(grouping("c3", &grouped), "g");
        let empty = json!({"annotations": {SANDBOX_ID_ANNOTATION: ""}});
        assert_eq!(grouping("c4", &empty), "c4");
    }

    #[test]
    fn a_pod_asking_for_a_node_namespace_is_refused_naming_the_field() {
        let sandbox = |kinds: &[&str], network: Option<&str>| {
            let ns: Vec<Value> = kinds.iter().map(|k| json!({"type": k})).collect();
            let mut annotations = json!({CONTAINER_TYPE_ANNOTATION: "sandbox"});
            if let Some(n) = network {
                annotations[NETWORK_ANNOTATION] = json!(n);
            }
            json!({"annotations": annotations, "linux": {"namespaces": ns}})
        };
        let all = ["pid", "ipc", "uts", "mount", "network"];
        check_host_namespaces(&sandbox(&all, None)).unwrap();
        check_host_namespaces(&sandbox(&all, Some(NETWORK_NONE))).unwrap();
        // hostNetwork that asks for no network at all: a VM without one.
        check_host_namespaces(&sandbox(&all[..4], Some(NETWORK_NONE))).unwrap();
        for (kinds, field) in [
            (&["pid", "uts", "mount", "network"][..], "spec.hostIPC"),
            (&["ipc", "uts", "mount", "network"][..], "spec.hostPID"),
            (&all[..4], "spec.hostNetwork"),
        ] {
            let e = check_host_namespaces(&sandbox(kinds, None)).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            assert!(e.to_string().contains(field), "{e}");
        }
        let e = check_host_namespaces(&sandbox(&all[..4], Some("host"))).unwrap_err();
        assert!(e.to_string().contains(NETWORK_ANNOTATION), "{e}");
        let e = network_none(&sandbox(&all, Some("bridge"))).unwrap_err();
        assert!(e.to_string().contains("\"bridge\""), "{e}");
        // Not a CRI sandbox (ctr's containers, app containers).
        check_host_namespaces(&json!({"linux": {"namespaces": []}})).unwrap();
    }

    #[test]
    fn envd_is_read_from_the_sandbox_annotations_and_bad_values_refused() {
        assert_eq!(envd(&json!({})).unwrap(), None);
        let on = json!({"annotations": {contract::ENVD_ANNOTATION: "true"}});
        assert_eq!(envd(&on).unwrap(), Some(EnvdPolicy { token_sha256: None }));
        let bad = json!({"annotations": {contract::ENVD_ANNOTATION: "on"}});
        let e = envd(&bad).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("twig.dev/envd"), "{e}");
    }
}
