#!/usr/bin/env bash
# One prepared GPU check in about 4 minutes: every gpu-marked test, the export tests against the
# real Lightning, transformers and accelerate, then the GPU benchmarks (amp_table, probe_overhead,
# a short trust run). Results as JSON and markdown in the folder given (default $OUT).
#
#   here, once:       PYTHON=.venv/bin/python bash scripts/gpu-wheels.sh   # wheels into .whl/
#   on the GPU box:   bash scripts/gpu-check.sh "$OUT"                      # with .whl carried
#
# Each stage runs under its own `timeout`, and all of them within GPU_CHECK_SECONDS (default
# 285), so a call limited to about 340 s leaves time to run it again. It writes at most seven
# files: summary.md, tests.log, benchmarks.log, amp_table.json, amp_table.md,
# probe_overhead.json and trust.json. Exit status: 0 when every stage passed, 1 when one failed
# or ran out of time, 2 when no CUDA device is visible.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
TOTAL="${GPU_CHECK_SECONDS:-285}"
# Every test file with gpu-marked tests (tests/test_gpu_check.py checks that none is missing);
# they run with -m gpu. The export tests run whole: CPU and GPU, against the real libraries.
GPU_TESTS=(tests/test_gpu.py tests/test_precision.py tests/test_probe.py tests/test_cuda_context.py
           tests/test_knobs.py tests/test_session.py tests/test_step.py tests/test_integrations.py)
EXPORT_TESTS=(tests/test_export.py)

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu-check: no CUDA device is visible to $PY (torch.cuda.is_available() is False); run it on a GPU machine" >&2
    exit 2
fi
# What the machine lacks comes from carried wheels, installed beside its own torch; carried
# versions come first on the import path.
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/autotune-site .whl/*.whl || exit 2
    export PYTHONPATH="$PWD:/tmp/autotune-site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu-check: no wheels in .whl/ (make them with scripts/gpu-wheels.sh and carry .whl)" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

SUMMARY="$OUT/summary.md"
TESTS_LOG="$OUT/tests.log"
BENCH_LOG="$OUT/benchmarks.log"
: >"$TESTS_LOG"
: >"$BENCH_LOG"
{
    echo "# gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    "$PY" - <<'PYEOF'
import platform
import torch
p = torch.cuda.get_device_properties(0)
print(f"- device: {torch.cuda.get_device_name(0)}, capability {p.major}.{p.minor}, "
      f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}, Python {platform.python_version()}")
PYEOF
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
    echo "| stage | status | seconds |"
    echo "|---|---|---|"
} >"$SUMMARY"

status=0
# stage NAME CAP LOG COMMAND...: run under min(CAP, time left), log to LOG, one summary row.
stage() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((TOTAL - SECONDS))
    local limit=$((cap < left ? cap : left))
    if ((limit < 10)); then
        echo "| $name | skipped: the check's $TOTAL s were spent | 0 |" >>"$SUMMARY"
        status=1
        return
    fi
    echo "== $name (limit ${limit}s)" | tee -a "$log"
    local began=$SECONDS rc
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    local verdict="passed"
    if ((rc == 124 || rc == 137)); then
        verdict="timed out after ${limit}s"
    elif ((rc != 0)); then
        verdict="failed (exit $rc)"
    fi
    ((rc == 0)) || status=1
    echo "| $name | $verdict | $((SECONDS - began)) |" >>"$SUMMARY"
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" --timeout 150)
stage "gpu tests" 130 "$TESTS_LOG" "${PYTEST[@]}" -m gpu "${GPU_TESTS[@]}"
stage "amp table" 110 "$BENCH_LOG" "$PY" benchmarks/amp_table.py --budget 60s --samples 10000 \
    --json "$OUT/amp_table.json" --markdown "$OUT/amp_table.md"
stage "export tests" 60 "$TESTS_LOG" "${PYTEST[@]}" "${EXPORT_TESTS[@]}"
stage "probe overhead" 45 "$BENCH_LOG" "$PY" benchmarks/probe_overhead.py --seconds 5 --repeats 1 \
    --json "$OUT/probe_overhead.json"
if [[ -f benchmarks/trust.py ]]; then
    stage "trust" 60 "$BENCH_LOG" "$PY" benchmarks/trust.py --budget 30s --json "$OUT/trust.json"
else
    echo "| trust | skipped: benchmarks/trust.py does not exist yet | 0 |" >>"$SUMMARY"
fi

{
    echo
    if [[ -f "$OUT/amp_table.md" ]]; then
        echo "## amp_table"
        echo
        cat "$OUT/amp_table.md"
    fi
    # The goals each benchmark printed, as it printed them.
    echo
    echo '```'
    grep -E '^(tuned_vs_fp32|tuned_vs_amp|amp_memory_saving_same_batch|tuned_loss_gap|timed share|check cost|check_seconds)' \
        "$BENCH_LOG" || true
    # pytest's closing lines: counts, failures and skips.
    grep -E '^(FAILED|ERROR|SKIPPED|XFAIL|XPASS)|^[0-9]+ .* in [0-9.]+s' "$TESTS_LOG" || true
    echo '```'
} >>"$SUMMARY"
echo "gpu-check: status $status in $SECONDS s; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $status
