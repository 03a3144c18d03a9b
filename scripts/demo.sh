#!/usr/bin/env bash
# DRUM's main demo: the optimiser on a generated cluster (ADMM vs the dual-decomposition
# baseline, with a convergence plot), then unmodified RDMA programs on softrnic, the built-in
# software NIC, between two emulated hosts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --workspace
mkdir -p out

echo "== drum-coordinator simulate: 1000 hosts x 500 apps, k = 20"
./target/release/drum-coordinator simulate --hosts 1000 --apps 500 --no-hosts \
    --plot out/convergence.png --trace out/convergence.csv --write-instance out/instance.json
echo "   (plot: out/convergence.png, trace: out/convergence.csv, instance: out/instance.json)"

echo
echo "== softrnic: unmodified ibverbs programs between two emulated hosts"
if [ "$(id -u)" -ne 0 ]; then
    echo "   softrnic needs root (network and mount namespaces); skipped"
    exit 0
fi
srn=./target/release/softrnic
export SOFTRNIC_RUN_DIR=/run/softrnic-demo
trap '$srn down >/dev/null 2>&1 || true' EXIT
$srn up --hosts 2
$srn exec --host h1 -- ibv_devinfo
$srn exec --host h1 -- ibv_rc_pingpong -g 0 -c -s 65536 -n 200 > out/pingpong-server.txt 2>&1 &
server=$!
sleep 1
$srn exec --host h2 -- ibv_rc_pingpong -g 0 -c -s 65536 -n 200 "$($srn addr h1)"
wait $server
echo "   server side: $(tail -n 1 out/pingpong-server.txt)"
