#!/usr/bin/env bash
# Installs Twig on a node that runs containerd (1.6 or later, config
# version 2) under systemd:
#   - the binaries: containerd-shim-twig-v2 (runtime io.containerd.twig.v2),
#     twig-vmm, twig-node (node daemon), twig-snapshotter (proxy snapshotter);
#   - the guest: /usr/share/twig/vmlinux and agent-initrd.cpio.gz;
#   - /etc/twig/node.json and shim.json (kept if present);
#   - systemd units twig-snapshotter.service and twig-node.service;
#   - the containerd drop-in /etc/containerd/conf.d/twig.toml (runtime
#     handler `twig`, proxy snapshotter `twig`) and, if containerd's config
#     does not import conf.d yet, that import;
# then (with --start) reloads systemd, starts both daemons and restarts
# containerd.
#
# Usage: scripts/install-node.sh [--from DIR] [--root DIR] [--start] [--handler NAME]
#                                [--containerd-version X.Y] [--registry-prefix P]
#                                [--registry-host HOST[:PORT]] [--registry-plain-http HOST:PORT]
#                                [--registry-credentials FILE] [--registry-lazy-fill-kib N]
#        scripts/install-node.sh --bundle DIR
#   --bundle DIR  build everything (release binaries, guest kernel,
#                 initramfs) into DIR (bin/, share/): what an installer
#                 image carries; nothing is installed
#   --from DIR    install a bundle made by --bundle (default: build one)
#   --root DIR    install under DIR instead of / (an image, a test, or the
#                 host's / mounted in the chart's installer pod)
#   --start       reload systemd, enable and start the daemons, restart
#                 containerd; with --root other than /, through the host's
#                 PID 1 (nsenter: the installer pod runs with hostPID)
#   --handler     the CRI runtime handler name (default: twig)
#   --containerd-version X.Y
#                 the node's containerd (default: asked from its binary
#                 under the root). containerd 1.6's CRI plugin has one
#                 snapshotter for every runtime (per-runtime snapshotters
#                 came in 1.7), so on 1.6 the drop-in makes `twig` the CRI
#                 snapshotter of the node: runc pods then run on
#                 twig-snapshotter's ext4 images too (runc mounts them).
#   --registry-prefix P, --registry-host HOST[:PORT], --registry-plain-http HOST:PORT,
#   --registry-credentials FILE, --registry-lazy-fill-kib N
#                 twig-node's `registry` section of a new node.json (the
#                 OCI registry snapshots are exported to and imported
#                 from; the node speaks to no other): its repository
#                 prefix, the registry (HTTPS), or one spoken to over
#                 plain HTTP, a Docker config.json of credentials,
#                 copied to /etc/twig/registry/config.json (mode 0600, on
#                 every run: a rotated Secret reaches the node), and the
#                 pace of lazy restores' background downloads (KiB a
#                 second; default 0, unpaced). A kept
#                 node.json keeps its own section (a note says so).
# Files are replaced by rename, never rewritten in place, so running
# binaries and a containerd reading its config are never torn.
set -euo pipefail
die() { echo "install-node.sh: $*" >&2; exit 1; }

here=$(cd "$(dirname "$0")/.." && pwd)
from="" root=/ start=0 bundle="" handler=twig containerd_version=""
registry=0 registry_prefix=twig registry_host="" registry_plain_http="" registry_credentials=""
registry_lazy_fill=0
while (($#)); do
  case $1 in
    --from) from=${2:?--from needs a directory}; shift 2 ;;
    --root) root=${2:?--root needs a directory}; shift 2 ;;
    --start) start=1; shift ;;
    --bundle) bundle=${2:?--bundle needs a directory}; shift 2 ;;
    --handler) handler=${2:?--handler needs a name}; shift 2 ;;
    --containerd-version) containerd_version=${2:?--containerd-version needs X.Y}; shift 2 ;;
    --registry-prefix) registry=1 registry_prefix=${2:?--registry-prefix needs a prefix}; shift 2 ;;
    --registry-host) registry=1 registry_host=${2:?--registry-host needs HOST[:PORT]}; shift 2 ;;
    --registry-plain-http) registry=1 registry_plain_http=${2:?--registry-plain-http needs HOST:PORT}; shift 2 ;;
    --registry-credentials) registry=1 registry_credentials=${2:?--registry-credentials needs a file}; shift 2 ;;
    --registry-lazy-fill-kib) registry=1 registry_lazy_fill=${2:?--registry-lazy-fill-kib needs KiB a second}; shift 2 ;;
    *) die "unknown argument $1 (see the comment at the top of the script)" ;;
  esac
done
[[ $handler =~ ^[a-z0-9][a-z0-9-]*$ ]] || die "invalid handler name $handler"
[[ $registry_prefix =~ ^[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*$ ]] \
  || die "invalid registry prefix $registry_prefix"
for h in "$registry_host" "$registry_plain_http"; do
  [[ -z $h || $h =~ ^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?$ ]] || die "invalid registry host $h"
done
[[ -z $registry_credentials || -f $registry_credentials ]] \
  || die "registry credentials $registry_credentials is not a file"
[[ $registry_lazy_fill =~ ^(0|[1-9][0-9]{0,9})$ ]] \
  || die "invalid lazy-restore download pace $registry_lazy_fill (KiB a second, 0: unpaced)"
bins=(containerd-shim-twig-v2 twig-vmm twig-node twig-snapshotter)

make_bundle() {
  local out=$1
  mkdir -p "$out/bin" "$out/share"
  (cd "$here" && cargo build --locked --release -q $(printf -- '-p %s ' containerd-shim-twig-v2 twig-vmm twig-node twig-snapshotter)) \
    || die "building the release binaries failed"
  local b
  for b in "${bins[@]}"; do
    install -m 0755 "${CARGO_TARGET_DIR:-$here/target}/release/$b" "$out/bin/$b"
  done
  local kernel
  kernel=$("$here/guest/build-kernel.sh") || die "building the guest kernel failed"
  install -m 0644 "$kernel/vmlinux" "$out/share/vmlinux"
  local initrd
  initrd=$("$here/guest/build-initramfs.sh") || die "building the initramfs failed"
  install -m 0644 "$initrd" "$out/share/agent-initrd.cpio.gz"
  install -m 0755 "$here/scripts/install-node.sh" "$out/install-node.sh"
}

if [[ -n $bundle ]]; then
  make_bundle "$bundle"
  echo "$bundle"
  exit 0
fi

if [[ -z $from ]]; then
  from=$(mktemp -d)
  trap 'rm -rf "$from"' EXIT
  make_bundle "$from"
fi
for f in "${bins[@]/#/bin/}" share/vmlinux share/agent-initrd.cpio.gz; do
  [[ -f $from/$f ]] || die "$from/$f is missing (make a bundle with --bundle)"
done
[[ -d $root ]] || die "root $root is not a directory"

# Runs a command on the host: here, or (the chart's installer: another root
# and --start) in PID 1's mount namespace.
on_host() {
  if [[ $root -ef / ]]; then
    "$@"
  else
    nsenter --target 1 --mount -- "$@"
  fi
}
if [[ -z $containerd_version ]]; then
  for c in "$root/usr/bin/containerd" "$root/usr/local/bin/containerd"; do
    if [[ -x $c ]]; then
      # The host's binary may not run in an installer image (its libc):
      # then ask the host, when this root is the host's.
      v=$("$c" --version 2>/dev/null || { ((start)) && on_host "${c#"$root"}" --version; } || true)
      containerd_version=$(grep -oE ' v?[0-9]+\.[0-9]+' <<<"$v" | head -1 | tr -d ' v')
      break
    fi
  done
  [[ -n $containerd_version ]] \
    || die "no containerd that answers under $root/usr/bin or $root/usr/local/bin: pass --containerd-version X.Y"
fi
[[ $containerd_version =~ ^([0-9]+)\.([0-9]+) ]] || die "unreadable containerd version $containerd_version"
major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}
# containerd reads drop-ins only through its config's `imports`.
config=$root/etc/containerd/config.toml
import='imports = ["/etc/containerd/conf.d/*.toml"]'
if [[ ! -e $config ]]; then
  config_action=create
elif grep -q '^imports *=' "$config"; then
  grep -q '^imports *=.*/etc/containerd/conf\.d/\*\.toml' "$config" \
    || die "$config has an imports line without /etc/containerd/conf.d/*.toml: add it"
  config_action=keep
else
  config_action=prepend
fi
cri_snapshotter=""
if ((major == 1 && minor < 7)); then
  echo "install-node.sh: containerd $containerd_version has one CRI snapshotter: making it twig for every runtime" >&2
  cri_snapshotter='
# containerd < 1.7: one snapshotter for every CRI runtime.
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "twig"'
fi


# Installs $1 as $2 (under the root) with mode $3, by rename.
put() {
  local dst=$root/$2
  mkdir -p "$(dirname "$dst")"
  install -m "$3" "$1" "$dst.twig-new"
  mv -f "$dst.twig-new" "$dst"
}
# Writes stdin to $1 (under the root) with mode $2, by rename; with
# "keep" as $3, an existing file stays.
write() {
  local dst=$root/$1
  if [[ ${3:-} == keep && -e $dst ]]; then
    cat >/dev/null
    echo "install-node.sh: keeping $1" >&2
    return
  fi
  mkdir -p "$(dirname "$dst")"
  cat >"$dst.twig-new"
  chmod "$2" "$dst.twig-new"
  mv -f "$dst.twig-new" "$dst"
}

for b in "${bins[@]}"; do put "$from/bin/$b" "usr/local/bin/$b" 0755; done
put "$from/share/vmlinux" usr/share/twig/vmlinux 0644
put "$from/share/agent-initrd.cpio.gz" usr/share/twig/agent-initrd.cpio.gz 0644

registry_json=""
if ((registry)); then
  credentials=null
  if [[ -n $registry_credentials ]]; then
    credentials='"/etc/twig/registry/config.json"'
    # Put on every run (by rename, mode 0600): rotated credentials arrive.
    mkdir -p "$root/etc/twig/registry"
    chmod 0700 "$root/etc/twig/registry"
    put "$registry_credentials" etc/twig/registry/config.json 0600
  fi
  plain="" hosts=""
  [[ -n $registry_plain_http ]] && plain="\"$registry_plain_http\""
  [[ -n $registry_host ]] && hosts="\"$registry_host\""
  registry_json=",
  \"registry\": {
    \"hosts\": [$hosts],
    \"credentials\": $credentials,
    \"plain_http\": [$plain],
    \"repository_prefix\": \"$registry_prefix\",
    \"lazy_fill_kib_per_s\": $registry_lazy_fill
  }"
  if [[ -e $root/etc/twig/node.json ]]; then
    echo "install-node.sh: etc/twig/node.json is kept: its \"registry\" section should read {$registry_json }" >&2
  fi
fi
write etc/twig/node.json 0644 keep <<EOF
{
  "socket": "/run/twig/node.sock",
  "store": "/var/lib/twig/vm",
  "vmm_binary": "/usr/local/bin/twig-vmm",
  "base": {
    "kernel": "/usr/share/twig/vmlinux",
    "initrd": "/usr/share/twig/agent-initrd.cpio.gz"
  }$registry_json
}
EOF
write etc/twig/shim.json 0644 keep <<'EOF'
{
  "node_socket": "/run/twig/node.sock",
  "state_root": "/run/twig/shim"
}
EOF

write etc/systemd/system/twig-snapshotter.service 0644 <<'EOF'
[Unit]
Description=Twig proxy snapshotter (reflinked ext4 images) for containerd
Before=containerd.service

[Service]
ExecStart=/usr/local/bin/twig-snapshotter --root /var/lib/twig/snapshotter --address /run/twig/snapshotter.sock
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
EOF
# KillMode=process: the VMMs handed over to shims are the daemon's children
# but belong to their pods; a restart of the daemon must not take them down.
write etc/systemd/system/twig-node.service 0644 <<'EOF'
[Unit]
Description=Twig node daemon (node store, templates, warm VMM pool)
Before=containerd.service

[Service]
ExecStart=/usr/local/bin/twig-node --config /etc/twig/node.json
KillMode=process
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
EOF

write etc/containerd/conf.d/twig.toml 0644 <<EOF
# Written by Twig's install-node.sh. pod_annotations lets the twig.dev/*
# annotations (template, restore-from) reach the shim in the OCI spec.
version = 2

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.$handler]
  runtime_type = "io.containerd.twig.v2"
  snapshotter = "twig"
  pod_annotations = ["twig.dev/*"]

[proxy_plugins.twig]
  type = "snapshot"
  address = "/run/twig/snapshotter.sock"
$cri_snapshotter
EOF

case $config_action in
  create) printf 'version = 2\n%s\n' "$import" | write etc/containerd/config.toml 0644 ;;
  # Top-level keys must precede every table: put it first.
  prepend) { echo "$import"; cat "$config"; } | write etc/containerd/config.toml 0644 ;;
esac

if ((start)); then
  on_host systemctl daemon-reload
  on_host systemctl enable --now twig-snapshotter.service twig-node.service
  on_host systemctl restart containerd.service
fi
echo "install-node.sh: installed under $root" >&2
