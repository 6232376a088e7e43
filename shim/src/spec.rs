//! The bundle's OCI spec, as the shim reads it: which sandbox a container
//! belongs to, where its rootfs comes from, and the spec the guest's agent
//! gets.
//!
//! The spec is kept as JSON (`serde_json::Value`) and only the fields the
//! shim must change are touched, so nothing the agent understands is lost
//! in a typed round trip.

use std::path::{Path, PathBuf};

use containerd_shim_protos::api::Mount;
use serde_json::Value;

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

/// CRI's sandbox annotation of the pod's memory limit, bytes: the sum of
/// its containers' limits as kubelet computed it (`PodSandboxConfig.linux.
/// resources`, without the RuntimeClass overhead); 0 when none is set.
pub const SANDBOX_MEMORY_ANNOTATION: &str = "io.kubernetes.cri.sandbox-memory";
/// CRI's sandbox annotation of the pod's CFS quota, µs per period (the sum
/// of its containers' CPU limits); 0 (or -1) when none is set.
pub const SANDBOX_CPU_QUOTA_ANNOTATION: &str = "io.kubernetes.cri.sandbox-cpu-quota";
/// CRI's sandbox annotation of the pod's CFS period, µs.
pub const SANDBOX_CPU_PERIOD_ANNOTATION: &str = "io.kubernetes.cri.sandbox-cpu-period";

/// The CFS period a quota given without one has (the kernel's default,
/// what runc applies), µs.
const DEFAULT_CPU_PERIOD_US: u64 = 100_000;

/// What a pod may use, as its sandbox's spec says; 0: no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PodResources {
    /// The memory limit, bytes.
    pub memory_limit_bytes: u64,
    /// The CPU limit, thousandths of a CPU (quota / period, rounded up).
    pub cpu_limit_millis: u32,
}

/// The pod's limits from its sandbox container's spec: CRI's sandbox
/// resource annotations ([`SANDBOX_MEMORY_ANNOTATION`], the CPU quota and
/// period) when any is there — containerd's CRI sets them from what
/// kubelet passes, and gives the sandbox container itself no limits (only
/// `cpu.shares` 2) — else the spec's own `linux.resources` (`memory.limit`,
/// `cpu.quota` and `cpu.period`: a container run outside CRI, `ctr run
/// --memory-limit … --cpus …`, is its own sandbox). CPU shares are
/// requests, not limits, and size nothing. A value that is not a number,
/// or negative where that means nothing (-1 is "unlimited" for the
/// memory limit and the quota), is an error naming it.
pub fn pod_resources(spec: &Value) -> Result<PodResources> {
    let annotated = [
        SANDBOX_MEMORY_ANNOTATION,
        SANDBOX_CPU_QUOTA_ANNOTATION,
        SANDBOX_CPU_PERIOD_ANNOTATION,
    ]
    .iter()
    .any(|k| annotation(spec, k).is_some());
    let (memory, quota, period) = if annotated {
        let number = |key: &str| -> Result<i64> {
            annotation(spec, key).map_or(Ok(0), |v| {
                v.trim().parse::<i64>().map_err(|e| {
                    Error::InvalidArgument(format!(
                        "the sandbox annotation {key} is {v:?}, not a whole number: {e}"
                    ))
                })
            })
        };
        (
            (
                SANDBOX_MEMORY_ANNOTATION,
                number(SANDBOX_MEMORY_ANNOTATION)?,
            ),
            (
                SANDBOX_CPU_QUOTA_ANNOTATION,
                number(SANDBOX_CPU_QUOTA_ANNOTATION)?,
            ),
            (
                SANDBOX_CPU_PERIOD_ANNOTATION,
                number(SANDBOX_CPU_PERIOD_ANNOTATION)?,
            ),
        )
    } else {
        let number = |pointer: &str| -> Result<i64> {
            match spec.pointer(pointer) {
                None | Some(Value::Null) => Ok(0),
                Some(v) => v.as_i64().ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "OCI spec: {pointer} is {v}, not a whole number"
                    ))
                }),
            }
        };
        (
            (
                "OCI spec /linux/resources/memory/limit",
                number("/linux/resources/memory/limit")?,
            ),
            (
                "OCI spec /linux/resources/cpu/quota",
                number("/linux/resources/cpu/quota")?,
            ),
            (
                "OCI spec /linux/resources/cpu/period",
                number("/linux/resources/cpu/period")?,
            ),
        )
    };
    let bad = |(what, v): (&str, i64), meaning: &str| {
        Error::InvalidArgument(format!("{what} is {v}: {meaning}"))
    };
    let memory_limit_bytes = match memory.1 {
        -1 | 0 => 0,
        m => u64::try_from(m).map_err(|_| {
            bad(
                memory,
                "a memory limit is a number of bytes (0 or -1: none)",
            )
        })?,
    };
    let period = match period.1 {
        0 => DEFAULT_CPU_PERIOD_US,
        p => {
            u64::try_from(p).map_err(|_| bad(period, "a CFS period is a number of microseconds"))?
        }
    };
    let cpu_limit_millis = match quota.1 {
        -1 | 0 => 0,
        q => {
            let q = u64::try_from(q).map_err(|_| {
                bad(
                    quota,
                    "a CFS quota is a number of microseconds (0 or -1: none)",
                )
            })?;
            u32::try_from((u128::from(q) * 1000).div_ceil(u128::from(period)))
                .map_err(|_| bad(quota, "no VM has that many CPUs"))?
        }
    };
    Ok(PodResources {
        memory_limit_bytes,
        cpu_limit_millis,
    })
}

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

/// The block image that holds the container's rootfs: the Create request's
/// single twig-snapshotter mount. Anything else (no mount: a rootfs already
/// on the host; overlay and other snapshotters) is refused with the way to
/// fix it.
pub fn rootfs_image(id: &str, mounts: &[Mount]) -> Result<PathBuf> {
    let fix =
        "run it with `--snapshotter twig` (ctr) or set the CRI runtime's snapshotter to `twig`";
    match mounts {
        [m] => twig_snapshotter::block_image(&m.type_, &m.source, &m.options).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "container {id}: its rootfs is a {} mount of {}, not a twig-snapshotter block image \
                 (ext4 with `loop`): the twig runtime hands the rootfs to the VM as a disk; {fix}",
                m.type_, m.source
            ))
        }),
        [] => Err(Error::InvalidArgument(format!(
            "container {id}: no rootfs mount; the twig runtime needs a twig-snapshotter block image; {fix}"
        ))),
        _ => Err(Error::InvalidArgument(format!(
            "container {id}: {} rootfs mounts; the twig runtime takes exactly one twig-snapshotter block image; {fix}",
            mounts.len()
        ))),
    }
}

/// The files containerd's CRI plugin writes for a pod on the host and
/// bind-mounts into each of its containers. The guest cannot see host
/// files; the container keeps its image's own (its hostname is the spec's
/// `hostname`, set in its UTS namespace).
const CRI_POD_FILES: [&str; 4] = [
    "/etc/hosts",
    "/etc/resolv.conf",
    "/etc/hostname",
    "/dev/termination-log",
];

/// Whether an OCI mount is a bind mount (its source a path).
fn is_bind(m: &Value) -> bool {
    m.get("type").and_then(Value::as_str) == Some("bind")
        || m.get("options")
            .and_then(Value::as_array)
            .is_some_and(|o| o.iter().any(|o| o == "bind" || o == "rbind"))
}

/// The spec's mounts as the guest can make them. Every bind mount's source
/// is a host path, which the guest cannot see: `/dev/shm` (CRI binds the
/// pod's shared memory there) becomes a tmpfs of the container's own (a bind
/// of the pod's first container's `/dev/shm` through `/proc/<pid>/root`
/// fails with EINVAL: a bind mount's source must be in the caller's mount
/// namespace; System V shared memory is still the pod's, through its IPC
/// namespace); CRI's pod files ([`CRI_POD_FILES`]) are dropped; any other (a
/// volume) is refused: nothing shares host files with the VM yet.
fn guest_mounts(spec: &mut Value) -> Result<()> {
    let Some(mounts) = spec.get_mut("mounts").and_then(Value::as_array_mut) else {
        return Ok(());
    };
    let mut kept = Vec::with_capacity(mounts.len());
    for m in mounts.drain(..) {
        if !is_bind(&m) {
            kept.push(m);
            continue;
        }
        let dest = m.get("destination").and_then(Value::as_str).unwrap_or("");
        if dest == "/dev/shm" {
            kept.push(serde_json::json!({
                "destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            }));
        } else if CRI_POD_FILES.contains(&dest) {
            tracing::debug!(
                destination = dest,
                "CRI's pod file is not shared with the VM; the image's own stays"
            );
        } else {
            return Err(Error::InvalidArgument(format!(
                "OCI spec: a bind mount of the host's {} on {dest}: the twig runtime does not \
                 share host files or volumes with the VM yet",
                m.get("source")
                    .and_then(Value::as_str)
                    .unwrap_or("(no source)")
            )));
        }
    }
    *mounts = kept;
    Ok(())
}

/// The spec the agent gets: the host's view removed. Network namespaces go
/// (the containers share the VM's network, which is the pod's), namespace
/// paths name the pod's first container's namespaces inside the guest
/// (`/proc/<guest pid>/ns/…`, when `sandbox_init` is known) instead of host
/// paths, bind mounts of host paths are translated or dropped
/// ([`guest_mounts`]), and hooks go (they would run on the host under runc;
/// nothing runs them in the guest). A container without a UTS namespace of
/// its own — a pod on the node's network (`hostNetwork`), whose containers
/// share the node's — shares the VM's, whose hostname is the VM's: the
/// spec's `hostname` (the node's, under CRI) goes.
pub fn guest_spec(mut spec: Value, sandbox_init: Option<u32>) -> Result<Value> {
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
    guest_mounts(&mut spec)?;
    let Some(namespaces) = spec
        .pointer_mut("/linux/namespaces")
        .and_then(Value::as_array_mut)
    else {
        return Ok(spec);
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
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn mount(t: &str, source: &str, options: &[&str]) -> Mount {
        Mount {
            type_: t.into(),
            source: source.into(),
            options: options.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn pod_limits_come_from_cri_annotations_else_the_spec() {
        let none = json!({"ociVersion": "1.0.2"});
        assert_eq!(pod_resources(&none).unwrap(), PodResources::default());
        // What containerd 1.6 writes for a pod with a 300 MiB and 1500m
        // limit: the annotations, and only cpu.shares 2 in the spec.
        let cri = json!({
            "annotations": {
                SANDBOX_MEMORY_ANNOTATION: "314572800",
                SANDBOX_CPU_QUOTA_ANNOTATION: "150000",
                SANDBOX_CPU_PERIOD_ANNOTATION: "100000",
                "io.kubernetes.cri.sandbox-cpu-shares": "1536",
            },
            "linux": {"resources": {"cpu": {"shares": 2}}},
        });
        assert_eq!(
            pod_resources(&cri).unwrap(),
            PodResources {
                memory_limit_bytes: 300 << 20,
                cpu_limit_millis: 1500
            }
        );
        // A pod without limits: kubelet's zeros (and -1, "unlimited").
        for quota in ["0", "-1"] {
            let unlimited = json!({"annotations": {
                SANDBOX_MEMORY_ANNOTATION: "0",
                SANDBOX_CPU_QUOTA_ANNOTATION: quota,
                SANDBOX_CPU_PERIOD_ANNOTATION: "100000",
            }});
            assert_eq!(pod_resources(&unlimited).unwrap(), PodResources::default());
        }
        // The annotations win over the spec's resources.
        let both = json!({
            "annotations": {SANDBOX_MEMORY_ANNOTATION: "0"},
            "linux": {"resources": {"memory": {"limit": 1 << 30}}},
        });
        assert_eq!(pod_resources(&both).unwrap(), PodResources::default());
        // Outside CRI: the container's own resources; a quota without a
        // period has the kernel's, and millis are rounded up.
        let ctr = json!({"linux": {"resources": {
            "memory": {"limit": 64 << 20}, "cpu": {"quota": 20001},
        }}});
        assert_eq!(
            pod_resources(&ctr).unwrap(),
            PodResources {
                memory_limit_bytes: 64 << 20,
                cpu_limit_millis: 201
            }
        );
    }

    #[test]
    fn bad_pod_limits_are_refused_naming_them() {
        for (spec, needle) in [
            (
                json!({"annotations": {SANDBOX_MEMORY_ANNOTATION: "1Gi"}}),
                "the sandbox annotation io.kubernetes.cri.sandbox-memory is \"1Gi\", not a whole number",
            ),
            (
                json!({"annotations": {SANDBOX_MEMORY_ANNOTATION: "-5"}}),
                "io.kubernetes.cri.sandbox-memory is -5: a memory limit is a number of bytes",
            ),
            (
                json!({"annotations": {SANDBOX_CPU_QUOTA_ANNOTATION: "-2"}}),
                "io.kubernetes.cri.sandbox-cpu-quota is -2: a CFS quota",
            ),
            (
                json!({"annotations": {
                    SANDBOX_CPU_QUOTA_ANNOTATION: "100000", SANDBOX_CPU_PERIOD_ANNOTATION: "-1"}}),
                "io.kubernetes.cri.sandbox-cpu-period is -1: a CFS period",
            ),
            (
                json!({"annotations": {
                    SANDBOX_CPU_QUOTA_ANNOTATION: "9223372036854775807",
                    SANDBOX_CPU_PERIOD_ANNOTATION: "1000"}}),
                "no VM has that many CPUs",
            ),
            (
                json!({"linux": {"resources": {"memory": {"limit": "64M"}}}}),
                "OCI spec: /linux/resources/memory/limit is \"64M\", not a whole number",
            ),
            (
                json!({"linux": {"resources": {"cpu": {"quota": 1.5}}}}),
                "/linux/resources/cpu/quota is 1.5, not a whole number",
            ),
        ] {
            let e = pod_resources(&spec).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(needle),
                "{spec}: {e}"
            );
        }
    }

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
    fn rootfs_must_be_one_twig_block_image() {
        let img = rootfs_image(
            "c",
            &[mount("ext4", "/s/snapshots/3/rootfs.img", &["rw", "loop"])],
        )
        .unwrap();
        assert_eq!(img, PathBuf::from("/s/snapshots/3/rootfs.img"));
        let e = rootfs_image("c", &[mount("overlay", "overlay", &["lowerdir=/a"])]).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(
            e.to_string().contains("--snapshotter twig") && e.to_string().contains("overlay"),
            "{e}"
        );
        let e = rootfs_image("c", &[]).unwrap_err();
        assert!(e.to_string().contains("--snapshotter twig"), "{e}");
        let two = [
            mount("ext4", "/a", &["loop"]),
            mount("ext4", "/b", &["loop"]),
        ];
        assert!(rootfs_image("c", &two)
            .unwrap_err()
            .to_string()
            .contains("2 rootfs mounts"));
    }

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
        let g = guest_spec(spec.clone(), Some(7)).unwrap();
        assert!(g.get("hooks").is_none());
        assert_eq!(g["process"]["args"][0], "sh");
        assert_eq!(
            g["linux"]["namespaces"],
            json!([{"type": "pid"}, {"type": "ipc", "path": "/proc/7/ns/ipc"},
                   {"type": "uts", "path": "/proc/7/ns/uts"}, {"type": "mount"}])
        );
        let g = guest_spec(spec, None).unwrap();
        assert_eq!(
            g["linux"]["namespaces"],
            json!([{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}])
        );
        let bad = json!({"linux": {"namespaces": [{"type": "user", "path": "/proc/1/ns/user"}]}});
        assert!(matches!(
            guest_spec(bad, Some(1)),
            Err(Error::InvalidArgument(_))
        ));
        // A pod on the node's network: no UTS namespace, the node's
        // hostname; it keeps the VM's.
        let host = json!({"hostname": "node-1", "linux": {"namespaces": [{"type": "pid"}]}});
        assert!(guest_spec(host, None).unwrap().get("hostname").is_none());
        let own = json!({"hostname": "pod", "linux": {"namespaces": [{"type": "uts"}]}});
        assert_eq!(guest_spec(own, None).unwrap()["hostname"], "pod");
        let untyped = json!({"linux": {"namespaces": [{"path": "/x"}]}});
        assert!(guest_spec(untyped, None).is_err());
    }

    #[test]
    fn guest_spec_translates_cri_bind_mounts_and_refuses_volumes() {
        let proc_mount = json!({"destination": "/proc", "type": "proc", "source": "proc"});
        let spec = |extra: Value| {
            json!({"mounts": [
                proc_mount.clone(),
                {"destination": "/etc/hosts", "type": "bind",
                 "source": "/var/lib/c/sandboxes/p/hosts", "options": ["rbind", "rprivate", "rw"]},
                {"destination": "/etc/resolv.conf", "source": "/var/lib/c/sandboxes/p/resolv.conf",
                 "options": ["rbind", "ro"]},
                {"destination": "/dev/shm", "type": "bind",
                 "source": "/run/c/sandboxes/p/shm", "options": ["rbind", "ro"]},
                extra,
            ]})
        };
        let hostname = json!({"destination": "/etc/hostname", "type": "bind",
                              "source": "/var/lib/c/sandboxes/p/hostname", "options": ["rbind"]});
        let shm = json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]});
        for init in [Some(9), None] {
            let g = guest_spec(spec(hostname.clone()), init).unwrap();
            assert_eq!(g["mounts"], json!([proc_mount, shm]));
        }
        let volume = json!({"destination": "/data", "type": "bind",
                            "source": "/var/lib/kubelet/pods/x/volumes/data", "options": ["rbind"]});
        let e = guest_spec(spec(volume), Some(9)).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(
            e.to_string()
                .contains("/var/lib/kubelet/pods/x/volumes/data"),
            "{e}"
        );
    }
}
