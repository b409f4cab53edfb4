"""Checking and merging the workers' answers into what one store would answer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ..errors import SchemaMismatchError, ShardMismatchError
from ..retrieval import TopKResult
from . import wire


def merge_top_k(tables: list[pa.Table], nq: int, k: int, key_type: str) -> TopKResult:
    """The ``k`` best of every worker's top-k candidates per query, ordered as one store
    orders them."""
    ks, ss, vs = [], [], []
    for t in tables:
        width = int(t.column("width")[0].as_py()) if t.num_rows else 0
        keys = wire.keys_from(t.column("key"), key_type)
        ks.append(keys.reshape(nq, width))
        ss.append(np.asarray(t.column("score").to_numpy(), np.float32).reshape(nq, width))
        vs.append(np.asarray(t.column("valid").to_numpy(zero_copy_only=False),
                             bool).reshape(nq, width))
    ck, cs, cv = np.concatenate(ks, axis=1), np.concatenate(ss, axis=1), np.concatenate(vs, 1)
    width = min(k, ck.shape[1])
    if ck.dtype == object:  # ties by key: rank the bytes keys, then sort as integers
        _, rank = np.unique(ck.reshape(-1), return_inverse=True)
        tie = rank.reshape(ck.shape)
    else:
        tie = ck
    # real items first, score descending (NaN after every number), ties by key ascending
    order = np.lexsort((tie, -cs, ~cv), axis=1)[:, :width]
    return TopKResult(np.take_along_axis(ck, order, axis=1),
                      np.take_along_axis(cs, order, axis=1),
                      np.take_along_axis(cv, order, axis=1))


def check_infos(infos: list[dict[str, Any]], addrs: list[str], url: str, dim: int | None,
                key_type: str | None) -> None:
    """The workers' ``info`` answers agree with their place in the URL and with each other
    (and with the dim and key type a client asked for)."""
    n = len(addrs)
    for s, info in enumerate(infos):
        if info["shard"] != s or info["shards"] != n:
            raise ShardMismatchError(
                f"{addrs[s]} is shard {info['shard']}/{info['shards']}, listed as "
                f"{s}/{n} in {url}")
    first = infos[0]["meta"]
    for s, info in enumerate(infos[1:], 1):
        for field in ("dim", "key_type", "layout", "optimizer"):
            if info["meta"][field] != first[field]:
                raise SchemaMismatchError(f"{addrs[s]} serves another {field} than "
                                          f"{addrs[0]}")
    if dim is not None and dim != first["dim"]:
        raise SchemaMismatchError(f"{url} holds dim {first['dim']}, not {dim}")
    if key_type is not None and key_type != first["key_type"]:
        raise SchemaMismatchError(f"{url} holds {first['key_type']} keys, not "
                                  f"{key_type}")
