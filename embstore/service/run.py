"""``embstore serve``: open a store and serve it as a DynamicEmbedding Worker until stopped.

SIGTERM and SIGINT shut the worker down gracefully: it stops taking calls, flushes the store
(a cache writes its dirty rows back) and closes it. ``--flush-every`` flushes on a timer, so a
crash loses at most that much of what a cache held.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from ..api import open as open_store
from ..errors import BackendError, InvalidInputError
from ..policies.admission import admission_from_config
from .ann_scan import ScanIndex, ann_index
from .auth import read_token_file
from .client import DesStore
from .follower import Follower, replica_options
from .metrics import OpsServer
from .server import Worker
from .shm import sweep, unlink_all


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``."""
    i, sep, n = text.partition("/")
    if not sep or not i.isdigit() or not n.isdigit() or not 0 <= int(i) < int(n):
        raise InvalidInputError(f"--shard must be I/N with 0 <= I < N, got {text!r}")
    return int(i), int(n)


def _connect_when_up(url: str, token_file: str | None, wait: float = 60.0) -> DesStore:
    """A client of the followed workers, waiting up to ``wait`` seconds for them to start
    (a follower launched beside its workers, as in deploy/Procfile)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return DesStore(url, token_file=token_file, read_only=True)
        except BackendError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def serve(url: str, *, listen: str = "127.0.0.1:0", shard: str = "0/1",
          token_file: str | None = None, tls_cert: str | None = None,
          tls_key: str | None = None, flush_every: float | None = None,
          follow: str | None = None, follow_token_file: str | None = None,
          poll: float | None = None, push_interval: float = 0.1, log_keys: int = 4_000_000,
          metrics: str | None = None, ann: bool = False,
          ann_rebuild: float = 0.1, ann_index_kind: str = "auto", ready: Any = None,
          shm: bool = True, **options: Any) -> int:
    """Serve ``url`` until SIGTERM/SIGINT; ``ready(port)`` is called once it listens.

    With ``follow`` (a ``des://`` URL), ``url`` is a replica: created with the followed
    table's layout, kept current from the workers' change logs, and served read-only: the
    workers push their changes at most every ``push_interval`` seconds, or with ``poll``
    the follower asks for them every ``poll`` seconds instead.
    """
    i, n = parse_shard(shard)
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidInputError(f"--listen must be HOST:PORT, got {listen!r}")
    if (tls_cert is None) != (tls_key is None):
        raise InvalidInputError("--tls-cert and --tls-key go together")
    if not log_keys > 0:
        raise InvalidInputError(f"--log-keys must be positive, got {log_keys}")
    if flush_every is not None and not flush_every > 0:
        raise InvalidInputError(f"--flush-every must be positive, got {flush_every}")
    tokens = read_token_file(token_file) if token_file else None
    tls = None
    if tls_cert and tls_key:
        with open(tls_cert, "rb") as c, open(tls_key, "rb") as k:
            tls = (c.read(), k.read())
    upstream = None
    if follow is not None:
        for flag, value in (("--poll", poll), ("--push-interval", push_interval)):
            if value is not None and not 0.001 <= value <= 60:
                raise InvalidInputError(f"{flag} must be 0.001..60 seconds, got {value}")
        upstream = _connect_when_up(follow, follow_token_file)
        options = {**replica_options(upstream), **options}
    store = open_store(url, **options)
    if shm:
        sweep()     # segment files of workers killed before their clients mapped them
    scheme = "grpc+tls" if tls else "grpc+tcp"
    try:
        worker = Worker(f"{scheme}://{host}:{port}", store, shard=i, shards=n, tokens=tokens,
                        tls=tls, read_only=upstream is not None, log_keys=log_keys, shm=shm)
    except BaseException:
        store.close()
        raise
    stop = threading.Event()
    follower: Follower | None = None
    if upstream is not None:
        follower = Follower(store, upstream, guard=worker.lock)
        worker.follower = follower
        follower.poll()  # a replica serves once it holds the whole table
    if ann:     # after a replica's first poll: --ann-index auto goes by the table's size
        worker.ann = ann_index(ann_index_kind, store, worker.lock, rebuild_at=ann_rebuild)
        if isinstance(worker.ann, ScanIndex):   # quantized once, then kept current
            with worker.lock:
                worker.ann.build()
    if follower is not None:
        threading.Thread(target=follower.run if poll else follower.follow,
                         args=(stop, poll or push_interval), name="embstore-follow",
                         daemon=True).start()

    def shutdown(*_: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    if flush_every:
        def flusher() -> None:
            while not stop.wait(flush_every):
                worker.flush()

        threading.Thread(target=flusher, name="embstore-flush", daemon=True).start()
    ops = None
    if metrics is not None:
        mhost, _, mport = metrics.rpartition(":")
        if not mhost or not mport.isdigit():
            raise InvalidInputError(f"--metrics must be HOST:PORT, got {metrics!r}")
        ops = OpsServer(metrics, worker.metrics_text, worker.ready)
        print(f"embstore: metrics on {mhost}:{ops.port}", flush=True)
    (ready or (lambda p: print(f"embstore: serving {store.url} as shard {i}/{n} on "
                               f"{host}:{p}", flush=True)))(worker.port)
    try:
        # The server has served since it was made. Not worker.serve(): its own signal
        # handling would shut the server down first, which waits for every stream a client
        # keeps open (embstore.service.streams), possibly forever, before the store closes.
        while not stop.wait(0.5):
            pass
    finally:
        stop.set()
        if ops is not None:
            ops.close()
        with worker.lock:
            # clients' kept streams (embstore.service.streams) may still send calls: from
            # here they are refused, and what was acknowledged is flushed by the close
            worker.stopping = True
            store.close()
        if upstream is not None:
            upstream.close()
        unlink_all()    # segments made for clients that never mapped them
        # new calls get an answer at once (GOAWAY); this waits for kept streams: not joined
        threading.Thread(target=worker.shutdown, daemon=True).start()
    return 0


def main(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """The ``embstore serve`` command."""
    if isinstance(options.get("admission"), dict):  # -o 'admission={"name": "frequency"...}'
        options["admission"] = admission_from_config(options["admission"])
    for name, value in (("dim", args.dim), ("key_type", args.key_type),
                        ("optimizer", args.optimizer), ("cache", args.cache)):
        if value is not None:
            # --optimizer '{"name": "sgd", "lr": 1.0}' gives a whole config
            options[name] = (json.loads(value) if name == "optimizer" and value.startswith("{")
                             else value)
    rc = serve(args.url, listen=args.listen, shard=args.shard, token_file=args.token_file,
               tls_cert=args.tls_cert, tls_key=args.tls_key, flush_every=args.flush_every,
               follow=args.follow, follow_token_file=args.follow_token_file, poll=args.poll,
               push_interval=args.push_interval, log_keys=args.log_keys,
               metrics=args.metrics, ann=args.ann, ann_rebuild=args.ann_rebuild,
               ann_index_kind=args.ann_index, shm=not args.no_shm, **options)
    # The store is closed and flushed. The Flight server, torn down at interpreter exit,
    # would wait for every stream a client still keeps open (embstore.service.streams),
    # possibly forever: the process ends here instead.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
