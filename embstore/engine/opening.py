"""URL + options -> backend stack + engine options: what :func:`embstore.open` does.

Kept below the store (it imports no engine code), so the store reopens itself from a pickle
through here without importing :mod:`embstore.api`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from ..backends.base import Backend
from ..layers import LAYER_OPTIONS, build_backend
from ..layers.sharded import ShardedBackend, parse_sharded_url
from ..options import accepted_options, unknown_option_error
from ..registry import backend_class, scheme_of

#: options of the engine (``EmbeddingStore``) rather than of the backend or a layer
ENGINE_OPTIONS = ("dim", "key_type", "initializer", "optimizer", "seed", "admission", "expiry",
                  "capacity", "eviction", "clock", "value_dtype", "stochastic_rounding",
                  "metadata")


def _cache_eviction_spelled_eviction(options: dict[str, Any]) -> bool:
    # Before cache_eviction=, eviction="lru"/"lfu" next to cache= and without capacity= meant
    # the cache's policy: that spelling still works, with a warning.
    return ("eviction" in options and "cache" in options and "capacity" not in options
            and "cache_eviction" not in options and isinstance(options["eviction"], str))


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], bool, dict[str, Any],
                                                     dict[str, Any]]:
    """``(engine, read_only, layer, backend)`` options from the keywords of ``open``."""
    options = dict(options)
    if _cache_eviction_spelled_eviction(options):
        warnings.warn("eviction= for the cache layer is deprecated: pass cache_eviction= "
                      "(eviction= with capacity= bounds the store itself)",
                      DeprecationWarning, stacklevel=3)
        options["cache_eviction"] = options.pop("eviction")
    engine = {k: options.pop(k) for k in ENGINE_OPTIONS if k in options}
    read_only = bool(options.pop("read_only", False))

    layer = {k: options.pop(k) for k in LAYER_OPTIONS if k in options}
    return engine, read_only, layer, options


def open_backend(url: str, *, read_only: bool, layer: dict[str, Any],
                 options: dict[str, Any]) -> Backend:
    """The backend of ``url`` with the requested layers around it."""
    if layer:
        return build_backend(url, read_only=read_only, layer=layer, options=options)
    return backend_class(url)(url, read_only=read_only, **options)


def check_backend_options(url: str, options: dict[str, Any], shards: Any = None,
                          also_known: Iterable[str] = ()) -> None:
    """Check the options left for the backend of ``url`` (or of every shard).

    ``also_known``: the engine and layer option names, offered as suggestions too (a
    misspelt engine option lands here).
    """
    if not options:
        return
    if shards is None and scheme_of(url) == "sharded":
        shards = parse_sharded_url(url)
    if shards is not None and not isinstance(shards, str):
        found_sets = [accepted_options(backend_class(s)) for s in shards if isinstance(s, str)]
        sets = [s for s in found_sets if s is not None]
        if not sets or len(sets) < len(found_sets):
            return
        accepted = frozenset.intersection(*sets) | (accepted_options(ShardedBackend) or set())
    else:
        found = accepted_options(backend_class(url))
        if found is None:
            return
        accepted = found
    unknown = set(options) - accepted
    if unknown:
        # the scheme only: a database URL may carry a password
        raise unknown_option_error(f"{scheme_of(url)}://", unknown,
                                   accepted | frozenset(also_known))
