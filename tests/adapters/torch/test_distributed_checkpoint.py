"""Checkpoints of ``embstore_torch.distributed`` stores: 2 ranks on gloo (spawned processes).

One spawn runs every rank-side case: ``state_dict`` is local (rank 0 alone saves while rank 1
waits at a barrier: a collective inside would hang until the join timeout kills the ranks),
``torch.distributed.checkpoint`` save/load restores every rank's shard bit for bit, per-rank
``torch.save`` files restore too, and a shared store keeps the true global step. The parent
then restarts with another world size, in every URL form.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embstore  # noqa: E402
from embstore.errors import SchemaMismatchError  # noqa: E402
from tests.adapters.torch.test_distributed import _free_port  # noqa: E402
from tests.restore_crash import table_digest  # noqa: E402

WORLD = 2
DIM = 4
JOIN_TIMEOUT = 240.0


def _entry(rank: int, port: int, outdir: str) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        _ranks(rank, outdir)
    except BaseException:
        with open(os.path.join(outdir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _train(module, rank: int, steps: int, seed: int) -> None:
    for t in range(steps):
        rng = np.random.default_rng(100 * seed + 10 * t + rank)
        keys = torch.from_numpy(rng.integers(0, 40, size=(6,)))
        module(keys).sum().backward()


def _ranks(rank: int, outdir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import embstore_torch.distributed as ed
    from embstore_torch import DynamicEmbedding

    out: dict = {}
    # -- one store per rank ({rank} and {world} in the URL) ---------------------------------
    store = ed.open(f"lmdb://{outdir}/sh-{{rank}}-of-{{world}}", dim=DIM, optimizer="adagrad",
                    timeout=60)
    model = torch.nn.Sequential(DynamicEmbedding(store))
    _train(model, rank, 3, seed=1)
    if rank == 0:  # the usual pattern: a collective inside state_dict would hang here
        torch.save(model.state_dict(), os.path.join(outdir, "rank0.pt"))
    dist.barrier()
    torch.save(model.state_dict(), os.path.join(outdir, f"own-{rank}.pt"))
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(outdir, "dcp"))
    out["saved"] = (table_digest(store.local), store.step)
    _train(model, rank, 2, seed=2)
    out["moved_on"] = (table_digest(store.local), store.step)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(outdir, "dcp"))
    model.load_state_dict(sd)
    out["after_dcp"] = (table_digest(store.local), store.step)
    _train(model, rank, 1, seed=3)
    model.load_state_dict(torch.load(os.path.join(outdir, f"own-{rank}.pt"), weights_only=True))
    out["after_torch_load"] = (table_digest(store.local), store.step)
    try:  # the other rank's file is refused (and changes nothing)
        model.load_state_dict(torch.load(os.path.join(outdir, f"own-{1 - rank}.pt"),
                                         weights_only=True))
        out["other_rank"] = "loaded"
    except SchemaMismatchError as e:
        out["other_rank"] = str(e)
    out["after_refusal"] = (table_digest(store.local), store.step)
    store.close()
    # -- a store per rank without {world} ---------------------------------------------------
    with ed.open(f"lmdb://{outdir}/nw-{{rank}}", dim=DIM, timeout=60) as s2:
        _train(torch.nn.Sequential(DynamicEmbedding(s2)), rank, 1, seed=4)
    # -- one shared store under both ranks: the stored step is the global one ---------------
    shared = ed.open(f"lmdb://{outdir}/shared", dim=DIM, timeout=60)
    m = DynamicEmbedding(shared)
    _train(m, rank, 10, seed=5)
    out["shared_step"] = shared.step
    shared.flush()
    out["shared_step_after_flush"] = shared.step
    sd = m.state_dict()
    _train(m, rank, 2, seed=6)
    m.load_state_dict(sd)
    out["shared_step_restored"] = shared.step
    shared.close()
    with open(os.path.join(outdir, f"rank-{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    import torch.multiprocessing as mp

    outdir = str(tmp_path_factory.mktemp("dist-ckpt"))
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, port, outdir)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(JOIN_TIMEOUT)
    finally:
        hung = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():  # a deadlock: fail instead of hanging the suite
                p.kill()
                p.join(5)
    errors = "\n".join(open(os.path.join(outdir, f)).read() for f in sorted(os.listdir(outdir))
                       if f.startswith("error-"))
    assert not hung, f"ranks {hung} hung (a collective inside state_dict?)\n{errors}"
    assert [p.exitcode for p in procs] == [0] * WORLD, errors
    results = [json.load(open(os.path.join(outdir, f"rank-{r}.json"))) for r in range(WORLD)]
    return outdir, results


def test_state_dict_is_local_and_dcp_restores_every_shard_bit_for_bit(ran):
    outdir, results = ran
    assert os.path.exists(os.path.join(outdir, "rank0.pt"))
    for rank, r in enumerate(results):
        assert r["moved_on"] != r["saved"]
        assert r["after_dcp"] == r["saved"]
        assert r["after_torch_load"] == r["saved"]
        assert f"holds the shards of ranks ['{1 - rank}'], not rank {rank}'s" in r["other_rank"]
        assert r["after_refusal"] == r["saved"]
    assert results[0]["saved"][1] == results[1]["saved"][1] == 3


def test_a_shared_store_keeps_the_true_global_step(ran):
    outdir, results = ran
    assert [r["shared_step"] for r in results] == [10, 10]
    assert [r["shared_step_after_flush"] for r in results] == [10, 10]
    assert [r["shared_step_restored"] for r in results] == [10, 10]
    with embstore.open(f"lmdb://{outdir}/shared", read_only=True) as s:
        assert s.step == 10


@pytest.mark.parametrize("template", ["sh-{rank}-of-{world}", "nw-{rank}"])
def test_a_restart_with_another_world_size_is_refused_naming_the_reshard_command(ran, template):
    import torch.distributed as dist

    import embstore_torch.distributed as ed

    outdir, _ = ran
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(SchemaMismatchError, match="embstore copy") as err:
            ed.open(f"lmdb://{outdir}/{template}", dim=DIM, timeout=30)
        assert "\n" not in str(err.value)
    finally:
        dist.destroy_process_group()
    assert not os.path.exists(f"{outdir}/sh-0-of-1")  # no empty shard was created


def test_a_two_rank_snapshot_is_refused_by_a_world_of_one(ran, tmp_path):
    import torch.distributed as dist

    import embstore_torch.distributed as ed
    from embstore_torch import DynamicEmbedding

    outdir, _ = ran
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        with ed.open(f"lmdb://{tmp_path}/one-{{rank}}", dim=DIM, optimizer="adagrad",
                     timeout=30) as s:
            m = torch.nn.Sequential(DynamicEmbedding(s))
            with pytest.raises(SchemaMismatchError, match="world of 2.*embstore copy"):
                m.load_state_dict(torch.load(os.path.join(outdir, "own-0.pt"),
                                             weights_only=True))
    finally:
        dist.destroy_process_group()
