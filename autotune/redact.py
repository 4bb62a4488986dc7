"""Hiding secrets in text: a database password in a URL or a ``password=`` parameter.

Everything autotune prints, logs or stores about a storage goes through :func:`mask_url`; the
log sinks of the command line apply it to every message as well (see ``logs.setup_logging``),
so a message that forgot to mask a URL still writes no password.
"""

from __future__ import annotations

import re

__all__ = ["mask_url", "secrets_of", "userinfo_ats"]

MASK = "***"

# A URL inside any text: a scheme, then everything up to white space or a quote.
_URL = re.compile(r"(?<![\w+.-])([a-zA-Z][a-zA-Z0-9+.-]*://)([^\s'\"<>]*)")
# A secret given as a parameter: ?password=…, &sslpassword=…, or a libpq "password=…" keyword.
_PARAM = re.compile(
    r"(?i)((?<![\w-])(?:password|passwd|pwd|sslpassword|secret|token|api_key)=)"
    r"([^&;#\s'\"]*)"
)


def _mask_userinfo(match: re.Match[str]) -> str:
    scheme, rest = match.group(1), match.group(2)
    # The userinfo ends at the *last* '@' before the query: a raw '@' (or '/') inside a
    # password would otherwise leave its tail in the clear.
    head, sep, query = rest.partition("?")
    at = head.rfind("@")
    if at > 0:
        user, colon, _password = head[:at].partition(":")
        if colon:
            head = f"{user}:{MASK}{head[at:]}"
    return scheme + head + sep + query


def mask_url(text: str, *, url: str | None = None) -> str:
    """Hide every password in ``text``: in a URL's user part and in ``password=`` parameters.

    Works on a bare URL and on a message that holds one; a text without a secret comes back
    unchanged. With ``url``, that URL's secrets are removed from ``text`` wherever they stand
    (for a driver's error about it).

    Example:
        >>> mask_url("postgresql://u:secret@h/db")
        'postgresql://u:***@h/db'
        >>> mask_url("postgresql://:secret@h/db")
        'postgresql://:***@h/db'
        >>> mask_url("postgresql://u:p@ss@h/db")
        'postgresql://u:***@h/db'
        >>> mask_url("postgresql://u@h/db?password=secret&sslmode=require")
        'postgresql://u@h/db?password=***&sslmode=require'
        >>> mask_url("cannot open 'sqlite:///studies/autotune.db'")
        "cannot open 'sqlite:///studies/autotune.db'"
    """
    text = _URL.sub(_mask_userinfo, text)
    text = _PARAM.sub(lambda m: m.group(1) + (MASK if m.group(2) else ""), text)
    # A driver's error may quote a piece of the URL without its scheme ("failed to resolve
    # host 'secret@db'"): the URL's own secrets go wherever they appear.
    for secret in secrets_of(url) if url else ():
        text = text.replace(secret, MASK)
    return text


def _parts(url: str) -> tuple[str, str]:
    """(userinfo, query) of a URL, split as :func:`mask_url` splits it."""
    _, sep, rest = url.partition("://")
    if not sep:
        return "", ""
    head, _, query = rest.partition("?")
    at = head.rfind("@")
    return (head[:at] if at > 0 else ""), query


def userinfo_ats(url: str) -> int:
    """How many raw ``@`` a URL's user and password hold (a database driver splits at the
    first one, so such a URL reaches the wrong host).

    Example:
        >>> userinfo_ats("postgresql://u:p@ss@h/db"), userinfo_ats("postgresql://u:p%40ss@h/db")
        (1, 0)
    """
    return _parts(url)[0].count("@")


def secrets_of(url: str) -> list[str]:
    """The secret strings of a URL (its password, and the pieces of it a driver may quote when
    it splits the URL differently), longest first, for scrubbing error texts.

    Example:
        >>> secrets_of("postgresql://u:p@ssword@h/db?password=other")
        ['p@ssword', 'ssword', 'other']
    """
    from urllib.parse import parse_qsl, unquote

    userinfo, query = _parts(url)
    found: list[str] = []
    _, colon, password = userinfo.partition(":")
    if colon and password:
        found += [password, *(p for p in password.split("@") if len(p) >= 4)]
    for key, value in parse_qsl(query, keep_blank_values=False):
        if _PARAM.match(f"{key}=") and value:
            found.append(value)
    found += [unquote(s) for s in found if unquote(s) != s]
    return sorted(set(found), key=lambda s: (-len(s), s))
