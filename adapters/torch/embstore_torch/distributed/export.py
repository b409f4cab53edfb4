"""Distributed export: every shard's records streamed to rank 0, checked, into one file.

Rank 0 writes one native file (or, with ``{rank}`` in the destination, every rank writes its
own). What rank 0 receives is checked like any payload from another rank: headers against
``items x`` (key + record) bytes before the exchange, keys and records filling their payload
exactly, every key the sending shard's own (one store per rank) and no key twice, neither
within a payload nor across rounds (:class:`SeenKeys`). A bad payload aborts the file (the
temporary file is removed, nothing is renamed into place) and raises ``RankFailureError``
naming the sender on rank 0, and on every other rank in the export's closing exchange.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from embstore.io.native import NativeWriter

from .collectives import Collectives
from .comm import Fits, rows_of
from .wire import bad_payload, check_unique, key_bytes, pack_records, unpack_records

__all__ = ["ExportOp", "SeenKeys"]

_ANY = np.iinfo(np.int64).max


class SeenKeys:
    """The keys rank 0 has written in one export, to refuse a key a shard sends twice in
    different rounds. Keeps 12 bytes per int64 key (the key and its sender), 20 per bytes key
    (a 16-byte BLAKE2b digest: a collision between two distinct keys is negligible)."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.sources: list[np.ndarray] = []

    def add(self, keys: np.ndarray, source: int) -> None:
        """Remember the ``keys`` rank ``source`` sent (copied: the buffer is reused)."""
        if keys.dtype == np.int64:
            ids = np.array(keys)
        else:
            ids = np.frombuffer(b"".join(hashlib.blake2b(k, digest_size=16).digest()
                                         for k in keys.tolist()),
                                dtype=[("hi", "<u8"), ("lo", "<u8")])
        self.parts.append(ids)
        self.sources.append(np.full(len(ids), source, np.int32))

    def check(self) -> None:
        """Raise ``RankFailureError`` naming the sender of a key seen twice."""
        if not self.parts:
            return
        ids, src = np.concatenate(self.parts), np.concatenate(self.sources)
        order = np.argsort(ids, kind="stable")
        ordered = ids[order]
        same = np.flatnonzero(ordered[1:] == ordered[:-1])
        if len(same):
            i = int(order[same[0] + 1])
            key = int(ids[i]) if ids.dtype == np.int64 else "a bytes key"
            raise bad_payload(int(src[i]), f"export rows with key {key!r} more than once, in "
                                           f"two rounds ({len(same)} repeats in all)")


class ExportOp:
    """:meth:`export` of :class:`~embstore_torch.distributed.DistributedStore`.

    Parameters
    ----------
    collectives : Collectives
        The comm, this rank's store, the global step (the file's) and the ranks' agreement.
    """

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.comm = collectives.comm
        self.key_type = collectives.key_type

    def export(self, dest: str | os.PathLike | BinaryIO, *, since: int | None = None,
               batch_size: int = 65536) -> int:
        """:meth:`~embstore_torch.distributed.DistributedStore.export` on this rank."""
        c = self.collectives
        st = c.live()
        if isinstance(dest, (str, os.PathLike)) and "{rank}" in os.fspath(dest):
            path = os.fspath(dest).replace("{rank}", str(c.rank)).replace(
                "{world}", str(c.world))
            err, n = None, 0
            try:
                n = st.export(path, since=since, batch_size=batch_size)
            except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
                err = e
            return c.agree("export", err, items=n)
        c.sync_shared()
        versions, _, _ = self.comm.begin("export", st.version, fits=rows_of(0, 0))
        header = st.meta
        header.update(step=c.step, version=int(versions.max()), since=since)
        if since is not None:
            header["deletions_complete"] = False
        src = (st.records(batch_size) if since is None
               else st.changes_since(since, batch_size))
        writer = NativeWriter(dest, header, background=True) if c.rank == 0 else None
        err, total = None, 0
        with writer if writer is not None else contextlib.nullcontext():
            try:
                total = self._rounds(src, writer, st.layout.dtype)
            except Exception as e:  # noqa: BLE001 - reported in the closing exchange
                err = e
            if err is not None and writer is not None:
                writer.abort()
        if err is not None and self.comm.broken is not None:
            raise err  # an exchange failed: the ranks cannot agree on anything any more
        # a bad payload: RankFailureError on every rank; rank 0 counted the rows
        return c.agree("export", err, items=total)

    def _fits(self, rec: int) -> tuple[Fits, Fits]:
        """Header bounds of an export round: rows of key + record bytes, to rank 0 only,
        from every shard (one store per rank) or from rank 0 alone (one shared store);
        ``rec``: the bytes of a record."""
        c = self.collectives
        w, me = c.world, c.rank
        lo, hi = key_bytes(self.key_type)
        sends = np.ones(w, bool) if c.sharded else np.arange(w) == 0
        # exclusive bounds on items: a rank that sends nothing may announce only 0
        bound_in = np.where(sends & (me == 0), _ANY, 1)
        bound_out = np.where((np.arange(w) == 0) & sends[me], _ANY, 1)
        return (rows_of(lo + rec, hi + rec, max_items=bound_in),
                rows_of(lo + rec, hi + rec, max_items=bound_out))

    def _rounds(self, src: Iterator[tuple[np.ndarray, np.ndarray]], writer: NativeWriter | None,
                dtype: np.dtype) -> int:
        """Stream the shards' batches (records of ``dtype``) to rank 0 until every rank is
        done; the rows rank 0 received (0 elsewhere). After a bad payload the rounds go on
        (every rank must finish them) but nothing more is written, and the error is raised at
        the end."""
        c = self.collectives
        w = c.world
        fits, fits_out = self._fits(int(dtype.itemsize))
        seen = SeenKeys() if writer is not None else None
        err: Exception | None = None
        total = 0
        while True:
            batch = next(src, None) if c.answers else None
            payload = np.zeros(0, np.uint8)
            n = 0
            if batch is not None:
                keys, recs = batch
                n = len(keys)
                payload = pack_records(keys, recs)
            items, nbytes, more = self.comm.begin(
                "export", [n if d == 0 else 0 for d in range(w)],
                [len(payload) if d == 0 else 0 for d in range(w)], int(batch is not None),
                fits=fits, fits_out=fits_out)
            if not more.any():
                break
            # keep=True: the file writer works on the rows in the background
            got = self.comm.exchange([payload if d == 0 else payload[:0] for d in range(w)],
                                     nbytes, "export", keep=True)
            if writer is None or err is not None:
                continue
            try:
                for s in range(w):
                    # a shard's records: sizes, (per-rank stores) its own keys, no key twice
                    k, recs = unpack_records(got[s], int(items[s]), self.key_type, dtype,
                                             owner=(s, w) if c.sharded else None, source=s)
                    check_unique(k, s, "export rows")
                    if len(k):
                        assert seen is not None
                        seen.add(k, s)
                        writer.write(k, recs)
                        total += len(k)
            except Exception as e:  # noqa: BLE001 - finish the rounds, then report
                err = e
        if err is None and seen is not None:
            seen.check()  # a key in two rounds (within one round: checked above)
        if err is not None:
            raise err
        return total
