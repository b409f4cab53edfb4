"""Which persistent store a ``.keras`` file may make a load open: the user decides, not the file.

A saved :class:`~embstore_tf.DynamicEmbedding` records its store's URL. Opening whatever URL a
file names would let a hostile file make the load connect to a database host or open a local
path of its choosing, so a load opens a persistent store from the file only when

- the user passed that URL (or the layer's name) in ``stores=`` (see :mod:`._spec`), or
- it is a file-based URL (``lmdb://``, ``rocksdb://``, ``sqlite:///``) whose path, with every
  symlink resolved, lies inside the ``store_dir`` the user passed. A path with a ``..``
  component is refused outright, whatever it resolves to.

Everything here runs before any store is opened or any connection is made.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

from embstore.errors import CorruptFileError, EmbstoreError, InvalidInputError
from embstore.urls import parse_dir_url, redact_url

__all__ = ["check_store_dir", "check_store_location"]

#: schemes whose store is one local directory
_DIR_SCHEMES = ("lmdb", "rocksdb")
#: SQLAlchemy driver names of a SQLite file a file may name (the stdlib driver)
_SQLITE_DRIVERS = ("sqlite", "sqlite+pysqlite")


def check_store_dir(store_dir: str | os.PathLike[str] | None) -> str | None:
    """The real path of the ``store_dir`` a user passed (``None`` stays ``None``).

    Raises
    ------
    InvalidInputError
        ``store_dir`` is not an existing directory.
    """
    if store_dir is None:
        return None
    path = os.fspath(store_dir)
    if not isinstance(path, str) or not os.path.isdir(path):
        raise InvalidInputError(f"store_dir={store_dir!r} is not an existing directory")
    return os.path.realpath(path)


def _refusal(layer: str | None, url: str, why: str) -> CorruptFileError:
    return CorruptFileError(
        f"saved layer {layer or '?'}: the file names the store {redact_url(url)!r}, {why}; "
        "to allow it, pass stores={url: store or url} or store_dir= with the directory "
        "that holds it".replace("\n", " "))


def _sqlite_path(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url
    except ImportError as e:  # pragma: no cover - the SQL backend needs it to open anyway
        raise InvalidInputError("sqlite:// stores need SQLAlchemy") from e
    try:
        u = make_url(url)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy raises ArgumentError/ValueError
        raise InvalidInputError(f"malformed SQLite URL ({e})") from e
    if u.drivername not in _SQLITE_DRIVERS:
        raise InvalidInputError(f"driver {u.drivername!r} is not the standard SQLite driver")
    if u.host or u.username or u.password or u.port:
        raise InvalidInputError("a SQLite URL names no host")
    if set(u.query) - {"table"}:  # driver options (uri=, ...) could name other files
        raise InvalidInputError(f"query options {sorted(set(u.query) - {'table'})} are not "
                                "accepted from a file (only table=)")
    db = u.database or ""
    if not db or db == ":memory:" or db.startswith("file:"):
        raise InvalidInputError("no SQLite file path")
    return db


def _local_path(url: str) -> str | None:
    """The local path a file-based store URL names, or ``None`` for any other URL."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in _DIR_SCHEMES:
        raw = unquote(urlsplit(url).path)
    elif scheme in _SQLITE_DRIVERS:
        raw = _sqlite_path(url)
    else:
        return None
    if ".." in raw.replace("\\", "/").split("/"):
        raise InvalidInputError("the path has a '..' component")
    if scheme in _DIR_SCHEMES:
        return parse_dir_url(url, scheme)
    return os.path.abspath(raw)


def check_store_location(url: str, store_dir: str | None, layer: str | None) -> None:
    """Raise ``CorruptFileError`` unless ``url`` is a file-based store inside ``store_dir``.

    ``store_dir`` is the real path :func:`check_store_dir` returned (``None``: the user
    allowed no directory, so no URL from a file is opened).
    """
    try:
        path = _local_path(url)
    except EmbstoreError as e:
        raise _refusal(layer, url, f"which a load does not open ({e})") from e
    if path is None:
        raise _refusal(layer, url, "and a load opens no network or other store a file names")
    if store_dir is None:
        raise _refusal(layer, url, "and no store_dir was given")
    real = os.path.realpath(path)
    if os.path.commonpath([store_dir, real]) != store_dir:
        where = "" if real == path else f" (resolves to {real})"
        raise _refusal(layer, url, f"which lies outside store_dir {store_dir}{where}")
