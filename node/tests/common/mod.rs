//! A real `twig-node` process on a temporary node store, its two ttrpc
//! clients, and a small template made by booting twig-vmm's ring-3 test
//! guest on this host's /dev/kvm and snapshotting it into the store. Tests
//! that need KVM or root fail (never skip) with a clear message.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use twig_proto::node::{AcquireVmRequest, AcquireVmResponse, StatusRequest, StatusResponse};
use twig_proto::node_ttrpc::PoolClient;
use twig_proto::twig_ttrpc::NodeClient;
use twig_store::NodeStore;
use twig_vmm::testguest;
use twig_vmm::{Capture, DeviceConfig, Kind, NetConfig, Shape, Vm, VsockConfig};

pub const BIN: &str = env!("CARGO_BIN_EXE_twig-node");
pub const T: Duration = Duration::from_secs(20);
/// The test template's shape (the node's disk slots: 2).
pub const MIB: u32 = 64;
pub const SLOTS: u32 = 2;

/// The workspace's `twig-vmm` binary next to twig-node's, built (once per
/// test binary) with the cargo that runs the tests — with the features
/// twig-vmm's own tests build it with, so that under `cargo test
/// --workspace` this build leaves the binary they use as it is (and its
/// test-only `test_trigger` op, a system call outside the seccomp filters,
/// is there). Plain feature names: `--features twig-vmm/test-trigger`
/// with `-p twig-vmm` built the binary without the feature.
pub fn vmm_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
            let status = twig_store::testkit::clear_cargo_test_env(&mut Command::new(cargo))
                .args([
                    "build",
                    "-q",
                    "-p",
                    "twig-vmm",
                    "--bin",
                    "twig-vmm",
                    "--features",
                    "testguest,test-trigger",
                    "--manifest-path",
                ])
                .arg(&manifest)
                .status()
                .expect("run cargo build -p twig-vmm");
            assert!(status.success(), "cargo build -p twig-vmm failed: {status}");
            let bin = Path::new(BIN).with_file_name("twig-vmm");
            assert!(bin.is_file(), "{} was not built", bin.display());
            bin
        })
        .clone()
}

/// Polls `f` until it holds, failing the test with `what` after `within`.
pub fn wait_until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The base configuration of a test node in `dir` (pool of `size` test-shaped VMMs).
pub fn config(dir: &Path, size: usize) -> serde_json::Value {
    serde_json::json!({
        "socket": dir.join("node.sock"),
        "store": dir.join("store"),
        "allow_copy": true,
        "run_dir": dir.join("run"),
        "vmm_binary": vmm_binary(),
        "disk_slots": SLOTS,
        "base": {"kernel": dir.join("no-kernel"), "initrd": dir.join("no-initrd"), "mem_mib": MIB},
        "pool": {"shapes": [{"mem_mib": MIB, "size": size}], "start_timeout_s": 10},
        "templates": {
            "cri_socket": dir.join("no-containerd.sock"),
            "log_dir": dir.join("template-logs"),
            "retry_s": 3600,
        },
        "net_pool": {"size": 0},
    })
}

/// Makes the published snapshot `id` in the node store `<dir>/store`: the
/// test guest booted in a VM of the test shape (its devices those of a
/// pooled VMM: the node's disk slots, a detached network device, a vsock
/// device and the balloon of free page reporting), full snapshot.
pub fn make_template(dir: &Path, id: &str) {
    make_template_of(dir, id, MIB);
}

/// [`make_template`] with `mib` MiB of guest RAM (one vCPU).
pub fn make_template_of(dir: &Path, id: &str, mib: u32) {
    make_snapshot(dir, id, mib, None, &[]);
}

/// [`make_template_of`], the snapshot owned by namespace `owner`, with
/// `labels`.
pub fn make_snapshot(dir: &Path, id: &str, mib: u32, owner: Option<&str>, labels: &[(&str, &str)]) {
    if let Err(e) = twig_vmm::open_kvm() {
        panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
    }
    let store = NodeStore::open(&dir.join("store"), true).expect("open the node store");
    let devices = DeviceConfig {
        disk_slots: SLOTS as usize,
        net: Some(NetConfig {
            tap: None,
            mac: [0x02, 0x74, 0x77, 0x69, 0x67, 0x01],
        }),
        vsock: Some(VsockConfig {
            cid: 3,
            uds_path: dir.join(format!("{id}.vsock")),
        }),
        balloon: true,
        ..Default::default()
    };
    let serial = Capture::new();
    let mut vm = Vm::create_with(Shape::new(mib as usize, 1), serial.writer(), &devices)
        .expect("create the template VM");
    let kernel = testguest::write_to(dir).expect("write the test guest");
    vm.boot(&kernel, "console=ttyS0").expect("boot");
    serial.wait_for(b"B", 0, T).expect("boot marker");
    testguest::wait_booted(&vm, T).expect("guest magic");
    let mut staging = store.stage(id).expect("stage");
    vm.snapshot(staging.dir(), Kind::Full).expect("snapshot");
    if let Some(o) = owner {
        staging.set_owner(o).expect("owner");
    }
    for (k, v) in labels {
        staging.set_label(k, v);
    }
    staging.publish().expect("publish");
}

/// A `twig-node` process, stopped with SIGTERM (then SIGKILL) on drop.
pub struct Node {
    pub child: Child,
    pub dir: PathBuf,
    pub rt: tokio::runtime::Runtime,
    pub node: NodeClient,
    pub pool: PoolClient,
}

impl Node {
    /// Writes `config` to `<dir>/node.json` and starts the daemon on it.
    pub fn start(dir: &Path, config: &serde_json::Value) -> Node {
        let path = dir.join("node.json");
        std::fs::write(&path, config.to_string()).unwrap();
        let log = std::fs::File::create(dir.join("node.log")).unwrap();
        let mut child = Command::new(BIN)
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start twig-node");
        let socket = dir.join("node.sock");
        wait_until("twig-node serves its socket", T, || {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "twig-node exited with {status}: {}",
                    std::fs::read_to_string(dir.join("node.log")).unwrap_or_default()
                );
            }
            std::os::unix::net::UnixStream::connect(&socket).is_ok()
        });
        let address = format!("unix://{}", socket.display());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let node = rt.block_on(async {
            NodeClient::new(ttrpc::r#async::Client::connect(&address).await.unwrap())
        });
        let pool = PoolClient::new(ttrpc::Client::connect(&address).expect("connect (sync)"));
        Node {
            child,
            dir: dir.to_path_buf(),
            rt,
            node,
            pool,
        }
    }

    pub fn acquire(&self, template: &str) -> Result<AcquireVmResponse, ttrpc::Error> {
        self.acquire_req(AcquireVmRequest {
            template: template.to_string(),
            sandbox_id: "test-sandbox".into(),
            ..Default::default()
        })
    }

    pub fn acquire_req(&self, req: AcquireVmRequest) -> Result<AcquireVmResponse, ttrpc::Error> {
        self.pool
            .acquire_vm(ttrpc::context::with_timeout(T.as_nanos() as i64), &req)
    }

    /// The daemon's status.
    pub fn status(&self) -> StatusResponse {
        self.pool
            .status(
                ttrpc::context::with_timeout(T.as_nanos() as i64),
                &StatusRequest::default(),
            )
            .expect("Status")
    }

    /// The pooled VMMs (of the one configured shape), sorted.
    pub fn pooled(&self) -> Vec<u32> {
        let mut pids = self
            .status()
            .pool
            .first()
            .map(|l| l.ready_pids.clone())
            .unwrap_or_default();
        pids.sort_unstable();
        pids
    }

    /// Asserts that the pooled VMMs `pids` answer on their API sockets and
    /// are not marked handed over.
    pub fn check_pooled(&self, pids: &[u32]) {
        for pid in pids {
            let dir = self.vm_dir(*pid);
            assert!(!dir.join("handed").exists(), "{pid} is pooled");
            twig_vmm::api::Client::connect(&dir.join("vm/api.sock"), T)
                .unwrap_or_else(|e| panic!("pooled VMM {pid} does not answer: {e}"));
        }
    }

    /// The directory of VMM `pid`.
    pub fn vm_dir(&self, pid: u32) -> PathBuf {
        std::fs::read_dir(self.dir.join("run/vms"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|d| {
                std::fs::read_to_string(d.join("pid")).is_ok_and(|p| p.trim() == pid.to_string())
            })
            .unwrap_or_else(|| panic!("no directory of VMM {pid}"))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("node.log")).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Reaped already (a test waited for it): its pid is not ours now.
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        // SAFETY: kill(2) on our own child, not reaped yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + T;
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `pid` is gone entirely: exited and reaped (a zombie keeps its
/// `/proc` entry).
pub fn gone(pid: u32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
}

/// The ttrpc status code and message of an error.
pub fn status(e: ttrpc::Error) -> (ttrpc::Code, String) {
    match e {
        ttrpc::Error::RpcStatus(s) => (s.code(), s.message().to_string()),
        other => panic!("not a status: {other:?}"),
    }
}

pub fn sigkill(pid: u32) {
    // SAFETY: kill(2); no memory involved.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
}
