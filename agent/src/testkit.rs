//! What hosts that drive twig-agent in tests and benchmarks need: a busybox
//! ext4 rootfs image and runc-style OCI specs. Used by the agent's own
//! tests, twig-vmm's Linux-guest tests in the nested lab and twig-bench.

use std::io;
use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

/// Where the static busybox comes from (Debian's busybox-static).
pub const BUSYBOX: &str = "/bin/busybox";

fn run(cmd: &mut Command) -> io::Result<String> {
    let out = cmd.output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A loop device over a file, detached on drop. Set up as util-linux's
/// and busybox's `losetup` both can (the lab's node has busybox's): `-f`
/// names a free device, then it is set up. Needs root.
pub struct LoopDevice(pub std::path::PathBuf);

impl LoopDevice {
    /// A loop device over `file`. Finding a free device and attaching it
    /// are two steps (busybox's `losetup` has no `--show`), so a device
    /// another test took in between is skipped for the next free one.
    pub fn new(file: &Path) -> io::Result<LoopDevice> {
        let mut tries = 0;
        loop {
            let dev = run(Command::new("losetup").arg("-f"))?.trim().to_string();
            match run(Command::new("losetup").arg(&dev).arg(file)) {
                Ok(_) => return Ok(LoopDevice(dev.into())),
                Err(e) if tries < 20 && e.to_string().contains("busy") => tries += 1,
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

/// Makes `image`, an ext4 file system of `size_mib` MiB holding a static
/// busybox with a link for each of its applets in /bin, the usual empty
/// mount points and `files` (path relative to the root, contents).
pub fn busybox_rootfs(image: &Path, size_mib: u64, files: &[(&str, &str)]) -> io::Result<()> {
    let stage = tempfile::tempdir()?;
    let root = stage.path();
    for d in ["bin", "proc", "dev", "sys", "tmp", "etc", "root", "run"] {
        std::fs::create_dir_all(root.join(d))?;
    }
    std::fs::copy(BUSYBOX, root.join("bin/busybox"))?;
    for applet in run(Command::new(BUSYBOX).arg("--list"))?.lines() {
        let applet = applet.trim();
        if !applet.is_empty() && applet != "busybox" && !applet.contains('/') {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet))?;
        }
    }
    for (path, contents) in files {
        let p = root.join(path);
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(p, contents)?;
    }
    let _ = std::fs::remove_file(image);
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(root)
        .arg(image)
        .arg(format!("{size_mib}M")))?;
    Ok(())
}

pub use crate::client::DEFAULT_CAPS;

fn default_caps() -> Value {
    json!({"bounding": DEFAULT_CAPS, "effective": DEFAULT_CAPS, "permitted": DEFAULT_CAPS})
}

/// Merges `b` into `a`: objects key by key, anything else replaced.
pub fn merge(a: &mut Value, b: Value) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

/// A runc-style container spec running `args` (pid, ipc, uts and mount
/// namespaces; the VM's network; containerd's default capabilities), with
/// `extra` merged in.
pub fn spec(args: &[&str], extra: Value) -> Vec<u8> {
    let mut spec = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM=xterm"],
            "cwd": "/",
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": true,
            "capabilities": default_caps()
        },
        "root": {"path": "rootfs"},
        "hostname": "twig-test",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]}
        ],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "maskedPaths": ["/proc/kcore", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"]
        }
    });
    merge(&mut spec, extra);
    spec.to_string().into_bytes()
}

/// An OCI process object running `args` (containerd's default
/// capabilities), with `extra` merged in.
pub fn process(args: &[&str], extra: Value) -> Vec<u8> {
    let mut p = json!({
        "terminal": false,
        "user": {"uid": 0, "gid": 0},
        "args": args,
        "env": ["PATH=/bin"],
        "cwd": "/",
        "capabilities": default_caps(),
    });
    merge(&mut p, extra);
    p.to_string().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_merge_extras_and_the_rootfs_holds_busybox() {
        let s: Value = serde_json::from_slice(&spec(&["true"], json!({"hostname": "h"}))).unwrap();
        assert_eq!(s["hostname"], "h");
        assert_eq!(s["process"]["args"][0], "true");
        let p: Value = serde_json::from_slice(&process(&["ls"], json!({"cwd": "/tmp"}))).unwrap();
        assert_eq!(p["cwd"], "/tmp");

        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("r.ext4");
        busybox_rootfs(&img, 16, &[("etc/marker", "m\n")]).unwrap();
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 16 << 20);
        let ls = run(Command::new("debugfs").args(["-R", "ls -l /bin"]).arg(&img)).unwrap();
        assert!(ls.contains("busybox") && ls.contains(" sh"), "{ls}");
        let cat = run(Command::new("debugfs")
            .args(["-R", "cat /etc/marker"])
            .arg(&img))
        .unwrap();
        assert_eq!(cat, "m\n");
        assert!(busybox_rootfs(Path::new("/nonexistent/dir/x.ext4"), 16, &[]).is_err());
    }
}
