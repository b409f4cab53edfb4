"""Adapter throughput, side by side in one run.

1. PyTorch: a small model (sum-pooled sparse features -> MLP, 4096 ids per batch) trained with
   ``DynamicEmbeddingBag(memory://)`` vs ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.SGD``
   (and the same with Adagrad). Target: steps/s ratio >= 0.8x.
2. TensorFlow: one lookup + update step of the TF adapter vs ``tf.nn.embedding_lookup`` on a
   ``tf.Variable`` + a sparse SGD scatter update (target >= 0.9x), the same step on the
   adapter's ``tf.numpy_function`` path (``EMBSTORE_TF_NATIVE=0``: what runs where its ops
   cannot be built), and vs TFRA's ``de.embedding_lookup`` on a
   pre-populated ``de.get_variable`` (CuckooHashTable) trained by
   ``de.DynamicEmbeddingOptimizer(SGD)`` (target >= 1.0x). TFRA 0.8.1 needs TF 2.16, so it runs
   in its own venv (``make tfra-venv``) as a peer process (``tfra_peer.py``) that times its
   rounds when told to: rounds of all contenders alternate (``races.py``), none runs while
   another is timed. Then the cost of one
   TF -> Python hand-over of the batch's keys: ``tf.numpy_function`` vs the adapter's
   ``EmbstorePyCall`` op.
3. PyTorch, small batches: ``DynamicEmbedding`` over one shared table fed a ``(256, 7)`` batch
   of raw keys (bytes, then int64), Adagrad, vs ``nn.Embedding(sparse=True)`` +
   ``torch.optim.Adagrad`` with the key -> row mapping timed on the torch side (a dict / a
   ``searchsorted``: what a user without embstore runs per batch), and on pre-mapped ids.
   Target: >= 1.0x the mapping reference (``--small-only`` runs just this part).

Usage: ``python bench/bench_adapters.py [--quick] [--steps N] [--no-tf | --tf-only]
[--tfra-python PATH]``
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import tfra_peer
from races import local_round, print_rows, race, race_rounds

IDS_PER_BATCH = 4096
BAG = 8
DIM = 64


def _keys_stream(n_steps: int, id_space: int, seed: int = 0) -> list[np.ndarray]:
    # Zipf-like ids (recommendation traffic): a few hot ids, a long tail of rare ones.
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        k = (rng.zipf(1.2, IDS_PER_BATCH) - 1) % id_space
        out.append(k.astype(np.int64))
    return out


def bench_torch(n_steps: int, id_space: int) -> list[tuple[str, float, float]]:
    import torch
    from torch import nn

    import embstore
    from embstore_torch import DynamicEmbeddingBag

    torch.manual_seed(0)
    batches = _keys_stream(n_steps, id_space)
    n_bags = IDS_PER_BATCH // BAG
    targets = torch.randn(n_bags, 1)

    def mlp():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(DIM, 128), nn.ReLU(), nn.Linear(128, 1))

    rows = []
    for opt_name in ("sgd", "adagrad"):
        # Reference: fixed-size table, sparse gradient, torch's sparse-capable optimizer.
        table = nn.EmbeddingBag(id_space, DIM, mode="sum", sparse=True)
        head = mlp()
        if opt_name == "sgd":
            sparse_opt = torch.optim.SGD(table.parameters(), lr=0.05)
            store_opt = embstore.optim.SGD(lr=0.05)
        else:
            sparse_opt = torch.optim.Adagrad(table.parameters(), lr=0.05)
            store_opt = embstore.optim.Adagrad(lr=0.05)
        dense_opt = torch.optim.SGD(head.parameters(), lr=0.01)

        def ref_step(keys, table=table, head=head, sparse_opt=sparse_opt, dense_opt=dense_opt):
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            x = table(torch.from_numpy(keys).view(n_bags, BAG))
            loss = nn.functional.mse_loss(head(x), targets)
            loss.backward()
            sparse_opt.step()
            dense_opt.step()

        store = embstore.open("memory://", dim=DIM, optimizer=store_opt,
                              initial_capacity=id_space)
        store.lookup(np.arange(id_space))  # same table size as the reference
        emb = DynamicEmbeddingBag(store, mode="sum")
        head2 = mlp()
        dense_opt2 = torch.optim.SGD(head2.parameters(), lr=0.01)

        def dyn_step(keys, emb=emb, head=head2, dense_opt=dense_opt2):
            dense_opt.zero_grad()
            x = emb(torch.from_numpy(keys).view(n_bags, BAG))
            loss = nn.functional.mse_loss(head(x), targets)
            loss.backward()  # the store applies its optimizer here
            dense_opt.step()

        rows.append((f"torch {opt_name}: steps/s", *race(ref_step, dyn_step, batches)))
        store.close()
    return rows


# The recommendation shape (an online CTR model, MovieLens-100k-like): batch 256, seven
# single-id features, one shared table. Cardinalities of MovieLens-100k's fields.
REC_BATCH = 256
REC_DIM = 16
REC_FIELDS = {"user": 943, "movie": 1682, "age": 61, "gender": 2, "occupation": 21,
              "zip": 795, "genre": 19}


def _rec_stream(n_steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Per step, each field's raw ids (Zipf-skewed over the field's cardinality)."""
    rng = np.random.default_rng(seed)
    return [{f: (rng.zipf(1.3, REC_BATCH) - 1) % n for f, n in REC_FIELDS.items()}
            for _ in range(n_steps)]


def bench_torch_rec(n_steps: int) -> list[tuple[str, float, float, float, float]]:
    """DynamicEmbeddingBagCollection (one shared table, 7 features, store Adagrad) vs
    ``nn.Embedding(sparse=True)`` + ``torch.optim.Adagrad``, with the id -> row mapping inside
    the timed step on both sides: a dict for the string keys, ``searchsorted`` over the sorted
    vocabulary for the int64 keys."""
    import torch
    from torch import nn

    import embstore
    from embstore_torch import DynamicEmbeddingBagCollection, KeyedJagged

    fields = list(REC_FIELDS)
    raw = _rec_stream(n_steps)
    # The raw events as a pipeline hands them over: per field, 256 keys.
    str_batches = [[np.array([f"{f}={v}".encode() for v in b[f].tolist()], dtype=object)
                    for f in fields] for b in raw]
    int_batches = [[b[f] + (i << 32) for i, f in enumerate(fields)] for b in raw]
    vocab_str = {f"{f}={v}".encode(): j for j, (f, v) in enumerate(
        (f, v) for f, n in REC_FIELDS.items() for v in range(n))}
    vocab_int = np.sort(np.concatenate([np.arange(n) + (i << 32)
                                        for i, n in enumerate(REC_FIELDS.values())]))
    n_rows = len(vocab_str)
    labels = [torch.from_numpy((np.random.default_rng(s).random(REC_BATCH) < 0.3)
                               .astype(np.float32))[:, None] for s in range(n_steps)]
    width = len(fields) * REC_DIM
    lengths = np.ones(len(fields) * REC_BATCH, dtype=np.int64)

    def mlp():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))

    rows = []
    for key_type, batches in (("bytes", str_batches), ("int64", int_batches)):
        table = nn.Embedding(n_rows, REC_DIM, sparse=True)
        head = mlp()
        sparse_opt = torch.optim.Adagrad(table.parameters(), lr=0.05)
        dense_opt = torch.optim.SGD(head.parameters(), lr=0.01)
        loss_fn = nn.BCEWithLogitsLoss()

        if key_type == "bytes":
            def to_rows(parts, vocab=vocab_str):
                return torch.tensor([[vocab[k] for k in p.tolist()] for p in parts])
        else:
            def to_rows(parts, vocab=vocab_int):
                return torch.from_numpy(np.searchsorted(vocab, np.stack(parts)))

        def ref_step(item, table=table, head=head, sparse_opt=sparse_opt,
                     dense_opt=dense_opt, to_rows=to_rows, loss_fn=loss_fn):
            parts, y = item
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            x = table(to_rows(parts).T).reshape(REC_BATCH, width)  # (batch, 7 * dim)
            loss_fn(head(x), y).backward()
            sparse_opt.step()
            dense_opt.step()

        store = embstore.open("memory://", dim=REC_DIM, key_type=key_type,
                              optimizer=embstore.optim.Adagrad(lr=0.05))
        ebc = DynamicEmbeddingBagCollection({"shared": store}, dict.fromkeys(fields, "shared"))
        head2 = mlp()
        dense_opt2 = torch.optim.SGD(head2.parameters(), lr=0.01)

        def dyn_step(item, ebc=ebc, head=head2, dense_opt=dense_opt2, loss_fn=loss_fn):
            parts, y = item
            dense_opt.zero_grad()
            kjt = KeyedJagged(fields, np.concatenate(parts), lengths=lengths)
            loss_fn(head(ebc(kjt).values()), y).backward()  # the store's Adagrad runs here
            dense_opt.step()

        items = list(zip(batches, labels, strict=True))
        rows.append((f"rec {key_type} adagrad: steps/s", *race(ref_step, dyn_step, items)))
        store.close()
    return rows


def bench_torch_small(n_steps: int) -> list[tuple[str, float, float, float, float]]:
    """``DynamicEmbedding`` (no bags) on the recommendation shape: a ``(256, 7)`` batch of raw
    keys, one shared ``memory://`` table, store Adagrad, against ``nn.Embedding(sparse=True)``
    + ``torch.optim.Adagrad``.

    The fair reference maps the raw keys to rows inside its timed step, as a user without
    embstore must: a Python dict for the bytes keys (``np.fromiter`` over ``dict.__getitem__``,
    the fastest plain form measured: 4x faster than ``torch.tensor`` of nested lists), one
    ``np.searchsorted`` over the sorted vocabulary for the int64 keys. The ``pre-mapped`` row
    times the same reference on ids mapped before the clock starts (no mapping at all), to
    show what the mapping costs."""
    import torch
    from torch import nn

    import embstore
    from embstore_torch import DynamicEmbedding

    fields = list(REC_FIELDS)
    raw = _rec_stream(n_steps, seed=1)
    str_batches = [np.array([[f"{f}={v}".encode() for v in b[f].tolist()] for f in fields],
                            dtype=object).T.copy() for b in raw]
    int_batches = [np.stack([b[f] + (i << 32) for i, f in enumerate(fields)], axis=1)
                   for b in raw]
    vocab_str = {f"{f}={v}".encode(): j for j, (f, v) in enumerate(
        (f, v) for f, n in REC_FIELDS.items() for v in range(n))}
    vocab_int = np.sort(np.concatenate([np.arange(n) + (i << 32)
                                        for i, n in enumerate(REC_FIELDS.values())]))
    labels = [torch.from_numpy((np.random.default_rng(s).random(REC_BATCH) < 0.3)
                               .astype(np.float32))[:, None] for s in range(n_steps)]
    width = len(fields) * REC_DIM
    shape = (REC_BATCH, len(fields))

    def map_str(x, vocab=vocab_str):
        return torch.from_numpy(np.fromiter(map(vocab.__getitem__, x.ravel().tolist()),
                                            np.int64, x.size).reshape(shape))

    def map_int(x, vocab=vocab_int):
        return torch.from_numpy(np.searchsorted(vocab, x))

    def mlp():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))

    loss_fn = nn.BCEWithLogitsLoss()
    rows = []
    for key_type, batches, to_rows in (("bytes", str_batches, map_str),
                                       ("int64", int_batches, map_int)):
        def torch_side(to_rows=to_rows):
            table = nn.Embedding(len(vocab_str), REC_DIM, sparse=True)
            head = mlp()
            sparse_opt = torch.optim.Adagrad(table.parameters(), lr=0.05)
            dense_opt = torch.optim.SGD(head.parameters(), lr=0.01)

            def step(item, mapped=None):
                x, y = item
                sparse_opt.zero_grad()
                dense_opt.zero_grad()
                ids = to_rows(x) if mapped is None else mapped
                loss_fn(head(table(ids).reshape(REC_BATCH, width)), y).backward()
                sparse_opt.step()
                dense_opt.step()
            return step

        ref_step, pre_step = torch_side(), torch_side()
        store = embstore.open("memory://", dim=REC_DIM, key_type=key_type,
                              optimizer=embstore.optim.Adagrad(lr=0.05))
        emb = DynamicEmbedding(store)
        head2 = mlp()
        dense_opt2 = torch.optim.SGD(head2.parameters(), lr=0.01)

        def dyn_step(item, emb=emb, head=head2, dense_opt=dense_opt2,
                     as_tensor=key_type == "int64"):
            x, y = item
            dense_opt.zero_grad()
            # int64 keys go in as a tensor, as a pipeline hands them over
            keys = torch.from_numpy(x) if as_tensor else x
            loss_fn(head(emb(keys).reshape(REC_BATCH, width)), y).backward()
            dense_opt.step()

        items = list(zip(batches, labels, strict=True))
        premapped = [(to_rows(x), y) for x, y in items]

        def pre(item_mapped, pre_step=pre_step):
            ids, y = item_mapped
            pre_step((None, y), mapped=ids)

        for i in range(3):  # warm-up
            ref_step(items[i])
            pre(premapped[i])
            dyn_step(items[i])
        r = race_rounds({"dyn": local_round(dyn_step, items[3:]),
                          "ref": local_round(ref_step, items[3:]),
                          "pre": local_round(pre, premapped[3:])})
        rows.append((f"small {key_type} DynamicEmbedding", r["dyn"][0], r["ref"][0],
                     r["dyn"][1], r["ref"][1]))
        rows.append(("  vs pre-mapped ids", r["dyn"][0], r["pre"][0], r["dyn"][1],
                     r["pre"][1]))
        store.close()
    return rows


def bench_tf(n_steps: int, id_space: int,
             tfra_python: str | None = None) -> list[tuple[str, float, float, float, float]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import embstore
    from embstore_tf import dynamic_embedding_lookup, native_status, trigger_variable

    # One thread, as for torch: idle TF pool threads spinning next to the store's Python work
    # would measure the machine's scheduling, not the two lookup paths.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    batches = _keys_stream(n_steps, id_space)
    lr, warmup = 0.05, 3
    table = tf.Variable(tf.random.uniform((id_space, DIM), -0.05, 0.05))

    @tf.function
    def ref_step(keys):
        with tf.GradientTape() as tape:
            vecs = tf.nn.embedding_lookup(table, keys)
            loss = tf.reduce_sum(vecs) * 1e-3  # a bounded gradient, whatever the key counts
        g = tape.gradient(loss, table)  # IndexedSlices
        table.scatter_sub(tf.IndexedSlices(g.values * lr, g.indices))
        return loss

    def adapter_step(native: bool):
        """The adapter's step, traced on its compiled ops or on ``tf.numpy_function``."""
        store = embstore.open("memory://", dim=DIM, optimizer=embstore.optim.SGD(lr=lr),
                              initial_capacity=id_space)
        store.lookup(np.arange(id_space))
        trig = trigger_variable(store)

        @tf.function
        def dyn_step(keys):
            with tf.GradientTape() as tape:
                vecs = dynamic_embedding_lookup(keys, store)
                loss = tf.reduce_sum(vecs) * 1e-3
            tape.gradient(loss, trig)  # runs the store update
            return loss

        old = os.environ.get("EMBSTORE_TF_NATIVE")
        os.environ["EMBSTORE_TF_NATIVE"] = "1" if native else "0"
        try:
            dyn_step.get_concrete_function(tf.TensorSpec([None], tf.int64))  # trace now
        finally:
            if old is None:
                del os.environ["EMBSTORE_TF_NATIVE"]
            else:
                os.environ["EMBSTORE_TF_NATIVE"] = old
        return store, dyn_step

    status = native_status()
    print(f"TF adapter ops: {'compiled' if status['native'] else 'unavailable'}"
          f"{'' if status['native'] else ' (' + str(status['error']) + ')'}")
    store, dyn_step = adapter_step(True)
    np_store, np_step = adapter_step(False)
    tb = [tf.constant(b) for b in batches]
    for b in tb[:warmup]:
        ref_step(b)
        dyn_step(b)
        np_step(b)
    rounds = {"dyn": local_round(dyn_step, tb[warmup:]),
              "ref": local_round(ref_step, tb[warmup:]),
              "np": local_round(np_step, tb[warmup:])}
    worker = None
    if tfra_python:
        try:
            worker = tfra_peer.TFRAPeer(tfra_python, batches, id_space, DIM, lr, warmup)
            rounds["tfra"] = worker.round
        except (OSError, RuntimeError) as e:
            print(f"(TFRA part skipped: {e})")
    try:
        load = os.getloadavg()
        r = race_rounds(rounds)
        print(f"TF part: load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    finally:
        if worker is not None:
            worker.close()
        store.close()
        np_store.close()
    rows = [("tf lookup+update: steps/s", r["dyn"][0], r["ref"][0], r["dyn"][1], r["ref"][1]),
            ("  numpy_function path", r["np"][0], r["ref"][0], r["np"][1], r["ref"][1])]
    if "tfra" in r:
        rows.append(("  vs TFRA de.embedding_lookup", r["dyn"][0], r["tfra"][0], r["dyn"][1],
                     r["tfra"][1]))
    elif not tfra_python:
        print("(TFRA not found: `make tfra-venv` or --tfra-python PATH to compare against it)")
    return rows


def bench_tf_handover(n_calls: int = 300) -> None:
    """Microseconds per ``tf.function`` call handing 4096 int64 keys to Python and back:
    ``tf.numpy_function`` vs the adapter's ``EmbstorePyCall`` op, and the call with no
    hand-over (the floor), in alternating rounds."""
    import tensorflow as tf

    from embstore_tf import _native

    lib = _native.library()
    if lib is None:
        print("(hand-over microbench skipped: the adapter's ops are not built)")
        return
    keys = tf.constant(np.arange(IDS_PER_BATCH, dtype=np.int64))
    handle = _native.register(lambda k: (k,))
    fns = {
        "none": tf.function(lambda k: k + 1),
        "numpy_function": tf.function(
            lambda k: tf.numpy_function(lambda a: a, [k], tf.int64, stateful=True)),
        "EmbstorePyCall": tf.function(
            lambda k: lib.embstore_py_call([k], handle=handle, Tout=[tf.int64])[0]),
    }
    for f in fns.values():
        for _ in range(20):
            f(keys)
    r = race_rounds({name: local_round(f, [keys] * n_calls) for name, f in fns.items()})
    print("one hand-over of 4096 int64 keys, per tf.function call (us, wall / CPU): " + ", ".join(
        f"{name} {1e6 / w:.0f} / {1e6 / c:.0f}" for name, (w, c) in r.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--no-tf", action="store_true")
    p.add_argument("--tf-only", action="store_true", help="only the TensorFlow part")
    p.add_argument("--rec-only", action="store_true",
                   help="only the recommendation shape (batch 256, 7 features, Adagrad)")
    p.add_argument("--small-only", action="store_true",
                   help="only DynamicEmbedding on the recommendation shape (256 x 7 raw keys)")
    p.add_argument("--tfra-python", default=tfra_peer.default_python(),
                   help="python of a venv with TFRA 0.8.1 (default: $EMBSTORE_TFRA_PYTHON, "
                        "else .venv-tfra/bin/python if present)")
    p.add_argument("--id-space", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    steps = a.steps or (15 if a.quick else 60)
    id_space = a.id_space or (50_000 if a.quick else 1_000_000)
    import torch

    torch.set_num_threads(1)
    if a.rec_only:
        print_rows(bench_torch_rec(max(steps, 40) * 4))
        return
    if a.small_only:
        print_rows(bench_torch_small(max(steps, 40) * 4))
        return
    print(f"batch {IDS_PER_BATCH} ids ({IDS_PER_BATCH // BAG} bags x {BAG}), dim {DIM}, "
          f"{id_space:,} ids, {steps} steps, 1 torch / 1 TF thread")
    rows = []
    if not a.tf_only:
        rows += bench_torch(steps, id_space)
        rows += bench_torch_rec(max(steps, 40) * 4)
        rows += bench_torch_small(max(steps, 40) * 4)
    if not a.no_tf:
        try:
            rows += bench_tf(steps, id_space, a.tfra_python)
            bench_tf_handover()
        except ImportError as e:
            print(f"(TensorFlow part skipped: {e})")
    print_rows(rows)
    print("steps/s per wall-clock second, then per CPU second of the process running the step "
          "(medians of alternating rounds)")
    print("references: torch nn.EmbeddingBag(sparse=True) + torch.optim.SGD/Adagrad; "
          "tf.nn.embedding_lookup on a tf.Variable + scatter_sub; TFRA 0.8.1 de.embedding_lookup "
          "+ DynamicEmbeddingOptimizer(SGD) (TF 2.16, own venv)")


if __name__ == "__main__":
    main()
