//! Kubelet's part of a pod's cgroup, for the lab (which runs no kubelet):
//! a pod cgroup `/<top>/pod-<name>` in the cgroup v2 tree with the memory
//! controller on, as the cgroupfs driver makes it, handed to CRI as the
//! sandbox's `cgroup_parent`; removed, with what the runtime left in it,
//! on drop.

use std::path::{Path, PathBuf};

/// The lab's cgroup v2 tree.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// A pod cgroup.
pub struct PodCgroup {
    /// Its path below the root: CRI's `cgroup_parent`.
    pub parent: String,
    /// Its directory.
    pub dir: PathBuf,
}

fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("{value} > {}: {e}", path.display()))
}

impl PodCgroup {
    /// `/<top>/pod-<name>`, with a memory limit of `limit` bytes and no
    /// swap when given (unlimited otherwise).
    pub fn new(top: &str, name: &str, limit: Option<u64>) -> Result<PodCgroup, String> {
        let root = Path::new(CGROUP_ROOT);
        let parent = format!("/{top}/pod-{name}");
        let dir = root.join(top).join(format!("pod-{name}"));
        write(&root.join("cgroup.subtree_control"), "+memory")?;
        std::fs::create_dir_all(root.join(top)).map_err(|e| format!("creating {top}: {e}"))?;
        write(&root.join(top).join("cgroup.subtree_control"), "+memory")?;
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        if let Some(limit) = limit {
            write(&dir.join("memory.max"), &limit.to_string())?;
            write(&dir.join("memory.swap.max"), "0")?;
        }
        Ok(PodCgroup { parent, dir })
    }

    /// A number of the pod cgroup's `file` (`memory.current`), or of its
    /// `key` line (`memory.events`' `oom_kill`).
    pub fn number(&self, file: &str, key: Option<&str>) -> Result<u64, String> {
        let text = std::fs::read_to_string(self.dir.join(file))
            .map_err(|e| format!("{}/{file}: {e}", self.dir.display()))?;
        let value = match key {
            Some(k) => text
                .lines()
                .find_map(|l| l.strip_prefix(k)?.strip_prefix(' '))
                .ok_or_else(|| format!("no {k} in {file}: {text}"))?,
            None => text.trim(),
        };
        value
            .trim()
            .parse()
            .map_err(|e| format!("{file}: {value:?}: {e}"))
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        let leaves = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.path());
        for dir in leaves.chain([self.dir.clone()]) {
            if let Err(e) = std::fs::remove_dir(&dir) {
                eprintln!("removing {}: {e}", dir.display());
            }
        }
        if let Some(top) = self.dir.parent() {
            let _ = std::fs::remove_dir(top);
        }
    }
}
