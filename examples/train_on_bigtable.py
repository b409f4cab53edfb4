"""Train an embedding model whose table lives in Bigtable, through a local cache.

A small matrix-factorization model (user and item embeddings, rating = dot product) is
trained with Adagrad kept *in the store*. The table lives in Bigtable; a ``memory://`` cache
with write-back sits in front, and ``prefetch`` loads the next batch's rows while the current
step computes. Then the store is closed, reopened without a cache, and the trained table is
shown to have persisted.

Run::

    python examples/train_on_bigtable.py                 # starts a local emulator
    BIGTABLE_EMULATOR_HOST=127.0.0.1:8086 python examples/train_on_bigtable.py
    python examples/train_on_bigtable.py --real --url bigtable://my-project/my-instance/embeddings

Against a real instance (``--real``: ``BIGTABLE_EMULATOR_HOST`` is ignored), authenticate with
``gcloud auth application-default login`` (or ``GOOGLE_APPLICATION_CREDENTIALS`` pointing at a
service-account key with the Bigtable User role) and create the table once with one column
family ``e`` (``cbt createtable embeddings families=e:maxversions=1``), or pass ``--create``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import embstore

DIM = 16
USERS, ITEMS = 2_000, 5_000
ITEM_BASE = 1 << 40  # items and users share one table: keep their key ranges apart


def make_data(n: int, seed: int = 0):
    """Synthetic ratings from hidden true embeddings (so the loss can go near zero)."""
    rng = np.random.default_rng(seed)
    true_u = rng.standard_normal((USERS, 4)) * 0.5
    true_i = rng.standard_normal((ITEMS, 4)) * 0.5
    users = rng.integers(0, USERS, n)
    items = (rng.zipf(1.2, n) - 1) % ITEMS  # popular items dominate, as in real logs
    ratings = np.einsum("nd,nd->n", true_u[users], true_i[items]).astype(np.float32)
    return users.astype(np.int64), items.astype(np.int64) + ITEM_BASE, ratings


def loss_of(store, users, items, ratings) -> float:
    u = store.lookup(users, insert=False)
    v = store.lookup(items, insert=False)
    return float(np.mean((np.einsum("nd,nd->n", u, v) - ratings) ** 2))


def train(store, users, items, ratings, epochs: int, batch: int) -> None:
    cache = store.backend  # the CachedBackend layer: prefetch lives there
    n = len(users)
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(n)
        for start in range(0, n, batch):
            idx = order[start:start + batch]
            u_keys, i_keys = users[idx], items[idx]
            u = store.lookup(u_keys)
            v = store.lookup(i_keys)
            nxt = order[start + batch:start + 2 * batch]
            if len(nxt):  # fetched in the background while this step computes
                cache.prefetch(np.concatenate([users[nxt], items[nxt]]))
            err = np.einsum("nd,nd->n", u, v) - ratings[idx]
            store.update(u_keys, err[:, None] * v)
            store.update(i_keys, err[:, None] * u)
        print(f"  epoch {epoch + 1}: mse {loss_of(store, users, items, ratings):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="bigtable://demo-project/demo-instance/mf-embeddings")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--cache-capacity", type=int, default=3_000)
    ap.add_argument("--real", action="store_true",
                    help="talk to real Bigtable (ignore BIGTABLE_EMULATOR_HOST, start nothing)")
    ap.add_argument("--create", action="store_true",
                    help="create the table on a real instance (needs Bigtable admin rights)")
    args = ap.parse_args()

    emulator = None
    if args.real:
        os.environ.pop("BIGTABLE_EMULATOR_HOST", None)
        print("using real Bigtable with Application Default Credentials")
    elif not os.environ.get("BIGTABLE_EMULATOR_HOST"):
        from embstore.testing.bigtable_emulator import start_emulator

        emulator = start_emulator()
        os.environ["BIGTABLE_EMULATOR_HOST"] = emulator.host
        print(f"started a Bigtable emulator at {emulator.host}")
    extra = {"create": True} if args.create else {}
    try:
        users, items, ratings = make_data(100_000)
        print(f"training {USERS} user + {ITEMS} item embeddings (dim {DIM}) on {args.url}")
        with embstore.open(args.url, dim=DIM, optimizer=embstore.optim.Adagrad(lr=0.2),
                           cache="memory://", cache_capacity=args.cache_capacity,
                           write_policy="back", **extra) as store:
            print(f"  before training: mse {loss_of(store, users, items, ratings):.4f}")
            train(store, users, items, ratings, args.epochs, args.batch)
            final = loss_of(store, users, items, ratings)
            st = store.backend.stats()
            print(f"  cache: hit rate {st['cache_hit_rate']:.3f}, remote reads "
                  f"{st['remote_reads']:,} rows in {st['remote_read_calls']:,} calls, remote "
                  f"writes {st['remote_writes']:,}, evictions {st['evictions']:,}, "
                  f"prefetched {st['prefetched_rows']:,}")
        # closed: every dirty row was flushed. Reopen straight on Bigtable, no cache.
        with embstore.open(args.url, read_only=True) as again:
            reopened = loss_of(again, users, items, ratings)
            print(f"reopened {again.url}: {len(again):,} rows, step {again.step}, "
                  f"mse {reopened:.4f} (at close: {final:.4f})")
            assert np.isclose(reopened, final), "the table did not persist"
    finally:
        if emulator is not None:
            emulator.stop()


if __name__ == "__main__":
    main()
