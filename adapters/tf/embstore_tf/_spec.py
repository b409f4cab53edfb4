"""The store a saved :class:`~embstore_tf.DynamicEmbedding` names, and how a load opens it.

A ``.keras`` file is data from elsewhere, so what its config says about the store is checked
before anything is opened (see ``docs/adapters.md``, "Hostile .keras files"):

- a ``memory://`` store (rebuilt from the rows in the file) must say ``memory://``: a file
  cannot make a load create a store anywhere else;
- a file cannot choose which persistent store a load opens: only a store or URL the user
  passes (``stores=``), or a file-based store inside the ``store_dir`` the user passes
  (:mod:`._location`); any other URL is refused before a connection is made;
- a persistent store is reopened, never created: the load first opens the URL read-only,
  which fails with ``CorruptFileError`` when no store is there, and only then (with
  ``writable=True``) reopens it writable;
- sizes and capacities the file gives are bounded (``dim``, reopen options), options that
  name other locations (``cache=``, ``shards=``) are refused, and every other malformed value
  raises :class:`~embstore.errors.CorruptFileError` in one line.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlsplit

import embstore
from embstore import StoreProtocol
from embstore.errors import (
    CorruptFileError,
    EmbstoreError,
    InvalidInputError,
    SchemaMismatchError,
    StoreNotFoundError,
)
from embstore.urls import redact_url

from ._location import check_store_location

__all__ = ["LOADING", "LoadRules", "open_store", "store_spec"]


class LoadRules(NamedTuple):
    """What the user allowed the layers being rebuilt by ``loading_stores`` / ``load_model``."""

    #: reopen persistent stores writable
    writable: bool = False
    #: {layer name or URL: open store, or a URL the user chose to open}
    stores: Mapping[str, StoreProtocol | str] = MappingProxyType({})
    #: {url: store opened by this load} (layers that shared a store share it again)
    opened: dict[str, StoreProtocol] | None = None
    #: real path of the directory whose file-based stores a file may name (None: none)
    store_dir: str | None = None


#: the rules of the ``loading_stores`` block being run (None outside one: nothing allowed)
LOADING: contextvars.ContextVar[LoadRules | None] = contextvars.ContextVar(
    "embstore_tf_loading", default=None)

#: largest ``dim`` a file may ask for (as the native format's reader)
MAX_DIM = 1 << 20
#: numeric reopen options a file may give, with their largest accepted value
_BOUNDED_OPTIONS = {
    "map_size": 1 << 44,           # LMDB: virtual, but a map beyond 16 TiB is not a real one
    "initial_capacity": 1 << 24,   # memory:// slots allocated up front
    "capacity": 1 << 31,
    "cache_capacity": 1 << 26,
    "block_cache_mb": 1 << 16,
    "bloom_bits": 64,
}
#: options naming another location: never taken from a file
_LOCATION_OPTIONS = ("cache", "shards", "path", "dir", "directory")
_MAX_OPTION_INT = 1 << 31
#: arguments the load sets itself: an option of that name in a file is malformed
_RESERVED = ("dim", "key_type", "read_only", "optimizer", "initializer", "seed")


def store_spec(store: StoreProtocol) -> dict[str, Any]:
    """What a saved layer records to reopen (or rebuild) ``store``: JSON only.

    Reopen options that are not plain JSON values (gRPC interceptors, credentials) are left
    out: pass the open store with ``load_model(..., stores={url: store})`` instead.
    """
    options: dict[str, Any] = {}
    # what embstore.open and reopen hand the store: its backend's own reopen options
    for k, v in dict(store.backend.reopen_options() or {}).items():
        try:
            json.dumps(v)
        except TypeError:
            continue
        options[k] = v
    return {
        "url": store.url,
        "persistent": bool(store.backend.persistent),
        "options": options,
        "dim": int(store.dim),
        "key_type": store.key_type,
        "optimizer": store.optimizer.config(),
        "initializer": store.initializer.config(),
        "seed": int(store.seed),
    }


def _bad(layer: str | None, msg: str) -> CorruptFileError:
    return CorruptFileError(f"saved layer {layer or '?'}: {msg}".replace("\n", " "))


def _checked_options(spec: Mapping[str, Any], layer: str | None,
                     persistent: bool) -> dict[str, Any]:
    options = spec.get("options") or {}
    if not isinstance(options, dict):
        raise _bad(layer, f"store options must be a mapping, got {type(options).__name__}")
    out: dict[str, Any] = {}
    for k, v in options.items():
        if not isinstance(k, str):
            raise _bad(layer, f"store option name {k!r} is not a string")
        if k in _RESERVED:
            raise _bad(layer, f"store option {k!r} is not a reopen option")
        if k in _LOCATION_OPTIONS and not (k == "cache" and v == "memory://"):
            raise _bad(layer, f"store option {k}={v!r} names another location; a saved "
                              "model cannot choose it (pass the open store with stores=)")
        if isinstance(v, bool) or v is None or isinstance(v, str):
            out[k] = v
        elif isinstance(v, (int, float)):
            bound = _BOUNDED_OPTIONS.get(k, _MAX_OPTION_INT)
            if not -_MAX_OPTION_INT <= v <= bound or v != v:
                raise _bad(layer, f"store option {k}={v!r} is out of bounds (at most {bound})")
            out[k] = v
        else:
            raise _bad(layer, f"store option {k} has a {type(v).__name__} value; "
                              "only strings, numbers and booleans are accepted")
    if not persistent:
        out.pop("cache", None)
    return out


def _checked_spec(spec: Any, layer: str | None) -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise _bad(layer, f"the store entry must be a mapping, got {type(spec).__name__}")
    url = spec.get("url")
    if not isinstance(url, str) or "://" not in url or len(url) > 4096:
        raise _bad(layer, f"no valid store URL (got {str(url)[:80]!r})")
    persistent = spec.get("persistent", True)
    if not isinstance(persistent, bool):
        raise _bad(layer, "'persistent' must be true or false")
    dim = spec.get("dim")
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)
                            or not 0 < dim <= MAX_DIM):
        raise _bad(layer, f"dim must be an int in [1, {MAX_DIM}], got {dim!r}")
    if spec.get("key_type", "int64") not in ("int64", "bytes"):
        raise _bad(layer, f"key_type must be 'int64' or 'bytes', got {spec.get('key_type')!r}")
    if not persistent:
        if url.split("?", 1)[0] != "memory://":
            raise _bad(layer, f"a store rebuilt from the file must be memory://, got {url!r}; "
                              "a saved model cannot create a store elsewhere")
        if dim is None:
            raise _bad(layer, "a memory:// store entry needs its dim")
        # the URL's query is the file's too: memory://?initial_capacity=... is held to the
        # bound of the option (the store refuses what is not a number)
        for k, v in parse_qsl(urlsplit(url).query):
            bound = _BOUNDED_OPTIONS.get(k)
            if bound is not None and v.strip().lstrip("-").isdigit() and int(v) > bound:
                raise _bad(layer, f"store URL option {k}={v} is out of bounds (at most {bound})")
        seed = spec.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
            raise _bad(layer, f"seed must be a non-negative int, got {seed!r}")
        for k in ("optimizer", "initializer"):
            if not isinstance(spec.get(k), dict):
                raise _bad(layer, f"{k} must be a config mapping, got {spec.get(k)!r}")
    return {**spec, "persistent": persistent,
            "options": _checked_options(spec, layer, persistent)}


def open_store(spec: Any, layer_name: str | None = None) -> StoreProtocol:
    """Open the store a saved layer names (see :func:`embstore_tf.load_model` for the rules).

    Raises
    ------
    CorruptFileError
        The entry is malformed, out of bounds, names a persistent store the user did not
        allow (``stores=`` / ``store_dir=``), or one that does not exist.
    """
    rules = LOADING.get() or LoadRules()
    url = spec.get("url") if isinstance(spec, dict) else None
    given: str | None = None  # a URL the user passed for this layer: opened as its own
    for name in (layer_name, url):
        if isinstance(name, str) and name in rules.stores:
            chosen = rules.stores[name]
            if not isinstance(chosen, str):
                return chosen
            given = chosen
            break
    spec = _checked_spec(spec, layer_name)
    url, options = spec["url"], spec["options"]
    if not spec["persistent"]:
        if given is not None:  # its rows are in the file: they fill only a memory:// copy
            raise InvalidInputError(
                f"stores= gives the URL {redact_url(given)!r} for layer {layer_name}, whose "
                "memory:// store is rebuilt from the file; pass an open store instead")
        # rebuilt from the rows in the .keras file, as the loaded model's own copy
        try:
            return embstore.open(url, dim=spec["dim"], key_type=spec["key_type"],
                                 optimizer=spec["optimizer"], initializer=spec["initializer"],
                                 seed=spec["seed"], **options)
        except EmbstoreError as e:
            raise _bad(layer_name, f"cannot rebuild its memory:// store: {e}") from e
    if given is not None:
        url = given
    else:  # the file's own URL: only where the user allowed it, before any connection
        check_store_location(url, rules.store_dir, layer_name)
    if rules.opened is not None and url in rules.opened:  # shared stores are shared again
        return rules.opened[url]
    checks = {k: spec[k] for k in ("dim", "key_type") if k in spec}
    try:
        # read-only first: it never creates anything, so a missing store is an error
        store = embstore.open(url, read_only=True, **checks, **options)
        if rules.writable:
            store.close()
            store = embstore.open(url, read_only=False, **checks, **options)
    except StoreNotFoundError as e:
        raise _bad(layer_name, f"no store at {redact_url(url)} ({e}); a load reopens stores, "
                               "it never creates one (pass stores={...} to use another)") from e
    except SchemaMismatchError:
        raise
    except EmbstoreError as e:
        raise _bad(layer_name, f"cannot reopen {redact_url(url)}: {e}") from e
    if rules.opened is not None:
        rules.opened[url] = store
    return store
