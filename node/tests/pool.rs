//! The warm pool with real `twig-vmm serve` processes on this host's
//! /dev/kvm: filled at start, a VMM handed over and restored into by the
//! test as a shim would, refilled, a pooled VMM killed with SIGKILL and
//! replaced, the empty pool spawning on demand, and every exited VMM reaped
//! (no zombie) with its directory removed.

mod common;

use std::path::Path;

use common::*;
use twig_proto::node::AcquireVmRequest;
use twig_vmm::api::Client;
use twig_vmm::RunState;

/// Restores the handed-over VMM's template through its API, as the shim
/// does, and waits until the guest runs.
fn restore(api_socket: &str, template_dir: &str) -> Client {
    let mut api = Client::connect(Path::new(api_socket), T).expect("connect to the handed VMM");
    api.restore(Path::new(template_dir), T)
        .expect("restore the template");
    wait_until("the restored guest runs", T, || {
        let s = api.stats(T).expect("stats");
        s.exits > 0 && s.state == RunState::Running
    });
    let net = api.stats(T).expect("stats").net;
    assert!(
        net.as_ref().is_some_and(|n| n.tap.is_none()),
        "a pooled VM has a network device, detached until the shim sends a tap: {net:?}"
    );
    api
}

#[test]
fn the_pool_fills_hands_over_and_refills() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let node = Node::start(dir.path(), &config(dir.path(), 2));
    wait_until("the pool holds 2 VMMs", T, || node.pooled().len() == 2);
    let before = node.pooled();
    node.check_pooled(&before);
    let status = node.status();
    assert_eq!(status.pool[0].target, 2);
    assert_eq!(
        (
            status.pool[0].memory_mib,
            status.pool[0].vcpus,
            status.pool[0].disk_slots
        ),
        (MIB, 1, SLOTS)
    );
    assert!(status.handed_pids.is_empty());

    let vm = node.acquire("tiny").expect("AcquireVm");
    assert!(vm.pooled, "{vm:?}");
    assert!(before.contains(&vm.pid), "{vm:?} not one of {before:?}");
    assert_eq!((vm.memory_mib, vm.vcpus, vm.disk_slots), (MIB, 1, SLOTS));
    assert!(vm.template_dir.ends_with("/snapshots/tiny"), "{vm:?}");
    assert!(Path::new(&vm.state_dir).join("handed").exists());
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", vm.pid)).unwrap();
    assert!(String::from_utf8_lossy(&cmdline).contains(&vm.api_socket));
    assert_eq!(node.status().handed_pids, vec![vm.pid]);

    // The pool refills behind the taken one.
    wait_until("the pool is back to 2 VMMs", T, || {
        let now = node.pooled();
        now.len() == 2 && !now.contains(&vm.pid)
    });

    // The caller owns the VMM: it restores into it and stops it; the
    // daemon reaps it and removes its directory.
    let mut api = restore(&vm.api_socket, &vm.template_dir);
    api.shutdown(T).expect("shutdown");
    wait_until("the stopped VMM is reaped", T, || gone(vm.pid));
    wait_until("its directory is removed", T, || {
        !Path::new(&vm.state_dir).exists()
    });
    assert!(node.status().handed_pids.is_empty());
    node.check_pooled(&node.pooled());
}

#[test]
fn a_killed_pooled_vmm_is_reaped_and_replaced() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let node = Node::start(dir.path(), &config(dir.path(), 2));
    wait_until("the pool holds 2 VMMs", T, || node.pooled().len() == 2);
    let victim = node.pooled()[0];
    sigkill(victim);
    wait_until("the killed VMM is reaped", T, || gone(victim));
    wait_until("the pool is back to 2 live VMMs", T, || {
        let now = node.pooled();
        now.len() == 2 && !now.contains(&victim)
    });
    assert!(
        node.log().contains("a pooled VMM exited; refilling"),
        "{}",
        node.log()
    );
    // What is handed over now is one of the live ones.
    let vm = node.acquire("tiny").expect("AcquireVm");
    assert_ne!(vm.pid, victim);
    restore(&vm.api_socket, &vm.template_dir);
    // The test is its owner: a handed-over VMM outlives the daemon.
    sigkill(vm.pid);
    wait_until("the handed VMM is reaped", T, || gone(vm.pid));
}

#[test]
fn an_empty_pool_spawns_on_demand_and_a_killed_handed_vmm_leaves_no_zombie() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let node = Node::start(dir.path(), &config(dir.path(), 0));
    let vm = node.acquire("tiny").expect("AcquireVm");
    assert!(!vm.pooled, "{vm:?}");
    let api = restore(&vm.api_socket, &vm.template_dir);
    drop(api);
    assert!(node.pooled().is_empty(), "a pool of size 0 keeps nothing");
    // A shim that kills its VMM (SIGKILL) leaves no zombie behind.
    sigkill(vm.pid);
    wait_until("the killed handed VMM is reaped", T, || gone(vm.pid));
    wait_until("its directory is removed", T, || {
        !Path::new(&vm.state_dir).exists()
    });
}

#[test]
fn bad_requests_hand_over_nothing() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let node = Node::start(dir.path(), &config(dir.path(), 1));
    wait_until("the pool holds 1 VMM", T, || node.pooled().len() == 1);
    let pooled = node.pooled();

    let e = node
        .acquire_req(AcquireVmRequest {
            template: "tiny".into(),
            memory_mib: 128,
            ..Default::default()
        })
        .unwrap_err();
    let (code, msg) = status(e);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{msg}");
    assert!(
        msg.contains("memory_mib 128") && msg.contains("tiny"),
        "{msg}"
    );

    let (code, msg) = status(node.acquire("../etc").unwrap_err());
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{msg}");

    let (code, msg) = status(node.acquire("missing").unwrap_err());
    assert_eq!(code, ttrpc::Code::NOT_FOUND, "{msg}");
    assert!(
        msg.contains("\"missing\"") && msg.contains("EnsureTemplate"),
        "{msg}"
    );

    // The base template cannot be made without its kernel.
    let (code, msg) = status(node.acquire("").unwrap_err());
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    assert!(msg.contains("no-kernel"), "{msg}");

    // Nothing was handed over: the pool still holds the same VMM.
    assert_eq!(node.pooled(), pooled);
}

#[test]
fn a_request_whose_deadline_passes_while_spawning_leaves_no_vmm() {
    use std::os::unix::fs::PermissionsExt;

    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    // A twig-vmm that takes a second to start: the request's deadline
    // passes while the daemon waits for it to answer.
    let slow = dir.path().join("slow-vmm");
    std::fs::write(
        &slow,
        format!(
            "#!/bin/sh\nsleep 1\nexec {} \"$@\"\n",
            vmm_binary().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&slow, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut c = config(dir.path(), 0);
    c["vmm_binary"] = serde_json::json!(slow);
    let node = Node::start(dir.path(), &c);
    let req = AcquireVmRequest {
        template: "tiny".into(),
        ..Default::default()
    };
    let e = node
        .pool
        .acquire_vm(ttrpc::context::with_timeout(300_000_000), &req)
        .unwrap_err();
    assert!(
        matches!(&e, ttrpc::Error::RpcStatus(s) if s.code() == ttrpc::Code::DEADLINE_EXCEEDED)
            || matches!(&e, ttrpc::Error::Others(m) if m.contains("timed out")),
        "{e:?}"
    );
    // Killed when the request was dropped, then reaped and its directory
    // removed (the directory goes only once the process is reaped);
    // without that it would serve, unowned, a second after its start.
    wait_until("the VMM started for it is gone", T, || {
        std::fs::read_dir(dir.path().join("run/vms"))
            .unwrap()
            .count()
            == 0
    });
    assert!(node.status().handed_pids.is_empty());
}

/// Whether `pid` no longer runs (gone, or a zombie waiting for a parent
/// other than the test to reap it).
fn not_running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}

#[test]
fn a_stop_kills_the_pool_but_not_handed_vms_and_a_restart_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let c = config(dir.path(), 1);
    let mut node = Node::start(dir.path(), &c);
    let vm = node.acquire("tiny").expect("AcquireVm");
    wait_until("the pool refills", T, || node.pooled().len() == 1);
    let pooled = node.pooled()[0];

    // SAFETY: kill(2) on the test's own child.
    unsafe { libc::kill(node.child.id() as i32, libc::SIGTERM) };
    let started = std::time::Instant::now();
    let status = node.child.wait().unwrap();
    assert!(status.success(), "{status}: {}", node.log());
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "a prompt stop"
    );
    assert!(
        !dir.path().join("node.sock").exists(),
        "the socket is removed"
    );
    wait_until("the pooled VMM is killed", T, || not_running(pooled));
    assert!(
        !not_running(vm.pid),
        "the handed-over VMM runs on (its shim owns it)"
    );
    drop(node);

    // A new daemon on the same directories leaves the handed-over VMM and
    // its directory alone.
    let node = Node::start(dir.path(), &c);
    wait_until("the new pool fills", T, || node.pooled().len() == 1);
    assert!(!not_running(vm.pid));
    assert!(Path::new(&vm.state_dir).join("handed").exists());
    restore(&vm.api_socket, &vm.template_dir);
    sigkill(vm.pid);
    // Not its child, but watched: its directory is removed once it exited.
    wait_until("the handed VMM's directory is removed", T, || {
        !Path::new(&vm.state_dir).exists()
    });
}

/// A child that stands for a shim owning a VMM.
fn owner() -> std::process::Child {
    std::process::Command::new("sleep")
        .arg("1000")
        .spawn()
        .expect("spawning sleep")
}

#[test]
fn a_vmm_dies_with_its_owner_and_an_owner_that_does_not_run_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let node = Node::start(dir.path(), &config(dir.path(), 1));
    let mut shim = owner();
    let vm = node
        .acquire_req(AcquireVmRequest {
            template: "tiny".into(),
            sandbox_id: "owned".into(),
            owner_pid: shim.id(),
            ..Default::default()
        })
        .expect("AcquireVm");
    restore(&vm.api_socket, &vm.template_dir);
    let handed = std::fs::read_to_string(Path::new(&vm.state_dir).join("handed")).unwrap();
    assert!(
        handed.starts_with(&format!("{} ", shim.id())),
        "the owner is recorded: {handed:?}"
    );
    assert!(!not_running(vm.pid));
    // The shim dies (before it recorded the VM anywhere): the VM goes too.
    shim.kill().unwrap();
    shim.wait().unwrap();
    wait_until("the owner's VMM is killed and reaped", T, || gone(vm.pid));
    wait_until("the daemon no longer lists the owner's VMM", T, || {
        node.status().handed_pids.is_empty()
    });

    // An owner that does not run is refused, and nothing is handed over.
    let mut dead = owner();
    let pid = dead.id();
    dead.kill().unwrap();
    dead.wait().unwrap();
    let before = node.status().handed_pids;
    let err = node
        .acquire_req(AcquireVmRequest {
            template: "tiny".into(),
            sandbox_id: "orphan".into(),
            owner_pid: pid,
            ..Default::default()
        })
        .expect_err("a dead owner");
    assert!(
        format!("{err:?}").contains(&format!("owner_pid {pid}")),
        "{err:?}"
    );
    assert_eq!(node.status().handed_pids, before);
}

#[test]
fn a_restarted_daemon_kills_a_vmm_whose_owner_died_while_it_was_down() {
    let dir = tempfile::tempdir().unwrap();
    make_template(dir.path(), "tiny");
    let c = config(dir.path(), 0);
    let mut node = Node::start(dir.path(), &c);
    let mut shim = owner();
    let mut survivor = owner();
    let acquire = |node: &Node, pid: u32| {
        node.acquire_req(AcquireVmRequest {
            template: "tiny".into(),
            sandbox_id: format!("owned-{pid}"),
            owner_pid: pid,
            ..Default::default()
        })
        .expect("AcquireVm")
    };
    let orphaned = acquire(&node, shim.id());
    let kept = acquire(&node, survivor.id());
    // SAFETY: kill(2) on the test's own child.
    unsafe { libc::kill(node.child.id() as i32, libc::SIGTERM) };
    assert!(node.child.wait().unwrap().success(), "{}", node.log());
    drop(node);
    shim.kill().unwrap();
    shim.wait().unwrap();
    assert!(
        !not_running(orphaned.pid),
        "nobody watched it while the daemon was down"
    );

    let node = Node::start(dir.path(), &c);
    wait_until("the orphaned VMM is killed", T, || {
        not_running(orphaned.pid)
    });
    assert!(
        !not_running(kept.pid),
        "a VMM whose owner runs is left alone"
    );
    // And its owner is watched again.
    survivor.kill().unwrap();
    survivor.wait().unwrap();
    wait_until("the second VMM dies with its owner", T, || {
        not_running(kept.pid)
    });
    drop(node);
}
