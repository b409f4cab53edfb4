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
from embstore.keys import normalize_keys

from ._keys import KeyBatch, _int_batch, factorize
from .jagged import PooledFeatures, as_keyed_jagged
from .modules import _padding_key, _StoreModule, _StoreRows

__all__ = ["DynamicEmbeddingBagCollection"]

_MODES = ("sum", "mean", "max")


class _Table(_StoreModule):
    """One table of the collection: its store, lookup, padding key and checkpoint entry."""

    def __init__(self, store: StoreProtocol, trainable: bool | None, count: bool,
                 padding_key: Any) -> None:
        super().__init__(store, trainable, count, padding_key)

    def rows(self, batch: KeyBatch) -> torch.Tensor:
        vectors, sink = self._lookup(batch)
        if sink is None:
            return torch.from_numpy(vectors)
        return _StoreRows.apply(torch.empty(0, requires_grad=True), vectors, sink)


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

    Notes
    -----
    ``forward(features)`` takes a :class:`~embstore_torch.KeyedJagged`, a TorchRec
    ``KeyedJaggedTensor`` (duck-typed) or a dict ``{feature: bags}`` (see
    :meth:`KeyedJagged.from_dict`) and returns :class:`~embstore_torch.PooledFeatures`
    (``values()`` is ``(batch, sum of dims)``; ``to_dict()`` per feature). Per-id weights
    (weighted features) need "sum" pooling. ``state_dict()`` holds each table's rows under
    ``embedding_bags.<table>._extra_state``.
    """

    def __init__(self, tables: Mapping[str, Any], features: Mapping[str, str] | None = None,
                 pooling: str | Mapping[str, str] = "sum", *, trainable: bool | None = None,
                 count: bool = True, padding_key: Any = None) -> None:
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
            name: _Table(store, trainable, count, _padding_key(store, pads.get(name), None))
            for name, store in tables.items()})
        self.features = features
        self.pooling = modes
        self._by_table = {t: [f for f, tt in features.items() if tt == t] for t in tables}

    @property
    def embedding_dims(self) -> dict[str, int]:
        return {f: self.embedding_bags[t].embedding_dim for f, t in self.features.items()}

    @torch.compiler.disable  # the store calls: a graph break, the model around it compiles
    def forward(self, features: Any) -> PooledFeatures:
        keys, values, lengths, stride, weights = as_keyed_jagged(features)
        missing = [f for f in self.features if f not in keys]
        extra = [k for k in keys if k not in self.features]
        if missing or extra:
            raise InvalidInputError(f"input features {keys} do not match the collection's "
                                    f"{list(self.features)} (missing {missing}, unknown {extra})")
        bad = [f for f in self.features if weights is not None and self.pooling[f] != "sum"]
        if bad:  # checked before any table is read: bad input writes nothing
            raise InvalidInputError(f"weighted features need sum pooling: {bad}")
        bounds = np.concatenate(([0], np.cumsum(lengths)))
        where = {k: i for i, k in enumerate(keys)}  # feature -> its block of bags
        pooled: dict[str, torch.Tensor] = {}
        for table, feats in self._by_table.items():
            if feats:
                pooled.update(self._pool_table(self.embedding_bags[table], feats, values,
                                               lengths, bounds, where, stride, weights))
        dev = self.embedding_bags[next(iter(self.embedding_bags))]._anchor.device
        order = list(self.features)
        out = torch.cat([pooled[f] for f in order], dim=1) if order else torch.zeros(stride, 0)
        return PooledFeatures(order, [pooled[f].shape[1] for f in order], out.to(dev))

    def _pool_table(self, table: _Table, feats: list[str], values: Any, lengths: np.ndarray,
                    bounds: np.ndarray, where: dict[str, int], stride: int,
                    weights: torch.Tensor | None) -> dict[str, torch.Tensor]:
        # The table's bags, feature after feature: one key batch, one lookup, one update.
        spans = [(bounds[where[f] * stride], bounds[(where[f] + 1) * stride]) for f in feats]
        bag_lens = np.concatenate([lengths[where[f] * stride:(where[f] + 1) * stride]
                                   for f in feats])
        batch = self._key_batch(table, values, spans)
        offs = torch.from_numpy(np.concatenate(([0], np.cumsum(bag_lens)[:-1])))
        psw = None
        if weights is not None:
            w = torch.as_tensor(weights, dtype=torch.float32).reshape(-1).cpu()
            psw = torch.cat([w[a:b] for a, b in spans])
        batch, offs, _, psw = table._drop_padding(batch, offs, 0, psw)
        if len(batch.uniq):
            rows = table.rows(batch)
        else:
            rows = torch.zeros(0, table.embedding_dim)
        inv = batch.inv.reshape(-1)
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

    @staticmethod
    def _key_batch(table: _Table, values: Any, spans: list[tuple[int, int]]) -> KeyBatch:
        if table.store.key_type == "int64":
            if isinstance(values, torch.Tensor):
                flat = values.detach().cpu()
                flat = (flat.view(torch.int64) if flat.dtype == torch.uint64
                        else flat.to(torch.int64)).numpy()
            else:
                flat = normalize_keys(values if isinstance(values, np.ndarray)
                                      else list(values), "int64")
            flat = np.concatenate([flat[a:b] for a, b in spans])
            return _int_batch(np.ascontiguousarray(flat), (len(flat),))
        flat = [k for a, b in spans for k in values[a:b]]
        uniq, inv = factorize(flat)
        return KeyBatch(uniq, torch.from_numpy(inv), (len(flat),))

    def extra_repr(self) -> str:
        return f"features={self.features}, pooling={self.pooling}"
