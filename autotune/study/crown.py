"""The tuned config, stored on its study (where every box of a shared study reads it) and crowned
the study's best trial with its validated figure."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from typing import Any

import optuna
import sqlalchemy as sa
from loguru import logger
from optuna.trial import FrozenTrial, TrialState
from pydantic import ValidationError

from autotune.schema.config import TunedConfig
from autotune.study import study_keys
from autotune.study.guarded import engine_of
from autotune.study.trials import TrialRecord, is_feasible, record

__all__ = ["store_config", "stored_config"]


def store_config(study: optuna.Study, config: TunedConfig) -> None:
    """Store the tuned config on the study, where every box of a shared study can read it, and
    make it the study's best trial (see :func:`_crown`).

    As JSON text: optuna-dashboard shows a text attribute whole, but cuts any other value's JSON
    at 1,024 characters (a config is longer), which would leave invalid JSON on the screen.
    """
    study.set_user_attr(study_keys.CONFIG, config.model_dump_json())
    try:
        _crown(study, config)
    except sa.exc.SQLAlchemyError as exc:  # best.json and the stored config are written
        logger.warning("the config could not be made the study's best trial: {}", exc)


def _crown(study: optuna.Study, config: TunedConfig) -> None:
    """The config, with the figure validation stands behind, as the study's best trial (the
    highest value of a COMPLETE one: optuna-dashboard's "Best Trial", ``study.best_trial``),
    marked ``tuned_config``, with the parameters of the search trial validated (none for the
    fp32 reference). Search figures (unpaired: they run high) at or above it are told just
    under it in their order, each keeping its ``speedup``; those below, their own again. The
    search reads only the order of values, so a resumed study searches on as before. Database
    storages only (Optuna changes no finished trial: this writes the values), speedup only.
    """
    engine = engine_of(study._storage)
    if engine is None or study.direction != optuna.study.StudyDirection.MAXIMIZE:
        return
    ev, value = config.evidence, config.evidence.speedup
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    key = (config.precision, config.batch_size, ev.search_speedup)
    source = next((t for t in done if ev.validated and _point(t) == key), None)
    params, dists = (source.params, source.distributions) if source else (None, None)
    made = optuna.trial.create_trial(value=value, params=params, distributions=dists)
    made.user_attrs = TrialRecord(
        tuned_config=True,
        reason=ev.validation_note,
        learning_rate=config.learning_rate,
        blocks=ev.paired_blocks,
        validated_trial=source.number if source else None,
        worker=f"{socket.gethostname()}:{os.getpid()}",  # who validated: as storage.owner_id
        **{k: getattr(ev, k) for k in _EVIDENCE},
    ).to_attrs()
    study.add_trial(made)
    figures = {t._trial_id: _searched(t) for t in done}
    floor = max((v for v in figures.values() if v < value), default=-math.inf)
    told = [{"i": i, "v": v} for i, v in figures.items() if math.isfinite(v) and v < value]
    for i in sorted((i for i, v in figures.items() if v >= value), key=lambda i: -figures[i]):
        value = max(math.nextafter(value, -math.inf), math.nextafter(floor, math.inf))
        told.append({"i": i, "v": value})
    table = sa.table("trial_values", *map(sa.column, ("trial_id", "objective", "value")))
    where = (table.c.trial_id == sa.bindparam("i")) & (table.c.objective == 0)
    with engine.begin() as conn:
        if told:
            conn.execute(table.update().where(where).values(value=sa.bindparam("v")), told)


# What the config's trial records of its evidence, under the same names.
_EVIDENCE: tuple[str, ...] = ("throughput", "throughput_low", "throughput_high", "speedup")
_EVIDENCE += ("speedup_low", "speedup_high", "peak_memory_bytes", "loss", "parity_gap")
_EVIDENCE += ("compile_seconds",)


def _point(t: FrozenTrial) -> tuple[Any, ...]:
    return t.params.get("precision"), t.params.get("batch_size"), record(t).speedup


def _searched(t: FrozenTrial) -> float:
    speedup = record(t).speedup
    return speedup if speedup is not None and is_feasible(t) else float(t.value or 0.0)


def stored_config(study: optuna.Study | Mapping[str, Any]) -> TunedConfig | None:
    """The tuned config stored on a study (or its user attributes), also as older versions
    stored it (a JSON object); None when there is none or it does not validate.

    Example:
        >>> stored_config({}) is None
        True
    """
    attrs = study if isinstance(study, Mapping) else study.user_attrs
    stored = attrs.get(study_keys.CONFIG)
    try:
        if isinstance(stored, str):
            return TunedConfig.model_validate_json(stored)
        if isinstance(stored, dict):
            return TunedConfig.model_validate(stored)
    except ValidationError:
        return None
    return None
