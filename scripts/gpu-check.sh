#!/usr/bin/env bash
# The prepared GPU check, split into calls that each fit one short session on a CUDA machine:
# every gpu-marked test, the export tests against the real Lightning, transformers and
# accelerate, then the GPU benchmarks (amp_table, probe_overhead, a short trust run).
#
#   here, once:          PYTHON=.venv/bin/python bash scripts/gpu-wheels.sh   # wheels into .whl/
#   here, any time:      bash scripts/gpu-check.sh --plan     # the calls, their caps and totals
#   on the GPU machine:  bash scripts/gpu-check.sh CALL [OUT]  # the call carries .whl
#
# CALL is one of tests-core, tests-integrations and bench (in that order, one right after
# another on one machine), or all: every stage in one go, for a machine of your own. The plan
# is printed first; --plan (or GPU_CHECK_DRY_RUN=1) prints it and the commands a call would
# run, and runs nothing: no GPU, no wheels needed. Each stage runs under its own `timeout`,
# all of a call's stages within the call's total. Results go to OUT/CALL (OUT defaults to
# $OUT, else gpu-check-out): summary.md, tests.log or benchmarks.log, and the benchmarks'
# amp_table.json, amp_table.md, probe_overhead.json and trust.json.
#
# Exit status: 0 when every stage passed, 1 when one failed or ran out of time, 2 when the call
# cannot start: an unknown call, no CUDA device, or no wheels where the machine lacks
# autotune's dependencies (wheels come from GPU_CHECK_WHEELS, default .whl).
set -uo pipefail
cd "$(dirname "$0")/.."

# ---- the plan: every number the check keeps to --------------------------------------------
SESSION=900    # device seconds one session has, start-up, idle time and every call counted
START_UP=75    # seconds one machine start takes, the tree sent (37-63 s on 2026-12-04; allowance)
PER_CALL=10    # per call: the tree and .whl/ sent, the files back, the step to the next call
SETUP=20       # per call: the wheels installed, autotune imported, the CUDA device checked
SETUP_GUARD=60 # ... ended past this (a hang); a slow setup leaves the stages less of the total
CALL_LIMIT=600 # the longest one call may run
CALLS=(tests-core tests-integrations bench)
# Run in the rerun's room once the three passed (it fits there on the warm machine): a real
# landscape of the device for the simulator, every figure measured.
EXTRA=landscape
# plan_of CALL: "TOTAL TIMEOUT_S STAGE:CAP ...": the seconds the call takes at most (the setup
# and every stage's cap fit in it), the timeout to give its call (a third more: the total is
# at most two thirds of it), and its stages with their caps in seconds.
plan_of() {
    case $1 in
        # Caps from three runs on an H200 (2026-12-04): core tests 203, 138 and 129 s, process
        # and library tests 56, 64 and 62 s, export tests 9, 14 and 15 s (pytest's 10 s and its
        # start), amp_table 43 s and past 45 s, probe_overhead past 20 s, 23 and 22 s, trust 17,
        # 13 and 14 s, the landscape 190, 147 and 153 s.
        tests-core) echo "195 295 core-tests:175" ;;
        tests-integrations) echo "145 220 process-and-library-tests:100 export-tests:25" ;;
        bench) echo "150 225 amp-table:70 probe-overhead:40 trust:20" ;;
        landscape) echo "220 330 landscape:200" ;;
        # For a machine of your own: no third to spare needed, within one call's limit.
        all) echo "475 600 $(for c in "${CALLS[@]}"; do plan_of "$c" | cut -d' ' -f3-; done | tr '\n' ' ')" ;;
    esac
}

# Every test file with gpu-marked tests is in one of these (tests/test_gpu_check.py checks);
# they run with -m gpu. The export tests run whole: CPU and GPU, against the real libraries.
CORE_TESTS=(tests/test_gpu.py tests/test_precision.py tests/test_probe.py tests/test_step.py)
PROCESS_TESTS=(tests/test_cuda_context.py tests/test_gpu_env.py tests/test_integrations.py
               tests/test_knobs.py tests/test_session.py tests/test_train_cli.py)
EXPORT_TESTS=(tests/test_export.py)

usage="usage: scripts/gpu-check.sh [--plan] CALL [OUT]; CALL: ${CALLS[*]}, $EXTRA or all"
DRY="${GPU_CHECK_DRY_RUN:-0}"
[[ $DRY == 0 ]] && DRY=""
CALL=""
OUT="${OUT:-gpu-check-out}"
out_given=""
for arg in "$@"; do
    case $arg in
        --plan) DRY=1 ;;
        -h | --help)
            echo "$usage"
            exit 0
            ;;
        tests-core | tests-integrations | bench | landscape | all)
            if [[ -n $CALL ]]; then
                echo "gpu-check: one call at a time, not both $CALL and $arg ($usage)" >&2
                exit 2
            fi
            CALL=$arg
            ;;
        *)
            if [[ -z $CALL ]]; then
                echo "gpu-check: unknown call '$arg' ($usage)" >&2
                exit 2
            elif [[ -n $out_given ]]; then
                echo "gpu-check: one output folder, not both $OUT and $arg ($usage)" >&2
                exit 2
            fi
            OUT=$arg
            out_given=1
            ;;
    esac
done
PY="${PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS:-.whl}"
SITE="${GPU_CHECK_SITE:-/tmp/autotune-site}"
RESULTS="$OUT/$CALL"
TESTS_LOG="$RESULTS/tests.log"
BENCH_LOG="$RESULTS/benchmarks.log"

# stage_command NAME: the command stage NAME runs, into CMD, and the log it writes, into LOG.
# pytest stops itself between tests once its session_timeout is past (a few seconds inside the
# stage's cap), so its slowest tests and its summary are printed even then; --timeout ends a
# test that hangs.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts=-ra --durations=20)
stage_command() {
    case $1 in
        core-tests)
            LOG=$TESTS_LOG
            CMD=("${PYTEST[@]}" -o session_timeout=165 --timeout 90 -m gpu "${CORE_TESTS[@]}")
            ;;
        process-and-library-tests)
            LOG=$TESTS_LOG
            CMD=("${PYTEST[@]}" -o session_timeout=90 --timeout 60 -m gpu "${PROCESS_TESTS[@]}")
            ;;
        export-tests)
            LOG=$TESTS_LOG
            CMD=("${PYTEST[@]}" -o session_timeout=20 --timeout 15 "${EXPORT_TESTS[@]}")
            ;;
        amp-table)
            LOG=$BENCH_LOG
            CMD=("$PY" benchmarks/amp_table.py --budget 20s --samples 5000
                 --json "$RESULTS/amp_table.json" --markdown "$RESULTS/amp_table.md")
            ;;
        probe-overhead)
            LOG=$BENCH_LOG
            CMD=("$PY" benchmarks/probe_overhead.py --seconds 3 --repeats 1
                 --json "$RESULTS/probe_overhead.json")
            ;;
        landscape)
            # ResNet-18 on this device, as recorded on 2026-12-04 (184 s there): the YAML and
            # its raw measurements come back; place them with --refit (docs/gpu-check.md).
            LOG=$RESULTS/record.log
            CMD=("$PY" benchmarks/record_landscape.py --workload autotune.workloads:resnet18
                 --device cuda --name gpu-resnet18 --out "$RESULTS/gpu-resnet18.yaml"
                 --raw "$RESULTS/gpu-resnet18.raw.json" --batch-sizes 64,128,256,512,1024,2048
                 --precisions fp32,bf16,fp16 --min-time 0.3 --steps 10 --time-limit 8 --seeds 2
                 --compile --compile-timeout 60 --fp16-scale-steps 12)
            ;;
        trust)
            # One study, one seed, one epoch, a fifth of the study's budget: 12 s of search.
            LOG=$BENCH_LOG
            CMD=("$PY" benchmarks/trust.py --studies tiny --seeds 1 --epochs 1 --budget-scale 0.2
                 --json "$RESULTS/trust.json")
            ;;
    esac
}

# ---- the plan, printed first; it must add up ---------------------------------------------
print_plan() {
    local i=0 c total timeout stages st sum line calls_total=0 biggest=0 planned spare
    local extra_line="" extra_total=0
    echo "gpu-check plan: ${#CALLS[@]} calls on one machine, in this order, each right after the last"
    echo "(the machine stays warm about 30 s after a call; hand it back after the last):"
    for c in "${CALLS[@]}" "$EXTRA" all; do
        read -r total timeout stages <<<"$(plan_of "$c")"
        sum=$SETUP
        line="setup $SETUP"
        for st in $stages; do
            sum=$((sum + ${st#*:}))
            line+=" + ${st%:*} ${st#*:}"
        done
        # A third to spare in every device call; all is for a machine of your own.
        spare=$((3 * total > 2 * timeout))
        [[ $c == all ]] && spare=$((total > timeout))
        if ((sum > total || spare || timeout > CALL_LIMIT)); then
            echo "gpu-check: the plan of $c does not add up: stages $sum s, total $total s," \
                "timeout $timeout s (stages <= total <= 2/3 timeout <= $CALL_LIMIT s)" >&2
            exit 1
        fi
        if [[ $c == all ]]; then
            echo "  or, on a machine of your own, all: $total s (timeout $timeout): every stage of the three, one setup"
        elif [[ $c == "$EXTRA" ]]; then
            extra_line="$c: $total s (timeout_s $timeout): $line"
            extra_total=$total
        else
            i=$((i + 1))
            echo "  $i. $c: $total s (timeout_s $timeout): $line"
            calls_total=$((calls_total + total))
            ((total > biggest)) && biggest=$total
        fi
    done
    planned=$((START_UP + calls_total + ${#CALLS[@]} * PER_CALL))
    echo "  device time: start-up $START_UP s + calls $calls_total s + ${#CALLS[@]} x $PER_CALL s" \
        "= $planned s of the session's $SESSION s; $((SESSION - planned)) s left for one rerun"
    if ((3 * planned > 2 * SESSION || SESSION - planned < START_UP + biggest + PER_CALL)); then
        echo "gpu-check: the plan does not add up: $planned s planned of $SESSION s leaves no" \
            "third to spare, or no room to rerun the longest call ($biggest s) on a fresh machine" >&2
        exit 1
    fi
    if ((extra_total + PER_CALL > SESSION - planned)); then
        echo "gpu-check: the plan does not add up: $EXTRA ($extra_total s) does not fit the" \
            "rerun's room ($((SESSION - planned)) s)" >&2
        exit 1
    fi
    echo "  then, when the three passed, in the rerun's room on the warm machine: $extra_line"
    echo "  each call, through the device tool: command \"bash scripts/gpu-check.sh CALL \$OUT\"," \
        "carry [\".whl\"] (the folder is ignored: it travels only when the call names it, and" \
        "without it the setup exits 2 after a whole machine start), timeout_s as above"
    echo "  the margin holds only when each call follows the last within the ~30 s the machine" \
        "stays warm (a later call starts a fresh machine: $START_UP s more); rerun a failed call" \
        "at once, then hand the machine back"
}
print_plan

# A dry run: the plan, and the commands of the call named; nothing runs.
if [[ -n $DRY ]]; then
    if [[ -z $CALL ]]; then
        echo "  a call's commands: bash scripts/gpu-check.sh --plan CALL"
        exit 0
    fi
    read -r _ _ stages <<<"$(plan_of "$CALL")"
    echo "gpu-check: dry run of $CALL, nothing runs; its stages and their commands:"
    echo "  setup (cap $SETUP s): install the wheels in $WHEELS/ into $SITE, import autotune, check the CUDA device"
    for st in $stages; do
        stage_command "${st%:*}"
        echo "  ${st%:*} (cap ${st#*:} s, log $LOG): $(printf '%q ' "${CMD[@]}")"
    done
    exit 0
fi
if [[ -z $CALL ]]; then
    echo "gpu-check: name the call to run ($usage)" >&2
    exit 2
fi
read -r TOTAL _ STAGES <<<"$(plan_of "$CALL")"

# ---- setup: the wheels, autotune's imports and the device ---------------------------------
# What the machine lacks comes from wheels, installed beside its own torch (once a machine: a
# later call finds them installed); the installed versions come first on the import path.
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
echo "== setup (planned ${SETUP}s)"
if ((${#wheels[@]})); then
    stamp=$(stat -c '%n %s' "${wheels[@]}")
    if [[ -f $SITE/.gpu-check-wheels && "$(cat "$SITE/.gpu-check-wheels")" == "$stamp" ]]; then
        echo "${#wheels[@]} wheels from $WHEELS/ are installed in $SITE already"
    else
        rm -rf "$SITE"
        if ! timeout -k 5 "$SETUP_GUARD" "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --target "$SITE" "${wheels[@]}"; then
            echo "gpu-check: the wheels in $WHEELS/ did not install into $SITE with $PY" >&2
            exit 2
        fi
        printf '%s\n' "$stamp" >"$SITE/.gpu-check-wheels"
        echo "${#wheels[@]} wheels from $WHEELS/ installed in $SITE in $SECONDS s"
    fi
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
left=$((SETUP_GUARD - SECONDS))
DEVICE=$(timeout -k 5 $((left > 10 ? left : 10)) "$PY" - <<'PYEOF'
import platform
import sys

try:
    import torch
except ImportError:
    print("torch is not installed for it")
    sys.exit(4)
try:
    import autotune.cli  # noqa: F401  what every stage imports
    import autotune.search  # noqa: F401
except ImportError as e:
    print(e.name or e)
    sys.exit(3)
if not torch.cuda.is_available():
    sys.exit(4)
p = torch.cuda.get_device_properties(0)
print(f"- device: {torch.cuda.get_device_name(0)}, capability {p.major}.{p.minor}, "
      f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}, Python {platform.python_version()}")
PYEOF
)
rc=$?
case $rc in
    0) ;;
    3)
        if ((${#wheels[@]})); then
            echo "gpu-check: $PY cannot import $DEVICE even with the wheels from $WHEELS/: remake them here with PYTHON=.venv/bin/python bash scripts/gpu-wheels.sh" >&2
        else
            echo "gpu-check: $PY cannot import $DEVICE and $WHEELS/ holds no wheels: make them here with PYTHON=.venv/bin/python bash scripts/gpu-wheels.sh and bring .whl/ along" >&2
        fi
        exit 2
        ;;
    4)
        echo "gpu-check: no CUDA device is visible to $PY (${DEVICE:-torch.cuda.is_available() is False}); run it on a GPU machine" >&2
        exit 2
        ;;
    124 | 137)
        echo "gpu-check: the setup ran past ${SETUP_GUARD}s (importing torch and autotune)" >&2
        exit 1
        ;;
    *)
        echo "gpu-check: $PY failed to import torch and autotune (exit $rc)" >&2
        exit 2
        ;;
esac
echo "$DEVICE"

# ---- the stages ---------------------------------------------------------------------------
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.md"
rm -f "$TESTS_LOG" "$BENCH_LOG"
{
    echo "# gpu-check $CALL $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "$DEVICE"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
    echo "| stage | status | seconds |"
    echo "|---|---|---|"
    echo "| setup | passed | $SECONDS |"
} >"$SUMMARY"

status=0
# stage NAME CAP: run stage NAME under min(CAP, the call's time left), one summary row.
stage() {
    local name=$1 cap=$2
    local left=$((TOTAL - SECONDS))
    local limit=$((cap < left ? cap : left))
    if ((limit < 10)); then
        echo "| $name | skipped: the call's $TOTAL s were spent | 0 |" >>"$SUMMARY"
        status=1
        return
    fi
    stage_command "$name"
    echo "== $name (limit ${limit}s)" | tee -a "$LOG"
    local began=$SECONDS rc
    timeout -k 10 "$limit" "${CMD[@]}" 2>&1 | tee -a "$LOG"
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
for st in $STAGES; do
    stage "${st%:*}" "${st#*:}"
done

{
    if [[ -f "$RESULTS/amp_table.md" ]]; then
        echo
        echo "## amp_table"
        echo
        cat "$RESULTS/amp_table.md"
    fi
    # The goals each benchmark printed, as it printed them; pytest's closing lines.
    echo
    echo '```'
    if [[ -f $BENCH_LOG ]]; then
        grep -E '^(tuned_vs_fp32|tuned_vs_amp|amp_memory_saving_same_batch|tuned_loss_gap|timed share|check cost|check_seconds|median|false claims)' \
            "$BENCH_LOG" || true
    fi
    if [[ -f $RESULTS/record.log ]]; then
        grep -E '^(raw measurements|landscape:|  (fp32|bf16|fp16):)' "$RESULTS/record.log" || true
    fi
    if [[ -f $TESTS_LOG ]]; then
        grep -E '^(FAILED|ERROR|SKIPPED|XFAIL|XPASS)|^[0-9]+ .* in [0-9.]+s|session-timeout' \
            "$TESTS_LOG" || true
    fi
    echo '```'
} >>"$SUMMARY"
echo "gpu-check: $CALL: status $status in $SECONDS s of $TOTAL; results in $RESULTS: $(ls "$RESULTS" | tr '\n' ' ')"
exit $status
