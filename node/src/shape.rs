//! Which VM shape a pod gets: its limits (what the shim read from CRI's
//! sandbox resource annotations or the sandbox container's
//! `linux.resources`) plus the guest's own reserve, against the base
//! template shapes the node offers.
//!
//! A pod's memory limit is enforced by the guest's cgroup, so the guest
//! must have that much left after its own use, or the guest kernel's global
//! OOM killer (not the pod's cgroup) would act first. A guest keeps a fixed
//! part — its kernel, the agent's initramfs (the root filesystem, in RAM),
//! the agent and the pause process: `base.guest_reserve_mib`, default 28
//! MiB — plus 1/[`RESERVE_SHARE`] of its RAM (page structures, page tables,
//! the allocator's watermarks). The model keeps 32 MiB of 128 and 44 of
//! 512, above what the lab measured (30 and 39–40 MiB, `e2e/tests/shapes.rs`;
//! node/BENCHMARKS.md); so 256 MiB holds a pod limit of 220 MiB, 512 holds
//! 468, 1024 holds 964, 2048 holds 1956.
//!
//! The default shapes double RAM with vCPUs growing slower (a pod's CPU
//! limit is usually well under its GiB count), and the default stays the
//! smallest, so a pod with limits never gets less than one without.
//!
//! Why the daemon chooses, from limits the shim sends: the shim choosing
//! would be a second call on every pod's path and a second place that knows
//! the guest's reserve; the daemon owns the shapes, the templates and the
//! guest, so one `AcquireVm` carries what the pod asks and is answered with
//! a VM that holds it or a refusal before any VMM is taken.

use crate::error::{Error, Result};
use crate::template::{list, Shape};

const MIB: u64 = 1 << 20;

/// The part of a VM's RAM its guest keeps whatever the pod does, besides
/// the fixed reserve: 1/32 (its page structures and page tables, 1.6 %,
/// and the allocator's watermarks, which grow with RAM). Measured in the
/// lab: 30 MiB of a 128 MiB VM and 39 MiB of a 512 MiB one were not
/// available to the pod (e2e/BENCHMARKS.md, *VM shapes*).
pub const RESERVE_SHARE: u32 = 32;

/// What a guest of `mem_mib` MiB keeps for itself: `reserve_mib` plus
/// 1/[`RESERVE_SHARE`] of its RAM.
pub fn guest_keeps(mem_mib: u32, reserve_mib: u32) -> u64 {
    u64::from(reserve_mib) + u64::from(mem_mib.div_ceil(RESERVE_SHARE))
}

/// How much of a VM of `shape` a pod's memory limit may take, MiB.
pub fn holds_mib(shape: Shape, reserve_mib: u32) -> u64 {
    u64::from(shape.mem_mib).saturating_sub(guest_keeps(shape.mem_mib, reserve_mib))
}

/// What a pod may use; 0: no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Need {
    /// The pod's memory limit, bytes.
    pub memory_limit_bytes: u64,
    /// The pod's CPU limit, thousandths of a CPU.
    pub cpu_limit_millis: u32,
}

impl Need {
    /// Whether the pod has no limit at all.
    pub fn is_none(&self) -> bool {
        self.memory_limit_bytes == 0 && self.cpu_limit_millis == 0
    }

    /// The memory limit, MiB rounded up (0: none).
    pub fn limit_mib(&self) -> u64 {
        self.memory_limit_bytes.div_ceil(MIB)
    }

    /// The vCPUs its VM needs: the CPU limit rounded up.
    pub fn vcpus(&self) -> u32 {
        self.cpu_limit_millis.div_ceil(1000)
    }

    /// Whether a VM of `shape` holds the pod: its memory limit fits in
    /// what the guest leaves of the VM's RAM ([`holds_mib`]), its CPU
    /// limit in the vCPUs.
    pub fn fits(&self, shape: Shape, reserve_mib: u32) -> bool {
        (self.memory_limit_bytes == 0 || self.limit_mib() <= holds_mib(shape, reserve_mib))
            && shape.vcpus >= self.vcpus()
    }

    /// What the pod asks, for messages: `a memory limit of 700 MiB and a
    /// CPU limit of 2500m (3 vCPUs)`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.memory_limit_bytes != 0 {
            parts.push(format!("a memory limit of {} MiB", self.limit_mib()));
        }
        if self.cpu_limit_millis != 0 {
            parts.push(format!(
                "a CPU limit of {}m ({} vCPU{})",
                self.cpu_limit_millis,
                self.vcpus(),
                if self.vcpus() == 1 { "" } else { "s" }
            ));
        }
        if parts.is_empty() {
            "no limits".to_string()
        } else {
            parts.join(" and ")
        }
    }
}

/// A shape and what a pod's memory limit may take of it, for messages:
/// `2048 MiB × 4 vCPUs, which holds a memory limit of 1956 MiB`.
fn with_room(shape: Shape, reserve_mib: u32) -> String {
    format!(
        "{}, which holds a memory limit of {} MiB",
        list(&[shape]),
        holds_mib(shape, reserve_mib)
    )
}

/// The shape of a pod that needs `need`: `default` when it has no limit,
/// else the smallest of `offered` (sorted smallest first: by RAM, then
/// vCPUs) that fits. None fits: `FAILED_PRECONDITION` naming what the pod
/// asked and the largest shape.
pub fn choose(offered: &[Shape], default: Shape, need: &Need, reserve_mib: u32) -> Result<Shape> {
    if need.is_none() {
        return Ok(default);
    }
    offered
        .iter()
        .copied()
        .find(|s| need.fits(*s, reserve_mib))
        .ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "the pod asks for {}, more than any VM shape of this node holds (the largest: {}; \
                 offered: {}; a guest keeps {reserve_mib} MiB + 1/{RESERVE_SHARE} of its RAM): \
                 lower the pod's limits, or offer a larger shape in twig-node's base.shapes",
                need.describe(),
                offered
                    .iter()
                    .max_by_key(|s| (s.mem_mib, s.vcpus))
                    .map_or_else(|| "none".to_string(), |s| with_room(*s, reserve_mib)),
                list(offered)
            ))
        })
}

/// Checks that a VM of `shape` (a template's or a snapshot's, `what`)
/// holds a pod that needs `need`: such pods keep the snapshot's shape.
pub fn check_fits(shape: Shape, what: &str, need: &Need, reserve_mib: u32) -> Result<()> {
    if need.fits(shape, reserve_mib) {
        return Ok(());
    }
    Err(Error::FailedPrecondition(format!(
        "the pod asks for {}, more than {what} holds ({}): a pod restored from a snapshot keeps \
         its VM shape; lower the pod's limits",
        need.describe(),
        with_room(shape, reserve_mib)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(mem_mib: u32, vcpus: u32) -> Shape {
        Shape {
            mem_mib,
            vcpus,
            disk_slots: 8,
        }
    }

    fn need(mib: u64, millis: u32) -> Need {
        Need {
            memory_limit_bytes: mib * MIB,
            cpu_limit_millis: millis,
        }
    }

    #[test]
    fn the_smallest_shape_that_fits_is_chosen() {
        let offered = [shape(256, 1), shape(512, 2), shape(1024, 2), shape(2048, 4)];
        let default = offered[0];
        let pick = |n: Need| choose(&offered, default, &n, 32).unwrap();
        assert_eq!(pick(Need::default()), default, "no limits: the default");
        assert_eq!(pick(need(64, 0)), shape(256, 1));
        // 256 MiB hold 256 - 32 - 256/32 = 216 MiB.
        assert_eq!(holds_mib(shape(256, 1), 32), 216);
        assert_eq!(pick(need(216, 0)), shape(256, 1));
        assert_eq!(pick(need(217, 0)), shape(512, 2));
        // Bytes are rounded up to whole MiB.
        assert_eq!(
            pick(Need {
                memory_limit_bytes: 216 * MIB + 1,
                cpu_limit_millis: 0
            }),
            shape(512, 2)
        );
        assert_eq!(pick(need(0, 1000)), shape(256, 1));
        assert_eq!(
            pick(need(0, 1001)),
            shape(512, 2),
            "1.001 CPUs need 2 vCPUs"
        );
        assert_eq!(pick(need(100, 2000)), shape(512, 2));
        assert_eq!(pick(need(600, 500)), shape(1024, 2));
        assert_eq!(pick(need(600, 2500)), shape(2048, 4), "CPU decides");
        assert_eq!(holds_mib(shape(2048, 4), 32), 1952);
        assert_eq!(pick(need(1952, 4000)), shape(2048, 4));

        // A default that is not the smallest: limits choose among all.
        let larger_default = choose(&offered, offered[1], &need(64, 0), 32).unwrap();
        assert_eq!(larger_default, shape(256, 1));
        assert_eq!(
            choose(&offered, offered[1], &Need::default(), 32).unwrap(),
            offered[1]
        );
    }

    #[test]
    fn a_pod_that_fits_no_shape_is_refused_naming_its_ask_and_the_largest() {
        let offered = [shape(256, 1), shape(512, 2)];
        for (n, needle) in [
            (
                need(465, 0),
                "the pod asks for a memory limit of 465 MiB, more than any VM shape of this node \
                 holds (the largest: 512 MiB × 2 vCPUs, which holds a memory limit of 464 MiB; \
                 offered: 256 MiB × 1 vCPU, 512 MiB × 2 vCPUs; a guest keeps 32 MiB + 1/32 of \
                 its RAM)",
            ),
            (need(0, 2001), "a CPU limit of 2001m (3 vCPUs)"),
            (
                need(100, 3000),
                "a memory limit of 100 MiB and a CPU limit of 3000m (3 vCPUs)",
            ),
        ] {
            let e = choose(&offered, offered[0], &n, 32).unwrap_err();
            assert!(
                matches!(e, Error::FailedPrecondition(_)) && e.to_string().contains(needle),
                "{e}"
            );
        }
    }

    #[test]
    fn a_snapshot_keeps_its_shape_if_the_pod_fits() {
        let s = shape(256, 1);
        check_fits(s, "snapshot \"a\"", &need(216, 1000), 32).unwrap();
        check_fits(s, "snapshot \"a\"", &Need::default(), 32).unwrap();
        let e = check_fits(s, "snapshot \"a\"", &need(217, 0), 32).unwrap_err();
        assert!(
            matches!(e, Error::FailedPrecondition(_))
                && e.to_string().contains(
                    "the pod asks for a memory limit of 217 MiB, more than snapshot \"a\" holds \
                     (256 MiB × 1 vCPU, which holds a memory limit of 216 MiB)"
                ),
            "{e}"
        );
    }
}
