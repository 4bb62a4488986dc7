"""What users pick instead of running the search, each as a deterministic pick on a landscape
(the one-line rules) or a plain tuner on the simulated device (Optuna's TPE on throughput
alone), for ``search_sim.py`` to score by the same truth as the search.

- ``amp``: the AMP recipe (PyTorch's recipe, nanoGPT's ``train.py``): fp16 autocast and a
  GradScaler at its default init_scale 65536, at the user's (the workload's base) batch and lr.
- ``hf-bf16``: Hugging Face ``TrainingArguments(bf16=True, auto_find_batch_size=True)``: bf16
  autocast at the user's batch; on an OOM accelerate's ``find_executable_batch_size`` retries at
  ``int(0.9 * batch)`` (accelerate 1.x; older releases halved), the lr kept. Where the device has
  no bf16, ``fp16=True`` (what HF's own error message points to).
- ``pl-scale`` / ``pl-scale-lr``: Lightning's ``Tuner.scale_batch_size(mode="power")`` with
  ``precision="bf16-mixed"`` (``"16-mixed"`` where there is no bf16): the batch doubled from the
  user's until the next doubling runs out of memory (the device's whole memory, no margin; at
  most ``max_val=8192``), once with the lr kept and once with the workload's lr rule.
- ``tpe-throughput``: an Optuna TPE study over the same space as the search, each trial one
  plain probe (``runner.run``) on the same virtual clock, until the budget is spent (Optuna's
  ``timeout``: no trial starts past it, the one running finishes); the pick is the highest
  measured throughput among the probes that completed (no parity check, no validation, no
  reference; a probe that diverged or ran out of memory is a failed trial, as a NaN loss or an
  OOM would be to anyone).
"""

from __future__ import annotations

from typing import Any

import optuna

from autotune.infra import clock
from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate, StudySpec
from autotune.search._space import Space
from autotune.sim import Landscape, SimulatedRunner

PEERS = {
    "amp": "the AMP recipe: fp16 + GradScaler(65536) at the base batch",
    "hf-bf16": "HF bf16=True + auto_find_batch_size at the base batch",
    "pl-scale": "Lightning scale_batch_size(power) + bf16-mixed, lr kept",
    "pl-scale-lr": "Lightning scale_batch_size(power) + bf16-mixed, the workload's lr rule",
    "tpe-throughput": "Optuna TPE on measured throughput alone, same budget",
}
# Lightning's scale_batch_size stops doubling here (its max_val).
LIGHTNING_MAX_BATCH = 8192
# A plain tuner's loop ends here whatever the clock says (a space of unsupported modes only).
_MAX_TRIALS = 5000


def _has(land: Landscape, precision: str) -> bool:
    return precision in land.modes and precision not in land.unsupported


def _runs(land: Landscape, cand: Candidate) -> bool:
    """The run starts without an OOM: the whole device's memory, no margin (the simulated
    device's own rule)."""
    return land.peak_bytes(cand) <= land.memory_total_bytes


def _at(land: Landscape, precision: str, bs: int, *, lr_rule: bool) -> Candidate:
    f = land.facts
    ratio = bs / f.base_batch_size
    scale = (ratio if f.lr_scaling == "linear" else ratio**0.5) if lr_rule else 1.0
    return Candidate(
        precision=precision if _has(land, precision) else "fp32",
        batch_size=bs,
        learning_rate=f.base_lr * scale,
    )


def amp_recipe(land: Landscape) -> Candidate:
    """fp16 + GradScaler at its default scale, the user's batch and lr."""
    return _at(land, "fp16", land.facts.base_batch_size, lr_rule=False)


def hf_bf16(land: Landscape) -> Candidate:
    """bf16 (fp16 without bf16) at the user's batch, cut by 10% per OOM, the lr kept."""
    precision = "bf16" if _has(land, "bf16") else "fp16"
    bs = land.facts.base_batch_size
    while bs > 1 and not _runs(land, _at(land, precision, bs, lr_rule=False)):
        bs = int(bs * 0.9)
    return _at(land, precision, bs, lr_rule=False)


def lightning_power(land: Landscape, *, lr_rule: bool) -> Candidate:
    """Lightning's ``_run_power_scaling``: from the user's batch, double after each run that
    fits; on an OOM halve, and stop there once one run has fitted; a size at ``max_val`` is
    returned untried (25 trials at most)."""
    precision = "bf16" if _has(land, "bf16") else "fp16"
    bs, any_success = land.facts.base_batch_size, False
    for _ in range(25):
        if bs >= LIGHTNING_MAX_BATCH:
            break
        if _runs(land, _at(land, precision, bs, lr_rule=lr_rule)):
            bs, any_success = min(bs * 2, LIGHTNING_MAX_BATCH), True
            continue
        bs = max(1, bs // 2)
        if any_success:
            break
    return _at(land, precision, bs, lr_rule=lr_rule)


def fixed_picks(land: Landscape) -> dict[str, Candidate]:
    """Every deterministic peer's pick on ``land``."""
    return {
        "amp": amp_recipe(land),
        "hf-bf16": hf_bf16(land),
        "pl-scale": lightning_power(land, lr_rule=False),
        "pl-scale-lr": lightning_power(land, lr_rule=True),
    }


def tpe_throughput(
    land: Landscape, spec: StudySpec, space: Space, budget: float, seed: int
) -> dict[str, Any]:
    """Optuna's TPE on measured throughput alone over ``space``, ``budget`` virtual seconds.

    Returns:
        ``{"pick": Candidate, "trials": n, "seconds": virtual seconds used}``; the pick is fp32
        at the base batch when no probe completed.
    """
    runner = SimulatedRunner(land, seed=seed)
    sampler = optuna.samplers.TPESampler(seed=seed)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    best: tuple[float, Candidate] | None = None
    with clock.use(runner.clock):
        runner.start()
        for _ in range(_MAX_TRIALS):
            if runner.clock.monotonic() >= budget:
                break
            trial = study.ask()
            cand = space.suggest(trial)
            runner.clock.advance(land.timing.trial_overhead_seconds)
            result = runner.run(land.workload, cand, spec.probe)
            if result.outcome != Outcome.COMPLETED:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                continue
            study.tell(trial, result.throughput)
            if best is None or result.throughput > best[0]:
                best = (result.throughput, cand)
        seconds = runner.clock.monotonic()
    pick = best[1] if best else space.candidate("fp32", space.base_batch)
    return {"pick": pick, "trials": len(study.get_trials(deepcopy=False)), "seconds": seconds}
