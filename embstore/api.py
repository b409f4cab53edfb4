"""Opening and reopening stores, in one place: ``embstore.open`` (URL -> backend -> engine)
and :func:`reopen` (what a pickled store comes back through).

Importing this module hands the lower layers what they need from it (see
:mod:`embstore.engine.services`): the transfers get :func:`open` to create a store, a pickled
store gets :func:`reopen`.
"""

from __future__ import annotations

from typing import Any, cast

from . import transfer  # noqa: F401 - installs the store's export/import (engine.services)
from .engine import services
from .engine.opening import ENGINE_OPTIONS, check_backend_options, open_backend, split_options
from .engine.unpickled import UnopenedStore
from .errors import BackendUnavailableError
from .extras import install_hint
from .layers import LAYER_OPTIONS
from .registry import scheme_of
from .store import EmbeddingStore


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
        ``cache_capacity``, ``write_policy`` (``"back"``/``"through"``), ``cache_eviction``
        (``"lfu"``/``"lru"``; ``eviction=`` next to ``cache=`` without ``capacity=`` still
        means it, with a ``DeprecationWarning``) and ``shards`` (list of URLs; see
        ``docs/cache-and-shards.md``); everything else goes to the backend (e.g.
        ``map_size`` for LMDB, ``table`` for SQL).

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
    engine, read_only, layer, backend_options = split_options(options)
    # a misspelt option must raise, never be dropped (see embstore/options.py)
    check_backend_options(url, backend_options, layer.get("shards"),
                          also_known=(*ENGINE_OPTIONS, "read_only", *LAYER_OPTIONS))
    backend = open_backend(url, read_only=read_only, layer=layer, options=backend_options)
    reopen = dict(backend.reopen_options())
    return EmbeddingStore(backend, dim=dim, read_only=read_only, reopen_options=reopen, **engine)


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
        engine, read_only, layer, backend_options = split_options(options)
        backend = open_backend(url, read_only=read_only, layer=layer, options=backend_options)
        return EmbeddingStore(backend, read_only=read_only,
                              reopen_options=dict(backend.reopen_options()), **engine)
    except Exception as e:  # noqa: BLE001 - raised on first use, not inside pickle.loads
        return UnopenedStore(url, e)


services.install(opener=open, reopener=reopen)
