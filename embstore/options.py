"""Declared option sets and the unknown-option check of :func:`embstore.open`.

A misspelt option must never be dropped silently (``optimzer="adam"`` would train with SGD):
every name is checked against what the engine, the layers and the backend that receives it
accept, and an unknown one raises ``InvalidInputError`` with a did-you-mean.

A backend declares its options with an ``accepted_options`` class attribute; without one the
keyword parameters of its ``__init__`` are the set (built-in backends). A third-party backend
whose ``__init__`` takes ``**options`` and declares nothing receives whatever is left.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable
from typing import Any

from .backends.base import Backend
from .errors import InvalidInputError

_NOT_OPTIONS = frozenset({"self", "url", "read_only", "shards"})


def accepted_options(cls: type) -> frozenset[str] | None:
    """The backend options ``cls`` accepts, or None when it cannot be told (it takes
    ``**options`` and declares no ``accepted_options``)."""
    declared = cls.accepted_options if issubclass(cls, Backend) else None
    if declared is not None:
        return frozenset(declared)
    params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    named = frozenset(p.name for p in params
                      if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                      and p.name not in _NOT_OPTIONS)
    takes_rest = any(p.kind is p.VAR_KEYWORD for p in params)
    # Built-in backends take **options only to pass them to Backend.__init__ (never to read
    # them back), so their named parameters are the whole set.
    if takes_rest and not cls.__module__.startswith("embstore."):
        return None
    return named


def unknown_option_error(where: str, unknown: Iterable[str],
                         known: Iterable[str]) -> InvalidInputError:
    """An ``InvalidInputError`` naming each unknown option, with the closest known name."""
    known = sorted(set(known))
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        parts.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return InvalidInputError(
        f"unknown option{'s' if len(parts) > 1 else ''} for {where}: {', '.join(parts)}; "
        f"accepted: {', '.join(known)}")


def check_options(where: str, given: dict[str, Any], accepted: Iterable[str]) -> None:
    """Raise :func:`unknown_option_error` if ``given`` has a name outside ``accepted``."""
    accepted = frozenset(accepted)
    unknown = set(given) - accepted
    if unknown:
        raise unknown_option_error(where, unknown, accepted)
