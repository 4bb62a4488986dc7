"""Hiding secrets in text: a database password in a URL or a ``password=`` parameter.

Everything autotune prints, logs or stores about a storage goes through :func:`mask_url`; the
log sinks of the command line apply it to every message as well (see ``logs.setup_logging``),
so a message that forgot to mask a URL still writes no password.
"""

from __future__ import annotations

import re

__all__ = ["mask_url", "remember", "secrets_of", "userinfo_ats"]

MASK = "***"

# A URL inside any text: a scheme, then everything up to white space or a quote.
_URL = re.compile(r"(?<![\w+.-])[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]*")
_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")
# A user name, then the ':' before its password (the driver's reading: no ':' or '/' in it).
_USER = re.compile(r"[^:/@]*:")
# Secrets seen in this process, hidden in every later text (shorter ones would garble messages).
_KNOWN: set[str] = set()
_MIN_KNOWN = 4
# A secret given as a parameter: ?password=…, &sslpassword=…, or a libpq "password=…" keyword.
_PARAM = re.compile(
    r"(?i)((?<![\w-])(?:password|passwd|pwd|sslpassword|secret|token|api_key)=)"
    r"([^&;#\s'\"]*)"
)


def _password_span(rest: str) -> tuple[int, int] | None:
    """Where the password lies in a URL's text after ``scheme://``, as the database driver reads
    it: after the user name's ``:``, up to the ``@`` before the host. A password may hold ``?``,
    ``/``, ``'`` or white space; a raw ``@`` in it reaches the last ``@`` before the query (the
    driver would split at the first one, and the URL is refused, but its tail stays hidden)."""
    user = _USER.match(rest)
    if user is None:
        return None
    first = rest.find("@", user.end())
    if first < 0:
        return None
    query = rest.find("?", first)
    return user.end(), rest.rfind("@", 0, query if query >= 0 else len(rest))


def _mask_one(url: str) -> str:
    """A URL with its user part's password replaced by ``***`` (a ``password=`` in its query
    is :data:`_PARAM`'s to mask)."""
    scheme = _SCHEME.match(url)
    if scheme is None:
        return url
    rest = url[scheme.end() :]
    span = _password_span(rest)
    if span is not None:
        rest = rest[: span[0]] + MASK + rest[span[1] :]
    return url[: scheme.end()] + rest


def remember(url: str) -> None:
    """Keep ``url``'s secrets for this process, so that any later text quoting them (a driver's
    error, a log line that forgot to mask) shows ``***`` instead."""
    _KNOWN.update(s for s in secrets_of(url) if len(s) >= _MIN_KNOWN)


def mask_url(text: str, *, url: str | None = None) -> str:
    """Hide every password in ``text``: in a URL's user part and in ``password=`` parameters.

    A text that is one URL is parsed whole (its password may hold ``?``, ``'`` or white space)
    and its secrets are remembered for the rest of the process; a message that holds URLs has
    each one masked, and every secret remembered so far is hidden wherever it stands. With
    ``url``, that URL's secrets are removed from ``text`` too (for a driver's error about it).

    Example:
        >>> mask_url("postgresql://u:secret@h/db")
        'postgresql://u:***@h/db'
        >>> mask_url("postgresql://:secret@h/db")
        'postgresql://:***@h/db'
        >>> mask_url("postgresql://u:p@ss@h/db")
        'postgresql://u:***@h/db'
        >>> mask_url("postgresql://u:a?b c'd@h/db")
        'postgresql://u:***@h/db'
        >>> mask_url("postgresql://u@h/db?password=secret&sslmode=require")
        'postgresql://u@h/db?password=***&sslmode=require'
        >>> mask_url("cannot open 'sqlite:///studies/autotune.db'")
        "cannot open 'sqlite:///studies/autotune.db'"
    """
    if _SCHEME.match(text):
        remember(text)
        text = _mask_one(text)
    else:
        text = _URL.sub(lambda m: _mask_one(m.group(0)), text)
    text = _PARAM.sub(lambda m: m.group(1) + (MASK if m.group(2) else ""), text)
    # A driver's error may quote a piece of the URL without its scheme ("failed to resolve
    # host 'secret@db'"): the URL's own secrets, and every one seen before, go wherever they are.
    for secret in sorted({*(secrets_of(url) if url else ()), *_KNOWN}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def _parts(url: str) -> tuple[str, str]:
    """(password, query) of a URL, split as :func:`mask_url` splits it ("" for either it lacks)."""
    scheme = _SCHEME.match(url)
    if scheme is None:
        return "", ""
    rest = url[scheme.end() :]
    span = _password_span(rest)
    host_at = span[1] if span else 0
    query = rest.find("?", host_at)
    return (rest[span[0] : span[1]] if span else ""), (rest[query + 1 :] if query >= 0 else "")


def userinfo_ats(url: str) -> int:
    """How many raw ``@`` a URL's user and password hold (a database driver splits at the
    first one, so such a URL reaches the wrong host).

    Example:
        >>> userinfo_ats("postgresql://u:p@ss@h/db"), userinfo_ats("postgresql://u:p%40ss@h/db")
        (1, 0)
    """
    password = _parts(url)[0]
    if password:
        return password.count("@")
    scheme = _SCHEME.match(url)
    host = re.split(r"[/?]", url[scheme.end() :], maxsplit=1)[0] if scheme else ""
    return max(host.count("@") - 1, 0)


def secrets_of(url: str) -> list[str]:
    """The secret strings of a URL (its password, and the pieces of it a driver may quote when
    it splits the URL differently), longest first, for scrubbing error texts.

    Example:
        >>> secrets_of("postgresql://u:p@ssword@h/db?password=other")
        ['p@ssword', 'ssword', 'other']
    """
    from urllib.parse import parse_qsl, unquote

    password, query = _parts(url)
    found: list[str] = []
    if password:
        found += [password, *(p for p in password.split("@") if len(p) >= 4)]
    for key, value in parse_qsl(query, keep_blank_values=False):
        if _PARAM.match(f"{key}=") and value:
            found.append(value)
    found += [unquote(s) for s in found if unquote(s) != s]
    return sorted(set(found), key=lambda s: (-len(s), s))
