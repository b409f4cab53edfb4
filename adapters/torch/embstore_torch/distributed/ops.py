"""The whole-store collectives of the distributed store that ask every shard: top_k and
sample.

As in the DynamicEmbedding paper, the owners do the work on their own keys and the asking rank
merges: ``top_k`` scores every rank's queries on every shard and merges the ``world x k``
candidates per query; ``sample`` splits the draws over the shards by their share of the
sampling weight, the owners draw, and the asking rank merges (and deduplicates, for unique
sampling). What a rank may ask of another shard is bounded: ``k < MAX_TOP_K`` and fewer than
``MAX_DRAWS`` draws per shard per sampling round (a larger sample takes more rounds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from embstore.errors import InvalidInputError
from embstore.retrieval import TopKResult, check_queries
from embstore.sampling.candidate import (
    check_num_sampled,
    expected_count,
    group_positives,
    merge_candidates,
    sampling_index,
)
from embstore.sampling.index import SamplingIndex, Snapshot
from embstore.sampling.samplers import resolve_sampler
from embstore.store import EmbeddingStore

from .collectives import Collectives
from .comm import MAX_PAYLOAD, Fits, rows_of
from .wire import (
    MAX_DRAWS,
    MAX_TOP_K,
    check_weights,
    expect_count,
    key_bytes,
    pack_candidates,
    pack_draws,
    pack_queries,
    pack_shard_weight,
    unpack_candidates,
    unpack_draws,
    unpack_queries,
    unpack_shard_weight,
)

__all__ = ["QueryOps"]


class QueryOps:
    """``top_k`` and ``sample`` of :class:`~embstore_torch.distributed.DistributedStore`.

    Parameters
    ----------
    collectives : Collectives
        The comm, this rank's store and the routing of keys to their owners.
    dim : int
    """

    def __init__(self, collectives: Collectives, dim: int) -> None:
        self.collectives = collectives
        self.comm = collectives.comm
        self.dim = dim
        self.key_type = collectives.key_type

    # -- top_k -------------------------------------------------------------------------------
    def top_k(self, queries: Any, k: int, exclude: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`~embstore_torch.distributed.DistributedStore.top_k` on this rank."""
        c = self.collectives
        st = c.live()
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
            raise InvalidInputError(f"k must be a positive int, got {k!r}")
        if k >= MAX_TOP_K:
            raise InvalidInputError(f"distributed top_k takes k below MAX_TOP_K={MAX_TOP_K} "
                                    f"(what one rank may ask of every shard), got {k}")
        if isinstance(exclude, (list, tuple)) and exclude and isinstance(
                exclude[0], (list, tuple, np.ndarray)):
            raise InvalidInputError("distributed top_k takes one exclude key array for all "
                                    "queries, not one per query")
        q = check_queries(st, queries)
        ex = st.normalize_keys([] if exclude is None else exclude)
        c.sync_shared()
        # every rank's queries, k and exclusions, to every shard
        # (the header: the number of queries and of exclusions, so its size is checked)
        blobs, _, _ = self.comm.allgather("top_k", pack_queries(q, int(k), ex), len(q),
                                          len(ex), fits=_query_fits(self.dim, self.key_type))
        key_dtype = np.int64 if self.key_type == "int64" else object
        parts, widths, asked = [], [], []
        try:
            rows = len(st) if c.answers else 0
            for s, b in enumerate(blobs):  # this shard's candidates for each rank's queries
                qs, ks, exs = unpack_queries(b, self.dim, self.key_type, source=s)
                asked.append((len(qs), ks))
                if len(qs) and rows:
                    # never wider than the shard: a k above its rows allocates for nothing
                    res = st.top_k(qs, min(ks, rows), exs if len(exs) else None)
                    kk, ss = res
                    vv = np.asarray(getattr(res, "valid", np.ones(kk.shape, bool)))
                else:
                    kk = np.zeros((len(qs), 0), key_dtype)
                    ss, vv = np.zeros((len(qs), 0), np.float32), np.zeros((len(qs), 0), bool)
                widths.append(kk.shape[1])
                parts.append(pack_candidates(kk, ss, vv))
        except Exception as e:
            # a bad query buffer (or this shard's own failure): the others, waiting for the
            # candidates, get an abort header instead of the timeout
            self.comm.abort(f"rank {c.rank}'s top_k failed: {e}")
            raise
        # a shard answers at most k candidates per query, each key + score + flag
        lo, hi = key_bytes(self.key_type)
        nq_to, k_to = (np.array(v, np.int64) for v in zip(*asked))
        cols, nbytes, _ = self.comm.begin(
            "top_k", widths, [sum(a.nbytes for a in p) for p in parts],
            fits=rows_of(len(q) * (lo + 5), len(q) * (hi + 5), max_items=int(k) + 1),
            fits_out=rows_of(nq_to * (lo + 5), nq_to * (hi + 5), max_items=k_to + 1))
        got = self.comm.exchange(parts, nbytes, "top_k")
        owner = (lambda s: (s, c.world)) if c.sharded else (lambda s: None)
        with self.comm.aborting():  # the last exchange: the others stop at their next call
            cands = [unpack_candidates(got[s], len(q), int(cols[s]), int(k), self.key_type,
                                       owner=owner(s), source=s)
                     for s in range(c.world)]
        ck, cs, cv = (np.concatenate([c[i] for c in cands], axis=1) for i in range(3))
        width = min(int(k), ck.shape[1])
        # As one store orders them: real items first, score descending (NaN after every
        # number), ties by key ascending.
        if ck.dtype == object:
            order = np.lexsort((-cs, ~cv), axis=1)
        else:
            order = np.lexsort((ck, -cs, ~cv), axis=1)
        order = order[:, :width]
        return TopKResult(np.take_along_axis(ck, order, axis=1),
                          np.take_along_axis(cs, order, axis=1),
                          np.take_along_axis(cv, order, axis=1))

    # -- sample ------------------------------------------------------------------------------
    def sample(self, positive_keys: Any, num_sampled: int, sampler: Any = None, *,
               offsets: Any = None, remove_accidental_hits: bool = True, unique: bool = True,
               seed: Any = None) -> Any:
        """:meth:`~embstore_torch.distributed.DistributedStore.sample` on this rank."""
        c = self.collectives
        st = c.live()
        if not c.sharded:
            raise InvalidInputError(
                "distributed sample needs a store per rank ({rank} in the URL): over one "
                "shared store a rank's sampling index does not see the other ranks' writes"
            )
        sampler = resolve_sampler(sampler)
        m = check_num_sampled(num_sampled)
        batch, positives = group_positives(st, positive_keys, offsets)
        flat_pos = (np.concatenate(positives) if len(positives) > 1
                    else positives[0] if positives else st.normalize_keys([]))
        idx = sampling_index(st)
        snap = idx.snapshot(sampler)
        blobs, _, _ = self.comm.allgather(
            "sample", pack_shard_weight(snap.total, snap.support - snap.dead_support),
            fits=rows_of(0, 0, base=16))
        with self.comm.aborting():  # every rank saw the same blobs: all abort together
            shards = [unpack_shard_weight(b, source=s) for s, b in enumerate(blobs)]
        shard_w = np.array([t for t, _ in shards], np.float64)
        support = sum(n for _, n in shards)
        total = float(shard_w.sum())
        rng = (seed if isinstance(seed, np.random.Generator)
               else np.random.default_rng(None if seed is None else (int(seed), c.rank)))
        problem = None
        if m and total <= 0:
            problem = "the store has no key with a positive sampling weight"
        elif m and unique and m > support:
            problem = (f"unique sampling of {m} candidates needs at least {m} keys with a "
                       f"positive weight; the store has {support}")
        neg, weights, tries = self._draw_rounds(st, idx, snap, rng, m if not problem else 0,
                                                shard_w, unique)
        neg_prob = expected_count(weights / total if total > 0 else weights, tries, unique)
        uniq_pos, inv = np.unique(flat_pos, return_inverse=True) if len(flat_pos) else (
            flat_pos, np.zeros(0, np.int64))
        pw = c.ask_owners("sample_prob", uniq_pos, 0, lambda asked, _: [
            idx.prob_of(snap, a) * snap.total for a in asked], np.float64, (),
            check=lambda rows, s: check_weights(rows, "a positive key's sampling weight", s))
        if problem:  # raised after the owners' last exchange, which every rank joins
            raise InvalidInputError(problem)
        pos_prob = expected_count((pw / total if total > 0 else pw)[inv.reshape(-1)], tries,
                                  unique)
        results = merge_candidates(positives, pos_prob, neg, neg_prob, tries,
                                   remove_accidental_hits)
        return results if batch else results[0]

    def _draw_rounds(self, st: EmbeddingStore, idx: SamplingIndex, snap: Snapshot,
                     rng: np.random.Generator,
                     m: int, shard_w: np.ndarray, unique: bool
                     ) -> tuple[np.ndarray, np.ndarray, int]:
        """Rounds of draws until this rank has ``m`` (distinct, with ``unique``) candidates;
        every rank takes part in every round (serving the others) until all are done."""
        w = self.collectives.world
        total = float(shard_w.sum())
        keys = st.normalize_keys([])
        wts = np.zeros(0, np.float64)
        need = m if not unique else int(m * 1.03) + 16 if m else 0
        tries, done = 0, m == 0
        lo, hi = key_bytes(self.key_type)
        while True:
            # at most MAX_DRAWS - 1 per shard and round: a larger sample takes more rounds
            req = (rng.multinomial(min(need, MAX_DRAWS - 1), shard_w / total)
                   if not done and total > 0 else np.zeros(w, np.int64))
            asked, _, active = self.comm.begin("sample_round", req, 0, int(not done),
                                               fits=rows_of(0, 0, max_items=MAX_DRAWS))
            if not active.any():
                break
            try:
                answers, drawn = [], []
                for c in asked.tolist():
                    k, _, p = (idx.draw(snap, rng, c) if c
                               else (keys[:0], None, np.zeros(0, np.float64)))
                    answers.append(pack_draws(k, p * snap.total))
                    drawn.append(len(k))
            except Exception as e:  # the askers wait for these draws: tell them at once
                self.comm.abort(f"rank {self.collectives.rank}'s sample failed: {e}")
                raise
            # the header says how many keys were drawn; the asker checks it is what it asked
            n_in, nbytes, _ = self.comm.begin("sample_round", drawn, [len(a) for a in answers],
                                              fits=rows_of(lo + 8, hi + 8))
            got = self.comm.exchange(answers, nbytes, "sample_round")
            if done:
                continue
            ks, ws = [keys], [wts]
            with self.comm.aborting():  # the others stop at their next round or call
                for s in range(w):
                    # each shard draws exactly what was asked of it, from its own keys
                    expect_count(n_in[s], req[s], "sampled keys", s)
                    k, p = unpack_draws(got[s], int(n_in[s]), self.key_type, owner=(s, w),
                                        source=s)
                    ks.append(k)
                    ws.append(p)
            # Draws grouped by shard are not an i.i.d. sequence; a shuffle makes them one.
            perm = len(keys) + rng.permutation(int(req.sum()))
            allk, allw = np.concatenate(ks), np.concatenate(ws)
            allk[len(keys):], allw[len(keys):] = allk[perm], allw[perm]
            keys, wts = allk, allw
            if not unique:
                tries, done = len(keys), len(keys) >= m
                need = m - len(keys)
                continue
            _, first = np.unique(keys, return_index=True)
            if len(first) >= m:
                sel = np.sort(first)[:m]
                tries = int(sel[-1]) + 1
                keys, wts, done = keys[sel], wts[sel], True
                continue
            rate = len(first) / max(len(keys), 1)
            need = int((m - len(first)) / max(rate, 1e-3) * 1.25) + 64
        return keys, wts, tries


def _query_fits(dim: int, key_type: str) -> Fits:
    """Header bounds of the top_k query exchange: items = queries, flag = exclusion keys."""
    lo, hi = key_bytes(key_type)

    def fits(items: np.ndarray, flags: np.ndarray) -> tuple[Any, Any, Any]:
        n, nex = items.astype(np.float64), np.maximum(flags, 0).astype(np.float64)
        base = 24 + n * 4 * dim
        # a negative exclusion count fits no size
        return np.where(flags < 0, MAX_PAYLOAD, base + nex * lo), base + nex * hi, _ANY
    return fits


_ANY = np.iinfo(np.int64).max
