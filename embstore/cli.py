"""The ``embstore`` command line: inspect, import, export, copy and verify stores offline.

Every command has ``--help``. Exit codes: 0 on success, 1 when a command fails for a reason
the user can act on (a one-line ``embstore: error: ...`` on stderr, no traceback), 2 for
command-line usage errors, 130 when interrupted. Long commands draw a progress bar on a
terminal (stderr) and stay silent when piped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import __version__
from .api import open as open_store
from .errors import EmbstoreError, InvalidInputError
from .io.formats import FORMATS, open_reader
from .registry import scheme_of
from .service.options import add_serve_command
from .transfer import (
    DEFAULT_CACHE_BYTES,
    MANIFEST_NAME,
    NewStore,
    Part,
    copy_store,
    creation_options,
    export_file,
    import_file,
    plan_parts,
    run_part,
    verify_file,
    verify_store,
)
from .transfer.own_storage import refuse_copy_onto_urls
from .transfer.parts import parse_part
from .urls import redact_text

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


# -- helpers ---------------------------------------------------------------------------------------
def _parse_value(v: str) -> Any:
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    if v[:1] in "[{":
        try:
            return json.loads(v)
        except ValueError:
            pass
    return v


def _options(pairs: Sequence[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in pairs or ():
        k, eq, v = p.partition("=")
        if not eq or not k:
            raise InvalidInputError(f"option {p!r} must look like KEY=VALUE")
        out[k.replace("-", "_")] = _parse_value(v)
    return out


def _open_ro(url: str, opts: dict[str, Any]):
    return open_store(url, read_only=True, **opts)


def _open_or_none(url: str, opts: dict[str, Any]):
    """Open an existing store for writing, or return None when there is none yet."""
    try:
        return open_store(url, **opts)
    except InvalidInputError as e:
        if "dim is required" in str(e):
            return None
        raise


def shard_urls(url: str, n: int) -> list[str]:
    """``n`` shard URLs from ``url``: ``{i}`` (or ``{rank}``, as in the URL templates of
    ``embstore_torch.distributed.store``) is replaced by the shard number and ``{world}`` by ``n``,
    else ``-<i>`` is inserted before the extension of the last path segment (``/data/t.db``
    -> ``/data/t-0.db``)."""
    if n < 1:
        raise InvalidInputError(f"--shards must be at least 1, got {n}")
    if "{i}" in url or "{rank}" in url:
        return [url.replace("{i}", str(i)).replace("{rank}", str(i)).replace("{world}", str(n))
                for i in range(n)]
    head, sep, query = url.partition("?")
    cut = head.rfind("/")
    dot = head.rfind(".")
    at = dot if dot > cut and dot > head.find("://") + 2 else len(head)
    return [f"{head[:at]}-{i}{head[at:]}{sep}{query}" for i in range(n)]


def _fmt_key(k: Any) -> str:
    if isinstance(k, bytes):
        try:
            return k.decode("utf-8")
        except UnicodeDecodeError:
            return repr(k)
    return str(k)


def _parse_key(store, key: str) -> Any:
    if store.key_type == "int64":
        try:
            return int(key)
        except ValueError:
            raise InvalidInputError(f"{key!r} is not an integer key (the store has int64 keys)"
                                    ) from None
    return key.encode("utf-8")


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


def _field_type(dt: np.dtype) -> str:
    if dt.subdtype is not None:
        base, shape = dt.subdtype
        return f"{base.kind}{base.itemsize}[{','.join(map(str, shape))}]"
    return f"{dt.kind}{dt.itemsize}"


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, np.generic):
        return v.item()
    return v


# -- commands --------------------------------------------------------------------------------------
def cmd_info(args: argparse.Namespace) -> int:
    with _open_ro(args.url, _options(args.option)) as store:
        stats = {k: _jsonable(v) for k, v in store.stats(count_rows=True).items()}
        info = {
            "url": store.url, "dim": store.dim, "key_type": store.key_type,
            "layout": {"fields": [[n, _field_type(store.layout.dtype.fields[n][0])]
                                  for n in store.layout.dtype.names],
                       "record_bytes": store.layout.itemsize,
                       "value_dtype": store.layout.value_dtype,
                       "metadata": "compact" if store.layout.is_compact else "full"},
            "optimizer": store.optimizer.config(), "initializer": store.initializer.config(),
            "seed": store.seed, "rows": stats["rows"], "size_bytes": stats.get("size_bytes"),
            "version": store.version, "step": store.step, "stats": stats,
        }
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
        return EXIT_OK
    print(f"url          {info['url']}")
    print(f"dim          {info['dim']}")
    print(f"key type     {info['key_type']}")
    fields = ", ".join(f"{n}:{t}" for n, t in info["layout"]["fields"])
    lay = info["layout"]
    print(f"layout       {lay['record_bytes']} bytes/record ({fields}); vectors "
          f"{lay['value_dtype']}, {lay['metadata']} metadata")
    print(f"optimizer    {json.dumps(info['optimizer'], sort_keys=True)}")
    print(f"initializer  {json.dumps(info['initializer'], sort_keys=True)}")
    print(f"rows         {info['rows']}")
    print(f"size         {_size(info['size_bytes'])}")
    print(f"version      {info['version']}  step {info['step']}")
    # one line per few counters, wrapped under the label, instead of one very long line
    print(textwrap.fill(", ".join(f"{k}={v}" for k, v in sorted(stats.items())), width=100,
                        initial_indent="stats        ", subsequent_indent=" " * 13,
                        break_long_words=False, break_on_hyphens=False))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    if args.part:
        return _export_part(args)
    with _open_ro(args.url, _options(args.option)) as store:
        n = export_file(store, args.dest, fmt=args.format, since=args.since,
                        batch_size=args.batch_size, progress=not args.quiet,
                        quantize=args.quantize)
    _note(args, f"exported {n} rows to {args.dest}")
    return EXIT_OK


def _part_of(store: Any, text: str) -> Part:
    index, count = parse_part(text)
    return plan_parts(store, count)[index]


def _export_part(args: argparse.Namespace) -> int:
    if args.since is not None or args.quantize:
        raise InvalidInputError("--part exports whole records: --since and --quantize "
                                "are for a whole export")
    with _open_ro(args.url, _options(args.option)) as store:
        part = _part_of(store, args.part)
        res = run_part(part, args.dest, fmt=args.format or "native",
                       batch_size=args.batch_size, progress=not args.quiet, store=store)
    done = os.path.exists(os.path.join(args.dest, MANIFEST_NAME))
    _note(args, f"exported part {args.part}: {res.rows} rows to "
          f"{os.path.join(args.dest, res.file)}" + (
              f"; all parts done, manifest {os.path.join(args.dest, MANIFEST_NAME)}"
              if done else ""))
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    opts = _options(args.option)
    store = _open_or_none(args.url, opts)
    try:
        if store is None:
            with open_reader(args.src, args.format) as reader:
                create = creation_options(reader, dim=args.dim, key_type=args.key_type)
                if reader.key_kind == "text" and create["key_type"] == "int64":
                    _note(args, f"{args.src}: the keys are integers, so {args.url} gets int64 "
                          "keys (--key-type bytes keeps them as text)")
            if args.optimizer:
                create["optimizer"] = args.optimizer
            target: Any = NewStore(args.url, {**create, **opts})
        else:
            if args.dim is not None and args.dim != store.dim:
                raise InvalidInputError(
                    f"{store.url} already exists with dim {store.dim}, not --dim {args.dim}")
            target = store
        if args.cache_mb is not None and args.cache_mb < 0:
            raise InvalidInputError(f"--cache-mb must be non-negative, got {args.cache_mb}")
        cache_bytes = (DEFAULT_CACHE_BYTES if args.cache_mb is None
                       else int(args.cache_mb * (1 << 20)))
        rep = import_file(target, args.src, fmt=args.format, skip_bad=args.skip_bad,
                          project=args.project, seed=args.seed, batch_size=args.batch_size,
                          progress=not args.quiet, cache_bytes=cache_bytes,
                          apply_deletes=args.apply_deletes)
        if rep.store is not None:
            store = rep.store
    finally:
        if store is not None:
            store.close()
    if rep.mode == "records":
        what = "records (vectors, optimizer state and metadata)"
    else:
        source = "int8 vectors, dequantized" if rep.value_dtype == "int8" else "vectors"
        what = (f"{source} (optimizer state: new keys start fresh, existing keys keep "
                "theirs)")
    msg = f"imported {rep.rows} rows as {what} into {store.url}"
    if rep.deleted:
        msg += f"; deleted {rep.deleted} keys the file lists as deleted"
    if rep.skipped:
        msg += f"; skipped {rep.skipped} bad rows"
        for b in rep.bad[:5]:
            print(f"embstore: skipped: {b}", file=sys.stderr)
    _note(args, msg)
    return EXIT_OK


def cmd_copy(args: argparse.Namespace) -> int:
    opts = _options(args.option)
    if scheme_of(args.dst) == "memory":
        raise InvalidInputError(
            f"refusing to copy to {args.dst}: a memory:// store lives in this process and is "
            "thrown away when the command exits; copy to a persistent store (lmdb://, ...)")
    with _open_ro(args.src, _options(args.src_option) or opts) as src:
        refuse_copy_onto_urls(src, shard_urls(args.dst, args.shards) if args.shards else [args.dst])
        dst_url = args.dst
        layer: dict[str, Any] = {}
        if args.shards:
            layer = {"shards": shard_urls(args.dst, args.shards)}
            dst_url = "sharded://"
        try:
            dst = open_store(dst_url, **layer, **opts)
        except InvalidInputError as e:
            if "dim is required" not in str(e):
                raise
            dst = open_store(dst_url, dim=src.dim, key_type=src.key_type,
                                optimizer=src.optimizer.config(),
                                initializer=src.initializer.config(), seed=src.seed,
                                **layer, **opts)
        part = _part_of(src, args.part) if args.part else None
        with dst:
            n = copy_store(src, dst, batch_size=args.batch_size, progress=not args.quiet,
                           part=part)
            url = dst.url
    _note(args, f"copied {n} rows to {url}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    if "://" in args.target:
        with _open_ro(args.target, _options(args.option)) as store:
            part = _part_of(store, args.part) if args.part else None
            rep = verify_store(store, batch_size=args.batch_size, progress=not args.quiet,
                               part=part)
    elif args.part:
        raise InvalidInputError("--part verifies a part of a store URL; a split export is "
                                "verified whole through its manifest.json")
    else:
        rep = verify_file(args.target, fmt=args.format, batch_size=args.batch_size,
                          progress=not args.quiet)
    status = "OK" if rep.ok else "FAILED"
    print(f"{status}: {rep.rows} rows, dim {rep.dim}, {rep.kind}, "
          f"digest {rep.digest_hex}")
    for p in rep.problems:
        print(f"embstore: verify: {p}", file=sys.stderr)
    if not rep.ok:
        print(f"embstore: error: {args.target}: {rep.bad} bad rows, "
              f"{len(rep.problems)} problems", file=sys.stderr)
    return EXIT_OK if rep.ok else EXIT_FAIL


def cmd_head(args: argparse.Namespace) -> int:
    if args.n < 0:
        raise InvalidInputError(f"-n must be non-negative, got {args.n}")
    with _open_ro(args.url, _options(args.option)) as store:
        shown = 0
        for keys, recs in store.records(max(1, min(args.n, 4096))):
            for k, r in zip(keys[:args.n - shown], recs[:args.n - shown]):
                vec = store.layout.vectors(r)
                vals = " ".join(f"{x:.6g}" for x in vec[:args.values].tolist())
                more = " ..." if len(vec) > args.values else ""
                print(f"{_fmt_key(k)}\t{vals}{more}\tcount={int(r['count'])}")
            shown += min(len(keys), args.n - shown)
            if shown >= args.n:
                break
    return EXIT_OK


def cmd_neighbors(args: argparse.Namespace) -> int:
    with _open_ro(args.url, _options(args.option)) as store:
        if not hasattr(store, "top_k"):
            raise InvalidInputError("top-k retrieval is not available in this embstore build")
        key = _parse_key(store, args.key)
        keys = np.array([key], dtype=np.int64) if store.key_type == "int64" else [key]
        if not bool(store.contains(keys)[0]):
            raise InvalidInputError(f"key {args.key!r} is not in {store.url}")
        query = store.lookup(keys, insert=False)
        found, scores = store.top_k(query, args.k, exclude=keys)
        for rank, (k, s) in enumerate(zip(found[0], scores[0]), 1):
            if not np.isfinite(s):
                break
            print(f"{rank}\t{_fmt_key(k)}\t{float(s):.6g}")
    return EXIT_OK


def _note(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr)


# -- parser ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="embstore",
        description="Inspect, import, export, copy and verify embstore tables offline.",
        epilog="Store URLs: memory://, lmdb:///abs/dir, rocksdb:///abs/dir, "
               "sqlite:////abs/file.db, postgresql+psycopg://user@host:port/db, "
               "bigtable://project/instance/table, sharded://?shard=...",
    )
    p.add_argument("--version", action="version", version=f"embstore {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar and no summary line")
    common.add_argument("-o", "--option", action="append", metavar="KEY=VALUE",
                        help="backend/engine option for the store(s), e.g. -o map_size=1e9 "
                             "(repeatable)")
    common.add_argument("--batch-size", type=int, default=65536, help="rows per batch")
    fmt_help = f"file format ({', '.join(FORMATS)}); detected from the file when omitted"
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("info", parents=[common], help="dim, key type, layout, rows, size, stats",
                       description="Show a store's configuration, row count, size and stats.")
    s.add_argument("url")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("export", parents=[common], help="write a store to a file",
                       description="Write every row (or rows changed after --since) to DEST.")
    s.add_argument("url")
    s.add_argument("dest")
    s.add_argument("--format", "-f", help=fmt_help + " (from the file name)")
    s.add_argument("--since", type=int, metavar="VERSION",
                   help="only rows written after this store version (see `embstore info`)")
    s.add_argument("--quantize", choices=("int8",),
                   help="write a serving table (native format): vectors quantized row-wise "
                   "to uint8 codes with a float32 scale and bias per row, no optimizer state")
    s.add_argument("--part", metavar="I/N",
                   help="export part I of N (1-based) into the directory DEST: a part file "
                        "and its record; the last part written adds DEST/manifest.json")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("import", parents=[common], help="load a file into a store",
                       description="Load SRC into the store at URL (created when missing). "
                       "The whole file is validated before anything is written.")
    s.add_argument("src")
    s.add_argument("url")
    s.add_argument("--format", "-f", help=fmt_help)
    s.add_argument("--dim", type=int, help="dim of a store to create (default: the file's)")
    s.add_argument("--key-type", choices=("int64", "bytes"),
                   help="key type of a store to create (default: from the file; text keys "
                        "-> bytes)")
    s.add_argument("--optimizer", help="optimizer of a store to create, e.g. adagrad")
    s.add_argument("--skip-bad", action="store_true",
                   help="skip rows with bad keys/values (counted) instead of refusing the file")
    s.add_argument("--project", choices=("random", "truncate"),
                   help="map vectors of another dim: seeded random projection or "
                        "truncate/zero-pad")
    s.add_argument("--seed", type=int, default=0, help="seed of --project random")
    s.add_argument("--apply-deletes", action="store_true",
                   help="let a native full export that lists deleted keys delete them "
                        "(refused otherwise; a --since delta's deletions always apply)")
    s.add_argument("--cache-mb", type=float, default=None,
                   help="memory (MiB) for keeping checked rows between the checking and the "
                        "writing pass; a file that fits is read once (default 512, 0: off)")
    s.set_defaults(func=cmd_import)

    s = sub.add_parser("copy", parents=[common], help="stream one store into another",
                       description="Copy every row of SRC_URL into DST_URL (created with the "
                       "source's configuration when missing).")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--shards", type=int,
                   help="write N shards: DST_URL with {i} (or {rank}) replaced by 0..N-1 and "
                        "{world} by N (else '-i' is "
                        "added to its last path segment)")
    s.add_argument("--src-option", action="append", metavar="KEY=VALUE",
                   help="option for the source store only")
    s.add_argument("--part", metavar="I/N", help="copy only part I of N (1-based) of SRC")
    s.set_defaults(func=cmd_copy)

    s = sub.add_parser("verify", parents=[common], help="check a store or file end to end",
                       description="Read every record of a store URL or file: decoding, "
                       "checksums, values, counts. Prints an order-independent digest of "
                       "(key, vector) rows that matches between a store and its exports.")
    s.add_argument("target", metavar="URL|FILE")
    s.add_argument("--format", "-f", help=fmt_help)
    s.add_argument("--part", metavar="I/N", help="verify only part I of N (1-based) of a "
                   "store; the parts' digests add up to the whole store's")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("head", parents=[common], help="print the first rows",
                       description="Print the first N rows (backend order).")
    s.add_argument("url")
    s.add_argument("-n", type=int, default=10, help="rows (default 10)")
    s.add_argument("--values", type=int, default=8, help="values shown per vector")
    s.set_defaults(func=cmd_head)

    add_serve_command(sub, common, _options)

    s = sub.add_parser("neighbors", parents=[common], help="top-k keys by dot product",
                       description="The K keys whose vectors have the largest dot product "
                       "with KEY's vector (KEY itself excluded).")
    s.add_argument("url")
    s.add_argument("key")
    s.add_argument("-k", type=int, default=10, help="neighbours (default 10)")
    s.set_defaults(func=cmd_neighbors)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("embstore: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - one line, never a traceback (EMBSTORE_DEBUG=1 shows it)
        if os.environ.get("EMBSTORE_DEBUG"):
            raise
        print(f"embstore: error: {redact_text(error_line(e, args))}", file=sys.stderr)
        return EXIT_FAIL


def error_line(e: BaseException, args: argparse.Namespace) -> str:
    """The one-line message for a failed command: names the file (or store) it concerns.

    Errors embstore raises on purpose say what went wrong; anything else (a bug, a library
    error no reader translated) is shown with its type so it can be reported.
    """
    text = str(e).strip()
    msg = text.splitlines()[0] if text else ""
    if isinstance(e, OSError) and not isinstance(e, EmbstoreError) and e.filename:
        msg = f"{e.filename}: {e.strerror}"
    elif isinstance(e, RecursionError):
        msg = "input nested too deeply to read"
    elif isinstance(e, MemoryError) and not isinstance(e, EmbstoreError):
        msg = "out of memory" + (f" ({msg})" if msg else "")
    elif not isinstance(e, (EmbstoreError, OSError, ValueError, TypeError)):
        msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    elif not msg:
        msg = type(e).__name__
    if len(msg) > 500:
        msg = msg[:500] + "..."
    subject = next((v for v in (getattr(args, n, None) for n in ("src", "target", "dest"))
                    if isinstance(v, str) and v), None)
    named = [v for v in (subject, getattr(args, "url", None)) if isinstance(v, str) and v]
    if subject and not any(v in msg for v in named):
        msg = f"{subject}: {msg}"
    return msg


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
