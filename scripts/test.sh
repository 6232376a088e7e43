#!/usr/bin/env bash
# The one test command (README, .ci/run). Installs what the tests need, checks
# formatting and lints, runs every workspace test on the real components
# (/dev/kvm, containerd, loop-mounted reflink filesystems), then runs the
# VMM's tests again inside the nested lab on a real kvm-amd, then containerd
# with twig-snapshotter and the twig shim in the lab (a container in a
# microVM restored from a template, through `ctr run`). Tests that need
# root, KVM, containerd or the lab fail loudly when those are missing; they
# never skip.
set -euo pipefail
cd "$(dirname "$0")/.."
# One build per run: incremental state only costs disk (and time) here.
export CARGO_INCREMENTAL=0
scripts/install-deps.sh
# The real helm and kubectl of the controller's tests (downloaded once, cached).
TWIG_KUBE_TOOLS="$(scripts/kube-tools.sh)"
export TWIG_KUBE_TOOLS
cargo fmt --all --check
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
cargo test --workspace --locked
tests/lab/run.sh -p twig-vmm --features twig-vmm/lab
tests/lab/run.sh -p twig-e2e --features twig-e2e/lab
