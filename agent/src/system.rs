//! What PID 1 sets up: the console, system mounts, `lo`.

use std::io::Write;
use std::os::fd::AsRawFd;

use nix::mount::{mount, MsFlags};

/// If the kernel found no /dev/console in the initramfs, fds 0-2 are
/// closed: mount devtmpfs and open the console onto them.
pub fn setup_console() {
    // SAFETY: F_GETFD only inspects fd 1.
    if unsafe { libc::fcntl(1, libc::F_GETFD) } >= 0 {
        return;
    }
    let _ = std::fs::create_dir_all("/dev");
    let _ = mount(
        Some("devtmpfs"),
        "/dev",
        Some("devtmpfs"),
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    );
    if let Ok(console) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    {
        for fd in 0..3 {
            // SAFETY: dup2 onto the standard descriptors.
            unsafe { libc::dup2(console.as_raw_fd(), fd) };
        }
    }
}

fn mount_one(source: &str, target: &str, fstype: &str, flags: MsFlags, data: Option<&str>) {
    if let Err(e) = std::fs::create_dir_all(target) {
        tracing::warn!("creating {target}: {e}");
    }
    match mount(Some(source), target, Some(fstype), flags, data) {
        Ok(()) | Err(nix::errno::Errno::EBUSY) => {}
        Err(e) => tracing::warn!("mounting {fstype} on {target}: {e}"),
    }
}

/// Mounts /proc, /sys, /dev, /dev/pts, /dev/shm, /run, /tmp and the
/// cgroup2 hierarchy (optional); brings `lo` up. Failures are logged:
/// PID 1 keeps going.
pub fn setup_pid1() {
    let common = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount_one("proc", "/proc", "proc", common, None);
    mount_one("sysfs", "/sys", "sysfs", common, None);
    mount_one(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    );
    mount_one(
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    );
    mount_one(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        None,
    );
    mount_one(
        "tmpfs",
        "/run",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755"),
    );
    mount_one(
        "tmpfs",
        "/tmp",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    );
    mount_one("cgroup2", "/sys/fs/cgroup", "cgroup2", common, None);
    if std::fs::symlink_metadata("/dev/ptmx").is_err() {
        let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
    }
    if let Err(e) = crate::netdev::set_up("lo") {
        tracing::warn!("bringing lo up: {e}");
    }
}

/// Tells whoever watches that the agent serves: on /dev/console as PID 1,
/// on stdout otherwise.
pub fn announce_ready(pid1: bool) {
    let line = b"twig-agent: ready\n";
    if pid1 {
        if let Ok(mut c) = std::fs::OpenOptions::new().write(true).open("/dev/console") {
            let _ = c.write_all(line);
            return;
        }
    }
    let mut out = std::io::stdout();
    let _ = out.write_all(line);
    let _ = out.flush();
}
