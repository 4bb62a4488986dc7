"""Phases 1 and 2: which modes the device really runs, and each mode's batch ceiling.

1. **Hardware**: modes the device cannot run are cut, with the worker's reasons.
2. **Ceilings**: per mode, the largest batch that fits (:func:`autotune.ceilings.find_ceiling`;
   each try one untimed step, which pays the mode's first-use costs, and one timed step),
   inside a share of the budget. A mode whose first try cannot run is cut with the reason. The
   ceilings are stored with the study per machine and device, so a resumed run or another
   worker on the same machine does not measure them again.
"""

from __future__ import annotations

import socket

import optuna
from loguru import logger

from autotune.ceilings import Ceiling, find_ceiling
from autotune.result import ProbeResult
from autotune.search._budget import CEILING_SHARE
from autotune.search._context import SearchContext
from autotune.search._events import CeilingFound, HardwareChecked, PhaseStarted
from autotune.spec import ProbeSettings
from autotune.trials import ceilings_key

__all__ = ["check_hardware", "find_ceilings", "lower_ceiling"]


def check_hardware(ctx: SearchContext, modes: list[str]) -> list[str]:
    """The modes of ``modes`` the device runs; the others go to ``ctx.cut`` with the reason."""
    runnable = []
    for name in modes:
        why = ctx.facts.unsupported.get(name)
        if why is not None:
            ctx.cut[name] = why
            logger.info("cut {}: {}", name, why)
        else:
            runnable.append(name)
    ctx.emit(HardwareChecked(modes=list(runnable), cut=dict(ctx.cut)))
    return runnable


def _key(ctx: SearchContext) -> str:
    # Per machine and device: workers on other boxes may have other GPUs.
    return ceilings_key(socket.gethostname(), ctx.device)


def find_ceilings(ctx: SearchContext, study: optuna.Study, modes: list[str]) -> None:
    """Measure (or read back) each mode's batch ceiling into ``ctx.ceilings``."""
    space = ctx.spec.space
    key = _key(ctx)
    stored = study.user_attrs.get(key)
    if isinstance(stored, dict) and all(m in stored for m in modes):
        ctx.ceilings.update({m: int(stored[m]) for m in modes})
        logger.info("ceilings from the stored study: {}", ctx.ceilings)
        return
    ctx.runner.start()
    phase_end = ctx.budget.elapsed() + CEILING_SHARE * ctx.budget.left()
    budget_bytes = ctx.facts.memory_budget(ctx.spec.memory_margin)
    base = ctx.space.base_batch
    start = min(max(base, space.batch_size.min), space.batch_size.max)
    cap = max(space.batch_sizes) if space.batch_sizes else space.batch_size.max
    for i, mode in enumerate(modes):
        ctx.emit(PhaseStarted(phase="ceilings", mode=mode))
        share = (phase_end - ctx.budget.elapsed()) / (len(modes) - i)
        if share < 0.5:
            # Out of ceiling time: the mode keeps the base batch size, which the baselines run.
            ctx.ceilings[mode] = start
            ctx.cut[f"{mode} batch>{start}"] = (
                f"{mode} ceiling not measured above {start}: no time left"
            )
            logger.info(
                "ceiling {} = {} (not measured: the ceiling phase is out of time)", mode, start
            )
            ctx.emit(
                CeilingFound(
                    mode=mode, ceiling=Ceiling(precision=mode, batch_size=start, limited_by="time")
                )
            )
            continue
        # Per try: a slice of this mode's share; a try that runs out of it stops the doubling.
        # The first try pays the mode's first-use costs (on some CPUs seconds for bf16): it
        # gets half the share.
        limit = max(0.5, min(ctx.spec.probe.time_limit, share / 4))
        first_limit = max(1.0, min(ctx.spec.probe.time_limit, share / 2))
        # One untimed step (first-use costs of the mode's kernels), one timed step: counted,
        # not timed by min_time.
        settings = ProbeSettings(
            warmup_steps=1,
            steps=1,
            check_every=1,
            min_time=0,
            time_limit=limit,
            seed=ctx.spec.probe.seed,
        )

        def try_batch(
            bs: int,
            mode: str = mode,
            settings: ProbeSettings = settings,
            first: ProbeSettings = settings.model_copy(update={"time_limit": first_limit}),
            tried: list[int] = [],  # noqa: B006 - one list per mode, bound here on purpose
        ) -> ProbeResult:
            use = settings if tried else first
            tried.append(bs)
            return ctx.run_probe(ctx.space.candidate(mode, bs), use)

        ceiling = find_ceiling(
            try_batch,
            mode,
            start=start,
            cap=cap,
            budget_bytes=budget_bytes,
            # Stop doubling once a try at twice this size would not fit in the limit.
            stop_when=lambda r, limit=limit: (
                r.outcome == "crashed" or (r.step_time or 0.0) * 2 * 2 > limit
            ),
        )
        # A try cut short by the stop says nothing about memory: store no ceiling.
        ctx.stop_if_asked()
        ctx.ceilings[mode] = ceiling.batch_size
        if ceiling.batch_size == 0:
            # Not even the first size ran: the mode cannot run here (or not within this budget).
            first = ceiling.tries[0] if ceiling.tries else None
            ctx.cut[mode] = f"{mode} could not run one step at batch_size={start}" + (
                f": {first.outcome}: {first.note}" if first is not None else ""
            )
            logger.info("cut {}: {}", mode, ctx.cut[mode])
            ctx.emit(CeilingFound(mode=mode, ceiling=ceiling))
            continue
        if ceiling.batch_size < space.batch_size.max:
            ctx.cut[f"{mode} batch>{ceiling.batch_size}"] = (
                f"{mode} ceiling is {ceiling.batch_size} (limited by {ceiling.limited_by})"
            )
        ctx.emit(CeilingFound(mode=mode, ceiling=ceiling))
    study.set_user_attr(key, dict(ctx.ceilings))


def lower_ceiling(ctx: SearchContext, study: optuna.Study, mode: str, batch_size: int) -> None:
    """An OOM at ``batch_size`` during the search: the mode's ceiling drops below it."""
    lower = max([b for b in ctx.space.ladder if b < batch_size], default=0)
    if lower < ctx.ceilings.get(mode, 0):
        logger.info("{} bs={} → OOM, ceiling now {}", mode, batch_size, lower)
        ctx.ceilings[mode] = lower
        study.set_user_attr(_key(ctx), dict(ctx.ceilings))
