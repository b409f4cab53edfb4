"""URL scheme -> backend class, resolved lazily.

Built-in backends are registered as ``"module:Class"`` strings and imported on first use, so
``import embstore`` never pulls in lmdb, rocksdict, SQLAlchemy or the Bigtable client. Third-party
backends register through the ``embstore.backends`` entry-point group (name = scheme, value =
``"package.module:Class"``) or by calling :func:`register_backend`.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from urllib.parse import urlsplit

from .errors import (
    BackendUnavailableError,
    InvalidInputError,
    InvalidURLError,
    UnknownSchemeError,
)
from .extras import install_hint, missing_module
from .urls import redact_url

# scheme -> (target, extra that provides its dependency)
_BUILTIN: dict[str, tuple[str, str | None]] = {
    "memory": ("embstore.backends.memory:MemoryBackend", None),
    "lmdb": ("embstore.backends.lmdb:LmdbBackend", "lmdb"),
    "rocksdb": ("embstore.backends.rocksdb:RocksDBBackend", "rocksdb"),
    "sqlite": ("embstore.backends.sql.backend:SQLBackend", "sql"),
    "postgresql": ("embstore.backends.sql.backend:SQLBackend", "postgres"),
    "postgres": ("embstore.backends.sql.backend:SQLBackend", "postgres"),
    "mysql": ("embstore.backends.sql.backend:SQLBackend", "sql"),
    "bigtable": ("embstore.backends.bigtable.backend:BigtableBackend", "bigtable"),
    "sharded": ("embstore.layers.sharded:ShardedBackend", None),
}
_registry: dict[str, tuple[str | type, str | None]] = dict(_BUILTIN)
_entry_points_loaded = False


def register_backend(scheme: str, target: str | type, extra: str | None = None, *,
                     replace: bool = False) -> None:
    """Register a backend class (or a ``"module:Class"`` string) for a URL scheme.

    Parameters
    ----------
    scheme : str
        The URL scheme, e.g. ``"redis"``; for ``"postgresql+psycopg://"`` the part before ``+``.
    target : type or str
        A :class:`embstore.backends.base.Backend` subclass or its import path.
    extra : str, optional
        The optional dependency group to name when the import fails (the hint is
        ``pip install -e '.[extra]'``).
    replace : bool
        Allow replacing the backend of a scheme that is already registered (a built-in, an
        entry point or an earlier call). Without it that raises ``InvalidInputError``;
        registering the same target again is always allowed.

    Raises
    ------
    InvalidURLError
        ``scheme`` is not a valid scheme name.
    InvalidInputError
        ``scheme`` already has another backend and ``replace`` is False.
    """
    if not isinstance(scheme, str) or not scheme \
            or not scheme.replace("-", "").replace("_", "").isalnum():
        raise InvalidURLError(f"invalid scheme name {scheme!r}")
    key = scheme.lower()
    _load_entry_points()
    if key in _registry and not replace and not _same_target(_registry[key][0], target):
        raise InvalidInputError(
            f"scheme {key!r} is already registered to {_target_name(_registry[key][0])}; "
            f"pass replace=True to register_backend to replace it")
    _registry[key] = (target, extra)


def _target_name(target: str | type) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def _same_target(a: str | type, b: str | type) -> bool:
    return a is b or _target_name(a) == _target_name(b)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group="embstore.backends"):
        _registry.setdefault(ep.name.lower(), (ep.value, None))


def known_schemes() -> list[str]:
    _load_entry_points()
    return sorted(_registry)


def scheme_of(url: str) -> str:
    """The registry scheme of a URL: lower-cased, driver suffix (``+psycopg``) dropped."""
    if not isinstance(url, str) or "://" not in url:
        raise InvalidURLError(f"store URL must look like 'scheme://...', got {url!r}")
    scheme = urlsplit(url).scheme.lower()
    if not scheme:
        raise InvalidURLError(f"store URL has no scheme: {redact_url(url)!r}")
    return scheme.split("+", 1)[0]


def backend_class(url: str) -> type:
    """Resolve the backend class for ``url``, importing it on first use."""
    scheme = scheme_of(url)
    _load_entry_points()
    if scheme not in _registry:
        raise UnknownSchemeError(
            f"no backend for scheme {scheme!r} (in {redact_url(url)!r}); known schemes: "
            + ", ".join(known_schemes())
        )
    target, extra = _registry[scheme]
    if isinstance(target, type):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = missing_module(e)
        what = f"{missing!r}, which is not installed" if missing else f"a missing package ({e})"
        hint = (f"install the {extra!r} extra: {install_hint(extra)}" if extra
                else "check the backend's package")
        raise BackendUnavailableError(
            f"the {scheme!r} backend (in {redact_url(url)!r}) needs {what}; {hint}") from e
    cls: type = getattr(module, attr)
    _registry[scheme] = (cls, extra)
    return cls
