//! The Task service through `ctr`, as a user drives it: `ctr task exec`,
//! `kill` (exit statuses as runc's shim reports them), `pause`/`resume`,
//! `metrics`, and TTY and non-TTY processes — each with twig's runtime (the
//! container in a microVM) and, as the reference the twig shim must match,
//! with runc's. Built with `--features lab` and run inside the nested lab by
//! `tests/lab/run.sh -p twig-e2e --features twig-e2e/lab`.

use std::time::{Duration, Instant};

use twig_e2e::must::node;
use twig_e2e::{Background, Node, Runtime, IMAGE_REF};

/// Deadline of a container's first output, and of a resumed one's progress:
/// a twig container restores a VM first, and the lab is slow.
const OUTPUT: Duration = Duration::from_secs(120);
/// Deadline of a signalled process's exit.
const EXIT: Duration = Duration::from_secs(60);
/// How long a paused container's output must stay still: the counter below
/// advances every 50 ms when it runs.
const STILL: Duration = Duration::from_secs(2);
/// Polling interval of the test's own waits.
const POLL: Duration = Duration::from_millis(50);

/// A container that prints `ready` and then waits; `USR1` makes it print
/// `got USR1` and exit 42.
const TRAPS_USR1: &str =
    "trap 'echo got USR1; exit 42' USR1; echo ready; while :; do sleep 0.1; done";
/// A process that prints `ready` and then waits, trapping nothing.
const WAITS: &str = "echo ready; while :; do sleep 0.1; done";
/// A TTY process: says whether stdin and stdout are terminals, waits (at
/// most 30 s) until its terminal has the size of ctr's (ctr resizes it
/// after the start, through ResizePty), prints that size and `end`, exits
/// 7. (With runc, the last line of a TTY process that exits at once was
/// seen lost on the host: runc's shim does not drain a console before
/// reporting the exit; twig's does, so only twig's run must show `end`.)
const TTY_SIZE: &str = "[ -t 0 ] && [ -t 1 ] && echo on a tty; echo name $(tty); i=0; \
     while [ \"$(stty size)\" != '24 80' ] && [ $i -lt 300 ]; do i=$((i+1)); sleep 0.1; done; \
     echo size $(stty size); echo end; exit 7";
/// A container that prints a counter, one line every 50 ms.
const COUNTS: &str = "i=0; while :; do i=$((i+1)); echo $i; sleep 0.05; done";

/// `ctr run --rm` of `script` in container `id`, in the background.
fn run_background(node: &Node, runtime: Runtime, id: &str, script: &str) -> Background {
    node.ctr_background([
        "run",
        "--rm",
        "--runtime",
        runtime.name(),
        "--snapshotter",
        "twig",
        IMAGE_REF,
        id,
        "sh",
        "-c",
        script,
    ])
    .unwrap_or_else(|e| panic!("starting ctr run of {id}: {e}"))
}

/// Waits for `bg` to print a line `ready`.
fn wait_ready(node: &Node, bg: &mut Background, what: &str) {
    bg.wait_for_stdout(OUTPUT, |o| o.lines().any(|l| l == "ready"))
        .unwrap_or_else(|e| panic!("{what} did not print ready: {e}\n{}", node.logs()));
}

/// The task's status in `ctr task ls` (`RUNNING`, `PAUSED`, …).
fn task_status(node: &Node, id: &str) -> String {
    node.task_status(id)
        .unwrap_or_else(|| panic!("task {id} not in ctr task ls\n{}", node.logs()))
}

/// The last value the counter printed.
fn last_count(out: &str) -> u64 {
    out.lines()
        .rev()
        .find_map(|l| l.trim().parse().ok())
        .unwrap_or(0)
}

/// `ctr task exec` (output, exit code), and signals to execs and to the
/// container's init: SIGTERM untrapped → 143, SIGKILL → 137, a trapped
/// signal → the trap's own exit code.
fn exec_and_signals(runtime: Runtime, prefix: &str) {
    let node = node(runtime);
    let id = format!("{prefix}-signals");
    let started = Instant::now();
    let mut init = run_background(&node, runtime, &id, TRAPS_USR1);
    wait_ready(&node, &mut init, "the container");
    eprintln!(
        "{}: ctr run to the container's first output in {:.2?}",
        runtime.name(),
        started.elapsed()
    );
    assert_eq!(task_status(&node, &id), "RUNNING");

    let out = node.must_ctr(&[
        "task",
        "exec",
        "--exec-id",
        "exit5",
        &id,
        "sh",
        "-c",
        "echo out; echo err >&2; exit 5",
    ]);
    assert_eq!(out.code(), Some(5), "exec's exit code: {out}");
    assert_eq!(out.stdout, "out\n", "exec's stdout: {out}");
    assert_eq!(out.stderr, "err\n", "exec's stderr: {out}");

    for (exec_id, signal, script, code) in [
        ("term", "TERM", WAITS, 143),
        ("kill", "KILL", WAITS, 137),
        ("trap", "USR1", TRAPS_USR1, 42),
    ] {
        let mut exec = node
            .ctr_background([
                "task",
                "exec",
                "--exec-id",
                exec_id,
                &id,
                "sh",
                "-c",
                script,
            ])
            .unwrap_or_else(|e| panic!("starting ctr task exec {exec_id}: {e}"));
        wait_ready(&node, &mut exec, exec_id);
        node.must_ctr_ok(&["task", "kill", "--exec-id", exec_id, "-s", signal, &id]);
        node.expect_exit(
            exec,
            code,
            &format!("exec {exec_id} after SIG{signal}"),
            EXIT,
        );
    }
    assert_eq!(
        task_status(&node, &id),
        "RUNNING",
        "signals to execs reached the container's init"
    );

    node.must_ctr_ok(&["task", "kill", "-s", "USR1", &id]);
    let out = node.expect_exit(init, 42, "the init after a trapped SIGUSR1", EXIT);
    assert!(
        out.stdout.contains("got USR1"),
        "the trap did not run: {out}"
    );

    let id = format!("{prefix}-killed");
    let mut init = run_background(&node, runtime, &id, WAITS);
    wait_ready(&node, &mut init, "the second container");
    node.must_ctr_ok(&["task", "kill", "-s", "KILL", &id]);
    node.expect_exit(init, 137, "the init after SIGKILL", EXIT);
    let left = node.must_ctr_ok(&["containers", "ls", "-q"]);
    assert!(
        left.trim().is_empty(),
        "ctr run --rm left containers: {left}"
    );
}

/// Pause: the task is `PAUSED` and its counter stands still; resume: it is
/// `RUNNING` and the counter goes on.
fn pause_and_resume(runtime: Runtime, prefix: &str) {
    let node = node(runtime);
    let id = format!("{prefix}-pause");
    let mut counter = run_background(&node, runtime, &id, COUNTS);
    counter
        .wait_for_stdout(OUTPUT, |o| last_count(o) >= 3)
        .unwrap_or_else(|e| panic!("the counter did not count: {e}\n{}", node.logs()));

    node.must_ctr_ok(&["task", "pause", &id]);
    assert_eq!(task_status(&node, &id), "PAUSED");
    // Lines already on their way out may still arrive: wait until the
    // counter has stood still for STILL, which a running one never does.
    let deadline = Instant::now() + OUTPUT;
    let mut seen = last_count(&counter.stdout());
    let mut since = Instant::now();
    while since.elapsed() < STILL {
        assert!(
            Instant::now() < deadline,
            "the paused counter kept counting (at {seen})\n{}",
            node.logs()
        );
        std::thread::sleep(POLL);
        let now = last_count(&counter.stdout());
        if now != seen {
            seen = now;
            since = Instant::now();
        }
    }
    assert_eq!(task_status(&node, &id), "PAUSED");

    node.must_ctr_ok(&["task", "resume", &id]);
    assert_eq!(task_status(&node, &id), "RUNNING");
    counter
        .wait_for_stdout(OUTPUT, |o| last_count(o) > seen + 2)
        .unwrap_or_else(|e| {
            panic!(
                "the resumed counter did not go on from {seen}: {e}\n{}",
                node.logs()
            )
        });

    node.must_ctr_ok(&["task", "kill", "-s", "KILL", &id]);
    node.expect_exit(counter, 137, "the counter after SIGKILL", EXIT);
}

/// The memory usage in `ctr task metrics --format json`: cgroups v1
/// (`memory.usage.usage`, what twig's shim reports) or v2
/// (`memory.usage`, runc's on a cgroup v2 node).
fn memory_usage(metrics: &serde_json::Value) -> Option<u64> {
    let usage = &metrics["memory"]["usage"];
    usage["usage"].as_u64().or_else(|| usage.as_u64())
}

/// `ctr task metrics`, both formats: the JSON decodes and shows memory in
/// use and at least one process; the table names the task.
fn metrics(runtime: Runtime, prefix: &str) {
    let node = node(runtime);
    let id = format!("{prefix}-metrics");
    let mut init = run_background(&node, runtime, &id, WAITS);
    wait_ready(&node, &mut init, "the container");

    let json = node.must_ctr_ok(&["task", "metrics", "--format", "json", &id]);
    let metrics: serde_json::Value = serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("ctr task metrics --format json: {e}: {json}"));
    let memory = memory_usage(&metrics);
    assert!(
        memory.is_some_and(|m| m > 0),
        "no memory usage in the metrics: {json}"
    );
    let pids = metrics["pids"]["current"].as_u64();
    assert!(
        pids.is_some_and(|p| p >= 1),
        "no process count in the metrics: {json}"
    );
    eprintln!(
        "{}: metrics memory {} B, {} processes",
        runtime.name(),
        memory.unwrap_or_default(),
        pids.unwrap_or_default()
    );
    let table = node.must_ctr_ok(&["task", "metrics", &id]);
    assert!(
        table.lines().any(|l| l.starts_with(&id)),
        "the metrics table does not name the task: {table}"
    );

    node.must_ctr_ok(&["task", "kill", "-s", "KILL", &id]);
    node.expect_exit(init, 137, "the container after SIGKILL", EXIT);
}

/// A TTY `ctr run -t` (its output through the pty, its exit code), and
/// TTY and non-TTY execs into a running container.
fn tty(runtime: Runtime, prefix: &str) {
    let node = node(runtime);
    let id = format!("{prefix}-tty");
    let out = node
        .ctr_tty([
            "run",
            "--rm",
            "-t",
            "--runtime",
            runtime.name(),
            "--snapshotter",
            "twig",
            IMAGE_REF,
            &id,
            "sh",
            "-c",
            TTY_SIZE,
        ])
        .unwrap_or_else(|e| panic!("ctr run -t: {e}\n{}", node.logs()));
    assert_eq!(out.code(), Some(7), "ctr run -t: {out}\n{}", node.logs());
    let lines = out.stdout.replace('\r', "");
    assert!(
        lines.lines().any(|l| l == "on a tty"),
        "ctr run -t: no terminal in the container: {out:?}"
    );
    // The pty comes from the container's own devpts, so `tty` can name it.
    assert!(
        lines.lines().any(|l| l.starts_with("name /dev/pts/")),
        "ctr run -t: `tty` cannot name the container's terminal: {out:?}"
    );
    assert!(
        lines.lines().any(|l| l == "size 24 80"),
        "ctr run -t: the container's terminal did not get ctr's size (80x24): {out:?}"
    );
    if runtime == Runtime::Twig {
        assert!(
            lines.lines().any(|l| l == "end"),
            "ctr run -t: the output's end was lost: {out:?}"
        );
    }

    let id = format!("{prefix}-tty-exec");
    let mut init = run_background(&node, runtime, &id, WAITS);
    wait_ready(&node, &mut init, "the container");
    let exec = node
        .ctr_tty([
            "task",
            "exec",
            "-t",
            "--exec-id",
            "tty",
            &id,
            "sh",
            "-c",
            "[ -t 0 ] && echo exec on a tty; exit 9",
        ])
        .unwrap_or_else(|e| panic!("ctr task exec -t: {e}\n{}", node.logs()));
    assert_eq!(exec.code(), Some(9), "ctr task exec -t: {exec}");
    // Line ends through one or two terminals (the container's and ctr's,
    // which ctr puts in raw mode or not): `\r\n` or `\r\r\n`.
    assert!(
        exec.stdout
            .replace('\r', "")
            .lines()
            .any(|l| l == "exec on a tty"),
        "ctr task exec -t: {exec:?}"
    );
    let plain = node.must_ctr(&[
        "task",
        "exec",
        "--exec-id",
        "plain",
        &id,
        "sh",
        "-c",
        "[ -t 0 ] || [ -t 1 ] || echo exec without a tty; exit 8",
    ]);
    assert_eq!(plain.code(), Some(8), "ctr task exec: {plain}");
    assert_eq!(
        plain.stdout, "exec without a tty\n",
        "ctr task exec: {plain}"
    );

    node.must_ctr_ok(&["task", "kill", "-s", "KILL", &id]);
    node.expect_exit(init, 137, "the container after SIGKILL", EXIT);
}

#[test]
fn runc_exec_and_signals() {
    exec_and_signals(Runtime::Runc, "runc");
}

#[test]
fn twig_exec_and_signals() {
    exec_and_signals(Runtime::Twig, "twig");
}

#[test]
fn runc_pause_and_resume() {
    pause_and_resume(Runtime::Runc, "runc");
}

#[test]
fn twig_pause_and_resume() {
    pause_and_resume(Runtime::Twig, "twig");
}

#[test]
fn runc_metrics() {
    metrics(Runtime::Runc, "runc");
}

#[test]
fn twig_metrics() {
    metrics(Runtime::Twig, "twig");
}

#[test]
fn runc_tty() {
    tty(Runtime::Runc, "runc");
}

#[test]
fn twig_tty() {
    tty(Runtime::Twig, "twig");
}
