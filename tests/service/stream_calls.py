"""A worker's kept stream opened and asked by hand (tests of ``Worker._serve_stream``)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from embstore.service import wire
from embstore.testing.service import WorkerProcess, start_worker

TRAIN_TOKEN, SERVE_TOKEN = "t" * 20, "s" * 20


def token_worker(tmp_path: Any, dim: int) -> WorkerProcess:
    """A ``memory://`` worker (zeros, SGD at lr 1) that takes a ``train`` role token
    (TRAIN_TOKEN) and a ``serve`` one (SERVE_TOKEN) from a token file in ``tmp_path``."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"train {TRAIN_TOKEN}\nserve {SERVE_TOKEN}\n")
    return start_worker("memory://", dim=dim, optimizer='{"name": "sgd", "lr": 1.0}',
                        initializer="zeros", extra=["--token-file", str(tokens)])


def open_stream(address: str, head: dict, schema: pa.Schema, token: str | None = None
                ) -> tuple[Any, Any, Any]:
    """``(client, writer, reader)`` of a kept stream to the worker at ``address`` (``head``:
    its shard and N), begun with ``schema``, sent with a bearer ``token`` when given."""
    client = flight.FlightClient(f"grpc+tcp://{address}")
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    writer, reader = client.do_exchange(wire.command("stream", **head),
                                        flight.FlightCallOptions(headers=headers, timeout=20))
    writer.begin(schema)
    return client, writer, reader


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
