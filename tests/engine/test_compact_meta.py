"""Compact metadata: only the bookkeeping fields a store's policies read, counts as uint32."""

from __future__ import annotations

import io

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError, SchemaMismatchError
from embstore.layout import COUNT_MAX_U32
from embstore.policies import Expiry
from embstore.testing.conformance import table_of

DIM = 8


def test_compact_keeps_count_and_version_only():
    s = embstore.open("memory://", dim=DIM, metadata="compact", value_dtype="bfloat16",
                      optimizer=embstore.optim.Adagrad(rowwise=True))
    f = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    assert s.layout.meta_names == ("count", "version")
    assert s.layout.itemsize == 2 * DIM + 4 + 4 + 8  # vector, accumulator, count, version
    assert f.layout.itemsize == 4 * DIM + 4 * DIM + 32
    assert s.layout.to_json()["meta"] == [["count", "<u4"], ["version", "<i8"]]
    with pytest.raises(InvalidInputError, match="metadata"):
        embstore.open("memory://", dim=DIM, metadata="tiny")


@pytest.mark.parametrize("expiry, fields", [
    (Expiry(ttl_steps=5), ("count", "last_step", "version")),
    (Expiry(ttl_seconds=60), ("count", "last_seen", "version")),
])
def test_compact_keeps_what_expiry_reads_and_expiry_works(expiry, fields):
    s = embstore.open("memory://", dim=DIM, metadata="compact", expiry=expiry)
    assert s.layout.meta_names == fields
    s.update([1, 2], np.ones((2, DIM)))
    if expiry.ttl_steps:
        for _ in range(6):
            s.update([2], np.ones((1, DIM)))
        assert s.expire() == 1 and s.contains([1, 2]).tolist() == [False, True]
    else:
        assert s.expire(now=1e12) == 2 and len(s) == 0


def test_capacity_eviction_keeps_its_fields_and_evicts():
    s = embstore.open("memory://", dim=DIM, metadata="compact", capacity=100, eviction="lru")
    assert s.layout.meta_names == ("count", "last_seen", "last_step", "version")
    for i in range(5):
        s.update(np.arange(i * 50, i * 50 + 50), np.ones((50, DIM)))
    assert len(s) <= 100


@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_uint32_counts_saturate(opt):
    # SGD steps known keys in place (Backend.update_rows), Adagrad through modify
    s = embstore.open("memory://", dim=DIM, metadata="compact", optimizer=opt)
    s.update([1, 2], np.ones((2, DIM)), counts=[COUNT_MAX_U32 - 3, 5])
    s.update([1, 2], np.ones((2, DIM)), counts=[10, 5])
    recs, _ = s.get_records([1, 2])
    assert recs["count"].tolist() == [COUNT_MAX_U32, 10]
    f = embstore.open("memory://", dim=DIM, optimizer=opt)  # full: int64, no saturation
    f.update([1], np.ones((1, DIM)), counts=[COUNT_MAX_U32 + 5])
    assert f.get_records([1])[0]["count"][0] == COUNT_MAX_U32 + 5


def test_reopen_checks_metadata_and_the_policies_it_serves(tmp_path):
    url = f"lmdb://{tmp_path}/s"
    with embstore.open(url, dim=DIM, metadata="compact") as s:
        s.update([1], np.ones((1, DIM)))
    with pytest.raises(SchemaMismatchError, match="metadata"):
        embstore.open(url, metadata="full")
    with pytest.raises(SchemaMismatchError, match="last_seen"):
        embstore.open(url, expiry=Expiry(ttl_seconds=10))
    with pytest.raises(SchemaMismatchError, match="last_step"):
        embstore.open(url, capacity=10, eviction="lru")
    with embstore.open(url) as s:
        assert s.layout.is_compact
        with pytest.raises(SchemaMismatchError, match="last_step"):
            s.expire(ttl_steps=3)
        assert len(s) == 1  # nothing touched


def test_incremental_export_of_a_compact_store_is_exact():
    s = embstore.open("memory://", dim=DIM, metadata="compact", value_dtype="bfloat16",
                      optimizer=embstore.optim.Adagrad(rowwise=True))
    s.lookup(np.arange(100))
    full = io.BytesIO()
    s.export(full)
    v = s.version
    s.update(np.arange(0, 100, 7), np.ones((15, DIM)))
    s.delete([3])
    changed = {k for keys, _ in s.changes_since(v) for k in keys.tolist()}
    assert changed == set(range(0, 100, 7))
    delta = io.BytesIO()
    assert s.export(delta, since=v) == 15
    t = embstore.open("memory://", dim=DIM, metadata="compact", value_dtype="bfloat16",
                      optimizer=embstore.optim.Adagrad(rowwise=True))
    t.import_(full.getvalue())
    t.import_(delta.getvalue())
    a, b = table_of(s), table_of(t)
    assert a.keys() == b.keys()
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)  # versions included, exactly


def test_compact_parquet_round_trip_and_frequency_sampling(tmp_path):
    s = embstore.open("memory://", dim=DIM, metadata="compact")
    s.update([1, 1, 1, 2], np.ones((4, DIM)))
    path = tmp_path / "t.parquet"
    s.export(path)
    t = embstore.open("memory://", dim=DIM, metadata="compact")
    t.import_(path)
    a, b = table_of(s), table_of(t)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    # the sampling index (unigram, skip-gram by frequency) reads the uint32 counts
    from embstore.sampling import sampling_index

    s.sample([1], 1, "unigram", seed=0)
    assert sampling_index(s).counts_of(np.array([1, 2])).tolist() == [3, 1]


def test_compact_store_with_ftrl_pruning_keeps_last_step_and_prunes() -> None:
    # FTRL(prune=True) deletes zero rows by how long they have been idle (``last_step``): a
    # compact store configured with it keeps the field, and the sweep runs without error.
    from embstore.optim import FTRL

    opt = FTRL(alpha=0.1, l1=1.0, prune=True, prune_idle_steps=2)
    with embstore.open("memory://", dim=4, metadata="compact", optimizer=opt) as store:
        assert "last_step" in store.layout.meta_names
        store.lookup(np.arange(10))
        store.update(np.arange(10), np.full((10, 4), 1e-3, np.float32))  # below l1: w stays 0
        for _ in range(6):
            store.update(np.array([100]), np.ones((1, 4), np.float32))
        assert not store.contains(np.arange(10)).any()
        assert store.contains([100]).all()
