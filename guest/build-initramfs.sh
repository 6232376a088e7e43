#!/usr/bin/env bash
# Builds the guest's initramfs: a static twig-agent as /init, plus the empty
# mount points it needs and /dev/console (the kernel opens it for init's
# stdio before any devtmpfs exists). Prints the path of the gzip'd cpio.
# The agent is stripped of its debug info there.
#
# Usage: guest/build-initramfs.sh [OUT]   (default: target/guest/agent-initrd)
# The agent is linked statically against glibc (no NSS use), built by cargo
# for the explicit host target so build scripts and proc-macros stay dynamic.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "guest/build-initramfs.sh: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "needs root (mknod /dev/console)"

target=x86_64-unknown-linux-gnu
out=${1:-target/guest/agent-initrd}
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --locked --release -q -p twig-agent --bin twig-agent --target "$target" >&2 \
  || die "building twig-agent failed"
agent=${CARGO_TARGET_DIR:-target}/$target/release/twig-agent
[[ -x $agent ]] || die "no $agent"
if readelf -d "$agent" | grep -q NEEDED; then die "$agent is not static"; fi

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{dev,proc,sys,run,tmp}
# Stripped: the guest decompresses and loads every byte at boot.
strip -o "$stage/init" "$agent"
mknod -m 600 "$stage/dev/console" c 5 1
mkdir -p "$(dirname "$out")"
(cd "$stage" && find . | cpio -o -H newc --quiet | gzip -1) > "$out.tmp"
mv "$out.tmp" "$out"
echo "$(cd "$(dirname "$out")" && pwd)/$(basename "$out")"
