"""``autotune train``: train a config's workload and print the table people compare AMP in."""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autotune.cli._app import app, console, err_console, fail, setup_logging
from autotune.errors import AutotuneError, AutotuneWarning

__all__ = ["autotune_warnings_as_lines", "load_config_for_cli"]

# How a failed allocation reads when it is not torch.OutOfMemoryError (the CPU allocator).
_ALLOCATION_FAILED = ("can't allocate memory", "DefaultCPUAllocator", "out of memory")


@contextlib.contextmanager
def autotune_warnings_as_lines() -> Iterator[None]:
    """Show autotune's own warnings as one ``warning:`` line on stderr, not a source location."""
    original = warnings.showwarning

    def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, AutotuneWarning):
            err_console.print(f"[yellow]warning:[/] {message}", highlight=False)
        else:
            original(message, category, *args, **kwargs)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


def load_config_for_cli(path: Path, device: str = "auto") -> Any:
    """``load_config`` for a command: raises ConfigError/DeviceError, warns as a line."""
    from autotune.schema.config import load_config

    with autotune_warnings_as_lines():
        return load_config(path, device=device)


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:,.1f} MiB"


def _num(value: float | None, fmt: str = ".4f") -> str:
    return "—" if value is None else format(value, fmt)


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3f} s" if value < 10 else f"{value:,.1f} s"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _compile_line(name: str, r: Any, cmp: Any) -> str:
    """What compiling cost a run (outside its timed blocks), and after how many samples the
    compiled run is ahead of the baseline, compile time included."""
    line = (
        f"compile: {name} compiled (torch.compile mode={r.compile_mode}) in "
        f"{_seconds(r.compile_seconds)} in its untimed warm-up: a fresh process pays it once"
    )
    base = cmp.baseline
    if r is cmp.tuned and base is not None and base.ok and r.throughput and cmp.speedup:
        # Seconds saved per sample against the baseline, at the paired speedup.
        saved = 1 / base.throughput - 1 / (base.throughput * cmp.speedup)
        if saved > 0:
            line += f"; ahead of {cmp.against}, compile time included, after {r.compile_seconds / saved:,.0f} samples"
        else:
            line += f"; never ahead of {cmp.against}: it is not faster"
    return line


def _print_table(cmp: Any, per_epoch: bool) -> None:
    """Each run's settings, the table of both runs and their ratio, then what the figures mean
    and the verdict."""
    runs = [r for r in (cmp.tuned, cmp.baseline) if r is not None]
    first = cmp.tuned
    names = {id(cmp.tuned): "tuned"}
    if cmp.baseline is not None:
        names[id(cmp.baseline)] = str(cmp.against)
    for r in runs:
        extra = " channels_last" if r.channels_last else ""
        state = "" if r.ok else f" [red]{r.outcome}[/]"
        console.print(f"[bold]{names[id(r)]}[/]: {r.settings()}{extra}{state}", highlight=False)
    console.print(_table(cmp, runs, names, per_epoch))
    kinds = {r.memory_source for r in runs}
    memory = (
        "CUDA max_memory_allocated"
        if kinds == {"cuda_allocated"}
        else "growth of the process's peak resident memory (CPU)"
    )
    console.print(
        f"time: steady state, after {first.warmup_steps} warmup step(s) (wall: "
        + ", ".join(f"{names[id(r)]} {r.wall_seconds:.2f}s" for r in runs)
        + f"); peak mem: {memory}; final loss: mean over the last tenth of the steps; "
        "ratio: tuned ÷ baseline.",
        highlight=False,
    )
    for r in runs:
        if r.compile_seconds is not None:
            console.print(_compile_line(names[id(r)], r, cmp), highlight=False)
    for r in runs:
        if not r.ok:
            console.print(f"[red]{names[id(r)]}: {r.outcome}:[/] {r.reason}", highlight=False)
    if cmp.baseline is not None and cmp.speedup:
        _print_verdict(cmp)


def _table(cmp: Any, runs: list[Any], names: dict[int, str], per_epoch: bool) -> Table:
    """One row per run, and the ratio row when there is a baseline."""
    first = cmp.tuned
    length = (
        f"{first.epochs:g} epoch(s) of {first.samples_per_epoch:,} samples"
        if per_epoch
        else f"{first.samples:,} samples"
    )
    table = Table(
        title=f"{first.workload} on {first.device}, {length} per run",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    columns = ["run", "steps", "time/epoch" if per_epoch else "time", "samples/s", "peak mem"]
    columns.append("final loss")
    show_acc = any(r.accuracy is not None for r in runs)
    if show_acc:
        columns.append("accuracy")
    for col in columns:
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    for r in runs:
        row = [
            names[id(r)],
            f"{r.steps:,}",
            _seconds(r.seconds_per_epoch if per_epoch else r.run_seconds),
            _num(r.throughput, ",.1f"),
            _mib(r.peak_memory_bytes),
            _num(r.final_loss),
        ]
        if show_acc:
            row.append("—" if r.accuracy is None else f"{r.accuracy:.1%}")
        table.add_row(*row)
    if cmp.baseline is not None:
        # The ratio of the figures in the rows above it (the paired estimate is the verdict's).
        b = cmp.baseline
        seconds = (first.seconds_per_epoch, b.seconds_per_epoch) if per_epoch else None
        time_ratio = _over(*(seconds or (first.run_seconds, b.run_seconds)))
        rate = _over(first.throughput, b.throughput)
        row = ["ratio", "", _x(time_ratio), _x(rate), _x(cmp.memory_ratio)]
        row.append(_x(cmp.loss_ratio))
        if show_acc:
            delta = cmp.accuracy_delta
            row.append("—" if delta is None else f"{delta * 100:+.1f} pts")
        table.add_row(*row, style="bold", end_section=False)
    return table


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# Where the final loss and the accuracy say different things: the loss kept within this share
# of the baseline's (the default parity tolerance) while the accuracy fell by more than this
# much, or the loss past it while the accuracy held.
_LOSS_KEPT = 1.05
_ACCURACY_KEPT = -0.02


def _print_verdict(cmp: Any) -> None:
    """Tuned against the baseline in one sentence, every metric measured in it (speed, memory,
    final loss, accuracy), with the speedup's interval when paired; then where the paired
    estimate and the runs' own figures differ, and where the loss and the accuracy disagree."""
    faster = "faster" if cmp.speedup >= 1 else "slower"
    factor = cmp.speedup if cmp.speedup >= 1 else 1 / cmp.speedup
    interval = ""
    if cmp.speedup_low is not None and cmp.speedup_high is not None:
        # The interval of the speedup itself (tuned ÷ baseline), from the paired blocks.
        interval = (
            f" (speedup {cmp.speedup:.2f}x, 95% interval {cmp.speedup_low:.2f}–"
            f"{cmp.speedup_high:.2f}, {cmp.pairs} paired blocks)"
        )
    tuned, base, delta = cmp.tuned, cmp.baseline, cmp.accuracy_delta
    accuracy = ""
    if delta is not None:
        accuracy = (
            f", accuracy {tuned.accuracy:.1%} against {base.accuracy:.1%} ({delta * 100:+.1f} pts)"
        )
    speed = f"{factor:.2f}x {faster}"
    if interval and cmp.speedup_low <= 1.0 <= cmp.speedup_high:
        # Two identical configs read "1.05x slower (0.90-1.08)": the pairs cannot tell.
        speed = "no difference in speed the pairs can tell"
    console.print(
        f"[bold]tuned vs {cmp.against}:[/] {speed} on the same samples"
        f"{interval}, {_x(cmp.memory_ratio)} the peak memory, final loss "
        f"{_x(cmp.loss_ratio)}{accuracy}",
        highlight=False,
    )
    if cmp.pairs:
        console.print(
            "paired: the two runs advanced a block each in turn, so the machine's load hit "
            "both; the speedup is the median of the per-pair ratios.",
            highlight=False,
        )
        own = _over(tuned.throughput, base.throughput)
        low, high = cmp.speedup_low, cmp.speedup_high
        if own is not None and low is not None and high is not None and not low <= own <= high:
            console.print(
                f"the runs' own rates give {own:.2f}x, outside the paired interval: the "
                "machine's speed moved between blocks, and the paired figure compares blocks "
                "run side by side.",
                highlight=False,
            )
    loss = cmp.loss_ratio
    if delta is not None and loss is not None:
        loss_kept, accuracy_kept = loss <= _LOSS_KEPT, delta >= _ACCURACY_KEPT
        if loss_kept != accuracy_kept:
            console.print(
                f"[yellow]the metrics disagree:[/] final loss {loss:.2f}x the baseline's "
                f"({'kept' if loss_kept else 'not kept'} within {_LOSS_KEPT - 1:.0%}) but accuracy "
                f"{delta * 100:+.1f} pts ({'held' if accuracy_kept else 'lower'}); judge by "
                "the one your training is for, or train longer.",
                highlight=False,
            )


class _Progress:
    """A rich progress bar on a terminal; a few plain lines otherwise (logs, CI, pipes).

    Always on stderr: stdout holds only the results (the table, or the JSON of ``--json``).
    """

    def __init__(self) -> None:
        self.live = err_console.is_terminal
        self.bar: Progress | None = None
        self.tasks: dict[str, Any] = {}
        self.loss: dict[str, float] = {}
        self.next_line: dict[str, int] = {}

    def __enter__(self) -> _Progress:
        if self.live:
            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TimeElapsedColumn(),
                console=err_console,
                transient=True,
            )
            self.bar.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.bar is not None:
            self.bar.__exit__(exc_type, exc, tb)

    def __call__(self, label: str, done: int, total: int, loss: float | None) -> None:
        if loss is not None:
            self.loss[label] = loss
        shown = f"{self.loss[label]:.4f}" if label in self.loss else "…"
        if self.bar is not None:
            if label not in self.tasks:
                self.tasks[label] = self.bar.add_task(label, total=total, loss=shown)
            self.bar.update(self.tasks[label], completed=done, loss=shown)
            return
        # Plain output: one line per quarter of the run, and the last step.
        mark = self.next_line.setdefault(label, 0)
        if done >= mark or done == total:
            loss_text = f", loss {self.loss[label]:.4f}" if label in self.loss else ""
            err_console.print(f"{label}: step {done}/{total}{loss_text}", highlight=False)
            self.next_line[label] = done + max(1, total // 4)


@app.command()
def train(  # noqa: PLR0913 - a typer command: its parameters are its command-line options
    config: Annotated[
        Path,
        typer.Option("--config", "-c", help="The best.json a search wrote.", show_default=False),
    ],
    steps: Annotated[
        int | None,
        typer.Option(help="Steps of the tuned config (the baseline sees as many samples)."),
    ] = None,
    epochs: Annotated[
        int | None, typer.Option(help="Epochs of --samples-per-epoch samples; 1 by default.")
    ] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda:N.")] = "auto",
    compare: Annotated[
        str | None,
        typer.Option(
            help="Also train a baseline on the same samples: fp32 or amp (fp16, default GradScaler)."
        ),
    ] = None,
    samples_per_epoch: Annotated[
        int, typer.Option(help="Samples in one epoch of the workload's data.")
    ] = 8192,
    warmup_steps: Annotated[int, typer.Option(help="Untimed first steps of each run.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed for the model and the data order.")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Train the config's workload under the tuned settings; compare with a baseline."""
    setup_logging(verbose, quiet=not verbose)
    from autotune.train import compare as run_compare
    from autotune.train import parse_train_settings
    from autotune.workloads import check_factory, load_workload

    try:
        settings = parse_train_settings(
            steps=steps,
            epochs=epochs,
            samples_per_epoch=samples_per_epoch,
            warmup_steps=warmup_steps,
            seed=seed,
        )
        cfg = load_config_for_cli(config, device)
        if not cfg.evidence.validated:
            err_console.print(
                f"note: {config} is the fp32 fallback, not a validated speedup: "
                f"{cfg.evidence.validation_note}",
                highlight=False,
                markup=False,
            )
        # A config file names code to import and call: check it names a workload factory
        # (never os:abort) before calling anything.
        workload = load_workload(check_factory(cfg.workload))
        with autotune_warnings_as_lines(), _Progress() as progress:
            result = run_compare(
                workload, cfg, device, settings, against=compare, on_progress=progress
            )
    except AutotuneError as exc:
        fail(str(exc))
        return
    except RuntimeError as exc:
        # A CPU allocator that cannot hold the batch raises a RuntimeError, not torch's
        # OutOfMemoryError: the same fact, said in one line.
        if not any(sign in str(exc) for sign in _ALLOCATION_FAILED):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(exc))
        detail = (
            f"{int(asked[1]) / 2**30:,.1f} GiB asked for"
            if asked
            else str(exc).strip().splitlines()[0][:160]
        )
        fail(
            f"out of memory: batch_size={cfg.batch_size} of {cfg.workload} does not fit on "
            f"device {device} ({detail}); train a config whose batch fits, e.g. one "
            "`autotune search` measured on this device",
            code=1,
        )
        return
    if json_out:
        # Plain print: exactly the JSON, never wrapped or styled for a terminal.
        typer.echo(result.model_dump_json(indent=2))
    else:
        _print_table(result, per_epoch=steps is None)
    if not all(r.ok for r in (result.tuned, result.baseline) if r is not None):
        raise typer.Exit(1)
