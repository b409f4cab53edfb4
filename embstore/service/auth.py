"""Who may call a DynamicEmbedding Worker: bearer tokens per role (``--token-file``).

A ``train`` token may call everything; a ``serve`` token only what reads
(:data:`READ_OPS`; a lookup that inserts is a write). Without a token file every caller may
train (loopback use).
"""

from __future__ import annotations

from typing import Any

import pyarrow.flight as flight

from ..errors import InvalidInputError

#: operations a ``serve`` token may call (everything else writes)
READ_OPS = frozenset({"info", "len", "stats", "lookup", "contains", "top_k", "sample_weight",
                      "sample_draw", "sample_prob", "records", "changes", "snapshot",
                      "subscribe"})
ROLES = ("train", "serve")


def read_token_file(path: str) -> dict[str, str]:
    """``token -> role`` from a file of ``ROLE TOKEN`` lines (``#`` comments)."""
    tokens: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or parts[0] not in ROLES or len(parts[1]) < 16:
                raise InvalidInputError(f"{path}:{n}: expected 'train|serve TOKEN' with a "
                                        "token of at least 16 characters")
            tokens[parts[1]] = parts[0]
    if not tokens:
        raise InvalidInputError(f"{path}: no tokens")
    return tokens


class Role(flight.ServerMiddleware):
    def __init__(self, role: str) -> None:
        self.role = role


class TokenAuth(flight.ServerMiddlewareFactory):
    """Bearer tokens per role; no token file means every caller may train (loopback use)."""

    def __init__(self, tokens: dict[str, str] | None) -> None:
        self.tokens = tokens

    def start_call(self, info: Any, headers: dict[str, list[str]]) -> Role:
        if self.tokens is None:
            return Role("train")
        for value in headers.get("authorization", []):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token in self.tokens:
                return Role(self.tokens[token])
        raise flight.FlightUnauthenticatedError("no valid token (Authorization: Bearer ...)")
