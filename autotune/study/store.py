"""The study store: one typed read and one write per study attribute, and a trial queued with its
record; nothing else touches user attributes."""

from __future__ import annotations

import copy
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.schema.config import TunedConfig
from autotune.study import study_keys
from autotune.study.crown import stored_config
from autotune.study.reference import ReferenceRecord, reference_key, stored_references
from autotune.study.trials import TrialRecord, stored_ceilings

__all__ = ["BudgetWindow", "StudyStore"]


@dataclass(frozen=True)
class BudgetWindow:
    """The job's budget, shared by every worker of the study: ``seconds`` long from
    ``started_at`` (wall time), named ``id`` (older studies stored none: their start names it).

    Example:
        >>> BudgetWindow(started_at=1700000000.5, seconds=600.0).name
        '1700000000.5'
    """

    started_at: float
    seconds: float
    id: str | None = None

    @property
    def name(self) -> str:
        """What names the window: validation runs once per name."""
        return str(self.id or self.started_at)


class StudyStore:
    """Typed reads and writes of what autotune stores on one Optuna study.

    Every read goes to the storage (other workers write the study too); nothing is cached.

    Example:
        >>> store = StudyStore(optuna.create_study())
        >>> store.precision_choices() is None
        True
        >>> store.set_precision_choices(["bf16", "fp16"])
        >>> store.precision_choices()
        ['bf16', 'fp16']
    """

    def __init__(self, study: optuna.Study) -> None:
        self.study = study

    @property
    def name(self) -> str:
        """The study's name."""
        return self.study.study_name

    @property
    def maximize(self) -> bool:
        """Whether the study maximizes its objective (throughput); False when it minimizes."""
        return self.study.direction == optuna.study.StudyDirection.MAXIMIZE

    @property
    def storage(self) -> optuna.storages.BaseStorage:
        """The storage the study lives in, for writes by trial id (a trial another worker
        started, one failed at the end of a search)."""
        return self.study._storage

    def trials(self, states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        """The study's trials as stored now, not copied (read them, never change them); only
        those in ``states`` when given."""
        return self.study.get_trials(deepcopy=False, states=states)

    def importances(self) -> dict[str, float]:
        """How much each sampled parameter explains of the objective over the completed trials
        (Optuna's default estimator); raises what the estimator raises on too few trials."""
        values = optuna.importance.get_param_importances(self.study)
        return {k: float(v) for k, v in values.items()}

    def ask(self) -> optuna.Trial:
        """Start the next trial: the first one queued, else one the sampler suggests."""
        return self.study.ask()

    def tell(
        self,
        trial: optuna.Trial | int,
        values: float | Sequence[float] | None = None,
        *,
        state: TrialState | None = None,
    ) -> FrozenTrial:
        """Finish a trial: with its objective ``values``, or in ``state`` (pruned, failed)."""
        return self.study.tell(trial, values, state=state)

    def _get(self, key: str) -> Any:
        """One attribute as stored now, a copy of its own (``study.user_attrs`` would copy
        them all)."""
        attrs = self.storage.get_study_user_attrs(self.study._study_id)
        return copy.deepcopy(attrs.get(key))

    def _set(self, key: str, value: Any) -> None:
        self.study.set_user_attr(key, value)

    # ---- what the study is -------------------------------------------------------------------

    def space_fingerprint(self) -> str | None:
        """The search space's fingerprint the study was made with (a changed space is a new
        study); None while its maker is still writing it."""
        return _text(self._get(study_keys.SPACE_FINGERPRINT))

    def workload(self) -> str | None:
        """The workload the study tunes (its spec's ``workload``)."""
        return _text(self._get(study_keys.WORKLOAD))

    def spec(self) -> dict[str, Any] | None:
        """The study's spec as stored: its JSON form, the storage URL's password hidden (an
        older version's may still hold it)."""
        return _table(self._get(study_keys.SPEC))

    def set_spec(self, stored: Mapping[str, Any]) -> None:
        """Store the spec's JSON form (:func:`autotune.study.storage.stored_spec`)."""
        self._set(study_keys.SPEC, dict(stored))

    def set_identity(self, fingerprint: str, workload: str, stored: Mapping[str, Any]) -> None:
        """Write what a new study is: its space's fingerprint (workers joining wait for it),
        its workload and its spec's JSON form."""
        self._set(study_keys.SPACE_FINGERPRINT, fingerprint)
        self._set(study_keys.WORKLOAD, workload)
        self.set_spec(stored)

    # ---- the job's budget and choices --------------------------------------------------------

    def budget_window(self) -> BudgetWindow | None:
        """The budget window the study's current run opened; None when none is open."""
        window = _table(self._get(study_keys.BUDGET_WINDOW))
        if window is None or not _number(window.get("started_at")):
            return None
        if not _number(window.get("seconds")):
            return None
        ident = window.get("id")
        return BudgetWindow(window["started_at"], window["seconds"], str(ident) if ident else None)

    def set_budget_window(self, window: BudgetWindow) -> None:
        """Open a budget window: every worker joining from now on shares its clock."""
        stored = {"started_at": window.started_at, "seconds": window.seconds, "id": window.id}
        self._set(study_keys.BUDGET_WINDOW, stored)

    def precision_choices(self) -> list[str] | None:
        """The precision modes the sampler offers, as the study's first worker fixed them."""
        stored = self._get(study_keys.PRECISION_CHOICES)
        return [str(m) for m in stored] if isinstance(stored, list) and stored else None

    def set_precision_choices(self, choices: Sequence[str]) -> None:
        self._set(study_keys.PRECISION_CHOICES, list(choices))

    def diagnosis(self) -> dict[str, Any] | None:
        """What diagnosing fp16's divergence found (the trial, verdict, advice, fp32 modules and
        the islands decision); None before a diagnosis."""
        return _table(self._get(study_keys.DIAGNOSIS))

    def set_diagnosis(self, summary: Mapping[str, Any]) -> None:
        self._set(study_keys.DIAGNOSIS, dict(summary))

    # ---- what one machine and device measured ------------------------------------------------

    def ceilings(self, host: str, device: str) -> dict[str, int] | None:
        """Each mode's batch ceiling on one device of one machine; None when not measured."""
        return self.all_ceilings().get((host, device))

    def all_ceilings(self) -> dict[tuple[str, str], dict[str, int]]:
        """Every stored ceiling table, by ``(host, device)``."""
        return stored_ceilings(self.study.user_attrs)

    def legacy_ceilings(self) -> dict[str, dict[str, int]]:
        """Ceiling tables of a study written by an older autotune, by device (one table per
        device, without the machine); tables that do not read as sizes are skipped."""
        out: dict[str, dict[str, int]] = {}
        for key, value in self.study.user_attrs.items():
            device = study_keys.parse_legacy_ceilings_key(key)
            if device is not None and isinstance(value, dict):
                try:
                    out[device] = {str(m): int(b) for m, b in value.items()}
                except (TypeError, ValueError):
                    continue
        return out

    def set_ceilings(self, host: str, device: str, ceilings: Mapping[str, int]) -> None:
        self._set(study_keys.ceilings_key(host, device), dict(ceilings))

    def ceiling_limits(self, host: str, device: str) -> dict[str, str]:
        """What limited each mode's ceiling there: ``memory``, ``margin``, ``time``, ``cap``,
        ... (empty when not stored: older studies)."""
        stored = _table(self._get(study_keys.ceilings_key(host, device, limits=True)))
        return {str(m): str(why) for m, why in (stored or {}).items()}

    def set_ceiling_limits(self, host: str, device: str, limits: Mapping[str, str]) -> None:
        self._set(study_keys.ceilings_key(host, device, limits=True), dict(limits))

    def reference(self, host: str, device: str) -> ReferenceRecord | None:
        """The fp32 reference of one device of one machine; None when none is stored or it
        does not read."""
        stored = _table(self._get(reference_key(host, device)))
        try:
            return ReferenceRecord.model_validate(stored) if stored is not None else None
        except ValueError:
            return None

    def references(self) -> dict[tuple[str, str], ReferenceRecord]:
        """Every stored fp32 reference, by ``(host, device)``; unreadable ones are skipped."""
        return stored_references(self.study.user_attrs)

    def set_reference(self, host: str, device: str, record: ReferenceRecord) -> None:
        self._set(reference_key(host, device), record.model_dump(mode="json"))

    # ---- what the search wrote -----------------------------------------------------------------

    def best_config_path(self) -> Path | None:
        """Where the search wrote ``best.json``; None before it did."""
        stored = self._get(study_keys.BEST_CONFIG)
        return Path(str(stored)) if stored else None

    def set_best_config_path(self, path: Path) -> None:
        self._set(study_keys.BEST_CONFIG, str(path))

    def config(self) -> TunedConfig | None:
        """The tuned config stored on the study (written with
        :func:`autotune.study.crown.store_config`); None when none is, or it does not validate."""
        return stored_config(self.study)

    def config_stored(self) -> bool:
        """Whether the study holds a config at all, one that no longer validates too."""
        return self._get(study_keys.CONFIG) is not None

    # ---- trials ------------------------------------------------------------------------------

    def enqueue(
        self,
        params: Mapping[str, Any],
        record: TrialRecord | None = None,
        *,
        skip_if_exists: bool = False,
    ) -> None:
        """Queue a trial at ``params`` that starts with ``record`` stored (its role, its fp32
        modules, a retry's origin); with ``skip_if_exists``, not when one at ``params`` exists.

        Example:
            >>> store = StudyStore(optuna.create_study())
            >>> store.enqueue({"precision": "bf16"}, TrialRecord(role="bf16_at_base"))
            >>> from autotune.study.trials import record
            >>> record(store.study.trials[0]).role
            'bf16_at_base'
        """
        attrs = record.to_attrs() if record is not None else None
        self.study.enqueue_trial(dict(params), user_attrs=attrs, skip_if_exists=skip_if_exists)


def _table(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
