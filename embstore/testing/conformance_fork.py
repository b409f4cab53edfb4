"""Opt-in conformance tests: a store handle used in a child made by ``fork()`` raises
:class:`~embstore.errors.ForkedProcessError`, or its writes really land -- never writes that
report success and are lost, nor a child that uses (and on exit ends) the parent's connection.

Subclass :class:`ForkConformance` with a ``url_factory`` fixture (a callable returning a fresh,
empty store URL per call) and set ``fork_writes``: True where a forked child's writes land in
the shared store, False where the backend refuses to be used from a forked child.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import embstore

DIM = 4


def in_child(fn: Callable[[], Any]) -> str:
    """Run ``fn()`` in a forked child; its result (``"ok <result>"``) or exception as text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(r)
        try:
            msg = f"ok {fn()}"
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            msg = f"{type(e).__name__}: {e}"
        os.write(w, msg.encode()[:4000])
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, out)
    return out


def _write_then_close(store: Any) -> Callable[[], str]:
    def fn() -> str:
        store.assign([3], np.full((1, DIM), 7.0, np.float32))
        store.flush()
        store.close()
        return "written"
    return fn


class ForkConformance:
    """A store handle in a forked child; see the module docstring."""

    #: a forked child's writes land (True) or the child's use is refused (False)
    fork_writes: bool = True

    @pytest.fixture
    def url_factory(self):  # pragma: no cover - subclasses provide it
        raise NotImplementedError("subclasses define a url_factory fixture")

    def test_forked_child_writes_for_real(self, url_factory):
        if not self.fork_writes:
            pytest.skip("the backend refuses a forked child (fork_writes is False)")
        s = embstore.open(url_factory(), dim=DIM)
        s.assign([1, 2], np.ones((2, DIM), np.float32))
        out = in_child(_write_then_close(s))
        assert out == "ok written", out
        # the parent sees the child's row, and its own connection/environment still works
        np.testing.assert_array_equal(s.lookup([3], insert=False), np.full((1, DIM), 7.0))
        s.assign([4], np.ones((1, DIM), np.float32))
        assert sorted(k for ks, _ in s.items() for k in ks.tolist()) == [1, 2, 3, 4]
        assert s.backend.counters.get("reconnects", 0) == 0  # the child never touched it
        s.close()

    @pytest.mark.parametrize("read_only", [False, True])
    def test_forked_child_is_refused_and_the_parent_unharmed(self, url_factory, read_only):
        if self.fork_writes:
            pytest.skip("the backend serves a forked child (fork_writes is True)")
        url = url_factory()
        with embstore.open(url, dim=DIM) as w:
            w.assign([1, 2], np.ones((2, DIM), np.float32))
        s = embstore.open(url, read_only=read_only)
        out = in_child(lambda: s.lookup([1], insert=False).tolist())
        assert out.startswith("ForkedProcessError") and "forked child" in out, out
        if not read_only:
            out = in_child(_write_then_close(s))
            assert out.startswith("ForkedProcessError"), out
            # the parent's handle is untouched by the child's attempt and its exit
            s.assign([4], np.ones((1, DIM), np.float32))
            assert len(s) == 3 and not s.contains([3])[0]
        s.close()
        with embstore.open(url, read_only=True) as r:
            assert len(r) == (3 if not read_only else 2)
