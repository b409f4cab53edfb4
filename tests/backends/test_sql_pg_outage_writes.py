"""PostgreSQL: a write cut off by a server crash raises (not replayed), and the store object
lives on: the next call reconnects. Before, a reconnect attempted while the server was still
down left the store dead for good ("the connection is lost" on every later call)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import embstore
from embstore.errors import BackendError

DIM = 8


def test_write_during_an_outage_raises_and_the_store_reconnects_after(private_postgres):
    pg = private_postgres
    keys = np.arange(100, dtype=np.int64)
    s = embstore.open(pg.url + "?table=cut", dim=DIM, optimizer="sgd")
    before = s.lookup(keys).copy()
    with pg.down():
        with pytest.raises(BackendError):
            s.update(keys, np.ones((100, DIM), np.float32))      # not replayed later
        with pytest.raises(BackendError, match="connecting again failed|connection"):
            s.lookup(keys, insert=False)                        # still down: a clear error
    s.update(keys, np.ones((100, DIM), np.float32))              # the same object works again
    np.testing.assert_allclose(s.lookup(keys, insert=False), before - 0.01, rtol=1e-5)
    assert s.backend.counters["reconnects"] >= 1
    s.close()


def test_update_cut_mid_batch_by_an_immediate_restart(private_postgres):
    pg = private_postgres
    keys = np.arange(100_000, dtype=np.int64)
    s = embstore.open(pg.url + "?table=mid", dim=DIM, optimizer="sgd")
    s.lookup(keys)
    errors: list[BaseException] = []
    started = threading.Event()

    def train():
        try:
            for _ in range(200):
                started.set()
                s.update(keys, np.ones((len(keys), DIM), np.float32))
        except BackendError as e:
            errors.append(e)

    t = threading.Thread(target=train)
    t.start()
    started.wait(60)
    time.sleep(0.5)
    pg.restart(mode="immediate")
    t.join(120)
    assert errors, "the restart should have cut an update"
    for _ in range(2):   # later calls reconnect (once) and work
        s.update(keys[:10], np.ones((10, DIM), np.float32))
    assert s.lookup(keys[:10], insert=False).shape == (10, DIM)
    s.close()
