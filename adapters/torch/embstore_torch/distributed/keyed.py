"""The keyed collectives of the distributed store: each key goes to its owner.

``lookup``, ``contains``, ``prefetch`` and ``delete`` send every distinct key to its owning
rank, which answers one row per key (:meth:`KeyedOps._ask_owners`: sizes first, then keys,
then the answers); ``update`` and ``assign`` send keys with their gradient or value rows in one
exchange. Every received header is checked against ``items x`` the op's row size before the
payload moves, and every received key against its owner (:mod:`.wire`), so a bad peer is a
:class:`~embstore_torch.distributed.comm.RankFailureError` naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from embstore.engine.batch import check_counts, check_rows, coalesce, sum_counts, unique_last

from .comm import CollectiveError, rows_of
from .wire import (
    dedupe,
    key_bytes,
    pack_keys,
    route,
    split_rows,
    unpack_keys,
    unpack_update,
)

__all__ = ["KeyedOps"]


class KeyedOps:
    """Lookup, update and the other keyed collectives of
    :class:`~embstore_torch.distributed.DistributedStore`."""

    comm: Any
    local: Any
    rank: int
    world_size: int
    dim: int
    key_type: str
    step: int
    average: bool
    read_only: bool
    _live: Any

    def _keys(self, keys: Any) -> np.ndarray:
        return self._live().normalize_keys(keys)

    def _key_fits(self, extra: int = 0) -> Any:
        """Header bounds of a payload of keys, each with ``extra`` bytes of rows."""
        lo, hi = key_bytes(self.key_type)
        return rows_of(lo + extra, hi + extra)

    def _ask_owners(self, op: str, keys: np.ndarray, flag: int, answer: Any,
                    row_dtype: np.dtype, row_shape: tuple[int, ...],
                    check: Any = None) -> np.ndarray:
        """Send distinct ``keys`` to their owners; return one answer row per key.

        ``answer(keys_by_source, flags)`` runs on the owner and returns the rows for each
        source's keys (arrays of ``row_dtype`` / ``row_shape``). ``check(rows, owner)``, if
        given, vets the rows another rank answered (raising ``RankFailureError``).
        """
        w, me = self.world_size, self.rank
        order, bounds = route(keys, w)
        counts = np.diff(bounds)
        # This rank's own keys never go through the exchange (no pack, copy or unpack).
        mine = order[bounds[me]:bounds[me + 1]]
        parts = [pack_keys(keys[order[bounds[d]:bounds[d + 1]]]) if d != me
                 else np.zeros(0, np.uint8) for d in range(w)]
        items_in, nbytes_in, flags = self.comm.begin(op, counts, [len(p) for p in parts],
                                                     flag, fits=self._key_fits())
        got = self.comm.exchange(parts, nbytes_in, op)
        row_bytes = int(np.dtype(row_dtype).itemsize * np.prod(row_shape, dtype=np.int64))
        try:
            # keys from another rank are checked (sizes, ownership) like any input
            asked = [unpack_keys(got[s], int(items_in[s]), self.key_type, exact=True,
                                 owner=(me, w), source=s)[0] if s != me
                     else keys[mine] for s in range(w)]
            rows = answer(asked, flags)
        except Exception as e:
            if w > 1:
                # Unblock the askers (zero rows, never used: their next collective raises)
                # and tell them this rank failed, instead of leaving them to time out.
                filler = [np.zeros(int(items_in[s]) * row_bytes, np.uint8) if s != me
                          else np.zeros(0, np.uint8) for s in range(w)]
                sizes = counts * row_bytes
                sizes[me] = 0
                try:
                    self.comm.exchange(filler, sizes, op)
                except CollectiveError:
                    pass  # an asker gone too (e.g. the one that sent garbage): e says why
            self.comm.abort(f"rank {me}'s {op} failed: {e}")
            raise
        if w == 1:  # a world of one: the local answer is the result
            return rows[0]
        sizes = counts * row_bytes
        sizes[me] = 0
        back = self.comm.exchange([r if s != me else r[:0] for s, r in enumerate(rows)],
                                  sizes, op)
        out = np.empty((len(keys), *row_shape), dtype=row_dtype)
        for d in np.flatnonzero(counts).tolist():
            got_rows = rows[me] if d == me else split_rows(
                back[d], np.dtype(row_dtype), row_shape, rows=int(counts[d]), source=d)
            if check is not None and d != me:
                with self.comm.aborting():  # the last exchange: the others stop at their next
                    check(got_rows, d)
            out[order[bounds[d]:bounds[d + 1]]] = got_rows
        return out

    # -- the training interface --------------------------------------------------------------------
    def lookup(self, keys: Any, *, insert: bool = True) -> np.ndarray:
        """Collective: vectors of ``keys`` (``(n, dim)`` float32, request order), read from
        (and, with ``insert``, created on) their owners."""
        k = self._keys(keys)
        uniq, inv = dedupe(k)
        vec = self._ask_owners("lookup", uniq, int(insert), self._answer_lookup, np.float32,
                               (self.dim,))
        return vec if inv is None else np.take(vec, inv, axis=0)

    def _answer_lookup(self, asked: list[np.ndarray], flags: np.ndarray) -> list[np.ndarray]:
        out = [np.empty((len(a), self.dim), np.float32) for a in asked]
        for ins in (True, False):  # ranks in training (insert) and in eval mode
            srcs = [s for s in range(len(asked)) if bool(flags[s]) == ins and len(asked[s])]
            if not srcs:
                continue
            allk = np.concatenate([asked[s] for s in srcs])
            uniq, inv = dedupe(allk)
            vec = self.local.lookup(uniq, insert=ins and not self.read_only)
            if inv is not None:
                vec = np.take(vec, inv, axis=0)
            start = 0
            for s in srcs:
                out[s] = vec[start:start + len(asked[s])]
                start += len(asked[s])
        return out

    def prefetch(self, keys: Any) -> None:
        """Collective: the owners start loading the rows of ``keys`` in the background (a
        cache layer's prefetch; other backends ignore it). Call it with the next batch."""
        uniq, _ = dedupe(self._keys(keys))
        w = self.world_size
        order, bounds = route(uniq, w)
        parts = [pack_keys(uniq[order[bounds[d]:bounds[d + 1]]]) for d in range(w)]
        items_in, nbytes_in, _ = self.comm.begin("prefetch", np.diff(bounds),
                                                 [len(p) for p in parts], fits=self._key_fits())
        got = self.comm.exchange(parts, nbytes_in, "prefetch")
        with self.comm.aborting():
            asked = [unpack_keys(got[s], int(items_in[s]), self.key_type, exact=True,
                                 owner=(self.rank, w), source=s)[0] for s in range(w)]
        mine = np.concatenate(asked)  # a copy: a background prefetch keeps its keys
        if len(mine):
            self.local.prefetch(dedupe(mine)[0])

    def contains(self, keys: Any) -> np.ndarray:
        """Collective: which keys have a stored record on their owner."""
        k = self._keys(keys)
        uniq, inv = dedupe(k)
        found = self._ask_owners(
            "contains", uniq, 0,
            lambda asked, _: [self.local.contains(a) if len(a) else np.zeros(0, bool)
                              for a in asked], np.bool_, ())
        return found if inv is None else found[inv]

    def update(self, keys: Any, grads: Any, *, counts: Any = None) -> None:
        """Collective: one global optimizer step.

        Every rank's gradient rows of a key are summed on its owner (divided by the world
        size when ``average``) and the store's optimizer is applied once per key; ``count``
        grows by the occurrences (or ``counts``) summed over ranks. A rank with no keys still
        calls (with empty arrays).
        """
        self._live().check_writable()
        k = self._keys(keys)
        g = check_rows(grads, len(k), self.dim, "gradients")
        c = (np.ones(len(k), np.int64) if counts is None else check_counts(counts, len(k)))
        uniq, summed, _ = coalesce(k, g) if len(k) else (k, g, c)
        mult = sum_counts(k, uniq, c) if len(k) else c
        w = self.world_size
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
        me = self.rank
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
                                                 fits=self._key_fits(8 + 4 * self.dim))
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
        self.local.step = self.step
        if ks:
            # keys are copied out of the reused receive buffer (a store may keep them);
            # gradient rows and counts are only read by the update
            allk = np.concatenate(ks)
            u, total, _ = coalesce(allk, gs[0] if len(gs) == 1 else np.concatenate(gs))
            cnt = sum_counts(allk, u, cs[0] if len(cs) == 1 else np.concatenate(cs))
            if self.average and w > 1:
                total = total / np.float32(w)
            try:
                self.local.update(u, total, counts=cnt)
            except Exception as e:
                # The other ranks believe the step applied: make their next collective fail.
                self.comm.abort(f"rank {me}'s update failed: {e}")
                raise
        self.step += 1
        self.local.step = self.step  # shards without keys this step keep the global step too


    # -- keyed writes ---------------------------------------------------------------------------
    def assign(self, keys: Any, values: Any) -> None:
        """Collective: set vectors directly on the keys' owners (the last value of a key
        repeated in one rank's batch wins; keys sent by several ranks: the highest rank's)."""
        self._live().check_writable()
        k = self._keys(keys)
        v = check_rows(values, len(k), self.dim, "values")
        if len(k):
            k, last = unique_last(k)
            v = v[last]
        w, me = self.world_size, self.rank
        order, bounds = route(k, w)
        parts = [(pack_keys(k[order[bounds[d]:bounds[d + 1]]]),
                  np.ascontiguousarray(v[order[bounds[d]:bounds[d + 1]]])) for d in range(w)]
        items_in, nbytes_in, _ = self.comm.begin("assign", np.diff(bounds),
                                                 [sum(a.nbytes for a in p) for p in parts],
                                                 fits=self._key_fits(4 * self.dim))
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
                self.local.assign(np.concatenate(ks), np.concatenate(vs))
            except Exception as e:
                self.comm.abort(f"rank {me}'s assign failed: {e}")
                raise

    def delete(self, keys: Any) -> int:
        """Collective: delete keys on their owners; returns how many of this rank's keys
        were present."""
        self._live().check_writable()

        def answer(asked: list[np.ndarray], _: Any) -> list[np.ndarray]:
            found = [self.local.contains(a) if len(a) else np.zeros(0, bool) for a in asked]
            gone = [a[f] for a, f in zip(asked, found) if f.any()]
            if gone:
                self.local.delete(np.concatenate(gone))
            return found

        uniq, _ = dedupe(self._keys(keys))
        return int(self._ask_owners("delete", uniq, 0, answer, np.bool_, ()).sum())

