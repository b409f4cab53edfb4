"""``export(since=)`` of a worker answered from its change log (O(changed rows)), with the
same rows as the store's own ``changes_since``; a scan where the log cannot tell."""

from __future__ import annotations

import json

import numpy as np
import pytest

import embstore
from embstore.io.native import NativeReader

pytest.importorskip("pyarrow.flight")

from embstore.service.changelog import ChangeLog  # noqa: E402
from embstore.testing.service import start_workers  # noqa: E402

DIM = 4


def _rows(pairs) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for keys, recs in pairs:
        for k, r in zip(keys.tolist(), recs):
            out[k] = r.tobytes()
    return out


def _from_log(store, log: ChangeLog, since: int) -> dict[int, bytes] | None:
    rows = log.rows_after_version(store, since)
    return None if rows is None else _rows(rows)


def test_log_keys_after_a_version_cover_every_row_changes_since_reports():
    rng = np.random.default_rng(3)
    with embstore.open("memory://", dim=DIM, optimizer="adagrad") as store:
        store.update(np.arange(50), rng.standard_normal((50, DIM), dtype=np.float32))
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        marks = [store.version]
        for step in range(6):   # every write path: update, lookup-insert, assign, delete
            keys = rng.integers(0, 120, 40)
            if step % 3 == 0:
                store.update(keys, rng.standard_normal((40, DIM), dtype=np.float32))
            elif step % 3 == 1:
                store.lookup(keys)
                store.delete(keys[:5])
            else:
                store.assign(keys[:10], rng.standard_normal((10, DIM), dtype=np.float32))
            marks.append(store.version)
        for since in marks:
            assert _from_log(store, log, since) == _rows(store.changes_since(since))
        # older than the log: it cannot tell
        assert log.keys_after_version(marks[0] - 1) is None
        assert log.version_answers == len(marks) and log.version_misses == 1


def test_log_refuses_versions_its_dropped_batches_or_an_import_may_hold(tmp_path):
    with embstore.open("memory://", dim=DIM) as store:
        log = ChangeLog(max_keys=30, version=lambda: store.version)
        store.add_observer(log)
        store.assign(np.arange(20), np.ones((20, DIM)))
        v1 = store.version
        store.assign(np.arange(100, 120), np.ones((20, DIM)))   # pushes the first batch out
        assert log.keys_after_version(v1 - 1) is None
        assert sorted(log.keys_after_version(v1).tolist()) == list(range(100, 120))
        v2 = store.version
        other = embstore.open("memory://", dim=DIM)
        other.assign(np.arange(500, 510), np.full((10, DIM), 2.0))
        other.export(str(tmp_path / "o.emb"))
        store.import_(str(tmp_path / "o.emb"))
        assert log.keys_after_version(v2) is None     # the import's rows are in no batch
        v3 = store.version
        store.assign([7], np.zeros((1, DIM)))
        assert log.keys_after_version(v3).tolist() == [7]
        assert _from_log(store, log, v3) == _rows(store.changes_since(v3))


def test_worker_exports_changes_since_a_version_from_its_log(tmp_path):
    rng = np.random.default_rng(5)
    sgd = json.dumps({"name": "sgd", "lr": 1.0})
    with start_workers([f"lmdb://{tmp_path}/s0", f"lmdb://{tmp_path}/s1"], dim=DIM,
                       optimizer=sgd) as workers, \
            embstore.open(workers.url, dim=DIM) as des:
        des.update(np.arange(1000), rng.standard_normal((1000, DIM), dtype=np.float32))
        des.flush()
        since = des.version
        changed = rng.choice(1000, 60, replace=False)
        des.update(changed, rng.standard_normal((60, DIM), dtype=np.float32))
        des.delete(changed[:5])
        n = des.export(str(tmp_path / "delta.emb"), since=since)
        with NativeReader(str(tmp_path / "delta.emb")) as r:
            got = np.concatenate([k for k, _ in r])
        assert n == 55 and sorted(got.tolist()) == sorted(changed[5:].tolist())
        st = des.stats()
        assert st.get("changelog_version_answers", 0) >= 1, st
