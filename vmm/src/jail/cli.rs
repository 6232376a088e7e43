//! The `serve` flags that confine the VMM.

use std::path::PathBuf;

use super::{seccomp, Bind, CgroupConfig, JailConfig, JailError};

/// Whether `serve` installs its seccomp filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SeccompMode {
    /// Filters on every thread; a syscall outside them kills the VMM.
    On,
    /// No filters: for debugging only.
    Off,
}

/// How `twig-vmm serve` is confined (flattened into its flags).
#[derive(Debug, Clone, clap::Args)]
pub struct JailArgs {
    /// Seccomp filters per thread (`off` is for debugging only).
    #[arg(long, value_enum, default_value_t = SeccompMode::On)]
    pub seccomp: SeccompMode,
    /// Run inside this directory as `/` (own mount namespace): every path
    /// the VMM is given (`--api-sock`, `--disk`, `--vsock-uds`, `--serial`,
    /// API requests) is then a path inside it. Needs root to start; the VMM
    /// then runs as `--uid`/`--gid` with no capabilities.
    #[arg(long, value_name = "DIR", requires_all = ["uid", "gid"])]
    pub jail: Option<PathBuf>,
    /// The jailed VMM's user id (not 0).
    #[arg(long, requires = "jail")]
    pub uid: Option<u32>,
    /// The jailed VMM's group id (not 0).
    #[arg(long, requires = "jail")]
    pub gid: Option<u32>,
    /// Bind a host path into the jail, `SOURCE[:TARGET][:ro]` (TARGET
    /// defaults to SOURCE). Repeatable: snapshot stores, disk images.
    #[arg(long = "jail-bind", value_name = "SRC[:DST][:ro]", requires = "jail")]
    pub binds: Vec<Bind>,
    /// The network namespace to join (where the pod's tap lives, e.g.
    /// /var/run/netns/pod); without it the jail gets a new, empty one.
    #[arg(long, requires = "jail")]
    pub netns: Option<PathBuf>,
    /// Run in this cgroup (relative, created in every hierarchy, v1 and v2).
    #[arg(long, requires = "jail")]
    pub cgroup: Option<PathBuf>,
    /// A cgroup setting `FILE=VALUE` (e.g. `pids.max=64`), repeatable.
    #[arg(long = "cgroup-set", value_name = "FILE=VALUE", requires = "cgroup", value_parser = parse_setting)]
    pub cgroup_settings: Vec<(String, String)>,
    /// Run as PID 1 of a new PID namespace; the process started stays as
    /// its parent and exits the way the VMM did.
    #[arg(long, requires = "jail")]
    pub new_pid_ns: bool,
    /// The jailed VMM's open file limit (RLIMIT_NOFILE).
    #[arg(long, default_value_t = 1024, requires = "jail")]
    pub max_files: u64,
}

fn parse_setting(s: &str) -> Result<(String, String), String> {
    let (file, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not FILE=VALUE"))?;
    if file.is_empty() || file.contains('/') || !file.contains('.') {
        return Err(format!("{file:?} is not a cgroup file name like pids.max"));
    }
    Ok((file.to_string(), value.to_string()))
}

impl JailArgs {
    /// The jail these flags describe, if any; `tun` says whether the VM
    /// uses a tap.
    pub fn config(&self, tun: bool) -> Result<Option<JailConfig>, JailError> {
        let Some(root) = self.jail.clone() else {
            return Ok(None);
        };
        let (Some(uid), Some(gid)) = (self.uid, self.gid) else {
            return Err(JailError::Config("--jail needs --uid and --gid".into()));
        };
        if tun && self.netns.is_none() {
            return Err(JailError::Config(
                "a jailed VMM with --tap needs --netns: the tap lives in the pod's network \
                 namespace, created there beforehand and owned by --uid"
                    .into(),
            ));
        }
        Ok(Some(JailConfig {
            root,
            uid,
            gid,
            netns: self.netns.clone(),
            binds: self.binds.clone(),
            tun,
            cgroup: self.cgroup.clone().map(|name| CgroupConfig {
                name,
                settings: self.cgroup_settings.clone(),
            }),
            new_pid_ns: self.new_pid_ns,
            max_files: self.max_files,
        }))
    }

    /// Enters the jail (if any) and turns the seccomp filters on (if on):
    /// call first thing, while the process has one thread. Afterwards, the
    /// caller confines its own thread with [`seccomp::confine`] once
    /// everything needing broader rights is open.
    pub fn apply(&self, tun: bool) -> Result<(), JailError> {
        if let Some(cfg) = self.config(tun)? {
            super::enter(&cfg)?;
        }
        if self.seccomp == SeccompMode::On {
            seccomp::enable();
        }
        Ok(())
    }
}
