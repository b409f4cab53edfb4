"""A write-back cache whose writer was SIGKILLed: the restart on the same host takes the lease
over at once; live and remote holders keep it, and the error says who holds it until when."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import embstore
from embstore.layers.cache.lease import (
    LeaseConflictError,
    holder_is_dead,
    machine_identity,
    modify_leases,
    process_start,
    read_leases,
)
from tests.subprocs import child_env

DIM = 4
LONG = 301.0   # the lease of the report: waiting for it would take five minutes


@pytest.fixture(params=["postgresql", "bigtable"])
def remote_url(request):
    factory = ("postgres_url_factory" if request.param == "postgresql"
               else "bigtable_url_factory")
    url = request.getfixturevalue(factory)()
    embstore.open(url, dim=DIM).close()
    return url


def _crashed_writer(url: str) -> None:
    """A training process: write-back cache, a few updates, then SIGKILL (no close)."""
    code = textwrap.dedent(f"""
        import os, signal, numpy as np, embstore
        s = embstore.open({url!r}, cache="memory://", write_policy="back",
                          lease_seconds={LONG})
        s.update(np.arange(8), np.ones((8, {DIM}), np.float32))
        s.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    res = subprocess.run([sys.executable, "-c", code], env=child_env(), timeout=120,
                         capture_output=True, text=True)
    assert res.returncode == -signal.SIGKILL, res.stderr


def test_restart_after_sigkill_takes_the_lease_over_at_once(remote_url):
    _crashed_writer(remote_url)
    with embstore.open(remote_url, read_only=True) as r:
        (lease,) = read_leases(r.backend)[1].values()   # the dead writer's, still there
        assert lease["expires"] - time.time() > LONG - 120
    with embstore.open(remote_url, cache="memory://", write_policy="back") as s:
        s.update(np.arange(8), np.ones((8, DIM), np.float32))   # refused before: 301 s wait
        s.flush()
    with embstore.open(remote_url, read_only=True) as r:
        np.testing.assert_array_equal(r.get_records(np.arange(8))[0]["count"], [2] * 8)
        assert read_leases(r.backend)[1] == {}


def test_a_live_holder_keeps_its_lease_and_the_error_says_who(remote_url):
    a = embstore.open(remote_url, cache="memory://", lease_seconds=LONG)
    a.update(np.arange(2), np.ones((2, DIM), np.float32))
    b = embstore.open(remote_url, cache="memory://")
    with pytest.raises(LeaseConflictError) as info:
        b.update(np.arange(2), np.ones((2, DIM), np.float32))
    msg = str(info.value)
    assert f"pid {os.getpid()}" in msg and "still running on this host" in msg
    assert "lease until" in msg and "s from now" in msg
    a.close()
    b.close()


def _plant(url: str, **lease) -> None:
    """Put a lease entry as another writer would have left it."""
    from embstore.registry import backend_class

    backend = backend_class(url)(url)
    entry = {"keys": None, **machine_identity(), "expires": time.time() + LONG, **lease}
    modify_leases(backend, lambda epoch, _: (epoch + 1, {"planted": {**entry,
                                                                    "token": epoch + 1}}))
    backend.close()


def test_pid_reused_by_another_process_is_taken_over(tmp_path):
    url = f"sqlite:///{tmp_path}/r.db"
    embstore.open(url, dim=DIM).close()
    # our own pid, but a start time that is not ours: the pid was reused after a crash
    _plant(url, pid=os.getpid(), start="1")
    with embstore.open(url, cache="memory://") as s:
        s.update([1], np.ones((1, DIM), np.float32))


def test_remote_and_unverifiable_holders_keep_their_lease(tmp_path):
    url = f"sqlite:///{tmp_path}/r.db"
    embstore.open(url, dim=DIM).close()
    _plant(url, host="some-other-host", pid=12345, start="1")
    with embstore.open(url, cache="memory://") as s:
        with pytest.raises(LeaseConflictError, match="on another host"):
            s.update([1], np.ones((1, DIM), np.float32))
    # a lease without process identity (an older writer): not provably dead, kept
    assert not holder_is_dead({"host": machine_identity()["host"], "pid": 2**22 + 7})


def test_process_identity_helpers():
    assert process_start(os.getpid()) is not None
    assert process_start(2**22 + 7) is None     # above pid_max: no such process
    me = machine_identity()
    live = {**me, "pid": os.getpid(), "start": process_start(os.getpid())}
    assert not holder_is_dead(live)
    # another boot id under the same host name may be another machine (cloned VMs, fixed
    # container host names) whose holder lives: never taken over before the lease expires
    assert not holder_is_dead({**live, "boot": "another-boot"})
    assert holder_is_dead({**live, "start": "1"})
    assert not holder_is_dead({**live, "pid": None})
    assert not holder_is_dead({**live, "pidns": "pid:[1]", "start": "1"})
