//! The shim's VM acquisition against a real `twig-node` on this host's
//! /dev/kvm: `VmSandbox::start` takes a prepared `twig-vmm` from the
//! daemon's pool and restores the template into it. The template is
//! twig-vmm's ring-3 test guest, which has no agent, so the start fails at
//! the agent: this exercises the failure path — the error says why, and
//! the handed-over VMM (the daemon's child, not the shim's) is killed
//! through its pidfd and reaped by the daemon, no zombie left. A start
//! waits for the node's start gate, and gives up without a VM when no
//! slot frees in time. Needs root
//! and KVM; fails, never skips, without them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use twig_shim::config::Config;
use twig_shim::error::Error;
use twig_shim::gate::StartGate;
use twig_shim::restore::RestoreFrom;
use twig_shim::vm::VmSandbox;
use twig_store::NodeStore;
use twig_vmm::{testguest, Capture, DeviceConfig, Kind, Shape, Vm, VsockConfig};

const T: Duration = Duration::from_secs(20);

/// Builds the workspace's binaries with the cargo running the tests (all
/// of them, with the workspace's features: after `cargo test --workspace`
/// nothing is compiled again, where `-p` would build some dependencies
/// again with other features) and returns `name`'s.
fn binary(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = twig_store::testkit::clear_cargo_test_env(&mut Command::new(cargo))
        .current_dir(root)
        .args(["build", "-q", "--workspace", "--bins"])
        .status()
        .unwrap_or_else(|e| panic!("running cargo build --workspace --bins: {e}"));
    assert!(st.success(), "building {name} failed");
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or(root.join("target"))
        .join("debug")
        .join(name)
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + T;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The node's base template: the test guest booted with a pooled VMM's
/// devices, snapshotted under the id twig-node derives from the node
/// configuration `config` (its kernel and initrd files are stand-ins).
fn make_template(dir: &Path, config: &serde_json::Value) -> String {
    if let Err(e) = twig_vmm::open_kvm() {
        panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
    }
    let store = NodeStore::open(&dir.join("store"), true).unwrap();
    let devices = DeviceConfig {
        disk_slots: 2,
        // A pooled VMM's network device: detached until `attach_net`.
        net: Some(twig_vmm::NetConfig {
            tap: None,
            mac: [0x02, 0x74, 0x77, 0x69, 0x67, 0x01],
        }),
        vsock: Some(VsockConfig {
            cid: 3,
            uds_path: dir.join("tpl.vsock"),
        }),
        // The node's VMMs take free page reports (free_page_reporting).
        balloon: true,
        ..Default::default()
    };
    let serial = Capture::new();
    let mut vm = Vm::create_with(Shape::new(64, 1), serial.writer(), &devices).unwrap();
    vm.boot(&testguest::write_to(dir).unwrap(), "console=ttyS0")
        .unwrap();
    testguest::wait_booted(&vm, T).unwrap();
    let config: twig_node::Config = serde_json::from_value(config.clone()).unwrap();
    let templates = twig_node::template::Templates::open(&config).unwrap();
    let id = templates.base_id(templates.default_shape()).unwrap();
    vm.snapshot_into(&store, &id, Kind::Full).unwrap();
    id
}

struct Daemon(Child);

impl Drop for Daemon {
    /// SIGTERM, so that the daemon kills its pooled VMMs; SIGKILL if it
    /// has not exited within the deadline.
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child, not reaped yet.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + T;
        while matches!(self.0.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_failed_restore_kills_the_handed_over_vmm_and_the_daemon_reaps_it() {
    let dir = tempfile::tempdir().unwrap();
    for file in ["kernel", "initrd"] {
        std::fs::write(dir.path().join(file), file).unwrap();
    }
    let node_config = serde_json::json!({
        "socket": dir.path().join("node.sock"),
        "store": dir.path().join("store"),
        "allow_copy": true,
        "run_dir": dir.path().join("run"),
        "vmm_binary": binary("twig-vmm"),
        "disk_slots": 2,
        "base": {"mem_mib": 64, "kernel": dir.path().join("kernel"), "initrd": dir.path().join("initrd")},
        "pool": {"shapes": [{"mem_mib": 64, "size": 1}]},
    });
    let base = make_template(dir.path(), &node_config);
    std::fs::write(dir.path().join("node.json"), node_config.to_string()).unwrap();
    let log = std::fs::File::create(dir.path().join("node.log")).unwrap();
    let _daemon = Daemon(
        Command::new(binary("twig-node"))
            .arg("--config")
            .arg(dir.path().join("node.json"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until("twig-node serves", || {
        std::os::unix::net::UnixStream::connect(dir.path().join("node.sock")).is_ok()
    });

    let config = Config {
        node_socket: dir.path().join("node.sock"),
        state_root: dir.path().join("shim-root"),
        call_timeout_s: 1,
        acquire_timeout_s: 5,
        start_concurrency: 1,
        ..Config::default()
    };
    let state = dir.path().join("shim-state");
    let e = VmSandbox::start(
        &config,
        &state,
        "sb",
        "",
        None,
        None,
        None,
        Default::default(),
        None,
    )
    .err()
    .expect("the test guest has no agent");
    assert!(matches!(e, Error::Agent { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("waiting for the agent of the restored VM"),
        "{e}"
    );
    assert!(
        !state.join("vmm.pid").exists(),
        "the failed start left its state directory"
    );
    let pid = handed_pid(&dir.path().join("node.log"));
    wait_until("the handed-over VMM is killed and reaped", || {
        !Path::new(&format!("/proc/{pid}")).exists()
    });

    let oci = serde_json::json!({"hostname": "clone"});
    let restore = |id: &str| {
        VmSandbox::start(
            &config,
            &state,
            "sb",
            "",
            None,
            Some(RestoreFrom {
                id: id.into(),
                app_template: None,
                artifact: None,
                oci: &oci,
                rootfs: Path::new("/nonexistent/rootfs.img"),
            }),
            None,
            Default::default(),
            None,
        )
        .err()
        .expect("no usable snapshot")
    };
    // Restore-from fails after the acquisition (the base template is no
    // pod snapshot): the handed-over VMM is killed too.
    let e = restore(&base);
    assert!(e.to_string().contains("twig.dev/restore-from"), "{e}");
    assert!(
        !state.join("vmm.pid").exists(),
        "the failed start left its state"
    );
    let pid = handed_pid(&dir.path().join("node.log"));
    wait_until("the handed-over VMM is killed and reaped", || {
        !Path::new(&format!("/proc/{pid}")).exists()
    });

    // A snapshot the store does not hold: refused before any VM is taken.
    let handed = handed_count(&dir.path().join("node.log"));
    let e = restore("no-such-snapshot");
    assert!(
        matches!(e, Error::NotFound(_))
            && e.to_string().contains(
                "twig.dev/restore-from: getting a VM to restore snapshot \"no-such-snapshot\" \
                 into from the node daemon"
            )
            && e.to_string()
                .contains("snapshot \"no-such-snapshot\" is not in this node's store"),
        "{e}"
    );
    assert_eq!(
        handed_count(&dir.path().join("node.log")),
        handed,
        "a VMM was handed over for a snapshot that is not there"
    );

    // The node's one start slot held by another start: this one waits for
    // it, then gives up without taking a VM...
    let other = StartGate::new(&config.state_root, config.start_concurrency)
        .enter(Duration::from_secs(1))
        .expect("the start slot");
    let e = VmSandbox::start(
        &config,
        &state,
        "sb",
        "",
        None,
        None,
        None,
        Default::default(),
        None,
    )
    .err()
    .expect("no start slot");
    assert!(
        matches!(e, Error::Deadline(_)) && e.to_string().contains("no sandbox start slot of 1"),
        "{e}"
    );
    assert_eq!(
        handed_count(&dir.path().join("node.log")),
        handed,
        "a VMM was handed over to a start that had no slot"
    );
    // ...and goes on once it is free (to the agent the test guest lacks).
    drop(other);
    let e = VmSandbox::start(
        &config,
        &state,
        "sb",
        "",
        None,
        None,
        None,
        Default::default(),
        None,
    )
    .err()
    .expect("the test guest has no agent");
    assert!(matches!(e, Error::Agent { .. }), "{e}");
    assert_eq!(handed_count(&dir.path().join("node.log")), handed + 1);
}

/// How many VMMs twig-node's log says it handed over.
fn handed_count(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter(|l| l.contains("handed over a VMM"))
        .count()
}

/// The pid of the last VMM twig-node's log says it handed over (the log
/// is coloured: escape sequences are dropped first).
fn handed_pid(log: &Path) -> u32 {
    let text = std::fs::read_to_string(log).unwrap();
    let mut plain = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|c| *c == 'm');
        } else {
            plain.push(c);
        }
    }
    let line = plain
        .lines()
        .rfind(|l| l.contains("handed over a VMM"))
        .unwrap_or_else(|| panic!("no VMM handed over in twig-node's log:\n{plain}"));
    let digits: String = line
        .split("pid=")
        .nth(1)
        .unwrap_or_default()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no pid in {line:?}"))
}
