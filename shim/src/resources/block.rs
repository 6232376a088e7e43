//! Raw block volumes: a pod's `volumeDevices` (a block-mode
//! PersistentVolumeClaim), as the pod's VM gets them.
//!
//! CRI hands kubelet's block device to the runtime as an entry of the
//! spec's `linux.devices` (type `b`, the container's `devicePath`, the host
//! device's major:minor) with a device-cgroup rule allowing it (`rw`, or
//! `r` for a read-only claim). The guest has none of the host's devices, so
//! the shim takes such an entry out of the spec, finds the host device by
//! its numbers (`/sys/dev/block/MAJ:MIN`), attaches it to one of the VM's
//! disk slots (the VMM serves a host block device as it serves an image
//! file) and has the agent make a block node of that guest disk at
//! `devicePath` in the container. Reads and writes go straight to the
//! volume.
//!
//! Which entries are volumes: under CRI a container gets host block
//! devices in `linux.devices` only from `volumeDevices` (or a device
//! plugin), except a privileged container, which gets every host device
//! at its own path. So every block entry is a volume, but a privileged
//! container's entry named as the host names the device (`/dev/sda` for
//! 8:0) is its host device list, which the agent ignores.
//!
//! A snapshot cannot carry a volume that lives outside the VM, and a
//! rollback would leave the guest's view of it wrong: Snapshot and Rollback
//! of a pod with a raw block volume are refused, naming it (the VMM refuses
//! too). A container restored from a snapshot runs already, so a block
//! volume cannot be added to it.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde_json::Value;
use twig_agent::proto::agent;

use crate::error::{Error, Result};
use crate::sandbox::{Attachment, Sandbox};

/// One raw block volume of a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockVolume {
    /// The node's path in the container (`devicePath`).
    pub path: String,
    /// The host's device node.
    pub host: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// The device cgroup allows reads only.
    pub read_only: bool,
    /// The node's permission bits, as CRI gave them.
    pub mode: u32,
    /// The node's owner.
    pub uid: u32,
    /// The node's group.
    pub gid: u32,
}

/// Takes the raw block volumes out of `spec`'s `linux.devices`, finding
/// each host device under `sys_dev_block` (`/sys/dev/block`) and `dev`
/// (`/dev`).
pub fn take_volumes(
    spec: &mut Value,
    sys_dev_block: &Path,
    dev: &Path,
) -> Result<Vec<BlockVolume>> {
    let privileged = allows_every_device(spec);
    let rules = spec
        .pointer("/linux/resources/devices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let Some(devices) = spec
        .pointer_mut("/linux/devices")
        .and_then(Value::as_array_mut)
    else {
        return Ok(Vec::new());
    };
    let mut volumes = Vec::new();
    let mut kept = Vec::with_capacity(devices.len());
    for d in devices.drain(..) {
        if d.get("type").and_then(Value::as_str) != Some("b") {
            kept.push(d);
            continue;
        }
        let path = d.get("path").and_then(Value::as_str).unwrap_or_default();
        let number = |k: &str| {
            d.get(k)
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "OCI spec: block device {path:?} has no valid {k} number"
                    ))
                })
        };
        let (major, minor) = (number("major")?, number("minor")?);
        let name = host_name(sys_dev_block, major, minor)?;
        if privileged && Path::new(path) == dev.join(&name) {
            kept.push(d);
            continue;
        }
        let host = dev.join(&name);
        check_node(&host, major, minor)?;
        let sectors: u64 = read_sys(&sys_dev_block.join(format!("{major}:{minor}/size")))?
            .parse()
            .map_err(|e| Error::Internal(format!("the size of block device {name}: {e}")))?;
        let field = |k: &str| {
            d.get(k)
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
        };
        volumes.push(BlockVolume {
            path: path.to_string(),
            host,
            bytes: sectors * 512,
            read_only: !writable(&rules, major, minor),
            mode: field("fileMode").unwrap_or(0o660) & 0o777,
            uid: field("uid").unwrap_or(0),
            gid: field("gid").unwrap_or(0),
        });
    }
    *devices = kept;
    Ok(volumes)
}

/// Attaches each volume's host device to a disk slot of `sandbox`;
/// returns the attachments (in order) and what the agent is told of them.
/// On failure none stays attached.
pub fn attach(
    sandbox: &dyn Sandbox,
    volumes: &[BlockVolume],
) -> Result<(Vec<Attachment>, Vec<agent::BlockVolume>)> {
    let mut attached: Vec<Attachment> = Vec::with_capacity(volumes.len());
    let mut requests = Vec::with_capacity(volumes.len());
    for v in volumes {
        match sandbox.attach_disk(&v.host, v.read_only) {
            Ok(a) => {
                requests.push(agent::BlockVolume {
                    device: a.device.clone(),
                    path: v.path.clone(),
                    bytes: v.bytes,
                    mode: v.mode,
                    uid: v.uid,
                    gid: v.gid,
                    ..Default::default()
                });
                attached.push(a);
            }
            Err(e) => {
                detach(sandbox, &attached);
                return Err(Error::FailedPrecondition(format!(
                    "raw block volume {} ({}): {e}",
                    v.path,
                    v.host.display()
                )));
            }
        }
    }
    Ok((attached, requests))
}

/// Detaches raw block volumes the guest no longer uses (a failure is
/// logged: the slot stays taken until the VM ends).
pub fn detach(sandbox: &dyn Sandbox, attachments: &[Attachment]) {
    for a in attachments {
        if let Err(e) = sandbox.detach(a) {
            tracing::warn!(device = a.device, "detaching a raw block volume: {e}");
        }
    }
}

/// The host's name of block device `major:minor` (`DEVNAME` of its
/// uevent, e.g. `loop3`, `mapper/…` names stay relative).
fn host_name(sys_dev_block: &Path, major: u32, minor: u32) -> Result<String> {
    let uevent =
        read_sys(&sys_dev_block.join(format!("{major}:{minor}/uevent"))).map_err(|_| {
            Error::FailedPrecondition(format!(
                "block device {major}:{minor} of a volumeDevices entry is not on this node"
            ))
        })?;
    let name = uevent
        .lines()
        .find_map(|l| l.strip_prefix("DEVNAME="))
        .unwrap_or_default();
    if name.is_empty()
        || name
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(Error::Internal(format!(
            "block device {major}:{minor} has no usable DEVNAME ({name:?})"
        )));
    }
    Ok(name.to_string())
}

/// Checks that `node` is block device `major:minor`.
fn check_node(node: &Path, major: u32, minor: u32) -> Result<()> {
    let meta = std::fs::metadata(node)
        .map_err(|e| Error::io(format!("block device {}", node.display()), e))?;
    let rdev = meta.rdev();
    if !meta.file_type().is_block_device()
        || (libc::major(rdev), libc::minor(rdev)) != (major, minor)
    {
        return Err(Error::FailedPrecondition(format!(
            "{} is not block device {major}:{minor}",
            node.display()
        )));
    }
    Ok(())
}

fn read_sys(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))
}

/// Whether the device cgroup rules let the container write block device
/// `major:minor`: the last rule naming it (or all block devices) decides.
fn writable(rules: &[Value], major: u32, minor: u32) -> bool {
    let mut w = false;
    for r in rules {
        let typ = r.get("type").and_then(Value::as_str).unwrap_or("a");
        let matches = |k: &str, n: u32| {
            r.get(k)
                .and_then(Value::as_i64)
                .is_none_or(|v| v == -1 || v == i64::from(n))
        };
        if !matches!(typ, "a" | "b") || !matches("major", major) || !matches("minor", minor) {
            continue;
        }
        let access = r.get("access").and_then(Value::as_str).unwrap_or("rwm");
        if access.contains('w') {
            w = r.get("allow").and_then(Value::as_bool).unwrap_or(false);
        }
    }
    w
}

/// Whether the device cgroup lets the container use every device: the
/// last rule for all devices (no type or `a`, no numbers) allows `rwm`
/// and no deny follows it — CRI's privileged container.
fn allows_every_device(spec: &Value) -> bool {
    let Some(rules) = spec
        .pointer("/linux/resources/devices")
        .and_then(Value::as_array)
    else {
        return false;
    };
    let mut all = false;
    for r in rules {
        let allow = r.get("allow").and_then(Value::as_bool).unwrap_or(false);
        let wildcard = matches!(r.get("type").and_then(Value::as_str), None | Some("a"))
            && r.get("major").is_none_or(Value::is_null)
            && r.get("minor").is_none_or(Value::is_null);
        if wildcard {
            let access = r.get("access").and_then(Value::as_str).unwrap_or_default();
            all = allow && ["r", "w", "m"].iter().all(|c| access.contains(c));
        } else if !allow {
            all = false;
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A fake `/sys/dev/block` naming this machine's `/dev/loop0` (7:0,
    /// which the test host has) and a `/dev` of the host.
    fn sys(dir: &Path) -> PathBuf {
        let d = dir.join("7:0");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("uevent"),
            "MAJOR=7\nMINOR=0\nDEVNAME=loop0\nDEVTYPE=disk\n",
        )
        .unwrap();
        std::fs::write(d.join("size"), "2048\n").unwrap();
        let d = dir.join("7:1");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("uevent"), "DEVNAME=../etc\n").unwrap();
        dir.to_path_buf()
    }

    fn spec(devices: Value, rules: Value) -> Value {
        json!({"linux": {"devices": devices, "resources": {"devices": rules}}})
    }

    const DENY_ALL: &str = r#"{"allow": false, "access": "rwm"}"#;

    #[test]
    fn block_entries_become_volumes_and_leave_the_spec() {
        let dir = tempfile::tempdir().unwrap();
        let sys = sys(dir.path());
        let deny: Value = serde_json::from_str(DENY_ALL).unwrap();
        let mut s = spec(
            json!([
                {"path": "/dev/xvda", "type": "b", "major": 7, "minor": 0, "fileMode": 0o100660, "uid": 0, "gid": 6},
                {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}
            ]),
            json!([deny, {"allow": true, "type": "b", "major": 7, "minor": 0, "access": "rwm"}]),
        );
        let v = take_volumes(&mut s, &sys, Path::new("/dev")).unwrap();
        assert_eq!(
            v,
            vec![BlockVolume {
                path: "/dev/xvda".into(),
                host: "/dev/loop0".into(),
                bytes: 2048 * 512,
                read_only: false,
                mode: 0o660,
                uid: 0,
                gid: 6,
            }]
        );
        assert_eq!(
            s["linux"]["devices"],
            json!([{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}])
        );

        // A read-only claim: its rule allows reads only.
        let mut s = spec(
            json!([{"path": "/dev/xvda", "type": "b", "major": 7, "minor": 0}]),
            json!([deny, {"allow": true, "type": "b", "major": 7, "minor": 0, "access": "r"}]),
        );
        assert!(take_volumes(&mut s, &sys, Path::new("/dev")).unwrap()[0].read_only);
    }

    #[test]
    fn a_privileged_containers_host_devices_are_not_volumes() {
        let dir = tempfile::tempdir().unwrap();
        let sys = sys(dir.path());
        let entries = json!([
            {"path": "/dev/loop0", "type": "b", "major": 7, "minor": 0},
            {"path": "/dev/data", "type": "b", "major": 7, "minor": 0}
        ]);
        let mut s = spec(entries.clone(), json!([{"allow": true, "access": "rwm"}]));
        let v = take_volumes(&mut s, &sys, Path::new("/dev")).unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].path, "/dev/data");
        assert_eq!(s["linux"]["devices"], json!([entries[0]]));
        // Not privileged: the same entry at the host's name is a volume.
        let mut s = spec(entries, json!([]));
        assert_eq!(
            take_volumes(&mut s, &sys, Path::new("/dev")).unwrap().len(),
            2
        );
    }

    #[test]
    fn devices_not_on_the_node_or_with_odd_names_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let sys = sys(dir.path());
        let mut missing = spec(
            json!([{"path": "/dev/x", "type": "b", "major": 9, "minor": 9}]),
            json!([]),
        );
        let e = take_volumes(&mut missing, &sys, Path::new("/dev")).unwrap_err();
        assert!(e.to_string().contains("9:9"), "{e}");
        let mut odd = spec(
            json!([{"path": "/dev/x", "type": "b", "major": 7, "minor": 1}]),
            json!([]),
        );
        let e = take_volumes(&mut odd, &sys, Path::new("/dev")).unwrap_err();
        assert!(e.to_string().contains("DEVNAME"), "{e}");
        let mut bad = spec(
            json!([{"path": "/dev/x", "type": "b", "major": -1, "minor": 0}]),
            json!([]),
        );
        assert!(matches!(
            take_volumes(&mut bad, &sys, Path::new("/dev")),
            Err(Error::InvalidArgument(_))
        ));
        // The node must be that device: /dev/null is not 7:0.
        let nodes = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/dev/null", nodes.path().join("loop0")).unwrap();
        let mut s = spec(
            json!([{"path": "/dev/x", "type": "b", "major": 7, "minor": 0}]),
            json!([]),
        );
        let e = take_volumes(&mut s, &sys, nodes.path()).unwrap_err();
        assert!(e.to_string().contains("is not block device 7:0"), "{e}");
    }
}
