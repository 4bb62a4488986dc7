"""Who may do what: the bind address, the token, the same-site check, and which workloads the
service will import."""

from __future__ import annotations

import hashlib
import hmac
import importlib.machinery
import ipaddress
import os
import sys
from http.cookies import CookieError, SimpleCookie
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse

from autotune.errors import SpecError, WorkloadError
from autotune.schema.workload_spec import canonical_reference, named_objects, parse_source
from autotune.workloads import (
    BUILTIN_MODULES,
    builtin_factories,
    is_reference,
    is_stdlib,
    normalize_reference,
)

__all__ = [
    "BUILTIN_MODULES",
    "builtin_factories",
    "TOKEN_ENV",
    "VIEW_COOKIE",
    "WorkloadPolicy",
    "WorkloadRefused",
    "PrivateReads",
    "SAFE_METHODS",
    "check_bind",
    "cross_site",
    "is_loopback",
    "load_token",
    "may_read",
    "token_matches",
    "view_key",
]

TOKEN_ENV = "AUTOTUNE_TOKEN"
# Long enough that guessing it over HTTP is hopeless.
_MIN_TOKEN = 16
_TOKEN_HINT = "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > token.txt"


class WorkloadRefused(WorkloadError):
    """A well-formed workload reference the service will not import (HTTP 403)."""


def is_loopback(host: str) -> bool:
    """True for ``127.0.0.1``, ``::1``, ``localhost`` and the rest of 127.0.0.0/8.

    Example:
        >>> is_loopback("127.0.0.1"), is_loopback("0.0.0.0")
        (True, False)
    """
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_token(token_file: Path | None) -> str | None:
    """The service's token: the file's content, else ``AUTOTUNE_TOKEN``, else None.

    Raises:
        SpecError: the file cannot be read, or the token is shorter than 16 characters.
    """
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise SpecError(
                f"--token-file {str(token_file)!r} cannot be read ({exc.strerror}); {_TOKEN_HINT}"
            ) from None
        except UnicodeDecodeError:
            raise SpecError(
                f"--token-file {str(token_file)!r} is not text; {_TOKEN_HINT}"
            ) from None
        source = f"--token-file {str(token_file)!r}"
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        source = TOKEN_ENV
        if not token:
            return None
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise SpecError(
            f"the token in {source} holds a space, a control or a non-ASCII character; an HTTP "
            f"header carries printable ASCII only: {_TOKEN_HINT}"
        )
    if len(token) < _MIN_TOKEN:
        raise SpecError(
            f"the token in {source} has {len(token)} characters; use at least {_MIN_TOKEN}, "
            f"{_TOKEN_HINT}"
        )
    return token


def check_bind(host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without a token.

    Raises:
        SpecError: naming the host and how to give a token.
    """
    if token is None and not is_loopback(host):
        raise SpecError(
            f"--host {host} accepts connections from other machines, so it needs a token: pass "
            f"--token-file FILE or set {TOKEN_ENV} ({_TOKEN_HINT}); or keep the default "
            "--host 127.0.0.1"
        )


# Requests that change nothing: a page on another site may cause them, they do no harm.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _host_port(value: str, scheme: str = "http") -> tuple[str, int | None]:
    """``Example.COM:80`` → ``("example.com", 80)``; the scheme's default port when none."""
    value = value.strip().lower()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    default = {"http": 80, "https": 443}.get(scheme)
    port = int(port_text) if port_text.isdigit() else default
    return host, port


def cross_site(method: str, headers: dict[str, str], *, loopback_only: bool = False) -> str | None:
    """Why a request must be refused as cross-site, or None when it may go on.

    A browser sends a "simple" request (a ``text/plain`` POST) to any address without asking
    first, so any page a user of the box opens could submit or cancel studies on a service
    that listens on loopback without a token. A changing request is refused when the browser
    says it comes from another site (``Sec-Fetch-Site``) or its ``Origin`` is not the service's
    own (``Host``). A client that is not a browser (the CLI, curl) sends neither and passes.
    With ``loopback_only`` (the service listens on loopback), a ``Host`` that is not a loopback
    name is refused for every request: a name that resolves to 127.0.0.1 only for a while (DNS
    rebinding) would otherwise make another site's page the service's "own".

    Args:
        method: the HTTP method.
        headers: the request's headers, names lower-case.
        loopback_only: the service listens on a loopback address.

    Example:
        >>> cross_site("POST", {"host": "127.0.0.1:8765", "origin": "http://evil.example"})
        'a cross-site request (Origin http://evil.example, not this service at 127.0.0.1:8765)'
        >>> cross_site("POST", {"host": "127.0.0.1:8765", "origin": "http://127.0.0.1:8765"})
        >>> cross_site("POST", {"host": "127.0.0.1:8765"}) is None  # the CLI, curl
        True
    """
    host = headers.get("host", "")
    if loopback_only and host and not is_loopback(_host_port(host)[0]):
        return (
            f"Host {host!r} is not a loopback name, and this service listens on loopback only; "
            "use http://127.0.0.1:<port> or http://localhost:<port>"
        )
    if method.upper() in SAFE_METHODS:
        return None
    fetch_site = headers.get("sec-fetch-site", "").strip().lower()
    if fetch_site and fetch_site not in ("same-origin", "none"):
        return f"a cross-site request (Sec-Fetch-Site: {fetch_site})"
    origin = headers.get("origin")
    if origin is None:
        return None
    scheme, sep, rest = origin.strip().partition("://")
    if not sep or not host or _host_port(rest, scheme.lower()) != _host_port(host, scheme.lower()):
        return f"a cross-site request (Origin {origin}, not this service at {host or '?'})"
    return None


def token_matches(expected: str | None, authorization: str | None) -> bool:
    """Whether an ``Authorization`` header carries the expected bearer token.

    Compared as bytes: ``compare_digest`` refuses ``str`` with non-ASCII characters, and a
    header may carry any byte.

    Example:
        >>> token_matches("s3cret-token-0123456", "Bearer s3cret-token-0123456")
        True
        >>> token_matches("s3cret-token-0123456", "Bearer tøken")
        False
    """
    if expected is None:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    given_bytes = given.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(given_bytes, expected.encode())


# The cookie a private service's page sets once its token is given, so that links (the report,
# best.json) read too: HttpOnly, SameSite=Strict, and only a key derived from the token.
VIEW_COOKIE = "autotune_view"


def view_key(token: str) -> str:
    """What the view cookie holds: derived from the token, so it cannot be used to write.

    Example:
        >>> len(view_key("s3cret-token-0123456")), view_key("a") != view_key("b")
        (64, True)
    """
    return hmac.new(token.encode(), b"autotune: view only", hashlib.sha256).hexdigest()


def may_read(token: str | None, headers: dict[str, str]) -> bool:
    """Whether a request of a private service may read: it carries the token, or the view cookie.

    Example:
        >>> may_read("s3cret-token-0123456", {"authorization": "Bearer s3cret-token-0123456"})
        True
        >>> may_read("s3cret-token-0123456", {"cookie": "autotune_view=" + view_key("x")})
        False
    """
    if token is None or token_matches(token, headers.get("authorization")):
        return True
    try:
        jar = SimpleCookie(headers.get("cookie", ""))
    except CookieError:
        return False
    morsel = jar.get(VIEW_COOKIE)
    return morsel is not None and hmac.compare_digest(
        morsel.value.encode("utf-8", "surrogateescape"), view_key(token).encode()
    )


class PrivateReads:
    """A private service (``serve --private``): reading needs the token too (401 without it),
    but for the page's shell, which holds no data, and ``/health``."""

    OPEN = frozenset({"/", "/health"})

    def __init__(self, app: Any, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1")
                for k, v in scope.get("headers") or []
            }
            if not may_read(self.token, headers):
                detail = (
                    "this service is private: reading needs its token too (Authorization: "
                    "Bearer <token>; on the page, give it in the Token field)"
                )
                response = JSONResponse({"detail": detail}, 401, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class WorkloadPolicy:
    """Which workload references the service may import.

    Args:
        dirs: folders whose top-level packages are trusted (``--workload-dir``).

    Example:
        >>> WorkloadPolicy([]).check("tiny_convnet")
        'autotune.workloads:tiny_convnet'
    """

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = [d.resolve() for d in dirs]

    def check(self, reference: str) -> str:
        """Return the normalized reference when the service may import it.

        An adapter reference (a spec's ``workload: {lightning: ...}``, as its JSON text) is
        checked object by object, each as a plain reference is.

        Raises:
            WorkloadError: the reference is malformed, or names a built-in or a module that
                does not exist.
            WorkloadRefused: the reference, or an object an adapter names, is outside the
                built-ins and the workload dirs.

        Example:
            >>> WorkloadPolicy([]).check('{"loop": {"model": "json:loads", "data": "m:d", '
            ...                          '"optimizer": "m:o"}}')  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            autotune.service._access.WorkloadRefused: workload loop.model 'json:loads': ...
        """
        if reference.lstrip().startswith("{"):
            return self._check_adapter(reference)
        ref = normalize_reference(reference)
        if not is_reference(ref):
            raise WorkloadError(
                f"workload {reference!r} must look like package.module:function or be a built-in "
                "name such as tiny_convnet"
            )
        self._check_object(f"workload {reference!r}", ref, "or use a built-in")
        return ref

    def _check_adapter(self, reference: str) -> str:
        try:
            kind, source = parse_source(reference)
            objects = named_objects(reference)
        except ValueError as exc:
            raise WorkloadError(f"workload: {exc}") from None
        for field, ref in objects:
            what = f"workload {field} {ref!r}"
            if ref.startswith("pickle:"):
                raise WorkloadRefused(
                    f"{what}: this service does not load pickled objects (autotune.tune() sends "
                    "a notebook's objects that way to its own worker); name a class or function "
                    "of a package under the service's workload dirs"
                )
            # A library's class (torch.optim:SGD) is code the spec's args reach as well: it
            # goes through the user's package, which chose to import it.
            self._check_object(
                what,
                ref,
                "or import the object into a module of a package there and name it from that "
                "module (e.g. mypkg.train:SGD after `from torch.optim import SGD`)",
            )
        return canonical_reference(kind, source)

    def _check_object(self, what: str, ref: str, instead: str) -> None:
        """Refuse ``package.module:name`` outside the built-ins and the workload dirs; ``what``
        names it in the message, ``instead`` says the other way out."""
        module, attr = ref.split(":")
        if module in BUILTIN_MODULES:
            self._builtin(what, module, attr)
            return
        top = module.split(".")[0]
        where = self._find(top)
        if where is None:
            dirs = ", ".join(str(d) for d in self.dirs) or "none configured"
            raise WorkloadRefused(
                f"{what}: this service imports only the built-in workloads "
                f"({', '.join(m + ':*' for m in BUILTIN_MODULES)}) and packages under its "
                f"workload dirs ({dirs}); {top!r} is not there. Ask whoever runs the service to "
                f"add its folder with --workload-dir, {instead}"
            )
        if not self._module_exists(module, where):
            raise WorkloadError(
                f"{what}: module {module!r} does not exist under {where}; check the spelling"
            )

    def _builtin(self, what: str, module: str, attr: str) -> None:
        names = builtin_factories(module)
        if attr not in names:
            raise WorkloadError(
                f"{what}: {module} has no workload {attr!r}; it has {', '.join(names)}"
            )

    def _find(self, top: str) -> Path | None:
        """The workload dir a top-level package lives in, if the import would really find it.

        The worker imports with the working directory first, then the workload dirs; a name the
        standard library or an already imported package owns would resolve to that instead.
        """
        if is_stdlib(top):
            return None
        search = [os.getcwd(), *map(str, self.dirs)]
        spec = importlib.machinery.PathFinder.find_spec(top, search)
        if spec is None:
            return None
        origin = spec.origin if spec.origin not in (None, "namespace") else None
        places = (
            [Path(origin)] if origin else [Path(p) for p in spec.submodule_search_locations or []]
        )
        for d in self.dirs:
            if places and all(p.resolve().is_relative_to(d) for p in places):
                loaded = sys.modules.get(top)
                loaded_file = getattr(loaded, "__file__", None) if loaded else None
                if loaded is not None and (
                    loaded_file is None or not Path(loaded_file).resolve().is_relative_to(d)
                ):
                    return None
                return d
        return None

    @staticmethod
    def _module_exists(module: str, where: Path) -> bool:
        """Find ``a.b.c`` under ``where`` step by step, without importing any of it."""
        paths = [str(where)]
        for part in module.split("."):
            spec = importlib.machinery.PathFinder.find_spec(part, paths)
            if spec is None:
                return False
            paths = list(spec.submodule_search_locations or [])
        return True
