"""Start and stop DynamicEmbedding Workers (``embstore serve``) as real processes, for tests
and benchmarks. Each handle stops only the process it started, by PID.

Example
-------
>>> from embstore.testing.service import start_workers
>>> with start_workers(["memory://", "memory://"], dim=8) as workers:   # doctest: +SKIP
...     store = embstore.open(workers.url)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["WorkerProcess", "Workers", "start_worker", "start_workers"]

_READY = re.compile(r"serving .* as shard (\d+)/(\d+) on ([\d.]+):(\d+)")
_METRICS = re.compile(r"metrics on ([\d.]+:\d+)")


class WorkerProcess:
    """One ``embstore serve`` process; ``address`` is ``host:port``."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 timeout: float = 60.0) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "embstore", "serve", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        self.pid = self.proc.pid
        self.output: list[str] = []
        #: ``host:port`` of its ``--metrics`` endpoint, when started with one
        self.metrics_address: str | None = None
        self.address = self._wait_ready(timeout)
        # keep draining its output so a chatty worker never blocks on a full pipe
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            mm = _METRICS.search(line)
            if mm:
                self.metrics_address = mm.group(1)
            m = _READY.search(line)
            if m:
                return f"{m.group(3)}:{m.group(4)}"
        self.kill()
        raise RuntimeError("embstore serve did not start:\n" + "".join(self.output[-20:]))

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the worker flushes and closes), then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def pause(self, timeout: float = 10.0) -> None:
        """SIGSTOP, and wait until every thread of the worker is stopped (the signal reaches
        them in turn: a call sent just after ``kill`` could still be answered)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not _stopped(self.pid) and time.monotonic() < deadline:
            time.sleep(0.005)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


class Workers:
    """N workers serving one table; ``url`` is the ``des://`` URL naming them in order."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.workers = workers

    @property
    def url(self) -> str:
        return "des://" + ",".join(w.address for w in self.workers)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_worker(url: str, shard: tuple[int, int] = (0, 1), port: int = 0,
                 extra: Sequence[str] = (), env: dict[str, str] | None = None,
                 **options: Any) -> WorkerProcess:
    """Start ``embstore serve url --shard I/N`` on 127.0.0.1; ``options`` become ``-o k=v``
    (``dim``, ``key_type``, ``optimizer`` and ``cache`` become their own flags); ``env``
    adds to the process's environment."""
    args = [url, "--listen", f"127.0.0.1:{port}", "--shard", f"{shard[0]}/{shard[1]}"]
    for name in ("dim", "key_type", "optimizer", "cache"):
        if name in options:
            args += [f"--{name.replace('_', '-')}", str(options.pop(name))]
    for k, v in options.items():
        args += ["-o", f"{k}={v}"]
    return WorkerProcess([*args, *extra], env=env)


def start_workers(urls: Sequence[str], extra: Sequence[str] = (), **options: Any) -> Workers:
    """One worker per URL, shard ``i`` of ``len(urls)`` each (all started or none)."""
    started: list[WorkerProcess] = []
    try:
        for i, url in enumerate(urls):
            started.append(start_worker(url, (i, len(urls)), extra=extra, **dict(options)))
    except BaseException:
        for w in started:
            w.kill()
        raise
    return Workers(started)


def _stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state ``T`` in ``/proc``)."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                    return False
    except OSError:  # (gone, or no /proc: nothing more to wait for)
        return True
    return True
