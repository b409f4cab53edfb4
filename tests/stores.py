"""Store URLs shared by tests that run one scenario on memory, LMDB and Bigtable stores.

Registered as a pytest plugin by ``tests/conftest.py``: a test that takes
``any_store_url_factory`` runs once per backend.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest


def run_in_threads(work: Callable[[int], None], n: int = 4) -> list[BaseException]:
    """Run ``work(0) .. work(n - 1)`` on ``n`` threads at once; return what they raised."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 - handed to the test to assert on
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def backend_available(scheme: str) -> bool:
    """True when the backend for ``scheme`` imports (its extra is installed)."""
    try:
        from embstore.registry import backend_class

        backend_class(f"{scheme}://x")
        return True
    except Exception:  # noqa: BLE001 - missing module or extra: the test skips
        return False


@pytest.fixture(params=["memory", "lmdb", "bigtable"])
def any_store_url_factory(request, tmp_path):
    counter = itertools.count()
    if request.param == "memory":
        return lambda: "memory://"
    if request.param == "lmdb":
        if not backend_available("lmdb"):
            pytest.skip("lmdb backend not available")
        return lambda: f"lmdb://{tmp_path}/s{next(counter)}"
    try:
        return request.getfixturevalue("bigtable_url_factory")
    except pytest.FixtureLookupError:
        pytest.skip("bigtable fixtures not available")


@pytest.fixture
def new_store_url(request, tmp_path):
    """new_store_url(kind) -> a fresh, empty store URL of that built-in backend (a name of
    ``tests/builtin_backends.py``: "memory", "lmdb", "rocksdb", "sqlite", "postgres",
    "bigtable"); skips cleanly when the backend or its server is not available."""
    from tests.builtin_backends import BY_NAME

    factories: dict[str, Callable[[], str]] = {}

    def make(kind: str) -> str:
        if kind not in factories:
            factories[kind] = BY_NAME[kind].url_factory(request, tmp_path)
        return factories[kind]()

    return make
