"""Store URL hygiene: refuse control characters, hide passwords in anything shown to people.

``store.url`` and ``repr(store)`` and error messages show :func:`redact_url`'s form; only the
backend object (what pickling and ``reopen`` use) keeps the URL with its password, so a store
still pickles into a worker. Nested URLs (``sharded://?shard=<percent-encoded url>``) are
redacted too.
"""

from __future__ import annotations

import os
import re
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from .errors import InvalidURLError

__all__ = ["REDACTED", "check_url_text", "parse_dir_url", "redact_text", "redact_url"]

REDACTED = "***"
# userinfo "user:password@" right after "scheme://"; the password runs to the last "@" before
# the host (a password may contain "@" when the URL was not percent-encoded)
_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/?#@]*):(?P<pw>[^/?#]*)@")
_SECRET_PARAMS = frozenset({"password", "passwd", "pwd", "secret", "token", "access_token",
                            "sslpassword"})
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# the same two shapes anywhere in a message (an error text quoting a URL)
_USERINFO_ANY = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/?#@\s'\"]*):"
                           r"(?P<pw>[^/?#\s'\"]*)@")
# also inside a nested URL, whose '&' (and, in older URLs, '?' and '=') are percent-encoded
_PARAM_ANY = re.compile(r"(?P<head>(?:[?&]|%26|%3F)(?:" + "|".join(sorted(_SECRET_PARAMS))
                        + r")(?:=|%3D))(?P<pw>(?:(?!%26)[^&\s'\"])+)", re.IGNORECASE)
# percent-encoded "://" of a nested URL, then "user:password@" in encoded form
_ENCODED_USERINFO_ANY = re.compile(r"(?P<head>%3A%2F%2F[^%/?#@\s'\"]*)%3A(?P<pw>[^/?#@\s'\"]*?)%40",
                                   re.IGNORECASE)


#: Characters a URL nested in a query value (``sharded://?shard=<url>``) keeps as they are:
#: all that read back the same through ``parse_qsl``. '&', '#', '%', '+' and spaces, which
#: would split or change the value, are percent-encoded.
NESTED_URL_SAFE = ":/@=?,;!$'()*~[]"


def query_string(pairs: list[tuple[str, str]]) -> str:
    """``k=v&...`` with values quoted as :data:`NESTED_URL_SAFE` allows: nested URLs stay
    readable."""
    return "&".join(f"{quote(k, safe='')}={quote(v, safe=NESTED_URL_SAFE)}" for k, v in pairs)


def check_url_text(url: str) -> None:
    """Raise ``InvalidURLError`` when ``url`` holds a control character (newline, NUL...):
    URL parsers stop or split there, so the rest (e.g. the table name) would be dropped."""
    m = _CONTROL.search(url)
    if m is not None:
        raise InvalidURLError(
            f"{redact_url(url)!r}: control character {m.group()!r} at position {m.start()} "
            "in the URL")


def redact_url(url: str) -> str:
    """``url`` with any password (``user:password@host``, ``?password=``) replaced by ``***``,
    also inside percent-encoded nested URLs (``sharded://?shard=...``)."""
    if not isinstance(url, str):
        return url
    out = _USERINFO.sub(lambda m: f"{m.group('head')}:{REDACTED}@", url, count=1)
    head, sep, query = out.partition("?")
    if not sep or not query:
        return out
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        return out
    changed = False
    redacted = []
    for k, v in pairs:
        if k.lower() in _SECRET_PARAMS and v:
            v, changed = REDACTED, True
        elif "://" in v:
            r = redact_url(v)
            changed |= r != v
            v = r
        redacted.append((k, v))
    if not changed:
        return out
    return head + "?" + query_string(redacted)


def redact_text(text: str) -> str:
    """``text`` (e.g. an error message quoting URLs) with every URL password shown as ``***``."""
    text = _USERINFO_ANY.sub(lambda m: f"{m.group('head')}:{REDACTED}@", text)
    text = _ENCODED_USERINFO_ANY.sub(lambda m: f"{m.group('head')}%3A{REDACTED}%40", text)
    return _PARAM_ANY.sub(lambda m: f"{m.group('head')}{REDACTED}", text)


def parse_dir_url(url: str, scheme: str) -> str:
    """Return the absolute directory path of a ``scheme:///abs/dir`` URL.

    Raises
    ------
    InvalidURLError
        For another scheme, a host part, a relative or empty path, a query or fragment.
    """
    if not isinstance(url, str):
        raise InvalidURLError(f"store URL must be a string, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme.lower() != scheme or not url.lower().startswith(f"{scheme}://"):
        raise InvalidURLError(f"not a {scheme}:// URL: {url!r}")
    if parts.netloc:
        raise InvalidURLError(
            f"{url!r}: {scheme} URLs need an absolute path and no host, e.g. "
            f"'{scheme}:///data/store' (three slashes); got host/relative part {parts.netloc!r}"
        )
    if parts.query or parts.fragment:
        raise InvalidURLError(f"{url!r}: {scheme} URLs take no query or fragment; "
                              "pass options as keyword arguments")
    path = unquote(parts.path)
    if not path.startswith("/") or path.rstrip("/") == "":
        raise InvalidURLError(f"{url!r}: need an absolute directory path, e.g. "
                              f"'{scheme}:///data/store'")
    if "\x00" in path:
        raise InvalidURLError(f"{url!r}: NUL byte in path")
    return os.path.normpath(path)
