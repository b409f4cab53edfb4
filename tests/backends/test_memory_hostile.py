"""Hostile inputs and failure paths of memory:// (issue 15): a store used in a forked child,
table growth that runs out of memory, keys crafted to collide through the inverse of the table's
hash. Every case is a regression test that failed before its fix.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import embstore

DIM = 4


# -- 11: memory:// in a fork-started child ------------------------------------------------------
def _use_in_child(store, conn):
    try:
        store.update([1], np.ones((1, DIM), np.float32))
        conn.send("no error")
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(f"{type(e).__name__}: {e}")
    try:
        fresh = embstore.open("memory://", dim=DIM)   # a store made in the child works
        fresh.assign([1], np.ones((1, DIM)))
        conn.send(len(fresh))
    except Exception as e:  # noqa: BLE001
        conn.send(f"{type(e).__name__}: {e}")


def test_memory_store_used_in_a_forked_child_raises():
    import multiprocessing

    s = embstore.open("memory://", dim=DIM)
    s.lookup([1])
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_use_in_child, args=(s, child))
    p.start()
    try:
        assert parent.poll(60)
        msg = parent.recv()
        assert msg.startswith("ForkedProcessError") and "forked child" in msg
        assert parent.poll(60) and parent.recv() == 1
    finally:
        p.join(60)
    s.update([1], np.ones((1, DIM), np.float32))      # the parent's store is unaffected


class _Steps:
    def __init__(self, store):
        self.store = store

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.store.update([i], np.ones((1, DIM), np.float32))
        return i


def test_memory_store_in_fork_started_dataloader_worker_raises():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from embstore.errors import ForkedProcessError

    s = embstore.open("memory://", dim=DIM)
    loader = DataLoader(_Steps(s), batch_size=None, num_workers=1,
                        multiprocessing_context="fork", timeout=120)
    with pytest.raises(ForkedProcessError):   # torch re-raises the worker's error type
        list(loader)
    assert torch is not None


# -- 10: memory:// table growth that fails, and keys crafted to collide ---------------------------
_M64 = (1 << 64) - 1


def _unmix64(h: int) -> int:
    """Inverse of splitmix64's finalizer (embstore's int64 key mix)."""
    h ^= (h >> 31) ^ (h >> 62)
    h = (h * pow(0x94D049BB133111EB, -1, 1 << 64)) & _M64
    h ^= (h >> 27) ^ (h >> 54)
    h = (h * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & _M64
    h ^= (h >> 30) ^ (h >> 60)
    return (h - 0x9E3779B97F4A7C15) & _M64


def _colliding_keys(n: int, seed: int = 0, split_bit: int | None = None) -> np.ndarray:
    """``n`` int64 keys whose hashes under ``seed`` agree on the low 28 bits of both halves
    (so they share both buckets up to 2**28 buckets); with ``split_bit``, they differ there in
    both halves, so one doubling past ``2**split_bit`` buckets separates them."""
    out = []
    for i in range(n):
        v = i if split_bit is None else i // 2
        lo, hi = 0x1234567 | ((v & 0xF) << 28), 0x7654321 | (((v >> 4) & 0xF) << 28)
        h = lo | (hi << 32)
        if split_bit is not None and i % 2:
            h |= (1 << split_bit) | (1 << (32 + split_bit))
        k = _unmix64(h & _M64) ^ seed
        out.append(k - (1 << 64) if k >= 1 << 63 else k)
    return np.array(out, dtype=np.int64)


def test_unmix64_inverts_the_key_hash():
    from embstore._keys import splitmix64

    keys = np.array([0, 1, -5, 2**62, -(2**63)], dtype=np.int64)
    mixed = splitmix64(keys).view(np.uint64).tolist()
    assert [_unmix64(h) for h in mixed] == keys.view(np.uint64).tolist()


def test_crafted_colliding_keys_do_not_blow_up_the_table():
    keys = _colliding_keys(40)                 # collide under the unseeded hash
    s = embstore.open("memory://", dim=DIM)
    s.lookup(np.arange(100))
    s.lookup(keys)
    st = s.stats()
    assert len(s) == 140 and st["table_capacity"] <= 4096 and st["size_bytes"] < 1 << 22


def test_colliding_keys_under_a_known_seed_stop_at_a_bound():
    from embstore.errors import CapacityError

    keys = _colliding_keys(40, seed=7)
    s = embstore.open("memory://", dim=DIM, hash_seed=7)
    s.assign(np.arange(1000, 1100), np.ones((100, DIM)))
    with pytest.raises(CapacityError, match="collide"):
        s.assign(keys, np.ones((40, DIM)))
    assert len(s) == 100 and not s.contains(keys).any()
    assert s.stats()["table_capacity"] <= 4 * 8192


def test_failed_table_grow_leaves_the_table_unchanged():
    from embstore._cython.cuckoo import _fail_next_grows
    from embstore.errors import CapacityError

    seed = 99
    crowd = _colliding_keys(9, seed=seed, split_bit=4)   # 9 keys for 8 places in 16 buckets
    s = embstore.open("memory://", dim=DIM, hash_seed=seed, initial_capacity=16)
    others = np.arange(5, 25)
    s.assign(others, np.arange(20 * DIM, dtype=np.float32).reshape(20, DIM))
    s.assign(crowd[:8], np.full((8, DIM), 3.0))
    cap = s.stats()["table_capacity"]
    for insert in (lambda k: s.assign(k, np.full((len(k), DIM), 9.0)),
                   lambda k: s.lookup(k)):
        _fail_next_grows(1)
        try:
            with pytest.raises(CapacityError, match="unchanged"):
                insert(np.array([1000, 1001, crowd[8]]))   # two new keys, then the ninth
        finally:
            _fail_next_grows(0)
        assert len(s) == 28 and s.stats()["table_capacity"] == cap
        assert not s.contains([1000, 1001, crowd[8]]).any()   # nothing half-inserted
        np.testing.assert_array_equal(s.lookup(others, insert=False),
                                      np.arange(20 * DIM, dtype=np.float32).reshape(20, DIM))
        np.testing.assert_array_equal(s.lookup(crowd[:8], insert=False),
                                      np.full((8, DIM), 3.0))    # no stored key lost
    s.assign(crowd[8:], np.full((1, DIM), 4.0))          # with memory, the grow goes through
    assert len(s) == 29 and s.stats()["table_capacity"] > cap
    np.testing.assert_array_equal(s.lookup(crowd, insert=False)[-1], np.full(DIM, 4.0))


_OUT_OF_MEMORY = """
import resource, sys
import numpy as np
import embstore

s = embstore.open("memory://", dim=64)
s.assign(np.arange(-1000, 0), np.full((1000, 64), 7.0))        # rows that must survive
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + (300 << 20), hard))
done, failed = 0, None
try:
    for i in range(200):
        keys = np.arange(i * 50_000, (i + 1) * 50_000)
        s.assign(keys, np.ones((50_000, 64)))
        done = i + 1
except MemoryError as e:
    failed = type(e).__name__
resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
n = done * 50_000
ok = (len(s) == 1000 + n and bool(s.contains(np.arange(n)).all())
      and not s.contains(np.arange(n, n + 50_000)).any()
      and bool((s.lookup(np.arange(-1000, 0), insert=False) == 7.0).all()))
print(failed, done, ok)
"""


def test_memory_store_out_of_memory_is_all_or_nothing_per_batch():
    """Under an address-space limit the store fills up until a batch cannot fit: that batch
    raises MemoryError (CapacityError where the table or arena could not grow) and adds
    nothing, and every earlier row is intact."""
    r = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    failed, done, ok = r.stdout.split()
    assert failed in ("CapacityError", "MemoryError") and 0 < int(done) < 200 and ok == "True"
