#!/bin/sh
# Incast through the receive port (docs/softrnic-congestion.md): SENDERS ib_write_bw senders
# on h2, h3, ... into h1, at RATE Gb/s (default 1) for DUR seconds (default 5); prints each
# sender's MiB/s, the aggregate, h1's receive-port counters and the senders' retransmissions
# and pauses received. Usage: incast.sh DIR SENDERS [more options of softrnic up], DIR holding
# a `softrnic` and its provider `libsoftrnic_provider.so`. Needs root.
set -u
D=$1; N=$2; shift 2
S="$D/softrnic"; RUN=$(mktemp -d /tmp/softrnic-incast.XXXXXX)
H=$((N + 1))
"$S" --run-dir "$RUN" up --hosts $H --line-rate-gbps ${RATE:-4} "$@" >/dev/null || exit 1
A=$("$S" --run-dir "$RUN" addr h1)
i=1
while [ $i -le $N ]; do
  "$S" --run-dir "$RUN" exec --host h1 -- timeout 60 ib_write_bw -x 0 -s 65536 -D ${DUR:-5} -p $((18600 + i)) >/dev/null 2>&1 &
  i=$((i + 1))
done
sleep 0.5
i=1
while [ $i -le $N ]; do
  "$S" --run-dir "$RUN" exec --host h$((i + 1)) -- timeout 60 ib_write_bw -x 0 -s 65536 -D ${DUR:-5} -p $((18600 + i)) "$A" > "$RUN/c$i.out" 2>&1 &
  i=$((i + 1))
done
wait
tot=0
i=1
while [ $i -le $N ]; do
  v=$(awk '/^ *[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+/ { print $4; exit }' "$RUN/c$i.out")
  echo "sender h$((i + 1)): ${v:-failed} MiB/s"
  tot=$(echo "$tot + ${v:-0}" | bc)
  i=$((i + 1))
done
echo "aggregate: $tot MiB/s"
sleep 0.5
"$S" --run-dir "$RUN" stats h1 | grep -E "rx_port|rx_queue|rx_ecn|rx_pause|rx_port_dropped|retransmits|dcqcn_cnps_sent"
for h in $(seq 2 $H); do "$S" --run-dir "$RUN" stats h$h | grep -E "pauses_received|retransmits|dcqcn_cnps_received|dcqcn_rate_decreases" | tr '\n' ' ' | sed "s/^/h$h: /"; echo; done
"$S" --run-dir "$RUN" down >/dev/null
rm -rf "$RUN"
