//! Confinement of a `twig-vmm serve` process, after Firecracker's jailer:
//! seccomp filters per thread ([`seccomp`]), and a jail ([`JailConfig`],
//! [`enter`]): its own mount namespace whose root is a per-VM directory
//! (`pivot_root`), holding only its own `/dev` (a tmpfs with `kvm` and,
//! with a tap, `net/tun`, owned by the VMM's user) and the host paths bound
//! into it; the pod's network namespace (or a new, empty one); optionally a
//! new PID namespace and a cgroup ([`cgroup`]); rlimits; an unprivileged
//! user and group with no capabilities and `PR_SET_NO_NEW_PRIVS`.
//!
//! Paths the VMM is given after entering (the API socket, `--disk`,
//! `--vsock-uds`, `--serial`, and the paths of API requests) are paths
//! inside the jail.
//!
//! Entered first thing, while the process has one thread, in this order:
//! cgroup (created under every mounted hierarchy, v1 and v2; v1 `cpuset`
//! levels get their parent's CPUs and nodes), network namespace (`--netns`,
//! else a new empty one), PID namespace (`--new-pid-ns`: the child is PID 1
//! there and dies with its parent, which exits the way the child did, so
//! the caller watches one pid), `/proc/self/pagemap` opened (snapshots'
//! hot lists read it), mount namespace (all mounts private, the
//! jail bound onto itself, `--jail-bind`s, the `/dev` tmpfs, `pivot_root`),
//! `RLIMIT_NOFILE`, an empty bounding set, no supplementary groups,
//! `setresgid`, `setresuid`, `PR_SET_NO_NEW_PRIVS`.
//!
//! - The jail directory must exist; it is `chown`ed (not recursively) to
//!   the VMM's user. Bind targets are created in it and stay as mount points.
//! - `--jail-bind SRC` with no target binds at the host path, so callers
//!   need no path translation (twig-node binds the VMM's directory, the
//!   store's `snapshots` read-only and `tmp` that way). A store bound `:ro`
//!   makes every snapshot `refused`.
//! - With `--tap` the VMM must be given `--netns` and the tap must exist
//!   there, owned by its uid (without `CAP_NET_ADMIN` it can only attach);
//!   with `--net` the tap comes later as a descriptor (`attach_net`).
//! - A PID namespace's init ignores unhandled signals from outside: stop a
//!   jailed VMM with the API's `shutdown`, or signal its parent, whose
//!   death SIGKILLs it (`PR_SET_PDEATHSIG`, set again after the uid change).
//! - The caller removes the cgroup after the VMM exited. uid/gid 0 are
//!   refused.

pub mod cgroup;
mod cli;
mod mount;
pub mod seccomp;

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::resource::{setrlimit, Resource};
use nix::unistd::{setgroups, setresgid, setresuid, Gid, Uid};

pub use cgroup::CgroupConfig;
pub use cli::{JailArgs, SeccompMode};
pub use mount::Bind;

/// What can go wrong while confining the VMM.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The jail's configuration is unusable.
    #[error("{0}")]
    Config(String),
    /// A system call setting up the jail failed.
    #[error("{op}: {source}")]
    Sys {
        /// What was being done.
        op: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Building or installing a seccomp filter failed.
    #[error("seccomp: {0}")]
    Seccomp(String),
}

impl JailError {
    pub(crate) fn sys(op: impl Into<String>, source: impl Into<std::io::Error>) -> JailError {
        JailError::Sys {
            op: op.into(),
            source: source.into(),
        }
    }
}

/// Where and as whom a VMM runs.
#[derive(Debug, Clone)]
pub struct JailConfig {
    /// The directory that becomes the VMM's `/`. It must exist; the VMM
    /// makes it its own (`chown uid:gid`, not recursive).
    pub root: PathBuf,
    /// The unprivileged user the VMM runs as (not 0).
    pub uid: u32,
    /// Its group (not 0).
    pub gid: u32,
    /// The network namespace to join (a path like `/var/run/netns/pod`,
    /// where the pod's tap lives); `None`: a new, empty one.
    pub netns: Option<PathBuf>,
    /// Host paths bound into the jail (snapshot stores, disk images, …).
    pub binds: Vec<Bind>,
    /// Give the jail `/dev/net/tun` (a `--tap` device is used).
    pub tun: bool,
    /// A cgroup to run in.
    pub cgroup: Option<CgroupConfig>,
    /// Run in a new PID namespace: the process forks, the child (PID 1 of
    /// the namespace) becomes the VMM, the parent waits for it and exits the
    /// same way (same code, or killed by the same signal).
    pub new_pid_ns: bool,
    /// `RLIMIT_NOFILE` of the VMM.
    pub max_files: u64,
}

/// Enters the jail: must be called while the process has one thread, before
/// any VM or socket exists. Returns in the confined process (with
/// [`JailConfig::new_pid_ns`], in the child; the parent never returns).
pub fn enter(cfg: &JailConfig) -> Result<(), JailError> {
    if cfg.uid == 0 || cfg.gid == 0 {
        return Err(JailError::Config(
            "the jail's --uid and --gid must not be 0".into(),
        ));
    }
    let root = std::fs::canonicalize(&cfg.root)
        .map_err(|e| JailError::sys(format!("the jail {}", cfg.root.display()), e))?;
    if !root.is_dir() || root == std::path::Path::new("/") {
        return Err(JailError::Config(format!(
            "the jail {} must be a directory other than /",
            root.display()
        )));
    }
    let devices = mount::host_devices(cfg.tun)?;
    if let Some(cg) = &cfg.cgroup {
        cgroup::join(cg, std::process::id())?;
    }
    match &cfg.netns {
        Some(path) => {
            let ns = File::open(path)
                .map_err(|e| JailError::sys(format!("opening netns {}", path.display()), e))?;
            setns(&ns, CloneFlags::CLONE_NEWNET)
                .map_err(|e| JailError::sys(format!("joining netns {}", path.display()), e))?;
        }
        None => unshare(CloneFlags::CLONE_NEWNET)
            .map_err(|e| JailError::sys("creating a network namespace", e))?,
    }
    if cfg.new_pid_ns {
        unshare(CloneFlags::CLONE_NEWPID)
            .map_err(|e| JailError::sys("creating a PID namespace", e))?;
        pidns::fork_and_wait()?;
    }
    // The VMM's own page tables, read for snapshots' hot lists
    // (`memory.rs`): `/proc` is out of reach once the root changes.
    crate::memory::keep_pagemap().map_err(|e| JailError::sys("opening /proc/self/pagemap", e))?;
    unshare(CloneFlags::CLONE_NEWNS)
        .map_err(|e| JailError::sys("creating a mount namespace", e))?;
    nix::unistd::chown(
        &root,
        Some(Uid::from_raw(cfg.uid)),
        Some(Gid::from_raw(cfg.gid)),
    )
    .map_err(|e| JailError::sys(format!("chown of {}", root.display()), e))?;
    mount::pivot(&root, &cfg.binds, &devices, cfg.uid, cfg.gid)?;
    setrlimit(Resource::RLIMIT_NOFILE, cfg.max_files, cfg.max_files)
        .map_err(|e| JailError::sys("setting RLIMIT_NOFILE", e))?;
    drop_privileges(cfg.uid, cfg.gid)?;
    if cfg.new_pid_ns {
        // Changing credentials cleared the parent-death signal.
        pidns::die_with_parent()?;
    }
    Ok(())
}

/// Becomes `uid:gid` with no supplementary groups, an empty capability
/// bounding set, no capabilities and `PR_SET_NO_NEW_PRIVS`.
fn drop_privileges(uid: u32, gid: u32) -> Result<(), JailError> {
    for cap in 0..=63 {
        // SAFETY: PR_CAPBSET_DROP takes a capability number and no
        // pointers; numbers past the kernel's last capability fail with
        // EINVAL, which ends the loop.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) && cap > 0 {
                break;
            }
            return Err(JailError::sys(format!("dropping capability {cap}"), e));
        }
    }
    setgroups(&[]).map_err(|e| JailError::sys("clearing supplementary groups", e))?;
    let (u, g) = (Uid::from_raw(uid), Gid::from_raw(gid));
    setresgid(g, g, g).map_err(|e| JailError::sys(format!("setresgid({gid})"), e))?;
    // Leaving uid 0 clears the permitted, effective and ambient sets (no
    // SECBIT_KEEP_CAPS).
    setresuid(u, u, u).map_err(|e| JailError::sys(format!("setresuid({uid})"), e))?;
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integers only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(JailError::sys(
            "PR_SET_NO_NEW_PRIVS",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// The new PID namespace's first process and the parent that waits for it.
mod pidns {
    use nix::sys::signal::{raise, signal, SigHandler};
    use nix::sys::wait::{waitpid, WaitStatus};
    use nix::unistd::{fork, ForkResult};

    use super::JailError;

    /// Has the kernel SIGKILL this process when its parent dies (a PID
    /// namespace's init ignores signals it has no handler for, SIGTERM
    /// included, so the parent's death is how a caller's signal reaches it).
    pub(super) fn die_with_parent() -> Result<(), JailError> {
        // SAFETY: PR_SET_PDEATHSIG takes integers only.
        if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) } != 0 {
            return Err(JailError::sys(
                "PR_SET_PDEATHSIG",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// Forks; returns in the child (PID 1 of the new namespace, killed if
    /// the parent dies). The parent waits for the child and ends the way it
    /// ended.
    pub(super) fn fork_and_wait() -> Result<(), JailError> {
        // SAFETY: the process has a single thread (the caller's contract),
        // so the child may run anything.
        match unsafe { fork() }.map_err(|e| JailError::sys("fork into the PID namespace", e))? {
            ForkResult::Child => die_with_parent(),
            ForkResult::Parent { child } => loop {
                match waitpid(child, None) {
                    Ok(WaitStatus::Exited(_, code)) => std::process::exit(code),
                    Ok(WaitStatus::Signaled(_, sig, _)) => {
                        tracing::error!("the jailed twig-vmm was killed by {sig}");
                        let _ = nix::sys::resource::setrlimit(
                            nix::sys::resource::Resource::RLIMIT_CORE,
                            0,
                            0,
                        );
                        // SAFETY: restoring the default action of a signal
                        // this process never handles.
                        let _ = unsafe { signal(sig, SigHandler::SigDfl) };
                        let _ = nix::sys::signal::sigprocmask(
                            nix::sys::signal::SigmaskHow::SIG_UNBLOCK,
                            Some(&nix::sys::signal::SigSet::from(sig)),
                            None,
                        );
                        let _ = raise(sig);
                        std::process::exit(128 + sig as i32);
                    }
                    Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => {
                        tracing::error!("waiting for the jailed twig-vmm: {e}");
                        std::process::exit(1);
                    }
                }
            },
        }
    }
}

/// The host's device number of `path` (a character device).
fn rdev(path: &str) -> Result<u64, JailError> {
    std::fs::metadata(path)
        .map(|m| m.rdev())
        .map_err(|e| JailError::sys(format!("looking at {path}"), e))
}

/// Performs a system call no filter allows (`personality(0xffffffff)`, a
/// harmless query): with the filters on, the kernel kills the process with
/// `SIGSYS`. Only in builds with the `test-trigger` feature.
#[cfg(feature = "test-trigger")]
pub fn forbidden_syscall() -> i64 {
    // SAFETY: personality(0xffffffff) only reads the persona.
    unsafe { libc::syscall(libc::SYS_personality, 0xffff_ffff_u64) }
}
