"""The table's control rows: its metadata (row ``wire.META_ROW``) and its writer-lease record
(row ``wire.LEASE_ROW``), read and written by compare-and-set through the CAS writer.

A :class:`ControlRows` also keeps the last of each that this backend wrote, so a table that
vanished and was recreated empty (an emulator restart) gets them back and its writer's fenced
writes go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..lease_record import check_fence, loads
from . import wire
from .cas import CasWriter, meta_update


class ControlRows:
    """Metadata and lease documents of one table (``marker`` gives the restore marker fields
    the metadata row carries while a committed restore is unfinished)."""

    def __init__(self, cas: CasWriter, marker: Callable[[], dict], url: str) -> None:
        self.cas, self.marker, self.url = cas, marker, url
        self.meta: dict | None = None    # the metadata as last read or written
        self.lease: dict | None = None   # the lease record as this backend last wrote it

    def read_meta(self) -> dict | None:
        doc = self.cas.read_doc()
        if doc is None:
            return None
        meta = doc.get("meta", doc) if isinstance(doc, dict) else doc
        if isinstance(doc, dict):  # never write below a timestamp already used
            self.cas.observe_ts(int(doc.get("ts_high", 0)))
        self.meta = meta
        return meta

    def write_meta(self, meta: dict) -> None:
        self.meta = dict(meta)
        # a committed restore's marker stays until the restore finishes (see .restore)
        self.cas.write_doc(wire.META_ROW, {"meta": meta, **self.marker()})

    def modify_meta(self, fn: Callable[[dict | None], dict]) -> dict:
        meta = self.cas.modify_doc(meta_update(fn))["meta"]
        self.meta = dict(meta)
        return meta

    def modify_leases(self, fn: Callable[[Any], dict]) -> dict:
        """The lease record replaced by ``fn(stored)``, by compare-and-set, retried on
        conflict."""
        self.lease = self.cas.modify_doc(fn, row=wire.LEASE_ROW)
        return self.lease

    def read_leases(self) -> Any:
        return loads(self.cas.read_raw_doc(wire.LEASE_ROW), self.url)

    def check_fence(self, fence: tuple[str, int] | None) -> None:
        """Refuse a write of a holder that lost its lease. No multi-row transactions: the
        lease row is read just before the batch is sent, so a takeover between the two lets
        this one batch land (docs/concurrency.md)."""
        if fence is not None:
            check_fence(self.read_leases(), fence, self.url)

    def put_back(self) -> None:
        """Write the metadata and lease record this backend last wrote into a table that was
        recreated empty."""
        if self.meta is not None:
            self.cas.write_doc(wire.META_ROW, {"meta": self.meta, **self.marker()})
        if self.lease is not None:
            self.cas.write_doc(wire.LEASE_ROW, self.lease, stamp=False)
