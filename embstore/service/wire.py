"""What travels between a ``des://`` client and a DynamicEmbedding Worker (DEW).

Every call is an Arrow Flight call: ``do_action`` for small JSON questions (``info``,
``flush``, ``len``, ``stats``, ``sample_weight``), ``do_exchange`` for batches (one JSON header
in the descriptor, one Arrow record batch each way: keys, vectors as fixed-size lists of
float32, counts, scores), ``do_get`` for an export's stream of records. Arrow buffers of
primitive columns are numpy views on both sides (no per-key Python for int64 keys).

Errors cross as one line, ``[embstore:ClassName] message``, and come out on the client as
the same :mod:`embstore.errors` class.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from .. import errors
from ..errors import EmbstoreError, InvalidInputError, InvalidURLError, KeyTypeError
from ..sampling.samplers import LogUniformSampler, Sampler, UniformSampler, UnigramSampler

#: rows one request may carry (a DEW refuses more: a bounded allocation per call)
MAX_ROWS = 1 << 21
#: bytes of one request's batch a DEW accepts
MAX_BYTES = 512 << 20
#: the gRPC message limit both sides set (above MAX_BYTES, so our own check speaks first)
GRPC_MESSAGE_BYTES = MAX_BYTES + (16 << 20)
#: most ``k`` a top-k request may ask of a shard, and most draws a sample round may ask
MAX_TOP_K = 1 << 16
MAX_DRAWS = 1 << 24

SCHEME = "des"

_MARK = re.compile(r"\[embstore:(\w+)\] (.*)", re.S)


def remote_error(e: BaseException) -> str:
    """The one line a DEW sends for ``e``."""
    name = type(e).__name__ if isinstance(e, EmbstoreError) else "BackendError"
    text = " ".join(str(e).split()) or type(e).__name__
    return f"[embstore:{name}] {text}"


def raise_remote(e: Exception, where: str) -> None:
    """Raise the :mod:`embstore.errors` class a DEW named, or a ``BackendError``/
    ``AuthenticationError`` for transport failures; ``where`` names the worker."""
    m = _MARK.search(str(e))
    if m is not None:
        cls = getattr(errors, m.group(1), None)
        text = m.group(2).split("\n")[0].split(". Detail:")[0].strip()
        if isinstance(cls, type) and issubclass(cls, EmbstoreError):
            raise cls(f"{where}: {text}") from None
    if isinstance(e, flight.FlightUnauthenticatedError):
        raise errors.AuthenticationError(f"{where}: refused: {_first_line(e)}") from None
    if isinstance(e, flight.FlightTimedOutError):
        raise errors.BackendError(f"{where}: no answer within the deadline") from None
    raise errors.BackendError(f"{where}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().split("\n")[0][:300]


def command(op: str, **fields: Any) -> flight.FlightDescriptor:
    """The descriptor of a ``do_exchange`` call: its JSON header."""
    return flight.FlightDescriptor.for_command(json.dumps({"op": op, **fields}).encode())


def parse_body(raw: bytes) -> dict[str, Any]:
    """A JSON object; ``InvalidInputError`` for anything else."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidInputError("request header is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidInputError("request header must be a JSON object")
    return body


def parse_header(raw: bytes) -> dict[str, Any]:
    """A request header: a JSON object with an ``op``."""
    header = parse_body(raw)
    if not isinstance(header.get("op"), str):
        raise InvalidInputError("request header must name an 'op'")
    return header


def parse_des_url(url: str) -> tuple[list[str], dict[str, str]]:
    """``(["host:port", ...], query options)`` of a ``des://`` URL."""
    parts = urlsplit(url)
    if parts.scheme.lower() != SCHEME or not parts.netloc or parts.path not in ("", "/"):
        raise InvalidURLError(f"not a des URL (des://host:port[,host:port...]): {url!r}")
    addrs = parts.netloc.split(",")
    for a in addrs:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidURLError(f"{url!r}: {a!r} is not host:port")
    return addrs, dict(parse_qsl(parts.query))


# -- columns ----------------------------------------------------------------------------------
def keys_column(keys: np.ndarray) -> pa.Array:
    if keys.dtype == np.int64:
        return pa.array(keys, type=pa.int64())
    return pa.array(keys.tolist(), type=pa.binary())


def keys_from(col: Any, key_type: str) -> np.ndarray:
    """Keys of a column, checked against the store's key type."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if key_type == "int64":
        if col.type != pa.int64():
            raise KeyTypeError(f"keys must be int64 for this store, got {col.type}")
        return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.int64)
    if col.type not in (pa.binary(), pa.large_binary()):
        raise KeyTypeError(f"keys must be bytes for this store, got {col.type}")
    out = np.empty(len(col), dtype=object)
    out[:] = col.to_pylist()
    if len(out) and any(v is None for v in out):
        raise InvalidInputError("null keys")
    return out


def vectors_column(v: np.ndarray) -> pa.Array:
    v = np.ascontiguousarray(v, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1])


def vectors_from(col: Any, dim: int, rows: int) -> np.ndarray:
    """A ``(rows, dim)`` float32 array from a fixed-size-list column, checked: a read-only
    view of the column's buffer (no copy; copy it to keep or write it)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    if not (pa.types.is_fixed_size_list(col.type) and col.type.list_size == dim
            and col.type.value_type == pa.float32()):
        raise InvalidInputError(f"vectors must be fixed-size lists of {dim} float32, got "
                                f"{col.type}")
    if len(col) != rows or col.null_count:
        raise InvalidInputError(f"expected {rows} vectors, got {len(col)} "
                                f"({col.null_count} null)")
    # the child array ignores the list's own offset (a sliced column): slice it to match
    flat = col.values.slice(col.offset * dim, rows * dim)
    if flat.null_count:
        raise InvalidInputError(f"{flat.null_count} null vector elements")
    # viewed as float32: the dtype numpy gives Arrow memory reads "=f" to some consumers
    return flat.to_numpy(zero_copy_only=True).view(np.float32).reshape(rows, dim)


def records_from(b: Any, key_type: str, dtype: np.dtype,
                 copy: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, records)`` of a batch or table with ``key`` and ``rec`` (fixed-size binary of
    one record each) columns, checked against the record size (``copy=False``: the records
    are a view of the batch's buffer, not to be written)."""
    keys = keys_from(b.column("key"), key_type)
    col = b.column("rec")
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if col.type != pa.binary(dtype.itemsize) or col.null_count:
        raise InvalidInputError(f"records must be {dtype.itemsize}-byte binaries, got {col.type}")
    if len(col) == 0:
        return keys, np.zeros(0, dtype)
    raw = col.buffers()[1]
    recs = np.frombuffer(raw, np.uint8, len(col) * dtype.itemsize, col.offset * dtype.itemsize)
    # copied as bytes: numpy copies a structured dtype field by field (10x slower)
    return keys, (recs.copy() if copy else recs).view(dtype)


def exclude_column(exclude: Any, n: int, normalize: Any) -> pa.ListArray:
    """A ``top_k`` request's ``ex`` column: one list of keys per query (``exclude`` one list
    for all ``n`` queries, or a list of ``n`` lists), ``normalize`` the store's key check."""
    per = (exclude if isinstance(exclude, (list, tuple)) and len(exclude) == n and n
           and all(isinstance(e, (list, tuple, np.ndarray)) for e in exclude)
           else [exclude] * n)
    lists = [normalize(e) for e in per]
    offs = np.concatenate(([0], np.cumsum([len(e) for e in lists]))).astype(np.int32)
    flat = np.concatenate(lists) if lists else normalize([])
    return pa.ListArray.from_arrays(pa.array(offs), keys_column(flat))


def batch(**columns: Any) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(columns)


def read_request(reader: Any) -> pa.Table:
    """The one batch of a request, bounded by :data:`MAX_ROWS` and :data:`MAX_BYTES`."""
    return request_table(reader.read_all())


def request_table(data: pa.Table | pa.RecordBatch) -> pa.Table | pa.RecordBatch:
    """A request's rows (a batch stays a batch: no table around it), bounded by
    :data:`MAX_ROWS` and :data:`MAX_BYTES`."""
    if data.num_rows > MAX_ROWS or data.nbytes > MAX_BYTES:
        raise InvalidInputError(f"request of {data.num_rows} rows / {data.nbytes} bytes is "
                                f"over the limit ({MAX_ROWS} rows, {MAX_BYTES} bytes)")
    return data


# -- samplers ---------------------------------------------------------------------------------
def sampler_spec(sampler: Sampler) -> dict[str, Any]:
    """A sampler as JSON (the ones a worker can rebuild)."""
    if isinstance(sampler, UniformSampler):
        return {"name": "uniform"}
    if isinstance(sampler, UnigramSampler):
        return {"name": "unigram", "power": float(sampler.power),
                "smoothing": float(sampler.smoothing)}
    if isinstance(sampler, LogUniformSampler):
        return {"name": "log_uniform"}
    raise InvalidInputError(f"{type(sampler).__name__} cannot be sent to a worker; use a "
                            "uniform, unigram or log-uniform sampler with des://")


def sampler_from(spec: Any) -> Sampler:
    if not isinstance(spec, dict):
        raise InvalidInputError("sampler must be a JSON object")
    name = spec.get("name")
    if name == "uniform":
        return UniformSampler()
    if name == "log_uniform":
        return LogUniformSampler()
    if name == "unigram":
        return UnigramSampler(power=spec.get("power", 0.75),
                              smoothing=spec.get("smoothing", 0.0))
    raise InvalidInputError(f"unknown sampler {name!r}")
