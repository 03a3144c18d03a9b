#!/bin/sh
# A/B of two softrnic builds in one sitting: ib_write_bw 64 KiB on one host (h1 <- h1, the
# NIC's loopback) and across namespaces (h1 <- h2), the builds alternated ROUNDS times.
# Usage: ab.sh DIR_A DIR_B  (each holding a `softrnic` and its provider `libsoftrnic_provider.so`)
# Environment: N (iterations, default 20000), ROUNDS (default 4), RATE (the NIC model's line
# rate in Gb/s, default 200: a comparison of the emulator's speed must not be capped by the
# modelled line, whose default of 25 Gb/s is about 3 GB/s). Needs root.
set -eu
[ $# -eq 2 ] || { echo "usage: $0 DIR_A DIR_B" >&2; exit 2; }
N=${N:-20000}
ROUNDS=${ROUNDS:-4}
RATE=${RATE:-200}
RUN=$(mktemp -d /tmp/softrnic-ab.XXXXXX)
cleanup() {
	for d in "$1" "$2"; do "$d/softrnic" --run-dir "$RUN" down >/dev/null 2>&1 || true; done
	rm -rf "$RUN"
}
trap 'cleanup "$1" "$2"' EXIT
bw() { awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+/ { print $4; exit }'; }
echo "| round | build | h1 <- h1 MiB/s | h1 <- h2 MiB/s |"
echo "| --- | --- | --- | --- |"
r=1
while [ $r -le "$ROUNDS" ]; do
	for d in "$1" "$2"; do
		S="$d/softrnic"
		"$S" --run-dir "$RUN" up --hosts 2 --line-rate-gbps "$RATE" >/dev/null
		line="| $r | $d"
		for c in h1 h2; do
			"$S" --run-dir "$RUN" exec --host h1 -- timeout 60 ib_write_bw -x 0 -s 65536 -n "$N" >/dev/null 2>&1 &
			sp=$!
			sleep 0.4
			v=$("$S" --run-dir "$RUN" exec --host $c -- timeout 60 ib_write_bw -x 0 -s 65536 -n "$N" \
				"$("$S" --run-dir "$RUN" addr h1)" 2>&1 | bw || true)
			wait $sp || true
			line="$line | ${v:-failed}"
		done
		echo "$line |"
		"$S" --run-dir "$RUN" down >/dev/null
	done
	r=$((r + 1))
done
