"""Offline jobs in parts: a store split into key ranges, each exported (or copied, verified)
on its own, by any engine that can call a function on a picklable argument.

:func:`plan_parts` asks the store's backend for ``n`` ranges it reads natively
(:meth:`embstore.backends.base.Backend.plan_ranges`: LMDB/RocksDB key ranges, SQL key
ranges, Bigtable row ranges, ``memory://`` hash ranges) and returns one picklable
:class:`Part` per range; every row is in exactly one part. :func:`run_part` writes one part
into a directory: the part file (``part-00001-of-00004.parquet``) and a small sidecar
(``.json``: rows, size, SHA-256, range). The run that completes the set writes
``manifest.json`` (:func:`finish_manifest`), which ``import`` and ``verify`` read as one
file (:class:`embstore.io.manifest.ManifestReader`). Nothing here knows a storage engine.

>>> parts = plan_parts("lmdb:///data/table", 4)                 # doctest: +SKIP
>>> results = [run_part(p, "/exports/table") for p in parts]    # any engine, any order
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..backends.ranges import KeyRange, check_plan
from ..engine import services
from ..errors import CapabilityError, CorruptFileError, InvalidInputError
from ..io.formats import format_name, open_writer
from ..io.manifest import CHECKSUM_KINDS, MANIFEST_KEY, file_checksum, write_json
from ..progress import progress_bar
from ..urls import redact_url
from .own_storage import refuse_own_storage

__all__ = ["MANIFEST_NAME", "Part", "PartResult", "finish_manifest", "parse_part",
           "part_records", "pending_parts", "plan_parts", "run_part"]

MANIFEST_NAME = "manifest.json"
_EXT = {"native": ".emb", "parquet": ".parquet", "npz": ".npz", "tsv": ".tsv",
        "word2vec": ".txt", "word2vec-binary": ".bin"}


@dataclass(frozen=True)
class Part:
    """One part of a plan: enough for a worker in another process to do it alone.

    Attributes
    ----------
    url : str
        The source store's URL (password included: the worker reopens it; ``repr`` hides it).
    index, count : int
        0-based index of this part, number of parts in the plan.
    range : KeyRange
        The rows of this part, in the source backend's own order.
    plan : str
        Fingerprint of the plan (source, count, ranges): parts of one plan share it.
    options : dict
        Options the source is reopened with (read-only is added).
    persistent : bool
        False for a ``memory://`` source: its parts run in the process that holds it
        (``run_part(..., store=)``).
    """

    url: str = field(repr=False)
    index: int
    count: int
    range: KeyRange
    plan: str
    options: dict[str, Any] = field(default_factory=dict, repr=False, hash=False)
    persistent: bool = True

    @property
    def source(self) -> str:
        """The source URL with any password redacted (for logs and manifests)."""
        return redact_url(self.url)

    def stem(self) -> str:
        """The part's file name without suffix (1-based, as ``--part I/N`` counts)."""
        return f"part-{self.index + 1:05d}-of-{self.count:05d}"


@dataclass
class PartResult:
    """What :func:`run_part` wrote: one manifest entry (``file`` is relative to the
    directory), plus the attempt's timing."""

    index: int
    count: int
    file: str
    rows: int
    bytes: int
    #: the file's checksum, ``{kind: hex}`` (``{"xxh3_128": ...}``; see
    #: :data:`embstore.io.manifest.CHECKSUM`)
    checksum: dict[str, str]
    range: dict[str, Any]
    plan: str
    seconds: float = 0.0
    #: CPU time of the process (all its threads) while it ran this part
    cpu_seconds: float = 0.0

    @property
    def sha256(self) -> str | None:
        """The file's SHA-256 where that is its checksum (parts written before XXH3-128)."""
        return self.checksum.get("sha256")


def checksum_of(entry: dict[str, Any]) -> dict[str, str]:
    """The checksum of a part's result (its ``checksum``) or manifest entry (its
    ``xxh3_128``, or the ``sha256`` of one written before), as ``{kind: hex}``."""
    got = entry.get("checksum")
    if isinstance(got, dict):
        return dict(got)
    return {k: entry[k] for k in CHECKSUM_KINDS if k in entry}


def parse_part(text: str) -> tuple[int, int]:
    """``"I/N"`` (1-based, as the CLI takes it) -> ``(index, count)`` with a 0-based index."""
    i, sep, n = text.partition("/")
    try:
        index, count = int(i), int(n)
    except ValueError:
        index = count = 0
    if not sep or count < 1 or not 1 <= index <= count:
        raise InvalidInputError(f"--part must look like I/N with 1 <= I <= N, got {text!r}")
    return index - 1, count


def _reopen_args(store: Any) -> tuple[str, dict[str, Any]]:
    # A persistent store pickles as (reopen, (url, options, ...)): the same URL and options
    # a worker needs; the store's own url attribute has any password redacted.
    _, args = store.__reduce__()
    return str(args[0]), dict(args[1])


def plan_parts(source: Any, n: int, **options: Any) -> list[Part]:
    """Split a store into ``n`` parts that each hold a key range the backend reads natively.

    Parameters
    ----------
    source : str or EmbeddingStore
        A store URL (opened read-only with ``options`` to plan) or an open store.
        A ``memory://`` store must be given open: its parts run in this process.
    n : int
        Number of parts (>= 1). Parts are balanced by rows where the backend counts them
        cheaply (LMDB, RocksDB, SQL, Bigtable), by key hash for ``memory://``.

    Returns
    -------
    list of Part
        Picklable; every row of the store is in exactly one of them.
    """
    if not isinstance(n, int) or n < 1:
        raise InvalidInputError(f"the number of parts must be a positive integer, got {n!r}")
    if isinstance(source, str):
        with services.opener()(source, read_only=True, **options) as store:
            return plan_parts(store, n)
    backend = source.backend
    if not backend.supports_ranges:
        kind = type(backend).__name__
        raise CapabilityError(f"{source.url} cannot be split into parts ({kind} reads no "
                                "key ranges); export it whole")
    ranges = backend.plan_ranges(n)
    check_plan(ranges)
    persistent = bool(backend.persistent)
    url, opts = _reopen_args(source) if persistent else (source.url, {})
    doc = json.dumps([redact_url(url), n, [r.to_json() for r in ranges]], sort_keys=True)
    plan = hashlib.sha256(doc.encode()).hexdigest()[:16]
    return [Part(url, i, n, r, plan, opts, persistent) for i, r in enumerate(ranges)]


def part_records(store: Any, part: Part, batch_size: int = 65536
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(keys, records)`` batches of ``part``'s range of ``store``."""
    if not store.backend.supports_ranges:
        raise CapabilityError(f"{store.url} reads no key ranges: it cannot run a part")
    yield from store.backend.scan_range(part.range, batch_size)


def _open_source(part: Part, store: Any) -> tuple[Any, bool]:
    if store is not None:
        return store, False
    if not part.persistent:
        raise InvalidInputError(
            f"part {part.index + 1}/{part.count} of {part.source}: a memory:// store lives in "
            "the process that planned it; run its parts there with run_part(..., store=store)")
    return services.opener()(part.url, **{**part.options, "read_only": True}), True


def run_part(part: Part, dest: str | os.PathLike[str], *, fmt: str = "native",
             batch_size: int = 65536, progress: bool = False, store: Any = None) -> PartResult:
    """Write ``part`` into the directory ``dest``: its part file and sidecar; the run that
    completes the set also writes ``manifest.json``. Safe to run again (a retry replaces
    the part's files atomically).

    Parameters
    ----------
    part : Part
        From :func:`plan_parts`.
    dest : path
        The directory of the split export (created when missing).
    fmt : str
        File format of the parts (``"native"``, ``"parquet"``, ``"npz"``, ...).
    store : EmbeddingStore, optional
        The source, already open (required for ``memory://``); else the part reopens it
        read-only from its URL.
    """
    name = format_name(fmt)
    if name not in _EXT:
        raise InvalidInputError(f"parts cannot be written as {fmt!r}; one of {sorted(_EXT)}")
    dest = os.fspath(dest)
    path = os.path.join(dest, part.stem() + _EXT[name])
    t0, c0 = time.perf_counter(), time.process_time()
    src, opened = _open_source(part, store)
    try:
        refuse_own_storage(src, path)  # before making the directory inside the store's files
        os.makedirs(dest, exist_ok=True)
        meta = src.meta
        meta["since"] = None
        with open_writer(path, meta, name) as w, progress_bar(
                total=None, enabled=progress, desc=f"part {part.index + 1}/{part.count}") as bar:
            for keys, recs in part_records(src, part, batch_size):
                w.write(keys, recs)
                bar.update(len(keys))
        rows = w.rows
    finally:
        if opened:
            src.close()
    res = PartResult(part.index, part.count, os.path.basename(path), rows,
                     os.path.getsize(path), file_checksum(path), part.range.to_json(), part.plan,
                     time.perf_counter() - t0, time.process_time() - c0)
    side = {"result": asdict(res), "source": part.source, "format": name,
            "key_type": meta["key_type"], "dim": meta["dim"], "layout": meta["layout"]}
    write_json(os.path.join(dest, part.stem() + ".json"), side)
    try:
        finish_manifest(dest, part.count, missing_ok=True)
    except CorruptFileError as e:  # this part is sound; the set it joins is not
        warnings.warn(f"part {part.index + 1}/{part.count} written, no manifest: {e}",
                      stacklevel=2)
    return res


def _sidecars(dest: str, count: int) -> dict[int, dict[str, Any]]:
    found = {}
    for i in range(count):
        p = os.path.join(dest, f"part-{i + 1:05d}-of-{count:05d}.json")
        try:
            with open(p, "rb") as f:
                found[i] = json.loads(f.read())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise CorruptFileError(f"{p}: unreadable part record: {e}") from e
    return found


def pending_parts(parts: list[Part], dest: str | os.PathLike[str]) -> list[Part]:
    """The parts of ``parts`` with no finished output in ``dest`` (none yet, another plan's,
    or a file that no longer matches its record): what a retry still has to run."""
    dest = os.fspath(dest)
    done = _sidecars(dest, parts[0].count) if parts else {}
    todo = []
    for p in parts:
        res = (done.get(p.index) or {}).get("result") or {}
        f = os.path.join(dest, str(res.get("file", "")))
        if (res.get("plan") != p.plan or not os.path.isfile(f)
                or os.path.getsize(f) != res.get("bytes")):
            todo.append(p)
    return todo


def finish_manifest(dest: str | os.PathLike[str], count: int, *,
                    missing_ok: bool = False) -> str | None:
    """Write ``dest/manifest.json`` from the parts' sidecars; return its path.

    Refuses (``CorruptFileError``) sidecars of different plans; with parts still missing it
    returns None when ``missing_ok``, else raises ``CorruptFileError`` naming them.
    """
    dest = os.fspath(dest)
    found = _sidecars(dest, count)
    missing = [i + 1 for i in range(count) if i not in found]
    if missing:
        if missing_ok:
            return None
        raise CorruptFileError(f"{dest}: parts {missing} of {count} have not been written")
    first = found[0]
    plans = {d["result"]["plan"] for d in found.values()}
    if len(plans) != 1:
        raise CorruptFileError(f"{dest}: the parts come from {len(plans)} different plans (the "
                               "store changed between parts?); export them again")
    entries = [found[i]["result"] for i in range(count)]
    doc = {MANIFEST_KEY: 1, "source": first["source"], "format": first["format"],
           "parts": count, "plan": plans.pop(), "rows": sum(e["rows"] for e in entries),
           "key_type": first["key_type"], "dim": first["dim"], "layout": first["layout"],
           "files": [{**{k: e[k] for k in ("index", "file", "rows", "bytes", "range")},
                      **checksum_of(e)} for e in entries]}
    path = os.path.join(dest, MANIFEST_NAME)
    write_json(path, doc)
    return path

