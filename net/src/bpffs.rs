//! The bpffs directory pods are pinned under.

use std::path::Path;

use nix::mount::{mount, MsFlags};
use nix::sys::statfs::statfs;

use crate::Error;

/// `BPF_FS_MAGIC` from `linux/magic.h`.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn is_bpffs(path: &Path) -> Result<bool, Error> {
    let stat = statfs(path).map_err(|e| Error::Bpffs {
        path: path.to_owned(),
        source: e.into(),
    })?;
    #[allow(clippy::unnecessary_cast)] // the field's type differs between targets
    Ok(stat.filesystem_type().0 as i64 == BPF_FS_MAGIC)
}

/// Makes sure `root` is a directory on a bpffs: creates it if needed and, when
/// it is not on a bpffs (e.g. `/sys/fs/bpf` was never mounted), mounts one
/// there.
pub fn ensure_bpffs(root: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(root).map_err(|source| Error::Bpffs {
        path: root.to_owned(),
        source,
    })?;
    if is_bpffs(root)? {
        return Ok(());
    }
    tracing::info!(path = %root.display(), "mounting bpffs");
    mount(
        Some("bpffs"),
        root,
        Some("bpf"),
        MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| Error::Bpffs {
        path: root.to_owned(),
        source: e.into(),
    })
}
