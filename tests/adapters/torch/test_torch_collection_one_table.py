"""A collection whose features all share one int64 table (the recommendation shape): its keys
are the whole input, normalized once, and it trains as one ``nn.Embedding`` over the same
weights with Adagrad does."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import embstore  # noqa: E402
from embstore.optim import Adagrad  # noqa: E402
from embstore_torch import DynamicEmbeddingBagCollection, KeyedJagged  # noqa: E402

FIELDS = ["user", "movie", "genre"]
VOCAB, DIM, BATCH, LR = 30, 4, 16, 0.1


@pytest.mark.parametrize("as_tensor", [False, True])
def test_one_shared_int_table_trains_like_an_embedding_with_adagrad(as_tensor):
    rng = np.random.default_rng(4)
    w0 = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0))
    store = embstore.open("memory://", dim=DIM, optimizer=Adagrad(lr=LR))
    store.assign(np.arange(VOCAB), w0.numpy())
    ebc = DynamicEmbeddingBagCollection({"t": store}, dict.fromkeys(FIELDS, "t"))
    ref = nn.Embedding(VOCAB, DIM, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(w0)
    opt = torch.optim.Adagrad(ref.parameters(), lr=LR)
    lengths = np.ones(len(FIELDS) * BATCH, dtype=np.int64)
    for _ in range(4):
        ids = rng.integers(0, VOCAB, (len(FIELDS), BATCH))  # feature-major, repeats
        values = torch.from_numpy(ids.reshape(-1)) if as_tensor else ids.reshape(-1)
        out = ebc(KeyedJagged(FIELDS, values, lengths=lengths)).values()
        want = ref(torch.from_numpy(ids).T).reshape(BATCH, -1)  # (batch, features * dim)
        # per-key gradient sums add in another order than torch: last-bit differences
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        target = torch.randn(BATCH, len(FIELDS) * DIM)
        opt.zero_grad()
        ((want - target) ** 2).sum().backward()
        opt.step()
        ((out - target) ** 2).sum().backward()
    torch.testing.assert_close(torch.from_numpy(store.lookup(np.arange(VOCAB), insert=False)),
                               ref.weight.detach(), rtol=1e-6, atol=1e-6)
