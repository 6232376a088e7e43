//! Recovery and failure paths of a pod, through `ctr` as a user sees them:
//! a VMM (or, for runc, the container's init) killed under a running
//! container, a shim killed, containerd restarted, twig-node restarted, a
//! guest that stops answering, a shim killed while it restores the VM.
//! Each with twig's runtime and, where runc has the same situation, with
//! runc's as the reference. Each ends with a check that nothing stayed: no
//! VMM process (nor zombie), no shim, no state directory. Built with
//! `--features lab`; run in the nested lab.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use twig_e2e::must::{node, node_with};
use twig_e2e::{
    kill9, poll_until, proc_state, process_tree, signal, Background, Node, ProcState, Runtime,
    IMAGE_REF,
};

/// Deadline of a container's first output (a twig container restores a
/// VM first, and the lab is slow).
const OUTPUT: Duration = Duration::from_secs(120);
/// Deadline of an exit, a cleanup, a state change.
const EXIT: Duration = Duration::from_secs(90);
/// The shim's call deadline on the frozen guest's node, seconds.
const FROZEN_CALL_S: u64 = 20;
/// A process that prints `ready` and then waits.
const WAITS: &str = "echo ready; while :; do sleep 0.1; done";

/// `ctr task exec` of [`WAITS`] in `id`, in the background, once ready.
fn exec_attached(node: &Node, id: &str, exec_id: &str) -> Background {
    let mut bg = node
        .ctr_background(["task", "exec", "--exec-id", exec_id, id, "sh", "-c", WAITS])
        .unwrap_or_else(|e| panic!("starting ctr task exec {exec_id}: {e}"));
    bg.wait_for_stdout(OUTPUT, |o| o.lines().any(|l| l == "ready"))
        .unwrap_or_else(|e| panic!("exec {exec_id} did not print ready: {e}\n{}", node.logs()));
    bg
}

/// `ctr run -d` of [`WAITS`]; returns once `ctr task ls` says RUNNING.
fn run_detached(node: &Node, runtime: Runtime, id: &str) {
    node.must_ctr_ok(&[
        "run",
        "-d",
        "--runtime",
        runtime.name(),
        "--snapshotter",
        "twig",
        IMAGE_REF,
        id,
        "sh",
        "-c",
        WAITS,
    ]);
    expect_status(node, id, Some("RUNNING"));
}

/// Waits until the task's status is `want` (`None`: not listed).
fn expect_status(node: &Node, id: &str, want: Option<&str>) {
    let mut last = None;
    let ok = poll_until(EXIT, || {
        last = node.task_status(id);
        last.as_deref() == want
    });
    assert!(
        ok,
        "task {id}: status {last:?}, not {want:?} within {EXIT:?}\n{}",
        node.logs()
    );
}

/// The pid `ctr task ls` shows for the task.
fn task_pid(node: &Node, id: &str) -> i32 {
    let ls = node.must_ctr_ok(&["task", "ls"]);
    ls.lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.first() == Some(&id)).then(|| f.get(1)?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("no pid for {id} in ctr task ls:\n{ls}"))
}

/// The one VMM the node's shims own.
fn the_handed_vmm(node: &Node) -> i32 {
    let vmms = node.handed_vmms();
    assert_eq!(vmms.len(), 1, "handed-over VMMs: {vmms:?}\n{}", node.logs());
    vmms[0]
}

/// Deletes the task (if containerd still lists it) and the container.
fn delete(node: &Node, id: &str) {
    if node.task_status(id).is_some() {
        node.must_ctr_ok(&["task", "rm", id]);
    }
    node.must_ctr_ok(&["containers", "rm", id]);
    let left = node.must_ctr_ok(&["containers", "ls", "-q"]);
    assert!(!left.lines().any(|l| l == id), "{id} still listed: {left}");
}

/// Nothing of the twig pods stayed: `vmm` (if given) is gone — reaped,
/// not a zombie — and no shim state directory and no twig shim remain.
fn expect_no_twig_leftovers(node: &Node, vmm: Option<i32>) {
    if let Some(pid) = vmm {
        let mut state = ProcState::Alive;
        let gone = poll_until(EXIT, || {
            state = proc_state(pid);
            state == ProcState::Gone
        });
        assert!(
            gone,
            "the pod's twig-vmm {pid} is {state:?} after {EXIT:?}\n{}",
            node.logs()
        );
    }
    let clean = poll_until(EXIT, || {
        node.shim_state_dirs().is_empty() && node.shim_pids(Runtime::Twig.shim()).is_empty()
    });
    assert!(
        clean,
        "left behind: shim state dirs {:?}, twig shims {:?}\n{}",
        node.shim_state_dirs(),
        node.shim_pids(Runtime::Twig.shim()),
        node.logs()
    );
}

/// A container (its init and an exec) whose runtime dies under it: twig's
/// VMM, or runc's container init, SIGKILLed from outside. The exec exits
/// 137 at once, a TaskExit with 137 is published for both, the task is
/// STOPPED, delete works, nothing stays.
fn runtime_killed(runtime: Runtime, prefix: &str) {
    let node = node(runtime);
    let id = format!("{prefix}-killed");
    run_detached(&node, runtime, &id);
    let exec = exec_attached(&node, &id, "e1");
    let vmm = (runtime == Runtime::Twig).then(|| the_handed_vmm(&node));
    let victim = vmm.unwrap_or_else(|| task_pid(&node, &id));
    let events = node
        .ctr_background(["events"])
        .unwrap_or_else(|e| panic!("starting ctr events: {e}"));
    // ctr subscribes some time after it starts (a second in the lab): an
    // exec's events seen first say the subscription is up.
    let subscribed = poll_until(EXIT, || {
        node.must_ctr_ok(&["task", "exec", "--exec-id", "marker", &id, "true"]);
        events.stdout().contains("marker")
    });
    assert!(subscribed, "ctr events saw no event\n{}", node.logs());

    let killed = Instant::now();
    kill9(victim);
    node.expect_exit(exec, 137, "the exec's ctr task exec", EXIT);
    expect_status(&node, &id, Some("STOPPED"));
    eprintln!(
        "{}: kill -9 of {victim} to the exec's exit and the task STOPPED: {:.2?}",
        runtime.name(),
        killed.elapsed()
    );
    let exits = |events: &Background| {
        events
            .stdout()
            .lines()
            .filter(|l| l.contains("/tasks/exit") && l.contains("\"exit_status\":137"))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    let ok = poll_until(EXIT, || exits(&events).len() >= 2);
    assert!(
        ok,
        "not two TaskExit events with status 137: {}\n{}",
        events.stdout(),
        node.logs()
    );
    let found = exits(&events);
    assert!(
        found.iter().any(|l| l.contains("\"id\":\"e1\""))
            && found
                .iter()
                .any(|l| l.contains(&format!("\"id\":\"{id}\""))),
        "TaskExit events: {found:?}"
    );
    drop(events);
    delete(&node, &id);
    if runtime == Runtime::Twig {
        expect_no_twig_leftovers(&node, vmm);
        let log = node.containerd_log();
        assert!(
            log.contains("the pod's VM died") && log.contains(&format!("pid {victim}")),
            "the shim's log does not say why the pod ended\n{}",
            node.logs()
        );
        assert!(
            node.node_daemon_log().contains("a handed-over VMM exited"),
            "twig-node did not reap the VMM\n{}",
            node.logs()
        );
    }
}

#[test]
fn twig_vmm_killed_reports_every_task_exited_and_leaves_nothing() {
    runtime_killed(Runtime::Twig, "twig");
}

#[test]
fn runc_init_killed_reports_every_task_exited() {
    runtime_killed(Runtime::Runc, "runc");
}

/// `kill -9` of the shim under a running container: containerd runs the
/// shim's `delete`, which stops what the shim owned (twig: the VMM); the
/// container can be removed and a new one runs.
fn shim_killed(runtime: Runtime, prefix: &str) {
    let node = node(runtime);
    let id = format!("{prefix}-shimkill");
    run_detached(&node, runtime, &id);
    let shims = node.shim_pids(runtime.shim());
    assert_eq!(shims.len(), 1, "shims: {shims:?}\n{}", node.logs());
    let vmm = (runtime == Runtime::Twig).then(|| the_handed_vmm(&node));

    kill9(shims[0]);
    let ok = poll_until(EXIT, || node.task_status(&id).as_deref() != Some("RUNNING"));
    assert!(
        ok,
        "{id} still RUNNING after its shim died\n{}",
        node.logs()
    );
    delete(&node, &id);
    if runtime == Runtime::Twig {
        expect_no_twig_leftovers(&node, vmm);
    }
    let after = format!("{prefix}-after-shimkill");
    let out = node
        .run(runtime, &after, &["sh", "-c", "echo after"])
        .unwrap_or_else(|e| panic!("{e}\n{}", node.logs()));
    assert_eq!(
        (out.code(), out.stdout.trim()),
        (Some(0), "after"),
        "{out}\n{}",
        node.logs()
    );
}

#[test]
fn twig_shim_killed_its_vmm_is_stopped_by_delete() {
    shim_killed(Runtime::Twig, "twig");
}

#[test]
fn runc_shim_killed_delete_cleans_up() {
    shim_killed(Runtime::Runc, "runc");
}

/// containerd `kill -9`ed and started again under a running container:
/// it finds the shim again (the bundle's `address`), the task is RUNNING,
/// exec, kill and delete work.
fn containerd_restarted(runtime: Runtime, prefix: &str) {
    let mut node = node(runtime);
    let id = format!("{prefix}-cdrestart");
    run_detached(&node, runtime, &id);
    let shims = node.shim_pids(runtime.shim());
    let vmm = (runtime == Runtime::Twig).then(|| the_handed_vmm(&node));

    node.restart_containerd(1)
        .unwrap_or_else(|e| panic!("restarting containerd: {e}\n{}", node.logs()));
    expect_status(&node, &id, Some("RUNNING"));
    assert_eq!(node.shim_pids(runtime.shim()), shims, "the shim changed");
    let out = node.must_ctr(&[
        "task",
        "exec",
        "--exec-id",
        "after",
        &id,
        "sh",
        "-c",
        "echo exec after restart; exit 4",
    ]);
    assert_eq!(
        (out.code(), out.stdout.trim()),
        (Some(4), "exec after restart"),
        "{out}\n{}",
        node.logs()
    );
    node.must_ctr_ok(&["task", "kill", "-s", "KILL", &id]);
    expect_status(&node, &id, Some("STOPPED"));
    delete(&node, &id);
    if runtime == Runtime::Twig {
        expect_no_twig_leftovers(&node, vmm);
    }
}

#[test]
fn twig_containerd_restarted_finds_the_shim_again() {
    containerd_restarted(Runtime::Twig, "twig");
}

#[test]
fn runc_containerd_restarted_finds_the_shim_again() {
    containerd_restarted(Runtime::Runc, "runc");
}

/// twig-node `kill -9`ed and started again under a running pod: the pod's
/// VMM runs on (handed over), the new daemon hands a VM to a new pod, and
/// the old pod's VMM still ends and is reaped when its container goes.
#[test]
fn twig_node_restarted_keeps_the_pod_and_serves_new_ones() {
    let mut node = node(Runtime::Twig);
    run_detached(&node, Runtime::Twig, "old");
    let vmm = the_handed_vmm(&node);

    node.restart_node_daemon(1)
        .unwrap_or_else(|e| panic!("restarting twig-node: {e}\n{}", node.logs()));
    assert_eq!(proc_state(vmm), ProcState::Alive, "the handed VMM died");
    expect_status(&node, "old", Some("RUNNING"));
    let out = node.must_ctr(&[
        "task",
        "exec",
        "--exec-id",
        "e1",
        "old",
        "sh",
        "-c",
        "echo still; exit 4",
    ]);
    assert_eq!(
        (out.code(), out.stdout.trim()),
        (Some(4), "still"),
        "{out}\n{}",
        node.logs()
    );
    let out = node
        .run(Runtime::Twig, "new", &["sh", "-c", "echo new pod"])
        .unwrap_or_else(|e| panic!("{e}\n{}", node.logs()));
    assert_eq!(
        (out.code(), out.stdout.trim()),
        (Some(0), "new pod"),
        "{out}\n{}",
        node.logs()
    );

    node.must_ctr_ok(&["task", "kill", "-s", "KILL", "old"]);
    expect_status(&node, "old", Some("STOPPED"));
    delete(&node, "old");
    expect_no_twig_leftovers(&node, Some(vmm));
}

/// A guest that stops answering (its VMM SIGSTOPped): a call fails with a
/// deadline naming the agent; `kill -s KILL` still ends the pod (the shim
/// kills the VMM) and delete leaves nothing. The shim's calls get
/// [`FROZEN_CALL_S`], not the lab's long default: each call into the
/// frozen guest waits that long, and the test makes three (the exec's
/// create and start, the kill).
#[test]
fn twig_guest_that_stops_answering_times_out_and_kill_ends_the_pod() {
    let node = node_with(Runtime::Twig, |c| c.shim_call_s = FROZEN_CALL_S);
    run_detached(&node, Runtime::Twig, "frozen");
    let vmm = the_handed_vmm(&node);
    // The VMM and, jailed in its own PID namespace, the VMM inside below
    // the pid the shim owns: stop them all.
    let tree = process_tree(vmm);
    for pid in tree.iter().rev() {
        signal(*pid, Signal::SIGSTOP).unwrap_or_else(|e| panic!("{e}"));
    }
    eprintln!("stopped the VMM's processes {tree:?}");

    let started = Instant::now();
    let out = node.must_ctr(&[
        "task",
        "exec",
        "--exec-id",
        "probe",
        "frozen",
        "echo",
        "answered",
    ]);
    assert!(!out.status.success(), "exec in a frozen guest: {out}");
    assert!(
        out.stderr.contains("twig-agent") && out.stderr.contains("no reply within"),
        "the error does not say the agent did not answer: {out}"
    );
    eprintln!(
        "exec in a frozen guest failed after {:.2?}: {}",
        started.elapsed(),
        out.stderr.trim()
    );

    node.must_ctr_ok(&["task", "kill", "-s", "KILL", "frozen"]);
    expect_status(&node, "frozen", Some("STOPPED"));
    delete(&node, "frozen");
    expect_no_twig_leftovers(&node, Some(vmm));
}

/// `kill -9` of the shim while it restores the pod's VM (its VMM acquired,
/// recorded, not yet answering for the agent): `ctr run` fails, and once
/// containerd cleaned up (the shim's `delete`) no VMM and no state stay; a
/// new container runs.
#[test]
fn twig_shim_killed_during_the_restore_leaves_nothing() {
    let node = node(Runtime::Twig);
    let run = node
        .ctr_background([
            "run",
            "--rm",
            "--runtime",
            Runtime::Twig.name(),
            "--snapshotter",
            "twig",
            IMAGE_REF,
            "midway",
            "sh",
            "-c",
            "echo ready",
        ])
        .unwrap_or_else(|e| panic!("starting ctr run: {e}"));
    let mut vmm = None;
    let recorded = poll_until(OUTPUT, || {
        vmm = node.handed_vmms().first().copied();
        vmm.is_some()
    });
    assert!(recorded, "no VMM recorded by the shim\n{}", node.logs());
    let shims = node.shim_pids(Runtime::Twig.shim());
    assert_eq!(shims.len(), 1, "shims: {shims:?}");
    kill9(shims[0]);

    let out = run
        .wait(EXIT)
        .unwrap_or_else(|e| panic!("ctr run did not end: {e}\n{}", node.logs()));
    eprintln!("ctr run whose shim was killed mid-restore: {out}");
    assert!(
        !out.stdout.contains("ready"),
        "the container ran although its shim died: {out}"
    );
    expect_no_twig_leftovers(&node, vmm);
    if node
        .must_ctr_ok(&["containers", "ls", "-q"])
        .lines()
        .any(|l| l == "midway")
    {
        delete(&node, "midway");
    }
    let out = node
        .run(Runtime::Twig, "after", &["sh", "-c", "echo after"])
        .unwrap_or_else(|e| panic!("{e}\n{}", node.logs()));
    assert_eq!(
        (out.code(), out.stdout.trim()),
        (Some(0), "after"),
        "{out}\n{}",
        node.logs()
    );
}
