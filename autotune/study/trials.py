"""The trial record: the one home of what autotune stores on an Optuna trial, with feasibility,
constraints and the stored ceilings."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import optuna
from optuna.trial import FrozenTrial, TrialState
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

from autotune.schema.enums import Outcome
from autotune.schema.spec import Candidate
from autotune.study.study_keys import MEASUREMENT, ceilings_key, parse_ceilings_key

__all__ = [
    "CONSTRAINTS_KEY",
    "DEFAULT_INIT_SCALE",
    "Rejection",
    "TrialRecord",
    "candidate",
    "ceilings_key",
    "constraints",
    "display_outcome",
    "feasible_trials",
    "frozen_trial",
    "is_feasible",
    "label",
    "measurement_name",
    "name_measurement",
    "objective_value",
    "parse_ceilings_key",
    "record",
    "role_trials",
    "set_constraints",
    "stored_ceilings",
    "trial_counts",
    "worst_diverged",
    "write_attrs",
]

# torch's GradScaler default; a trial without an init_scale parameter ran with it.
DEFAULT_INIT_SCALE = 2.0**16
# Optuna 5 keeps each constraint in a system attribute named "constraints:<key>"; optuna-dashboard
# reads only the older form, a list under "constraints" itself.
CONSTRAINTS_KEY = "constraints"


def write_attrs(
    storage: optuna.storages.BaseStorage, trial_id: int, attrs: Mapping[str, Any]
) -> None:
    """Store user attributes on a running trial: in one transaction where the storage can (the
    project's database storage, under Optuna's cache), else one by one."""
    backend = getattr(storage, "_backend", storage)
    many = getattr(backend, "set_trial_user_attrs", None)
    if many is not None:
        many(trial_id, attrs)
        return
    for key, value in attrs.items():
        storage.set_trial_user_attr(trial_id, key, value)


def _series(name: str) -> Any:  # stored as z_<name>; read as that, or as older studies stored it
    key = f"z_{name}"
    return Field(
        default_factory=list, validation_alias=AliasChoices(key, name), serialization_alias=key
    )


class TrialRecord(BaseModel):
    """Everything autotune stores on a trial, typed. Unknown keys (older versions) are ignored.

    Example:
        >>> rec = TrialRecord(outcome=Outcome.COMPLETED, throughput=812.5)
        >>> sorted(rec.to_attrs())
        ['outcome', 'throughput']
    """

    model_config = ConfigDict(extra="ignore")

    # A Role, or a mode's Role.at_base(mode): a str, as a role may name a mode.
    role: str | None = None
    outcome: Outcome | None = None
    reason: str = ""
    learning_rate: float | None = None
    lr_scaling: str | None = None
    worker: str | None = None
    seed: int | None = None
    # The measurement.
    throughput: float | None = None
    throughput_low: float | None = None
    throughput_high: float | None = None
    blocks: int | None = None
    reference_throughput: float | None = None
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    peak_memory_bytes: int | None = None
    skipped_steps: int | None = None
    timed_steps: int | None = None
    truncated: bool | None = None
    probe_seconds: float | None = None
    compile_seconds: float | None = None
    fp32_modules: list[str] = []
    kept_lr: float | None = None
    # Bulky series, stored last: optuna-dashboard lists a trial's attributes by name.
    losses: list[float | None] = _series("losses")
    scales: list[tuple[int, float]] = _series("scales")
    # The end of what the workload printed during the trial, and how many bytes it printed.
    output: str | None = None
    output_bytes: int | None = None
    # Parity against the fp32 reference, and the samples seen where it was decided.
    loss: float | None = None
    ref_loss: float | None = None
    parity_gap: float | None = None
    parity_samples: int | None = None
    # Which fidelity decided the trial: "full probe", or where it stopped early and why.
    decided_by: str | None = None
    # Bookkeeping.
    duplicate_of: int | None = None
    retry_of: int | None = None
    tuned_config: bool | None = None
    validated_trial: int | None = None

    @classmethod
    def from_trial(cls, trial: FrozenTrial | optuna.Trial) -> TrialRecord:
        """The record stored on a trial; fields that do not validate are left at their default
        (a hand-edited or foreign attribute never breaks a reader)."""
        attrs = dict(trial.user_attrs)
        try:
            return cls.model_validate(attrs)
        except ValidationError as exc:
            bad = {str(e["loc"][0]) for e in exc.errors() if e.get("loc")}
            return cls.model_validate({k: v for k, v in attrs.items() if k not in bad})

    def to_attrs(self) -> dict[str, Any]:
        """The fields that were set and hold a value, JSON-safe: None (a non-finite float too)
        is left out, never stored as null: absent means absent."""
        data = self.model_dump(mode="json", include=self.model_fields_set, by_alias=True)
        return {k: v for k, v in ((k, _json_safe(v)) for k, v in data.items()) if v is not None}

    def settings(self, **fields: Any) -> TrialRecord:
        """What a trial run again at its params must carry besides them (its fp32 modules, a
        kept lr's multiplier), with ``fields`` set too: for ``enqueue_trial``'s user_attrs.

        Example:
            >>> TrialRecord(fp32_modules=["fc"], kept_lr=0.5, throughput=9.0).settings(
            ...     retry_of=3
            ... ).to_attrs()
            {'fp32_modules': ['fc'], 'kept_lr': 0.5, 'retry_of': 3}
        """
        own: dict[str, Any] = {"fp32_modules": self.fp32_modules} if self.fp32_modules else {}
        if self.kept_lr is not None:
            own["kept_lr"] = self.kept_lr
        return TrialRecord(**(own | fields))

    def without(self, *fields: str) -> TrialRecord:
        """This record with ``fields`` unset, so not stored.

        Example:
            >>> TrialRecord(outcome=Outcome.NOT_RUN, reason="the search ended", kept_lr=0.5).without(
            ...     "outcome", "reason"
            ... ).to_attrs()
            {'kept_lr': 0.5}
        """
        kept = self.model_fields_set - set(fields)
        return TrialRecord.model_construct(kept, **{k: getattr(self, k) for k in kept})

    def write(self, trial: optuna.Trial) -> None:
        """Store the fields that were set on a running trial."""
        attrs = self.to_attrs()
        write_attrs(trial.storage, trial._trial_id, attrs)
        trial._cached_frozen_trial.user_attrs.update(attrs)  # as Trial.set_user_attr does

    @property
    def finite_losses(self) -> list[float]:
        return [v for v in self.losses if v is not None]


def _json_safe(value: Any) -> Any:
    """Storage never holds NaN or inf: they become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def record(trial: FrozenTrial | optuna.Trial) -> TrialRecord:
    """Shorthand for :meth:`TrialRecord.from_trial`."""
    return TrialRecord.from_trial(trial)


def frozen_trial(rec: TrialRecord, **fields: Any) -> FrozenTrial:
    """A trial that stores ``rec``, made by ``optuna.trial.create_trial`` with ``fields``
    (``state``, ``value``, ``params``, ...): for ``study.add_trial``, and for examples.

    Example:
        >>> made = frozen_trial(TrialRecord(outcome=Outcome.OOM), state=TrialState.FAIL)
        >>> record(made).outcome
        <Outcome.OOM: 'oom'>
    """
    return optuna.trial.create_trial(user_attrs=rec.to_attrs(), **fields)


def measurement_name(trial: FrozenTrial | optuna.Trial) -> dict[str, Any] | None:
    """How a trial names the fp32 reference measurement its speedup was divided by (its
    ``reference_measurement``: ``{"key", "index"}``), or None when it names none."""
    named = trial.user_attrs.get(MEASUREMENT)
    return named if isinstance(named, dict) else None


def name_measurement(trial: optuna.Trial, name: Mapping[str, Any]) -> None:
    """Store on a running trial the reference measurement its speedup was divided by."""
    trial.set_user_attr(MEASUREMENT, dict(name))


# ---- constraints and feasibility -------------------------------------------------------------


def set_constraints(trial: optuna.Trial, values: Mapping[str, float]) -> None:
    """Store a trial's constraints (≤ 0 is satisfied), one named value each: the one place
    constraints are written.

    Each goes where Optuna 5 keeps it (``trial.set_constraint``, the system attribute
    ``constraints:<name>``) and, as a list in name order, where optuna-dashboard reads
    constraints (the system attribute ``constraints``), so the dashboard shows them and tells
    feasible trials from infeasible ones. Keys of that list (``"0"``, ``"1"``, ...) that
    :func:`constraints` would not return are skipped, so a twin's ``trial.constraints`` can be
    passed as they are.

    Example:
        >>> study = optuna.create_study()
        >>> trial = study.ask()
        >>> set_constraints(trial, {"parity": 0.02})
        >>> _ = study.tell(trial, 1.0)
        >>> constraints(study.trials[0]), is_feasible(study.trials[0])
        ({'parity': 0.02}, False)
    """
    named = {k: float(v) for k, v in values.items() if not k.isdigit()}
    for key, value in named.items():
        trial.set_constraint(key, value)
    # The dashboard's list: every named constraint the trial holds, this call's and earlier.
    held = constraints(trial.storage.get_trial(trial._trial_id))
    trial.storage.set_trial_system_attr(
        trial._trial_id, CONSTRAINTS_KEY, [held[k] for k in sorted(held)]
    )


def constraints(trial: FrozenTrial) -> dict[str, float]:
    """A trial's constraints by name, without the dashboard's unnamed copies of them."""
    return {k: float(v) for k, v in (trial.constraints or {}).items() if not k.isdigit()}


def objective_value(value: float, constraints: Mapping[str, float], *, maximize: bool) -> float:
    """The value to tell Optuna for a COMPLETE trial with these constraints.

    Feasible: the measured value. Infeasible: the worst value there is (``-inf`` when
    maximizing, ``+inf`` when minimizing). Optuna's own ``study.best_trial`` and its samplers
    already rank infeasible trials by their constraints, never by their value; what ranks by
    value alone does not (optuna-dashboard's "Best Trial" is the storage's best value among
    COMPLETE trials), and would crown a fast trial that failed parity. The measurement itself
    stays on the trial (its ``throughput`` attribute).

    Example:
        >>> objective_value(812.5, {"parity": -0.01}, maximize=True)
        812.5
        >>> objective_value(950.0, {"parity": 0.07}, maximize=True)
        -inf
    """
    if all(v <= 0.0 for v in constraints.values()):
        return float(value)
    return -math.inf if maximize else math.inf


def is_feasible(trial: FrozenTrial) -> bool:
    """COMPLETE and every constraint satisfied (≤ 0): the one feasibility rule.

    Example:
        >>> from optuna.trial import create_trial
        >>> is_feasible(create_trial(value=1.0, system_attrs={"constraints:parity": 0.02}))
        False
    """
    return trial.state == TrialState.COMPLETE and all(
        v <= 0.0 for v in (trial.constraints or {}).values()
    )


def feasible_trials(trials: Iterable[FrozenTrial], *, measured: bool = True) -> list[FrozenTrial]:
    """Feasible search trials (not the config's own); with ``measured``, none copied a twin's."""
    feasible = [(t, record(t)) for t in trials if is_feasible(t)]
    return [
        t
        for t, rec in feasible
        if not rec.tuned_config and not (measured and rec.duplicate_of is not None)
    ]


def display_outcome(trial: FrozenTrial) -> str | None:
    """The outcome a person reads: ``completed``, ``infeasible``, ``diverged``, ``oom``, ...,
    ``stale`` for a trial failed by the heartbeat check; None while it runs or waits."""
    if trial.state in (TrialState.RUNNING, TrialState.WAITING):
        return None
    rec = record(trial)
    if trial.state == TrialState.COMPLETE:
        return Outcome.COMPLETED if is_feasible(trial) else Outcome.INFEASIBLE
    if trial.state == TrialState.FAIL and not rec.outcome:
        # Failed by the heartbeat check: nobody was left to record why.
        return Outcome.STALE
    return rec.outcome or trial.state.name.lower()


# ---- what a trial ran --------------------------------------------------------------------------


def candidate(trial: FrozenTrial) -> Candidate:
    """The Candidate a trial ran (its learning rate is the one recorded, after the lr rule;
    its fp32 modules too).

    Raises:
        ValueError: the trial holds no precision, batch size or learning rate.
    """
    p, rec = trial.params, record(trial)
    if "precision" not in p or "batch_size" not in p or rec.learning_rate is None:
        raise ValueError(f"trial {trial.number} holds no candidate (params {dict(p)})")
    return Candidate(
        precision=p["precision"],
        batch_size=int(p["batch_size"]),
        learning_rate=rec.learning_rate,
        init_scale=float(p.get("init_scale", DEFAULT_INIT_SCALE)),
        channels_last=p.get("channels_last"),
        compile=bool(p.get("compile", False)),
        compile_mode=p.get("compile_mode", "default"),
        fp32_modules=list(rec.fp32_modules),
    )


def label(params: Mapping[str, Any]) -> str:
    """A trial's sampled parameters in one line: ``fp16 bs=32 lr×1 init_scale=1024``, then the
    knobs a trial turned (``compile``, ``channels_last``/``nchw``, ``fp32 islands``).

    Example:
        >>> label({"precision": "fp16", "batch_size": 32, "lr_multiplier": 1.0,
        ...        "init_scale": 1024.0, "compile": True})
        'fp16 bs=32 lr×1 init_scale=1024 compile'
    """
    text = (
        f"{params.get('precision')} bs={params.get('batch_size')} "
        f"lr×{float(params.get('lr_multiplier', 1.0)):.3g}"
    )
    if "init_scale" in params:
        scale = float(params["init_scale"])
        text += " init_scale=" + (
            f"{scale:.0f}" if scale >= 1 and scale.is_integer() else f"{scale:g}"
        )
    if params.get("compile"):
        mode = params.get("compile_mode", "default")
        text += " compile" if mode == "default" else f" compile={mode}"
    if "channels_last" in params:
        text += " channels_last" if params["channels_last"] else " nchw"
    if params.get("fp32_islands", "none") != "none":
        text += " fp32 islands"
    return text


def worst_diverged(trials: Iterable[FrozenTrial], precision: str = "fp16") -> FrozenTrial | None:
    """The diverged trial of a precision that broke soonest (fewest finite losses recorded,
    then the highest learning rate), or None when none diverged."""

    def key(t: FrozenTrial) -> tuple[int, float]:
        losses = record(t).losses
        finite = next((n for n, v in enumerate(losses) if v is None), len(losses))
        return finite, -(record(t).learning_rate or 0.0)

    # One pruned without a run (its lr past one that blew up) has no losses: nothing to read.
    diverged = [
        t
        for t in trials
        if t.params.get("precision") == precision
        and record(t).outcome == Outcome.DIVERGED
        and record(t).losses
    ]
    return min(diverged, key=key) if diverged else None


def role_trials(trials: Iterable[FrozenTrial]) -> dict[str, FrozenTrial]:
    """The trial of each role; where a resumed study holds a role twice, the one that
    completed (else the latest)."""
    out: dict[str, FrozenTrial] = {}
    for t in sorted(trials, key=lambda t: t.number):
        role = record(t).role
        if role and (role not in out or out[role].state != TrialState.COMPLETE):
            out[role] = t
    return out


# ---- batch ceilings, stored per machine and device -------------------------------------------


def stored_ceilings(attrs: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, int]]:
    """Every stored ceiling table of a study, by ``(host, device)``."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    for key, value in attrs.items():
        where = parse_ceilings_key(key)
        if where is not None and isinstance(value, dict):
            out[where] = {str(m): int(b) for m, b in value.items()}
    return out


# ---- why a candidate was not chosen -------------------------------------------------------------


class Rejection(BaseModel):
    """Why a candidate was not chosen, as data: where (``search`` or ``validation``), what kind
    (an outcome such as ``diverged``, or ``parity``, ``speed``, ``infeasible``) and the words.

    Example:
        >>> str(Rejection(label="bf16 bs=64 lr×1", stage="validation", kind="parity",
        ...               detail="loss parity +7.0% vs the fp32 reference (tolerance 5%)"))
        'bf16 bs=64 lr×1: failed validation: loss parity +7.0% vs the fp32 reference (tolerance 5%)'
    """

    model_config = ConfigDict(extra="forbid")

    label: str
    stage: Literal["search", "validation"]
    kind: str
    detail: str = ""
    count: int = 1

    def __str__(self) -> str:
        if self.stage == "validation":
            return f"{self.label}: failed validation: {self.detail}"
        text = f"{self.label}: {self.count} {self.kind}"
        return text + (f" (e.g. {self.detail})" if self.detail else "")


def trial_counts(trials: Iterable[FrozenTrial]) -> dict[str, int]:
    """Trials by state, infeasible (COMPLETE but breaking parity) counted apart too; failed ones
    that never ran (queued, then the search ended: no parameters) and ones that reused an
    earlier trial's measurement (the same parameters: nothing was measured) apart."""
    out = {
        "complete": 0, "infeasible": 0, "pruned": 0, "failed": 0, "not_run": 0, "reused": 0,
        "other": 0,
    }  # fmt: skip
    for t in trials:
        rec = record(t)
        if rec.tuned_config:
            continue  # a config an earlier run crowned, not a trial of the search
        if rec.duplicate_of is not None:
            out["reused"] += 1
        elif t.state == TrialState.COMPLETE:
            out["complete"] += 1
            out["infeasible"] += not is_feasible(t)
        elif t.state == TrialState.PRUNED:
            out["pruned"] += 1
        elif t.state == TrialState.FAIL:
            out["failed" if t.params else "not_run"] += 1
        else:
            out["other"] += 1
    return out
