//! The device nodes of a container's `/dev`.
//!
//! A spec's `linux.devices` name the *host's* devices (CRI fills them from
//! the node's `/dev`); in a VM only the guest kernel's devices exist, with
//! its own numbers. So:
//!
//! - a container allowed every device (`linux.resources.devices` ends with
//!   an allow-all `rwm` rule: what CRI, Docker and Podman give a privileged
//!   container) gets a copy of the guest's own device nodes, and the
//!   spec's list (the host's `/dev`) is ignored;
//! - any other container gets the spec's devices that the guest kernel has
//!   (a `/sys/dev/{char,block}/MAJOR:MINOR` entry); the others are left out
//!   with a warning rather than failing the container.
//!
//! In both cases a path that already exists in the container (the default
//! devices the helper binds, a node of the image) is left as it is, as
//! runc does.
//!
//! Why not the host's list: host numbers mean other devices here (dynamic
//! majors such as virtio-blk's 254 collide). A privileged container's reach
//! is the pod's VM, as a runc one's is the node: the guest's devices
//! include the pod's virtio-blk disks (every container's rootfs). Device
//! cgroup rules themselves are accepted (containerd sends them for every
//! container) but not enforced: the guest has no cgroup v2 device program
//! (`BPF_PROG_TYPE_CGROUP_DEVICE`) wired up, so a container granted
//! CAP_MKNOD could create and open other device nodes of the VM.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use oci_spec::runtime::{LinuxDevice, LinuxDeviceType, Spec};
use serde::{Deserialize, Serialize};

/// What kind of node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    Char,
    Block,
    Fifo,
}

impl Kind {
    fn mode_bits(self) -> libc::mode_t {
        match self {
            Kind::Char => libc::S_IFCHR,
            Kind::Block => libc::S_IFBLK,
            Kind::Fifo => libc::S_IFIFO,
        }
    }
}

/// A device node to create in a container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    /// Its absolute path in the container.
    pub path: PathBuf,
    pub kind: Kind,
    pub major: u64,
    pub minor: u64,
    /// Permission bits.
    pub mode: u32,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

impl Node {
    /// The node a spec entry asks for; `None` for type `a`, which names no
    /// node.
    pub fn from_spec(d: &LinuxDevice) -> Option<Node> {
        let kind = match d.typ() {
            LinuxDeviceType::C | LinuxDeviceType::U => Kind::Char,
            LinuxDeviceType::B => Kind::Block,
            LinuxDeviceType::P => Kind::Fifo,
            LinuxDeviceType::A => return None,
        };
        Some(Node {
            path: d.path().clone(),
            kind,
            // Negative numbers are nonsense; as u64 they name no device.
            major: d.major() as u64,
            minor: d.minor() as u64,
            mode: d.file_mode().unwrap_or(0o666),
            uid: d.uid(),
            gid: d.gid(),
        })
    }

    /// The node of a raw block volume (a pod's `volumeDevices`): the
    /// guest's disk numbered `rdev` at `path` in the container, with
    /// `mode` (at most 0o777), `uid` and `gid`. `path` must be absolute,
    /// without `.` or `..` components.
    pub fn block_volume(
        path: &str,
        rdev: u64,
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<Node, String> {
        let p = Path::new(path);
        let plain = p
            .components()
            .skip(1)
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !p.is_absolute() || !plain || p.parent().is_none() {
            return Err(format!(
                "block volume path {path:?} is not an absolute path below / without . or .."
            ));
        }
        if mode > 0o777 {
            return Err(format!(
                "block volume {path}: mode {mode:#o} is more than 0o777"
            ));
        }
        Ok(Node {
            path: p.to_path_buf(),
            kind: Kind::Block,
            major: libc::major(rdev).into(),
            minor: libc::minor(rdev).into(),
            mode,
            uid: Some(uid),
            gid: Some(gid),
        })
    }

    /// Whether the running kernel has this device (a fifo always "exists").
    /// Without `/sys/dev` (sysfs not mounted) it cannot tell and says yes.
    pub fn in_kernel(&self) -> bool {
        in_kernel(Path::new("/sys/dev"), self)
    }

    /// Creates the node at `dest` (the container's path resolved on the
    /// host side); `Ok(false)` when something is already there.
    pub fn create(&self, dest: &Path) -> io::Result<bool> {
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let path = std::ffi::CString::new(dest.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let rdev = libc::makedev(self.major as u32, self.minor as u32);
        // SAFETY: mknod with a NUL-terminated path.
        if unsafe { libc::mknod(path.as_ptr(), self.kind.mode_bits() | self.mode, rdev) } < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EEXIST) {
                return Ok(false);
            }
            return Err(e);
        }
        // mknod applies the umask; the node gets exactly its mode.
        std::fs::set_permissions(
            dest,
            std::os::unix::fs::PermissionsExt::from_mode(self.mode),
        )?;
        nix::unistd::chown(
            dest,
            self.uid.map(nix::unistd::Uid::from_raw),
            self.gid.map(nix::unistd::Gid::from_raw),
        )?;
        Ok(true)
    }
}

fn in_kernel(sys_dev: &Path, n: &Node) -> bool {
    let class = match n.kind {
        Kind::Char => "char",
        Kind::Block => "block",
        Kind::Fifo => return true,
    };
    if std::fs::symlink_metadata(sys_dev.join(class)).is_err() {
        return true;
    }
    std::fs::symlink_metadata(sys_dev.join(class).join(format!("{}:{}", n.major, n.minor))).is_ok()
}

/// Whether the spec lets the container use every device: its device cgroup
/// rules end with an allow-all rule (no type or type `a`, no numbers) with
/// `r`, `w` and `m`, and no deny rule follows it. CRI's privileged
/// containers (with or without host devices), Docker's and Podman's
/// `--privileged` look so; a default container starts with deny-all.
pub fn allows_every_device(spec: &Spec) -> bool {
    let Some(rules) = spec
        .linux()
        .as_ref()
        .and_then(|l| l.resources().as_ref())
        .and_then(|r| r.devices().as_ref())
    else {
        return false;
    };
    let mut all = false;
    for r in rules {
        let wildcard = matches!(r.typ(), None | Some(LinuxDeviceType::A))
            && r.major().is_none()
            && r.minor().is_none();
        if wildcard {
            all = r.allow()
                && r.access()
                    .as_deref()
                    .is_some_and(|a| a.contains('r') && a.contains('w') && a.contains('m'));
        } else if !r.allow() {
            all = false;
        }
    }
    all
}

/// The device nodes under `dev` (the guest's devtmpfs), as nodes of the
/// container's `/dev`: character and block devices, subdirectories
/// included; symlinks, other mounts below it (devpts, `/dev/shm`,
/// mqueue) and `console` (the VM's serial console; a container's console
/// is its own terminal, as containerd leaves it out of host devices) are
/// not.
pub fn guest_devices(dev: &Path) -> io::Result<Vec<Node>> {
    let fs = std::fs::metadata(dev)?.dev();
    let mut nodes = Vec::new();
    let mut dirs = vec![PathBuf::new()];
    while let Some(rel) = dirs.pop() {
        let mut entries = std::fs::read_dir(dev.join(&rel))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<Vec<_>>>()?;
        entries.sort();
        for name in entries {
            let rel = rel.join(&name);
            if rel == Path::new("console") {
                continue;
            }
            let m = match std::fs::symlink_metadata(dev.join(&rel)) {
                Ok(m) => m,
                // Gone since read_dir (a hot-unplugged disk).
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let t = m.file_type();
            let kind = if t.is_dir() {
                if m.dev() == fs {
                    dirs.push(rel);
                }
                continue;
            } else if t.is_char_device() {
                Kind::Char
            } else if t.is_block_device() {
                Kind::Block
            } else {
                continue;
            };
            let rdev = m.rdev();
            nodes.push(Node {
                path: Path::new("/dev").join(&rel),
                kind,
                major: nix::sys::stat::major(rdev),
                minor: nix::sys::stat::minor(rdev),
                mode: m.mode() & 0o7777,
                uid: Some(m.uid()),
                gid: Some(m.gid()),
            });
        }
    }
    nodes.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(linux: serde_json::Value) -> Spec {
        serde_json::from_value(serde_json::json!({"ociVersion": "1.0.2", "linux": linux})).unwrap()
    }

    fn rules(r: serde_json::Value) -> Spec {
        spec(serde_json::json!({"resources": {"devices": r}}))
    }

    #[test]
    fn privileged_is_an_allow_all_rwm_rule_left_standing() {
        // containerd's privileged container: the list replaced by one rule.
        assert!(allows_every_device(&rules(
            serde_json::json!([{"allow": true, "access": "rwm"}])
        )));
        assert!(allows_every_device(&rules(
            serde_json::json!([{"allow": false, "access": "rwm"}, {"allow": true, "type": "a", "access": "rwm"}])
        )));
        // containerd's default: deny all, then a few devices allowed.
        assert!(!allows_every_device(&rules(serde_json::json!([
            {"allow": false, "access": "rwm"},
            {"allow": true, "type": "c", "major": 10, "minor": 229, "access": "rwm"}
        ]))));
        // Allowed, then taken back, in whole or in part.
        assert!(!allows_every_device(&rules(
            serde_json::json!([{"allow": true, "access": "rwm"}, {"allow": false, "access": "rwm"}])
        )));
        assert!(!allows_every_device(&rules(serde_json::json!([
            {"allow": true, "access": "rwm"},
            {"allow": false, "type": "b", "major": 8, "minor": 0, "access": "rwm"}
        ]))));
        // Not every access, or only every character device.
        assert!(!allows_every_device(&rules(
            serde_json::json!([{"allow": true, "access": "rw"}])
        )));
        assert!(!allows_every_device(&rules(
            serde_json::json!([{"allow": true, "type": "c", "access": "rwm"}])
        )));
        assert!(!allows_every_device(&rules(serde_json::json!([]))));
        assert!(!allows_every_device(&spec(serde_json::json!({}))));
    }

    fn node(kind: Kind, major: u64, minor: u64) -> Node {
        Node {
            path: PathBuf::from("/dev/x"),
            kind,
            major,
            minor,
            mode: 0o666,
            uid: None,
            gid: None,
        }
    }

    #[test]
    fn a_device_is_in_the_kernel_when_sysfs_lists_its_numbers() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("char/1:3")).unwrap();
        std::fs::create_dir_all(dir.path().join("block")).unwrap();
        assert!(in_kernel(dir.path(), &node(Kind::Char, 1, 3)));
        // /dev/kvm on a host, not in the guest.
        assert!(!in_kernel(dir.path(), &node(Kind::Char, 10, 232)));
        // Same numbers, other class.
        assert!(!in_kernel(dir.path(), &node(Kind::Block, 1, 3)));
        assert!(in_kernel(dir.path(), &node(Kind::Fifo, 0, 0)));
        // No sysfs: cannot tell.
        assert!(in_kernel(
            &dir.path().join("none"),
            &node(Kind::Block, 8, 0)
        ));
        // The running kernel has /dev/null.
        assert!(node(Kind::Char, 1, 3).in_kernel());
    }

    #[test]
    fn spec_entries_become_nodes_and_type_a_none() {
        let d: LinuxDevice = serde_json::from_value(serde_json::json!({
            "path": "/dev/fuse", "type": "c", "major": 10, "minor": 229,
            "fileMode": 0o600, "uid": 0, "gid": 5
        }))
        .unwrap();
        let n = Node::from_spec(&d).unwrap();
        assert_eq!(
            (n.kind, n.major, n.minor, n.mode),
            (Kind::Char, 10, 229, 0o600)
        );
        assert_eq!((n.uid, n.gid), (Some(0), Some(5)));
        let a: LinuxDevice = serde_json::from_value(
            serde_json::json!({"path": "/dev/x", "type": "a", "major": 0, "minor": 0}),
        )
        .unwrap();
        assert_eq!(Node::from_spec(&a), None);
    }

    /// Needs root (mknod), as the agent's other tests.
    #[test]
    fn creating_over_an_existing_path_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("dev/full");
        let full = Node {
            mode: 0o640,
            uid: Some(1),
            gid: Some(2),
            ..node(Kind::Char, 1, 7)
        };
        assert!(full.create(&dest).unwrap());
        let m = std::fs::symlink_metadata(&dest).unwrap();
        assert!(m.file_type().is_char_device());
        assert_eq!(m.rdev(), libc::makedev(1, 7));
        assert_eq!((m.mode() & 0o7777, m.uid(), m.gid()), (0o640, 1, 2));
        // The same device again (a CRI privileged spec lists /dev/full,
        // which the helper has already bound): left as it is, no EEXIST.
        assert!(!full.create(&dest).unwrap());
        // Something else at the path is not replaced either.
        let file = dir.path().join("dev/null");
        std::fs::write(&file, b"image").unwrap();
        assert!(!node(Kind::Char, 1, 3).create(&file).unwrap());
        assert_eq!(std::fs::read(&file).unwrap(), b"image");
    }

    #[test]
    fn guest_devices_walks_one_devtmpfs_without_links_or_console() {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path();
        for (path, n) in [
            ("null", node(Kind::Char, 1, 3)),
            ("console", node(Kind::Char, 5, 1)),
            ("net/tun", node(Kind::Char, 10, 200)),
            ("vda", node(Kind::Block, 254, 0)),
        ] {
            assert!(n.create(&dev.join(path)).unwrap());
        }
        std::os::unix::fs::symlink("/proc/self/fd", dev.join("fd")).unwrap();
        std::fs::write(dev.join("regular"), b"").unwrap();
        let found: Vec<_> = guest_devices(dev)
            .unwrap()
            .into_iter()
            .map(|n| (n.path, n.kind, n.major, n.minor))
            .collect();
        assert_eq!(
            found,
            [
                (PathBuf::from("/dev/net/tun"), Kind::Char, 10, 200),
                (PathBuf::from("/dev/null"), Kind::Char, 1, 3),
                (PathBuf::from("/dev/vda"), Kind::Block, 254, 0),
            ]
        );
    }

    #[test]
    fn guest_devices_of_the_running_system_skip_other_mounts() {
        let nodes = guest_devices(Path::new("/dev")).unwrap();
        assert!(
            nodes
                .iter()
                .any(|n| n.path == Path::new("/dev/null") && (n.major, n.minor) == (1, 3)),
            "{nodes:?}"
        );
        // /dev/pts is a devpts mount of its own.
        assert!(
            !nodes.iter().any(|n| n.path.starts_with("/dev/pts")),
            "{nodes:?}"
        );
    }
}
