"""SQL row store (SQLite, PostgreSQL, any SQLAlchemy URL): :class:`SQLBackend` and its modules.

:mod:`.backend` is the backend; :mod:`.url` parses store URLs, :mod:`.connection` owns the
engine/connection and retries, :mod:`.schema` the table, :mod:`.rows` row packing, :mod:`.ops`
the batch statements, :mod:`.modify` read-modify-write, :mod:`.bulk` bulk loads, :mod:`.core`
dialect-neutral statements and :mod:`.sqlite` SQLite specifics.
"""

from __future__ import annotations

from .backend import SQLBackend
from .url import DEFAULT_TABLE, validate_table_name

__all__ = ["DEFAULT_TABLE", "SQLBackend", "validate_table_name"]
