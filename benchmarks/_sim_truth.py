"""The truth ``search_sim.py`` scores a simulated search and its peers by: the spec it runs, the
space that spec searches, the real run's horizon, a candidate's verdict (its effective speedup,
and whether it is safe), the optimum over the space and what a grid over it would take.

A verdict charges torch.compile's compile time to the real run that uses it: over a real run
that takes fp32 at the base batch ``T_ref`` seconds, a candidate of noise-free speedup ``s``
takes ``T_ref / s + compile_seconds``, so its effective speedup is
``T_ref / (T_ref / s + compile_seconds)``. The spec has no horizon of its own yet; ``T_ref`` is
``--horizon`` (default one hour: a run shorter than that is not worth a 30-minute search).

A candidate is unsafe when the truth (``Landscape.truth(cand, margin=spec.memory_margin)``)
says it does not fit with the spec's memory margin, diverges, or has a lasting parity gap past
``spec.parity_tolerance``; an unsafe candidate scores 0.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from autotune.infra import clock
from autotune.schema.spec import Candidate, StudySpec, parse_spec
from autotune.search import lr_for, reference_factor
from autotune.search._risk import KEPT_LR_FLOOR
from autotune.search._space import Space
from autotune.sim import Landscape, SimulatedRunner

# The real run, in seconds of fp32 at the base batch, when the spec does not say.
DEFAULT_HORIZON_S = 3600.0
# The knobs ``--knobs`` makes the spec search (each both ways).
KNOBS = ("compile", "channels_last")
# GradScaler's default init_scale: what a grid, and every peer that uses fp16, runs.
DEFAULT_SCALE = 2.0**16


def precisions_of(land: Landscape) -> list[str]:
    return [p for p in land.modes if p not in land.unsupported]


def spec_for(
    land: Landscape,
    budget: float,
    *,
    early_stop: bool = True,
    knobs: tuple[str, ...] = (),
    run_seconds: float = 0.0,
) -> StudySpec:
    """The benchmark's spec: the defaults but the landscape's precisions, the budget, each
    knob of ``knobs`` searched on and off, and the real run's length: ``run_seconds`` of fp32
    at the base batch, in samples (none where 0)."""
    space: dict[str, Any] = {"precisions": precisions_of(land)}
    for knob in knobs:
        space[knob] = [False, True]
    raw: dict[str, Any] = {
        "name": f"sim-{land.name}",
        "workload": land.workload,
        "budget": budget,
        "space": space,
    }
    if not early_stop:
        raw["probe"] = {"early_stop": False}
    if run_seconds:
        f = land.facts
        base = Candidate(precision="fp32", batch_size=f.base_batch_size, learning_rate=f.base_lr)
        raw["run"] = {"samples": max(1, round(run_seconds * land.throughput(base)))}
    return parse_spec(raw)


def space_of(land: Landscape, spec: StudySpec) -> Space:
    f = land.facts
    return Space.of(
        spec,
        precisions_of(land),
        rule=f.lr_scaling,
        base_lr=f.base_lr,
        base_batch=f.base_batch_size,
        channels_last=f.channels_last,
    )


def compile_seconds(land: Landscape, cand: Candidate) -> float:
    """What compiling costs the run that uses ``cand`` (0 when it does not compile)."""
    per_mode = getattr(land, "compile_seconds", None)  # schema 2 states it per compile mode
    if per_mode is not None:
        return per_mode(cand)
    return land.knobs.compile_seconds if cand.compile else 0.0


@dataclass(frozen=True)
class Verdict:
    """A candidate by the truth."""

    # Noise-free speedup over fp32 at the base batch, steady state (what a probe measures) ...
    raw: float
    # ... and over the real run, its compile time charged: what the candidate is scored by.
    effective: float
    parity_gap: float
    # Empty when safe; else why not ("no fit with the margin", "diverges", "parity +6.1%").
    unsafe: str = ""

    @property
    def safe(self) -> bool:
        return not self.unsafe

    @property
    def score(self) -> float:
        """The effective speedup, 0 when unsafe."""
        return self.effective if self.safe else 0.0


def judge(land: Landscape, spec: StudySpec, cand: Candidate, horizon_s: float) -> Verdict:
    """``cand``'s verdict over a real run of ``horizon_s`` seconds of fp32 at the base batch."""
    truth = land.truth(cand, margin=spec.memory_margin)
    raw = truth.speedup
    effective = horizon_s / (horizon_s / raw + compile_seconds(land, cand)) if raw > 0 else 0.0
    why = ""
    if not truth.fits:
        why = "no fit with the margin"
    elif truth.diverges:
        why = "diverges"
    elif truth.parity_gap > spec.parity_tolerance:
        why = f"parity {truth.parity_gap:+.1%}"
    return Verdict(raw=raw, effective=effective, parity_gap=truth.parity_gap, unsafe=why)


def describe(cand: Candidate, land: Landscape) -> str:
    """``bf16 bs=256``, with what differs from the plain point (compiled, channels_last, the
    init_scale, fp32 islands)."""
    out = f"{cand.precision} bs={cand.batch_size}"
    if cand.compile:
        out += " compiled"
    if cand.channels_last is not None and cand.channels_last != land.facts.channels_last:
        out += " cl" if cand.channels_last else " no-cl"
    if cand.precision == "fp16" and cand.init_scale != DEFAULT_SCALE:
        out += f" scale={_power(cand.init_scale)}"
    if cand.fp32_modules:
        out += " islands"
    if abs(cand.learning_rate / _rule_lr(land, cand.batch_size) - 1) > 1e-6:
        out += f" lr={cand.learning_rate:g}"
    return out


def _rule_lr(land: Landscape, batch: int) -> float:
    """The lr the workload's rule gives ``batch``."""
    f = land.facts
    return lr_for(f.lr_scaling, f.base_lr, f.base_batch_size, batch, 1.0)


def _kept_lrs(land: Landscape, spec: StudySpec, space: Space, batch: int) -> list[float]:
    """The lr multipliers the search may keep a batch at after its rule's lr blew up (``lr_scaling:
    auto``): any lr the ladder's rule gives a smaller batch, the base lr the least (see
    ``autotune.search._risk.kept_lr``)."""
    if spec.space.lr_scaling != "auto" or batch <= space.base_batch:
        return []
    rule = _rule_lr(land, batch)
    lrs = {_rule_lr(land, b) for b in space.ladder if space.base_batch <= b < batch}
    return sorted(
        r / rule for r in lrs if KEPT_LR_FLOOR * rule * (1 - 1e-9) <= r < rule * (1 - 1e-9)
    )


def _power(x: float) -> str:
    """``128.0`` -> ``2^7``; anything not a power of two as itself."""
    k = round(math.log2(x))
    return f"2^{k}" if 2.0**k == x else f"{x:g}"


def _knob_choices(space: Space) -> list[dict[str, Any]]:
    """Every combination of the searched knobs (compile, channels_last)."""
    compiles = list(space.compile)
    layouts: list[bool | None] = list(space.channels_last) if space.channels_last else [None]
    return [{"compile": c, "channels_last": cl} for c, cl in itertools.product(compiles, layouts)]


def space_points(land: Landscape, spec: StudySpec, space: Space) -> list[Candidate]:
    """Every point the spec searches: precision x batch ladder x the searched knobs, at lr
    multiplier 1 and at each lr the search may keep a larger batch at, fp16 at each init_scale
    of the space and, where the landscape has fp32 islands and the spec tries them, fp16 with
    those modules in fp32."""
    points = []
    for precision, bs, knobs in itertools.product(
        space.precisions, space.ladder, _knob_choices(space)
    ):
        for mult in [1.0, *_kept_lrs(land, spec, space, bs)]:
            if precision != "fp16":
                points.append(space.candidate(precision, bs, mult, **knobs))
                continue
            # The default scale first: where scales tie, the optimum names the one users run.
            for scale in sorted(space.scales, key=lambda x: x != DEFAULT_SCALE):
                points.append(space.candidate(precision, bs, mult, init_scale=scale, **knobs))
                if land.fp16.islands and spec.space.fp32_islands:
                    islands = list(land.fp16.islands)
                    points.append(
                        space.candidate(
                            precision, bs, mult, init_scale=scale, fp32_modules=islands, **knobs
                        )
                    )
    return points


def optimum(
    land: Landscape, spec: StudySpec, horizon_s: float, *, inside: float = 0.0
) -> dict[str, Any]:
    """The best safe effective speedup over the space, or the fp32 fallback (1.0x) where that
    does not reach the spec's ``min_speedup`` (falling back is then right); with ``inside``,
    over the settings whose lasting gap lies at least that far under the tolerance."""
    space = space_of(land, spec)
    best, best_v = None, None
    limit = spec.parity_tolerance - inside
    for cand in space_points(land, spec, space):
        v = judge(land, spec, cand, horizon_s)
        if v.safe and v.parity_gap <= limit and (best_v is None or v.effective > best_v.effective):
            best, best_v = cand, v
    if best is None or best_v is None or best_v.effective < spec.validation.min_speedup:
        return {"optimum": 1.0, "optimum_point": "fp32 bs=base"}
    return {"optimum": best_v.effective, "optimum_point": describe(best, land)}


def grid_seconds(land: Landscape, spec: StudySpec, how: str = "paired") -> dict[str, Any]:
    """What a grid over the spec's space would take, simulated (see ``search_sim.py``): worker
    start, the fp32 reference once, then one probe (``probes``) or one paired run (``paired``)
    per precision x fitting batch x searched knob combination, fp16 at GradScaler's default
    init_scale only."""
    space = space_of(land, spec)
    runner = SimulatedRunner(land, seed=0)
    ref = space.candidate("fp32", space.base_batch)
    factor = reference_factor(max(space.ladder), space.base_batch)
    probe = spec.probe
    points = 0
    with clock.use(runner.clock):
        runner.start()
        ref_settings = probe.model_copy(
            update={"steps": probe.steps * factor, "time_limit": probe.time_limit * factor}
        )
        runner.run(land.workload, ref, ref_settings)
        for precision, bs, knobs in itertools.product(
            space.precisions, space.ladder, _knob_choices(space)
        ):
            point = space.candidate(precision, bs, **knobs)
            if not land.truth(point, margin=spec.memory_margin).fits:
                continue
            points += 1
            if how == "paired":
                runner.compare(land.workload, point, ref, probe)
            else:
                runner.run(land.workload, point, probe)
        seconds = runner.clock.monotonic()
    return {"seconds": seconds, "points": points}
