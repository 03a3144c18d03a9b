#!/bin/sh
# Checks the unit files with systemd-analyze verify, against the binaries of this checkout
# (verify insists that ExecStart exists). Usage: deploy/verify.sh [BINDIR]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
bindir=$(cd "${1:-$here/../target/release}" && pwd)
command -v systemd-analyze >/dev/null || { echo "systemd-analyze not installed: skipped"; exit 0; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for u in drum-coordinator drum-agent; do
    sed "s|/usr/local/bin/|$bindir/|" "$here/systemd/$u.service" >"$tmp/$u.service"
done
# verify exits 0 on unknown keys and other warnings; treat any output as a failure.
out=$(systemd-analyze verify --man=no "$tmp"/*.service 2>&1) || { echo "$out"; exit 1; }
if [ -n "$out" ]; then echo "$out"; exit 1; fi
echo "unit files verified"
