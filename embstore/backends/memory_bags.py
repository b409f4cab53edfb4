"""memory:// bags by arena slot: the fused bag path's pooling and one-pass step
(:class:`~embstore.backends.capabilities.FusedBagPooling`) at slots, for
:class:`~embstore.backends.memory.MemoryBackend` (its ``lookup_pool`` / ``step_bags``) and for
a cache layer whose rows are a ``memory://`` arena (``pool_slots`` / ``step_slots`` at the slots
it holds)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .._cython import fused
from ..errors import CapacityError
from .memory_rows import RowKernels

__all__ = ["BagKernels"]

_EMPTY = np.uint32(0xFFFFFFFF)


class BagKernels:
    """The compiled bag calls over the records of an arena, for the layout of ``rows`` (the
    table's :class:`~embstore.backends.memory_rows.RowKernels`, whose step plans they share).

    Every call takes the arena, as ``RowKernels`` does, so a table swapped in by a restore
    needs no new object.
    """

    def __init__(self, rows: RowKernels) -> None:
        self.rows = rows
        self._vector: tuple[int, int] | None = None  # (rows' layout is bound for good)
        # The table-parallel path of a collection (fused.probe_pool), under the store's lock:
        # the distinct keys of a batch it pooled already, with their slots.
        self.ahead: tuple[np.ndarray, np.ndarray | None, int] | None = None
        self.kept: np.ndarray | None = None
        # The rows of keys an admission policy turned away in the last ``lookup_pool``: ``(its
        # slots, EMPTY for them; the slots pooled and stepped; arena; theirs)`` (:meth:`found`)
        self.scratch: tuple[np.ndarray | None, np.ndarray | None, Any, np.ndarray] | None = None

    def vector_field(self) -> tuple[int, int]:
        """``(offset, kind)`` of the vector field (``fused.KINDS``), as :meth:`pool` reads it."""
        if self._vector is None:
            layout = self.rows.layout
            self._vector = (layout.fields["vector"][1], fused.KINDS[layout.value_dtype])
        return self._vector

    def pooled_ahead(self, keys: np.ndarray | None, slots: np.ndarray | None = None,
                     absent: int = 0) -> None:
        """The next ``lookup_pool`` of exactly ``keys`` (the same array) finds them at
        ``slots`` (:func:`~embstore._cython.fused.probe_pool`), its bags pooled already, or,
        with ``absent`` keys (``EMPTY`` slots), only those keys left to place and then every
        bag to pool."""
        self.ahead = None if keys is None else (keys, slots, absent)

    def take_ahead(self, keys: np.ndarray) -> tuple[np.ndarray, Any]:
        """``(slots, which keys to place)`` for ``lookup_pool`` of ``keys``: the slots
        :meth:`pooled_ahead` left for them and None (nothing to place or pool) or a mask of
        the absent keys; for other keys, an empty slot array and every key. Once."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[0] is not keys or ahead[1] is None:
            self.kept = None
            return np.empty(len(keys), dtype=np.uint32), slice(None)
        self.kept = keys
        return ahead[1], (ahead[1] == _EMPTY if ahead[2] else None)

    def snapshot(self, keys: np.ndarray) -> np.ndarray:
        """A copy of ``keys`` to recognise them at the step, or the keys themselves where
        :meth:`pooled_ahead` gave them (a batch of the collection's own, never changed)."""
        return keys if keys is self.kept else keys.copy()

    def placer(self, place: Callable[..., tuple[np.ndarray, int]],
               probe: Callable[[np.ndarray], np.ndarray], arena: Any,
               admit: Callable[[np.ndarray], np.ndarray] | None
               ) -> Callable[..., tuple[np.ndarray, int]]:
        """``lookup_pool``'s placing of new keys, ``(keys, initial, template) -> (slots,
        placed)``: ``place`` (the table's ``_place_new``) of every absent key, or with ``admit``
        (the policy, asked with the rows of ``keys`` that ``probe`` finds absent), of those
        it lets in; the others get :meth:`scratch_rows` (:meth:`found` tells them apart)."""
        if admit is None:
            return lambda keys, initial, template: place(keys, initial, template,
                                                         np.empty(len(keys), np.uint8))
        self.drop_scratch(arena)  # (the last batch's)
        return functools.partial(self._admitted, place, probe, arena, admit)

    def _admitted(self, place: Callable[..., tuple[np.ndarray, int]],
                  probe: Callable[[np.ndarray], np.ndarray], arena: Any,
                  admit: Callable[[np.ndarray], np.ndarray], keys: np.ndarray,
                  initial: Callable[[np.ndarray], np.ndarray],
                  template: Callable[[], np.ndarray]) -> tuple[np.ndarray, int]:
        slots = probe(keys)
        rows = np.flatnonzero(slots == _EMPTY)
        if not len(rows):
            return slots, 0
        ok = np.asarray(admit(rows), dtype=bool)
        made: list[np.ndarray] = []

        def once() -> np.ndarray:  # one template (one version stamp) for the batch
            if not made:
                made.append(template())
            return made[0]

        n_new, placed, rejected = 0, rows[ok], rows[~ok]
        if len(placed):
            slots[placed], n_new = place(keys[placed], initial, once,
                                         np.empty(len(placed), np.uint8))
        if len(rejected):
            slots[rejected] = self.scratch_rows(arena, once(), initial(keys[rejected]))
        return slots, n_new

    def scratch_rows(self, arena: Any, template: np.ndarray, vectors: np.ndarray) -> np.ndarray:
        """Slots of new records, ``template`` with ``vectors``, for keys an admission policy
        turned away: arena slots no key of the table points to, so the pooling reads their
        initial vectors and the step's writes to them go nowhere. They are the batch's until
        :meth:`drop_scratch` (the step frees them)."""
        scratch = np.empty(len(vectors), dtype=np.uint32)
        try:
            arena.alloc(scratch)
        except MemoryError as e:
            raise CapacityError(f"memory:// store: no room for {len(scratch)} rows ({e})") from e
        self.rows.write_new(arena, scratch, template, vectors)
        self.scratch = (None, None, arena, scratch)
        return scratch

    def found(self, slots: np.ndarray) -> np.ndarray:
        """The slots ``lookup_pool`` remembers for its step: ``slots`` with the scratch rows of
        the batch it just placed as ``EMPTY`` (absent, as the table holds them; the step
        recognises the array, :meth:`step`)."""
        s = self.scratch
        if s is None or s[0] is not None:
            return slots
        held = slots.copy()
        held[np.isin(slots, s[3])] = _EMPTY
        self.scratch = (held, slots, s[2], s[3])
        return held

    def drop_scratch(self, arena: Any) -> None:
        """Free the scratch rows (into ``arena`` if they came from it: a table cleared or
        swapped in by a restore has none of them)."""
        s, self.scratch = self.scratch, None
        if s is not None and s[2] is arena:
            arena.release(s[3])

    def defer(self, arena: Any, last: tuple[Any, np.ndarray, int] | None, epoch: int,
              batch: Any, update: Any, grad: np.ndarray, threads: int, rounding: int | None,
              sums: np.ndarray, steps: list[Any]) -> bool | None:
        """:meth:`step` of a collection's table-parallel step: the kernel's arguments at the
        slots the forward kept for ``batch``'s own keys (``last``, the table's
        ``(keys, slots, epoch)``), with its gradient ``sums`` (all finite), appended to
        ``steps`` for one :func:`~embstore._cython.fused.step_tables` call; True. None,
        nothing done, where those slots are gone (a key placed or removed since: ``epoch``
        moved) or the kernels do not cover the layout or rule."""
        if last is None or last[0] is not batch.uniq or last[2] != epoch:
            return None
        args = self.rows.step_args(arena, last[1], update, batch.inv, batch.offsets,
                                   batch.weights, batch.mean, grad, threads, rounding)
        if args is None:
            return None
        steps.append((sums, args))
        return True

    def pool(self, arena: Any, slots: np.ndarray, inv: np.ndarray, offsets: np.ndarray,
             weights: np.ndarray, mean: bool, out: np.ndarray, threads: int = 1, *,
             argmax: np.ndarray | None = None) -> None:
        """Row ``b`` of ``out`` pools the vectors at ``slots[inv[e]]`` for the elements ``e``
        of bag ``b`` (``FusedBagPooling.lookup_pool``'s pooling, max pooling with
        ``argmax``); every slot is occupied."""
        layout = self.rows.layout
        fused.pool(arena, slots, inv, offsets, weights, layout.fields["vector"][1], mean, out,
                   threads, fused.KINDS[layout.value_dtype], argmax)

    def step(self, arena: Any, slots: np.ndarray, update: Any, inv: np.ndarray,
             offsets: np.ndarray, weights: np.ndarray, mean: bool, grad: np.ndarray,
             threads: int = 1, rounding: int | None = None, *,
             argmax: np.ndarray | None = None, dropped: np.ndarray | None = None,
             kept: bool = False) -> bool | None:
        """``FusedBagPooling.step_bags`` at ``slots``: None where a slot is empty (a key lost
        its record) or the kernels do not cover the layout or rule; False (nothing written)
        where a summed gradient is not finite. The slots of a batch with
        :meth:`scratch_rows` step those rows (and free them), ``dropped[0]`` set to how many.
        ``kept``: the slots are those ``lookup_pool`` kept for the batch's own keys
        (occupied, but for the scratch rows taken first)."""
        scratch = self.scratch
        if scratch is not None and scratch[0] is slots and scratch[1] is not None:
            try:  # ``lookup_pool``'s with ids turned away: their rows, freed after the step
                done = self.step(arena, scratch[1], update, inv, offsets, weights, mean, grad,
                                 threads, rounding, argmax=argmax)
            finally:
                self.drop_scratch(arena)
            if done and dropped is not None:
                dropped[0] = len(scratch[3])
            return done
        if not kept and len(slots) and (slots == _EMPTY).any():
            return None
        return self.rows.step_bags(arena, slots, update, inv, offsets, weights, mean, grad,
                                   threads, rounding, argmax)
