//! The jail of the pool's VMMs (see the module doc of [`super`]): its
//! configuration, the `twig-vmm serve --jail` flags, the shared staging
//! directory, cgroup removal, and the grants that let each VMM's user read
//! the published snapshots it restores or wrote.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{own_dir, UID};
use crate::error::{Error, Result};

/// What confines the pool's VMMs (from [`crate::config::JailConfig`]).
pub(super) struct Jail {
    /// The first user id; each VMM has one of `uid .. uid + ids`.
    pub(super) uid: u32,
    pub(super) ids: u32,
    pub(super) gid: u32,
    pub(super) new_pid_ns: bool,
    pub(super) cgroup: Option<PathBuf>,
    pub(super) cgroup_settings: Vec<(String, String)>,
    pub(super) max_files: u64,
    /// Bound read-only at its own path: templates and snapshots to restore
    /// and roll back to (each VMM reads those it was granted).
    pub(super) snapshots: PathBuf,
    /// Bound read-write at its own path: staging directories of snapshots.
    pub(super) staging: PathBuf,
    /// The node store, whose published snapshots a VMM reads only once
    /// granted.
    pub(super) store: PathBuf,
}

impl Jail {
    /// Lets user `uid` (a jailed VMM's, handed over) read the snapshots
    /// `uses` and every parent they name.
    pub(super) fn grant(&self, uid: u32, uses: &[String]) -> Result<()> {
        for id in uses {
            twig_store::grants::grant_chain(&self.store, id, uid)?;
        }
        Ok(())
    }

    /// Takes back what user `uid` was granted to read (its VMM exited, or
    /// a new one is about to run as it): the snapshots its ledger in the
    /// store names, no walk of the store.
    pub(super) fn revoke(&self, uid: u32) -> Result<()> {
        twig_store::grants::revoke_grants(&self.store, uid)?;
        Ok(())
    }

    /// At the daemon's start: seals snapshots published open, and takes
    /// back the grants of every user of the range but `kept` (those of
    /// handed-over VMMs that run on).
    pub(super) fn forget_grants(&self, kept: &HashSet<u32>) -> Result<()> {
        let range = self.uid..self.uid.saturating_add(self.ids);
        twig_store::nodestore::seal_published(&self.store)?;
        twig_store::grants::revoke_reads(&self.store, |u| {
            range.contains(&u) && !kept.contains(&u)
        })?;
        Ok(())
    }
}

/// Lets jailed VMMs (group `gid`) create files in the store's `tmp`
/// (group-writable, sticky: nobody removes another's entries): a rollback
/// backs up a disk sent as a descriptor there, as an anonymous
/// (`O_TMPFILE`) reflink on the images' filesystem.
pub(super) fn share_staging(staging: &Path, gid: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::chown(staging, None, Some(gid))
        .map_err(|e| Error::io(format!("chown of {}", staging.display()), e))?;
    std::fs::set_permissions(staging, std::fs::Permissions::from_mode(0o1775))
        .map_err(|e| Error::io(format!("chmod of {}", staging.display()), e))
}

/// Adds the jail's flags to a `twig-vmm serve` command for the VMM in
/// `dir` (named `name`), running as `uid`: its root `dir/jail`, its own
/// directory and the store's `snapshots` (read-only) and `tmp` bound at
/// their host paths. The user id is recorded in `dir/uid`.
pub(super) fn jail_args(
    cmd: &mut tokio::process::Command,
    jail: &Jail,
    uid: u32,
    dir: &Path,
    name: &str,
) -> Result<()> {
    let root = dir.join("jail");
    let own = own_dir(dir);
    std::fs::create_dir(&root).map_err(|e| Error::io(format!("creating {}", root.display()), e))?;
    std::fs::write(dir.join(UID), uid.to_string())
        .map_err(|e| Error::io(format!("writing {}/{UID}", dir.display()), e))?;
    // The VMM creates its sockets and console log here, as its own user.
    std::os::unix::fs::chown(&own, Some(uid), Some(jail.gid))
        .map_err(|e| Error::io(format!("chown of {}", own.display()), e))?;
    let bind = |src: &Path, ro: bool| {
        let mut b = src.as_os_str().to_os_string();
        if ro {
            b.push(":ro");
        }
        b
    };
    cmd.arg("--jail")
        .arg(&root)
        .args(["--uid", &uid.to_string()])
        .args(["--gid", &jail.gid.to_string()])
        .args(["--max-files", &jail.max_files.to_string()])
        .arg("--jail-bind")
        .arg(bind(&own, false))
        .arg("--jail-bind")
        .arg(bind(&jail.snapshots, true))
        .arg("--jail-bind")
        .arg(bind(&jail.staging, false));
    if jail.new_pid_ns {
        cmd.arg("--new-pid-ns");
    }
    if let Some(cg) = &jail.cgroup {
        cmd.arg("--cgroup").arg(cg.join(name));
        for (file, value) in &jail.cgroup_settings {
            cmd.arg("--cgroup-set").arg(format!("{file}={value}"));
        }
    }
    Ok(())
}

/// How long the removal of an exited VMM's cgroup waits for its last
/// process (the PID namespace's init, killed when its parent died) to go.
const CGROUP_GONE_WITHIN: Duration = Duration::from_secs(5);

/// Removes the cgroup `name` from every hierarchy once it is empty.
pub(super) async fn remove_cgroup(name: &Path) {
    let hierarchies = match twig_vmm::jail::cgroup::hierarchies() {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!(cgroup = %name.display(), "listing cgroup hierarchies: {e}");
            return;
        }
    };
    let deadline = Instant::now() + CGROUP_GONE_WITHIN;
    for h in hierarchies {
        let path = h.mount.join(name);
        loop {
            match std::fs::remove_dir(&path) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                // EBUSY: a process of the VMM is still dying.
                Err(e) if Instant::now() < deadline => {
                    tracing::trace!(cgroup = %path.display(), "not removable yet: {e}");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(e) => {
                    tracing::warn!(cgroup = %path.display(), "removing a VMM's cgroup: {e}");
                    break;
                }
            }
        }
    }
}
