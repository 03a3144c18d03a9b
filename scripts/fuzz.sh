#!/usr/bin/env bash
# Coverage-guided fuzzing of DRUM's decoders (docs/fuzzing.md), on the stable toolchain.
#
#   bash scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   (default: 60 s, every target)
#   bash scripts/fuzz.sh --list                              the targets
#   bash scripts/fuzz.sh --seeds                             regenerate fuzz/corpus/ from our encoders
#
# Builds the cargo-fuzz targets in fuzz/ with plain `cargo build` and the sanitizer-coverage
# flags cargo-fuzz would pass (no nightly, no cargo-fuzz needed), then runs each for the given
# time, starting from its committed seeds (fuzz/corpus/TARGET/), committed regression inputs
# (fuzz/regressions/TARGET/) and whatever earlier runs on this machine found
# (fuzz/corpus-run/TARGET/, not committed). Fails if any target crashes,
# leaks, times out or runs out of memory; the reproducer is left in fuzz/artifacts/TARGET/.
#
# Environment: FUZZ_CONFIGS=1 adds the daemon_config target (links the QUIC daemons: a longer
# cold build); FUZZ_JOBS is how many targets run at once (default: the number of cores);
# FUZZ_ARGS adds libFuzzer flags (e.g. FUZZ_ARGS=-only_ascii=1); FUZZ_TARGET_DIR is the cargo
# target directory (default target/fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
[ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"

targets_all=(control_agent_frames control_coord_frames softrnic_packet softrnic_cm_msg softrnic_flow_attr softrnic_request
    softrnic_response instance_json dasr_datagram)
features=()
if [ "${FUZZ_CONFIGS:-0}" = 1 ]; then
    targets_all+=(daemon_config)
    features=(--features configs)
fi

export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$root/target/fuzz}"
export CARGO_TERM_COLOR=never
unset CARGO_ENCODED_RUSTFLAGS RUSTC_WRAPPER

case "${1:-}" in
--list)
    printf '%s\n' "${targets_all[@]}"
    exit 0
    ;;
--seeds)
    # An ordinary (uninstrumented) test build: it writes every seed and checks it decodes.
    unset RUSTFLAGS
    rm -rf fuzz/corpus
    (cd fuzz && FUZZ_WRITE_SEEDS=1 cargo test --release --lib --quiet)
    (cd fuzz && cargo test --release --lib --quiet)
    exit 0
    ;;
esac

secs="${1:-60}"
[[ "$secs" =~ ^[0-9]+$ ]] || { echo "usage: $0 [SECONDS_PER_TARGET] [TARGET...]" >&2; exit 2; }
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${targets_all[@]}")
for t in "${targets[@]}"; do [ "$t" = daemon_config ] && features=(--features configs); done

# What `cargo fuzz build -s none` passes, minus what needs nightly. An explicit --target keeps
# these flags off build scripts and proc macros (they would not link without libFuzzer).
triple=$(rustc -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"

start=$(date +%s)
bins=()
for t in "${targets[@]}"; do bins+=(--bin "$t"); done
echo "fuzz: building ${#targets[@]} targets (target dir $CARGO_TARGET_DIR)"
(cd fuzz && cargo build --release --target "$triple" "${features[@]}" "${bins[@]}")
echo "fuzz: built in $(($(date +%s) - start)) s"

# The config target writes its input to a file per process: keep those under the target dir.
export TMPDIR="$CARGO_TARGET_DIR/tmp"
mkdir -p "$TMPDIR"

run_one() {
    local t=$1 bin="$CARGO_TARGET_DIR/$triple/release/$1" log="$CARGO_TARGET_DIR/$1.log"
    mkdir -p "fuzz/corpus/$t" "fuzz/corpus-run/$t" "fuzz/artifacts/$t"
    # Inputs that once failed a check (committed): read, never written to.
    local extra=()
    [ -d "fuzz/regressions/$t" ] && extra=("fuzz/regressions/$t")
    local rc=0
    # shellcheck disable=SC2086 # FUZZ_ARGS is a list of flags
    "$bin" "fuzz/corpus-run/$t" "fuzz/corpus/$t" "${extra[@]}" \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
        -artifact_prefix="fuzz/artifacts/$t/" -print_final_stats=1 ${FUZZ_ARGS:-} \
        >"$log" 2>&1 || rc=$?
    echo "$rc" >"$CARGO_TARGET_DIR/$t.rc"
}

# Targets run side by side, FUZZ_JOBS at a time (default: the number of cores).
jobs_max="${FUZZ_JOBS:-$(nproc)}"
running=0
for t in "${targets[@]}"; do
    rm -f "$CARGO_TARGET_DIR/$t.rc"
    run_one "$t" &
    running=$((running + 1))
    if [ "$running" -ge "$jobs_max" ]; then
        wait -n || true
        running=$((running - 1))
    fi
done
wait
failed=()
for t in "${targets[@]}"; do
    log="$CARGO_TARGET_DIR/$t.log"
    rc=$(cat "$CARGO_TARGET_DIR/$t.rc" 2>/dev/null || echo missing)
    if [ "$rc" = 0 ]; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
        last=$(grep -E '^#[0-9]+' "$log" | tail -1 | tr -s ' \t' ' ')
        echo "fuzz: $t ok: ${runs:-?} runs in ${secs} s; last: ${last:-none}"
    else
        echo "fuzz: $t FAILED (exit $rc, log $log):"
        tail -n 40 "$log"
        ls -l "fuzz/artifacts/$t/" || true
        failed+=("$t")
    fi
done
echo "fuzz: total $(($(date +%s) - start)) s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: crashes in: ${failed[*]}" >&2
    exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran without a crash"
