"""Limits of what one rank accepts from another, and a closed distributed store: 2 ranks on the
real gloo transport, rank 1 misbehaving.

Before: an all-zero export payload (key 0 belongs to rank 1) wrote one key hundreds of times;
a header whose size disagreed with its item count aborted the receiver inside gloo (SIGABRT),
and counts or sizes of 2**40 (a header, a top_k ``k``, a number of draws) raised a raw
``MemoryError``; ``len()`` of a closed distributed store raised ``TypeError``.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import traceback

import numpy as np
import pytest

from tests.subprocs import run_ranks

torch = pytest.importorskip("torch")

WORLD = 2
DIM = 4
TIMEOUT = 5.0     # seconds a rank waits for a peer that gave up
HUGE = 1 << 40


def _entry(scenario: str, rank: int, port: int, outdir: str) -> None:
    import torch.distributed as dist

    result: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        name, _, arg = scenario.partition(":")
        result = SCENARIOS[name](rank, arg)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {"unexpected": traceback.format_exc(), "type": type(e).__name__}
    with open(os.path.join(outdir, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip teardown of process groups a peer may have left


def _run(scenario: str, tmp_path) -> list[dict]:
    res = run_ranks(_entry, scenario, tmp_path, world=WORLD)
    for out in res:
        assert "unexpected" not in out, out["unexpected"]
    return res


def _outcome(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the parent checks the type (MemoryError: a bug)
        return {"error": type(e).__name__, "message": str(e),
                "failed_rank": getattr(e, "failed_rank", None)}
    return {"error": None}


def _own_keys(rank: int, n: int) -> np.ndarray:
    from embstore_torch.distributed.wire import owner_of

    keys = np.arange(10 * n, dtype=np.int64)
    return keys[owner_of(keys, WORLD) == rank][:n]


def _open(n: int = 200):
    import embstore_torch.distributed as ed

    store = ed.open("memory://", dim=DIM, timeout=TIMEOUT)
    store.lookup(np.arange(n))
    return store


# -- item 9: export payloads of duplicate keys ------------------------------------------------
def _export_duplicates(rank: int, how: str) -> dict:
    from embstore_torch.distributed import export

    store = _open()
    if rank == 1:
        real = export.pack_records
        first: list = []

        def dup(keys, recs):
            if how == "zeros":  # key 0 is rank 1's own: only its repetition is wrong
                return real(np.zeros_like(keys), recs)
            if how == "within":
                return real(np.concatenate((keys[:-1], keys[:1])), recs)
            first.append(keys.copy())  # "rounds": the first batch's keys in every round
            return real(first[0][:len(keys)], recs)

        export.pack_records = dup
    path = os.path.join(tempfile.mkdtemp(), "all.es")
    out = _outcome(lambda: store.export(path, batch_size=16))
    out["file"] = os.path.exists(path)
    return out


@pytest.mark.parametrize("how", ["zeros", "within", "rounds"])
def test_export_refuses_duplicate_keys_from_a_shard(tmp_path, how):
    from embstore_torch.distributed.wire import owner_of

    assert int(owner_of(np.zeros(1, np.int64), WORLD)[0]) == 1  # the fault needs this
    got, other = _run(f"export_duplicates:{how}", tmp_path)
    assert got["error"] == "RankFailureError" and got["failed_rank"] == 1, got
    assert "rank 1 sent" in got["message"] and "more than once" in got["message"], got
    assert not got["file"]  # no file with repeated keys is left behind
    # the other rank fails in the same export, naming the rank that found the payload bad
    assert other["error"] == "RankFailureError" and other["failed_rank"] == 0, other


# -- item 10: headers that disagree with their payload, and absurd counts -------------------
def _patch_header(comm, op: str, mutate, received: bool = False) -> None:
    """Rank-local sabotage of every ``op`` header: ``mutate(row)`` changes the row this rank
    sends to rank 0 or, with ``received``, the row it got from rank 1 (a message corrupted on
    the way: the sender sends what it announced, the receiver expects something else)."""
    from embstore_torch.distributed import comm as comm_mod

    real = comm_mod.Comm._all_to_all

    def sabotaged(self, buf, send_sizes, recv_sizes, op_name, keep=True):
        header = (op_name == op and len(buf) == 48 * self.world
                  and send_sizes == [48] * self.world)
        if header and not received:
            mutate(buf.view(np.int64).reshape(self.world, 6)[0])
        out = real(self, buf, send_sizes, recv_sizes, op_name, keep)
        if header and received:
            mutate(out.view(np.int64).reshape(self.world, 6)[1])
        return out

    comm._all_to_all = sabotaged.__get__(comm)


CALLS = {
    "lookup": lambda s, r: s.lookup(np.arange(300, 340)),
    "assign": lambda s, r: s.assign(np.arange(40), np.ones((40, DIM), np.float32)),
    "update": lambda s, r: s.update(np.arange(40), np.ones((40, DIM), np.float32)),
    "top_k": lambda s, r: s.top_k(np.ones((2 + r, DIM), np.float32), 5),
    "sample_round": lambda s, r: s.sample(np.arange(4), 8, "uniform", seed=r),
    "export": lambda s, r: s.export(os.path.join(tempfile.mkdtemp(), "all.es")),
}


def _bad_header(rank: int, arg: str) -> dict:
    op, field, change, side = arg.split(",")
    col = {"items": 3, "nbytes": 4}[field]
    store = _open()
    if rank == (0 if side == "received" else 1):
        def mutate(row):
            if row[4] == 0:  # e.g. a sampling request (its count is the greedy_peer case)
                return
            if change == "huge":
                row[col] = HUGE
            else:
                row[col] += int(change)
        _patch_header(store.comm, op, mutate, received=side == "received")
    out = _outcome(lambda: CALLS[op](store, rank))
    out["then"] = _outcome(lambda: len(store)) if out["error"] is None else {"error": None}
    return out


OPS = ("lookup", "assign", "update", "top_k", "sample_round", "export")
# received: the message changed on the way (before: SIGABRT inside gloo on the receiver, which
# then waited for bytes never sent); sent: a rank announcing absurd counts (before: a raw
# MemoryError on the receiver)
HEADERS = ([f"{op},nbytes,8,received" for op in OPS] + [f"{op},items,huge,sent" for op in OPS]
           + ["lookup,nbytes,huge,sent", "update,items,1,sent", "export,nbytes,-8,sent",
              "top_k,items,huge,received"])


@pytest.mark.parametrize("case", HEADERS)
def test_a_header_that_disagrees_with_its_sizes_is_a_rank_failure(tmp_path, case):
    res = _run(f"bad_header:{case}", tmp_path)
    # rank 0 refuses rank 1's header before the payload exchange, naming it
    assert res[0]["error"] == "RankFailureError" and res[0]["failed_rank"] == 1, res
    assert "rank 1 announced" in res[0]["message"], res
    # rank 1 stops too: at its own header, or when rank 0 is not in the exchange (timeout)
    err = res[1] if res[1]["error"] else res[1]["then"]
    assert err["error"] in ("CollectiveError", "RankFailureError"), res  # never MemoryError


def _greedy_peer(rank: int, what: str) -> dict:
    """Rank 1 asks the shards for 2**40 draws, or for the top 2**40 keys."""
    from embstore_torch.distributed import ops

    store = _open()
    if rank == 1 and what == "k":
        real = ops.pack_queries
        ops.pack_queries = lambda q, k, ex: real(q, HUGE, ex)
    if rank == 1 and what == "draws":
        _patch_header(store.comm, "sample_round", lambda row: row.__setitem__(3, HUGE))
    out = _outcome(lambda: CALLS["top_k" if what == "k" else "sample_round"](store, rank))
    out["then"] = _outcome(lambda: len(store)) if out["error"] is None else {"error": None}
    return out


@pytest.mark.parametrize("what, limit", [("k", "MAX_TOP_K"), ("draws", "MAX_DRAWS")])
def test_what_a_peer_may_ask_of_a_shard_is_bounded(tmp_path, what, limit):
    import embstore_torch.distributed as ed

    res = _run(f"greedy_peer:{what}", tmp_path)
    for r, out in enumerate(res):
        err = out if out["error"] else out["then"]
        # rank 1 may see first that its own request is over the limit
        allowed = ("RankFailureError",) if r == 0 else ("RankFailureError", "CollectiveError")
        assert err["error"] in allowed, (r, out)
    assert res[0]["failed_rank"] == 1, res
    assert str(getattr(ed, limit)) in res[0]["message"], res


def _limits_locally(rank: int, _: str) -> dict:
    """Over-limit requests are refused on the asking rank, before anything is sent."""
    from embstore_torch.distributed import MAX_TOP_K

    store = _open()
    out = {"k": _outcome(lambda: store.top_k(np.ones((1, DIM), np.float32), MAX_TOP_K))}
    # a large sample still works: the draws go in rounds of at most MAX_DRAWS per shard
    from embstore_torch.distributed import ops

    ops.MAX_DRAWS = 7
    res = store.sample(np.arange(3), 40, "uniform", unique=False, seed=rank,
                       remove_accidental_hits=False)
    out["draws"] = int(res.num_tries)
    out["candidates"] = len(res.keys)
    out["then"] = _outcome(lambda: len(store))
    return out


def test_over_limit_requests_are_refused_before_the_exchange(tmp_path):
    for out in _run("limits_locally:", tmp_path):
        assert out["k"]["error"] == "InvalidInputError" and "MAX_TOP_K" in out["k"]["message"]
        assert out["draws"] == 40 and out["candidates"] == 3 + 40
        assert out["then"]["error"] is None


# -- item 12 (distributed part): a closed or failed store raises StoreClosedError ----------------
METHODS = {
    "len": lambda s: len(s),
    "lookup": lambda s: s.lookup([1, 2]),
    "update": lambda s: s.update([1], np.ones((1, DIM), np.float32)),
    "assign": lambda s: s.assign([1], np.ones((1, DIM), np.float32)),
    "delete": lambda s: s.delete([1]),
    "contains": lambda s: s.contains([1]),
    "prefetch": lambda s: s.prefetch([1]),
    "top_k": lambda s: s.top_k(np.ones((1, DIM), np.float32), 2),
    "sample": lambda s: s.sample([1], 2, "uniform"),
    "export": lambda s: s.export(os.path.join(tempfile.mkdtemp(), "x.es")),
    "flush": lambda s: s.flush(),
    "stats": lambda s: s.stats(),
    "check_writable": lambda s: s.check_writable(),
}


def _closed_store(rank: int, how: str) -> dict:
    store = _open(20)
    if how == "closed":
        store.close()
    elif how == "failed":  # a flush fails on rank 1: both ranks close their shard
        if rank == 1:
            def broken():
                raise OSError("injected flush failure")
            store.local.flush = broken
        _outcome(store.flush)
    else:  # "broken": rank 1 routes keys to rank 0 that it does not own
        if rank == 1:
            from embstore_torch.distributed import keyed
            keyed.route = lambda keys, world: (np.arange(len(keys)),
                                               np.array([0, len(keys), len(keys)]))
        _outcome(lambda: store.update(np.arange(100, 164), np.ones((64, DIM), np.float32)))
        _outcome(lambda: len(store))  # where rank 1 learns of rank 0's failure
    out = {name: _outcome(lambda f=f: f(store)) for name, f in METHODS.items()}
    out["close"] = _outcome(store.close)
    out["repr"] = repr(store)
    out["optimizer"] = _outcome(lambda: store.optimizer)  # as a closed EmbeddingStore: kept
    return out


@pytest.mark.parametrize("how", ["closed", "failed", "broken"])
def test_a_closed_or_failed_store_raises_store_closed_error(tmp_path, how):
    from embstore.errors import StoreClosedError
    from embstore_torch.distributed import CollectiveError

    for out in _run(f"closed_store:{how}", tmp_path):
        for name in METHODS:
            if how == "broken" and name == "stats":
                continue  # a broken store's local stats stay readable, for the post-mortem
            assert out[name]["error"] in ("StoreClosedError", "StoreUnusableError"), (name, out)
        assert out["close"]["error"] is None and "DistributedStore" in out["repr"]
        assert out["optimizer"]["error"] is None
    from embstore_torch.distributed import StoreUnusableError

    assert issubclass(StoreUnusableError, StoreClosedError)
    assert issubclass(StoreUnusableError, CollectiveError)


SCENARIOS = {"export_duplicates": _export_duplicates, "bad_header": _bad_header,
             "greedy_peer": _greedy_peer, "limits_locally": _limits_locally,
             "closed_store": _closed_store}


def test_a_shards_candidates_holding_a_key_twice_are_refused():
    """No processes: a crafted candidate buffer (the asking rank's parser)."""
    from embstore_torch.distributed import RankFailureError, wire

    def parse(keys, valid, key_type="int64"):
        keys = np.array(keys, dtype=np.int64 if key_type == "int64" else object)
        parts = wire.pack_candidates(keys, np.zeros(keys.shape, np.float32),
                                     np.array(valid, bool))
        buf = np.concatenate([p.reshape(-1).view(np.uint8) for p in parts])
        return wire.unpack_candidates(buf, *keys.shape, 5, key_type, owner=None, source=1)

    parse([[3, 3, 4], [5, 6, 7]], [[1, 0, 1], [1, 1, 1]])   # a filler key may repeat
    for key_type, keys in (("int64", [[5, 6, 7], [4, 9, 4]]),
                           ("bytes", [[b"a", b"b", b"c"], [b"d", b"x", b"d"]])):
        with pytest.raises(RankFailureError, match="more than once") as info:
            parse(keys, [[1, 1, 1], [1, 1, 1]], key_type)
        assert info.value.failed_rank == 1


def test_export_duplicate_checks_without_processes():
    from embstore_torch.distributed import RankFailureError, wire
    from embstore_torch.distributed.export import SeenKeys

    wire.check_unique(np.array([3, 1, 2]), 1)
    with pytest.raises(RankFailureError, match="key 0 more than once"):
        wire.check_unique(np.zeros(987, np.int64), 1)
    with pytest.raises(RankFailureError, match="more than once"):
        wire.check_unique(np.array([b"a", b"b", b"a"], dtype=object), 1)
    for keys in (np.arange(4), np.array([b"a", b"b", b"c", b"d"], dtype=object)):
        seen = SeenKeys()
        seen.add(keys[:2], 1)
        seen.add(keys[2:], 0)
        seen.check()
        seen.add(keys[1:2], 1)
        with pytest.raises(RankFailureError, match="in two rounds") as info:
            seen.check()
        assert info.value.failed_rank == 1
