"""How the engine writes records: construction, stamps, and the one write/delete path.

:class:`RecordWriter` owns the store's version clock, its operation counters and its
:class:`~embstore.store.observers.Observers`; every row the engine writes or deletes goes
through it (one ``Backend.modify`` per update or assign, ``insert_rows`` / ``lookup_insert``
for lookups, ``delete``), so observers (sampling and retrieval indexes) and the tombstone log
see all of them. It is also what the policies work on (:class:`~embstore.engine.protocols.
PolicyHost`): expiry and eviction read its rows and delete through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .._cython.strkeys import NotPlainBytes
from .._keys import normalize_keys
from ..backends.base import Backend, RowUpdate
from ..engine.batch import (
    coalesce,
    count_repeats_of,
    distinct,
    occurrences,
    sum_counts,
    unique_first,
    unique_last,
)
from ..errors import CapabilityError, SchemaMismatchError
from ..valuetypes import round_trip
from .bag_admission import AbsentKeys
from .observers import Observers

if TYPE_CHECKING:
    from ..backends.base import FusedBagPooling
    from ..engine.fused import BagBatch
    from ..init import Initializer
    from ..layout import Layout
    from ..optim import Optimizer
    from ..policies.runtime import PolicyRuntime

__all__ = ["STAT_NAMES", "RecordWriter", "require_scan"]

STAT_NAMES = ("lookups", "hits", "misses", "inserts", "updates", "assigns", "deletes")


def _now_us() -> int:
    return time.time_ns() // 1000


def require_scan(backend: Backend, what: str) -> None:
    """Raise :class:`~embstore.errors.CapabilityError` unless ``backend`` can scan its rows."""
    if not backend.supports_scan:
        raise CapabilityError(f"{backend.url}: {what} needs a backend that can scan its "
                              "rows (supports_scan)")


class RecordWriter:
    """The write path of one store, its version clock, step, counters and observers.

    Parameters are the store's collaborators and schema: the backend, the policy runtime
    (shared with the store, which configures it), the clock, and what the store's metadata
    says (layout, key type, initializer, optimizer, seed, step and version as stored).
    Methods take clean arrays: the store validates at its edge.
    """

    def __init__(self, backend: Backend, policy: PolicyRuntime, clock: Callable[[], float], *,
                 layout: Layout, key_type: str, initializer: Initializer, optimizer: Optimizer,
                 seed: int, step: int, version: int, read_only: bool,
                 stochastic_rounding: bool) -> None:
        self.backend, self.policy, self.clock = backend, policy, clock
        self.layout, self.key_type = layout, key_type
        self.initializer, self.optimizer, self.seed = initializer, optimizer, seed
        self.step, self.version = step, version
        self.read_only = read_only
        self.stochastic_rounding = stochastic_rounding
        self.stats = dict.fromkeys(STAT_NAMES, 0)
        self.observers = Observers()

    # -- what the policies use (PolicyHost) ------------------------------------------------------
    def now(self) -> float:
        return float(self.clock())

    @property
    def counters(self) -> Mapping[str, int]:
        return MappingProxyType(self.stats)

    def records(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        require_scan(self.backend, "iterating the records")
        yield from self.backend.scan(batch_size)

    # -- clocks and stamps -----------------------------------------------------------------------
    def next_version(self) -> int:
        """A new version stamp. A hybrid clock: microseconds since the epoch, forced monotonic,
        so stamps keep increasing across a crash even when the stored counter lags behind."""
        self.version = max(self.version + 1, _now_us())
        return self.version

    def adopt_synced(self, step_before: int, step: int, version: int) -> None:
        """Take the step and version a metadata merge settled on; updates made by other
        threads since ``step_before`` was read stay on top of the merged step."""
        self.step = step + (self.step - step_before)
        self.version = max(self.version, version)

    def stamp_time(self) -> float | None:
        """The clock's reading for the stamps of one write (None: the layout keeps no
        ``last_seen``). Write paths read it before they change anything: a caller's clock is
        checked (:mod:`embstore.policies.clock`) and one that strays raises here."""
        return self.clock() if "last_seen" in self.layout.meta_names else None

    def stamps(self, now: float | None = None) -> dict[str, Any]:
        """The stamps of a write, for the metadata fields the layout keeps (``version``
        always); ``now`` is the clock's reading if the caller took one already."""
        names = self.layout.meta_names
        out: dict[str, Any] = {}
        if "last_seen" in names:
            out["last_seen"] = self.clock() if now is None else now
        if "last_step" in names:
            out["last_step"] = self.step
        out["version"] = self.next_version()
        return out

    def _stamp(self, recs: np.ndarray, now: float | None = None) -> None:
        for name, value in self.stamps(now).items():
            recs[name] = value

    # -- new records -----------------------------------------------------------------------------
    def _new_records(self, keys: np.ndarray, vectors: np.ndarray | None = None) -> np.ndarray:
        layout = self.layout
        wide = layout.wide.empty(len(keys))
        wide["vector"] = (vectors if vectors is not None
                          else self.initializer(keys, layout.dim, self.seed))
        self.optimizer.init_slots(wide)
        if layout.is_wide:
            return wide
        recs = layout.empty(len(keys))
        layout.narrow_into(wide, recs)  # to nearest: ``initial`` rounds the same way
        return recs

    def initial(self, keys: np.ndarray) -> np.ndarray:
        """Initial vectors of ``keys`` as they read back once stored (float32)."""
        return round_trip(self.initializer(keys, self.layout.dim, self.seed),
                          self.layout.value_dtype)

    def initial_stored(self, keys: np.ndarray) -> np.ndarray:
        """Initial vectors of ``keys`` in the stored dtype."""
        return self.layout.encode_vectors(self.initializer(keys, self.layout.dim, self.seed))

    def template(self, now: float | None = None) -> np.ndarray:
        """One fresh record (zero vector, initial slots, stamped): what new rows are made of."""
        template = self._new_records(np.zeros(1, dtype=np.int64),
                                     np.zeros((1, self.layout.dim), dtype=np.float32))
        self._stamp(template, now)  # slots are per-row constants
        return template

    def rounding_seed(self) -> int | None:
        """The fused step's stochastic-rounding seed (None: to nearest), of seed and step."""
        if self.stochastic_rounding and not self.layout.is_wide:
            return (self.seed * 0x9E3779B97F4A7C15 + self.step * 0xBF58476D1CE4E5B9) % 2**64
        return None

    def _rounding(self) -> np.random.Generator | None:
        """The random source of stochastic rounding for this step (None: to nearest): seeded
        by the store's seed and step, so a run replays exactly, and a backend that retries a
        ``modify`` gets the same bits again."""
        if not self.stochastic_rounding:
            return None
        return np.random.default_rng((self.seed & 0xFFFFFFFFFFFFFFFF, self.step, 0x5EED))

    # -- lookup ------------------------------------------------------------------------------------
    def lookup(self, k: np.ndarray, c: np.ndarray | None, insert: bool,
               known_distinct: bool = False, checked: bool = True) -> np.ndarray:
        """``lookup`` of a clean key array: read, insert the misses a policy admits
        (``known_distinct``: no key of ``k`` repeats, so none of its misses does).
        ``checked=False``: ``k`` is an object array nobody read yet, for a backend with
        ``checks_bytes_keys``: its probe proves the keys plain bytes, or refuses them having
        changed nothing, and the batch is normalized and looked up again."""
        if not checked:
            try:
                return self._lookup(k, c, insert, known_distinct, {"plain_only": True})
            except NotPlainBytes:
                self.stats["lookups"] -= len(k)  # the refused probe read nothing
                k = normalize_keys(k, "bytes")  # str encoded; KeyTypeError for a wrong type
        return self._lookup(k, c, insert, known_distinct, {})

    def _lookup(self, k: np.ndarray, c: np.ndarray | None, insert: bool, known_distinct: bool,
                probe: dict[str, bool]) -> np.ndarray:
        n = len(k)
        stats = self.stats
        stats["lookups"] += n
        if n == 0:
            return np.empty((0, self.layout.dim), dtype=np.float32)
        policy = self.policy
        if (insert and not self.read_only and self.backend.supports_lookup_insert
                and policy.admission is None):
            # No policy to ask: the backend places the new keys as it finds them missing (one
            # pass instead of a read and then a write); observers learn which keys were new.
            vectors, new, missed = self._lookup_insert(k, probe)
            n_new = int(np.count_nonzero(new))
            if n_new:
                # every occurrence of a new key missed (a repeated one is inserted once); a
                # bytes-key table counts them during its probe (-1: not counted)
                misses = (n if n_new == n else int(missed[0]) if missed[0] >= 0
                          else count_repeats_of(k, new))
                stats["hits"] += n - misses
                stats["misses"] += misses
                stats["inserts"] += n_new
                policy.maybe_evict(self, lookup=k)
            else:
                stats["hits"] += n
            return vectors
        vectors, found = self.backend.get_field(k, "vector", **probe)  # PlainOnlyProbes
        vectors = self.layout.vectors(vectors)
        nfound = int(np.count_nonzero(found))
        stats["hits"] += nfound
        if nfound == n:
            return vectors
        stats["misses"] += n - nfound
        if nfound == 0:  # a batch of only new keys (a table being filled): no masking
            miss_keys = k
            vectors = new_vecs = self.initial(k)
        else:
            miss = ~found
            miss_keys = k[miss]
            new_vecs = self.initial(miss_keys)
            vectors[miss] = new_vecs
        if insert and not self.read_only:
            now = self.stamp_time()  # before admission counts this batch's sightings
            miss_counts = None if c is None else (c if nfound == 0 else c[~found])
            if known_distinct or distinct(miss_keys):
                uniq, seen = miss_keys, miss_counts
            else:
                uniq, first = unique_first(miss_keys)
                new_vecs = new_vecs[first]
                seen = (occurrences(miss_keys, uniq) if miss_counts is None
                        else sum_counts(miss_keys, uniq, miss_counts))
            if policy.admission is not None:
                if seen is None:
                    seen = np.ones(len(uniq), dtype=np.int64)
                ok = policy.admit_lookup(uniq, seen)
                uniq, new_vecs = uniq[ok], new_vecs[ok]
            if len(uniq):
                stats["inserts"] += self._insert(uniq, new_vecs, now)
                policy.maybe_evict(self, lookup=k)
        return vectors

    def _insert(self, keys: np.ndarray, vectors: np.ndarray, now: float | None = None) -> int:
        """Write new records of ``keys`` with these vectors where no record exists by now
        (another writer may have created one since the caller's read: insert-if-absent);
        return how many were written."""
        template = self.template(now)
        done = self.backend.insert_rows(keys, self.layout.encode_vectors(vectors), template)
        if done is not None and not done.all():
            keys, vectors = keys[done], vectors[done]
        if len(keys):
            self.observers.inserted(keys, vectors, template)
        return len(keys)

    def _lookup_insert(self, keys: np.ndarray, probe: dict[str, bool]
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``Backend.lookup_insert``: vectors, which keys were inserted (the first occurrence
        of each new key) and, where the backend counted them, how many positions missed (one
        int64, -1 if not); observers are told about the new rows. ``probe``: see
        :meth:`lookup`."""
        made: list[np.ndarray] = []
        # read before the backend places new keys: a clock that fails fails before any write
        now = self.stamp_time()

        def template() -> np.ndarray:
            made.append(self.template(now))
            return made[-1]

        new = np.zeros(len(keys), dtype=bool)
        missed = np.full(1, -1, dtype=np.int64)
        vectors, n_new = self.backend.lookup_insert(keys, self.initial_stored, template, new=new,
                                                    missed=missed, **probe)
        vectors = self.layout.vectors(vectors)
        if n_new and self.observers.registered:
            self.observers.inserted(keys[new], vectors[new], made[-1])
        return vectors, new, missed

    # -- update ------------------------------------------------------------------------------------
    def apply_gradients(self, k: np.ndarray, g: np.ndarray, c: np.ndarray | None,
                        known_distinct: bool = False) -> None:
        """``update`` of clean keys and gradients: one optimizer step per distinct key.
        ``known_distinct``: no key of ``k`` repeats (a caller's dedupe found them), so the
        rows need no summing; bytes keys then skip :func:`coalesce`, which would hash and
        compare every key to find that (int64 keys take it still: it sorts them, in O(n)
        where they come sorted)."""
        if known_distinct and k.dtype == object:
            uniq, summed, mult = k, g, np.ones(len(k), dtype=np.int64)
        else:
            uniq, summed, mult = coalesce(k, g)
        if c is not None:
            mult = sum_counts(k, uniq, c)
        self.apply_distinct(uniq, summed, mult, len(k))

    def apply_distinct(self, uniq: np.ndarray, summed: np.ndarray, mult: np.ndarray,
                       n_rows: int) -> None:
        """One optimizer step for each of the distinct keys ``uniq`` (``n_rows`` rows given)."""
        now = self.stamp_time()
        self.step += 1
        self.stats["updates"] += n_rows
        wide = self.layout.is_wide
        axpy = self.optimizer.axpy_step(summed) if wide else None
        rule = self.optimizer.row_rule() if (wide and axpy is None) else None
        if (axpy is not None or rule is not None) and self.backend.supports_row_update:
            # The step is plain field arithmetic, or a rule of each row and its gradient
            # alone: the backend applies it where the records live (observers are told the
            # same update); only keys without a record yet go the general way below.
            counts = {"count": mult} if "count" in self.layout.meta_names else {}
            row_update = RowUpdate(axpy or ("vector", 1.0, summed), counts, self.stamps(now), rule)
            found = self.backend.update_rows(uniq, row_update)
            if self.observers.registered:  # none: not even a call (the training step's path)
                self.observers.row_updated(uniq, row_update, found)
            if found.all():
                self.policy.after_update(self)
                return
            new = ~found
            uniq, summed, mult = uniq[new], summed[new], mult[new]
        self._update_records(uniq, summed, mult, now)
        self.policy.after_update(self)

    def _update_records(self, uniq: np.ndarray, summed: np.ndarray, mult: np.ndarray,
                        now: float | None = None) -> None:
        """One optimizer step on the records of ``uniq``, read and written back by one
        ``Backend.modify``; stats, tombstones and observers follow its last call's outcome."""
        policy = self.policy
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

        self.backend.modify(uniq, step)
        recs, found, keep, drop = last[0]
        if policy.admission is not None and not found.all():
            missing = ~found
            policy.count_update(admitted[missing], fresh[missing])
        written = np.ones(n, dtype=bool) if keep is None else keep
        self.stats["inserts"] += int(np.count_nonzero(written & ~found))
        if drop is not None and drop.any():
            policy.counters["pruned"] += int(np.count_nonzero(drop))
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

    # -- assign and delete -------------------------------------------------------------------------
    def assign(self, uniq: np.ndarray, values: np.ndarray) -> None:
        """Set the vectors of ``uniq`` (new keys get fresh records) in one ``modify``."""
        last: list[Any] = [None]
        stored = self.layout.encode_vectors(values)
        now = self.stamp_time()

        def assign(recs: np.ndarray, found: np.ndarray) -> None:
            if not found.all():
                new = ~found
                recs[new] = self._new_records(uniq[new], values[new])
            recs["vector"] = stored
            self._stamp(recs, now)
            last[0] = (recs, found)

        found = self.backend.modify(uniq, assign)
        recs = last[0][0]
        self.stats["inserts"] += int(len(uniq) - np.count_nonzero(found))
        self.stats["assigns"] += len(uniq)
        self._after_modify(uniq, recs, found, None)

    def _after_modify(self, keys: np.ndarray, recs: np.ndarray, found: np.ndarray,
                      keep: np.ndarray | None) -> None:
        """Side effects of a ``modify``: deletes counted and logged, observers told."""
        if keep is not None:
            gone = found & ~keep
            if gone.any():
                self._deleted(keys[gone])
            if not keep.all():
                keys, recs = keys[keep], recs[keep]
        if len(keys):
            self.observers.wrote(keys, recs)

    def delete(self, keys: np.ndarray) -> int:
        """Delete the rows of distinct clean ``keys``; return how many were present."""
        present = self.backend.delete(keys)
        n = int(np.count_nonzero(present))
        if n:
            self._deleted(keys[np.asarray(present, dtype=bool)])
        return n

    def _deleted(self, gone: np.ndarray) -> None:
        """Record rows that left the table: counted, logged as tombstones, observers told."""
        self.stats["deletes"] += len(gone)
        self.policy.tombstones.add(gone, self.next_version())
        self.observers.deleted(gone)

    def clear(self, batch_size: int) -> int:
        """Delete every row (as a delete of all keys); return how many."""
        require_scan(self.backend, "clear()")
        batches = [keys for keys, _ in self.backend.scan(batch_size)]
        if not batches:
            return 0
        return self.delete(unique_first(np.concatenate(batches))[0])

    # -- whole tables ------------------------------------------------------------------------------
    def bulk_load(self, batches: Iterable[tuple[Any, np.ndarray]],
                  header: dict[str, Any] | None) -> int:
        """``load_records``: whole records written around the engine's write path, then the
        version clock, step and policy state moved forward to cover them."""
        top = [self.version]

        def clean() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for keys, recs in batches:
                keys = normalize_keys(keys, self.key_type)
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

        n = self.backend.bulk_load(clean())
        self.observers.bulk_loaded()  # bulk loads bypass the engine's writes: indexes resync
        self.version = max(self.version, top[0])
        if header:
            self.step = max(self.step, int(header.get("step", 0)))
            self.policy.load_from_header(header.get("extra") or {})
        self._resync_policy()
        return n

    def replaced(self, step: int, version: int, header: dict[str, Any]) -> None:
        """The state after the backend swapped a whole table in (a restore)."""
        self.step, self.version = step, version
        extra = header.get("extra")
        if isinstance(extra, dict) and extra.get("policies"):
            # admission state (checked whole before the swap), saved with the next flush
            self.policy.load_from_header(extra)
        self.observers.bulk_loaded()  # the rows changed under the engine: indexes resync
        self._resync_policy()

    def _resync_policy(self) -> None:
        if self.policy.eviction is not None:
            self.policy.resync_rows(self)
            self.policy.maybe_evict(self)

    # -- the fused bag path (embstore.engine.fused) --------------------------------------------
    def fused_ok(self) -> bool:
        """Whether the fused bag path applies now (see ``EmbeddingStore.fused_bags``)."""
        return bool(self.backend.supports_fused_bags and self.key_type == "int64"
                    and self.layout.fused_kernels and not self.read_only
                    and (self.policy.admission is None
                         or getattr(self.backend, "supports_fused_admission", False))
                    and not self.observers.registered)

    def pool(self, batch: BagBatch, out: np.ndarray | None = None,
             threads: int = 1) -> np.ndarray:
        """The pooled bags of ``batch`` (into ``out`` when given: ``(n_bags, dim)`` float32,
        rows contiguous), new ids inserted (counted as ``lookup`` counts)."""
        uniq = batch.uniq
        n = len(uniq)
        if out is None:
            out = np.empty((batch.n_bags, self.layout.dim), dtype=np.float32)  # pool sets all
        self.stats["lookups"] += n
        if not n:
            out.fill(0.0)
            return out
        pooling = cast("FusedBagPooling", self.backend)  # supports_fused_bags
        kw, admit = batch.pooling(self.layout.dim), None
        template: Callable[[], np.ndarray] = self.template
        if self.policy.admission is not None:  # asked about the absent keys as lookup asks
            kw["admit"] = admit = AbsentKeys(self.policy, batch, self.stamp_time, self.template)
            template = admit.template
        n_new = pooling.lookup_pool(uniq, self.initial_stored, template, batch.inv,
                                    batch.offsets, batch.weights, batch.mean, out, threads, **kw)
        misses = n_new if admit is None else admit.absent
        self.stats["hits"] += n - misses
        if misses:
            self.stats["misses"] += misses
        if n_new:
            self.stats["inserts"] += n_new
            self.policy.maybe_evict(self, lookup=uniq)
        return out
