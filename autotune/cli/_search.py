"""``autotune search`` and ``autotune probe``."""

from __future__ import annotations

import shlex
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from loguru import logger
from rich.markup import escape

import autotune
from autotune.cli._app import (
    Launch,
    app,
    console,
    err_console,
    fail,
    parse_sets,
    setup_logging,
    warn,
)
from autotune.errors import AutotuneError, SpecError, StorageIOError
from autotune.infra.logs import JSON_ENV, log_to_file
from autotune.infra.redact import mask_url
from autotune.schema.enums import Outcome

# Torch, optuna and the storage are imported in the functions that use them: `--help` loads none.

DEFAULT_SPEC = Path("studies/resnet18.yaml")


@app.command()
def search(  # noqa: PLR0913 - a typer command: its parameters are its command-line options
    spec_file: Annotated[
        Path | None,
        typer.Argument(
            help="Study spec YAML; studies/resnet18.yaml when omitted.", show_default=False
        ),
    ] = None,
    budget: Annotated[
        str | None, typer.Option(help="Wall time for the whole job: 30m, 1h30m, 90s.")
    ] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda:N.")] = None,
    workload: Annotated[
        str | None, typer.Option(help="package.module:function or a built-in name.")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Study name (also the output folder).")] = None,
    storage: Annotated[str | None, typer.Option(help="Optuna storage URL.")] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output folder; studies/<name>/ by default.")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Sampler seed.")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override any spec field: --set probe.steps=10."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every probe.")] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Only warnings and the summary.")
    ] = False,
    log_json: Annotated[
        bool,
        typer.Option(
            "--log-json",
            envvar=JSON_ENV,
            help="Logs as one JSON object per line, on stderr and in search.log.",
        ),
    ] = False,
    simulate: Annotated[
        str | None,
        typer.Option(
            help="Run on a simulated device instead: a shipped landscape (a100-resnet18, "
            "h100-resnet18, t4-resnet18, ...) or a landscape file. The search is the real one; "
            "the device and its clock are simulated, so a long budget takes seconds.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Search precision × batch size × lr × init_scale within a budget; write best.json and
    report.html, with live progress on a terminal and a log in search.log."""
    setup_logging(verbose, quiet, json_lines=log_json)
    overrides: dict[str, Any] = {
        "budget": budget,
        "device": device,
        "workload": workload,
        "name": name,
        "storage": storage,
        "seed": seed,
    }
    try:
        spec, runner, where = _search_spec(spec_file, overrides, set_, simulate=simulate)
    except AutotuneError as exc:
        fail(str(exc))
        return
    out_dir = out if out is not None else Path("studies") / spec.name
    log_file = _open_log(out_dir, json_lines=log_json)
    try:
        logger.info("autotune {}", " ".join(mask_url(a) for a in sys.argv[1:]))
        # JSON logs are for machines, and --quiet asked for no chatter: no live view (nor for a
        # simulation, which is over in seconds).
        result, clock = _run(spec, runner, out_dir, where=where, still=log_json or quiet, out=out)
        _log_outcome(result)
        # The report first, then what the terminal reads: a reader that stops early (autotune
        # search ... | head) ends the printing, not the results.
        if runner is None:
            report = _write_report(spec, out_dir)
        else:
            # Its environment is the simulated device's: that it is not this machine's is known.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = _write_report(spec, out_dir)
        _print_outcome(spec, result, runner, clock)
        if report is not None:
            console.print(f"report written to [bold]{escape(str(report))}[/]", highlight=False)
    finally:
        logger.remove(log_file)


def _search_spec(
    spec_file: Path | None,
    overrides: dict[str, Any],
    sets: list[str] | None,
    *,
    simulate: str | None,
) -> tuple[Any, Any, str]:
    """The spec with the command line's overrides, the simulated runner of ``--simulate``
    (None: the real device), and where it runs, in words."""
    from autotune.schema.spec import load_spec

    path = spec_file or DEFAULT_SPEC
    if spec_file is None and not path.is_file():
        raise SpecError(
            f"no spec given and the default {str(DEFAULT_SPEC)!r} is not here; run from the "
            "project folder or pass a spec file, e.g. autotune search studies/tiny.yaml"
        )
    spec = load_spec(path)
    spec = spec.with_overrides({**overrides, **parse_sets(sets)})
    if simulate is None:
        # As the spec names it: the probe worker resolves it (and says when it does not exist),
        # so this process never imports torch.
        return spec, None, spec.device
    spec, runner = _simulated(spec, simulate, storage_given=overrides["storage"] is not None)
    return spec, runner, f"{runner.landscape.device} (simulated: {runner.landscape.name})"


def _open_log(out_dir: Path, *, json_lines: bool) -> int:
    """The study's own log: every decision of every run (a resumed run appends), at DEBUG."""
    try:
        return log_to_file(out_dir / "search.log", json_lines=json_lines)
    except OSError as exc:
        fail(
            f"cannot write the log file in {str(out_dir)!r}: {exc}; pass --out DIR to a writable folder"
        )


def _run(
    spec: Any, runner: Any, out_dir: Path, *, where: str, still: bool, out: Path | None
) -> tuple[Any, Any]:
    """The search under its progress view (a live one unless ``still``), with each way it
    can stop turned into one message and an exit code.

    Returns:
        The SearchResult and the Budget it ran against.
    """
    from autotune.execution.probe_worker import ProbeWorker

    # The probe worker first: it imports torch while this process imports the search and opens
    # the study (half a second sooner to the first trial).
    try:
        worker = ProbeWorker(spec.device) if runner is None else None
    except AutotuneError as exc:  # its memory limit's setting
        fail(str(exc))
    if worker is not None:
        worker.spawn()
    try:
        return _run_with(spec, runner, worker, out_dir, where=where, still=still, out=out)
    finally:
        if worker is not None:
            worker.close()


def _run_with(  # noqa: PLR0913 - _run's arguments, and the worker it started
    spec: Any,
    runner: Any,
    worker: Any,
    out_dir: Path,
    *,
    where: str,
    still: bool,
    out: Path | None,
) -> tuple[Any, Any]:
    from autotune.infra import clock as clocks
    from autotune.report.progress import SearchProgress
    from autotune.schema.workload_spec import workload_label
    from autotune.search import Budget, SearchInterrupted, run_search

    virtual = runner.clock if runner is not None else None
    with clocks.use(virtual or clocks.current()):
        # A simulated search's budget starts on its own clock, now.
        launched = Launch.for_this_command and not virtual
        clock = Budget(spec.budget, started=autotune.STARTED) if launched else Budget(spec.budget)
    progress = SearchProgress(
        clock,
        console=err_console,
        live=False if (still or virtual) else None,
        title=f"{spec.name} · {workload_label(spec.workload)}",
        device=where,
        parity_tolerance=spec.parity_tolerance,
    )
    try:
        with progress, clocks.use(virtual or clocks.current()):
            result = run_search(
                spec,
                out_dir=out_dir,
                budget=clock,
                on_event=progress,
                handle_sigint=True,
                runner=runner or worker,
            )
    except SearchInterrupted as exc:
        warn(str(exc))
        warn(f"to see the trials so far: autotune report {_report_args(spec, out)}")
        raise typer.Exit(130) from None
    except StorageIOError as exc:
        fail(f"{exc} by running the same command again")
    except AutotuneError as exc:
        fail(str(exc))
    except OSError as exc:  # the results folder: a full disk, a read-only mount
        fail(
            f"cannot write the results in {str(out_dir)!r} ({exc.strerror}); the trials are "
            "kept in the study's storage: make room, then run the same command again"
        )
    return result, clock


def _print_outcome(spec: Any, result: Any, runner: Any, clock: Any) -> None:
    """What the person at the terminal reads at the end: the simulated device, then the
    summary (or who validates, when another worker does)."""
    if runner is not None:
        from autotune.infra import clock as clocks

        land = runner.landscape
        with clocks.use(runner.clock):  # the budget counts on the simulated clock
            simulated = clock.elapsed()
        console.print(
            f"simulated: {land.device} from landscape {land.name!r} ({land.kind}"
            f"{', modelled from published figures, not measured' if land.kind == 'modelled' else ''}"
            f"); {simulated:.0f}s of simulated time",
            highlight=False,
        )
    if result.config is None:
        console.print(
            f"validation of study {spec.name!r} is done by {result.validated_by}; its "
            "config will be in the study's storage",
            highlight=False,
        )
    else:
        _print_summary(result)


# Simulated studies live apart from real ones: a what-if never mixes into a real study.
SIMULATED_STORAGE = "sqlite:///studies/simulated.db"


def _simulated(spec: Any, landscape: str, *, storage_given: bool) -> tuple[Any, Any]:
    """The spec and the simulated runner of ``--simulate``: the study named after the landscape,
    in its own storage, started afresh (a simulation is a new what-if each time).

    Raises:
        SpecError: no such landscape, or the spec's workload is not the landscape's.
    """
    from autotune.sim import SimulatedRunner, load_landscape
    from autotune.study.storage import delete_study, open_storage, study_names
    from autotune.workloads import normalize_reference

    land = load_landscape(landscape)
    if normalize_reference(spec.workload) != land.workload:
        raise SpecError(
            f"--simulate {landscape}: the landscape is of workload {land.workload!r}, the spec's "
            f"is {spec.workload!r}; pass --workload {land.workload} or another landscape"
        )
    spec = spec.with_overrides(
        {
            "name": f"{spec.name}.sim-{land.name}",
            "storage": spec.storage if storage_given else SIMULATED_STORAGE,
            "device": "cpu" if land.device_type == "cpu" else "cuda",
        }
    )
    opened = open_storage(spec.storage)
    if spec.name in study_names(opened):
        delete_study(opened, spec.name)
    return spec, SimulatedRunner(land, seed=spec.seed)


def _report_args(spec: Any, out: Path | None) -> str:
    """The arguments of the `autotune report` command that reads this search's study."""
    from autotune.report import DEFAULT_STORAGE

    args = [spec.name]
    if spec.storage != DEFAULT_STORAGE:
        args += ["--storage", mask_url(spec.storage)]
    if out is not None:
        args += ["--out", str(out)]
    return " ".join(shlex.quote(a) for a in args)


def _log_outcome(result: Any) -> None:
    """The search's final decisions, into the log file too (the summary table is stdout only)."""
    from autotune.report import ratio_text

    for r in result.rejected:
        if r.stage == "validation":
            logger.bind(event="rejected", label=r.label, kind=r.kind).info(
                "rejected in validation: {}", r
            )
    cfg = result.config
    if cfg is None:
        return
    ev = cfg.evidence
    logger.bind(
        event="config",
        precision=cfg.precision,
        batch_size=cfg.batch_size,
        learning_rate=cfg.learning_rate,
        throughput=ev.throughput,
        speedup=ev.speedup,
        speedup_low=ev.speedup_low,
        speedup_high=ev.speedup_high,
        paired_blocks=ev.paired_blocks,
        search_speedup=ev.search_speedup,
        search_optimism=ev.search_optimism,
        noise=ev.noise,
        validated=ev.validated,
    ).info(
        "config: {} bs={} lr={:.3g} at {:.1f} samples/s, {} the fp32 reference{} ({})",
        cfg.precision,
        cfg.batch_size,
        cfg.learning_rate,
        ev.throughput,
        ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high),
        f" over {ev.paired_blocks} paired blocks" if ev.paired_blocks else "",
        "validated" if ev.validated else "not validated: fp32 fallback",
    )


def _write_report(spec: Any, out_dir: Path) -> Path | None:
    """Write report.html beside best.json; its path. The search's result is already saved: a
    report that cannot be written is a warning (and None), not a failed search."""
    from autotune.report import write_report

    try:
        path = write_report(spec.name, storage=spec.storage, out_dir=out_dir)
    except (OSError, AutotuneError) as exc:
        warn(f"report not written: {exc}; try again with autotune report {spec.name}")
        return None
    logger.debug("wrote {}", path)
    return path


def _print_summary(result: Any) -> None:
    """The end-of-search summary table and notes (see :mod:`autotune.report._summary`)."""
    from autotune.report import print_summary

    print_summary(result, console)


@app.command()
def probe(  # noqa: PLR0913 - a typer command: its parameters are its command-line options
    workload: Annotated[
        str, typer.Option(help="package.module:function or a built-in name.")
    ] = "resnet18",
    precision: Annotated[str, typer.Option(help="fp32, tf32, fp16 or bf16.")] = "fp32",
    batch_size: Annotated[
        int | None, typer.Option(help="Batch size; the workload's base size by default.")
    ] = None,
    lr: Annotated[
        float | None, typer.Option(help="Learning rate; the workload's base lr by default.")
    ] = None,
    init_scale: Annotated[float, typer.Option(help="GradScaler init_scale (fp16).")] = 2.0**16,
    warmup: Annotated[int, typer.Option(help="Untimed warmup steps.")] = 3,
    steps: Annotated[int, typer.Option(help="Timed steps.")] = 20,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda:N.")] = "auto",
    time_limit: Annotated[
        str, typer.Option(help="Soft time limit: the probe stops and is scored.")
    ] = "120s",
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the ProbeResult as JSON.")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run one probe of a workload under one setting and print what it measured."""
    setup_logging(verbose, quiet=not verbose)
    from pydantic import ValidationError

    from autotune.errors import format_validation_error
    from autotune.measure.probe import run_probe
    from autotune.schema.spec import Candidate, ProbeSettings
    from autotune.workloads import load_workload

    try:
        wl = load_workload(workload)
        errors: list[str] = []
        cand = settings = None
        try:
            cand = Candidate(
                precision=precision,
                batch_size=wl.base_batch_size if batch_size is None else batch_size,
                learning_rate=wl.base_lr if lr is None else lr,
                init_scale=init_scale,
            )
        except ValidationError as exc:
            errors.append(format_validation_error(exc, "probe arguments"))
        try:
            settings = ProbeSettings(warmup_steps=warmup, steps=steps, time_limit=time_limit)
        except ValidationError as exc:
            errors.append(format_validation_error(exc, "probe arguments"))
        if cand is None or settings is None:
            lines = [errors[0].splitlines()[0]] + [ln for e in errors for ln in e.splitlines()[1:]]
            raise SpecError("\n".join(lines))
        result = run_probe(wl, cand, device, settings)
    except AutotuneError as exc:
        fail(str(exc))
        return
    if json_out:
        console.print_json(result.model_dump_json())
        return
    _print_probe(result)


def _print_probe(result: Any) -> None:
    """What one probe measured, for a person; exit 1 unless it completed."""
    console.print(result.summary(), highlight=False)
    if result.ok:
        mem = result.peak_memory
        console.print(
            f"  {result.timed_steps} timed steps in {result.timed_seconds:.2f}s "
            f"({result.wall_seconds:.2f}s wall); peak memory "
            f"{'—' if mem is None else f'{mem / 2**20:.1f} MiB'}; "
            f"loss {result.losses[0]:.4g} → {result.losses[-1]:.4g}; skipped steps {result.skipped_steps}",
            highlight=False,
        )
    if result.outcome != Outcome.COMPLETED:
        raise typer.Exit(1)
