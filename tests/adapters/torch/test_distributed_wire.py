"""The distributed store's wire is not trusted: 2 ranks on the real gloo transport, rank 1
misbehaving. Every scenario ends with a CollectiveError on every rank (within the timeout),
never a SIGABRT, and no foreign key is stored.

Before: a header announcing fewer bytes than sent aborted the receiver inside gloo, keys a rank
does not own were stored on the wrong shard, and a read_only mismatch went unnoticed.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback

import numpy as np
import pytest

from tests.subprocs import run_ranks

torch = pytest.importorskip("torch")

WORLD = 2
DIM = 4
TIMEOUT = 5.0     # seconds a rank waits for a peer that gave up


def _entry(scenario: str, rank: int, port: int, outdir: str, url: str) -> None:
    import torch.distributed as dist

    result: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        result = SCENARIOS[scenario](rank, url)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {"unexpected": traceback.format_exc(), "type": type(e).__name__}
    with open(os.path.join(outdir, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # skip teardown of process groups a peer may have left


def _outcome(fn) -> dict:
    from embstore_torch.distributed import CollectiveError

    try:
        fn()
    except CollectiveError as e:
        return {"error": type(e).__name__, "message": str(e),
                "failed_rank": getattr(e, "failed_rank", None)}
    return {"error": None}


def _patch_header(comm, op: str, mutate) -> None:
    """Rank-local sabotage: ``mutate(header)`` changes the header this rank sends in ``op``."""
    from embstore_torch.distributed import comm as comm_mod

    real = comm_mod.Comm._all_to_all

    def sabotaged(self, buf, send_sizes, recv_sizes, op_name, keep=True):
        if op_name == op and len(buf) == 48 * self.world and send_sizes == [48] * self.world:
            mutate(buf.view(np.int64).reshape(self.world, 6))
        return real(self, buf, send_sizes, recv_sizes, op_name, keep)

    comm._all_to_all = sabotaged.__get__(comm)


def _short_header(rank: int, url: str) -> dict:
    """Rank 1 announces 8 bytes fewer than it sends to rank 0 (keys of a lookup)."""
    import embstore_torch.distributed as ed

    store = ed.open(url, dim=DIM, timeout=TIMEOUT)
    if rank == 1:
        def minus_eight(head):
            head[0, 4] -= 8
        _patch_header(store.comm, "lookup", minus_eight)
    out = _outcome(lambda: store.lookup(np.arange(64)))
    out["then"] = _outcome(lambda: len(store))
    return out


def _garbage_header(rank: int, url: str) -> dict:
    """Rank 1's update header announces an impossible size (2**62 bytes)."""
    import embstore_torch.distributed as ed

    store = ed.open(url, dim=DIM, timeout=TIMEOUT)
    store.lookup(np.arange(16))
    if rank == 1:
        def huge(head):
            head[0, 4] = 1 << 62
        _patch_header(store.comm, "update", huge)
    out = _outcome(lambda: store.update(np.arange(16), np.ones((16, DIM), np.float32)))
    out["then"] = _outcome(lambda: len(store))
    return out


def _foreign_keys(rank: int, url: str) -> dict:
    """Rank 1 routes every key of its update to rank 0, owned or not."""
    import embstore_torch.distributed as ed
    from embstore_torch.distributed import keyed

    store = ed.open(url, dim=DIM, timeout=TIMEOUT)
    before = len(store.local)
    if rank == 1:
        keyed.route = lambda keys, world: (np.arange(len(keys)),
                                           np.array([0, len(keys), len(keys)]))
    out = _outcome(lambda: store.update(np.arange(100, 164), np.ones((64, DIM), np.float32)))
    out["then"] = _outcome(lambda: len(store))
    out["local_rows_added"] = len(store.local) - before
    return out


def _read_only_mismatch(rank: int, url: str) -> dict:
    import embstore_torch.distributed as ed

    try:
        ed.open(url, read_only=(rank == 1), timeout=TIMEOUT)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


# -- bad payloads in export, top_k, sample and assign ---------------------------------------
# Rank 1 builds one payload wrong (its header announces what it really sends, so only the
# payload's content can tell); the rank that parses it must raise RankFailureError naming
# rank 1, and the other rank must fail at the same or its next collective, not hang.

def _own_keys(rank: int, n: int = 32) -> np.ndarray:
    """Keys 0..199 that ``rank`` owns (of two)."""
    from embstore_torch.distributed.wire import owner_of

    keys = np.arange(max(200, 4 * n), dtype=np.int64)
    return keys[owner_of(keys, WORLD) == rank][:n]


def _bad_payload(rank: int, url: str, name: str, fault, call) -> dict:
    """Open, give each rank rows, let rank 1 apply ``fault(module)`` to the modules of the
    collectives, run ``call``."""
    import embstore_torch.distributed as ed
    from embstore_torch.distributed import export, keyed, ops

    store = ed.open(url, dim=DIM, timeout=TIMEOUT)
    store.lookup(np.arange(200))  # 200 rows over the two shards
    if rank == 1:
        for module in (export, keyed, ops):
            fault(module)
    out = _outcome(lambda: call(store, rank))
    # a rank that got through the call must fail at its next one (not wait for a timeout)
    out["then"] = _outcome(lambda: len(store)) if out["error"] is None else {"error": None}
    return out


def _wrap(module, name: str, change) -> None:
    if not hasattr(module, name):  # the function is another module's
        return
    real = getattr(module, name)
    setattr(module, name, lambda *a, **k: change(real, *a, **k))


def _export(store, rank):
    import tempfile

    store.export(os.path.join(tempfile.mkdtemp(), "all.es"))


def _top_k(store, rank):
    # rank 0 asks 2 queries, rank 1 asks 3: a fault in the candidates for 2 queries reaches
    # rank 0 only, which must then tell rank 1
    store.top_k(np.ones((2 + rank, DIM), np.float32), 5)


def _to_rank_0(change):
    """``change`` applied to the top_k candidates for rank 0's queries only."""
    return lambda real, kk, ss, vv: (change(real, kk, ss, vv) if len(kk) == 2
                                     else real(kk, ss, vv))


def _sample(store, rank):
    store.sample(np.arange(20), 8, "uniform", seed=rank)


def _assign(store, rank):
    store.assign(np.arange(300, 340), np.ones((40, DIM), np.float32))


def _foreign(real, keys, *rest):
    """The same payload with keys of rank 0 in place of rank 1's."""
    return real(_own_keys(0, len(keys))[:len(keys)], *rest)


BAD_PAYLOADS = {
    # export: rank 0 unpacks the other shards' records
    # (a payload whose size does not fit its header's item count is refused at the header,
    # before the payload exchange: "announced")
    "export_truncated": ("pack_records", lambda real, k, r: real(k, r)[:-3], _export,
                         "announced"),
    "export_foreign_keys": ("pack_records", _foreign, _export, "belong to other ranks"),
    # top_k: every shard parses every rank's queries (rank 1 sees its own bad buffer too)
    "top_k_query_count": ("pack_queries", lambda real, q, k, ex: real(
        np.concatenate((q, q)), k, ex)[np.r_[0:24, 24 + 4 * DIM:24 + 8 * DIM * len(q)]],
        _top_k, "announced"),
    "top_k_nan_query": ("pack_queries", lambda real, q, k, ex: real(q * np.nan, k, ex),
                        _top_k, "NaN"),
    # top_k: the asking rank parses every shard's candidates
    "top_k_short_scores": ("pack_candidates", _to_rank_0(lambda real, kk, ss, vv: real(
        kk, ss[:, :-1], vv)), _top_k, "announced"),
    "top_k_flags": ("pack_candidates", _to_rank_0(lambda real, kk, ss, vv: real(
        kk, ss, vv)[:2] + (vv.view(np.uint8) * 2,)), _top_k, "validity flags"),
    "top_k_too_wide": ("unpack_queries", lambda real, *a, **kw: (
        lambda q, k, ex: (q, k + 3, ex))(*real(*a, **kw)), _top_k, "fewer than 6 items"),
    # sample: shard weights (everyone parses them), draws, positive keys' weights
    "sample_nan_weight": ("pack_shard_weight", lambda real, t, n: real(np.nan, n), _sample,
                          "not a finite weight"),
    "sample_negative_support": ("pack_shard_weight", lambda real, t, n: real(t, -3.5),
                                _sample, "shard support"),
    "sample_negative_draw": ("pack_draws", lambda real, k, w: real(k, -w), _sample,
                             "not a finite weight"),
    "sample_foreign_draws": ("pack_draws", _foreign, _sample, "belong to other ranks"),
    "sample_truncated_draws": ("pack_draws", lambda real, k, w: real(k, w)[:-8], _sample,
                               "announced"),
    "sample_fewer_draws": ("sampling_index", lambda real, store: _fewer_draws(real(store)),
                           _sample, "sampled keys where"),
    "sample_prob_negative": ("sampling_index", lambda real, store: _negative_prob(real(store)),
                             _sample, "positive key's sampling weight"),
    # assign: keys routed to a rank that does not own them
    "assign_foreign_keys": ("route", lambda real, keys, world: (
        np.arange(len(keys)), np.array([0, len(keys), len(keys)])), _assign,
        "belong to other ranks"),
}


def _negative_prob(idx):
    """A sampling index whose owner answers negative weights for positive keys."""
    real = idx.prob_of
    idx.prob_of = lambda snap, keys: -1.0 - real(snap, keys)
    return idx


def _fewer_draws(idx):
    """A sampling index whose owner sends one key fewer than it was asked for."""
    real = idx.draw
    idx.draw = lambda snap, rng, n: tuple(part[:-1] for part in real(snap, rng, n))
    return idx


def _top_k_own_k(rank: int, url: str) -> dict:
    """Rank 0 asks for 3, rank 1 for 7: each shard answers a rank's queries with its k."""
    import embstore_torch.distributed as ed

    store = ed.open(url, dim=DIM, timeout=TIMEOUT)
    store.lookup(np.arange(200))
    q = np.random.default_rng(rank).normal(size=(4, DIM)).astype(np.float32)
    mine = store.top_k(q, 3 + 4 * rank)
    same_k = store.top_k(q, 7)
    return {"keys": mine.keys.tolist(), "scores": mine.scores.tolist(),
            "keys_7": same_k.keys.tolist(), "scores_7": same_k.scores.tolist()}


def _make_bad_payload(name: str):
    target, change, call, _ = BAD_PAYLOADS[name]
    return lambda rank, url: _bad_payload(rank, url, name,
                                          lambda ops: _wrap(ops, target, change), call)


SCENARIOS = {"short_header": _short_header, "garbage_header": _garbage_header,
             "foreign_keys": _foreign_keys, "read_only_mismatch": _read_only_mismatch,
             "top_k_own_k": _top_k_own_k,
             **{name: _make_bad_payload(name) for name in BAD_PAYLOADS}}


def _run(scenario: str, tmp_path, url: str) -> list[dict]:
    return run_ranks(_entry, scenario, tmp_path, url, world=WORLD)


@pytest.mark.parametrize("scenario", ["short_header", "garbage_header", "foreign_keys"])
def test_bad_wire_input_fails_every_rank_cleanly(tmp_path, scenario):
    res = _run(scenario, tmp_path, "memory://")
    for r, out in enumerate(res):
        assert "unexpected" not in out, out
        # the collective itself or, at the latest, the next one raises a CollectiveError
        assert out["error"] or out["then"]["error"], (r, out)
    first = res[0]["error"] and res[0]
    assert first and first["failed_rank"] == 1, res      # rank 0 names the culprit
    if scenario == "foreign_keys":
        assert res[0]["local_rows_added"] == 0            # nothing stored on the wrong shard
        assert "belong to other ranks" in res[0]["message"]


def test_read_only_mismatch_is_refused_at_open(tmp_path):
    import embstore

    url = f"lmdb://{tmp_path}/shared"
    embstore.open(url, dim=DIM).close()
    res = _run("read_only_mismatch", tmp_path, url)
    assert all(out.get("error") == "SchemaMismatchError" for out in res), res
    assert "read_only" in res[0]["message"]


@pytest.mark.parametrize("scenario", sorted(BAD_PAYLOADS))
def test_bad_payload_names_the_sender_and_no_rank_hangs(tmp_path, scenario):
    problem = BAD_PAYLOADS[scenario][3]
    res = _run(scenario, tmp_path, "memory://")
    for r, out in enumerate(res):
        assert "unexpected" not in out, out
        # the collective itself or, at the latest, the next one raises a RankFailureError
        err = out if out["error"] else out["then"]
        if r == 1 and problem == "announced":
            # the culprit sees that its own header does not fit what it sends
            assert err["error"] == "CollectiveError" and "its own header" in err["message"]
            continue
        assert err["error"] == "RankFailureError", (r, out)
        # ... naming a rank: the sender, or the rank that found the payload bad and told the
        # others (a timeout or a closed connection would name none; so does a header refused
        # before the exchange, which leaves its sender waiting for the timeout)
        assert err["failed_rank"] in (0, 1) or problem.startswith("fewer than"), (r, out)
    # the rank that parsed rank 1's header or payload names it and what was wrong with it
    detected = [out for out in res if out["error"] == "RankFailureError"
                and out["failed_rank"] == 1 and ("rank 1 sent" in out["message"]
                                                 or "rank 1 announced" in out["message"])]
    assert detected, res
    assert all(problem in out["message"] for out in detected), (problem, detected)


def test_top_k_answers_each_rank_with_its_own_k(tmp_path):
    res = _run("top_k_own_k", tmp_path, "memory://")
    for r, out in enumerate(res):
        assert "unexpected" not in out, out
        k = 3 + 4 * r
        assert np.array(out["keys"]).shape == (4, k)
        # the first k of everything's top 7 (ties aside, which random vectors do not have)
        assert out["keys"] == [row[:k] for row in out["keys_7"]]
        np.testing.assert_allclose(out["scores"], [row[:k] for row in out["scores_7"]])


# -- the payload parsers on crafted buffers (no processes) --------------------------------------

def test_payload_parsers_round_trip():
    from embstore_torch.distributed import wire

    keys = np.array([b"a", b"bcd", b""], dtype=object)
    q = np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM)
    got_q, k, ex = wire.unpack_queries(wire.pack_queries(q, 7, keys), DIM, "bytes", source=1)
    assert (got_q == q).all() and k == 7 and ex.tolist() == keys.tolist()
    kk, ss = np.arange(6).reshape(2, 3), np.ones((2, 3), np.float32)
    vv = np.array([[1, 1, 0], [1, 0, 0]], bool)
    buf = np.concatenate([p.reshape(-1).view(np.uint8) for p in wire.pack_candidates(kk, ss, vv)])
    ck, cs, cv = wire.unpack_candidates(buf, 2, 3, 5, "int64", owner=None, source=1)
    assert (ck == kk).all() and (cs == ss).all() and (cv == vv).all()
    assert wire.unpack_shard_weight(wire.pack_shard_weight(2.5, 4), source=1) == (2.5, 4)
    dk, dw = wire.unpack_draws(wire.pack_draws(keys, np.array([1.0, 0.5, 0.0])), 3, "bytes",
                               owner=None, source=1)
    assert dk.tolist() == keys.tolist() and dw.tolist() == [1.0, 0.5, 0.0]


def _craft(name: str) -> np.ndarray:
    from embstore_torch.distributed import wire

    q = np.ones((2, DIM), np.float32)
    good = {"queries": wire.pack_queries(q, 5, np.arange(3)),
            "draws": wire.pack_draws(np.arange(4), np.ones(4)),
            "weight": wire.pack_shard_weight(3.0, 2)}
    return good[name].copy()


def _cands(width: int = 2, flag: int = 1) -> np.ndarray:
    from embstore_torch.distributed import wire

    parts = wire.pack_candidates(np.zeros((2, width), np.int64),
                                 np.zeros((2, width), np.float32), np.ones((2, width), bool))
    buf = np.concatenate([p.reshape(-1).view(np.uint8) for p in parts])
    buf[len(buf) - 1] = flag
    return buf


@pytest.mark.parametrize("case, problem", [
    ("queries short", "top_k queries of dimension"),
    ("queries padded", "bytes for 3 int64 keys"),
    ("queries negative count", "top_k counts"),
    ("queries inf", "NaN or inf"),
    ("candidates wider than k", "at most k=1"),
    ("candidates short", "bytes of scores and flags"),
    ("candidates flag 7", "validity flags"),
    ("weight NaN", "not a finite weight"),
    ("weight negative", "not a finite weight"),
    ("weight 24 bytes", "16 belong"),
    ("support fraction", "shard support"),
    ("draws short", "bytes where 4 rows"),
    ("draws inf weight", "not a finite weight"),
    ("records padded", "bytes where 3 rows"),
])
def test_payload_parsers_name_the_sender_of_a_bad_buffer(case, problem):
    from embstore_torch.distributed import RankFailureError, wire

    dt = np.dtype([("v", np.float32, (DIM,)), ("count", np.int64)])

    def parse():
        what, _, how = case.partition(" ")
        if what == "queries":
            buf = _craft("queries")
            if how == "short":
                buf = buf[:-30]
            elif how == "padded":
                buf = np.concatenate((buf, np.zeros(8, np.uint8)))
            elif how == "negative count":
                buf[8:16] = np.array([-1], np.int64).view(np.uint8)
            else:
                buf[24:28] = np.array([np.inf], np.float32).view(np.uint8)
            wire.unpack_queries(buf, DIM, "int64", source=3)
        elif what == "candidates":
            buf = _cands(flag=7 if how == "flag 7" else 1)
            k = 1 if how == "wider than k" else 5
            wire.unpack_candidates(buf[:-1] if how == "short" else buf, 2, 2, k, "int64",
                                   owner=None, source=3)
        elif what in ("weight", "support"):
            buf = _craft("weight")
            vals = buf.view(np.float64)
            if how == "24 bytes":
                buf = np.concatenate((buf, buf[:8]))
            else:
                vals[0 if what == "weight" else 1] = {"NaN": np.nan, "negative": -1.0,
                                                      "fraction": 1.5}[how]
            wire.unpack_shard_weight(buf, source=3)
        elif what == "draws":
            buf = _craft("draws")
            if how == "inf weight":
                buf[-8:] = np.array([np.inf]).view(np.uint8)
            wire.unpack_draws(buf[:-4] if how == "short" else buf, 4, "int64", owner=None,
                              source=3)
        else:
            recs = np.zeros(3, dt)
            buf = np.concatenate((wire.pack_records(np.arange(3), recs), np.zeros(2, np.uint8)))
            wire.unpack_records(buf, 3, "int64", dt, owner=None, source=3)

    with pytest.raises(RankFailureError, match=problem) as info:
        parse()
    assert info.value.failed_rank == 3 and "rank 3 sent" in str(info.value)


def test_draws_and_candidates_of_keys_the_sender_does_not_own_are_refused():
    from embstore_torch.distributed import RankFailureError, wire

    keys = _own_keys(0, 4)
    with pytest.raises(RankFailureError, match="belong to other ranks") as info:
        wire.unpack_draws(wire.pack_draws(keys, np.ones(4)), 4, "int64", owner=(1, WORLD),
                          source=1)
    assert info.value.failed_rank == 1
    # an invalid top_k cell's key is filler: only the valid ones must be the shard's own
    parts = wire.pack_candidates(keys.reshape(2, 2), np.zeros((2, 2), np.float32),
                                 np.zeros((2, 2), bool))
    buf = np.concatenate([p.reshape(-1).view(np.uint8) for p in parts])
    wire.unpack_candidates(buf, 2, 2, 5, "int64", owner=(1, WORLD), source=1)
    buf[-1] = 1
    with pytest.raises(RankFailureError, match="belong to other ranks"):
        wire.unpack_candidates(buf, 2, 2, 5, "int64", owner=(1, WORLD), source=1)
