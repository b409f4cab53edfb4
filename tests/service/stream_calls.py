"""A request on a worker's kept stream, sent by hand (tests of ``Worker._serve_stream``)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa


def ask(writer: Any, reader: Any, meta: bytes, batch: pa.RecordBatch | None) -> Any:
    """Send one stream message (``meta`` as its header, ``batch`` its rows, or none) and
    return the answer: its rows, or the one-line error text of a refusal."""
    if batch is None:
        writer.write_metadata(pa.py_buffer(meta))
    else:
        writer.write_with_metadata(batch, pa.py_buffer(meta))
    chunk = reader.read_chunk()
    if chunk.data is None:
        return chunk.app_metadata.to_pybytes().decode()
    return chunk.data
