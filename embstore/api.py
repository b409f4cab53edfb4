"""Opening and reopening stores, in one place: ``embstore.open`` (URL -> backend -> engine)
and :func:`reopen` (what a pickled store comes back through).

:func:`open` is :func:`open_backend` (the URL's backend stack, options checked) followed by
:func:`open_store` (the engine over it); a caller that must act between the two (a
distributed run agreeing on its shards, a wrapper around the backend) calls both itself.
Importing this module hands the lower layers what they need from it (see
:mod:`embstore.engine.services`): the transfers get :func:`open` to create a store, a pickled
store gets :func:`reopen`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, cast

from . import transfer  # noqa: F401 - installs the store's export/import (engine.services)
from .backends.base import Backend
from .engine import services
from .engine.unpickled import UnopenedStore
from .errors import BackendUnavailableError
from .extras import install_hint
from .layers import LAYER_OPTIONS, build_backend
from .layers.sharded import ShardedBackend, parse_sharded_url
from .options import accepted_options, unknown_option_error
from .registry import backend_class, scheme_of
from .store import EmbeddingStore

__all__ = ["ENGINE_OPTIONS", "open", "open_backend", "open_store", "reopen"]

#: options of the engine (``EmbeddingStore``) rather than of the backend or a layer
ENGINE_OPTIONS = ("dim", "key_type", "initializer", "optimizer", "seed", "admission", "expiry",
                  "capacity", "eviction", "clock", "value_dtype", "stochastic_rounding",
                  "metadata")


def open(url: str, dim: int | None = None, **options: Any) -> EmbeddingStore:  # noqa: A001
    """Create or reopen the embedding store at ``url``.

    Parameters
    ----------
    url : str
        ``memory://``, ``lmdb:///abs/dir``, ``rocksdb:///abs/dir``, ``sqlite:///abs/file.db``,
        ``postgresql+psycopg://user@host:port/db``, ``bigtable://project/instance/table`` or a
        scheme registered with :func:`embstore.register_backend`.
    dim : int, optional
        Embedding dimension; required to create, checked on reopen.
    key_type : {"int64", "bytes"}, optional
        Fixed at creation (default ``"int64"``); ``str`` keys are UTF-8 encoded.
    initializer : Initializer or str, optional
        Vector of a key on first sight (default ``Uniform(-0.05, 0.05)``).
    optimizer : Optimizer or str, optional
        Applied by ``update`` (default ``SGD(lr=0.01)``); its slots are part of the layout.
    seed : int, optional
        Seed of the initializer (default 0).
    read_only : bool
        Serving ("sandbox") mode: every write raises ``ReadOnlyError``; lookups of unknown keys
        return their initial vector without inserting.
    admission, expiry, capacity, eviction : optional
        Which unknown keys get a row, rows leaving by age, and a bound on the rows
        (``capacity`` + ``eviction``); see ``docs/training.md``.
    clock : callable, optional
        Seconds for ``last_seen``, ``ttl_seconds`` and recency eviction (default the wall
        clock); an :class:`embstore.policies.EventClock` replays a stream by event time. Not
        saved: a reopened or unpickled store uses the wall clock unless given one again.
    value_dtype : {"float32", "float16", "bfloat16", "int8"}, optional
        Storage dtype of the vectors, fixed at creation (default ``"float32"``; checked on
        reopen). Lookups return float32 either way; updates compute in float32. ``"int8"``
        (row-wise quantized, see ``export(quantize="int8")``) serves only: ``update`` raises.
    metadata : {"full", "compact"}, optional
        Bookkeeping fields kept per key, fixed at creation (default ``"full"``: ``count``,
        ``last_seen``, ``last_step``, ``version``, 32 bytes). ``"compact"`` keeps a saturating
        uint32 ``count`` and ``version``, plus ``last_seen`` / ``last_step`` only where the
        store's expiry or capacity eviction reads them (12 bytes without either).
    stochastic_rounding : bool
        Round updated 16-bit values stochastically (default True; deterministic given
        ``seed`` and the sequence of updates). ``False`` rounds to nearest, which loses steps
        smaller than half the gap between neighbouring 16-bit values.
    **options
        Layer options ``cache`` (local URL, e.g. ``"memory://"``), ``cache_capacity``,
        ``write_policy`` (``"back"``/``"through"``), ``cache_eviction`` (``"lfu"``/``"lru"``;
        ``eviction=`` next to ``cache=`` without ``capacity=`` still means it, with a
        ``DeprecationWarning``) and ``shards`` (list of URLs; see
        ``docs/cache-and-shards.md``); everything else goes to the backend (e.g.
        ``map_size`` for LMDB, ``table`` for SQL). A misspelt option raises.

    Returns
    -------
    EmbeddingStore
        Also a context manager that closes the store. A ``des://host:port[,...]`` URL gives a
        :class:`embstore.service.client.DesStore` instead: a client of DynamicEmbedding
        Workers that satisfies :class:`embstore.StoreProtocol` (options: ``token``,
        ``token_file``, ``timeout``, ``tls_root_certs``, ``key_type``, ``read_only``).
    """
    if scheme_of(url) == "des":
        return cast(EmbeddingStore, _connect(url, dim, options))
    backend, engine = open_backend(url, **options)
    return open_store(backend, dim, **engine)


def open_backend(url: str, **options: Any) -> tuple[Backend, dict[str, Any]]:
    """The first half of :func:`open`: the backend of ``url`` with the requested layers
    around it, and the engine options for :func:`open_store` (``read_only`` and the
    backend's ``reopen_options`` included). Options are those of :func:`open` (a misspelt
    one raises); the caller closes the backend if it does not hand it to :func:`open_store`.
    """
    engine, read_only, layer, backend_options = _split_options(options)
    # a misspelt option must raise, never be dropped (see embstore/options.py)
    _check_backend_options(url, backend_options, layer.get("shards"),
                           also_known=(*ENGINE_OPTIONS, "read_only", *LAYER_OPTIONS))
    return _open_backend(url, engine, read_only, layer, backend_options)


def open_store(backend: Backend, dim: int | None = None, **engine: Any) -> EmbeddingStore:
    """The second half of :func:`open`: the engine over ``backend`` (from :func:`open_backend`,
    possibly wrapped), created or checked against its metadata. The backend is closed when
    this raises."""
    return EmbeddingStore(backend, dim=dim, **engine)


def _cache_eviction_spelled_eviction(options: dict[str, Any]) -> bool:
    # Before cache_eviction=, eviction="lru"/"lfu" next to cache= and without capacity= meant
    # the cache's policy: that spelling still works, with a warning.
    return ("eviction" in options and "cache" in options and "capacity" not in options
            and "cache_eviction" not in options and isinstance(options["eviction"], str))


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], bool, dict[str, Any],
                                                      dict[str, Any]]:
    """``(engine, read_only, layer, backend)`` options from the keywords of ``open``."""
    options = dict(options)
    if _cache_eviction_spelled_eviction(options):
        warnings.warn("eviction= for the cache layer is deprecated: pass cache_eviction= "
                      "(eviction= with capacity= bounds the store itself)",
                      DeprecationWarning, stacklevel=4)
        options["cache_eviction"] = options.pop("eviction")
    engine = {k: options.pop(k) for k in ENGINE_OPTIONS if k in options}
    read_only = bool(options.pop("read_only", False))
    layer = {k: options.pop(k) for k in LAYER_OPTIONS if k in options}
    return engine, read_only, layer, options


def _open_backend(url: str, engine: dict[str, Any], read_only: bool, layer: dict[str, Any],
                  options: dict[str, Any]) -> tuple[Backend, dict[str, Any]]:
    if layer:
        backend = build_backend(url, read_only=read_only, layer=layer, options=options)
    else:
        backend = backend_class(url)(url, read_only=read_only, **options)
    engine = {**engine, "read_only": read_only,
              "reopen_options": dict(backend.reopen_options())}
    return backend, engine


def _check_backend_options(url: str, options: dict[str, Any], shards: Any = None,
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


def _connect(url: str, dim: int | None, options: dict[str, Any]) -> Any:
    """A ``des://`` client (the service needs pyarrow: the ``service`` extra)."""
    try:
        # deferred: pyarrow (Arrow Flight) is imported only for des:// URLs
        from .service.client import DesStore
    except ImportError as e:
        raise BackendUnavailableError(
            f"des:// needs pyarrow ({e.name or e}); install the 'service' extra: "
            + install_hint("service")) from e
    return DesStore(url, dim=dim, **options)


def reopen(url: str, options: dict[str, Any]) -> EmbeddingStore | UnopenedStore:
    """Reopen an existing store from its URL and reopen options (a pickled store).

    Never raises: a store that fails to reopen becomes an :class:`UnopenedStore` that raises
    the error on first use (see :mod:`embstore.engine.unpickled` for why).
    """
    try:
        backend, engine = _open_backend(url, *_split_options(options))
        return open_store(backend, **engine)
    except Exception as e:  # noqa: BLE001 - raised on first use, not inside pickle.loads
        return UnopenedStore(url, e)


services.install(opener=open, reopener=reopen)
