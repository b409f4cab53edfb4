"""How the engine writes records: construction, stamps, and the one write/delete path.

``EmbeddingStore`` inherits these from :class:`RecordWrites`; every row the engine writes or
deletes goes through ``_update_records`` / ``_assign_records`` (one ``Backend.modify`` each),
``_insert`` / ``_lookup_insert`` or ``_delete`` here, so observers (sampling and retrieval
indexes, :class:`~embstore.engine.protocols.StoreObserver`) and the tombstone log see all of
them. The row-update fast path in ``EmbeddingStore.update`` tells observers itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .._cython.rowops import all_finite
from ..backends.base import RowUpdate
from ..errors import InvalidInputError, SchemaMismatchError
from ..valuetypes import round_trip
from .batch import (
    coalesce,
    count_repeats_of,
    distinct,
    occurrences,
    sum_counts,
    unique_first,
    unique_last,
)
from .fused import BagBatch, bag_batch

if TYPE_CHECKING:
    from ..backends.base import Backend, FusedBagPooling
    from ..init import Initializer
    from ..layout import Layout
    from ..optim import Optimizer
    from ..policies.runtime import PolicyRuntime
    from .protocols import PolicyHost, StoreObserver


def _now_us() -> int:
    return time.time_ns() // 1000


class RecordWrites:
    """The write half of :class:`embstore.EmbeddingStore` (no public methods)."""

    layout: Layout
    initializer: Initializer
    optimizer: Optimizer
    seed: int
    step: int
    _version: int
    _backend: Backend
    _stats: dict[str, int]
    _policy: PolicyRuntime
    _observers: list[StoreObserver]
    _clock: Callable[[], float]

    normalize_keys: Callable[[Any], np.ndarray]  # StoreSeams'
    check_writable: Callable[[], None]  # StoreSeams'
    check_open: Callable[[], None]  # StoreSeams'
    _require_scan: Callable[[str], None]  # StoreSeams'
    read_only: bool
    key_type: str

    def _next_version(self) -> int:
        # A hybrid clock: microseconds since the epoch, forced monotonic, so stamps keep
        # increasing across a crash even when the stored counter lags behind.
        self._version = max(self._version + 1, _now_us())
        return self._version

    stochastic_rounding: bool

    def _new_records(self, keys: np.ndarray, vectors: np.ndarray | None = None) -> np.ndarray:
        layout = self.layout
        wide = layout.wide.empty(len(keys))
        wide["vector"] = (vectors if vectors is not None
                          else self.initializer(keys, layout.dim, self.seed))
        self.optimizer.init_slots(wide)
        if layout.is_wide:
            return wide
        recs = layout.empty(len(keys))
        layout.narrow_into(wide, recs)  # to nearest: ``_initial`` rounds the same way
        return recs

    def _rounding(self) -> np.random.Generator | None:
        """The random source of stochastic rounding for this step (None: to nearest): seeded
        by the store's seed and step, so a run replays exactly, and a backend that retries a
        ``modify`` gets the same bits again."""
        if not self.stochastic_rounding:
            return None
        return np.random.default_rng((self.seed & 0xFFFFFFFFFFFFFFFF, self.step, 0x5EED))

    def _update_records(self, uniq: np.ndarray, summed: np.ndarray, mult: np.ndarray,
                        now: float | None = None) -> None:
        """One optimizer step on the records of ``uniq``, read and written back by one
        ``Backend.modify``; stats, tombstones and observers follow its last call's outcome."""
        policy = self._policy
        n = len(uniq)
        # Admission is asked once per key however often the backend runs ``step`` (a policy
        # counts sightings): decisions are kept across calls, and counted after the last one.
        asked = np.zeros(n, dtype=bool)
        admitted = np.zeros(n, dtype=bool)
        fresh = np.zeros(n, dtype=bool)
        last: list[Any] = [None]

        def step(recs: np.ndarray, found: np.ndarray) -> np.ndarray | None:
            ok = None
            if not found.all():
                if policy.admission is not None:
                    ask = ~found & ~asked
                    if ask.any():
                        admitted[ask], fresh[ask] = policy.decide_update(uniq[ask], mult[ask])
                        asked[ask] = True
                    ok = found | admitted
                new = ~found if ok is None else ~found & ok
                if new.any():
                    recs[new] = self._new_records(uniq[new])
            if ok is None or ok.all():
                drop = self._step(recs, summed, mult, now)
            else:  # gradients of keys not admitted are dropped: they get no row
                sub = recs[ok]
                sub_drop = self._step(sub, summed[ok], mult[ok], now)
                recs[ok] = sub
                drop = None
                if sub_drop is not None:
                    drop = np.zeros(n, dtype=bool)
                    drop[ok] = sub_drop
            if drop is not None and drop.any():
                ok = ~drop if ok is None else ok & ~drop
            last[0] = (recs, found, ok, drop)
            return ok

        self._backend.modify(uniq, step)
        recs, found, keep, drop = last[0]
        if policy.admission is not None and not found.all():
            missing = ~found
            policy.count_update(admitted[missing], fresh[missing])
        written = np.ones(n, dtype=bool) if keep is None else keep
        self._stats["inserts"] += int(np.count_nonzero(written & ~found))
        if drop is not None and drop.any():
            self._policy.counters["pruned"] += int(np.count_nonzero(drop))
        self._after_modify(uniq, recs, found, keep)

    def _step(self, recs: np.ndarray, summed: np.ndarray, mult: np.ndarray,
              now: float | None = None) -> np.ndarray | None:
        layout = self.layout
        if layout.is_wide:
            drop = self.optimizer.apply(recs, summed, self.step)
        else:  # 16-bit storage: compute on a float32 copy, round the results back
            wide = layout.widen(recs)
            drop = self.optimizer.apply(wide, summed, self.step)
            layout.narrow_into(wide, recs, self._rounding())
        layout.add_counts(recs, mult)
        self._stamp(recs, now)
        return drop

    def _assign_records(self, uniq: np.ndarray, values: np.ndarray) -> None:
        """Set the vectors of ``uniq`` (new keys get fresh records) in one ``modify``."""
        last: list[Any] = [None]
        stored = self.layout.encode_vectors(values)
        now = self._stamp_time()

        def assign(recs: np.ndarray, found: np.ndarray) -> None:
            if not found.all():
                new = ~found
                recs[new] = self._new_records(uniq[new], values[new])
            recs["vector"] = stored
            self._stamp(recs, now)
            last[0] = (recs, found)

        found = self._backend.modify(uniq, assign)
        recs = last[0][0]
        self._stats["inserts"] += int(len(uniq) - np.count_nonzero(found))
        self._stats["assigns"] += len(uniq)
        self._after_modify(uniq, recs, found, None)

    def _after_modify(self, keys: np.ndarray, recs: np.ndarray, found: np.ndarray,
                      keep: np.ndarray | None) -> None:
        """Side effects of a ``modify``: deletes counted and logged, observers told."""
        if keep is not None:
            gone = found & ~keep
            ngone = int(np.count_nonzero(gone))
            if ngone:
                self._deleted(keys[gone])
            if not keep.all():
                keys, recs = keys[keep], recs[keep]
        if len(keys):
            for obs in self._observers:
                obs.on_write(keys, recs)

    def _initial(self, keys: np.ndarray) -> np.ndarray:
        """Initial vectors of ``keys`` as they read back once stored (float32)."""
        return round_trip(self.initializer(keys, self.layout.dim, self.seed),
                          self.layout.value_dtype)

    def _initial_stored(self, keys: np.ndarray) -> np.ndarray:
        """Initial vectors of ``keys`` in the stored dtype."""
        return self.layout.encode_vectors(self.initializer(keys, self.layout.dim, self.seed))

    def _template(self, now: float | None = None) -> np.ndarray:
        """One fresh record (zero vector, initial slots, stamped): what new rows are made of."""
        template = self._new_records(np.zeros(1, dtype=np.int64),
                                     np.zeros((1, self.layout.dim), dtype=np.float32))
        self._stamp(template, now)  # slots are per-row constants
        return template

    def _insert(self, keys: np.ndarray, vectors: np.ndarray, now: float | None = None) -> int:
        """Write new records of ``keys`` with these vectors where no record exists by now
        (another writer may have created one since the caller's read: insert-if-absent);
        return how many were written."""
        template = self._template(now)
        done = self._backend.insert_rows(keys, self.layout.encode_vectors(vectors), template)
        if done is not None and not done.all():
            keys, vectors = keys[done], vectors[done]
        if len(keys):
            for obs in self._observers:
                obs.on_insert(keys, vectors, template)
        return len(keys)

    def _lookup_insert(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``Backend.lookup_insert``: vectors and which keys were inserted (the first
        occurrence of each new key); observers are told about the new rows."""
        made: list[np.ndarray] = []
        # read before the backend places new keys: a clock that fails fails before any write
        now = self._stamp_time()

        def template() -> np.ndarray:
            made.append(self._template(now))
            return made[-1]

        new = np.zeros(len(keys), dtype=bool)
        vectors, n_new = self._backend.lookup_insert(keys, self._initial_stored, template, new=new)
        vectors = self.layout.vectors(vectors)
        if n_new:
            for obs in self._observers:
                obs.on_insert(keys[new], vectors[new], made[-1])
        return vectors, new

    # Every row write and delete of the engine goes through this module, so observers see all.
    def _delete(self, keys: np.ndarray) -> int:
        present = self._backend.delete(keys)
        n = int(np.count_nonzero(present))
        if n:
            self._deleted(keys[np.asarray(present, dtype=bool)])
        return n

    def _deleted(self, gone: np.ndarray) -> None:
        """Record rows that left the table: counted, logged as tombstones, observers told."""
        self._stats["deletes"] += len(gone)
        self._policy.tombstones.add(gone, self._next_version())
        for obs in self._observers:
            obs.on_delete(gone)

    def _stamp_time(self) -> float | None:
        """The clock's reading for the stamps of one write (None: the layout keeps no
        ``last_seen``). Write paths read it before they change anything: a caller's clock is
        checked (:mod:`embstore.policies.clock`) and one that strays raises here."""
        return self._clock() if "last_seen" in self.layout.meta_names else None

    def _stamps(self, now: float | None = None) -> dict[str, Any]:
        """The stamps of a write, for the metadata fields the layout keeps (``version``
        always); ``now`` is the clock's reading if the caller took one already."""
        names = self.layout.meta_names
        out: dict[str, Any] = {}
        if "last_seen" in names:
            out["last_seen"] = self._clock() if now is None else now
        if "last_step" in names:
            out["last_step"] = self.step
        out["version"] = self._next_version()
        return out

    def _stamp(self, recs: np.ndarray, now: float | None = None) -> None:
        for name, value in self._stamps(now).items():
            recs[name] = value

    def _bulk_load(self, batches: Iterable[tuple[Any, np.ndarray]],
                   header: dict[str, Any] | None) -> int:
        """``load_records``: whole records written around the engine's write path, then the
        version clock, step and policy state moved forward to cover them."""
        top = [self._version]

        def clean() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for keys, recs in batches:
                keys = self.normalize_keys(keys)
                if len(keys) == 0:
                    continue
                if getattr(recs, "dtype", None) != self.layout.dtype or len(recs) != len(keys):
                    raise SchemaMismatchError(
                        f"records do not match the store layout {self.layout}")
                top[0] = max(top[0], int(recs["version"].max()))
                if not distinct(keys):
                    uniq, last = unique_last(keys)
                    keys, recs = uniq, recs[last]
                yield keys, recs

        n = self._backend.bulk_load(clean())
        for obs in self._observers:  # bulk loads bypass the engine's writes: indexes resync
            obs.on_bulk_load()
        self._version = max(self._version, top[0])
        policy = self._policy
        if header:
            self.step = max(self.step, int(header.get("step", 0)))
            policy.load_from_header(header.get("extra") or {})
        if policy.eviction is not None:
            policy.resync_rows(self)  # type: ignore[arg-type]  # the store is the host
            policy.maybe_evict(self)  # type: ignore[arg-type]
        return n

    def _as_host(self) -> PolicyHost:
        # EmbeddingStore, the one class that mixes this in, is the policies' host
        return cast("PolicyHost", self)

    def _lookup_rows(self, k: np.ndarray, c: np.ndarray | None, insert: bool) -> np.ndarray:
        """``lookup`` of a clean non-empty key array: read, insert the misses a policy admits."""
        n = len(k)
        if (insert and not self.read_only and self._backend.supports_lookup_insert
                and self._policy.admission is None):
            # No policy to ask: the backend places the new keys as it finds them missing (one
            # pass instead of a read and then a write); observers learn which keys were new.
            vectors, new = self._lookup_insert(k)
            n_new = int(np.count_nonzero(new))
            if n_new:
                # every occurrence of a new key missed (a repeated one is inserted once)
                misses = n if n_new == n else count_repeats_of(k, new)
                self._stats["hits"] += n - misses
                self._stats["misses"] += misses
                self._stats["inserts"] += n_new
                self._policy.maybe_evict(self._as_host(), lookup=k)
            else:
                self._stats["hits"] += n
            return vectors
        vectors, found = self._backend.get_field(k, "vector")
        vectors = self.layout.vectors(vectors)
        nfound = int(np.count_nonzero(found))
        self._stats["hits"] += nfound
        if nfound == n:
            return vectors
        self._stats["misses"] += n - nfound
        if nfound == 0:  # a batch of only new keys (a table being filled): no masking
            miss_keys = k
            vectors = new_vecs = self._initial(k)
        else:
            miss = ~found
            miss_keys = k[miss]
            new_vecs = self._initial(miss_keys)
            vectors[miss] = new_vecs
        if insert and not self.read_only:
            now = self._stamp_time()  # before admission counts this batch's sightings
            miss_counts = None if c is None else (c if nfound == 0 else c[~found])
            if distinct(miss_keys):
                uniq, seen = miss_keys, miss_counts
            else:
                uniq, first = unique_first(miss_keys)
                new_vecs = new_vecs[first]
                seen = (occurrences(miss_keys, uniq) if miss_counts is None
                        else sum_counts(miss_keys, uniq, miss_counts))
            if self._policy.admission is not None:
                if seen is None:
                    seen = np.ones(len(uniq), dtype=np.int64)
                ok = self._policy.admit_lookup(uniq, seen)
                uniq, new_vecs = uniq[ok], new_vecs[ok]
            if len(uniq):
                self._stats["inserts"] += self._insert(uniq, new_vecs, now)
                self._policy.maybe_evict(self._as_host(), lookup=k)
        return vectors

    def _apply_gradients(self, k: np.ndarray, g: np.ndarray, c: np.ndarray | None) -> None:
        """``update`` of clean keys and gradients: one optimizer step per distinct key."""
        uniq, summed, mult = coalesce(k, g)
        if c is not None:
            mult = sum_counts(k, uniq, c)
        self._apply_distinct(uniq, summed, mult, len(k))

    def _apply_distinct(self, uniq: np.ndarray, summed: np.ndarray, mult: np.ndarray,
                        n_rows: int) -> None:
        """One optimizer step for each of the distinct keys ``uniq`` (``n_rows`` rows given)."""
        now = self._stamp_time()
        self.step += 1
        self._stats["updates"] += n_rows
        wide = self.layout.is_wide
        axpy = self.optimizer.axpy_step(summed) if wide else None
        rule = self.optimizer.row_rule() if (wide and axpy is None) else None
        if (axpy is not None or rule is not None) and self._backend.supports_row_update:
            # The step is plain field arithmetic, or a rule of each row and its gradient
            # alone: the backend applies it where the records live (observers are told the
            # same update); only keys without a record yet go the general way below.
            counts = {"count": mult} if "count" in self.layout.meta_names else {}
            row_update = RowUpdate(axpy or ("vector", 1.0, summed), counts, self._stamps(now), rule)
            found = self._backend.update_rows(uniq, row_update)
            for obs in self._observers:
                obs.on_row_update(uniq, row_update, found)
            if found.all():
                self._policy.after_update(self._as_host())
                return
            new = ~found
            uniq, summed, mult = uniq[new], summed[new], mult[new]
        self._update_records(uniq, summed, mult, now)
        self._policy.after_update(self._as_host())

    # -- the fused bag path (embstore.engine.fused) --------------------------------------------
    def fused_bags(self) -> bool:
        """Whether :meth:`pool_bags` takes the fused path now: a backend that pools in place
        (``supports_fused_bags``), int64 keys, float32 rows, writable, and nothing that must
        see each lookup as today (an admission policy, observers such as sampling indexes)."""
        return bool(self._backend.supports_fused_bags and self.key_type == "int64"
                    and self.layout.is_wide and not self.read_only
                    and self._policy.admission is None and not self._observers)

    def pool_bags(self, ids: Any, offsets: Any = None, *, weights: Any = None,
                  mean: bool = False) -> tuple[np.ndarray, BagBatch] | None:
        """Bags of ``ids`` pooled straight from the stored rows, new ids inserted with their
        initial vectors: ``(pooled (n_bags, dim) float32, batch)``, or None where
        :meth:`fused_bags` is False (then use :meth:`lookup`).

        ``ids`` is 2-D (one bag per row) or 1-D with ``offsets`` (the start of each bag);
        ``weights`` (sum pooling only) scale each id's vector. The result equals an
        ``embedding_bag`` over ``lookup`` of the distinct ids, bit for bit, and the store's
        counters move as that ``lookup`` moves them. Hand ``batch`` and the pooled gradient to
        :meth:`update_bags`.
        """
        self.check_open()
        if not self.fused_bags():
            return None
        batch = bag_batch(ids, offsets, weights, mean)
        uniq = batch.uniq
        n = len(uniq)
        out = np.empty((batch.n_bags, self.layout.dim), dtype=np.float32)  # pool sets every bag
        self._stats["lookups"] += n
        if not n:
            out.fill(0.0)
            return out, batch
        pooling = cast("FusedBagPooling", self._backend)  # supports_fused_bags
        n_new = pooling.lookup_pool(uniq, self._initial_stored, self._template, batch.inv,
                                    batch.offsets, batch.weights, batch.mean, out)
        self._stats["hits"] += n - n_new
        if n_new:
            self._stats["misses"] += n_new
            self._stats["inserts"] += n_new
            self._policy.maybe_evict(self._as_host(), lookup=uniq)
        return out, batch

    def update_bags(self, batch: BagBatch, grad: Any, *, counts: Any = None) -> None:
        """Apply the gradient of :meth:`pool_bags`' output (``(n_bags, dim)``) as ``update``
        applies the per-id sums: one optimizer step per distinct id. ``count`` grows by each
        id's occurrences, or by ``counts`` (one per distinct id, e.g. zeros) when given."""
        self.check_writable()
        g = np.asarray(grad, dtype=np.float32)
        if g.ndim == 2 and g.shape[1] > 1 and g.strides[1] != 4:  # rows may sit apart
            g = np.ascontiguousarray(g)
        if g.shape != (batch.n_bags, self.layout.dim):
            raise InvalidInputError(f"gradients must have shape ({batch.n_bags}, "
                                    f"{self.layout.dim}), got {g.shape}")
        if not len(batch.uniq):
            return
        sums = batch.grad_sums(g)
        if not all_finite(sums):
            raise InvalidInputError("gradients contain NaN or inf")
        mult = batch.counts if counts is None else np.asarray(counts, dtype=np.int64)
        self._apply_distinct(batch.uniq, sums, mult, len(batch.uniq))

    def clear(self, batch_size: int = 65536) -> int:
        """Delete every row (as :meth:`delete` of all keys: policies and observers are told,
        incremental exports see the deletions); return how many rows were deleted. The store's
        step, options and layout stay."""
        self.check_writable()
        self._require_scan("clear()")
        batches = [keys for keys, _ in self._backend.scan(batch_size)]
        if not batches:
            return 0
        return self._delete(unique_first(np.concatenate(batches))[0])

    def _after_replace(self, header: dict) -> None:
        """The engine's state after the backend swapped a whole table in (a restore)."""
        extra = header.get("extra")
        if isinstance(extra, dict) and extra.get("policies"):
            # admission state (checked whole before the swap), saved with the next flush
            self._policy.load_from_header(extra)
        for obs in self._observers:  # the rows changed under the engine: indexes resync
            obs.on_bulk_load()
        if self._policy.eviction is not None:
            self._policy.resync_rows(self._as_host())
            self._policy.maybe_evict(self._as_host())
