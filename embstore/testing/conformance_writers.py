"""Opt-in conformance tests: several writers (threads, processes) on one store lose nothing.

Every writer applies a known total gradient with SGD lr=1 on zero-initialized vectors, on key
sets that overlap heavily and start out missing (so the writers also race to create rows), and
looks up one fresh shared key per step first (both writers create it: insert-if-absent). The
result is exact: every element of a key equals minus the number of updates it received, and
``count`` equals that number. The store's ``step`` is the sum of the writers' steps.

Subclass :class:`SeveralWritersConformance` and provide a ``url_factory`` fixture (a callable
returning a fresh, empty store URL per call), as for
:class:`~embstore.testing.conformance.StoreConformance`::

    class TestMyBackendWriters(SeveralWritersConformance):
        several_processes = True      # other processes may write the same store at once

        @pytest.fixture
        def url_factory(self, tmp_path):
            return lambda: f"mine://{tmp_path}/store"
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import embstore
from embstore.errors import BackendError

DIM = 8
TIMEOUT = 240.0  # seconds a writer may take before the test fails


def _keys_of(writer: int, nkeys: int) -> np.ndarray:
    """Writer 0 updates keys 0..n-1, writer 1 keys n/2..3n/2-1: half of them shared."""
    start = writer * (nkeys // 2)
    return np.arange(start, start + nkeys, dtype=np.int64)


def write_steps(store: Any, writer: int, steps: int, nkeys: int) -> None:
    """One writer's share of the work (run by a thread or a spawned process)."""
    keys = _keys_of(writer, nkeys)
    ones = np.ones((nkeys, DIM), np.float32)
    for i in range(steps):
        fresh = np.array([100_000 + i], dtype=np.int64)  # both writers create it, once
        store.lookup(fresh)
        store.update(fresh, np.ones((1, DIM), np.float32))
        store.update(keys, ones)


def _expected(steps: int, nkeys: int) -> tuple[np.ndarray, np.ndarray]:
    counts: dict[int, int] = {}
    for w in (0, 1):
        for k in _keys_of(w, nkeys).tolist():
            counts[k] = counts.get(k, 0) + steps
    for i in range(steps):
        counts[100_000 + i] = 2
    keys = np.array(sorted(counts), dtype=np.int64)
    return keys, np.array([counts[k] for k in keys.tolist()], dtype=np.int64)


def _check(store: Any, steps: int, nkeys: int) -> None:
    keys, counts = _expected(steps, nkeys)
    recs, found = store.get_records(keys)
    assert found.all()
    np.testing.assert_array_equal(recs["count"], counts)
    expect = -np.repeat(counts[:, None], DIM, axis=1).astype(np.float32)
    np.testing.assert_array_equal(recs["vector"], expect)
    assert len(store) == len(keys)
    assert store.step == 4 * steps


def process_writer(url: str, options: dict, writer: int, steps: int, nkeys: int, env: dict,
                   errors: Any, start: Any) -> None:
    """Entry point of a spawned writer process (module level: ``spawn`` imports it)."""
    os.environ.update(env)
    try:
        with embstore.open(url, **options) as store:
            start.wait(TIMEOUT)  # both open before either writes: the runs overlap
            write_steps(store, writer, steps, nkeys)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        errors.put(f"writer {writer}: {traceback.format_exc()}")
        raise


def open_second_writer(url: str, options: dict, answers: Any) -> None:
    """Entry point of a spawned process that tries to open a store for writing."""
    try:
        embstore.open(url, **options).close()
        answers.put("opened")
    except BackendError as e:
        answers.put(f"refused: {e}")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        answers.put(f"unexpected {type(e).__name__}: {e}")


def run_threads(work: Callable[[int], None], n: int = 2) -> None:
    """``work(0) .. work(n - 1)`` on ``n`` threads at once; fails on a raise or a hang."""
    errors: list[BaseException] = []

    def guarded(w: int) -> None:
        try:
            work(w)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a writer thread hangs"
    assert not errors, errors


class SeveralWritersConformance:
    """Several writers on one store; see the module docstring."""

    #: other processes may open the same store for writing while this one writes
    several_processes: bool = False
    #: steps per writer and keys per writer (a slow backend runs fewer)
    writer_steps: int = 40
    writer_keys: int = 100
    #: passed to every open besides the SGD optimizer (``{"durable": False}``: fsync per batch
    #: is not under test here)
    writer_options: dict[str, Any] = {}

    @pytest.fixture
    def url_factory(self):  # pragma: no cover - subclasses provide it
        raise NotImplementedError("subclasses define a url_factory fixture")

    def writer_open_options(self) -> dict[str, Any]:
        return {"dim": DIM, "optimizer": embstore.optim.SGD(lr=1.0), "initializer": "zeros",
                **self.writer_options}

    def test_two_threads_sharing_one_store_lose_nothing(self, url_factory):
        url, steps, nkeys = url_factory(), self.writer_steps, self.writer_keys
        store = embstore.open(url, **self.writer_open_options())
        persistent = store.backend.persistent
        try:
            run_threads(lambda w: write_steps(store, w, steps, nkeys))
            _check(store, steps, nkeys)
        finally:
            store.close()
        if persistent:
            with embstore.open(url, **self.writer_open_options()) as again:
                _check(again, steps, nkeys)

    def test_two_processes_lose_nothing(self, url_factory):
        if not self.several_processes:
            pytest.skip("the backend admits one writing process (several_processes is False)")
        url, steps, nkeys = url_factory(), self.writer_steps, self.writer_keys
        options = self.writer_open_options()
        # Created first, so both writers reopen it (the creation race is not under test here).
        embstore.open(url, **options).close()
        ctx = mp.get_context("spawn")
        errors = ctx.Queue()
        start = ctx.Barrier(2)
        env = {k: v for k, v in os.environ.items() if k == "BIGTABLE_EMULATOR_HOST"}
        procs = [ctx.Process(target=process_writer,
                             args=(url, options, w, steps, nkeys, env, errors, start))
                 for w in (0, 1)]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(TIMEOUT)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        msgs = []
        while not errors.empty():
            msgs.append(errors.get_nowait())
        assert not msgs, "\n".join(msgs)
        assert [p.exitcode for p in procs] == [0, 0], "a writer process died or timed out"
        with embstore.open(url, **options) as store:
            _check(store, steps, nkeys)

    def test_a_second_writer_process_is_refused(self, url_factory):
        """A backend that admits one writing process refuses a second one with a clear error
        while the first keeps writing exactly."""
        if self.several_processes:
            pytest.skip("the backend admits several writing processes")
        url, steps, nkeys = url_factory(), self.writer_steps, self.writer_keys
        options = self.writer_open_options()
        store = embstore.open(url, **options)
        if not store.backend.persistent:
            store.close()
            pytest.skip("a store of one process (not persistent)")
        ctx = mp.get_context("spawn")
        answers = ctx.Queue()
        p = ctx.Process(target=open_second_writer, args=(url, options, answers))
        p.start()
        p.join(TIMEOUT)
        if p.is_alive():
            p.kill()
        answer = answers.get(timeout=5)
        assert answer.startswith("refused:") and "one writer" in answer, answer
        write_steps(store, 0, steps, nkeys)
        write_steps(store, 1, steps, nkeys)
        store.close()
        with embstore.open(url, **options) as again:
            _check(again, steps, nkeys)

    def test_insert_rows_never_overwrites_a_row_created_meanwhile(self, url_factory):
        """The lookup path writes new rows only where none exists by then: a writer whose read
        missed a key that another writer created and trained meanwhile leaves that row alone."""
        with embstore.open(url_factory(), **self.writer_open_options()) as s:
            keys = np.arange(10, dtype=np.int64)
            s.update(keys[:4], np.ones((4, DIM), np.float32))  # "the other writer"
            template = s.layout.empty(1)  # a fresh row: zero count, no slots under SGD
            vectors = s.layout.encode_vectors(s.initial_vectors(keys))
            done = s.backend.insert_rows(keys, vectors, template)  # a stale lookup's insert
            if done is not None:
                np.testing.assert_array_equal(done, [False] * 4 + [True] * 6)
            recs, found = s.get_records(keys)
            assert found.all()
            np.testing.assert_array_equal(recs["count"], [1] * 4 + [0] * 6)
            np.testing.assert_array_equal(recs["vector"][:4], -np.ones((4, DIM), np.float32))

    def test_bytes_keys_two_threads(self, url_factory):
        store = embstore.open(url_factory(), key_type="bytes", **self.writer_open_options())
        keys = [f"w{i}".encode() for i in range(30)]
        steps = 5

        def work(w: int) -> None:
            mine = keys[w * 10:w * 10 + 20]  # 10 of 20 shared
            for _ in range(steps):
                store.lookup(mine)
                store.update(mine, np.ones((20, DIM), np.float32))

        try:
            run_threads(work)
            recs, found = store.get_records(keys)
            assert found.all()
            expect = np.array([steps] * 10 + [2 * steps] * 10 + [steps] * 10)
            np.testing.assert_array_equal(recs["count"], expect)
            np.testing.assert_array_equal(recs["vector"][:, 0], -expect.astype(np.float32))
        finally:
            store.close()
