"""Which short-horizon parity rule predicts the full run? Loss curves only, so timing noise
does not enter: the figures are the same on a busy machine.

For each workload, the fp32 reference and a grid of batch sizes × lr multipliers (fp32, so
only the batch and the learning rate differ) train for ``--epochs`` full epochs with the same
seed. Every short run a search makes is a prefix of these curves (same seed, same data), so
one full run per setting gives, side by side:

- ``probe``: the gap at equal samples over a search probe's horizon;
- ``valid``: the same over validation's minimum horizon (its steps; a validation pair measures
  for most of its time share, and sees more);
- ``at``: the same after each of ``--at``'s sample counts, and ``proj``: the gap those samples'
  curves project to the full run's end where it fades as an early lag does (the least fall
  their noise allows, as validation reads it with a spec's ``run``; ``—``: not projected);
- ``trend``: the candidate's loss decrease over the second half of the validation horizon
  against the reference's over the same samples (negative: it is still improving more slowly);
- ``time``: the gap at equal *time*, from each run's samples/s (what a user pays for);
- ``final``: the full run's final loss over the reference's: the truth the others should predict.

    python benchmarks/parity_horizon.py [--workloads tiny_convnet,tiny_gpt] [--epochs 2]
        [--precisions fp32,bf16] [--seeds 1,2,3] [--at 8192,32768]
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial
from pathlib import Path
from typing import Any

from autotune.measure.parity import parity_gap, projected_gap, smoothed_loss_at
from autotune.schema.spec import Candidate, load_spec
from autotune.search import lr_for
from autotune.train import TrainSettings, train
from autotune.workloads import load_workload

ROOT = Path(__file__).resolve().parent.parent
STUDY = {"tiny_convnet": "tiny", "tiny_gpt": "tiny-gpt", "resnet18": "resnet18"}


def _prefix_gap(
    losses: list[float], bs: int, ref: list[float], ref_bs: int, samples: int
) -> float | None:
    n, m = max(1, samples // bs), max(1, samples // ref_bs)
    found = parity_gap(losses[:n], bs, ref[:m], ref_bs)
    return None if found is None else found[0]


def _prefix_projection(
    losses: list[float], bs: int, ref: list[float], ref_bs: int, samples: int, run: int
) -> float | None:
    n, m = max(1, samples // bs), max(1, samples // ref_bs)
    found = projected_gap(losses[:n], bs, ref[:m], ref_bs, run)
    return None if found is None else found[1]


def _slope(losses: list[float], bs: int, lo: float, hi: float) -> float | None:
    a, b = smoothed_loss_at(losses, bs, lo), smoothed_loss_at(losses, bs, hi)
    return None if a is None or b is None else (a - b) / max(abs(a), 1e-12)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="tiny_convnet,tiny_gpt")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--factors", default="1,2,4,8", help="batch sizes, x the base")
    parser.add_argument("--multipliers", default="0.5,1,1.5,2")
    parser.add_argument("--precisions", default="fp32", help="e.g. fp32,bf16")
    parser.add_argument("--seeds", default="1", help="one run of everything per seed")
    parser.add_argument("--at", default="", help="also the gap at these samples seen, e.g. 8192")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for name in args.workloads.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            rows += _workload(name, seed, args)
    _judge(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


def _workload(name: str, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One seed's reference and grid on one workload, a row per grid point."""
    spec = load_spec(ROOT / "studies" / f"{STUDY.get(name, 'tiny')}.yaml")
    wl = load_workload(name)
    rule = wl.lr_scaling if spec.space.lr_scaling == "auto" else spec.space.lr_scaling
    settings = TrainSettings(epochs=args.epochs, seed=seed, eval_samples=0)
    base = Candidate(precision="fp32", batch_size=wl.base_batch_size, learning_rate=wl.base_lr)
    ref = train(wl, base, args.device, settings, label="reference")
    probe_steps = spec.probe.warmup_steps + spec.probe.steps
    valid_steps = spec.probe.warmup_steps + spec.validation.steps
    at = [int(a) for a in args.at.split(",") if a]
    print(f"{name} seed {seed}: reference {ref.final_loss:.4f} after {ref.samples} samples")
    rows = []
    for precision in args.precisions.split(","):
        for factor in (int(f) for f in args.factors.split(",")):
            for mult in (float(m) for m in args.multipliers.split(",")):
                bs = wl.base_batch_size * factor
                lr = lr_for(rule, wl.base_lr, wl.base_batch_size, bs, mult)
                cand = Candidate(precision=precision, batch_size=bs, learning_rate=lr)
                run = train(wl, cand, args.device, settings, label="candidate")
                horizon = valid_steps * bs
                slope_c = _slope(run.losses, bs, horizon / 2, horizon)
                slope_r = _slope(ref.losses, ref.batch_size, horizon / 2, horizon)
                # Equal time: the candidate's samples at the moment the reference saw `horizon`.
                ratio = run.throughput / ref.throughput if ref.throughput else 1.0
                gap = partial(_prefix_gap, run.losses, bs, ref.losses, ref.batch_size)
                row = {
                    "workload": name,
                    "seed": seed,
                    "precision": precision,
                    "batch_size": bs,
                    "lr_multiplier": mult,
                    "lr": lr,
                    "probe": gap(probe_steps * bs),
                    "valid": gap(horizon),
                    "at": {str(n): gap(n) for n in at},
                    "proj": {
                        str(n): _prefix_projection(
                            run.losses, bs, ref.losses, ref.batch_size, n, ref.samples
                        )
                        for n in at
                    },
                    "trend": None if slope_c is None or slope_r is None else slope_c - slope_r,
                    "time": _time_gap(run.losses, bs, ref.losses, ref.batch_size, horizon, ratio),
                    "final": run.final_loss / ref.final_loss if ref.final_loss else None,
                    "diverged": not run.ok,
                }
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _time_gap(
    losses: list[float], bs: int, ref: list[float], ref_bs: int, samples: int, speed: float
) -> float | None:
    """The gap when the reference has seen ``samples`` and the candidate, ``speed`` times as
    fast, has seen ``speed × samples``."""
    mine = min(len(losses) * bs, samples * max(speed, 1e-9))
    a = smoothed_loss_at(losses, bs, mine)
    b = smoothed_loss_at(ref, ref_bs, samples)
    return None if a is None or b is None else (a - b) / max(abs(b), 1e-12)


def _fmt(v: float | None) -> str:
    return "   —  " if v is None or not math.isfinite(v) else f"{v:+.1%}"


def _line(r: dict[str, Any]) -> str:
    final = r["final"]
    at = "".join(f" @{n} {_fmt(v)} proj {_fmt(r['proj'].get(n))}" for n, v in r["at"].items())
    return (
        f"  {r['precision']} bs={r['batch_size']:<5} lr×{r['lr_multiplier']:<4g} "
        f"probe {_fmt(r['probe'])} valid {_fmt(r['valid'])}{at} trend {_fmt(r['trend'])} "
        f"time {_fmt(r['time'])} -> final "
        + ("diverged" if r["diverged"] or final is None else f"{final:.3f}x")
    )


def _judge(rows: list[dict[str, Any]], tol: float = 0.05) -> None:
    """How often each short rule agrees with the full run's verdict (final within tol)."""
    truth = [(r["final"] is not None and not r["diverged"] and r["final"] <= 1 + tol) for r in rows]
    rules = {
        "probe gap <= tol": lambda r: r["probe"] is not None and r["probe"] <= tol,
        "valid gap <= tol": lambda r: r["valid"] is not None and r["valid"] <= tol,
        "valid gap <= tol and trend >= -tol": lambda r: (
            r["valid"] is not None and r["valid"] <= tol and (r["trend"] or 0) >= -tol
        ),
        "time gap <= tol": lambda r: r["time"] is not None and r["time"] <= tol,
        "time gap <= tol and trend >= -tol": lambda r: (
            r["time"] is not None and r["time"] <= tol and (r["trend"] or 0) >= -tol
        ),
    }
    for n in rows[0]["at"] if rows else []:
        rules[f"gap at {n} <= tol, or its projection"] = lambda r, n=n: any(
            v is not None and v <= tol for v in (r["at"][n], r["proj"][n])
        )
    for name, rule in rules.items():
        said = [rule(r) for r in rows]
        false_pass = sum(s and not t for s, t in zip(said, truth, strict=True))
        false_fail = sum(t and not s for s, t in zip(said, truth, strict=True))
        print(
            f"{name:<40} agrees {sum(s == t for s, t in zip(said, truth, strict=True))}/{len(rows)};"
            f" passes a run that ends worse: {false_pass}; rejects one that ends fine: {false_fail}"
        )


if __name__ == "__main__":
    main()
