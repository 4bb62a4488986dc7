"""The service's page at ``/``: the devices, the queue, running and finished studies, live, every
string from outside escaped."""

from __future__ import annotations

import contextlib
import html
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import quote

from pydantic import ValidationError

from autotune.errors import StorageError
from autotune.infra import clock
from autotune.report import collect, config_notes, load_study, render_html
from autotune.schema.config import TunedConfig
from autotune.schema.enums import StudyState
from autotune.schema.spec import format_duration
from autotune.schema.workload_spec import workload_label
from autotune.service._models import DeviceInfo, Health, StudyDetail, StudyStatus
from autotune.service._page_assets import PRIVATE_NOTE, SCRIPT, STYLE
from autotune.service._tuning_service import RequestError, TuningService
from autotune.study.trials import label

__all__ = [
    "Overview",
    "best_json",
    "new_nonce",
    "overview",
    "page_headers",
    "render_live",
    "render_page",
    "report_headers",
    "report_html",
]

# Finished studies the page lists, newest first; the API lists them all.
MAX_FINISHED = 50
_GIB = 2**30


@dataclass
class Overview:
    """Everything the page shows, read from the service in one go."""

    health: Health
    devices: list[DeviceInfo]
    running: list[StudyDetail]
    queued: list[StudyStatus]
    finished: list[StudyStatus]
    # study → the device its spec asks for (``auto``, ``cuda``, ``cuda:1``...)
    requested: dict[str, str] = field(default_factory=dict)
    configs: dict[str, TunedConfig] = field(default_factory=dict)
    older: int = 0
    # The service's wall clock (seconds since the epoch): ages are counted from it.
    now: float = 0.0


def overview(service: TuningService) -> Overview:
    """Read what the page shows: every device and every study, the running ones in detail.

    A few reads however long the queue: the queue once more beside ``studies()``, and the
    finished studies' configs from the standings that call has just cached.
    """
    rows = {r.name: r for r in service.queue.rows()}
    running: list[StudyDetail] = []
    queued: list[StudyStatus] = []
    finished: list[StudyStatus] = []
    for status in service.studies():
        if status.state.finished:
            finished.append(status)
        elif status.state == StudyState.QUEUED:
            queued.append(status)
        else:  # at most one a device
            with contextlib.suppress(RequestError):  # gone between the two reads
                running.append(service.study(status.name))
    finished.sort(key=lambda s: s.finished_at or s.submitted_at, reverse=True)
    shown, older = finished[:MAX_FINISHED], max(0, len(finished) - MAX_FINISHED)
    configs = {}
    for status in shown:
        row = rows.get(status.name)
        if status.state != StudyState.DONE or row is None:
            continue
        standing = service.standings.get(row.name, (row.state, row.finished_at), final=True)
        # Without a readable config, the study is shown with its detail instead.
        if standing is not None and standing.tuned_config is not None:
            with contextlib.suppress(ValidationError):
                configs[status.name] = TunedConfig.model_validate(standing.tuned_config)
    return Overview(
        health=service.health(),
        devices=service.devices(),
        running=running,
        queued=queued,
        finished=shown,
        requested={name: row.requested_device for name, row in rows.items()},
        configs=configs,
        older=older,
        now=clock.wall(),
    )


# ---- small formatting ----------------------------------------------------------------------


def _e(value: object) -> str:
    """Escaped for HTML text and attribute values alike."""
    return html.escape(str(value), quote=True)


def _link(name: str, tail: str = "") -> str:
    """A relative URL of a study's resource (relative: the page works behind a path prefix)."""
    return _e(f"studies/{quote(name, safe='')}{tail}")


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / _GIB:.1f} GiB"


def _age(since: datetime | None, now: float) -> str:
    if since is None:
        return "—"
    return format_duration(max(0.0, round(now - since.timestamp())))


def _when(since: datetime | None, now: float, suffix: str = "") -> str:
    """How long ago, with the moment itself (UTC) on hover."""
    if since is None:
        return "—"
    title = _e(since.isoformat(timespec="seconds"))
    return f'<span class="when" title="{title}">{_age(since, now)}{suffix}</span>'


def _speedup(value: float | None, low: float | None, high: float | None) -> str:
    if value is None:
        return "—"
    text = f"<b>{value:.2f}x</b>"
    if low is not None and high is not None:
        text += f" ({low:.2f}–{high:.2f})"
    return text


def _owner(owner: str | None) -> str:
    return f"by {_e(owner)}" if owner else "owner not given"


def _badge(state: str) -> str:
    return f'<span class="badge {_e(state)}">{_e(state)}</span>'


def _cancel(name: str) -> str:
    return f'<button type="button" class="cancel" data-cancel="{_e(name)}">Cancel</button>'


def _section(key: str, title: str, count: int, body: str) -> str:
    return (
        f'<section id="{key}"><h2>{title} <span class="count">{count}</span></h2>{body}</section>'
    )


def _table(head: list[tuple[str, str]], rows: list[str]) -> str:
    heads = "".join(
        f'<th class="{cls}">{text}</th>' if cls else f"<th>{text}</th>" for text, cls in head
    )
    return (
        f'<div class="scroll"><table><thead><tr>{heads}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


# ---- the sections ---------------------------------------------------------------------------


def _device_row(d: DeviceInfo, owners: dict[str, str | None]) -> str:
    if d.total_bytes is not None and d.free_bytes is not None:
        used = d.total_bytes - d.free_bytes
        memory = (
            f'<progress max="{d.total_bytes}" value="{used}"></progress>'
            f'<div class="muted">{_gib(used)} used · {_gib(d.free_bytes)} free of '
            f"{_gib(d.total_bytes)}"
            + (f" · {d.utilization:.0f}% busy" if d.utilization is not None else "")
            + "</div>"
        )
    else:
        memory = '<span class="muted">not read yet (the worker reports it after a probe)</span>'
    held = []
    if d.study is not None:
        held.append(
            f'study <a class="name" href="#study-{_e(d.study)}">{_e(d.study)}</a> '
            f'<span class="muted">{_owner(owners.get(d.study))}</span>'
        )
    for p in d.other_processes:
        held.append(f"another process: pid {p.pid} ({_gib(p.used_bytes)})")
    if not d.other_processes and d.others_bytes:
        held.append(f"other processes ({_gib(d.others_bytes)})")
    who = "<br>".join(held) or '<span class="muted">free</span>'
    if d.busy_reason:
        who += f'<div class="warn">{_e(d.busy_reason)}</div>'
    return (
        f'<tr data-device="{_e(d.name)}"><td><span class="name">{_e(d.name)}</span>'
        f'<div class="muted">{_e(d.description)}</div></td><td>{memory}</td><td>{who}</td></tr>'
    )


def _devices(ov: Overview) -> str:
    owners = {s.name: s.owner for s in ov.running}
    rows = [_device_row(d, owners) for d in ov.devices]
    head = [("Device", ""), ("Memory", ""), ("Held by", "")]
    return _section("devices", "Devices", len(rows), _table(head, rows))


def _trial_chips(s: StudyDetail) -> str:
    counts = dict(s.by_outcome)
    if s.progress.trials.get("running"):
        counts["in flight"] = s.progress.trials["running"]
    chips = "".join(
        f'<span class="chip" data-outcome="{_e(k)}">{_e(k)} {v}</span>'
        for k, v in sorted(counts.items())
    )
    return f'<dd class="chips">{chips}</dd>' if chips else '<dd class="muted">none yet</dd>'


def _best(s: StudyDetail) -> str:
    b = s.best
    if b is None:
        return '<span class="muted">no feasible trial yet</span>'
    return (
        f"<code>{_e(label(b.params))}</code> {_speedup(b.speedup, b.speedup_low, b.speedup_high)}"
        " the fp32 reference"
    )


def _running_card(s: StudyDetail) -> str:
    p = s.progress
    share = p.budget_used_seconds / p.budget_seconds if p.budget_seconds else 0.0
    budget = (
        f'<progress max="{p.budget_seconds:g}" value="{min(p.budget_used_seconds, p.budget_seconds):g}">'
        f"</progress> {format_duration(p.budget_used_seconds)} of "
        f"{format_duration(p.budget_seconds)} ({share:.0%})"
    )
    return (
        f'<article class="card" id="study-{_e(s.name)}" data-study="{_e(s.name)}">'
        f"<h3>{_e(s.name)} {_badge(s.state)}</h3>"
        f'<div class="muted">{_owner(s.owner)} · on {_e(s.device or "?")} · '
        f"<code>{_e(workload_label(s.workload))}</code></div><dl>"
        f'<dt>Phase</dt><dd class="phase">{_e(p.phase or "starting")}</dd>'
        f'<dt>Budget</dt><dd class="budget">{budget}</dd>'
        f"<dt>Trials</dt>{_trial_chips(s)}"
        f'<dt>Best so far</dt><dd class="best">{_best(s)}</dd></dl>'
        f'<p class="muted detail">{_e(s.error or s.detail)}</p>{_cancel(s.name)}</article>'
    )


def _running(ov: Overview) -> str:
    if not ov.running:
        body = '<p class="empty">Nothing is running.</p>'
    else:
        body = f'<div class="cards">{"".join(_running_card(s) for s in ov.running)}</div>'
    return _section("running", "Running", len(ov.running), body)


def _queue_row(i: int, s: StudyStatus, device: str, now: float) -> str:
    return (
        f'<tr data-study="{_e(s.name)}"><td class="num wide">{i}</td>'
        f'<td><span class="name">{_e(s.name)}</span><div class="muted">{_owner(s.owner)}</div></td>'
        f'<td class="wide"><code>{_e(workload_label(s.workload))}</code><div class="muted">device '
        f"{_e(device)} · priority {s.priority}</div></td>"
        f'<td class="num">{format_duration(s.progress.budget_seconds)}</td>'
        f"<td>{_when(s.submitted_at, now)}</td>"
        f'<td class="wide muted">{_e(s.detail)}</td><td>{_cancel(s.name)}</td></tr>'
    )


def _queue(ov: Overview) -> str:
    if not ov.queued:
        body = '<p class="empty">The queue is empty.</p>'
    else:
        head = [("#", "wide"), ("Study", ""), ("Spec", "wide"), ("Budget", ""),
                ("Waiting", ""), ("Why", "wide"), ("", "")]  # fmt: skip
        rows = [
            _queue_row(i, s, ov.requested.get(s.name, "auto"), ov.now)
            for i, s in enumerate(ov.queued, 1)
        ]
        body = _table(head, rows)
    return _section("queue", "Queue", len(ov.queued), body)


def _result(s: StudyStatus, cfg: TunedConfig | None) -> str:
    if cfg is None:
        return f'<span class="muted">{_e(s.error or s.detail)}</span>'
    ev = cfg.evidence
    verdict = "validated" if ev.validated else "not validated: fp32 fallback"
    # Why it fell back, the timing noise and others' load: best.json's, as every surface says.
    more = "".join(f'<div class="muted">{_e(n)}</div>' for n in config_notes(cfg))
    return (
        f"<code>{_e(cfg.precision)} bs={cfg.batch_size} lr={cfg.learning_rate:.3g}</code>"
        f'<div class="figure">{_speedup(ev.speedup, ev.speedup_low, ev.speedup_high)} the fp32 '
        f'reference, <span class="muted">{verdict}</span></div>{more}'
    )


def _finished_row(s: StudyStatus, cfg: TunedConfig | None, now: float) -> str:
    links = [f'<a href="{_link(s.name, "/report")}">report</a>']
    if cfg is not None:
        links.append(f'<a href="{_link(s.name, "/best.json")}" download>best.json</a>')
    return (
        f'<tr data-study="{_e(s.name)}"><td><span class="name">{_e(s.name)}</span>'
        f'<div class="muted">{_owner(s.owner)}</div></td><td>{_badge(s.state)}</td>'
        f"<td>{_result(s, cfg)}</td><td>{' · '.join(links)}</td>"
        f'<td class="wide">{_when(s.finished_at, now, " ago")}</td></tr>'
    )


def _finished(ov: Overview) -> str:
    if not ov.finished:
        body = '<p class="empty">No study has finished yet.</p>'
    else:
        head = [("Study", ""), ("State", ""), ("Result", ""), ("", ""), ("Finished", "wide")]
        rows = [_finished_row(s, ov.configs.get(s.name), ov.now) for s in ov.finished]
        body = _table(head, rows)
        if ov.older:
            body += f'<p class="muted">and {ov.older} older (GET /studies lists them all)</p>'
    return _section("finished", "Finished", len(ov.finished) + ov.older, body)


def _status(h: Health) -> str:
    state = "ok" if h.status == "ok" else "draining"
    why = "" if state == "ok" else ": it is stopping, and takes no new studies"
    return (
        f'<p class="status">Service {_badge(state)}{why} · {h.running} running · {h.queued} '
        f"queued · version {_e(h.version)}</p>"
    )


def render_live(ov: Overview) -> str:
    """The part of the page that changes: the service's state, devices, running, queue and
    finished studies (HTML)."""
    return _status(ov.health) + _devices(ov) + _running(ov) + _queue(ov) + _finished(ov)


def render_page(
    ov: Overview | None, *, nonce: str, private: bool = False, has_token: bool = False
) -> str:
    """The whole page, its style and script carrying ``nonce`` (see :func:`page_headers`).

    ``ov`` None: a private service's page before its token is given (no data on it).
    """
    token_required = ov.health.token_required if ov is not None else has_token
    token = (
        '<form id="token-form" class="token" autocomplete="off">'
        '<label for="token">Token</label>'
        '<input id="token" type="password" autocomplete="off" spellcheck="false" '
        f'placeholder="to {"see and " if private else ""}cancel studies">'
        '<button type="submit">Use</button>'
        '<button type="button" id="forget">Forget</button>'
        '<span id="token-state" class="muted"></span></form>'
        if token_required
        else ""
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="referrer" content="no-referrer"><link rel="icon" href="data:,">'
        f'<title>autotune service</title><style nonce="{nonce}">{STYLE}</style></head>'
        f'<body data-token-required="{str(token_required).lower()}" '
        f'data-private="{str(private).lower()}"><header><div>'
        '<h1>autotune service</h1><div id="live" class="muted">as of loading</div></div>'
        f'{token}</header><main><p id="notice" role="status"></p><noscript><p class="empty">This '
        "page updates itself with JavaScript; without it, reload it to see changes."
        f'</p></noscript><div id="live-main">{render_live(ov) if ov else PRIVATE_NOTE}</div>'
        "</main>"
        f'<script nonce="{nonce}">{SCRIPT}</script></body></html>'
    )


def new_nonce() -> str:
    """A fresh nonce for one response's style and script."""
    return secrets.token_urlsafe(18)


_COMMON = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def page_headers(nonce: str | None = None) -> dict[str, str]:
    """Headers of the page (with its nonce) or of its live part (without: it runs nothing).

    Only the page's own style and script run, it talks to its own origin only, and no other
    site may frame it (a framed cancel button could be clicked through a decoy).
    """
    if nonce is None:
        policy = "default-src 'none'; frame-ancestors 'none'"
    else:
        policy = (
            f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'"
        )
    return {**_COMMON, "Content-Security-Policy": policy}


def report_headers() -> dict[str, str]:
    """The report is inline CSS and SVG, no script: it may run nothing and load nothing."""
    policy = (
        "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    )
    return {**_COMMON, "Content-Security-Policy": policy}


# ---- a study's report and best.json ---------------------------------------------------------


def report_html(service: TuningService, name: str) -> str:
    """The HTML report of a study the service knows, as it stands now (running ones too).

    Raises:
        RequestError: 404 for a study the service does not know, 409 for one with nothing
            stored yet.
    """
    status = service.study(name)
    try:
        study = load_study(name, service.storage_url)
    except StorageError:
        raise RequestError(
            409,
            f"study {name!r} has nothing stored yet ({status.detail}); its report exists once "
            "it has started",
        ) from None
    out = service.scheduler.out_dir / name
    return render_html(collect(study, out_dir=out, storage=service.storage_url))


def best_json(service: TuningService, name: str) -> tuple[str, bytes]:
    """A finished study's TunedConfig as ``best.json`` holds it: ``(file name, bytes)``.

    Raises:
        RequestError: 404 unknown, 409 not done.
    """
    cfg = TunedConfig.model_validate(service.config(name))
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100]
    return f"{safe}-best.json", (cfg.model_dump_json(indent=2) + "\n").encode()
