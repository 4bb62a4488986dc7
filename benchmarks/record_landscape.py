"""Record a real workload's landscape on this machine: a YAML the simulated device loads.

Every figure is measured here, the way the search measures (``benchmarks/search_vs_grid.py``):

1. Start: a probe worker is started (timed: ``timing.worker_start_seconds``); the workload's
   facts come from :func:`autotune.execution.facts.workload_facts`, the device's from the machine.
2. Timing, in this process: a run of the fp32 reference is built (``timing.build_seconds``) and
   stepped one step at a time, cold (the process's first use of the kernels) and warm; the first
   step's extra cost and the warm-up's decay are fitted to the per-step times.
3. Grid: every (precision, batch size) is measured PAIRED against fp32 at the workload's base
   batch and lr (:meth:`~autotune.execution.probe_worker.ProbeWorker.compare`: interleaved blocks in one
   worker), once per seed, at the lr the workload's rule gives. The candidate's samples/s in
   the table is the paired speedup (median over seeds) times the reference's samples/s (median
   over every paired run of the recording): drift and a neighbour's load hit both arms of a pair
   and cancel in the ratio, so the table's ratios are the paired speedups. The parity gap is
   :func:`autotune.measure.parity.parity_gap` of the two arms' loss curves at equal samples seen.
4. Knobs, paired the same way at the base batch: lr multipliers (``parity.gap_per_lr_log2``,
   ``parity.diverge_lr_multiplier``), channels_last against the workload's own layout (4-d
   inputs only), torch.compile (``--compile``).
5. Memory: a short unpaired probe per grid point in a fresh worker; its peak (CUDA: the
   allocator's reserve; CPU: the growth of the worker's peak resident memory), fitted per mode
   as ``fixed + per_sample * batch`` by least squares.
6. fp16: a short probe at a high GradScaler ``init_scale`` counts the steps skipped while the
   scale backs off (``fp16.safe_init_scale``); a divergence in the grid sets
   ``fp16.diverges_at_step``.

From these it fits the landscape (``kind: recorded``), writes it with a comment on every figure
saying how it was measured, checks that :func:`autotune.sim.load_landscape` loads it, and
writes every raw measurement (blocks, loss curves, per-run figures) to a sidecar JSON
(``benchmarks/recordings/<name>.raw.json``; the landscape model forbids extra fields).
``--refit RAW`` rewrites the YAML from a sidecar without measuring again.

    python benchmarks/record_landscape.py --workload autotune.workloads:tiny_convnet \\
        --device cpu --out autotune/sim/landscapes/cpu-tiny_convnet.yaml \\
        --name cpu-tiny_convnet --batch-sizes 16,32,64,128,256 --precisions fp32,bf16,fp16 \\
        --min-time 0.5 --time-limit 20 --seeds 2 \\
        [--mode-batch-sizes fp16=32,128] [--mode-time-limit fp16=8] [--compile]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from autotune.execution.facts import workload_facts  # noqa: E402
from autotune.execution.limits import machine_memory  # noqa: E402
from autotune.execution.probe_worker import ProbeWorker  # noqa: E402
from autotune.measure.parity import parity_gap  # noqa: E402
from autotune.measure.precision import resolve_device, unsupported_modes  # noqa: E402
from autotune.measure.result import PairedResult, ProbeResult  # noqa: E402
from autotune.measure.stats import ratio_estimate  # noqa: E402
from autotune.measure.step import StepEngine  # noqa: E402
from autotune.schema.spec import Candidate, ProbeSettings  # noqa: E402
from autotune.search import lr_for  # noqa: E402
from autotune.workloads import load_workload, normalize_reference  # noqa: E402

RAW_DIR = ROOT / "benchmarks" / "recordings"
RAW_VERSION = 1
# GradScaler's default init_scale (2**16): the grid's fp16 runs use it.
DEFAULT_INIT_SCALE = 2.0**16
# IQR -> sigma, MAD -> sigma of a normal distribution.
_MAD_SIGMA = 1.4826
# A block this many times slower than its arm's median is a burst, not noise.
_BURST = 1.5


def log(message: str) -> None:
    print(message, flush=True)


# ---- the machine ------------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine(device: torch.device) -> dict[str, Any]:
    """What the landscape says about the device, and what the description names."""
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return {
            "device": torch.cuda.get_device_name(device),
            "device_type": "cuda",
            "capability": list(torch.cuda.get_device_capability(device)),
            "memory_total_bytes": int(total),
            "memory_source": "torch.cuda.mem_get_info total",
            "cores": os.cpu_count(),
        }
    total = machine_memory()
    if total is None:
        raise SystemExit("cannot read MemTotal from /proc/meminfo: this CPU's memory is unknown")
    return {
        "device": cpu_name(),
        "device_type": "cpu",
        "capability": None,
        "memory_total_bytes": total,
        "memory_source": "/proc/meminfo MemTotal",
        "cores": os.cpu_count(),
    }


# ---- measuring -------------------------------------------------------------------------------


def settings_for(
    args: argparse.Namespace, precision: str, seed: int, **update: Any
) -> ProbeSettings:
    data = {
        "warmup_steps": args.warmup_steps,
        "steps": args.steps,
        "check_every": args.check_every,
        "min_time": args.min_time,
        "time_limit": args.mode_time_limit.get(precision, args.time_limit),
        "seed": seed,
        # Every probe runs to its end: the recording wants the whole figure, not a verdict.
        "early_stop": False,
        **update,
    }
    return ProbeSettings(**data)


def _round(values: list[float], digits: int = 5) -> list[Any]:
    out: list[Any] = []
    for v in values:
        out.append(float(f"{v:.{digits}g}") if math.isfinite(v) else str(v))
    return out


def arm_record(r: ProbeResult) -> dict[str, Any]:
    """One arm's raw figures."""
    return {
        "outcome": r.outcome,
        "reason": r.reason,
        "throughput": r.throughput,
        "throughput_low": r.throughput_low,
        "throughput_high": r.throughput_high,
        "spread": r.spread,
        "step_time": r.step_time,
        "blocks": [[s, round(sec, 6)] for s, sec in r.blocks],
        "timed_steps": r.timed_steps,
        "warmup_steps": r.warmup_steps,
        "timed_seconds": r.timed_seconds,
        "wall_seconds": r.wall_seconds,
        "check_seconds": r.check_seconds,
        "compile_seconds": r.compile_seconds,
        "skipped_steps": r.skipped_steps,
        "scales": [[s, v] for s, v in r.scales],
        "truncated": r.truncated,
        "timed_out": r.timed_out,
        "peak_memory_allocated": r.peak_memory_allocated,
        "peak_memory_reserved": r.peak_memory_reserved,
        "losses": _round(r.losses),
    }


def block_rates(arm: dict[str, Any], batch_size: int) -> list[float]:
    return [s * batch_size / sec for s, sec in arm["blocks"] if sec > 0]


def paired_record(
    paired: PairedResult, kind: str, seed: int, cand: Candidate, lr_multiplier: float
) -> dict[str, Any]:
    c, r = paired.candidate, paired.reference
    row: dict[str, Any] = {
        "kind": kind,
        "seed": seed,
        "precision": cand.precision,
        "batch_size": cand.batch_size,
        "lr_multiplier": lr_multiplier,
        "learning_rate": cand.learning_rate,
        "init_scale": cand.init_scale,
        "channels_last": cand.channels_last,
        "compile": cand.compile,
        "speedup": paired.speedup,
        "speedup_low": paired.speedup_low,
        "speedup_high": paired.speedup_high,
        "pairs": paired.pairs,
        "candidate": arm_record(c),
        "reference": arm_record(r),
    }
    # An arm that diverged or hit its limit still ran timed blocks: their paired ratio is what
    # its speed was while it ran (fp16's throughput when its loss later turned inf).
    if paired.speedup is None:
        est = ratio_estimate(
            block_rates(row["candidate"], c.batch_size),
            block_rates(row["reference"], r.batch_size),
        )
        row["speedup_from_blocks"] = None if est is None else est.value
    gap = None
    if c.losses and r.losses:
        found = parity_gap(c.losses, c.batch_size, r.losses, r.batch_size)
        gap = None if found is None else found[0]
    row["parity_gap"] = gap
    return row


def fmt_row(row: dict[str, Any]) -> str:
    c = row["candidate"]
    head = f"{row['precision']:>4} bs={row['batch_size']:<4}"
    if row["lr_multiplier"] != 1.0:
        head += f" lr×{row['lr_multiplier']:g}"
    if row["channels_last"] is not None:
        head += " channels_last" if row["channels_last"] else " nchw"
    if row["compile"]:
        head += " compile"
    if row["speedup"] is not None:
        body = (
            f"{row['speedup']:.3f}x ({row['speedup_low']:.3f}–{row['speedup_high']:.3f}) over "
            f"{row['pairs']} pairs, {c['throughput']:.1f} samples/s"
        )
    else:
        body = f"{c['outcome']}: {c['reason'] or row['reference']['reason']}"[:160]
    gap = row["parity_gap"]
    body += "" if gap is None else f", parity {gap:+.2%}"
    if c["skipped_steps"]:
        body += f", {c['skipped_steps']} skipped"
    return f"  seed {row['seed']} {head} → {body} [{row['seconds']:.1f}s]"


def measure_timing(
    workload: Any, ref: Candidate, device: torch.device, budget: float, min_steps: int, runs: int
) -> dict:
    """Build time and per-step times of the reference, in this process: cold (the first run
    here) and warm (a fresh run of the same shape afterwards: what each probe pays)."""

    def one(label: str) -> dict[str, Any]:
        torch.manual_seed(0)
        with StepEngine(workload, ref, device, seed=0) as engine:
            t0 = time.perf_counter()
            engine.build()
            build = time.perf_counter() - t0
            steps: list[float] = []
            started = time.perf_counter()
            while len(steps) < 60 and (
                len(steps) < min_steps or time.perf_counter() - started < budget
            ):
                steps.append(engine.run_steps(1).seconds)
            engine.read_losses()
        return {"label": label, "build_seconds": build, "step_seconds": steps}

    saved = torch.is_grad_enabled()
    torch.set_grad_enabled(True)
    try:
        cold = one("cold")
        warm = [one(f"warm{i}") for i in range(runs)]
    finally:
        torch.set_grad_enabled(saved)
    return {"cold": cold, "warm": warm}


def record(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Measure everything; the raw record the fits read."""
    t_start = time.monotonic()
    if args.threads:
        # The workers are fresh interpreters: torch reads these when it starts.
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    if args.compile:
        # A cache of its own: compile_seconds is what compiling costs here, not what an earlier
        # process left in the shared cache (and the recording leaves that cache alone).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="record-inductor-")
    ref_name = normalize_reference(args.workload)
    dev = resolve_device(args.device)
    workload = load_workload(ref_name)
    facts = workload_facts(workload)
    base_bs, base_lr = int(facts["base_batch_size"]), float(facts["base_lr"])
    unsupported = unsupported_modes(dev)
    precisions = [p for p in args.precisions.split(",") if p]
    if "fp32" not in precisions:
        precisions.insert(0, "fp32")
    skipped_modes = {p: unsupported[p] for p in precisions if p in unsupported}
    precisions = [p for p in precisions if p not in unsupported]
    sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    mode_sizes = {p: sorted(args.mode_batch_sizes.get(p, sizes)) for p in precisions}
    # The anchor: fp32 at the base batch is always measured (the reference paired with itself).
    if base_bs not in mode_sizes["fp32"]:
        mode_sizes["fp32"] = sorted({*mode_sizes["fp32"], base_bs})
    ref = Candidate(precision="fp32", batch_size=base_bs, learning_rate=base_lr)
    seeds = list(range(args.seeds))
    raw: dict[str, Any] = {
        "raw_version": RAW_VERSION,
        "name": args.name,
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            **machine(dev),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "threads_set": args.threads,
            "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        },
        "workload": ref_name,
        "facts": facts,
        "unsupported": unsupported,
        "skipped_modes": skipped_modes,
        "precisions": precisions,
        "mode_batch_sizes": {p: mode_sizes[p] for p in precisions},
        "seeds": seeds,
        "settings": {p: json.loads(settings_for(args, p, 0).model_dump_json()) for p in precisions},
        "runs": [],
    }
    log(
        f"recording {ref_name} on {raw['machine']['device']} ({dev}): modes {precisions}, "
        f"batch sizes {raw['mode_batch_sizes']}, seeds {seeds}; base fp32 bs={base_bs} lr={base_lr:g}"
    )

    # 1. The worker's start.
    worker = ProbeWorker(args.device)
    t0 = time.perf_counter()
    worker.start()
    raw["worker_start_seconds"] = time.perf_counter() - t0
    worker_facts = worker.facts(ref_name)
    raw["worker_facts"] = json.loads(worker_facts.model_dump_json())
    log(f"worker started in {raw['worker_start_seconds']:.2f}s")

    # 2. Timing, in this process.
    t0 = time.monotonic()
    raw["timing"] = measure_timing(
        workload, ref, dev, args.timing_seconds, args.timing_min_steps, args.timing_runs
    )
    cold, warm = raw["timing"]["cold"], raw["timing"]["warm"]
    log(
        f"timing: build {statistics.median(w['build_seconds'] for w in warm):.3f}s, first step "
        f"cold {cold['step_seconds'][0]:.3f}s warm {warm[-1]['step_seconds'][0]:.3f}s, steady "
        f"{statistics.median(warm[-1]['step_seconds'][len(warm[-1]['step_seconds']) // 2 :]):.4f}s "
        f"[{time.monotonic() - t0:.1f}s]"
    )

    rule = str(facts["lr_scaling"])

    def paired(
        kind: str,
        seed: int,
        cand: Candidate,
        mult: float,
        timeout_extra: float = 0.0,
        limit_extra: float = 0.0,
    ) -> dict[str, Any]:
        s = settings_for(args, cand.precision, seed)
        if limit_extra:
            s = s.model_copy(update={"time_limit": s.time_limit + limit_extra})
        began = time.monotonic()
        result = worker.compare(
            ref_name, cand, ref, s, timeout=s.time_limit + args.grace + timeout_extra
        )
        row = paired_record(result, kind, seed, cand, mult)
        row["started_s"] = began - t_start
        row["seconds"] = time.monotonic() - began
        raw["runs"].append(row)
        log(fmt_row(row))
        return row

    # 3a. Throwaway pairs: the worker's first use of each mode's kernels is not a grid point's.
    t0 = time.monotonic()
    raw["throwaway"] = []
    for p in [] if args.no_throwaway else precisions:
        bs = min(mode_sizes[p])
        cand = Candidate(
            precision=p, batch_size=bs, learning_rate=lr_for(rule, base_lr, base_bs, bs, 1.0)
        )
        s = settings_for(args, p, 0, steps=2, min_time=0, warmup_steps=1)
        began = time.monotonic()
        result = worker.compare(ref_name, cand, ref, s, timeout=s.time_limit + args.grace)
        raw["throwaway"].append(
            {
                "precision": p,
                "batch_size": bs,
                "seconds": time.monotonic() - began,
                "summary": result.summary(),
            }
        )
    log(f"throwaway warm-up pairs done [{time.monotonic() - t0:.1f}s]")

    # 3b. The grid: seeds outermost, so a slow stretch of the machine spreads over the points.
    t0 = time.monotonic()
    for seed in seeds:
        for p in precisions:
            for bs in mode_sizes[p]:
                lr = lr_for(rule, base_lr, base_bs, bs, 1.0)
                paired("grid", seed, Candidate(precision=p, batch_size=bs, learning_rate=lr), 1.0)
    raw["grid_seconds"] = time.monotonic() - t0
    log(f"grid done [{raw['grid_seconds']:.1f}s]")

    # 4. Knobs at the base batch, fp32.
    t0 = time.monotonic()
    mults = [float(m) for m in args.lr_multipliers.split(",") if m]
    first = next(workload.make_batches(2, dev, torch.Generator().manual_seed(0)))
    raw["input_dims"] = int(first[0].dim())
    for seed in seeds:
        for mult in mults:
            lr = lr_for(rule, base_lr, base_bs, base_bs, mult)
            paired(
                "lr", seed, Candidate(precision="fp32", batch_size=base_bs, learning_rate=lr), mult
            )
        if raw["input_dims"] == 4 and not args.no_channels_last:
            cand = ref.model_copy(update={"channels_last": not bool(facts["channels_last"])})
            paired("channels_last", seed, cand, 1.0)
        if args.compile:
            cand = ref.model_copy(update={"compile": True})
            # The pair's time limit also covers the reference arm's warm-up, which runs after
            # the candidate has compiled: give the limit the compile's time too.
            paired(
                "compile",
                seed,
                cand,
                1.0,
                timeout_extra=args.compile_timeout,
                limit_extra=args.compile_timeout,
            )
    raw["knob_seconds"] = time.monotonic() - t0
    worker.close()

    # 5. Memory: short unpaired probes in a fresh worker (a throwaway first).
    t0 = time.monotonic()
    raw["memory"] = []
    if not args.no_memory:
        with ProbeWorker(args.device) as mem_worker:
            for p in precisions:
                sizes_p = mode_sizes[p]
                for i, bs in enumerate([sizes_p[0], *sizes_p]):
                    lr = lr_for(rule, base_lr, base_bs, bs, 1.0)
                    cand = Candidate(precision=p, batch_size=bs, learning_rate=lr)
                    s = settings_for(
                        args,
                        p,
                        0,
                        warmup_steps=args.memory_warmup_steps,
                        steps=args.memory_steps,
                        min_time=0,
                        check_every=args.memory_steps,
                    )
                    began = time.monotonic()
                    r = mem_worker.run(ref_name, cand, s, timeout=s.time_limit + args.grace)
                    row = {
                        "precision": p,
                        "batch_size": bs,
                        "throwaway": i == 0,
                        "outcome": r.outcome,
                        "reason": r.reason,
                        "peak_memory_allocated": r.peak_memory_allocated,
                        "peak_memory_reserved": r.peak_memory_reserved,
                        "throughput": r.throughput,
                        "wall_seconds": r.wall_seconds,
                        "seconds": time.monotonic() - began,
                    }
                    raw["memory"].append(row)
                    peak = r.peak_memory
                    log(
                        f"  memory {p:>4} bs={bs:<4}{' (throwaway)' if i == 0 else ''}: "
                        + (
                            f"{peak / 2**20:.1f} MiB"
                            if peak is not None
                            else f"{r.outcome}, no figure"
                        )
                    )
    raw["memory_seconds"] = time.monotonic() - t0

    # 6. fp16's GradScaler at a high init_scale.
    raw["fp16_scale_probe"] = None
    if "fp16" in precisions and args.fp16_scale_probe > 0:
        t0 = time.monotonic()
        bs = min(mode_sizes["fp16"], key=lambda b: (abs(math.log2(b / base_bs)), b))
        lr = lr_for(rule, base_lr, base_bs, bs, 1.0)
        cand = Candidate(
            precision="fp16", batch_size=bs, learning_rate=lr, init_scale=args.fp16_scale_probe
        )
        n = args.fp16_scale_steps
        s = settings_for(args, "fp16", 0, warmup_steps=0, steps=n, min_time=0, check_every=n)
        with ProbeWorker(args.device) as w:
            r = w.run(ref_name, cand, s, timeout=s.time_limit + args.grace)
        raw["fp16_scale_probe"] = {
            "batch_size": bs,
            "init_scale": args.fp16_scale_probe,
            "steps": len(r.losses),
            "outcome": r.outcome,
            "reason": r.reason,
            "skipped_steps": r.skipped_steps,
            "scales": [[a, b] for a, b in r.scales],
            "seconds": time.monotonic() - t0,
        }
        log(
            f"fp16 at init_scale={args.fp16_scale_probe:g}: {r.skipped_steps} of {len(r.losses)} "
            f"steps skipped ({r.outcome}) [{time.monotonic() - t0:.1f}s]"
        )
    if args.compile:
        shutil.rmtree(os.environ.pop("TORCHINDUCTOR_CACHE_DIR"), ignore_errors=True)
    raw["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    raw["recording_seconds"] = time.monotonic() - t_start
    return raw


# ---- fitting ---------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def _speedup(row: dict[str, Any]) -> float | None:
    if row["speedup"] is not None:
        return row["speedup"]
    return row.get("speedup_from_blocks")


def _lstsq_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def _through_origin(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares ``y = k x``."""
    sxx = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys, strict=True)) / sxx if sxx else None


def fit_loss(curves: list[list[float]], batch_size: int) -> dict[str, Any]:
    """``final + (initial - final) * exp(-s / scale)`` fitted to the reference's curves by
    least squares (a grid over the scale, the linear two in closed form)."""
    pts = [
        ((i + 1) * batch_size, float(v))
        for curve in curves
        for i, v in enumerate(curve)
        if isinstance(v, (int, float)) and math.isfinite(v)
    ]
    if len(pts) < 4:
        return {"ok": False}
    s_max = max(s for s, _ in pts)
    best: tuple[float, float, float, float] | None = None
    for k in range(241):
        scale = s_max * 10 ** (-2 + 4 * k / 240)  # s_max/100 .. 100 s_max
        xs = [math.exp(-s / scale) for s, _ in pts]
        final, amp = _lstsq_line(xs, [v for _, v in pts])
        if final <= 0 or amp <= 0:
            continue
        sse = sum((final + amp * x - v) ** 2 for x, (_, v) in zip(xs, pts, strict=True))
        if best is None or sse < best[0]:
            best = (sse, final, amp, scale)
    if best is None:
        return {"ok": False}
    _, final, amp, scale = best
    resid = [v / (final + amp * math.exp(-s / scale)) - 1 for s, v in pts]
    return {
        "ok": True,
        "initial": final + amp,
        "final": final,
        "samples_scale": scale,
        # Robust (1.4826 x MAD): where a real curve spikes off a low floor (an H200's ResNet-18
        # at a relative +10), the plain spread made the simulator's log-normal step noise blow
        # the reference up 100-fold; the spikes are the curve's, not its step-to-step noise.
        "step_noise": 1.4826 * statistics.median(abs(r - statistics.median(resid)) for r in resid),
        "step_noise_std": statistics.pstdev(resid),
        "points": len(pts),
        "samples_max": s_max,
        "scale_at_grid_edge": scale >= 99 * s_max or scale <= s_max / 99,
    }


def fit_noise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Block-to-block sigma of log rates (robust, per arm; median over arms) and bursts."""
    sigmas: list[float] = []
    slow: list[float] = []
    blocks = 0
    for row in runs:
        for arm, bs in (("candidate", row["batch_size"]), ("reference", None)):
            a = row[arm]
            size = bs if bs is not None else row["reference_batch_size"]
            rates = block_rates(a, size)
            if len(rates) < 3:
                continue
            logs = [math.log(r) for r in rates]
            med = statistics.median(logs)
            dev = [abs(x - med) for x in logs]
            bursts = [med - x for x in logs if med - x > math.log(_BURST)]
            calm = [x for x in logs if med - x <= math.log(_BURST)]
            blocks += len(logs)
            slow.extend(math.exp(b) for b in bursts)
            if len(calm) >= 3:
                cm = statistics.median(calm)
                sigmas.append(_MAD_SIGMA * statistics.median(abs(x - cm) for x in calm))
            else:
                sigmas.append(_MAD_SIGMA * statistics.median(dev))
    if not sigmas:
        return {"ok": False}
    return {
        "ok": True,
        "block_cv": statistics.median(sigmas),
        "arms": len(sigmas),
        "blocks": blocks,
        "burst_probability": len(slow) / blocks if blocks else 0.0,
        "burst_slowdown": statistics.median(slow) if slow else None,
        "bursts": len(slow),
    }


def fit_warmup(steps: list[float]) -> dict[str, Any]:
    """``t_i = steady * (1 + extra * exp(-i / w))`` for i >= 1; the first step's surplus apart.

    Fitted by least absolute deviations to a running median of three steps: a neighbour's
    time slice makes single steps slow, and must not read as a warm-up.
    """
    n = len(steps)
    steady = statistics.median(steps[n // 2 :])
    smooth = [statistics.median(steps[max(1, i - 1) : i + 2]) for i in range(1, n)]
    r = [(i, t / steady - 1) for i, t in enumerate(smooth, start=1)]
    best = (math.inf, 0.0, 1.0)
    for k in range(61):
        w = 0.2 * 10 ** (2 * k / 60)  # 0.2 .. 20 steps
        es = [math.exp(-i / w) for i, _ in r]
        for j in range(201):
            extra = 0.02 * j  # 0 .. 4
            sad = sum(abs(extra * e - y) for e, (_, y) in zip(es, r, strict=True))
            if sad < best[0] - 1e-12:
                best = (sad, extra, w)
    _, extra, w = best
    return {
        "steady_step_seconds": steady,
        "warmup_extra": extra,
        "warmup_steps": w,
        "first_step_seconds": max(0.0, steps[0] - steady * (1 + extra)),
        "first_step_raw": steps[0],
        "steps": n,
    }


def fit(raw: dict[str, Any]) -> dict[str, Any]:
    """Every figure of the landscape from the raw record, with how each was found."""
    facts = raw["facts"]
    base_bs = int(facts["base_batch_size"])
    precisions = raw["precisions"]
    for row in raw["runs"]:
        row.setdefault("reference_batch_size", base_bs)
    grid = [r for r in raw["runs"] if r["kind"] == "grid"]
    out: dict[str, Any] = {"notes": {}}

    # Reference throughput: median over every paired run's reference arm.
    ref_rates = [
        r["reference"]["throughput"]
        for r in raw["runs"]
        if r["reference"]["outcome"] == "completed" and r["reference"]["throughput"] > 0
    ]
    if not ref_rates:
        raise SystemExit("no paired run completed: nothing to fit")
    R = statistics.median(ref_rates)
    out["reference_throughput"] = R
    out["reference_runs"] = len(ref_rates)
    ref_cv = (
        statistics.pstdev(ref_rates) / statistics.mean(ref_rates) if len(ref_rates) > 1 else 0.0
    )
    out["reference_cv"] = ref_cv

    points: dict[tuple[str, int], dict[str, Any]] = {}
    for p in precisions:
        for bs in raw["mode_batch_sizes"][p]:
            rows = [r for r in grid if r["precision"] == p and r["batch_size"] == bs]
            speeds = [_speedup(r) for r in rows]
            speeds = [s for s in speeds if s is not None and s > 0]
            # A run that diverged has a curve, but not a gap the landscape's parity model means:
            # the divergence is its own figure.
            gaps = [
                r["parity_gap"]
                for r in rows
                if r["parity_gap"] is not None and r["candidate"]["outcome"] != "diverged"
            ]
            ok = [r for r in rows if r["speedup"] is not None]
            points[(p, bs)] = {
                "rows": rows,
                "speedup": _median(speeds),
                "speedups": speeds,
                "speedup_low": _median([r["speedup_low"] for r in ok]),
                "speedup_high": _median([r["speedup_high"] for r in ok]),
                "pairs": sum(r["pairs"] for r in ok),
                "gap": _median(gaps),
                "gaps": gaps,
                "outcomes": [r["candidate"]["outcome"] for r in rows],
                "from_blocks": bool(rows) and not ok and bool(speeds),
                "skipped": [r["candidate"]["skipped_steps"] for r in rows],
            }
    out["points"] = points

    # Throughput tables.
    tables: dict[str, dict[int, float]] = {}
    for p in precisions:
        table = {}
        for bs in raw["mode_batch_sizes"][p]:
            pt = points[(p, bs)]
            if p == "fp32" and bs == base_bs:
                table[bs] = R  # the anchor: the reference itself
            elif pt["speedup"] is not None:
                table[bs] = pt["speedup"] * R
        if table:
            tables[p] = table
    out["tables"] = tables

    # Parity: each mode's gap at the base batch, then one slope over doublings above it.
    mode_gap: dict[str, float | None] = {}
    for p in precisions:
        g = points.get((p, base_bs), {}).get("gap")
        mode_gap[p] = g
    xs: list[float] = []
    ys: list[float] = []
    for (p, bs), pt in points.items():
        if bs > base_bs and pt["gap"] is not None and mode_gap.get(p) is not None:
            xs.append(math.log2(bs / base_bs))
            ys.append(pt["gap"] - mode_gap[p])
    k = _through_origin(xs, ys)
    out["gap_fit_points"] = len(xs)
    out["gap_per_batch_doubling"] = k
    # A mode measured off the base batch: its gap from its points less the slope's share.
    for p in precisions:
        if mode_gap[p] is None:
            rest = [
                pt["gap"] - (k or 0.0) * max(0.0, math.log2(bs / base_bs))
                for (q, bs), pt in points.items()
                if q == p and pt["gap"] is not None
            ]
            mode_gap[p] = statistics.mean(rest) if rest else None
            out["notes"][f"gap_{p}"] = "off the base batch" if rest else "none measured"
    out["mode_gap"] = mode_gap

    # Seed spread: the gap's std across seeds at each point, the median over points (a large
    # gap far past any tolerance spreads far more, and must not set the spread of the small
    # ones that decide feasibility). fp32 at the base batch is left out: paired with itself on
    # the same seed it is the same run. The simulated device draws an offset for each arm, so
    # the difference of two arms spreads sqrt(2) times more than one.
    stds = [
        statistics.stdev(pt["gaps"])
        for key, pt in points.items()
        if len(pt["gaps"]) >= 2 and key != ("fp32", base_bs)
    ]
    out["gap_seed_std"] = statistics.median(stds) if stds else None
    out["seed_spread"] = None if out["gap_seed_std"] is None else out["gap_seed_std"] / math.sqrt(2)
    out["seed_spread_points"] = len(stds)

    # lr multipliers.
    lr_rows = [r for r in raw["runs"] if r["kind"] == "lr"]
    by_mult: dict[float, list[dict]] = {}
    for r in lr_rows:
        by_mult.setdefault(r["lr_multiplier"], []).append(r)
    lr_x, lr_y, lr_summary = [], [], {}
    diverged_mults: list[float] = []
    # The rule's own lr (x1) did not diverge where the grid's base point completed.
    base_rows = [r for r in grid if r["precision"] == "fp32" and r["batch_size"] == base_bs]
    fine_mults = [1.0] if any(r["candidate"]["outcome"] == "completed" for r in base_rows) else []
    for mult, rows in sorted(by_mult.items()):
        gaps = [r["parity_gap"] for r in rows if r["parity_gap"] is not None]
        div = any(r["candidate"]["outcome"] == "diverged" for r in rows)
        (diverged_mults if div else fine_mults).append(mult)
        g = _median(gaps)
        lr_summary[mult] = {"gap": g, "gaps": gaps, "diverged": div}
        if g is not None and not div:
            lr_x.append(abs(math.log2(mult)))
            lr_y.append(g - (mode_gap.get("fp32") or 0.0))
    out["lr"] = lr_summary
    out["gap_per_lr_log2"] = _through_origin(lr_x, lr_y) if lr_x else None
    above = [m for m in diverged_mults if m > 1]
    out["diverge_lr_first"] = min(above) if above else None
    out["diverge_lr_multiplier"] = (
        max([m for m in fine_mults if m < min(above)], default=1.0) if above else None
    )

    # Knobs.
    cl = [r for r in raw["runs"] if r["kind"] == "channels_last"]
    cl_s = _median([_speedup(r) for r in cl if _speedup(r)])
    out["channels_last_measured"] = cl_s
    if cl_s:
        # The candidate ran the other layout than the workload's: off it costs 1/k, on it gains k.
        out["channels_last_speedup"] = 1 / cl_s if facts["channels_last"] else cl_s
    comp = [r for r in raw["runs"] if r["kind"] == "compile"]
    out["compile_speedup"] = _median([_speedup(r) for r in comp if _speedup(r)])
    out["compile_seconds_each"] = [
        r["candidate"]["compile_seconds"] for r in comp if r["candidate"]["compile_seconds"]
    ]
    out["compile_seconds"] = _median(out["compile_seconds_each"])
    out["compile_outcomes"] = [r["candidate"]["outcome"] for r in comp]

    # Memory.
    mem_fit: dict[str, dict[str, Any]] = {}
    for p in precisions:
        pts = [
            (m["batch_size"], m["peak_memory_reserved"] or m["peak_memory_allocated"])
            for m in raw["memory"]
            # A probe that diverged (fp16 skipping its few steps) still held its memory.
            if m["precision"] == p
            and not m["throwaway"]
            and m["outcome"] not in ("oom", "crashed", "unsupported")
        ]
        pts = [(b, v) for b, v in pts if v is not None]
        mem_fit[p] = {"points": pts}
        if len({b for b, _ in pts}) >= 2:
            a, b = _lstsq_line([float(x) for x, _ in pts], [float(v) for _, v in pts])
            how = "least squares over the measured peaks"
            if b < 0:
                a, b = statistics.median(v for _, v in pts), 0.0
                how = "peaks fell with the batch (noise): median as fixed, no per-sample term"
            elif a < 0:
                b = _through_origin([float(x) for x, _ in pts], [float(v) for _, v in pts]) or 0.0
                a = 0.0
                how = "least squares through the origin (the line's intercept came out negative)"
            mem_fit[p].update(fixed=int(a), per_sample=int(b), how=how)
    for p in precisions:
        pts = mem_fit[p]["points"]
        if "fixed" in mem_fit[p] or not pts:
            continue
        # One batch size: fp32's per-sample bytes, the rest fixed (or all of it fixed).
        per = mem_fit.get("fp32", {}).get("per_sample", 0) if p != "fp32" else 0
        bs, peak = pts[0]
        per = min(per, peak // bs)
        how = "one peak: " + (
            "fp32's per-sample bytes, the rest fixed" if per else "all of it fixed"
        )
        mem_fit[p].update(fixed=int(peak - per * bs), per_sample=int(per), how=how)
    out["memory"] = mem_fit
    if any("fixed" not in m for m in mem_fit.values()):
        # No peak readable (not Linux): weights, gradients and optimizer state, counted.
        wl = load_workload(raw["workload"])
        params = sum(p.numel() for p in wl.build_model().parameters())
        slots = 1 if facts["optimizer"] == "SGD" else 2
        est = params * 4 * (2 + slots)
        for m in mem_fit.values():
            if "fixed" not in m:
                m.update(
                    fixed=est,
                    per_sample=0,
                    how=f"estimate: {params} parameters x 4 bytes x (weights, grads, {slots} "
                    "optimizer slots); no peak could be read",
                )

    # Loss curve: the reference arms, the longest curve per seed.
    curves: dict[int, list] = {}
    for r in raw["runs"]:
        if r["kind"] == "grid" and r["reference"]["losses"]:
            c = r["reference"]["losses"]
            if len(c) > len(curves.get(r["seed"], [])):
                curves[r["seed"]] = c
    out["loss"] = fit_loss(list(curves.values()), base_bs)
    out["loss_curves"] = {s: len(c) for s, c in curves.items()}

    # Noise.
    out["noise"] = fit_noise(grid)

    # Timing.
    timing = raw["timing"]
    # Step by step, the median over the warm runs: one neighbour's burst moves one run's step.
    runs = [w["step_seconds"] for w in timing["warm"]]
    n_steps = min(len(r) for r in runs)
    warm = fit_warmup([statistics.median(r[i] for r in runs) for i in range(n_steps)])
    cold_first = timing["cold"]["step_seconds"][0]
    warm_first = statistics.median(w["step_seconds"][0] for w in timing["warm"])
    out["timing"] = {
        **warm,
        "build_seconds": statistics.median(w["build_seconds"] for w in timing["warm"]),
        "cold_first_step": cold_first,
        "warm_first_step": warm_first,
        "first_use_seconds": max(0.0, cold_first - warm_first),
        "worker_start_seconds": raw["worker_start_seconds"] + max(0.0, cold_first - warm_first),
        "worker_start_raw": raw["worker_start_seconds"],
    }
    # Cross-check: what a paired run spent outside its timed blocks.
    overhead = [
        r["candidate"]["wall_seconds"]
        - r["candidate"]["timed_seconds"]
        - r["reference"]["timed_seconds"]
        for r in grid
        if r["candidate"]["outcome"] == "completed"
    ]
    out["timing"]["paired_overhead_median"] = _median(overhead)

    # fp16.
    fp16: dict[str, Any] = {}
    if "fp16" in precisions:
        rows = [r for r in grid if r["precision"] == "fp16"]
        # Skips at the start of a default-scale run: the scale backing off from 2**16.
        early = [
            r["candidate"]["skipped_steps"]
            for r in rows
            if r["candidate"]["outcome"] in ("completed", "diverged")
        ]
        fp16["default_skips"] = early
        probe = raw.get("fp16_scale_probe")
        safe: float | None = None
        how = ""
        k0 = int(statistics.median(early)) if early else None
        saturated = bool(probe and probe["steps"] and probe["skipped_steps"] >= probe["steps"])
        if probe and probe["steps"] and not (saturated and k0):
            k_hi = probe["skipped_steps"]
            safe = probe["init_scale"] / 2**k_hi
            how = (
                f"{k_hi} of {probe['steps']} steps skipped at init_scale={probe['init_scale']:g} "
                f"(bs={probe['batch_size']}): {probe['init_scale']:g} / 2^{k_hi}"
            )
            if k_hi == 0:
                how += " (no skip: at least that)"
            elif saturated:
                how += " (every step skipped: at most that)"
        elif early:
            k0 = int(statistics.median(early))
            safe = DEFAULT_INIT_SCALE / 2**k0
            how = f"median {k0} skipped steps at the default 2^16: 65536 / 2^{k0}" + (
                " (no skip: at least that)" if k0 == 0 else ""
            )
            if saturated:
                how += (
                    f"; the probe at init_scale={probe['init_scale']:g} skipped all its "
                    f"{probe['steps']} steps (it says at most {probe['init_scale'] / 2 ** probe['steps']:g})"
                )
        fp16["safe_init_scale"] = safe
        fp16["safe_how"] = how
        steps_div = []
        for r in rows:
            c = r["candidate"]
            if c["outcome"] == "diverged":
                m = re.search(r"loss=(\S+) at step (\d+)", c["reason"])
                # fp16's range overflows into inf/nan; a finite blow-up is the lr's doing.
                if m and not math.isfinite(float(m.group(1))):
                    steps_div.append(int(m.group(2)))
        fp16["diverged_runs"] = len([r for r in rows if r["candidate"]["outcome"] == "diverged"])
        fp16["runs"] = len(rows)
        fp16["diverges_at_step"] = (
            int(statistics.median(steps_div))
            if steps_div and 2 * len(steps_div) >= len(rows)
            else None
        )
        fp16["diverge_steps"] = steps_div
    out["fp16"] = fp16
    return out


# ---- writing ---------------------------------------------------------------------------------


def dump_raw(data: Any, indent: int = 0) -> str:
    """JSON with one key per line but each list of plain values on one line: the raw record's
    loss curves and blocks stay readable without a line per number."""
    pad = " " * (indent + 1)
    if isinstance(data, dict) and data:
        items = [f"{pad}{json.dumps(str(k))}: {dump_raw(v, indent + 1)}" for k, v in data.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(data, list) and any(isinstance(v, (dict, list)) for v in data):
        flat = all(
            isinstance(v, list) and not any(isinstance(x, (dict, list)) for x in v) for v in data
        )
        if flat:  # a list of pairs ([steps, seconds], [step, scale])
            return json.dumps(data, separators=(",", ":"))
        items = [pad + dump_raw(v, indent + 1) for v in data]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    return json.dumps(data, separators=(",", ":"))


def num(x: float, sig: int = 4) -> str:
    """A float YAML reads back as a float: plain decimal, never an exponent (PyYAML reads
    ``1e+04`` as a string), ``sig`` significant digits."""
    if x == 0:
        return "0.0"
    digits = sig - 1 - math.floor(math.log10(abs(x)))
    text = f"{round(x, digits):.{max(1, digits)}f}"
    if "." in text:
        text = text.rstrip("0")
        text = text + "0" if text.endswith(".") else text
    return text


def q(text: str) -> str:
    """A double-quoted YAML scalar (JSON's escapes are YAML's)."""
    return json.dumps(text, ensure_ascii=False)


def mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def render(raw: dict[str, Any], f: dict[str, Any], raw_path: str) -> str:
    """The landscape as commented YAML."""
    m = raw["machine"]
    facts = raw["facts"]
    base_bs = int(facts["base_batch_size"])
    R = f["reference_throughput"]
    name = raw["name"]
    cores = m.get("cores")
    tl = raw["settings"]["fp32"]
    mem_peak = max(
        (mm["fixed"] + mm["per_sample"] * max(raw["mode_batch_sizes"][p]))
        for p, mm in f["memory"].items()
        if p in f["tables"]
    )
    total = m["memory_total_bytes"]
    seeds = len(raw["seeds"])
    modes_text = ", ".join(
        f"{p} at batch {','.join(map(str, raw['mode_batch_sizes'][p]))}" for p in f["tables"]
    )
    cpu = m["device_type"] == "cpu"
    desc = (
        f"Recorded, every figure measured: {raw['workload']} on {m['device']}"
        + (
            f" ({cores} cores, torch {m['torch']}, {m['torch_threads']} torch thread(s)"
            + (f" set by --threads {m['threads_set']}" if m.get("threads_set") else "")
            + ")"
            if cpu
            else f" (torch {m['torch']})"
        )
        + f", on {raw['date']}, by `{raw['command']}` "
        f"({raw['recording_seconds'] / 60:.1f} min). Grid: {modes_text}; {seeds} seed(s); each "
        f"point paired against fp32 at the base batch {base_bs} (interleaved blocks, "
        f"min_time {tl['min_time']}, steps {tl['steps']}). "
    )
    if cpu:
        desc += (
            f"Memory is the worker's peak resident growth, fitted per mode; the CPU's memory is "
            f"not the limit here (the largest fitted peak, {mib(mem_peak)}, is "
            f"{mem_peak / total:.2%} of {total / 2**30:.1f} GiB). The machine was shared "
            "(other processes ran beside the recording): its noise is in the figures"
        )
        loads = (m.get("load_average_at_start"), raw.get("load_average_at_end"))
        if all(loads):
            desc += (
                f" (1-minute load average {loads[0][0]:.1f} at the start, {loads[1][0]:.1f} at "
                "the end)"
            )
        desc += ". "
    if raw.get("note"):
        desc += raw["note"].rstrip(".") + ". "
    desc += f"Raw figures: {raw_path}."

    L: list[str] = []
    add = L.append
    add("# RECORDED on this machine, not modelled: benchmarks/record_landscape.py measured every")
    add(f"# figure below on {m['device']} ({raw['date']}); the raw measurements (every run's")
    add(f"# blocks, loss curves, memory probes, step times) are in {raw_path}.")
    add(f"# Command: {raw['command']}")
    add("# Throughput: samples/s = the paired speedup against fp32 at the base batch (median over")
    add(
        f"# seeds) x the fp32 reference's samples/s, R = {num(R, 5)} (median over the {f['reference_runs']}"
    )
    add("# paired runs' reference arms). Pairing interleaves the two arms' blocks, so drift and a")
    add("# neighbour's load hit both and cancel: the table's ratios are the measured speedups.")
    add(f"# The reference's own samples/s varied {f['reference_cv']:.1%} (CV) from run to run.")
    add("# Batches below a table's smallest entry cost its step (rate x bs/smallest); above its")
    add("# largest the rate stays flat (the simulator's rule): only measured sizes are listed.")
    add("schema_version: 1")
    add(f"name: {name}")
    add("kind: recorded")
    add(f"description: {q(desc)}")
    add(f"device: {q(m['device'])}")
    add(f"device_type: {m['device_type']}")
    add(f"capability: {json.dumps(m['capability']) if m['capability'] else 'null'}")
    add(f"memory_total_bytes: {total}  # {m['memory_source']}: {total / 2**30:.2f} GiB")
    add(f"workload: {raw['workload']}")
    add("facts:  # autotune.execution.facts.workload_facts(load_workload(workload))")
    add(f"  base_lr: {facts['base_lr']!r}")
    add(f"  base_batch_size: {base_bs}")
    add(f"  lr_scaling: {facts['lr_scaling']}")
    add(f"  channels_last: {'true' if facts['channels_last'] else 'false'}")
    add(f"  optimizer: {facts['optimizer']}")
    add("modes:")
    for p, table in f["tables"].items():
        add(f"  {p}:")
        add("    throughput:  # samples/s")
        for bs, rate in sorted(table.items()):
            pt = f["points"][(p, bs)]
            if p == "fp32" and bs == base_bs:
                s = pt["speedup"]
                note = "the reference R itself" + (
                    f"; paired with itself it measured {s:.3f}x (the noise floor)" if s else ""
                )
            else:
                note = f"{pt['speedup']:.3f}x R"
                if pt["from_blocks"]:
                    note += f" (from its blocks before it {'/'.join(set(pt['outcomes']))})"
                elif pt["speedup_low"] is not None:
                    note += f" ({pt['speedup_low']:.2f}–{pt['speedup_high']:.2f})"
                if len(pt["speedups"]) > 1:
                    note += "; seeds " + ", ".join(f"{s:.3f}" for s in pt["speedups"])
            note += f"; {1000 * bs / rate:.3g} ms/step"
            add(f"      {bs}: {num(rate, 5)}  # measured: {note}")
        missing = [bs for bs in raw["mode_batch_sizes"][p] if bs not in table]
        if missing:
            outs = {bs: "/".join(sorted(set(f["points"][(p, bs)]["outcomes"]))) for bs in missing}
            add(f"      # not in the table: {', '.join(f'bs={b} {o}' for b, o in outs.items())}")
        mm = f["memory"][p]
        pts = ", ".join(f"{b}: {mib(v)}" for b, v in mm["points"]) or "none"
        label = "" if mm["how"].startswith("estimate") else "measured: "
        add(f"    memory_fixed_bytes: {mm['fixed']}  # {label}{mm['how']} ({mib(mm['fixed'])})")
        add(f"    memory_per_sample_bytes: {mm['per_sample']}  # measured: peaks by batch {pts}")
        g = f["mode_gap"].get(p)
        if p == "fp32":
            pg = f["points"].get(("fp32", base_bs), {}).get("gaps", [])
            add(
                f"    parity_gap: 0.0  # the reference itself; paired with itself (same seed) the "
                f"gap measured {', '.join(f'{x:+.4f}' for x in pg) or 'nothing'}"
            )
        elif g is None:
            add("    parity_gap: 0.0  # no gap could be measured (no loss curve): none assumed")
        else:
            gaps = f["points"].get((p, base_bs), {}).get("gaps", [])
            how = (
                f"median over seeds at bs={base_bs}: " + ", ".join(f"{x:+.4f}" for x in gaps)
                if gaps
                else "from its points off the base batch (less the doubling slope above it)"
            )
            add(f"    parity_gap: {num(g, 3)}  # measured: {how}")
    if raw["skipped_modes"] or raw["unsupported"]:
        add("unsupported:  # autotune.measure.precision.unsupported_modes on this device")
        for p, why in raw["unsupported"].items():
            add(f"  {p}: {q(why)}")
    n = f["noise"]
    add("noise:")
    if n.get("ok"):
        add(
            f"  block_cv: {num(n['block_cv'], 3)}  # measured: median over {n['arms']} arms of "
            f"1.4826 x MAD of log block rates (bursts apart), {n['blocks']} blocks"
        )
        # A sinusoid of amplitude A has RMS A/sqrt(2); the reference's run-to-run CV, less what
        # its block noise explains, is that RMS.
        cv = f["reference_cv"]
        drift = min(0.5, math.sqrt(2) * cv)
        add(
            f"  drift_amplitude: {num(drift, 3)}  # measured: sqrt(2) x the reference's run-to-run "
            f"CV ({cv:.2%}) over the recording"
        )
        period = max(60.0, raw.get("grid_seconds", 600.0))
        add(
            f"  drift_period_s: {num(period, 3)}  # the grid's duration: one cycle (the period "
            "itself cannot be told from these runs)"
        )
        add(
            f"  burst_probability: {num(n['burst_probability'], 3) if n['burst_probability'] else '0.0'}"
            f"  # measured: {n['bursts']} of {n['blocks']} blocks ran >{_BURST}x slower than their arm's median"
        )
        if n["burst_slowdown"]:
            add(
                f"  burst_slowdown: {num(max(1.0, n['burst_slowdown']), 3)}  # measured: "
                "median slowdown of those blocks"
            )
    else:
        add("  block_cv: 0.02  # NOT measured: no arm ran 3 blocks; the model's default")
    lf = f["loss"]
    add(
        f"loss:  # fitted to the fp32 reference's curves ({len(f['loss_curves'])} seed(s), bs={base_bs})"
    )
    if lf.get("ok"):
        edge = (
            " (at the fit's grid edge: the curve barely bends)" if lf["scale_at_grid_edge"] else ""
        )
        add(f"  initial: {num(lf['initial'])}  # measured: least squares, {lf['points']} losses")
        add(f"  final: {num(lf['final'])}  # measured: the fit's floor")
        add(
            f"  samples_scale: {num(lf['samples_scale'])}  # measured: e-fold in samples{edge}; "
            f"curves reach {lf['samples_max']:,} samples"
        )
        add(
            f"  step_noise: {num(lf['step_noise'], 3)}  # measured: 1.4826 x MAD of the relative "
            f"residuals (their plain std: {lf['step_noise_std']:.3g})"
        )
    else:
        add("  # NOT measured: no reference curve long enough to fit; the model's defaults")
    if f["seed_spread"] is not None:
        add(
            f"  seed_spread: {num(f['seed_spread'], 3)}  # measured: the gap's std across seeds, "
            f"median over {f['seed_spread_points']} points ({f['gap_seed_std']:.4f}), / sqrt(2): "
            "the simulator offsets both arms"
        )
    else:
        add("  seed_spread: 0.01  # NOT measured (one seed): the model's default")
    add("parity:")
    for p in f["tables"]:
        gaps = [
            f"{bs}: {f['points'][(p, bs)]['gap']:+.3f}"
            for bs in raw["mode_batch_sizes"][p]
            if f["points"][(p, bs)]["gap"] is not None
        ]
        if gaps:
            add(f"  # measured {p} gaps by batch (median over seeds): {', '.join(gaps)}")
    blown = []
    for (p, bs), pt in f["points"].items():
        n_div = pt["outcomes"].count("diverged")
        if n_div:
            blown.append(f"{p} bs={bs} ({n_div} of {len(pt['outcomes'])} seeds)")
    if blown:
        add(f"  # diverged in the grid at the rule's lr (left out of the gaps): {', '.join(blown)}")
    k = f["gap_per_batch_doubling"]
    if k is not None:
        add(
            f"  gap_per_batch_doubling: {num(k, 3)}  # measured: least squares through 0 of "
            f"gap - mode gap over log2(bs/{base_bs}), {f['gap_fit_points']} points above the base"
        )
    else:
        add("  gap_per_batch_doubling: 0.0  # NOT measured: no batch above the base")
    if f["gap_per_lr_log2"] is not None:
        detail = "; ".join(
            f"x{m_:g}: {'diverged' if v['diverged'] else ', '.join(f'{g:+.4f}' for g in v['gaps'])}"
            for m_, v in f["lr"].items()
        )
        add(
            f"  gap_per_lr_log2: {num(f['gap_per_lr_log2'], 3)}  # measured: least squares "
            f"through 0 of the fp32 gap over |log2 lr multiplier| ({detail})"
        )
    else:
        add("  gap_per_lr_log2: 0.05  # NOT measured (no --lr-multipliers): the model's default")
    if f["diverge_lr_multiplier"] is not None:
        add(
            f"  diverge_lr_multiplier: {num(f['diverge_lr_multiplier'], 3)}  # measured: "
            f"x{f['diverge_lr_multiplier']:g} did not diverge, x{f['diverge_lr_first']:g} did "
            "(the threshold lies between; the largest that did not is kept)"
        )
    else:
        tried = ", ".join(f"x{m_:g}" for m_ in f["lr"]) or "none tried"
        add(f"  diverge_lr_multiplier: null  # measured: no lr multiplier diverged ({tried})")
    fp = f["fp16"]
    add("fp16:")
    if fp:
        if fp["safe_init_scale"] is not None:
            add(f"  safe_init_scale: {num(fp['safe_init_scale'], 6)}  # measured: {fp['safe_how']}")
        else:
            add("  safe_init_scale: 65536.0  # NOT measured (no fp16 step ran): the default")
        skips = ", ".join(map(str, fp["default_skips"])) or "none"
        if fp["diverges_at_step"] is not None:
            add(
                f"  diverges_at_step: {fp['diverges_at_step']}  # measured: median step of "
                f"{len(fp['diverge_steps'])} of {fp['runs']} grid runs that diverged"
            )
        else:
            add(
                f"  diverges_at_step: null  # measured: {fp['diverged_runs']} of {fp['runs']} fp16 "
                f"grid runs diverged; skipped steps at 2^16: {skips}"
            )
        add("  islands: []  # not measured: no fp16 run diverged for a module to be named")
    else:
        add("  safe_init_scale: 65536.0  # fp16 not recorded: the default")
        add("  diverges_at_step: null")
        add("  islands: []")
    add("knobs:")
    if f["compile_speedup"]:
        add(
            f"  compile_speedup: {num(f['compile_speedup'], 3)}  # measured: fp32 bs={base_bs} "
            "compiled, paired against eager"
        )
        each = ", ".join(f"{x:.2f}s" for x in f["compile_seconds_each"])
        add(
            f"  compile_seconds: {num(f['compile_seconds'] or 0.0, 3)}  # measured: median "
            f"compile_seconds of the compiled arm (its warm-up beyond its steps), by seed {each}; "
            "the inductor cache was empty at the first"
        )
    else:
        why = (
            "compile failed: " + "/".join(f["compile_outcomes"])
            if f["compile_outcomes"]
            else "record with --compile"
        )
        add(f"  compile_speedup: 1.0  # NOT measured ({why}): no gain assumed")
        add("  compile_seconds: 30.0  # NOT measured: the model's default")
    if f.get("channels_last_speedup"):
        layout = "NCHW" if facts["channels_last"] else "channels_last"
        add(
            f"  channels_last_speedup: {num(f['channels_last_speedup'], 3)}  # measured: fp32 "
            f"bs={base_bs} in {layout} paired against the workload's layout "
            f"({f['channels_last_measured']:.3f}x)"
        )
    else:
        why = (
            "inputs are not 4-d: the knob does nothing"
            if raw.get("input_dims") != 4
            else "not recorded"
        )
        add(f"  channels_last_speedup: 1.0  # {why}")
    add("  fp32_module_cost: 0.05  # NOT measured (no fp32 islands recorded): the model's default")
    t = f["timing"]
    add("timing:  # measured in the recording's own process, fp32 at the base batch")
    add(
        f"  worker_start_seconds: {num(t['worker_start_seconds'], 3)}  # measured: a probe worker's "
        f"start ({t['worker_start_raw']:.2f}s) + the process's first use of the kernels "
        f"({t['first_use_seconds']:.2f}s)"
    )
    add(
        "  trial_overhead_seconds: 0.1  # NOT measured: the tuner's own per-trial cost, not the "
        "device's; the model's default"
    )
    add(
        f"  build_seconds: {num(t['build_seconds'], 3)}  # measured: StepEngine.build (model, optimizer; the batch pool is made in the first step, counted there)"
    )
    add(
        f"  first_step_seconds: {num(t['first_step_seconds'], 3) if t['first_step_seconds'] > 0 else '0.0'}"
        f"  # measured: first step {t['first_step_raw']:.4f}s less the warm-up curve's step 0"
    )
    add(
        f"  warmup_extra: {num(t['warmup_extra'], 3) if t['warmup_extra'] > 0 else '0.0'}  # measured: "
        f"fitted to {t['steps']} step times, steady {1000 * t['steady_step_seconds']:.3g} ms"
    )
    add(f"  warmup_steps: {num(t['warmup_steps'], 3)}  # measured: the warm-up's decay, in steps")
    add("sources:")
    add("  - id: recording")
    add(f"    cite: {q('benchmarks/record_landscape.py, ' + raw['date'] + ': ' + raw['command'])}")
    add(f"    used_for: {q('every figure; raw measurements in ' + raw_path)}")
    return "\n".join(L) + "\n"


# ---- the command -------------------------------------------------------------------------------


def _mode_map(values: list[str], kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in values or []:
        mode, _, rest = v.partition("=")
        if not rest:
            raise SystemExit(f"expected MODE=VALUE, got {v!r}")
        out[mode] = [int(b) for b in rest.split(",")] if kind == "sizes" else float(rest)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="autotune.workloads:tiny_convnet")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="the landscape YAML")
    parser.add_argument("--name", default=None, help="the landscape's name (default: --out's stem)")
    parser.add_argument(
        "--raw", type=Path, default=None, help="default: benchmarks/recordings/<name>.raw.json"
    )
    parser.add_argument("--batch-sizes", default="16,32,64,128,256")
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument(
        "--mode-batch-sizes",
        action="append",
        default=[],
        metavar="MODE=B1,B2",
        help="a mode's own batch sizes (fp16 on a CPU is slow: keep them few)",
    )
    parser.add_argument("--mode-time-limit", action="append", default=[], metavar="MODE=SECONDS")
    parser.add_argument("--min-time", type=float, default=0.5)
    parser.add_argument("--time-limit", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--check-every", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--lr-multipliers", default="0.5,2", help="'' to skip")
    parser.add_argument("--no-channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true", help="measure torch.compile too")
    parser.add_argument(
        "--compile-timeout",
        type=float,
        default=300.0,
        help="seconds a compiled pair may add to its time limit for compiling",
    )
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--fp16-scale-probe", type=float, default=2.0**24, help="init_scale to probe; 0: skip"
    )
    parser.add_argument("--fp16-scale-steps", type=int, default=12)
    parser.add_argument("--timing-seconds", type=float, default=1.5)
    parser.add_argument("--timing-min-steps", type=int, default=6)
    parser.add_argument("--timing-runs", type=int, default=3, help="warm runs timed step by step")
    parser.add_argument("--memory-warmup-steps", type=int, default=1)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument(
        "--no-throwaway",
        action="store_true",
        help="skip the untimed first pair per mode (a slow workload's warm-up steps suffice)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's CPU threads in the workers and here (OMP_NUM_THREADS); default: torch's own",
    )
    parser.add_argument("--grace", type=float, default=60.0, help="hard limit past time_limit")
    parser.add_argument("--refit", type=Path, default=None, help="rewrite from a raw JSON")
    parser.add_argument("--note", default="", help="a sentence for the description")
    args = parser.parse_args(argv)
    args.mode_batch_sizes = _mode_map(args.mode_batch_sizes, "sizes")
    args.mode_time_limit = _mode_map(args.mode_time_limit, "seconds")

    if args.refit is not None:
        raw = json.loads(args.refit.read_text())
        raw_path = args.refit
        args.name = args.name or raw["name"]
        raw["name"] = args.name
        raw["note"] = args.note or raw.get("note", "")
    else:
        if args.out is None and args.name is None:
            parser.error("give --out or --name")
        args.name = args.name or args.out.stem
        given = list(sys.argv[1:] if argv is None else argv)
        # --note words the description; it measures nothing, so the command leaves it out.
        for i, a in reversed(list(enumerate(given))):
            if a == "--note":
                del given[i : i + 2]
            elif a.startswith("--note="):
                del given[i]
        command = "python benchmarks/record_landscape.py " + shlex.join(given)
        raw = record(args, command)
        raw["note"] = args.note
        raw_path = args.raw or RAW_DIR / f"{args.name}.raw.json"
        raw_path.parent.mkdir(parents=True, exist_ok=True)
        raw_path.write_text(dump_raw(raw) + "\n")
        log(f"raw measurements: {raw_path} ({raw['recording_seconds']:.0f}s of recording)")
    out = args.out or ROOT / "autotune" / "sim" / "landscapes" / f"{args.name}.yaml"
    fitted = fit(raw)
    try:
        rel = str(Path(raw_path).resolve().relative_to(ROOT))
    except ValueError:
        rel = str(raw_path)
    text = render(raw, fitted, rel)

    from autotune.sim import load_landscape

    # Check it loads before it lands where the simulator looks.
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / f"{args.name}.yaml"
        probe.write_text(text)
        land = load_landscape(probe)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    log(f"landscape: {out} ({land.name}, kind {land.kind}, modes {', '.join(land.modes)})")
    for p, mode in land.modes.items():
        rates = ", ".join(f"{b}: {v:,.0f}" for b, v in sorted(mode.throughput.items()))
        log(f"  {p}: {rates} samples/s; gap {mode.parity_gap:+.4f}")
    return {"raw": raw, "fit": fitted, "landscape": land}


if __name__ == "__main__":
    main()
