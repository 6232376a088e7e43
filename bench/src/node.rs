//! `twig-bench node`: what a pod's VM costs the shim with the node daemon —
//! `AcquireVm` on twig-node's socket, then `restore` of the template into
//! the handed-over `twig-vmm serve` process — taken from the warm pool
//! (VM and memory slots created ahead) versus spawned on demand (an empty
//! pool), and a rollback of the running VM to the template — each with
//! the VMMs bare (no jail, no seccomp), filtered (seccomp, no jail) and
//! jailed (twig-node's default: jail and seccomp), the variants
//! alternating run by run. Real twig-node and twig-vmm processes; the
//! template is the ring-3 test guest, booted on this host's /dev/kvm and
//! snapshotted into the daemons' node store.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use twig_proto::node::{AcquireVmRequest, StatusRequest};
use twig_proto::node_ttrpc::PoolClient;
use twig_store::NodeStore;
use twig_vmm::api::Client;
use twig_vmm::{testguest, Capture, DeviceConfig, Kind, RunState, Shape, Vm, VsockConfig};

use crate::stats::{Context, Error, Report};
use crate::vmm::workspace_binary;

const T: Duration = Duration::from_secs(30);
/// The node's disk slots (every pooled VMM and the template have them).
const DISK_SLOTS: u32 = 2;
const TEMPLATE: &str = "bench-tpl";

#[derive(clap::Args)]
pub struct Args {
    /// Timed pod VM acquisitions of each kind.
    #[arg(long, default_value_t = 30)]
    runs: usize,
    /// Guest RAM of the template and the pooled VMs, MiB.
    #[arg(long, default_value_t = 128)]
    mem_mib: u32,
    /// Prepared VMMs the pool keeps (the pooled runs wait until it is full
    /// again before each acquisition: pods arriving slower than the refill).
    #[arg(long, default_value_t = 2)]
    pool_size: usize,
    /// Directory under which the temporary node (store, sockets) is made.
    #[arg(long, default_value = "/tmp")]
    dir: PathBuf,
}

/// A twig-node process, stopped on drop.
struct Daemon {
    child: Child,
    pool: PoolClient,
}

impl Daemon {
    fn start(bin: &Path, dir: &Path, config: &Value) -> Result<Daemon, Error> {
        std::fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("node.json");
        std::fs::write(&path, config.to_string())
            .context(|| format!("writing {}", path.display()))?;
        let log = std::fs::File::create(dir.join("node.log")).context(|| "node.log".into())?;
        let mut child = Command::new(bin)
            .arg("--config")
            .arg(&path)
            .stdin(Stdio::null())
            .stderr(log)
            .spawn()
            .context(|| format!("starting {}", bin.display()))?;
        let socket = dir.join("node.sock");
        let deadline = Instant::now() + T;
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if let Some(status) = child.try_wait()? {
                return Err(format!(
                    "twig-node exited with {status}: {}",
                    std::fs::read_to_string(dir.join("node.log")).unwrap_or_default()
                )
                .into());
            }
            if Instant::now() > deadline {
                return Err(
                    format!("twig-node did not serve {} in {T:?}", socket.display()).into(),
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let client = ttrpc::Client::connect(&format!("unix://{}", socket.display()))
            .context(|| format!("connecting to {}", socket.display()))?;
        Ok(Daemon {
            child,
            pool: PoolClient::new(client),
        })
    }

    /// Prepared VMMs in the pool (its one shape), as the daemon reports.
    fn pooled(&self) -> Result<usize, Error> {
        let status = self
            .pool
            .status(
                ttrpc::context::with_timeout(T.as_nanos() as i64),
                &StatusRequest::default(),
            )
            .context(|| "Status".into())?;
        Ok(status.pool.first().map_or(0, |l| l.ready_pids.len()))
    }

    fn wait_pool(&self, n: usize) -> Result<(), Error> {
        let deadline = Instant::now() + T;
        while self.pooled()? < n {
            if Instant::now() > deadline {
                return Err(format!("the pool did not reach {n} VMMs in {T:?}").into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) on our own child; no memory involved.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + T;
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What one pod's VM took.
struct PodTimes {
    acquire: Duration,
    acquire_restore: Duration,
    rollback: Duration,
}

/// One pod's VM: acquire, restore, wait until the guest runs, roll it back
/// to the template (in place), stop it.
fn pod_vm(daemon: &Daemon, pooled: bool) -> Result<PodTimes, Error> {
    let start = Instant::now();
    let req = AcquireVmRequest {
        template: TEMPLATE.into(),
        sandbox_id: "bench".into(),
        ..Default::default()
    };
    let vm = daemon
        .pool
        .acquire_vm(ttrpc::context::with_timeout(T.as_nanos() as i64), &req)
        .context(|| "AcquireVm".into())?;
    let acquire = start.elapsed();
    if vm.pooled != pooled {
        return Err(format!("expected pooled={pooled}, got {vm:?}").into());
    }
    let mut api = Client::connect(Path::new(&vm.api_socket), T)?;
    api.restore(Path::new(&vm.template_dir), T)?;
    let acquire_restore = start.elapsed();
    let deadline = Instant::now() + T;
    loop {
        let s = api.stats(T)?;
        if s.exits > 0 && s.state == RunState::Running {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("the restored guest did not run: {s:?}").into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let started = Instant::now();
    api.rollback(Path::new(&vm.template_dir), T)?;
    let rollback = started.elapsed();
    api.shutdown(T)?;
    let proc_dir = PathBuf::from(format!("/proc/{}", vm.pid));
    let deadline = Instant::now() + T;
    while proc_dir.exists() {
        if Instant::now() > deadline {
            return Err(format!("twig-vmm {} was not reaped by twig-node", vm.pid).into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(PodTimes {
        acquire,
        acquire_restore,
        rollback,
    })
}

/// How the daemon's VMMs are confined.
#[derive(Clone, Copy)]
enum Confinement {
    /// No jail, `--seccomp off`.
    Bare,
    /// No jail, seccomp filters on (twig-vmm's default).
    Filtered,
    /// Jailed and filtered (twig-node's default).
    Jailed,
}

impl Confinement {
    fn name(self) -> &'static str {
        match self {
            Confinement::Bare => "bare",
            Confinement::Filtered => "filtered",
            Confinement::Jailed => "jailed",
        }
    }
}

/// A twig-vmm that runs without its filters: the binary behind a script
/// adding `--seccomp off` (the daemon's flags come first).
fn unfiltered_vmm(dir: &Path, vmm: &Path) -> Result<PathBuf, Error> {
    use std::os::unix::fs::PermissionsExt;
    let script = dir.join("twig-vmm-seccomp-off");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nexec {} \"$@\" --seccomp off\n", vmm.display()),
    )
    .context(|| format!("writing {}", script.display()))?;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
        .context(|| format!("making {} executable", script.display()))?;
    Ok(script)
}

pub fn run(args: &Args) -> Result<Value, Error> {
    twig_vmm::open_kvm().context(|| "this benchmark needs a usable /dev/kvm".into())?;
    if args.runs == 0 || args.pool_size == 0 {
        return Err("--runs and --pool-size must be at least 1".into());
    }
    let node_bin = workspace_binary("twig-node")?;
    let vmm_bin = workspace_binary("twig-vmm")?;
    let tmp = tempfile::Builder::new()
        .prefix("twig-bench-node-")
        .tempdir_in(&args.dir)
        .context(|| format!("creating a temporary directory in {}", args.dir.display()))?;
    let root = std::path::absolute(tmp.path()).context(|| "resolving the temp dir".into())?;
    let store_dir = root.join("store");

    // The template: the test guest in a VM with a pooled VMM's devices.
    let store = NodeStore::open(&store_dir, true)?;
    let devices = DeviceConfig {
        disk_slots: DISK_SLOTS as usize,
        // A pooled VMM's network device: detached until `attach_net`.
        net: Some(twig_vmm::NetConfig {
            tap: None,
            mac: [0x02, 0x74, 0x77, 0x69, 0x67, 0x01],
        }),
        vsock: Some(VsockConfig {
            cid: 3,
            uds_path: root.join("template.vsock"),
        }),
        // The node's VMMs take free page reports (free_page_reporting).
        balloon: true,
        ..Default::default()
    };
    let serial = Capture::new();
    let mut vm = Vm::create_with(
        Shape::new(args.mem_mib as usize, 1),
        serial.writer(),
        &devices,
    )?;
    vm.boot(&testguest::write_to(&root)?, "console=ttyS0")?;
    testguest::wait_booted(&vm, T)?;
    vm.snapshot_into(&store, TEMPLATE, Kind::Full)?;
    drop(vm);

    let mut r = Report::default();
    r.value("mem_mib", json!(args.mem_mib));
    r.value("pool_size", json!(args.pool_size));
    let bare_vmm = unfiltered_vmm(&root, &vmm_bin)?;
    let mut variants = Vec::new();
    for (kind, size) in [("pooled", args.pool_size), ("on_demand", 0)] {
        for c in [
            Confinement::Bare,
            Confinement::Filtered,
            Confinement::Jailed,
        ] {
            let name = format!("{kind}_{}", c.name());
            let dir = root.join(&name);
            let config = json!({
                "socket": dir.join("node.sock"),
                "store": store_dir,
                "allow_copy": true,
                "run_dir": dir.join("run"),
                "vmm_binary": if matches!(c, Confinement::Bare) { &bare_vmm } else { &vmm_bin },
                "disk_slots": DISK_SLOTS,
                "base": {"mem_mib": args.mem_mib},
                "pool": {"shapes": [{"mem_mib": args.mem_mib, "size": size}]},
                "jail": {"enabled": matches!(c, Confinement::Jailed), "cgroup": format!("twig-bench-{}", std::process::id())},
            });
            let daemon = Daemon::start(&node_bin, &dir, &config)?;
            variants.push((name, size, daemon, Vec::new()));
        }
    }
    // The variants alternate run by run, so load changes hit them alike.
    for i in 0..args.runs {
        for (name, size, daemon, times) in &mut variants {
            daemon.wait_pool(*size)?;
            times.push(pod_vm(daemon, *size > 0).context(|| format!("{name} run {i}"))?);
        }
    }
    for (name, _, _, times) in &variants {
        let of = |f: fn(&PodTimes) -> Duration| times.iter().map(f).collect::<Vec<_>>();
        r.timing(&format!("{name}_acquire_ms"), &of(|t| t.acquire));
        r.timing(
            &format!("{name}_acquire_restore_ms"),
            &of(|t| t.acquire_restore),
        );
        r.timing(&format!("{name}_rollback_ms"), &of(|t| t.rollback));
    }
    // The daemons stop (and remove their VMMs' cgroups); then the parent.
    drop(variants);
    if let Ok(hierarchies) = twig_vmm::jail::cgroup::hierarchies() {
        for h in hierarchies {
            let _ = std::fs::remove_dir(h.mount.join(format!("twig-bench-{}", std::process::id())));
        }
    }
    Ok(r.into_value())
}
