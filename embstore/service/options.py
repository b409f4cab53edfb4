"""The ``embstore serve`` command line (no pyarrow here: ``embstore --help`` runs without it)."""

from __future__ import annotations

import argparse

from ..errors import InvalidInputError


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``."""
    i, sep, n = text.partition("/")
    if not sep or not i.isdigit() or not n.isdigit() or not 0 <= int(i) < int(n):
        raise InvalidInputError(f"--shard must be I/N with 0 <= I < N, got {text!r}")
    return int(i), int(n)


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's arguments (besides the common ``-o``)."""
    s.add_argument("url", help="the store this worker owns (any backend; e.g. lmdb:///d/s0)")
    s.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="address to serve on (port 0: any free port; printed at start)")
    s.add_argument("--shard", default="0/1", metavar="I/N",
                   help="this worker's shard of N (keys with key_hash64 %% N == I)")
    s.add_argument("--dim", type=int, help="dim of a store to create")
    s.add_argument("--key-type", choices=("int64", "bytes"), help="key type of a new store")
    s.add_argument("--optimizer", help="optimizer of a new store, e.g. adagrad")
    s.add_argument("--cache", metavar="URL", help="a local cache over a remote store "
                   "(e.g. memory://), written back on flush")
    s.add_argument("--flush-every", type=float, metavar="SECONDS",
                   help="flush the store on this period (default: on shutdown only)")
    s.add_argument("--token-file", help="file of 'train|serve TOKEN' lines; callers then need "
                   "a bearer token ('serve' tokens only read)")
    s.add_argument("--tls-cert", help="PEM certificate (with --tls-key): serve over TLS")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--metrics", metavar="HOST:PORT", help="serve /metrics (Prometheus text), "
                   "/healthz and /readyz over HTTP on this address")
    s.add_argument("--follow", metavar="DES_URL", help="serve URL as a read-only replica kept "
                   "current from these workers' change logs (docs/service.md, Followers)")
    s.add_argument("--follow-token-file", help="file holding the token for --follow")
    s.add_argument("--poll", type=float, default=0.1, metavar="SECONDS",
                   help="how often a follower asks the workers for changes (default 0.1)")
