"""memory:// records by arena slot: the in-place row kernels and where they apply, and the
key-table helpers of :class:`~embstore.backends.memory.MemoryBackend`."""

from __future__ import annotations

import functools
import struct
from typing import Any

import numpy as np

from .._cython import fused
from .._cython.arena import RecordArena
from .._cython.bytestable import BytesTable
from .._cython.cuckoo import CuckooTable
from .._cython.rowops import row_mean_squares
from .._cython.strkeys import KeySnapshot

__all__ = ["RowKernels", "new_snapshot", "row_plan", "same_keys", "table_items"]


_NO_CONSTANTS = np.zeros(0, dtype=np.float64)
_NO_CONSTANTS.flags.writeable = False
_UNPLANNED = object()
#: the rules :meth:`RowKernels.update` steps in place (the arena's Adagrad kernels); the fused
#: step covers every rule of ``fused.RULES``
IN_PLACE_RULES = ("adagrad", "adagrad_rowwise")


def row_plan(fields: Any, name: str, width: tuple[int, ...], add: tuple[str, ...],
             assign: tuple[str, ...], rule: tuple[str, int] | None, narrow: bool = False
             ) -> tuple[int, int, int, np.ndarray, np.ndarray, np.dtype] | None:
    """Offsets for the in-place kernels (the axpy or rule field, the rule's first and second
    slot or -1, the added and the assigned fields), or None where they do not apply: the
    axpy (or rule) field is not float32 of the gradients' width, an added field is not
    int64, an assigned one not 8 bytes, or the rule's slots (``fused.RULE_SLOTS``) are
    missing or not float32 of their width. Without ``narrow`` only Adagrad rules (with
    their two params) apply, the kernels of :meth:`RowKernels.update`; with it (the fused
    step) every rule of ``fused.RULES``, and float fields may be 16-bit (bfloat16 as
    ``<u2``, or float16: what the fused step widens and rounds back). ``fields`` is the
    bound layout's ``dtype.fields``."""
    floats = (np.float32, np.uint16, np.float16) if narrow else (np.float32,)
    slots: tuple[str, ...] | None = ()
    if rule is not None:
        known = name == "vector" and (narrow or (rule[0] in IN_PLACE_RULES and rule[1] == 2))
        slots = fused.RULE_SLOTS.get(rule[0]) if known else None
    slot_shape = (1,) if rule is not None and rule[0] == "adagrad_rowwise" else width
    ok = (slots is not None
          and fields[name][0].base in floats and fields[name][0].shape == width
          and all(fields[f][0] == np.int64 for f in add)
          and all(fields[f][0].itemsize == 8 for f in assign)
          and all(f in fields and fields[f][0].base in floats and fields[f][0].shape == slot_shape
                  for f in slots or ()))
    if not ok or slots is None:
        return None
    acc = [fields[f][1] for f in slots] + [-1, -1]
    return (fields[name][1], acc[0], acc[1],
            np.array([fields[f][1] for f in add], dtype=np.intp),
            np.array([fields[f][1] for f in assign], dtype=np.intp),
            np.dtype([(f, fields[f][0]) for f in assign]))


class RowKernels:
    """Reads and writes of ``memory://`` records by arena slot, for one bound layout.

    Every call takes the arena (a :class:`~embstore._cython.arena.RecordArena`), so a table
    swapped in by a restore needs no new object. It keeps the kernel plans of the update
    shapes it has seen (:func:`row_plan`, worked out once per shape).
    """

    def __init__(self, layout: Any) -> None:
        self.layout = layout
        self._plans: dict[tuple, Any] = {}

    def gather(self, arena: Any, slots: np.ndarray, out: Any = None) -> np.ndarray:
        """Whole records at ``slots`` (zero rows for empty slots); with ``out`` (contiguous
        memory of as many records, say uint8 rows of a record's bytes: a follower's
        shared-memory slot) written there and ``out`` returned, no fresh array between."""
        recs = np.empty(len(slots), dtype=self.layout.dtype) if out is None else out
        # the record width spelt out: reshape cannot infer it for zero rows
        arena.gather(slots, recs.view(np.uint8).reshape(len(slots), self.layout.itemsize))
        return recs

    def gather_field(self, arena: Any, slots: np.ndarray, field: str) -> np.ndarray:
        """One field of the records at ``slots``, contiguous."""
        n = len(slots)
        fdt, offset = self.layout.fields[field]
        out = np.empty((n,) + fdt.shape, dtype=fdt.base)
        arena.gather(slots, out.view(np.uint8).reshape(n, -1), offset, fdt.itemsize)
        return out

    def scatter(self, arena: Any, slots: np.ndarray, records: np.ndarray) -> None:
        """Overwrite the records at ``slots``."""
        arena.scatter(slots, np.ascontiguousarray(records).view(np.uint8)
                      .reshape(len(slots), self.layout.itemsize))

    def write_new(self, arena: Any, slots: np.ndarray, template: np.ndarray,
                  vectors: np.ndarray) -> None:
        """New records at ``slots``: ``template`` (a 1-row record array) with each row of
        ``vectors`` as the vector. The compiled writer takes float32 rows; 16-bit rows of an
        even width pass as float32 of half the width, bit for bit."""
        n = len(slots)
        if not n:
            return
        vdt, offset = self.layout.fields["vector"]
        tmpl = np.ascontiguousarray(template[:1]).view(np.uint8)
        vectors = np.ascontiguousarray(vectors, dtype=vdt.base)
        if vectors.dtype == np.float32 or vectors.shape[1] * vectors.itemsize % 4 == 0:
            arena.write_rows(slots, tmpl, offset, vectors.reshape(n, -1).view(np.float32))
            return
        recs = np.repeat(tmpl.view(self.layout.dtype)[:1], n)
        recs["vector"] = vectors
        self.scatter(arena, slots, recs)

    def update(self, arena: Any, slots: np.ndarray, update: Any) -> None:
        """Apply a ``RowUpdate`` (one row per slot) to the records at occupied ``slots`` in
        place: the compiled kernels where the layout fits them, else gather, apply, scatter."""
        if not len(slots):
            return
        x = np.ascontiguousarray(update.axpy[2], dtype=np.float32)
        name, alpha, _ = update.axpy
        rule = update.rule
        plan = self._plan(update, x.shape[1:])
        if plan is None:
            recs = self.gather(arena, slots)  # a layout (or rule) the kernels were not built for
            update.apply(recs)
            self.scatter(arena, slots, recs)
            return
        axpy_offset, acc_offset, _, add_offsets, set_offsets, set_dtype = plan
        if rule is not None:
            lr, eps = rule.params
            if rule.name == "adagrad_rowwise":
                # the float32 reduction of Adagrad(rowwise=True)'s numpy step: the same bits
                ms = np.empty(len(x), dtype=np.float32)
                row_mean_squares(x, ms)
                arena.adagrad_rowwise_rows(slots, axpy_offset, acc_offset, x, ms, lr, eps)
            else:
                arena.adagrad_rows(slots, axpy_offset, acc_offset, x, lr, eps)
            x, alpha = x[:, :0], 0.0  # the metadata below, no axpy
        counts, bits = _metadata(update, len(slots), set_offsets, set_dtype)
        arena.update_rows(slots, axpy_offset, x, float(alpha), add_offsets, counts,
                          set_offsets, bits)

    def step_bags(self, arena: Any, slots: np.ndarray, update: Any, inv: np.ndarray,
                  offsets: np.ndarray, weights: np.ndarray, mean: bool, grad: np.ndarray,
                  threads: int, rounding: int | None = None,
                  argmax: np.ndarray | None = None) -> bool | None:
        """``update`` (its counts, stamps and rule; no gradient rows) applied to the records
        at ``slots`` with each key's gradient summed from the pooled ``grad`` of the bags
        ``inv``/``offsets``/``weights``/``mean``, in one compiled call
        (:func:`~embstore._cython.fused.step_bags`). False: a summed gradient is not finite
        and nothing was written; None: the kernels do not cover this layout or rule.
        16-bit fields round back to nearest, or stochastically from the 64-bit seed
        ``rounding``. The rule's ``params`` are ``(lr, eps, *hyper)`` in the kernel's terms
        (:meth:`~embstore.optim.Optimizer.fused_rule`). ``argmax``: the bags were max-pooled
        (:func:`~embstore._cython.fused.pool`'s rows of each value)."""
        args = self.step_args(arena, slots, update, inv, offsets, weights, mean, grad, threads,
                              rounding, argmax)
        return None if args is None else bool(fused.step_bags(*args))

    def step_args(self, arena: Any, slots: np.ndarray, update: Any, inv: np.ndarray,
                  offsets: np.ndarray, weights: np.ndarray, mean: bool, grad: np.ndarray,
                  threads: int, rounding: int | None = None,
                  argmax: np.ndarray | None = None) -> tuple | None:
        """The arguments of :meth:`step_bags`' :func:`~embstore._cython.fused.step_bags` call
        (also a table's step of :func:`~embstore._cython.fused.step_tables`); None where the
        kernels do not cover this layout or rule."""
        name, alpha, _ = update.axpy
        rule = update.rule
        plan = self._plan(update, grad.shape[1:], narrow=True)
        if plan is None or name != "vector":
            return None
        axpy_offset, acc_offset, acc2_offset, add_offsets, set_offsets, set_dtype = plan
        counts, bits = _metadata(update, len(slots), set_offsets, set_dtype)
        lr, eps, *hyper = rule.params if rule is not None else (0.0, 0.0)
        kind = fused.RULES["axpy" if rule is None else rule.name]
        constants = np.array(hyper, dtype=np.float64) if hyper else _NO_CONSTANTS
        return (arena, slots, inv, offsets, weights, mean, grad, kind, float(alpha), lr, eps,
                axpy_offset, acc_offset, add_offsets, counts, set_offsets, bits, threads,
                fused.KINDS[self.layout.value_dtype], fused.KINDS[self.layout.slot_dtype],
                rounding or 0, rounding is not None, constants,
                acc2_offset) + (() if argmax is None else (argmax,))

    def _plan(self, update: Any, width: tuple[int, ...], narrow: bool = False) -> Any:
        rule = update.rule
        # (one flat tuple: a step asks once per table, and nested tuples cost more to build)
        key = (narrow, update.axpy[0], width, None if rule is None else rule.name,
               None if rule is None else len(rule.params), *update.add, None, *update.assign)
        plan = self._plans.get(key, _UNPLANNED)
        if plan is _UNPLANNED:  # worked out once per shape of update
            plan = self._plans[key] = row_plan(
                self.layout.fields, key[1], width, tuple(update.add), tuple(update.assign),
                None if rule is None else (rule.name, len(rule.params)), narrow=narrow)
        return plan



def _metadata(update: Any, n: int, set_offsets: np.ndarray,
              set_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' count rows (one per added field) and the 8 bytes of each assigned value."""
    adds = update.add
    if len(adds) == 1:
        (first,) = adds.values()
        counts = (first if type(first) is np.ndarray and first.dtype == np.int64
                  and first.flags.c_contiguous else
                  np.ascontiguousarray(first, dtype=np.int64)).reshape(1, n)
    else:
        counts = np.array([np.asarray(v, dtype=np.int64) for v in adds.values()]).reshape(-1, n)
    # each assigned value in its field's dtype, as the 8 bytes the kernel copies
    if not len(set_offsets):
        return counts, np.empty(0, dtype=np.uint64)
    packer = _packer(set_dtype)
    values = tuple(update.assign.values())
    if packer is not None:
        try:
            return counts, np.frombuffer(packer.pack(*values), dtype=np.uint64)
        except struct.error:  # (a value struct takes otherwise than numpy: numpy converts)
            pass
    return counts, np.array([values], dtype=set_dtype).view(np.uint64)


@functools.lru_cache(maxsize=64)
def _packer(set_dtype: np.dtype) -> struct.Struct | None:
    """The assigned fields' bytes by :mod:`struct` (a tenth of a structured array's cost per
    step) where each is a little-endian float64, int64 or uint64; None otherwise."""
    codes = {"<f8": "d", "<i8": "q", "<u8": "Q"}
    by_name: Any = set_dtype.fields or {}
    fields = [by_name[n] for n in set_dtype.names or ()]
    if any(f[0].str not in codes for f in fields) or set_dtype.itemsize != 8 * len(fields):
        return None
    return struct.Struct("<" + "".join(codes[f[0].str] for f in fields))


def new_snapshot(keys: np.ndarray) -> np.ndarray | KeySnapshot:
    """A copy of a looked-up batch, to recognise it when its update comes. String keys get an
    empty :class:`KeySnapshot` that the table's probe fills from the keys it reads anyway."""
    return KeySnapshot() if keys.dtype == object else keys.copy()


#: a probe remembered: ``(snapshot of its keys, their slots, the table's epoch)``
Kept = tuple[Any, np.ndarray, int]


def recall(last: Kept | None, epoch: int,
           keys: np.ndarray) -> np.ndarray | None:
    """The slots of ``last = (snapshot, slots, epoch)`` where ``keys`` are its batch and no key
    was inserted or removed since (``epoch`` unchanged); None otherwise."""
    if last is not None and last[2] == epoch and same_keys(last[0], keys):
        return last[1]
    return None


def kept_batch(last: tuple[Any, np.ndarray, int] | None, slots: np.ndarray | None,
               keys: np.ndarray) -> bool:
    """Whether ``slots`` (:func:`recall` of ``last``) are those a pooled batch's own ``keys``
    were kept with (``lookup_pool``: the array itself, not a copy): every slot occupied, but
    for rows an admission policy turned away (``BagKernels.scratch_rows``)."""
    return slots is not None and last is not None and last[0] is keys


def same_keys(snapshot: np.ndarray | KeySnapshot, keys: np.ndarray) -> bool:
    """Whether ``keys`` are the batch ``snapshot`` was taken of."""
    if snapshot is keys:  # (a batch kept as it is: BagKernels.snapshot)
        return True
    if isinstance(snapshot, KeySnapshot):
        return keys.dtype == object and snapshot.same(keys)  # numpy compares in Python
    return keys.dtype != object and np.array_equal(snapshot, keys)


def kept_slots(table: Any, last: tuple[Any, np.ndarray, int] | None, epoch: int,
               keys: np.ndarray) -> tuple[np.ndarray, tuple[Any, np.ndarray, int]]:
    """``(slots, last)``: the slots ``last`` remembered where ``keys`` are its batch and no
    key was inserted or removed since (:func:`recall`), else a probe of ``keys`` in ``table``,
    remembered as the new ``last`` (a training step probes its keys for the lookup and again
    for the update: the second costs a comparison of the keys instead)."""
    slots = recall(last, epoch, keys)
    if slots is not None and last is not None:
        return slots, last
    snapshot, slots = find_kept(table, keys)
    return slots, (snapshot, slots, epoch)


class ReadCopies:
    """Whether a read's probe keeps a copy of its keys, for the update that follows it.

    A training step reads its keys and updates them: the update then compares the keys with
    the copy instead of probing them again. A copy costs something (a bytes-key lookup of
    4096 keys in a 1M-key table spent 8% of its time filling it), so reads stop keeping one
    after two in a row that no update recalled (serving, evaluation: lookups alone), except
    every 16th, which finds out whether updates follow again. A read whose copy the next
    update recalls puts them back to keeping one each. Only how fast a step goes depends on
    it, never what it does: an update that finds no copy probes its keys."""

    __slots__ = ("pending", "unused", "reads")

    def __init__(self) -> None:
        self.pending = False    # the last read kept a copy that no update has recalled yet
        self.unused = 0         # reads in a row whose copy went unrecalled
        self.reads = 0

    def take(self) -> bool:
        """Whether this read keeps a copy."""
        if self.pending:
            self.unused += 1
        self.reads += 1
        self.pending = self.unused < 2 or self.reads % 16 == 0
        return self.pending

    def settled(self, recalled: bool) -> None:
        """An update probed its keys; ``recalled``: it found them in the kept copy."""
        if recalled:
            self.unused = 0
        self.pending = False

    def read(self, table: Any, last: Kept | None, epoch: int, keys: np.ndarray,
             plain_only: bool) -> tuple[np.ndarray, Kept | None]:
        """``(slots, last)`` of a read's probe: ``last`` replaced by this batch's where the
        read keeps a copy (``plain_only``: see ``PlainOnlyProbes``)."""
        if not self.take():
            return probe_slots(table, keys, plain_only), last
        snapshot, slots = find_kept(table, keys, plain_only)
        return slots, (snapshot, slots, epoch)

    def update(self, table: Any, last: Kept | None, epoch: int, keys: np.ndarray
               ) -> tuple[np.ndarray, Kept]:
        """:func:`kept_slots` for an update's probe."""
        slots, kept = kept_slots(table, last, epoch, keys)
        self.settled(kept is last)
        return slots, kept


def probe_slots(table: Any, keys: np.ndarray, plain_only: bool = False,
              snapshot: KeySnapshot | None = None) -> np.ndarray:
    """The slot of each key; a bytes table fills ``snapshot`` (when given) with a copy of
    the keys during its probe (``plain_only``: see ``PlainOnlyProbes``)."""
    out = np.empty(len(keys), dtype=np.uint32)
    if isinstance(table, BytesTable):
        table.find(keys, out, snapshot, plain_only)
    else:
        table.find(keys, out)
    return out


def find_kept(table: Any, keys: np.ndarray, plain_only: bool = False
              ) -> tuple[np.ndarray | KeySnapshot, np.ndarray]:
    """``(snapshot, slots)``: the slot of each key and a :func:`new_snapshot` of ``keys``
    (a bytes table fills a string snapshot during its probe; ``plain_only``: see
    ``PlainOnlyProbes``)."""
    snapshot = new_snapshot(keys)
    strings = snapshot if isinstance(snapshot, KeySnapshot) else None
    return snapshot, probe_slots(table, keys, plain_only, strings)


def new_table(key_type: str, itemsize: int, opts: Any) -> tuple[Any, RecordArena]:
    """An empty key table (int64 or bytes keys) and record arena made as ``opts``
    (``memory_url.TableOptions``) say; ``MemoryError`` where the memory cannot be had."""
    arena = RecordArena(itemsize, prefault=opts.prefault, huge_pages=opts.huge_pages)
    table = (CuckooTable(opts.capacity, opts.prefault, opts.hash_seed, opts.huge_pages)
             if key_type == "int64" else BytesTable(opts.capacity, opts.hash_seed))
    return table, arena


def table_stats(table: Any, arena: Any) -> dict[str, int]:
    """Figures of an open key table and arena (none when closed): ``stats()``'s, and
    ``bytes``, the live records plus the key table (falls when rows are deleted; the arena
    keeps freed slots for reuse, ``arena_bytes`` is what it holds)."""
    out = {}
    if table is not None:
        out["table_capacity"] = int(table.capacity)
        out["table_rehashes"] = int(table.rehashes)
    if arena is not None:
        out["arena_bytes"] = int(arena.nbytes)
        table_bytes = 0 if table is None else int(table.nbytes)
        out["bytes"] = int(arena.live * arena.itemsize) + table_bytes
    return out


def table_items(table: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(key, slot)`` of a key table holding ``n`` keys."""
    if isinstance(table, CuckooTable):  # int64 keys
        keys = np.empty(n, dtype=np.int64)
        slots = np.empty(n, dtype=np.uint32)
        table.items(keys, slots)
        return keys, slots
    return table.items()
