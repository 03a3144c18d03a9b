#!/usr/bin/env bash
# DRUM's main demo: the optimiser on a generated cluster (ADMM vs the dual-decomposition
# baseline, with a convergence plot), then unmodified RDMA programs on softrnic, the built-in
# software NIC, between two emulated hosts, and the same perftest governed by DRUM's shim and
# an agent that grants it 30 % of the line.
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
agent_pid=
trap '[ -n "$agent_pid" ] && kill $agent_pid 2>/dev/null; $srn down >/dev/null 2>&1 || true' EXIT
$srn up --hosts 2 --line-rate-gbps 1
$srn exec --host h1 -- ibv_devinfo
$srn exec --host h1 -- ibv_rc_pingpong -g 0 -c -s 65536 -n 200 > out/pingpong-server.txt 2>&1 &
server=$!
sleep 1
$srn exec --host h2 -- ibv_rc_pingpong -g 0 -c -s 65536 -n 200 "$($srn addr h1)"
wait $server
echo "   server side: $(tail -n 1 out/pingpong-server.txt)"

echo
echo "== DRUM: ib_write_bw alone, then as app 'bulk' under the shim, granted 30 % of the 1 Gb/s line"
cat > out/agent.toml <<'EOF'
status_file = "agent-status.json"
[shim]
socket = "drum-shim.sock"
line_rate_gbps = 1
[shim.apps.bulk]
rate = 0.3
EOF
./target/release/drum-agent --local out/agent.toml 2> out/agent.log &
agent_pid=$!
for _ in $(seq 100); do [ -S out/drum-shim.sock ] && break; sleep 0.05; done
bw() {
    $srn exec --host h1 -- ib_write_bw -x 0 -s 65536 -n 1000 >/dev/null 2>&1 &
    local s=$!
    sleep 1
    $srn exec --host h2 -- ib_write_bw -x 0 -s 65536 -n 1000 "$($srn addr h1)" |
        awk '/^ *65536/ { print "   " $4 " MiB/s (BW average)" }'
    wait $s
}
echo " without the shim:"
bw
echo " with the shim, governed by drum-agent --local (30 % of 1 Gb/s = 35.76 MiB/s):"
LD_PRELOAD=$PWD/target/release/libdrum_shim.so DRUM_APP=bulk \
    DRUM_AGENT_SOCKET=$PWD/out/drum-shim.sock bw
echo "   (the agent's view of its shims: out/agent-status.json)"
