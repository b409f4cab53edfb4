"""Admission, expiry and eviction: exact counts against a Python model on a seeded Zipf
stream, on memory, LMDB and Bigtable stores; policy state across reopen; bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.policies import (
    BloomAdmission,
    EventClock,
    Eviction,
    Expiry,
    FrequencyCutoff,
    ProbabilisticAdmission,
)
from tests.stores import backend_available

DIM = 4


@pytest.fixture(params=["lmdb", "sqlite"])
def persistent_url_factory(request, tmp_path):
    """Persistent local stores, for reopen tests (Bigtable has its own test below)."""
    counter = itertools.count()
    if not backend_available(request.param):
        pytest.skip(f"{request.param} backend not available")
    if request.param == "lmdb":
        return lambda: f"lmdb://{tmp_path}/p{next(counter)}"
    return lambda: f"sqlite:///{tmp_path}/p{next(counter)}.db"


def zipf_stream(seed: int, batches: int, batch: int, a: float = 1.3, vocab: int = 5000):
    rng = np.random.default_rng(seed)
    for _ in range(batches):
        yield (rng.zipf(a, batch) % vocab).astype(np.int64)


# -- admission ---------------------------------------------------------------------------------
def test_frequency_cutoff_counts_match_exact_model(any_store_url_factory):
    min_count = 3
    s = embstore.open(any_store_url_factory(), dim=DIM, admission=FrequencyCutoff(min_count))
    seen: dict[int, int] = {}
    rows: set[int] = set()
    rejected = 0
    try:
        for keys in zipf_stream(1, 30, 100):
            vecs = s.lookup(keys)
            np.testing.assert_array_equal(vecs, s.initial_vectors(keys))
            uniq, occ = np.unique(keys, return_counts=True)
            for k, c in zip(uniq.tolist(), occ.tolist()):
                if k in rows:
                    continue
                seen[k] = seen.get(k, 0) + c
                if seen[k] >= min_count:
                    rows.add(k)
                else:
                    rejected += 1
        st = s.stats(count_rows=True)
        assert st["admission_rejected"] == rejected
        assert st["rows"] == len(rows) == len(s)
        np.testing.assert_array_equal(s.contains(np.array(sorted(rows))), True)
        pending = np.array(sorted(set(seen) - rows), dtype=np.int64)
        assert len(pending) > 0
        assert not s.contains(pending).any()
        # Gradients of a not-yet-admitted key are dropped (after a lookup: not counted twice).
        k = np.array([next(x for x in pending.tolist() if seen[x] == 1)])
        assert s.admission.estimate(k)[0] == 1
        s.lookup(k)
        s.update(k, np.ones((1, DIM), np.float32))
        st = s.stats()
        assert st["gradients_dropped"] == 1
        assert s.admission.estimate(k)[0] == 2
        assert not s.contains(k)[0]
        np.testing.assert_array_equal(s.lookup(k, insert=False), s.initial_vectors(k))
    finally:
        s.close()


def test_update_only_training_counts_sightings_in_update():
    s = embstore.open("memory://", dim=DIM, admission=FrequencyCutoff(2))
    g = np.ones((1, DIM), np.float32)
    s.update([5], g)
    assert not s.contains([5])[0] and s.stats()["gradients_dropped"] == 1
    s.update([5], g)  # second sighting: admitted, its gradient applied
    assert s.contains([5])[0]
    rec = s.get_records([5])[0]
    assert rec["count"][0] == 1
    np.testing.assert_allclose(rec["vector"][0], s.initial_vectors([5])[0] - 0.01 * g[0],
                               rtol=1e-6)


def test_bloom_admits_on_second_sighting():
    s = embstore.open("memory://", dim=DIM, admission=BloomAdmission(1000, 0.001))
    s.lookup(np.arange(100))
    assert len(s) <= 1  # at most a false positive
    s.lookup(np.arange(50))
    assert s.contains(np.arange(50)).all()
    s.lookup([1000, 1000])  # twice in one call counts as two sightings
    assert s.contains([1000])[0]
    assert s.stats()["admission_rejected"] >= 99


def test_probabilistic_admission_rate_and_determinism():
    def run():
        s = embstore.open("memory://", dim=DIM, admission=ProbabilisticAdmission(0.25, seed=3))
        s.lookup(np.arange(4000))
        s.lookup(np.repeat(np.arange(10_000, 14_000), 3))
        once = s.contains(np.arange(4000)).mean()
        thrice = s.contains(np.arange(10_000, 14_000)).mean()
        return once, thrice, s.contains(np.arange(4000))

    a, b = run(), run()
    assert abs(a[0] - 0.25) < 0.04
    assert abs(a[1] - (1 - 0.75 ** 3)) < 0.04
    np.testing.assert_array_equal(a[2], b[2])
    s = embstore.open("memory://", dim=DIM, admission=ProbabilisticAdmission(1.0))
    s.lookup(np.arange(100))
    assert len(s) == 100


@pytest.mark.parametrize("policy", [lambda: FrequencyCutoff(3),
                                    lambda: BloomAdmission(1000, 0.001),
                                    lambda: ProbabilisticAdmission(0.5, seed=1)])
def test_admission_state_survives_reopen(persistent_url_factory, policy):
    url = persistent_url_factory()
    s = embstore.open(url, dim=DIM, admission=policy())
    s.lookup(np.arange(200))
    s.lookup(np.arange(200))
    rows = len(s)
    s.close()
    # Reopened without naming the policy: the stored one (with its state) comes back.
    s = embstore.open(url)
    assert s.admission == policy()
    s.lookup(np.arange(200))
    if isinstance(s.admission, FrequencyCutoff):
        assert rows == 0 and len(s) == 200  # third sighting of each key
    elif isinstance(s.admission, BloomAdmission):
        assert len(s) == 200
    else:
        assert len(s) > rows
    s.close()


def test_policy_state_survives_reopen_on_bigtable(request):
    try:
        factory = request.getfixturevalue("bigtable_url_factory")
    except pytest.FixtureLookupError:
        pytest.skip("bigtable fixtures not available")
    url = factory()
    s = embstore.open(url, dim=DIM, admission=FrequencyCutoff(2),
                      expiry=Expiry(ttl_steps=5), capacity=1000, eviction="lfu")
    s.lookup(np.arange(50))
    assert len(s) == 0
    s.close()
    s = embstore.open(url)
    assert s.expiry == Expiry(ttl_steps=5) and s.eviction == Eviction(1000, "lfu")
    s.lookup(np.arange(50))
    assert len(s) == 50
    s.close()


# -- expiry ------------------------------------------------------------------------------------
def test_step_expiry_matches_model(any_store_url_factory):
    s = embstore.open(any_store_url_factory(), dim=DIM)
    last: dict[int, int] = {}
    try:
        for i, keys in enumerate(zipf_stream(2, 25, 60), start=1):
            s.update(keys, np.ones((len(keys), DIM), np.float32))
            for k in keys.tolist():
                last[k] = i
        ttl = 10
        expected = {k for k, st in last.items() if st < s.step - ttl}
        assert 0 < len(expected) < len(last)
        assert s.expire(ttl_steps=ttl) == len(expected)
        assert s.stats()["expired"] == len(expected)
        assert len(s) == len(last) - len(expected)
        assert not s.contains(np.array(sorted(expected))).any()
        assert s.expire(ttl_steps=ttl) == 0
    finally:
        s.close()


def test_wall_time_expiry_with_explicit_now():
    s = embstore.open("memory://", dim=DIM)
    s.lookup(np.arange(10))
    t = s.get_records(np.arange(10))[0]["last_seen"].max()
    assert s.expire(ttl_seconds=3600, now=t + 10) == 0
    assert s.expire(ttl_seconds=3600, now=t + 3601) == 10
    assert len(s) == 0 and s.stats()["expired"] == 10


def test_expiry_runs_every_n_updates():
    s = embstore.open("memory://", dim=DIM, expiry=Expiry(ttl_steps=2, every=3))
    g = np.ones((1, DIM), np.float32)
    s.update([1], g)            # step 1
    for _ in range(4):
        s.update([2], g)        # steps 2..5; the pass after step 3 keeps key 1 (1 < 3-2 fails)
    assert s.contains([1])[0]
    s.update([2], g)            # step 6: the second pass expires key 1 (1 < 6-2)
    assert not s.contains([1])[0] and s.contains([2])[0]
    assert s.stats()["expired"] == 1
    assert s.expire() == 0      # the configured TTL applies without arguments


def test_event_time_clock_drives_last_seen_ttl_and_recency():
    """A logged stream replayed by event time: rows are stamped with the batch's timestamp,
    ``ttl_seconds`` counts stream time (the replay takes milliseconds of wall time), and LRU
    ranks by it."""
    clock = EventClock(start=1_000_000.0)
    s = embstore.open("memory://", dim=DIM, clock=clock,
                      expiry=Expiry(ttl_seconds=3600, every=1))
    g = np.zeros((10, DIM), np.float32)
    s.update(np.arange(10), g)                      # t0
    assert (s.get_records(np.arange(10))[0]["last_seen"] == 1_000_000.0).all()
    clock.set(1_000_000.0 + 1800)
    s.update(np.arange(10, 20), g)                  # half an hour of stream later
    assert s.contains(np.arange(20)).all()
    clock.set(1_000_000.0 + 3601)
    s.update(np.arange(20, 30), g)                  # keys 0..9 are now older than the TTL
    assert not s.contains(np.arange(10)).any() and s.contains(np.arange(10, 30)).all()
    assert s.stats()["expired"] == 10
    clock.set(1.0)                                  # a late batch does not move time back
    assert s.now() == 1_000_000.0 + 3601
    with pytest.raises(InvalidInputError):
        embstore.open("memory://", dim=DIM, clock=12.5)
    with pytest.raises(InvalidInputError):
        clock.set(float("nan"))


# -- eviction ----------------------------------------------------------------------------------
def _eviction_model(stream, capacity: int, policy: str):
    """Capacity eviction as plain Python; LFU counts lose half per ``capacity`` evictions for
    the rows not written since (the aging rule of ``embstore.policies.eviction``)."""
    rows: dict[int, list[int]] = {}  # key -> [last_step, count]
    evicted, since_halving, halvings = 0, 0, []
    for step, keys in enumerate(stream, start=1):
        uniq, mult = np.unique(keys, return_counts=True)
        for k, m in zip(uniq.tolist(), mult.tolist()):
            r = rows.setdefault(k, [0, 0])
            r[0] = step
            r[1] += m
        if len(rows) > capacity:
            def order(k, step=step):
                ls, c = rows[k]
                aged = c >> sum(1 for h in halvings if h >= ls)
                return (ls >= step, aged, ls, k) if policy == "lfu" else (ls >= step, ls, k)

            for k in sorted(rows, key=order)[:len(rows) - capacity]:
                del rows[k]
                evicted += 1
                since_halving += 1
                if since_halving == capacity:
                    halvings.append(step)
                    since_halving = 0
    return set(rows), evicted, len(halvings)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_capacity_eviction_matches_model(any_store_url_factory, policy):
    cap = 150
    s = embstore.open(any_store_url_factory(), dim=DIM, capacity=Eviction(cap, policy, slack=0.0))
    try:
        stream = list(zipf_stream(3, 40, 40, a=1.2, vocab=2000))
        for keys in stream:
            s.update(keys, np.full((len(keys), DIM), 0.5, np.float32))
            assert len(s) <= cap
        expected, evicted, halvings = _eviction_model(stream, cap, policy)
        assert evicted > 2 * cap and halvings >= 2
        assert s.stats()["evictions"] == evicted
        got = set()
        for keys, _ in s.items():
            got.update(keys.tolist())
        assert got == expected
    finally:
        s.close()


def test_lfu_capacity_ages_stale_keys_out_on_a_drifting_stream():
    """100 keys seen 5 times, then 200 fresh keys seen twice each (in batches of 10): without
    aging the stale keys' counts of 5 outrank every fresh key forever and the table keeps
    them (93 stale, 3 fresh); with aging they lose half per ``capacity`` evictions and the
    fresh keys take over, as LRU would keep them."""
    kept = {}
    for policy in ("lfu", "lru"):
        s = embstore.open("memory://", dim=DIM, capacity=Eviction(100, policy))
        g = np.zeros((100, DIM), np.float32)
        stale, fresh = np.arange(100), np.arange(1000, 1200)
        for _ in range(5):
            s.update(stale, g)
        for batch in fresh.reshape(20, 10):
            s.update(batch, g[:10])
            s.update(batch, g[:10])
        kept[policy] = (int(s.contains(stale).sum()), int(s.contains(fresh).sum()))
        evictions = s.stats()["evictions"]
        if policy == "lfu":
            lfu_evictions = evictions
    assert kept["lfu"][0] <= 10 and kept["lfu"][1] >= 85, kept
    assert kept["lru"][0] == 0
    assert lfu_evictions <= evictions + 10  # no churn of fresh keys against stale ones


def test_eviction_with_slack_amortizes_and_lookup_inserts_respect_capacity():
    s = embstore.open("memory://", dim=DIM, capacity=1000, eviction="lru")
    assert s.eviction == Eviction(1000, "lru")
    for i in range(20):
        s.lookup(np.arange(i * 300, (i + 1) * 300))
        assert len(s) <= 1000
    st = s.stats()
    assert st["evictions"] == 20 * 300 - len(s)
    # LRU keeps the newest keys.
    assert s.contains(np.arange(5700, 6000)).all()


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: FrequencyCutoff(0), lambda: FrequencyCutoff(-3), lambda: FrequencyCutoff(2.5),
    lambda: FrequencyCutoff(True), lambda: FrequencyCutoff(3, width=1000),
    lambda: Expiry(ttl_seconds=0), lambda: Expiry(ttl_steps=-1), lambda: Expiry(),
    lambda: Expiry(ttl_seconds=float("inf")), lambda: Expiry(ttl_steps=1.5),
    lambda: Expiry(ttl_steps=3, every=-1),
    lambda: Eviction(0), lambda: Eviction(10, "fifo"), lambda: Eviction(10, slack=1.0),
    lambda: ProbabilisticAdmission(0), lambda: ProbabilisticAdmission(1.5),
    lambda: BloomAdmission(error_rate=0),
])
def test_bad_policy_parameters_raise(make):
    with pytest.raises(InvalidInputError):
        make()


def test_bad_policy_options_on_open():
    with pytest.raises(InvalidInputError):
        embstore.open("memory://", dim=DIM, admission="often")
    with pytest.raises(InvalidInputError):
        embstore.open("memory://", dim=DIM, capacity=-5)
    with pytest.raises(InvalidInputError):
        embstore.open("memory://", dim=DIM, eviction="lru")  # no capacity
    s = embstore.open("memory://", dim=DIM)
    s.lookup([1, 2])
    with pytest.raises(InvalidInputError):
        s.expire()  # no TTL configured
    with pytest.raises(InvalidInputError):
        s.expire(ttl_seconds=-1)
    assert len(s) == 2


@pytest.mark.parametrize("policy", [lambda: FrequencyCutoff(2), lambda: BloomAdmission(100)])
def test_admission_with_bytes_keys(policy):
    s = embstore.open("memory://", dim=DIM, key_type="bytes", admission=policy())
    s.lookup(["a", "b"])
    assert len(s) == 0
    s.lookup(["a"])
    assert s.contains(["a", "b"]).tolist() == [True, False]
    s.update(["c"], np.ones((1, DIM)))
    s.update(["c"], np.ones((1, DIM)))
    assert s.contains(["c"])[0] and s.stats()["gradients_dropped"] == 1


# -- admission state: batch Bloom hashing, sketch sizing --------------------------------------
def _bloom_per_key(sbf, hashes):
    """The per-key path: pybloom's ``ScalableBloomFilter.add`` logic one key at a time, on
    the same bit positions as the batch path."""
    from pybloom_live import BloomFilter

    from embstore.policies.admission import bloom_positions

    out = []
    for h in hashes:
        h = np.array([h], dtype=np.uint64)
        present = False
        for f in reversed(sbf.filters):
            pos = bloom_positions(h, f.num_slices, f.bits_per_slice)[0]
            if all(f.bitarray[int(p)] for p in pos):
                present = True
                break
        out.append(present)
        if present:
            continue
        if not sbf.filters:
            sbf.filters.append(BloomFilter(sbf.initial_capacity, sbf.error_rate * sbf.ratio))
        elif sbf.filters[-1].count >= sbf.filters[-1].capacity:
            last = sbf.filters[-1]
            sbf.filters.append(BloomFilter(last.capacity * sbf.scale,
                                           last.error_rate * sbf.ratio))
        f = sbf.filters[-1]
        for p in bloom_positions(h, f.num_slices, f.bits_per_slice)[0]:
            f.bitarray[int(p)] = True
        f.count += 1
    return np.array(out, dtype=bool)


def test_bloom_batch_path_equals_the_per_key_path():
    """Same decisions, same bits, same counts as adding keys one by one, across the filter's
    growth inside a batch, with repeats across batches and false positives (a tiny, very
    loose filter makes them common)."""
    pytest.importorskip("pybloom_live")
    from embstore._keys import key_hash64

    rng = np.random.default_rng(5)
    for cap, err in ((50, 0.3), (1000, 0.001)):
        batch = BloomAdmission(initial_capacity=cap, error_rate=err)
        ref = BloomAdmission(initial_capacity=cap, error_rate=err)
        for size in (1, 7, 300, 64, 2000, 5):
            keys = np.unique(rng.integers(0, 3000, size))
            counts = rng.integers(1, 3, len(keys))
            got = batch.admit(keys, counts)
            want = _bloom_per_key(ref._bloom, key_hash64(keys)) | (counts >= 2)
            np.testing.assert_array_equal(got, want)
        assert len(batch._bloom.filters) == len(ref._bloom.filters)
        assert len(batch._bloom.filters) >= (2 if cap == 50 else 1)  # grew inside a batch
        for fa, fb in zip(batch._bloom.filters, ref._bloom.filters):
            assert fa.bitarray == fb.bitarray and fa.count == fb.count
        restored = BloomAdmission(initial_capacity=cap, error_rate=err)
        restored.load_state(batch.state())  # pybloom's own file format
        keys = np.arange(3000, 3100)
        np.testing.assert_array_equal(restored.admit(keys, np.ones(100)),
                                      batch.admit(keys, np.ones(100)))


def test_bloom_saved_before_batch_hashing_keeps_its_filter():
    pytest.importorskip("pybloom_live")
    from embstore.policies import admission_from_config

    old = admission_from_config({"name": "bloom", "initial_capacity": 100, "error_rate": 0.01})
    assert old.hashing == "pybloom" and old.config() == {"name": "bloom",
                                                         "initial_capacity": 100,
                                                         "error_rate": 0.01}
    keys = np.arange(10)
    assert not old.admit(keys, np.ones(10)).any() and old.admit(keys, np.ones(10)).all()
    assert BloomAdmission().config()["hashing"] == "key_hash64"


def test_frequency_sketch_is_sized_by_keys_and_counted_in_stats():
    """The sketch starts small and doubles with the distinct keys it counts (never losing a
    count), up to its byte budget; stats() reports it and size_bytes includes it."""
    small = FrequencyCutoff(3)
    assert small.nbytes <= 4096  # not a fixed 4 MiB
    keys = np.arange(20_000, dtype=np.int64)
    small.admit(keys[:5000], np.ones(5000))
    est_before = small.estimate(keys[:5000]).copy()
    small.admit(keys[5000:], np.ones(15_000))
    assert small.sketch.width >= 8 * 20_000 // 2 and small.nbytes <= 4 * small.sketch.width
    assert (small.estimate(keys[:5000]) >= est_before).all()
    assert (small.estimate(keys) >= 1).all()
    # false early admissions at the sizing load stay rare
    early = small.admit(np.arange(10**6, 10**6 + 20_000), np.ones(20_000))
    assert early.mean() < 0.01
    sized = FrequencyCutoff(3, expected_keys=100_000)
    assert sized.sketch.width == 1 << 20
    capped = FrequencyCutoff(3, max_bytes=64 << 10)
    capped.admit(np.arange(200_000), np.ones(200_000))
    assert capped.nbytes <= 64 << 10
    with pytest.raises(InvalidInputError):
        FrequencyCutoff(3, expected_keys=0)

    s = embstore.open("memory://", dim=DIM, admission=FrequencyCutoff(2, expected_keys=1000))
    st = s.stats()
    assert st["admission_bytes"] == 4 * 16384 // 8  # 9.5 x 1000 counters a row, 1 bit each
    s.lookup(np.arange(100))
    s.lookup(np.arange(100))  # admitted now
    full = s.stats()
    assert full["rows"] == 100
    s.delete(np.arange(50))
    after = s.stats()
    assert after["size_bytes"] < full["size_bytes"]  # live rows, not the arena's high mark
    assert after["size_bytes"] - after["admission_bytes"] \
        == full["size_bytes"] - full["admission_bytes"] - 50 * s.layout.itemsize


def test_frequency_sketch_growth_survives_reopen(tmp_path):
    url = f"lmdb://{tmp_path}/s"
    s = embstore.open(url, dim=DIM, admission=FrequencyCutoff(3))
    s.lookup(np.arange(5000))
    s.lookup(np.arange(5000))
    width, early = s.admission.sketch.width, len(s)
    assert width > 1024 and early <= 5  # a few keys admitted early, by collisions
    s.close()
    s = embstore.open(url, admission=FrequencyCutoff(3))
    assert s.admission.sketch.width == width
    s.lookup(np.arange(5000))
    assert len(s) == 5000  # the two earlier sightings were kept
    s.close()


def test_frequency_sketch_memory_follows_the_keys_it_has_seen():
    """The sketch grows from the keys it has counted, at a few bytes per key, and keeps its
    error rate while it grows: doubling one table by copying counters kept every collision
    (100,000 keys took 4 MiB, 42 bytes a key, and 1.3% of fresh keys passed a cutoff of 2 on
    their first sighting)."""
    rng = np.random.default_rng(0)
    n = 100_000
    keys = rng.permutation(np.arange(10**9, 10**9 + 2 * n)).astype(np.int64)
    seen, fresh = keys[:n], keys[n:]
    f = FrequencyCutoff(2)
    for i in range(0, n, 4096):
        f.admit(seen[i:i + 4096], np.ones(len(seen[i:i + 4096])))
    assert f.nbytes <= 8 * n  # bytes: 1-bit counters, layers that double
    assert (f.estimate(seen) >= 1).all()  # nothing forgotten while growing
    early = np.concatenate([f.admit(fresh[i:i + 4096], np.ones(len(fresh[i:i + 4096])))
                            for i in range(0, n, 4096)])
    assert early.mean() < 0.004  # BloomAdmission's default error is 0.001
    filled = [layer.occupied for layer in f.sketch.layers]
    assert f.admit(seen[:1000], np.ones(1000)).all()  # second sightings pass
    # a key past the cutoff gets a row and is counted no more: it fills no counters
    assert [layer.occupied for layer in f.sketch.layers] == filled
    # more bits per counter only where the cutoff needs them
    f5 = FrequencyCutoff(5)
    f5.admit(seen, np.ones(n))
    assert f5.nbytes <= 4 * f.nbytes + 4096
    assert f5.admit(seen[:100], np.full(100, 4)).all()  # 1 + 4 sightings
    assert not f5.admit(seen[100:200], np.full(100, 2)).any()


def test_frequency_sketch_saved_by_earlier_versions_loads(tmp_path):
    """A growing sketch saved as ``[width, distinct]`` + one table of one-byte counters
    (the format before layers) loads with every count."""
    from embstore.policies import CountMinSketch

    old = CountMinSketch(4096, 4, cap=3, seed=0)
    keys = np.arange(300, dtype=np.int64)
    old.add(keys[:200], np.ones(200))
    old.add(keys[:100], np.ones(100))
    raw = np.array([4096, 200], dtype="<i8").tobytes() + old.to_bytes()
    f = FrequencyCutoff(3)
    f.load_state(raw)
    assert (f.estimate(keys[:100]) == 2).all() and (f.estimate(keys[100:200]) >= 1).all()
    assert f.admit(keys[:100], np.ones(100)).all()
    assert not f.admit(keys[250:300], np.ones(50)).any()
    again = FrequencyCutoff(3)
    again.load_state(f.state())  # and saves in the layered format
    assert (again.estimate(keys[100:200]) == f.estimate(keys[100:200])).all()
    with pytest.raises(InvalidInputError):
        FrequencyCutoff(3).load_state(raw[:-1])


def test_frequency_sketch_state_with_a_hostile_header_is_refused():
    """Layer widths that do not match the bytes that follow are refused before any table
    is allocated (a width of 2**40 must not ask for a terabyte)."""
    f = FrequencyCutoff(2)
    f.admit(np.arange(5000), np.ones(5000))
    raw = f.state()
    head = np.frombuffer(raw[:16], dtype="<i8")
    n = int(head[1])
    for widths in ([1 << 40] * n, [1 << 12] * n, [3] * n):
        bad = head.tobytes() + np.array(widths, dtype="<i8").tobytes() + raw[16 + 8 * n:]
        with pytest.raises(InvalidInputError):
            FrequencyCutoff(2).load_state(bad)
    with pytest.raises(InvalidInputError):
        FrequencyCutoff(2).load_state(raw + b"\0")
    ok = FrequencyCutoff(2)
    ok.load_state(raw)
    assert (ok.estimate(np.arange(5000)) >= 1).all()
