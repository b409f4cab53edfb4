"""The ``embstore serve`` command line (no pyarrow here: ``embstore --help`` runs without it)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InvalidInputError
from ..extras import install_hint


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
    s.add_argument("--no-shm", action="store_true", help="send every client's rows over the "
                   "network, also a client on this host (default: through shared memory)")
    s.add_argument("--tls-cert", help="PEM certificate (with --tls-key): serve over TLS")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--metrics", metavar="HOST:PORT", help="serve /metrics (Prometheus text), "
                   "/healthz and /readyz over HTTP on this address")
    s.add_argument("--ann", action="store_true", help="keep an HNSW index (usearch) for "
                   "top_k(approximate=True); fresh keys are scored exactly until a rebuild")
    s.add_argument("--ann-index", choices=("auto", "scan", "hnsw"), default="auto",
                   help="the --ann index: scan (exact: an int8 scan with provable bounds, "
                   "then exact re-scoring), hnsw (usearch graph + fresh segment), or auto "
                   "(default): scan up to 400k rows at start, hnsw beyond")
    s.add_argument("--ann-rebuild", type=float, default=0.1, metavar="SHARE",
                   help="rebuild the ANN index once this share of rows changed (default 0.1)")
    s.add_argument("--follow", metavar="DES_URL", help="serve URL as a read-only replica kept "
                   "current from these workers' change logs (docs/service.md, Followers)")
    s.add_argument("--follow-token-file", help="file holding the token for --follow")
    s.add_argument("--log-keys", type=int, default=4_000_000, metavar="N",
                   help="keys the change log keeps for followers (default 4M); a follower "
                   "further behind takes a snapshot")
    s.add_argument("--push-interval", type=float, default=0.1, metavar="SECONDS",
                   help="a follower's workers push its changes at most this often "
                   "(default 0.1)")
    s.add_argument("--poll", type=float, metavar="SECONDS",
                   help="a follower polls its workers for changes this often instead of "
                   "subscribing to them")


def add_serve_command(sub: Any, common: argparse.ArgumentParser,
                      options: Callable[[Sequence[str] | None], dict[str, Any]]) -> None:
    """Register ``embstore serve`` on the CLI's subparsers; ``options`` parses ``-o``."""
    s = sub.add_parser("serve", parents=[common], help="serve a store as a DynamicEmbedding "
                       "Worker (des://)", description="Serve the store at URL to des:// "
                       "clients until SIGTERM/SIGINT (then flush and close). See "
                       "docs/service.md.")
    add_serve_arguments(s)

    def run(args: argparse.Namespace) -> int:
        try:
            # deferred: pyarrow (Arrow Flight) is imported only when a worker is started
            from .run import main
        except ImportError as e:
            raise InvalidInputError(f"embstore serve needs pyarrow ({e.name or e}); install "
                                    f"the 'service' extra: {install_hint('service')}") from e
        return main(args, options(args.option))

    s.set_defaults(func=run)
