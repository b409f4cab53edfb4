"""The keyed collectives of the distributed store: each key goes to its owner.

``lookup``, ``contains``, ``prefetch`` and ``delete`` send every distinct key to its owning
rank, which answers one row per key (:meth:`.Collectives.ask_owners`: sizes first, then
keys, then the answers); ``update`` and ``assign`` send keys with their gradient or value rows
in one exchange. Every received header is checked against ``items x`` the op's row size before the
payload moves, and every received key against its owner (:mod:`.wire`), so a bad peer is a
:class:`~embstore_torch.distributed.comm.RankFailureError` naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from embstore.engine.batch import check_counts, check_rows, coalesce, sum_counts, unique_last
from embstore.store import EmbeddingStore

from .collectives import Collectives
from .wire import dedupe, pack_keys, route, split_rows, unpack_keys, unpack_update

__all__ = ["KeyedOps"]


class KeyedOps:
    """Lookup, update and the other keyed collectives of
    :class:`~embstore_torch.distributed.DistributedStore`.

    Parameters
    ----------
    collectives : Collectives
        The comm, this rank's store and the global step (an update advances it).
    dim : int
    average : bool
        Divide a key's summed gradient by the world size.
    """

    def __init__(self, collectives: Collectives, dim: int, average: bool) -> None:
        self.collectives = collectives
        self.comm = collectives.comm
        self.dim = dim
        self.key_type = collectives.key_type
        self.average = average

    # -- the training interface --------------------------------------------------------------------
    def lookup(self, keys: Any, *, insert: bool = True) -> np.ndarray:
        """:meth:`~embstore_torch.distributed.DistributedStore.lookup` on this rank."""
        st = self.collectives.live()
        uniq, inv = dedupe(st.normalize_keys(keys))
        vec = self.collectives.ask_owners(
            "lookup", uniq, int(insert),
            lambda asked, flags: self._answer_lookup(st, asked, flags), np.float32, (self.dim,))
        return vec if inv is None else np.take(vec, inv, axis=0)

    def _answer_lookup(self, st: EmbeddingStore, asked: list[np.ndarray],
                       flags: np.ndarray) -> list[np.ndarray]:
        out = [np.empty((len(a), self.dim), np.float32) for a in asked]
        for ins in (True, False):  # ranks in training (insert) and in eval mode
            srcs = [s for s in range(len(asked)) if bool(flags[s]) == ins and len(asked[s])]
            if not srcs:
                continue
            allk = np.concatenate([asked[s] for s in srcs])
            uniq, inv = dedupe(allk)
            vec = st.lookup(uniq, insert=ins and not st.read_only)
            if inv is not None:
                vec = np.take(vec, inv, axis=0)
            start = 0
            for s in srcs:
                out[s] = vec[start:start + len(asked[s])]
                start += len(asked[s])
        return out

    def prefetch(self, keys: Any) -> None:
        """:meth:`~embstore_torch.distributed.DistributedStore.prefetch` on this rank."""
        st = self.collectives.live()
        uniq, _ = dedupe(st.normalize_keys(keys))
        w, me = self.collectives.world, self.collectives.rank
        order, bounds = route(uniq, w)
        parts = [pack_keys(uniq[order[bounds[d]:bounds[d + 1]]]) for d in range(w)]
        items_in, nbytes_in, _ = self.comm.begin("prefetch", np.diff(bounds),
                                                 [len(p) for p in parts],
                                                 fits=self.collectives.key_fits())
        got = self.comm.exchange(parts, nbytes_in, "prefetch")
        with self.comm.aborting():
            asked = [unpack_keys(got[s], int(items_in[s]), self.key_type, exact=True,
                                 owner=(me, w), source=s)[0] for s in range(w)]
        mine = np.concatenate(asked)  # a copy: a background prefetch keeps its keys
        if len(mine):
            st.prefetch(dedupe(mine)[0])

    def contains(self, keys: Any) -> np.ndarray:
        """:meth:`~embstore_torch.distributed.DistributedStore.contains` on this rank."""
        st = self.collectives.live()
        uniq, inv = dedupe(st.normalize_keys(keys))
        found = self.collectives.ask_owners(
            "contains", uniq, 0,
            lambda asked, _: [st.contains(a) if len(a) else np.zeros(0, bool)
                              for a in asked], np.bool_, ())
        return found if inv is None else found[inv]

    def update(self, keys: Any, grads: Any, *, counts: Any = None) -> None:
        """:meth:`~embstore_torch.distributed.DistributedStore.update` on this rank."""
        c = self.collectives
        st = c.live()
        st.check_writable()
        k = st.normalize_keys(keys)
        g = check_rows(grads, len(k), self.dim, "gradients")
        occ = (np.ones(len(k), np.int64) if counts is None else check_counts(counts, len(k)))
        uniq, summed, _ = coalesce(k, g) if len(k) else (k, g, occ)
        mult = sum_counts(k, uniq, occ) if len(k) else occ
        w, me = c.world, c.rank
        order, bounds = route(uniq, w)
        # Gradient rows in destination order, gathered into a reused buffer (fresh memory
        # of this size costs page faults every step); each destination's part is a slice.
        if w == 1:  # nothing to reorder
            rows, keys_by, mult_by = summed, uniq, mult
        else:
            stage = self.comm.scratch("_grads", len(uniq) * self.dim * 4).view(np.float32)
            rows = np.take(summed, order, axis=0, out=stage.reshape(len(uniq), self.dim),
                           mode="clip")
            keys_by, mult_by = uniq[order], mult[order]
        parts, items = [], []
        for d in range(w):
            lo, hi = int(bounds[d]), int(bounds[d + 1])
            # this rank's own part stays here (see below), the rest is packed for its owner
            parts.append((pack_keys(keys_by[lo:hi]), mult_by[lo:hi], rows[lo:hi]) if d != me
                         else ())
            items.append(hi - lo)
        nbytes = [sum(a.nbytes for a in p) for p in parts]
        # each key with its count (int64) and gradient row
        items_in, nbytes_in, _ = self.comm.begin("update", items, nbytes,
                                                 fits=c.key_fits(8 + 4 * self.dim))
        got = self.comm.exchange(parts, nbytes_in, "update")
        ks, cs, gs = [], [], []
        for s in range(w):
            n = int(items_in[s])
            if n == 0:
                continue
            if s == me:
                lo, hi = int(bounds[me]), int(bounds[me + 1])
                ks.append(keys_by[lo:hi])
                cs.append(mult_by[lo:hi])
                gs.append(rows[lo:hi])
                continue
            with self.comm.aborting():  # another rank's keys, counts and gradients: checked
                kk, cc, gg = unpack_update(got[s], n, self.key_type, self.dim, (me, w), s)
            ks.append(kk)
            cs.append(cc)
            gs.append(gg)
        c.set_step(c.step)
        if ks:
            # keys are copied out of the reused receive buffer (a store may keep them);
            # gradient rows and counts are only read by the update
            allk = np.concatenate(ks)
            u, total, _ = coalesce(allk, gs[0] if len(gs) == 1 else np.concatenate(gs))
            cnt = sum_counts(allk, u, cs[0] if len(cs) == 1 else np.concatenate(cs))
            if self.average and w > 1:
                total = total / np.float32(w)
            try:
                st.update(u, total, counts=cnt)
            except Exception as e:
                # The other ranks believe the step applied: make their next collective fail.
                self.comm.abort(f"rank {me}'s update failed: {e}")
                raise
        c.set_step(c.step + 1)  # shards without keys this step keep the global step too

    # -- keyed writes ---------------------------------------------------------------------------
    def assign(self, keys: Any, values: Any) -> None:
        """:meth:`~embstore_torch.distributed.DistributedStore.assign` on this rank."""
        st = self.collectives.live()
        st.check_writable()
        k = st.normalize_keys(keys)
        v = check_rows(values, len(k), self.dim, "values")
        if len(k):
            k, last = unique_last(k)
            v = v[last]
        w, me = self.collectives.world, self.collectives.rank
        order, bounds = route(k, w)
        parts = [(pack_keys(k[order[bounds[d]:bounds[d + 1]]]),
                  np.ascontiguousarray(v[order[bounds[d]:bounds[d + 1]]])) for d in range(w)]
        items_in, nbytes_in, _ = self.comm.begin("assign", np.diff(bounds),
                                                 [sum(a.nbytes for a in p) for p in parts],
                                                 fits=self.collectives.key_fits(4 * self.dim))
        got = self.comm.exchange(parts, nbytes_in, "assign")
        ks, vs = [], []
        with self.comm.aborting():  # nothing assigned; the others stop at their next call
            for s in range(w):  # in rank order: a later rank's value of a shared key wins
                n = int(items_in[s])
                kk, used = unpack_keys(got[s], n, self.key_type, owner=(me, w), source=s)
                vv = split_rows(got[s][used:], np.dtype(np.float32), (self.dim,), rows=n,
                                source=s)
                if n:
                    ks.append(kk)
                    vs.append(vv)
        if ks:
            try:
                st.assign(np.concatenate(ks), np.concatenate(vs))
            except Exception as e:
                self.comm.abort(f"rank {me}'s assign failed: {e}")
                raise

    def delete(self, keys: Any) -> int:
        """:meth:`~embstore_torch.distributed.DistributedStore.delete` on this rank."""
        st = self.collectives.live()
        st.check_writable()

        def answer(asked: list[np.ndarray], _: Any) -> list[np.ndarray]:
            found = [st.contains(a) if len(a) else np.zeros(0, bool) for a in asked]
            gone = [a[f] for a, f in zip(asked, found) if f.any()]
            if gone:
                st.delete(np.concatenate(gone))
            return found

        uniq, _ = dedupe(st.normalize_keys(keys))
        return int(self.collectives.ask_owners("delete", uniq, 0, answer, np.bool_, ()).sum())

