//! Checking, at start, that the kernel can run the pod network path.

use aya::maps::MapType;
use aya::programs::ProgramType;
use aya::sys::{is_map_supported, is_program_supported};
use aya::util::KernelVersion;

use crate::Error;

/// TCX (tc BPF links, pinnable, no qdisc) arrived in Linux 6.6.
const TCX_SINCE: KernelVersion = KernelVersion::new(6, 6, 0);

/// Fails with [`Error::Unsupported`] unless the kernel can load tc programs,
/// attach them as TCX links, and create LPM-trie and per-CPU array maps.
/// Callers run it at start: a node that cannot enforce the policy must refuse
/// pods, not run them with an open network.
pub fn check_support() -> Result<(), Error> {
    let version = KernelVersion::current()
        .map_err(|e| Error::Unsupported(format!("cannot read the kernel version: {e}")))?;
    if version < TCX_SINCE {
        return Err(Error::Unsupported(format!(
            "kernel {version} has no TCX links (Linux 6.6 or later needed)"
        )));
    }
    match is_program_supported(ProgramType::SchedClassifier) {
        Ok(true) => {}
        Ok(false) => {
            return Err(Error::Unsupported(
                "tc (sched_cls) BPF programs are not supported".into(),
            ))
        }
        Err(e) => {
            return Err(Error::Unsupported(format!(
                "cannot load a tc BPF program (BPF disabled or not root?): {e}"
            )))
        }
    }
    for (map, name) in [
        (MapType::LpmTrie, "LPM trie"),
        (MapType::PerCpuArray, "per-CPU array"),
    ] {
        match is_map_supported(map) {
            Ok(true) => {}
            Ok(false) => {
                return Err(Error::Unsupported(format!(
                    "{name} BPF maps are not supported"
                )))
            }
            Err(e) => {
                return Err(Error::Unsupported(format!(
                    "cannot create a {name} BPF map: {e}"
                )))
            }
        }
    }
    Ok(())
}
