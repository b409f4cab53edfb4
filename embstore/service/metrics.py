"""A worker's operations endpoint: Prometheus text metrics, liveness and readiness, over HTTP.

``embstore serve ... --metrics HOST:PORT`` serves

- ``/metrics``: request counts, errors and a latency histogram per operation; the store's
  counters (``embstore_store_hits``, ``..._misses``, rows where counting is free, a cache's
  dirty rows...), the change log's position, a follower's lag;
- ``/healthz``: 200 while the process serves;
- ``/readyz``: 200 when the store answers (and, on a follower, it heard from its workers
  recently), 503 otherwise, with the reason.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: latency histogram bucket bounds, seconds
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_NAME = re.compile(r"[^a-zA-Z0-9_]")


class RequestMetrics:
    """Counts and latencies per operation (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.sums: dict[str, float] = {}
        #: per operation, the count of requests in each bucket alone (the text sums them):
        #: one increment per request, not one per bound above its latency
        self.buckets: dict[str, list[int]] = {}

    def observe(self, op: str, seconds: float, failed: bool) -> None:
        i = bisect.bisect_left(BUCKETS, seconds)   # the first bound >= seconds
        with self._lock:
            self.counts[op] = self.counts.get(op, 0) + 1
            if failed:
                self.errors[op] = self.errors.get(op, 0) + 1
            self.sums[op] = self.sums.get(op, 0.0) + seconds
            b = self.buckets.get(op)
            if b is None:
                b = self.buckets[op] = [0] * (len(BUCKETS) + 1)
            b[i] += 1

    def text(self) -> list[str]:
        with self._lock:
            out = ["# TYPE embstore_requests_total counter"]
            out += [f'embstore_requests_total{{op="{op}"}} {n}' for op, n in
                    sorted(self.counts.items())]
            out.append("# TYPE embstore_request_errors_total counter")
            out += [f'embstore_request_errors_total{{op="{op}"}} {self.errors.get(op, 0)}'
                    for op in sorted(self.counts)]
            out.append("# TYPE embstore_request_seconds histogram")
            for op in sorted(self.counts):
                for bound, n in zip(BUCKETS, itertools.accumulate(self.buckets[op][:-1]),
                                    strict=True):
                    out.append(f'embstore_request_seconds_bucket{{op="{op}",le="{bound}"}} {n}')
                out.append(f'embstore_request_seconds_bucket{{op="{op}",le="+Inf"}} '
                           f"{self.counts[op]}")
                out.append(f'embstore_request_seconds_sum{{op="{op}"}} {self.sums[op]:.6f}')
                out.append(f'embstore_request_seconds_count{{op="{op}"}} {self.counts[op]}')
        return out


def gauges(stats: dict[str, Any], prefix: str = "embstore_store_") -> list[str]:
    """Numeric entries of a stats dict as gauges (names made Prometheus-safe)."""
    out = []
    for name, v in sorted(stats.items()):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out.append(f"{prefix}{_NAME.sub('_', name)} {v}")
    return out


class OpsServer:
    """The HTTP endpoint; ``metrics()`` gives the text lines, ``ready()`` ``(ok, reason)``."""

    def __init__(self, address: str, metrics: Callable[[], list[str]],
                 ready: Callable[[], tuple[bool, str]]) -> None:
        host, _, port = address.rpartition(":")
        ops = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/metrics":
                    code, body, ctype = 200, "\n".join(ops.metrics()) + "\n", \
                        "text/plain; version=0.0.4"
                elif self.path == "/healthz":
                    code, body, ctype = 200, "ok\n", "text/plain"
                elif self.path == "/readyz":
                    ok, why = ops.ready()
                    code, body, ctype = (200 if ok else 503), why + "\n", "text/plain"
                else:
                    code, body, ctype = 404, "not found\n", "text/plain"
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:  # quiet: scrapes every few seconds
                pass

        self.metrics, self.ready = metrics, ready
        self.httpd = ThreadingHTTPServer((host, int(port)), Handler)
        self.port = self.httpd.server_address[1]
        self.started = time.time()
        threading.Thread(target=self.httpd.serve_forever, name="embstore-ops",
                         daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
