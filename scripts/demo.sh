#!/usr/bin/env bash
# DRUM's main demo: the DRUM paper's experiments on a cluster of emulated hosts — unmodified
# perftest programs and the drum-kv store in RAW, SHARE and DRUM modes, DRUM being the live
# coordinator, an agent per host and the shim — ending in a self-contained report.html
# (drum-testbed run --profile quick; docs/testbed.md). Before it, the optimiser alone on a
# generated cluster of 300 hosts (ADMM against the dual-decomposition baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --workspace
mkdir -p out

# 300 hosts, and 150 iterations in the comparison, keep this step near half a minute (1000
# hosts took three); docs/benchmarks.md has every size.
echo "== drum-coordinator simulate: 300 hosts x 500 apps, k = 20"
./target/release/drum-coordinator simulate --hosts 300 --apps 500 --no-hosts --compare-iters 150 \
    --plot out/convergence.png --trace out/convergence.csv --write-instance out/instance.json
echo "   (plot: out/convergence.png, trace: out/convergence.csv, instance: out/instance.json)"

echo
if [ "$(id -u)" -ne 0 ]; then
    echo "== drum-testbed needs root (softrnic's network and mount namespaces); skipped"
    exit 0
fi
echo "== drum-testbed: every scenario, RAW vs SHARE vs DRUM, quick profile (out/testbed)"
# A run with the same --out resumes; start afresh so the report is this run's.
rm -rf out/testbed
./target/release/drum-testbed run all --profile quick --out out/testbed
./target/release/drum-testbed check out/testbed || true
echo
echo "report: $PWD/out/testbed/report.html"
