"""The simulated device: the real search (:func:`simulate`) and the service's scheduler
(:func:`run_box`) on landscapes and a virtual clock."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from autotune.infra import clock
from autotune.schema.config import TunedConfig
from autotune.schema.enums import Phase
from autotune.schema.spec import StudySpec
from autotune.sim._box import Arrival, BoxReport, StudyOutcome, run_box
from autotune.sim._family import family
from autotune.sim._landscape import LANDSCAPE_DIR, Landscape, load_landscape, shipped_landscapes
from autotune.sim._simulated_runner import SimulatedRunner
from autotune.study.storage import Storage, in_memory_storage
from autotune.study.store import StudyStore

__all__ = [
    "LANDSCAPE_DIR",
    "Arrival",
    "BoxReport",
    "StudyOutcome",
    "run_box",
    "Landscape",
    "SimulatedRun",
    "family",
    "SimulatedRunner",
    "load_landscape",
    "shipped_landscapes",
    "simulate",
]


@dataclass
class SimulatedRun:
    """What a simulated search did."""

    config: TunedConfig | None
    store: StudyStore
    # Virtual seconds from the start to the config written, and before the first trial.
    seconds: float
    fixed_cost: float
    runner: SimulatedRunner
    # Virtual seconds per phase (start, ceilings, reference, search, validation, writing).
    spent: dict[str, float] = field(default_factory=dict)


def simulate(
    spec: StudySpec,
    landscape: Landscape | str | Path,
    *,
    seed: int = 0,
    out_dir: str | Path | None = None,
    storage: Storage | None = None,
) -> SimulatedRun:
    """Run the real search for ``spec`` on a simulated device, on a virtual clock.

    Args:
        spec: the study spec; its workload must be the landscape's.
        landscape: a Landscape, a shipped name (``a100-resnet18``) or a file.
        seed: seeds the timing noise and the sampler (with ``spec.seed``).
        out_dir: where ``best.json`` goes; a temporary folder by default.
        storage: where the study is kept; in memory by default.

    Raises:
        SpecError: a bad landscape reference or file.
        DeviceError: the spec's workload is not the landscape's.

    Example:
        >>> from autotune.schema.spec import parse_spec
        >>> spec = parse_spec({"name": "sim", "workload": "resnet18", "budget": "10m"})
        >>> run = simulate(spec, "a100-resnet18", seed=1)
        >>> run.config.precision in ("bf16", "fp16"), run.config.batch_size, run.seconds <= 600
        (True, 1024, True)
    """
    from autotune.search import Budget, PhaseStarted, TrialStarted, run_search

    land = landscape if isinstance(landscape, Landscape) else load_landscape(landscape)
    runner = SimulatedRunner(land, seed=seed)
    spec = spec.with_overrides({"seed": spec.seed + seed}) if seed else spec
    first_trial: list[float] = []

    def on_event(event: object) -> None:
        if isinstance(event, PhaseStarted) and event.phase == Phase.SEARCH and not first_trial:
            first_trial.append(runner.clock.monotonic())
        if isinstance(event, TrialStarted):
            # The tuner's own decision (ask, tell, storage writes) costs time too.
            runner.clock.advance(land.timing.trial_overhead_seconds)

    with clock.use(runner.clock), tempfile.TemporaryDirectory() as tmp:
        budget = Budget(spec.budget)
        result = run_search(
            spec,
            out_dir=out_dir if out_dir is not None else tmp,
            runner=runner,
            budget=budget,
            on_event=on_event,
            storage=storage or in_memory_storage(),
        )
        seconds = budget.elapsed()
    return SimulatedRun(
        config=result.config,
        store=result.store,
        seconds=seconds,
        fixed_cost=first_trial[0] if first_trial else seconds,
        runner=runner,
        spent={str(phase): spent for phase, spent in result.spent.items()},
    )
