#!/bin/sh
# Installs DRUM's control-plane daemons as systemd services.
#   deploy/install.sh coordinator|agent|both [BINDIR]
#   deploy/install.sh certs [DIR]
# BINDIR holds drum-coordinator / drum-agent (default: target/release of this checkout).
# Creates the system user `drum`, /etc/drum with example configs (never overwrites existing
# ones), the units, and for the coordinator a sysctl drop-in for UDP buffers. It does not
# start anything: put certificates and the instance in /etc/drum first
# (for a test cluster: `drum-coordinator dev-certs --out /etc/drum/certs`, then
# `deploy/install.sh certs`), then
#   systemctl enable --now drum-coordinator   (or drum-agent)
# `certs` makes the daemons' keys in DIR (default /etc/drum/certs) readable by the group the
# units run as (`drum`; DRUM_GROUP overrides it): dev-certs, run as root, writes every key
# 0600 root, which `User=drum` cannot read. The CA's key stays 0600 root: no daemon needs it.
set -eu
role=${1:-}
here=$(cd "$(dirname "$0")" && pwd)
group=${DRUM_GROUP:-drum}
if [ "$role" = certs ]; then
    dir=${2:-/etc/drum/certs}
    [ -d "$dir" ] || { echo "$0: $dir is not a directory" >&2; exit 1; }
    chgrp "$group" "$dir"
    chmod 0750 "$dir"
    for f in "$dir"/*; do
        case "$(basename "$f")" in
            ca.key) chmod 0600 "$f" ;;
            *.key) chgrp "$group" "$f"; chmod 0640 "$f" ;;
            *.pem) chgrp "$group" "$f"; chmod 0644 "$f" ;;
        esac
    done
    echo "certificates in $dir: keys readable by group $group, ca.key by its owner only"
    exit 0
fi
bindir=${2:-$here/../target/release}
case "$role" in
    coordinator) daemons="coordinator" ;;
    agent) daemons="agent" ;;
    both) daemons="coordinator agent" ;;
    *) echo "usage: $0 coordinator|agent|both [BINDIR] | certs [DIR]" >&2; exit 2 ;;
esac
[ "$(id -u)" -eq 0 ] || { echo "$0: run as root" >&2; exit 1; }
getent group drum >/dev/null || groupadd --system drum
getent passwd drum >/dev/null ||
    useradd --system --gid drum --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin drum
install -d -m 0750 -o root -g drum /etc/drum /etc/drum/certs
for d in $daemons; do
    bin="$bindir/drum-$d"
    [ -x "$bin" ] || { echo "$0: $bin not found; build with cargo build --release first" >&2; exit 1; }
    install -m 0755 "$bin" /usr/local/bin/
    [ -e "/etc/drum/$d.toml" ] || install -m 0640 -o root -g drum "$here/config/$d.toml" /etc/drum/
    install -m 0644 "$here/systemd/drum-$d.service" /etc/systemd/system/
    if [ "$d" = coordinator ]; then
        install -m 0644 "$here/sysctl/90-drum-coordinator.conf" /etc/sysctl.d/
        sysctl -q -p /etc/sysctl.d/90-drum-coordinator.conf || echo "$0: could not apply the sysctl settings now" >&2
    fi
done
if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
echo "installed: $daemons. Next: certificates into /etc/drum/certs (dev-certs, then $0 certs), configs in /etc/drum, then systemctl enable --now drum-<daemon>"
