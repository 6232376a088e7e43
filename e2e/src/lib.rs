//! Twig's end-to-end test harness: a node in a box — a reflink XFS,
//! `twig-snapshotter`, containerd 1.6 with `twig` as its proxy snapshotter
//! and the runtimes `io.containerd.runc.v2` and `io.containerd.twig.v2` —
//! driven with `ctr`, every wait with a deadline, every process stopped by
//! PID at the end (on panic too).
//!
//! The harness finds its programs on `PATH` (containerd, `ctr`, runc and its
//! shim from Debian; `twig-snapshotter`, `twig-vmm` and
//! `containerd-shim-twig-v2` from the workspace build). The tests that use
//! it need Linux guests, so they run inside the nested lab:
//! `tests/lab/run.sh -p twig-e2e --features twig-e2e/lab` carries all of
//! that in, with the test image (`e2e/build-image.sh`).

mod background;
pub mod cgroup;
pub mod cost;
pub mod cri;
pub mod crilab;
pub mod ctrllab;
mod error;
pub mod kubelet;
pub mod must;
mod node;
mod process;
mod recovery;
pub mod redis;
mod twig;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

pub use background::{run_on_pty, Background};
pub use error::{Error, Result};
pub use node::{
    cni_conf_dir, containerd_config, mounts_under, shim_config, Guest, Node, NodeConfig, Runtime,
    BASE_MEM_MIB, NAMESPACE,
};
pub use process::{kill_processes_with_arg, run, run_ok, tail, Daemon, Output};
pub use recovery::{kill9, pids_with_arg, poll_until, proc_state, process_tree, signal, ProcState};
pub use twig::fill_up;

/// The test image's name, as `e2e/build-image.sh` names it by default.
pub const IMAGE_REF: &str = "docker.io/library/twig-e2e-busybox:v1";

/// The first executable file called `program` in a directory of `PATH`.
pub fn find_on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Fails unless running as root with every one of `programs` on `PATH`.
pub fn require(programs: &[&str]) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        return Err(Error::Environment(
            "the end-to-end tests need root (loop devices, mounts, containerd)".into(),
        ));
    }
    match programs.iter().find(|p| find_on_path(p).is_none()) {
        None => Ok(()),
        Some(p) => Err(Error::Missing {
            program: (*p).to_string(),
            hint: hint(p).to_string(),
        }),
    }
}

/// Where a program the harness needs comes from.
fn hint(program: &str) -> &'static str {
    match program {
        "twig-snapshotter" | "twig-vmm" | "containerd-shim-twig-v2" => {
            "a workspace binary: `cargo build` it and put target/debug on PATH, or run the \
             tests through tests/lab/run.sh, which carries it into the lab"
        }
        _ => "install it with scripts/install-deps.sh",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_on_path_finds_executables_only() {
        assert!(find_on_path("sh").is_some());
        assert!(find_on_path("twig-e2e-no-such-program").is_none());
    }

    #[test]
    fn a_missing_workspace_binary_says_how_to_get_it() {
        let err = Error::Missing {
            program: "twig-snapshotter".into(),
            hint: hint("twig-snapshotter").into(),
        };
        assert!(err.to_string().contains("tests/lab/run.sh"), "{err}");
    }
}
