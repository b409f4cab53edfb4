"""The Bigtable data API's calls on a gRPC channel (requests go pre-encoded)."""

from __future__ import annotations

from typing import Any, NamedTuple

from ...errors import BackendUnavailableError
from ...extras import install_hint

try:
    from google.cloud.bigtable_v2.types import bigtable as _pb
except ImportError as e:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        "the bigtable:// backend needs google-cloud-bigtable; install it with: "
        + install_hint("bigtable")) from e


class DataStubs(NamedTuple):
    read_rows: Any
    mutate_rows: Any
    sample_row_keys: Any
    check_and_mutate: Any


def data_stubs(channel: Any) -> DataStubs:
    """ReadRows, MutateRows, SampleRowKeys and CheckAndMutateRow on ``channel``, taking
    encoded request bytes."""
    def ident(b: bytes) -> bytes:
        return b

    def stream(method: str, response: Any) -> Any:
        return channel.unary_stream(f"/google.bigtable.v2.Bigtable/{method}",
                                    request_serializer=ident,
                                    response_deserializer=response.pb().FromString)

    return DataStubs(stream("ReadRows", _pb.ReadRowsResponse),
                     stream("MutateRows", _pb.MutateRowsResponse),
                     stream("SampleRowKeys", _pb.SampleRowKeysResponse),
                     channel.unary_unary(
                         "/google.bigtable.v2.Bigtable/CheckAndMutateRow",
                         request_serializer=ident,
                         response_deserializer=_pb.CheckAndMutateRowResponse.pb().FromString))
