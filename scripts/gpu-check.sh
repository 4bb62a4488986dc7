#!/usr/bin/env bash
# One prepared GPU check, a few minutes at most: every gpu-marked test, then the GPU
# benchmarks, with logs and results (JSON + markdown) under the folder given (default $OUT).
#
#   here:            bash scripts/gpu-wheels.sh          # once: wheels into .whl/
#   on the GPU box:  make gpu-check OUT=$OUT              # carry .whl
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu-check: no CUDA device is visible to $PY (torch.cuda.is_available() is False); run it on a GPU machine" >&2
    exit 2
fi
# What the machine lacks comes from carried wheels, installed beside its own torch.
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/autotune-site .whl/*.whl || exit 2
    export PYTHONPATH="$PWD:/tmp/autotune-site${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
status=0
"$PY" - <<'PYEOF' | tee "$OUT/environment.txt"
import torch
print("device:", torch.cuda.get_device_name(0), "capability:", torch.cuda.get_device_capability(0))
print("torch:", torch.__version__, "cuda:", torch.version.cuda)
PYEOF

echo "== gpu tests" | tee "$OUT/tests.log"
"$PY" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" --timeout 300 \
    --junitxml="$OUT/tests.xml" tests 2>&1 | tee -a "$OUT/tests.log" || status=1

echo "== amp table" | tee "$OUT/amp_table.log"
"$PY" benchmarks/amp_table.py --json "$OUT/amp_table.json" --markdown "$OUT/amp_table.md" \
    2>&1 | tee -a "$OUT/amp_table.log" || status=1

echo "== probe overhead" | tee "$OUT/probe_overhead.log"
"$PY" benchmarks/probe_overhead.py --seconds 10 --repeats 1 --json "$OUT/probe_overhead.json" \
    2>&1 | tee -a "$OUT/probe_overhead.log" || status=1

echo "gpu-check: results in $OUT (status $status)"
exit $status
