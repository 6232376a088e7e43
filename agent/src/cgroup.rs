//! A container's cgroup in the VM (cgroup v2 at `/sys/fs/cgroup`, mounted
//! by the agent at start): its memory, pids and CPU limits from the spec's
//! `linux.resources`, every process of the container in it, and the OOM
//! kills its memory limit caused (`memory.events`), which the shim reports
//! as containerd's TaskOOM (CRI: `OOMKilled`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use oci_spec::runtime::LinuxResources;

use crate::error::{AgentError, Result};

/// Where cgroup v2 is mounted in the VM.
const ROOT: &str = "/sys/fs/cgroup";
/// The agent's subtree: one child per container.
const SUBTREE: &str = "twig";

/// The limits the agent enforces.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Limits {
    /// `memory.max`, bytes.
    pub memory: Option<u64>,
    /// `memory.low`, bytes (the reservation).
    pub memory_low: Option<u64>,
    /// `pids.max`.
    pub pids: Option<u64>,
    /// `cpu.weight`, from the spec's shares.
    pub cpu_weight: Option<u64>,
    /// `cpu.max`: quota and period, microseconds.
    pub cpu_max: Option<(u64, u64)>,
    /// `cpuset.cpus`.
    pub cpus: Option<String>,
    /// `cpuset.mems`.
    pub mems: Option<String>,
}

/// CPU shares (cgroup v1, 2..=262144) as a cgroup v2 weight (1..=10000),
/// with runc's conversion.
fn shares_to_weight(shares: u64) -> u64 {
    let shares = shares.clamp(2, 262_144);
    1 + ((shares - 2) * 9999) / 262_142
}

impl Limits {
    /// The limits of `resources`. Zero and negative values mean "no limit",
    /// as in runc.
    pub fn of(resources: Option<&LinuxResources>) -> Limits {
        let Some(r) = resources else {
            return Limits::default();
        };
        let positive = |v: Option<i64>| v.filter(|v| *v > 0).map(|v| v as u64);
        let memory = r.memory().as_ref();
        let cpu = r.cpu().as_ref();
        let nonempty = |v: Option<&String>| v.filter(|v| !v.is_empty()).cloned();
        Limits {
            memory: positive(memory.and_then(|m| m.limit())),
            memory_low: positive(memory.and_then(|m| m.reservation())),
            pids: positive(r.pids().as_ref().map(|p| p.limit())),
            cpu_weight: cpu
                .and_then(|c| c.shares())
                .filter(|s| *s > 0)
                .map(shares_to_weight),
            cpu_max: positive(cpu.and_then(|c| c.quota())).map(|quota| {
                let period = cpu.and_then(|c| c.period()).filter(|p| *p > 0);
                (quota, period.unwrap_or(100_000))
            }),
            cpus: nonempty(cpu.and_then(|c| c.cpus().as_ref())),
            mems: nonempty(cpu.and_then(|c| c.mems().as_ref())),
        }
    }

    /// Whether any limit is given.
    pub fn any(&self) -> bool {
        *self != Limits::default()
    }
}

/// One container's cgroup; removed on drop (once its processes are gone).
#[derive(Debug)]
pub struct Cgroup {
    dir: PathBuf,
}

fn is_cgroup2(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
        .unwrap_or(false)
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value)
        .map_err(|e| AgentError::sys(format!("writing {value:?} to {}", path.display()), e))
}

impl Cgroup {
    /// Creates container `id`'s cgroup with `limits`. Without cgroup v2 at
    /// `/sys/fs/cgroup` (the agent run on a host for tests) there is none:
    /// `Ok(None)` if no limit is asked for, a clear error if one is.
    pub fn create(id: &str, limits: Limits) -> Result<Option<Cgroup>> {
        let root = Path::new(ROOT);
        if !is_cgroup2(root) {
            if limits.any() {
                return Err(AgentError::InvalidArgument(format!(
                    "container {id:?} has resource limits ({limits:?}), which need cgroup v2 \
                     at {ROOT}; it is not mounted there"
                )));
            }
            return Ok(None);
        }
        let subtree = root.join(SUBTREE);
        match std::fs::create_dir(&subtree) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(AgentError::sys(
                    format!("creating {}", subtree.display()),
                    e,
                ))
            }
        }
        for parent in [root, subtree.as_path()] {
            write(
                &parent.join("cgroup.subtree_control"),
                "+memory +pids +cpu +cpuset",
            )?;
        }
        let dir = subtree.join(id);
        std::fs::create_dir(&dir)
            .map_err(|e| AgentError::sys(format!("creating {}", dir.display()), e))?;
        let cgroup = Cgroup { dir };
        cgroup.apply(&limits)?;
        Ok(Some(cgroup))
    }

    /// Writes `limits` into the cgroup's files; a limit not given stays as
    /// it is.
    fn apply(&self, limits: &Limits) -> Result<()> {
        if let Some(max) = limits.memory {
            write(&self.dir.join("memory.max"), &max.to_string())?;
            // No swap in the VM, but a limit must never be escaped by it.
            write(&self.dir.join("memory.swap.max"), "0").ok();
        }
        if let Some(low) = limits.memory_low {
            write(&self.dir.join("memory.low"), &low.to_string())?;
        }
        if let Some(max) = limits.pids {
            write(&self.dir.join("pids.max"), &max.to_string())?;
        }
        if let Some(weight) = limits.cpu_weight {
            write(&self.dir.join("cpu.weight"), &weight.to_string())?;
        }
        if let Some((quota, period)) = limits.cpu_max {
            write(&self.dir.join("cpu.max"), &format!("{quota} {period}"))?;
        }
        if let Some(cpus) = &limits.cpus {
            write(&self.dir.join("cpuset.cpus"), cpus)?;
        }
        if let Some(mems) = &limits.mems {
            write(&self.dir.join("cpuset.mems"), mems)?;
        }
        Ok(())
    }

    /// Changes the running container's limits (CRI's
    /// UpdateContainerResources, kubelet's in-place resize), as runc's
    /// `update` does: what `limits` gives is written, the rest stays.
    pub fn update(&self, limits: &Limits) -> Result<()> {
        self.apply(limits)
    }

    /// Moves process `pid` into the cgroup.
    pub fn add(&self, pid: i32) -> Result<()> {
        write(&self.dir.join("cgroup.procs"), &pid.to_string())
    }

    /// SIGKILLs every process in the cgroup (`cgroup.kill`, Linux 5.14;
    /// before that, each pid of `cgroup.procs`).
    pub fn kill_all(&self) {
        if write(&self.dir.join("cgroup.kill"), "1").is_ok() {
            return;
        }
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }

    /// How many processes its memory limit has OOM-killed so far.
    pub fn oom_kills(&self) -> u64 {
        let path = self.dir.join("memory.events");
        std::fs::read_to_string(&path)
            .ok()
            .and_then(|text| parse_oom_kills(&text))
            .unwrap_or(0)
    }
}

/// `oom_kill` from a `memory.events` file.
fn parse_oom_kills(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // The last process may still be leaving (reaped, not yet unlinked
        // from the cgroup): retry briefly.
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(e) if Instant::now() >= deadline => {
                    tracing::warn!("removing {}: {e}", self.dir.display());
                    return;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_from_resources() {
        let r: LinuxResources = serde_json::from_value(serde_json::json!({
            "memory": {"limit": 67108864, "reservation": 0},
            "pids": {"limit": 64},
            "cpu": {"shares": 1024, "quota": 20000, "cpus": "0"}
        }))
        .unwrap();
        assert_eq!(
            Limits::of(Some(&r)),
            Limits {
                memory: Some(64 << 20),
                pids: Some(64),
                cpu_weight: Some(39),
                cpu_max: Some((20_000, 100_000)),
                cpus: Some("0".into()),
                ..Limits::default()
            }
        );
        let none: LinuxResources = serde_json::from_value(serde_json::json!({
            "memory": {"limit": -1}, "cpu": {"quota": -1, "cpus": ""}
        }))
        .unwrap();
        assert!(!Limits::of(Some(&none)).any());
        assert!(!Limits::of(None).any());
    }

    #[test]
    fn shares_become_runcs_weights() {
        assert_eq!(shares_to_weight(2), 1);
        assert_eq!(shares_to_weight(1024), 39);
        assert_eq!(shares_to_weight(262_144), 10_000);
        assert_eq!(shares_to_weight(1), 1);
    }

    #[test]
    fn oom_kills_from_memory_events() {
        let text = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(parse_oom_kills(text), Some(1));
        assert_eq!(parse_oom_kills("garbage"), None);
    }
}
