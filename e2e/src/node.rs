//! A node in a box: a reflink XFS, `twig-snapshotter` and `twig-node` (the
//! node daemon: base template, warm VMM pool) on it, and containerd with
//! `twig` as its proxy snapshotter and the twig and runc runtimes, with the
//! test image imported. Everything it starts is stopped by PID when the
//! node is dropped, also when a test panics.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::mount::{umount2, MntFlags};
use tempfile::TempDir;

use crate::background::{run_on_pty, Background};
use crate::cri::CRI_NAMESPACE;
use crate::error::{io, Error, Result};
use crate::process::{kill_processes_with_arg, run, run_ok, tail, Daemon, Output};
use crate::{find_on_path, require, IMAGE_REF};

/// containerd namespace of every test.
pub const NAMESPACE: &str = "twig-e2e";
/// Deadline of a daemon's start. Under the lab's TCG everything is 10–50×
/// slower than on a host.
const START: Duration = Duration::from_secs(180);
/// Deadline of one `ctr` command.
const CTR: Duration = Duration::from_secs(300);
/// Deadline of one `ctr` command while tearing down.
const TEARDOWN: Duration = Duration::from_secs(30);
/// Size of the harness's own XFS, when it makes one.
const XFS_MIB: u64 = 1024;
/// Size of each snapshot's ext4 image (sparse).
const IMAGE_MIB: &str = "256";
/// Guest memory of the node's base template: the lab has 3 GiB.
pub const BASE_MEM_MIB: u64 = 128;
/// Prepared VMMs the node daemon keeps warm (each has its guest RAM
/// reserved, untouched).
const POOL_SIZE: usize = 1;

/// A containerd runtime (shim) the tests run containers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    /// runc's v2 shim: the runc mounts twig's loop image itself.
    Runc,
    /// Twig's shim: the container runs in a microVM.
    Twig,
}

impl Runtime {
    /// The runtime's name for `ctr run --runtime`.
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Runc => "io.containerd.runc.v2",
            Runtime::Twig => "io.containerd.twig.v2",
        }
    }

    /// The shim binary containerd looks up on its `PATH` for this runtime.
    pub fn shim(self) -> &'static str {
        match self {
            Runtime::Runc => "containerd-shim-runc-v2",
            Runtime::Twig => "containerd-shim-twig-v2",
        }
    }
}

/// containerd's configuration: its own root, state and socket; `twig` as a
/// proxy snapshotter; CRI with the runtimes `runc` and `twig`, both on the
/// `twig` snapshotter. `disable_apparmor` and `restrict_oom_score_adj` are
/// what runc's sandboxes need on this machine (DESIGN.md).
pub fn containerd_config(dir: &Path, snapshotter_socket: &Path) -> String {
    format!(
        r#"version = 2
root = "{root}"
state = "{state}"

[grpc]
  address = "{socket}"

[proxy_plugins.twig]
  type = "snapshot"
  address = "{snap}"

[plugins."io.containerd.grpc.v1.cri"]
  disable_apparmor = true
  restrict_oom_score_adj = true
  sandbox_image = "{pause}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "twig"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "{runc}"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.twig]
      runtime_type = "{twig}"
      pod_annotations = ["twig.dev/*"]
"#,
        root = dir.join("root").display(),
        state = dir.join("state").display(),
        socket = dir.join("containerd.sock").display(),
        snap = snapshotter_socket.display(),
        runc = Runtime::Runc.name(),
        twig = Runtime::Twig.name(),
        pause = crate::cri::PAUSE_REF,
        cni_bin = twig_cri::harness::CNI_BIN_DIR,
        cni_conf = cni_conf_dir(dir).display(),
    )
}

/// Where containerd's CRI plugin reads its CNI network (`crate::cri` writes
/// it) for a node whose containerd lives in `containerd_dir`.
pub fn cni_conf_dir(containerd_dir: &Path) -> PathBuf {
    containerd_dir.join("net.d")
}

/// The twig shim's configuration (`TWIG_SHIM_CONFIG`) for a node in
/// `dir`: its state in the node's directory, its VMs from the node daemon
/// on `node_socket`, its pods' network paths pinned under
/// [`bpffs_root`], `call_s` seconds for one VMM or agent call, a pod's own
/// egress policy bounded by the lab's private networks.
pub fn shim_config(dir: &Path, node_socket: &Path, call_s: u64) -> serde_json::Value {
    serde_json::json!({
        "state_root": dir.join("shim"),
        "node_socket": node_socket,
        "bpffs_root": bpffs_root(dir),
        "call_timeout_s": call_s,
        // The lab's admin lets a pod's own policy reach the lab's private
        // networks (its CNI subnet, the node's bridge); the default still
        // denies them.
        "egress_bound": {"allow": [{"cidr": "10.0.0.0/8"}]},
    })
}

/// Seconds a shim's VMM or agent call may take, in the lab: under TCG, 64
/// guests restored at once (a Clone of 64) take longer than the 30 s a
/// node's own CPUs need.
pub const SHIM_CALL_S: u64 = 120;

/// The node daemon's pool of prepared twig-net sets, under [`bpffs_root`].
pub const NET_POOL_DIR: &str = "pool";

/// Where the twig shims of the node in `dir` pin their pods' network paths
/// (`/sys/fs/bpf/twig-<the directory's name>`, one per node).
pub fn bpffs_root(dir: &Path) -> PathBuf {
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    PathBuf::from("/sys/fs/bpf").join(format!("twig-{}", name.trim_start_matches('.')))
}

/// Seconds a VMM spawned on demand has to answer, in the lab.
const VMM_START_S: u64 = 120;

/// twig-node's configuration for a node in `dir`: its socket, runtime
/// directory and pool in the node's directory, its node store `store`,
/// `twig-vmm` from `PATH`, a 128 MiB base template booting `guest` when
/// given, one prepared VMM of that shape kept warm. A VMM spawned on demand
/// has 120 s to answer, not the default 10 s: under the lab's TCG
/// eight VMMs spawned at once (a Clone's pods) take longer.
pub fn node_config(
    dir: &Path,
    store: &Path,
    guest: Option<&Guest>,
    net_pool: usize,
) -> serde_json::Value {
    let mut base = serde_json::json!({ "mem_mib": BASE_MEM_MIB });
    if let Some(g) = guest {
        base["kernel"] = serde_json::json!(g.kernel);
        base["initrd"] = serde_json::json!(g.initrd);
    }
    let mut config = serde_json::json!({
        "socket": dir.join("node.sock"),
        "store": store,
        "run_dir": dir.join("node"),
        "base": base,
        "pool": {
            "shapes": [{ "mem_mib": BASE_MEM_MIB, "size": POOL_SIZE }],
            "start_timeout_s": VMM_START_S,
        },
        // App templates are built through the node's containerd (CRI).
        "templates": {
            "cri_socket": dir.join("containerd").join("containerd.sock"),
            "task_dir": dir.join("containerd/state/io.containerd.runtime.v2.task").join(CRI_NAMESPACE),
            "log_dir": dir.join("template-logs"),
            "retry_s": 5,
        },
        // Prepared twig-net sets, handed to the shims by a rename: on the
        // shims' bpffs root.
        "net_pool": { "dir": bpffs_root(dir).join(NET_POOL_DIR), "size": net_pool },
    });
    if let Some(vmm) = find_on_path("twig-vmm") {
        config["vmm_binary"] = serde_json::json!(vmm);
    }
    config
}

/// The node store of a node's twig-node: on a given XFS (the lab's), one
/// store shared by every node of the run, so the base template is built by
/// the first daemon that needs it (daemons build it under a lock on the
/// store, and it is only read once built) and a test binary's nodes after
/// the first restore from a warm template; on the harness's own XFS, in the
/// node's directory `dir`.
fn store_dir(xfs: &Xfs, dir: &Path) -> PathBuf {
    let root = match xfs {
        Xfs::Given(given) => given.join("twig-e2e-shared"),
        Xfs::Own { .. } => dir.to_path_buf(),
    };
    root.join("vm")
}

/// The mount points under `dir` in the mount table, deepest first.
pub fn mounts_under(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount_path)
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}

/// The kernel writes space, tab, newline and backslash in mount paths as
/// octal escapes (`\040`).
fn unescape_mount_path(field: &str) -> PathBuf {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).and_then(|d| {
            std::str::from_utf8(d)
                .ok()
                .and_then(|s| u8::from_str_radix(s, 8).ok())
        });
        match (b[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsString::from(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&out),
    ))
}

/// containerd's stack dumps in the temporary directory.
fn stack_dumps() -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(OsStr::to_str)
                .is_some_and(|n| n.starts_with("containerd.") && n.ends_with(".stacks.log"))
        })
        .collect()
}

/// The `*.log` files in `dir` and its subdirectories, `depth` levels down.
fn log_files(dir: &Path, depth: usize) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for path in entries.flatten().map(|e| e.path()) {
        if path.is_dir() && depth > 0 {
            found.extend(log_files(&path, depth - 1));
        } else if path.extension().is_some_and(|e| e == "log") {
            found.push(path);
        }
    }
    found.sort();
    found
}

/// Detaches every mount under `dir`, deepest first.
fn unmount_all_under(dir: &Path) {
    let table = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for m in mounts_under(&table, dir) {
        // Already gone with its parent is fine: nothing is left to do.
        let _ = umount2(&m, MntFlags::MNT_DETACH);
    }
}

/// Where the node's files live.
#[derive(Debug)]
enum Xfs {
    /// A reflink-capable directory given by [`NodeConfig::xfs`] (the lab's `/xfs`).
    Given(PathBuf),
    /// The harness's own loop-mounted XFS (image and mount point in a temp
    /// dir), unmounted on drop.
    Own { _dir: TempDir, mnt: PathBuf },
}

impl Xfs {
    fn open(given: Option<&Path>) -> Result<Xfs> {
        if let Some(dir) = given {
            return Ok(Xfs::Given(dir.to_path_buf()));
        }
        require(&["mkfs.xfs", "mount"])?;
        let dir = tempfile::Builder::new()
            .prefix("twig-e2e-xfs-")
            .tempdir()
            .map_err(io("creating a temp dir for the XFS image"))?;
        let img = dir.path().join("xfs.img");
        fs::File::create(&img)
            .and_then(|f| f.set_len(XFS_MIB << 20))
            .map_err(io(format!("sizing {}", img.display())))?;
        run_ok(
            Command::new("mkfs.xfs")
                .args(["-q", "-m", "reflink=1"])
                .arg(&img),
            START,
        )?;
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).map_err(io(format!("creating {}", mnt.display())))?;
        run_ok(
            Command::new("mount")
                .args(["-t", "xfs", "-o", "loop"])
                .arg(&img)
                .arg(&mnt),
            START,
        )?;
        Ok(Xfs::Own { _dir: dir, mnt })
    }

    fn path(&self) -> &Path {
        match self {
            Xfs::Given(p) => p,
            Xfs::Own { mnt, .. } => mnt,
        }
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        if let Xfs::Own { mnt, .. } = self {
            unmount_all_under(mnt);
            // The loop device was set up with autoclear: it goes with the
            // mount; the image goes with the temp dir, dropped after this.
            let _ = umount2(mnt.as_path(), MntFlags::MNT_DETACH);
        }
    }
}

/// Where a node takes its image and keeps its files.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// An OCI archive holding [`IMAGE_REF`] (from `e2e/build-image.sh`).
    pub image: PathBuf,
    /// A reflink-capable directory for the node's files; `None`: the
    /// harness mounts its own loop XFS.
    pub xfs: Option<PathBuf>,
    /// The guest kernel and agent initramfs the twig shim builds its base
    /// template from; `None`: the shim's defaults.
    pub guest: Option<Guest>,
    /// How many verified twig-net program sets twig-node keeps ready for
    /// the shims (0: each shim loads its own). The tests keep none: in the
    /// lab, the pool's eBPF verification next to running nested guests
    /// wedged the outer VM (QEMU's SVM emulation; see tests/lab/README.md);
    /// the benchmark turns it on.
    pub net_pool: usize,
    /// Seconds a twig shim's VMM or agent call may take (the shim's
    /// `call_timeout_s`): [`SHIM_CALL_S`] unless a test times a guest out.
    pub shim_call_s: u64,
    /// The node store in the node's own directory instead of the run's
    /// shared one: a second node whose store is its own (snapshots across
    /// nodes).
    pub own_store: bool,
    /// A registry (`host:port`) twig-node exports snapshots to and imports
    /// them from over plain HTTP.
    pub registry: Option<String>,
    /// The pace of lazy restores' background downloads, KiB a second
    /// (node.json `registry.lazy_fill_kib_per_s`; 0: unpaced).
    pub lazy_fill_kib_per_s: u64,
}

/// What the twig shim's base template boots (the lab's `TWIG_GUEST_KERNEL`
/// and `TWIG_AGENT_INITRD`).
#[derive(Clone, Debug)]
pub struct Guest {
    /// Twig's guest kernel (`guest/build-kernel.sh`).
    pub kernel: PathBuf,
    /// The agent initramfs (`guest/build-initramfs.sh`).
    pub initrd: PathBuf,
}

impl NodeConfig {
    /// `TWIG_E2E_IMAGE` (required), `TWIG_E2E_XFS`, `TWIG_GUEST_KERNEL`
    /// and `TWIG_AGENT_INITRD` (optional), as tests/lab/run.sh sets them in
    /// the lab.
    pub fn from_env() -> Result<NodeConfig> {
        let image = std::env::var_os("TWIG_E2E_IMAGE")
            .map(PathBuf::from)
            .ok_or_else(|| {
                Error::Environment(
                    "TWIG_E2E_IMAGE is not set: build the test image with \
                     `e2e/build-image.sh OUT.tar` and point TWIG_E2E_IMAGE at it, or run the \
                     tests through tests/lab/run.sh"
                        .into(),
                )
            })?;
        let var = |name| std::env::var_os(name).map(PathBuf::from);
        let guest = match (var("TWIG_GUEST_KERNEL"), var("TWIG_AGENT_INITRD")) {
            (Some(kernel), Some(initrd)) => Some(Guest { kernel, initrd }),
            _ => None,
        };
        Ok(NodeConfig {
            image,
            xfs: var("TWIG_E2E_XFS"),
            guest,
            net_pool: 0,
            shim_call_s: SHIM_CALL_S,
            own_store: false,
            registry: None,
            lazy_fill_kib_per_s: 0,
        })
    }
}

/// A running node: XFS, `twig-snapshotter`, `twig-node`, containerd, the
/// test image imported onto the `twig` snapshotter.
#[derive(Debug)]
pub struct Node {
    pub(crate) containerd: Daemon,
    snapshotter: Daemon,
    pub(crate) node_daemon: Daemon,
    socket: PathBuf,
    /// The node's directory on the XFS; `None` once torn down.
    pub(crate) work: Option<TempDir>,
    /// Held for its drop, after the teardown: unmounted when it is the
    /// harness's own.
    _xfs: Xfs,
}

impl Node {
    /// Starts a node as [`NodeConfig::from_env`] says.
    pub fn start() -> Result<Node> {
        Node::start_with(&NodeConfig::from_env()?)
    }

    /// Starts a node on `config.xfs` (or its own loop XFS) and imports
    /// `config.image` with `ctr images import --snapshotter twig`; on any
    /// failure, what was started is stopped and removed again.
    pub fn start_with(config: &NodeConfig) -> Result<Node> {
        require(&[
            "containerd",
            "ctr",
            "runc",
            Runtime::Runc.shim(),
            "twig-snapshotter",
            "twig-node",
            "mkfs.ext4",
            "debugfs",
        ])?;
        let image = &config.image;
        let xfs = Xfs::open(config.xfs.as_deref())?;
        let work = tempfile::Builder::new()
            .prefix("node-")
            .tempdir_in(xfs.path())
            .map_err(io(format!(
                "creating a node dir in {}",
                xfs.path().display()
            )))?;
        let dir = work.path().to_path_buf();

        let snap_socket = dir.join("twig.sock");
        let mut snapshotter = Daemon::spawn(
            "twig-snapshotter",
            Command::new("twig-snapshotter")
                .arg("--root")
                .arg(dir.join("snapshotter"))
                .arg("--address")
                .arg(&snap_socket)
                .args(["--image-size-mib", IMAGE_MIB])
                .env("RUST_LOG", "info"),
            dir.join("twig-snapshotter.log"),
        )?;
        snapshotter.wait_for_socket(&snap_socket, START)?;

        let node_socket = dir.join("node.sock");
        let node_file = dir.join("node.json");
        let store = if config.own_store {
            dir.join("vm")
        } else {
            store_dir(&xfs, &dir)
        };
        let mut node_json = node_config(&dir, &store, config.guest.as_ref(), config.net_pool);
        if let Some(host) = &config.registry {
            node_json["registry"] = serde_json::json!({
                "plain_http": [host],
                "lazy_fill_kib_per_s": config.lazy_fill_kib_per_s,
            });
        }
        fs::write(&node_file, node_json.to_string())
            .map_err(io(format!("writing {}", node_file.display())))?;
        let mut node_daemon = Daemon::spawn(
            "twig-node",
            Command::new("twig-node")
                .arg("--config")
                .arg(&node_file)
                .env("RUST_LOG", "info"),
            dir.join("twig-node.log"),
        )?;
        node_daemon.wait_for_socket(&node_socket, START)?;

        let cdir = dir.join("containerd");
        fs::create_dir(&cdir).map_err(io(format!("creating {}", cdir.display())))?;
        let config_file = cdir.join("config.toml");
        fs::write(&config_file, containerd_config(&cdir, &snap_socket))
            .map_err(io(format!("writing {}", config_file.display())))?;
        // containerd's environment is its shims'.
        let shim_file = dir.join("shim.json");
        fs::write(
            &shim_file,
            shim_config(&dir, &node_socket, config.shim_call_s).to_string(),
        )
        .map_err(io(format!("writing {}", shim_file.display())))?;
        let socket = cdir.join("containerd.sock");
        let mut containerd = Daemon::spawn(
            "containerd",
            Command::new("containerd")
                .arg("--config")
                .arg(&config_file)
                .env("TWIG_SHIM_CONFIG", &shim_file),
            cdir.join("containerd.log"),
        )?;
        containerd.wait_for_socket(&socket, START)?;

        let node = Node {
            containerd,
            snapshotter,
            node_daemon,
            socket,
            work: Some(work),
            _xfs: xfs,
        };
        node.ctr_ok([
            OsStr::new("images"),
            OsStr::new("import"),
            OsStr::new("--snapshotter"),
            OsStr::new("twig"),
            image.as_os_str(),
        ])?;
        let images = node.ctr_ok(["images", "ls", "-q"])?;
        if !images.lines().any(|l| l == IMAGE_REF) {
            return Err(Error::Environment(format!(
                "{} did not hold {IMAGE_REF} (containerd has: {images:?}); \
                 build it with e2e/build-image.sh",
                image.display()
            )));
        }
        Ok(node)
    }

    /// containerd's socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The node's directory (containerd's own is `containerd/` in it).
    pub fn dir(&self) -> Result<&Path> {
        self.work
            .as_ref()
            .map(TempDir::path)
            .ok_or_else(|| Error::Environment("the node was torn down".into()))
    }

    /// [`Node::ctr_ok`] in containerd namespace `namespace` (CRI's is
    /// `k8s.io`).
    pub fn ctr_ns_ok(&self, namespace: &str, args: &[&OsStr]) -> Result<String> {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(&self.socket)
            .args(["--namespace", namespace])
            .args(args);
        let out = run(&mut cmd, CTR)?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(Error::Failed {
                what: format!("{cmd:?}"),
                status: out.status,
                output: format!("stdout: {}\nstderr: {}", out.stdout, out.stderr),
            })
        }
    }

    /// `ctr` against this node's containerd in [`NAMESPACE`], within a
    /// deadline, whatever its exit status.
    pub fn ctr<I, S>(&self, args: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.ctr_within(args, CTR)
    }

    fn ctr_within<I, S>(&self, args: I, within: Duration) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        run(&mut self.ctr_command(args), within)
    }

    fn ctr_command<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(&self.socket)
            .args(["--namespace", NAMESPACE])
            .args(args);
        cmd
    }

    /// `ctr` against this node's containerd in [`NAMESPACE`], in the
    /// background (e.g. a `ctr run` or `ctr task exec` waiting for its
    /// process while the test signals, pauses or measures it).
    pub fn ctr_background<I, S>(&self, args: I) -> Result<Background>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        Background::spawn(&mut self.ctr_command(args))
    }

    /// `ctr` against this node's containerd in [`NAMESPACE`] with a new
    /// pseudo-terminal as its stdin, stdout and stderr (what `ctr run -t`
    /// and `ctr task exec -t` need), within a deadline; the terminal's
    /// output is the result's stdout.
    pub fn ctr_tty<I, S>(&self, args: I) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        run_on_pty(&mut self.ctr_command(args), CTR)
    }

    /// [`Node::ctr`] that fails on a failure status; returns stdout.
    pub fn ctr_ok<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let args: Vec<S> = args.into_iter().collect();
        let what = format!(
            "ctr {}",
            args.iter()
                .map(|a| a.as_ref().to_string_lossy())
                .collect::<Vec<_>>()
                .join(" ")
        );
        let out = self.ctr(&args)?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(Error::Failed {
                what,
                status: out.status,
                output: format!("stdout: {}\nstderr: {}", out.stdout, out.stderr),
            })
        }
    }

    /// `ctr run --rm --runtime <runtime> --snapshotter twig` of the test
    /// image as container `id`, running `argv`, without a TTY; the output
    /// and exit status are the container's.
    pub fn run(&self, runtime: Runtime, id: &str, argv: &[&str]) -> Result<Output> {
        self.run_with(runtime, id, &[], argv)
    }

    /// [`Node::run`] with more `ctr run` flags (e.g. `--memory-limit`).
    pub fn run_with(
        &self,
        runtime: Runtime,
        id: &str,
        flags: &[&str],
        argv: &[&str],
    ) -> Result<Output> {
        let mut args = vec!["run", "--rm", "--runtime", runtime.name()];
        args.extend_from_slice(flags);
        args.extend_from_slice(&["--snapshotter", "twig", IMAGE_REF, id]);
        args.extend_from_slice(argv);
        self.ctr(args)
    }

    /// The end of containerd's and twig-snapshotter's logs, and of the twig
    /// shim's VM logs (VMM, serial console), for a failing test's message.
    pub fn logs(&self) -> String {
        self.logs_of(40, 40)
    }

    /// [`Node::logs`] with the last `containerd` lines of containerd's log
    /// (it holds every shim's log too) and `lines` of each other log.
    pub fn logs_of(&self, containerd: usize, lines: usize) -> String {
        let mut text = format!(
            "--- containerd ({}):\n{}\n--- twig-snapshotter ({}):\n{}\n--- twig-node ({}):\n{}",
            self.containerd.log().display(),
            tail(self.containerd.log(), containerd),
            self.snapshotter.log().display(),
            tail(self.snapshotter.log(), lines),
            self.node_daemon.log().display(),
            tail(self.node_daemon.log(), lines)
        );
        if let Some(work) = &self.work {
            let dirs = [work.path().join("shim"), work.path().join("node")];
            for log in dirs.iter().flat_map(|d| log_files(d, 3)) {
                text.push_str(&format!("\n--- {}:\n{}", log.display(), tail(&log, lines)));
            }
        }
        text
    }

    /// containerd's goroutines that mention `needle`, from the stack dump it
    /// writes on SIGUSR1 (`$TMPDIR/containerd.<unix time>.stacks.log`), at
    /// most `lines` lines: where a CRI call that does not return waits.
    pub fn containerd_stacks(&self, needle: &str, lines: usize) -> String {
        let Some(pid) = self.containerd.pid() else {
            return "containerd is not running".into();
        };
        let before = stack_dumps();
        let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX));
        if let Err(e) = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGUSR1) {
            return format!("SIGUSR1 to containerd: {e}");
        }
        // The dump is new, and written: its size stopped changing.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let mut seen = None;
        let dump = loop {
            let new = stack_dumps().into_iter().find(|d| !before.contains(d));
            let size = new
                .as_ref()
                .and_then(|d| fs::metadata(d).ok())
                .map(|m| m.len());
            match (new, size) {
                (Some(d), Some(n)) if n > 0 && seen == Some(n) => break d,
                (_, n) => seen = n,
            }
            if std::time::Instant::now() >= deadline {
                return "containerd wrote no stack dump within 20 s".into();
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let text = fs::read_to_string(&dump).unwrap_or_default();
        let _ = fs::remove_file(&dump);
        let picked: Vec<&str> = text.split("\n\n").filter(|g| g.contains(needle)).collect();
        let out = picked.join("\n\n");
        let shown: Vec<&str> = out.lines().take(lines).collect();
        format!(
            "--- {} of containerd's goroutines mention {needle:?}:\n{}",
            picked.len(),
            shown.join("\n")
        )
    }

    /// Kills and deletes what is left of the node's tasks, stops containerd,
    /// its shims and the snapshotter by PID, and removes the node's files.
    fn teardown(&mut self) {
        if self.containerd.pid().is_some() {
            let tasks = self
                .ctr_within(["tasks", "ls", "-q"], TEARDOWN)
                .map(|o| o.stdout)
                .unwrap_or_default();
            for id in tasks.lines().filter(|l| !l.is_empty()) {
                // Best effort: the shims are killed below in any case.
                let _ = self.ctr_within(["tasks", "rm", "-f", id], TEARDOWN);
            }
        }
        self.containerd.stop();
        // Shims outlive containerd; each names its socket in `-address`.
        kill_processes_with_arg(&self.socket.to_string_lossy());
        // The VMMs the shims took outlive them (they are the daemon's
        // children, owned by the shims): each is found by its API socket's
        // path in its arguments (`<vm>/vm/api.sock`, bound into a jailed
        // VMM at that path). The daemon reaps them, then stops.
        if let Some(work) = &self.work {
            let vms = work.path().join("node").join("vms");
            for vm in fs::read_dir(&vms).into_iter().flatten().flatten() {
                kill_processes_with_arg(&vm.path().join("vm/api.sock").to_string_lossy());
            }
        }
        self.node_daemon.stop();
        self.snapshotter.stop();
        if let Some(work) = self.work.take() {
            unmount_all_under(work.path());
            // Removing is best effort: an own XFS goes away with its image.
            let _ = work.close();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // The XFS (a field) is unmounted after this, once nothing uses it.
        self.teardown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_names_the_proxy_snapshotter_and_both_runtimes() {
        let c = containerd_config(Path::new("/n/containerd"), Path::new("/n/twig.sock"));
        assert!(
            c.contains("[proxy_plugins.twig]\n  type = \"snapshot\"\n  address = \"/n/twig.sock\"")
        );
        assert!(c.contains("address = \"/n/containerd/containerd.sock\""));
        assert!(c.contains("runtime_type = \"io.containerd.twig.v2\""));
        assert!(c.contains("pod_annotations = [\"twig.dev/*\"]"));
        assert!(c.contains("runtime_type = \"io.containerd.runc.v2\""));
        assert!(c.contains("snapshotter = \"twig\""));
    }

    #[test]
    fn configs_keep_shim_and_daemon_in_the_node_and_boot_the_given_guest() {
        let c = shim_config(Path::new("/n"), Path::new("/n/node.sock"), SHIM_CALL_S);
        assert_eq!(c["state_root"], "/n/shim");
        assert_eq!(c["node_socket"], "/n/node.sock");
        assert_eq!(c["bpffs_root"], "/sys/fs/bpf/twig-n");
        assert_eq!(c["call_timeout_s"], 120);
        let guest = Guest {
            kernel: PathBuf::from("/guest/bzImage"),
            initrd: PathBuf::from("/guest/agent-initrd"),
        };
        let c = node_config(Path::new("/n"), Path::new("/x/vm"), Some(&guest), 8);
        assert_eq!(c["socket"], "/n/node.sock");
        assert_eq!(c["store"], "/x/vm");
        assert_eq!(c["run_dir"], "/n/node");
        assert_eq!(c["base"]["kernel"], "/guest/bzImage");
        assert_eq!(c["base"]["initrd"], "/guest/agent-initrd");
        assert_eq!(c["pool"]["shapes"][0]["mem_mib"], BASE_MEM_MIB);
        assert_eq!(c["pool"]["start_timeout_s"], 120);
        assert_eq!(
            c["templates"]["cri_socket"],
            "/n/containerd/containerd.sock"
        );
        assert_eq!(
            c["templates"]["task_dir"],
            "/n/containerd/state/io.containerd.runtime.v2.task/k8s.io"
        );
        assert_eq!(c["net_pool"]["dir"], "/sys/fs/bpf/twig-n/pool");
        assert_eq!(c["net_pool"]["size"], 8);
        let bare = node_config(Path::new("/n"), Path::new("/x/vm"), None, 0);
        assert!(bare["base"].get("kernel").is_none(), "{bare}");
    }

    #[test]
    fn mounts_under_finds_escaped_paths_deepest_first() {
        let table = "\
22 1 8:1 / / rw - ext4 /dev/sda1 rw
90 22 7:0 / /x/node-1 rw - xfs /dev/loop0 rw
91 90 7:1 / /x/node-1/a\\040b/rootfs rw - ext4 /dev/loop1 rw
92 22 7:2 / /x/node-10 rw - xfs /dev/loop2 rw
";
        assert_eq!(
            mounts_under(table, Path::new("/x/node-1")),
            vec![
                PathBuf::from("/x/node-1/a b/rootfs"),
                PathBuf::from("/x/node-1")
            ]
        );
    }
}
