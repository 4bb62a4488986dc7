"""The AMP comparison table, reproduced and beaten, in one run on one device.

For ResNet-18 at CIFAR size (the model the usual AMP write-up measures) it trains, on the same
synthetic samples:

1. fp32 — IEEE fp32, TF32 off, at the workload's base batch size and lr;
2. the plain AMP recipe — fp16 autocast with torch's default GradScaler, same batch size and lr;
3. the config `autotune search` finds with a short budget (or one given with --config).

For each: the time for a fixed number of samples (an "epoch" of synthetic data) at its
samples/s (the median of its timed blocks), peak memory, the final loss after the same
samples, achieved TFLOP/s (FLOPs counted with torch.utils.flop_counter) and its share of the
device's dense peak for the precision used, and the ratios to fp32. Only measured figures are
printed.

The three runs are paired, as ``autotune train --compare`` pairs two: all three are alive at
once and take a timed block each in turn, each round in another order, so a neighbour's load
or a clock change hits every row alike. A row's speed against fp32 is the median of its
per-block rate ratios to the fp32 blocks around it, with its 95% interval and the number of
pairs; the fp32 row is 1.00x by construction. A row that ended early (diverged, out of
memory) is marked unpaired. Peak memory is each run's own, measured alone in a few steps
first (those steps also pay the one-time costs before anything is timed).

    python benchmarks/amp_table.py                         # GPU: 50k samples, 3-minute search
    python benchmarks/amp_table.py --device cpu            # smaller, so it also runs here
    python benchmarks/amp_table.py --config studies/resnet18/best.json --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from autotune import load_config
from autotune.measure.precision import autocast, backend_flags, get_mode, resolve_device
from autotune.measure.stats import Estimate, claimed, ratio_estimate
from autotune.schema.config import TunedConfig
from autotune.schema.spec import Candidate, load_spec
from autotune.search import run_search
from autotune.train import TrainResult, TrainSettings, baseline_candidate, held_out_batches, train

# The run that advances a block at a time, as `train --compare` interleaves two; autotune.train
# does not export it (yet).
from autotune.train._training_run import TrainRun
from autotune.workloads import Workload, load_workload

ROOT = Path(__file__).resolve().parent.parent

# Dense (no sparsity) tensor-core peaks in TFLOP/s from the vendors' data sheets, by precision
# mode; fp32 is the non-tensor-core FP32 rate. Keyed by the exact name
# torch.cuda.get_device_name() reports: a part not listed (an H200 NVL, an H100 NVL, an L40, an
# A10G, a V100 PCIe ...) has other clocks or limits, so its peak is unknown here rather than a
# similar name's figure.
_HOPPER_SXM = {"fp32": 66.9, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4}
_A100 = {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0}
_V100_SXM2 = {"fp32": 15.7, "fp16": 125.0}
PEAKS: dict[str, dict[str, float]] = {
    "NVIDIA H200": _HOPPER_SXM,
    "NVIDIA H100 80GB HBM3": _HOPPER_SXM,
    "NVIDIA H100 PCIe": {"fp32": 51.2, "tf32": 378.0, "fp16": 756.0, "bf16": 756.0},
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40S": {"fp32": 91.6, "tf32": 183.0, "fp16": 362.0, "bf16": 362.0},
    "NVIDIA A10": {"fp32": 31.2, "tf32": 62.5, "fp16": 125.0, "bf16": 125.0},
    "NVIDIA L4": {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0},
    "Tesla V100-SXM2-16GB": _V100_SXM2,
    "Tesla V100-SXM2-32GB": _V100_SXM2,
    "Tesla T4": {"fp32": 8.1, "fp16": 65.0},
}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak TFLOP/s of a device, by its exact name, for a precision mode; None when
    the name is not in the table (never a similar name's figure)."""
    return PEAKS.get(device_name.strip(), {}).get(precision)


def dense_peak(device: torch.device, precision: str) -> float | None:
    """The device's dense peak TFLOP/s for a precision mode, or None when unknown."""
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device), precision)


def flops_per_sample(workload: Workload, device: torch.device, precision: str) -> float:
    """FLOPs of one training step (forward and backward) per sample, counted by torch."""
    model = workload.build_model().to(device)
    batch = next(workload.make_batches(4, device, torch.Generator().manual_seed(0)))
    mode = get_mode(precision)
    counter = FlopCounterMode(display=False)
    with backend_flags(mode), counter, autocast(mode, device):
        loss = workload.loss(model, batch)
        loss.backward()
    return counter.get_total_flops() / 4


def search_config(spec_path: Path, device: torch.device, budget: str) -> TunedConfig:
    with tempfile.TemporaryDirectory() as tmp:
        spec = load_spec(spec_path).with_overrides(
            {"device": str(device), "budget": budget, "storage": f"sqlite:///{tmp}/amp_table.db"}
        )
        result = run_search(spec, out_dir=Path(tmp) / "out")
        assert result.config is not None
        return result.config


def paired_speedup(rates: list[float], against: list[float]) -> Estimate | None:
    """A run's speed over another's from their interleaved block rates: the median per-pair
    ratio and its 95% interval (at least ±3%, as every paired figure autotune claims); None
    when no pair was measured."""
    pairs = min(len(rates), len(against))
    est = ratio_estimate(rates[:pairs], against[:pairs]) if pairs else None
    return claimed(est) if est is not None else None


def measure(
    workload: Workload,
    setups: list[tuple[str, Candidate | TunedConfig]],
    device: torch.device,
    settings: TrainSettings,
    held: list,
) -> tuple[dict[str, TrainResult], dict[str, list[float]]]:
    """Train every setup on the same samples, their timed blocks interleaved; each run's
    result (with the peak memory of its own short run alone) and its block rates."""
    # A few steps of each setup first, one at a time: one-time costs (library set-up,
    # first-use kernels, allocator growth) are paid before anything is timed, and each run's
    # peak memory is its own (while the runs interleave, a peak would be all of theirs).
    prime = settings.model_copy(update={"samples": None, "steps": 5, "eval_samples": 0})
    peaks = {name: train(workload, setup, device, prime, label="prime") for name, setup in setups}
    with contextlib.ExitStack() as stack:
        runs = [
            stack.enter_context(
                TrainRun(workload, setup, device, settings, label=name, measure_memory=False)
            )
            for name, setup in setups
        ]
        # A block each per round while all run (then whichever are left finish alone), each
        # round in the next of all the orders: on a CPU the block right after another run's
        # pays for the switch (a fifth more after an fp16 block, measured), so no run may
        # always follow the same one.
        orders = itertools.cycle(itertools.permutations(runs))
        while any([run.advance() for run in next(orders)]):
            pass
        names = [name for name, _ in setups]
        results = {name: run.finish(held) for name, run in zip(names, runs, strict=True)}
        rates = {name: run.rates() for name, run in zip(names, runs, strict=True)}
    for name, result in results.items():
        result.peak_memory_bytes = peaks[name].peak_memory_bytes
        result.memory_source = peaks[name].memory_source
    return results, rates


def row(
    name: str,
    result: TrainResult,
    flops: float,
    device: torch.device,
    speedup: Estimate | None,
    rates: list[float],
) -> dict[str, Any]:
    # The median of the run's timed blocks: a burst of load that stalls one block (on a shared
    # CPU, a hundredfold for a moment) moves a run's total, not its typical rate, and the
    # speedups are medians too.
    throughput = statistics.median(rates) if rates and result.ok else result.throughput
    tflops = flops * throughput / 1e12 if throughput else None
    peak = dense_peak(device, result.precision)
    return {
        "setup": name,
        "settings": result.settings(),
        "outcome": result.outcome,
        "samples": result.samples,
        "seconds": result.samples / throughput if throughput else None,
        "throughput": throughput,
        # All the run's timed samples over all its timed seconds.
        "throughput_total": result.throughput,
        # Paired against the fp32 run's blocks; the fp32 row is 1.0 by construction.
        "speedup": speedup.value if speedup else None,
        "speedup_low": speedup.low if speedup else None,
        "speedup_high": speedup.high if speedup else None,
        "pairs": speedup.n if speedup else 0,
        "timed_blocks": len(rates),
        "peak_memory_bytes": result.peak_memory_bytes,
        "final_loss": result.final_loss,
        "accuracy": result.accuracy,
        "tflops": tflops,
        "peak_tflops": peak,
        "share_of_peak": tflops / peak if (tflops and peak) else None,
    }


def speed_text(r: dict[str, Any]) -> str:
    """``1.93x (1.85–2.01, 38 pairs)``; the fp32 row is the reference; a row without pairs
    says it is unpaired (and why, when it ended early)."""
    if r["setup"] == "fp32":
        return "1.00x (reference)"
    if r["speedup"] is None:
        return "unpaired" + ("" if r["outcome"] == "completed" else f" ({r['outcome']})")
    return (
        f"{r['speedup']:.2f}x ({r['speedup_low']:.2f}–{r['speedup_high']:.2f}, {r['pairs']} pairs)"
    )


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def f(value: Any, fmt: str) -> str:
        return "—" if value is None else format(value, fmt)

    base = rows[0]
    lines = [
        f"Measured {meta['date']} on {meta['device']} (torch {meta['torch']}, CUDA {meta['cuda']}); "
        f"{meta['workload']}, {meta['samples']} synthetic samples per run. The runs' timed "
        "blocks are interleaved; samples/s is the median of a run's blocks (time: the samples "
        "at that rate), vs fp32 (speed) the median of its per-block rate ratios to the fp32 "
        "blocks around it, with its 95% interval and the pairs.",
        "",
        "| setup | settings | time (s) | samples/s | vs fp32 | peak memory (MiB) | vs fp32 | "
        "final loss | TFLOP/s | share of peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = (
            r["peak_memory_bytes"] / base["peak_memory_bytes"]
            if base["peak_memory_bytes"] and r["peak_memory_bytes"]
            else None
        )
        share = "peak unknown" if r["peak_tflops"] is None else f(r["share_of_peak"], ".1%")
        lines.append(
            f"| {r['setup']} | {r['settings']} | {f(r['seconds'], '.2f')} | {f(r['throughput'], ',.0f')} | "
            f"{speed_text(r)} | {f(r['peak_memory_bytes'] and r['peak_memory_bytes'] / 2**20, ',.0f')} | "
            f"{f(mem, '.2f')}x | {f(r['final_loss'], '.4f')} | {f(r['tflops'], '.1f')} | {share} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workload", default="resnet18")
    parser.add_argument("--spec", type=Path, default=ROOT / "studies" / "resnet18.yaml")
    parser.add_argument("--budget", default=None, help="search budget; 3m on CUDA, 60s on CPU")
    parser.add_argument("--samples", type=int, default=None, help="50000 on CUDA, 512 on CPU")
    parser.add_argument("--config", type=Path, default=None, help="use this best.json, no search")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    samples = args.samples or (50_000 if cuda else 512)
    workload = load_workload(args.workload)
    if args.config is not None:
        cfg = load_config(args.config)
    else:
        cfg = search_config(args.spec, device, args.budget or ("3m" if cuda else "60s"))
    settings = TrainSettings(samples=samples, samples_per_epoch=samples, warmup_steps=3)
    setups: list[tuple[str, Candidate | TunedConfig]] = [
        ("fp32", baseline_candidate(workload, "fp32")),
        ("plain AMP recipe", baseline_candidate(workload, "amp")),
        ("autotune", cfg),
    ]
    held = held_out_batches(workload, device, settings) if workload.accuracy else []
    results, rates = measure(workload, setups, device, settings, held)
    rows = []
    for name, _ in setups:
        result = results[name]
        # fp32 against itself is 1.0 by construction; the others, paired against its blocks.
        speedup = Estimate(1.0, 1.0, 1.0, 0) if name == "fp32" else None
        if name != "fp32" and result.ok and results["fp32"].ok:
            speedup = paired_speedup(rates[name], rates["fp32"])
        flops = flops_per_sample(workload, device, result.precision)
        rows.append(row(name, result, flops, device, speedup, rates[name]))
        print(
            f"{name:>18}: {result.settings():<36} {result.throughput:>10.1f} samples/s  "
            f"{speed_text(rows[-1])}  loss {result.final_loss}",
            flush=True,
        )
    from datetime import date

    meta = {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({device})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "workload": workload.reference or workload.name,
        "samples": samples,
        "config": cfg.model_dump(mode="json"),
    }
    table = markdown(rows, meta)
    print(table)
    base, amp, tuned = rows
    goals: dict[str, float] = {}
    intervals: dict[str, Estimate] = {}
    if tuned["speedup"] is not None:
        goals["tuned_vs_fp32"] = tuned["speedup"]
        intervals["tuned_vs_fp32"] = Estimate(
            tuned["speedup"], tuned["speedup_low"], tuned["speedup_high"], tuned["pairs"]
        )
    if results["autotune"].ok and results["plain AMP recipe"].ok:
        # Paired too: against the plain AMP run's blocks, taken in the same rounds.
        est = paired_speedup(rates["autotune"], rates["plain AMP recipe"])
        if est is not None:
            goals["tuned_vs_amp"], intervals["tuned_vs_amp"] = est.value, est
    if base["peak_memory_bytes"] and amp["peak_memory_bytes"]:
        goals["amp_memory_saving_same_batch"] = (
            1 - amp["peak_memory_bytes"] / base["peak_memory_bytes"]
        )
    if base["final_loss"] and tuned["final_loss"]:
        goals["tuned_loss_gap"] = tuned["final_loss"] / base["final_loss"] - 1
    for key, value in goals.items():
        est = intervals.get(key)
        extra = f" (95% interval {est.low:.3f}–{est.high:.3f}, {est.n} pairs)" if est else ""
        print(f"{key}: {value:.3f}{extra}")
    out = {
        "meta": meta,
        "rows": rows,
        "goals": goals,
        "goal_intervals": {k: [e.low, e.high, e.n] for k, e in intervals.items()},
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    if args.markdown:
        args.markdown.write_text(table)
    return out


if __name__ == "__main__":
    main()
