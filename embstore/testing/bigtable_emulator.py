"""Start and stop the Cloud Bigtable emulator (``cbtemulator``) for tests and benchmarks.

The binary is started directly, never through ``gcloud beta emulators bigtable start``: the
gcloud wrapper forks a child that survives when the wrapper is killed. Each handle kills only
the process it started, by PID. The emulator keeps everything in memory, so a restart (same
port) comes back empty.

:class:`FaultInjector` is a gRPC client interceptor that fails a chosen number of calls with
UNAVAILABLE / DEADLINE_EXCEEDED (or aborts streams mid-way) before passing calls through to
the real emulator: the one fault the emulator cannot produce on demand.

Example
-------
>>> from embstore.testing.bigtable_emulator import start_emulator
>>> emu = start_emulator()              # doctest: +SKIP
>>> os.environ["BIGTABLE_EMULATOR_HOST"] = emu.host   # doctest: +SKIP
>>> emu.stop()                          # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Sequence

import grpc

__all__ = [
    "EmulatorHandle", "FaultInjector", "InjectedRpcError", "find_emulator", "free_port",
    "start_emulator",
]

_DEFAULT_PATHS = (
    "/usr/lib/google-cloud-sdk/platform/bigtable-emulator/cbtemulator",
    "/usr/share/google-cloud-sdk/platform/bigtable-emulator/cbtemulator",
    "/opt/google-cloud-sdk/platform/bigtable-emulator/cbtemulator",
)
_live: weakref.WeakSet[EmulatorHandle] = weakref.WeakSet()


def find_emulator() -> str:
    """Path of the ``cbtemulator`` binary (``$CBTEMULATOR`` overrides the search)."""
    env = os.environ.get("CBTEMULATOR")
    candidates = ([env] if env else []) + list(_DEFAULT_PATHS)
    on_path = shutil.which("cbtemulator")
    if on_path:
        candidates.append(on_path)
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        "cbtemulator not found; install the Cloud SDK component 'bigtable' or set CBTEMULATOR"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float,
                    address: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"cbtemulator exited with code {proc.returncode} on port {port}")
        try:
            with socket.create_connection((address, port), timeout=0.2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"cbtemulator did not listen on port {port} in {timeout} s") from e
            time.sleep(0.01)


class EmulatorHandle:
    """One running ``cbtemulator`` process.

    Attributes
    ----------
    port : int
        The port it listens on (kept across :meth:`restart`).
    host : str
        ``"ADDRESS:PORT"`` (``127.0.0.1`` unless started with another ``address``), the
        value for ``BIGTABLE_EMULATOR_HOST``.
    pid : int or None
        PID of the current process, None once stopped.
    """

    def __init__(self, binary: str, port: int, start_timeout: float = 10.0, *,
                 address: str = "127.0.0.1", prefix: Sequence[str] = ()) -> None:
        self.binary = binary
        self.port = int(port)
        self.address = address
        # a command it runs under, e.g. ``ip netns exec NAME`` (a network namespace)
        self.prefix = list(prefix)
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None
        self._start()
        _live.add(self)

    @property
    def host(self) -> str:
        return f"{self.address}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _start(self) -> None:
        proc = subprocess.Popen(
            [*self.prefix, self.binary, "-host", self.address, "-port", str(self.port)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # Its own process group: a Ctrl-C at the terminal reaches the test runner, which
            # then stops the emulator itself, instead of racing it.
            start_new_session=True,
        )
        try:
            _wait_listening(self.port, proc, self.start_timeout, self.address)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        self._proc = proc

    def stop(self) -> None:
        """Kill the emulator process (by PID) and reap it. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def restart(self) -> None:
        """Stop (if running) and start a fresh, empty emulator on the same port."""
        self.stop()
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                self._start()
                return
            except RuntimeError:
                # The old socket may linger for a moment after the kill.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __enter__(self) -> EmulatorHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<EmulatorHandle {self.host} pid={self.pid}>"


def start_emulator(port: int | None = None, *, binary: str | None = None,
                   start_timeout: float = 10.0, address: str = "127.0.0.1",
                   prefix: Sequence[str] = ()) -> EmulatorHandle:
    """Start ``cbtemulator -host ADDRESS -port PORT`` and wait until it accepts connections.

    Parameters
    ----------
    port : int, optional
        Port to listen on; a free one is picked when omitted.
    binary : str, optional
        Path of ``cbtemulator`` (default: :func:`find_emulator`).
    start_timeout : float
        Seconds to wait for the port to accept connections.
    address : str
        The address it listens on (default loopback).
    prefix : sequence of str
        A command it runs under, e.g. ``["ip", "netns", "exec", NAME]`` to start it in a
        network namespace (:mod:`embstore.testing.netns`).

    Returns
    -------
    EmulatorHandle
        Call ``.stop()`` (or use it as a context manager); ``.host`` is the address.
    """
    return EmulatorHandle(binary or find_emulator(), port or free_port(), start_timeout,
                          address=address, prefix=prefix)


@atexit.register
def _stop_all() -> None:  # pragma: no cover - interpreter shutdown
    for handle in list(_live):
        handle.stop()


# -- fault injection ------------------------------------------------------------------------------
class InjectedRpcError(grpc.RpcError, grpc.Call):
    """The error a :class:`FaultInjector` raises: looks like a real failed gRPC call."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    # grpc.Call / grpc.RpcContext surface, unused by embstore
    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self):
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback) -> bool:
        return False


class FaultInjector(grpc.UnaryStreamClientInterceptor, grpc.UnaryUnaryClientInterceptor):
    """gRPC client interceptor failing the first ``failures`` calls, then passing through.

    Pass it to the backend (``embstore.open(url, interceptors=[inj])``); every other call
    reaches the real emulator untouched. It is the only fake in the Bigtable tests: the
    emulator cannot be made to return UNAVAILABLE on demand.

    Parameters
    ----------
    failures : int
        How many matching calls fail.
    codes : sequence of grpc.StatusCode
        Codes used in turn (default UNAVAILABLE, DEADLINE_EXCEEDED).
    methods : sequence of str
        Method names to target (``"ReadRows"``, ``"MutateRows"``); all when empty.
    mid_stream : bool
        Fail a streaming call after its first response (an aborted stream) instead of at
        the start; the real request has then reached the emulator.
    on_call : callable, optional
        ``on_call(n, method)`` before each matching call (n counts from 1) — e.g. to kill
        the emulator at a precise point of an operation.
    """

    def __init__(self, failures: int = 1, codes=None, methods=(), mid_stream: bool = False,
                 on_call=None) -> None:
        self.failures = int(failures)
        self.codes = list(codes or (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED))
        self.methods = tuple(methods)
        self.mid_stream = mid_stream
        self.on_call = on_call
        self.calls = 0
        self.injected = 0
        self._lock = threading.Lock()

    def _decide(self, method: str) -> InjectedRpcError | None:
        name = method.rsplit("/", 1)[-1]
        if self.methods and name not in self.methods:
            return None
        with self._lock:
            self.calls += 1
            n = self.calls
            fail = self.injected < self.failures
            if fail:
                self.injected += 1
                code = self.codes[(self.injected - 1) % len(self.codes)]
        if self.on_call is not None:
            self.on_call(n, name)
        if not fail:
            return None
        return InjectedRpcError(code, f"injected fault #{self.injected} on {name}")

    def intercept_unary_unary(self, continuation, client_call_details, request):
        err = self._decide(client_call_details.method)
        if err is not None:
            raise err
        return continuation(client_call_details, request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        err = self._decide(client_call_details.method)
        if err is None:
            return continuation(client_call_details, request)
        if not self.mid_stream:
            raise err
        return _abort_after_first(continuation(client_call_details, request), err)


def _abort_after_first(responses, err):
    for resp in responses:
        yield resp
        break
    raise err
