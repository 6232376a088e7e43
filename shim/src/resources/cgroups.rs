//! The pod's cgroup on the host: the VM is charged to the pod. CRI gives
//! the sandbox container a cgroup below kubelet's pod cgroup (the spec's
//! `linux.cgroupsPath`); the handed-over twig-vmm — the process twig-node
//! handed over and its children (the jail's PID namespace init) — moves
//! into it from twig-node's cgroup before the restore touches the VM's
//! memory, so the pod's memory limit bounds its VM and kubelet's eviction
//! and stats see it (Kata's `sandbox_cgroup_only`).
//!
//! As runc's cgroupfs manager places a container: the cgroup is created
//! (with its missing parents) and joined in every mounted hierarchy — each
//! v1 controller's, the named ones and the v2 unified tree — and its
//! limits are its parents', kubelet's pod cgroup's. A `slice:prefix:name`
//! path (kubelet's systemd driver) is converted as runc converts it and
//! created directly in cgroupfs. The shim itself stays where containerd
//! started it, as runc's shim does: outside the pod's CPU quota and OOM
//! domain, so a VM killed at its pod's limit is reported, not orphaned.
//! Over the pod's memory limit the host's OOM killer ends the VM (every
//! container 137). A move that fails fails the start
//! (`FailedPrecondition`, naming the cgroup and file). Not charged to the
//! pod: template pages already in the page cache (they count for whoever
//! read them first).

use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use twig_vmm::jail::cgroup::{hierarchies, Hierarchy};

use crate::error::{Error, Result};

/// The cgroup systemd's form names when its slice is empty (runc's
/// default parent).
const DEFAULT_SLICE: &str = "system.slice";

/// The sandbox's cgroup, an absolute path below each hierarchy's root, from
/// its spec's `linux.cgroupsPath`; `None` when the spec has none (the VM
/// stays in twig-node's cgroup). A path that is neither absolute nor
/// systemd's `slice:prefix:name` is an error naming it.
pub fn sandbox_cgroup(spec: &Value) -> Result<Option<PathBuf>> {
    match spec
        .pointer("/linux/cgroupsPath")
        .and_then(Value::as_str)
        .filter(|p| !p.is_empty())
    {
        Some(path) => parse(path).map(Some),
        None => {
            tracing::debug!("the sandbox's spec has no linux.cgroupsPath: its VM is not moved");
            Ok(None)
        }
    }
}

/// A `linux.cgroupsPath` as a cgroup path: cgroupfs's absolute
/// `/kubepods/burstable/pod<uid>/<id>` as it is, systemd's
/// `kubepods-burstable-pod<uid>.slice:cri-containerd:<id>` as
/// `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope`.
pub fn parse(cgroups_path: &str) -> Result<PathBuf> {
    let bad = |why: &str| {
        Error::InvalidArgument(format!(
            "linux.cgroupsPath {cgroups_path:?} {why} (an absolute cgroupfs path or systemd's \
             slice:prefix:name)"
        ))
    };
    let path = if cgroups_path.starts_with('/') {
        PathBuf::from(cgroups_path)
    } else {
        let parts: Vec<&str> = cgroups_path.split(':').collect();
        let [slice, prefix, name] = parts[..] else {
            return Err(bad("is not absolute"));
        };
        if name.is_empty() || prefix.contains('/') || name.contains('/') {
            return Err(bad("has no usable unit name"));
        }
        let slice = if slice.is_empty() {
            DEFAULT_SLICE
        } else {
            slice
        };
        let unit = match (name.ends_with(".slice"), prefix.is_empty()) {
            (true, _) => name.to_string(),
            (false, true) => format!("{name}.scope"),
            (false, false) => format!("{prefix}-{name}.scope"),
        };
        expand_slice(slice)
            .ok_or_else(|| bad("has an invalid slice"))?
            .join(unit)
    };
    if path
        .to_string_lossy()
        .split('/')
        .any(|part| part == "." || part == "..")
    {
        return Err(bad("has . or .. in it"));
    }
    if !path.components().any(|c| matches!(c, Component::Normal(_))) {
        return Err(bad("names the root cgroup"));
    }
    Ok(path)
}

/// systemd's path of a slice: `a-b-c.slice` is `/a.slice/a-b.slice/a-b-c.slice`,
/// `-.slice` the root; `None` for a name systemd refuses (runc's
/// `ExpandSlice`).
fn expand_slice(slice: &str) -> Option<PathBuf> {
    let stem = slice.strip_suffix(".slice")?;
    if stem.is_empty() || slice.contains('/') {
        return None;
    }
    let mut path = PathBuf::from("/");
    if stem == "-" {
        return Some(path);
    }
    let mut prefix = String::new();
    for part in stem.split('-') {
        if part.is_empty() {
            return None;
        }
        path.push(format!("{prefix}{part}.slice"));
        prefix.push_str(part);
        prefix.push('-');
    }
    Some(path)
}

/// Moves process `pid` and its descendants (parents first) into `cgroup`
/// (from [`sandbox_cgroup`]) in every mounted hierarchy, creating it where
/// it is missing; a v1 `cpuset` group gets its parent's CPUs and memory
/// nodes. A failure is `FailedPrecondition` naming the cgroup, the file and
/// the errno: a pod whose limit cannot be enforced does not start.
pub fn join(cgroup: &Path, pid: u32) -> Result<()> {
    let fail = |what: String, e: std::io::Error| {
        Error::FailedPrecondition(format!(
            "moving pid {pid} (the pod's twig-vmm or file server) into the pod's cgroup {} \
             (linux.cgroupsPath): {what}: {e}",
            cgroup.display()
        ))
    };
    let relative = cgroup.strip_prefix("/").unwrap_or(cgroup);
    let mounted = hierarchies().map_err(|e| {
        Error::FailedPrecondition(format!(
            "moving pid {pid} (the pod's twig-vmm or file server) into the pod's cgroup {}: {e}",
            cgroup.display()
        ))
    })?;
    if mounted.is_empty() {
        return Err(fail(
            "no cgroup hierarchy is mounted".into(),
            std::io::ErrorKind::NotFound.into(),
        ));
    }
    let tree = process_tree(pid).map_err(|e| fail(format!("listing /proc/{pid}'s children"), e))?;
    for h in &mounted {
        let group = h.mount.join(relative);
        std::fs::create_dir_all(&group)
            .map_err(|e| fail(format!("creating {}", group.display()), e))?;
        if is_cpuset(h) {
            inherit_cpuset(&h.mount, relative).map_err(|(file, e)| fail(file, e))?;
        }
        let procs = group.join("cgroup.procs");
        for p in &tree {
            std::fs::write(&procs, p.to_string())
                .map_err(|e| fail(format!("writing {p} to {}", procs.display()), e))?;
        }
    }
    tracing::debug!(cgroup = %cgroup.display(), pids = ?tree, hierarchies = mounted.len(), "twig-vmm moved into the pod's cgroup");
    Ok(())
}

/// How long the sandbox's cgroup may keep tasks after its VMM was reaped
/// (the jail's PID namespace empties as the kernel tears it down).
const REMOVE_WAIT: Duration = Duration::from_secs(2);

/// Removes the sandbox's cgroup (only the leaf the shim made, as runc
/// removes a container's) from every mounted hierarchy once its VMM
/// exited, so kubelet can remove the pod's cgroup. Missing is fine; one
/// still holding tasks after [`REMOVE_WAIT`] is an error naming it.
pub fn remove(cgroup: &Path) -> Result<()> {
    let relative = cgroup.strip_prefix("/").unwrap_or(cgroup);
    let mounted = hierarchies().map_err(|e| {
        Error::FailedPrecondition(format!(
            "removing the pod's cgroup {}: {e}",
            cgroup.display()
        ))
    })?;
    let deadline = Instant::now() + REMOVE_WAIT;
    for h in &mounted {
        let group = h.mount.join(relative);
        loop {
            match std::fs::remove_dir(&group) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => {
                    return Err(Error::FailedPrecondition(format!(
                        "removing the pod's cgroup {}: {e}",
                        group.display()
                    )))
                }
            }
        }
    }
    tracing::debug!(cgroup = %cgroup.display(), "the pod's cgroup removed");
    Ok(())
}

fn is_cpuset(h: &Hierarchy) -> bool {
    !h.v2 && h.controllers.iter().any(|c| c == "cpuset")
}

/// `pid` and every process below it, parents before their children (a
/// child that exits meanwhile is left out; `pid` itself must be there).
fn process_tree(pid: u32) -> std::io::Result<Vec<u32>> {
    let mut tree = vec![pid];
    let mut i = 0;
    while let Some(&p) = tree.get(i) {
        let tasks = match std::fs::read_dir(format!("/proc/{p}/task")) {
            Ok(t) => t,
            Err(e) if i > 0 && e.kind() == std::io::ErrorKind::NotFound => {
                i += 1;
                continue;
            }
            Err(e) => return Err(e),
        };
        for task in tasks {
            match std::fs::read_to_string(task?.path().join("children")) {
                Ok(children) => tree.extend(
                    children
                        .split_whitespace()
                        .filter_map(|c| c.parse::<u32>().ok()),
                ),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        i += 1;
    }
    Ok(tree)
}

/// v1 cpuset groups start with no CPUs and no memory nodes and refuse
/// tasks until they have some: from the top down, each level of `relative`
/// that has none gets its parent's. An error names the file.
fn inherit_cpuset(
    mount: &Path,
    relative: &Path,
) -> std::result::Result<(), (String, std::io::Error)> {
    let mut parent = mount.to_path_buf();
    for part in relative.components() {
        let group = parent.join(part);
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let (mine, theirs) = (group.join(file), parent.join(file));
            let own = std::fs::read_to_string(&mine)
                .map_err(|e| (format!("reading {}", mine.display()), e))?;
            if own.trim().is_empty() {
                let value = std::fs::read_to_string(&theirs)
                    .map_err(|e| (format!("reading {}", theirs.display()), e))?;
                std::fs::write(&mine, value.trim())
                    .map_err(|e| (format!("writing {} to {}", value.trim(), mine.display()), e))?;
            }
        }
        parent = group;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_cgroupfs_path_is_taken_as_it_is() {
        assert_eq!(
            parse("/kubepods/burstable/pod1234/abcd").unwrap(),
            PathBuf::from("/kubepods/burstable/pod1234/abcd")
        );
        assert_eq!(
            parse("/k8s.io/abcd/").unwrap(),
            PathBuf::from("/k8s.io/abcd")
        );
    }

    #[test]
    fn a_systemd_path_is_converted_as_runc_converts_it() {
        let cases = [
            (
                "kubepods-burstable-pod12_34.slice:cri-containerd:abcd",
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod12_34.slice/\
                 cri-containerd-abcd.scope",
            ),
            (
                "kubepods-pod12.slice:cri-containerd:abcd",
                "/kubepods.slice/kubepods-pod12.slice/cri-containerd-abcd.scope",
            ),
            ("machine.slice::abcd", "/machine.slice/abcd.scope"),
            (":docker:abcd", "/system.slice/docker-abcd.scope"),
            ("-.slice:p:abcd", "/p-abcd.scope"),
            ("a-b.slice:p:c-d.slice", "/a.slice/a-b.slice/c-d.slice"),
        ];
        for (given, want) in cases {
            assert_eq!(parse(given).unwrap(), PathBuf::from(want), "{given}");
        }
    }

    #[test]
    fn paths_neither_form_takes_are_refused_naming_them() {
        for bad in [
            "kubepods/pod1/abcd",
            "a.slice:b",
            "a.slice:b:c:d",
            "a.slice:p:",
            "notaslice:p:abcd",
            "a--b.slice:p:abcd",
            "-a.slice:p:abcd",
            "a.slice:p:x/y",
            "/kubepods/../etc",
            "/kubepods/./pod",
            "/",
        ] {
            let e = parse(bad).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(bad),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_spec_without_cgroups_path_moves_nothing() {
        assert_eq!(sandbox_cgroup(&json!({})).unwrap(), None);
        assert_eq!(
            sandbox_cgroup(&json!({"linux": {"cgroupsPath": ""}})).unwrap(),
            None
        );
        assert_eq!(
            sandbox_cgroup(&json!({"linux": {"cgroupsPath": "/kubepods/pod1/sb"}})).unwrap(),
            Some(PathBuf::from("/kubepods/pod1/sb"))
        );
    }

    #[test]
    fn the_process_tree_of_a_shell_holds_its_subshell() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "(sleep 30; :); :"])
            .spawn()
            .unwrap();
        let pid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let tree = loop {
            let tree = process_tree(pid).unwrap();
            if tree.len() >= 3 || std::time::Instant::now() > deadline {
                break tree;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        for p in tree.iter().rev() {
            // SAFETY: kill takes integers only.
            unsafe { libc::kill(*p as i32, libc::SIGKILL) };
        }
        child.wait().unwrap();
        assert_eq!(tree.first(), Some(&pid));
        assert!(tree.len() >= 3, "sh, its subshell and sleep: {tree:?}");
        assert!(process_tree(u32::MAX).is_err());
    }
}
