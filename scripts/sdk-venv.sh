#!/usr/bin/env bash
# Prints the path of a Python venv holding the sandbox SDKs Twig's sandbox
# API is tested against, unmodified from PyPI. Made once per set of pinned
# versions under ${XDG_CACHE_HOME:-$HOME/.cache}/twig/sdk/<hash>, built in a
# temporary directory and renamed into place, so a killed run leaves nothing
# half-made.
set -euo pipefail
pins=(e2b==2.63.0 e2b-code-interpreter==2.11.5 cubesandbox==0.7.3)
die() { echo "sdk-venv: $*" >&2; exit 1; }
command -v python3 >/dev/null || die "python3 is missing (install python3 and python3-venv)"
key=$(printf '%s\n' "${pins[@]}" "$(python3 -c 'import sys; print(sys.version)')" | sha256sum | cut -c1-16)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/twig/sdk
venv=$cache/$key
if [[ -x $venv/bin/python ]]; then
  echo "$venv"
  exit 0
fi
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp" >&2 || die "python3 -m venv failed (install python3-venv)"
"$tmp/bin/pip" install -q --disable-pip-version-check "${pins[@]}" >&2 ||
  die "pip install ${pins[*]} failed (PyPI unreachable?)"
# Moved, the venv's bin/python still finds its packages (pyvenv.cfg sits
# beside bin/); its other scripts name the temporary path: use bin/python.
mv -T "$tmp" "$venv" 2>/dev/null || [[ -x $venv/bin/python ]] || die "could not move the venv into $venv"
trap - EXIT
echo "$venv"
