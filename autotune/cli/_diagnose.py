"""``autotune diagnose``: which layers break a precision, and what to do about it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from autotune.cli._app import DEFAULT_STORAGE, app, console, err_console, fail, setup_logging
from autotune.diagnose import DEFAULT_STEPS
from autotune.errors import AutotuneError, SpecError, StorageError

if TYPE_CHECKING:
    from autotune.study.store import StudyStore

SHOWN_LAYERS = 10


@app.command()
def diagnose(  # noqa: PLR0913 - a typer command: its parameters are its command-line options
    target: Annotated[
        str,
        typer.Argument(
            help="A workload (built-in name or package.module:function), or the name of a study "
            "in --storage: its worst diverged trial of --precision is diagnosed.",
            show_default=False,
        ),
    ],
    precision: Annotated[
        str | None, typer.Option(help="fp16 (default), bf16, fp32 or tf32.", show_default=False)
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            help="Batch size; the trial's, else the workload's base size.", show_default=False
        ),
    ] = None,
    lr: Annotated[
        float | None,
        typer.Option(
            help="Learning rate; the trial's, else the workload's base lr.", show_default=False
        ),
    ] = None,
    init_scale: Annotated[
        float | None,
        typer.Option(
            help="GradScaler init_scale (fp16); the trial's, else 2^16.", show_default=False
        ),
    ] = None,
    steps: Annotated[int, typer.Option(help="Instrumented training steps.")] = DEFAULT_STEPS,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda:N.")] = "auto",
    storage: Annotated[
        str, typer.Option(help="Optuna storage URL holding studies.")
    ] = DEFAULT_STORAGE,
    json_out: Annotated[bool, typer.Option("--json", help="Print the Diagnosis as JSON.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Train a few steps with hooks on every layer; say which layer overflows or underflows.

    Exits 0 for a safe or at-risk verdict, 1 when the precision fails here or the diagnosis is
    inconclusive, 2 for a bad argument.
    """
    setup_logging(verbose, quiet=not verbose)
    from pydantic import ValidationError

    from autotune.diagnose import diagnose as run_diagnose
    from autotune.errors import format_validation_error
    from autotune.measure.precision import get_mode
    from autotune.schema.spec import Candidate
    from autotune.workloads import load_workload

    try:
        if steps < 1:
            raise SpecError(
                f"--steps must be at least 1, got --steps {steps}; try --steps {DEFAULT_STEPS}"
            )
        mode = get_mode(precision or "fp16")  # unknown precision: named before any work
        reference, trial, note = _resolve(target, storage, mode.name)
        wl = load_workload(reference)
        fields: dict[str, Any] = {
            "precision": mode.name,
            "batch_size": wl.base_batch_size,
            "learning_rate": wl.base_lr,
        }
        if trial is not None:
            from autotune.diagnose import trial_candidate

            fields.update(
                trial_candidate(trial, wl).model_dump(include=set(fields) | {"init_scale"})
            )
        given = {"batch_size": batch_size, "learning_rate": lr, "init_scale": init_scale}
        fields.update({k: v for k, v in given.items() if v is not None})
        try:
            cand = Candidate(**fields)
        except ValidationError as exc:
            lines = format_validation_error(exc, "diagnose arguments").splitlines()
            raise SpecError(lines[0] + " " + "; ".join(x.strip() for x in lines[1:])) from None
        result = run_diagnose(wl, cand, device, steps=steps)
    except AutotuneError as exc:
        fail(str(exc))
        return
    if note:
        err_console.print(note, highlight=False)
    if json_out:
        console.print_json(result.model_dump_json())
    else:
        _print(result)
    if result.verdict in ("fails", "inconclusive"):
        raise typer.Exit(1)


def _resolve(target: str, storage: str, precision: str) -> tuple[str, Any, str]:
    """A workload reference or a study name → (workload reference, trial or None, a note)."""
    from autotune.diagnose import worst_diverged_trial
    from autotune.study.trials import record
    from autotune.workloads import BUILTINS, normalize_reference

    ref = normalize_reference(target)
    if ":" in ref:
        return ref, None, ""
    store = _load_store(target, storage)
    reference = store.workload()
    if not reference:
        raise StorageError(
            f"study {target!r} has no stored workload (user attr 'workload'); diagnose its workload "
            f"directly, e.g. autotune diagnose {next(iter(BUILTINS))}"
        )
    trial = worst_diverged_trial(store.trials(), precision)
    if trial is None:
        return (
            reference,
            None,
            (
                f"study {target!r} has no diverged {precision} trial: diagnosing {precision} at the "
                f"workload's base settings"
            ),
        )
    reason = record(trial).reason or "diverged"
    return (
        reference,
        trial,
        (
            f"study {target!r}: diagnosing trial {trial.number}, its worst diverged {precision} trial "
            f"({reason})"
        ),
    )


def _load_store(name: str, storage: str) -> StudyStore:
    from autotune.study.storage import mask_url, open_storage, stored_study, study_names
    from autotune.study.store import StudyStore
    from autotune.workloads import BUILTINS

    what = (
        f"{name!r} is neither a workload (a built-in: {', '.join(BUILTINS)}; or "
        f"package.module:function) nor a study in {mask_url(storage)!r}"
    )
    # Opening a SQLite URL creates the file: a typo must not leave an empty database behind.
    if storage.startswith("sqlite:///") and not Path(storage[len("sqlite:///") :]).is_file():
        raise SpecError(f"{what} (no such database file); check the name, or pass --storage")
    opened = open_storage(storage)
    study = stored_study(opened, name)
    if study is None:
        names = study_names(opened)
        known = f"studies there: {', '.join(names[:8])}" if names else "it holds no study"
        raise SpecError(f"{what} ({known}); check the name, or pass --storage")
    return StudyStore(study)


def _fmt(x: float | None) -> str:
    """Short numbers for narrow terminals: 5.63, 0.0149, 1.68e+06, 3.1e-09."""
    if x is None:
        return "—"
    return f"{x:.3g}" if x == 0 or 0.001 <= abs(x) < 1e4 else f"{x:.2e}"


def _share(x: float) -> str:
    if x >= 1:
        return f"{x:.3g}x"
    return f"{x:.1%}" if x >= 0.001 else "<0.1%"


def _print(d: Any) -> None:
    """The diagnosis for a person: what ran, its worst layers, where it broke, what to do."""
    _print_run(d)
    if d.layers:
        _print_layers(d)
    _print_verdict(d)


def _print_run(d: Any) -> None:
    c = d.candidate
    settings = f"{c.precision} bs={c.batch_size} lr={c.learning_rate:.3g}"
    if c.precision == "fp16":
        settings += f" init_scale={c.init_scale:g}"
    losses = f"{d.losses[0]:.4g} → {d.losses[-1]:.4g}" if d.losses else "—"
    console.print(
        f"[bold]diagnose[/] {d.workload}: {settings} on {d.device}; {d.steps} "
        f"step{'s' if d.steps != 1 else ''} in "
        f"{d.wall_seconds:.1f}s, loss {losses}, skipped steps {d.skipped_steps}",
        highlight=False,
    )


def _print_layers(d: Any) -> None:
    """The worst layers as a table, with what its columns mean."""
    console.print(_layer_table(d))
    console.print(
        "  [dim]|act| |grad|: largest size (fp32, unscaled); inf/nan: non-finite values "
        "forward/backward; uflow: share of gradient values flushed to zero[/]",
        highlight=False,
    )
    if len(d.layers) > SHOWN_LAYERS:
        console.print(
            f"  {len(d.layers) - SHOWN_LAYERS} more layers: --json lists them all",
            highlight=False,
        )


def _layer_table(d: Any) -> Table:
    short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
    limit = f"{d.limit:,.0f}" if d.limit < 1e7 else f"{d.limit:.3g}"
    worst = d.worst(SHOWN_LAYERS)
    table = Table(
        title=f"worst layers ({short.get(d.dtype, d.dtype)} limit {limit})",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    # The names matter most: the type column gives way on a narrow terminal (the numbers
    # take about 60 columns).
    name_width = max(len(s.label) for s in worst)
    with_type = console.width >= name_width + 70
    table.add_column("layer", min_width=min(40, name_width))
    if with_type:
        table.add_column("type", overflow="ellipsis", no_wrap=True, max_width=12)
    table.add_column("dtype", no_wrap=True)
    for col in ("|act|", "of limit", "inf/nan", "|grad|", "uflow"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in worst:
        first = d.first_nonfinite == s.name and d.first_nonfinite_pass in (
            "forward",
            "backward",
        )
        table.add_row(
            s.label,
            *([s.type] if with_type else []),
            short.get(s.dtype, s.dtype),
            _fmt(s.act_max),
            _share(s.act_limit_ratio),
            f"{s.act_nonfinite}/{s.grad_nonfinite}",
            _fmt(s.grad_max),
            "—" if s.grad_underflow is None else f"{s.grad_underflow:.1%}",
            style="bold red" if first else None,
        )
    return table


def _print_verdict(d: Any) -> None:
    """Where the first non-finite value appeared, the verdict, and what to do about it."""
    if d.first_nonfinite_pass is not None:
        where = (
            f"`{d.first_nonfinite or '(model)'}`"
            if d.first_nonfinite_pass != "loss"
            else "the loss"
        )
        console.print(
            f"first non-finite value: {where} ({d.first_nonfinite_pass}, step "
            f"{d.first_nonfinite_step})",
            highlight=False,
        )
    style = {"safe": "green", "at_risk": "yellow"}.get(d.verdict, "red")
    console.print(f"verdict: [bold {style}]{d.verdict.replace('_', ' ')}[/]", highlight=False)
    for rec in d.recommendations:
        console.print(f"  • {rec.evidence}:\n    [bold]{rec.action}[/]", highlight=False)
