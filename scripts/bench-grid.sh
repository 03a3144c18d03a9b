#!/usr/bin/env bash
# The optimiser's convergence grid of docs/benchmarks.md: for each size, `simulate` solves with
# ADMM + 10 selection rounds, then counts cold-start iterations to 0.5% of the optimum of the
# final active sets for ADMM and the dual baselines. Prints one markdown row per size.
# Usage: scripts/bench-grid.sh [NxM ...]   (default: the 3 × 3 grid of the issue)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DRUM_COORDINATOR:-./target/release/drum-coordinator}; [ -n "${DRUM_COORDINATOR:-}" ] || cargo build --release -p drum-coordinator >/dev/null
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(100x50 100x500 100x5000 1000x50 1000x500 1000x5000 10000x50 10000x500 10000x5000)
echo "| n × m | ADMM iters to 0.5% | dual (normalised) | dual (paper step) | gap after 10 rounds (of activation value / of objective) | solve wall (s) | peak RSS (MiB) |"
echo "|---|---|---|---|---|---|---|"
for s in "${sizes[@]}"; do
    n=${s%x*}; m=${s#*x}
    "$bin" simulate --hosts "$n" --apps "$m" --no-hosts --json --compare-iters 300 |
        python3 -c '
import json, sys
d = json.load(sys.stdin); c = d["comparison"]; a = d["admm"]
f = lambda v: str(v) if v is not None else "> %d" % c["cap"]
print("| %d × %d | %s | %s | %s | %.2f%% / %.2f%% | %.1f | %.0f |" % (d["hosts"], d["apps"], f(c["admm_iterations"]),
      f(c["dual_iterations"]), f(c["dual_paper_step_iterations"]), 100 * a["relative_gap"], 100 * a["relative_gap_objective"], a["wall_ms"] / 1e3,
      d["peak_rss_mib"] or 0))'
done
