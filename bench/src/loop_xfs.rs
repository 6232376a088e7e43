//! A loop-mounted XFS with reflinks (`mkfs.xfs -m reflink=1`), for the
//! benchmarks that need FICLONE (the snapshotter's, and the vmm rows when
//! the benchmark's directory lacks it, as ext4 does). Needs root and
//! xfsprogs. Unmounted, detached and removed on drop, on every exit path;
//! a failed `new` undoes what it had done.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::stats::{Context, Error};

/// A sparse image file, its loop device and its mount point, all under one
/// directory that drop removes.
pub struct LoopXfs {
    base: PathBuf,
    mnt: PathBuf,
    /// Set once attached, so drop detaches only what was attached.
    loopdev: Option<String>,
    mounted: bool,
}

/// Runs `cmd`; returns its stdout, or an error with its stderr.
pub fn exec(cmd: &mut Command) -> Result<String, Error> {
    let out = cmd
        .output()
        .context(|| format!("cannot run {:?}", cmd.get_program()))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl LoopXfs {
    /// Makes a `size_mib` XFS in `base` (created, and removed on drop) and
    /// mounts it at `base/mnt`.
    pub fn new(base: &Path, size_mib: u64) -> Result<LoopXfs, Error> {
        fs::create_dir_all(base).context(|| format!("creating {}", base.display()))?;
        let mut xfs = LoopXfs {
            base: base.to_path_buf(),
            mnt: base.join("mnt"),
            loopdev: None,
            mounted: false,
        };
        let img = base.join("xfs.img");
        fs::File::create(&img)
            .and_then(|f| f.set_len(size_mib << 20))
            .context(|| format!("creating {}", img.display()))?;
        exec(
            Command::new("mkfs.xfs")
                .args(["-q", "-m", "reflink=1"])
                .arg(&img),
        )
        .context(|| "making the benchmark's XFS (needs root and xfsprogs)".into())?;
        let dev = exec(Command::new("losetup").args(["--find", "--show"]).arg(&img))?;
        xfs.loopdev = Some(dev.trim().to_string());
        fs::create_dir_all(&xfs.mnt).context(|| format!("creating {}", xfs.mnt.display()))?;
        exec(
            Command::new("mount")
                .args(["-t", "xfs"])
                .arg(dev.trim())
                .arg(&xfs.mnt),
        )?;
        xfs.mounted = true;
        Ok(xfs)
    }

    /// Where the XFS is mounted.
    pub fn mnt(&self) -> &Path {
        &self.mnt
    }
}

impl Drop for LoopXfs {
    fn drop(&mut self) {
        if self.mounted {
            if let Err(e) = exec(Command::new("umount").arg(&self.mnt)) {
                eprintln!("twig-bench: {e}");
            }
        }
        if let Some(dev) = &self.loopdev {
            if let Err(e) = exec(Command::new("losetup").args(["-d", dev])) {
                eprintln!("twig-bench: {e}");
            }
        }
        if let Err(e) = fs::remove_dir_all(&self.base) {
            eprintln!("twig-bench: removing {}: {e}", self.base.display());
        }
    }
}
