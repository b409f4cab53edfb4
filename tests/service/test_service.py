"""The DynamicEmbedding Service: real `embstore serve` processes on loopback, des:// clients.

Workers are started by `embstore.testing.service` (stopped by PID); every test compares what
the service answers with one local store given the same seed, or with arithmetic it knows.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import numpy as np
import pytest

import embstore
from embstore.errors import (
    AuthenticationError,
    BackendError,
    InvalidInputError,
    ReadOnlyError,
    SchemaMismatchError,
    ShardMismatchError,
)
from embstore.testing.protocols import conformance_problems

pytest.importorskip("pyarrow.flight")

from embstore.service.client import DesStore  # noqa: E402
from embstore.testing.service import start_worker, start_workers  # noqa: E402
from tests.paths import REPO_ROOT

SGD1 = json.dumps({"name": "sgd", "lr": 1.0})
DIM = 8


@pytest.fixture(params=["memory", "lmdb"])
def two_workers(request, tmp_path):
    urls = (["memory://", "memory://"] if request.param == "memory"
            else [f"lmdb://{tmp_path}/s0", f"lmdb://{tmp_path}/s1"])
    with start_workers(urls, dim=DIM, optimizer="adagrad", seed=7) as workers:
        yield workers


def test_des_store_satisfies_the_store_protocol():
    assert conformance_problems(embstore.StoreProtocol, DesStore) == []


def test_two_workers_answer_as_one_store(two_workers):
    rng = np.random.default_rng(0)
    local = embstore.open("memory://", dim=DIM, optimizer="adagrad", seed=7)
    with embstore.open(two_workers.url, dim=DIM) as des:
        assert isinstance(des, embstore.StoreProtocol)
        for _ in range(5):
            keys = rng.integers(0, 300, 256)
            np.testing.assert_array_equal(des.lookup(keys), local.lookup(keys))
            g = rng.standard_normal((256, DIM), dtype=np.float32)
            des.update(keys, g)
            local.update(keys, g)
        probe = np.arange(-5, 305)
        np.testing.assert_array_equal(des.lookup(probe, insert=False),
                                      local.lookup(probe, insert=False))
        np.testing.assert_array_equal(des.contains(probe), local.contains(probe))
        assert len(des) == len(local)
        grid = np.arange(12).reshape(3, 4)
        assert des.lookup(grid).shape == (3, 4, DIM)
        des.assign([1000], np.ones((1, DIM)))
        local.assign([1000], np.ones((1, DIM)))
        assert des.delete([1000, 1, 99999]) == local.delete([1000, 1, 99999])
        q = rng.standard_normal((4, DIM), dtype=np.float32)
        for exclude in (None, [2, 3], [[5], [], [6, 7], []]):
            dk, ds = des.top_k(q, 7, exclude)
            lk, ls = local.top_k(q, 7, exclude)
            np.testing.assert_array_equal(dk, lk)
            # float32 dot products: BLAS blocks another matrix shape differently
            np.testing.assert_allclose(ds, ls, rtol=1e-5, atol=1e-6)
        # unique=False: every positive's expected count is one store's for count samplers
        for sampler in ("uniform", embstore.sampling.UnigramSampler(0.75)):
            r = des.sample([3, 4], 50, sampler, unique=False, seed=1,
                           remove_accidental_hits=False)
            o = local.sample([3, 4], 50, sampler, unique=False, seed=1)
            np.testing.assert_allclose(r.prob[r.is_positive], o.prob[o.is_positive])
            assert local.contains(r.keys).all() and len(r.negatives) == 50
        u = des.sample([3], 40, "uniform", seed=2)
        assert len(set(u.negatives.tolist()) - {3}) == len(u.negatives)
        des.flush()
        stats = des.stats()
        assert stats["shards"] == 2 and stats["updates"] == 5 * 256


def test_export_of_the_service_imports_as_the_same_table(two_workers, tmp_path):
    with embstore.open(two_workers.url) as des:
        keys = np.arange(500)
        des.update(keys, np.full((500, DIM), 0.5, np.float32))
        n = des.export(str(tmp_path / "all.emb"))
        assert n == 500
        with embstore.open("memory://", dim=DIM, optimizer="adagrad") as copy:
            copy.import_(str(tmp_path / "all.emb"))
            np.testing.assert_array_equal(copy.lookup(keys, insert=False),
                                          des.lookup(keys, insert=False))


def _trainer(url: str, p: int, steps: int) -> None:
    store = embstore.open(url)
    keys = np.arange(0, 200, dtype=np.int64)
    for _ in range(steps):
        store.update(keys, np.full((len(keys), DIM), float(p + 1), np.float32))
    store.close()


def test_three_trainer_processes_lose_no_update(tmp_path):
    urls = [f"lmdb://{tmp_path}/t0", f"lmdb://{tmp_path}/t1"]
    with start_workers(urls, dim=DIM, optimizer=SGD1, initializer="zeros") as workers:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_trainer, args=(workers.url, p, 15)) for p in range(3)]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join(120)
            assert pr.exitcode == 0
        with embstore.open(workers.url) as des:
            # SGD lr=1 on integer gradients: exact, whatever order the updates arrived in
            expected = -15.0 * (1 + 2 + 3)
            np.testing.assert_array_equal(des.lookup(np.arange(200)),
                                          np.full((200, DIM), expected, np.float32))
            assert des.stats()["updates"] == 3 * 15 * 200


def test_torch_module_trains_through_the_service():
    torch = pytest.importorskip("torch")
    from embstore_torch import DynamicEmbeddingBag

    with start_workers(["memory://", "memory://"], dim=DIM, optimizer=SGD1,
                       initializer="zeros") as workers, embstore.open(workers.url) as des:
        emb = DynamicEmbeddingBag(des, mode="sum")
        ids = torch.tensor([[1, 2], [2, 3]])
        emb(ids).sum().backward()
        got = des.lookup([1, 2, 3], insert=False)
        np.testing.assert_array_equal(got[:, 0], [-1.0, -2.0, -1.0])


def test_a_killed_worker_fails_calls_within_the_deadline_and_serves_after_restart(tmp_path):
    url = f"lmdb://{tmp_path}/k0"
    w = start_worker(url, dim=DIM, optimizer=SGD1, initializer="zeros")
    try:
        with embstore.open(f"des://{w.address}", timeout=3) as des:
            des.update([1, 2], np.ones((2, DIM), np.float32))
            des.flush()
            w.kill()
            t = time.monotonic()
            with pytest.raises(BackendError, match=w.address):
                des.lookup([1])
            assert time.monotonic() - t < 10
        w = start_worker(url, port=w.port, dim=DIM, optimizer=SGD1)
        with embstore.open(f"des://{w.address}") as des:
            np.testing.assert_array_equal(des.lookup([1, 2], insert=False),
                                          np.full((2, DIM), -1.0, np.float32))
    finally:
        w.kill()


def test_graceful_stop_flushes_what_a_worker_holds(tmp_path):
    url = f"lmdb://{tmp_path}/g0"
    w = start_worker(url, dim=DIM, optimizer=SGD1, initializer="zeros", durable=False)
    with embstore.open(f"des://{w.address}") as des:
        des.update([7], np.ones((1, DIM), np.float32))
    assert w.stop() == 0
    with embstore.open(url, read_only=True) as s:
        np.testing.assert_array_equal(s.lookup([7], insert=False), np.full((1, DIM), -1.0))


def test_workers_refuse_foreign_shards_wrong_n_tokens_and_bad_input(tmp_path):
    import pyarrow.flight as flight

    from embstore._keys import key_hash64
    from embstore.service import wire

    tokens = tmp_path / "tokens"
    tokens.write_text("train " + "t" * 20 + "\nserve " + "s" * 20 + "\n")
    with start_workers(["memory://", "memory://"], dim=DIM,
                       extra=["--token-file", str(tokens)]) as workers:
        url = workers.url
        with pytest.raises(AuthenticationError):
            embstore.open(url)
        with pytest.raises(AuthenticationError):
            embstore.open(url, token="x" * 20)
        with embstore.open(url, token="s" * 20) as reader:
            reader.lookup([1, 2], insert=False)
            with pytest.raises(AuthenticationError, match="serve"):
                reader.lookup([1, 2])
            with pytest.raises(AuthenticationError):
                reader.update([1], np.ones((1, DIM), np.float32))
        with pytest.raises(ShardMismatchError, match="shard 0/2"):
            embstore.open(f"des://{workers.workers[0].address}", token="t" * 20)
        with pytest.raises(SchemaMismatchError, match="dim"):
            embstore.open(url, dim=DIM + 1, token="t" * 20)
        with embstore.open(url, token="t" * 20) as des:
            des.lookup(np.arange(50))
            with pytest.raises(InvalidInputError):
                des.update([1], np.full((1, DIM), np.nan, np.float32))
            before = len(des)
            # hand-made requests to shard 0: a key shard 1 owns, a short vector, garbage
            owner = key_hash64(np.arange(1000)) % np.uint64(2)
            foreign, own = int(np.flatnonzero(owner == 1)[0]), int(np.flatnonzero(owner == 0)[0])
            client = flight.FlightClient(f"grpc+tcp://{workers.workers[0].address}")
            opts = flight.FlightCallOptions(
                timeout=10, headers=[(b"authorization", b"Bearer " + b"t" * 20)])

            def exchange(header, batch):
                writer, reader = client.do_exchange(
                    flight.FlightDescriptor.for_command(header), opts)
                with writer:
                    writer.begin(batch.schema)
                    writer.write_batch(batch)
                    writer.done_writing()
                    return reader.read_all()

            head = json.dumps({"op": "lookup", "shard": 0, "shards": 2, "insert": True}).encode()
            keys = wire.batch(key=wire.keys_column(np.array([foreign], np.int64)))
            with pytest.raises(flight.FlightError, match="ShardMismatchError"):
                exchange(head, keys)
            short = wire.batch(key=wire.keys_column(np.array([own], np.int64)),
                               vec=wire.vectors_column(np.ones((1, DIM - 1), np.float32)))
            upd = json.dumps({"op": "update", "shard": 0, "shards": 2}).encode()
            with pytest.raises(flight.FlightError, match="InvalidInputError"):
                exchange(upd, short)
            for garbage in (b"\xff\x00", b"[1, 2]", b'{"op": "drop_table", "shard": 0, '
                            b'"shards": 2}'):
                with pytest.raises(flight.FlightError, match="InvalidInputError"):
                    exchange(garbage, keys)
            client.close()
            assert len(des) == before


def test_read_only_client_and_closed_store():
    with start_workers(["memory://"], dim=DIM) as workers:
        des = embstore.open(workers.url, read_only=True)
        with pytest.raises(ReadOnlyError):
            des.assign([1], np.ones((1, DIM), np.float32))
        des.close()
        des.close()
        with pytest.raises(embstore.errors.StoreClosedError):
            len(des)


def test_bad_des_urls_and_shard_specs():
    from embstore.errors import InvalidURLError
    from embstore.service.run import parse_shard

    for bad in ("des://", "des://host", "des://h:0", "des://h:1/path"):
        with pytest.raises(InvalidURLError):
            embstore.open(bad)
    for bad in ("1", "2/2", "-1/2", "a/b"):
        with pytest.raises(InvalidInputError):
            parse_shard(bad)


def _table(store, keys):
    return store.lookup(keys, insert=False), store.contains(keys)


def test_a_follower_serves_the_trainers_table_and_keeps_up(tmp_path):
    from embstore.testing.service import WorkerProcess

    with start_workers(["memory://", "memory://"], dim=DIM, optimizer="adagrad",
                       initializer="zeros") as workers:
        with embstore.open(workers.url) as des:
            des.update(np.arange(300), np.ones((300, DIM), np.float32))
            replica = WorkerProcess([f"lmdb://{tmp_path}/replica", "--listen", "127.0.0.1:0",
                                     "--follow", workers.url, "--poll", "0.05"])
            try:
                with embstore.open(f"des://{replica.address}") as served:
                    keys = np.arange(-10, 400)
                    # the replica answers once it holds the whole table
                    np.testing.assert_array_equal(served.lookup(keys, insert=False),
                                                  des.lookup(keys, insert=False))
                    with pytest.raises(AuthenticationError):
                        served.update([1], np.ones((1, DIM), np.float32))
                    # training goes on: updates, new keys, deletions all arrive
                    des.update(np.arange(250, 350), np.full((100, DIM), 2.0, np.float32))
                    des.delete(np.arange(0, 20))
                    des.lookup(np.arange(1000, 1010))
                    deadline = time.monotonic() + 30
                    want = _table(des, keys)
                    while time.monotonic() < deadline:
                        # (each worker's delta comes on its own: wait for the keys beyond
                        # these too, the lookup's new ones, before comparing the sizes)
                        got = _table(served, keys)
                        if (all(np.array_equal(a, b) for a, b in zip(got, want))
                                and len(served) == len(des)):
                            break
                        time.sleep(0.05)
                    np.testing.assert_array_equal(got[0], want[0])
                    np.testing.assert_array_equal(got[1], want[1])
                    assert len(served) == len(des)
                    st = served.stats()
                    assert st["follower_snapshots"] >= 2 and st["follower_rows_applied"] > 0
            finally:
                replica.stop()


def test_change_log_gives_keys_since_a_sequence_or_asks_for_a_snapshot():
    from embstore.service.changelog import ChangeLog

    log = ChangeLog(max_keys=10)
    log.on_write(np.array([1, 2, 3]), None)
    log.on_delete(np.array([3]))
    keys, seq = log.since(0)
    assert sorted(keys.tolist()) == [1, 2, 3] and seq == 2
    assert log.since(2)[0].tolist() == []
    log.on_insert(np.arange(100, 109), None, None)       # pushes the first batches out
    assert log.since(0)[0] is None and log.since(2)[0] is not None
    log.on_bulk_load()
    assert log.since(3)[0] is None
    assert log.since(log.seq)[0].tolist() == []


def test_metrics_health_and_readiness_over_http():
    import urllib.request

    w = start_worker("memory://", dim=DIM, extra=["--metrics", "127.0.0.1:0"])
    try:
        assert w.metrics_address
        with embstore.open(f"des://{w.address}") as des:
            des.lookup(np.arange(10))
            des.update(np.arange(10), np.ones((10, DIM), np.float32))
            with pytest.raises(InvalidInputError):
                des.update([1], np.full((1, DIM), np.nan, np.float32))

        def get(path):
            try:
                with urllib.request.urlopen(f"http://{w.metrics_address}{path}", timeout=10) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        code, text = get("/metrics")
        assert code == 200
        assert 'embstore_requests_total{op="lookup"} 1' in text
        assert 'embstore_requests_total{op="update"} 1' in text  # the NaN one never left
        assert 'embstore_request_seconds_count{op="lookup"} 1' in text
        assert "embstore_store_updates 10" in text and "embstore_changelog_seq" in text
        assert get("/healthz")[0] == 200
        assert get("/readyz") == (200, "ready\n")
        assert get("/nothing")[0] == 404
    finally:
        w.stop()


def test_shipped_deployments_run_commands_the_cli_accepts():
    """deploy/Procfile and the Kubernetes manifests start `embstore serve` with arguments
    the command takes (shell variables as a pod would expand them)."""
    import shlex

    from embstore.cli import build_parser

    yaml = pytest.importorskip("yaml")
    root = REPO_ROOT / "deploy"
    commands = [line.split(":", 1)[1].strip() for line in
                (root / "Procfile").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in sorted((root / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] not in ("StatefulSet", "Deployment"):
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                argv = c["command"] + c["args"]
                commands.append(argv[-1] if argv[:2] == ["/bin/sh", "-c"]
                                else shlex.join(argv))
                for probe in ("readinessProbe", "livenessProbe"):
                    if probe in c:
                        assert c[probe]["httpGet"]["path"] in ("/readyz", "/healthz")
    assert len(commands) == 5
    parser = build_parser()
    for cmd in commands:
        cmd = cmd.replace("${HOSTNAME##*-}", "0").replace("${SHARDS}", "2")
        argv = shlex.split(cmd)
        argv = argv[argv.index("embstore") + 1:]
        args = parser.parse_args(argv)
        assert args.command == "serve" and args.shard.count("/") == 1, cmd


def test_keras_layer_trains_through_the_service_with_admission_counting_occurrences():
    tf = pytest.importorskip("tensorflow")
    import embstore_tf

    with start_workers(["memory://", "memory://"], dim=DIM, optimizer=SGD1,
                       initializer="zeros", admission='{"name": "frequency", "min_count": 2}'
                       ) as workers, embstore.open(workers.url) as des:
        assert des.admission is not None and des.admission["min_count"] == 2
        layer = embstore_tf.DynamicEmbedding(des)
        ids = tf.constant([[1, 1], [2, 3]])       # 1 occurs twice: admitted in this batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(ids))
        tape.gradient(loss, layer.trainable_variables)
        assert des.contains([1, 2, 3]).tolist() == [True, False, False]
        np.testing.assert_array_equal(des.lookup([1], insert=False)[0], np.full(DIM, -2.0))


def test_a_paused_owner_fails_its_next_write_after_a_replacement_takes_the_shard(
        bigtable_url_factory):
    """Workers with a write-back cache over one shared Bigtable table hold the cache's fenced
    writer lease: a replacement takes the shard once the paused owner's lease ran out, and
    the old owner, resumed, acknowledges no write and flushes nothing over the new one's."""
    from embstore.errors import LeaseConflictError, LeaseLostError

    url = bigtable_url_factory()
    opts = dict(dim=DIM, optimizer=SGD1, initializer="zeros", cache="memory://",
                write_policy="back", lease_seconds=4)
    old = start_worker(url, **opts)
    new = None
    try:
        with embstore.open(f"des://{old.address}", timeout=20) as a:
            a.update([1, 2], np.ones((2, DIM), np.float32))
            a.flush()                                   # takes the lease, writes the rows
            a.update([1], np.ones((1, DIM), np.float32))  # dirty in the old owner's cache
            old.pause()
            new = start_worker(url, **opts)
            with embstore.open(f"des://{new.address}", timeout=20) as b:
                deadline = time.monotonic() + 30
                while True:                             # refused while the lease is live
                    try:
                        b.update([2], np.full((1, DIM), 5.0, np.float32))
                        break
                    except LeaseConflictError:
                        assert time.monotonic() < deadline
                        time.sleep(0.5)
                b.flush()
                old.resume()
                with pytest.raises(LeaseLostError):
                    a.update([3], np.ones((1, DIM), np.float32))
                with pytest.raises(LeaseLostError):
                    a.flush()
                # row 1 holds the flushed update only; row 2 the new owner's
                got = b.lookup([1, 2], insert=False)
                np.testing.assert_array_equal(got[:, 0], [-1.0, -6.0])
    finally:
        old.resume()
        old.kill()
        if new is not None:
            new.stop()


def test_ann_index_keeps_recall_while_training_rewrites_the_table():
    import threading

    pytest.importorskip("usearch")
    from embstore.service.ann import AnnIndex

    rng = np.random.default_rng(5)
    n, dim = 20_000, 32
    store = embstore.open("memory://", dim=dim)
    store.assign(np.arange(n), rng.standard_normal((n, dim), dtype=np.float32))
    guard = threading.RLock()
    ann = AnnIndex(store, guard, rebuild_at=0.1, threads=1)   # one thread: the same graph
    recalls = []
    gone: set[int] = set()
    for _ in range(10):
        touched = rng.choice(n, n // 20, replace=False)          # 5% of the rows rewritten
        store.assign(touched, rng.standard_normal((len(touched), dim), dtype=np.float32))
        gone -= set(touched.tolist())                                 # assigned again: back
        dead = rng.choice(n, 50, replace=False)
        store.delete(dead)
        gone |= set(dead.tolist())
        q = rng.standard_normal((40, dim), dtype=np.float32)
        with guard:
            got = ann.top_k(q, 10)
            exact = store.top_k(q, 10)
        live = ~np.isin(got.keys, np.array(sorted(gone)))
        assert live.all()                                           # deleted keys never come back
        # returned scores are exact dot products with the current vectors
        vec = store.lookup(got.keys.reshape(-1), insert=False).reshape(40, 10, dim)
        np.testing.assert_allclose(got.scores, np.einsum("qkd,qd->qk", vec, q), rtol=1e-5,
                                   atol=1e-5)
        recalls.append(np.mean([len(set(a) & set(b)) / 10 for a, b in
                                zip(got.keys.tolist(), exact.keys.tolist())]))
        if ann._building is not None:
            ann._building.join()
    assert min(recalls) >= 0.95, recalls
    assert ann.builds >= 3                                        # rebuilt in the background


def test_workers_answer_approximate_top_k_with_an_ann_index():
    pytest.importorskip("usearch")
    rng = np.random.default_rng(6)
    with start_workers(["memory://", "memory://"], dim=DIM, extra=["--ann"]) as workers, \
            embstore.open(workers.url) as des:
        des.assign(np.arange(2000), rng.standard_normal((2000, DIM), dtype=np.float32))
        q = rng.standard_normal((5, DIM), dtype=np.float32)
        approx = des.top_k(q, 10, approximate=True)
        exact = des.top_k(q, 10)
        overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in
                           zip(approx.keys.tolist(), exact.keys.tolist())])
        assert overlap >= 0.9
        assert des.stats()["ann_builds"] >= 2                    # one index per worker
    with start_workers(["memory://"], dim=DIM) as plain, embstore.open(plain.url) as des:
        des.assign([1], np.ones((1, DIM), np.float32))
        with pytest.raises(InvalidInputError, match="--ann"):
            des.top_k(np.ones((1, DIM), np.float32), 3, approximate=True)
