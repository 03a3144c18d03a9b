#!/usr/bin/env bash
# rdma-core's pyverbs test suite on an emulated softrnic host, three ways: on the bare
# device, through the shim with no agent (fail-open), and through the shim governed by a
# real agent whose pin throttles it (a WQE rate and at most 2 active QPs). Prints each run's
# totals and every test whose outcome differs from the bare run; exits 1 if one does.
#
# The suite is not part of DRUM and is never committed: SUITE_DIR is the tests/ folder of an
# rdma-core checkout of the release the machine's libibverbs comes from (44 on Debian 12).
# Needs root, python3-pyverbs and the release build (cargo build --workspace --release).
# Usage: scripts/pyverbs-suite.sh SUITE_DIR [OUT_DIR]
set -euo pipefail
suite=$(realpath "${1:?usage: scripts/pyverbs-suite.sh SUITE_DIR [OUT_DIR]}")
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${2:-$root/out/pyverbs}")
bin=$root/target/release
mkdir -p "$out"
export SOFTRNIC_RUN_DIR
SOFTRNIC_RUN_DIR=$(mktemp -d /tmp/pyverbs-suite.XXXXXX)
agent_pid=""
cleanup() {
    [ -n "$agent_pid" ] && kill "$agent_pid" 2>/dev/null && wait "$agent_pid" 2>/dev/null
    "$bin/softrnic" down >/dev/null 2>&1 || true
    rm -rf "$SOFTRNIC_RUN_DIR"
}
trap cleanup EXIT INT TERM
"$bin/softrnic" up --hosts 2 >/dev/null

cat > "$SOFTRNIC_RUN_DIR/agent.toml" <<TOML
status_file = "agent-status.json"
[shim]
socket = "agent.sock"
line_rate_gbps = 25
[shim.apps.pyverbs]
rate_wqe_per_s = 20000
max_active_qps = 2
TOML
DRUM_LOG=warn "$bin/drum-agent" --local "$SOFTRNIC_RUN_DIR/agent.toml" &
agent_pid=$!
for _ in $(seq 100); do [ -S "$SOFTRNIC_RUN_DIR/agent.sock" ] && break; sleep 0.1; done

run() { # NAME [VAR=VALUE...]: the suite on h1, outcomes to $out/NAME.txt
    local name=$1
    shift
    env "$@" "$bin/softrnic" exec --host h1 -- /usr/bin/python3 "$root/scripts/pyverbs_outcomes.py" \
        "$suite" --dev softrnic0 --port 1 --gid 0 >"$out/$name.txt" 2>"$out/$name.stderr"
    echo "$name: $(tail -n 1 "$out/$name.txt")"
}
shim=(LD_PRELOAD="$bin/libdrum_shim.so" DRUM_SHIM_LOG=1 DRUM_APP=pyverbs)
run bare
run fail-open "${shim[@]}" DRUM_AGENT_SOCKET="$SOFTRNIC_RUN_DIR/none.sock"
run governed "${shim[@]}" DRUM_AGENT_SOCKET="$SOFTRNIC_RUN_DIR/agent.sock"
grep -q "governed=yes" "$out/governed.stderr" || { echo "the governed run was not governed"; exit 1; }

status=0
for name in fail-open governed; do
    if ! diff <(grep -v '^totals' "$out/bare.txt") <(grep -v '^totals' "$out/$name.txt") >"$out/$name.diff"; then
        echo "$name differs from bare:"
        cat "$out/$name.diff"
        status=1
    fi
done
exit $status
