"""The word2vec demo's training step (``examples/word2vec.py``: two bytes-key
``DynamicEmbedding`` modules, negatives from ``store.sample``) writes the same records as the
same step spelt out with the numpy grouping and draw the adapter and the sampler used before
their compiled kernels (``embstore._cython.indexops``): every record field but the wall-clock
stamps, and the store counters."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import embstore
from embstore.init import Uniform
from embstore.keys import factorize, hash64
from embstore.optim import SGD
from embstore.policies import FrequencyCutoff
from embstore.sampling import UnigramSampler, sampling_index
from embstore_torch import DynamicEmbedding
from tests.numpy_draw import numpy_draw

from .same_tables import assert_same_tables

DIM, K, B = 16, 5, 512


def stores():
    common = dict(dim=DIM, key_type="bytes", optimizer=SGD(lr=0.025), seed=1)
    inp = embstore.open("memory://?hash_seed=7", initializer=Uniform(-0.03, 0.03), **common)
    out = embstore.open("memory://?hash_seed=7", initializer="zeros",
                        admission=FrequencyCutoff(2), **common)
    return inp, out


def corpus(rng):
    words = np.array([b"w%d" % i for i in range(400)], dtype=object)
    return words[np.minimum(rng.zipf(1.3, 6000), 400) - 1]


def count(out, tokens):
    words, inverse = factorize(tokens)
    out.update(words, np.zeros((len(words), DIM), np.float32),
               counts=np.bincount(inverse, minlength=len(words)))
    return words, inverse


def numpy_negatives(out, sampler, m, rng):
    """``store.sample(..., unique=False, remove_accidental_hits=False).keys`` with the numpy
    draw it had before the kernels (one part, a cdf in cache)."""
    idx = sampling_index(out)
    keys, pos, _ = numpy_draw(idx, idx.snapshot(sampler), rng, m)
    assert idx.parts[0].alive[pos].all()  # no deleted key to draw again here
    return keys


def numpy_rows(store, keys, counts_on_update, admission_counts):
    """The adapter's unfused forward with its former grouping (stable argsort, bincount):
    rows of the distinct keys, and a backward that sums the gradient per key and updates."""
    uniq, inv = factorize(keys)
    order = np.argsort(inv.astype(np.uint16), kind="stable").astype(np.int64)
    occ = np.bincount(inv, minlength=len(uniq))
    starts = np.zeros(len(uniq), np.int64)
    np.cumsum(occ[:-1], out=starts[1:])
    if admission_counts:
        vectors = store.lookup(uniq, insert=True, counts=occ)
    else:
        vectors = store.lookup(uniq, insert=True)
    leaf = torch.from_numpy(vectors).requires_grad_(True)
    rows = leaf[torch.from_numpy(inv)]

    def apply(grad):
        g = grad.reshape(-1, DIM).contiguous()
        sums = torch.embedding_bag(g, torch.from_numpy(order), torch.from_numpy(starts), False,
                                   0, False, None, False)[0]
        counts = occ if counts_on_update else np.zeros(len(uniq), np.int64)
        store.update(uniq, sums.numpy(), counts=counts)
        return grad

    rows.register_hook(apply)
    return rows


def step(v, u, negs, contexts):
    b = len(contexts)
    scores = (u * v.unsqueeze(1)).sum(2)
    sign = torch.ones(K + 1)
    sign[1:] = -1.0
    weight = np.ones((b, K + 1), dtype=np.float32)
    weight[:, 1:] = hash64(negs.reshape(-1)).reshape(b, K) != hash64(contexts)[:, None]
    loss = -(F.logsigmoid(scores * sign) * torch.from_numpy(weight)).sum()
    (loss * 0.9).backward()


def test_skipgram_steps_write_the_records_of_the_numpy_step():
    runs = {}
    for path in ("modules", "numpy"):
        rng = np.random.default_rng(5)
        inp, out = stores()
        tokens = corpus(rng)
        words, inverse = count(out, tokens)
        sampler = UnigramSampler(power=0.75)
        in_emb, out_emb = DynamicEmbedding(inp), DynamicEmbedding(out, count=False)
        keep = out.contains(words)[inverse]
        ids = inverse[keep]
        for s in range(0, 4 * B, B):
            c = words[ids[s:s + B]]
            x = words[ids[s + 1:s + 1 + B]][:len(c)]
            c = c[:len(x)]
            if path == "modules":
                negs = out.sample([], len(c) * K, sampler, unique=False,
                                  remove_accidental_hits=False, seed=rng).keys
                negs = negs.reshape(len(c), K)
                targets = np.concatenate((x[:, None], negs), axis=1)
                v, u = in_emb(c), out_emb(targets)
            else:
                negs = numpy_negatives(out, sampler, len(c) * K, rng).reshape(len(c), K)
                targets = np.concatenate((x[:, None], negs), axis=1)
                v = numpy_rows(inp, c, True, False)
                u = numpy_rows(out, targets.reshape(-1), False, True).reshape(len(c), K + 1,
                                                                               DIM)
            step(v, u, negs, x)
        runs[path] = {"in": inp, "out": out}
        assert len(out) > 150
    every = np.array([b"w%d" % i for i in range(400)], dtype=object)
    assert_same_tables(runs["modules"], runs["numpy"], every)
