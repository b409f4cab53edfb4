"""Hand-encoded Bigtable v2 protobuf requests, and row-key codecs, for the hot paths.

Why not the client library's objects: building one ``Mutation``/``Entry`` message per row costs
~7x the emulator's own write time (REFERENCE.md: 35-38k rows/s through client objects against
271k rows/s with raw protobuf). Every record of a store has the same width, so for int64 keys
every ``MutateRowsRequest.Entry`` has the same size and the whole request is built as one
``(n, entry_size)`` uint8 array: a fixed template with the keys and record bytes copied in.

Wire facts used (google/bigtable/v2/bigtable.proto, data.proto)::

    MutateRowsRequest  table_name=1 app_profile_id=3 entries=2
      Entry            row_key=1 mutations=2
      Mutation         set_cell=1 delete_from_row=4
      SetCell          family_name=1 column_qualifier=2 timestamp_micros=3 value=4
    ReadRowsRequest    table_name=1 app_profile_id=5 rows=2 filter=3 rows_limit=4
      RowSet           row_keys=1 row_ranges=2
      RowRange         start_key_closed=1 start_key_open=2 end_key_open=3

Also here: which gRPC failures are transient (worth a retry).

Row keys: every data row starts with ``DATA_PREFIX`` (so no key can collide with the metadata
row ``META_ROW`` or the lease row ``LEASE_ROW``); an int64 key follows as 8 big-endian bytes
with the sign bit flipped, which makes byte order equal numeric order; a bytes key follows raw.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlsplit

import grpc
import numpy as np

from ..._keys import int64_from_ordered, ordered_int64_bytes
from ...errors import InvalidInputError, InvalidURLError

DATA_PREFIX = b"r"
DATA_END = b"s"  # exclusive end of the data row range
META_ROW = b"m"
LEASE_ROW = b"l"  # the writer-lease record (embstore.backends.lease_record), outside the data
#: a restore's generation (a fresh id per restore), outside the data range and the metadata row
GEN_ROW = b"g"
MAX_ROW_KEY = 4096  # Bigtable's row-key limit, in bytes


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int (or int64 as two's complement)."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def int_field(num: int, value: int) -> bytes:
    """A varint field (wire type 0)."""
    return varint(num << 3) + varint(value)


# -- row keys -------------------------------------------------------------------------------------
def encode_int_keys(keys: np.ndarray) -> np.ndarray:
    """``(n, 9)`` uint8: prefix + order-preserving big-endian int64 for each key."""
    out = np.empty((len(keys), 9), dtype=np.uint8)
    out[:, 0] = DATA_PREFIX[0]
    out[:, 1:] = ordered_int64_bytes(keys).view(np.uint8).reshape(-1, 8)
    return out


def decode_int_keys(row_keys: list[bytes]) -> np.ndarray:
    """Inverse of :func:`encode_int_keys` over a list of 9-byte row keys."""
    if not row_keys:
        return np.empty(0, dtype=np.int64)
    raw = np.frombuffer(b"".join(row_keys), dtype=np.uint8)
    if raw.size != 9 * len(row_keys):
        raise ValueError("row keys of an int64 store must be 9 bytes long")
    be = raw.reshape(-1, 9)[:, 1:].copy().view(">u8").ravel()
    return int64_from_ordered(be)


def encode_bytes_keys(keys: np.ndarray) -> list[bytes]:
    return [DATA_PREFIX + k for k in keys]


def decode_bytes_keys(row_keys: list[bytes]) -> np.ndarray:
    out = np.empty(len(row_keys), dtype=object)
    out[:] = [k[1:] for k in row_keys]
    return out


def row_keys(keys: np.ndarray, key_type: str) -> np.ndarray | list[bytes]:
    """The row keys of store keys of ``key_type`` (``"int64"``: one ``(n, 9)`` array)."""
    if key_type == "int64":
        return encode_int_keys(keys)
    too_long = [k for k in keys if len(k) >= MAX_ROW_KEY]
    if too_long:
        raise InvalidInputError(
            f"bytes keys must be shorter than {MAX_ROW_KEY} bytes for Bigtable; got one of "
            f"{len(too_long[0])} bytes")
    return encode_bytes_keys(keys)


def row_key_list(keys: np.ndarray, key_type: str) -> list[bytes]:
    """:func:`row_keys` as a list of ``bytes``."""
    rk = row_keys(keys, key_type)
    return [bytes(r) for r in rk] if isinstance(rk, np.ndarray) else list(rk)


def decode_keys(row_keys: list[bytes], key_type: str) -> np.ndarray:
    """Inverse of :func:`row_keys`."""
    if key_type == "int64":
        return decode_int_keys(row_keys)
    return decode_bytes_keys(row_keys)


# -- requests -------------------------------------------------------------------------------------
def request_head(table_name: str, app_profile_id: str | None, app_field: int) -> bytes:
    head = field(1, table_name.encode())
    if app_profile_id:
        head += field(app_field, app_profile_id.encode())
    return head


def _tag(num: int) -> bytes:
    return varint(num << 3 | 2)


def _cell_tail(family: bytes, ts: int, width: int) -> bytes:
    """Entry bytes between the row-key field and the value payload of a one-SetCell entry."""
    sc_head = field(1, family) + int_field(3, ts) + _tag(4) + varint(width)
    sc_len = len(sc_head) + width
    mut_len = len(_tag(1) + varint(sc_len)) + sc_len
    return _tag(2) + varint(mut_len) + _tag(1) + varint(sc_len) + sc_head


def mutate_rows_int(head: bytes, family: bytes, ts: int, row_keys: np.ndarray,
                    values: np.ndarray) -> bytes:
    """MutateRowsRequest setting one cell per row (``row_keys`` ``(n, k)``, ``values``
    ``(n, w)`` uint8), built as one ``(n, entry_size)`` array."""
    n, width = values.shape
    klen = row_keys.shape[1]
    mid = _cell_tail(family, ts, width)
    pre = _tag(2) + varint(2 + klen + len(mid) + width) + b"\x0a" + varint(klen)
    a = len(pre)
    b = a + klen + len(mid)
    buf = np.empty((n, b + width), dtype=np.uint8)
    buf[:, :a] = np.frombuffer(pre, np.uint8)
    buf[:, a:a + klen] = row_keys
    buf[:, a + klen:b] = np.frombuffer(mid, np.uint8)
    buf[:, b:] = values
    return head + buf.tobytes()


def mutate_rows_generic(head: bytes, family: bytes, ts: int, row_keys: list[bytes],
                        values: np.ndarray) -> bytes:
    """MutateRowsRequest setting one cell per row, for row keys of any length."""
    width = values.shape[1]
    mid = _cell_tail(family, ts, width)
    raw = values.tobytes()
    return head + b"".join(
        field(2, field(1, k) + mid + raw[i * width:(i + 1) * width])
        for i, k in enumerate(row_keys)
    )


_DELETE_ROW = field(2, field(4, b""))  # Entry.mutations = [Mutation{delete_from_row{}}]


def delete_rows(head: bytes, row_keys: list[bytes]) -> bytes:
    return head + b"".join(field(2, field(1, k) + _DELETE_ROW) for k in row_keys)


# -- CheckAndMutateRow (compare-and-set of one row) ---------------------------------------------
# CheckAndMutateRowRequest table_name=1 app_profile_id=7 row_key=2 predicate_filter=6
#   true_mutations=4 false_mutations=5; Mutation delete_from_column=2 (family_name=1,
#   column_qualifier=2); RowFilter chain=1 value_range_filter=15; ValueRange
#   start_value_closed=1 end_value_closed=3; CheckAndMutateRowResponse predicate_matched=1.
def set_cell(family: bytes, ts: int, value: bytes) -> bytes:
    """A ``Mutation`` setting the record cell (empty qualifier)."""
    return field(1, field(1, family) + int_field(3, ts) + field(4, value))


def delete_column(family: bytes) -> bytes:
    """A ``Mutation`` deleting every version of the record cell."""
    return field(2, field(1, family))


DELETE_ROW = field(4, b"")  # Mutation{delete_from_row{}}


def value_equals_filter(family: str, value: bytes) -> bytes:
    """RowFilter: the latest record cell holds exactly ``value`` (a closed value range)."""
    filters = [field(5, re.escape(family).encode()), int_field(12, 1),
               field(15, field(1, value) + field(3, value))]
    return field(1, b"".join(field(1, f) for f in filters))


def check_and_mutate(head: bytes, row_key: bytes, predicate: bytes, if_true: list[bytes],
                     if_false: list[bytes]) -> bytes:
    """CheckAndMutateRowRequest (``head`` from :func:`request_head` with app field 7)."""
    return (head + field(2, row_key) + field(6, predicate)
            + b"".join(field(4, m) for m in if_true) + b"".join(field(5, m) for m in if_false))


def read_rows_keys(head: bytes, row_keys: np.ndarray | list[bytes], filt: bytes) -> bytes:
    """ReadRowsRequest for explicit row keys (``(n, 9)`` uint8 array or list of bytes)."""
    if isinstance(row_keys, np.ndarray):
        n = len(row_keys)
        rs = np.empty((n, 11), dtype=np.uint8)
        rs[:, 0] = 0x0A
        rs[:, 1] = 9
        rs[:, 2:] = row_keys
        rowset = rs.tobytes()
    else:
        rowset = b"".join(field(1, k) for k in row_keys)
    return head + field(2, rowset) + field(3, filt)


def read_rows_range(head: bytes, start: bytes, start_open: bool, end: bytes, filt: bytes,
                    limit: int = 0) -> bytes:
    rng = field(2 if start_open else 1, start) + field(3, end)
    req = head + field(2, field(2, rng)) + field(3, filt)
    if limit:
        req += int_field(4, limit)
    return req


# -- filters --------------------------------------------------------------------------------------
class Heads(NamedTuple):
    """The fixed parts of one table's requests (immutable: every part of a backend shares
    them)."""

    family: str
    family_b: bytes
    read: bytes  # ReadRowsRequest head
    write: bytes  # MutateRowsRequest head
    cam: bytes  # CheckAndMutateRowRequest head
    sample: bytes  # SampleRowKeysRequest (the whole request)
    filter: bytes  # the latest cell of the family
    keys_filter: bytes  # ... with the value stripped


def heads(table_name: str, app_profile_id: str | None, family: str) -> Heads:
    """The :class:`Heads` of ``table_name`` (``app_profile_id``'s field differs per request)."""
    return Heads(family, family.encode(), request_head(table_name, app_profile_id, 5),
                 request_head(table_name, app_profile_id, 3),
                 request_head(table_name, app_profile_id, 7),
                 request_head(table_name, app_profile_id, 2), latest_cell_filter(family),
                 latest_cell_filter(family, strip_value=True))


def latest_cell_filter(family: str, strip_value: bool = False) -> bytes:
    """RowFilter: chain(family == ``family``, cells_per_column_limit 1[, strip_value]).

    The emulator keeps every old version of a cell whatever the GC rule says, so every read
    carries the limit; on real Bigtable it also hides versions not yet garbage-collected.
    """
    import re

    filters = [field(5, re.escape(family).encode()), int_field(12, 1)]
    if strip_value:
        filters.append(int_field(13, 1))
    return field(1, b"".join(field(1, f) for f in filters))


def parse_rows(responses, family: str) -> tuple[list[bytes], list[bytes]]:
    """Collect ``(row_keys, values)`` of committed rows from ReadRowsResponse messages.

    Implements the chunk state machine: a row's first chunk carries its key, a cell value may
    be split over chunks (``value_size`` > 0 on all but the last), ``reset_row`` discards the
    row so far and ``commit_row`` completes it. Only the first cell of ``family`` counts.
    """
    keys: list[bytes] = []
    vals: list[bytes] = []
    cur_key = b""
    cur_val: bytes | None = None
    parts: list[bytes] = []
    cur_fam = ""
    for resp in responses:
        for c in resp.chunks:
            if c.reset_row:
                cur_val, parts = None, []
                continue
            if c.row_key:
                cur_key = c.row_key
            if c.HasField("family_name"):
                cur_fam = c.family_name.value
            if c.value_size > 0:  # more chunks of this cell follow
                parts.append(c.value)
                continue
            if cur_val is None and cur_fam == family:
                if parts:
                    parts.append(c.value)
                    cur_val = b"".join(parts)
                else:
                    cur_val = c.value
            parts = []
            if c.commit_row:
                if cur_val is not None:
                    keys.append(cur_key)
                    vals.append(cur_val)
                cur_val = None
    return keys, vals


# -- gRPC status classification ---------------------------------------------------------------
TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
TRANSIENT_CODES = {s.value[0] for s in TRANSIENT}  # as ints, for per-entry rpc.Status
_STREAM_RESET = re.compile(r"RST_STREAM|stream removed|stream terminated|connection reset",
                           re.IGNORECASE)


def is_transient(err: grpc.RpcError) -> bool:
    """True for errors a retry may cure, including streams reset mid-way."""
    code = err.code() if hasattr(err, "code") else None
    if code in TRANSIENT:
        return True
    details = (err.details() if hasattr(err, "details") else "") or ""
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and bool(
        _STREAM_RESET.search(details))


def describe(err: BaseException) -> str:
    """``CODE: details`` of a gRPC error (any other exception: its type and message)."""
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        code = err.code()
        return f"{code.name if code else 'UNKNOWN'}: {err.details()}"
    return f"{type(err).__name__}: {err}"


class PartialWrite(Exception):
    """Some entries of a MutateRows request failed; ``failed`` holds their indices."""

    def __init__(self, failed: np.ndarray, status: Any, transient: bool) -> None:
        super().__init__(f"{len(failed)} rows failed: code {status.code} {status.message}")
        self.failed = failed
        self.status = status
        self.transient = transient


_PROJECT = re.compile(r"^[a-z0-9][-a-z0-9.:]*$")
_INSTANCE = re.compile(r"^[a-z][-a-z0-9]*$")
_TABLE = re.compile(r"^[-_.a-zA-Z0-9]{1,50}$")


def url_emulator_host(url: str) -> str | None:
    """The ``?emulator_host=HOST:PORT`` of a bigtable:// URL (the only query it takes)."""
    query = urlsplit(url).query
    if not query:
        return None
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        pairs = []
    if len(pairs) != 1 or pairs[0][0] != "emulator_host" or not pairs[0][1]:
        raise InvalidURLError(f"a bigtable URL takes only ?emulator_host=HOST:PORT as its "
                              f"query: {url!r}")
    return pairs[0][1]


def parse_url(url: str) -> tuple[str, str, str]:
    """Split ``bigtable://project/instance/table[?emulator_host=...]`` into its three ids,
    validating each."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "bigtable":
        raise InvalidURLError(f"not a bigtable:// URL: {url!r}")
    if parts.fragment:
        raise InvalidURLError(f"bigtable URL takes no fragment: {url!r}")
    url_emulator_host(url)
    ids = [parts.netloc] + parts.path.strip("/").split("/")
    if len(ids) != 3 or not all(ids):
        raise InvalidURLError(
            f"bigtable URL must be bigtable://project/instance/table, got {url!r}"
        )
    project, instance, table = ids
    for what, value, pat in (("project", project, _PROJECT), ("instance", instance, _INSTANCE),
                             ("table", table, _TABLE)):
        if not pat.match(value):
            raise InvalidURLError(f"invalid Bigtable {what} id {value!r} in {url!r}")
    return project, instance, table
