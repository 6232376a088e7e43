//! What the `Twig` service tests need from a node: where containerd keeps
//! a task's bundle (the shim's `address`, the runtime-v2 task directory the
//! controller's `ContainerdLocator` scans), the node store the twig shim
//! snapshots into, and a filesystem filled up on purpose.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::node::{Node, NAMESPACE};

fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what, source }
}

impl Node {
    /// containerd's runtime-v2 task directory of [`NAMESPACE`]: one
    /// bundle per task (`config.json`, `address`, …), what the
    /// controller's `ContainerdLocator` reads.
    pub fn task_dir(&self) -> Result<PathBuf> {
        Ok(self
            .dir()?
            .join("containerd/state/io.containerd.runtime.v2.task")
            .join(NAMESPACE))
    }

    /// The ttrpc address of the shim running task `id` (its bundle's
    /// `address` file).
    pub fn shim_address(&self, id: &str) -> Result<String> {
        let file = self.task_dir()?.join(id).join("address");
        fs::read_to_string(&file)
            .map(|a| a.trim().to_string())
            .map_err(io(format!("reading {}", file.display())))
    }

    /// The node store twig-node keeps the templates in, and so the twig
    /// shim the pods' snapshots: `store` of the node's `node.json`.
    pub fn vm_store(&self) -> Result<PathBuf> {
        let file = self.dir()?.join("node.json");
        let text = fs::read_to_string(&file).map_err(io(format!("reading {}", file.display())))?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Environment(format!("{}: {e}", file.display())))?;
        config["store"]
            .as_str()
            .map(PathBuf::from)
            .ok_or_else(|| Error::Environment(format!("{} names no store", file.display())))
    }
}

/// Fills the filesystem of `dir` until at most `leave` bytes stay free,
/// with one preallocated file (no data written: fast, and it costs no
/// memory when the filesystem sits on tmpfs). Remove the file to free the
/// space again.
pub fn fill_up(dir: &Path, leave: u64) -> Result<PathBuf> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(|e| Error::Io {
        what: format!("statvfs {}", dir.display()),
        source: e.into(),
    })?;
    let free = st.blocks_available() * st.fragment_size();
    let path = dir.join("filler");
    let file = File::create(&path).map_err(io(format!("creating {}", path.display())))?;
    let len = i64::try_from(free.saturating_sub(leave)).unwrap_or(i64::MAX);
    nix::fcntl::fallocate(&file, nix::fcntl::FallocateFlags::empty(), 0, len).map_err(|e| {
        Error::Io {
            what: format!("fallocate {} bytes for {}", len, path.display()),
            source: e.into(),
        }
    })?;
    Ok(path)
}
