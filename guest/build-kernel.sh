#!/usr/bin/env bash
# Builds Twig's guest kernel from Debian's linux-source-6.1 with the options in
# kernel.config, and prints the directory holding `vmlinux` and `bzImage`.
# The result is cached under ${XDG_CACHE_HOME:-~/.cache}/twig/guest-kernel,
# keyed by the hash of kernel.config and this script and by the source
# package version, so a machine builds each configuration once.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "guest/build-kernel.sh: $*" >&2; exit 1; }

for p in linux-source-6.1 bc flex bison libelf-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
    || die "package $p is missing (scripts/install-deps.sh installs it)"
done
ver=$(dpkg-query -W -f='${Version}' linux-source-6.1)
key=$(cat "$here/kernel.config" "$here/build-kernel.sh" | sha256sum | cut -c1-16)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/twig/guest-kernel
out=$cache/$ver-$key
if [[ -f $out/done ]]; then
  echo "$out"
  exit 0
fi

mkdir -p "$cache"
build=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$build"' EXIT
echo "guest kernel: extracting linux-source-6.1 $ver" >&2
tar -xf /usr/src/linux-source-6.1.tar.xz -C "$build"
src=$(echo "$build"/linux-source-*)
jobs=$(nproc)
(
  cd "$src"
  make -s tinyconfig >&2
  scripts/kconfig/merge_config.sh -m .config "$here/kernel.config" >/dev/null
  make -s olddefconfig >&2
  bad=0
  while IFS= read -r line; do
    [[ $line =~ ^CONFIG_([A-Z0-9_]+)=(.*)$ ]] || continue
    opt=${BASH_REMATCH[1]} want=${BASH_REMATCH[2]}
    if [[ $want == n ]]; then
      grep -q "^CONFIG_$opt=" .config && { echo "guest kernel: CONFIG_$opt is set, wanted off" >&2; bad=1; }
    else
      grep -qx "CONFIG_$opt=$want" .config || { echo "guest kernel: CONFIG_$opt is not $want" >&2; bad=1; }
    fi
  done < "$here/kernel.config"
  ((bad == 0)) || exit 1
  echo "guest kernel: building with $jobs jobs" >&2
  make -s -j"$jobs" vmlinux bzImage >&2
) || die "kernel build failed"
mkdir -p "$out.tmp"
cp "$src/vmlinux" "$src/arch/x86/boot/bzImage" "$src/.config" "$out.tmp/"
rm -rf "$out"
mv "$out.tmp" "$out"
touch "$out/done"
echo "$out"
