"""``sample`` (candidate sampling for sampled softmax) and ``subsample_mask`` (word2vec's rule).

Both are called through the engine (``store.sample`` / ``store.subsample_mask``) and read only
the store's :class:`~embstore.sampling.index.SamplingIndex`, never the table itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidInputError
from .index import SamplingIndex
from .samplers import FixedCandidatesSampler, SampledResult, resolve_sampler

if TYPE_CHECKING:
    from ..engine.protocols import IndexHost

def sampling_index(store: IndexHost, *, staleness: float | None = None) -> SamplingIndex:
    """The store's sampling index, built with one scan on first use and then kept current
    as one of the store's observers."""
    store.check_open()
    idx = next((o for o in store.observers if isinstance(o, SamplingIndex)), None)
    if idx is None or idx.backend is not store.backend:
        if idx is not None:
            store.remove_observer(idx)
        idx = SamplingIndex(store.backend, store.key_type,
                            **({} if staleness is None else {"staleness": staleness}))
        idx.build()
        store.add_observer(idx)
    else:
        if staleness is not None:
            if not (isinstance(staleness, (int, float)) and 0.0 <= staleness < float("inf")):
                raise InvalidInputError(f"staleness must be a number >= 0, got {staleness!r}")
            idx.staleness = float(staleness)
        if idx.stale:
            idx.build()
    return idx


def _rng(idx_rng: np.random.Generator | None, seed: Any) -> np.random.Generator:
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is None:
        return idx_rng if idx_rng is not None else np.random.default_rng()
    return np.random.default_rng(seed)


def group_positives(store: Any, positive_keys: Any, offsets: Any) -> tuple[bool, list[np.ndarray]]:
    """Normalize positives to per-example key arrays; tell whether a batch was given
    (``offsets`` splits a flat array of keys into examples)."""
    if offsets is not None:
        flat = store.normalize_keys(positive_keys)
        off = np.asarray(offsets)
        if off.ndim != 1 or off.dtype.kind not in "iu" or len(off) < 1:
            raise InvalidInputError("offsets must be a 1-D integer array of row splits")
        off = off.astype(np.int64)
        if off[0] != 0 or off[-1] != len(flat) or (np.diff(off) < 0).any():
            raise InvalidInputError(
                f"offsets must start at 0, be non-decreasing and end at {len(flat)} "
                "(the number of positive keys)"
            )
        return True, np.split(flat, off[1:-1])
    arr = positive_keys.numpy() if hasattr(positive_keys, "numpy") and not isinstance(
        positive_keys, np.ndarray) else positive_keys
    if isinstance(arr, np.ndarray) and arr.ndim == 2:  # TF's true_classes: (batch, num_true)
        return True, [store.normalize_keys(row) for row in arr]
    if isinstance(positive_keys, (list, tuple)) and positive_keys and all(
        isinstance(p, (list, tuple, np.ndarray)) or hasattr(p, "numpy")
        for p in positive_keys
    ):
        return True, [store.normalize_keys(p) for p in positive_keys]
    return False, [store.normalize_keys(positive_keys)]


def expected_count(p: np.ndarray, num_tries: int, unique: bool) -> np.ndarray:
    """Expected number of occurrences of a key of draw probability ``p`` among the samples.

    With ``unique=True`` this is the probability that the key is among the distinct
    candidates after ``num_tries`` draws, ``1 - (1 - p) ** num_tries`` (TF's formula).
    """
    if not unique:
        return p * num_tries
    with np.errstate(divide="ignore"):
        return -np.expm1(num_tries * np.log1p(-p))


def _draw_unique(idx: SamplingIndex, snap: Any, rng: np.random.Generator, m: int,
                 hint: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """Draw until ``m`` distinct keys were seen; return them (in order of first draw), their
    draw probabilities and the number of draws it took."""
    support = snap.support - snap.dead_support
    if m > support:
        raise InvalidInputError(
            f"unique sampling of {m} candidates needs at least {m} keys with a positive "
            f"weight; the store has {support}"
        )
    # Unseeded calls size the first draw by the last call's draws-per-distinct ratio, so one
    # round usually suffices (surplus draws past the m-th distinct key are discarded). Seeded
    # calls start at m so that their result depends on the seed alone.
    first_round = int(m * snap.tries_ratio * 1.03) + 16 if hint else m
    keys, ids, ps = idx.draw(snap, rng, first_round)
    while True:
        _, first = np.unique(ids, return_index=True)
        if len(first) >= m:
            sel = np.sort(first)[:m]
            tries = int(sel[-1]) + 1
            snap.tries_ratio = tries / m
            return keys[sel], ps[sel], tries
        if len(ids) > 1000 * m + 10_000_000:
            raise InvalidInputError(
                f"unique sampling found only {len(first)} distinct keys of {m} in {len(ids)} "
                "draws: the weights are too concentrated; sample fewer or use unique=False"
            )
        # Draw about as many more as the distinct rate so far says are missing.
        rate = len(first) / len(ids)
        more = int((m - len(first)) / max(rate, 1e-3) * 1.25) + 64
        k2, i2, p2 = idx.draw(snap, rng, more)
        keys, ids, ps = (np.concatenate((keys, k2)), np.concatenate((ids, i2)),
                         np.concatenate((ps, p2)))


def check_num_sampled(num_sampled: Any) -> int:
    """``num_sampled`` as an int, or ``InvalidInputError`` (bools and negatives refused)."""
    if isinstance(num_sampled, bool) or not isinstance(num_sampled, (int, np.integer)):
        raise InvalidInputError(f"num_sampled must be an int, got {num_sampled!r}")
    m = int(num_sampled)
    if m < 0:
        raise InvalidInputError(f"num_sampled must be >= 0, got {m}")
    return m


def sample(store: Any, positive_keys: Any, num_sampled: int, sampler: Any = None, *,
           offsets: Any = None, remove_accidental_hits: bool = True, unique: bool = True,
           seed: Any = None) -> SampledResult | list[SampledResult]:
    """Candidate sampling (``store.sample``): positives and ``num_sampled`` sampled
    negatives of ``store``, merged.

    Parameters
    ----------
    positive_keys : array-like, list of array-like, 2-D array, or flat keys with ``offsets``
        One example's positives, or a batch (multi-label): then a list of results.
    num_sampled : int
        Negatives drawn (shared by the examples of a batch, as in TF's sampled softmax).
    sampler : Sampler or str
        ``UniformSampler``, ``LogUniformSampler`` (default), ``UnigramSampler(0.75)``,
        ``FixedCandidatesSampler`` (from :mod:`embstore.sampling`) or their names.
    offsets : array-like of int, optional
        Row splits of a flat ``positive_keys`` (length batch + 1).
    remove_accidental_hits : bool
        Drop sampled negatives equal to one of the example's positives.
    unique : bool
        Draw until ``num_sampled`` distinct keys; ``prob`` is then an inclusion probability.
    seed : int or numpy Generator, optional

    Returns
    -------
    SampledResult or list of SampledResult
        ``keys``, ``is_positive``, ``prob`` (expected count, for the logQ correction).
    """
    store.check_open()
    sampler = resolve_sampler(sampler)
    m = check_num_sampled(num_sampled)
    batch, positives = group_positives(store, positive_keys, offsets)
    flat_pos = (np.concatenate(positives) if len(positives) > 1
                else positives[0] if positives else store.normalize_keys([]))

    if isinstance(sampler, FixedCandidatesSampler):
        cand = store.normalize_keys(sampler.candidates)
        if len(cand) < m:
            raise InvalidInputError(f"FixedCandidatesSampler has {len(cand)} candidates, "
                                    f"{m} requested")
        neg, neg_prob, tries = cand[:m], sampler.expected_counts[:m], m
        pos_prob = np.zeros(len(flat_pos), dtype=np.float64)
        if len(cand) and len(flat_pos):
            order = np.argsort(cand, kind="stable")
            where = np.minimum(np.searchsorted(cand[order], flat_pos), len(cand) - 1)
            hit = cand[order][where] == flat_pos
            pos_prob[hit] = sampler.expected_counts[order][where[hit]]
    else:
        idx = sampling_index(store)
        rng = _rng(idx.rng, seed)
        snap = idx.snapshot(sampler)
        if m == 0:
            neg, p, tries = store.normalize_keys([]), np.zeros(0), 0
        elif unique:
            neg, p, tries = _draw_unique(idx, snap, rng, m, hint=seed is None)
        else:
            neg, _, p = idx.draw(snap, rng, m)
            tries = m
        neg_prob = expected_count(p, tries, unique)
        pos_prob = expected_count(idx.prob_of(snap, flat_pos), tries, unique)

    # the drawn negatives are this call's own array (a fixed sampler's are the sampler's)
    owned = not isinstance(sampler, FixedCandidatesSampler)
    results = merge_candidates(positives, pos_prob, neg, neg_prob, tries,
                               remove_accidental_hits, owned)
    return results if batch else results[0]


def merge_candidates(positives: list[np.ndarray], pos_prob: np.ndarray, neg: np.ndarray,
                     neg_prob: np.ndarray, tries: int, remove_accidental_hits: bool,
                     owned: bool = False) -> list[SampledResult]:
    """One :class:`SampledResult` per row of positives: its positives, then the shared
    negatives (less the row's own positives with ``remove_accidental_hits``), with their
    expected counts (``pos_prob`` holds the positives' of every row, in order). ``owned``:
    ``neg`` is the caller's to give away, so the one result that returns it whole (no
    positives, a single row) takes it as it is, where a copy would write the reference count
    of every drawn key object once more."""
    results = []
    start = 0
    for pos in positives:
        pp = pos_prob[start:start + len(pos)]
        start += len(pos)
        if remove_accidental_hits and len(pos) and len(neg):
            keep = ~np.isin(neg, pos)
            nk, npb = neg[keep], neg_prob[keep]
        else:
            nk, npb = neg, neg_prob
        if len(pos):
            keys = np.concatenate((pos, nk))
        else:
            keys = nk if owned and len(positives) == 1 and nk is neg else nk.copy()
        is_pos = np.zeros(len(keys), dtype=bool)
        is_pos[:len(pos)] = True
        results.append(SampledResult(keys=keys, is_positive=is_pos,
                                     prob=np.concatenate((pp, npb)).astype(np.float64,
                                                                           copy=False),
                                     num_tries=tries))
    return results


def keep_probability(store: Any, keys: Any, t: float = 1e-3) -> np.ndarray:
    """word2vec's probability of keeping each occurrence of ``keys``: with ``f`` a key's share
    of all counted sightings, ``min(1, (sqrt(f / t) + 1) * t / f)``; 1 for keys never counted."""
    if not (isinstance(t, (int, float, np.floating)) and np.isfinite(t) and t > 0):
        raise InvalidInputError(f"t must be a positive number, got {t!r}")
    k = store.normalize_keys(keys)
    idx = sampling_index(store)
    counts = idx.counts_of(k).astype(np.float64)
    out = np.ones(len(k), dtype=np.float64)
    if idx.total_count <= 0:
        return out
    f = counts / float(idx.total_count)
    seen = counts > 0
    fs = f[seen]
    out[seen] = np.minimum(1.0, (np.sqrt(fs / t) + 1.0) * t / fs)
    return out


def subsample_mask(store: Any, keys: Any, t: float = 1e-3, seed: Any = None) -> np.ndarray:
    """A bool mask keeping each occurrence with :func:`keep_probability` (as TF's
    ``skip_gram_sample`` with ``vocab_subsampling=t``); frequent keys are dropped most."""
    p = keep_probability(store, keys, t)
    idx = sampling_index(store)
    return _rng(idx.rng, seed).random(len(p)) < p
