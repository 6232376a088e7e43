//! `ctr run` of the busybox test image on the `twig` snapshotter, with
//! runc's runtime (containerd, twig-snapshotter and the lab's plumbing) and
//! with twig's (the container in a microVM). Built with `--features lab`
//! and run inside the nested lab by
//! `tests/lab/run.sh -p twig-e2e --features twig-e2e/lab`.

use std::time::Instant;

use twig_e2e::{find_on_path, Node, Runtime};

/// Prints a line on stdout naming the kernel it runs on, one on stderr,
/// then exits 3.
const SCRIPT: &str =
    "echo hello from $(cat /etc/hostname 2>/dev/null || echo twig) on $(uname -r); \
                      echo to stderr >&2; exit 3";

/// Runs [`SCRIPT`] with `runtime` and checks the container's output, its
/// exit code as `ctr run` reports it, that `--rm` left no container, and
/// which kernel it ran on: the node's with runc, the microVM's own with twig.
fn run_prints_and_exits_3(runtime: Runtime, id: &str) {
    let started = Instant::now();
    let node = Node::start().unwrap_or_else(|e| panic!("the node did not start: {e}"));
    let up = started.elapsed();
    let started = Instant::now();
    let out = node
        .run(runtime, id, &["sh", "-c", SCRIPT])
        .unwrap_or_else(|e| panic!("ctr run with {}: {e}\n{}", runtime.name(), node.logs()));
    eprintln!(
        "{}: node up with the image imported in {up:.2?}, ctr run in {:.2?}",
        runtime.name(),
        started.elapsed()
    );
    let fail = |what: &str| -> String {
        format!(
            "{what} (runtime {}): ctr run ended with {out}\n{}",
            runtime.name(),
            node.logs()
        )
    };
    assert_eq!(out.code(), Some(3), "{}", fail("wrong exit code"));
    assert!(
        out.stdout.starts_with("hello from ") && out.stdout.lines().count() == 1,
        "{}",
        fail("wrong stdout")
    );
    assert!(out.stderr.contains("to stderr"), "{}", fail("no stderr"));
    let node_kernel = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_else(|e| panic!("uname: {e}"));
    let on_node_kernel = out
        .stdout
        .trim_end()
        .ends_with(&format!(" on {node_kernel}"));
    match runtime {
        Runtime::Runc => assert!(on_node_kernel, "{}", fail("runc not on the node's kernel")),
        Runtime::Twig => assert!(
            !on_node_kernel && out.stdout.contains(" on "),
            "{}",
            fail("not in a microVM: the container saw the node's kernel")
        ),
    }
    let left = node
        .ctr_ok(["containers", "ls", "-q"])
        .unwrap_or_else(|e| panic!("listing containers: {e}"));
    assert!(
        !left.lines().any(|l| l == id),
        "ctr run --rm left container {id}: {left}"
    );
}

#[test]
fn runc_runs_busybox_from_the_twig_snapshotter() {
    run_prints_and_exits_3(Runtime::Runc, "e2e-runc");
}

/// Needs the shim crate (`shim/`, `containerd-shim-twig-v2`) on `PATH`
/// (tests/lab/run.sh carries it); fails loudly, never skips, without it.
#[test]
fn twig_runs_busybox_from_the_twig_snapshotter() {
    assert!(
        find_on_path(Runtime::Twig.shim()).is_some(),
        "containerd-shim-twig-v2 not found in the workspace build (not on PATH); \
         tests/lab/run.sh carries it into the lab once the workspace has the shim crate"
    );
    run_prints_and_exits_3(Runtime::Twig, "e2e-twig");
}
