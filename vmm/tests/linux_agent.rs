//! Real Linux guests with twig-agent as PID 1: Twig's guest kernel
//! (guest/build-kernel.sh) and the agent initramfs (guest/build-initramfs.sh),
//! a busybox ext4 rootfs built by the test on a virtio-blk disk, the agent
//! reached over virtio-vsock, and the VM's network on a tap. These need a KVM
//! that runs guest ring 0, so they are built with `--features lab` and run
//! inside the nested lab (tests/lab/run.sh), which provides the kernel and
//! initramfs.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use twig_agent::client::{AgentClient, Stream};
use twig_agent::proto::agent::ReidentifyRequest;
use twig_agent::testkit;
use twig_vmm::{
    Capture, DeviceConfig, DiskConfig, Kind, NetConfig, RunState, Shape, Vm, VsockConfig,
};

const MEM_MIB: usize = 128;
const BOOT: Duration = Duration::from_secs(180);
const CALL: Duration = Duration::from_secs(60);
const AGENT_PORT: u32 = 1024;
const MSR_KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;
const MSR_KVM_ASYNC_PF_EN: u32 = 0x4b56_4d02;
const CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 loglevel=4 root=/dev/ram0";

fn env_path(name: &str) -> PathBuf {
    std::env::var_os(name)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!("{name} is not set: this test runs inside the nested lab (tests/lab/run.sh)")
        })
}

/// A VM's host-side files: its writable rootfs disk and its vsock socket.
struct Slot {
    disk: PathBuf,
    uds: PathBuf,
    tap: String,
    mac: [u8; 6],
}

impl Slot {
    /// A VM's files; its disk starts empty (a restore fills it from the
    /// snapshot, a boot from a fresh rootfs image).
    fn new(dir: &Path, name: &str, i: u8) -> Slot {
        std::fs::File::create(dir.join(format!("{name}.ext4"))).expect("disk file");
        Slot {
            disk: dir.join(format!("{name}.ext4")),
            uds: dir.join(format!("{name}.vsock")),
            tap: format!("twt{}x{name}", std::process::id() % 10000),
            mac: [0x06, 0, 0, 0, 0, i],
        }
    }

    fn devices(&self) -> DeviceConfig {
        DeviceConfig {
            disks: vec![DiskConfig {
                path: self.disk.clone(),
                read_only: false,
            }],
            net: Some(NetConfig {
                tap: Some(self.tap.clone()),
                mac: self.mac,
            }),
            vsock: Some(VsockConfig {
                cid: 3,
                uds_path: self.uds.clone(),
            }),
            ..Default::default()
        }
    }

    /// Waits for the agent; a failure shows what the guest printed and the
    /// state of the VM's devices.
    fn connect_logged(&self, vm: &mut Vm, serial: &Capture) -> AgentClient {
        AgentClient::wait_ready(&self.uds, AGENT_PORT, BOOT).unwrap_or_else(|e| {
            panic!(
                "agent at {}: {e}; the VM:\n{}\nguest console:\n{}",
                self.uds.display(),
                vm.post_mortem(),
                String::from_utf8_lossy(&serial.bytes())
            )
        })
    }

    fn connect(&self) -> AgentClient {
        AgentClient::wait_ready(&self.uds, AGENT_PORT, BOOT)
            .unwrap_or_else(|e| panic!("agent at {}: {e}", self.uds.display()))
    }
}

struct Guest {
    vm: Vm,
    agent: AgentClient,
}

/// Starts booting the guest kernel with the agent initramfs and a fresh
/// busybox rootfs on /dev/vda.
fn start(slot: &Slot) -> (Vm, Capture) {
    start_with(slot, &slot.devices())
}

/// Starts booting as [`start`] does, with `devices`.
fn start_with(slot: &Slot, devices: &DeviceConfig) -> (Vm, Capture) {
    start_sized(slot, devices, MEM_MIB)
}

/// Starts booting as [`start_with`] does, with `mib` MiB of RAM.
fn start_sized(slot: &Slot, devices: &DeviceConfig, mib: usize) -> (Vm, Capture) {
    require_kvm();
    testkit::busybox_rootfs(&slot.disk, 32, &[]).expect("busybox ext4 image");
    let serial = Capture::new();
    let mut vm = Vm::create_with(Shape::new(mib, 1), serial.writer(), devices).expect("create VM");
    vm.boot_linux(
        &env_path("TWIG_GUEST_KERNEL"),
        Some(&env_path("TWIG_AGENT_INITRD")),
        CMDLINE,
    )
    .expect("boot");
    (vm, serial)
}

/// Boots as [`start`] does and waits until the agent answers a ping.
fn boot(slot: &Slot) -> Guest {
    let (mut vm, serial) = start(slot);
    let agent = slot.connect_logged(&mut vm, &serial);
    Guest { vm, agent }
}

fn restored(image: &Path, slot: &Slot) -> Guest {
    restored_with(image, slot, &slot.devices())
}

/// Restores as [`restored`] does, with `devices`.
fn restored_with(image: &Path, slot: &Slot, devices: &DeviceConfig) -> Guest {
    restored_sized(image, slot, devices, MEM_MIB)
}

/// Restores as [`restored_with`] does, into a VM of `mib` MiB.
fn restored_sized(image: &Path, slot: &Slot, devices: &DeviceConfig, mib: usize) -> Guest {
    let serial = Capture::new();
    let mut vm = Vm::create_with(Shape::new(mib, 1), serial.writer(), devices).expect("create VM");
    vm.restore(image).expect("restore");
    vm.resume().expect("resume");
    let agent = slot.connect_logged(&mut vm, &serial);
    Guest { vm, agent }
}

fn spec(args: &[&str], hostname: &str) -> Vec<u8> {
    testkit::spec(args, json!({ "hostname": hostname }))
}

fn create(g: &Guest, id: &str, args: &[&str]) {
    g.agent
        .create_container(id, "/dev/vda", false, &spec(args, id), CALL)
        .expect("create container");
    g.agent.start_container(id, CALL).expect("start container");
}

fn sh(agent: &AgentClient, id: &str, exec_id: &str, script: &str) -> (i32, String) {
    let (code, out, err) = agent
        .run(id, exec_id, &["sh", "-c", script], CALL)
        .unwrap_or_else(|e| panic!("exec {script:?}: {e}"));
    assert!(
        err.is_empty() || code != 0,
        "stderr of {script:?}: {}",
        String::from_utf8_lossy(&err)
    );
    (code, String::from_utf8_lossy(&out).trim().to_string())
}

/// Polls `f` until it returns Some, or panics at the deadline.
fn poll<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

const COUNTER: &str =
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new && mv /tmp/c.new /tmp/counter; sleep 0.1; done";

/// The counter's value; polls until the counter has written it once.
fn counter(agent: &AgentClient, tag: &str) -> u64 {
    counter_past(agent, 0, tag)
}

/// Waits until the counter passes `n`.
fn counter_past(agent: &AgentClient, n: u64, tag: &str) -> u64 {
    let mut k = 0;
    poll("the counter to advance", BOOT, || {
        k += 1;
        let (code, out) = sh(agent, "app", &format!("{tag}{k}"), "cat /tmp/counter");
        let c: u64 = (code == 0).then(|| out.parse().ok()).flatten()?;
        (c > n).then_some(c)
    })
}

#[test]
fn the_agent_runs_containers_from_a_block_rootfs() {
    let d = tmp();
    let slot = Slot::new(d.path(), "a", 1);
    let g = boot(&slot);
    let pong = g.agent.ping(CALL).unwrap();
    assert!(!pong.version.is_empty());

    // echo in a container: stdout and exit code.
    create(&g, "echo", &["echo", "hello from twig"]);
    let w = g.agent.wait_exit("echo", "", CALL).unwrap();
    assert_eq!((w.status, w.signal), (0, 0));
    let out = g
        .agent
        .read_to_end("echo", "", Stream::Stdout, CALL)
        .unwrap();
    assert_eq!(out, b"hello from twig\n");

    // A long-running container: exec a second process in it, then kill it.
    create(&g, "app", &["sleep", "1000"]);
    let (code, out) = sh(&g.agent, "app", "e1", "hostname; ls /bin/busybox; exit 7");
    assert_eq!(code, 7);
    assert_eq!(out, "app\n/bin/busybox");
    g.agent.signal_process("app", "", 9, CALL).unwrap();
    let w = g.agent.wait_exit("app", "", CALL).unwrap();
    assert_eq!((w.status, w.signal), (128 + 9, 9));

    // Bad requests get error replies, and the agent carries on.
    assert!(g
        .agent
        .create_container("bad1", "/dev/vdz", false, &spec(&["true"], "x"), CALL)
        .is_err());
    assert!(g
        .agent
        .create_container("bad2", "/dev/vda", false, b"{not json", CALL)
        .is_err());
    assert!(g.agent.wait_process("nope", "", Duration::ZERO).is_err());
    g.agent.ping(CALL).unwrap();
    assert_eq!(g.vm.state(), RunState::Running);
}

#[test]
fn a_counter_continues_in_a_vm_restored_from_its_snapshot() {
    let d = tmp();
    let slot = Slot::new(d.path(), "c", 2);
    let mut g = boot(&slot);
    create(&g, "app", &["sh", "-c", COUNTER]);
    let before = counter_past(&g.agent, 5, "a");
    g.vm.pause().unwrap();
    let s = snap(d.path(), "snap");
    take(&mut g.vm, &s, Kind::Full).unwrap();
    g.vm.resume().unwrap();
    let after = counter(&g.agent, "b");
    assert!(after >= before);

    // The original runs on well past the snapshot's value.
    let ran_on = counter_past(&g.agent, after + 20, "c");
    g.vm.pause().unwrap();

    let r = restored(&s, &Slot::new(d.path(), "r", 3));
    let first = counter(&r.agent, "d");
    assert!(
        (before..=after + 2).contains(&first),
        "restored counter {first}: not from the snapshot (taken between {before} and {after}; the original reached {ran_on})"
    );
    let later = counter_past(&r.agent, first, "e");
    assert!(later > first);
}

const DAY: u64 = 86_400;

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[test]
fn four_clones_get_their_own_identity_entropy_and_disk() {
    let d = tmp();
    let slot = Slot::new(d.path(), "p", 4);
    let mut g = boot(&slot);
    // No UTS namespace of its own: the container sees the VM's hostname.
    let shared_uts = json!({
        "hostname": null,
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "mount"}]}
    });
    g.agent
        .create_container(
            "app",
            "/dev/vda",
            false,
            &testkit::spec(&["sleep", "100000"], shared_uts),
            CALL,
        )
        .unwrap();
    g.agent.start_container("app", CALL).unwrap();
    g.vm.pause().unwrap();
    let s = snap(d.path(), "snap");
    take(&mut g.vm, &s, Kind::Full).unwrap();

    let slots: Vec<Slot> = (0..4)
        .map(|i| Slot::new(d.path(), &format!("k{i}"), 10 + i as u8))
        .collect();
    let captures: Vec<Capture> = (0..4).map(|_| Capture::new()).collect();
    eprintln!("clone: snapshot taken");
    let mut clones =
        Vm::clone_from(&s, 4, |i| captures[i].writer(), |i| slots[i].devices()).expect("clone ×4");
    eprintln!("clone: 4 clones running");
    assert_eq!(clones.len(), 4);
    let mut rng = Vec::new();
    let mut ips = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        eprintln!("clone {i}: connecting");
        let agent = slot.connect_logged(&mut clones[i], &captures[i]);
        eprintln!("clone {i}: connected");
        let mut entropy = vec![0u8; 64];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut entropy))
            .unwrap();
        let ip = format!("10.77.0.{}", 10 + i);
        agent
            .reidentify(
                &ReidentifyRequest {
                    hostname: format!("clone-{i}"),
                    interface: "eth0".into(),
                    mac: format!("06:00:00:00:01:{:02x}", i),
                    ipv4_cidr: format!("{ip}/24"),
                    entropy,
                    // A day ahead of the host, so that a clock that was
                    // not stepped cannot pass for one that was.
                    realtime_ns: (unix_now() + DAY) * 1_000_000_000,
                    ..Default::default()
                },
                CALL,
            )
            .expect("reidentify");
        let (_, bytes) = sh(
            &agent,
            "app",
            "rng",
            "head -c 16 /dev/urandom | od -An -tx1",
        );
        rng.push(bytes);
        let (_, addr) = sh(&agent, "app", "ip", "ip -4 -o addr show dev eth0");
        assert!(addr.contains(&format!("{ip}/24")), "clone {i}: {addr}");
        ips.push(addr);
        let (_, date) = sh(&agent, "app", "date", "date +%s");
        let host_now = unix_now() + DAY;
        let guest_now: u64 = date.parse().unwrap();
        assert!(
            guest_now.abs_diff(host_now) <= 30,
            "clone {i}'s clock was not stepped: {guest_now} vs {host_now}"
        );
        let (_, host) = sh(&agent, "app", "host", "cat /proc/sys/kernel/hostname");
        assert_eq!(host, format!("clone-{i}"));
        if i == 0 {
            assert_eq!(sh(&agent, "app", "w", "echo mine > /marker && sync").0, 0);
            // The clone's network works: it reaches the host end of its tap.
            for args in [
                vec!["addr", "add", "10.77.0.1/24", "dev", &slot.tap],
                vec!["link", "set", &slot.tap, "up"],
            ] {
                let st = std::process::Command::new("ip")
                    .args(&args)
                    .status()
                    .unwrap();
                assert!(st.success(), "ip {args:?}");
            }
            let (code, out, err) = agent
                .run(
                    "app",
                    "ping",
                    &["sh", "-c", "ping -c 1 -W 20 10.77.0.1"],
                    CALL,
                )
                .unwrap_or_else(|e| panic!("exec ping: {e}"));
            assert_eq!(
                code,
                0,
                "ping from clone 0 over its tap: {} / {}",
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&err)
            );
        } else {
            assert_eq!(
                sh(&agent, "app", "w", "test -e /marker").0,
                1,
                "clone {i} sees clone 0's file"
            );
        }
    }
    rng.sort();
    rng.dedup();
    assert_eq!(rng.len(), 4, "clones shared RNG output: {rng:?}");
    for (i, c) in clones.iter().enumerate() {
        assert!(
            c.state() == RunState::Running,
            "clone {i} stopped: {}\nguest console:\n{}",
            c.describe_devices().join("\n"),
            String::from_utf8_lossy(&captures[i].bytes())
        );
    }
}

#[test]
fn rollback_rewinds_files_and_processes_and_the_agent_answers() {
    let d = tmp();
    let slot = Slot::new(d.path(), "b", 5);
    let mut g = boot(&slot);
    create(&g, "app", &["sh", "-c", COUNTER]);
    let before = counter_past(&g.agent, 3, "a");
    g.vm.pause().unwrap();
    let s = snap(d.path(), "snap");
    take(&mut g.vm, &s, Kind::Full).unwrap();
    g.vm.resume().unwrap();

    // After the snapshot: files on the rootfs and in tmpfs, a new process.
    assert_eq!(
        sh(
            &g.agent,
            "app",
            "w",
            "echo later > /later && echo t > /tmp/later && sync"
        )
        .0,
        0
    );
    g.agent
        .exec_process(
            "app",
            "sleeper",
            &testkit::process(&["sleep", "1000"], json!({})),
            CALL,
        )
        .unwrap();
    let ran_on = counter_past(&g.agent, before + 30, "b");

    let info = g.vm.rollback(&s).unwrap();
    assert_eq!(g.vm.state(), RunState::Running);
    assert!(info.pages_restored > 0);
    let agent = slot.connect();
    agent.ping(CALL).expect("the agent answers after rollback");
    g.agent = agent;
    let now = counter(&g.agent, "c");
    assert!(
        now < ran_on,
        "counter {now} not rewound (snapshot at about {before}, reached {ran_on})"
    );
    assert_eq!(
        sh(&g.agent, "app", "r1", "test -e /later").0,
        1,
        "rootfs file"
    );
    assert_eq!(
        sh(&g.agent, "app", "r2", "test -e /tmp/later").0,
        1,
        "tmpfs file"
    );
    assert!(
        g.agent
            .wait_process("app", "sleeper", Duration::ZERO)
            .is_err(),
        "the process started after the snapshot is unknown again"
    );
}

/// Rewrites a 4 MiB tmpfs file of random bytes followed by their md5
/// (`md5sum`'s 36-byte line), then renames it over `/tmp/d`, and counts
/// the rewrites.
const WRITER: &str = "i=0; while true; do i=$((i+1)); head -c 4194304 /dev/urandom > /tmp/d.new; \
     s=$(md5sum < /tmp/d.new); echo \"$s\" >> /tmp/d.new; mv /tmp/d.new /tmp/d; \
     echo $i > /tmp/c.new && mv /tmp/c.new /tmp/counter; done";

/// Checks that `/tmp/d` holds bytes that match their md5 (on a copy: the
/// writer renames a new file over it meanwhile).
fn assert_data_whole(agent: &AgentClient, tag: &str) {
    let (code, out) = sh(
        agent,
        "app",
        tag,
        "cp /tmp/d /tmp/chk && test \"$(head -c 4194304 /tmp/chk | md5sum)\" = \"$(tail -c 36 /tmp/chk)\" && echo whole",
    );
    assert_eq!((code, out.as_str()), (0, "whole"), "{tag}: /tmp/d is torn");
}

#[test]
fn a_full_snapshot_of_a_running_pod_restores_and_rolls_back_exactly() {
    let d = tmp();
    let slot = Slot::new(d.path(), "w", 6);
    let mut g = boot(&slot);
    create(&g, "app", &["sh", "-c", WRITER]);
    let before = counter_past(&g.agent, 2, "a");
    assert_data_whole(&g.agent, "a0");
    // Taken while the guest writes: pre-copied.
    let s = snap(d.path(), "snap");
    let info = take(&mut g.vm, &s, Kind::Full).unwrap();
    eprintln!("full snapshot of the running pod: {info:?}");
    assert_eq!(g.vm.state(), RunState::Running);
    assert!(info.precopy_rounds >= 1, "{info:?}");
    twig_vmm::snapshot::verify(&s).unwrap();
    let after = counter(&g.agent, "b");

    // A VM restored from it holds one moment of the pod and goes on.
    let r = restored(&s, &Slot::new(d.path(), "wr", 7));
    let first = counter(&r.agent, "c");
    assert!(
        (before..=after + 1).contains(&first),
        "restored counter {first}: not from the snapshot (taken between {before} and {after})"
    );
    assert_data_whole(&r.agent, "d");
    let later = counter_past(&r.agent, first + 2, "e");
    assert_data_whole(&r.agent, &format!("f{later}"));

    // The source runs on, then rolls back to it, exactly.
    let ran_on = counter_past(&g.agent, after + 3, "g");
    let back = g.vm.rollback(&s).unwrap();
    eprintln!("rollback: {back:?}");
    g.agent = slot.connect();
    let now = counter(&g.agent, "h");
    assert!(
        now < ran_on,
        "counter {now} not rewound (snapshot at about {before}..{after}, reached {ran_on})"
    );
    assert_data_whole(&g.agent, "i");
    let later = counter_past(&g.agent, now + 2, "j");
    assert_data_whole(&g.agent, &format!("k{later}"));
}

#[test]
fn a_guest_that_stops_answering_fails_calls_within_their_deadline() {
    let d = tmp();
    let slot = Slot::new(d.path(), "h", 6);
    let mut g = boot(&slot);
    g.vm.pause().unwrap();
    let t = Instant::now();
    assert!(g.agent.ping(Duration::from_secs(2)).is_err());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    g.vm.resume().unwrap();
    let agent = slot.connect();
    agent.ping(CALL).unwrap();
}

#[test]
fn a_template_restores_to_a_ready_agent_without_booting() {
    let d = tmp();
    let slot = Slot::new(d.path(), "t", 7);
    let (mut vm, _serial) = start(&slot);
    // The kernel's boot id is drawn at every boot: VMs restored from the
    // template must share it.
    let boot_id = || {
        let agent = slot.connect();
        let args = ["cat", "/proc/sys/kernel/random/boot_id"];
        agent
            .create_container("id", "/dev/vda", false, &spec(&args, "id"), CALL)
            .unwrap();
        agent.start_container("id", CALL).unwrap();
        agent.read_to_end("id", "", Stream::Stdout, CALL).unwrap()
    };
    let booted = boot_id();
    assert_eq!(booted.len(), 37, "{booted:?}");
    // The readiness probe `twig-vmm template` uses: the guest accepts a
    // vsock connection on the agent's port.
    let t = snap(d.path(), "template");
    let (store, id) = store_of(&t);
    let staging = store.stage(&id).expect("stage the template");
    vm.template(staging.dir(), BOOT, || {
        twig_vmm::host_connect(&slot.uds, AGENT_PORT, Duration::from_secs(2)).is_ok()
    })
    .expect("template");
    staging.publish().expect("publish the template");
    assert_eq!(vm.state(), RunState::Paused);
    // The guest took kvmclock but not async page faults, which twig hides:
    // a task waiting on KVM's "page ready" would never wake in a restore.
    let msr = |index| vm.vcpu_msr(0, index).expect("read MSR");
    assert_ne!(msr(MSR_KVM_SYSTEM_TIME_NEW) & 1, 0, "kvmclock is off");
    assert_eq!(msr(MSR_KVM_ASYNC_PF_EN), 0, "async page faults are on");
    drop(vm);

    for name in ["u1", "u2"] {
        let r = restored(&t, &Slot::new(d.path(), name, 8));
        create(&r, "hi", &["cat", "/proc/sys/kernel/random/boot_id"]);
        let id = r.agent.read_to_end("hi", "", Stream::Stdout, CALL).unwrap();
        assert_eq!(id, booted, "the restored guest booted again");
    }
}

#[test]
fn a_rootfs_attached_to_a_vm_restored_from_a_template_runs_a_container() {
    let d = tmp();
    let with_slot = |s: &Slot| DeviceConfig {
        disk_slots: 1,
        ..s.devices()
    };
    let slot = Slot::new(d.path(), "v", 9);
    let (mut vm, _serial) = start_with(&slot, &with_slot(&slot));
    let t = snap(d.path(), "template");
    let (store, id) = store_of(&t);
    let staging = store.stage(&id).expect("stage the template");
    vm.template(staging.dir(), BOOT, || {
        twig_vmm::host_connect(&slot.uds, AGENT_PORT, Duration::from_secs(2)).is_ok()
    })
    .expect("template with an empty disk slot");
    staging.publish().expect("publish the template");
    drop(vm);

    // The pod's VM is restored (no boot); the container's rootfs is made
    // afterwards and attached to the slot, /dev/vdb.
    let pod = Slot::new(d.path(), "w", 9);
    let mut g = restored_with(&t, &pod, &with_slot(&pod));
    let ctr = d.path().join("ctr.ext4");
    testkit::busybox_rootfs(&ctr, 16, &[("marker", "attached-later")]).expect("rootfs");
    let disk = DiskConfig {
        path: ctr.clone(),
        read_only: false,
    };
    g.vm.attach_disk(0, &disk).expect("attach");
    // The guest re-reads the capacity in a work item after the interrupt:
    // until then the mount fails.
    let mut k = 0;
    let id = poll("the guest to mount the attached disk", BOOT, || {
        k += 1;
        let id = format!("ctr{k}");
        let spec = spec(&["cat", "/marker"], "ctr");
        g.agent
            .create_container(&id, "/dev/vdb", false, &spec, CALL)
            .ok()
            .map(|_| id)
    });
    g.agent.start_container(&id, CALL).expect("start");
    let out = g.agent.read_to_end(&id, "", Stream::Stdout, CALL).unwrap();
    assert_eq!(out, b"attached-later");
    let w = g.agent.wait_exit(&id, "", CALL).unwrap();
    assert_eq!((w.status, w.signal), (0, 0));
    assert_eq!(g.vm.state(), RunState::Running);
}

/// Guest RAM of the balloon tests: room for [`HOG_MIB`] beside the agent.
const BALLOON_MIB: usize = 256;
/// What the balloon tests' guest allocates and frees, MiB.
const HOG_MIB: usize = 128;
const MIB_KIB: usize = 1024;

/// Guest RAM private to the VM (the pod's own copies), KiB.
fn private_kib(vm: &mut Vm) -> usize {
    vm.stats().expect("VM stats").guest_private_kib
}

/// The pod's private memory in the balloon tests, KiB.
struct PodMemory {
    /// Just restored.
    idle: usize,
    /// With a 32 MiB tmpfs file written.
    before: usize,
    /// Holding [`HOG_MIB`] besides.
    holding: usize,
    /// After both were freed: with the balloon, the least seen over
    /// [`SETTLE`] once three quarters of the [`HOG_MIB`] came back.
    after: usize,
}

/// How long the balloon test keeps watching the pod's memory fall.
const SETTLE: Duration = Duration::from_secs(10);

/// A pod restored from a template (with or without the balloon) whose
/// guest writes a 32 MiB file, allocates [`HOG_MIB`] and frees both. With
/// the balloon, the pod's memory is polled until three quarters of it
/// came back; a rollback to a snapshot taken before the free then gives
/// back the freed file, intact.
fn allocate_and_free(balloon: bool) -> PodMemory {
    let d = tmp();
    let name = if balloon { "bal" } else { "nob" };
    let slot = Slot::new(d.path(), name, if balloon { 7 } else { 8 });
    let devices = DeviceConfig {
        balloon,
        ..slot.devices()
    };
    let (mut vm, serial) = start_sized(&slot, &devices, BALLOON_MIB);
    let agent = slot.connect_logged(&mut vm, &serial);
    let mut g = Guest { vm, agent };
    create(&g, "app", &["sleep", "999999"]);
    g.vm.pause().unwrap();
    let template = snap(d.path(), "template");
    take(&mut g.vm, &template, Kind::Full).unwrap();
    drop(g);

    let mut p = restored_sized(&template, &slot, &devices, BALLOON_MIB);
    assert_eq!(sh(&p.agent, "app", "idle", "true").0, 0);
    let idle = private_kib(&mut p.vm);
    // A file the guest frees after a snapshot: 32 MiB of tmpfs.
    let (code, sum) = sh(
        &p.agent,
        "app",
        "data",
        "head -c 33554432 /dev/urandom > /tmp/data && md5sum /tmp/data",
    );
    assert_eq!(code, 0, "{sum}");
    p.vm.pause().unwrap();
    let before_free = snap(d.path(), "before-free");
    take(&mut p.vm, &before_free, Kind::Incremental).unwrap();
    p.vm.resume().unwrap();
    let before = private_kib(&mut p.vm);

    // HOG_MIB held by dd (blocked on a pipe nobody reads), then freed.
    p.agent
        .exec_process(
            "app",
            "hog",
            &testkit::process(
                &[
                    "sh",
                    "-c",
                    &format!(
                        "dd if=/dev/zero bs={} count=1 | sleep 999999",
                        HOG_MIB << 20
                    ),
                ],
                json!({}),
            ),
            CALL,
        )
        .unwrap();
    let holding = poll("the guest to hold its allocation", BOOT, || {
        let now = private_kib(&mut p.vm);
        (now >= before + HOG_MIB * 15 / 16 * MIB_KIB).then_some(now)
    });
    let (code, out) = sh(
        &p.agent,
        "app",
        "free",
        "kill -9 $(pidof dd) && rm /tmp/data",
    );
    assert_eq!(code, 0, "{out}");
    let after = if balloon {
        let first = poll("the freed memory to leave the host", BOOT, || {
            let now = private_kib(&mut p.vm);
            (now + HOG_MIB * 3 / 4 * MIB_KIB <= holding).then_some(now)
        });
        // A measurement window, not a synchronisation: the least seen,
        // between calls into the guest (which leave its vCPU the CPU).
        let end = Instant::now() + SETTLE;
        let (mut least, mut k) = (first, 0);
        while Instant::now() < end {
            k += 1;
            assert_eq!(sh(&p.agent, "app", &format!("settle{k}"), "true").0, 0);
            least = least.min(private_kib(&mut p.vm));
        }
        least
    } else {
        // Nothing gives it back: the guest's free pages stay the pod's.
        assert_eq!(sh(&p.agent, "app", "settle", "sync").0, 0);
        private_kib(&mut p.vm)
    };
    eprintln!(
        "balloon {balloon}: pod private memory {} MiB restored, {} MiB with a 32 MiB file, \
         {} MiB holding {HOG_MIB} MiB more, {} MiB after freeing both",
        idle / MIB_KIB,
        before / MIB_KIB,
        holding / MIB_KIB,
        after / MIB_KIB
    );

    // The freed file comes back intact with a rollback to before the free.
    p.vm.rollback(&before_free).unwrap();
    let agent = slot.connect();
    let (code, again) = sh(&agent, "app", "check", "md5sum /tmp/data");
    assert_eq!((code, again), (0, sum), "the file after the rollback");
    PodMemory {
        idle,
        before,
        holding,
        after,
    }
}

#[test]
fn memory_a_restored_guest_frees_goes_back_to_the_host_with_the_balloon() {
    let m = allocate_and_free(true);
    assert!(m.holding >= m.before + HOG_MIB * 15 / 16 * MIB_KIB);
    assert!(m.after + HOG_MIB * 3 / 4 * MIB_KIB <= m.holding);
    assert!(m.idle <= m.before);
}

#[test]
fn memory_a_restored_guest_frees_stays_with_the_pod_without_the_balloon() {
    let m = allocate_and_free(false);
    assert!(m.holding >= m.before + HOG_MIB * 15 / 16 * MIB_KIB);
    assert!(
        m.after >= m.before + HOG_MIB * 25 / 32 * MIB_KIB,
        "without the balloon the memory stays: {} KiB after, {} before",
        m.after,
        m.before
    );
}
