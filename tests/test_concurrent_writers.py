"""No lost updates: several writers (processes and threads) on one store.

Every writer applies a known total gradient with SGD lr=1 on zero-initialized vectors, on key
sets that overlap heavily and start out missing (so the writers also race to create rows), and
looks up one fresh shared key per step first (both writers create it: insert-if-absent). The
result is exact: every element of a key equals minus the number of updates it received, and
``count`` equals that number. The store's ``step`` is the sum of the writers' steps.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import traceback

import numpy as np
import pytest

import embstore
from embstore.errors import BackendError, LeaseLostError

from .stores import backend_available

DIM = 8
STEPS = {"memory": 40, "lmdb": 40, "rocksdb": 40, "sqlite": 30, "postgresql": 25,
         "bigtable": 10}
NKEYS = {"bigtable": 40}
TIMEOUT = 240.0  # seconds a writer process may take before the test fails


def _options(kind: str) -> dict:
    opts: dict = {"dim": DIM, "optimizer": embstore.optim.SGD(lr=1.0), "initializer": "zeros"}
    if kind in ("lmdb", "sqlite", "rocksdb"):
        opts["durable"] = False  # fsync per batch is not under test here
    return opts


def _keys_of(writer: int, nkeys: int) -> np.ndarray:
    """Writer 0 updates keys 0..n-1, writer 1 keys n/2..3n/2-1: half of them shared."""
    start = writer * (nkeys // 2)
    return np.arange(start, start + nkeys, dtype=np.int64)


def _work(store, writer: int, steps: int, nkeys: int) -> None:
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


def _check(url: str, kind: str, steps: int, nkeys: int, step_expected: int) -> None:
    keys, counts = _expected(steps, nkeys)
    with embstore.open(url, **_options(kind)) as store:
        recs, found = store.get_records(keys)
        assert found.all()
        np.testing.assert_array_equal(recs["count"], counts)
        expect = -np.repeat(counts[:, None], DIM, axis=1).astype(np.float32)
        np.testing.assert_array_equal(recs["vector"], expect)
        assert len(store) == len(keys)
        assert store.step == step_expected


def _process_writer(url: str, kind: str, writer: int, steps: int, nkeys: int, env: dict,
                    errors, start) -> None:
    os.environ.update(env)
    try:
        with embstore.open(url, **_options(kind)) as store:
            start.wait(TIMEOUT)  # both open before either writes: the runs overlap
            _work(store, writer, steps, nkeys)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        errors.put(f"writer {writer}: {traceback.format_exc()}")
        raise


def _run_processes(url: str, kind: str, steps: int, nkeys: int) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    start = ctx.Barrier(2)
    env = {k: v for k, v in os.environ.items() if k == "BIGTABLE_EMULATOR_HOST"}
    procs = [ctx.Process(target=_process_writer,
                         args=(url, kind, w, steps, nkeys, env, errors, start))
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


def _run_threads(url: str, kind: str, steps: int, nkeys: int) -> str:
    store = embstore.open(url, **_options(kind))
    errors: list[BaseException] = []

    def guarded(w: int) -> None:
        try:
            _work(store, w, steps, nkeys)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a writer thread hangs"
    assert not errors, errors
    url = store.url
    if kind == "memory":
        return store  # nothing to reopen: checked on the open store
    store.close()
    return url


@pytest.fixture
def store_url(request, tmp_path):
    """A fresh store URL of the backend named by the test's ``kind`` parameter."""
    kind = request.node.callspec.params["kind"]
    if kind == "memory":
        return "memory://"
    if kind in ("lmdb", "rocksdb"):
        if not backend_available(kind):
            pytest.skip(f"{kind} backend not available")
        return f"{kind}://{tmp_path}/store"
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/store.db"
    if kind == "postgresql":
        return request.getfixturevalue("postgres_url_factory")()
    return request.getfixturevalue("bigtable_url_factory")()


@pytest.mark.parametrize("kind", ["memory", "lmdb", "rocksdb", "sqlite", "postgresql",
                                  "bigtable"])
def test_two_threads_sharing_one_store_lose_nothing(kind, store_url):
    steps, nkeys = STEPS[kind], NKEYS.get(kind, 100)
    out = _run_threads(store_url, kind, steps, nkeys)
    if kind == "memory":
        keys, counts = _expected(steps, nkeys)
        recs, found = out.get_records(keys)
        assert found.all()
        np.testing.assert_array_equal(recs["count"], counts)
        np.testing.assert_array_equal(recs["vector"][:, 0], -counts.astype(np.float32))
        assert out.step == 4 * steps
        return
    _check(out, kind, steps, nkeys, 4 * steps)


@pytest.mark.parametrize("kind", ["lmdb", "sqlite", "postgresql", "bigtable"])
def test_two_processes_lose_nothing(kind, store_url):
    steps, nkeys = STEPS[kind], NKEYS.get(kind, 100)
    # Created first, so both writers reopen it (the creation race is not under test here).
    embstore.open(store_url, **_options(kind)).close()
    _run_processes(store_url, kind, steps, nkeys)
    _check(store_url, kind, steps, nkeys, 4 * steps)


def _open_second_writer(url: str, errors) -> None:
    try:
        embstore.open(url, **_options("rocksdb")).close()
        errors.put("opened")
    except BackendError as e:
        errors.put(f"refused: {e}")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        errors.put(f"unexpected {type(e).__name__}: {e}")


@pytest.mark.parametrize("kind", ["rocksdb"])
def test_rocksdb_refuses_a_second_writer_process(kind, store_url):
    """RocksDB admits one writing process; a second one is refused with a clear error
    while the first keeps writing exactly."""
    steps, nkeys = STEPS[kind], NKEYS.get(kind, 100)
    store = embstore.open(store_url, **_options(kind))
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    p = ctx.Process(target=_open_second_writer, args=(store_url, answers))
    p.start()
    p.join(TIMEOUT)
    if p.is_alive():
        p.kill()
    answer = answers.get(timeout=5)
    assert answer.startswith("refused:") and "one writer" in answer, answer
    _work(store, 0, steps, nkeys)
    _work(store, 1, steps, nkeys)
    store.close()
    _check(store_url, kind, steps, nkeys, 4 * steps)


def test_bigtable_conflicting_write_is_retried_not_lost(bigtable_url_factory):
    """A writer that changes a row between another writer's read and its compare-and-set
    makes that compare-and-set fail; the batch is re-read and re-applied, nothing is lost,
    and rows that already landed are not applied twice."""
    url = bigtable_url_factory()
    a = embstore.open(url, **_options("bigtable"))
    b = embstore.open(url, **_options("bigtable"))
    keys = np.arange(6, dtype=np.int64)
    a.update(keys, np.ones((6, DIM), np.float32))
    backend = a.backend
    calls = []
    real_modify = backend.modify

    def interfering(ks, fn):
        def wrapped(recs, found):
            calls.append(1)
            if len(calls) == 1:  # another writer slips in after this read
                b.update(keys[:2], np.full((2, DIM), 10, np.float32))
            return fn(recs, found)
        return real_modify(ks, wrapped)

    backend.modify = interfering
    a.update(keys, np.ones((6, DIM), np.float32))
    backend.modify = real_modify
    assert len(calls) == 2
    assert backend.stats()["cas_conflicts"] == 2
    recs, found = a.get_records(keys)
    assert found.all()
    np.testing.assert_array_equal(recs["vector"][:, 0], [-12, -12, -2, -2, -2, -2])
    np.testing.assert_array_equal(recs["count"], [3, 3, 2, 2, 2, 2])
    a.close()
    b.close()
    with embstore.open(url) as c:
        assert c.step == 3


def test_bigtable_without_check_and_set_is_a_single_writer_option(bigtable_url_factory):
    url = bigtable_url_factory()
    with embstore.open(url, check_and_set=False, **_options("bigtable")) as s:
        s.update(np.arange(3), np.ones((3, DIM), np.float32))
        assert "check_and_set" in s.backend.reopen_options()
        assert s.backend.stats().get("cas_conflicts", 0) == 0
    with embstore.open(url) as s:
        np.testing.assert_array_equal(s.lookup(np.arange(3))[:, 0], [-1, -1, -1])


def test_bigtable_compare_and_set_survives_lost_answers(bigtable_url_factory):
    """Transient errors on CheckAndMutateRow are retried, including ones raised *after* the
    server applied the mutation (the retry's predicate then fails): such a row is recognized
    on the re-read and not applied twice."""
    import grpc

    from embstore.testing.bigtable_emulator import InjectedRpcError

    class Faults(grpc.UnaryUnaryClientInterceptor):
        """The first 4 calls fail before reaching the server, the next 3 after it applied
        them (the answer is lost)."""

        def __init__(self) -> None:
            self.before = self.lost = 0
            self.armed = False
            self.lock = threading.Lock()  # calls come from several sender threads

        def intercept_unary_unary(self, continuation, details, request):
            if not (self.armed and details.method.endswith("CheckAndMutateRow")):
                return continuation(details, request)
            with self.lock:
                fail_before = self.before < 4
                self.before += fail_before
                lose = not fail_before and self.lost < 3
                self.lost += lose
            if fail_before:
                raise InjectedRpcError(grpc.StatusCode.UNAVAILABLE, "injected")
            out = continuation(details, request)
            if lose:
                out.result()  # the server applied it; the answer never arrives
                raise InjectedRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "answer lost")
            return out

    url = bigtable_url_factory()
    faults = Faults()
    with embstore.open(url, interceptors=[faults], **_options("bigtable")) as s:
        faults.armed = True
        keys = np.arange(5, dtype=np.int64)
        s.update(keys, np.ones((5, DIM), np.float32))
        s.update(keys, np.ones((5, DIM), np.float32))
        s.assign(keys[:1], np.full((1, DIM), 7, np.float32))
        assert faults.lost == 3 and faults.before == 4
        recs, found = s.get_records(keys)
        assert found.all()
        np.testing.assert_array_equal(recs["vector"][:, 0], [7, -2, -2, -2, -2])
        np.testing.assert_array_equal(recs["count"], [2, 2, 2, 2, 2])


# -- caches over a shared remote: one writer per key range, enforced --------------------------
def test_second_write_back_cache_on_the_same_keys_is_refused(tmp_path):
    from embstore._keys import key_hash64
    from embstore.layers.cache.lease import LeaseConflictError

    url = f"sqlite:///{tmp_path}/shared.db"
    embstore.open(url, **_options("sqlite")).close()
    a = embstore.open(url, cache="memory://", **_options("sqlite"))
    b = embstore.open(url, cache="memory://", **_options("sqlite"))
    a.update(np.arange(4), np.ones((4, DIM), np.float32))
    with pytest.raises(LeaseConflictError, match="writer_keys"):
        b.update(np.arange(4), np.ones((4, DIM), np.float32))
    assert b.lookup(np.arange(4), insert=False).shape == (4, DIM)  # reading is fine
    a.close()  # releases the lease
    b.update(np.arange(4), np.ones((4, DIM), np.float32))
    b.close()
    with embstore.open(url) as s:
        np.testing.assert_array_equal(s.get_records(np.arange(4))[0]["count"], [2] * 4)
        assert "writer_leases" not in s.meta

    # disjoint writer_keys: both write; a key of the other range is refused
    keys = np.arange(100, dtype=np.int64)
    owner = (key_hash64(keys) % np.uint64(2)).astype(np.int64)
    c0 = embstore.open(url, cache="memory://", writer_keys=(0, 2))
    c1 = embstore.open(url, cache="memory://", writer_keys=(1, 2))
    c0.update(keys[owner == 0], np.ones((int((owner == 0).sum()), DIM), np.float32))
    c1.update(keys[owner == 1], np.ones((int((owner == 1).sum()), DIM), np.float32))
    with pytest.raises(embstore.errors.InvalidInputError, match="route other keys"):
        c0.update(keys[owner == 1][:1], np.ones((1, DIM), np.float32))
    c0.close()
    c1.close()
    with embstore.open(url) as s:
        assert (s.get_records(keys)[0]["count"] >= 1).all()


def test_a_dead_writers_lease_expires(tmp_path):
    url = f"sqlite:///{tmp_path}/shared.db"
    embstore.open(url, **_options("sqlite")).close()
    a = embstore.open(url, cache="memory://", lease_seconds=0.2)
    a.update(np.arange(2), np.ones((2, DIM), np.float32))  # takes the lease, never closes
    import time

    time.sleep(0.3)
    with embstore.open(url, cache="memory://") as b:
        b.update(np.arange(2), np.ones((2, DIM), np.float32))
    # a comes back: its lease was taken over, so its rows must not overwrite b's (fenced)
    with pytest.raises(LeaseLostError, match="2 updated rows"):
        a.close()
    with embstore.open(url, read_only=True) as r:
        np.testing.assert_array_equal(r.get_records(np.arange(2))[0]["count"], [1, 1])


@pytest.mark.parametrize("kind", ["memory", "lmdb", "rocksdb", "sqlite", "postgresql",
                                  "bigtable"])
def test_insert_rows_never_overwrites_a_row_created_meanwhile(kind, store_url):
    """The lookup path writes new rows only where none exists by then: a writer whose read
    missed a key that another writer created and trained meanwhile leaves that row alone."""
    with embstore.open(store_url, **_options(kind)) as s:
        keys = np.arange(10, dtype=np.int64)
        s.update(keys[:4], np.ones((4, DIM), np.float32))  # "the other writer"
        template = s.writer.template()
        vectors = s.initial_vectors(keys)
        done = s.backend.insert_rows(keys, vectors, template)  # a stale lookup's insert
        if done is not None:
            np.testing.assert_array_equal(done, [False] * 4 + [True] * 6)
        recs, found = s.get_records(keys)
        assert found.all()
        np.testing.assert_array_equal(recs["count"], [1] * 4 + [0] * 6)
        np.testing.assert_array_equal(recs["vector"][:4], -np.ones((4, DIM), np.float32))


def test_metadata_merge_keeps_every_writers_share():
    """Unit check of the metadata merge: step summed, version max, expiry counter summed,
    tombstone logs united."""
    from embstore.engine.metadata_merge import merge_meta
    from embstore.policies.tombstones import TombstoneLog

    def tomb(keys, version):
        log = TombstoneLog("int64")
        log.add(np.asarray(keys, np.int64), version)
        return log.to_json()

    stored = {"step": 10, "version": 500, "key_type": "int64",
              "extra": {"policies": {"updates_since_expire": 7, "tombstones": tomb([1, 2], 400)}}}
    mine = {"step": 6, "version": 450, "key_type": "int64",
            "extra": {"policies": {"updates_since_expire": 3, "tombstones": tomb([9], 440)}}}
    out = merge_meta(stored, mine, steps=4, expire_updates=3)
    assert out["step"] == 14 and out["version"] == 500
    pol = out["extra"]["policies"]
    assert pol["updates_since_expire"] == 10
    log = TombstoneLog.from_json("int64", pol["tombstones"], 0)
    assert log.since(0)[0].tolist() == [1, 2, 9]
    # an expiry pass by this writer restarts the counter with its own count
    assert merge_meta(stored, mine, 4, None)["extra"]["policies"]["updates_since_expire"] == 3
    assert merge_meta(None, mine, 4, 3) == mine


@pytest.mark.parametrize("kind", ["memory", "lmdb", "rocksdb", "sqlite", "postgresql",
                                  "bigtable"])
def test_bytes_keys_two_threads(kind, store_url):
    store = embstore.open(store_url, key_type="bytes", **_options(kind))
    keys = [f"w{i}".encode() for i in range(30)]
    steps = 5

    def work(w: int) -> None:
        mine = keys[w * 10:w * 10 + 20]  # 10 of 20 shared
        for _ in range(steps):
            store.lookup(mine)
            store.update(mine, np.ones((20, DIM), np.float32))

    errors = []
    threads = [threading.Thread(target=lambda w=w: _guard(work, w, errors)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    recs, found = store.get_records(keys)
    assert found.all()
    expect = np.array([steps] * 10 + [2 * steps] * 10 + [steps] * 10)
    np.testing.assert_array_equal(recs["count"], expect)
    np.testing.assert_array_equal(recs["vector"][:, 0], -expect.astype(np.float32))
    store.close()


def _guard(fn, arg, errors: list) -> None:
    try:
        fn(arg)
    except BaseException as e:  # noqa: BLE001 - asserted by the caller
        errors.append(e)
