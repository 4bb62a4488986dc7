"""The search: an Optuna study over precision × batch size × learning rate × init_scale.

The phases, all inside one wall-clock budget:

1. **Hardware**: modes the device cannot really run are cut from the space, with reasons.
2. **Ceilings**: the largest batch that fits, per mode; the ladder above it is cut.
3. **Search**: the fp32 reference and the plain AMP recipe are enqueued first; then the sampler
   proposes candidates. Each runs as a probe in the worker. Completed trials report throughput
   with a convergence-parity constraint; diverged, OOM and unsupported trials are PRUNED with the
   reason (the sampler learns from them); a crashed worker is FAIL.
4. **Validation** (:mod:`autotune.validate`): the best feasible candidates are re-run longer,
   with a fresh seed, beside the fp32 reference.
5. **Artifact**: ``best.json``.
"""

from __future__ import annotations

import contextlib
import math
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from loguru import logger
from optuna.trial import TrialState

from autotune.ceilings import Ceiling, find_ceiling, memory_budget
from autotune.config import TunedConfig
from autotune.errors import AutotuneError, StorageError, StorageIOError
from autotune.parity import parity_gap, time_to_loss
from autotune.precision import resolve_device, unsupported_modes
from autotune.result import ProbeResult
from autotune.spec import Candidate, ProbeSettings, StudySpec
from autotune.storage import (
    GRACE_PERIOD,
    HEARTBEAT_INTERVAL,
    claim,
    fail_stale,
    heartbeat,
    open_study,
    owner_id,
)
from autotune.worker import ProbeWorker, Runner
from autotune.workloads import Workload, load_workload, normalize_reference

__all__ = [
    "Budget",
    "SearchInterrupted",
    "SearchStopped",
    "SearchResult",
    "batch_ladder",
    "lr_for",
    "reference_factor",
    "run_search",
]

# Share of the budget the ceiling phase may use at most.
_CEILING_SHARE = 0.25
# Share of the budget held back for validation.
_VALIDATION_SHARE = 0.3
# Seconds held back for writing the artifact.
_WRITE_RESERVE = 0.5
# A probe may overrun its soft limit by about one step; the hard limit adds this much.
_HARD_GRACE = 15.0
# No ordinary trial may take more than this share of the budget.
_TRIAL_SHARE = 0.1
# The fp32 reference runs up to this many times the probe length (see reference_factor) ...
_MAX_REFERENCE_FACTOR = 8
# ... within this share of the budget.
_REFERENCE_SHARE = 0.15


def reference_factor(largest_batch: int, base_batch: int) -> int:
    """How many times longer the reference probe runs, so it sees as many samples as a probe of
    the largest batch size does (capped at 8).

    Example:
        >>> reference_factor(1024, 128)
        8
    """
    return max(1, min(_MAX_REFERENCE_FACTOR, math.ceil(largest_batch / base_batch)))


Event = Callable[[str, dict[str, Any]], None]
# Called before each probe with its candidate; may block until the device has room.
Gate = Callable[[Candidate], None]


class SearchInterrupted(AutotuneError):
    """Ctrl-C: the trials done so far are saved in the storage; running again resumes."""


class SearchStopped(AutotuneError):
    """The caller asked the search to stop (a cancel, or a service draining)."""


@dataclass
class Budget:
    """The whole job's wall-clock budget, counted from ``started`` (a ``time.monotonic()``).

    Time spent inside :meth:`paused` (waiting for a busy device) does not count: a study's
    budget is probe time, not queue time.
    """

    total: float
    started: float = field(default_factory=time.monotonic)
    paused_seconds: float = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.started - self.paused_seconds

    def left(self) -> float:
        return self.total - self.elapsed()

    @contextmanager
    def paused(self) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.paused_seconds += time.monotonic() - t0

    @classmethod
    def shared(cls, study: optuna.Study) -> Budget | None:
        """The budget window the study's current run opened, as seen by a joining worker.

        Returns None when the study has no open window (nobody started a search on it).
        """
        window = study.user_attrs.get("budget_window")
        if not isinstance(window, dict):
            return None
        ago = time.time() - float(window["started_at"])
        return cls(total=float(window["seconds"]), started=time.monotonic() - ago)


@dataclass
class SearchResult:
    """What a search produced: the config, where it was written and the study behind it."""

    config: TunedConfig | None
    path: Path | None
    study: optuna.Study
    baselines: dict[str, dict[str, Any]]
    rejected: list[str]
    cut: dict[str, str]
    ceilings: dict[str, int]
    elapsed: float
    # Who validated: this process, or another worker of the same study.
    validated_by: str = ""


def batch_ladder(lo: int, hi: int, base: int) -> list[int]:
    """Powers of two in ``[lo, hi]``, plus ``lo``, ``hi`` and the workload's base batch size.

    Example:
        >>> batch_ladder(16, 1000, 128)
        [16, 32, 64, 128, 256, 512, 1000]
    """
    sizes = {2**k for k in range(0, 31) if lo <= 2**k <= hi} | {lo, hi, base}
    return sorted(sizes)


def lr_for(rule: str, base_lr: float, base_batch: int, batch_size: int, multiplier: float) -> float:
    """The learning rate for a batch size: the scaling rule, times the sampled multiplier.

    ``linear``: lr ∝ batch (SGD-like); ``sqrt``: lr ∝ √batch (Adam-like); ``none``: lr fixed.

    Example:
        >>> lr_for("linear", 0.1, 128, 512, 1.0)
        0.4
    """
    ratio = batch_size / base_batch
    factor = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]
    return base_lr * factor * multiplier


def _finite(values: list[float]) -> list[float | None]:
    """Losses for storage: NaN and inf become null (storage never holds NaN)."""
    return [v if math.isfinite(v) else None for v in values]


def _powers_of_two(lo: float, hi: float) -> list[float]:
    out = [2.0**k for k in range(0, 40) if lo <= 2.0**k <= hi]
    return sorted(set(out) | {2.0**16})


class _Search:
    def __init__(
        self,
        spec: StudySpec,
        runner: Runner,
        budget: Budget,
        out_dir: Path,
        on_event: Event | None,
        gate: Gate | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        self.spec = spec
        self.gate = gate
        self.should_stop = should_stop or (lambda: False)
        self.runner = runner
        self.budget = budget
        self.out_dir = out_dir
        self.emit = on_event or (lambda kind, data: None)
        self.ref = normalize_reference(spec.workload)
        self.workload: Workload = load_workload(self.ref)
        self.device = resolve_device(spec.device)
        self.rule = (
            self.workload.lr_scaling if spec.space.lr_scaling == "auto" else spec.space.lr_scaling
        )
        self.cut: dict[str, str] = {}
        self.ceilings: dict[str, int] = {}
        self.probe_seconds: list[float] = []
        # Wall seconds of the search trials' probes only (not ceilings, not the reference).
        self.trial_seconds: list[float] = []
        self._reference: optuna.trial.FrozenTrial | None = None
        self.choices: list[str] = ["fp32"]
        # Validation's reserve, recomputed every few trials: it reads the whole study.
        self._reserve: tuple[int, float] | None = None

    # ---- helpers -------------------------------------------------------------------------

    def _lr(self, batch_size: int, multiplier: float) -> float:
        wl = self.workload
        return lr_for(self.rule, wl.base_lr, wl.base_batch_size, batch_size, multiplier)

    def run_probe(self, candidate: Candidate, settings: ProbeSettings) -> ProbeResult:
        """Run one probe in the runner: gated, counted against the budget, hard-limited."""
        if self.should_stop():
            raise SearchStopped(f"study {self.spec.name!r} was asked to stop")
        if self.gate is not None:
            with self.budget.paused():
                self.gate(candidate)
        left = self.budget.left()
        hard = min(settings.time_limit + _HARD_GRACE, max(settings.time_limit + 1.0, left))
        t0 = time.monotonic()
        result = self.runner.run(self.ref, candidate, settings, timeout=hard)
        self.probe_seconds.append(time.monotonic() - t0)
        return result

    # ---- phase 1: hardware ------------------------------------------------------------------

    def fix_choices(self, study: optuna.Study, modes: list[str]) -> None:
        """The precision choices the sampler offers: the modes the study's first device runs,
        stored with the study so every worker and every resumed run offers the same ones."""
        stored = study.user_attrs.get("precision_choices")
        if isinstance(stored, list) and stored:
            self.choices = [str(m) for m in stored]
        else:
            self.choices = [m for m in self.all_modes if m in modes] or ["fp32"]
            study.set_user_attr("precision_choices", self.choices)

    @property
    def all_modes(self) -> list[str]:
        """The spec's modes (and always fp32, the reference): the sampler's fixed choices."""
        return list(dict.fromkeys(["fp32", *self.spec.space.precisions]))

    def hardware(self) -> list[str]:
        unsupported = unsupported_modes(self.device)
        modes = []
        for name in self.all_modes:
            if name in unsupported:
                self.cut[name] = unsupported[name]
                logger.info("cut {}: {}", name, unsupported[name])
            else:
                modes.append(name)
        self.emit("hardware", {"modes": modes, "cut": dict(self.cut)})
        return modes

    # ---- phase 2: ceilings ------------------------------------------------------------------

    def find_ceilings(self, study: optuna.Study, modes: list[str]) -> None:
        space = self.spec.space
        # Per machine and device: workers on other boxes may have other GPUs.
        key = f"ceilings:{socket.gethostname()}:{self.device}"
        stored = study.user_attrs.get(key)
        if isinstance(stored, dict) and all(m in stored for m in modes):
            self.ceilings = {m: int(stored[m]) for m in modes}
            logger.info("ceilings from the stored study: {}", self.ceilings)
            return
        self.runner.start()
        phase_end = self.budget.elapsed() + _CEILING_SHARE * self.budget.left()
        budget_bytes = memory_budget(self.device, self.spec.memory_margin)
        start = min(max(self.workload.base_batch_size, space.batch_size.min), space.batch_size.max)
        for i, mode in enumerate(modes):
            self.emit("phase", {"phase": "ceilings", "mode": mode})
            share = (phase_end - self.budget.elapsed()) / (len(modes) - i)
            if share < 0.5:
                # Out of ceiling time: the mode keeps the base batch size, which the baselines run.
                self.ceilings[mode] = start
                self.cut[f"{mode} batch>{start}"] = (
                    f"{mode} ceiling not measured above {start}: no time left"
                )
                logger.info(
                    "ceiling {} = {} (not measured: the ceiling phase is out of time)", mode, start
                )
                self.emit(
                    "ceiling",
                    {
                        "mode": mode,
                        "ceiling": {
                            "precision": mode,
                            "batch_size": start,
                            "limited_by": "time",
                            "tries": [],
                        },
                    },
                )
                continue
            if not self._warm_up(mode, start, share):
                continue
            # Per try: a slice of this mode's share; a try that runs out of it stops the doubling.
            limit = max(0.5, min(self.spec.probe.time_limit, share / 4))
            # One untimed step (first-use costs of the mode's kernels), one timed step.
            settings = ProbeSettings(
                warmup_steps=1, steps=1, check_every=1, time_limit=limit, seed=self.spec.probe.seed
            )

            def try_batch(
                bs: int, mode: str = mode, settings: ProbeSettings = settings
            ) -> ProbeResult:
                cand = Candidate(precision=mode, batch_size=bs, learning_rate=self._lr(bs, 1.0))
                return self.run_probe(cand, settings)

            ceiling = find_ceiling(
                try_batch,
                mode,
                start=start,
                cap=max(space.batch_sizes) if space.batch_sizes else space.batch_size.max,
                budget_bytes=budget_bytes,
                # Stop doubling once a try at twice this size would not fit in the limit.
                stop_when=lambda r, limit=limit: (
                    r.outcome == "crashed" or (r.step_time or 0.0) * 2 * 2 > limit
                ),
            )
            if self.should_stop():
                # A try cut short by the stop says nothing about memory: store no ceiling.
                raise SearchStopped(f"study {self.spec.name!r} was asked to stop")
            self.ceilings[mode] = ceiling.batch_size
            self._record_ceiling(mode, ceiling)
        study.set_user_attr(key, dict(self.ceilings))

    def _warm_up(self, mode: str, batch_size: int, share: float) -> bool:
        """Pay a mode's first-use costs (kernel compilation, library set-up) once, untimed.

        On some CPUs the first bf16 step takes seconds. A mode that cannot finish one step
        within its share is too slow for this budget: it is cut, with the measurement.
        """
        limit = max(1.0, share / 2)
        cand = Candidate(
            precision=mode, batch_size=batch_size, learning_rate=self._lr(batch_size, 1.0)
        )
        settings = ProbeSettings(warmup_steps=0, steps=1, check_every=1, time_limit=limit)
        result = self.run_probe(cand, settings)
        if result.outcome in ("completed", "diverged"):
            return True
        self.ceilings[mode] = 0
        self.cut[mode] = (
            f"{mode} could not run one step at batch_size={batch_size}: {result.outcome}: {result.reason}"
        )
        logger.info("cut {}: {}", mode, self.cut[mode])
        return False

    def _record_ceiling(self, mode: str, ceiling: Ceiling) -> None:
        if ceiling.batch_size < self.spec.space.batch_size.max:
            self.cut[f"{mode} batch>{ceiling.batch_size}"] = (
                f"{mode} ceiling is {ceiling.batch_size} (limited by {ceiling.limited_by})"
            )
        self.emit("ceiling", {"mode": mode, "ceiling": ceiling.model_dump()})

    # ---- phase 3: search --------------------------------------------------------------------

    def enqueue_baselines(self, study: optuna.Study, modes: list[str]) -> None:
        base = self.workload.base_batch_size
        study.enqueue_trial(
            {"precision": "fp32", "batch_size": base, "lr_multiplier": 1.0},
            user_attrs={"role": "reference"},
            skip_if_exists=True,
        )
        if "fp16" in modes:
            study.enqueue_trial(
                {
                    "precision": "fp16",
                    "batch_size": base,
                    "lr_multiplier": 1.0,
                    "init_scale": 2.0**16,
                },
                user_attrs={"role": "amp_recipe"},
                skip_if_exists=True,
            )
        # Each other mode at the reference's own settings: the same curve, only faster or not.
        for mode in modes:
            if mode not in ("fp32", "fp16"):
                study.enqueue_trial(
                    {"precision": mode, "batch_size": base, "lr_multiplier": 1.0},
                    user_attrs={"role": f"{mode}_at_base"},
                    skip_if_exists=True,
                )

    def reference(self, study: optuna.Study) -> optuna.trial.FrozenTrial | None:
        """The completed fp32 reference trial; once found it never changes, so it is kept."""
        if self._reference is not None:
            return self._reference
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.user_attrs.get("role") == "reference" and t.user_attrs.get("losses"):
                self._reference = t
                return t
        return None

    def validation_reserve(self, study: optuna.Study) -> float:
        """Seconds validation will need: the reference and the top-k reruns, from the search's
        own probe times, with room to spare; a share of the budget until there are figures."""
        done = len(self.trial_seconds)
        if self._reserve is not None and done - self._reserve[0] < 5:
            return self._reserve[1]
        reserve = self._validation_reserve(study)
        self._reserve = (done, reserve)
        return reserve

    def _validation_reserve(self, study: optuna.Study) -> float:
        from autotune.validate import feasible_best

        val, probe = self.spec.validation, self.spec.probe
        ratio = (probe.warmup_steps + val.steps) / (probe.warmup_steps + probe.steps)
        ref = self.reference(study)
        best = feasible_best(study, self.spec.objective == "throughput", val.top_k)
        if ref is None or not best:
            return _VALIDATION_SHARE * self.budget.total
        seconds = [float(t.user_attrs.get("probe_seconds") or 0) for t in best]
        ref_seconds = float(ref.user_attrs.get("probe_seconds") or 0)
        need = 1.5 * ratio * (sum(seconds) + ref_seconds) + 0.5
        return min(_VALIDATION_SHARE * self.budget.total, max(3.0, need))

    def search(self, study: optuna.Study, modes: list[str], end_at: float) -> None:
        space = self.spec.space
        if space.batch_sizes:
            ladder = sorted(set(space.batch_sizes) | {self.workload.base_batch_size})
        else:
            ladder = batch_ladder(
                space.batch_size.min, space.batch_size.max, self.workload.base_batch_size
            )
        # The choices stay those of the spec, whatever this device cuts: every worker and every
        # resumed run of a study must offer the sampler the same space. What this device cannot
        # run is pruned at once, with the reason, at no cost.
        lr_lo = min(space.lr_multiplier.min, 1.0)
        lr_hi = max(space.lr_multiplier.max, 1.0)
        scales = _powers_of_two(space.init_scale.min, space.init_scale.max)
        self.emit("phase", {"phase": "search"})
        while True:
            deadline = end_at - self.validation_reserve(study)
            left = deadline - self.budget.elapsed()
            typical = statistics.median(self.probe_seconds[-10:]) if self.probe_seconds else 0.0
            if left < max(1.0, 0.25 * typical):
                logger.info("search phase over: {:.0f}s left for it", max(0.0, left))
                return
            if self.should_stop():
                raise SearchStopped(f"study {self.spec.name!r} was asked to stop")
            # Trials whose worker died (no heartbeat) are failed here and retried once.
            fail_stale(study)
            trial = study.ask()
            try:
                with heartbeat(study, trial):
                    self._trial(study, trial, modes, ladder, (lr_lo, lr_hi), scales, left)
            except (KeyboardInterrupt, SearchStopped) as exc:
                trial.set_user_attr("outcome", "interrupted")
                trial.set_user_attr("reason", "stopped before the trial finished")
                study.tell(trial, state=TrialState.FAIL)
                if isinstance(exc, SearchStopped):
                    self._retry(study, trial)
                raise
            except AutotuneError:
                # When the storage is what failed, failing the trial fails too (it is failed as
                # stale on resume): the storage's own error is the one to report.
                with contextlib.suppress(StorageIOError):
                    study.tell(trial, state=TrialState.FAIL)
                raise

    def _trial(
        self,
        study: optuna.Study,
        trial: optuna.Trial,
        modes: list[str],
        ladder: list[int],
        lr_range: tuple[float, float],
        scales: list[float],
        left: float,
    ) -> None:
        precision = trial.suggest_categorical("precision", self.choices)
        batch_size = trial.suggest_categorical("batch_size", ladder)
        if self.spec.space.lr_multipliers:
            choices = sorted(set(self.spec.space.lr_multipliers) | {1.0})
            multiplier = trial.suggest_categorical("lr_multiplier", choices)
        else:
            multiplier = trial.suggest_float("lr_multiplier", *lr_range, log=True)
        init_scale = 2.0**16
        if precision == "fp16":
            init_scale = trial.suggest_categorical("init_scale", scales)
        lr = self._lr(batch_size, multiplier)
        cand = Candidate(
            precision=precision, batch_size=batch_size, learning_rate=lr, init_scale=init_scale
        )
        trial.set_user_attr("learning_rate", lr)
        trial.set_user_attr("lr_scaling", self.rule)
        trial.set_user_attr("worker", owner_id())
        self.emit("trial", {"number": trial.number, "candidate": cand.model_dump()})

        # Same parameters as a finished trial: reuse its measurement, spend no budget.
        twin = self._twin(study, trial)
        if twin is not None:
            self._copy(study, trial, twin)
            return
        if precision not in modes:
            why = self.cut.get(precision, f"{precision} was cut on this device")
            self._prune(study, trial, "unsupported", why)
            return
        ceiling = self.ceilings.get(precision, 0)
        if batch_size > ceiling and trial.user_attrs.get("role") is None:
            self._prune(
                study,
                trial,
                "above_ceiling",
                f"batch_size={batch_size} is above the {precision} ceiling {ceiling}",
            )
            return
        settings = self._settings_for(trial, ladder, left)
        result = self.run_probe(cand, settings)
        if result.outcome == "crashed" and self.should_stop():
            # The probe was cut short by the stop itself (Ctrl-C kills the worker's probe).
            raise SearchStopped(f"study {self.spec.name!r} was asked to stop")
        logger.info("trial {}: {}", trial.number, result.summary())
        self._attrs(trial, result)
        if trial.user_attrs.get("role") != "reference" and result.outcome == "completed":
            self.trial_seconds.append(result.wall_seconds)
        if result.outcome == "completed":
            self._complete(study, trial, result)
        elif result.outcome == "crashed":
            if result.timed_out:
                # Far too slow to finish one step in time: a measurement, not a crash.
                self._prune(study, trial, "too_slow", result.reason)
                return
            trial.set_user_attr("outcome", "crashed")
            trial.set_user_attr("reason", result.reason)
            study.tell(trial, state=TrialState.FAIL)
            logger.warning("trial {} failed: {}", trial.number, result.reason)
            self._retry(study, trial)
            self.emit(
                "result", {"number": trial.number, "outcome": "crashed", "reason": result.reason}
            )
        else:
            if result.outcome == "oom":
                lower = max([b for b in ladder if b < batch_size], default=0)
                if lower < self.ceilings.get(precision, 0):
                    logger.info("{} bs={} → OOM, ceiling now {}", precision, batch_size, lower)
                    self.ceilings[precision] = lower
                    key = f"ceilings:{socket.gethostname()}:{self.device}"
                    study.set_user_attr(key, dict(self.ceilings))
            self._prune(study, trial, result.outcome, result.reason)

    def _retry(self, study: optuna.Study, trial: optuna.Trial) -> None:
        """A crashed or interrupted trial runs once more (a crash may be the worker, not the
        candidate); a retry that fails too stays failed."""
        if trial.user_attrs.get("retry_of") is not None or not trial.params:
            return
        attrs = {k: v for k, v in trial.user_attrs.items() if k in ("role",)}
        study.enqueue_trial(dict(trial.params), user_attrs={**attrs, "retry_of": trial.number})
        logger.info("trial {} will be retried once", trial.number)

    def _settings_for(self, trial: optuna.Trial, ladder: list[int], left: float) -> ProbeSettings:
        """Probe settings for a trial. The fp32 reference runs longer: parity compares curves at
        equal samples seen, so it must have seen as many samples as the largest batch's probe."""
        probe = self.spec.probe
        limit = max(1.0, min(probe.time_limit, left))
        if trial.user_attrs.get("role") != "reference":
            # A mode far slower than the rest (fp16 on many CPUs) shows it in a few steps; a
            # short budget should not spend a large slice of itself proving it.
            limit = max(1.0, min(limit, max(3.0, _TRIAL_SHARE * self.budget.total)))
            if len(self.trial_seconds) >= 3:
                # Once typical trials are known, one far slower than them is cut at a few times
                # their length: its throughput is measured by then.
                typical = statistics.median(self.trial_seconds)
                limit = max(1.0, min(limit, max(2.0, 4 * typical)))
            return probe.model_copy(update={"time_limit": limit})
        factor = reference_factor(max(ladder), self.workload.base_batch_size)
        limit = max(1.0, min(probe.time_limit * factor, _REFERENCE_SHARE * self.budget.total, left))
        return probe.model_copy(update={"steps": probe.steps * factor, "time_limit": limit})

    def _twin(self, study: optuna.Study, trial: optuna.Trial) -> optuna.trial.FrozenTrial | None:
        params = trial.params
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            if t.number != trial.number and t.params == params and "outcome" in t.user_attrs:
                return t
        return None

    def _copy(
        self, study: optuna.Study, trial: optuna.Trial, twin: optuna.trial.FrozenTrial
    ) -> None:
        for k, v in twin.user_attrs.items():
            if k != "role":
                trial.set_user_attr(k, v)
        trial.set_user_attr("duplicate_of", twin.number)
        if twin.state == TrialState.COMPLETE:
            for k, v in twin.constraints.items():
                trial.set_constraint(k, v)
            study.tell(trial, twin.value)
        else:
            study.tell(trial, state=TrialState.PRUNED)
        self.emit(
            "result",
            {
                "number": trial.number,
                "outcome": "reused",
                "reason": f"same parameters as trial {twin.number}: its measurement is reused",
                **self.standing(study),
            },
        )

    def _attrs(self, trial: optuna.Trial, result: ProbeResult) -> None:
        trial.set_user_attr("outcome", result.outcome)
        trial.set_user_attr("reason", result.reason)
        trial.set_user_attr("throughput", result.throughput)
        trial.set_user_attr("peak_memory_bytes", result.peak_memory)
        trial.set_user_attr("skipped_steps", result.skipped_steps)
        trial.set_user_attr("timed_steps", result.timed_steps)
        trial.set_user_attr("truncated", result.truncated)
        trial.set_user_attr("probe_seconds", round(result.wall_seconds, 3))
        trial.set_user_attr("losses", _finite(result.losses))
        trial.set_user_attr("scales", [[s, v] for s, v in result.scales])
        trial.set_user_attr("seed", result.seed)

    def _prune(self, study: optuna.Study, trial: optuna.Trial, outcome: str, reason: str) -> None:
        trial.set_user_attr("outcome", outcome)
        trial.set_user_attr("reason", reason)
        study.tell(trial, state=TrialState.PRUNED)
        logger.info("trial {} pruned: {}: {}", trial.number, outcome, reason)
        self.emit(
            "result",
            {"number": trial.number, "outcome": outcome, "reason": reason, **self.standing(study)},
        )

    def _complete(self, study: optuna.Study, trial: optuna.Trial, result: ProbeResult) -> None:
        ref = self.reference(study)
        tol = self.spec.parity_tolerance
        gap = None
        if trial.user_attrs.get("role") == "reference" or ref is None:
            constraint = 0.0
        else:
            ref_losses = [v for v in ref.user_attrs["losses"] if v is not None]
            measured = parity_gap(
                result.losses, result.batch_size, ref_losses, ref.params["batch_size"]
            )
            if measured is None:
                constraint = 1.0
                trial.set_user_attr("reason", "parity: loss curve not comparable")
            else:
                gap, loss, ref_loss = measured
                constraint = gap - tol
                trial.set_user_attr("loss", loss)
                trial.set_user_attr("ref_loss", ref_loss)
                trial.set_user_attr("parity_gap", gap)
                if constraint > 0:
                    trial.set_user_attr(
                        "reason",
                        f"parity: loss {loss:.4g} is {gap:+.1%} vs the fp32 reference's {ref_loss:.4g} "
                        f"(tolerance {tol:.0%})",
                    )
        trial.set_constraint("parity", constraint)
        if self.spec.objective == "time_to_loss":
            value = self._time_to_loss(result, ref)
            if value is None:
                trial.set_constraint("reaches_reference_loss", 1.0)
                value = result.timed_seconds * 1e3 + 1e6
        else:
            value = result.throughput
        study.tell(trial, value)
        feasible = constraint <= 0
        trial_outcome = "completed" if feasible else "infeasible"
        self.emit(
            "result",
            {
                "number": trial.number,
                "outcome": trial_outcome,
                "throughput": result.throughput,
                "gap": gap,
                **self.standing(study),
            },
        )

    def _time_to_loss(
        self, result: ProbeResult, ref: optuna.trial.FrozenTrial | None
    ) -> float | None:
        losses = result.losses
        if ref is None:
            target = min(v for v in losses if math.isfinite(v)) if losses else math.inf
        else:
            finite = [v for v in ref.user_attrs["losses"] if v is not None]
            target = sum(finite[-3:]) / max(1, len(finite[-3:]))
        return time_to_loss(losses, result.batch_size, result.throughput, target)

    def settle(self, study: optuna.Study) -> None:
        """Before validating, let other workers' last trials finish, or go stale and fail
        (their worker died), so validation sees every result and nothing stays RUNNING."""
        waited = time.monotonic()
        while True:
            fail_stale(study)
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if not running or self.budget.left() < 1.0:
                return
            if time.monotonic() - waited > GRACE_PERIOD + 2 * HEARTBEAT_INTERVAL:
                return
            time.sleep(min(1.0, max(0.1, self.budget.left() - 1.0)))

    def diagnose_failures(self, study: optuna.Study) -> None:
        """When fp16 trials diverged, diagnose the worst one layer by layer, so the config and
        the report say *why* next to the rejection. Costs a few steps; skipped when the budget
        cannot spare them."""
        from autotune.diagnose import trial_candidate, worst_diverged_trial

        if "fp16_diagnosis" in study.user_attrs:
            return
        worst = worst_diverged_trial(study.get_trials(deepcopy=False), "fp16")
        typical = statistics.median(self.probe_seconds[-10:]) if self.probe_seconds else 5.0
        left = self.budget.left() - _WRITE_RESERVE
        if worst is None or left < 3 * typical:
            return
        cand = trial_candidate(worst, self.workload)
        if self.gate is not None:
            with self.budget.paused():
                self.gate(cand)
        found = self.runner.diagnose(self.ref, cand, steps=3, timeout=max(2.0, min(60.0, left / 3)))
        if found is None:
            return
        summary = {
            "trial": worst.number,
            "candidate": found["candidate"],
            "verdict": found["verdict"],
            "reason": found["reason"],
            "first_nonfinite": found.get("first_nonfinite"),
            "recommendations": [
                f"{r['evidence']}: {r['action']}" for r in found.get("recommendations", [])
            ],
        }
        study.set_user_attr("fp16_diagnosis", summary)
        logger.info(
            "fp16 diagnosis of trial {}: {} (first non-finite: {})",
            worst.number,
            found["verdict"],
            found.get("first_nonfinite"),
        )

    def standing(self, study: optuna.Study) -> dict[str, Any]:
        """The best feasible trial so far and the fp32 reference's throughput, for progress."""
        ref = self.reference(study)
        out: dict[str, Any] = {
            "reference_throughput": ref.user_attrs.get("throughput") if ref else None,
            "best": None,
            "best_params": None,
            "best_throughput": None,
        }
        try:
            best = study.best_trial
        except ValueError:
            return out
        out.update(
            best=best.value,
            best_params=dict(best.params),
            best_throughput=best.user_attrs.get("throughput"),
        )
        return out


def run_search(
    spec: StudySpec,
    *,
    out_dir: str | Path | None = None,
    runner: Runner | None = None,
    budget: Budget | None = None,
    on_event: Event | None = None,
    gate: Gate | None = None,
    should_stop: Callable[[], bool] | None = None,
    join: bool = False,
    handle_sigint: bool = False,
) -> SearchResult:
    """Search a spec's space within its budget and write the validated config.

    Args:
        spec: the study spec (budget, space, probe lengths, storage...).
        out_dir: where ``best.json`` goes; ``studies/<name>/`` by default.
        runner: runs probes; a :class:`ProbeWorker` on the spec's device by default.
        budget: the clock to count against; starts now by default (the CLI starts it earlier).
        on_event: called with ``(kind, data)`` as phases, trials and results happen.
        gate: called before each probe with its candidate; may block while the device is busy
            (that time does not count against the budget).
        should_stop: polled before each trial; True stops the search with SearchStopped.
        join: join a study another process started (``autotune worker``): use its spec and
            its budget window instead of opening a new one.
        handle_sigint: make Ctrl-C stop cleanly: the probe in flight is stopped, the trial is
            recorded as interrupted (and retried on resume), then SearchInterrupted is raised.
            A second Ctrl-C interrupts at once.

    Returns:
        The SearchResult with the TunedConfig and the path it was written to. When another
        worker of the same study validates, ``config`` is what it stored so far (maybe None).

    Raises:
        SpecError, WorkloadError, DeviceError, StorageError: the user's mistake, named.
        SearchInterrupted: Ctrl-C; the trials so far are saved, the same command resumes.
        SearchStopped: ``should_stop`` said so; the interrupted trial is retried on resume.
    """
    from autotune.validate import validate_and_build

    study = open_study(spec, create=not join)
    if join:
        budget = Budget.shared(study)
        if budget is None:
            raise StorageError(
                f"study {spec.name!r} has no running search to join; start one with "
                f"`autotune search ... --storage <url>` first"
            )
    else:
        budget = budget or Budget(spec.budget)
        window = {"started_at": time.time() - budget.elapsed(), "seconds": budget.total}
        study.set_user_attr("budget_window", window)
    out = Path(out_dir) if out_dir is not None else Path("studies") / spec.name
    own_runner = runner is None
    runner = runner or ProbeWorker(str(resolve_device(spec.device)))
    interrupted = threading.Event()

    def stop_requested() -> bool:
        return interrupted.is_set() or (should_stop is not None and should_stop())

    search = _Search(spec, runner, budget, out, on_event, gate=gate, should_stop=stop_requested)
    previous_handler = None
    if handle_sigint and threading.current_thread() is threading.main_thread():

        def on_sigint(signum: int, frame: Any) -> None:
            if interrupted.is_set():
                raise KeyboardInterrupt
            interrupted.set()
            runner.interrupt()

        previous_handler = signal.signal(signal.SIGINT, on_sigint)
    logger.info(
        "study {!r}: workload {} on {}, budget {:.0f}s ({:.0f}s left), {} trials stored",
        spec.name,
        search.ref,
        search.device,
        budget.total,
        budget.left(),
        len(study.trials),
    )
    validated_by = ""
    config = None
    baselines: dict[str, dict[str, Any]] = {}
    rejected: list[str] = []
    try:
        modes = search.hardware()
        search.find_ceilings(study, modes)
        modes = [m for m in modes if search.ceilings.get(m, 0) > 0 or m == "fp32"]
        search.fix_choices(study, modes)
        search.enqueue_baselines(study, modes)
        search.search(study, modes, budget.total - _WRITE_RESERVE)
        # Validation runs once per budget window, by whichever worker gets there first.
        window = study.user_attrs.get("budget_window", {})
        me = owner_id()
        validated_by = claim(study, f"validation:{window.get('started_at', 0)}", me)
        if validated_by == me:
            search.settle(study)
            search.emit("phase", {"phase": "validation"})
            search.diagnose_failures(study)
            config, baselines, rejected = validate_and_build(
                search, study, budget.total - _WRITE_RESERVE
            )
        else:
            logger.info("validation of study {!r} is done by {}", spec.name, validated_by)
    except (KeyboardInterrupt, SearchStopped) as exc:
        if isinstance(exc, SearchStopped) and not interrupted.is_set():
            raise
        done = len(
            study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        )
        raise SearchInterrupted(
            f"interrupted: {done} finished trials of study {spec.name!r} are saved in its storage; "
            "run the same command again to resume"
        ) from None
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
        if own_runner:
            search.runner.close()
    path = None
    if config is not None:
        path = config.save(out / "best.json")
        study.set_user_attr("best_config", str(path))
        study.set_user_attr("tuned_config", config.model_dump(mode="json"))
        logger.info(
            "wrote {} after {:.1f}s of a {:.0f}s budget", path, budget.elapsed(), budget.total
        )
    else:
        stored = study.user_attrs.get("tuned_config")
        config = TunedConfig.model_validate(stored) if isinstance(stored, dict) else None
    return SearchResult(
        config=config,
        path=path,
        study=study,
        baselines=baselines,
        rejected=rejected,
        cut=search.cut,
        ceilings=search.ceilings,
        elapsed=budget.elapsed(),
        validated_by=validated_by,
    )
