//! A container's memory limit and CPU quota, as containerd passes them in
//! the OCI spec (`ctr run --memory-limit`, `--cpus`): enforced inside the
//! microVM by the guest's cgroup, an OOM kill reported as containerd's
//! `/tasks/oom` event (what CRI turns into the reason `OOMKilled`), a busy
//! loop held to its quota — with twig's runtime and,
//! as the reference, with runc's; and a twig pod's VM charged to its pod's
//! cgroup on the host and bounded by its limit, through CRI. Built with
//! `--features lab` and run in the nested lab by `tests/lab/run.sh -p
//! twig-e2e --features twig-e2e/lab`.

use std::time::Duration;

use twig_cri::container_config;
use twig_e2e::cgroup::PodCgroup;
use twig_e2e::cri::CriNode;
use twig_e2e::crilab::{runtime, wait_exited};
use twig_e2e::must::node;
use twig_e2e::{Node, Runtime, IMAGE_REF};

/// Deadline of the OOM event after the container's exit.
const EVENT: Duration = Duration::from_secs(60);

/// A subshell that doubles a string `doublings` times (for ever: `None`),
/// touching its memory from user space, then says how the subshell ended.
/// (An allocation the kernel touches for a syscall, such as `dd`'s read
/// buffer, fails with an error under a memory limit instead of being
/// OOM-killed: only user-space faults invoke a cgroup's OOM killer.)
fn script(doublings: Option<u32>) -> String {
    let cond = match doublings {
        Some(n) => format!("[ $i -lt {n} ]"),
        None => ":".to_string(),
    };
    format!(
        "echo start; ( x=a; i=0; while {cond}; do x=$x$x; i=$((i+1)); done ); echo sub $?; exit 3"
    )
}

/// `ctr run` of `script` with `flags`; it must exit 3. Its stdout.
fn run(node: &Node, runtime: Runtime, id: &str, flags: &[&str], script: &str) -> String {
    let out = node
        .run_with(runtime, id, flags, &["sh", "-c", script])
        .unwrap_or_else(|e| panic!("ctr run {id}: {e}\n{}", node.logs()));
    assert_eq!(out.code(), Some(3), "ctr run {id}: {out}\n{}", node.logs());
    out.stdout
}

fn memory_limit(runtime: Runtime, prefix: &str) {
    let node = node(runtime);
    let limit = (64u64 << 20).to_string();
    let flags = ["--memory-limit", limit.as_str()];
    let mut events = node
        .ctr_background(["events"])
        .unwrap_or_else(|e| panic!("ctr events: {e}"));

    // Under the limit: the allocation succeeds.
    let small = format!("{prefix}-mem-small");
    let out = run(&node, runtime, &small, &flags, &script(Some(22)));
    assert!(
        out.lines().any(|l| l == "sub 0"),
        "4 MiB under a 64 MiB limit: {out:?}"
    );

    // Over it: the kernel's OOM killer ends the subshell (137), the shell
    // goes on, and containerd hears of the OOM kill.
    let big = format!("{prefix}-mem-big");
    let out = run(&node, runtime, &big, &flags, &script(None));
    assert!(
        out.lines().any(|l| l == "sub 137"),
        "unbounded growth under a 64 MiB limit was not OOM-killed: {out:?}\n{}",
        node.logs()
    );
    events
        .wait_for_stdout(EVENT, |o| {
            o.lines()
                .any(|l| l.contains("/tasks/oom") && l.contains(&big))
        })
        .unwrap_or_else(|e| panic!("no /tasks/oom event for {big}: {e}\n{}", node.logs()));
    assert!(
        !events
            .stdout()
            .lines()
            .any(|l| l.contains("/tasks/oom") && l.contains(&small)),
        "an OOM event for the container under its limit: {}",
        events.stdout()
    );
}

#[test]
fn twig_enforces_a_memory_limit_and_reports_the_oom_kill() {
    memory_limit(Runtime::Twig, "twig");
}

#[test]
fn runc_enforces_a_memory_limit_and_reports_the_oom_kill() {
    memory_limit(Runtime::Runc, "runc");
}

/// A busy loop in the background for 3 s of the container's clock, then
/// the CPU time it got, in clock ticks (100 per second).
const BUSY: &str = "( while :; do :; done ) & p=$!; sleep 3; set -- $(cat /proc/$p/stat); \
     kill $p; echo ticks $((${14} + ${15})); exit 3";

fn ticks(out: &str) -> u64 {
    out.lines()
        .find_map(|l| l.strip_prefix("ticks "))
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or_else(|| panic!("no CPU ticks in {out:?}"))
}

fn cpu_quota(runtime: Runtime, prefix: &str) {
    let node = node(runtime);
    let free = ticks(&run(
        &node,
        runtime,
        &format!("{prefix}-cpu-free"),
        &[],
        BUSY,
    ));
    let bound = ticks(&run(
        &node,
        runtime,
        &format!("{prefix}-cpu-bound"),
        &["--cpus", "0.2"],
        BUSY,
    ));
    // 20% of 3 s is 60 ticks; allow for the loop's start and the clock's
    // granularity, and require the quota to be what made the difference.
    assert!(
        bound <= 100,
        "a 0.2 CPU quota let a busy loop use {bound} ticks in 3 s (unbounded: {free})"
    );
    assert!(
        free >= 2 * bound,
        "the unbounded loop got {free} ticks, the bounded one {bound}: the quota made no difference"
    );
}

#[test]
fn twig_bounds_a_busy_loop_by_its_cpu_quota() {
    cpu_quota(Runtime::Twig, "twig");
}

#[test]
fn runc_bounds_a_busy_loop_by_its_cpu_quota() {
    cpu_quota(Runtime::Runc, "runc");
}

/// The pod's memory limit on the host: half the lab's 128 MiB guest.
const POD_LIMIT: u64 = 64 << 20;
/// What the first container holds in the guest (a 16 MiB string).
const HELD: u64 = 16 << 20;

/// The cgroup v2 path of `pid` (`/proc/<pid>/cgroup`'s `0::` line).
fn cgroup_of(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_string))
}

/// A twig pod under a host memory limit of half its guest's RAM: its VMM
/// runs in the sandbox's cgroup below the pod cgroup (CRI's
/// `cgroup_parent`/<sandbox id>), the memory the guest touches is charged
/// there, and when the guest touches more than the pod's limit the host's
/// OOM killer ends the VM (every container 137) — the pod never holds more
/// than its limit on the host.
#[test]
fn a_pod_whose_memory_limit_is_exceeded_by_its_vm_is_bounded_by_its_pod_cgroup_on_the_host() {
    runtime().block_on(pod_cgroup_bounds_the_vm());
}

async fn pod_cgroup_bounds_the_vm() {
    let node = CriNode::start().unwrap_or_else(|e| panic!("CRI node: {e}"));
    let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
    let fail = |what: &str, e: twig_cri::Error| -> ! { panic!("{}", node.cri_error(what, e)) };
    let top = format!("twig-e2e-{}", std::process::id());
    let cgroup = PodCgroup::new(&top, "bounded", Some(POD_LIMIT)).unwrap_or_else(|e| panic!("{e}"));
    let mut pod = node.pod_config("bounded").unwrap_or_else(|e| panic!("{e}"));
    pod.linux.get_or_insert_with(Default::default).cgroup_parent = cgroup.parent.clone();
    let pod_id = cri
        .run_pod_sandbox(&pod, "twig")
        .await
        .unwrap_or_else(|e| fail("RunPodSandbox", e));

    let sandbox = format!("{}/{pod_id}", cgroup.parent);
    let vmms = node.pod_vmms();
    assert_eq!(vmms.len(), 1, "one pod, one VMM: {vmms:?}");
    let vmm = vmms[0];
    let tree = twig_e2e::process_tree(vmm as i32);
    assert!(
        tree.len() >= 2,
        "twig-vmm and its PID namespace's init: {tree:?}"
    );
    for p in &tree {
        assert_eq!(
            cgroup_of(*p as u32).as_deref(),
            Some(sandbox.as_str()),
            "pid {p} of the pod's twig-vmm (pid {vmm}) is not in the sandbox's cgroup"
        );
    }

    // The guest touches 16 MiB: the pod's cgroup is charged for it.
    let hold = container_config(
        "hold",
        IMAGE_REF,
        &[
            "/bin/sh",
            "-c",
            "x=a; i=0; while [ $i -lt 24 ]; do x=$x$x; i=$((i+1)); done; echo held; sleep 1000",
        ],
        "hold.log",
    );
    let id = cri
        .create_container(&pod_id, &hold, &pod)
        .await
        .unwrap_or_else(|e| fail("CreateContainer hold", e));
    cri.start_container(&id)
        .await
        .unwrap_or_else(|e| fail("StartContainer hold", e));
    twig_cri::logs::wait_for(
        &CriNode::container_log(&pod, "hold.log"),
        Duration::from_secs(120),
        |lines| lines.iter().any(|l| l.text == "held"),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", node.node().logs()));
    let current = cgroup
        .number("memory.current", None)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        current >= HELD,
        "the pod's cgroup holds {current} bytes, less than the {HELD} its guest touched"
    );

    // Unbounded growth in the guest (no container limit; the guest has
    // twice the pod's limit): the host's OOM killer ends the VM.
    let hog = container_config(
        "hog",
        IMAGE_REF,
        &["/bin/sh", "-c", "echo start; x=a; while :; do x=$x$x; done"],
        "hog.log",
    );
    let hog_id = cri
        .create_container(&pod_id, &hog, &pod)
        .await
        .unwrap_or_else(|e| fail("CreateContainer hog", e));
    cri.start_container(&hog_id)
        .await
        .unwrap_or_else(|e| fail("StartContainer hog", e));
    let status = wait_exited(&node, &cri, &hog_id, Duration::from_secs(180)).await;
    assert_eq!(status.exit_code, 137, "{status:?}\n{}", node.node().logs());
    let kills = cgroup
        .number("memory.events", Some("oom_kill"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        kills >= 1,
        "the pod's cgroup saw no OOM kill: the guest, not the host, ended the hog"
    );
    // memory.peak: Linux 5.19 on.
    if cgroup.dir.join("memory.peak").exists() {
        let peak = cgroup
            .number("memory.peak", None)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            peak <= POD_LIMIT,
            "the pod held {peak} bytes, over its limit"
        );
    }
    // The sandbox's cgroup is empty, or gone with the VM the OOM kill
    // ended.
    match std::fs::read_to_string(cgroup.dir.join(&pod_id).join("cgroup.procs")) {
        Ok(left) => assert!(
            left.trim().is_empty(),
            "the pod's twig-vmm (pid {vmm}) outlived the OOM kill: {left}"
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("the sandbox's cgroup: {e}"),
    }
    cri.stop_pod_sandbox(&pod_id)
        .await
        .unwrap_or_else(|e| fail("StopPodSandbox", e));
    cri.remove_pod_sandbox(&pod_id)
        .await
        .unwrap_or_else(|e| fail("RemovePodSandbox", e));
    // The sandbox's cgroup went with its VM, as runc's container's goes:
    // kubelet can remove the pod's.
    let leaf = cgroup.dir.join(&pod_id);
    assert!(!leaf.exists(), "{} outlived the pod's VM", leaf.display());
}
