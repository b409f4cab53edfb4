"""Schema of the SQL backend (:mod:`embstore.backends.sql`): the table definitions of a store,
and the checks that an existing table or metadata row really belongs to an embstore store."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from ...errors import SchemaMismatchError

#: name of the ``<table>_meta`` row holding the id of the last restore
#: (``BulkLoader.replace``; a scan compares it around every page)
GENERATION = "generation"


def table_definitions(table_name: str, key_type: str) -> tuple[sa.Table, sa.Table, sa.Index]:
    """The data table, the ``_meta`` table and the version index of one store."""
    md = sa.MetaData()
    if key_type == "int64":
        # INTEGER PRIMARY KEY is SQLite's rowid alias: no second B-tree for the key.
        ktype: sa.types.TypeEngine[Any] = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
    else:
        from sqlalchemy.dialects.mysql import VARBINARY  # a BLOB cannot be a MySQL key

        ktype = sa.LargeBinary().with_variant(VARBINARY(767), "mysql")
    data = sa.Table(table_name, md,
                    sa.Column("k", ktype, primary_key=True, autoincrement=False),
                    sa.Column("rec", sa.LargeBinary(), nullable=False),
                    sa.Column("version", sa.BigInteger(), nullable=False))
    meta = sa.Table(table_name + "_meta", md,
                    sa.Column("name", sa.String(64), primary_key=True),
                    sa.Column("value", sa.Text(), nullable=False))
    index = sa.Index(table_name + "_version_idx", data.c.version, data.c.k)
    return data, meta, index


def index_ddl(index: sa.Index, dialect: Any) -> str:
    """``CREATE INDEX IF NOT EXISTS`` of ``index`` as text of ``dialect``."""
    return str(sa.schema.CreateIndex(index, if_not_exists=True).compile(dialect=dialect))


def create_statements(table_name: str, key_type: str, dialect: Any) -> list:
    """The DDL creating a store's tables and index: statement objects (``dialect`` None, for
    SQLAlchemy Core) or their text in ``dialect``."""
    data, meta, index = table_definitions(table_name, key_type)
    if dialect is None:
        return [sa.schema.CreateTable(data, if_not_exists=True),
                sa.schema.CreateTable(meta, if_not_exists=True),
                sa.schema.CreateIndex(index, if_not_exists=True)]
    return [*(str(sa.schema.CreateTable(t, if_not_exists=True).compile(dialect=dialect))
              for t in (data, meta)), index_ddl(index, dialect)]


def check_data_columns(safe_url: str, table_name: str, cols: dict[str, str],
                       key_type: str) -> None:
    """Refuse an existing table that is not an embstore data table of this key type."""
    if set(cols) != {"k", "rec", "version"}:
        raise SchemaMismatchError(
            f"{safe_url}: table {table_name!r} has columns {sorted(cols)}, not "
            "an embstore table (k, rec, version)"
        )
    kt = cols["k"]
    is_int = "INT" in kt
    if is_int != (key_type == "int64"):
        raise SchemaMismatchError(
            f"{safe_url}: key column is {kt}, the store has {key_type} keys")


def read_store_meta(ops: Any, safe_url: str, table_name: str) -> dict | None:
    """The store metadata in ``table_name``'s ``_meta`` table, read through the statements
    object ``ops``; ``None`` when no store exists there."""
    meta_cols = ops.columns(table_name + "_meta")
    if meta_cols is None:
        if ops.columns(table_name) is not None:
            raise SchemaMismatchError(
                f"{safe_url}: table {table_name!r} exists but is not an embstore "
                f"store (no {table_name}_meta table); choose another table name"
            )
        return None
    if set(meta_cols) != {"name", "value"}:
        raise SchemaMismatchError(
            f"{safe_url}: table {table_name}_meta is not embstore metadata")
    text = ops.meta_get()
    if text is None:
        return None
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise SchemaMismatchError(f"{safe_url}: unreadable metadata: {e}") from e
    if not isinstance(meta, dict):
        raise SchemaMismatchError(f"{safe_url}: metadata is not a JSON object")
    return meta
