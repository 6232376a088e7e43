#!/usr/bin/env bash
# The nested lab: real KVM for twig's tests on machines whose /dev/kvm cannot
# run them (see ../shared/DESIGN.md, "This machine").
#
# Boots Debian's cloud kernel under QEMU TCG with `-cpu max` (SVM, nested
# paging, XSAVE) from an initramfs holding busybox, irqbypass/kvm/kvm-amd and
# the test binaries with their shared libraries; /init loads kvm-amd and runs
# every test binary against that /dev/kvm, printing their output to the
# serial console, which this script relays and judges.
#
# Usage: tests/lab/run.sh [cargo test selection...]
#        (default: -p twig-vmm --features twig-vmm/lab)
#        tests/lab/run.sh -p twig-e2e --features twig-e2e/lab
#        (end-to-end: also carries containerd, runc, twig-snapshotter, twig-node,
#        twig-vmm, containerd-shim-twig-v2 when it exists, and a busybox
#        image, a pod sandbox image and a Redis image built with e2e/build-image.sh)
#        tests/lab/run.sh --bench [twig-bench linux options...]
#        (runs `twig-bench linux --json` in the lab; the JSON goes to stdout,
#        the table and the lab's console to stderr)
#        tests/lab/run.sh --bench cri [twig-bench cri options...]
#        (`twig-bench cri --node lab --json`: pods through CRI, twig against
#        runc, on the end-to-end payload built in release)
#        tests/lab/run.sh --bench objects [twig-bench objects options...]
#        (`twig-bench objects --json`: Snapshot, Rollback and Clone through
#        the Kubernetes objects against their cost at the shim; one outer CPU)
#        tests/lab/run.sh --demo
#        (`twig-bench demo`: README's set-up-and-run command; the real path
#        through containerd's CRI, timed: a pod from the template, exec,
#        snapshot, rollback, clone)
# The kernel is cached under ${XDG_CACHE_HOME:-~/.cache}/twig/lab, keyed by
# the Debian package version. Every wait has a deadline.
set -euo pipefail
cd "$(dirname "$0")/../.."

# Seconds for each test binary. The longest take 5-6 min in the lab when
# the machine is quick and twice that when it is not (its TCG speed varies
# 2x from hour to hour here).
TEST_TIMEOUT=${TWIG_LAB_TEST_TIMEOUT:-1200}
KVM_AMD_PARAMS=${TWIG_LAB_KVM_AMD:-vgif=0 vls=0 lbrv=0}
# The outer VM's CPUs: one for the tests, two for the benchmark. With two,
# Linux guests restored from snapshots were now and then corrupted under
# QEMU's SVM emulation (triple faults in clear_page, stalls), which one CPU
# has not shown; a restore's latency, though, needs the VMM's device thread
# to run beside the vCPU, as on a real node.
SMP=${TWIG_LAB_SMP:-}
MEM=${TWIG_LAB_MEM:-3072}   # MiB of the outer VM
CPU=${TWIG_LAB_CPU:-max}
ACCEL=${TWIG_LAB_ACCEL:-tcg,thread=multi}
QEMU_ARGS=${TWIG_LAB_QEMU_ARGS:-}
REPEAT=${TWIG_LAB_REPEAT:-1}   # runs of each test binary, for hunting flakes
[[ $REPEAT =~ ^[1-9][0-9]*$ ]] || { echo "lab: TWIG_LAB_REPEAT must be a positive number" >&2; exit 1; }
# Test binaries that need host tools the lab lacks (mount namespaces,
# setpriv, a 2 GiB guest, the twig-vmm binary they spawn) stay on the host;
# lazy restore runs in the lab through e2e's cross_node. So do those whose
# guests are the tiny ring-3 ones the host's KVM runs as they are (boot,
# disks, store, bad_input): under emulation they took CI's lab minutes and
# covered nothing more; `snapshot` and the library's tests (vCPU state,
# dirty logging, pre-copy) run on both, as the two KVMs differ there.
SKIP_IN_LAB=${TWIG_LAB_SKIP:-api jail multicore lazy boot disks store bad_input}
# Single tests to skip (TWIG_LAB_SKIP_TESTS="name ..."), for narrowing a run.
skip_tests=""
for t in ${TWIG_LAB_SKIP_TESTS:-}; do
  skip_tests="$skip_tests --skip $t"
done

die() { echo "lab: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "needs root (apt-get, building the initramfs)"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing (scripts/install-deps.sh installs it)"
[[ -x /bin/busybox ]] || die "busybox-static missing (scripts/install-deps.sh installs it)"

cache=${XDG_CACHE_HOME:-$HOME/.cache}/twig/lab
mkdir -p "$cache"

# 1. The outer kernel and its KVM modules, from Debian's package (cached),
#    from TWIG_LAB_KERNEL_SUITE (default: bookworm's own suites, as the
#    machine's apt sources have them; e.g. bookworm-backports for 6.12),
#    resolved with a private apt list under the cache so the machine's apt
#    configuration is left alone.
suite=${TWIG_LAB_KERNEL_SUITE:-}
apt_opts=()
if [[ -n $suite ]]; then
  aptdir=$cache/apt-$suite
  mkdir -p "$aptdir/lists/partial" "$aptdir/cache/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" > "$aptdir/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$aptdir/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$aptdir/lists" -o "Dir::Cache=$aptdir/cache")
  apt-get "${apt_opts[@]}" update -qq 2>/dev/null || echo "lab: apt-get update for $suite failed; using the cached lists" >&2
fi
resolve() { apt-cache "${apt_opts[@]}" depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}'; }
pkg=$(resolve)
[[ -n $pkg || -n $suite ]] || { apt-get update -qq; pkg=$(resolve); }
[[ -n $pkg ]] || die "cannot resolve linux-image-cloud-amd64${suite:+ in $suite}"
ver=$(apt-cache "${apt_opts[@]}" policy "$pkg" | awk '/Candidate:/{print $2}')
kdir=$cache/kernel-$pkg-$ver
# Lab runs at once (scripts/test.sh's two lanes) fill the cache one at a time.
exec 9> "$cache/.lock"
flock 9
if [[ ! -f $kdir/done ]]; then
  rm -rf "$kdir"; mkdir -p "$kdir/deb"
  (cd "$kdir/deb" && apt-get "${apt_opts[@]}" download "$pkg" >/dev/null 2>&1) || die "apt-get download $pkg failed"
  dpkg-deb -x "$kdir"/deb/*.deb "$kdir/x"
  touch "$kdir/done"
fi
exec 9>&-
kver=${pkg#linux-image-}
vmlinuz=$kdir/x/boot/vmlinuz-$kver
mods=$kdir/x/lib/modules/$kver/kernel
[[ -f $vmlinuz ]] || die "no $vmlinuz in $pkg"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 2. Twig's guest kernel (cached by guest/build-kernel.sh) and a busybox
#    initramfs for it that prints a tick a second with 16 bytes read from
#    the virtio-rng device: the Linux guests of the `lab` tests.
gk=$(guest/build-kernel.sh) || die "guest kernel build failed"
ginit=$work/guest-initrd
mkdir -p "$ginit"/{bin,proc,dev}
cp /bin/busybox "$ginit/bin/busybox"
cat > "$ginit/init" <<'GINIT'
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs dev /dev
echo TWIG-GUEST-READY
i=0
while true; do
  i=$((i + 1))
  echo "tick $i $(/bin/busybox hexdump -n 16 -e '16/1 "%02x"' /dev/hwrng)"
  /bin/busybox sleep 1
done
GINIT
chmod +x "$ginit/init"

# The agent initramfs (guest/build-initramfs.sh): a static twig-agent as /init.
agent_initrd=$(guest/build-initramfs.sh "$work/agent-initrd") || die "agent initramfs build failed"

# 3. The test binaries, or the benchmark.
bench=0
demo=0
[[ ${1:-} == --bench ]] && bench=1
[[ ${1:-} == --demo ]] && { bench=1; demo=1; }
# The demo is about what happens, not the last millisecond: one CPU, as the
# tests; so is the objects benchmark, whose clones two outer CPUs corrupt
# (README, "Guests corrupted under two outer CPUs").
[[ ${2:-} == objects ]] && SMP=${SMP:-1}
# Its Clone of 64 (twice: through the objects and at the shim) outlasts a
# test binary's 1200 s under TCG.
[[ ${2:-} == objects ]] && TEST_TIMEOUT=${TWIG_LAB_TEST_TIMEOUT:-3000}
# And its 65 guests, their shims and VMMs want more than the tests' 3 GiB.
[[ ${2:-} == objects ]] && MEM=${TWIG_LAB_MEM:-14336}
SMP=${SMP:-$((bench && !demo ? 2 : 1))}
bench_cmd=linux
if ((bench)); then
  shift
  ((demo)) && bench_cmd=demo
  [[ ${1:-} == cri ]] && { shift; bench_cmd="cri --node lab"; }
  [[ ${1:-} == objects ]] && { shift; bench_cmd=objects; }
  cargo build --locked --release -q -p twig-bench || die "building twig-bench failed"
  bins=("${CARGO_TARGET_DIR:-target}/release/twig-bench")
  bench_args="$*"
else
sel=("$@"); ((${#sel[@]})) || sel=(-p twig-vmm --features twig-vmm/lab)
mapfile -t bins < <(cargo test --locked "${sel[@]}" --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("executable") and ("lib" in t.get("kind", []) or "test" in t.get("kind", [])):
        print(m["executable"])
' | sort -u)
((${#bins[@]})) || die "cargo built no test binaries for ${sel[*]}"
fi
# The end-to-end tests (twig-e2e) drive a whole node: containerd and runc
# from Debian, and twig-snapshotter, twig-node, twig-vmm and (once the workspace has
# it) containerd-shim-twig-v2 from the workspace build. Carried only when
# twig-e2e is asked for: they add ~30 MB to the gzip'd initramfs.
e2e=0
((bench)) || [[ " ${sel[*]} " != *twig-e2e* ]] || e2e=1
[[ $bench_cmd == linux ]] || e2e=1
# Seconds for each boot of the outer VM: a backstop, since each test binary
# has TEST_TIMEOUT and a wedged VM stops its heartbeat. A boot must hold all
# its binaries on a slow hour (twig-vmm's took 19 min on 2026-11-25, when
# 900 s cut a passing run short): each timed-out boot costs a new boot and
# the binary it was running.
LAB_TIMEOUT=${TWIG_LAB_TIMEOUT:-$((e2e ? 5400 : 2400))}
# The benchmark measures release builds of the node's daemons.
profile=debug; ((bench)) && profile=release
daemons=()
if ((e2e)); then
  ws_bins=(twig-snapshotter twig-node twig-vmm)
  cargo metadata --locked --no-deps --format-version 1 | python3 -c '
import json, sys
sys.exit(0 if any("containerd-shim-twig-v2" == t["name"] and "bin" in t["kind"]
                  for p in json.load(sys.stdin)["packages"] for t in p["targets"]) else 1)
' && ws_bins+=(containerd-shim-twig-v2)
  # Debug: every binary with the workspace's features, as `cargo test
  # --workspace` built them (naming the four would build some
  # dependencies again with other features).
  cargo build --locked -q $( ((bench)) && echo --release $(printf -- '--bin %s ' "${ws_bins[@]}") || echo --workspace --bins) ||
    die "building ${ws_bins[*]} failed"
  for b in "${ws_bins[@]}"; do daemons+=("${CARGO_TARGET_DIR:-target}/$profile/$b"); done
fi

# 4. The lab's initramfs.
root=$work/root
mkdir -p "$root"/{bin,dev,proc,sys,tmp,lib/modules,tests}
cp /bin/busybox "$root/bin/busybox"
for m in virt/lib/irqbypass arch/x86/kvm/kvm arch/x86/kvm/kvm-amd drivers/net/tun \
  drivers/block/loop lib/libcrc32c fs/xfs/xfs net/llc/llc net/802/stp net/bridge/bridge \
  drivers/net/veth net/sched/sch_ingress net/sched/cls_bpf; do
  # Newer Debian kernels ship xz-compressed modules; busybox insmod wants them plain.
  if [[ -f $mods/$m.ko ]]; then cp "$mods/$m.ko" "$root/lib/modules/"
  elif [[ -f $mods/$m.ko.xz ]]; then xz -dc "$mods/$m.ko.xz" > "$root/lib/modules/$(basename "$m").ko"
  else die "no module $m in $pkg"; fi
done
copy_with_libs() {
  cp "$1" "$2"
  ldd "$1" 2>/dev/null | grep -o '/[^ ]*' | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
}
# mkfs.ext4, for tests that build a container rootfs image themselves;
# mkfs.xfs, for reflinks on a loop-mounted XFS.
mkdir -p "$root/sbin"
copy_with_libs "$(command -v mkfs.ext4)" "$root/sbin/mkfs.ext4"
copy_with_libs "$(command -v mkfs.xfs)" "$root/sbin/mkfs.xfs"
if ((e2e)); then
  mkdir -p "$root/usr/bin" "$root/usr/local/bin" "$root/e2e"
  # docker-registry: the registry of snapshots across nodes (cross_node).
  for b in containerd containerd-shim-runc-v2 ctr runc docker-registry; do
    p=$(command -v $b) || die "$b missing (scripts/install-deps.sh installs it)"
    copy_with_libs "$p" "$root/usr/bin/$b"
  done
  copy_with_libs "$(command -v debugfs)" "$root/sbin/debugfs"
  for b in "${daemons[@]}"; do
    copy_with_libs "$b" "$root/usr/local/bin/$(basename "$b")"
    strip "$root/usr/local/bin/$(basename "$b")"
  done
  e2e/build-image.sh "$root/e2e/busybox.tar" || die "building the e2e test image failed"
  # CRI: the pod sandbox ("pause") image, whose PID 1 waits until SIGTERM,
  # and the CNI plugins of a bridge network (containernetworking-plugins).
  e2e/build-image.sh "$root/e2e/pause.tar" docker.io/library/twig-e2e-pause:v1 \
    /bin/sh -c 'trap "exit 0" TERM INT; while :; do sleep 3600 & wait $!; done' ||
    die "building the e2e pod sandbox image failed"
  # The agent workflows' Redis (e2e/tests/workflows.rs), from Debian's
  # packages, unpacked aside (nothing is installed here).
  TWIG_IMAGE_DEBS="redis-server redis-tools libjemalloc2 liblzf1 libatomic1" \
    TWIG_IMAGE_BINARIES="/usr/bin/redis-server /usr/bin/redis-cli" \
    e2e/build-image.sh "$root/e2e/redis.tar" docker.io/library/twig-e2e-redis:v1 ||
    die "building the e2e Redis image failed"
  # The Python interpreter template workflow's image (e2e/tests/
  # python_template.rs): python3.11 and its standard library.
  TWIG_IMAGE_DEBS="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib" \
    TWIG_IMAGE_BINARIES="/usr/bin/python3.11" TWIG_IMAGE_TREES="/usr/lib/python3.11" \
    e2e/build-image.sh "$root/e2e/python.tar" docker.io/library/twig-e2e-python:v1 ||
    die "building the e2e Python image failed"
  # The sandbox API test (e2e/tests/sandbox_api.rs): the unmodified SDKs
  # (scripts/sdk-venv.sh) and the interpreter of their venv, with its
  # standard library and the libraries it loads, as a tree the test
  # chroots into (/sdk holds the packages: PYTHONPATH).
  venv=$(scripts/sdk-venv.sh) || die "making the SDK venv failed (scripts/sdk-venv.sh)"
  py=$(readlink -f "$venv/bin/python")
  pyhome=$("$venv/bin/python" -c 'import sys; print(sys.base_prefix)')
  pylib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
  sdk=$(mktemp -d)
  install -D -m 755 "$py" "$sdk$py"
  mkdir -p "$sdk$(dirname "$pylib")" "$sdk/sdk" "$sdk/dev" "$sdk/tmp" "$sdk/etc"
  tar -C "$(dirname "$pylib")" --exclude=__pycache__ --exclude=test --exclude=idlelib \
    --exclude=tkinter --exclude=ensurepip --exclude=site-packages --exclude='config-*' \
    -cf - "$(basename "$pylib")" |
    tar -C "$sdk$(dirname "$pylib")" -xf -
  tar -C "$venv/lib/$(basename "$pylib")/site-packages" --exclude=__pycache__ --exclude='pip*' \
    --exclude='setuptools*' --exclude=pkg_resources --exclude=_distutils_hack -cf - . |
    tar -C "$sdk/sdk" -xf -
  while IFS= read -r -d '' so; do
    { ldd "$so" 2>/dev/null || :; } | { grep -o '/[^ ]*' || :; } | while read -r lib; do
      [[ -e $sdk$lib ]] || install -D -m 755 "$(readlink -f "$lib")" "$sdk$lib"
    done
  done < <(find "$sdk$pylib" "$sdk/sdk" -name '*.so*' -print0; printf '%s\0' "$sdk$py")
  find "$sdk" -name '*.so*' -type f -exec strip --strip-debug {} + 2>/dev/null || :
  strip --strip-debug "$sdk$py" 2>/dev/null || :
  echo "$pyhome" > "$sdk/etc/twig-python-home"
  # The SDKs' HTTP clients load the system's CA certificates at start.
  install -D -m 644 "$venv/lib/$(basename "$pylib")/site-packages/certifi/cacert.pem" \
    "$sdk/etc/ssl/certs/ca-certificates.crt"
  tar -C "$sdk" -czf "$root/e2e/sdk.tar.gz" . || die "packing the SDK tree failed"
  rm -rf "$sdk"
  mkdir -p "$root/usr/lib/cni"
  for p in bridge host-local loopback; do
    [[ -x /usr/lib/cni/$p ]] || die "/usr/lib/cni/$p missing (containernetworking-plugins: scripts/install-deps.sh)"
    copy_with_libs "/usr/lib/cni/$p" "$root/usr/lib/cni/$p"
  done
fi
n=0
for b in "${bins[@]}"; do
  name=$(basename "$b"); ((bench)) || name=${name%-*}
  [[ " $SKIP_IN_LAB " == *" $name "* ]] && { echo "lab: $name runs on the host only" >&2; continue; }
  copy_with_libs "$b" "$root/tests/$name"; n=$((n + 1))
  # Without their DWARF (the symbols stay, for backtraces): the initramfs
  # lives in the outer VM's RAM, and fifteen debug test binaries there
  # (~100 MB each) left the nested guests too little of its 3 GiB.
  strip --strip-debug "$root/tests/$name"
done
mkdir -p "$root/guest"
cp "$gk/bzImage" "$root/guest/bzImage"
cp "$agent_initrd" "$root/guest/agent-initrd"
(cd "$ginit" && find . | cpio -o -H newc --quiet | gzip -1) > "$root/guest/initrd"
cat > "$root/init" <<INIT
#!/bin/busybox sh
# runc's pivot_root cannot leave the initramfs (rootfs): for the end-to-end
# tests, the lab's root moves to a tmpfs first, as a node's root is a real
# filesystem. (Not for twig-vmm's tests: the copy would only cost time.)
if [ $e2e = 1 ] && [ ! -e /.lab-tmpfs-root ]; then
  copied=0
  /bin/busybox mkdir /newroot && /bin/busybox mount -t tmpfs -o mode=755 root /newroot && copied=1
  for d in /*; do
    [ "\$d" = /newroot ] || /bin/busybox cp -a "\$d" /newroot/ || copied=0
  done
  [ \$copied = 1 ] && /bin/busybox touch /newroot/.lab-tmpfs-root &&
    exec /bin/busybox switch_root /newroot /init
  echo "LAB-ERROR moving the root to a tmpfs"
fi
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp; mount -t debugfs debugfs /sys/kernel/debug
for m in irqbypass kvm tun loop libcrc32c xfs llc stp bridge veth sch_ingress cls_bpf; do insmod /lib/modules/\$m.ko || echo "LAB-ERROR insmod \$m"; done
insmod /lib/modules/kvm-amd.ko $KVM_AMD_PARAMS || echo "LAB-ERROR insmod kvm-amd $KVM_AMD_PARAMS"
echo "LAB-KVM-AMD \$(cd /sys/module/kvm_amd/parameters && grep . * | tr '\\n' ' ')"
[ -c /dev/kvm ] || echo "LAB-ERROR no /dev/kvm"
export TWIG_GUEST_KERNEL=/guest/bzImage TWIG_GUEST_INITRD=/guest/initrd TWIG_AGENT_INITRD=/guest/agent-initrd
export PATH=/sbin:/bin:/usr/bin:/usr/local/bin ${TWIG_LAB_ENV:-}
# What containerd and runc expect of a node: cgroups (v2), /run, /dev/shm
# (a hostIPC pod's), a loopback; CRI copies the node's /etc/hosts and
# /etc/resolv.conf into every pod.
mkdir -p /run /var/lib /etc && mount -t cgroup2 cgroup2 /sys/fs/cgroup || echo "LAB-ERROR no cgroup2"
mkdir -p /dev/shm && mount -t tmpfs -o mode=1777,nosuid,nodev shm /dev/shm || echo "LAB-ERROR no /dev/shm"
# twig-net pins each pod's eBPF path under /sys/fs/bpf, as a node mounts it.
mount -t bpf bpf /sys/fs/bpf || echo "LAB-ERROR no bpffs"
[ -e /etc/hosts ] || echo '127.0.0.1 localhost' > /etc/hosts
[ -e /etc/resolv.conf ] || : > /etc/resolv.conf
ip link set lo up || echo "LAB-ERROR lo"
[ $e2e = 0 ] || export TWIG_E2E_IMAGE=/e2e/busybox.tar TWIG_E2E_PAUSE_IMAGE=/e2e/pause.tar TWIG_E2E_REDIS_IMAGE=/e2e/redis.tar TWIG_E2E_PYTHON_IMAGE=/e2e/python.tar TWIG_E2E_SDK=/e2e/sdk.tar.gz TWIG_E2E_SDK_PYTHON=${py:-} TWIG_E2E_XFS=/xfs
# The benchmark's files live on XFS, as in production: snapshots and
# restores share disk extents (reflinks) instead of copying them.
truncate -s 4G /tmp/xfs.img && mkfs.xfs -q -m reflink=1 /tmp/xfs.img && mkdir /xfs &&
  mount -o loop /tmp/xfs.img /xfs && export TWIG_BENCH_DIR=/xfs || echo "LAB-ERROR no XFS"
# L1 KVM's exits, interrupt injections and nested page faults go to the
# trace ring buffer (not while benchmarking: tracing costs time). A guest's
# triple fault stops the buffer, so it keeps what led up to it; a failing
# test binary gets that history printed (LAB-TRACE lines).
tr=/sys/kernel/debug/tracing
if [ $bench = 0 ] && [ -d \$tr/events/kvm ]; then
  echo 16384 > \$tr/buffer_size_kb
  for e in kvm_exit kvm_page_fault kvm_inj_virq kvm_inj_exception kvm_pic_set_irq kvm_set_irq; do
    echo 1 > \$tr/events/kvm/\$e/enable || echo "LAB-ERROR tracing kvm:\$e"
  done
  echo 'traceoff if exit_reason == 127' > \$tr/events/kvm/kvm_exit/trigger || echo "LAB-ERROR trace trigger"
fi
trace_tail() {
  [ -f \$tr/trace ] || return 0
  if [ "\$(cat \$tr/tracing_on)" = 0 ]; then
    pid=\$(grep -i 'reason shutdown' \$tr/trace | tail -1 | sed 's/^ *[^ ]*-\([0-9]*\) .*/\1/')
    echo "LAB-TRACE a guest triple-faulted (vCPU thread \$pid); L1 KVM's last events for it:"
    grep -- "-\$pid *\\[" \$tr/trace | tail -300 | sed 's/^/LAB-TRACE /'
  else
    echo "LAB-TRACE L1 KVM's last events:"
    grep -v '^#' \$tr/trace | tail -300 | sed 's/^/LAB-TRACE /'
  fi
  echo > \$tr/trace; echo 1 > \$tr/tracing_on
}
# A heartbeat on the second serial port: the host's watchdog.
(while :; do echo . > /dev/ttyS1; sleep 5; done) &
beat=\$!
# Binaries that passed in an earlier boot of this run are not run again.
done_bins=" \$(sed -n 's/.*twig_done=\([^ ]*\).*/\1/p' /proc/cmdline | tr , ' ') "
echo LAB-BEGIN
if [ $bench = 1 ]; then
  timeout $TEST_TIMEOUT ${TWIG_LAB_WRAP:-} /tests/twig-bench $bench_cmd --json ${bench_args:-} > /tmp/bench.json
  echo "LAB-EXIT twig-bench \$?"
  sed 's/^/LAB-JSON /' /tmp/bench.json
else
for t in /tests/*; do
  case "\$done_bins" in *" \$(basename \$t) "*) echo "LAB-DONE-EARLIER \$(basename \$t)"; continue;; esac
  for rep in \$(seq $REPEAT); do
  echo "LAB-RUN \$t"
  ${TWIG_LAB_WRAP:-} \$t --test-threads=1 $skip_tests ${TWIG_LAB_TEST_ARGS:-} 2>&1 &
  pid=\$!
  n=0
  while kill -0 \$pid 2>/dev/null; do
    if [ \$n -ge $TEST_TIMEOUT ]; then
      # A hang: say where every thread waits, then kill the binary.
      echo "LAB-HANG \$(basename \$t) after $TEST_TIMEOUT s; its threads:"
      for d in /proc/\$pid/task/*; do
        echo "  \$(cat \$d/comm) wchan=\$(cat \$d/wchan) syscall=\$(cat \$d/syscall)"
      done
      # Which processes the CPU went to (clock ticks of user and system
      # time), and how much memory is left.
      for p in /proc/[0-9]*; do
        echo "\$(sed 's/^.*) //' \$p/stat 2>/dev/null | awk '{print \$12 + \$13}') \${p#/proc/} \$(cat \$p/comm 2>/dev/null)"
      done | sort -rn | head -n 12 | sed 's/^/LAB-CPU /'
      grep -E '^(MemTotal|MemAvailable|Cached|Shmem|AnonPages):' /proc/meminfo | tr -s ' ' | sed 's/^/LAB-MEM /'
      # And the last lines of every log its node wrote (containerd, the
      # snapshotter, twig-node, each shim and VMM, the test kubelet).
      find /tmp /xfs -name '*.log' -size +0 2>/dev/null | while read -r f; do
        echo "LAB-LOG \$f:"; tail -n 12 "\$f" | sed 's/^/LAB-LOG   /'
      done
      kill -9 \$pid
      # And what it started (containerd, shims, VMMs, now init's): the next
      # binary starts on a clean node. Kernel threads ignore the signal.
      for p in /proc/[0-9]*; do
        case \${p#/proc/} in 1|\$beat) ;; *) kill -9 \${p#/proc/} 2>/dev/null;; esac
      done
      break
    fi
    sleep 1
    n=\$((n + 1))
  done
  wait \$pid
  rc=\$?
  [ \$rc = 0 ] || trace_tail
  echo "LAB-EXIT \$(basename \$t) \$rc"
  [ \$rc = 0 ] || break
  done
done
fi
echo LAB-END
poweroff -f
INIT
chmod +x "$root/init"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$work/initrd"
echo "lab: initramfs $(du -m "$work/initrd" | cut -f1) MiB (gzip -1)" >&2

# 5. Boot it and judge what it prints.
# The outer kernel's nested KVM runs on QEMU's emulation of SVM, which has
# crashed the outer kernel ("BUG: TASK stack guard page was hit" at
# error_entry, in KVM_RUN: an interrupt taken between VMLOAD of the guest's
# state and VMRUN, while GIF should block it, looks exactly like that) or
# wedged it (QEMU spinning, the outer kernel printing nothing). Such a boot
# says nothing about twig. So the outer VM beats a heartbeat on its second
# serial port; when the heartbeat stops for BEAT_TIMEOUT seconds, or the
# outer kernel stops before LAB-END without any test binary having failed,
# the outer VM is booted again (at most LAB_BOOTS times in all) and carries
# on with the binaries that have not yet passed. A failing test is never
# retried.
# What a failing (or unfinished) binary printed, without L1 KVM's trace, as
# its last 150 lines marked LAB-DIGEST: scripts/test.sh prints them again at
# its very end, where a CI log's tail shows them.
digest() {
  awk '$1 == "LAB-RUN" {on = 1; bin = $2; sub(".*/", "", bin); n = 0}
    on && $1 != "LAB-TRACE" {text[n++] = $0}
    $1 == "LAB-EXIT" && on {on = 0; if ($3 != 0) show()}
    END {if (on) show()}
    function show() {for (i = 0; i < n; i++) print "LAB-DIGEST " bin ": " text[i]}' "$all" |
    tail -n 150
}
# The console's lines, carriage returns dropped; each test's verdict (`ok`,
# `FAILED`, on the test's line or, after its output, one of their own) and
# each binary's start and exit stamped with the seconds since the boot
# (`[lab 123s]`), so a run says where its minutes went.
stamp() {
  local line
  while IFS= read -r line; do
    line=${line%$'\r'}
    case $line in
      LAB-RUN* | LAB-EXIT* | ok | *" ok" | FAILED | *" FAILED") printf '%s [lab %ds]\n' "$line" $((SECONDS - boot_start)) ;;
      *) printf '%s\n' "$line" ;;
    esac
  done
}
BEAT_TIMEOUT=${TWIG_LAB_BEAT_TIMEOUT:-90}
LAB_BOOTS=${TWIG_LAB_BOOTS:-8}
all=$work/all.log
: > "$all"
passed_bins=""
for attempt in $(seq 1 "$LAB_BOOTS"); do
  log=$work/serial-$attempt.log
  beat=$work/beat-$attempt
  : > "$beat"
  boot_start=$SECONDS
  echo "lab: booting $pkg ($ver) under QEMU TCG with $n test binaries (boot $attempt of at most $LAB_BOOTS)${passed_bins:+; passed already: $passed_bins}" >&2
  # `--foreground`: timeout stays in this script's process group, so that
  # stopping the group (scripts/test.sh's lane B on a failure elsewhere)
  # stops QEMU too; in a group of its own, an outer VM outlived its run.
  { timeout --foreground "$LAB_TIMEOUT" qemu-system-x86_64 -M pc -accel "$ACCEL" -smp "$SMP" -cpu "$CPU" -m "$MEM" $QEMU_ARGS \
      -nographic -no-reboot -serial stdio -serial "file:$beat" -monitor none \
      -pidfile "$work/qemu.pid" -kernel "$vmlinuz" -initrd "$work/initrd" \
      -append "console=ttyS0 panic=-1 quiet twig_done=$(echo $passed_bins | tr ' ' ,)" </dev/null
    echo $? > "$work/qemu.rc"; } | stamp | tee "$log" >&$((bench ? 2 : 1)) &
  relay=$!
  last=0 still=0 wedged=""
  while kill -0 $relay 2>/dev/null; do
    sleep 5
    size=$(stat -c %s "$beat")
    if ((size != last)); then last=$size still=0; else still=$((still + 5)); fi
    if ((size > 0 && still >= BEAT_TIMEOUT)); then
      wedged="no heartbeat from the outer VM for $BEAT_TIMEOUT s"
      kill "$(cat "$work/qemu.pid")" 2>/dev/null || true
      break
    fi
  done
  wait $relay || true
  qemu=$(cat "$work/qemu.rc" 2>/dev/null || echo "?")
  cat "$log" >> "$all"
  grep -q '^LAB-END' "$log" && break
  failed_before=$(awk '$1 == "LAB-EXIT" && $3 != 0 {print; exit}' "$log")
  oops=$(grep -m1 -E 'Kernel panic|BUG: |Oops: ' "$log" || true)
  why="${wedged:-qemu exit $qemu}${oops:+; the outer kernel said: $oops}"
  if [[ -n $failed_before || $attempt == "$LAB_BOOTS" ]]; then
    digest
    die "the lab did not finish ($why); see output above"
  fi
  # (awk, not grep: a boot that wedged before any binary finished has no
  # LAB-EXIT line, and a grep finding nothing would end this script.)
  ((bench)) || passed_bins=$(awk -v r="$REPEAT" '$1 == "LAB-EXIT" && $3 == 0 {n[$2]++}
    END {for (b in n) if (n[b] >= r) print b}' "$all" | sort | tr '\n' ' ')
  echo "lab: the outer VM stopped before the tests finished ($why); booting it again" >&2
done
log=$all
! grep -q '^LAB-ERROR' "$log" || die "$(grep '^LAB-ERROR' "$log")"
if ((bench)); then
  grep -q '^LAB-EXIT twig-bench 0' "$log" || die "twig-bench failed in the lab"
  sed -n 's/^LAB-JSON //p' "$log"
  exit 0
fi
passed=$(awk '/^test result:/ {for (i = 1; i < NF; i++) if ($(i + 1) ~ /^passed/) s += $i} END {print s + 0}' "$log")
failed=$(awk '/^test result:/ {for (i = 1; i < NF; i++) if ($(i + 1) ~ /^failed/) s += $i} END {print s + 0}' "$log")
bad=$(awk '$1 == "LAB-EXIT" && $3 != 0 {printf "%s (exit %s) ", $2, $3}' "$log")
echo "lab: $passed passed, $failed failed"
[[ -z $bad ]] || { digest; die "failing test binaries in the lab: $bad"; }
