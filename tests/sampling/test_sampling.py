"""Candidate sampling: distributions (chi-square at fixed seeds), expected counts, sharding,
index maintenance, no table scan per call on memory / LMDB / Bigtable, subsampling."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import embstore
from embstore.errors import InvalidInputError
from embstore.sampling import (
    FixedCandidatesSampler,
    LogUniformSampler,
    UniformSampler,
    UnigramSampler,
    expected_count,
    keep_probability,
    sampling_index,
)
from embstore.store import EmbeddingStore

P_MIN = 1e-3  # chi-square p-values below this fail (fixed seeds: the outcome is deterministic)


def fill(store, keys, counts):
    """Give ``keys`` exactly ``counts`` training sightings (zero gradients)."""
    occ = np.repeat(np.asarray(keys), counts)
    store.update(occ, np.zeros((len(occ), store.dim), dtype=np.float32))


def corpus(n=80, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.choice(10**9, n, replace=False).astype(np.int64)
    counts = rng.integers(1, 60, n)
    return keys, counts


def expected_p(sampler, keys, counts):
    if isinstance(sampler, UniformSampler):
        w = np.ones(len(keys))
    elif isinstance(sampler, UnigramSampler):
        w = counts.astype(float) ** sampler.power
    else:
        order = np.lexsort((keys, -counts))
        rank = np.empty(len(keys))
        rank[order] = np.arange(len(keys))
        w = np.log((rank + 2) / (rank + 1)) / np.log(len(keys) + 1)
    return w / w.sum()


def draws(store, keys, sampler, m, seed):
    res = store.sample(np.zeros(0, np.int64), m, sampler, unique=False, seed=seed)
    assert not res.is_positive.any() and len(res.keys) == m
    return np.bincount(np.searchsorted(np.sort(keys), res.keys), minlength=len(keys)), res


SAMPLERS = [UniformSampler(), UnigramSampler(0.75), UnigramSampler(1.0), LogUniformSampler()]


@pytest.fixture
def mem_store():
    s = embstore.open("memory://", dim=2)
    keys, counts = corpus()
    fill(s, keys, counts)
    return s, keys, counts


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: repr(s))
def test_draws_follow_the_sampler_distribution(mem_store, sampler):
    s, keys, counts = mem_store
    order = np.argsort(keys)
    p = expected_p(sampler, keys, counts)[order]
    hist, res = draws(s, keys, sampler, 200_000, seed=7)
    assert stats.chisquare(hist, p * hist.sum()).pvalue > P_MIN
    # prob of a non-unique draw is the expected count m * p, key by key
    np.testing.assert_allclose(res.prob, 200_000 * p[np.searchsorted(np.sort(keys), res.keys)],
                               rtol=1e-9)


def test_log_uniform_is_zipfian_over_frequency_rank(mem_store):
    s, keys, counts = mem_store
    hist, _ = draws(s, keys, LogUniformSampler(), 100_000, seed=3)
    by_rank = hist[np.searchsorted(np.sort(keys), keys[np.lexsort((keys, -counts))])]
    # the most frequent key is drawn most: P(rank 0) = log 2 / log(N + 1)
    assert by_rank[0] == by_rank.max()
    assert abs(by_rank[0] / 100_000 - np.log(2) / np.log(len(keys) + 1)) < 0.01


def test_unique_prob_matches_the_empirical_inclusion_rate(mem_store):
    s, keys, counts = mem_store
    skeys = np.sort(keys)
    rng = np.random.default_rng(11)
    trials, m = 3000, 12
    included = np.zeros(len(keys))
    prob = np.zeros(len(keys))
    for _ in range(trials):
        r = s.sample(skeys, m, UnigramSampler(0.75), seed=rng, remove_accidental_hits=False)
        neg = r.keys[~r.is_positive]
        assert len(neg) == m and len(np.unique(neg)) == m
        included[np.searchsorted(skeys, neg)] += 1
        prob += r.prob[:len(keys)]
        # a negative's prob equals the same key's prob as a positive (same formula, same tries)
        np.testing.assert_allclose(r.prob[len(keys):], r.prob[np.searchsorted(skeys, neg)])
    emp, mean_prob = included / trials, prob / trials
    # TF's 1 - (1 - p) ** num_tries is an approximation for unique sampling; it holds to ~1%
    assert np.abs(emp - mean_prob).max() < 0.035
    assert abs(mean_prob.sum() - m) < 0.05 * m


def test_sharded_sampling_matches_unsharded():
    ShardedBackend = pytest.importorskip("embstore.layers.sharded").ShardedBackend

    keys, counts = corpus(120, seed=5)
    one = embstore.open("memory://", dim=2)
    sharded = EmbeddingStore(ShardedBackend(["memory://"] * 3), dim=2)
    for s in (one, sharded):
        fill(s, keys, counts)
    assert len(sampling_index(sharded).parts) == 3
    assert all(len(p) > 10 for p in sampling_index(sharded).parts)
    skeys = np.sort(keys)
    for sampler in SAMPLERS:
        a, _ = draws(one, keys, sampler, 100_000, seed=1)
        b, _ = draws(sharded, keys, sampler, 100_000, seed=2)
        table = np.stack([a, b])[:, (a + b) > 0]
        assert stats.chi2_contingency(table).pvalue > P_MIN, sampler
        p = expected_p(sampler, keys, counts)[np.argsort(keys)]
        assert stats.chisquare(b, p * b.sum()).pvalue > P_MIN, sampler
        # the probabilities reported are the same as one store's, key by key
        ia, ib = sampling_index(one), sampling_index(sharded)
        pa = ia.prob_of(ia.snapshot(sampler), skeys)
        np.testing.assert_allclose(ib.prob_of(ib.snapshot(sampler), skeys), pa, rtol=1e-9)
        np.testing.assert_allclose(pa, p, rtol=1e-9)
        ra = one.sample(skeys, 50, sampler, seed=0)
        rb = sharded.sample(skeys, 50, sampler, seed=0)
        assert ra.is_positive.sum() == rb.is_positive.sum() == len(keys)


def test_batch_of_examples_as_lists_or_offsets():
    s = embstore.open("memory://", dim=2)
    fill(s, np.arange(30), np.arange(1, 31))
    pos = [np.array([1, 2, 3]), np.array([4]), np.array([], np.int64), np.array([5, 6])]
    a = s.sample(pos, 10, "unigram", seed=4)
    b = s.sample(np.array([1, 2, 3, 4, 5, 6]), 10, "unigram", offsets=[0, 3, 4, 4, 6], seed=4)
    assert len(a) == len(b) == 4
    for ra, rb, p in zip(a, b, pos, strict=True):
        np.testing.assert_array_equal(ra.keys, rb.keys)
        np.testing.assert_array_equal(ra.prob, rb.prob)
        np.testing.assert_array_equal(ra.keys[:len(p)], p)  # positives first, in order
        assert ra.is_positive.sum() == len(p)
        assert not np.isin(ra.negatives, p).any()  # accidental hits removed
    c = s.sample(np.array([[1, 2], [3, 4]]), 10, "unigram", seed=4)  # (batch, num_true)
    d = s.sample([[1, 2], [3, 4]], 10, "unigram", seed=4)
    assert [r.keys.tolist() for r in c] == [r.keys.tolist() for r in d]
    # all examples share the batch's negatives (minus their own hits)
    assert set(a[2].negatives) >= set(a[0].negatives)


def test_accidental_hits_can_be_kept():
    s = embstore.open("memory://", dim=2)
    fill(s, np.arange(5), [1, 1, 1, 1, 1])
    r = s.sample([0, 1], 5, "uniform", remove_accidental_hits=False, seed=0)
    assert sorted(r.negatives.tolist()) == [0, 1, 2, 3, 4]
    # TF's formula with p = 1/5 and the number of draws it took to see all five keys
    np.testing.assert_allclose(r.prob, 1 - 0.8 ** r.num_tries)
    assert r.num_tries >= 5
    r = s.sample([0, 1], 5, "uniform", seed=0)
    assert sorted(r.negatives.tolist()) == [2, 3, 4]


def test_fixed_candidates_sampler():
    s = embstore.open("memory://", dim=2)
    r = s.sample([7, 3], 3, FixedCandidatesSampler([3, 4, 5, 6], prob=[0.1, 0.2, 0.3, 0.4]))
    assert r.keys.tolist() == [7, 3, 4, 5]
    np.testing.assert_allclose(r.prob, [0.0, 0.1, 0.2, 0.3])
    assert len(s) == 0  # nothing read from or written to the table


def test_bad_input_raises_and_leaves_the_store_alone():
    s = embstore.open("memory://", dim=2)
    fill(s, np.arange(10), np.ones(10, int))
    before = s.get_records(np.arange(10))[0].copy()
    for kwargs in ({"num_sampled": -1}, {"num_sampled": 2.5}, {"num_sampled": 11},
                   {"num_sampled": 2, "sampler": "zipf"},
                   {"num_sampled": 2, "offsets": [0, 5]}, {"num_sampled": 2, "offsets": [1, 2]}):
        with pytest.raises(InvalidInputError):
            s.sample([1, 2], **kwargs)
    with pytest.raises(InvalidInputError):
        UnigramSampler(power=-1)
    with pytest.raises(InvalidInputError):
        embstore.open("memory://", dim=2).sample([], 1, "uniform")  # empty store
    np.testing.assert_array_equal(s.get_records(np.arange(10))[0], before)


def test_index_follows_writes_and_deletes():
    s = embstore.open("memory://", dim=2)
    fill(s, np.arange(100), np.full(100, 2))
    idx = sampling_index(s, staleness=0.0)
    fill(s, np.arange(100, 150), np.full(50, 3))        # new keys
    fill(s, np.arange(10), np.full(10, 5))               # more sightings
    s.delete(np.arange(20, 40))
    s.lookup(np.arange(150, 160))                        # inserted with count 0
    fresh = type(idx)(s.backend, s.key_type)
    fresh.build()
    got = dict(zip(*(a.tolist() for a in idx.parts[0].items("count")), strict=True))
    want = dict(zip(*(a.tolist() for a in fresh.parts[0].items("count")), strict=True))
    assert got == want and idx.total_count == fresh.total_count == sum(want.values())
    assert idx.scans == 1
    hist = s.sample([], 20_000, "unigram", unique=False, seed=0).keys
    assert not np.isin(hist, np.arange(20, 40)).any()     # deleted keys are never drawn
    assert not np.isin(hist, np.arange(150, 160)).any()   # count 0: weight 0 at power 0.75
    assert np.isin(np.arange(100, 150), hist).all()       # new keys are drawn


def test_snapshot_staleness_bounds_rebuilds():
    s = embstore.open("memory://", dim=2)
    fill(s, np.arange(1000), np.ones(1000, int))
    idx = sampling_index(s, staleness=0.05)
    s.sample([1], 8, "unigram", seed=0)
    r0 = idx.rebuilds
    fill(s, np.arange(10), np.full(10, 9))                # 1% of rows changed: reused
    s.sample([1], 8, "unigram", seed=0)
    assert idx.rebuilds == r0
    fill(s, np.arange(100), np.full(100, 9))              # > 5%: rebuilt
    r = s.sample([1], 8, "unigram", seed=0)
    assert idx.rebuilds == r0 + 1
    assert r.prob[0] > 0
    # the snapshot in use carries the counts as of its (re)build, i.e. the current ones
    c = idx.counts_of(np.arange(1000)).astype(float) ** 0.75
    np.testing.assert_allclose(idx.prob_of(idx.snapshot(UnigramSampler()), np.arange(1000)),
                               c / c.sum(), rtol=1e-9)


def test_steps_that_count_nothing_never_stale_the_snapshot():
    # An adapter with count=False steps rows with zero counts: the sampling weights do not
    # move, so no such step may count towards a rebuild.
    s = embstore.open("memory://", dim=2)
    fill(s, np.arange(100), np.ones(100, int))
    idx = sampling_index(s, staleness=0.05)
    s.sample([1], 8, "unigram", seed=0)
    r0 = idx.rebuilds
    for _ in range(20):
        s.update(np.arange(100), np.ones((100, 2), np.float32), counts=np.zeros(100, int))
    s.sample([1], 8, "unigram", seed=0)
    assert idx.rebuilds == r0
    fill(s, np.arange(10), np.full(10, 3))                # 10% of rows counted: rebuilt
    s.sample([1], 8, "unigram", seed=0)
    assert idx.rebuilds == r0 + 1


def test_bytes_keys():
    s = embstore.open("memory://", dim=2, key_type="bytes")
    words = [f"w{i}" for i in range(40)]
    fill(s, np.array(words, dtype=object), np.arange(1, 41))
    r = s.sample(["w1", "w2"], 10, "log_uniform", seed=0)
    assert r.keys[:2].tolist() == [b"w1", b"w2"]
    assert all(isinstance(k, bytes) for k in r.keys)
    assert len(set(r.negatives.tolist())) == len(r.negatives)
    assert (r.prob > 0).all()
    assert s.subsample_mask(["w39", "nope"], t=1e-2, seed=0).shape == (2,)


def test_subsample_follows_the_word2vec_rule():
    s = embstore.open("memory://", dim=2)
    counts = np.array([10_000, 1000, 100, 10, 1])
    fill(s, np.arange(5), counts)
    t = 1e-3
    f = counts / counts.sum()
    want = np.minimum(1, (np.sqrt(f / t) + 1) * t / f)
    np.testing.assert_allclose(keep_probability(s, np.arange(5), t), want)
    assert keep_probability(s, [99], t)[0] == 1.0  # unknown keys are kept
    occ = np.repeat(np.arange(5), 20_000)
    mask = s.subsample_mask(occ, t=t, seed=3)
    rate = np.bincount(occ[mask], minlength=5) / 20_000
    np.testing.assert_allclose(rate, want, atol=0.015)
    with pytest.raises(InvalidInputError):
        s.subsample_mask([1], t=0)


def test_import_resyncs_the_index(tmp_path):
    a = embstore.open("memory://", dim=2)
    fill(a, np.arange(50), np.full(50, 4))
    a.export(tmp_path / "a.emb")
    b = embstore.open("memory://", dim=2)
    fill(b, [1000], [1])
    idx = sampling_index(b)
    b.import_(tmp_path / "a.emb")
    r = b.sample([], 51, "uniform", seed=0)
    assert sorted(r.keys.tolist()) == list(range(50)) + [1000]
    assert idx.scans == 2
    assert b.stats()["sampling_index_scans"] == 2 and b.stats()["sampling_index_rows"] == 51


# -- no table scan per call, on every backend ------------------------------------------------------
class Counting:
    """Counts calls of a real backend's row reads (wrapping its bound methods), and of its
    shards' when it is sharded."""

    def __init__(self, backend):
        self.calls = {"scan": 0, "get": 0, "get_field": 0, "contains": 0}
        for b in [backend, *getattr(backend, "shards", [])]:
            for name in self.calls:
                orig = getattr(b, name)

                def wrapped(*a, _orig=orig, _name=name, **kw):
                    self.calls[_name] += 1
                    return _orig(*a, **kw)

                setattr(b, name, wrapped)

    @property
    def scans(self):
        return self.calls["scan"]

    def reset(self):
        for k in self.calls:
            self.calls[k] = 0


@pytest.fixture(params=["memory", "lmdb", "bigtable", "sharded-lmdb"])
def any_url(request, tmp_path):
    if request.param == "memory":
        return lambda: "memory://"
    if request.param == "sharded-lmdb":
        pytest.importorskip("embstore.backends.lmdb")
        mod = pytest.importorskip("embstore.layers.sharded")
        return lambda: mod.sharded_url([f"lmdb://{tmp_path}/s{i}" for i in range(3)])
    if request.param == "lmdb":
        pytest.importorskip("lmdb")
        pytest.importorskip("embstore.backends.lmdb")
        return lambda: f"lmdb://{tmp_path}/db"
    pytest.importorskip("embstore.backends.bigtable.backend")
    try:
        return request.getfixturevalue("bigtable_url_factory")
    except pytest.FixtureLookupError:
        pytest.skip("bigtable fixtures not available")


def test_sample_reads_the_table_once_on_every_backend(any_url):
    url = any_url()
    keys, counts = corpus(60, seed=2)
    with embstore.open(url, dim=2) as s:
        fill(s, keys, counts)
        c = Counting(s.backend)
        s.sample(keys[:3], 8, "unigram", seed=0)
        assert c.scans == (3 if url.startswith("sharded") else 1)  # one per shard
        c.reset()
        for i in range(20):
            s.sample([keys[i]], 8, "unigram", seed=i)
            s.sample([keys[i]], 8, "log_uniform", seed=i)
            s.sample([[keys[i]], keys[i + 1:i + 3]], 8, "uniform", seed=i)
            s.subsample_mask(keys[:5], t=1e-2, seed=i)
        assert c.calls == {"scan": 0, "get": 0, "get_field": 0, "contains": 0}
        sampling_index(s, staleness=0.0)  # every write shows in the next draw
        fill(s, [10**10], [100])  # a write through the store keeps the index current
        c.reset()
        assert 10**10 in s.sample([], 200, "unigram", unique=False, seed=1).keys
        assert c.calls["scan"] == 0
        hist, _ = draws(s, np.append(keys, 10**10), UnigramSampler(), 50_000, seed=5)
        p = expected_p(UnigramSampler(), np.append(keys, 10**10), np.append(counts, 100))
        assert stats.chisquare(hist, p[np.argsort(np.append(keys, 10**10))] * 50_000
                               ).pvalue > P_MIN
    if url != "memory://":  # after a reopen: one scan rebuilds the index, then none
        with embstore.open(url) as s:
            c = Counting(s.backend)
            r1 = s.sample(keys[:2], 8, "unigram", seed=0)
            r2 = s.sample(keys[:2], 8, "unigram", seed=1)
            assert c.scans == (3 if url.startswith("sharded") else 1)
            assert (r1.prob[:2] > 0).all()
            assert r2.prob[0] == pytest.approx(
                -np.expm1(r2.num_tries * np.log1p(-counts[0] ** 0.75 / (
                    (counts.astype(float) ** 0.75).sum() + 100 ** 0.75))))


def test_seeded_calls_are_reproducible():
    s = embstore.open("memory://", dim=2)
    keys, counts = corpus()
    fill(s, keys, counts)
    a = s.sample(keys[:3], 40, "unigram", seed=9)
    s.sample(keys[:3], 70, "unigram")  # unseeded calls in between use the store's generator
    s.sample(keys[:3], 40, "unigram")
    b = s.sample(keys[:3], 40, "unigram", seed=9)
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.prob, b.prob)
    c = s.sample(keys[:3], 40, "unigram")
    d = s.sample(keys[:3], 40, "unigram")
    assert not np.array_equal(c.keys, d.keys)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: repr(s))
@pytest.mark.parametrize("shards", [1, 3])
def test_deletes_are_rejected_without_a_rebuild(sampler, shards):
    ShardedBackend = pytest.importorskip("embstore.layers.sharded").ShardedBackend

    keys, counts = corpus(200, seed=8)
    s = EmbeddingStore(ShardedBackend(["memory://"] * shards), dim=2) if shards > 1 \
        else embstore.open("memory://", dim=2)
    fill(s, keys, counts)
    idx = sampling_index(s, staleness=0.5)
    s.sample([], 10, sampler, seed=0)
    rebuilds = idx.rebuilds
    gone = keys[:30]  # 15% of the keys: below the compaction threshold
    s.delete(gone)
    hist, res = draws(s, keys, sampler, 100_000, seed=4)
    assert idx.rebuilds == rebuilds  # the snapshot was kept...
    assert not np.isin(res.keys, gone).any()  # ...and deleted keys are never drawn
    # the distribution is the snapshot's, conditioned on the keys still alive
    p = expected_p(sampler, keys, counts)
    p[:30] = 0.0
    p /= p.sum()
    order = np.argsort(keys)
    assert stats.chisquare(hist[hist + p[order] > 0],
                           (p[order] * hist.sum())[hist + p[order] > 0]).pvalue > P_MIN
    snap = idx.snapshot(sampler)
    np.testing.assert_allclose(idx.prob_of(snap, keys), p, rtol=1e-9, atol=1e-15)


def test_many_deletes_compact_the_index():
    s = embstore.open("memory://", dim=2)
    fill(s, np.arange(4000), np.full(4000, 2))
    idx = sampling_index(s, staleness=1.0)
    s.sample([], 10, "unigram", seed=0)
    epoch, rebuilds = idx.parts[0].epoch, idx.rebuilds
    for i in range(0, 2000, 100):  # half the keys, in small batches
        s.delete(np.arange(i, i + 100))
        assert s.sample([], 50, "unigram", unique=False, seed=i).keys.min() >= i + 100
    assert idx.parts[0].epoch > epoch and idx.rebuilds > rebuilds
    assert idx.parts[0].n < 4000 and len(idx) == 2000
    np.testing.assert_array_equal(idx.parts[0].positions(np.arange(2000)), -1)
    k, c = idx.parts[0].items("count")
    assert sorted(k.tolist()) == list(range(2000, 4000)) and (c == 2).all()
    fill(s, [1], [5])  # a deleted key comes back: not in the snapshot until it is rebuilt
    assert s.sample([1], 2000, "unigram", seed=1).prob[0] == 0
    sampling_index(s, staleness=0.0)
    r = s.sample([1], 2000, "unigram", seed=1)
    assert r.prob[0] > 0


def test_log_uniform_prob_matches_tensorflow():
    tf = pytest.importorskip("tensorflow")
    n = 50
    s = embstore.open("memory://", dim=2)
    fill(s, np.arange(n), np.arange(n, 0, -1))  # key r has frequency rank r, as TF assumes
    true = np.array([[0], [3], [49]], dtype=np.int64)
    for unique in (False, True):
        tf_s, tf_true, tf_samp = tf.random.log_uniform_candidate_sampler(
            true, num_true=1, num_sampled=20, unique=unique, range_max=n, seed=1)
        tf_s, tf_true, tf_samp = tf_s.numpy(), tf_true.numpy()[:, 0], tf_samp.numpy()
        p = np.log((np.arange(n) + 2) / (np.arange(n) + 1)) / np.log(n + 1)
        if unique:  # recover TF's number of tries from one sampled class, then check all
            tries = np.log1p(-tf_samp[0]) / np.log1p(-p[tf_s[0]])
            assert abs(tries - round(tries)) < 1e-3
            tries = round(tries)
        else:
            tries = 20
        np.testing.assert_allclose(expected_count(p[tf_s], tries, unique), tf_samp, rtol=1e-5)
        np.testing.assert_allclose(expected_count(p[true[:, 0]], tries, unique), tf_true,
                                   rtol=1e-5)
        ours = s.sample(true[:, 0], 20, "log_uniform", unique=unique, seed=0,
                        remove_accidental_hits=False)
        want = expected_count(p, ours.num_tries, unique)
        np.testing.assert_allclose(ours.prob, want[ours.keys], rtol=1e-9)
