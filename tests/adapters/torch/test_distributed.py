"""embstore_torch.distributed: 2 ranks on gloo (spawned processes, free loopback port).

Each spawn of torch costs seconds, so one spawn runs every training case (memory, LMDB shards,
Bigtable + per-rank write-back cache) and the collective checks (top_k, sample, len,
contains, mismatched calls); a second spawn kills a rank. The parent compares what the ranks
wrote with a single-process run on the concatenated batches.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embstore  # noqa: E402
from embstore.errors import SchemaMismatchError, StoreNotFoundError  # noqa: E402
from embstore.io.native import NativeReader  # noqa: E402
from embstore.layers.sharded import sharded_url  # noqa: E402

WORLD = 2
DIM = 8
STEPS = 4
ROWS = 4          # examples per rank per step
NKEYS = 24        # small key range: the ranks' batches overlap on most keys
SGD = {"name": "sgd", "lr": 0.5}
ADAGRAD = {"name": "adagrad", "lr": 0.1}
COMPARED = ("vector", "count", "last_step")


# -- the data: each rank's batch of one step, and the single-process concatenation ------------
def _batch(rank: int, t: int, dyadic: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * t + rank)
    keys = rng.integers(0, NKEYS, size=(ROWS, 3))
    if dyadic:  # multiples of 1/4: every gradient sum is exact in float32
        w = rng.integers(-4, 5, size=(ROWS, 3, DIM)) / 4.0
    else:
        w = rng.normal(size=(ROWS, 3, DIM))
    return keys, w.astype(np.float32)


def _loss(module, keys, w: np.ndarray, bag: bool, rows: int):
    """A mean over the examples (as each rank's loss in DDP)."""
    if isinstance(keys, np.ndarray):
        keys = torch.from_numpy(keys)
    if bag:
        out = module(keys)                                          # (rows, dim)
        return (out * torch.from_numpy(w[:, 0])).sum() / rows
    return (module(keys) * torch.from_numpy(w)).sum() / rows


def _module(store, bag: bool):
    from embstore_torch import DynamicEmbedding, DynamicEmbeddingBag

    return DynamicEmbeddingBag(store, mode="sum") if bag else DynamicEmbedding(store)


CASES = {
    # name: (url template, options, optimizer, dyadic gradients, bag module)
    "memory": ("memory://", {}, SGD, True, False),
    "lmdb": ("lmdb://{tmp}/lm-{{rank}}-of-{{world}}", {}, ADAGRAD, False, True),
    "bigtable": ("{bigtable}", {"cache": "memory://", "write_policy": "back",
                                "cache_capacity": 16}, SGD, True, False),
    "bigtable_shards": ("{bigtable}-{{rank}}-of-{{world}}", {"cache": "memory://",
                                                            "cache_capacity": 16},
                        ADAGRAD, False, True),
}


def _reference(optimizer: dict, dyadic: bool, bag: bool) -> embstore.EmbeddingStore:
    store = embstore.open("memory://", dim=DIM, optimizer=optimizer)
    module = _module(store, bag)
    for t in range(STEPS):
        parts = [_batch(r, t, dyadic) for r in range(WORLD)]
        keys = np.concatenate([p[0] for p in parts])
        w = np.concatenate([p[1] for p in parts])
        _loss(module, keys, w, bag, ROWS * WORLD).backward()
    return store


def _records(batches) -> dict[int, np.void]:
    out = {}
    for keys, recs in batches:
        for k, r in zip(keys.tolist(), recs, strict=True):
            assert k not in out, f"key {k} twice"
            out[k] = r
    return out


def _assert_same(got: dict, want: dict, tol: float) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        for f in COMPARED + tuple(n for n in want[k].dtype.names if n == "accum"):
            a, b = np.asarray(got[k][f]), np.asarray(want[k][f])
            if tol == 0 or f in ("count", "last_step"):
                assert a.tobytes() == b.tobytes(), (k, f, a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=f"key {k} {f}")


# -- running ranks --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn_name: str, rank: int, port: int, outdir: str, cfg: dict) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        globals()[fn_name](rank, outdir, cfg)
    except BaseException:
        with open(os.path.join(outdir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # skip interpreter teardown of the process groups (a peer may be gone)


def _spawn(fn_name: str, outdir: str, cfg: dict, timeout: float = 240.0) -> list[int | None]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn_name, r, port, outdir, cfg))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():  # a hang: fail the test instead of hanging it
                p.kill()
                p.join(5)
    return [p.exitcode for p in procs]


def _errors(outdir: str) -> str:
    return "\n".join(open(os.path.join(outdir, f)).read() for f in sorted(os.listdir(outdir))
                     if f.startswith("error-"))


# -- rank side ------------------------------------------------------------------------------------
def _train_ranks(rank: int, outdir: str, cfg: dict) -> None:
    import embstore_torch.distributed as ed

    report: dict = {}
    for name, (url, options, optimizer, dyadic, bag) in CASES.items():
        url = cfg["urls"][name]
        if url is None:
            continue
        store = ed.open(url, dim=DIM, optimizer=optimizer, timeout=60, **options)
        module = _module(store, bag)
        for t in range(STEPS):
            keys, w = _batch(rank, t, dyadic)
            _loss(module, keys, w, bag, ROWS).backward()
            if "cache" in options:  # the owners' caches load the next batch's rows
                store.prefetch(_batch(rank, t + 1, dyadic)[0].reshape(-1))
        store.flush()
        report[name] = {"url": store.url, "len": len(store), "step": store.step}
        store.export(os.path.join(outdir, f"{name}.emb"))
        if name == "memory":
            _collective_checks(store, rank, outdir)
            _mismatch(store, rank, report)
        else:
            store.close()
    _bytes_case(rank, outdir, report)
    with open(os.path.join(outdir, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)


def _words(keys: np.ndarray) -> list:
    return [[f"w{k}" for k in row] for row in keys.tolist()]


def _bytes_case(rank: int, outdir: str, report: dict) -> None:
    """bytes keys travel as lengths + data."""
    import embstore_torch.distributed as ed

    store = ed.open("memory://", dim=DIM, key_type="bytes", optimizer=SGD, timeout=60)
    module = _module(store, False)
    for t in range(2):
        keys, w = _batch(rank, t, True)
        _loss(module, _words(keys), w, False, ROWS).backward()
    report["bytes"] = {"len": len(store)}
    store.export(os.path.join(outdir, "bytes.emb"))
    store.close()


_EXCLUDE = [np.array([0, 1, 2]), np.array([3, 4])]


def _collective_checks(store, rank: int, outdir: str) -> None:
    from embstore.sampling import UnigramSampler

    queries = np.random.default_rng(rank).normal(size=(rank + 1, DIM)).astype(np.float32)
    keys, scores = store.top_k(queries, 5)
    # more than there are rows, each rank excluding its own keys (every shard applies the
    # asking rank's exclusions): the width is what is left, as one store gives
    padded = store.top_k(queries, NKEYS + 10, exclude=_EXCLUDE[rank])
    probe = np.arange(NKEYS + 4)
    found = store.contains(probe)
    store.prefetch(probe[::-1])  # a collective hint; memory:// has nothing to load
    uni = store.sample(np.array([1, 2]), 6, "uniform", seed=rank)
    gram = store.sample(np.array([3]), 5, UnigramSampler(0.75), unique=False, seed=rank,
                        remove_accidental_hits=False)
    # A rank with nothing to look up still takes part in the collective.
    empty = store.lookup(np.zeros(0, np.int64) if rank else np.array([5, 5, 7]), insert=False)
    # ... and in an update (last: it changes key 5)
    before = store.lookup(np.array([5]), insert=False)
    store.update(np.zeros(0, np.int64) if rank else np.array([5, 5]),
                 np.ones((0 if rank else 2, DIM), np.float32))
    after = store.lookup(np.array([5]), insert=False)
    assert (after == before - np.float32(0.5)).all()  # 2 rows summed, / 2 ranks, lr 0.5
    # SampledSoftmaxLoss unchanged on top (sample + store_rows + update, all collectives)
    from embstore_torch import SampledSoftmaxLoss

    hidden = torch.ones(3, DIM, requires_grad=True)
    loss = SampledSoftmaxLoss(store, num_sampled=4, sampler="uniform")(
        hidden, torch.tensor([1, 2, 3]) + rank)
    loss.backward()
    assert torch.isfinite(loss) and hidden.grad is not None
    # The modules take part with an empty batch too: forward looks up, backward updates.
    from embstore_torch import DynamicEmbedding, DynamicEmbeddingBag

    ids = torch.zeros(0, dtype=torch.int64) if rank else torch.tensor([9, 9, 11])
    DynamicEmbedding(store)(ids).sum().backward()
    bags = DynamicEmbeddingBag(store, mode="mean")(ids, torch.tensor([0]))
    bags.sum().backward()
    assert bags.shape == (1, DIM)
    np.savez(os.path.join(outdir, f"checks-{rank}.npz"), queries=queries, keys=keys,
             scores=scores, pad_keys=padded.keys, pad_scores=padded.scores,
             pad_valid=padded.valid, found=found, uni_keys=uni.keys, uni_prob=uni.prob,
             uni_tries=uni.num_tries, uni_pos=uni.is_positive, gram_keys=gram.keys,
             gram_prob=gram.prob, gram_tries=gram.num_tries, empty=empty)


def _mismatch(store, rank: int, report: dict) -> None:
    from embstore_torch.distributed import CollectiveMismatchError

    try:
        if rank == 0:
            store.lookup(np.array([1, 2]))
        else:
            len(store)
    except CollectiveMismatchError as e:
        report["mismatch"] = str(e)
    else:
        report["mismatch"] = None


def _failing_ranks(rank: int, outdir: str, cfg: dict) -> None:
    import time

    import embstore_torch.distributed as ed
    from embstore.registry import backend_class
    from embstore.store import EmbeddingStore
    from embstore_torch.distributed import RankFailureError
    from embstore_torch.distributed.shard import ShardView

    # 0. a run that finds only some of its shards refuses to start, creating nothing
    partial = cfg["partial"]
    if rank == 0:
        one = partial.format(rank=0, world=WORLD)
        EmbeddingStore(ShardView(backend_class(one)(one), 0, WORLD), dim=DIM).close()
    try:
        ed.open(partial, dim=DIM, timeout=cfg["timeout"] * 10)
    except SchemaMismatchError as e:
        _note(outdir, f"partial-{rank}", {"error": str(e)})
    # 1. a rank that raised and stays alive (does not call): the other times out
    store = ed.open("memory://", dim=DIM, timeout=cfg["timeout"])
    store.lookup(np.arange(10))
    if rank == 1:
        time.sleep(1)  # "raised" in user code: never calls this store again
    else:
        t0 = time.monotonic()
        try:
            store.lookup(np.arange(10))
        except RankFailureError as e:
            _note(outdir, "hang", {"error": str(e), "seconds": time.monotonic() - t0})
    # 2. a rank whose own part fails (its store raises; an injected fault) tells the others:
    #    their next collective raises at once, not after the timeout
    for what in ("update", "lookup"):
        store = ed.open("memory://", dim=DIM, timeout=120)
        store.lookup(np.arange(20))
        if rank == 1:
            def broken(*a, **k):
                raise OSError("injected store failure")
            setattr(store.local, what, broken)
        try:
            if what == "update":
                store.update(np.arange(20), np.ones((20, DIM), np.float32))
            else:
                store.lookup(np.arange(20))
            len(store)
        except (OSError, RankFailureError) as e:
            _note(outdir, f"{what}-{rank}", {"error": f"{type(e).__name__}: {e}"})
    # 3. a rank that dies after an acknowledged (flushed) update: the survivor raises at once
    store = ed.open(cfg["url"], dim=DIM, optimizer=SGD, timeout=cfg["timeout"] * 10)
    store.update(np.arange(20), np.ones((20, DIM), np.float32))
    store.flush()
    if rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        store.update(np.arange(20), np.ones((20, DIM), np.float32))
    except RankFailureError as e:
        _note(outdir, "died", {"error": str(e), "seconds": time.monotonic() - t0})
    try:
        len(store)
    except ed.CollectiveError as e:
        _note(outdir, "after", {"error": str(e)})


def _note(outdir: str, name: str, data: dict) -> None:
    with open(os.path.join(outdir, f"{name}.json"), "w") as f:
        json.dump(data, f)


# -- tests ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    """One spawn of 2 ranks running every case; yields (outdir, urls, per-rank reports)."""
    outdir = str(tmp_path_factory.mktemp("dist"))
    urls = {"memory": "memory://",
            "lmdb": f"lmdb://{outdir}/lm-{{rank}}-of-{{world}}",
            "bigtable": None, "bigtable_shards": None}
    try:
        request.getfixturevalue("bigtable_emulator")  # sets BIGTABLE_EMULATOR_HOST
        urls["bigtable"] = f"bigtable://test-project/test-instance/dist{os.getpid()}"
        urls["bigtable_shards"] = urls["bigtable"] + "-{rank}-of-{world}"  # a table per rank
    except pytest.skip.Exception:
        pass
    codes = _spawn("_train_ranks", outdir, {"urls": urls})
    assert codes == [0, 0], _errors(outdir)
    reports = [json.load(open(os.path.join(outdir, f"report-{r}.json"))) for r in range(WORLD)]
    return outdir, urls, reports


@pytest.mark.parametrize("name", list(CASES))
def test_training_matches_one_process(trained, name):
    """Zero lost updates on overlapping keys: every record equals a single-process run on
    the concatenated batches (SGD with exact gradients bit for bit, Adagrad within 1e-5)."""
    outdir, urls, reports = trained
    if urls[name] is None:
        pytest.skip("no Bigtable emulator")
    _, _, optimizer, dyadic, bag = CASES[name]
    want = _records(_reference(optimizer, dyadic, bag).records())
    with NativeReader(os.path.join(outdir, f"{name}.emb")) as r:
        got = _records(r)
        assert r.header["step"] == STEPS
    _assert_same(got, want, 0 if dyadic else 1e-5)
    assert [rep[name]["len"] for rep in reports] == [len(want)] * WORLD
    assert [rep[name]["step"] for rep in reports] == [STEPS] * WORLD
    # one store per rank reopens as sharded://; a shared store under its own URL
    assert reports[0][name]["url"].startswith("sharded://") == ("{rank}" in urls[name]
                                                               or name == "memory")


def test_bytes_keys_match_one_process(trained):
    outdir, _, reports = trained
    store = embstore.open("memory://", dim=DIM, key_type="bytes", optimizer=SGD)
    module = _module(store, False)
    for t in range(2):
        parts = [_batch(r, t, True) for r in range(WORLD)]
        keys = np.concatenate([p[0] for p in parts])
        w = np.concatenate([p[1] for p in parts])
        _loss(module, _words(keys), w, False, ROWS * WORLD).backward()
    want = _records(store.records())
    with NativeReader(os.path.join(outdir, "bytes.emb")) as r:
        _assert_same(_records(r), want, 0)
    assert [rep["bytes"]["len"] for rep in reports] == [len(want)] * WORLD


def test_shards_reopen_as_sharded_store_and_reshard(trained, tmp_path):
    from embstore.cli import main

    outdir, _, reports = trained
    url = reports[0]["lmdb"]["url"]
    shards = [f"lmdb://{outdir}/lm-{r}-of-{WORLD}" for r in range(WORLD)]
    assert url == sharded_url(shards) == reports[1]["lmdb"]["url"]
    want = _records(_reference(ADAGRAD, False, True).records())
    with embstore.open(url, read_only=True) as s:
        assert s.step == STEPS
        _assert_same(_records(s.records()), want, 1e-5)
        # each key sits on the shard sharded:// routes it to
        for i, shard in enumerate(s.backend.shards):
            keys = np.concatenate([k for k, _ in shard.scan()])
            assert (s.backend.shard_of(keys) == i).all()
    with pytest.raises(SchemaMismatchError, match="shard"):
        embstore.open(sharded_url(shards[:1]), read_only=True)
    with pytest.raises(SchemaMismatchError):
        embstore.open(shards[0], read_only=True)  # one shard alone is not a store
    # reshard to 3, named as a 3-rank run would open them
    dst = f"lmdb://{tmp_path}/re-{{rank}}-of-{{world}}"
    assert main(["copy", url, dst, "--shards", "3", "-q"]) == 0
    three = [dst.format(rank=i, world=3) for i in range(3)]
    with embstore.open(sharded_url(three), read_only=True) as s:
        _assert_same(_records(s.records()), want, 1e-5)
    # what rank 1 of a 3-rank run opens; a 2-rank run is refused
    from embstore.registry import backend_class
    from embstore.store import EmbeddingStore
    from embstore_torch.distributed.shard import ShardView

    with EmbeddingStore(ShardView(backend_class(three[1])(three[1]), 1, 3)) as s:
        assert len(s) and (s.backend.inner.url == three[1]) and s.step == STEPS
    with pytest.raises(SchemaMismatchError, match="original world size"):
        EmbeddingStore(ShardView(backend_class(three[1])(three[1]), 1, 2))


def test_top_k_sample_contains_and_empty_batches(trained):
    from embstore.sampling.candidate import expected_count

    outdir, _, _ = trained
    ref = _reference(SGD, True, False)
    counts = {k: int(r["count"]) for k, r in _records(ref.records()).items()}
    for rank in range(WORLD):
        c = np.load(os.path.join(outdir, f"checks-{rank}.npz"))
        keys, scores = ref.top_k(c["queries"], 5)
        assert (c["keys"] == keys).all()
        np.testing.assert_allclose(c["scores"], scores, rtol=1e-6, atol=1e-6)  # matmul blocking
        want = ref.top_k(c["queries"], NKEYS + 10, exclude=_EXCLUDE[rank])
        assert c["pad_keys"].shape == want.keys.shape
        assert (c["pad_valid"] == want.valid).all() and (c["pad_keys"] == want.keys).all()
        assert not set(c["pad_keys"].reshape(-1).tolist()) & set(_EXCLUDE[rank].tolist())
        np.testing.assert_allclose(c["pad_scores"], want.scores, rtol=1e-6, atol=1e-6)
        assert (c["found"] == np.isin(np.arange(NKEYS + 4), list(counts))).all()
        # uniform unique sampling: distinct stored negatives, TF's expected-count formula
        neg = c["uni_keys"][~c["uni_pos"]]
        assert len(set(neg.tolist())) == len(neg) and set(neg.tolist()) <= set(counts)
        assert not set(neg.tolist()) & {1, 2}
        p = expected_count(np.array([1 / len(counts) if k in counts else 0.0
                                     for k in c["uni_keys"].tolist()]), int(c["uni_tries"]), True)
        np.testing.assert_allclose(c["uni_prob"], p, rtol=1e-12)
        # unigram^0.75 over the counts of all shards, as one store would weigh them
        w = {k: v ** 0.75 for k, v in counts.items()}
        total = sum(w.values())
        assert len(c["gram_keys"]) == 6 and int(c["gram_tries"]) == 5
        want = [w[k] / total * 5 for k in c["gram_keys"].tolist()]
        np.testing.assert_allclose(c["gram_prob"], want, rtol=1e-9)
        if rank == 0:
            np.testing.assert_array_equal(c["empty"], ref.lookup([5, 5, 7], insert=False))
        else:
            assert c["empty"].shape == (0, DIM)


def test_mismatched_collectives_are_detected(trained):
    _, _, reports = trained
    for rep in reports:
        assert rep["mismatch"] is not None
        assert "lookup" in rep["mismatch"] and "len" in rep["mismatch"]


def test_rank_failure_raises_on_survivor_and_keeps_flushed_writes(tmp_path):
    outdir = str(tmp_path / "out")
    os.makedirs(outdir)
    tmpl = f"lmdb://{tmp_path}/f-{{rank}}-of-{{world}}"
    partial = f"lmdb://{tmp_path}/p-{{rank}}-of-{{world}}"
    codes = _spawn("_failing_ranks", outdir, {"timeout": 3.0, "url": tmpl, "partial": partial},
                   timeout=120)
    assert codes == [0, 3], _errors(outdir)
    for r in range(WORLD):
        note = json.load(open(os.path.join(outdir, f"partial-{r}.json")))
        assert "ranks [1] hold no store" in note["error"]
    with pytest.raises(StoreNotFoundError):  # rank 1's shard was not created
        embstore.open(partial.format(rank=1, world=WORLD), read_only=True)
    hang = json.load(open(os.path.join(outdir, "hang.json")))
    assert "lookup" in hang["error"] and hang["seconds"] < 60
    for what in ("update", "lookup"):
        assert "injected" in json.load(open(os.path.join(outdir, f"{what}-1.json")))["error"]
        survivor = json.load(open(os.path.join(outdir, f"{what}-0.json")))["error"]
        assert "RankFailureError" in survivor and "rank 1" in survivor and "aborted" in survivor
    died = json.load(open(os.path.join(outdir, "died.json")))
    assert "update" in died["error"]
    assert "unusable" in json.load(open(os.path.join(outdir, "after.json")))["error"]
    # the acknowledged (flushed) update is on disk, on both shards
    shards = [tmpl.format(rank=r, world=WORLD) for r in range(WORLD)]
    with embstore.open(sharded_url(shards), read_only=True) as s:
        init = s.initial_vectors(np.arange(20))
        got = s.lookup(np.arange(20), insert=False)
        np.testing.assert_array_equal(got, init - np.float32(0.5))  # (1 + 1) / 2 * lr


def test_world_of_one_in_process_equals_plain_store(tmp_path):
    """A world of one (no spawn): the same records as the plain store, shard-recorded."""
    import torch.distributed as dist

    import embstore_torch.distributed as ed

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        url = f"lmdb://{tmp_path}/one-{{rank}}-of-{{world}}"
        store = ed.open(url, dim=DIM, optimizer=ADAGRAD, timeout=30)
        plain = embstore.open("memory://", dim=DIM, optimizer=ADAGRAD)
        for s in (store, plain):
            module = _module(s, True)
            for t in range(STEPS):
                keys, w = _batch(0, t, False)
                _loss(module, keys, w, True, ROWS).backward()
        assert len(store) == len(plain) and store.step == plain.step == STEPS
        _assert_same(_records(store.local.records()), _records(plain.records()), 0)
        assert store.url == sharded_url([f"lmdb://{tmp_path}/one-0-of-1"])
        keys, scores = store.top_k(np.ones((2, DIM), np.float32), 3)
        want = plain.top_k(np.ones((2, DIM), np.float32), 3)
        assert (keys == want[0]).all()
        np.testing.assert_allclose(scores, want[1], rtol=1e-6, atol=1e-6)
        store.close()
        with embstore.open(sharded_url([f"lmdb://{tmp_path}/one-0-of-1"]),
                           read_only=True) as s:
            assert len(s) == len(plain)
    finally:
        dist.destroy_process_group()
