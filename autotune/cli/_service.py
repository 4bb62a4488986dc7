"""``autotune serve`` and its client commands: ``submit``, ``status``, ``result``, ``cancel``."""

from __future__ import annotations

import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from autotune.cli._app import app, console, fail, setup_logging
from autotune.errors import AutotuneError, SpecError
from autotune.schema.enums import StudyState

if TYPE_CHECKING:
    from autotune.service import ServiceClient, TuningService

DEFAULT_SERVER = "http://127.0.0.1:8765"

Server = Annotated[
    str,
    typer.Option(envvar="AUTOTUNE_SERVER", help="The service's URL."),
]
Token = Annotated[
    str | None,
    typer.Option(
        envvar="AUTOTUNE_TOKEN",
        help="Bearer token, if the service needs one. Given as a flag it shows in the process "
        "list (ps) and the shell history: prefer the AUTOTUNE_TOKEN variable, or "
        '--token "$(cat token.txt)" from a file only you can read.',
        show_default=False,
    ),
]


def _client(server: str, token: str | None) -> ServiceClient:
    from autotune.service import ServiceClient

    return ServiceClient(server, token)


def _bind(host: str, port: int) -> socket.socket:
    """Listen on host:port now, so a taken port is one clear error before anything starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio turns Nagle off only on sockets that say they are TCP; with
    # Nagle on, every keep-alive response waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SpecError(
            f"cannot listen on {host}:{port}: {exc.strerror}; is another service running there? "
            "Pick another --port"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


@app.command()
def serve(  # noqa: PLR0913 - a typer command: its parameters are its command-line options
    host: Annotated[
        str, typer.Option(help="Address to listen on; anything but loopback needs a token.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8765,
    devices: Annotated[
        str | None,
        typer.Option(help="cpu, or GPU indices like 0,1; every visible GPU by default."),
    ] = None,
    storage: Annotated[
        str, typer.Option(help="Study storage URL; the queue lives in the same database.")
    ] = "sqlite:///studies/autotune.db",
    token_file: Annotated[
        Path | None,
        typer.Option(help="File holding the token for submit/cancel (else AUTOTUNE_TOKEN)."),
    ] = None,
    workload_dir: Annotated[
        list[Path] | None,
        typer.Option(help="A folder whose packages may be workloads; repeat for more."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Each study writes <out>/<name>/best.json.")] = Path(
        "studies"
    ),
    max_budget: Annotated[
        str, typer.Option(help="The longest budget a submitted study may ask for.")
    ] = "24h",
    private: Annotated[
        bool,
        typer.Option(
            "--private",
            help="Reading (the page, status, results) needs the token too; by default anyone "
            "who reaches the service may read.",
        ),
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every request.")] = False,
) -> None:
    """Run the tuning service: queue studies, run their probes where there is room, serve status
    and results over HTTP (API docs at /docs). SIGTERM or Ctrl-C drains it."""
    setup_logging(verbose)
    from autotune.execution.limits import check_memory_limit
    from autotune.schema.spec import parse_duration
    from autotune.service import TuningService, check_bind, load_token, parse_devices
    from autotune.study.storage import mask_url

    # An IPv6 address may come bracketed, as in a URL: [::1].
    host = host.strip().removeprefix("[").removesuffix("]")
    try:
        longest = parse_duration(max_budget, "--max-budget")
        token = load_token(token_file)
        check_bind(host, token)
        if private and token is None:
            raise SpecError(
                "--private needs a token (it guards reading too): give --token-file or set "
                "AUTOTUNE_TOKEN"
            )
        names = parse_devices(devices)
        check_memory_limit(names)  # a worker that cannot start fails every study
        dirs = _workload_dirs(workload_dir or [])
        service = TuningService(
            storage, names, out_dir=out, workload_dirs=dirs, token=token, max_budget=longest
        )
        sock = _bind(host, port)
        recovered = service.recover()
    except AutotuneError as exc:
        fail(str(exc))
        return
    shown = f"[{host}]" if ":" in host else host
    console.print(
        f"autotune service on http://{shown}:{port} (API docs: /docs) · devices "
        f"{', '.join(names)} · storage {mask_url(storage)} · "
        + (
            "token required to read and to change"
            if private
            else ("token required for changes" if token else "no token (loopback only)")
        ),
        highlight=False,
    )
    if recovered:
        console.print(
            f"resuming after an unclean stop: {', '.join(recovered)} back in the queue",
            highlight=False,
        )
    _run_server(service, sock, host, private=private, verbose=verbose)


def _workload_dirs(given: list[Path]) -> list[Path]:
    """The --workload-dir folders, resolved, put on this process's and its workers' import
    path: the service and its workers import workloads from these folders (and nothing else
    outside the built-ins: the policy checks every submitted reference first)."""
    import sys

    dirs = []
    for d in given:
        if not d.is_dir():
            raise SpecError(f"--workload-dir {str(d)!r} is not a folder; pass an existing one")
        dirs.append(d.resolve())
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for d in reversed(dirs):
        sys.path.insert(0, str(d))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*map(str, dirs), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return dirs


def _run_server(
    service: TuningService, sock: socket.socket, host: str, *, private: bool, verbose: bool
) -> None:
    """Serve the app on the bound socket until SIGTERM or Ctrl-C drains it."""
    import uvicorn

    from autotune.service import (
        KEEP_ALIVE,
        MAX_HEAD,
        DrainFirstServer,
        SlowClientGuard,
        create_app,
        is_loopback,
    )

    config = uvicorn.Config(
        create_app(service, loopback_only=is_loopback(host), private=private),
        log_config=None,
        access_log=verbose,
        lifespan="on",
        timeout_graceful_shutdown=5,
        # A client that sends its request slowly, or too large a head, cannot hold a connection.
        http=SlowClientGuard,
        timeout_keep_alive=KEEP_ALIVE,
        h11_max_incomplete_event_size=MAX_HEAD,
    )
    DrainFirstServer(config, service).run(sockets=[sock])


@app.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(help="Study spec, YAML or JSON.")],
    priority: Annotated[int, typer.Option(help="Higher runs first.")] = 0,
    server: Server = DEFAULT_SERVER,
    token: Token = None,
) -> None:
    """Queue a study spec on the service."""
    from autotune.infra.inputs import read_text

    try:
        text = read_text(spec_file, f"study spec {str(spec_file)!r}")
        with _client(server, token) as client:
            reply = client.submit(text, json_body=spec_file.suffix == ".json", priority=priority)
    except AutotuneError as exc:
        fail(str(exc))
        return
    console.print(
        f"study [bold]{escape(reply.name)}[/] {reply.message} (priority {reply.priority}); "
        f"follow it with: autotune status {escape(reply.name)}",
        highlight=False,
    )


def _age(when: datetime | None) -> str:
    if when is None:
        return "—"
    seconds = (datetime.now(timezone.utc) - when).total_seconds()
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**30:.1f} GiB"


def _tp(value: float | None) -> str:
    return "—" if not value else f"{value:,.1f}"


_STATE_STYLE = {
    StudyState.QUEUED: "cyan",
    StudyState.RUNNING: "bold yellow",
    StudyState.DONE: "green",
    StudyState.FAILED: "red",
    StudyState.CANCELLED: "dim",
    StudyState.PAUSED: "bold red",
}


def _trials(counts: dict[str, int]) -> str:
    order = ("complete", "pruned", "fail", "not_run", "reused", "running", "waiting")
    return " ".join(f"{counts[k]} {k}" for k in order if counts.get(k)) or "—"


def _print_studies(studies: list[Any], devices: list[Any]) -> None:
    table = Table(title="studies")
    for col in ("study", "state", "prio", "device", "trials", "budget", "best samples/s", "detail"):
        table.add_column(col, overflow="fold")
    for s in studies:
        p = s.progress
        table.add_row(
            escape(s.name) + (f"\n[dim]by {escape(s.owner)}[/]" if s.owner else ""),
            f"[{_STATE_STYLE[s.state]}]{s.state}[/]",
            str(s.priority),
            s.device or "—",
            _trials(p.trials),
            f"{p.budget_used_seconds:.0f}/{p.budget_seconds:.0f}s",
            _tp(p.best_throughput),
            escape(s.detail),
        )
    if not studies:
        table.add_row("—", "", "", "", "", "", "", "no studies yet: autotune submit studies/x.yaml")
    console.print(table)
    dev = Table(title="devices")
    for col in ("device", "free / total", "running", "worker pid", "others", "busy"):
        dev.add_column(col, overflow="fold")
    for d in devices:
        others = _gib(d.others_bytes)
        if d.other_processes:
            others += f" ({len(d.other_processes)} processes)"
        dev.add_row(
            f"{d.name} ({escape(d.description)})",
            f"{_gib(d.free_bytes)} / {_gib(d.total_bytes)}",
            d.study or "—",
            str(d.worker_pid or "—"),
            others,
            escape(d.busy_reason) or "no",
        )
    console.print(dev)


def _print_config(cfg: Any, s: Any) -> None:
    """A finished study's config, read from best.json's record as every surface reads it: its
    figure with its interval and verdict, then why it fell back, the noise and others' load."""
    from autotune.report import config_notes, ratio_text

    ev = cfg.evidence
    verdict = "validated" if ev.validated else "not validated: fp32 fallback"
    if ev.validated and ev.paired_blocks:
        verdict += f" over {ev.paired_blocks} paired blocks"
    trial = (
        f", trial {s.best.number}" if s.best is not None and s.best.role == "tuned_config" else ""
    )
    console.print(
        f"  config: {cfg.precision} bs={cfg.batch_size} lr={cfg.learning_rate:.3g} → "
        f"{_tp(ev.throughput)} samples/s, "
        f"{ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high)} the fp32 reference "
        f"({verdict}{trial})",
        highlight=False,
    )
    for note in config_notes(cfg):
        console.print(f"  {escape(note)}", highlight=False)


def _print_study(s: Any, config: Any = None) -> None:
    """One study: its state, budget and trials; its config (``config``, best.json's record)
    once it is done, else the best trial so far; the latest trials."""
    from autotune.report import ratio_text
    from autotune.schema.workload_spec import workload_label
    from autotune.study.trials import label

    p = s.progress
    console.print(
        f"[bold]{escape(s.name)}[/] · {escape(workload_label(s.workload))} · "
        f"[{_STATE_STYLE[s.state]}]{s.state}[/] · priority {s.priority} · "
        f"submitted {_age(s.submitted_at)}",
        highlight=False,
    )
    if config is None:  # a done study's config says it below, with its notes
        console.print(f"  {escape(s.detail)}", highlight=False)
    console.print(
        f"  budget {p.budget_used_seconds:.1f}s of {p.budget_seconds:.0f}s (probe time; queue "
        f"time not counted) · trials: {_trials(p.trials)}",
        highlight=False,
    )
    if s.by_outcome:
        console.print(
            "  by outcome: " + ", ".join(f"{n} {k}" for k, n in sorted(s.by_outcome.items())),
            highlight=False,
        )
    if config is not None:
        _print_config(config, s)
    elif s.best is not None:
        best = s.best
        # The config's trial carries validation's figure; before it, the search's best.
        head = "config" if best.role == "tuned_config" else "best so far"
        settings = label(best.params) if best.params else "the fp32 reference"
        line = f"  {head}: trial {best.number} {settings} → {_tp(best.throughput)} samples/s"
        if best.speedup is not None:
            line += f", {ratio_text(best.speedup, best.speedup_low, best.speedup_high)} the fp32 reference"
        console.print(
            f"{line} (fp32 reference now {_tp(p.reference_throughput)} samples/s)",
            highlight=False,
        )
    if not s.trials:
        return
    table = Table(title=f"latest trials of {s.name}")
    for col in ("#", "state", "settings", "samples/s", "vs fp32", "outcome", "reason"):
        table.add_column(col, overflow="fold")
    for t in s.trials[:20]:
        settings = label(t.params) if t.params else "—"
        retry = f" (retry of {t.retry_of})" if t.retry_of is not None else ""
        table.add_row(
            str(t.number),
            t.state,
            settings + retry,
            _tp(t.throughput),
            ratio_text(t.speedup, t.speedup_low, t.speedup_high),
            t.outcome or "—",
            escape(t.reason or ""),
        )
    console.print(table)


def _study_and_config(client: Any, name: str) -> tuple[Any, Any]:
    """A study's detail and, once it is done, its config (None while it has none)."""
    detail = client.study(name)
    if detail.state != StudyState.DONE:
        return detail, None
    try:
        return detail, client.config(name)
    except AutotuneError:  # done, but its storage holds no config: the detail says the rest
        return detail, None


@app.command()
def status(
    study: Annotated[
        str | None, typer.Argument(help="One study's detail; every study when omitted.")
    ] = None,
    server: Server = DEFAULT_SERVER,
    token: Token = None,
) -> None:
    """Show the service's studies and devices, or one study's trials."""
    try:
        with _client(server, token) as client:
            if study is None:
                _print_studies(client.studies(), client.devices())
            else:
                _print_study(*_study_and_config(client, study))
    except AutotuneError as exc:
        fail(str(exc))


@app.command()
def result(
    study: Annotated[str, typer.Argument(help="The study's name.")],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write the config here; printed when omitted."),
    ] = None,
    server: Server = DEFAULT_SERVER,
    token: Token = None,
) -> None:
    """Fetch a finished study's TunedConfig (best.json)."""
    try:
        with _client(server, token) as client:
            config = client.config(study)
    except AutotuneError as exc:
        fail(str(exc))
        return
    if output is None:
        console.print_json(config.model_dump_json())
        return
    try:
        path = config.save(output)
    except OSError as exc:
        fail(f"cannot write {str(output)!r}: {exc.strerror}; pass -o to a writable path")
        return
    from autotune.report import config_notes, ratio_text

    ev = config.evidence
    console.print(
        f"wrote {escape(str(path))}: {config.precision} bs={config.batch_size} "
        f"lr={config.learning_rate:.3g}, {ratio_text(ev.speedup, ev.speedup_low, ev.speedup_high)} "
        f"the fp32 reference ({'validated' if ev.validated else 'not validated: fp32 fallback'})",
        highlight=False,
    )
    for note in config_notes(config):
        console.print(f"  {escape(note)}", highlight=False)


@app.command()
def cancel(
    study: Annotated[str, typer.Argument(help="The study's name.")],
    server: Server = DEFAULT_SERVER,
    token: Token = None,
) -> None:
    """Cancel a queued or running study (its trials stay in the storage)."""
    try:
        with _client(server, token) as client:
            reply = client.cancel(study)
    except AutotuneError as exc:
        fail(str(exc))
        return
    console.print(f"study {escape(reply.name)}: {reply.state}: {reply.message}", highlight=False)
