#!/usr/bin/env bash
# GPU check for a CUDA machine, in under 8 minutes: the GPU-only tests, then `kvsidecar bench gpu`
# (offload/onboard through the daemon vs a torch pinned copy in the worker; engine-to-engine
# moves through CUDA IPC vs an in-process device copy; every result checked).
#
#   benchmarks/gpu_check.sh [OUT_DIR]      # default bench-results/gpu; PYTHON=... to choose python
#
# Writes OUT_DIR/pytest.txt, OUT_DIR/bench.txt and OUT_DIR/gpu.json. Exits non-zero if there is no
# CUDA device, a test fails, or the benchmark fails. Each step has its own time limit
# (270 s + 180 s, plus start-up), so the whole check ends within 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-bench-results/gpu}
mkdir -p "$OUT"
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}

"$PY" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}); "
             "run this on a GPU machine")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY

echo "== pytest -m gpu"
status=0
timeout -k 10 270 "$PY" -m pytest -m gpu -q -p no:cacheprovider --timeout 120 \
    2>&1 | tee "$OUT/pytest.txt" || status=$?
# pytest's 5 = nothing collected: say so, but it is not a failure of the code.
if [ "$status" -eq 5 ]; then echo "gpu_check: no gpu-marked tests collected"; status=0; fi

echo "== kvsidecar bench gpu"
bench=0
timeout -k 10 180 "$PY" -m kvsidecar.cli bench gpu --no-progress --json "$OUT/gpu.json" \
    2>&1 | tee "$OUT/bench.txt" || bench=$?

echo "gpu_check: pytest exit $status, bench exit $bench; results in $OUT"
[ "$status" -eq 0 ] && [ "$bench" -eq 0 ]
