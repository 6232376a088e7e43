//! The VMM's cgroup, on cgroup v1 (one hierarchy per controller, as on
//! this machine's hybrid layout) and v2 (one unified tree).
//!
//! The group `name` is created under every mounted hierarchy (v1 and v2)
//! and the process joins each one, so that it is accounted everywhere; a
//! setting `FILE=VALUE` goes to the hierarchy of the controller its file
//! name starts with (`memory.limit_in_bytes` to v1's `memory` hierarchy,
//! `memory.max` or `pids.max` to v2 where that controller is enabled).
//! The caller removes the groups (`rmdir`) once the VMM has exited.

use std::path::{Component, Path, PathBuf};

use super::JailError;

/// A cgroup to run in and what to write into it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupConfig {
    /// The group, relative to each hierarchy's root (`twig/vm-1`).
    pub name: PathBuf,
    /// Files to write before joining, `(file, value)`.
    pub settings: Vec<(String, String)>,
}

/// A mounted cgroup hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    /// Where it is mounted.
    pub mount: PathBuf,
    /// v1: the controllers it carries (`["cpu"]`, `["name=systemd"]`);
    /// empty for v2.
    pub controllers: Vec<String>,
    /// Whether it is the v2 unified hierarchy.
    pub v2: bool,
}

/// The cgroup hierarchies mounted in this mount namespace.
pub fn hierarchies() -> Result<Vec<Hierarchy>, JailError> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| JailError::sys("reading /proc/self/mountinfo", e))?;
    Ok(parse_mountinfo(&info))
}

fn parse_mountinfo(info: &str) -> Vec<Hierarchy> {
    info.lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let mount = pre.split(' ').nth(4)?;
            let mut post = post.split(' ');
            let fstype = post.next()?;
            let opts = post.nth(1)?;
            match fstype {
                "cgroup2" => Some(Hierarchy {
                    mount: PathBuf::from(mount),
                    controllers: vec![],
                    v2: true,
                }),
                "cgroup" => Some(Hierarchy {
                    mount: PathBuf::from(mount),
                    controllers: opts
                        .split(',')
                        .filter(|o| !matches!(*o, "rw" | "ro") && !o.contains("xattr"))
                        .map(str::to_string)
                        .collect(),
                    v2: false,
                }),
                _ => None,
            }
        })
        .collect()
}

fn write(path: &Path, value: &str) -> Result<(), JailError> {
    std::fs::write(path, value)
        .map_err(|e| JailError::sys(format!("writing {value:?} to {}", path.display()), e))
}

/// Creates the group in every hierarchy, applies the settings and moves
/// process `pid` into it.
pub fn join(cfg: &CgroupConfig, pid: u32) -> Result<(), JailError> {
    if cfg.name.as_os_str().is_empty()
        || cfg
            .name
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
    {
        return Err(JailError::Config(format!(
            "the cgroup {:?} must be a relative path without ..",
            cfg.name
        )));
    }
    let all = hierarchies()?;
    if all.is_empty() {
        return Err(JailError::Config("no cgroup hierarchy is mounted".into()));
    }
    let mut unplaced: Vec<&(String, String)> = cfg.settings.iter().collect();
    for h in &all {
        let group = h.mount.join(&cfg.name);
        std::fs::create_dir_all(&group)
            .map_err(|e| JailError::sys(format!("creating cgroup {}", group.display()), e))?;
        if h.controllers.iter().any(|c| c == "cpuset") {
            inherit_cpuset(&h.mount, &cfg.name)?;
        }
        let mut i = 0;
        while i < unplaced.len() {
            let (file, value) = unplaced[i];
            let controller = file.split('.').next().unwrap_or_default();
            let here = if h.v2 {
                group.join(file).exists()
            } else {
                h.controllers.iter().any(|c| c == controller)
            };
            if here {
                write(&group.join(file), value)?;
                unplaced.remove(i);
            } else {
                i += 1;
            }
        }
        write(&group.join("cgroup.procs"), &pid.to_string())?;
    }
    if let Some((file, _)) = unplaced.first() {
        return Err(JailError::Config(format!(
            "no cgroup hierarchy has {file} (mounted: {})",
            all.iter()
                .map(|h| h.mount.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    Ok(())
}

/// v1 cpuset groups start with no CPUs and no memory nodes, and refuse
/// tasks (and children with some) until they have some: from the top
/// down, each level of the new group that has none gets its parent's.
fn inherit_cpuset(mount: &Path, name: &Path) -> Result<(), JailError> {
    let mut parent = mount.to_path_buf();
    for part in name.components() {
        let group = parent.join(part);
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let mine = std::fs::read_to_string(group.join(file)).unwrap_or_default();
            if mine.trim().is_empty() {
                let theirs = std::fs::read_to_string(parent.join(file)).map_err(|e| {
                    JailError::sys(format!("reading {}", parent.join(file).display()), e)
                })?;
                write(&group.join(file), theirs.trim())?;
            }
        }
        parent = group;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_finds_v1_and_v2_hierarchies() {
        let info = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
        let h = parse_mountinfo(info);
        assert_eq!(h.len(), 4);
        assert_eq!(h[0].controllers, vec!["cpu"]);
        assert_eq!(h[1].mount, PathBuf::from("/sys/fs/cgroup/memory"));
        assert_eq!(h[2].controllers, vec!["name=systemd"]);
        assert!(h[3].v2 && h[3].controllers.is_empty());
    }
}
