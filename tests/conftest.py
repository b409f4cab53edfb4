"""Shared fixtures. Real servers (PostgreSQL, the Bigtable emulator) are started once per
session by the plugins below, on free loopback ports, and stopped by PID."""

from __future__ import annotations

import itertools

import pytest

pytest_plugins = ["tests.stores"] + [
    p for p in ("tests.fixtures_postgres", "tests.fixtures_bigtable")
    if __import__("importlib.util").util.find_spec(p) is not None
]


@pytest.fixture
def fresh_name():
    """Unique short names within a test (for table names, directories...)."""
    counter = itertools.count()
    return lambda prefix="s": f"{prefix}{next(counter)}"
