"""Opening the Optuna study a spec names, with clear errors and a resume check."""

from __future__ import annotations

import re
from pathlib import Path

import optuna
from sqlalchemy.exc import SQLAlchemyError

from autotune.errors import StorageError
from autotune.spec import StudySpec

__all__ = ["mask_url", "open_storage", "open_study"]


def mask_url(url: str) -> str:
    """Hide a password in a storage URL: ``postgresql://u:secret@h/db`` → ``postgresql://u:***@h/db``."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Open an Optuna storage URL, creating the folder of a SQLite file.

    Raises:
        StorageError: the URL cannot be opened, naming it (password hidden) and the fix.
    """
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///") :])
        if path.parent and not path.parent.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(
                    f"storage {url!r}: cannot create folder {str(path.parent)!r}: {exc}"
                ) from None
    if not re.match(r"^[a-z][a-z0-9+]*://", url):
        raise StorageError(
            f"storage {mask_url(url)!r} is not a database URL; use sqlite:///studies/autotune.db "
            "or postgresql://user:password@host/db"
        )
    try:
        return optuna.storages.RDBStorage(url)
    except (SQLAlchemyError, ImportError, ValueError, OSError) as exc:
        detail = str(exc).splitlines()[0][:300]
        raise StorageError(
            f"storage {mask_url(url)!r} cannot be opened: {detail}; check the URL, the server and "
            "the credentials"
        ) from None


def open_study(spec: StudySpec, storage: optuna.storages.BaseStorage | None = None) -> optuna.Study:
    """Create the spec's study, or load it to resume when it exists with the same space.

    Raises:
        StorageError: the storage cannot be opened, or a study of this name exists with a
            different space (its trials are left untouched).
    """
    storage = storage or open_storage(spec.storage)
    direction = "maximize" if spec.objective == "throughput" else "minimize"
    sampler = optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=6)
    fingerprint = spec.space_fingerprint()
    try:
        existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage)}
    except SQLAlchemyError as exc:
        raise StorageError(f"storage {mask_url(spec.storage)!r} cannot be read: {exc}") from None
    if spec.name in existing:
        study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler)
        stored = study.user_attrs.get("space_fingerprint")
        if stored != fingerprint:
            raise StorageError(
                f"study {spec.name!r} already exists in {mask_url(spec.storage)!r} with a different "
                f"space (workload, space, probe lengths or objective changed; stored "
                f"{study.user_attrs.get('workload', '?')!r}); its {len(study.trials)} trials are kept. "
                f"Use --name {spec.name}-2 for a new study, or run with the spec it was made with"
            )
        return study
    study = optuna.create_study(
        study_name=spec.name, storage=storage, sampler=sampler, direction=direction
    )
    study.set_user_attr("space_fingerprint", fingerprint)
    study.set_user_attr("workload", spec.workload)
    study.set_user_attr("spec", spec.model_dump(mode="json"))
    return study
