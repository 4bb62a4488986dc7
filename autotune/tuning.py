"""``autotune.tune()``: a search from a notebook or a script, on the objects a project has.

The same search as ``autotune search``, in the same isolated worker process: the objects are
handed to it the way a spec names them. A class or function defined at the top level of an
importable module travels as its name (``mypkg.model:LitClassifier``), which the worker imports
(the notebook's own import path goes with it). Anything else, a class defined in the notebook
(``__main__``) or a dataset object, is pickled to ``studies/<name>/objects/``: by value with
cloudpickle when it is installed; without it, plain pickle carries data but not a notebook's
classes or functions, and tune() says so in one line before anything runs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from loguru import logger

from autotune.errors import AutotuneError, AutotuneWarning, SpecError
from autotune.measure.precision import resolve_device
from autotune.report.notebook import NotebookProgress
from autotune.schema.config import TunedConfig
from autotune.schema.spec import StudySpec, format_duration, load_spec, parse_spec
from autotune.workloads import reference_for

__all__ = ["tune"]

_USAGE = (
    "tune() takes one workload: module= and datamodule= (Lightning), model= and dataset= "
    "(Hugging Face), model=, data= and optimizer= (a plain loop), or workload= (a reference or "
    "a function returning autotune.Workload)"
)
# What each kind needs, and what it may take besides.
_REQUIRED = {
    "lightning": ("module", "datamodule"),
    "huggingface": ("model", "dataset"),
    "loop": ("model", "data", "optimizer"),
}
_OPTIONAL = {
    "lightning": ("module_args", "datamodule_args"),
    "huggingface": ("collator", "tokenizer", "training_args", "model_args"),
    "loop": ("loss", "model_args"),
}
# Which init args go with which object, when they must travel bound to it.
_ARGS_OF = {"module": "module_args", "datamodule": "datamodule_args", "model": "model_args"}


def _kind(given: dict[str, Any]) -> str:
    """Which workload the keyword arguments describe; SpecError when none or several."""
    kinds = []
    if given.get("workload") is not None:
        kinds.append("workload")
    if given.get("module") is not None or given.get("datamodule") is not None:
        kinds.append("lightning")
    if given.get("dataset") is not None:
        kinds.append("huggingface")
    if given.get("data") is not None or given.get("optimizer") is not None:
        kinds.append("loop")
    if len(kinds) != 1:
        got = ", ".join(k for k, v in given.items() if v is not None) or "nothing"
        raise SpecError(f"{_USAGE}; got {got}")
    kind = kinds[0]
    missing = [k for k in _REQUIRED.get(kind, ()) if given.get(k) is None]
    if missing:
        raise SpecError(f"tune(): {kind} needs {', '.join(f'{k}=' for k in missing)} too; {_USAGE}")
    allowed = {"workload"} if kind == "workload" else {*_REQUIRED[kind], *_OPTIONAL[kind]}
    stray = [k for k, v in given.items() if v is not None and k not in allowed]
    if stray:
        raise SpecError(
            f"tune(): {', '.join(f'{k}=' for k in stray)} do not go with {kind}; {_USAGE}"
        )
    return kind


def _plain(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _workload_field(kind: str, given: dict[str, Any], objects: Path) -> Any:
    """The spec's ``workload``: a reference, or ``{kind: {field: reference, ...}}``."""
    if kind == "workload":
        wl = given["workload"]
        if isinstance(wl, (str, Mapping)):
            return wl if isinstance(wl, str) else dict(wl)
        return reference_for(wl, "workload", objects)
    body: dict[str, Any] = {}
    for field in (*_REQUIRED[kind], *_OPTIONAL[kind]):
        value = given.get(field)
        if value is None or field.endswith("_args"):
            continue
        args = _ARGS_OF.get(field)
        if args and given.get(args) and not _plain(given[args]):
            # Init args that are objects travel bound to what they build.
            value, given[args] = functools.partial(value, **given[args]), None
        body[field] = reference_for(value, f"{kind}.{field}", objects)
    for field in _OPTIONAL[kind]:
        if field.endswith("_args") and given.get(field):
            body[field] = dict(given[field])
    return {kind: body}


def _default_name(kind: str, given: dict[str, Any]) -> str:
    first = given["workload" if kind == "workload" else _REQUIRED[kind][0]]
    if isinstance(first, str):
        text = first.rsplit(":", 1)[-1]
    else:
        while isinstance(first, functools.partial):
            first = first.func
        text = getattr(first, "__name__", None) or type(first).__name__
    text = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-._")
    return text or "tune"


def _base_fields(spec: StudySpec | str | Path | Mapping[str, Any] | None) -> dict[str, Any]:
    if spec is None:
        return {}
    if isinstance(spec, StudySpec):
        return spec.model_dump(mode="json")
    if isinstance(spec, (str, Path)):
        return load_spec(spec).model_dump(mode="json")
    if isinstance(spec, Mapping):
        return dict(spec)
    raise SpecError(
        f"tune(spec=...) takes a StudySpec, a spec file or a mapping of spec fields, got a "
        f"{type(spec).__name__}"
    )


@contextlib.contextmanager
def _worker_import_path() -> Iterator[None]:
    """The probe worker gets this process's own import path (a notebook's ``sys.path.append``
    included): what imports here imports there. The interpreter's own folders it has already."""
    own = (sys.prefix, sys.base_prefix, sys.exec_prefix)
    extra = [
        p
        for p in sys.path
        if p and os.path.isdir(p) and not any(os.path.abspath(p).startswith(o) for o in own)
    ]
    before = os.environ.get("PYTHONPATH")
    parts = [*(before.split(os.pathsep) if before else []), *extra]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


@contextlib.contextmanager
def _logs(verbose: bool) -> Iterator[None]:
    """Unless ``verbose``, autotune's log lines and Optuna's info lines held back for the call:
    the progress says what matters, and they would bury it."""
    if verbose:
        yield
        return
    import optuna

    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logger.disable("autotune")
    try:
        yield
    finally:
        logger.enable("autotune")
        optuna.logging.set_verbosity(level)


def tune(  # noqa: PLR0913 - public API: one keyword per object a workload is made of (Lightning, HF, a loop)
    workload: Any = None,
    *,
    module: Any = None,
    datamodule: Any = None,
    module_args: Mapping[str, Any] | None = None,
    datamodule_args: Mapping[str, Any] | None = None,
    model: Any = None,
    dataset: Any = None,
    collator: Any = None,
    tokenizer: Any = None,
    training_args: Any = None,
    model_args: Mapping[str, Any] | None = None,
    data: Any = None,
    optimizer: Any = None,
    loss: Any = None,
    base_lr: float | None = None,
    base_batch_size: int | None = None,
    budget: str | float | None = None,
    name: str | None = None,
    device: str | None = None,
    spec: StudySpec | str | Path | Mapping[str, Any] | None = None,
    storage: str | None = None,
    out: str | Path | None = None,
    progress: bool | None = None,
    verbose: bool = False,
) -> TunedConfig:
    """Tune precision, batch size, lr and GradScaler ``init_scale`` for the objects you have,
    and return the validated config (also written to ``studies/<name>/best.json``).

    Name one workload, by what it is made of:

    - Lightning: ``module`` (a LightningModule class, factory or instance) and ``datamodule``
      (a LightningDataModule class, factory or instance), with ``module_args`` /
      ``datamodule_args`` for their constructors.
    - Hugging Face: ``model`` (a PreTrainedModel class, config, factory or model) and
      ``dataset`` (a map-style dataset of dicts), optionally ``collator``, ``tokenizer``,
      ``training_args`` and ``model_args``.
    - A plain loop: ``model``, ``data`` (``data(batch_size)`` returns a DataLoader),
      ``optimizer`` (``optimizer(params, lr=...)``) and optionally ``loss(outputs, targets)``.
    - Or ``workload``: a reference (``"mypkg.train:workload"``, ``"tiny_mlp"``), a function
      returning :class:`~autotune.Workload`, or a spec's mapping (``{"lightning": {...}}``).

    The search runs in a separate worker process, as ``autotune search`` does: see this
    module's notes for how the objects reach it.

    Args:
        workload: see above.
        module, datamodule, module_args, datamodule_args: a Lightning workload.
        model, dataset, collator, tokenizer, training_args, model_args: a Hugging Face one.
        data, optimizer, loss: with ``model`` (and ``model_args``), a plain loop.
        base_lr: the lr at the base batch size, where the objects do not say it.
        base_batch_size: the batch size ``base_lr`` belongs to, likewise.
        budget: the whole job's wall time (``"5m"``, ``90``); the spec's, else 5 minutes.
        name: the study's name and output folder; the model's class name by default.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; the spec's, else ``auto``.
        spec: the other spec fields (space, probe, validation...): a StudySpec, a spec file
            or a mapping; its workload is replaced by the one given here.
        storage: the Optuna storage URL; the spec's (``studies/autotune.db``) by default.
        out: where best.json and report.html go; ``studies/<name>/`` by default.
        progress: a tqdm bar when tqdm is installed (None), or plain lines only (False).
        verbose: let the search's log lines through (to whatever loguru sinks there are);
            by default they are held back while the call runs.

    Returns:
        The TunedConfig, as ``autotune.load_config("studies/<name>/best.json")`` returns it.

    Raises:
        SpecError: the arguments do not describe one workload, or a spec field is invalid.
        WorkloadError: an object cannot reach the worker, or cannot be built or used there;
            one line naming it.
        DeviceError, StorageError: as for ``autotune search``.
        SearchInterrupted: Ctrl-C (the interrupt button); calling again resumes the study.

    Example:
        >>> import autotune
        >>> cfg = autotune.tune(module=LitClassifier, datamodule=CIFARData, budget="5m")  # doctest: +SKIP
        >>> cfg.precision, cfg.batch_size, cfg.learning_rate  # doctest: +SKIP
        ('bf16', 256, 0.4)
    """
    given = {
        "workload": workload,
        "module": module,
        "datamodule": datamodule,
        "module_args": module_args,
        "datamodule_args": datamodule_args,
        "model": model,
        "dataset": dataset,
        "collator": collator,
        "tokenizer": tokenizer,
        "training_args": training_args,
        "model_args": model_args,
        "data": data,
        "optimizer": optimizer,
        "loss": loss,
    }
    study, out_dir = _study(
        given,
        base={"base_lr": base_lr, "base_batch_size": base_batch_size},
        fields=_base_fields(spec),
        given_fields={"name": name, "budget": budget, "device": device, "storage": storage},
        out=out,
    )
    return _run(study, out_dir, progress=progress, verbose=verbose)


def _study(
    given: dict[str, Any],
    *,
    base: dict[str, Any],
    fields: dict[str, Any],
    given_fields: dict[str, Any],
    out: str | Path | None,
) -> tuple[StudySpec, Path]:
    """The spec tune()'s arguments describe, and its output folder; the objects that must
    travel by value are pickled into ``<out>/objects`` on the way."""
    workload = given["workload"]
    if isinstance(workload, Mapping) and len(workload) == 1:
        # A spec's mapping holding objects: the same as naming them one by one.
        ((adapter, body),) = workload.items()
        if adapter in _REQUIRED and isinstance(body, Mapping):
            given.update({"workload": None, **body})
    kind = _kind(given)
    fields["name"] = given_fields["name"] or fields.get("name") or _default_name(kind, given)
    out_dir = Path(out) if out is not None else Path("studies") / str(fields["name"])
    wl = _workload_field(kind, given, out_dir / "objects")
    said = {k: v for k, v in base.items() if v is not None}
    if kind != "workload":
        wl[kind].update(said)
    elif said:
        raise SpecError(
            "tune(): base_lr= and base_batch_size= go with module=, model= or data=; a "
            "workload function says its own"
        )
    fields["workload"] = wl
    defaults = {"budget": "5m", "device": "auto", "storage": fields.get("storage")}
    for key, default in defaults.items():
        value = given_fields[key] if given_fields[key] is not None else fields.get(key, default)
        if value is not None:
            fields[key] = value
    return parse_spec(fields, source="autotune.tune() arguments"), out_dir


def _run(study: StudySpec, out_dir: Path, *, progress: bool | None, verbose: bool) -> TunedConfig:
    """The search, in its worker, with the progress a notebook shows; then the report."""
    from autotune.search import Budget, run_search

    title = (
        f"tuning {study.name} on {resolve_device(study.device)} for "
        f"{format_duration(study.budget)} → {out_dir / 'best.json'}"
    )
    clock = Budget(study.budget)
    with _logs(verbose), _worker_import_path():
        with NotebookProgress(clock, title=title, bar=progress) as watcher:
            result = run_search(
                study, out_dir=out_dir, budget=clock, on_event=watcher, handle_sigint=True
            )
            if result.config is not None:
                watcher.config_written(result.config)
        _write_report(study, out_dir)
    if result.config is None:
        raise AutotuneError(
            f"study {study.name!r} is validated by {result.validated_by}; its config will be in "
            f"the storage {study.storage}"
        )
    return result.config


def _write_report(spec: StudySpec, out_dir: Path) -> None:
    """report.html beside best.json, as ``autotune search`` writes it; a report that cannot be
    written is a warning, not a failed search."""
    from autotune.report import write_report

    try:
        write_report(spec.name, storage=spec.storage, out_dir=out_dir)
    except (OSError, AutotuneError) as exc:
        warnings.warn(
            f"report not written: {exc}; try again with autotune report {spec.name}",
            AutotuneWarning,
            stacklevel=3,
        )
