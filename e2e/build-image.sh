#!/usr/bin/env bash
# Builds the end-to-end tests' container image: one layer with the host's
# static busybox (/bin/busybox and a symlink per applet), /etc/passwd and
# /etc/group for root, and `/bin/sh` as its command (or CMD..., e.g. the
# pod sandbox image's endless shell loop). umoci makes the OCI layout, skopeo
# turns it into an OCI archive that `ctr images import` takes, named REF
# (default: the harness's twig_e2e::IMAGE_REF).
#
# TWIG_IMAGE_DEBS (Debian package names) and TWIG_IMAGE_BINARIES (paths)
# add programs from Debian packages without installing them on this
# machine: the packages are downloaded (apt-get download) and unpacked
# aside, and each binary goes into the image at its path with the shared
# libraries it needs, from those packages or from this machine. The lab
# builds its Redis image so (tests/lab/run.sh). TWIG_IMAGE_TREES (paths of
# directories in those packages) adds whole trees, such as an interpreter's
# standard library: each goes in at its path, and every shared object in it
# gets the libraries it needs as a binary does; one that needs a library
# found nowhere is left out with a note (its module will not import),
# since a tree carries modules nobody asked for. The lab builds its Python
# image so.
#
# Usage: e2e/build-image.sh OUT.tar [REF [CMD...]]
# Needs umoci, skopeo and busybox-static (scripts/install-deps.sh).
set -euo pipefail
out=${1:?usage: e2e/build-image.sh OUT.tar [REF]}
ref=${2:-docker.io/library/twig-e2e-busybox:v1}
shift $(($# < 2 ? $# : 2))
cmd=("$@"); ((${#cmd[@]})) || cmd=(/bin/sh)
die() { echo "build-image: $*" >&2; exit 1; }
for t in umoci skopeo; do
  command -v $t >/dev/null || die "$t missing (scripts/install-deps.sh installs it)"
done
# A dynamic busybox would not run in an image without a libc.
file -L /bin/busybox | grep -q 'statically linked' ||
  die "/bin/busybox is not static (install busybox-static: scripts/install-deps.sh)"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
layout=$work/layout
umoci init --layout "$layout"
umoci new --image "$layout:v1"
umoci unpack --image "$layout:v1" "$work/bundle" >/dev/null
r=$work/bundle/rootfs
mkdir -p "$r"/{bin,etc,proc,sys,dev,tmp,root}
chmod 1777 "$r/tmp"
cp /bin/busybox "$r/bin/busybox"
for a in $(/bin/busybox --list); do
  [[ $a == busybox ]] || ln -s busybox "$r/bin/$a"
done
echo 'root:x:0:0:root:/root:/bin/sh' > "$r/etc/passwd"
echo 'root:x:0:' > "$r/etc/group"
read -ra debs <<< "${TWIG_IMAGE_DEBS:-}"
read -ra bins <<< "${TWIG_IMAGE_BINARIES:-}"
if ((${#debs[@]})); then
  mkdir -p "$work/debs" "$work/pkg"
  (cd "$work/debs" && apt-get download "${debs[@]}" >/dev/null 2>&1) ||
    die "apt-get download ${debs[*]} failed"
  for d in "$work"/debs/*.deb; do dpkg-deb -x "$d" "$work/pkg"; done
fi
libpath=$work/pkg/usr/lib/x86_64-linux-gnu:$work/pkg/lib/x86_64-linux-gnu
for b in "${bins[@]}"; do
  src=$work/pkg$b
  [[ -e $src ]] || src=$b
  [[ -e $src ]] || die "$b is in none of the packages (${debs[*]}) nor on this machine"
  install -D -m 755 "$(readlink -f "$src")" "$r$b"
  libs=$(LD_LIBRARY_PATH=$libpath ldd "$src") || die "ldd $b failed"
  grep -q 'not found' <<< "$libs" && die "$b needs libraries found nowhere: $libs"
  for lib in $(grep -o '/[^ ]*' <<< "$libs"); do
    dest=${lib#"$work/pkg"}
    [[ -e $r$dest ]] || install -D -m 755 "$(readlink -f "$lib")" "$r$dest"
  done
done
read -ra trees <<< "${TWIG_IMAGE_TREES:-}"
for t in "${trees[@]}"; do
  [[ -d $work/pkg$t ]] || die "$t is in none of the packages (${debs[*]})"
  mkdir -p "$r$(dirname "$t")"
  cp -a "$work/pkg$t" "$r$t"
  while IFS= read -r -d '' so; do
    if ! libs=$(LD_LIBRARY_PATH=$libpath ldd "$so" 2>/dev/null) || grep -q 'not found' <<< "$libs"; then
      echo "build-image: leaving out ${so#"$r"}: it needs libraries found nowhere" >&2
      rm -f "$so"
      continue
    fi
    for lib in $(grep -o '/[^ ]*' <<< "$libs"); do
      dest=${lib#"$work/pkg"}
      [[ -e $r$dest ]] || install -D -m 755 "$(readlink -f "$lib")" "$r$dest"
    done
  done < <(find "$r$t" -name '*.so' -type f -print0)
done
umoci repack --image "$layout:v1" "$work/bundle"
cmd_args=()
for a in "${cmd[@]}"; do cmd_args+=("--config.cmd=$a"); done
umoci config --image "$layout:v1" "${cmd_args[@]}" --config.env PATH=/bin
skopeo copy --quiet "oci:$layout:v1" "oci-archive:$out.part:$ref"
mv "$out.part" "$out"
