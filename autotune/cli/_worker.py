"""``autotune worker``: join a study in a shared storage and run its trials on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from autotune.cli._app import app, console, err_console, fail, setup_logging
from autotune.errors import AutotuneError, SpecError


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
    import optuna

    from autotune.search import Budget, SearchInterrupted, run_search
    from autotune.spec import load_spec, parse_spec
    from autotune.storage import mask_url, open_storage, open_study

    try:
        if spec_file is None and study is None:
            raise SpecError(
                "give a spec file or --study NAME; e.g. autotune worker --study resnet18 --storage URL"
            )
        if spec_file is not None:
            spec = load_spec(spec_file)
            spec = spec.with_overrides({"storage": storage, "device": device, "name": study})
        else:
            if storage is None:
                raise SpecError("--study needs --storage URL: the storage the study lives in")
            opened = open_storage(storage)
            try:
                stored = optuna.load_study(study_name=study, storage=opened)
            except KeyError:
                names = ", ".join(
                    sorted(s.study_name for s in optuna.get_all_study_summaries(opened))
                )
                raise SpecError(
                    f"study {study!r} does not exist in {mask_url(storage)!r} (studies there: "
                    f"{names or 'none'}); start it with `autotune search` or a worker given its spec"
                ) from None
            data = stored.user_attrs.get("spec")
            if not isinstance(data, dict):
                raise SpecError(f"study {study!r} was not made by autotune: it has no stored spec")
            data = {**data, "storage": storage}
            if device is not None:
                data["device"] = device
            spec = parse_spec(data, source=f"stored spec of study {study!r}")
        # Join the window a running search opened; open one when there is none.
        shared = Budget.shared(open_study(spec))
        join = shared is not None and shared.left() > 1.0
        if study is not None and spec_file is None and not join:
            console.print(
                f"study {spec.name!r}: its budget is spent; nothing to do", highlight=False
            )
            return
        result = run_search(spec, out_dir=out, join=join, handle_sigint=True)
    except SearchInterrupted as exc:
        err_console.print(f"[yellow]{exc}[/]", highlight=False)
        raise typer.Exit(130) from None
    except AutotuneError as exc:
        fail(str(exc))
        return
    from autotune.trials import record

    mine = [t for t in result.study.trials if record(t).worker == _me()]
    console.print(
        f"worker {_me()}: ran {len(mine)} trials of study {spec.name!r}; "
        + (
            f"validated and wrote {result.path}"
            if result.path
            else f"validation by {result.validated_by}"
        ),
        highlight=False,
    )


def _me() -> str:
    from autotune.storage import owner_id

    return owner_id()
