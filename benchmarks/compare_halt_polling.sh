#!/usr/bin/env bash
# Command latency with a VM guest's halt polling off and on, in turns (docs/benchmarks.md, round 8).
#
#   sudo benchmarks/compare_halt_polling.sh [RUNS] [OUT_DIR]   # default 6, bench-results/haltpoll
#
# On a KVM guest whose cpuidle driver is haltpoll, `guest_halt_poll_ns` says how long an idle
# vCPU polls for work before it halts (a halt is a VM exit, and waking a halted vCPU costs an
# interrupt through the host). This runs `kvsidecar bench latency`, unpinned and `--pin`, RUNS
# times with the parameter at 0 (no polling) and at 200000 ns (the kernel's default), in turns, so
# both settings share the machine's background load. It needs root and the haltpoll module; it
# puts the parameter back as it found it, however it ends. Each run's JSON records the setting
# it ran under (machine.cpu_idle).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-6}
OUT=${2:-bench-results/haltpoll}
PARAM=/sys/module/haltpoll/parameters/guest_halt_poll_ns
PYTHON=${PYTHON:-.venv/bin/python}
if [[ ! -w $PARAM ]]; then
    echo "compare_halt_polling: $PARAM is missing or not writable (needs root on a haltpoll guest)" >&2
    exit 2
fi
ORIGINAL=$(cat "$PARAM")
trap 'echo "$ORIGINAL" > "$PARAM"' EXIT
mkdir -p "$OUT"
for run in $(seq "$RUNS"); do
    for poll in 0 200000; do
        echo "$poll" > "$PARAM"
        for pin in "" --pin; do
            name="latency${pin:+-pinned}-poll$poll-$run"
            "$PYTHON" -m kvsidecar.cli bench latency $pin --no-progress --json "$OUT/$name.json" \
                > "$OUT/$name.txt"
            echo "$name: $(grep 'blocking client: 1-block move, 1 layer p50 .*blocking pyzmq echo p50' \
                "$OUT/$name.txt" | awk -F'|' '{print $3 "µs, ratio" $8}')"
        done
    done
done
