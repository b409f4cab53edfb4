"""``embstore.open``: URL -> backend -> engine."""

from __future__ import annotations

from typing import Any

from ._options import ENGINE_OPTIONS, check_backend_options
from .registry import backend_class
from .store import EmbeddingStore

_ENGINE_OPTIONS = ("dim", "key_type", "initializer", "optimizer", "seed", "admission", "expiry",
                   "capacity")


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
    **options
        Engine options: ``key_type``, ``initializer``, ``optimizer``, ``seed``,
        ``read_only``, ``admission``, ``expiry``, ``capacity`` + ``eviction`` (store bound;
        see ``docs/training.md``); layer options ``cache`` (local URL, e.g. ``"memory://"``),
        ``cache_capacity``, ``write_policy`` (``"back"``/``"through"``), ``eviction``
        (``"lru"``/``"lfu"``) and ``shards`` (list of URLs; see ``docs/cache-and-shards.md``);
        everything else goes to the backend (e.g. ``map_size`` for LMDB, ``table`` for SQL).

    Returns
    -------
    EmbeddingStore
        Also a context manager that closes the store.
    """
    engine = {k: options.pop(k) for k in _ENGINE_OPTIONS if k in options}
    if "eviction" in options and ("capacity" in engine or not isinstance(options["eviction"], str)
                                  or "cache" not in options):
        # eviction= belongs to the store's capacity bound unless it configures a cache layer.
        engine["eviction"] = options.pop("eviction")
    read_only = bool(options.pop("read_only", False))
    from .layers import LAYER_OPTIONS, build_backend

    layer = {k: options.pop(k) for k in LAYER_OPTIONS if k in options}
    # a misspelt option must raise, never be dropped (see embstore/_options.py)
    check_backend_options(url, options, layer.get("shards"),
                          also_known=(*ENGINE_OPTIONS, *LAYER_OPTIONS))
    if layer:
        backend = build_backend(url, read_only=read_only, layer=layer, options=options)
    else:
        backend = backend_class(url)(url, read_only=read_only, **options)
    reopen = dict(backend.reopen_options())
    return EmbeddingStore(backend, dim=dim, read_only=read_only, reopen_options=reopen, **engine)
