"""Layers: Backends that wrap Backends (cache over remote, shards).

:func:`build_backend` turns the layer options of :func:`embstore.open` (``cache=``,
``cache_capacity=``, ``write_policy=``, ``cache_eviction=``, ``write_behind=``, ``shards=``) into a
backend stack.
"""

from __future__ import annotations

from typing import Any

from ..backends.base import Backend
from ..errors import InvalidInputError
from ..registry import backend_class
from .cache.backend import CachedBackend
from .sharded import ShardedBackend, sharded_url
from .wrapper import WrapperBackend

LAYER_OPTIONS = ("cache", "cache_capacity", "write_policy", "cache_eviction", "write_behind",
                 "shards", "writer_keys", "lease_seconds")

__all__ = ["LAYER_OPTIONS", "build_backend", "WrapperBackend", "CachedBackend", "ShardedBackend"]


def build_backend(url: str, *, read_only: bool, layer: dict[str, Any],
                  options: dict[str, Any]) -> Backend:
    """Open ``url`` (or ``layer["shards"]``) and wrap it in the requested layers.

    Parameters
    ----------
    url : str
        The store URL. With ``shards=[...]`` it must be ``"sharded://"``, the first shard URL
        or the equivalent ``sharded://?shard=...`` URL.
    read_only : bool
    layer : dict
        Layer options: ``shards`` (list of URLs), ``cache`` (local URL or True for
        ``memory://``), ``cache_capacity``, ``write_policy``, ``cache_eviction``,
        ``write_behind``.
    options : dict
        Backend options, passed to the remote (every shard).
    """
    layer = dict(layer)
    unknown = set(layer) - set(LAYER_OPTIONS)
    if unknown:
        raise InvalidInputError(f"unknown layer option(s): {sorted(unknown)}")
    shards = layer.pop("shards", None)
    if shards is not None:
        if isinstance(shards, str) or not all(isinstance(s, str) for s in shards) or not shards:
            raise InvalidInputError("shards must be a non-empty list of store URLs")
        shards = list(shards)
        if url not in ("sharded://", shards[0], sharded_url(shards)):
            raise InvalidInputError(
                f"with shards=[...] the URL must be 'sharded://' or the first shard's URL, "
                f"got {url!r}"
            )
        remote: Backend = ShardedBackend(shards, read_only=read_only, **options)
    else:
        remote = backend_class(url)(url, read_only=read_only, **options)
    cache = layer.pop("cache", None)
    if cache is None or cache is False:
        if layer:
            remote.close()
            raise InvalidInputError(f"{sorted(layer)} only apply with cache=<local url>")
        return remote
    if cache is True:
        cache = "memory://"
    try:
        capacity = layer.pop("cache_capacity", 100_000)
        if "cache_eviction" in layer:
            layer["eviction"] = layer.pop("cache_eviction")
        return CachedBackend(remote, cache, read_only=read_only, capacity=capacity, **layer)
    except BaseException:
        remote.close()
        raise

