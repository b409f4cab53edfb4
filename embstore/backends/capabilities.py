"""The methods behind three capability flags of ``Backend``, declared as protocols.

A backend with ``supports_slots`` is :class:`SlotAddressed`; one with
``supports_fused_bags`` is :class:`FusedBagPooling` (``memory://`` is both, and
:class:`SlotBagPooling`: the fused bag calls at slots, which a cache layer over it makes);
one with ``checks_bytes_keys`` is :class:`PlainOnlyProbes` (``memory://``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from .rows import RowUpdate


@runtime_checkable
class SlotAddressed(Protocol):
    """A backend whose records sit at stable integer slots (``supports_slots``).

    A slot stays valid until its key is deleted; ``0xFFFFFFFF`` marks an absent key. The
    cache layer keeps its eviction bookkeeping per slot (``embstore.layers.cache``).
    """

    supports_slots: bool

    def find_slots(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key (uint32), ``0xFFFFFFFF`` where absent."""
        ...

    def read_slots(self, slots: np.ndarray, field: str | None = None) -> np.ndarray:
        """Records (or one field) stored at ``slots``; zero rows for empty slots."""
        ...

    def write_slots(self, slots: np.ndarray, records: np.ndarray) -> None:
        """Overwrite the records at occupied ``slots`` (their keys do not change)."""
        ...

    def update_slots(self, slots: np.ndarray, update: RowUpdate) -> None:
        """Apply ``update`` (one row per slot) to the records at occupied ``slots``."""
        ...


class FusedBagPooling(Protocol):
    """A backend that pools bags of stored vectors in one pass (``supports_fused_bags``):
    the engine's fused bag path (:mod:`embstore.engine.fused`), for sum, mean and max
    pooling (its two calls' ``argmax=``).

    One whose class sets ``supports_fused_admission`` (``memory://``) also takes
    ``lookup_pool(..., admit=)``: a callable asked with the rows of ``keys`` absent from the
    table, answering which may be placed (the store's admission policy); the others are not
    placed but pool their ``initial`` vectors. Its ``step_bags(..., dropped=)`` (an int64
    array of one) then receives how many keys' gradients it dropped: those turned away at the
    pooling, where it stepped at the slots that pooling left."""

    supports_fused_bags: bool

    def lookup_pool(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                    template: Callable[[], np.ndarray], inv: np.ndarray, offsets: np.ndarray,
                    weights: np.ndarray, mean: bool, out: np.ndarray, threads: int = 1, *,
                    argmax: np.ndarray | None = None) -> int:
        """``Backend.lookup_insert`` of distinct ``keys`` with the vectors pooled into bags
        instead of returned: row ``b`` of ``out`` sums (``mean``: averages) the vectors of
        ``keys[inv[e]]`` for ``e`` in ``offsets[b]:offsets[b+1]``, each times ``weights[e]``
        where ``weights`` is not empty. ``out`` may be a column block of a wider array; the
        bags may be split over ``threads`` native threads. Returns how many keys were
        inserted. Only called when ``supports_fused_bags``. With ``argmax`` (int32
        ``(n_bags, dim)``) row ``b`` of ``out`` is instead the bag's maximum per column, as
        torch's CPU ``embedding_bag(mode="max")`` takes it (``weights`` and ``mean`` unused),
        and ``argmax[b, k]`` receives the row of ``keys`` that gave ``out[b, k]`` (-1 in an
        empty bag, whose values are zeros)."""
        ...

    def step_bags(self, keys: np.ndarray, update: RowUpdate, inv: np.ndarray,
                  offsets: np.ndarray, weights: np.ndarray, mean: bool, grad: np.ndarray,
                  threads: int = 1, rounding: int | None = None, *,
                  argmax: np.ndarray | None = None) -> bool | None:
        """The backward of :meth:`lookup_pool` in one pass: each distinct key's gradient
        summed from the pooled ``grad`` (``(n_bags, dim)``) as ``BagBatch.grad_sums`` sums
        it, then ``update`` (a ``RowUpdate`` whose rows are those sums: counts, stamps and
        an axpy or Adagrad rule) applied to the records in place. Returns True when applied,
        False when a sum is not finite (nothing written), None when this backend cannot
        (a key lost its record, or the layout or rule is not covered): then the caller
        takes the general path. 16-bit fields round back to nearest, or stochastically
        from the 64-bit seed ``rounding``. ``argmax``: the bags were max-pooled, the
        pooling's ``argmax`` (each value's gradient goes to the key that gave it)."""
        ...


@runtime_checkable
class SlotBagPooling(Protocol):
    """A slot-addressed backend that runs :class:`FusedBagPooling`'s two calls on the records
    at given slots (``memory://``): the cache layer keeps the fused bag path through the rows
    it holds there (``embstore.layers.cache``). Every slot must be occupied."""

    supports_fused_bags: bool

    def pool_slots(self, slots: np.ndarray, inv: np.ndarray, offsets: np.ndarray,
                   weights: np.ndarray, mean: bool, out: np.ndarray, threads: int = 1, *,
                   argmax: np.ndarray | None = None) -> None:
        """``FusedBagPooling.lookup_pool``'s pooling (max pooling with ``argmax``), of the
        vectors at ``slots`` (distinct keys' records, in the order ``inv`` indexes)."""
        ...

    def step_slots(self, slots: np.ndarray, update: RowUpdate, inv: np.ndarray,
                   offsets: np.ndarray, weights: np.ndarray, mean: bool, grad: np.ndarray,
                   threads: int = 1, rounding: int | None = None, *,
                   argmax: np.ndarray | None = None) -> bool | None:
        """``FusedBagPooling.step_bags`` on the records at ``slots``: True when applied, False
        when a summed gradient is not finite (nothing written), None when the kernels do not
        cover the layout or rule (nothing written)."""
        ...


class PlainOnlyProbes(Protocol):
    """A backend whose key probes check bytes keys themselves (``checks_bytes_keys``).

    Normalizing an object array of keys reads every scattered key object once to prove it
    holds only ``bytes``; the store's probe reads each of them again. On a table of 1M
    bytes keys the first walk over a 4096-key batch cost a sixth of a lookup (each key
    object is a TLB miss, in cache or not), so where the backend probes the keys first the
    engine hands it the array unread with ``plain_only=True``: the probe's own pass is the
    check, and a key that is not exactly ``bytes`` (a str, a bytes subclass, a wrong type)
    raises ``embstore._cython.strkeys.NotPlainBytes`` with nothing changed. The engine then
    normalizes the batch (encoding str, refusing a wrong type with ``KeyTypeError``) and
    asks again."""

    checks_bytes_keys: bool

    def get_field(self, keys: np.ndarray, field: str, *,
                  plain_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``Backend.get_field``; with ``plain_only``, as the class docstring says."""
        ...

    def lookup_insert(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                      template: Callable[[], np.ndarray], new: np.ndarray | None = None,
                      missed: np.ndarray | None = None, *,
                      plain_only: bool = False) -> tuple[np.ndarray, int]:
        """``Backend.lookup_insert``; with ``plain_only``, as the class docstring says."""
        ...
