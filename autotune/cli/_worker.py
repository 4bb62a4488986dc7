"""``autotune worker``: join a study in a shared storage and run its trials on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from autotune.cli._app import app, console, err_console, fail, setup_logging
from autotune.errors import AutotuneError, SpecError

if TYPE_CHECKING:
    from autotune.schema.spec import StudySpec


@app.command()
def worker(
    spec_file: Annotated[
        Path | None,
        typer.Argument(
            help="Study spec: creates the study, or joins it when it exists.", show_default=False
        ),
    ] = None,
    study: Annotated[
        str | None, typer.Option(help="Join this existing study (its spec is in the storage).")
    ] = None,
    storage: Annotated[
        str | None, typer.Option(help="The shared storage URL, e.g. postgresql://user:pw@host/db.")
    ] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda:N on this machine.")] = None,
    out: Annotated[
        Path | None, typer.Option(help="Where this worker writes best.json if it validates.")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run trials of one study on this machine's device, beside any number of other workers.

    Every worker takes trials from the study's shared sampler and records them in the shared
    storage; the study's budget holds across workers, a worker that dies has its trial retried
    by another, and validation runs once, in whichever worker reaches it first.
    """
    setup_logging(verbose)
    from autotune.schema.spec import load_spec
    from autotune.search import Budget, SearchInterrupted, run_search
    from autotune.study.storage import open_study
    from autotune.study.store import StudyStore

    try:
        if spec_file is not None:
            spec = load_spec(spec_file)
            spec = spec.with_overrides({"storage": storage, "device": device, "name": study})
        elif study is not None:
            spec = _stored_spec(study, storage, device)
        else:
            raise SpecError(
                "give a spec file or --study NAME; e.g. autotune worker --study resnet18 --storage URL"
            )
        # Join the window a running search opened; open one when there is none.
        opened_study = open_study(spec)
        shared = Budget.shared(StudyStore(opened_study))
        join = shared is not None and shared.left() > 1.0
        if study is not None and spec_file is None and not join:
            if not _finish_spent(opened_study, spec):
                return
            # Its workers died before it wrote a config (a database restart, a killed box):
            # validate what it measured, in a short window of its own, instead of a new budget.
            spec = spec.with_overrides({"budget": _finishing_budget(spec.budget)})
        result = run_search(spec, out_dir=out, join=join, handle_sigint=True)
    except SearchInterrupted as exc:
        err_console.print(f"[yellow]{exc}[/]", highlight=False)
        raise typer.Exit(130) from None
    except AutotuneError as exc:
        fail(str(exc))
        return
    from autotune.study.trials import record

    mine = [t for t in result.store.trials() if record(t).worker == _me()]
    console.print(
        f"worker {_me()}: ran {len(mine)} trials of study {spec.name!r}; "
        + (
            f"validated and wrote {result.path}"
            if result.path
            else f"validation by {result.validated_by}"
        ),
        highlight=False,
    )


def _stored_spec(study: str, storage: str | None, device: str | None) -> StudySpec:
    """The spec an existing study stored, on this worker's storage URL and device.

    Raises:
        SpecError: no --storage, no such study there, or a study autotune did not make.
    """
    from autotune.schema.spec import parse_spec
    from autotune.study.storage import mask_url, open_storage, stored_study, study_names
    from autotune.study.store import StudyStore

    if storage is None:
        raise SpecError("--study needs --storage URL: the storage the study lives in")
    opened = open_storage(storage)
    stored = stored_study(opened, study)
    if stored is None:
        names = ", ".join(study_names(opened))
        raise SpecError(
            f"study {study!r} does not exist in {mask_url(storage)!r} (studies there: "
            f"{names or 'none'}); start it with `autotune search` or a worker given its spec"
        )
    data = StudyStore(stored).spec()
    if data is None:
        raise SpecError(f"study {study!r} was not made by autotune: it has no stored spec")
    data = {**data, "storage": storage}
    if device is not None:
        data["device"] = device
    return parse_spec(data, source=f"stored spec of study {study!r}")


def _finishing_budget(budget: float) -> str:
    from autotune.search import finishing_seconds

    return f"{finishing_seconds(budget):.0f}s"


def _finish_spent(study: Any, spec: Any) -> bool:
    """A study whose budget is spent: fail what its dead workers left RUNNING, and say whether
    it still needs a config (True) or is done (False, said on the terminal)."""
    from optuna.trial import TrialState

    from autotune.study.crown import stored_config
    from autotune.study.storage import fail_stale

    failed = fail_stale(study)
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if failed:
        console.print(
            f"study {spec.name!r}: failed {len(failed)} trials its dead workers left running "
            "(each retried once)",
            highlight=False,
        )
    if stored_config(study) is not None:
        console.print(f"study {spec.name!r}: its budget is spent; nothing to do", highlight=False)
        return False
    if running:
        console.print(
            f"study {spec.name!r}: its budget is spent and {len(running)} trials still run "
            "elsewhere (their heartbeats are fresh); run this again once they end",
            highlight=False,
        )
        return False
    console.print(
        f"study {spec.name!r}: its budget is spent but no config was written: validating what "
        f"it measured in {_finishing_budget(spec.budget)}",
        highlight=False,
    )
    return True


def _me() -> str:
    from autotune.study.storage import owner_id

    return owner_id()
