"""What a report shows, read from the Optuna storage and the study's ``best.json``."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import TunedConfig, load_config
from autotune.errors import ConfigError, StorageError
from autotune.spec import StudySpec
from autotune.storage import mask_url, open_storage
from autotune.trials import CONFIG_KEY, stored_config

__all__ = ["DEFAULT_STORAGE", "ReportData", "collect", "load_study"]

# The spec's default, so `autotune report tiny` finds what `autotune search` wrote.
DEFAULT_STORAGE: str = StudySpec.model_fields["storage"].default


@dataclass
class ReportData:
    """Everything a report shows about one study."""

    name: str
    storage: str
    spec: dict[str, Any]
    trials: list[FrozenTrial]
    maximize: bool
    config: TunedConfig | None = None
    config_path: Path | None = None
    ceilings: dict[str, int] = field(default_factory=dict)
    ceiling_device: str | None = None
    reference: FrozenTrial | None = None
    amp_recipe: FrozenTrial | None = None
    winner: FrozenTrial | None = None
    winner_note: str = ""
    importances: dict[str, float] | None = None
    importance_note: str = ""
    notes: list[str] = field(default_factory=list)
    generated_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def parity_tolerance(self) -> float:
        return float(self.spec.get("parity_tolerance", 0.05))

    @property
    def reference_throughput(self) -> float | None:
        if self.reference is None:
            return None
        tp = self.reference.user_attrs.get("throughput")
        return float(tp) if tp else None

    def vs_reference(self, trial: FrozenTrial) -> float | None:
        """A completed trial's throughput over the fp32 reference's (the search probes)."""
        tp, ref = trial.user_attrs.get("throughput"), self.reference_throughput
        if trial.state != TrialState.COMPLETE or not tp or not ref:
            return None
        return float(tp) / ref

    def counts(self) -> dict[str, int]:
        """Trials by state, infeasible (COMPLETE but breaking parity) counted apart too."""
        out = {"complete": 0, "infeasible": 0, "pruned": 0, "failed": 0, "other": 0}
        for t in self.trials:
            if t.state == TrialState.COMPLETE:
                out["complete"] += 1
                out["infeasible"] += not feasible(t)
            elif t.state == TrialState.PRUNED:
                out["pruned"] += 1
            elif t.state == TrialState.FAIL:
                out["failed"] += 1
            else:
                out["other"] += 1
        return out


def feasible(trial: FrozenTrial) -> bool:
    """COMPLETE and every constraint satisfied (≤ 0)."""
    return trial.state == TrialState.COMPLETE and all(
        v <= 0 for v in (trial.constraints or {}).values()
    )


def load_study(name: str, storage: str = DEFAULT_STORAGE) -> optuna.Study:
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
    names = sorted(s.study_name for s in optuna.get_all_study_summaries(backend))
    if name not in names:
        known = ", ".join(repr(n) for n in names) if names else "none"
        raise StorageError(
            f"study {name!r} is not in storage {mask_url(storage)!r}; known studies: {known}. "
            "Pass one of those names, or --storage with the URL the search used"
        )
    # A plain sampler: reading a study needs none, and TPE's start-up would only cost time.
    return optuna.load_study(
        study_name=name, storage=backend, sampler=optuna.samplers.RandomSampler()
    )


def _pick_ceilings(attrs: dict[str, Any], device: str) -> tuple[dict[str, int], str | None]:
    stored = {k.split(":", 1)[1]: v for k, v in attrs.items() if k.startswith("ceilings:")}
    stored = {k: v for k, v in stored.items() if isinstance(v, dict)}
    if not stored:
        return {}, None
    # Keys are "<device>" or "<machine>:<device>"; prefer the spec's device, else the first.
    keys = sorted(stored)
    key = next((k for k in keys if k == device or k.endswith(f":{device}")), keys[0])
    return {str(m): int(b) for m, b in stored[key].items()}, key


def _find_config(
    study: optuna.Study, out_dir: Path | None, notes: list[str]
) -> tuple[TunedConfig | None, Path | None]:
    """The study's best.json: in ``out_dir``, where the search recorded it, or the default
    folder; else the copy stored in the study."""
    places: list[Path] = []
    if out_dir is not None:
        places.append(out_dir / "best.json")
    if study.user_attrs.get("best_config"):
        places.append(Path(str(study.user_attrs["best_config"])))
    places.append(Path("studies") / study.study_name / "best.json")
    for path in dict.fromkeys(places):
        if not path.is_file():
            continue
        try:
            cfg = load_config(path)
        except ConfigError as exc:
            notes.append(f"{path} could not be read: {exc}")
            continue
        if cfg.study != study.study_name:
            notes.append(f"{path} belongs to study {cfg.study!r}, not this one; not used")
            continue
        return cfg, path
    # The search also stores the config in the study: the one copy every box of a
    # PostgreSQL-backed study can read.
    stored = stored_config(study)
    if stored is None and study.user_attrs.get(CONFIG_KEY) is not None:
        notes.append("the config stored in the study does not validate")
    return stored, None


def _winner(
    trials: list[FrozenTrial],
    cfg: TunedConfig | None,
    reference: FrozenTrial | None,
    maximize: bool,
) -> tuple[FrozenTrial | None, str]:
    """The trial whose settings the config holds, or the best feasible one without a config."""
    done = [
        t
        for t in trials
        if t.state == TrialState.COMPLETE and t.user_attrs.get("duplicate_of") is None
    ]
    if cfg is not None:
        if not cfg.evidence.validated:
            return reference, "no candidate passed validation: the config is the fp32 reference"
        for t in done:
            lr = t.user_attrs.get("learning_rate")
            if (
                t.params.get("precision") == cfg.precision
                and t.params.get("batch_size") == cfg.batch_size
                and lr is not None
                and math.isclose(float(lr), cfg.learning_rate, rel_tol=1e-9)
                and (
                    cfg.precision != "fp16"
                    or t.params.get("init_scale", 2.0**16) == cfg.grad_scaler.init_scale
                )
            ):
                return t, ""
        return None, "the config's settings match no trial of this study"
    best = sorted(
        (t for t in done if feasible(t) and t.value is not None),
        key=lambda t: t.value,
        reverse=maximize,
    )
    if not best:
        return None, "no feasible trial yet"
    return best[0], "best feasible trial of the search; no best.json found, so not validated"


def _importances(study: optuna.Study, trials: list[FrozenTrial]) -> tuple[dict | None, str]:
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    if len(done) < 2:
        return None, (
            f"needs at least 2 completed trials, this study has {len(done)}; a longer budget "
            "gives the sampler more to compare"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = optuna.importance.get_param_importances(study)
    # Importance is an optional view: whatever the estimator trips over (too few distinct
    # values, a parameter in too few trials), the rest of the report still renders.
    except Exception as exc:
        return None, f"could not be computed from {len(done)} completed trials: {exc}"
    note = f"PED-ANOVA (Optuna's default) over {len(done)} completed trials"
    if len(done) < 20:
        note += "; with this few trials, read it as a hint"
    return {k: float(v) for k, v in values.items()}, note


def collect(
    study: optuna.Study, *, out_dir: str | Path | None = None, storage: str = ""
) -> ReportData:
    """Gather what the report shows from a study and its ``best.json``.

    Args:
        study: the Optuna study a search wrote.
        out_dir: where to look for ``best.json`` first (the search's ``--out``).
        storage: the storage URL, shown in the report with any password hidden.

    Returns:
        The ReportData; missing pieces (no config yet, no importances) come with notes.
    """
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    attrs = study.user_attrs
    spec = dict(attrs.get("spec") or {})
    maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
    data = ReportData(
        name=study.study_name,
        storage=mask_url(storage),
        spec=spec,
        trials=trials,
        maximize=maximize,
    )
    data.ceilings, data.ceiling_device = _pick_ceilings(attrs, str(spec.get("device", "")))
    data.config, data.config_path = _find_config(
        study, Path(out_dir) if out_dir is not None else None, data.notes
    )
    roles: dict[str, FrozenTrial] = {}
    for t in trials:
        role = t.user_attrs.get("role")
        # A resumed study may hold the role twice; the one that finished is the one to show.
        if role and (role not in roles or roles[role].state != TrialState.COMPLETE):
            roles[role] = t
    data.reference = roles.get("reference")
    data.amp_recipe = roles.get("amp_recipe")
    data.winner, data.winner_note = _winner(trials, data.config, data.reference, maximize)
    data.importances, data.importance_note = _importances(study, trials)
    return data
