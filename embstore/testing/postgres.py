"""Start and stop a throwaway PostgreSQL 15 server for tests and benchmarks.

``initdb`` creates a cluster in a fresh temporary directory and ``pg_ctl`` starts it on a free
loopback port with its Unix socket inside that directory. PostgreSQL refuses to run as root, so
under root both run as the ``postgres`` user (``runuser``) and the directory is handed to it.
A handle stops only the postmaster it started (``pg_ctl stop``, then SIGKILL of that PID) and
removes the directory.

Example
-------
>>> from embstore.testing.postgres import start_postgres
>>> pg = start_postgres()                    # doctest: +SKIP
>>> store = embstore.open(pg.url + "?table=words", dim=64)   # doctest: +SKIP
>>> pg.stop()                                # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator

__all__ = ["PostgresHandle", "find_pg_bin", "free_port", "start_postgres"]

_DEFAULT_BINDIRS = (
    "/usr/lib/postgresql/15/bin",
    "/usr/lib/postgresql/16/bin",
    "/usr/lib/postgresql/17/bin",
    "/usr/lib/postgresql/14/bin",
)
_live: weakref.WeakSet[PostgresHandle] = weakref.WeakSet()


def find_pg_bin() -> str:
    """Directory holding ``initdb`` and ``pg_ctl`` (``$EMBSTORE_PGBIN`` overrides the search)."""
    env = os.environ.get("EMBSTORE_PGBIN")
    candidates = ([env] if env else []) + list(_DEFAULT_BINDIRS)
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(os.path.dirname(on_path))
    for d in candidates:
        if d and os.access(os.path.join(d, "initdb"), os.X_OK):
            return d
    raise FileNotFoundError("PostgreSQL binaries (initdb, pg_ctl) not found; set EMBSTORE_PGBIN")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresHandle:
    """One running PostgreSQL cluster.

    Attributes
    ----------
    host, port, user, dbname : str, int, str, str
        Where to connect (trust authentication, no password).
    url : str
        SQLAlchemy URL of the default database, ``postgresql+psycopg://user@host:port/db``.
    pid : int
        The postmaster's PID (the only process :meth:`stop` kills).
    """

    pid: int | None  # None once stopped

    def __init__(self, base: str, data: str, port: int, pid: int, as_user: list[str],
                 bindir: str) -> None:
        self.base, self.data, self.port, self.pid = base, data, port, pid
        self.host, self.user, self.dbname = "127.0.0.1", "postgres", "postgres"
        self._as_user, self._bindir = as_user, bindir
        self.url = f"postgresql+psycopg://{self.user}@{self.host}:{port}/{self.dbname}"
        self.dsn = f"host={self.host} port={port} user={self.user} dbname={self.dbname}"
        _live.add(self)

    def __getitem__(self, name: str):  # dict-style access for fixtures: server["port"]
        return getattr(self, name)

    @property
    def running(self) -> bool:
        return self.pid is not None

    def stop(self) -> None:
        """Stop the postmaster this handle started, then remove its directory. Idempotent."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        try:
            subprocess.run(self._as_user + [os.path.join(self._bindir, "pg_ctl"), "-D", self.data,
                                            "-m", "immediate", "-w", "-t", "20", "stop"],
                           capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_gone(pid, 10)
        shutil.rmtree(self.base, ignore_errors=True)

    def restart(self, mode: str = "fast") -> None:
        """Restart the server in place (same port, same data): every client connection is
        cut. ``mode`` is ``pg_ctl``'s shutdown mode (``fast`` or ``immediate``)."""
        if self.pid is None:
            raise RuntimeError("the server was stopped")
        r = subprocess.run(self._as_user + [os.path.join(self._bindir, "pg_ctl"), "-D", self.data,
                                            "-m", mode, "-w", "-t", "60", "-l",
                                            os.path.join(self.base, "server.log"), "restart"],
                           capture_output=True, text=True, timeout=90, check=False)
        self._running_after(r, "restart")

    def _running_after(self, r: subprocess.CompletedProcess, what: str) -> None:
        """Take the server's new pid after ``pg_ctl`` (``r``), or raise with its log's tail."""
        pid = _read_pid(self.data)
        if r.returncode != 0 or not pid:
            raise RuntimeError(f"PostgreSQL did not {what}: {r.stderr.strip()}"
                               + _tail(os.path.join(self.base, "server.log")))
        self.pid = pid

    @contextlib.contextmanager
    def down(self, mode: str = "immediate") -> Iterator[None]:
        """Stop the server (keeping its data) for the ``with`` block, then start it again on
        the same port: clients see an outage, e.g. a write cut off mid-batch."""
        if self.pid is None:
            raise RuntimeError("the server was stopped")
        ctl = self._as_user + [os.path.join(self._bindir, "pg_ctl"), "-D", self.data]
        # the server's own command line (port, socket dir, settings), to start it as it was
        with open(os.path.join(self.data, "postmaster.opts")) as f:
            args = shlex.split(f.read())[1:]
        keep = [a for i, a in enumerate(args) if a != "-D" and (i == 0 or args[i - 1] != "-D")]
        subprocess.run(ctl + ["-m", mode, "-w", "-t", "60", "stop"], capture_output=True,
                       timeout=90, check=False)
        try:
            yield
        finally:
            r = subprocess.run(ctl + ["-o", shlex.join(keep), "-w", "-t", "60", "-l",
                                      os.path.join(self.base, "server.log"), "start"],
                               capture_output=True, text=True, timeout=90, check=False)
            self._running_after(r, "start again")

    def __enter__(self) -> PostgresHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<PostgresHandle {self.url} pid={self.pid}>"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours would still answer kill(0); reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def start_postgres(*, settings: dict[str, str] | None = None, attempts: int = 3,
                   timeout: float = 60.0) -> PostgresHandle:
    """Create a cluster in a temporary directory and start it on a free loopback port.

    Parameters
    ----------
    settings : dict, optional
        Extra ``-c name=value`` server settings (e.g. ``{"fsync": "off"}`` for fast tests).
    attempts : int
        Ports to try when the chosen one was taken between probing and binding.
    timeout : float
        Seconds ``pg_ctl -w`` waits for the server to accept connections.
    """
    bindir = find_pg_bin()
    base = tempfile.mkdtemp(prefix="embstore-pg-")
    data = os.path.join(base, "data")
    as_user: list[str] = []
    if os.geteuid() == 0:
        # The postmaster refuses to run as root; the cluster belongs to 'postgres'.
        import pwd

        pw = pwd.getpwnam("postgres")
        os.chown(base, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    try:
        r = subprocess.run(as_user + [os.path.join(bindir, "initdb"), "-D", data, "-U",
                                      "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed ({r.returncode}): {r.stderr.strip()}")
        opts = ["-c", "listen_addresses=127.0.0.1"]
        for k, v in (settings or {}).items():
            opts += ["-c", f"{k}={v}"]
        last = ""
        for _ in range(max(1, attempts)):
            port = free_port()
            o = " ".join([f"-p {port}", f"-k {base}"] + opts)
            r = subprocess.run(as_user + [os.path.join(bindir, "pg_ctl"), "-D", data, "-o", o,
                                          "-l", os.path.join(base, "server.log"), "-w", "-t",
                                          str(int(timeout)), "start"],
                               capture_output=True, text=True, timeout=timeout + 30)
            pid = _read_pid(data)
            if r.returncode == 0 and pid:
                return PostgresHandle(base, data, port, pid, as_user, bindir)
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
                _wait_gone(pid, 10)
            last = r.stderr.strip() + _tail(os.path.join(base, "server.log"))
        raise RuntimeError(f"PostgreSQL did not start: {last}")
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise


def _read_pid(data: str) -> int | None:
    try:
        with open(os.path.join(data, "postmaster.pid")) as f:
            return int(f.readline().strip())
    except (OSError, ValueError):
        return None


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return "\n" + f.read()[-n:]
    except OSError:
        return ""


@atexit.register
def _stop_leftovers() -> None:
    # A crashed test session must not leave a postmaster behind.
    for h in list(_live):
        h.stop()
