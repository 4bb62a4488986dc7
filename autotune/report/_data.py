"""What a report shows, read from the Optuna storage and the study's ``best.json``."""

from __future__ import annotations

import math
import socket
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

from optuna.trial import FrozenTrial, TrialState

from autotune.errors import ConfigError, StorageError
from autotune.schema.config import TunedConfig, read_config
from autotune.schema.enums import Role
from autotune.schema.spec import StudySpec
from autotune.study.reference import ReferenceMeasurement, ReferenceRecord
from autotune.study.storage import mask_url, open_storage, stored_study, study_names
from autotune.study.store import StudyStore
from autotune.study.trials import (
    DEFAULT_INIT_SCALE,
    TrialRecord,
    feasible_trials,
    record,
    role_trials,
    trial_counts,
)

__all__ = [
    "DEFAULT_STORAGE",
    "ReportData",
    "collect",
    "counts_text",
    "load_study",
    "measured_interval",
]

# The spec's default, so `autotune report tiny` finds what `autotune search` wrote.
DEFAULT_STORAGE: str = StudySpec.model_fields["storage"].default


@dataclass
class ReportData:
    """Everything a report shows about one study.

    Trials are read through their :class:`~autotune.study.trials.TrialRecord` (``rec(t)``); the fp32
    reference is the study's :class:`~autotune.study.trials.ReferenceRecord` of the spec's device. A
    study written before the reference left the trials has it as a trial instead
    (``legacy_reference``): it is shown from that trial, measured once and without interval.
    """

    name: str
    storage: str
    spec: dict[str, Any]
    # The search's trials; apart, the configs validation stood behind (store_config's trials).
    trials: list[FrozenTrial]
    maximize: bool
    validated: list[FrozenTrial] = field(default_factory=list)
    records: dict[int, TrialRecord] = field(default_factory=dict)
    config: TunedConfig | None = None
    config_path: Path | None = None
    ceilings: dict[str, int] = field(default_factory=dict)
    # What limited each ceiling (memory, margin, time, cap, crash); empty for older studies.
    ceiling_limits: dict[str, str] = field(default_factory=dict)
    ceiling_device: str | None = None
    reference: ReferenceRecord | None = None
    # Where the reference was measured: "host:device", or "trial N" for an older study.
    reference_where: str | None = None
    legacy_reference: FrozenTrial | None = None
    amp_recipe: FrozenTrial | None = None
    winner: FrozenTrial | None = None
    winner_note: str = ""
    importances: dict[str, float] | None = None
    importance_note: str = ""
    notes: list[str] = field(default_factory=list)
    generated_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    def rec(self, trial: FrozenTrial) -> TrialRecord:
        """The trial's record (read once per report)."""
        got = self.records.get(trial.number)
        if got is None:
            got = self.records[trial.number] = record(trial)
        return got

    @property
    def parity_tolerance(self) -> float:
        return float(self.spec.get("parity_tolerance", 0.05))

    @property
    def objective(self) -> str:
        """What the trials' values are: ``speedup`` over the fp32 reference measured close in
        time, ``throughput`` (samples/s, older studies) or ``time_to_loss`` (seconds)."""
        if self.spec.get("objective") == "time_to_loss":
            return "time_to_loss"
        return "throughput" if self.legacy_reference is not None else "speedup"

    @property
    def reference_latest(self) -> ReferenceMeasurement | None:
        return self.reference.latest() if self.reference is not None else None

    @property
    def reference_throughput(self) -> float | None:
        m = self.reference_latest
        return m.throughput if m is not None and m.throughput > 0 else None

    @property
    def noise(self) -> float | None:
        """This device's timing noise: the config's (:meth:`ReferenceRecord.timing_noise`, as
        every surface shows it), else the reference's own; None where nothing measured it."""
        if self.config is not None and self.config.evidence.noise:
            return self.config.evidence.noise
        return self.reference.timing_noise() if self.reference is not None else None

    @property
    def noise_interval(self) -> float | None:
        """The relative half-width of the reference's latest 95% interval: what stands in for
        the noise where no spread was measured."""
        m = self.reference_latest
        if m is None or m.blocks <= 0 or m.throughput <= 0:
            return None
        return (m.high - m.low) / 2 / m.throughput

    def reference_measurements(self) -> list[ReferenceMeasurement]:
        return list(self.reference.measurements) if self.reference is not None else []

    def speedup(self, trial: FrozenTrial) -> tuple[float | None, float | None, float | None]:
        """A completed trial's speedup over the fp32 reference and its interval.

        The speedup is the one the search recorded (against the reference measured close in
        time); an older trial without one is divided by the reference's throughput, and has no
        interval.
        """
        if trial.state != TrialState.COMPLETE:
            return None, None, None
        rec = self.rec(trial)
        if rec.speedup is not None:
            return rec.speedup, rec.speedup_low, rec.speedup_high
        ref = self.reference_throughput
        if rec.throughput and ref:
            return rec.throughput / ref, None, None
        return None, None, None

    def counts(self) -> dict[str, int]:
        """Trials by state: see :func:`trial_counts`."""
        return trial_counts(self.trials)


def counts_text(c: dict[str, int]) -> str:
    """``4 complete (1 infeasible), 2 pruned, 0 failed, 3 reused an earlier trial's
    measurement``: what :func:`~autotune.study.trials.trial_counts` counted, the empty extras
    left out."""
    return (
        f"{c['complete']} complete ({c['infeasible']} infeasible), {c['pruned']} pruned, "
        f"{c['failed']} failed"
        + (f", {c['not_run']} queued but never run" if c["not_run"] else "")
        + (f", {c['reused']} reused an earlier trial's measurement" if c["reused"] else "")
        + (f", {c['other']} not finished" if c["other"] else "")
    )


def measured_interval(m: ReferenceMeasurement) -> tuple[float | None, float | None]:
    """A reference measurement's interval; none for one that timed no blocks (an older
    study's single figure)."""
    return (m.low, m.high) if m.blocks > 0 else (None, None)


def load_study(name: str, storage: str = DEFAULT_STORAGE) -> StudyStore:
    """Open a finished (or running) study by name, read-only in spirit.

    Raises:
        StorageError: the SQLite file does not exist (nothing is created), the storage cannot
            be opened, or no study of that name is in it (the message lists the known ones).
    """
    if storage.startswith("sqlite:///"):
        path = Path(storage[len("sqlite:///") :])
        if not path.is_file():
            raise StorageError(
                f"storage {storage!r} has no database file {str(path)!r}: no search has written "
                "there; run `autotune search` first, or pass --storage with the URL the search used"
            )
    backend = open_storage(storage)
    study = stored_study(backend, name)
    if study is None:
        names = study_names(backend)
        known = ", ".join(repr(n) for n in names) if names else "none"
        raise StorageError(
            f"study {name!r} is not in storage {mask_url(storage)!r}; known studies: {known}. "
            "Pass one of those names, or --storage with the URL the search used"
        )
    return StudyStore(study)


def _pick(where: list[tuple[str, str]], device: str) -> tuple[str, str] | None:
    """Of the ``(host, device)`` places a study stored something for, the spec's device on
    this machine, else on any machine, else the first."""
    if not where:
        return None
    places = sorted(where)
    here = socket.gethostname()

    def matches(d: str) -> bool:
        # "cuda" in a spec is the first GPU: the search stored it as "cuda:0".
        return bool(device) and (d == device or d.startswith(f"{device}:"))

    return (
        next((p for p in places if p[0] == here and matches(p[1])), None)
        or next((p for p in places if matches(p[1])), None)
        or places[0]
    )


def _pick_ceilings(
    data: ReportData, store: StudyStore, device: str
) -> tuple[dict[str, int], str | None]:
    stored = store.all_ceilings()
    where = _pick(list(stored), device)
    if where is not None:
        data.ceiling_limits = store.ceiling_limits(*where)
        return stored[where], f"{where[0]}:{where[1]}"
    # Older studies stored one table per device, without the machine.
    legacy = store.legacy_ceilings()
    if not legacy:
        return {}, None
    key = device if device in legacy else sorted(legacy)[0]
    return legacy[key], key


def _pick_reference(data: ReportData, store: StudyStore, roles: dict[str, FrozenTrial]) -> None:
    """The study's fp32 reference for the spec's device; an older study's reference trial."""
    stored = store.references()
    where = _pick(list(stored), str(data.spec.get("device", "")))
    if where is not None:
        data.reference, data.reference_where = stored[where], f"{where[0]}:{where[1]}"
        if len(stored) > 1:
            others = ", ".join(f"{h}:{d}" for h, d in sorted(stored) if (h, d) != where)
            data.notes.append(
                f"the study also holds fp32 references measured on {others}; this report "
                f"shows {where[0]}:{where[1]}'s"
            )
        return
    t = roles.get(Role.REFERENCE)
    if t is None or "batch_size" not in t.params:
        return
    # An older study: the reference was a trial, measured once, without an interval.
    rec = data.rec(t)
    measurements = []
    if t.state == TrialState.COMPLETE and rec.throughput:
        at = t.datetime_complete.timestamp() if t.datetime_complete else 0.0
        measurements.append(
            ReferenceMeasurement(
                at=at, throughput=rec.throughput, low=rec.throughput, high=rec.throughput
            )
        )
    data.legacy_reference = t
    data.reference_where = f"trial {t.number}"
    data.reference = ReferenceRecord(
        precision=str(t.params.get("precision", "fp32")),
        batch_size=int(t.params["batch_size"]),
        learning_rate=rec.learning_rate or 0.0,
        losses=list(rec.losses),
        peak_memory_bytes=rec.peak_memory_bytes,
        measurements=measurements,
    )
    data.notes.append(
        "this study was written by an older autotune: its fp32 reference is trial "
        f"{t.number}, measured once, and its figures carry no intervals (shown as —)"
    )


def _find_config(
    store: StudyStore, out_dir: Path | None, notes: list[str]
) -> tuple[TunedConfig | None, Path | None]:
    """The study's best.json: in ``out_dir``, where the search recorded it, or the default
    folder; else the copy stored in the study."""
    places: list[Path] = []
    if out_dir is not None:
        places.append(out_dir / "best.json")
    if (recorded := store.best_config_path()) is not None:
        places.append(recorded)
    places.append(Path("studies") / store.name / "best.json")
    for path in dict.fromkeys(places):
        if not path.is_file():
            continue
        try:
            cfg = read_config(path)
        except ConfigError as exc:
            notes.append(f"{path} could not be read: {exc}")
            continue
        if cfg.study != store.name:
            notes.append(f"{path} belongs to study {cfg.study!r}, not this one; not used")
            continue
        return cfg, path
    # The search also stores the config in the study: the one copy every box of a
    # PostgreSQL-backed study can read.
    stored = store.config()
    if stored is None and store.config_stored():
        notes.append("the config stored in the study does not validate")
    return stored, None


def _same_settings(data: ReportData, t: FrozenTrial, cfg: TunedConfig) -> bool:
    lr = data.rec(t).learning_rate
    return (
        t.params.get("precision") == cfg.precision
        and t.params.get("batch_size") == cfg.batch_size
        and lr is not None
        and math.isclose(lr, cfg.learning_rate, rel_tol=1e-9)
        and (
            cfg.precision != "fp16"
            or t.params.get("init_scale", DEFAULT_INIT_SCALE) == cfg.grad_scaler.init_scale
        )
        and bool(t.params.get("compile", False)) == cfg.compile
        and t.params.get("channels_last", cfg.channels_last) == cfg.channels_last
        and data.rec(t).fp32_modules == cfg.fp32_modules
    )


def _winner(data: ReportData) -> tuple[FrozenTrial | None, str]:
    """The trial whose settings the config holds, or the best feasible one without a config."""
    cfg = data.config
    done = [
        t
        for t in data.trials
        if t.state == TrialState.COMPLETE and data.rec(t).duplicate_of is None
    ]
    if cfg is not None:
        match = next((t for t in done if _same_settings(data, t, cfg)), None)
        if not cfg.evidence.validated:
            # The fp32 reference is not a trial; an fp32 trial at its settings may be.
            return match, "no candidate passed validation: the config is the fp32 reference"
        if match is not None:
            return match, ""
        return None, "the config's settings match no trial of this study"
    best = sorted(
        (t for t in feasible_trials(done) if t.value is not None),
        key=lambda t: cast(float, t.value),
        reverse=data.maximize,
    )
    if not best:
        return None, "no feasible trial yet"
    return best[0], "best feasible trial of the search; no best.json found, so not validated"


_OBJECTIVE_WORDS = {
    "speedup": "each trial's speedup over the fp32 reference measured close to it in time",
    "throughput": "each trial's samples/s (an older study: not yet a speedup)",
    "time_to_loss": "each trial's estimated time to the fp32 reference's loss",
}


def _importances(store: StudyStore, data: ReportData) -> tuple[dict | None, str]:
    done = [t for t in data.trials if t.state == TrialState.COMPLETE]
    if len(done) < 2:
        return None, (
            f"needs at least 2 completed trials, this study has {len(done)}; a longer budget "
            "gives the sampler more to compare"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = store.importances()
    # Importance is an optional view: whatever the estimator trips over (too few distinct
    # values, a parameter in too few trials), the rest of the report still renders.
    except Exception as exc:
        return None, f"could not be computed from {len(done)} completed trials: {exc}"
    note = (
        f"PED-ANOVA (Optuna's default) over {len(done)} completed trials, computed on the "
        f"objective: {_OBJECTIVE_WORDS[data.objective]}"
    )
    if data.objective == "speedup":
        note += (
            "; a parameter that moves the speedup by less than its interval's width explains "
            "noise, not speed"
        )
    if len(done) < 20:
        note += "; with this few trials, read it as a hint"
    return values, note


def collect(
    store: StudyStore, *, out_dir: str | Path | None = None, storage: str = ""
) -> ReportData:
    """Gather what the report shows from a study and its ``best.json``.

    Args:
        store: the study a search wrote (:func:`load_study` opens one by name).
        out_dir: where to look for ``best.json`` first (the search's ``--out``).
        storage: the storage URL, shown in the report with any password hidden.

    Returns:
        The ReportData; missing pieces (no config yet, no importances) come with notes.
    """
    trials = sorted(store.trials(), key=lambda t: t.number)
    spec = dict(store.spec() or {})
    if "storage" in spec:  # a study stored by an older version may hold the password
        spec["storage"] = mask_url(str(spec["storage"]))
    maximize = store.maximize
    records = {t.number: record(t) for t in trials}
    crowned = {n for n, rec in records.items() if rec.tuned_config}
    data = ReportData(
        name=store.name,
        storage=mask_url(storage),
        spec=spec,
        trials=[t for t in trials if t.number not in crowned],
        maximize=maximize,
        validated=[t for t in trials if t.number in crowned],
    )
    data.records = records
    data.ceilings, data.ceiling_device = _pick_ceilings(data, store, str(spec.get("device", "")))
    data.config, data.config_path = _find_config(
        store, Path(out_dir) if out_dir is not None else None, data.notes
    )
    roles = role_trials(trials)
    _pick_reference(data, store, roles)
    data.amp_recipe = roles.get(Role.AMP_RECIPE)
    data.winner, data.winner_note = _winner(data)
    data.importances, data.importance_note = _importances(store, data)
    return data
