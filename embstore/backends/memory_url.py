"""The options a ``memory://`` URL may carry (``memory://?hash_seed=7``), checked."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..errors import InvalidInputError, InvalidURLError
from ..options import check_options

__all__ = ["MAX_INITIAL_CAPACITY", "TableOptions", "capacity_hint", "check_initial_capacity",
           "flag", "url_options"]

#: largest ``initial_capacity``: the records of a memory:// table are numbered by uint32, so
#: no table holds more keys than this; larger asks are a mistake (or a hostile saved model)
MAX_INITIAL_CAPACITY = 1 << 31
#: bytes of key table per key of ``initial_capacity``, at most (16-byte slots, a load factor
#: of 0.85 and rounding up to a power of two)
_TABLE_BYTES_PER_KEY = 40


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
    if "initial_capacity" in found:
        check_initial_capacity(found["initial_capacity"], url)
    return found


def check_initial_capacity(value: Any, url: str = "memory://") -> int:
    """``initial_capacity`` as an int in ``[0, MAX_INITIAL_CAPACITY]`` whose key table (sized
    up front, ~40 bytes a key at most) takes at most half this machine's memory;
    ``InvalidInputError`` otherwise. The table grows on its own past it, so a smaller value
    only costs rehashes."""
    if isinstance(value, bool):
        raise InvalidInputError(f"{url!r}: initial_capacity must be an integer, got {value!r}")
    try:
        n = int(value) if isinstance(value, str) else value.__index__()
    except (AttributeError, TypeError, ValueError):
        raise InvalidInputError(
            f"{url!r}: initial_capacity must be an integer, got {value!r}") from None
    if not 0 <= n <= MAX_INITIAL_CAPACITY:
        raise InvalidInputError(
            f"{url!r}: initial_capacity {n} is outside [0, 2**31] (the most keys a memory:// "
            "table can hold); the table grows on its own, so give the keys you expect")
    need, have = n * _TABLE_BYTES_PER_KEY, _physical_memory()
    if have is not None and need > have // 2:
        raise InvalidInputError(
            f"{url!r}: initial_capacity {n} asks for a key table of about {need >> 20} MiB up "
            f"front, more than half this machine's {have >> 20} MiB of memory; give a smaller "
            "one (the table grows on its own)")
    return n


def capacity_hint(rows: int | None) -> int:
    """An ``initial_capacity`` for a table about to receive ``rows`` rows: ``rows`` where
    :func:`check_initial_capacity` allows it, else a small one (the table grows as they
    arrive)."""
    hint = max(int(rows or 0), 16)
    try:
        return check_initial_capacity(hint)
    except InvalidInputError:
        return 1024


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


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


@dataclass(frozen=True)
class TableOptions:
    """How a ``memory://`` table is made: the checked keyword options, each overridden by the
    same name in the URL's query (a flag from the query wins over the keyword)."""

    capacity: int
    prefault: bool
    hash_seed: int | None
    huge_pages: bool

    @classmethod
    def resolve(cls, url: str, initial_capacity: Any, prefault: Any, hash_seed: Any,
                huge_pages: Any) -> TableOptions:
        query = url_options(url)
        capacity = check_initial_capacity(query.get("initial_capacity", initial_capacity), url)
        seed = query.get("hash_seed", hash_seed)
        return cls(max(int(capacity), 16), flag("prefault", query.get("prefault", prefault)),
                   None if seed is None else int(seed),
                   flag("huge_pages", query.get("huge_pages", huge_pages)))
