//! A container's memory limit and CPU quota, as containerd passes them in
//! the OCI spec (`ctr run --memory-limit`, `--cpus`): enforced inside the
//! microVM by the guest's cgroup, an OOM kill reported as containerd's
//! `/tasks/oom` event (what CRI turns into the reason `OOMKilled`), a busy
//! loop held to its quota — with twig's runtime and,
//! as the reference, with runc's. Built with `--features lab` and run in
//! the nested lab by `tests/lab/run.sh -p twig-e2e --features twig-e2e/lab`.

use std::time::Duration;

use twig_e2e::must::node;
use twig_e2e::{Node, Runtime};

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
