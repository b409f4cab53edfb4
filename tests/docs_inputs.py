"""Input files and stores that the documentation's examples name (used by their hidden setup).

Each function builds, in the current directory (the docs test's temporary directory), what a
page assumes a reader already has: a word2vec file called ``GoogleNews-vectors.bin``, a store of
items, a Bigtable table. Small sizes keep the docs test fast.
"""

from __future__ import annotations

import os

import numpy as np

import embstore

WORDS = [b"king", b"queen", b"man", b"woman", b"cat", b"dog", b"the", b"a", b"zebra", b"car"]


def word_vectors(dim: int, name: str = "GoogleNews-vectors.bin") -> None:
    """A word2vec binary file of ``WORDS`` (real format, written by embstore's exporter)."""
    rng = np.random.default_rng(0)
    with embstore.open("memory://", dim=dim, key_type="bytes") as words:
        words.assign(WORDS, rng.standard_normal((len(WORDS), dim)).astype(np.float32))
        words.export(name, format=None if name.endswith(".npz") else "word2vec-binary")


def item_store(url: str, dim: int = 8, rows: int = 100) -> None:
    """An int64 store with ``rows`` trained rows at ``url``."""
    keys = np.arange(rows, dtype=np.int64)
    with embstore.open(url, dim=dim, optimizer="adagrad") as store:
        store.update(keys, np.full((rows, dim), 0.1, np.float32))


def cli_inputs(data: str) -> None:
    """Everything docs/cli.md and the README's CLI block open: stores under ``data``
    (the placeholder directory /data/) and ``bigtable://proj/inst/items``, plus input files."""
    item_store(f"lmdb://{data}items")
    if os.environ.get("BIGTABLE_EMULATOR_HOST"):  # only blocks that name bigtable:// get one
        item_store("bigtable://proj/inst/items")
    word_vectors(8)
    with embstore.open("memory://", dim=8, key_type="bytes") as words:
        words.assign(WORDS[:4], np.ones((4, 8), np.float32))
        words.export("vectors.tsv", format="tsv")
    with embstore.open("memory://", dim=12, key_type="bytes") as words:
        words.assign(WORDS[:4], np.ones((4, 12), np.float32))
        words.export("small.txt", format="word2vec")


def single_rank_world() -> None:
    """The environment ``torchrun`` gives a world of one process (for the distributed examples)."""
    import os

    from embstore.testing.bigtable_emulator import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")


def keras_model(url: str):
    """A small Keras model over a bytes-key store at ``url``: (model, store)."""
    import keras

    import embstore_tf

    store = embstore.open(url, dim=4, key_type="bytes", optimizer="adagrad")
    inputs = keras.Input(shape=(2,), dtype="string")
    pooled = keras.ops.sum(embstore_tf.DynamicEmbedding(store)(inputs), axis=1)
    model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
    model.compile(optimizer="sgd", loss="mse")
    return model, store


def des_workers(ports: list[int], **options):
    """Workers on these loopback ports serving fresh memory:// shards (docs/service.md)."""
    from embstore.testing.service import Workers, start_worker

    started = []
    try:
        for i, port in enumerate(ports):
            started.append(start_worker("memory://", (i, len(ports)), port=port, **options))
    except BaseException:
        for w in started:
            w.kill()
        raise
    return Workers(started)
