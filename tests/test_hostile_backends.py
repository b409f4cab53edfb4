"""Hostile inputs and failure paths of the backends (issue 15): names that alias, URLs that
hide text, passwords that leak, servers that are down, hang or restart, memory that runs out,
crafted keys, forked children, NaN scores, pickles sent to a Pool, disks that fill up.

Every case is a regression test that failed before its fix. Real servers (PostgreSQL, the
Bigtable emulator) are used throughout; a fake appears only for a fault a real server cannot
produce on demand (a TCP server that accepts and never answers).
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError, InvalidURLError

DIM = 4


# -- 2: SQLite table names that differ only in case ------------------------------------------------
def test_sqlite_table_names_differing_in_case_are_refused(tmp_path):
    db = f"sqlite:///{tmp_path}/x.db"
    with embstore.open(db + "?table=Items", dim=DIM) as first:
        first.assign([1, 2], np.ones((2, DIM)))
    with pytest.raises(InvalidInputError, match="clashes with the existing 'Items'"):
        embstore.open(db + "?table=ITEMS", dim=8)
    with pytest.raises(InvalidInputError, match="ignore case"):
        embstore.open(db + "?table=items", dim=DIM)
    with embstore.open(db + "?table=Items") as again:      # the first store is untouched
        assert again.dim == DIM and len(again) == 2
    with embstore.open(db + "?table=Other", dim=8) as other:  # a distinct name still works
        assert other.dim == 8


# -- 16: URLs whose table part is empty or cut short -----------------------------------------------
@pytest.mark.parametrize("suffix", ["?table=", "?table=&x=1"])
def test_sqlite_empty_table_parameter_is_an_error(tmp_path, suffix):
    with pytest.raises(InvalidURLError, match="empty table name"):
        embstore.open(f"sqlite:///{tmp_path}/x.db{suffix}", dim=DIM)
    assert not (tmp_path / "x.db").exists()


@pytest.mark.parametrize("char", ["\n", "\r", "\x00", "\t"])
def test_control_character_in_url_is_an_error(tmp_path, char):
    with pytest.raises(InvalidURLError, match="control character"):
        embstore.open(f"sqlite:///{tmp_path}/x.db?table=abc{char}def", dim=DIM)
    assert not (tmp_path / "x.db").exists()
    with pytest.raises(InvalidURLError, match="control character"):
        embstore.open(f"bigtable://p/i/abc{char}def", dim=DIM, emulator_host="127.0.0.1:9")


# -- 15: passwords are not shown -------------------------------------------------------------------
def test_password_is_redacted_in_url_repr_and_errors_but_kept_for_pickling(postgres_server):
    import psycopg

    with psycopg.connect(postgres_server.dsn, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS hostile_pw")
        conn.execute("CREATE ROLE hostile_pw LOGIN PASSWORD 's3cret-pw' SUPERUSER")
    url = (f"postgresql+psycopg://hostile_pw:s3cret-pw@{postgres_server.host}:"
           f"{postgres_server.port}/{postgres_server.dbname}?table=t_hostile_pw")
    with embstore.open(url, dim=DIM) as s:
        s.assign([1], np.ones((1, DIM)))
        assert "s3cret" not in s.url and "hostile_pw:***@" in s.url
        assert "s3cret" not in repr(s)
        clone = pickle.loads(pickle.dumps(s))   # the pickle keeps what reopening needs
        try:
            assert clone.lookup([1], insert=False).tolist() == [[1.0] * DIM]
        finally:
            clone.close()
    bad = url.replace("@", "@nohost.invalid.", 1).replace("?table", "?connect_timeout=2&table")
    with pytest.raises(embstore.errors.EmbstoreError) as info:
        embstore.open(bad, dim=DIM)
    assert "s3cret" not in str(info.value)


def test_redact_url_and_text():
    from embstore._urls import redact_text, redact_url
    from embstore.layers.sharded import sharded_url

    assert redact_url("postgresql://u:p@ss@h/db?table=t") == "postgresql://u:***@h/db?table=t"
    assert redact_url("postgresql://u@h/db?password=zz") == "postgresql://u@h/db?password=***"
    nested = redact_url(sharded_url(["postgresql://a:pw@h/db?table=x", "lmdb:///tmp/a"]))
    assert "pw" not in nested.replace("%3A***%40", "") and "***" in nested
    assert redact_url("bigtable://p/i/t") == "bigtable://p/i/t"
    text = "cannot open 'postgresql://u:hunter2@h/db' (shard 'x?password=hunter2')"
    assert "hunter2" not in redact_text(text)


def test_cli_error_does_not_print_the_password(tmp_path):
    for url in ("postgresql+psycopg://u:hunter2@/db?table=t",          # quoted in the error
                "postgresql+psycopg://u:hunter2@127.0.0.1:9/db?connect_timeout=2&table=t"):
        r = subprocess.run([sys.executable, "-m", "embstore", "info", url], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode != 0 and "embstore: error:" in r.stderr
        assert "hunter2" not in r.stderr + r.stdout
