"""``DynamicEmbeddingBagCollection``: many jagged features over a few store-backed tables.

The counterpart of TorchRec's ``EmbeddingBagCollection`` (mapping in ``docs/adapters.md``): each
table is one store; several features may share a table; each feature has its own pooling. Per
table and batch, the ids of all its features are deduplicated together and looked up in *one*
store call, and the backward pass applies *one* ``store.update`` with the gradient summed over
every feature that used a key — what a shared table's fused optimizer does in TorchRec, and what
keeps stateful optimizers (Adagrad, Adam) exact where one update per feature would not be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from embstore import StoreProtocol
from embstore.errors import InvalidInputError
from embstore.keys import normalize

from . import _compiled, _fused, _fused_tables
from ._bridges import Sink, StoreBag, StoreGather, StoreRows
from ._keys import KeyBatch, factorize, int_batch, integer_ids
from .jagged import KeyedJagged, PooledFeatures, as_keyed_jagged
from .modules import StoreModule, padding_key_of

__all__ = ["DynamicEmbeddingBagCollection"]

_MODES = ("sum", "mean", "max")
_BLOCK = "\0block"  # _pool_table's (features, batch, dim) result, beside the per-feature views


class _Table(StoreModule):
    """One table of the collection: its store, lookup, padding key and checkpoint entry."""

    def __init__(self, store: StoreProtocol, trainable: bool | None, count: bool,
                 padding_key: Any) -> None:
        super().__init__(store, trainable, count, padding_key)

    def rows(self, batch: KeyBatch) -> torch.Tensor:
        """The rows of ``batch.uniq``, wired to the store's update where trainable."""
        vectors, sink = self._lookup(batch)
        if sink is None:
            return torch.from_numpy(vectors)
        return StoreRows.apply(torch.empty(0, requires_grad=True), vectors, sink)

    def vectors(self, batch: KeyBatch) -> tuple[np.ndarray, Sink | None]:
        """The vectors of ``batch.uniq`` and the sink of their gradient (None: frozen)."""
        return self._lookup(batch)

    def drop_padding(self, batch: KeyBatch, offs: torch.Tensor,
                     psw: torch.Tensor | None) -> tuple[KeyBatch, torch.Tensor,
                                                        torch.Tensor | None]:
        """The bags without their padding elements (``StoreModule._drop_padding``)."""
        batch, offs, _, psw = self._drop_padding(batch, offs, 0, psw)
        return batch, offs, psw

    def fused_store(self) -> StoreProtocol | None:
        """The store, where this training forward may take the fused path (no padding key,
        a store that pools in place), else None."""
        if self.padding_key is not None or not self._writes() or not self._counts:
            return None
        store = self._store_here()
        return store if _fused.store_pools(store) else None

    def pool_fused(self, ids: torch.Tensor, offsets: torch.Tensor, weights: Any,
                   mode: str) -> torch.Tensor:
        """The bags of int64 ``ids`` (``offsets``: their starts) pooled by ``mode`` through
        the fused bag path (``_fused.eager_bag``): one autograd node, whose backward steps
        the store (call it where :meth:`fused_store` gave the store)."""
        return _fused.eager_bag(self._buffers["_trigger"], self._eager_how(mode), ids, offsets,
                                weights)

    def placed(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` in this table's device and dtype (the collection's output follows its
        first table's)."""
        return self._output(out)


class DynamicEmbeddingBagCollection(nn.Module):
    """Pooled embeddings of many jagged features over store-backed tables.

    Parameters
    ----------
    tables : mapping of str to embstore.EmbeddingStore
        One store per table (``embedding_dim`` is each store's ``dim``).
    features : mapping of str to str, optional
        Feature name -> table name; several features may share a table. Default: one feature
        per table, named like it. The output lists features in this order.
    pooling : {"sum", "mean", "max"} or mapping of feature to mode
        Per-feature pooling (default "sum"); an empty bag pools to zeros.
    trainable, count : bool, optional
        As in :class:`~embstore_torch.DynamicEmbedding`, for every table.
    padding_key : key or mapping of table to key, optional
        Ids left out of their bag (no row, no gradient), as ``DynamicEmbeddingBag``'s.
    namespaces : mapping of feature to namespace, or True, optional
        Per-feature key namespaces in a shared table (Monolith's feature slots): the same raw
        id in two features gets two rows. In a bytes table a feature's key ``k`` is stored as
        ``b"<namespace>=" + k`` (``True``: every feature of a bytes table uses its own name);
        in an int64 table the namespace is an int in ``[0, 255]`` put in the key's top 8 bits
        (``namespace << 56 | id``), so ids must lie in ``[0, 2**56)``. Features not named
        keep their raw keys.

    Notes
    -----
    ``forward(features)`` takes a :class:`~embstore_torch.KeyedJagged`, a TorchRec
    ``KeyedJaggedTensor`` (duck-typed) or a dict ``{feature: bags}`` (see
    :meth:`KeyedJagged.from_dict`) and returns :class:`~embstore_torch.PooledFeatures`
    (``values()`` is ``(batch, sum of dims)``; ``to_dict()`` per feature). Per-id weights
    (weighted features) need "sum" pooling. ``state_dict()`` holds each table's rows under
    ``embedding_bags.<table>._extra_state``. Tables may have different key types (an int64
    table next to a bytes one); a feature's bags may be given as lists of lists (multi-hot),
    a 2-D tensor (fixed-size bags), a 1-D tensor or flat list (one id per sample).

    With one table per feature and stores that pool in place (``store.fused_bags()``), a
    training forward pools every table (sum, mean or max) straight into its columns of one
    output under one autograd node (``_fused_tables.py``; set ``use_fused_path`` to False to
    turn it off); both paths give the same bits.
    """

    use_fused_path = True

    def __init__(self, tables: Mapping[str, StoreProtocol],
                 features: Mapping[str, str] | None = None,
                 pooling: str | Mapping[str, str] = "sum", *, trainable: bool | None = None,
                 count: bool = True, padding_key: Any = None,
                 namespaces: Mapping[str, Any] | bool | None = None) -> None:
        super().__init__()
        if not tables:
            raise InvalidInputError("give at least one table")
        if len({id(s) for s in tables.values()}) != len(tables):
            raise InvalidInputError("each table needs its own store (share a table across "
                                    "features with features=, not a store across tables)")
        features = dict(features) if features is not None else {t: t for t in tables}
        unknown = sorted({t for t in features.values() if t not in tables})
        if unknown:
            raise InvalidInputError(f"features name unknown tables {unknown}; "
                                    f"tables are {sorted(tables)}")
        modes = (dict.fromkeys(features, pooling) if isinstance(pooling, str)
                 else {f: pooling.get(f, "sum") for f in features})
        stray = [] if isinstance(pooling, str) else sorted(set(pooling) - set(features))
        bad = {f: m for f, m in modes.items() if m not in _MODES}
        if stray or bad:
            raise InvalidInputError(f"pooling: unknown features {stray} or modes {bad} "
                                    f"(modes are {_MODES})")
        pads = (padding_key if isinstance(padding_key, Mapping)
                else dict.fromkeys(tables, padding_key))
        self.embedding_bags = nn.ModuleDict({
            name: _Table(store, trainable, count, padding_key_of(store, pads.get(name), None))
            for name, store in tables.items()})
        self.features = features
        self.pooling = modes
        self.namespaces = _namespaces(namespaces, features, tables)
        self._by_table = {t: [f for f, tt in features.items() if tt == t] for t in tables}
        # the one table serving every feature (its features in output order), if there is one
        self._single = [t for t, fs in self._by_table.items() if fs == list(features)]

    @property
    def embedding_dims(self) -> dict[str, int]:
        return {f: self.embedding_bags[t].embedding_dim for f, t in self.features.items()}

    def forward(self, features: Any) -> PooledFeatures:
        if torch.compiler.is_compiling():
            pooled = self._compiled_fused(features)
            if pooled is not None:  # one embstore::fused_tables node for every table
                return pooled
            # other store calls: a graph break, the model around them compiles
            return _compiled.graph_break(self._forward)(features)
        return self._forward(features)

    def _compiled_fused(self, features: Any) -> PooledFeatures | None:
        """The fused forward under ``torch.compile`` (``_fused_tables.compiled``), or None
        where it does not apply: a :class:`KeyedJagged` of the collection's features with
        integer CPU ids, and tables the fused path takes."""
        if not isinstance(features, KeyedJagged):
            return None
        values, keys, weights = features.values(), features.keys(), features.weights_or_none()
        if (not isinstance(values, torch.Tensor) or not integer_ids(values)
                or sorted(keys) != sorted(self.features)):
            return None
        parts = self._fused_parts(weights)
        if parts is None:
            return None
        tables = [self.embedding_bags[t] for t in self.features.values()]
        out = _fused_tables.compiled(values, features.lengths(), weights, tables,
                                     [keys.index(f) for f in self.features],
                                     [p.mode for p in parts], features.stride())
        return PooledFeatures(list(self.features), [p.dim for p in parts],
                              tables[0].placed(out))

    def _forward(self, features: Any) -> PooledFeatures:
        keys, values, lengths, stride, weights = as_keyed_jagged(features)
        missing = [f for f in self.features if f not in keys]
        extra = [k for k in keys if k not in self.features]
        if missing or extra:
            raise InvalidInputError(f"input features {keys} do not match the collection's "
                                    f"{list(self.features)} (missing {missing}, unknown {extra})")
        bad = [f for f in self.features if weights is not None and self.pooling[f] != "sum"]
        if bad:  # checked before any table is read: bad input writes nothing
            raise InvalidInputError(f"weighted features need sum pooling: {bad}")
        ordered = isinstance(features, KeyedJagged)  # (its lengths were checked: bounds rise)
        bounds = (features.offsets_array() if ordered
                  else np.concatenate(([0], np.cumsum(lengths))))
        where = {k: i for i, k in enumerate(keys)}  # feature -> its block of bags
        parts = self._fused_parts(weights)
        flat = _fused.int64_ids(values) if parts is not None else None
        if parts is not None and flat is not None:
            first = next(iter(self.embedding_bags.values()))
            out = _fused_tables.pool(parts, [where[f] for f in self.features], flat, bounds,
                                     stride, weights, first.pooled_pinned, ordered)
            return PooledFeatures(list(self.features), [p.dim for p in parts],
                                  first.placed(out))
        shared = None if parts is not None else self._shared_fused(keys, values, bounds,
                                                                   stride, weights, ordered)
        if shared is not None:
            return PooledFeatures(list(self.features), [shared.shape[1] // len(keys)] * len(keys),
                                  shared)
        pooled: dict[str, torch.Tensor] = {}
        block = None
        for table, feats in self._by_table.items():
            if feats:
                part = self._pool_table(self.embedding_bags[table], feats, values, lengths,
                                        bounds, where, stride, weights)
                block = part.pop(_BLOCK, None)
                pooled.update(part)
        first = self.embedding_bags[next(iter(self.embedding_bags))]
        order = list(self.features)
        if block is not None and len(getattr(self, "_single", ())) == 1:
            # one table pooled every feature, in output order, as (features, batch, dim):
            # one transposing copy instead of a split and a concatenation
            out = block.transpose(0, 1).reshape(stride, -1)
        else:
            out = (torch.cat([pooled[f] for f in order], dim=1) if order
                   else torch.zeros(stride, 0))
        if (not out.requires_grad and torch.is_grad_enabled()
                and any(t.trainable for t in self.embedding_bags.values())):
            out.requires_grad_(True)  # a batch without ids: backward runs, writes nothing
        return PooledFeatures(order, [pooled[f].shape[1] for f in order], first.placed(out))

    def _shared_fused(self, keys: Any, values: Any, bounds: np.ndarray, stride: int,
                      weights: Any, ordered: bool) -> torch.Tensor | None:
        """The ``(stride, sum of dims)`` output where one table serves every feature in the
        input's order, pooled one way (sum or mean), and its store pools in place: every
        feature's bags in one fused call (``_fused.eager_bag``, as a ``DynamicEmbeddingBag``
        over all of them: one dedupe and probe, one autograd node, one ``update_bags``), the
        ``(features, batch, dim)`` block placed where the table's module lives, then
        transposed into the output there. None where the general path runs (it gives the
        same bits)."""
        if (not self.use_fused_path or self.namespaces or len(self._single) != 1
                or not self.features or list(keys) != list(self.features) or not stride):
            return None
        modes = {self.pooling[f] for f in self.features}
        mode = modes.pop()
        if (modes or mode not in ("sum", "mean") or not _fusable_weights(weights)
                or (weights is not None and mode != "sum")):
            return None
        if not ordered and (bounds[1:] < bounds[:-1]).any():
            return None  # (bad lengths: the general path says so)
        table = self.embedding_bags[self._single[0]]
        flat = _fused.int64_ids(values)
        if flat is None or not len(flat) or table.fused_store() is None:
            return None
        offsets = torch.from_numpy(np.ascontiguousarray(bounds[:-1], dtype=np.int64))
        pooled = table.placed(table.pool_fused(torch.from_numpy(flat), offsets, weights, mode))
        return pooled.reshape(len(self.features), stride, -1).transpose(0, 1).reshape(stride, -1)

    def _fused_parts(self, weights: Any) -> list[_fused_tables.Part] | None:
        """The tables of a fused forward (``_fused_tables.py``) in output order, or None
        where the general path runs."""
        if not self.use_fused_path or self.namespaces or not _fusable_weights(weights):
            return None
        parts, column = [], 0
        tables = dict(self.embedding_bags.items())  # (a ModuleDict's [] costs a microsecond)
        for feature, name in self.features.items():
            mode = self.pooling[feature]
            if (len(self._by_table[name]) != 1 or mode not in ("sum", "mean", "max")
                    or (weights is not None and mode != "sum")):
                return None
            table = tables[name]
            store = table.fused_store()
            if store is None:
                return None
            parts.append(_fused_tables.Part(store, column, table.embedding_dim, mode,
                                            table.count))
            column += table.embedding_dim
        return parts

    def _pool_table(self, table: _Table, feats: list[str], values: Any, lengths: np.ndarray,
                    bounds: np.ndarray, where: dict[str, int], stride: int,
                    weights: torch.Tensor | None) -> dict[str, torch.Tensor]:
        # The table's bags, feature after feature: one key batch, one lookup, one update.
        spans = [(bounds[where[f] * stride], bounds[(where[f] + 1) * stride]) for f in feats]
        bag_lens = np.concatenate([lengths[where[f] * stride:(where[f] + 1) * stride]
                                   for f in feats])
        batch = self._key_batch(table, values, spans, feats)
        offs = torch.from_numpy(np.concatenate(([0], np.cumsum(bag_lens)[:-1])))
        psw = None
        if weights is not None:
            w = torch.as_tensor(weights, dtype=torch.float32).reshape(-1).cpu()
            psw = torch.cat([w[a:b] for a, b in spans])
        batch, offs, psw = table.drop_padding(batch, offs, psw)
        modes = {self.pooling[f] for f in feats}
        mode = modes.pop() if len(modes) == 1 else None
        if mode in ("sum", "mean") and len(batch.uniq):
            # One fused pooling + per-key gradient sum over every feature's bags (the
            # grouping of the dedupe reused), as DynamicEmbeddingBag does.
            vectors, sink = table.vectors(batch)
            # single-id bags (a gather) only when every bag holds exactly one id: as many ids
            # as bags is not enough ([[0, 1], [], [2]] has three of each)
            single = len(offs) == len(batch.inv) and bool(
                torch.equal(offs, torch.arange(len(offs), dtype=offs.dtype)))
            size = 1 if single else 0
            if sink is None:
                pooled = F.embedding_bag(batch.inv, torch.from_numpy(vectors), offs,
                                         mode=mode, per_sample_weights=psw)
            elif size and psw is None:  # every bag one id: the fused gather
                pooled = StoreGather.apply(torch.empty(0, requires_grad=True), vectors,
                                            batch, sink)
            else:
                pooled = StoreBag.apply(torch.empty(0, requires_grad=True), psw, vectors,
                                         batch, offs, size, mode, sink)
            block = pooled.reshape(len(feats), stride, -1)
            return {**dict(zip(feats, block, strict=True)), _BLOCK: block}
        if len(batch.uniq):
            rows = table.rows(batch)
        else:  # no ids: zeros that a backward still runs through (and writes nothing)
            rows = torch.zeros(0, table.embedding_dim,
                               requires_grad=table.trainable and torch.is_grad_enabled())
        inv = batch.inv.reshape(-1)
        if mode is not None and len(inv):  # one embedding_bag over every feature's bags
            pooled = F.embedding_bag(inv, rows, offs, mode=mode, per_sample_weights=psw)
            return dict(zip(feats, pooled.reshape(len(feats), stride, -1), strict=True))
        n = len(inv)
        out: dict[str, torch.Tensor] = {}
        for i, f in enumerate(feats):
            bag_offs = offs[i * stride:(i + 1) * stride]
            lo = int(bag_offs[0]) if stride else 0
            hi = int(offs[(i + 1) * stride]) if (i + 1) * stride < len(offs) else n
            if hi == lo:  # no ids at all for this feature: zeros, as an empty bag pools
                out[f] = torch.zeros(stride, table.embedding_dim)
                continue
            out[f] = F.embedding_bag(inv[lo:hi], rows, bag_offs - lo, mode=self.pooling[f],
                                     per_sample_weights=None if psw is None else psw[lo:hi])
        return out

    def _key_batch(self, table: _Table, values: Any, spans: list[tuple[int, int]],
                   feats: list[str]) -> KeyBatch:
        """The table's keys, feature after feature (namespaced where asked), deduplicated."""
        whole = len(spans) == 1 and spans[0] == (0, len(values))
        if table.store.key_type == "int64":
            # this table's features span all of ``values`` in input order (the common
            # single-table collection): its keys are ``values``, normalized once, not per feature
            every = whole or (spans[0][0] == 0 and spans[-1][1] == len(values) and all(
                b == a for (_, b), (a, _) in zip(spans, spans[1:])))
            if every and not self.namespaces and isinstance(values, (np.ndarray, torch.Tensor)):
                flat = (normalize(values, "int64") if isinstance(values, np.ndarray)
                        else _int_tensor(values))
                return int_batch(flat, (len(flat),))
            if isinstance(values, torch.Tensor):
                arr = _int_tensor(values)
                parts = [arr[a:b] for a, b in spans]
            elif isinstance(values, np.ndarray):
                parts = [normalize(values[a:b], "int64") for a, b in spans]
            else:  # a list, possibly mixing this table's ints with another table's strings
                parts = [normalize(list(values[a:b]), "int64") for a, b in spans]
            parts = [_int_namespace(p, self.namespaces.get(f), f) for p, f in zip(
                parts, feats, strict=True)]
            flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
            return int_batch(np.ascontiguousarray(flat, dtype=np.int64), (len(flat),))
        named = any(f in self.namespaces for f in feats)
        if whole and not named:
            flat = values if isinstance(values, np.ndarray) else _objects(values)
        else:
            flat = np.concatenate([_bytes_namespace(_objects(values[a:b]),
                                                    self.namespaces.get(f))
                                   for (a, b), f in zip(spans, feats, strict=True)])
        uniq, inv = factorize(flat)
        return KeyBatch(uniq, torch.from_numpy(inv), (len(flat),))

    def extra_repr(self) -> str:
        return f"features={self.features}, pooling={self.pooling}"


def _fusable_weights(weights: Any) -> bool:
    """Whether a fused forward takes these per-id weights: none, or a tensor that needs no
    gradient (the fused backward steps the tables only)."""
    return weights is None or (isinstance(weights, torch.Tensor) and not weights.requires_grad)


def _int_tensor(values: torch.Tensor) -> np.ndarray:
    arr = values.detach().cpu()
    return np.ascontiguousarray((arr.view(torch.int64) if arr.dtype == torch.uint64
                                 else arr.to(torch.int64)).numpy())


def _objects(values: Any) -> np.ndarray:
    """A 1-D object array of str/bytes keys (one C loop, no per-key Python list)."""
    if isinstance(values, np.ndarray):
        return values if values.dtype == object else values.astype(object)
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


def _namespaces(spec: Any, features: Mapping[str, str],
                tables: Mapping[str, StoreProtocol]) -> dict[str, Any]:
    """Validated ``{feature: namespace}``: bytes for bytes tables, an int for int64 ones."""
    if spec is None or spec is False:
        return {}
    if spec is True:
        spec = {f: f for f, t in features.items() if tables[t].key_type == "bytes"}
    out: dict[str, Any] = {}
    for f, ns in dict(spec).items():
        if f not in features:
            raise InvalidInputError(f"namespaces: unknown feature {f!r}")
        if tables[features[f]].key_type == "int64":
            if not isinstance(ns, (int, np.integer)) or isinstance(ns, bool) \
                    or not 0 <= int(ns) < 256:
                raise InvalidInputError(f"namespaces: feature {f!r} of an int64 table needs an "
                                        f"int namespace in [0, 255], got {ns!r}")
            out[f] = int(ns)
        else:
            b = ns.encode("utf-8") if isinstance(ns, str) else ns
            if not isinstance(b, bytes) or b"=" in b:
                raise InvalidInputError(f"namespaces: feature {f!r} needs a str/bytes "
                                        f"namespace without '=', got {ns!r}")
            out[f] = b + b"="
    return out


_ID_BITS = 56


def _int_namespace(keys: np.ndarray, ns: int | None, feature: str) -> np.ndarray:
    if ns is None or not len(keys):
        return keys
    if int(keys.min()) < 0 or int(keys.max()) >= 1 << _ID_BITS:
        raise InvalidInputError(f"feature {feature!r} has a namespace: its ids must lie in "
                                f"[0, 2**{_ID_BITS}) (the top 8 bits hold the namespace)")
    return keys | np.int64(ns << _ID_BITS) if ns < 128 else \
        keys | np.int64((ns << _ID_BITS) - (1 << 64))


def _bytes_namespace(keys: np.ndarray, prefix: bytes | None) -> np.ndarray:
    if prefix is None:
        return keys
    return np.array([prefix + (k.encode("utf-8") if isinstance(k, str) else bytes(k))
                     for k in keys.tolist()], dtype=object)
