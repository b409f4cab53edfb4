"""Store URLs of the SQL backend: splitting ``sqlite:///...`` / ``postgresql://...?table=``
into the SQLAlchemy URL and a validated table name, and the URL ``store.url`` reopens."""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl

from sqlalchemy.engine import make_url

from ...errors import InvalidInputError, InvalidURLError
from ...urls import check_url_text, redact_url

DEFAULT_TABLE = "embeddings"
# Identifiers are validated, then always quoted: never interpolated unchecked. 50 characters
# leave room for the "_meta" / "_version_idx" suffixes within PostgreSQL's 63.
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,49}")
_RESERVED_PREFIXES = ("sqlite_", "pg_")


def validate_table_name(name: Any) -> str:
    """Return ``name`` if it is a plain SQL identifier, else raise ``InvalidInputError``."""
    if not isinstance(name, str) or not _IDENT.fullmatch(name):
        raise InvalidInputError(
            f"table name {name!r} is not a plain identifier: use letters, digits and "
            "underscores, starting with a letter or underscore, at most 50 characters"
        )
    if name.lower().startswith(_RESERVED_PREFIXES):
        raise InvalidInputError(f"table name {name!r} uses a prefix reserved by the database")
    return name


def parse_store_url(url: str, table: str | None):
    """Split a store URL into (SQLAlchemy URL without ``table``, table name, public URL)."""
    check_url_text(url)
    try:
        u = make_url(url)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy raises ArgumentError/ValueError
        raise InvalidURLError(f"malformed SQL URL {redact_url(url)!r}: {e}") from e
    q = dict(u.query)
    in_url = q.get("table")
    if isinstance(in_url, tuple):
        raise InvalidURLError(f"{redact_url(url)!r}: 'table' given more than once")
    if in_url is None and ("table", "") in parse_qsl(url.partition("?")[2],
                                                     keep_blank_values=True):
        # SQLAlchemy drops empty query values: "?table=" would silently mean the default table
        raise InvalidURLError(f"{redact_url(url)!r}: empty table name in '?table='")
    if in_url is not None and table is not None and in_url != table:
        raise InvalidInputError(f"table={table!r} conflicts with table={in_url!r} in the URL")
    name = validate_table_name(table if table is not None else (in_url or DEFAULT_TABLE))
    u = u.difference_update_query(["table"])
    backend = u.get_backend_name()
    if backend == "postgres":  # the libpq alias SQLAlchemy no longer accepts
        u = u.set(drivername="postgresql" + u.drivername[len("postgres"):])
        backend = "postgresql"
    if backend == "postgresql" and "+" not in u.drivername:
        u = u.set(drivername="postgresql+psycopg")
    if backend == "sqlite":
        db = u.database or ""
        if not db or db == ":memory:" or db.startswith("file:"):
            raise InvalidURLError(
                f"{redact_url(url)!r}: a SQLite store needs a file path (sqlite:////abs/file.db); "
                "use memory:// for a store in process memory"
            )
        if not os.path.isabs(db):
            u = u.set(database=os.path.abspath(db))
    elif not u.host and backend != "sqlite" and not u.query.get("host"):
        raise InvalidURLError(f"{redact_url(url)!r}: no host in the URL")
    public = u.update_query_dict({"table": name}).render_as_string(hide_password=False)
    return u, name, public
