#!/bin/sh
# softrnic benchmarks (docs/softrnic.md, "Performance"). Needs root, perftest, a C compiler.
#   sudo testbed/softrnic/bench/bench.sh [target/release/softrnic] [section...]
# Sections: speed (ib_write_bw 64 KiB vs memcpy, ib_send_lat), linerate (throughput against
# the configured line rate), knee (aggregate throughput vs active QPs, DRUM Fig. 2c),
# corunner (foreground latency vs a co-runner's batch size, DRUM Fig. 2a; environment
# FETCH_NS and FETCH_BATCH set its --wqe-fetch-ns and --wqe-fetch-batch). Default: all.
# Every run uses its own run directory, torn down on exit; every program has a timeout.
set -eu
B=${1:-target/release/softrnic}
[ $# -gt 0 ] && shift
SECTIONS=${*:-speed linerate knee corunner}
HERE=$(cd "$(dirname "$0")" && pwd)
RUN=$(mktemp -d /tmp/softrnic-bench.XXXXXX)
cleanup() { "$B" --run-dir "$RUN" down >/dev/null 2>&1 || true; }
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM
T="timeout 120"

up() { "$B" --run-dir "$RUN" up "$@" >/dev/null; }
addr() { "$B" --run-dir "$RUN" addr "$1"; }
ex() { h=$1; shift; $T "$B" --run-dir "$RUN" exec --host "$h" -- "$@"; }

# pair SERVER_HOST CLIENT_HOST PROGRAM ARGS...: server in the background, client in front;
# prints the client's output.
pair() {
	s=$1 c=$2
	shift 2
	ex "$s" "$@" >/dev/null 2>&1 &
	sp=$!
	sleep 0.4
	ex "$c" "$@" "$(addr "$s")" 2>&1 || true
	wait $sp || true
}

# The "BW average" column of perftest's result line.
bw() { awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+/ { print $4; exit }'; }
# The "t_typical" column of a latency result line (5th field).
typ() { awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+/ { print $5; exit }'; }
p99() { awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+/ { print $8; exit }'; }

echo "# softrnic benchmarks, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"

for sec in $SECTIONS; do
	case $sec in
	speed)
		# The emulator's own speed: a line of 200 Gb/s, so that the modelled line (25 Gb/s
		# by default, about 2.9 GiB/s of payload) does not cap what is measured.
		up --hosts 2 --line-rate-gbps 200
		cc -O2 -o "$RUN/memcpy_bw" "$HERE/memcpy_bw.c"
		mc=$("$RUN/memcpy_bw")
		echo "## speed (NIC model at --line-rate-gbps 200, else default; memcpy of 64 KiB blocks: $mc MiB/s)"
		# Both programs on one host (its NIC loops the traffic back), then across namespaces.
		for c in h1 h2; do
			wbw=$(pair h1 $c ib_write_bw -x 0 -s 65536 -n 5000 | bw)
			lat=$(pair h1 $c ib_send_lat -x 0 -n 5000)
			echo "h1 <- $c: ib_write_bw -s 65536 -n 5000: $wbw MiB/s = $(echo "$wbw $mc" | awk '{ printf "%.1f", 100 * $1 / $2 }') % of memcpy;" \
				"ib_send_lat -n 5000 (2 B): typical $(echo "$lat" | typ) us, 99 % $(echo "$lat" | p99) us"
		done
		;;
	linerate)
		echo "## line rate (--mtu 4096; payload share of the wire 4096/4186 = 97.8 %)"
		for g in 0.5 1 2; do
			up --hosts 2 --line-rate-gbps $g
			r=$(pair h1 h2 ib_write_bw -x 0 -s 65536 -n 2000 --report_gbits | bw)
			echo "line rate $g Gb/s: ib_write_bw $r Gb/s = $(echo "$r $g" | awk '{ printf "%.1f", 100 * $1 / ($2 * 4096 / 4186) }') % of the payload rate"
		done
		;;
	knee)
		# A scaled-down NIC so that the model, not the emulator's CPU, is the bottleneck:
		# 0.2 Gb/s, 1 KiB MTU (45 us per packet on the wire), 20 cached QP contexts, 40 us
		# per miss.
		echo "## aggregate throughput vs active QPs (--line-rate-gbps 0.2 --mtu 1024 --qp-cache 20 --qp-miss-ns 40000; ib_write_bw -s 1024)"
		echo "| QPs | MiB/s | QP-cache miss ratio (requester engine) |"
		echo "| --- | --- | --- |"
		up --hosts 2 --line-rate-gbps 0.2 --mtu 1024 --qp-cache 20 --qp-miss-ns 40000
		for q in 1 4 8 16 20 24 32 48 64; do
			n=$((4000 / q))
			[ $n -lt 20 ] && n=20
			h0=$("$B" --run-dir "$RUN" stats h2 | awk '/qp_cache_hits/ { print $2 }')
			m0=$("$B" --run-dir "$RUN" stats h2 | awk '/qp_cache_misses/ { print $2 }')
			r=$(pair h1 h2 ib_write_bw -x 0 -s 1024 -n $n -q $q | bw)
			sleep 0.5
			h1=$("$B" --run-dir "$RUN" stats h2 | awk '/qp_cache_hits/ { print $2 }')
			m1=$("$B" --run-dir "$RUN" stats h2 | awk '/qp_cache_misses/ { print $2 }')
			echo "| $q | $r | $(echo "$h0 $m0 $h1 $m1" | awk '{ d = ($3 - $1) + ($4 - $2); printf "%.2f", d ? ($4 - $2) / d : 0 }') |"
		done
		;;
	corunner)
		# Foreground: ib_write_lat h2 -> h1 (2 B). Co-runner: ib_write_bw h2 -> h1 on its own
		# QP, 64-byte messages posted BATCH per ibv_post_send (-l; queue 2 x BATCH, at least
		# 128, so a next list waits while one is sent). Both share h2's NIC (same engine, same
		# line). Small messages and a WQE fetch of FETCH_NS (default 50 us: a NIC scaled down
		# as in the knee section, so that the fetch unit, not the emulator's CPU, limits the
		# co-runner; with 20 us the batch-1 point was dominated by CPU contention) make the
		# co-runner fetch-bound: each list costs min(BATCH, FETCH_BATCH) x FETCH_NS on the
		# pipeline clock before any other QP's packet (FETCH_BATCH: --wqe-fetch-batch, default
		# the model's 64; 1 = fetching one work request at a time, the control). Last column:
		# work requests per fetch read on h2 while the foreground ran (its own are single).
		fns=${FETCH_NS:-50000}
		fb=${FETCH_BATCH:-64}
		echo "## foreground latency vs co-runner batch size (--line-rate-gbps 1 --wqe-fetch-ns $fns --wqe-fetch-batch $fb; fg ib_write_lat 2 B, co-runner ib_write_bw -s 64 -l BATCH)"
		echo "| co-runner batch | fg typical us | fg 99 % us | WQEs per fetch read (h2) |"
		echo "| --- | --- | --- | --- |"
		up --hosts 2 --line-rate-gbps 1 --wqe-fetch-ns "$fns" --wqe-fetch-batch "$fb"
		fetched() { "$B" --run-dir "$RUN" stats h2 | awk '/^wqe_fetch(es|_reads) / { printf "%s ", $2 }'; }
		for batch in none 1 8 32 64 128; do
			f0=$(fetched)
			if [ $batch != none ]; then
				depth=$((2 * batch > 128 ? 2 * batch : 128))
				ex h1 ib_write_bw -x 0 -s 64 -D 8 -p 18600 -l $batch -t $depth >/dev/null 2>&1 &
				cs=$!
				sleep 0.4
				ex h2 ib_write_bw -x 0 -s 64 -D 8 -p 18600 -l $batch -t $depth "$(addr h1)" >/dev/null 2>&1 &
				cc_=$!
				sleep 1.5
			fi
			o=$(pair h1 h2 ib_write_lat -x 0 -n 1000 -p 18601)
			f1=$(fetched)
			echo "| $batch | $(echo "$o" | typ) | $(echo "$o" | p99) | $(echo "$f0 $f1" | awk '{ printf "%.1f", ($4 - $2) ? ($3 - $1) / ($4 - $2) : 0 }') |"
			if [ $batch != none ]; then
				wait $cc_ || true
				wait $cs || true
			fi
		done
		;;
	*)
		echo "unknown section $sec" >&2
		exit 2
		;;
	esac
done
