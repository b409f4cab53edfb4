"""Several framework processes train one des:// table: two TensorFlow processes (the Keras
layer of ``embstore_tf``) and one torch process (``embstore_torch``) update overlapping keys
of two real `embstore serve` workers with SGD and known gradients; every update is present.

One test: importing TensorFlow in each process costs seconds.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import numpy as np
import pytest

import embstore

pytest.importorskip("pyarrow.flight")
pytest.importorskip("tensorflow")
pytest.importorskip("torch")

from embstore.testing.service import start_workers  # noqa: E402

SGD1 = json.dumps({"name": "sgd", "lr": 1.0})
DIM, STEPS = 8, 6
KEYS = np.arange(0, 120, dtype=np.int64)


def _tf_trainer(url: str, scale: float, steps: int) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import embstore_tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    store = embstore.open(url)
    layer = embstore_tf.DynamicEmbedding(store)
    ids = tf.constant(KEYS[:, None])
    for _ in range(steps):
        with tf.GradientTape() as tape:
            # d loss / d row = scale for every key (each once per batch)
            loss = scale * tf.reduce_sum(layer(ids, training=True))
        tape.gradient(loss, layer.trainable_variables)
    store.close()


def _torch_trainer(url: str, scale: float, steps: int) -> None:
    import torch

    from embstore_torch import DynamicEmbeddingBag

    torch.set_num_threads(1)
    store = embstore.open(url)
    emb = DynamicEmbeddingBag(store, mode="sum")
    ids = torch.from_numpy(KEYS[:, None].copy())
    for _ in range(steps):
        (scale * emb(ids).sum()).backward()
    store.close()


def test_tf_and_torch_trainer_processes_lose_no_update_of_shared_keys(tmp_path):
    urls = [f"lmdb://{tmp_path}/f0", f"lmdb://{tmp_path}/f1"]
    with start_workers(urls, dim=DIM, optimizer=SGD1, initializer="zeros") as workers:
        ctx = mp.get_context("spawn")
        runs = [(_tf_trainer, 1.0), (_tf_trainer, 2.0), (_torch_trainer, 4.0)]
        procs = [ctx.Process(target=fn, args=(workers.url, scale, STEPS))
                 for fn, scale in runs]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join(600)
        assert [pr.exitcode for pr in procs] == [0, 0, 0]
        with embstore.open(workers.url) as des:
            # SGD lr=1 on integer gradients: exact whatever order the updates arrived in
            expected = -float(STEPS) * (1.0 + 2.0 + 4.0)
            np.testing.assert_array_equal(des.lookup(KEYS, insert=False),
                                          np.full((len(KEYS), DIM), expected, np.float32))
            assert des.stats()["updates"] == 3 * STEPS * len(KEYS)
