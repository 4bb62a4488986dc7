"""The HTTP API: a thin FastAPI shell over :class:`~autotune.service.TuningService` (OpenAPI at
``/docs``, the page at ``/``)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated, Any

import anyio
import h11
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from loguru import logger
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

import autotune
from autotune.errors import SpecError, StorageIOError, short_repr
from autotune.schema.config import TunedConfig
from autotune.service._access import (
    VIEW_COOKIE,
    PrivateReads,
    cross_site,
    may_read,
    token_matches,
    view_key,
)
from autotune.service._models import (
    CancelReply,
    DeviceInfo,
    ErrorReply,
    Health,
    StudyDetail,
    StudyStatus,
    SubmitReply,
)
from autotune.service._page import (
    best_json,
    new_nonce,
    overview,
    page_headers,
    render_live,
    render_page,
    report_headers,
    report_html,
)
from autotune.service._tuning_service import RequestError, TuningService

__all__ = [
    "KEEP_ALIVE",
    "MAX_BODY",
    "MAX_HEAD",
    "REQUEST_TIMEOUT",
    "DrainFirstServer",
    "SlowClientGuard",
    "create_app",
]

# A study spec is a few hundred bytes; 64 KiB leaves room for comments and stops abuse.
MAX_BODY = 64 * 1024
# A request's line and headers: a client sends a few hundred bytes; 16 KiB is h11's own bound.
MAX_HEAD = 16 * 1024
# Seconds an idle keep-alive connection stays open (pollers reconnect for free on loopback).
KEEP_ALIVE = 5
# Seconds a client has to send a whole request (head and body): the CLI takes milliseconds.
REQUEST_TIMEOUT = 10.0


class SlowClientGuard(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for receiving each request.

    uvicorn has no read timeout: its keep-alive timer runs only between requests and stops at
    the first byte, so a client that sends its headers a byte every few seconds ("slowloris")
    would hold its connection open forever, and enough of them every file descriptor the
    service has. Here a request must arrive whole within ``REQUEST_TIMEOUT`` of the connection
    opening or of the previous response; a client still sending then is disconnected. A
    request that arrived and is being answered is never cut.

    Pass the class as ``uvicorn.Config(http=SlowClientGuard)``.
    """

    request_timeout = REQUEST_TIMEOUT

    def connection_made(self, transport: Any) -> None:
        self._deadline: Any = None
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout, self._too_slow)

    def _disarm(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        # IDLE: its request line and headers are not all here; SEND_BODY: its body is not.
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        logger.warning(
            "closed a connection from {}: its request was not all sent within {:g}s",
            ":".join(map(str, self.client)) if self.client else "?",
            self.request_timeout,
        )
        self.transport.close()


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The refusals an endpoint documents in OpenAPI, each an ErrorReply."""
    return {code: {"model": ErrorReply} for code in codes}


class _BodyLimit:
    """Refuse a request whose declared body is larger than ``limit`` before reading it (413)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.limit:
                response = JSONResponse(
                    {"detail": _too_large(self.limit, length.decode(errors="replace"))},
                    status_code=413,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _SameSite:
    """Refuse (403) what :func:`~autotune.service._access.cross_site` calls cross-site, before
    the request reaches an endpoint."""

    def __init__(self, app: Any, loopback_only: bool) -> None:
        self.app = app
        self.loopback_only = loopback_only

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1")
                for k, v in scope.get("headers") or []
            }
            why = cross_site(scope["method"], headers, loopback_only=self.loopback_only)
            if why is not None:
                logger.warning("refused {} {}: {}", scope["method"], scope.get("path"), why)
                response = JSONResponse(
                    {
                        "detail": f"refused {why}: a page of another site may not drive this "
                        "service; use the autotune CLI, or call the API from its own address"
                    },
                    status_code=403,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _too_large(limit: int, got: str) -> str:
    return f"the body has {got} bytes; the limit is {limit} bytes (a study spec is a few hundred)"


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` (chunked bodies too)."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(413, _too_large(limit, f"more than {limit}"))
            chunks.append(chunk)
    except ClientDisconnect:
        # Gone (or cut off by SlowClientGuard) mid-body: nobody reads the answer.
        raise RequestError(400, "the client went away before its body was sent") from None
    return b"".join(chunks)


async def _answer(call: Any, *args: Any, status: int = 200) -> Response:
    """Run a service call off the event loop (it reads the database) and send its models.

    The models are serialized here, once, by pydantic-core; FastAPI's second validation of a
    returned model would cost another thread hop per request, and status pages get polled.
    """
    result = await run_in_threadpool(call, *args)
    if isinstance(result, list):
        body = b"[" + b",".join(m.model_dump_json().encode() for m in result) + b"]"
    else:
        body = result.model_dump_json().encode()
    return Response(body, status_code=status, media_type="application/json")


class DrainFirstServer(uvicorn.Server):
    """A uvicorn server that drains the service *before* it stops answering.

    Plain uvicorn closes its socket on SIGTERM and only then runs the lifespan's shutdown, so a
    drain would look like a dead service. Here the first SIGTERM (or Ctrl-C) starts the drain
    while the API keeps answering: ``/health`` says ``draining``, submits get 503, status
    reads go on; when the drain is over the server stops. A second signal stops answering at
    once; the drain itself still finishes before the process exits.
    """

    def __init__(self, config: uvicorn.Config, service: TuningService) -> None:
        super().__init__(config)
        self.service = service
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain is not None:
            super().handle_exit(sig, frame)
            return
        # Raised again once the server is down, as uvicorn does, so the exit says which signal.
        self._captured_signals.append(sig)

        def drain() -> None:
            try:
                self.service.stop()
            finally:
                self.should_exit = True

        self._drain = threading.Thread(target=drain, name="drain", daemon=True)
        self._drain.start()


def create_app(
    service: TuningService,
    *,
    max_body: int = MAX_BODY,
    loopback_only: bool = False,
    private: bool = False,
) -> FastAPI:
    """The FastAPI app serving ``service``; its lifespan starts the scheduler and drains it.

    Changing requests from another site's page are refused (403); with ``loopback_only`` (the
    service listens on loopback) so is any request whose ``Host`` is not a loopback name. With
    ``private``, reading needs the service's token too.

    Example:
        >>> app = create_app(TuningService("sqlite:///studies/autotune.db", ["cpu"]))  # doctest: +SKIP
        >>> uvicorn.run(app, port=8765)  # doctest: +SKIP
    """
    app = FastAPI(
        title="autotune",
        version=autotune.__version__,
        description="A tuning service for a shared box: queue study specs, run their probes "
        "where there is room, read status and results.",
        lifespan=_lifespan(service),
    )
    app.add_middleware(_BodyLimit, limit=max_body)
    if private:
        if service.token is None:
            raise SpecError("a private service needs a token: give --token-file or AUTOTUNE_TOKEN")
        app.add_middleware(PrivateReads, token=service.token)
    # Added last, so it runs first: a cross-site request is refused before its body is read.
    app.add_middleware(_SameSite, loopback_only=loopback_only)
    _handle_errors(app, service)
    require_token = _token_check(service)
    _route_health_and_submit(app, service, require_token, max_body=max_body)
    _route_studies(app, service, require_token)
    _route_page(app, service, require_token, private=private)
    return app


def _lifespan(service: TuningService) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the scheduler starts with the app and drains when it stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            # Joining the device threads blocks: keep it off the event loop. (Under
            # DrainFirstServer the drain is already over, and this returns at once.)
            await anyio.to_thread.run_sync(service.stop)

    return lifespan


def _handle_errors(app: FastAPI, service: TuningService) -> None:
    """Every refusal, and every failure, answers ``{"detail": ...}`` with its status."""

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(StorageIOError)
    async def _storage(request: Request, exc: StorageIOError) -> JSONResponse:
        service.queue.problem = str(exc)  # /health says so until the storage answers again
        return JSONResponse(
            {"detail": f"{exc}; nothing was changed, try again in a moment"},
            status_code=503,
            headers={"Retry-After": "10"},
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.opt(exception=exc).error("{} {}: internal error", request.method, request.url.path)
        return JSONResponse(
            {
                "detail": f"internal error ({type(exc).__name__}); nothing was changed; the "
                "service's log has the details"
            },
            status_code=500,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:10]:
            loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("query", "path"))
            parts.append(f"{loc}: {err.get('msg')}, got {loc}={short_repr(err.get('input'))}")
        return JSONResponse({"detail": "; ".join(parts)}, status_code=422)


def _token_check(service: TuningService) -> Callable[..., None]:
    """The dependency of every changing endpoint: the service's token, or 401."""

    def require_token(
        authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
    ) -> None:
        if not token_matches(service.token, authorization):
            what = "a wrong token" if authorization else "no token"
            raise HTTPException(
                401,
                f"this service needs a token to change anything, and the request carried {what}; "
                "send Authorization: Bearer <token> (autotune CLI: --token or AUTOTUNE_TOKEN)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return require_token


def _route_health_and_submit(
    app: FastAPI, service: TuningService, require_token: Callable[..., None], *, max_body: int
) -> None:
    """``/health``, then ``POST /studies``: the body is read here, bounded by ``max_body``."""

    @app.get("/health", response_model=Health)
    async def health() -> Response:
        """Whether the service is up (``ok``) or draining, with queue counts."""
        # On the event loop, from memory: never queued behind submits in the thread pool.
        body = service.health().model_dump_json().encode()
        return Response(body, media_type="application/json")

    @app.post(
        "/studies",
        response_model=SubmitReply,
        status_code=201,
        responses=_errors(401, 403, 409, 413, 422),
        dependencies=[Depends(require_token)],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/yaml": {"schema": {"type": "string"}},
                    "application/json": {"schema": {"type": "object"}},
                },
            }
        },
    )
    async def submit(
        request: Request,
        priority: Annotated[int, Query(ge=-1000, le=1000, description="higher runs first")] = 0,
        owner: Annotated[
            str | None,
            Query(
                max_length=64,
                pattern=r"^[^\x00-\x1f\x7f]*$",
                description="who submits it, shown beside the study (not checked)",
            ),
        ] = None,
    ) -> Response:
        """Queue a study spec (the body: YAML, or JSON with ``Content-Type: application/json``).

        The service's own storage replaces the spec's ``storage``; ``device: auto`` runs on any
        of the service's devices.
        """
        body = await _read_body(request, max_body)
        content_type = request.headers.get("content-type")
        owner = owner.strip() if owner else None
        return await _answer(service.submit, body, content_type, priority, owner, status=201)


def _route_studies(
    app: FastAPI, service: TuningService, require_token: Callable[..., None]
) -> None:
    """The studies' JSON: status, detail, config; cancel (with the token); the devices."""

    @app.get("/studies", response_model=list[StudyStatus])
    async def studies() -> Response:
        """Every study in queue order (priority, then submission), with state and progress."""
        return await _answer(service.studies)

    @app.get("/studies/{name}", response_model=StudyDetail, responses=_errors(404))
    async def study(name: str) -> Response:
        """One study: trials by state and outcome, the best so far, budget used, latest trials."""
        return await _answer(service.study, name)

    @app.get("/studies/{name}/config", response_model=TunedConfig, responses=_errors(404, 409))
    async def config(name: str) -> Response:
        """The study's TunedConfig once it is done; 409 while queued or running."""
        return await _answer(lambda: TunedConfig.model_validate(service.config(name)))

    @app.post(
        "/studies/{name}/cancel",
        response_model=CancelReply,
        responses=_errors(401, 404, 409),
        dependencies=[Depends(require_token)],
    )
    async def cancel(name: str) -> Response:
        """Cancel a queued study, or stop a running one (its trials stay in the storage)."""
        return await _answer(service.cancel, name)

    @app.get("/devices", response_model=list[DeviceInfo])
    async def devices() -> Response:
        """Each device: free/total memory, what runs there, other processes, the worker's pid."""
        return await _answer(service.devices)


def _route_page(
    app: FastAPI, service: TuningService, require_token: Callable[..., None], *, private: bool
) -> None:
    """The page (see _page): HTML for people, from the same calls as the JSON."""

    @app.get("/", response_class=HTMLResponse)
    async def page(request: Request) -> Response:
        """The page: devices, the queue, running and finished studies; it keeps itself live. A
        private service's page shows them once its token is given."""
        headers = {k.lower(): v for k, v in request.headers.items()}
        shown = not private or may_read(service.token, headers)
        ov = await run_in_threadpool(overview, service) if shown else None
        nonce = new_nonce()
        body = render_page(ov, nonce=nonce, private=private, has_token=service.token is not None)
        return HTMLResponse(body, headers=page_headers(nonce))

    @app.post("/page/session", status_code=204, dependencies=[Depends(require_token)])
    async def page_session() -> Response:
        """The view cookie, for the page of a private service: its links (a report, best.json)
        then read too. It holds a key derived from the token, good for reading only."""
        response = Response(status_code=204)
        if service.token is not None:
            key = view_key(service.token)
            response.set_cookie(VIEW_COOKIE, key, httponly=True, samesite="strict", path="/")
        return response

    @app.post("/page/session/end", status_code=204)
    async def page_session_end() -> Response:
        """Forget the view cookie."""
        response = Response(status_code=204)
        response.delete_cookie(VIEW_COOKIE, path="/", httponly=True, samesite="strict")
        return response

    @app.get("/page/live", response_class=HTMLResponse)
    async def page_live() -> Response:
        """The page's live part, which the page fetches every two seconds (an HTML fragment)."""
        ov = await run_in_threadpool(overview, service)
        return HTMLResponse(render_live(ov), headers=page_headers())

    @app.get("/studies/{name}/report", response_class=HTMLResponse, responses=_errors(404, 409))
    async def report(name: str) -> Response:
        """The study's HTML report as it stands (plots, every trial); 409 before it started."""
        text = await run_in_threadpool(report_html, service, name)
        return HTMLResponse(text, headers=report_headers())

    @app.get("/studies/{name}/best.json", response_model=TunedConfig, responses=_errors(404, 409))
    async def download(name: str) -> Response:
        """The study's TunedConfig as a ``best.json`` download once it is done."""
        filename, body = await run_in_threadpool(best_json, service, name)
        return Response(
            body,
            media_type="application/json",
            headers={"Content-Disposition": f'attachment; filename="{filename}"'},
        )
