"""Incremental sync (changes_since, delta export/import with deletions), read-only serving,
checkpoint/restore that resumes training bit for bit."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import multiprocessing as mp

import numpy as np
import pytest

import embstore
from embstore.errors import ReadOnlyError, StoreNotFoundError
from embstore.optim import FTRL, Adagrad, Adam
from embstore.policies import Expiry, FrequencyCutoff, ProbabilisticAdmission
from embstore.policies.tombstones import TombstoneLog
from tests.stores import backend_available

DIM = 8


@pytest.fixture
def lmdb_url(tmp_path):
    if not backend_available("lmdb"):
        pytest.skip("lmdb backend not available")
    counter = itertools.count()
    return lambda: f"lmdb://{tmp_path}/l{next(counter)}"


def table(store) -> dict:
    out = {}
    for keys, recs in store.records(batch_size=101):
        for k, r in zip(keys.tolist(), recs):
            out[k] = r.tobytes()
    return out


def batches(seed: int, n: int, size: int = 64, vocab: int = 400):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        keys = rng.integers(0, vocab, size).astype(np.int64)
        yield keys, rng.normal(0, 0.1, (size, DIM)).astype(np.float32)


# -- incremental sync --------------------------------------------------------------------------
def test_changes_since_streams_exactly_the_touched_keys(any_store_url_factory):
    s = embstore.open(any_store_url_factory(), dim=DIM, optimizer=Adagrad(lr=0.1))
    try:
        s.lookup(np.arange(100))
        v = s.version
        touched = np.array([3, 5, 99, 150, 151])
        s.update(touched, np.ones((5, DIM), np.float32))
        s.assign([7], np.zeros((1, DIM), np.float32))
        got = set()
        for keys, recs in s.changes_since(v, batch_size=2):
            got.update(keys.tolist())
            assert (recs["version"] > v).all()
        assert got == {3, 5, 7, 99, 150, 151}
        assert sum(len(k) for k, _ in s.changes_since(s.version)) == 0
    finally:
        s.close()


def test_delta_export_import_brings_serving_copy_to_same_state(any_store_url_factory, tmp_path):
    train = embstore.open(any_store_url_factory(), dim=DIM, optimizer=Adagrad(lr=0.1))
    serve = embstore.open(any_store_url_factory(), dim=DIM, optimizer=Adagrad(lr=0.1))
    try:
        for k, g in batches(0, 5, vocab=2000):
            train.update(k, g)
        v = train.version
        assert train.export(tmp_path / "full.emb") == len(train)
        serve.import_(tmp_path / "full.emb")
        assert table(serve) == table(train)
        for rnd in range(2):
            for k, g in batches(10 + rnd, 4, vocab=2000):
                train.update(k, g)
            train.delete(np.arange(rnd * 20, rnd * 20 + 10))          # explicit deletes
            train.update([rnd * 20 + 1], np.ones((1, DIM), np.float32))  # re-created after
            train.expire(ttl_steps=6)                                   # expiry deletes too
            gone, complete = train.deletions_since(v)
            assert complete and len(gone) >= 9
            path = tmp_path / f"delta{rnd}.emb"
            n = train.export(path, since=v)
            assert n < len(train)  # a delta, not a full copy
            v = train.version
            serve.import_(path)
            assert table(serve) == table(train)
    finally:
        train.close()
        serve.close()


def test_tombstones_survive_reopen_and_report_incompleteness(lmdb_url):
    url = lmdb_url()
    s = embstore.open(url, dim=DIM)
    s.lookup(np.arange(10))
    v = s.version
    s.delete([1, 2])
    s.close()
    s = embstore.open(url)
    gone, complete = s.deletions_since(v)
    assert gone.tolist() == [1, 2] and complete
    s.close()
    log = TombstoneLog("int64", max_entries=4)
    for i in range(1, 6):
        log.add(np.array([i]), version=i * 10)
    keys, complete = log.since(0)
    assert not complete and set(keys.tolist()) <= {1, 2, 3, 4, 5}
    keys, complete = log.since(40)
    assert complete and keys.tolist() == [5]


# -- read-only serving -------------------------------------------------------------------------
def _serve(url: str) -> tuple[int, float]:
    import numpy as np

    import embstore

    with embstore.open(url, read_only=True) as s:
        v = s.lookup(np.arange(200), insert=True)  # read-only: never inserts
        return len(s), float(v[:100].sum())


def test_read_only_serving(lmdb_url):
    url = lmdb_url()
    with embstore.open(url, dim=DIM, optimizer=Adam(lr=0.01)) as s:
        s.update(np.arange(100), np.ones((100, DIM), np.float32))
        expected = float(s.lookup(np.arange(100)).sum())
    ro = embstore.open(url, read_only=True)
    try:
        for write in (lambda: ro.update([1], np.ones((1, DIM))),
                      lambda: ro.assign([1], np.ones((1, DIM))),
                      lambda: ro.delete([1]),
                      lambda: ro.expire(ttl_steps=1),
                      lambda: ro.import_(b"")):
            with pytest.raises(ReadOnlyError):
                write()
        before = ro.get_records(np.arange(100))[0].tobytes()
        v = ro.lookup(np.arange(150, 160))  # unknown keys: default, nothing written
        np.testing.assert_array_equal(v, ro.initial_vectors(np.arange(150, 160)))
        assert len(ro) == 100 and not ro.contains(np.arange(150, 160)).any()
        assert ro.get_records(np.arange(100))[0].tobytes() == before
        # Many read-only openers at once, in other processes, while this one stays open.
        with cf.ProcessPoolExecutor(3, mp_context=mp.get_context("spawn")) as pool:
            results = list(pool.map(_serve, [url] * 3))
        for n, total in results:
            assert n == 100 and abs(total - expected) < 1e-3
    finally:
        ro.close()
    with pytest.raises(StoreNotFoundError):
        embstore.open(lmdb_url(), read_only=True)


# -- checkpoint / restore ----------------------------------------------------------------------
POLICIES = [
    (lambda: Adam(lr=0.01), lambda: FrequencyCutoff(2)),
    (lambda: FTRL(alpha=0.1, l1=0.01, l21=0.001), lambda: ProbabilisticAdmission(0.5, seed=4)),
]


def _train(store, stream):
    for k, g in stream:
        store.lookup(k)
        store.update(k, g)


def _learned(store) -> dict:
    out = {}
    names = ("vector",) + store.layout.slot_names + ("count", "last_step")
    for keys, recs in store.records():
        for k, r in zip(keys.tolist(), recs):
            out[k] = b"".join(np.ascontiguousarray(r[n]).tobytes() for n in names)
    return out


@pytest.mark.parametrize("opt, adm", POLICIES, ids=["adam-cutoff", "ftrl-probabilistic"])
def test_checkpoint_restore_resumes_bit_for_bit(tmp_path, opt, adm):
    stream = list(batches(7, 30, size=128, vocab=600))
    n = 15
    a = embstore.open("memory://", dim=DIM, optimizer=opt(), admission=adm())
    _train(a, stream[:n])
    ckpt = tmp_path / "ckpt.emb"
    a.export(ckpt)
    _train(a, stream[n:])
    b = embstore.open("memory://", dim=DIM, optimizer=opt(), admission=adm())
    b.import_(ckpt)
    assert b.step == n
    _train(b, stream[n:])
    assert a.step == b.step == len(stream)
    assert _learned(a) == _learned(b)
    assert len(a) > 0


def test_reopen_resumes_bit_for_bit(lmdb_url):
    stream = list(batches(8, 20, size=128, vocab=600))
    url, ref_url = lmdb_url(), lmdb_url()
    opts = dict(dim=DIM, optimizer=Adam(lr=0.02), admission=FrequencyCutoff(2),
                expiry=Expiry(ttl_steps=6, every=4))
    ref = embstore.open(ref_url, **opts)
    _train(ref, stream)
    s = embstore.open(url, **opts)
    _train(s, stream[:9])
    s.close()
    s = embstore.open(url)  # everything (optimizer, policies, their state, step) from the store
    _train(s, stream[9:])
    assert _learned(s) == _learned(ref)
    assert s.stats()["expired"] > 0
    s.close()
    ref.close()


def test_delta_beyond_the_tombstone_log_warns_on_import(tmp_path):
    train = embstore.open("memory://", dim=DIM)
    train._policy.tombstones.max_entries = 4  # a tiny log, to reach its bound
    train.lookup(np.arange(20))
    v = train.version
    for k in range(10):
        train.delete([k])
    gone, complete = train.deletions_since(v)
    assert not complete
    train.export(tmp_path / "d.emb", since=v)
    serve = embstore.open("memory://", dim=DIM)
    with pytest.warns(UserWarning, match="does not carry every deletion"):
        serve.import_(tmp_path / "d.emb")
