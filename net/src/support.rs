//! Checking, at start, that the kernel can run the pod network path, and
//! choosing how the programs are attached.

use aya::maps::MapType;
use aya::programs::ProgramType;
use aya::sys::{is_map_supported, is_program_supported};
use aya::util::KernelVersion;

use crate::Error;

/// TCX (tc BPF links, pinnable, no qdisc) arrived in Linux 6.6.
const TCX_SINCE: KernelVersion = KernelVersion::new(6, 6, 0);

/// The environment variable that forces an [`AttachMode`]: `tcx` or `netlink`.
pub const ATTACH_MODE_ENV: &str = "TWIG_NET_ATTACH_MODE";

/// How the two programs are attached to the ingress of the veth and the tap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttachMode {
    /// TCX links (Linux ≥ 6.6), pinned in the pod's directory.
    Tcx,
    /// Classic tc: a `clsact` qdisc and a direct-action `bpf` filter, created
    /// through netlink (any kernel since 4.5; Debian bookworm's 6.1). The
    /// filters' priority and handle are recorded in the pod's `attachment`
    /// map and the programs are pinned, so a restarted process detaches
    /// exactly what was attached.
    Netlink,
}

impl AttachMode {
    /// The mode named by [`ATTACH_MODE_ENV`], if it is set.
    pub fn from_env() -> Result<Option<Self>, Error> {
        match std::env::var(ATTACH_MODE_ENV) {
            Ok(value) => value.parse().map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(value)) => Err(Error::Unsupported(format!(
                "{ATTACH_MODE_ENV}={value:?}: expected `tcx` or `netlink`"
            ))),
        }
    }
}

impl std::str::FromStr for AttachMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "tcx" => Ok(Self::Tcx),
            "netlink" => Ok(Self::Netlink),
            other => Err(Error::Unsupported(format!(
                "{ATTACH_MODE_ENV}={other:?}: expected `tcx` or `netlink`"
            ))),
        }
    }
}

impl std::fmt::Display for AttachMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tcx => "tcx",
            Self::Netlink => "netlink",
        })
    }
}

/// Checks the kernel and returns the attach mode to use: netlink tc filters
/// (any kernel; set-up well under a millisecond), or TCX links (6.6+) when
/// [`ATTACH_MODE_ENV`] asks for them. Fails with [`Error::Unsupported`] unless the kernel can load tc
/// programs and create LPM-trie and per-CPU array maps. Callers run it at
/// start: a node that cannot enforce the policy must refuse pods, not run
/// them with an open network.
pub fn check_support() -> Result<AttachMode, Error> {
    check_support_with(AttachMode::from_env()?)
}

/// [`check_support`] with the mode chosen by the caller (`None`: netlink).
/// Asking for [`AttachMode::Tcx`] on a kernel before 6.6 fails.
pub fn check_support_with(requested: Option<AttachMode>) -> Result<AttachMode, Error> {
    let version = KernelVersion::current()
        .map_err(|e| Error::Unsupported(format!("cannot read the kernel version: {e}")))?;
    let has_tcx = version >= TCX_SINCE;
    let mode = match requested {
        Some(AttachMode::Tcx) if !has_tcx => {
            return Err(Error::Unsupported(format!(
                "kernel {version} has no TCX links (Linux 6.6 or later needed); use `netlink`"
            )))
        }
        Some(mode) => mode,
        None => AttachMode::Netlink,
    };
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
    tracing::info!(kernel = %version, mode = %mode, "twig-net supported");
    Ok(mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print_and_bad_names_say_what_is_expected() {
        for mode in [AttachMode::Tcx, AttachMode::Netlink] {
            assert_eq!(mode.to_string().parse::<AttachMode>().ok(), Some(mode));
        }
        let err = "tc".parse::<AttachMode>().expect_err("not a mode");
        assert!(
            err.to_string().contains("expected `tcx` or `netlink`"),
            "{err}"
        );
    }
}
