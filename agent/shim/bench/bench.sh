#!/usr/bin/env bash
# Benchmarks of the shim over softrnic, governed by a real `drum-agent --local`; prints
# markdown tables (docs/shim.md quotes them). Needs root (softrnic's namespaces), perftest.
#   sudo agent/shim/bench/bench.sh [TARGET_DIR] [SECTIONS...]
# TARGET_DIR defaults to target/release and must hold softrnic, drum-agent and
# libdrum_shim.so (cargo build --release --workspace). Sections: overhead (shim + agent
# granting line rate vs no shim; polling and event-driven latency), isolation (foreground latency next to a greedy
# background, with and without DRUM), topk (64 QPs on a 20-entry QP cache), pacing (grants
# of 10/30/60 % of line rate), compare (this build's shim against another build's,
# OLD_SHIM=path/to/libdrum_shim.so, both under the agent granting line rate, alternating; for a
# change that must cost nothing, copy the old build's libdrum_shim.so aside before building the
# new one). Every run has its own run directory, torn down on exit, and
# every program a timeout. Ratios are from one run: these machines are shared and noisy.
# Environment: BG_RATE (isolation: the background's grant, default 0.5), FG_EXTRA (extra
# foreground flags, e.g. -e), ISO_UP (extra `softrnic up` flags for isolation), ISO_GBPS
# (isolation: the line rate of NIC and agent, default 1).
set -eu
B=${1:-target/release}
[ $# -gt 0 ] && shift
SECTIONS=${*:-overhead isolation topk pacing}
B=$(cd "$B" && pwd)
RUN=$(mktemp -d /tmp/drum-shim-bench.XXXXXX)
AGENT_PID=
cleanup() {
	[ -n "$AGENT_PID" ] && kill "$AGENT_PID" 2>/dev/null && wait "$AGENT_PID" 2>/dev/null
	"$B/softrnic" --run-dir "$RUN" down >/dev/null 2>&1 || true
	rm -rf "$RUN"
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM
T="timeout 180"

up() { "$B/softrnic" --run-dir "$RUN" up "$@" >/dev/null; }
addr() { "$B/softrnic" --run-dir "$RUN" addr "$1"; }
# ex HOST APP|- PROGRAM ARGS...: PROGRAM on HOST; under the shim as app APP unless APP is "-".
ex() {
	h=$1 app=$2
	shift 2
	if [ "$app" = - ]; then
		env -u LD_PRELOAD $T "$B/softrnic" --run-dir "$RUN" exec --host "$h" -- "$@"
	else
		LD_PRELOAD="${SHIM:-$B/libdrum_shim.so}" DRUM_APP=$app DRUM_AGENT_SOCKET="$RUN/agent.sock" \
			$T "$B/softrnic" --run-dir "$RUN" exec --host "$h" -- "$@"
	fi
}
# pair APP PROGRAM ARGS...: server on h1, client on h2; prints the client's output.
pair() {
	app=$1
	shift
	ex h1 "$app" "$@" >/dev/null 2>&1 &
	sp=$!
	sleep 0.4
	ex h2 "$app" "$@" "$(addr h1)" 2>&1 || true
	wait $sp || true
}
# agent LINE_RATE_GBPS [TOML...]: (re)starts the local agent with these pins.
agent() {
	rate=$1
	shift
	[ -n "$AGENT_PID" ] && kill "$AGENT_PID" 2>/dev/null && wait "$AGENT_PID" 2>/dev/null || true
	{
		printf '[shim]\nsocket = "agent.sock"\nline_rate_gbps = %s\n' "$rate"
		[ $# -gt 0 ] && printf '%s\n' "$@"
	} >"$RUN/agent.toml"
	rm -f "$RUN/agent.sock"
	DRUM_LOG=warn "$B/drum-agent" --local "$RUN/agent.toml" &
	AGENT_PID=$!
	for _ in $(seq 100); do [ -S "$RUN/agent.sock" ] && return; sleep 0.05; done
	echo "agent did not start" >&2
	exit 1
}
bw() { awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+/ { print $4; exit }'; }
typ() { awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+/ { print $5; exit }'; }
p99() { awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+/ { print $8; exit }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }'; }
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

echo "# drum-shim benchmarks, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for sec in $SECTIONS; do
	echo
	case $sec in
	overhead)
		# The governed path with a grant in force (line rate: the limiter admits everything
		# on softrnic, which moves far less than 25 Gb/s) against no shim at all, alternating,
		# five runs each; medians.
		up --hosts 2
		agent 25 '[shim.apps.full]' 'rate = 1.0'
		echo "## overhead: shim + agent granting line rate vs no shim (5 alternating runs each, medians)"
		echo "| measure | without | with | ratio |"
		echo "| --- | --- | --- | --- |"
		wb0= wb1= lt0= lt1= le0= le1=
		for _ in 1 2 3 4 5; do
			wb0="$wb0 $(pair - ib_write_bw -x 0 -s 65536 -n 2000 | bw)"
			wb1="$wb1 $(pair full ib_write_bw -x 0 -s 65536 -n 2000 | bw)"
			lt0="$lt0 $(pair - ib_send_lat -x 0 -n 2000 | typ)"
			lt1="$lt1 $(pair full ib_send_lat -x 0 -n 2000 | typ)"
			le0="$le0 $(pair - ib_send_lat -x 0 -n 2000 -e | typ)"
			le1="$le1 $(pair full ib_send_lat -x 0 -n 2000 -e | typ)"
		done
		a=$(echo "$wb0" | median) b=$(echo "$wb1" | median)
		echo "| ib_write_bw 64 KiB, MiB/s (runs: $wb0 / $wb1) | $a | $b | $(ratio "$b" "$a") |"
		a=$(echo "$lt0" | median) b=$(echo "$lt1" | median)
		echo "| ib_send_lat 2 B typical, us (runs: $lt0 / $lt1) | $a | $b | $(ratio "$b" "$a") |"
		a=$(echo "$le0" | median) b=$(echo "$le1" | median)
		echo "| ib_send_lat -e 2 B typical, us (runs: $le0 / $le1) | $a | $b | $(ratio "$b" "$a") |"
		;;
	compare)
		# The same governed path with two builds of the shim (OLD_SHIM, then this one),
		# alternating, seven runs each; medians.
		[ -n "${OLD_SHIM:-}" ] || { echo "compare: set OLD_SHIM to the other build's libdrum_shim.so" >&2; exit 1; }
		up --hosts 2
		agent 25 '[shim.apps.full]' 'rate = 1.0'
		echo "## compare: OLD_SHIM ($OLD_SHIM) vs this build ($B), agent granting line rate (7 alternating runs each, medians)"
		echo "| measure | old | new | ratio |"
		echo "| --- | --- | --- | --- |"
		wb0= wb1= lt0= lt1= le0= le1=
		for _ in 1 2 3 4 5 6 7; do
			wb0="$wb0 $(SHIM=$OLD_SHIM pair full ib_write_bw -x 0 -s 65536 -n 2000 | bw)"
			wb1="$wb1 $(pair full ib_write_bw -x 0 -s 65536 -n 2000 | bw)"
			lt0="$lt0 $(SHIM=$OLD_SHIM pair full ib_send_lat -x 0 -n 2000 | typ)"
			lt1="$lt1 $(pair full ib_send_lat -x 0 -n 2000 | typ)"
			le0="$le0 $(SHIM=$OLD_SHIM pair full ib_send_lat -x 0 -n 2000 -e | typ)"
			le1="$le1 $(pair full ib_send_lat -x 0 -n 2000 -e | typ)"
		done
		a=$(echo "$wb0" | median) b=$(echo "$wb1" | median)
		echo "| ib_write_bw 64 KiB, MiB/s (runs: $wb0 / $wb1) | $a | $b | $(ratio "$b" "$a") |"
		a=$(echo "$lt0" | median) b=$(echo "$lt1" | median)
		echo "| ib_send_lat 2 B typical, us (runs: $lt0 / $lt1) | $a | $b | $(ratio "$b" "$a") |"
		a=$(echo "$le0" | median) b=$(echo "$le1" | median)
		echo "| ib_send_lat -e 2 B typical, us (runs: $le0 / $le1) | $a | $b | $(ratio "$b" "$a") |"
		;;
	isolation)
		# Foreground ib_send_lat (2 B) h2 -> h1 next to a greedy background ib_write_bw h2 -> h1:
		# 4 QPs, 64 KiB messages, queue depth 128, posting lists of 32. With DRUM the agent
		# grants the background half the line and one active QP; the foreground is not
		# limited. Three foreground runs per case; medians.
		g=${ISO_GBPS:-1}
		up --hosts 2 --line-rate-gbps "$g" ${ISO_UP:-}
		agent "$g" '[shim.apps.bg]' "rate = ${BG_RATE:-0.5}" 'max_active_qps = 1' '[shim.apps.fg]'
		echo "## isolation: foreground ib_send_lat next to a greedy ib_write_bw (--line-rate-gbps $g ${ISO_UP:-}; medians of 3 runs)"
		echo "| case | fg typical us | fg 99 % us | p99 / unloaded | runs (typical/p99) |"
		echo "| --- | --- | --- | --- | --- |"
		base=
		for case in unloaded without-drum with-drum; do
			app=- fg=-
			[ $case = with-drum ] && app=bg fg=fg
			if [ $case != unloaded ]; then
				ex h1 $app ib_write_bw -x 0 -q 4 -s 65536 -D 14 -p 18600 -l 32 -t 128 >/dev/null 2>&1 &
				cs=$!
				sleep 0.4
				ex h2 $app ib_write_bw -x 0 -q 4 -s 65536 -D 14 -p 18600 -l 32 -t 128 "$(addr h1)" >/dev/null 2>&1 &
				cc_=$!
				sleep 1.5
			fi
			ts= ps= runs=
			for _ in 1 2 3; do
				o=$(pair $fg ib_send_lat -x 0 -n 5000 -p 18601 ${FG_EXTRA:-})
				t=$(echo "$o" | typ) p=$(echo "$o" | p99)
				ts="$ts $t" ps="$ps $p" runs="$runs $t/$p"
			done
			t=$(echo "$ts" | median) p=$(echo "$ps" | median)
			[ $case = unloaded ] && base=$p
			echo "| $case | $t | $p | $(ratio "$p" "$base") |$runs |"
			if [ $case != unloaded ]; then
				wait $cc_ || true
				wait $cs || true
			fi
		done
		;;
	topk)
		up --hosts 2 --line-rate-gbps 0.1 --mtu 1024 --qp-cache 20 --qp-miss-ns 80000
		agent 0.1 '[shim.apps.gated]' 'max_active_qps = 16'
		echo "## top-k: ib_write_bw -q 64 -s 1024 on a NIC caching 20 QP contexts (--line-rate-gbps 0.1 --mtu 1024 --qp-miss-ns 80000)"
		echo "| case | MiB/s |"
		echo "| --- | --- |"
		a=$(pair - ib_write_bw -x 0 -q 64 -s 1024 -n 62 | bw)
		b=$(pair gated ib_write_bw -x 0 -q 64 -s 1024 -n 62 | bw)
		echo "| no shim | $a |"
		echo "| 16 active QPs granted | $b |"
		echo "| ratio | $(ratio "$b" "$a") |"
		;;
	pacing)
		up --hosts 2 --line-rate-gbps 1
		agent 1 '[shim.apps.r10]' 'rate = 0.1' '[shim.apps.r30]' 'rate = 0.3' '[shim.apps.r60]' 'rate = 0.6'
		echo "## pacing accuracy: ib_write_bw -s 65536 -n 1000 granted a share of 1 Gb/s"
		echo "| grant | expected MiB/s | measured MiB/s | ratio |"
		echo "| --- | --- | --- | --- |"
		for g in 10 30 60; do
			want=$(awk -v g=$g 'BEGIN { printf "%.2f", g / 100 * 1e9 / 8 / 1048576 }')
			got=$(pair r$g ib_write_bw -x 0 -s 65536 -n 1000 | bw)
			echo "| $g % | $want | $got | $(ratio "$got" "$want") |"
		done
		;;
	*)
		echo "unknown section $sec" >&2
		exit 2
		;;
	esac
done
