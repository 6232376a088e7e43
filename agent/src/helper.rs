//! The container side of a spawn: `twig-agent __twig-init`.
//!
//! The agent clones a child (with the new namespaces) that immediately
//! re-executes the agent binary in this mode, so that all the setup below
//! runs as ordinary single-threaded Rust code. It reads its task (JSON) from
//! fd 3, reports warnings and a fatal error as lines on fd 4 (close-on-exec:
//! end of file there means the final exec succeeded), sets the container up
//! and execs the process, whose stdio is already on fds 0-2.
//!
//! In order: join the namespaces given by path, write the namespaced
//! sysctls, make `/` rslave, bind the rootfs, perform `spec.mounts` (cgroup
//! mounts become cgroup2 or are skipped with a warning), populate a tmpfs
//! `/dev` (binds of the default devices, the `fd`/`std*`/`ptmx` links, the
//! container's device nodes), mask `maskedPaths`, make `readonlyPaths`
//! read-only, then `pivot_root` — or, from an initramfs whose root mount
//! has no parent (`pivot_root` is EINVAL even in a new mount namespace),
//! move the rootfs onto `/` and `chroot`, like runc's `--no-pivot`. Then
//! hostname and domain name, `setsid` (and the pty as controlling
//! terminal), console size, rlimits, `oom_score_adj`, cwd, the credentials
//! and capabilities in runc's order, umask, no_new_privs, default signal
//! dispositions, every other fd close-on-exec, the seccomp filter, and
//! `execve` (the program looked up on the process's `PATH`). Container
//! paths are resolved with symlinks confined to the rootfs.
//!
//! An exec joins a running container instead: the helper opens
//! `/proc/<init>/root` and `/proc/<init>/ns/*`, joins cgroup, ipc, uts, net
//! and mnt, `chroot`s to the init's root and goes on as above.

use std::convert::Infallible;
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{setns, CloneFlags};
use oci_spec::runtime::{LinuxNamespaceType, LinuxSeccomp, Mount, PosixRlimitType, Process, Spec};
use serde::{Deserialize, Serialize};

use crate::spec::secure_join;

/// The helper's fd carrying its task.
pub const TASK_FD: i32 = 3;
/// The helper's fd for warnings and errors.
pub const STATUS_FD: i32 = 4;

/// What the helper is asked to do.
#[derive(Debug, Serialize, Deserialize)]
pub enum HelperTask {
    /// Set up a new container and exec its init process.
    Init(Box<InitTask>),
    /// Enter a running container and exec a process in it.
    Exec(Box<ExecTask>),
}

/// A container's init.
#[derive(Debug, Serialize, Deserialize)]
pub struct InitTask {
    /// Where the rootfs is mounted (in the agent's mount namespace).
    pub rootfs: PathBuf,
    /// The validated spec.
    pub spec: Spec,
    /// Existing namespaces to join (not pid, not mount).
    pub join: Vec<(LinuxNamespaceType, PathBuf)>,
    /// A network namespace was created: bring its `lo` up.
    pub new_net: bool,
    /// Do not try pivot_root.
    pub no_pivot_root: bool,
    /// A pod's sandbox container without a rootfs: after the namespaces,
    /// sysctls, names and the process's credentials, the helper itself
    /// becomes the pause process instead of exec'ing the spec's.
    #[serde(default)]
    pub pause: bool,
    /// The device nodes of its raw block volumes (the guest's disks).
    #[serde(default)]
    pub block_nodes: Vec<crate::devices::Node>,
}

/// A process in a running container.
#[derive(Debug, Serialize, Deserialize)]
pub struct ExecTask {
    /// The container init's pid (in the agent's pid namespace).
    pub init_pid: i32,
    /// The process to run.
    pub process: Process,
    /// The container's seccomp profile, which every process gets.
    pub seccomp: Option<LinuxSeccomp>,
}

type HResult<T> = Result<T, String>;

fn ctx<E: std::fmt::Display>(what: impl std::fmt::Display) -> impl FnOnce(E) -> String {
    move |e| format!("{what}: {e}")
}

fn status_line(kind: char, msg: &str) {
    let line = format!("{kind} {}\n", msg.replace('\n', " "));
    // SAFETY: STATUS_FD is ours for the helper's whole life; ManuallyDrop
    // keeps it open.
    let mut f = std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(STATUS_FD) });
    let _ = f.write_all(line.as_bytes());
}

fn warn(msg: &str) {
    status_line('W', msg);
}

/// Entry point of `twig-agent __twig-init`; never returns.
pub fn main() -> ! {
    let err = match run() {
        Ok(never) => match never {},
        Err(e) => e,
    };
    status_line('E', &err);
    std::process::exit(1)
}

fn run() -> HResult<Infallible> {
    // SAFETY: fds 3 and 4 were placed by the agent for this helper.
    let mut task_fd = unsafe { File::from_raw_fd(TASK_FD) };
    set_cloexec(STATUS_FD)?;
    let mut json = Vec::new();
    task_fd
        .read_to_end(&mut json)
        .map_err(ctx("reading the task"))?;
    drop(task_fd);
    let task: HelperTask = serde_json::from_slice(&json).map_err(ctx("decoding the task"))?;
    match task {
        HelperTask::Init(t) => init(*t),
        HelperTask::Exec(t) => exec(*t),
    }
}

fn set_cloexec(fd: i32) -> HResult<()> {
    // SAFETY: fcntl on an fd number; failure is reported.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
        return Err(format!(
            "setting close-on-exec on fd {fd}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn join_ns(path: &Path, flag: CloneFlags) -> HResult<()> {
    let f = File::open(path).map_err(ctx(format!("opening namespace {}", path.display())))?;
    setns(f.as_fd(), flag).map_err(ctx(format!("joining namespace {}", path.display())))
}

fn init(t: InitTask) -> HResult<Infallible> {
    for (typ, path) in &t.join {
        join_ns(
            path,
            crate::spec::ns_flag(*typ).unwrap_or(CloneFlags::empty()),
        )?;
    }
    if t.new_net {
        crate::netdev::set_up("lo").map_err(ctx("bringing lo up"))?;
    }
    // In the container's namespaces, with the VM's (writable) /proc.
    if let Some(sysctls) = t.spec.linux().as_ref().and_then(|l| l.sysctl().as_ref()) {
        crate::sysctl::apply(sysctls)?;
    }
    let process = t
        .spec
        .process()
        .clone()
        .ok_or_else(|| "the spec has no process".to_string())?;
    let seccomp = t.spec.linux().as_ref().and_then(|l| l.seccomp().as_ref());
    if t.pause {
        set_names(&t.spec)?;
        return become_process(&process, seccomp, Then::Pause);
    }
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .map_err(ctx("making / rslave"))?;
    let rootfs = &t.rootfs;
    mount(
        Some(rootfs),
        rootfs,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(ctx("bind-mounting the rootfs onto itself"))?;
    let mounts = t.spec.mounts().clone().unwrap_or_default();
    for m in &mounts {
        setup_mount(rootfs, m)?;
    }
    if mounts.iter().any(|m| m.destination() == Path::new("/dev")) {
        setup_dev(rootfs)?;
    }
    make_devices(rootfs, &t.spec, &t.block_nodes)?;
    if let Some(linux) = t.spec.linux() {
        for p in linux.masked_paths().iter().flatten() {
            mask_path(rootfs, Path::new(p))?;
        }
        for p in linux.readonly_paths().iter().flatten() {
            readonly_path(rootfs, Path::new(p))?;
        }
    }
    enter_root(rootfs, t.no_pivot_root)?;
    if t.spec.root().as_ref().and_then(|r| r.readonly()) == Some(true) {
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .map_err(ctx("remounting / read-only"))?;
    }
    set_names(&t.spec)?;
    if process.terminal() == Some(true) {
        open_console()?;
    }
    become_process(&process, seccomp, Then::Exec)
}

/// Sets the spec's hostname and domain name (in the container's UTS
/// namespace).
fn set_names(spec: &Spec) -> HResult<()> {
    if let Some(h) = spec.hostname().as_deref().filter(|h| !h.is_empty()) {
        nix::unistd::sethostname(h).map_err(ctx(format!("setting the hostname {h:?}")))?;
    }
    if let Some(d) = spec.domainname().as_deref().filter(|d| !d.is_empty()) {
        // SAFETY: pointer and length of a live buffer.
        if unsafe { libc::setdomainname(d.as_ptr().cast(), d.len()) } < 0 {
            return Err(format!(
                "setting the domain name {d:?}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

fn exec(t: ExecTask) -> HResult<Infallible> {
    let proc_dir = PathBuf::from(format!("/proc/{}", t.init_pid));
    let root = File::open(proc_dir.join("root"))
        .map_err(ctx(format!("opening {}/root", proc_dir.display())))?;
    // Open every namespace first: once in the mount namespace, /proc is the
    // container's.
    let mut namespaces = Vec::new();
    for (name, flag) in [
        ("cgroup", CloneFlags::CLONE_NEWCGROUP),
        ("ipc", CloneFlags::CLONE_NEWIPC),
        ("uts", CloneFlags::CLONE_NEWUTS),
        ("net", CloneFlags::CLONE_NEWNET),
        ("mnt", CloneFlags::CLONE_NEWNS),
    ] {
        let path = proc_dir.join("ns").join(name);
        match File::open(&path) {
            Ok(f) => namespaces.push((f, flag, path)),
            Err(e) if name == "cgroup" && e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(format!("opening {}: {e}", path.display())),
        }
    }
    for (f, flag, path) in &namespaces {
        setns(f.as_fd(), *flag).map_err(ctx(format!("joining {}", path.display())))?;
    }
    nix::unistd::fchdir(&root).map_err(ctx("entering the container's root"))?;
    nix::unistd::chroot(".").map_err(ctx("chroot into the container's root"))?;
    drop(root);
    if t.process.terminal() == Some(true) {
        open_console()?;
    }
    become_process(&t.process, t.seccomp.as_ref(), Then::Exec)
}

/// For a terminal process, whose stdio is the agent's console socket: opens
/// a pty from the container's `/dev/ptmx` (its own devpts instance, so the
/// process's `tty` names a device that exists where it runs), sends the
/// master to the agent and puts the slave on fds 0-2.
fn open_console() -> HResult<()> {
    let (master, slave) = crate::stdio::open_pty().map_err(|e| {
        format!("a terminal needs /dev/ptmx and a devpts mount at /dev/pts in the container: {e}")
    })?;
    // SAFETY: fd 0 is the console socket the agent placed for this helper;
    // it stays open for the borrow.
    let console = unsafe { std::os::fd::BorrowedFd::borrow_raw(0) };
    crate::stdio::send_fd(console, master.as_fd()).map_err(|e| e.to_string())?;
    drop(master);
    for fd in 0..=2 {
        // SAFETY: dup2 of an fd we own onto a stdio number; the socket's
        // copies there are replaced (closed) by it.
        if unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&slave), fd) } < 0 {
            return Err(format!(
                "putting the pty on fd {fd}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// Mount flags and data parsed from OCI mount options.
#[derive(Debug, PartialEq, Eq)]
struct MountOptions {
    flags: MsFlags,
    propagation: Vec<MsFlags>,
    data: Vec<String>,
    bind: bool,
}

fn parse_mount_options(options: &[String]) -> MountOptions {
    let mut o = MountOptions {
        flags: MsFlags::empty(),
        propagation: Vec::new(),
        data: Vec::new(),
        bind: false,
    };
    for opt in options {
        let (set, clear) = match opt.as_str() {
            "bind" => {
                o.bind = true;
                (MsFlags::MS_BIND, MsFlags::empty())
            }
            "rbind" => {
                o.bind = true;
                (MsFlags::MS_BIND | MsFlags::MS_REC, MsFlags::empty())
            }
            "ro" => (MsFlags::MS_RDONLY, MsFlags::empty()),
            "rw" => (MsFlags::empty(), MsFlags::MS_RDONLY),
            "nosuid" => (MsFlags::MS_NOSUID, MsFlags::empty()),
            "suid" => (MsFlags::empty(), MsFlags::MS_NOSUID),
            "nodev" => (MsFlags::MS_NODEV, MsFlags::empty()),
            "dev" => (MsFlags::empty(), MsFlags::MS_NODEV),
            "noexec" => (MsFlags::MS_NOEXEC, MsFlags::empty()),
            "exec" => (MsFlags::empty(), MsFlags::MS_NOEXEC),
            "sync" => (MsFlags::MS_SYNCHRONOUS, MsFlags::empty()),
            "async" => (MsFlags::empty(), MsFlags::MS_SYNCHRONOUS),
            "dirsync" => (MsFlags::MS_DIRSYNC, MsFlags::empty()),
            "mand" => (MsFlags::MS_MANDLOCK, MsFlags::empty()),
            "nomand" => (MsFlags::empty(), MsFlags::MS_MANDLOCK),
            "noatime" => (MsFlags::MS_NOATIME, MsFlags::empty()),
            "atime" => (MsFlags::empty(), MsFlags::MS_NOATIME),
            "nodiratime" => (MsFlags::MS_NODIRATIME, MsFlags::empty()),
            "diratime" => (MsFlags::empty(), MsFlags::MS_NODIRATIME),
            "relatime" => (MsFlags::MS_RELATIME, MsFlags::empty()),
            "norelatime" => (MsFlags::empty(), MsFlags::MS_RELATIME),
            "strictatime" => (MsFlags::MS_STRICTATIME, MsFlags::empty()),
            "nostrictatime" => (MsFlags::empty(), MsFlags::MS_STRICTATIME),
            "remount" => (MsFlags::MS_REMOUNT, MsFlags::empty()),
            "silent" => (MsFlags::MS_SILENT, MsFlags::empty()),
            "loud" => (MsFlags::empty(), MsFlags::MS_SILENT),
            "private" | "rprivate" | "shared" | "rshared" | "slave" | "rslave" | "unbindable"
            | "runbindable" => {
                let base = match opt.trim_start_matches('r') {
                    "private" => MsFlags::MS_PRIVATE,
                    "shared" => MsFlags::MS_SHARED,
                    "slave" => MsFlags::MS_SLAVE,
                    _ => MsFlags::MS_UNBINDABLE,
                };
                let rec = if opt.starts_with('r') {
                    MsFlags::MS_REC
                } else {
                    MsFlags::empty()
                };
                o.propagation.push(base | rec);
                continue;
            }
            _ => {
                o.data.push(opt.clone());
                continue;
            }
        };
        o.flags.insert(set);
        o.flags.remove(clear);
    }
    o
}

fn create_mountpoint(dest: &Path, file: bool) -> HResult<()> {
    if file {
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)
                .map_err(ctx(format!("creating {}", parent.display())))?;
        }
        if std::fs::symlink_metadata(dest).is_err() {
            File::create(dest).map_err(ctx(format!("creating {}", dest.display())))?;
        }
        Ok(())
    } else {
        std::fs::create_dir_all(dest).map_err(ctx(format!("creating {}", dest.display())))
    }
}

fn setup_mount(rootfs: &Path, m: &Mount) -> HResult<()> {
    let dest = secure_join(rootfs, m.destination())
        .map_err(ctx(format!("resolving {}", m.destination().display())))?;
    let typ = m.typ().as_deref().unwrap_or("");
    let opts = parse_mount_options(m.options().as_deref().unwrap_or_default());
    let what = format!("mount {:?} on {}", typ, m.destination().display());
    if typ == "bind" || opts.bind {
        let src = m
            .source()
            .as_ref()
            .ok_or_else(|| format!("{what}: a bind mount needs a source"))?;
        let is_file = !std::fs::metadata(src)
            .map_err(ctx(format!("{what}: source {}", src.display())))?
            .is_dir();
        create_mountpoint(&dest, is_file)?;
        let bind_flags = MsFlags::MS_BIND | (opts.flags & MsFlags::MS_REC);
        mount(Some(src), &dest, None::<&str>, bind_flags, None::<&str>).map_err(ctx(&what))?;
        let extra = opts.flags - (MsFlags::MS_BIND | MsFlags::MS_REC);
        if !extra.is_empty() {
            mount(
                None::<&str>,
                &dest,
                None::<&str>,
                MsFlags::MS_REMOUNT | MsFlags::MS_BIND | extra,
                None::<&str>,
            )
            .map_err(ctx(format!("{what}: remount with {extra:?}")))?;
        }
    } else if typ == "cgroup" || typ == "cgroup2" {
        create_mountpoint(&dest, false)?;
        if let Err(e) = mount(
            Some("cgroup2"),
            &dest,
            Some("cgroup2"),
            opts.flags,
            None::<&str>,
        ) {
            warn(&format!("{what}: skipped, cgroup2 cannot be mounted: {e}"));
            return Ok(());
        }
    } else {
        if typ.is_empty() {
            return Err(format!("{what}: no type and not a bind mount"));
        }
        create_mountpoint(&dest, false)?;
        let source = m
            .source()
            .as_ref()
            .map(|s| s.as_os_str().to_os_string())
            .unwrap_or_else(|| typ.into());
        let data = opts.data.join(",");
        mount(
            Some(source.as_os_str()),
            &dest,
            Some(typ),
            opts.flags,
            (!data.is_empty()).then_some(data.as_str()),
        )
        .map_err(ctx(&what))?;
    }
    for p in &opts.propagation {
        mount(None::<&str>, &dest, None::<&str>, *p, None::<&str>)
            .map_err(ctx(format!("{what}: propagation {p:?}")))?;
    }
    Ok(())
}

/// Default devices and links of a container's /dev (a tmpfs from the spec).
fn setup_dev(rootfs: &Path) -> HResult<()> {
    let dev = rootfs.join("dev");
    for name in ["null", "zero", "full", "random", "urandom", "tty"] {
        let dest = dev.join(name);
        if std::fs::symlink_metadata(&dest).is_ok() {
            continue;
        }
        create_mountpoint(&dest, true)?;
        let src = Path::new("/dev").join(name);
        mount(
            Some(&src),
            &dest,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(ctx(format!("binding {} into the container", src.display())))?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        let path = dev.join(link);
        if std::fs::symlink_metadata(&path).is_err() {
            std::os::unix::fs::symlink(target, &path)
                .map_err(ctx(format!("creating /dev/{link}")))?;
        }
    }
    Ok(())
}

/// The container's device nodes (see `devices.rs`): for a container
/// allowed every device, the guest's own; otherwise the spec's that the
/// guest kernel has. Paths already present are left as they are.
fn make_devices(rootfs: &Path, spec: &Spec, volumes: &[crate::devices::Node]) -> HResult<()> {
    // A raw block volume's node comes first, and must be made: nothing of
    // the spec's list may take its path.
    for n in volumes {
        let dest =
            secure_join(rootfs, &n.path).map_err(ctx(format!("resolving {}", n.path.display())))?;
        if !n
            .create(&dest)
            .map_err(ctx(format!("creating block volume {}", n.path.display())))?
        {
            return Err(format!(
                "block volume {}: the path exists in the container",
                n.path.display()
            ));
        }
    }
    let listed = spec
        .linux()
        .as_ref()
        .and_then(|l| l.devices().as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    let nodes = if crate::devices::allows_every_device(spec) {
        crate::devices::guest_devices(Path::new("/dev"))
            .map_err(ctx("listing the guest's devices"))?
    } else {
        let mut nodes = Vec::with_capacity(listed.len());
        for d in listed {
            let n = crate::devices::Node::from_spec(d).ok_or_else(|| {
                format!(
                    "device {}: type \"a\" cannot be created",
                    d.path().display()
                )
            })?;
            if n.in_kernel() {
                nodes.push(n);
            } else {
                warn(&format!(
                    "device {} ({:?} {}:{}) is not in the guest; left out",
                    d.path().display(),
                    n.kind,
                    n.major,
                    n.minor
                ));
            }
        }
        nodes
    };
    for n in &nodes {
        let dest =
            secure_join(rootfs, &n.path).map_err(ctx(format!("resolving {}", n.path.display())))?;
        n.create(&dest)
            .map_err(ctx(format!("creating device {}", n.path.display())))?;
    }
    Ok(())
}

fn mask_path(rootfs: &Path, p: &Path) -> HResult<()> {
    let dest = secure_join(rootfs, p).map_err(ctx(format!("resolving {}", p.display())))?;
    let Ok(meta) = std::fs::metadata(&dest) else {
        return Ok(());
    };
    let r = if meta.is_dir() {
        mount(
            Some("tmpfs"),
            &dest,
            Some("tmpfs"),
            MsFlags::MS_RDONLY,
            None::<&str>,
        )
    } else {
        mount(
            Some("/dev/null"),
            &dest,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
    };
    r.map_err(ctx(format!("masking {}", p.display())))
}

fn readonly_path(rootfs: &Path, p: &Path) -> HResult<()> {
    let dest = secure_join(rootfs, p).map_err(ctx(format!("resolving {}", p.display())))?;
    if std::fs::symlink_metadata(&dest).is_err() {
        return Ok(());
    }
    let what = format!("making {} read-only", p.display());
    mount(
        Some(&dest),
        &dest,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(ctx(&what))?;
    mount(
        None::<&str>,
        &dest,
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY,
        None::<&str>,
    )
    .map_err(ctx(&what))
}

/// pivot_root into the rootfs; where that is impossible (the agent runs
/// from an initramfs, whose root mount has no parent: EINVAL) move the
/// rootfs onto / and chroot, as runc's --no-pivot does.
fn enter_root(rootfs: &Path, no_pivot: bool) -> HResult<()> {
    nix::unistd::chdir(rootfs).map_err(ctx(format!("chdir {}", rootfs.display())))?;
    if !no_pivot {
        match nix::unistd::pivot_root(".", ".") {
            Ok(()) => {
                // The old root now sits on top of the new one: detach it.
                mount(
                    None::<&str>,
                    ".",
                    None::<&str>,
                    MsFlags::MS_SLAVE | MsFlags::MS_REC,
                    None::<&str>,
                )
                .map_err(ctx("making the old root rslave"))?;
                umount2(".", MntFlags::MNT_DETACH).map_err(ctx("detaching the old root"))?;
                return nix::unistd::chdir("/").map_err(ctx("chdir /"));
            }
            Err(nix::errno::Errno::EINVAL) => {}
            Err(e) => return Err(format!("pivot_root into {}: {e}", rootfs.display())),
        }
    }
    mount(
        Some(rootfs),
        "/",
        None::<&str>,
        MsFlags::MS_MOVE,
        None::<&str>,
    )
    .map_err(ctx(format!("moving {} onto /", rootfs.display())))?;
    nix::unistd::chroot(".").map_err(ctx("chroot into the rootfs"))?;
    nix::unistd::chdir("/").map_err(ctx("chdir /"))
}

fn rlimit_resource(t: PosixRlimitType) -> libc::__rlimit_resource_t {
    match t {
        PosixRlimitType::RlimitCpu => libc::RLIMIT_CPU,
        PosixRlimitType::RlimitFsize => libc::RLIMIT_FSIZE,
        PosixRlimitType::RlimitData => libc::RLIMIT_DATA,
        PosixRlimitType::RlimitStack => libc::RLIMIT_STACK,
        PosixRlimitType::RlimitCore => libc::RLIMIT_CORE,
        PosixRlimitType::RlimitRss => libc::RLIMIT_RSS,
        PosixRlimitType::RlimitNproc => libc::RLIMIT_NPROC,
        PosixRlimitType::RlimitNofile => libc::RLIMIT_NOFILE,
        PosixRlimitType::RlimitMemlock => libc::RLIMIT_MEMLOCK,
        PosixRlimitType::RlimitAs => libc::RLIMIT_AS,
        PosixRlimitType::RlimitLocks => libc::RLIMIT_LOCKS,
        PosixRlimitType::RlimitSigpending => libc::RLIMIT_SIGPENDING,
        PosixRlimitType::RlimitMsgqueue => libc::RLIMIT_MSGQUEUE,
        PosixRlimitType::RlimitNice => libc::RLIMIT_NICE,
        PosixRlimitType::RlimitRtprio => libc::RLIMIT_RTPRIO,
        PosixRlimitType::RlimitRttime => libc::RLIMIT_RTTIME,
    }
}

/// Finds `name` on the container's PATH (as a shell would), unless it
/// holds a slash.
fn resolve_program(name: &str, env: &[String]) -> HResult<PathBuf> {
    if name.contains('/') {
        return Ok(PathBuf::from(name));
    }
    let path = env
        .iter()
        .rev()
        .find_map(|e| e.strip_prefix("PATH="))
        .unwrap_or("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        let candidate = Path::new(dir).join(name);
        if nix::unistd::access(&candidate, nix::unistd::AccessFlags::X_OK).is_ok()
            && std::fs::metadata(&candidate).is_ok_and(|m| m.is_file())
        {
            return Ok(candidate);
        }
    }
    Err(format!("executable {name:?} not found in PATH {path:?}"))
}

fn cstring(s: &OsStr) -> HResult<CString> {
    CString::new(s.as_bytes()).map_err(ctx(format!("{s:?} contains a NUL byte")))
}

/// Sets up the calling helper as process `p` and execs it. The security
/// context comes last, in runc's order: bounding set, keep-caps, groups,
/// gid, uid, capabilities, umask, no_new_privs, and the seccomp filter
/// right before `execve` (or, without no_new_privs, before the
/// capabilities are dropped, while CAP_SYS_ADMIN still allows it).
/// What the helper becomes once it is the container's process.
enum Then {
    /// Exec the spec's program.
    Exec,
    /// Stay, as the pod's pause process.
    Pause,
}

/// Gives the helper the process's session, terminal, limits, seccomp
/// filter and credentials, then execs it or becomes the pause process.
fn become_process(p: &Process, seccomp: Option<&LinuxSeccomp>, then: Then) -> HResult<Infallible> {
    let filter = seccomp
        .map(crate::seccomp::compile)
        .transpose()
        .map_err(ctx("seccomp profile"))?;
    let no_new_privs = p.no_new_privileges() == Some(true);
    nix::unistd::setsid().map_err(ctx("setsid"))?;
    if p.terminal() == Some(true) {
        // SAFETY: TIOCSCTTY on stdin (the pty slave) with arg 0.
        if unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) } < 0 {
            return Err(format!(
                "making the pty the controlling terminal: {}",
                std::io::Error::last_os_error()
            ));
        }
        if let Some(size) = p.console_size() {
            let stdin = std::io::stdin();
            crate::stdio::set_winsize(
                stdin.as_fd(),
                u16::try_from(size.height()).unwrap_or(u16::MAX),
                u16::try_from(size.width()).unwrap_or(u16::MAX),
            )
            .map_err(ctx("setting the console size"))?;
        }
    }
    for r in p.rlimits().iter().flatten() {
        let res = rlimit_resource(r.typ());
        let lim = libc::rlimit {
            rlim_cur: r.soft(),
            rlim_max: r.hard(),
        };
        // SAFETY: setrlimit with a valid struct.
        if unsafe { libc::setrlimit(res, &lim) } < 0 {
            return Err(format!(
                "setrlimit {:?}: {}",
                r.typ(),
                std::io::Error::last_os_error()
            ));
        }
    }
    if let Some(adj) = p.oom_score_adj() {
        std::fs::write("/proc/self/oom_score_adj", adj.to_string())
            .map_err(ctx("setting oom_score_adj"))?;
    }
    nix::unistd::chdir(p.cwd()).map_err(ctx(format!("cwd {}", p.cwd().display())))?;
    if let (Some(f), false) = (&filter, no_new_privs) {
        crate::seccomp::install(f).map_err(|e| e.to_string())?;
    }
    let caps = twig_agent::caps::CapSets::of(p);
    twig_agent::caps::before_setuid(&caps)?;
    let user = p.user();
    let groups: Vec<nix::unistd::Gid> = user
        .additional_gids()
        .iter()
        .flatten()
        .map(|g| nix::unistd::Gid::from_raw(*g))
        .collect();
    nix::unistd::setgroups(&groups).map_err(ctx("setgroups"))?;
    nix::unistd::setgid(nix::unistd::Gid::from_raw(user.gid()))
        .map_err(ctx(format!("setgid {}", user.gid())))?;
    nix::unistd::setuid(nix::unistd::Uid::from_raw(user.uid()))
        .map_err(ctx(format!("setuid {}", user.uid())))?;
    twig_agent::caps::after_setuid(&caps)?;
    if let Some(mask) = user.umask() {
        nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(mask));
    }
    if no_new_privs {
        // SAFETY: prctl with integer arguments.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } < 0 {
            return Err(format!(
                "no_new_privileges: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    if let Then::Pause = then {
        reset_signals();
        if let Some(f) = &filter {
            if no_new_privs {
                crate::seccomp::install(f).map_err(|e| e.to_string())?;
            }
        }
        // End of file on the status fd tells the agent the init runs, as
        // a successful exec does.
        // SAFETY: STATUS_FD is the helper's; nothing uses it after this.
        unsafe { libc::close(STATUS_FD) };
        pause();
    }
    let args = p.args().clone().unwrap_or_default();
    let env = p.env().clone().unwrap_or_default();
    let first = args.first().ok_or_else(|| "no args".to_string())?;
    let program = resolve_program(first, &env)?;
    let c_program = cstring(program.as_os_str())?;
    let c_args = args
        .iter()
        .map(|a| cstring(OsStr::new(a)))
        .collect::<HResult<Vec<_>>>()?;
    let c_env = env
        .iter()
        .map(|e| cstring(OsStr::new(e)))
        .collect::<HResult<Vec<_>>>()?;
    reset_signals();
    // Everything but stdio and the status fd (already close-on-exec) must
    // not leak into the process.
    // SAFETY: close_range with constant arguments.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if let (Some(f), true) = (&filter, no_new_privs) {
        crate::seccomp::install(f).map_err(|e| e.to_string())?;
    }
    let e = nix::unistd::execve(&c_program, &c_args, &c_env).unwrap_err();
    Err(format!("exec {}: {e}", program.display()))
}

/// The pod's pause process, as Kubernetes' `pause`: holds the pod's
/// namespaces, reaps the orphans it inherits as a PID namespace's init,
/// and exits 0 on SIGINT or SIGTERM.
fn pause() -> ! {
    use nix::sys::signal::{SigSet, Signal};
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    let mut set = SigSet::empty();
    for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGCHLD] {
        set.add(sig);
    }
    // Blocked, the signals wait for sigwait (a PID namespace's init would
    // otherwise drop those without a handler).
    let _ = set.thread_block();
    loop {
        match set.wait() {
            Ok(Signal::SIGCHLD) => {
                while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                    if status == WaitStatus::StillAlive {
                        break;
                    }
                }
            }
            Ok(_) => std::process::exit(0),
            Err(_) => {}
        }
    }
}

/// Gives the process default signal handling: nothing blocked (the agent
/// blocks SIGCHLD) and nothing ignored (the agent's runtime ignores
/// SIGPIPE; a parent may have ignored more), as both survive exec.
fn reset_signals() {
    let _ = nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&nix::sys::signal::SigSet::empty()),
        None,
    );
    // The raw system call: libc's sigaction refuses the signals it
    // reserves for itself (32, 33), which a parent may still have ignored.
    // The kernel's struct sigaction: handler, flags, restorer, mask.
    let default_action = [0u64; 4];
    for sig in 1..=64 {
        if sig != libc::SIGKILL && sig != libc::SIGSTOP {
            // SAFETY: rt_sigaction with a valid kernel sigaction (SIG_DFL)
            // and the kernel's sigset size (8); errors are harmless.
            unsafe {
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    sig,
                    default_action.as_ptr(),
                    std::ptr::null_mut::<u64>(),
                    8usize,
                )
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(v: &[&str]) -> MountOptions {
        parse_mount_options(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn mount_options() {
        let o = opts(&["nosuid", "noexec", "nodev", "mode=755", "size=65536k"]);
        assert_eq!(
            o.flags,
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NODEV
        );
        assert_eq!(o.data, vec!["mode=755", "size=65536k"]);
        assert!(!o.bind);
        let o = opts(&["rbind", "ro", "rprivate"]);
        assert!(o.bind);
        assert_eq!(
            o.flags,
            MsFlags::MS_BIND | MsFlags::MS_REC | MsFlags::MS_RDONLY
        );
        assert_eq!(o.propagation, vec![MsFlags::MS_PRIVATE | MsFlags::MS_REC]);
        let o = opts(&["ro", "rw"]);
        assert_eq!(o.flags, MsFlags::empty());
    }

    #[test]
    fn program_lookup() {
        assert_eq!(
            resolve_program("/bin/x", &[]).unwrap(),
            PathBuf::from("/bin/x")
        );
        let found =
            resolve_program("sh", &["PATH=/nonexistent:/bin:/usr/bin".to_string()]).unwrap();
        assert!(found.ends_with("sh"), "{found:?}");
        let e = resolve_program("no-such-program-x", &["PATH=/bin".to_string()]).unwrap_err();
        assert!(e.contains("not found"), "{e}");
    }
}
