#!/usr/bin/env bash
# GPU check, made to run once, unattended, on a fresh CUDA machine with a copy of this repo.
#
#   benchmarks/gpu_check.sh [OUT_DIR]        # default bench-results/gpu
#
# Steps, each with its own time limit (the whole script ends within 8 minutes):
#   1. environment: GPUs, driver, limits (printed for diagnosis)
#   2. python: a python whose torch sees CUDA ($PYTHON, python3, /opt/torch/.venv/bin/python3,
#      or a new .venv-gpu with `pip install torch`), plus the packages kvsidecar needs, installed
#      into .gpu-site (from the package index, or offline from $KVSIDECAR_WHEELS or ./.whl)
#   3. checks: `pytest -m gpu` (tests/memory/test_gpu.py, tests/memory/test_memory.py, tests/core/test_mover.py): one PASS/FAIL
#      line per check, with the failure's message; among them the vLLM connector's GPU path
#      (vLLM 0.31+'s [B, H, N, K+V] cache views registered through the connector, a store sent
#      while a kernel still writes its blocks, a load and a pull, each ordered by its event)
#   4. bandwidth: `kvsidecar bench gpu` (daemon offload/onboard/engine-to-engine against the
#      worker's own torch copies): one RATIO line per path
#
# Everything it prints also goes to OUT_DIR/gpu_check.log (pytest's full output to pytest.txt,
# its results to junit.xml, the benchmark to bench.txt and gpu.json). Exit 0 only if every check
# passed and the benchmark ran. Figures belong in docs/benchmarks.md with the commit and date.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${1:-bench-results/gpu}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
START=$(date +%s)
FAILED=0
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}

say() { echo "gpu_check [$(( $(date +%s) - START ))s]: $*"; }
result() { # PASS|FAIL NAME [DETAIL]
  echo "$1 $2${3:+: $3}"
  [ "$1" = PASS ] || FAILED=$((FAILED + 1))
}
finish() {
  say "done in $(( $(date +%s) - START )) s, $FAILED failed; results in $OUT"
  [ "$FAILED" -eq 0 ]
  exit $?
}

say "== 1. environment ($(git rev-parse --short HEAD 2>/dev/null || echo 'no git'), $(date -u +%FT%TZ))"
uname -a
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used \
  --format=csv 2>&1 || say "nvidia-smi failed"
echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>} PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-<unset>}"
echo "ulimit -n: $(ulimit -n) (hard $(ulimit -Hn)); nproc $(nproc); load $(cut -d' ' -f1-3 /proc/loadavg)"
ls -l /dev/shm 2>&1 | head -3; df -h /dev/shm /tmp 2>&1 | tail -2
ldconfig -p 2>/dev/null | grep -m2 libcuda.so || say "libcuda.so not in the linker cache"

say "== 2. python with a CUDA torch"
# GPU_CHECK_ANY_TORCH=1 accepts a CPU torch: a dry run of this script's own steps, off a GPU.
cuda_ok() {
  "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() or '${GPU_CHECK_ANY_TORCH:-}' else 1)" \
    >/dev/null 2>&1
}
PY=""
for cand in "${PYTHON:-}" python3 /opt/torch/.venv/bin/python3 .venv/bin/python .venv-gpu/bin/python; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && cuda_ok "$cand" && { PY=$(command -v "$cand"); break; }
done
if [ -z "$PY" ]; then
  say "no python here has a CUDA torch: making .venv-gpu and installing torch (a CUDA build on Linux)"
  python3 -m venv .venv-gpu && timeout 300 .venv-gpu/bin/python -m pip install -q --progress-bar off torch numpy \
    && cuda_ok .venv-gpu/bin/python && PY=$ROOT/.venv-gpu/bin/python
fi
if [ -z "$PY" ]; then
  result FAIL python "no python with a torch that sees CUDA, and none could be installed"
  finish
fi
"$PY" - <<'PY'
import sys, torch
print(f"python {sys.version.split()[0]} at {sys.executable}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, uuid {p.uuid}")
if torch.cuda.is_available():
    print("allocator backend:", torch.cuda.memory.get_allocator_backend())
PY
# kvsidecar runs from this checkout (PYTHONPATH); what the python lacks goes into .gpu-site.
need=()
for pair in zmq:pyzmq msgspec:msgspec numpy:numpy uvloop:uvloop prometheus_client:prometheus-client \
  pytest:pytest pytest_timeout:pytest-timeout pytest_asyncio:pytest-asyncio hypothesis:hypothesis; do
  "$PY" -c "import ${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  say "installing into .gpu-site: ${need[*]}"
  wheels=${KVSIDECAR_WHEELS:-.whl}
  pipi=("$PY" -m pip install -q --disable-pip-version-check --no-deps --target .gpu-site)
  timeout 180 "${pipi[@]}" "${need[@]}" \
    || { [ -d "$wheels" ] && "${pipi[@]}" --no-index --find-links "$wheels" "${need[@]}"; } \
    || say "could not install ${need[*]} (no index reachable, no wheels in $wheels)"
fi
export PYTHONPATH="$ROOT:$ROOT/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import kvsidecar.daemon.server, kvsidecar.client' 2>&1; then
  result FAIL python "kvsidecar does not import (missing packages above)"
  finish
fi
result PASS python "$PY"

say "== 3. checks (pytest -m gpu; 300 s at most)"
timeout -k 10 300 "$PY" -m pytest -m gpu -p no:cacheprovider -q -rfE --timeout 240 \
  --junitxml "$OUT/junit.xml" tests/memory/test_gpu.py tests/memory/test_memory.py tests/core/test_mover.py \
  >"$OUT/pytest.txt" 2>&1
status=$?
tail -n 25 "$OUT/pytest.txt"
if [ -s "$OUT/junit.xml" ]; then
  while IFS= read -r line; do
    echo "$line"
    # On a GPU a skipped GPU check did not run: that is a failure too (not in a dry run).
    case $line in FAIL*) FAILED=$((FAILED + 1)) ;; SKIP*) [ -n "${GPU_CHECK_ANY_TORCH:-}" ] || FAILED=$((FAILED + 1)) ;; esac
  done < <("$PY" - "$OUT/junit.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
for case in cases:
    name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
    bad = case.find("failure") if case.find("failure") is not None else case.find("error")
    if bad is not None:
        text = (bad.get("message") or bad.text or "").strip().replace("\n", " ")
        print(f"FAIL {name}: {text[:400]}")
    elif case.find("skipped") is not None:
        print(f"SKIP {name}: {case.find('skipped').get('message', '')}")
    else:
        print(f"PASS {name} ({float(case.get('time', 0)):.1f} s)")
PY
  )
else
  result FAIL pytest "exit $status and no junit.xml (timed out or crashed; see $OUT/pytest.txt)"
fi
[ "$status" -eq 0 ] || [ "$status" -eq 1 ] || result FAIL pytest "exit $status"

say "== 4. bandwidth against in-process copies (kvsidecar bench gpu; 150 s at most)"
timeout -k 10 150 "$PY" -m kvsidecar.cli bench gpu --no-progress --repeat 5 \
  --json "$OUT/gpu.json" >"$OUT/bench.txt" 2>&1
bench=$?
cat "$OUT/bench.txt"
if [ "$bench" -eq 0 ] && [ -s "$OUT/gpu.json" ]; then
  "$PY" - "$OUT/gpu.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(f"RATIO {r['name']}: {r['value']:.2f} {r['unit']} vs {r['baseline']} "
          f"{r['baseline_value']:.2f} = {r['ratio']:.2f}x")
PY
  result PASS bench "gpu.json written"
else
  result FAIL bench "exit $bench (see $OUT/bench.txt)"
fi
finish
