#!/usr/bin/env bash
# The one test command (README, .ci/run). Installs what the tests need, checks
# formatting and lints, builds everything, runs every workspace test on the
# real components (/dev/kvm, containerd, loop-mounted reflink filesystems)
# and, beside them and after, the nested lab's two lanes: twig-vmm's Linux
# guests on a real kvm-amd, and whole nodes (containerd with
# twig-snapshotter, twig-node and the twig shim, the controller, twig-api)
# running pods restored from templates. Tests that need
# root, KVM, containerd or the lab fail loudly when those are missing; they
# never skip.
set -euo pipefail
cd "$(dirname "$0")/.."
# One build per run: incremental state only costs disk (and time) here.
export CARGO_INCREMENTAL=0
# Where the run's time goes, on standard error: each phase's start, in
# seconds since the run began.
phase() { echo "test.sh: $1 at ${SECONDS}s" >&2; }
phase "installing dependencies"
scripts/install-deps.sh
# The real helm and kubectl of the controller's tests (downloaded once, cached).
TWIG_KUBE_TOOLS="$(scripts/kube-tools.sh)"
export TWIG_KUBE_TOOLS
phase "fmt and clippy"
cargo fmt --all --check
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
phase "builds"
# Everything the host tests and both lab lanes run, built while nothing else
# runs: a build beside the lab's emulated CPUs slowed its guests into
# timeouts, and two cargo builds at once only wait on each other's lock.
cargo test --workspace --locked --no-run
cargo test --locked -p twig-vmm --features twig-vmm/lab --no-run
cargo test --locked -p twig-e2e --features twig-e2e/lab --no-run
# The binaries tests and the lab build for themselves, each as they build
# it: twig-node's tests' VMM (with its test features: one build, which
# later only puts the binary in place again), and every workspace binary
# with the workspace's features (shim's tests, e2e's images, the lab's
# node daemons: after `cargo test --workspace`, a few binaries only).
# Built inside the host tests and beside the lab, they stretched the host
# tests and delayed lane B's boot by minutes.
cargo build --locked -q -p twig-vmm --bin twig-vmm --features testguest,test-trigger
cargo build --locked -q --workspace --bins
guest/build-kernel.sh > /dev/null
guest/build-initramfs.sh > /dev/null
# The lab runs two outer VMs at once, one per CPU of a 2-core machine: each
# runs its tests on one emulated CPU, and one after the other they outlast
# CI's 90 minutes. Lane B (the longest end-to-end binaries, its lines
# marked `lab-b|`) starts beside the host tests, which keep about one CPU
# busy; lane A (twig-vmm's lab tests, then every end-to-end binary not in
# lane B) once they are done. Lane B holds more, as it starts earlier;
# since the host tests stopped rebuilding (6 min), lane A starts 6 min
# after it, and `cri_oom`, `restore_from`, `python_template` and `shapes`
# (~510 s) moved there (2026-11-30's run: lane A done at 60 min, lane B
# near 76: `kubelet` 611 s, `sandbox_api` 415, `security` 271).
lane_b=(controller forks kubelet recovery twig_service security workflows sandbox_api volumes)
lanes=$(mktemp -d)
lane_b_pid=
# Lane B in its own process group, so that a failure elsewhere stops its
# outer VM too.
trap '[[ -n $lane_b_pid ]] && kill -- -"$lane_b_pid" 2> /dev/null; rm -rf "$lanes"' EXIT
phase "host tests, with the lab's lane B beside them"
setsid bash -c 'set -o pipefail; tests/lab/run.sh -p twig-e2e --features twig-e2e/lab "${@:2}" 2>&1 |
  sed -u "s/^/lab-b| /" | tee "$1"' lane-b "$lanes/b" $(printf -- '--test %s ' "${lane_b[@]}") &
lane_b_pid=$!
cargo test --workspace --locked
phase "the lab's lane A"
lane_a_rc=0
{ tests/lab/run.sh -p twig-vmm --features twig-vmm/lab &&
  TWIG_LAB_SKIP="${lane_b[*]}" tests/lab/run.sh -p twig-e2e --features twig-e2e/lab; } 2>&1 |
  tee "$lanes/a" || lane_a_rc=$?
phase "lane A done"
lane_b_rc=0
wait "$lane_b_pid" || lane_b_rc=$?
lane_b_pid=
phase "lane B done"
((lane_a_rc == 0 && lane_b_rc == 0)) || {
  # Each failing binary's own lines again (run.sh's LAB-DIGEST), last.
  grep -h 'LAB-DIGEST' "$lanes/a" "$lanes/b" >&2 || true
  echo "lab failed: lane A exit $lane_a_rc, lane B (${lane_b[*]}) exit $lane_b_rc" >&2
  exit 1
}
