//! The pod's resource limits, as its sandbox's spec gives them: they
//! choose the shape of the pod's VM (twig-node's smallest base template
//! shape that holds them), and a pod that fits no shape is refused before a
//! VM is taken. The limits inside the VM (cgroups v2, per container) are
//! the agent's, from each container's own spec.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::sandbox::VmShape;
use crate::spec::annotation;

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

/// Checks a container's new limits (containerd's Update: CRI's
/// UpdateContainerResources, kubelet's in-place resize; `resources` is an
/// OCI `linux.resources` as JSON) against its VM's `shape`: a pod is
/// resized inside its VM, which does not grow. A memory limit beyond the
/// VM's memory or a CPU limit beyond its vCPUs is `InvalidArgument` naming
/// the field and the shape; unreadable resources are too.
pub fn check_update(resources: &[u8], shape: VmShape) -> Result<()> {
    let r: Value = serde_json::from_slice(resources).map_err(|e| {
        Error::InvalidArgument(format!(
            "the container's new resources are not an OCI linux.resources: {e}"
        ))
    })?;
    let int = |ptr: &str| r.pointer(ptr).and_then(Value::as_i64).filter(|v| *v > 0);
    let beyond = |field: &str, asked: String| {
        Error::InvalidArgument(format!(
            "resources.{field}: {asked} is beyond the pod's VM ({} MiB, {} vCPUs): the twig \
             runtime resizes a pod inside its VM, which does not grow; recreate the pod to \
             give it more",
            shape.memory_bytes >> 20,
            shape.vcpus
        ))
    };
    if let Some(limit) = int("/memory/limit") {
        if limit as u64 > shape.memory_bytes {
            return Err(beyond("limits.memory", format!("{limit} bytes")));
        }
    }
    if let Some(quota) = int("/cpu/quota") {
        let period = int("/cpu/period").map_or(DEFAULT_CPU_PERIOD_US, |p| p as u64);
        let millis = (quota as u64).saturating_mul(1000).div_ceil(period);
        if millis > u64::from(shape.vcpus) * 1000 {
            return Err(beyond("limits.cpu", format!("{millis}m")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

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
    fn a_resize_beyond_the_vms_shape_is_refused_naming_the_field() {
        let shape = VmShape {
            memory_bytes: 512 << 20,
            vcpus: 2,
        };
        let ok = |json: serde_json::Value| check_update(json.to_string().as_bytes(), shape);
        ok(serde_json::json!({"memory": {"limit": 256 << 20}, "cpu": {"quota": 150_000, "period": 100_000}}))
            .unwrap();
        ok(serde_json::json!({"memory": {"limit": 512 << 20}, "cpu": {"quota": 200_000}})).unwrap();
        // -1 and 0 are "no limit", as in runc.
        ok(serde_json::json!({"memory": {"limit": -1}, "cpu": {"quota": -1}})).unwrap();
        ok(serde_json::json!({})).unwrap();
        let e = ok(serde_json::json!({"memory": {"limit": (512 << 20) + 1}})).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(
            e.to_string().contains("resources.limits.memory") && e.to_string().contains("512 MiB"),
            "{e}"
        );
        let e = ok(serde_json::json!({"cpu": {"quota": 250_000, "period": 100_000}})).unwrap_err();
        assert!(e.to_string().contains("resources.limits.cpu: 2500m"), "{e}");
        let e = check_update(b"not json", shape).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
}
