"""What users run instead of a search, as picks on a real device, for ``trust.py --peers``: each
pick is trained in full beside fp32 (paired, as the search's config is) so the comparison
``search_sim.py`` makes by a landscape's truth also stands on a device.

- ``amp``: the AMP recipe: fp16 autocast and a GradScaler at its default init_scale, at the
  workload's batch and lr.
- ``hf-bf16``: Hugging Face ``bf16=True``: bf16 autocast at the workload's batch and lr (fp16
  where the device has no bf16).
- ``pl-scale`` / ``pl-scale-lr``: Lightning's ``scale_batch_size(mode="power")`` with
  ``bf16-mixed``: the batch doubled from the workload's as far as it fits, with the lr kept and
  with the workload's lr rule. "As far as it fits" is the search's own ceiling for that mode,
  which keeps the spec's memory margin and stops at its largest batch (Lightning keeps no margin
  and stops at 8192): a pick no larger than Lightning's.
- ``fastest-probe``: the fastest probe the search measured to its end, parity ignored: what a
  tuner on throughput alone picks from the same trials (on the simulated device,
  ``search_sim.py`` runs Optuna's TPE on throughput with the search's budget instead).
"""

from __future__ import annotations

from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autotune.infra.devices import resolve_device
from autotune.measure.precision import unsupported_modes
from autotune.schema.config import TunedConfig
from autotune.schema.spec import Candidate
from autotune.study.trials import candidate, record

PEERS = {
    "amp": "fp16 + GradScaler(65536) at the workload's batch",
    "hf-bf16": "bf16 at the workload's batch (fp16 without bf16)",
    "pl-scale": "bf16 at the largest doubling of the batch that fits, lr kept",
    "pl-scale-lr": "bf16 at the largest doubling of the batch that fits, the lr rule",
    "fastest-probe": "the search's fastest probe, parity ignored",
}


def parse(names: str, *, cpu: bool = False) -> list[str]:
    """``--peers``'s names, checked; ``all``: every one, but the AMP recipe on a CPU, where fp16
    runs 15-70x slower than fp32 and its full run would take hours (name it to train it)."""
    if names.strip() == "all":
        return [n for n in PEERS if not (cpu and n == "amp")]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer(s) {', '.join(unknown)}; use {', '.join(PEERS)} or all")
    return wanted


def picks(
    names: list[str], workload: Any, cfg: TunedConfig, trials: list[FrozenTrial], device: str
) -> dict[str, Candidate]:
    """Each named peer's pick for ``workload`` on ``device``, beside the search that wrote
    ``cfg`` from ``trials`` (a peer with nothing to pick, such as ``fastest-probe`` after a
    search that completed no probe, is left out)."""
    base, lr = workload.base_batch_size, workload.base_lr
    half = "fp16" if "bf16" in unsupported_modes(resolve_device(device)) else "bf16"
    top = max(base, cfg.evidence.ceilings.get(half, base))
    doubled = base
    while doubled * 2 <= top:
        doubled *= 2
    ratio = doubled / base
    rule = ratio if workload.lr_scaling == "linear" else ratio**0.5

    def at(precision: str, batch: int, rate: float) -> Candidate:
        return Candidate(
            precision=precision,
            batch_size=batch,
            learning_rate=rate,
            channels_last=workload.channels_last,
        )

    out = {
        "amp": at("fp16", base, lr),
        "hf-bf16": at(half, base, lr),
        "pl-scale": at(half, doubled, lr),
        "pl-scale-lr": at(half, doubled, lr * rule),
    }
    fastest = max(
        (t for t in trials if t.state == TrialState.COMPLETE and record(t).throughput),
        key=lambda t: record(t).throughput or 0.0,
        default=None,
    )
    if fastest is not None:
        out["fastest-probe"] = candidate(fastest)
    return {n: c for n, c in out.items() if n in names}


def describe(cand: Candidate) -> str:
    return f"{cand.precision} bs={cand.batch_size} lr={cand.learning_rate:.3g}"
