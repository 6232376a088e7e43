#!/usr/bin/env bash
# Builds Firecracker from its public repository for `twig-bench fc` (not CI).
#
#   scripts/build-firecracker.sh [--fc-git DIR] [--fc-commit REV] [--mh-git DIR] [--mh-commit REV] [--toolchain T]
#
# DIR are git directories (bare clones or mirrors) of Firecracker and of its
# `micro_http` dependency; REV defaults to their HEAD. Each commit is exported
# with `git archive` under ~/.cache/twig/firecracker-src/<commit> and
# ~/.cache/twig/micro-http-src/<commit> (outside the work tree), and
# `cargo build --release -p firecracker` runs with the micro-http git
# dependency replaced by the local copy through a `[patch]` given on the
# command line (`--config`), into its own target directory
# ~/.cache/twig/firecracker/<fc-commit>. Crates come from the configured
# registry. Firecracker pins its toolchain in rust-toolchain.toml; the build
# overrides it with RUSTUP_TOOLCHAIN (default `stable`; `--toolchain nightly`
# if a crate needs a newer rustc). On the gnu target Firecracker's build.rs
# compiles its empty default seccomp policy (it ships filters only for musl).
#
# The last line printed is the binary's path; also written to
# ~/.cache/twig/firecracker/<fc-commit>/BINARY.
set -euo pipefail

FC_GIT=${FC_GIT:-/work/.mirror/firecracker-microvm+firecracker/repo}
MH_GIT=${MH_GIT:-/work/.mirror/firecracker-microvm+micro-http/repo}
FC_REV=HEAD
MH_REV=HEAD
TOOLCHAIN=${RUSTUP_TOOLCHAIN:-stable}
CACHE=${TWIG_CACHE:-$HOME/.cache/twig}

while [ $# -gt 0 ]; do
    case "$1" in
    --fc-git) FC_GIT=$2; shift 2 ;;
    --fc-commit) FC_REV=$2; shift 2 ;;
    --mh-git) MH_GIT=$2; shift 2 ;;
    --mh-commit) MH_REV=$2; shift 2 ;;
    --toolchain) TOOLCHAIN=$2; shift 2 ;;
    -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "build-firecracker.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

for d in "$FC_GIT" "$MH_GIT"; do
    git --git-dir="$d" rev-parse --git-dir >/dev/null 2>&1 ||
        { echo "build-firecracker.sh: $d is not a git directory" >&2; exit 1; }
done
FC_COMMIT=$(git --git-dir="$FC_GIT" rev-parse --verify "$FC_REV^{commit}")
MH_COMMIT=$(git --git-dir="$MH_GIT" rev-parse --verify "$MH_REV^{commit}")

export_tree() { # git-dir commit dest
    if [ ! -f "$3/.twig-exported" ]; then
        rm -rf "$3.tmp"
        mkdir -p "$3.tmp"
        # A mirror may lack its largest blobs (Firecracker's test kernel
        # src/vmm/src/test_utils/mock_resources/test_noisy_elf.bin, read only
        # by its unit tests at run time): those are left out, and named
        # (git archive still prints "invalid object" for them, and succeeds).
        local missing=() path
        while IFS= read -r path; do
            missing+=(":(exclude,literal)$path")
            echo "build-firecracker.sh: $path is absent from $1, left out" >&2
        done < <(paste -d ' ' \
            <(git --git-dir="$1" ls-tree -r --format='%(objectname)' "$2" |
                git --git-dir="$1" cat-file --batch-check='%(objecttype)') \
            <(git --git-dir="$1" ls-tree -r --format='%(path)' "$2") |
            awk '$2 == "missing" { sub(/^[^ ]+ [^ ]+ /, ""); print }' |
            while IFS= read -r p; do # blobs only (a submodule's commit is never there)
                [ "$(git --git-dir="$1" ls-tree --format='%(objecttype)' "$2" -- "$p")" = blob ] && echo "$p"
            done)
        git --git-dir="$1" archive --format=tar "$2" -- . "${missing[@]}" | tar -x -C "$3.tmp"
        touch "$3.tmp/.twig-exported"
        rm -rf "$3"
        mv "$3.tmp" "$3"
    fi
}
FC_SRC=$CACHE/firecracker-src/$FC_COMMIT
MH_SRC=$CACHE/micro-http-src/$MH_COMMIT
export_tree "$FC_GIT" "$FC_COMMIT" "$FC_SRC"
export_tree "$MH_GIT" "$MH_COMMIT" "$MH_SRC"

# Firecracker's seccompiler links libseccomp (Debian: libseccomp-dev).
if ! echo 'int main(void) { return 0; }' | cc -x c - -lseccomp -o /dev/null 2>/dev/null; then
    echo "build-firecracker.sh: libseccomp.so not found (apt-get install libseccomp-dev)" >&2
    exit 1
fi

TARGET_DIR=$CACHE/firecracker/$FC_COMMIT
mkdir -p "$TARGET_DIR"
echo "build-firecracker.sh: firecracker $FC_COMMIT, micro-http $MH_COMMIT, toolchain $TOOLCHAIN" >&2
(
    cd "$FC_SRC"
    RUSTUP_TOOLCHAIN=$TOOLCHAIN cargo build --release -p firecracker \
        --target-dir "$TARGET_DIR" \
        --config "patch.\"https://github.com/firecracker-microvm/micro-http\".micro_http.path = \"$MH_SRC\""
) >&2

BIN=$TARGET_DIR/release/firecracker
[ -x "$BIN" ] || { echo "build-firecracker.sh: no binary at $BIN" >&2; exit 1; }
{
    echo "firecracker $FC_COMMIT"
    echo "micro-http $MH_COMMIT"
    echo "toolchain $(RUSTUP_TOOLCHAIN=$TOOLCHAIN rustc --version)"
} >"$TARGET_DIR/COMMITS"
echo "$BIN" >"$TARGET_DIR/BINARY"
echo "$BIN"
