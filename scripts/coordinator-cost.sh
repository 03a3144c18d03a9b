#!/bin/bash
# scripts/coordinator-cost.sh SCALE_BIN AGENTS [SECONDS]: runs the scale example with the coordinator in its own
# process and, once rounds run, counts over SECONDS the coordinator's CPU, syscalls and rounds.
B=$1; N=$2; S=${3:-5}
OUT=$(mktemp)
$B --agents $N --rounds 100000 --warmup 10 --coordinator-process >$OUT 2>&1 &
SP=$!
for i in $(seq 1 600); do grep -q "rounds began" $OUT && break; sleep 0.2; done
P=$(pgrep -n -f "drum-coordinator serve" -P $SP)
sleep 2
PORT=$(ss -ltnp | grep "pid=$P," | awk '{print $4}' | head -1)
it() { curl -s http://$PORT/metrics | grep -E "^drum_coordinator_rounds_total" | awk '{print $2}'; }
L=$(cut -d' ' -f1 /proc/loadavg)
R0=$(it)
perf stat -x, -e task-clock,context-switches,syscalls:sys_enter_sendmsg,syscalls:sys_enter_recvmmsg,syscalls:sys_enter_recvmsg,syscalls:sys_enter_futex,syscalls:sys_enter_epoll_wait -p $P -o $OUT.perf -- sleep $S
R1=$(it)
Q=$(curl -s http://$PORT/metrics | grep 'round_recent_seconds{quantile="0.5"}' | awk '{print $2*1000}')
# The coordinator is the scale example's child and outlives a SIGTERM to it, which also
# skips the example's removal of its temporary directory (the coordinator's config's): end
# both and remove it.
CONF=$(tr '\0' '\n' < /proc/$P/cmdline | grep 'coordinator.toml$')
kill $P $SP; wait $SP 2>/dev/null
case "$CONF" in /tmp/.tmp*/coordinator.toml) rm -rf "$(dirname "$CONF")" ;; esac
R=$((R1-R0))
awk -F, -v r=$R -v n=$N -v l=$L -v q=$Q '
  /task-clock/ {cpu=$1}
  /context-switches/ {cs=$1}
  /sendmsg/ {s=$1} /recvmmsg/ {rm=$1} /sys_enter_recvmsg/ {rv=$1} /futex/ {fx=$1} /epoll_wait/ {ep=$1}
  END { ar=r*n; printf "agents %d load %s rounds %d p50 %.1fms | cpu/agent-round %.2f us | per agent-round: sendmsg %.2f recvmmsg %.3f futex %.2f ctxsw %.2f epoll %.2f\n", n, l, r, q, cpu*1000/ar, s/ar, rm/ar, fx/ar, cs/ar, ep/ar }' $OUT.perf
rm -f $OUT $OUT.perf
