"""``des://host:port[,host:port...]``: a store whose shards are DynamicEmbedding Workers.

There is no master: the position of an address in the list is its shard index, keys go to
``key_hash64(key) % N`` (the routing of ``sharded://`` and ``embstore_torch.distributed``),
and the requests of one call go to the workers in parallel. ``top_k`` merges the workers'
``N x k`` candidates exactly as one store orders them; ``sample`` splits the draws over the
workers by their share of the sampling weight, as the distributed store does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from .. import optim
from .._keys import key_hash64, normalize_keys
from ..engine.batch import check_counts, check_rows, nd_keys
from ..errors import (
    InvalidInputError,
    ReadOnlyError,
    ShardMismatchError,
    StoreClosedError,
)
from ..io.native import NativeWriter
from ..layout import Layout
from ..retrieval import check_queries
from ..sampling.candidate import (
    check_num_sampled,
    expected_count,
    group_positives,
    merge_candidates,
)
from ..sampling.samplers import resolve_sampler
from . import wire
from .merge import check_infos, merge_top_k
from .push import Subscription, delta_rows
from .shm_client import ShmStreams
from .streams import STREAM_OPS
from .wire import SCHEME, parse_des_url

_T = TypeVar("_T")


class DesStore:
    """A client of one table served by N workers; satisfies :class:`embstore.StoreProtocol`.

    Parameters
    ----------
    url : str
        ``des://host:port[,host:port...]``; the list order is the shard order and must be the
        same for every client (a worker refuses another N or index).
    dim, key_type : optional
        Checked against the workers' table (``SchemaMismatchError`` on a difference).
    token : str, optional
        Bearer token (``train`` or ``serve`` role) when the workers run with ``--token-file``;
        also read from ``token_file=`` or the ``EMBSTORE_TOKEN`` environment variable.
    timeout : float
        Deadline of each call in seconds (default 30): a worker that does not answer in time
        raises ``BackendError`` naming it.
    tls_root_certs : str, optional
        PEM file of the CA that signed the workers' certificates (``grpc+tls`` then).
    shm : bool
        Rows through shared memory with workers on this host (default; ``?shm=0``: Flight).
    """

    collective = False
    layout: Layout
    read_only: bool

    def __init__(self, url: str, *, dim: int | None = None, key_type: str | None = None,
                 token: str | None = None, token_file: str | None = None,
                 timeout: float = 30.0, tls_root_certs: str | None = None,
                 read_only: bool = False, shm: bool = True) -> None:
        addrs, query = parse_des_url(url)
        token_file = token_file or query.get("token_file")
        if token is None and token_file:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        token = token or os.environ.get("EMBSTORE_TOKEN")
        timeout = float(query.get("timeout", timeout))
        if not timeout > 0:
            raise InvalidInputError(f"timeout must be positive, got {timeout}")
        self._addrs = addrs
        self._url = f"{SCHEME}://{','.join(addrs)}"
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        self._call = flight.FlightCallOptions(timeout=timeout, headers=headers)
        scheme = "grpc+tls" if tls_root_certs else "grpc+tcp"
        root = open(tls_root_certs, "rb").read() if tls_root_certs else None
        self._clients = [flight.FlightClient(f"{scheme}://{a}", tls_root_certs=root,
                                             generic_options=[("grpc.max_receive_message_length",
                                                               wire.GRPC_MESSAGE_BYTES)])
                         for a in addrs]
        self._pool = ThreadPoolExecutor(len(addrs), thread_name_prefix="embstore-des")
        self._streams = ShmStreams(self._clients, headers, timeout, shm and query.get("shm") != "0")
        self._headers = headers
        self._closed = False
        try:
            infos = self._each(lambda s: self._action(s, "info"))
            check_infos(infos, self._addrs, self._url, dim, key_type)
        except BaseException:
            self.close()
            raise
        meta = infos[0]["meta"]
        self.layout = Layout.from_json(meta["layout"])
        self._streams.ready(self.layout.dim, infos)
        self._key_type = str(meta["key_type"])
        self._optimizer = optim.resolve(meta["optimizer"])
        self._meta = meta
        self.read_only = bool(read_only) or any(i["read_only"] for i in infos)

    # -- calls -------------------------------------------------------------------------------
    def _where(self, s: int) -> str:
        return f"des://{self._addrs[s]} (shard {s}/{len(self._addrs)})"

    def _head(self, s: int) -> dict[str, Any]:
        return {"shard": s, "shards": len(self._addrs)}

    def _action(self, s: int, op: str, **fields: Any) -> Any:
        body = json.dumps({**self._head(s), **fields}).encode()
        try:
            results = list(self._clients[s].do_action(flight.Action(op, body), self._call))
        except flight.FlightError as e:
            wire.raise_remote(e, self._where(s))
        return json.loads(results[0].body.to_pybytes())

    def _exchange(self, s: int, op: str, batch: pa.RecordBatch,
                  **fields: Any) -> pa.Table | pa.RecordBatch:
        if op in STREAM_OPS:
            return self._streams.exchange(s, self._head(s), op, batch, fields, self._where(s))
        desc = wire.command(op, **self._head(s), **fields)
        try:
            writer, reader = self._clients[s].do_exchange(desc, self._call)
            with writer:
                writer.begin(batch.schema)
                writer.write_batch(batch)
                writer.done_writing()
                return reader.read_all()
        except (flight.FlightError, OSError) as e:  # OSError: the call closed under a write
            wire.raise_remote(e, self._where(s))
            raise  # unreachable: raise_remote always raises

    def _each(self, fn: Callable[[int], _T], shards: list[int] | None = None) -> list[_T]:
        """``fn(s)`` for every shard (or those given), in parallel; the first error raised."""
        todo = list(range(len(self._addrs))) if shards is None else shards
        if len(todo) == 1:
            return [fn(todo[0])]
        futures = [self._pool.submit(fn, s) for s in todo]
        return [f.result() for f in futures]

    def _route(self, keys: np.ndarray) -> list[tuple[int, np.ndarray | None]]:
        """``(shard, positions)`` of the shards holding some of ``keys`` (None: all of them)."""
        n = len(self._addrs)
        if n == 1:
            return [(0, None)]
        owner = (key_hash64(keys) % np.uint64(n)).astype(np.int64)
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(n + 1))
        return [(s, order[bounds[s]:bounds[s + 1]]) for s in range(n)
                if bounds[s + 1] > bounds[s]]

    def _keyed(self, op: str, keys: np.ndarray, make: Callable[[np.ndarray | None], dict],
               **fields: Any) -> list[tuple[np.ndarray | None, pa.Table | pa.RecordBatch]]:
        if len(self._addrs) == 1:  # one worker: no routing, no hand-off to the pool
            return [(None, self._exchange(0, op, wire.batch(**make(None)), **fields))]
        routes = self._route(keys)
        by_shard = dict(routes)

        def one(s: int) -> pa.Table | pa.RecordBatch:
            return self._exchange(s, op, wire.batch(**make(by_shard[s])), **fields)

        tables = self._each(one, [s for s, _ in routes])
        return [(sel, t) for (_, sel), t in zip(routes, tables, strict=True)]

    # -- StoreInfo ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._url

    @property
    def dim(self) -> int:
        return self.layout.dim

    @property
    def key_type(self) -> str:
        return self._key_type

    @property
    def optimizer(self) -> optim.Optimizer:
        assert self._optimizer is not None  # a stored table always records its optimizer
        return self._optimizer

    @property
    def meta(self) -> dict[str, Any]:
        """The table's metadata as shard 0 recorded it when this client connected."""
        return dict(self._meta)

    @property
    def step(self) -> int:
        """The largest step of the workers (each counts the updates it applied)."""
        return max(int(i["step"]) for i in self._each(lambda s: self._action(s, "info")))

    def check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self._url} is closed")

    def check_writable(self) -> None:
        self.check_open()
        if self.read_only:
            raise ReadOnlyError(f"{self._url} was opened read-only")

    def normalize_keys(self, keys: Any) -> np.ndarray:
        return normalize_keys(keys, self._key_type)

    # -- rows --------------------------------------------------------------------------------
    @property
    def admission(self) -> dict[str, Any] | None:
        """The workers' admission policy (its config), or None. The workers apply it; an
        adapter only needs to know there is one, to send occurrence ``counts``."""
        policies = (self._meta.get("extra") or {}).get("policies") or {}
        adm = policies.get("admission")
        return adm.get("config") if isinstance(adm, dict) else None

    def lookup(self, keys: Any, *, insert: bool = True, counts: Any = None) -> np.ndarray:
        """``(n, dim)`` float32 vectors in request order (N-D keys give ``(..., dim)``);
        unknown keys are inserted by their owner unless ``insert=False`` (``counts``: how often
        each key occurred, for an admission policy)."""
        self.check_open()
        flat, shape = nd_keys(keys)
        k = self.normalize_keys(flat)
        c = None if counts is None else check_counts(counts, len(k))
        insert = bool(insert) and not self.read_only
        out = np.empty((len(k), self.dim), np.float32)

        def cols(sel: np.ndarray | None) -> dict[str, Any]:
            d = {"key": wire.keys_column(k if sel is None else k[sel])}
            if c is not None:
                d["count"] = pa.array(c if sel is None else c[sel], pa.int64())
            return d

        if len(k):
            for sel, t in self._keyed("lookup", k, cols, insert=insert):
                rows = len(k) if sel is None else len(sel)
                v = wire.vectors_from(t.column("vec"), self.dim, rows)
                if sel is None:
                    out[:] = v
                else:
                    out[sel] = v
        return out.reshape(*shape, self.dim) if shape is not None else out

    def contains(self, keys: Any) -> np.ndarray:
        self.check_open()
        k = self.normalize_keys(keys)
        out = np.zeros(len(k), bool)
        if len(k):
            for sel, t in self._keyed("contains", k, lambda sel: {
                    "key": wire.keys_column(k if sel is None else k[sel])}):
                found = np.asarray(t.column("found").to_numpy(zero_copy_only=False), bool)
                out[slice(None) if sel is None else sel] = found
        return out

    def _write(self, op: str, keys: Any, rows: Any, counts: Any = None) -> None:
        self.check_writable()
        k = self.normalize_keys(keys)
        r = check_rows(rows, len(k), self.dim, "gradients" if op == "update" else "values")
        c = None if counts is None else check_counts(counts, len(k))
        if not len(k):
            return

        def cols(sel: np.ndarray | None) -> dict[str, Any]:
            out = {"key": wire.keys_column(k if sel is None else k[sel]),
                   "vec": wire.vectors_column(r if sel is None else r[sel])}
            if c is not None:
                out["count"] = pa.array(c if sel is None else c[sel], pa.int64())
            return out

        self._keyed(op, k, cols)

    def update(self, keys: Any, grads: Any, *, counts: Any = None) -> None:
        """Send gradients to their owners, which apply the table's optimizer (duplicates of a
        key summed first); per key, updates apply in the order workers receive them."""
        self._write("update", keys, grads, counts)

    def assign(self, keys: Any, values: Any) -> None:
        self._write("assign", keys, values)

    def delete(self, keys: Any) -> int:
        self.check_writable()
        k = self.normalize_keys(keys)
        if not len(k):
            return 0
        return sum(int(t.column("deleted")[0].as_py()) for _, t in self._keyed(
            "delete", k, lambda sel: {"key": wire.keys_column(k if sel is None else k[sel])}))

    def prefetch(self, keys: Any) -> None:
        """Nothing to do: a worker's own cache (``--cache``) loads what its callers read."""
        self.check_open()

    # -- retrieval and sampling ----------------------------------------------------------------
    def top_k(self, queries: Any, k: int, exclude: Any = None, *,
              approximate: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` by dot product over every worker's rows, ordered as one store orders
        them (score descending, NaN last, ties by key); a
        :class:`~embstore.retrieval.TopKResult`. Exact, or with ``approximate=True`` from the
        workers' ANN indexes (``--ann``; candidates re-scored exactly)."""
        self.check_open()
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k <= 0:
            raise InvalidInputError(f"k must be a positive int, got {k!r}")
        q = check_queries(self, queries)
        cols: dict[str, Any] = {"q": wire.vectors_column(q)}
        if exclude is not None:
            cols["ex"] = wire.exclude_column(exclude, len(q), self.normalize_keys)
        tables = self._each(lambda s: self._exchange(s, "top_k", wire.batch(**cols), k=int(k),
                                                     approximate=bool(approximate)))
        return merge_top_k(tables, len(q), int(k), self._key_type)

    def sample(self, positive_keys: Any, num_sampled: int, sampler: Any = None, *,
               offsets: Any = None, remove_accidental_hits: bool = True, unique: bool = True,
               seed: Any = None) -> Any:
        """Candidate sampling over every worker's keys (see
        :meth:`embstore.EmbeddingStore.sample`): draws split over the workers by a
        multinomial on their share of the sampling weight, each drawn by its owner."""
        self.check_open()
        sampler = resolve_sampler(sampler)
        spec = wire.sampler_spec(sampler)
        m = check_num_sampled(num_sampled)
        batch, positives = group_positives(self, positive_keys, offsets)
        flat_pos = (np.concatenate(positives) if len(positives) > 1
                    else positives[0] if positives else self.normalize_keys([]))
        weights = self._each(lambda s: self._action(s, "sample_weight", sampler=spec))
        shard_w = np.array([w["total"] for w in weights], np.float64)
        support = sum(int(w["support"]) for w in weights)
        total = float(shard_w.sum())
        if m and total <= 0:
            raise InvalidInputError("the store has no key with a positive sampling weight")
        if m and unique and m > support:
            raise InvalidInputError(f"unique sampling of {m} candidates needs at least {m} "
                                    f"keys with a positive weight; the store has {support}")
        rng = (seed if isinstance(seed, np.random.Generator)
               else np.random.default_rng(None if seed is None else int(seed)))
        neg, wts, tries = self._draw_rounds(spec, rng, m, shard_w, unique)
        neg_prob = expected_count(wts / total if total > 0 else wts, tries, unique)
        pw = np.zeros(len(flat_pos), np.float64)
        if len(flat_pos):
            for sel, t in self._keyed("sample_prob", flat_pos, lambda sel: {
                    "key": wire.keys_column(flat_pos if sel is None else flat_pos[sel])},
                    sampler=spec):
                pw[slice(None) if sel is None else sel] = t.column("weight").to_numpy()
        pos_prob = expected_count(pw / total if total > 0 else pw, tries, unique)
        results = merge_candidates(positives, pos_prob, neg, neg_prob, tries,
                                   remove_accidental_hits)
        return results if batch else results[0]

    def _draw_rounds(self, spec: dict[str, Any], rng: np.random.Generator, m: int,
                     shard_w: np.ndarray, unique: bool) -> tuple[np.ndarray, np.ndarray, int]:
        """Rounds of draws until ``m`` (distinct, with ``unique``) candidates."""
        keys = self.normalize_keys([])
        wts = np.zeros(0, np.float64)
        total = float(shard_w.sum())
        need = m if not unique else int(m * 1.03) + 16 if m else 0
        n = len(self._addrs)
        while need and total > 0:
            req = rng.multinomial(need, shard_w / total)
            seeds = rng.integers(0, 2**62, size=n)
            asked = [s for s in range(n) if req[s]]
            empty = wire.batch(key=wire.keys_column(keys[:0]))

            def draw(s: int, req: np.ndarray = req, seeds: np.ndarray = seeds,
                     empty: pa.RecordBatch = empty) -> pa.Table:
                return self._exchange(s, "sample_draw", empty, sampler=spec,
                                      count=int(req[s]), seed=int(seeds[s]))

            got = self._each(draw, asked)
            ks, ws = [keys], [wts]
            for s, t in zip(asked, got, strict=True):
                k = wire.keys_from(t.column("key"), self._key_type)
                if len(k) != req[s]:
                    raise ShardMismatchError(f"{self._where(s)} drew {len(k)} keys, asked "
                                             f"{int(req[s])}")
                ks.append(k)
                ws.append(np.asarray(t.column("weight").to_numpy(), np.float64))
            # draws grouped by shard are not an i.i.d. sequence; a shuffle makes them one
            perm = len(keys) + rng.permutation(int(req.sum()))
            allk, allw = np.concatenate(ks), np.concatenate(ws)
            allk[len(keys):], allw[len(keys):] = allk[perm], allw[perm]
            keys, wts = allk, allw
            if not unique:
                return keys, wts, len(keys)
            _, first = np.unique(keys, return_index=True)
            if len(first) >= m:
                sel = np.sort(first)[:m]
                return keys[sel], wts[sel], int(sel[-1]) + 1
            rate = len(first) / max(len(keys), 1)
            need = int((m - len(first)) / max(rate, 1e-3) * 1.25) + 64
        return keys, wts, 0

    # -- whole table ---------------------------------------------------------------------------
    def export(self, dest: str | os.PathLike[str] | BinaryIO, *, since: int | None = None,
               batch_size: int = 65536) -> int:
        """Write every worker's records (or those changed after ``since``) as one native
        file, equal to what one store holding every key would export; returns the rows."""
        self.check_open()
        infos = self._each(lambda s: self._action(s, "info"))
        header = dict(infos[0]["meta"])
        header.update(step=max(int(i["step"]) for i in infos),
                      version=max(int(i["version"]) for i in infos), since=since)
        if since is not None:
            header["deletions_complete"] = False
        total = 0
        with NativeWriter(dest, header) as writer:
            for s in range(len(self._addrs)):
                try:
                    for k, recs in self._stream(s, "records", since=since)[1]:
                        writer.write(k, recs)
                        total += len(k)
                except BaseException:
                    writer.abort()
                    raise
        return total

    def _stream(self, s: int, op: str, **fields: Any) -> tuple[dict[bytes, bytes], Any]:
        """``(schema metadata: seq, log id; batches of (keys, records))`` of worker ``s``'s
        ``records``/``snapshot`` stream."""
        ticket = flight.Ticket(wire.command(op, **self._head(s), **fields).command)
        try:
            reader = self._clients[s].do_get(ticket, self._call)
            meta = dict(reader.schema.metadata or {})
        except flight.FlightError as e:
            wire.raise_remote(e, self._where(s))
            raise

        def batches() -> Any:
            try:
                for chunk in reader:
                    yield wire.records_from(chunk.data, self._key_type, self.layout.dtype)
            except flight.FlightError as e:
                wire.raise_remote(e, self._where(s))

        return meta, batches()

    # -- followers ---------------------------------------------------------------------------
    @property
    def shards(self) -> int:
        return len(self._addrs)

    def shard_snapshot(self, s: int) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
        """Every record of worker ``s`` and its change-log position when it read them."""
        _, seq, batches = self.shard_state(s)
        return seq, batches

    def shard_state(self, s: int) -> tuple[str | None, int, list[tuple[np.ndarray, np.ndarray]]]:
        """:meth:`shard_snapshot` and, first, the id of the log ``seq`` counts in."""
        self.check_open()
        meta, batches = self._stream(s, "snapshot")
        log = meta[b"log"].decode() if b"log" in meta else None
        return log, int(meta.get(b"seq", b"0")), list(batches)

    def shard_changes(self, s: int, since: int, log: str | None = None
                      ) -> tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """``(seq, (keys, records, found))`` of worker ``s``'s keys changed after ``since``
        (``push.delta_rows``); None instead of the rows when the log no longer holds
        ``since`` or is not ``log`` (take :meth:`shard_state` then)."""
        self.check_open()
        t = self._exchange(s, "changes", wire.batch(key=wire.keys_column(
            self.normalize_keys([]))), since=int(since), **({"log": log} if log else {}))
        meta = t.schema.metadata or {}
        return int(meta.get(b"seq", b"0")), (None if meta.get(b"resync") == b"1" else
                                             delta_rows(t, self._key_type, self.layout.dtype))

    def shard_subscribe(self, s: int, since: int, log: str | None = None,
                        interval: float = 0.1) -> Subscription:
        """Worker ``s``'s changes after ``since`` pushed as its change log grows, at most every
        ``interval`` seconds (``embstore.service.push``)."""
        self.check_open()
        cmd = wire.command("subscribe", **self._head(s), since=int(since), interval=interval,
                           **({"log": log} if log else {}), **self._streams.push_fields(s))
        return Subscription(self._clients[s], cmd, self._headers, self._key_type,
                            self.layout.dtype, self._where(s), lambda: self._streams.refuse(s))

    def __len__(self) -> int:
        self.check_open()
        return sum(self._each(lambda s: int(self._action(s, "len"))))

    @property
    def version(self) -> int:
        """The newest version of any worker's store: pass it to ``export(since=)`` later for
        the rows written after now (each worker answers from its change log)."""
        self.check_open()
        return max(int(i["version"]) for i in self._each(lambda s: self._action(s, "info")))

    def stats(self) -> dict[str, Any]:
        """Counters summed over the workers, and ``shards``."""
        self.check_open()
        out: dict[str, Any] = {"shards": len(self._addrs)}
        for st in self._each(lambda s: self._action(s, "stats")):
            for name, v in st.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[name] = out.get(name, 0) + v
        return out

    def flush(self) -> None:
        """Every worker flushes its store (durable at return where its backend is)."""
        self.check_open()
        if not self.read_only:
            self._each(lambda s: self._action(s, "flush"))

    def close(self) -> None:
        """Close the connections (the workers and their tables stay); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False)
        self._streams.close()
        for c in self._clients:
            c.close()

    def __enter__(self) -> DesStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DesStore {self._url!r} dim={self.dim} key_type={self._key_type}>"
