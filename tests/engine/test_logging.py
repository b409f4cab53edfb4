"""logging.getLogger("embstore") events (silent by default) and the metrics hook."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import numpy as np
import pytest

import embstore
from embstore.errors import BackendError, InvalidInputError
from embstore.layers.cache.write_behind import WriteBehind

DIM = 4


@pytest.fixture
def events():
    got: list[tuple[str, dict]] = []
    previous = embstore.set_metrics_hook(lambda name, fields: got.append((name, fields)))
    yield got
    embstore.set_metrics_hook(previous)


def _records(caplog, logger):
    return [r for r in caplog.records if r.name == logger]


def test_nothing_is_printed_by_default(tmp_path):
    # a warning from an embstore module with logging left unconfigured: no lastResort output
    code = ("import logging, embstore\n"
            "from embstore.log import event\n"
            "event(logging.getLogger('embstore.backends.bigtable'), logging.WARNING, 'x', 'boo')\n"
            "logging.getLogger('embstore.layers.cache').error('boo')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "" and run.stderr == ""
    assert any(isinstance(h, logging.NullHandler)
               for h in logging.getLogger("embstore").handlers)


def test_lmdb_map_growth_is_logged(tmp_path, caplog, events):
    caplog.set_level(logging.INFO, logger="embstore")
    with embstore.open(f"lmdb://{tmp_path}/s", dim=64, map_size=1 << 16, durable=False) as s:
        s.assign(np.arange(5000), np.ones((5000, 64), np.float32))
        grows = s.stats()["map_grows"]
    recs = _records(caplog, "embstore.backends.lmdb")
    assert grows >= 1 and len(recs) == grows
    assert all(r.levelno == logging.INFO and "grew" in r.getMessage() for r in recs)
    sizes = [f["map_size"] for name, f in events if name == "lmdb.map_grow"]
    assert len(sizes) == grows and sizes == sorted(sizes)


def test_write_behind_flush_and_failure_are_logged(caplog, events):
    caplog.set_level(logging.DEBUG, logger="embstore")
    calls = []

    def put(keys, recs):  # a remote that fails once (a fault a real server won't give on demand)
        calls.append(len(keys))
        if len(calls) == 1:
            raise ConnectionError("remote down")

    wb = WriteBehind(put, retry_min=0.01, retry_max=0.05)
    wb.submit(np.arange(3), np.zeros(3))
    for _ in range(200):  # the writer retries by itself; drain raises while it has not landed
        try:
            wb.drain()
            break
        except BackendError:
            time.sleep(0.01)
    wb.submit(np.arange(3, 5), np.zeros(2))
    wb.drain()
    wb.close()
    assert calls == [3, 3, 2]
    recs = _records(caplog, "embstore.layers.cache.write_behind")
    msgs = [r.getMessage() for r in recs]
    assert any("failed (remote down)" in m for m in msgs)
    assert [r.levelno for r in recs if "failed (" in r.getMessage()] == [logging.WARNING]
    assert any("the remote is back; 3 pending rows written after 1 failed" in m for m in msgs)
    assert any("wrote 2 evicted rows" in m for m in msgs)
    assert [n for n, _ in events] == ["write_behind.failed", "write_behind.flushed",
                                      "write_behind.recovered", "write_behind.flushed"]


def test_store_eviction_is_logged(caplog, events):
    caplog.set_level(logging.INFO, logger="embstore")
    with embstore.open("memory://", dim=DIM, capacity=100, eviction="lru") as s:
        for i in range(5):
            s.lookup(np.arange(i * 100, (i + 1) * 100))
        evicted = s.stats()["evictions"]
    assert evicted > 0
    assert sum(f["rows"] for n, f in events if n == "store.evicted") == evicted
    assert any("evicted" in r.getMessage() for r in _records(caplog, "embstore.policies.runtime"))


def test_cache_evictions_are_debug_events(tmp_path, caplog, events):
    caplog.set_level(logging.DEBUG, logger="embstore")
    with embstore.open(f"lmdb://{tmp_path}/r", dim=DIM, durable=False, cache="memory://",
                       cache_capacity=50, write_behind=False) as s:
        for i in range(10):
            s.lookup(np.arange(i * 50, (i + 1) * 50))
    assert any(n == "cache.evicted" for n, _ in events)
    assert all(r.levelno == logging.DEBUG for r in _records(caplog, "embstore.layers.cache"))


def test_bigtable_retries_and_recovery_are_logged(bigtable_url_factory, caplog, events):
    from embstore.testing.bigtable_emulator import FaultInjector

    caplog.set_level(logging.DEBUG, logger="embstore")
    url = bigtable_url_factory()
    inj = FaultInjector(failures=0, methods=["MutateRows"])
    # batched MutateRows writes (not the compare-and-set path)
    s = embstore.open(url, dim=DIM, interceptors=[inj], retry_deadline=10.0,
                      check_and_set=False)
    inj.failures = 3
    s.assign(np.arange(10), np.ones((10, DIM), np.float32))
    s.close()
    recs = _records(caplog, "embstore.backends.bigtable")
    warnings = [r for r in recs if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "retry 1" in warnings[0].getMessage()  # first retry only
    assert sum(1 for n, _ in events if n == "bigtable.retry") == 3
    assert ("bigtable.recovered", {"op": "write", "retries": 3}) in events or any(
        n == "bigtable.recovered" and f["retries"] == 3 for n, f in events)


def test_a_broken_hook_never_breaks_a_write(caplog):
    def bad(name, fields):
        raise RuntimeError("hook bug")

    previous = embstore.set_metrics_hook(bad)
    try:
        with embstore.open("memory://", dim=DIM, capacity=10) as s:
            s.lookup(np.arange(100))
            assert len(s) <= 10
    finally:
        embstore.set_metrics_hook(previous)
    assert any("metrics hook failed" in r.getMessage() for r in caplog.records)
    with pytest.raises(InvalidInputError):
        embstore.set_metrics_hook(42)
