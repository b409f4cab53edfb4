"""A worker started with ``--ann --ann-index scan`` answers ``top_k(approximate=True)``
exactly, through writes, deletes and in-place training updates."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.testing.service import start_workers

pytest.importorskip("pyarrow")
DIM = 8


def test_workers_with_the_scan_index_answer_as_exact_top_k():
    rng = np.random.default_rng(7)
    with start_workers(["memory://", "memory://"], dim=DIM, optimizer="sgd",
                       extra=["--ann", "--ann-index", "scan"]) as workers, \
            embstore.open(workers.url) as des:
        des.assign(np.arange(3000), rng.standard_normal((3000, DIM), dtype=np.float32))
        for _ in range(3):
            q = rng.standard_normal((4, DIM), dtype=np.float32)
            ex = [des.top_k(q[i], 2).keys[0] for i in range(4)]
            for exclude in (None, ex):
                got = des.top_k(q, 10, exclude, approximate=True)
                want = des.top_k(q, 10, exclude)
                assert got.keys.tolist() == want.keys.tolist()
                np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)
            keys = rng.choice(3000, 300, replace=False)
            des.update(keys, rng.standard_normal((300, DIM), dtype=np.float32))
            des.delete(rng.choice(3000, 30, replace=False))
        st = des.stats()
        assert st["ann_builds"] == 2 and st["ann_queries"] >= 24   # one scan index per worker
        assert st["ann_indexed"] == len(des)
        with pytest.raises(InvalidInputError, match="k must be"):
            des.top_k(q, 0, approximate=True)


def test_a_replicas_scan_index_follows_the_followed_table():
    """A ``--follow`` replica with ``--ann`` (auto: the scan at this size, chosen after its
    first poll) answers approximate queries exactly as the replicated rows change."""
    import time

    from embstore.testing.service import WorkerProcess

    rng = np.random.default_rng(8)
    with start_workers(["memory://"], dim=DIM) as workers, \
            embstore.open(workers.url) as des:
        des.assign(np.arange(3000), rng.standard_normal((3000, DIM), dtype=np.float32))
        replica = WorkerProcess(["memory://", "--listen", "127.0.0.1:0", "--follow",
                                 workers.url, "--poll", "0.05", "--ann"])
        try:
            with embstore.open(f"des://{replica.address}") as served:
                assert "ann_queries" in served.stats()       # the scan index's counters
                des.assign(np.arange(3000, 3100),
                           rng.standard_normal((100, DIM), dtype=np.float32))
                deadline = time.monotonic() + 30
                while len(served) < 3100 and time.monotonic() < deadline:
                    time.sleep(0.05)
                q = rng.standard_normal((3, DIM), dtype=np.float32)
                got = served.top_k(q, 10, approximate=True)
                assert got.keys.tolist() == served.top_k(q, 10).keys.tolist()
                assert served.stats()["ann_indexed"] == 3100
        finally:
            replica.stop()
