//! The jail's mount namespace: the per-VM directory becomes `/`, with its
//! own `/dev` and the host paths bound into it.

use std::path::{Component, Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{mknod, Mode, SFlag};
use nix::unistd::{chdir, chown, pivot_root, Gid, Uid};

use super::{rdev, JailError};

/// A host path bound into the jail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    /// The host path (a file or a directory).
    pub source: PathBuf,
    /// Where it appears inside the jail (absolute, no `..`).
    pub target: PathBuf,
    /// Bound read-only.
    pub read_only: bool,
}

impl std::str::FromStr for Bind {
    type Err = String;

    /// `SOURCE[:TARGET][:ro]`; TARGET defaults to SOURCE.
    fn from_str(s: &str) -> Result<Bind, String> {
        let (rest, read_only) = match s.strip_suffix(":ro") {
            Some(r) => (r, true),
            None => (s.strip_suffix(":rw").unwrap_or(s), false),
        };
        let (source, target) = match rest.split_once(':') {
            Some((a, b)) => (PathBuf::from(a), PathBuf::from(b)),
            None => (PathBuf::from(rest), PathBuf::from(rest)),
        };
        if !source.is_absolute() || !target.is_absolute() {
            return Err(format!("{s:?}: both paths must be absolute"));
        }
        if target
            .components()
            .any(|c| matches!(c, Component::ParentDir))
        {
            return Err(format!("{s:?}: the jail path must not contain .."));
        }
        Ok(Bind {
            source,
            target,
            read_only,
        })
    }
}

/// A device node the jail gets in its `/dev`.
pub(super) struct Device {
    name: &'static str,
    rdev: u64,
}

/// `/dev/kvm`, and `/dev/net/tun` with `tun`, as the host numbers them.
pub(super) fn host_devices(tun: bool) -> Result<Vec<Device>, JailError> {
    let mut v = vec![Device {
        name: "kvm",
        rdev: rdev("/dev/kvm")?,
    }];
    if tun {
        v.push(Device {
            name: "net/tun",
            rdev: rdev("/dev/net/tun")?,
        });
    }
    Ok(v)
}

fn sys(op: String) -> impl FnOnce(nix::errno::Errno) -> JailError {
    move |e| JailError::sys(op, e)
}

/// In a fresh mount namespace: makes every mount private, mounts a tmpfs
/// on `root/dev` with the devices (owned by `uid:gid`, mode 0600) and
/// proc on `root/proc`, binds `binds`, and pivots into `root`, detaching
/// the old root.
pub(super) fn pivot(
    root: &Path,
    binds: &[Bind],
    devices: &[Device],
    uid: u32,
    gid: u32,
) -> Result<(), JailError> {
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none)
        .map_err(sys("making / private".into()))?;
    mount(
        Some(root),
        root,
        none,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        none,
    )
    .map_err(sys(format!("binding {} onto itself", root.display())))?;
    for b in binds {
        bind(root, b)?;
    }
    let dev = root.join("dev");
    std::fs::create_dir_all(&dev)
        .map_err(|e| JailError::sys(format!("creating {}", dev.display()), e))?;
    mount(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=0755,size=64k"),
    )
    .map_err(sys(format!("mounting a tmpfs on {}", dev.display())))?;
    for d in devices {
        let path = dev.join(d.name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| JailError::sys(format!("creating {}", parent.display()), e))?;
        }
        mknod(&path, SFlag::S_IFCHR, Mode::S_IRUSR | Mode::S_IWUSR, d.rdev)
            .map_err(sys(format!("mknod {}", path.display())))?;
        chown(&path, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
            .map_err(sys(format!("chown of {}", path.display())))?;
    }
    // The VMM reads /proc/self (smaps for its stats). Other users'
    // processes stay hidden (hidepid=2); in a new PID namespace it sees
    // only its own anyway.
    let proc = root.join("proc");
    std::fs::create_dir_all(&proc)
        .map_err(|e| JailError::sys(format!("creating {}", proc.display()), e))?;
    mount(
        Some("proc"),
        &proc,
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("hidepid=2"),
    )
    .map_err(sys(format!("mounting proc on {}", proc.display())))?;
    chdir(root).map_err(sys(format!("chdir to {}", root.display())))?;
    // The old root is stacked under the new one and detached at once, so
    // no directory for it is needed.
    pivot_root(".", ".").map_err(sys(format!("pivot_root into {}", root.display())))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(sys("detaching the old root".into()))?;
    chdir("/").map_err(sys("chdir to the new /".into()))?;
    Ok(())
}

/// Binds `b.source` on `root/b.target`, creating the target (a directory
/// or an empty file, like the source).
fn bind(root: &Path, b: &Bind) -> Result<(), JailError> {
    let rel = b.target.strip_prefix("/").unwrap_or(&b.target);
    let target = root.join(rel);
    let meta = std::fs::metadata(&b.source)
        .map_err(|e| JailError::sys(format!("the bind source {}", b.source.display()), e))?;
    let created = if meta.is_dir() {
        std::fs::create_dir_all(&target)
    } else {
        target
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|_| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&target)
                    .map(drop)
            })
    };
    created.map_err(|e| JailError::sys(format!("creating {}", target.display()), e))?;
    let none: Option<&str> = None;
    mount(
        Some(&b.source),
        &target,
        none,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        none,
    )
    .map_err(sys(format!(
        "binding {} on {}",
        b.source.display(),
        target.display()
    )))?;
    if b.read_only {
        mount(
            none,
            &target,
            none,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            none,
        )
        .map_err(sys(format!("making {} read-only", target.display())))?;
    }
    Ok(())
}
