"""pytest plugin: the Bigtable emulator for the test session (loaded by tests/conftest.py).

Fixtures (a contract other test modules rely on):

``bigtable_emulator``
    session-scoped :class:`~embstore.testing.bigtable_emulator.EmulatorHandle`; sets
    ``BIGTABLE_EMULATOR_HOST`` for the session. Do not stop or restart it.
``bigtable_url_factory``
    function-scoped; a callable returning a fresh ``bigtable://test-project/test-instance/tN``
    URL (a new, empty table) on each call.
``bigtable_private_emulator``
    function-scoped handle of an emulator of the test's own, free to kill and restart.
    Pass ``emulator_host=handle.host`` to ``embstore.open``.

The emulator keeps every overwritten cell version in memory: keep test tables small.
"""

from __future__ import annotations

import itertools
import os

import pytest

_tables = itertools.count()


def _start():
    # Imported here: this plugin loads for every test run, also without the bigtable extra.
    try:
        from embstore.testing.bigtable_emulator import find_emulator, start_emulator
    except ImportError as e:
        pytest.skip(f"google-cloud-bigtable is not installed: {e}")
    try:
        binary = find_emulator()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return start_emulator(binary=binary)


@pytest.fixture(scope="session")
def bigtable_emulator():
    handle = _start()
    old = os.environ.get("BIGTABLE_EMULATOR_HOST")
    os.environ["BIGTABLE_EMULATOR_HOST"] = handle.host
    try:
        yield handle
    finally:
        if old is None:
            os.environ.pop("BIGTABLE_EMULATOR_HOST", None)
        else:
            os.environ["BIGTABLE_EMULATOR_HOST"] = old
        handle.stop()


@pytest.fixture
def bigtable_url_factory(bigtable_emulator):
    # The pid keeps names unique should two test processes ever share one emulator.
    def make() -> str:
        return f"bigtable://test-project/test-instance/t{os.getpid()}x{next(_tables)}"

    return make


@pytest.fixture
def bigtable_private_emulator():
    handle = _start()
    try:
        yield handle
    finally:
        handle.stop()
