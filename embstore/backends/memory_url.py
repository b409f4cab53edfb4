"""The options a ``memory://`` URL may carry (``memory://?hash_seed=7``), checked."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..errors import InvalidInputError, InvalidURLError
from ..options import check_options

__all__ = ["flag", "url_options"]


def url_options(url: str) -> dict[str, str]:
    """``memory://?hash_seed=7&initial_capacity=...``: the options a memory:// URL may carry.
    Unknown names are refused, as every other backend refuses them (a misspelt option must not
    be ignored)."""
    parts = urlsplit(url)
    if parts.netloc or parts.path not in ("", "/") or parts.fragment:
        raise InvalidURLError(f"{url!r}: a memory:// URL has no host or path; options go in "
                              "the query (memory://?hash_seed=7) or as keyword arguments")
    if not parts.query:
        return {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True)
    except ValueError as e:
        raise InvalidURLError(f"{url!r}: unreadable query: {e}") from None
    found = dict(pairs)
    if len(found) != len(pairs):
        raise InvalidURLError(f"{url!r}: an option is given twice")
    check_options("memory://", found,
                  ("initial_capacity", "prefault", "hash_seed", "huge_pages"))
    for name in ("initial_capacity", "hash_seed"):
        if name in found:
            try:
                int(found[name])
            except ValueError:
                raise InvalidInputError(
                    f"{url!r}: {name} must be an integer, got {found[name]!r}") from None
    return found


def flag(name: str, value: Any) -> bool:
    # Options may come from a URL query string as well as from keyword arguments.
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
        raise InvalidInputError(f"{name} must be true or false, got {value!r}")
    return bool(value)
