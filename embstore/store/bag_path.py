"""The fused bag path of an :class:`~embstore.store.core.EmbeddingStore`: ``pool_bags`` and
``update_bags`` (:class:`BagPath`), over the store's :class:`~embstore.store.writer.RecordWriter`.

The forward makes the batch (:func:`~embstore.engine.fused.bag_batch`) and has the writer pool
it; the backward hands the pooled gradient to the backend's one-pass step
(``FusedBagPooling.step_bags``: per-key sums, element by element for sum and mean, by the
pooling's ``argmax`` for max, then the optimizer's step on the records in place), with the
counts and stamps ``RecordWriter.apply_distinct`` writes, or, where the backend does not cover
the optimizer or the layout, to ``apply_distinct`` itself: the same bits either way.

With an admission policy (on a backend that keeps it on this path, ``memory://``'s
``supports_fused_admission``) the forward asks it about the batch's absent keys as ``lookup``
asks (:mod:`.bag_admission`): the admitted ones are placed, the others pool their initial
vectors from rows the table does not hold, and the step drops their gradients (counted as
``update`` counts them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..backends.base import RowUpdate
from ..engine.fused import BagBatch, bag_input, batch_of, check_out, probe_pool
from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..backends.base import FusedBagPooling
    from .writer import RecordWriter

__all__ = ["BagPath", "pool_probed", "probe_spec"]


class BagPath:
    """``EmbeddingStore.pool_bags`` / ``update_bags`` through ``writer``."""

    def __init__(self, writer: RecordWriter) -> None:
        self.writer = writer
        self._empty: np.ndarray | None = None

    def pool_bags(self, ids: Any, offsets: Any, weights: Any, mode: str,
                  out: np.ndarray | None, threads: int) -> tuple[np.ndarray, BagBatch] | None:
        """``EmbeddingStore.pool_bags`` of bags pooled by ``mode`` (``"sum"``, ``"mean"`` or
        ``"max"``); None where the fused path does not apply now."""
        w = self.writer
        if not w.fused_ok():
            return None
        flat, bounds, wts, mode = bag_input(ids, offsets, weights, mode)
        check_out(out, len(bounds) - 1, w.layout.dim)
        if (threads <= 1 and mode != "max" and len(flat) and w.policy.admission is None
                and hasattr(w.backend, "fused_table")):  # (admission: lookup_pool asks it)
            return self._probe_pool(flat, bounds, wts, mode, out, threads)
        batch = batch_of(flat, bounds, wts, mode)
        return w.pool(batch, out, threads), batch

    def _probe_pool(self, flat: np.ndarray, bounds: np.ndarray, wts: np.ndarray, mode: str,
                    out: np.ndarray | None, threads: int) -> tuple[np.ndarray, BagBatch]:
        """:meth:`pool_bags` on a ``memory://`` table (``fused_table``) on one thread, with no
        admission policy (its ``lookup_pool`` asks the policy about the batch's rows): the
        dedupe, the probe of the distinct ids and, where all are there, the pooling in one
        native call (``fused.probe_pool``, as a collection's tables take it), under the
        store's lock; the writer then places the absent ids only and pools, and keeps the
        slots for the step (``BagKernels.pooled_ahead``). The bits of :func:`batch_of` and
        ``lookup_pool``: the same dedupe, the same rows, the same pooling."""
        w = self.writer
        n = len(flat)
        uniq, inv, counts = (np.empty(n, dtype=np.int64) for _ in range(3))
        slots = np.empty(n, dtype=np.uint32)
        if out is None:
            out = np.empty((len(bounds) - 1, w.layout.dim), dtype=np.float32)  # pool sets all
        found = np.empty((1, 2), dtype=np.int64)
        backend: Any = w.backend  # (a MemoryBackend: pool_bags asked for fused_table)
        with backend.fused_table()[0]:
            probe_pool([probe_spec(backend, flat, uniq, inv, counts, slots, bounds, wts,
                                   mode == "mean", out)], found, threads)
            nu, absent = found[0].tolist()
            batch = BagBatch(uniq[:nu], inv, counts[:nu], bounds, wts, mode)
            pool_probed(w, batch, slots[:nu], absent, out, threads)
        return out, batch

    def update_bags(self, batch: BagBatch, grad: Any, counts: Any, threads: int) -> None:
        """``EmbeddingStore.update_bags``: the fused step where the backend covers it, else
        the per-id sums applied as ``update`` applies them."""
        w = self.writer
        g = batch.checked_grad(grad, w.layout.dim)
        if g is None:
            return
        mult = batch.counts if counts is None else np.asarray(counts, dtype=np.int64)
        # (an observer or a policy added since the forward: the general path tells it)
        if w.fused_ok() and self._step_bags(batch, g, mult, threads):
            return
        w.apply_distinct(batch.uniq, batch.grad_sums(g, finite=True), mult, len(batch.uniq))

    def defer_checked(self, batch: BagBatch, grad: np.ndarray, counts: np.ndarray | None,
                      threads: int, sums: np.ndarray, steps: list[Any]) -> bool:
        """:meth:`update_bags` of a collection's table-parallel step on ``memory://``: the
        table's step appended to ``steps`` with ``sums``, its per-id gradient sums (all
        finite), for one ``fused.step_tables`` call of every table, which the caller makes
        under the store's lock (``MemoryBackend.defer_bags``). The writer's bookkeeping is
        :meth:`_step_bags`' (step counter, stamps, rounding seed, counters, policies), without
        its keyword plumbing: this runs once per table per step. The caller checked what
        :meth:`update_bags` checks: the store writable, the fused path on with no admission
        policy, ``grad`` float32 ``(n_bags, dim)`` with contiguous rows, ``batch`` with ids.
        False where this does not apply (max pooling, an optimizer with no fused step, or
        the slots of the forward gone): then nothing was done."""
        w = self.writer
        if batch.argmax is not None or w.policy.admission is not None:
            return False
        row_update = self._next_update(batch.counts if counts is None else counts)
        if row_update is None:
            return False
        done = False
        try:
            done = bool(cast(Any, w.backend).defer_bags(
                batch, row_update, grad, threads, w.rounding_seed(), sums, steps))
        finally:
            if not done:
                w.step -= 1  # nothing was written
        if done:
            w.stats["updates"] += len(batch.uniq)
            w.policy.after_update(w)
        return done

    def _next_update(self, mult: np.ndarray) -> RowUpdate | None:
        """The ``RowUpdate`` of the next fused step (counts ``mult``, the stamps, the
        optimizer's rule or axpy), the writer's step counter moved on (the caller moves it
        back where nothing gets written); None where the optimizer has no fused step. The
        clock is read before anything changes (a clock that strays raises there)."""
        w = self.writer
        width = self._no_rows()
        axpy = w.optimizer.axpy_step(width)
        rule = w.optimizer.fused_rule(w.step + 1) if axpy is None else None
        if axpy is None and rule is None:
            return None
        now = w.stamp_time()
        counts = {"count": mult} if "count" in w.layout.meta_names else {}
        w.step += 1
        try:
            return RowUpdate(axpy or ("vector", 1.0, width), counts, w.stamps(now), rule)
        except BaseException:
            w.step -= 1
            raise

    def _no_rows(self) -> np.ndarray:
        """An empty ``(0, dim)`` float32 array: the gradient rows of a ``RowUpdate`` whose
        gradient the kernel sums itself (made once: it holds nothing)."""
        dim = self.writer.layout.dim
        rows = self._empty
        if rows is None or rows.shape[1] != dim:
            rows = self._empty = np.empty((0, dim), dtype=np.float32)
        return rows

    def _step_bags(self, batch: BagBatch, grad: np.ndarray, mult: np.ndarray,
                   threads: int) -> bool:
        """``apply_distinct`` of the pooled gradient's per-id sums in one backend call
        (``FusedBagPooling.step_bags``); False where it does not cover the optimizer."""
        w = self.writer
        row_update = self._next_update(mult)
        if row_update is None:
            return False
        done = None
        kw = batch.stepping()
        if w.policy.admission is not None:  # keys turned away at the forward: no step
            kw["dropped"] = dropped = np.zeros(1, dtype=np.int64)
        try:
            done = cast("FusedBagPooling", w.backend).step_bags(
                batch.uniq, row_update, batch.inv, batch.offsets, batch.weights, batch.mean, grad,
                threads, w.rounding_seed(), **kw)
        finally:
            w.step -= 0 if done else 1  # nothing was written
        if done is False:
            raise InvalidInputError("gradients contain NaN or inf")
        if done:
            w.stats["updates"] += len(batch.uniq)
            if "dropped" in kw:  # (rejected by the lookup: counted as update counts them)
                w.policy.count_update(np.zeros(int(dropped[0]), dtype=bool),
                                      np.zeros(int(dropped[0]), dtype=bool))
            w.policy.after_update(w)
        return bool(done)


def probe_spec(backend: Any, flat: np.ndarray, uniq: np.ndarray, inv: np.ndarray,
               counts: np.ndarray, slots: np.ndarray, bounds: np.ndarray, wts: np.ndarray,
               mean: bool, out: np.ndarray) -> tuple[Any, ...]:
    """One table's entry of ``fused.probe_pool``'s list: the key table, arena and vector
    field of ``backend`` (a ``memory://`` backend's ``fused_table``, read under its lock) with
    the batch's ids, bag bounds (n_bags + 1), weights, output and the arrays it fills."""
    _, table, arena, bags = backend.fused_table()
    offset, kind = bags.vector_field()
    return (table, arena, flat, uniq, inv, counts, slots, bounds, wts, offset, mean, out, kind)


def pool_probed(writer: RecordWriter, batch: BagBatch, slots: np.ndarray, absent: int,
                out: np.ndarray, threads: int) -> None:
    """``writer``'s pooling of ``batch`` after ``fused.probe_pool`` deduplicated and probed it
    (``slots``: those of the distinct ids, ``absent``: how many it did not find): the writer
    places the absent ids only, pools again where there were any, counts, and keeps the
    slots for the step (``BagKernels.pooled_ahead``); under the backend's lock. Where every
    id was found and there is no admission policy to ask, the counters and the kept slots
    only: the probe pooled every bag."""
    backend = cast(Any, writer.backend)
    if not absent and writer.policy.admission is None:
        writer.stats["lookups"] += len(batch.uniq)
        writer.stats["hits"] += len(batch.uniq)
        backend.keep_found(batch.uniq, slots)
        return
    bags = backend.fused_table()[3]
    bags.pooled_ahead(batch.uniq, slots, absent)
    try:
        writer.pool(batch, out, threads)
    finally:
        bags.pooled_ahead(None)
