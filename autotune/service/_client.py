"""A typed client for the tuning service's HTTP API (what ``autotune submit/status/...`` use)."""

from __future__ import annotations

import getpass
import os
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter

from autotune.errors import ServiceError
from autotune.schema.config import TunedConfig
from autotune.service._access import TOKEN_ENV
from autotune.service._models import (
    CancelReply,
    DeviceInfo,
    Health,
    StudyDetail,
    StudyStatus,
    SubmitReply,
)

__all__ = ["DEFAULT_SERVER", "SERVER_ENV", "ServiceClient"]

DEFAULT_SERVER = "http://127.0.0.1:8765"
SERVER_ENV = "AUTOTUNE_SERVER"


def _q(name: str) -> str:
    return quote(name, safe="")


def _user() -> str | None:
    """This machine's user name, or None where the system has none (a bare container)."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return None


class ServiceClient:
    """Talks to one ``autotune serve``.

    Args:
        server: its base URL; ``AUTOTUNE_SERVER`` or http://127.0.0.1:8765 by default.
        token: the bearer token for submit and cancel; ``AUTOTUNE_TOKEN`` by default.
        timeout: seconds to wait for an answer.

    Raises:
        ServiceError: the token holds a character an HTTP header cannot carry.

    Raises (from every call):
        ServiceError: the service cannot be reached (``status`` None), or refused the request
            (``status`` is the HTTP status, the message is the service's).

    Example:
        >>> client = ServiceClient()  # doctest: +SKIP
        >>> client.submit(open("studies/tiny.yaml").read()).position  # doctest: +SKIP
        1
    """

    def __init__(
        self, server: str | None = None, token: str | None = None, *, timeout: float = 30.0
    ) -> None:
        self.server = (server or os.environ.get(SERVER_ENV) or DEFAULT_SERVER).rstrip("/")
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        token = token.strip() if token else None
        if token and not (token.isascii() and token.isprintable() and " " not in token):
            bad = next(
                i for i, c in enumerate(token) if not (c.isascii() and c.isprintable()) or c == " "
            )
            raise ServiceError(
                f"the token holds a character an HTTP header cannot carry (position {bad + 1}): "
                f"tokens are printable ASCII; check --token or {TOKEN_ENV}"
            )
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.ConnectError:
            raise ServiceError(
                f"cannot reach the autotune service at {self.server}: connection refused; start "
                f"it with `autotune serve`, or point --server (or {SERVER_ENV}) at it"
            ) from None
        except httpx.TimeoutException:
            raise ServiceError(
                f"the autotune service at {self.server} did not answer within "
                f"{self._http.timeout.read}s"
            ) from None
        except httpx.HTTPError as exc:
            raise ServiceError(f"talking to the autotune service at {self.server}: {exc}") from None
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = None
            if not isinstance(detail, str):
                detail = f"HTTP {response.status_code}: {response.text[:300]}"
            raise ServiceError(detail, status=response.status_code)
        return response.json()

    def health(self) -> Health:
        return Health.model_validate(self._call("GET", "/health"))

    def submit(
        self, spec: str, *, json_body: bool = False, priority: int = 0, owner: str | None = None
    ) -> SubmitReply:
        """Queue a study spec given as YAML (or JSON with ``json_body=True``) text; ``owner``
        (shown beside the study) is this machine's user name unless given."""
        kind = "application/json" if json_body else "application/yaml"
        params: dict[str, Any] = {"priority": priority}
        if owner := owner if owner is not None else _user():
            params["owner"] = owner[:64]
        data = self._call(
            "POST", "/studies", content=spec.encode(), headers={"Content-Type": kind}, params=params
        )
        return SubmitReply.model_validate(data)

    def studies(self) -> list[StudyStatus]:
        return TypeAdapter(list[StudyStatus]).validate_python(self._call("GET", "/studies"))

    def study(self, name: str) -> StudyDetail:
        return StudyDetail.model_validate(self._call("GET", f"/studies/{_q(name)}"))

    def config(self, name: str) -> TunedConfig:
        return TunedConfig.model_validate(self._call("GET", f"/studies/{_q(name)}/config"))

    def cancel(self, name: str) -> CancelReply:
        return CancelReply.model_validate(self._call("POST", f"/studies/{_q(name)}/cancel"))

    def devices(self) -> list[DeviceInfo]:
        return TypeAdapter(list[DeviceInfo]).validate_python(self._call("GET", "/devices"))
