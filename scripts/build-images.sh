#!/usr/bin/env bash
# Builds the OCI images charts/twig runs, without a container builder
# (umoci makes each image, skopeo copies it; no docker, no buildah), tagged
# with the chart's appVersion (charts/twig/Chart.yaml), so a chart and the
# images it names go together:
#
#   twig-controller      /usr/local/bin/twig-controller (the DaemonSet's
#                        container), user 65532
#   twig-api             /usr/local/bin/twig-api (the sandbox API's
#                        Deployment), user 65532
#   twig-node-installer  the node bundle (`scripts/install-node.sh
#                        --bundle`: release binaries, guest kernel and
#                        initramfs, install-node.sh) at /opt/twig, with
#                        busybox-static (sh, nsenter, grep, mv...), bash and
#                        coreutils' install (install-node.sh is a bash
#                        script that installs files); user root, as it
#                        installs onto the host
#
# twig-controller and twig-api hold nothing but the stripped binary, the
# shared libraries `ldd` lists for it (glibc, libgcc_s; copied from this
# machine at their paths), /etc/passwd and /etc/group (root and nonroot,
# 65532) and a /tmp: no shell, no package manager.
#
# Each image is an OCI layout OUT/<name> with the tag VERSION; with
# --archive also an OCI archive OUT/<name>-VERSION.tar (`ctr images import`
# takes it); with --push it is copied to docker://REGISTRY/<name>:VERSION.
# Prints the reference of every image, REGISTRY/<name>:VERSION, one a line
# on stdout: the references the chart renders with `image.registry` set to
# REGISTRY (`cargo test -p twig-controller --test chart` checks the two
# agree; `cargo test -p twig-e2e --test images` builds the images, runs
# them and pulls them from a registry as the chart names them).
#
# Usage: scripts/build-images.sh [options]
#   --out DIR          where the layouts go (default: target/images)
#   --registry REG     registry and path of the references
#                      (default: ghcr.io/twig-dev, the chart's default)
#   --profile P        cargo profile of twig-controller and twig-api
#                      (default: release)
#   --bundle DIR       the installer's node bundle, made already by
#                      `scripts/install-node.sh --bundle DIR` (default:
#                      made now, which builds the release binaries, the
#                      guest kernel and the initramfs; needs root)
#   --only NAME        build only this image (repeatable)
#   --archive          also write OUT/<name>-VERSION.tar
#   --push             copy each image to REGISTRY (skopeo; log in first
#                      with `skopeo login` where the registry asks)
#   --insecure         push over plain HTTP / without TLS verification
#                      (a registry on loopback)
#   --list             print the references and build nothing
# Needs umoci, skopeo, busybox-static and binutils (strip)
# (scripts/install-deps.sh).
set -euo pipefail
die() { echo "build-images: $*" >&2; exit 1; }

here=$(cd "$(dirname "$0")/.." && pwd)
out=$here/target/images registry=ghcr.io/twig-dev profile=release bundle=""
archive=0 push=0 insecure=0 list=0 only=()
while (($#)); do
  case $1 in
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --registry) registry=${2:?--registry needs a name}; shift 2 ;;
    --profile) profile=${2:?--profile needs a cargo profile}; shift 2 ;;
    --bundle) bundle=${2:?--bundle needs a directory}; shift 2 ;;
    --only) only+=("${2:?--only needs an image name}"); shift 2 ;;
    --archive) archive=1; shift ;;
    --push) push=1; shift ;;
    --insecure) insecure=1; shift ;;
    --list) list=1; shift ;;
    *) die "unknown argument $1 (see the comment at the top of the script)" ;;
  esac
done
registry=${registry%/}
[[ $registry =~ ^[a-z0-9]([a-z0-9._:-]*[a-z0-9])?(/[a-z0-9]([a-z0-9._-]*[a-z0-9])?)*$ ]] \
  || die "invalid registry $registry (host[:port][/path], lower case)"

# The chart's appVersion: the tag of every image (and the chart's default tag).
version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$here/charts/twig/Chart.yaml")
[[ $version =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] \
  || die "charts/twig/Chart.yaml has no usable appVersion (got '$version')"

images=(twig-controller twig-api twig-node-installer)
if ((${#only[@]})); then
  for o in "${only[@]}"; do
    [[ " ${images[*]} " == *" $o "* ]] || die "unknown image $o (one of ${images[*]})"
  done
  images=("${only[@]}")
fi

if ((list)); then
  for name in "${images[@]}"; do echo "$registry/$name:$version"; done
  exit 0
fi

for t in umoci skopeo strip ldd; do
  command -v $t >/dev/null || die "$t missing (scripts/install-deps.sh installs it)"
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"
unpack_flags=()
[[ $(id -u) -eq 0 ]] || unpack_flags=(--rootless)

# Copies the shared libraries ELF $1 needs (ldd) into rootfs $2, at their paths.
add_libs() {
  local libs lib
  libs=$(ldd "$1" 2>&1) || {
    # A static binary: ldd says so and fails.
    grep -q 'not a dynamic executable\|statically linked' <<<"$libs" && return 0
    die "ldd $1 failed: $libs"
  }
  grep -q 'not found' <<<"$libs" && die "$1 needs libraries not on this machine: $libs"
  for lib in $(grep -o '/[^ ]*' <<<"$libs"); do
    [[ -e $2$lib ]] || install -D -m 0755 "$(readlink -f "$lib")" "$2$lib"
  done
}

# /etc/passwd and /etc/group with root and the accounts in $2... ("name:uid").
add_accounts() {
  local r=$1 a
  shift
  mkdir -p "$r/etc"
  echo 'root:x:0:0:root:/root:/sbin/nologin' >"$r/etc/passwd"
  echo 'root:x:0:' >"$r/etc/group"
  for a in "$@"; do
    echo "${a%%:*}:x:${a#*:}:${a#*:}:${a%%:*}:/nonexistent:/sbin/nologin" >>"$r/etc/passwd"
    echo "${a%%:*}:x:${a#*:}:" >>"$r/etc/group"
  done
}

# Creates layout OUT/$1 with an empty image tagged VERSION and unpacks it
# into $work/$1 (the rootfs is $work/$1/rootfs).
start_image() {
  rm -rf "${out:?}/$1"
  umoci init --layout "$out/$1"
  umoci new --image "$out/$1:$version"
  umoci unpack "${unpack_flags[@]}" --image "$out/$1:$version" "$work/$1" >/dev/null
  mkdir -p "$work/$1/rootfs/tmp"
  chmod 1777 "$work/$1/rootfs/tmp"
}

# Repacks image $1 and sets its config: user $2, then umoci config flags.
finish_image() {
  local name=$1 user=$2
  shift 2
  umoci repack --image "$out/$name:$version" "$work/$name"
  umoci config --image "$out/$name:$version" \
    --config.user "$user" \
    --config.env PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin \
    --config.label "org.opencontainers.image.title=$name" \
    --config.label "org.opencontainers.image.version=$version" \
    --config.label "org.opencontainers.image.source=https://github.com/twig-dev/twig" \
    "$@"
  umoci gc --layout "$out/$name"
  rm -rf "${work:?}/$name"
}

# twig-controller and twig-api: the binary, its libraries, two accounts.
binary_image() {
  local name=$1 bin=$2 r=$work/$1/rootfs
  start_image "$name"
  install -d "$r/usr/local/bin"
  strip -o "$r/usr/local/bin/$name" "$bin"
  chmod 0755 "$r/usr/local/bin/$name"
  add_libs "$r/usr/local/bin/$name" "$r"
  add_accounts "$r" nonroot:65532
  finish_image "$name" 65532:65532 --config.entrypoint "/usr/local/bin/$name"
}

installer_image() {
  local name=twig-node-installer r=$work/twig-node-installer/rootfs f a
  local from=$bundle
  if [[ -z $from ]]; then
    from=$work/bundle
    "$here/scripts/install-node.sh" --bundle "$from" >/dev/null || die "making the node bundle failed"
  fi
  for f in install-node.sh bin/containerd-shim-twig-v2 bin/twig-vmm bin/twig-node \
    bin/twig-snapshotter share/vmlinux share/agent-initrd.cpio.gz; do
    [[ -f $from/$f ]] || die "the bundle $from has no $f (scripts/install-node.sh --bundle makes one)"
  done
  # A dynamic busybox would need its libraries too: Debian's busybox-static.
  ! ldd /bin/busybox >/dev/null 2>&1 \
    || die "/bin/busybox is not static (install busybox-static: scripts/install-deps.sh)"
  start_image "$name"
  install -D -m 0755 /bin/busybox "$r/bin/busybox"
  # Every applet at its usual path (/bin/sh, /usr/bin/env, /usr/bin/nsenter...).
  for a in $(/bin/busybox --list-full); do
    [[ -e $r/$a || $a == bin/busybox ]] || {
      mkdir -p "$r/$(dirname "$a")"
      ln -s /bin/busybox "$r/$a"
    }
  done
  # What install-node.sh needs beyond busybox: bash (#!/usr/bin/env bash)
  # and coreutils' install (busybox-static has no applet of it), from this
  # machine, with their libraries.
  for f in /bin/bash /usr/bin/install; do
    rm -f "$r$f"
    install -D -m 0755 "$(readlink -f "$f")" "$r$f"
    add_libs "$r$f" "$r"
  done
  mkdir -p "$r/opt/twig"
  cp -a "$from/." "$r/opt/twig/"
  add_accounts "$r" nobody:65534
  finish_image "$name" 0:0 --config.cmd /bin/sh
}

target=${CARGO_TARGET_DIR:-$here/target}
need_bins=()
for name in "${images[@]}"; do
  case $name in twig-controller | twig-api) need_bins+=(-p "$name") ;; esac
done
# The tests' dev builds take every binary of the workspace, with its
# features: after `cargo test --workspace` nothing is compiled again
# (`-p` would build some dependencies again with other features).
[[ $profile == dev || $profile == test ]] && ((${#need_bins[@]})) && need_bins=(--workspace --bins)
if ((${#need_bins[@]})); then
  (cd "$here" && cargo build --locked -q --profile "$profile" "${need_bins[@]}") \
    || die "building ${need_bins[*]} ($profile) failed"
fi
# cargo's `dev` profile builds into target/debug.
dir=$profile
[[ $profile == dev || $profile == test ]] && dir=debug
[[ $profile == bench ]] && dir=release

for name in "${images[@]}"; do
  case $name in
    twig-controller | twig-api)
      [[ -x $target/$dir/$name ]] || die "no $target/$dir/$name after building it"
      binary_image "$name" "$target/$dir/$name"
      ;;
    twig-node-installer) installer_image ;;
  esac
  ref=$registry/$name:$version
  if ((archive)); then
    rm -f "$out/$name-$version.tar"
    skopeo copy --quiet "oci:$out/$name:$version" "oci-archive:$out/$name-$version.tar:$ref"
  fi
  if ((push)); then
    tls=()
    ((insecure)) && tls=(--dest-tls-verify=false)
    skopeo copy --quiet "${tls[@]}" "oci:$out/$name:$version" "docker://$ref" \
      || die "pushing $ref failed"
  fi
  echo "$ref"
done
